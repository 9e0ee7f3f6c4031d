"""Putting implementations into the dispatcher: the lazy stubs at the device keys, kernel
libraries loaded above them, the autograd (C++ or the reference's), and the per-context
router for :func:`opreg.use` scopes. See :mod:`opreg.registry` for the design (threads,
scopes) and the selection order."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from . import _build
from ._build import BuildError, Extension
from ._dispatch import (BELOW_BACKEND_SELECT, first_tensor, plain_eager, push_kernel, reference_autograd, retire,
                        run_python, warn_once)
from ._log import logger
from ._state import (DEVICE_KEYS, Impl, Op, _autograd, _bound, _extensions, _lock, _open, _ops, _routers,
                     _scope)


def _install_stub(op: Op, device: str) -> None:
    def stub(keyset: Any, *args: Any) -> Any:
        impl = _bound.get((op.name, device)) or _bind_default(op, device)
        if impl.fn is not None:
            return run_python(op, impl, args)
        # A kernel library: loading it put its C++ kernel above this stub, at this key.
        return op.torch_op.redispatch(keyset & BELOW_BACKEND_SELECT, *args)

    push_kernel(op.name, DEVICE_KEYS[device], stub, with_keyset=True)


def _autograd_stub(op: Op) -> Callable[..., Any]:
    # not named `stub`: tests tell the device stub's and router's frames by name
    # (test_python_call.py), and this one runs once, before the autograd kernel exists
    def first_call(*args: Any) -> Any:
        if op.name not in _autograd:
            with _lock:
                if op.name not in _autograd:
                    _ensure_autograd(op)
        return op.torch_op(*args)  # again, from the top: the autograd kernel now above us

    return first_call


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
    push_kernel(op.name, "Autograd", reference_autograd(op, lambda args: direct(op, args)))
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
        impl = choice(op, args)
        if impl is None or impl.fn is None:
            return op.torch_op.redispatch(keyset & BELOW_BACKEND_SELECT, *args)
        return run_python(op, impl, args)

    return route


def choice(op: Op, args: Any) -> Impl | None:
    """What a call of ``op`` with ``args`` runs below autograd: the calling scope's
    :func:`opreg.use` choice on the first tensor's device, else that device's bound default
    (bound now on a first call), or None (a device with no key of ours)."""
    t = first_tensor(args)
    device = t.device.type if t is not None else "cpu"
    impl = _scoped_choice(op, device)
    if impl is None and device in DEVICE_KEYS:
        impl = _bound.get((op.name, device)) or _bind_default(op, device)
    return impl


def direct(op: Op, args: Any) -> Impl | None:
    """The Python implementation a call of ``op`` may run without the dispatcher: where the
    call is plain eager (:func:`opreg._dispatch.plain_eager`) and the router or device stub
    would pick a Python function (:func:`choice`); else None (a kernel library, a mode, a
    subclass, a call that can carry a gradient: the dispatcher decides)."""
    if not plain_eager(args):
        return None
    impl = choice(op, args)
    return impl if impl is not None and impl.fn is not None else None


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
