"""``scatter_combine``: the Mixture-of-Experts combine.

``out[t] = sum over rows r with token_idx[r] == t of gates[r] * expert_hidden[r]``

expert_hidden (N, H) float; token_idx (N,) int32/int64; gates (N,), the dtype of
expert_hidden or float32; num_tokens T >= 0. Returns (T, H) in expert_hidden's dtype;
tokens that receive no row are 0. Accumulates in float32 (float64 for float64 inputs).

This file is the op's spec: :func:`unsupported` says what fits it (the op's own check,
its pattern and its loop idiom all ask it), :func:`reference` what it means.
"""
from __future__ import annotations

from typing import Any

import torch

from ._common import (FLOAT_DTYPES, INDEX_DTYPES, Holds, Reason, define_builtin, dt, first,
                      not_float, not_strided, other_device, raise_if)

NAME = "scatter_combine"
SCHEMA = "(Tensor expert_hidden, Tensor token_idx, Tensor gates, SymInt num_tokens) -> Tensor"
BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor expert_hidden, Tensor token_idx, Tensor gates)"
                   " -> (Tensor, Tensor)")


def unsupported(expert_hidden: torch.Tensor, token_idx: torch.Tensor, gates: torch.Tensor,
                num_tokens: Any, *, op: str = NAME, holds: Holds = bool) -> Reason | None:
    """Why these (real or fake) inputs don't fit the op, or None. Shapes, dtypes, devices
    and layouts only: the index *values* are checked by :func:`check_range`."""
    h, i, g = expert_hidden, token_idx, gates

    def shapes() -> Reason | None:
        if h.dim() != 2:
            return Reason(ValueError, f"{op}: expert_hidden must be 2-D (N, H), got shape {list(h.shape)}")
        n = h.shape[0]
        if i.dim() != 1 or not holds(i.shape[0] == n):
            return Reason(ValueError, f"{op}: token_idx must have shape (N,) = ({n},), got {list(i.shape)}")
        if g.dim() != 1 or not holds(g.shape[0] == n):
            return Reason(ValueError, f"{op}: gates must have shape (N,) = ({n},), got {list(g.shape)}")
        return None

    def dtypes() -> Reason | None:
        if i.dtype not in INDEX_DTYPES:
            return Reason(TypeError, f"{op}: token_idx must be int32 or int64, got {dt(i)}")
        bad = not_float(op, "expert_hidden", h)
        if bad is None and g.dtype not in (h.dtype, torch.float32):
            bad = Reason(TypeError, f"{op}: gates must be {dt(h)} (like expert_hidden) or float32, "
                                    f"got {dt(g)}")
        return bad

    def count() -> Reason | None:
        if isinstance(num_tokens, (int, torch.SymInt)) and not isinstance(num_tokens, bool) \
                and holds(num_tokens >= 0):
            return None
        return Reason(ValueError, f"{op}: num_tokens must be >= 0, got {num_tokens}")

    return first(shapes, dtypes,
                 lambda: other_device(op, "expert_hidden", h, token_idx=i, gates=g),
                 lambda: not_strided(op, expert_hidden=h, token_idx=i, gates=g),
                 count)


def check(expert_hidden: torch.Tensor, token_idx: torch.Tensor, gates: torch.Tensor,
          num_tokens: int, op: str = NAME) -> None:
    """Raise what :func:`unsupported` finds (no index range check: that needs the values)."""
    raise_if(unsupported(expert_hidden, token_idx, gates, num_tokens, op=op))


def check_range(token_idx: torch.Tensor, num_tokens: int) -> None:
    """Raise IndexError naming the first out-of-range index (synchronises on CUDA)."""
    if token_idx.numel() == 0:
        return
    bad = (token_idx < 0) | (token_idx >= num_tokens)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise IndexError(f"{NAME}: token_idx[{r}] = {int(token_idx[r])} is out of range "
                         f"[0, num_tokens={num_tokens})")


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(expert_hidden: torch.Tensor, token_idx: torch.Tensor, gates: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """The meaning of the op, vectorised and deterministic: on CUDA
    ``index_put_(accumulate=True)`` (sort-based; ``index_add_`` uses atomics there), on the
    CPU ``index_add_`` (sequential; CPU ``index_put_`` sums in a varying order: 2 distinct
    results in 20 calls at 2048 x 96 rows into 512 tokens, found by opreg.testing)."""
    check(expert_hidden, token_idx, gates, num_tokens)
    check_range(token_idx, num_tokens)
    acc = accumulate_dtype(expert_hidden.dtype)
    contrib = expert_hidden.to(acc) * gates.to(acc).unsqueeze(-1)
    out = contrib.new_zeros(num_tokens, expert_hidden.shape[1])
    if out.device.type == "cuda":
        out.index_put_((token_idx.long(),), contrib, accumulate=True)
    else:
        out.index_add_(0, token_idx.long(), contrib)
    return out.to(expert_hidden.dtype)


def fake(expert_hidden: torch.Tensor, token_idx: torch.Tensor, gates: torch.Tensor,
         num_tokens: int) -> torch.Tensor:
    check(expert_hidden, token_idx, gates, num_tokens)
    return expert_hidden.new_empty((num_tokens, expert_hidden.shape[1]))


def backward_reference(grad_out: torch.Tensor, expert_hidden: torch.Tensor,
                       token_idx: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_expert_hidden, grad_gates): ``gates[r] * grad_out[idx[r]]`` and
    ``<grad_out[idx[r]], expert_hidden[r]>``, accumulated in float32 (float64)."""
    check(expert_hidden, token_idx, gates, grad_out.shape[0], op=NAME + "_backward")
    acc = accumulate_dtype(expert_hidden.dtype)
    g = grad_out.index_select(0, token_idx.long()).to(acc)
    grad_hidden = (g * gates.to(acc).unsqueeze(-1)).to(expert_hidden.dtype)
    grad_gates = (g * expert_hidden.to(acc)).sum(-1).to(gates.dtype)
    return grad_hidden, grad_gates


def backward_fake(grad_out: torch.Tensor, expert_hidden: torch.Tensor,
                  token_idx: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (expert_hidden.new_empty(expert_hidden.shape), gates.new_empty(gates.shape))


define_builtin(NAME, SCHEMA, reference, fake)
# Differentiable too (backends/autograd/scatter_combine.cpp), so that double backward of
# scatter_combine is right.
define_builtin(NAME + "_backward", BACKWARD_SCHEMA, backward_reference, backward_fake)

__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES", "NAME", "check", "check_range", "reference", "unsupported"]
