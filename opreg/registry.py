"""The registry: named ops, each with one meaning and several implementations.

An op's meaning is its *reference*: a plain-PyTorch function. Its implementations are
either Python callables or C++/CUDA kernel libraries (:class:`opreg._build.Extension`)
that register themselves with the dispatcher. Every op is a ``torch.library`` op,
``torch.ops.opreg.<name>``; the registry *binds* one implementation per device
(dispatch key ``CPU``/``CUDA``), so the default call path is the dispatcher straight
into a C++ kernel, with no Python in between. Other devices run the reference.

Binding is lazy: until an op is first called on a device, a small Python stub sits at
that key; it picks the best available implementation (building it on first use),
installs it and re-dispatches. Autograd works the same way: built-in ops get C++
autograd from the host library; if that cannot be built, or for ops registered from
Python, the gradient is the reference's own (``torch.autograd`` through it).

Selection order: an explicit ``get(op, impl=...)`` > the innermost :func:`use` scope >
the highest-priority available implementation. An implementation whose build fails is
skipped with one warning.
"""
from __future__ import annotations

import contextlib
import shutil
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from . import _build
from ._build import BuildError, Extension
from ._log import logger

NAMESPACE = "opreg"
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
        """Why this implementation can't run (on ``device``), or None if it can."""
        if device is not None and not self.supports(device):
            return f"does not run on {device}"
        ext = self.extension
        if ext is None:
            return None
        state = _extensions.get(ext)
        if isinstance(state, BuildError):
            return f"failed to build ({str(state).splitlines()[0][:200]})"
        if ext.cuda:
            if torch.version.cuda is None:
                return "torch was built without CUDA"
            if state is None and _build.cuda_home() is None:
                return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
            if not torch.cuda.is_available():
                return "no CUDA device"
        elif state is None and shutil.which(os.environ.get("CXX", "c++")) is None:
            return "no C++ compiler found (set CXX)"
        return None


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
_bound: dict[tuple[str, str], Impl] = {}            # (op, device) -> bound impl
# (op, dispatch key) -> the Library holding our Python kernel there, and the kernel
_py_libs: dict[tuple[str, str], tuple[torch.library.Library, Callable[..., Any] | None]] = {}
_autograd: dict[str, str] = {}                      # op -> "cpp" | "python"
_scopes: list[dict[str, str]] = []                  # innermost last
_warned: set[str] = set()


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
            _set_py_kernel(name, "Autograd", _autograd_stub(op))
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

def _set_py_kernel(op_name: str, key: str, fn: Callable[..., Any] | None) -> None:
    """Put ``fn`` (or nothing) as the Python kernel of ``op`` at dispatch key ``key``,
    above any C++ kernel there."""
    old = _py_libs.pop((op_name, key), None)
    if old is not None:
        old[0]._destroy()
    if fn is not None:
        lib = torch.library.Library(NAMESPACE, "IMPL")
        with warnings.catch_warnings():
            # Deliberate: a Python kernel over our C++ one is how a scope or plug-in wins
            # (torch 2.11 warns about it; 2.14 doesn't).
            warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
            lib.impl(op_name, fn, key)
        _py_libs[(op_name, key)] = (lib, fn)


def _install_stub(op: Op, device: str) -> None:
    def stub(*args: Any) -> Any:
        with _lock:
            if (op.name, device) not in _bound:
                _bind(op, device, _resolve(op, device))
        return op.torch_op(*args)  # dispatches again, to what was just bound

    _bound.pop((op.name, device), None)
    _set_py_kernel(op.name, DEVICE_KEYS[device], stub)


def _autograd_stub(op: Op) -> Callable[..., Any]:
    def stub(*args: Any) -> Any:
        with _lock:
            if op.name not in _autograd:
                _ensure_autograd(op)
        return op.torch_op(*args)

    return stub


def _ensure_autograd(op: Op) -> None:
    ext = op.autograd_extension
    if ext is not None:
        try:
            load(ext)
            _set_py_kernel(op.name, "Autograd", None)
            _autograd[op.name] = "cpp"
            return
        except BuildError as e:
            _warn_once(ext.name, f"opreg: {ext.name} failed to build; {op.name} falls back to "
                       f"Python autograd. {str(e).splitlines()[0][:300]}")
    _set_py_kernel(op.name, "Autograd", None)  # drop the stub first: one Python kernel per key
    lib = torch.library.Library(NAMESPACE, "IMPL")
    setup_context, backward = _reference_vjp(op)
    torch.library.register_autograd(f"{NAMESPACE}::{op.name}", backward,
                                    setup_context=setup_context, lib=lib)
    _py_libs[(op.name, "Autograd")] = (lib, None)
    _autograd[op.name] = "python"


