"""The registry: named ops, each with one meaning and several implementations.

An op's meaning is its *reference*: a plain-PyTorch function. Its implementations are
either Python callables or C++/CUDA kernel libraries (:class:`opreg._build.Extension`)
that register themselves with the dispatcher. Every op is a ``torch.library`` op,
``torch.ops.opreg.<name>``; the registry *binds* one implementation per device
(dispatch key ``CPU``/``CUDA``), so the default call path is the dispatcher straight
into a C++ kernel, with no Python in between. Other devices run the reference.

Binding is lazy: until an op is first called on a device, a small Python stub sits at
that key; it picks the best available implementation (building it on first use) and
re-dispatches. Loading a kernel library registers its C++ kernels *above* the stub (the
dispatcher runs the newest registration at a key). Autograd works the same way: built-in
ops get C++ autograd from a kernel library; if that cannot be built, or for ops registered
from Python, the gradient is the reference's own (``torch.autograd`` through it).

Threads: no Python kernel we register is ever unregistered while the process runs. Another
thread may be inside it (the dispatcher calls a kernel through the table entry it read,
holding no reference), and freeing it under that thread crashed first use 1 time in 6
(issue 12). Changes go on top instead; all binding happens under ``_lock``, so each
library is built once per process (and once across processes: ``_build`` holds a file lock).

Scopes (:func:`use`) are per thread / asyncio task: a ``ContextVar``, read by a Python
*router* at the ``BackendSelect`` key (below autograd, above the backend keys). The router
is registered for an op the first time a scope names it and is covered by a fallthrough
whenever no scope anywhere names it, so the default call path stays Python-free.

Selection order: an explicit ``get(op, impl=...)`` > the innermost :func:`use` scope of the
calling thread/task > the highest-priority available implementation. An implementation
whose build fails is skipped with one warning.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from . import _entry
from ._binding import (_autograd_stub, _bind, _install_stub, _refresh, _resolve, _scoped,
                       _scoped_choice, load)
from ._build import Extension
from ._dispatch import NAMESPACE, push_kernel
from ._state import (ANY_DEVICE, DEVICE_KEYS, Impl, Op, _autograd, _bound, _defs, _lock, _ops, _scope)

__all__ = ["DEVICE_KEYS", "Impl", "NAMESPACE", "Op", "add_impl", "autograd_kind", "bound", "define_op",
           "get", "implementations", "load", "lookup", "ops", "remove_impl", "resolve", "running", "use"]


# ---------------------------------------------------------------------------- defining

def define_op(
    name: str,
    schema: str,
    reference: Callable[..., Any],
    fake: Callable[..., Any] | None = None,
    autograd_extension: Extension | None = None,
    differentiable: bool = True,
) -> Op:
    """Define ``torch.ops.opreg.<name>`` with ``schema`` (the part after the name).

    ``reference`` is the op's meaning and its kernel on devices with no other
    implementation; ``fake`` computes output metadata for tracing (default: the
    reference, which must then be traceable on fake tensors).
    """
    with _lock:
        if name in _ops:
            raise ValueError(f"opreg: an op named {name!r} is already registered")
        _defs.define(name + schema)
        op = Op(name, schema, reference, autograd_extension=autograd_extension)
        _ops[name] = op
        qualname = f"{NAMESPACE}::{name}"
        torch.library.register_fake(qualname, fake or reference, lib=_defs)
        _defs.impl(name, reference, "CompositeExplicitAutograd")
        op.impls["reference"] = Impl("reference", name, (ANY_DEVICE,), priority=0, fn=reference)
        for device in DEVICE_KEYS:
            _install_stub(op, device)
        if differentiable:
            push_kernel(name, "Autograd", _autograd_stub(op))
        return op


def add_impl(op_name: str, impl: Impl) -> Impl:
    """Add ``impl`` to an op; raises on a duplicate name. Rebinds devices it now wins."""
    with _lock:
        op = lookup(op_name)
        if impl.name in op.impls:
            raise ValueError(f"opreg: {op_name} already has an implementation named {impl.name!r}")
        op.impls[impl.name] = impl
        _refresh(op)
        return impl


def remove_impl(op_name: str, name: str) -> None:
    """Remove a (third-party) implementation; devices it was bound to are rebound."""
    with _lock:
        op = lookup(op_name)
        if name == "reference" or op.impls.get(name, None) is None:
            raise ValueError(f"opreg: {op_name} has no removable implementation {name!r}")
        del op.impls[name]
        _refresh(op)


def lookup(name: str) -> Op:
    try:
        return _ops[name]
    except KeyError:
        raise KeyError(f"opreg: no op named {name!r}; registered: {sorted(_ops)}") from None


def ops() -> dict[str, Op]:
    return dict(_ops)


# ---------------------------------------------------------------------------- public

def get(op: str, impl: str | None = None) -> Callable[..., Any]:
    """The callable for ``op``: with no ``impl``, the op as the dispatcher runs it (the
    bound implementation for the inputs' device, or the calling scope's choice): its C++
    entry where it has one (``cat_linear``, ``cat_linear_stacked``, ``scatter_combine``:
    the same call as ``torch.ops.opreg.<op>.default`` at less host cost; getting it loads,
    and the first time builds, opreg's C++ autograd library), else that OpOverload; with
    ``impl``, that implementation, whatever scope is open where it is called (raises if it
    is unknown or unavailable here): a Python implementation's own function, or for a
    kernel library a pinning wrapper around the op (its autograd too)."""
    o = lookup(op)
    if impl is None:
        return _entry.entry(o) or o.torch_op
    i = o.impls.get(impl)
    if i is None:
        raise KeyError(f"opreg: {op} has no implementation {impl!r}; it has {sorted(o.impls)}")
    if i.fn is not None:
        return i.fn
    reason = i.unavailable()
    if reason is not None:
        raise RuntimeError(f"opreg: {op}/{impl} is unavailable: {reason}")
    with _lock:
        load(i.extension)  # type: ignore[arg-type]
        for d in i.devices:  # not used on d yet, and the default there anyway: bind now
            if (op, d) not in _bound and _resolve(o, d) is i:
                _bind(o, d, i)
    return _pinned(o, i)


def _pinned(o: Op, i: Impl) -> Callable[..., Any]:
    """Call ``o`` running ``i`` (a kernel library's implementation). The op itself when
    that is what it would run anyway -- ``i`` is the default on its devices now and no
    scope of the calling thread/task names the op (another thread's scope doesn't matter:
    the router reads the caller's) -- else through the router, as the innermost scope, for
    this call only. Checked per call: a scope opened, or a plug-in bound, after ``get``.
    Traced by ``torch.compile``, it is the op (a graph can't hold the pin: there the
    calling scope, if any, picks at run time, as for ``torch.ops.opreg.<op>``)."""
    name, torch_op = o.name, o.torch_op
    keys = [(name, d) for d in i.devices]
    pin = {name: i.name}

    def pinned(*args: Any) -> Any:
        if torch.compiler.is_compiling() or (
                all(_bound.get(k) is i for k in keys) and not any(name in p for p in _scope.get())):
            return torch_op(*args)
        with _scoped(pin):
            return torch_op(*args)

    pinned.__name__ = pinned.__qualname__ = f"{name}[{i.name}]"
    return pinned


@contextlib.contextmanager
def use(default: str | None = None, /, **per_op: str) -> Iterator[None]:
    """Prefer implementations inside a ``with`` block, for every op (``use("reference")``)
    or per op (``use(scatter_combine="cpu")``), in the calling thread / asyncio task only
    (a task started inside inherits it while the block is open). An implementation that
    can't run on some device is ignored there."""
    with _lock:
        prefs = {name: default for name in _ops if default is not None}
        for name, impl in per_op.items():
            if impl not in lookup(name).impls:
                raise KeyError(f"opreg: {name} has no implementation {impl!r}; "
                               f"it has {sorted(lookup(name).impls)}")
            prefs[name] = impl
        if default is not None and not any(default in o.impls for o in _ops.values()):
            raise KeyError(f"opreg: no op has an implementation named {default!r}")
    with _scoped(prefs):
        yield


def implementations(op: str | None = None) -> list[dict[str, Any]]:
    """One row per (op, implementation): devices, priority, availability and why not."""
    rows = []
    for o in ([lookup(op)] if op else _ops.values()):
        for i in sorted(o.impls.values(), key=lambda i: -i.priority):
            reason = i.unavailable()
            rows.append({
                "op": o.name, "impl": i.name, "devices": ",".join(i.devices),
                "priority": i.priority, "available": reason is None, "why_not": reason or "",
                "bound_on": ",".join(d for d in DEVICE_KEYS if _bound.get((o.name, d)) is i),
            })
    return rows


def autograd_kind(op: str) -> str | None:
    """``"cpp"``, ``"python"``, or None before the op's first differentiable call."""
    return _autograd.get(op)


def bound(op: str, device: str) -> str | None:
    """Name of the implementation a call on ``device`` runs now, in this thread/task: its
    :func:`use` scope's choice, else the default (None before first use there)."""
    o = lookup(op)
    i = _scoped_choice(o, device, build=False) or _bound.get((op, device))
    return i.name if i else None


@torch.compiler.assume_constant_result
def running(op: str, device: str) -> str:
    """Name of the implementation a call on ``device`` runs now: :func:`bound`'s, else the
    default it would bind (:func:`resolve`). A constant to Dynamo, which need not trace the
    registry: code traced on its answer keeps the implementation of when it was compiled (a
    :func:`use` scope entered later counts after a recompile, e.g. ``torch._dynamo.reset()``)."""
    return bound(op, device) or resolve(op, device).name


def resolve(op: str, device: str) -> Impl:
    """The implementation a call on ``device`` would run by default now (building it if needed)."""
    return _resolve(lookup(op), device)
