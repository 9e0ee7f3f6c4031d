"""The dispatcher mechanics the registry is built on, with no registry state: putting a
Python kernel at a dispatch key (for good: see :mod:`opreg.registry` on threads), the
Python fallback autograd kernel, calling a Python implementation, one-time warnings."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

NAMESPACE = "opreg"
_DK = torch._C.DispatchKey
# Where the router and the stubs re-dispatch to: the backend keys, below BackendSelect.
BELOW_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(_DK.BackendSelect).remove(
    _DK.PythonDispatcher)
# Every Library holding a Python kernel of ours, alive until exit: another thread may be
# running a kernel of it (the dispatcher holds no reference), so none is ever destroyed.
_py_libs: list[torch.library.Library] = []
_warned: set[str] = set()


def push_kernel(op_name: str, key: str, fn: Callable[..., Any], *,
                 with_keyset: bool = False) -> torch.library.Library:
    """Register ``fn`` as ``op``'s kernel at dispatch key ``key``, above what is there (the
    dispatcher runs the newest registration). Kept registered for good: see the docstring."""
    lib = torch.library.Library(NAMESPACE, "IMPL")
    # Older torch refuses a second Python kernel at one key; the set is bookkeeping only.
    getattr(torch.library, "_impls", set()).discard(f"{NAMESPACE}/{op_name}/{key}")
    with warnings.catch_warnings():
        # Deliberate: a newer kernel over an older one is how binding works here.
        warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
        lib.impl(op_name, fn, key, with_keyset=with_keyset)
    _py_libs.append(lib)
    return lib


def retire(lib: torch.library.Library) -> None:
    """Destroy a Library that holds no Python object (a fallthrough registration)."""
    _py_libs.remove(lib)
    lib._destroy()


def differentiating(args: Sequence[Any]) -> bool:
    """Can a gradient (reverse mode) or a tangent (forward mode) flow through this call?"""
    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in flat):
        return True
    # No dual level open (forward_ad and torch.func.jvp both open one): no tensor can carry
    # a tangent, and unpack_dual per tensor was most of this check's cost (~25 of the 42 us
    # that moe_experts' Python dispatch took per no-grad call, 2-core box).
    if getattr(torch.autograd.forward_ad, "_current_level", 0) < 0:
        return False
    return any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in flat)


def plain_eager(args: Sequence[Any]) -> bool:
    """May a call with ``args`` skip the dispatcher (as the C++ entries' ``plain_call``)?
    Plain tensors only (exactly ``torch.Tensor`` or ``nn.Parameter``: fake, functional and
    proxy tensors are subclasses), no ``__torch_function__`` or ``__torch_dispatch__`` mode,
    no functorch transform or forward-mode level, nothing that can carry a gradient, and no
    profiler running (so a profile names the op as it would from torch.ops)."""
    if (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or torch._C._autograd._profiler_enabled()
            or torch._C._functorch.maybe_current_level() is not None
            or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0):
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN or (grad and a.requires_grad) or torch._is_functional_tensor(a):
                return False
        elif isinstance(a, (list, tuple)) and not plain_eager_list(a, grad):  # a Tensor[] argument
            return False
    return True


def plain_eager_list(items: Sequence[Any], grad: bool) -> bool:
    """:func:`plain_eager`'s test of each tensor in a list argument (``Tensor[]``)."""
    for t in items:
        if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or (grad and t.requires_grad)
                                            or torch._is_functional_tensor(t)):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def reference_autograd(op: Any, direct: Callable[[Sequence[Any]], Any] | None = None) -> Callable[..., Any]:
    """The Python fallback's Autograd kernel: where a gradient or tangent can flow, the
    bound implementation's own training run where it has one that takes the call
    (``Impl.train``), else the reference, which torch differentiates in every mode and to
    any order (reverse, double backward, forward mode, functorch); otherwise the
    implementation below autograd. ``direct(args)``: the Python implementation the
    dispatcher would run below autograd on a plain eager call (:func:`plain_eager`; the
    ``use()`` router's or the device stub's pick), or None; called here directly, as
    :func:`opreg._entry.python_call` does. Why: a compiled graph
    calls the op through ``torch.ops`` (Inductor's wrapper code), and each Python kernel
    the dispatcher enters costs host time: moe_experts' two (this one, then the device
    stub) took 37-223 us a call on the H200 host (``bench/moe_profile.py``, 2026-12-02).
    With one, the compiled MoE block at decode was still 50-100 us behind the eager one
    (bench/RESULTS.md, fifteenth session): the rest is torch's own wrappers."""
    def kernel(*args: Any) -> Any:
        # A plain eager call (what a compiled graph makes at run time) can carry no gradient
        # or tangent (plain_eager implies not differentiating), so it is asked first: one
        # pass over the arguments instead of two. A no-grad moe_experts call through
        # torch.ops, launches stubbed: 38.3-39.9 -> 35.8-36.5 us, of which 27 are the
        # implementation itself (2-core box, min of 21 rounds of thread time, 2026-12-03).
        impl = direct(args) if direct is not None else None
        if impl is not None:
            return run_python(op, impl, args)
        if differentiating(args):
            out = _trained(op, args) if any(i.train is not None for i in op.impls.values()) else None
            return op.reference(*args) if out is None else out
        with torch._C._AutoDispatchBelowAutograd():
            return op.torch_op(*args)

    return kernel


def _trained(op: Any, args: Sequence[Any]) -> Any:
    """The output of the bound implementation's ``train`` on ``args``, or None (no tensor,
    no ``train``, or it does not take them)."""
    from . import registry  # imports this module

    t = first_tensor(args)
    if t is None:
        return None
    name = registry.running(op.name, t.device.type)
    train = getattr(op.impls.get(name), "train", None)
    return None if train is None else train(*args)


def run_python(op: Any, impl: Any, args: Sequence[Any]) -> Any:
    """Call a Python impl; a dtype it doesn't take goes to the reference."""
    fn = impl.fn if impl.dtypes is None or first_dtype(args) in impl.dtypes else op.reference
    return fn(*args)  # type: ignore[misc]


def first_tensor(args: Sequence[Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


def first_dtype(args: Sequence[Any]) -> torch.dtype | None:
    t = first_tensor(args)
    return None if t is None else t.dtype


def warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
