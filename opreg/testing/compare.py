"""The comparisons :mod:`opreg.testing` is built on, usable on their own: per-dtype
tolerances against a float64 reference, output poisoning, samples and argument helpers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

__all__ = ["FLOAT_DTYPES", "TOL", "BadCase", "Sample", "Unavailable", "assert_matches", "assert_outputs_match",
           "assert_same_bits", "describe", "grad_leaves", "grads_wrt", "map_tensors", "need_device", "outputs",
           "poison", "samples_from_list", "tensors", "to_float64"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Normwise relative error allowed against a float64 reference (METHOD.md's bands:
# fp32 arithmetic lands far under 1e-3, half-precision operands within 1e-2). The worst
# single element may be 4x that, relative to the output's largest magnitude.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

Args = tuple[Any, ...]
# (what, mutate(*args) -> bad args, exception type, regex its message must match)
BadCase = tuple[str, Callable[..., Args], type[BaseException], str]
SampleFn = Callable[..., Iterable[Any]]  # (device, dtype, requires_grad=False) -> samples


class Unavailable(Exception):
    """Nothing to check on this machine (no such device, implementation unavailable)."""


@dataclass
class Sample:
    """One call's positional arguments, as in the op's schema. ``dtype``: the output's
    expected dtype (default: the dtype the samples were asked for)."""

    args: Args
    name: str = ""
    dtype: torch.dtype | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {describe(self.args)}".strip()


# ----------------------------------------------------------------------------- helpers

def assert_matches(got: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype,
                   scale: torch.Tensor | None = None) -> None:
    """``got`` (dtype) agrees with the float64 reference: same shape and dtype, every
    element finite (an unwritten, poisoned element fails here), and both the normwise
    and the worst elementwise error within the dtype's tolerance of the output's scale.

    ``scale`` (optional, ``ref64``'s shape): the magnitude of the terms summed into each
    output, e.g. the reference run on the inputs' absolute values (``|x| @ |w|.T + |b|``
    for a linear). Rounding error grows with the terms, not with their sum, so an output
    that cancels (a dot product whose terms nearly sum to 0) is measured against what its
    inputs could give, not held to a precision they never had. Without it, the scale is
    the output itself."""
    if got.dtype != dtype:
        raise AssertionError(f"dtype {got.dtype}, expected {dtype}")
    if got.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(got.shape)}, expected {tuple(ref64.shape)}")
    if got.numel() == 0:
        return
    g = got.detach().double().cpu()
    r = ref64.detach().double().cpu()
    if not bool(torch.isfinite(g).all()):
        raise AssertionError("non-finite output (unwritten element?)")
    m = r.abs() if scale is None else scale.detach().double().cpu().abs().maximum(r.abs())
    err = float((g - r).abs().max() / m.max().clamp_min(1e-30))
    rel = float((g - r).norm() / m.norm().clamp_min(1e-30))
    tol = TOL[dtype]
    if not (err <= 4 * tol and rel <= tol):
        raise AssertionError(f"{dtype}: max err {err:.3g}, norm err {rel:.3g}, tol {tol:g}")


def poison(nbytes: int, device: str | torch.device) -> None:
    """Leave NaN-filled memory in the allocator's free lists, so an output that a kernel
    forgets to write comes back as NaN rather than as lucky zeros."""
    blob = torch.empty(max(nbytes, 1) // 4 + 1, dtype=torch.float32, device=device)
    blob.fill_(float("nan"))
    del blob


def map_tensors(fn: Callable[[torch.Tensor], Any], args: Any) -> Any:
    """``args`` with ``fn`` applied to every tensor, through lists and tuples."""
    if isinstance(args, torch.Tensor):
        return fn(args)
    if isinstance(args, (list, tuple)):
        return type(args)(map_tensors(fn, a) for a in args)
    return args


def tensors(args: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(out.append, args)
    return out


def to_float64(args: Any, keep_grad: bool = False) -> Any:
    """Floating tensors detached and cast to float64 (leaves again if ``keep_grad`` and
    they required grad); index tensors and numbers as they are."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        return t.detach().double().requires_grad_(keep_grad and t.requires_grad)

    return map_tensors(cast, args)


def describe(args: Any) -> str:
    """``(Tensor[14, 5] float32 strided, Tensor[14] int64, 7)``, for failure messages."""
    return repr(map_tensors(lambda t: _Shown(f"Tensor{list(t.shape)} {str(t.dtype)[6:]}"
                                             + ("" if t.is_contiguous() else " strided")), tuple(args)))


class _Shown(str):
    __repr__ = str.__str__


def outputs(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)


def grad_leaves(args: Args) -> list[torch.Tensor]:
    """The tensors of ``args`` that require grad (what a gradient check differentiates)."""
    return [t for t in tensors(args) if t.requires_grad]


# ----------------------------------------------------------------------------- the suite's checks (suite.py)

def need_device(device: str) -> None:
    """Raise :class:`Unavailable` where ``device`` is "cuda" and there is none."""
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("needs a CUDA device")


def grads_wrt(out: list[torch.Tensor], leaves: list[torch.Tensor],
              cot: list[torch.Tensor]) -> list[torch.Tensor]:
    """d(out . cot)/d(leaves); an unused leaf's gradient is zeros."""
    got = torch.autograd.grad(out, leaves, cot, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves, strict=True)]


def assert_same_bits(run: Callable[..., Any], args: Args, one_thread: bool) -> None:
    """``run(*args)`` gives the same bits on a second call (and on one thread, with ``one_thread``)."""
    first = outputs(run(*args))
    again = [outputs(run(*args))]
    if one_thread:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            again.append(outputs(run(*args)))
        finally:
            torch.set_num_threads(threads)
    for i, other in enumerate(again):
        if not all(torch.equal(a, b) for a, b in zip(first, other, strict=True)):
            raise AssertionError("different bits on " + ("a second call", "one thread")[i])


def assert_outputs_match(got: list[torch.Tensor], want: list[torch.Tensor], dtypes: list[torch.dtype]) -> None:
    """:func:`assert_matches` for each output, at its dtype's tolerance; the failing one named by index."""
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} outputs, expected {len(want)}")
    for i, (g, w, d) in enumerate(zip(got, want, dtypes, strict=True)):
        try:
            assert_matches(g, w, d)
        except AssertionError as e:
            raise AssertionError(f"[{i}] {e}" if len(got) > 1 else str(e)) from None


def samples_from_list(fixed: list[Any]) -> SampleFn:
    """A sample function over fixed samples: tensors moved to the device, floats cast."""
    def fn(device: str, dtype: torch.dtype, requires_grad: bool = False) -> list[Sample]:
        def adapt(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t.to(device)
            return t.detach().to(device, dtype).requires_grad_(requires_grad)

        return [Sample(map_tensors(adapt, tuple(s.args if isinstance(s, Sample) else s)),
                       getattr(s, "name", "")) for s in fixed]

    return fn
