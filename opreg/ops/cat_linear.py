"""``cat_linear``: ``F.linear(torch.cat(parts, -1), weight, bias)`` without the cat.

parts: R >= 1 tensors (..., H_i) with equal leading shapes; weight (K, sum H_i);
bias (K,) or None. Returns (..., K). All of one float dtype and one device.

``cat_linear_stacked(x, dim, weight, bias)`` is the same over the slices of one tensor,
``cat_linear(x.unbind(dim), weight, bias)``: what ``torch.cat([x[i] for i in range(R)], -1)``
means. It exists because the slices never have to exist: on a GPU host, making R views
in Python costs more than the whole fused kernel launch (H200, torch 2.11: 28.1 µs per
call with four slices vs 18.0 with the parts prebuilt; ``bench/model_overhead.py``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

from ._common import (FLOAT_DTYPES, Holds, Reason, define_builtin, dt, first, not_float,
                      not_strided, other_device, raise_if)

NAME = "cat_linear"
SCHEMA = "(Tensor[] parts, Tensor weight, Tensor? bias) -> Tensor"

# The stacked form saves host time (no Python-made slices), which only matters when the
# kernel is short. The pattern emits it only up to this many multiply-adds (rows *
# in-features * out-features) because its CUDA GEMM path used to build the matrix with
# movedim + reshape, 9-14 % slower than the list form's at::cat (H200, bench/RESULTS.md).
# It now runs the list form's kernels (at::cat(x.unbind(d), -1) + cuBLAS), so this cap
# can go once bench/sweep.py shows cat_linear_stacked within 3 % of eager at GEMM sizes
# (its cat_linear_stacked/stacked/* rows with B 1024/8192).
STACKED_MAX_MACS = 1 << 24


def unsupported(parts: Sequence[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor],
                *, holds: Holds = bool) -> Reason | None:
    """Why these (real or fake) inputs don't fit the op, or None."""
    if len(parts) == 0:
        return Reason(ValueError, f"{NAME}: parts must hold at least one tensor")
    p0 = parts[0]

    def each_part() -> Reason | None:
        for i, p in enumerate(parts):
            if p.dim() < 1:
                return Reason(ValueError, f"{NAME}: parts[{i}] must have at least 1 dim, got a scalar")
            if p.dim() != p0.dim() or not all(holds(a == b) for a, b in zip(p.shape[:-1], p0.shape[:-1])):
                return Reason(ValueError, f"{NAME}: parts[{i}] has leading shape {list(p.shape[:-1])} "
                                          f"but parts[0] has {list(p0.shape[:-1])}")
            if p.dtype != p0.dtype:
                return Reason(TypeError, f"{NAME}: parts[{i}] is {dt(p)} but parts[0] is {dt(p0)}")
            bad = other_device(NAME, "parts[0]", p0, **{f"parts[{i}]": p}) \
                or not_strided(NAME, **{f"parts[{i}]": p})
            if bad:
                return bad
        return None

    return first(lambda: not_float(NAME, "parts[0]", p0), each_part,
                 lambda: linear_params_unsupported(NAME, "parts[0]", p0, sum(p.shape[-1] for p in parts),
                                                   "the sum of the parts' widths", weight, bias, holds))


def linear_params_unsupported(op: str, ref_name: str, ref: torch.Tensor, width: Any, width_desc: str,
                              weight: torch.Tensor, bias: Optional[torch.Tensor],
                              holds: Holds = bool) -> Reason | None:
    """Why ``weight`` (K, width) and ``bias`` (K,) or None don't fit inputs like ``ref``."""
    if weight.dim() != 2:
        return Reason(ValueError, f"{op}: weight must be 2-D (K, {width_desc}), got shape "
                                  f"{list(weight.shape)}")
    if weight.dtype != ref.dtype:
        return Reason(TypeError, f"{op}: weight has dtype {dt(weight)} but {ref_name} has dtype {dt(ref)}")
    if not holds(weight.shape[1] == width):
        return Reason(ValueError, f"{op}: weight has {weight.shape[1]} columns but {width_desc} is {width}")
    bad = other_device(op, ref_name, ref, weight=weight) or not_strided(op, weight=weight)
    if bad or bias is None:
        return bad
    if bias.dim() != 1 or not holds(bias.shape[0] == weight.shape[0]):
        return Reason(ValueError, f"{op}: bias must have shape (K,) = ({weight.shape[0]},), got "
                                  f"{list(bias.shape)}")
    if bias.dtype != ref.dtype:
        return Reason(TypeError, f"{op}: bias has dtype {dt(bias)} but {ref_name} has dtype {dt(ref)}")
    return other_device(op, ref_name, ref, bias=bias) or not_strided(op, bias=bias)


def check(parts: Sequence[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    raise_if(unsupported(parts, weight, bias))


def reference(parts: list[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The meaning of the op, literally."""
    check(parts, weight, bias)
    return F.linear(torch.cat(parts, -1), weight, bias)


def fake(parts: list[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    check(parts, weight, bias)
    return parts[0].new_empty((*parts[0].shape[:-1], weight.shape[0]))


define_builtin(NAME, SCHEMA, reference, fake)


STACKED = "cat_linear_stacked"
STACKED_SCHEMA = "(Tensor x, int dim, Tensor weight, Tensor? bias) -> Tensor"


def unsupported_stacked(x: torch.Tensor, dim: Any, weight: torch.Tensor,
                        bias: Optional[torch.Tensor], *, holds: Holds = bool) -> Reason | None:
    """Why these (real or fake) inputs don't fit ``cat_linear_stacked``, or None."""
    nd = x.dim()
    if nd < 2:
        return Reason(ValueError, f"{STACKED}: x must have at least 2 dims (the slices are 1-D "
                                  f"or more), got shape {list(x.shape)}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -nd <= dim < nd:
        return Reason(ValueError, f"{STACKED}: dim must be in [{-nd}, {nd - 1}] for x "
                                  f"of shape {list(x.shape)}, got {dim}")
    d = dim % nd
    if not holds(x.shape[d] >= 1):
        return Reason(ValueError, f"{STACKED}: x.size(dim) must be >= 1 (at least one "
                                  f"slice), got x of shape {list(x.shape)} and dim {dim}")
    last = nd - 2 if d == nd - 1 else nd - 1
    return not_float(STACKED, "x", x) or not_strided(STACKED, x=x) or linear_params_unsupported(
        STACKED, "x", x, x.shape[d] * x.shape[last], "x.size(dim) * the slices' width", weight,
        bias, holds)


def check_stacked(x: torch.Tensor, dim: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    """Raise on bad input (as the C++ checks do); return dim made non-negative."""
    raise_if(unsupported_stacked(x, dim, weight, bias))
    return dim % x.dim()


def reference_stacked(x: torch.Tensor, dim: int, weight: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The meaning of the op, literally: x (..., S, ...) sliced along dim, S slices."""
    check_stacked(x, dim, weight, bias)
    return F.linear(torch.cat(x.unbind(dim), -1), weight, bias)


def fake_stacked(x: torch.Tensor, dim: int, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> torch.Tensor:
    d = check_stacked(x, dim, weight, bias)
    lead = [s for i, s in enumerate(x.shape) if i != d][:-1]
    return x.new_empty((*lead, weight.shape[0]))


define_builtin(STACKED, STACKED_SCHEMA, reference_stacked, fake_stacked)

__all__ = ["FLOAT_DTYPES", "NAME", "STACKED", "STACKED_MAX_MACS", "check", "check_stacked",
           "reference", "reference_stacked", "unsupported", "unsupported_stacked"]
