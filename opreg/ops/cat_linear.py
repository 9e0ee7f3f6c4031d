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

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ._common import _dt, check_float, check_same_device, define_builtin, require

NAME = "cat_linear"
SCHEMA = "(Tensor[] parts, Tensor weight, Tensor? bias) -> Tensor"


def check(parts: Sequence[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    require(len(parts) > 0, ValueError, f"{NAME}: parts must hold at least one tensor")
    p0 = parts[0]
    lead = list(p0.shape[:-1])
    check_float(NAME, "parts[0]", p0)
    for i, p in enumerate(parts):
        require(p.dim() >= 1, ValueError, f"{NAME}: parts[{i}] must have at least 1 dim, got a scalar")
        require(list(p.shape[:-1]) == lead, ValueError,
                f"{NAME}: parts[{i}] has leading shape {list(p.shape[:-1])} but parts[0] has {lead}")
        require(p.dtype == p0.dtype, TypeError,
                f"{NAME}: parts[{i}] is {_dt(p)} but parts[0] is {_dt(p0)}")
        check_same_device(NAME, "parts[0]", p0, **{f"parts[{i}]": p})
    width = sum(p.shape[-1] for p in parts)
    check_linear_params(NAME, "parts[0]", p0, width, "the sum of the parts' widths", weight, bias)


def check_linear_params(op: str, ref_name: str, ref: torch.Tensor, width: int, width_desc: str,
                        weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    require(weight.dim() == 2, ValueError,
            f"{op}: weight must be 2-D (K, {width_desc}), got shape {list(weight.shape)}")
    require(weight.dtype == ref.dtype, TypeError,
            f"{op}: weight has dtype {_dt(weight)} but {ref_name} has dtype {_dt(ref)}")
    require(weight.shape[1] == width, ValueError,
            f"{op}: weight has {weight.shape[1]} columns but {width_desc} is {width}")
    check_same_device(op, ref_name, ref, weight=weight)
    if bias is not None:
        require(bias.dim() == 1 and bias.shape[0] == weight.shape[0], ValueError,
                f"{op}: bias must have shape (K,) = ({weight.shape[0]},), got {list(bias.shape)}")
        require(bias.dtype == ref.dtype, TypeError,
                f"{op}: bias has dtype {_dt(bias)} but {ref_name} has dtype {_dt(ref)}")
        check_same_device(op, ref_name, ref, bias=bias)


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


def check_stacked(x: torch.Tensor, dim: int, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> int:
    """Raise on bad input (as backends/common/checks.h does); return dim made non-negative."""
    nd = x.dim()
    require(nd >= 2, ValueError, f"{STACKED}: x must have at least 2 dims (the slices are 1-D "
            f"or more), got shape {list(x.shape)}")
    require(-nd <= dim < nd, ValueError, f"{STACKED}: dim must be in [{-nd}, {nd - 1}] for x "
            f"of shape {list(x.shape)}, got {dim}")
    d = dim % nd
    require(x.shape[d] >= 1, ValueError, f"{STACKED}: x.size(dim) must be >= 1 (at least one "
            f"slice), got x of shape {list(x.shape)} and dim {dim}")
    check_float(STACKED, "x", x)
    last = nd - 2 if d == nd - 1 else nd - 1
    check_linear_params(STACKED, "x", x, x.shape[d] * x.shape[last],
                        "x.size(dim) * the slices' width", weight, bias)
    return d


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
