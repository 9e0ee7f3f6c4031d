"""``cat_linear``: ``F.linear(torch.cat(parts, -1), weight, bias)`` without the cat.

parts: R >= 1 tensors (..., H_i) with equal leading shapes; weight (K, sum H_i);
bias (K,) or None. Returns (..., K). All of one float dtype and one device.
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
    require(weight.dim() == 2, ValueError,
            f"{NAME}: weight must be 2-D (K, sum of part widths), got shape {list(weight.shape)}")
    require(weight.dtype == p0.dtype, TypeError,
            f"{NAME}: weight is {_dt(weight)} but parts are {_dt(p0)}")
    check_same_device(NAME, "parts[0]", p0, weight=weight)
    width = sum(p.shape[-1] for p in parts)
    require(weight.shape[1] == width, ValueError,
            f"{NAME}: weight has {weight.shape[1]} columns but the parts' widths sum to {width}")
    if bias is not None:
        require(bias.dim() == 1 and bias.shape[0] == weight.shape[0], ValueError,
                f"{NAME}: bias must have shape (K,) = ({weight.shape[0]},), got {list(bias.shape)}")
        require(bias.dtype == p0.dtype, TypeError, f"{NAME}: bias is {_dt(bias)} but parts are {_dt(p0)}")
        check_same_device(NAME, "parts[0]", p0, bias=bias)


def reference(parts: list[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The meaning of the op, literally."""
    check(parts, weight, bias)
    return F.linear(torch.cat(parts, -1), weight, bias)


def fake(parts: list[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    check(parts, weight, bias)
    return parts[0].new_empty((*parts[0].shape[:-1], weight.shape[0]))


define_builtin(NAME, SCHEMA, reference, fake)
