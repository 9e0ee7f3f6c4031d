"""``scatter_combine``: the Mixture-of-Experts combine.

``out[t] = sum over rows r with token_idx[r] == t of gates[r] * expert_hidden[r]``

expert_hidden (N, H) float; token_idx (N,) int32/int64; gates (N,), the dtype of
expert_hidden or float32; num_tokens T >= 0. Returns (T, H) in expert_hidden's dtype;
tokens that receive no row are 0. Accumulates in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch

from ._common import INDEX_DTYPES, _dt, check_float, check_same_device, define_builtin, require

NAME = "scatter_combine"
SCHEMA = "(Tensor expert_hidden, Tensor token_idx, Tensor gates, SymInt num_tokens) -> Tensor"
BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor expert_hidden, Tensor token_idx, Tensor gates)"
                   " -> (Tensor, Tensor)")


def check(expert_hidden: torch.Tensor, token_idx: torch.Tensor, gates: torch.Tensor,
          num_tokens: int, op: str = NAME) -> None:
    """Shape/dtype/device checks (no index range check: that needs the values)."""
    require(expert_hidden.dim() == 2, ValueError,
            f"{op}: expert_hidden must be 2-D (N, H), got shape {list(expert_hidden.shape)}")
    n = expert_hidden.shape[0]
    require(token_idx.dim() == 1 and token_idx.shape[0] == n, ValueError,
            f"{op}: token_idx must have shape (N,) = ({n},), got {list(token_idx.shape)}")
    require(gates.dim() == 1 and gates.shape[0] == n, ValueError,
            f"{op}: gates must have shape (N,) = ({n},), got {list(gates.shape)}")
    require(token_idx.dtype in INDEX_DTYPES, TypeError,
            f"{op}: token_idx must be int32 or int64, got {_dt(token_idx)}")
    check_float(op, "expert_hidden", expert_hidden)
    require(gates.dtype in (expert_hidden.dtype, torch.float32), TypeError,
            f"{op}: gates must be {_dt(expert_hidden)} (like expert_hidden) or float32, "
            f"got {_dt(gates)}")
    check_same_device(op, "expert_hidden", expert_hidden, token_idx=token_idx, gates=gates)
    require(num_tokens >= 0, ValueError, f"{op}: num_tokens must be >= 0, got {num_tokens}")


def check_range(token_idx: torch.Tensor, num_tokens: int) -> None:
    """Raise IndexError naming the first out-of-range index (synchronises on CUDA)."""
    if token_idx.numel() == 0:
        return
    bad = (token_idx < 0) | (token_idx >= num_tokens)
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise IndexError(f"{NAME}: token_idx[{r}] = {int(token_idx[r])} is out of range "
                         f"[0, num_tokens={num_tokens})")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference(expert_hidden: torch.Tensor, token_idx: torch.Tensor, gates: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """The meaning of the op, vectorised. ``index_put_(accumulate=True)`` rather than
    ``index_add_``: it is deterministic on CUDA too (sort-based), index_add_ uses atomics."""
    check(expert_hidden, token_idx, gates, num_tokens)
    check_range(token_idx, num_tokens)
    acc = _acc(expert_hidden.dtype)
    contrib = expert_hidden.to(acc) * gates.to(acc).unsqueeze(-1)
    out = contrib.new_zeros(num_tokens, expert_hidden.shape[1])
    out.index_put_((token_idx.long(),), contrib, accumulate=True)
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
    acc = _acc(expert_hidden.dtype)
    g = grad_out.index_select(0, token_idx.long()).to(acc)
    grad_hidden = (g * gates.to(acc).unsqueeze(-1)).to(expert_hidden.dtype)
    grad_gates = (g * expert_hidden.to(acc)).sum(-1).to(gates.dtype)
    return grad_hidden, grad_gates


def backward_fake(grad_out: torch.Tensor, expert_hidden: torch.Tensor,
                  token_idx: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (expert_hidden.new_empty(expert_hidden.shape), gates.new_empty(gates.shape))


define_builtin(NAME, SCHEMA, reference, fake)
define_builtin(NAME + "_backward", BACKWARD_SCHEMA, backward_reference, backward_fake,
               differentiable=False)