def _reference_vjp(op: Op) -> tuple[Callable[..., None], Callable[..., Any]]:
    """Gradients of an op = gradients of its reference (plain torch autograd)."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.op_inputs = inputs

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        leaves: list[torch.Tensor] = []

        def leaf(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                x = x.detach().requires_grad_(True)
                leaves.append(x)
            return x

        args = [[leaf(t) for t in a] if isinstance(a, (list, tuple)) else leaf(a)
                for a in ctx.op_inputs]
        with torch.enable_grad():
            out = op.reference(*args)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                      allow_unused=True) if pairs else [None] * len(leaves)
        it = iter(got)
        pick = lambda x: next(it) if isinstance(x, torch.Tensor) and x.is_floating_point() else None  # noqa: E731
        return tuple([pick(t) for t in a] if isinstance(a, (list, tuple)) else pick(a)
                     for a in ctx.op_inputs)

    return setup_context, backward


def load(ext: Extension, cuda_arch: str | None = None, verbose: bool = False) -> None:
    """Build and load ``ext`` once per process (remembering a failure), keeping every
    Python kernel we placed (stubs, scoped bindings) above its C++ kernels."""
    with _lock:
        state = _extensions.get(ext)
        if isinstance(state, BuildError):
            raise state
        if state is not None:
            return
        # Lift our Python kernels off the keys it registers while it loads (a C++
        # registration over a Python one warns "Overriding a previously registered
        # kernel"), then put them back on top. Autograd stubs go for good: C++ replaces them.
        keys = {(op.name, DEVICE_KEYS[d]) for op in _ops.values() for i in op.impls.values()
                if i.extension is ext for d in i.devices}
        cpp_autograd = [op.name for op in _ops.values()
                        if op.autograd_extension is ext and op.name not in _autograd]
        keys |= {(name, "Autograd") for name in cpp_autograd}
        lifted = {k: _py_libs[k][1] for k in keys if k in _py_libs}
        for k in lifted:
            _set_py_kernel(*k, None)
        try:
            _extensions[ext] = _build.build(ext, cuda_arch=cuda_arch, verbose=verbose)
        except BuildError as e:
            _extensions[ext] = e
            raise
        finally:
            for (name, key), fn in lifted.items():
                if not (key == "Autograd" and name in cpp_autograd and ext in _extensions
                        and not isinstance(_extensions[ext], BuildError)):
                    _set_py_kernel(name, key, fn)
        for name in cpp_autograd:
            _autograd[name] = "cpp"


def _bind(op: Op, device: str, impl: Impl) -> None:
    if impl.extension is not None:
        load(impl.extension)
        _set_py_kernel(op.name, DEVICE_KEYS[device], None)  # the C++ kernel is below
    else:
        _set_py_kernel(op.name, DEVICE_KEYS[device], _python_kernel(op, impl))
    _bound[(op.name, device)] = impl
    logger.debug("bound %s on %s to %s", op.name, device, impl.name)


def _python_kernel(op: Op, impl: Impl) -> Callable[..., Any]:
    assert impl.fn is not None
    fn, dtypes, ref = impl.fn, impl.dtypes, op.reference
    if dtypes is None:
        return fn

    def kernel(*args: Any) -> Any:
        return (fn if _first_dtype(args) in dtypes else ref)(*args)

    return kernel


def _first_dtype(args: Sequence[Any]) -> torch.dtype | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.dtype
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].dtype
    return None


def _resolve(op: Op, device: str) -> Impl:
    for scope in reversed(_scopes):
        name = scope.get(op.name)
        impl = op.impls.get(name) if name else None
        if impl is not None and impl.supports(device) and _usable(impl, device):
            return impl
    ranked = sorted((i for i in op.impls.values() if i.supports(device)),
                    key=lambda i: -i.priority)
    for impl in ranked:
        if _usable(impl, device):
            return impl
    return op.impls["reference"]


def _usable(impl: Impl, device: str) -> bool:
    reason = impl.unavailable(device)
    if reason is not None:
        if impl.extension is not None and impl.priority > 0 and "failed to build" not in reason:
            logger.info("%s/%s unavailable on %s: %s", impl.op, impl.name, device, reason)
        return False
    if impl.extension is None:
        return True
    try:
        load(impl.extension)
        return True
    except BuildError as e:
        _warn_once(impl.extension.name,
                   f"opreg: the {impl.name!r} implementation of {impl.op} failed to build and "
                   f"is skipped (falling back to the next one). {str(e).splitlines()[0][:300]}")
        return False


def _refresh(op: Op) -> None:
    """Re-resolve every device already bound (a new impl may now win)."""
    for device in DEVICE_KEYS:
        if (op.name, device) in _bound:
            impl = _resolve(op, device)
            if _bound[(op.name, device)] is not impl:
                _bind(op, device, impl)


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


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

    # Another implementation is bound there (a use() scope, a plug-in): rebind per call.
    # Slow (~70 µs), and only for this unusual combination.
    def pinned(*args: Any) -> Any:
        with use(**{op: impl}):
            return o.torch_op(*args)

    return pinned


@contextlib.contextmanager
def use(default: str | None = None, /, **per_op: str) -> Iterator[None]:
    """Prefer implementations inside a ``with`` block, for every op (``use("reference")``)
    or per op (``use(scatter_combine="cpu")``). Process-wide (the dispatcher is global);
    an implementation that can't run on some device is ignored there."""
    with _lock:
        prefs = {name: default for name in _ops if default is not None}
        for name, impl in per_op.items():
            if impl not in lookup(name).impls:
                raise KeyError(f"opreg: {name} has no implementation {impl!r}; "
                               f"it has {sorted(lookup(name).impls)}")
            prefs[name] = impl
        if default is not None and not any(default in o.impls for o in _ops.values()):
            raise KeyError(f"opreg: no op has an implementation named {default!r}")
        saved = {k: v for k, v in _bound.items() if k[0] in prefs}
        _scopes.append(prefs)
        try:
            for name, device in saved:
                _bind(_ops[name], device, _resolve(_ops[name], device))
        except BaseException:
            _scopes.pop()
            raise
    try:
        yield
    finally:
        with _lock:
            _scopes.remove(prefs)
            for name in prefs:
                for device in DEVICE_KEYS:
                    prev = saved.get((name, device))
                    if prev is not None:
                        _bind(_ops[name], device, prev)
                    elif (name, device) in _bound:
                        _install_stub(_ops[name], device)


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
    """Name of the implementation bound on ``device`` (None before first use there)."""
    i = _bound.get((op, device))
    return i.name if i else None
