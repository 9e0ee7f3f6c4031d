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
import contextvars
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from . import _build
from ._build import BuildError, Extension
from ._dispatch import (BELOW_BACKEND_SELECT, NAMESPACE, first_tensor, push_kernel,
                        reference_autograd, retire, run_python, warn_once)
from ._log import logger

DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
ANY_DEVICE = "*"

_lock = threading.RLock()
_defs = torch.library.Library(NAMESPACE, "FRAGMENT")


@dataclass
class Impl:
    """One implementation of an op.

    ``fn`` is a Python kernel with the op's signature; ``extension`` a kernel library
    whose ``TORCH_LIBRARY_IMPL`` registers the kernel itself. ``devices`` are device
    types (``"cpu"``, ``"cuda"``) or ``"*"`` for any. ``dtypes=None`` means all.
    """

    name: str
    op: str
    devices: tuple[str, ...]
    priority: int
    fn: Callable[..., Any] | None = None
    extension: Extension | None = None
    dtypes: frozenset[torch.dtype] | None = None

    def supports(self, device: str) -> bool:
        return ANY_DEVICE in self.devices or device in self.devices

    def unavailable(self, device: str | None = None) -> str | None:
        """Why this implementation can't run (on ``device``), or None if it can. Builds
        and loads nothing: a library not loaded yet is probed (a few stat calls) for a
        cache location it can't use or a missing toolchain."""
        if device is not None and not self.supports(device):
            return f"does not run on {device}"
        ext = self.extension
        if ext is None:
            return None
        state = _extensions.get(ext)
        if isinstance(state, BuildError):
            return str(state).splitlines()[0][:300]  # says what failed: build, load, cache
        if ext.cuda and torch.version.cuda is None:
            return "torch was built without CUDA"
        if ext.cuda and not torch.cuda.is_available():
            return "no CUDA device"
        return None if state is not None else _build.why_not(ext)


@dataclass
class Op:
    """A registered op: its schema, reference (the meaning) and implementations."""

    name: str
    schema: str
    reference: Callable[..., Any]
    impls: dict[str, Impl] = field(default_factory=dict)
    autograd_extension: Extension | None = None

    @property
    def torch_op(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default


_ops: dict[str, Op] = {}
_extensions: dict[Extension, "os.PathLike[str] | BuildError"] = {}
_bound: dict[tuple[str, str], Impl] = {}            # (op, device) -> default impl there
_autograd: dict[str, str] = {}                      # op -> "cpp" | "python"
# The calling thread's/task's open use() scopes, innermost last.
_scope: contextvars.ContextVar[tuple[dict[str, str], ...]] = contextvars.ContextVar(
    "opreg_scope", default=())
_open: dict[str, int] = {}                          # op -> open scopes naming it, all threads
# op -> None: its router is live; a Library: the fallthrough covering it; absent: no router
_routers: dict[str, torch.library.Library | None] = {}


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


# ---------------------------------------------------------------------------- binding

def _install_stub(op: Op, device: str) -> None:
    def stub(keyset: Any, *args: Any) -> Any:
        impl = _bound.get((op.name, device)) or _bind_default(op, device)
        if impl.fn is not None:
            return run_python(op, impl, args)
        # A kernel library: loading it put its C++ kernel above this stub, at this key.
        return op.torch_op.redispatch(keyset & BELOW_BACKEND_SELECT, *args)

    push_kernel(op.name, DEVICE_KEYS[device], stub, with_keyset=True)


def _autograd_stub(op: Op) -> Callable[..., Any]:
    def stub(*args: Any) -> Any:
        if op.name not in _autograd:
            with _lock:
                if op.name not in _autograd:
                    _ensure_autograd(op)
        return op.torch_op(*args)  # again, from the top: the autograd kernel now above us

    return stub


def _ensure_autograd(op: Op) -> None:
    ext = op.autograd_extension
    if ext is not None:
        try:
            load(ext)  # registers its C++ autograd kernel above the stub
            _autograd[op.name] = "cpp"
            return
        except BuildError as e:
            warn_once(e.key or ext.name, f"opreg: {ext.name} failed to build; {op.name} falls back "
                       f"to Python autograd (the reference's gradients). {str(e).splitlines()[0][:300]}")
    push_kernel(op.name, "Autograd", reference_autograd(op))
    _autograd[op.name] = "python"


def load(ext: Extension, cuda_arch: str | None = None, verbose: bool = False) -> None:
    """Build and load ``ext`` once per process (remembering a failure). Its C++ kernels
    register above our Python stubs, which stay (another thread may be running one)."""
    with _lock:
        state = _extensions.get(ext)
        if isinstance(state, BuildError):
            raise state
        if state is not None:
            return
        cpp_autograd = [op.name for op in _ops.values()
                        if op.autograd_extension is ext and op.name not in _autograd]
        try:
            _extensions[ext] = _build.build(ext, cuda_arch=cuda_arch, verbose=verbose)
        except BuildError as e:
            _extensions[ext] = e
            raise
        for name in cpp_autograd:
            _autograd[name] = "cpp"
        _after_load(ext)


def _after_load(ext: Extension) -> None:
    """``ext``'s C++ kernels now sit above the stubs of every op it registers, called or
    not: record the default there now, and route to it if it is Python (a plug-in)."""
    for op in list(_ops.values()):
        for d in {d for i in op.impls.values() if i.extension is ext for d in i.devices}:
            if d in DEVICE_KEYS and (op.name, d) not in _bound:
                _bind(op, d, _resolve(op, d))
        _update_router(op)


def _bind(op: Op, device: str, impl: Impl) -> None:
    """Make ``impl`` the default on ``device``: no dispatcher change but loading its
    library (its C++ kernel lands above the stub) and, for a Python impl that a loaded
    C++ kernel now covers, the router."""
    if impl.extension is not None:
        load(impl.extension)
    _bound[(op.name, device)] = impl
    _update_router(op)
    logger.debug("bound %s on %s to %s", op.name, device, impl.name)


def _bind_default(op: Op, device: str) -> Impl:
    """The default on ``device``, bound now if it isn't yet (the first call there)."""
    with _lock:
        impl = _bound.get((op.name, device))
        if impl is None:
            impl = _resolve(op, device)
            _bind(op, device, impl)
        return impl


# ---------------------------------------------------------------------------- routing

def _loaded(impl: Impl) -> bool:
    state = _extensions.get(impl.extension) if impl.extension is not None else None
    return state is not None and not isinstance(state, BuildError)


def _scoped_choice(op: Op, device: str, build: bool = True) -> Impl | None:
    """The calling thread's/task's scope choice on ``device`` (innermost first), if any.
    Without ``build``, a kernel library that would have to be built first still counts."""
    for prefs in reversed(_scope.get()):
        impl = op.impls.get(prefs.get(op.name, ""))
        if impl is None or not impl.supports(device):
            continue
        if impl.fn is not None or _loaded(impl):
            return impl
        if not build:
            if impl.unavailable(device) is None:
                return impl
            continue
        with _lock:
            if _usable(impl, device):
                return impl
    return None


def _router(op: Op) -> Callable[..., Any]:
    """The Python kernel at BackendSelect: runs the scope's (or a Python default's) impl,
    or goes on down to the C++ kernel at the backend key."""

    def route(keyset: Any, *args: Any) -> Any:
        t = first_tensor(args)
        device = t.device.type if t is not None else "cpu"
        impl = _scoped_choice(op, device)
        if impl is None and device in DEVICE_KEYS:
            impl = _bound.get((op.name, device)) or _bind_default(op, device)
        if impl is None or impl.fn is None:
            return op.torch_op.redispatch(keyset & BELOW_BACKEND_SELECT, *args)
        return run_python(op, impl, args)

    return route


def _covered_python_default(op: Op) -> bool:
    """Is a Python impl the default on a device where a loaded C++ kernel sits above the
    stub (so only the router can reach it)?"""
    return any(impl is not None and impl.fn is not None
               and any(i.supports(d) and _loaded(i) for i in op.impls.values())
               for d in DEVICE_KEYS for impl in [_bound.get((op.name, d))])


def _update_router(op: Op) -> None:
    """Route ``op`` through Python at BackendSelect exactly while a scope anywhere names
    it or a covered Python default needs it. The router is never unregistered (a thread
    may be in it); a fallthrough above it, which holds no Python object, turns it off."""
    with _lock:
        want = _open.get(op.name, 0) > 0 or _covered_python_default(op)
        if op.name not in _routers:
            if want:
                push_kernel(op.name, "BackendSelect", _router(op), with_keyset=True)
                _routers[op.name] = None
            return
        cover = _routers[op.name]
        if want and cover is not None:
            retire(cover)
            _routers[op.name] = None
        elif not want and cover is None:
            _routers[op.name] = push_kernel(op.name, "BackendSelect",
                                             torch.library.fallthrough_kernel)


def _resolve(op: Op, device: str) -> Impl:
    """The default on ``device``: the highest-priority impl usable there (building it)."""
    ranked = sorted((i for i in op.impls.values() if i.supports(device)),
                    key=lambda i: -i.priority)
    for impl in ranked:
        if _usable(impl, device):
            return impl
    return op.impls["reference"]


def _usable(impl: Impl, device: str) -> bool:
    reason = impl.unavailable(device)
    if impl.extension is None:
        return reason is None
    if reason is not None and not isinstance(reason, _build.CacheProblem):
        if impl.priority > 0 and not isinstance(_extensions.get(impl.extension), BuildError):
            logger.info("%s/%s unavailable on %s: %s", impl.op, impl.name, device, reason)
        return False
    try:
        # A cache problem the probe saw fails here too, as a BuildError (warned below):
        # the probe's os.access can be wrong (ACLs), so the build decides.
        load(impl.extension)
        return True
    except BuildError as e:
        # One warning per cause: a bad cache location stops every library, and the one
        # carrying the autograd may have reported it already.
        told = e.key is not None and any(isinstance(s, BuildError) and s is not e and s.key == e.key
                                         for s in _extensions.values())
        if not told:
            warn_once(e.key or impl.extension.name,
                       f"opreg: {impl.op}/{impl.name} is skipped, falling back to the next "
                       f"implementation: {str(e).splitlines()[0][:300]}")
        return False


def _refresh(op: Op) -> None:
    """Re-resolve every device already bound (a new impl may now win)."""
    for device in DEVICE_KEYS:
        if (op.name, device) in _bound:
            impl = _resolve(op, device)
            if _bound[(op.name, device)] is not impl:
                _bind(op, device, impl)


# ---------------------------------------------------------------------------- public

def get(op: str, impl: str | None = None) -> Callable[..., Any]:
    """The callable for ``op``: with no ``impl``, ``torch.ops.opreg.<op>.default``
    (the dispatcher runs the bound implementation for the inputs' device); with
    ``impl``, that implementation (raises if it is unknown or unavailable here)."""
    o = lookup(op)
    if impl is None:
        return o.torch_op
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
    if all(_bound.get((op, d)) is i for d in i.devices):
        return o.torch_op

    # Another implementation is the default there (a plug-in): pin this one per call,
    # through the router, like a one-op scope of this thread only.
    def pinned(*args: Any) -> Any:
        with _scoped({op: impl}):
            return o.torch_op(*args)

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


@contextlib.contextmanager
def _scoped(prefs: dict[str, str]) -> Iterator[None]:
    """Open a scope in this context; the router runs while any scope names an op."""
    token = _scope.set(_scope.get() + (prefs,))
    _count_open(prefs, +1)
    try:
        yield
    finally:
        _scope.reset(token)
        _count_open(prefs, -1)


def _count_open(prefs: dict[str, str], step: int) -> None:
    with _lock:
        for name in prefs:
            _open[name] = _open.get(name, 0) + step
            _update_router(_ops[name])


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
