"""``moe_experts``: the routed experts of a sparse-MoE block, fused (transformers' layout).

``out[t] = sum over j < k of top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])``

with ``expert_e(x) = down_e(gate(up_e(x)))``, ``up_e(x) = x @ gate_up_proj[e].T (+ gate_up_bias[e])``
(``x @ gate_up_proj[e]`` when ``transposed``), ``down_e`` likewise, and ``gate`` named by
``activation`` (see :data:`ACTIVATIONS`):

- ``gated``: the up projection gives 2I columns, split into gate and up halves (first and
  second half, or even and odd columns when ``interleaved``); ``act(gate) * up``, both
  clamped first when ``limit`` is finite (``gate <= limit``, ``|up| <= limit``). ``"gpt_oss"``
  is GPT-OSS's gate: ``(up + 1) * gate * sigmoid(alpha * gate)`` with the same clamps.
- not ``gated``: ``act(up)``.

hidden_states (T, H) float; top_k_index (T, k) int32/int64; top_k_weights (T, k) float;
gate_up_proj (E, N, H), or (E, H, N) when ``transposed``, N = 2I if gated else I;
down_proj (E, H, I) or (E, I, H); biases (E, N) and (E, H) or None; weights and biases in
hidden_states' dtype. Returns (T, H) in hidden_states' dtype; the weighted sum over the k
slots accumulates in float32 (float64 for float64). A slot whose expert id is >= E
contributes nothing: transformers' expert-parallel sentinel (an expert on another rank).
A negative id raises IndexError on the CPU and in the reference; on CUDA it is not checked
(that would synchronise) unless ``opreg.check_indices()`` is on, and contributes nothing.

Implementations: ``reference`` (every token through every expert, masked: the meaning) and ``grouped`` (CPU and
CUDA): rows grouped by expert on the device (stable sort, offsets by ``searchsorted``: no
host sync), grouped GEMMs (``torch._grouped_mm`` for bf16 on sm90+, which is CUDA-graph
capturable; elsewhere one GEMM per expert after one host read of the offsets), the gate,
and ``scatter_combine`` for the weighted combine (deterministic, fp32 accumulation).
Gradients of the op are its reference's; :func:`grouped` itself is differentiable (plain
torch autograd, scatter_combine's own), which the transformers integration uses to train.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from ._common import (INDEX_DTYPES, Holds, Reason, dt, first, not_float, not_strided,
                      other_device, raise_if)

NAME = "moe_experts"
SCHEMA = ("(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up_proj,"
          " Tensor? gate_up_bias, Tensor down_proj, Tensor? down_bias, str activation, bool gated,"
          " bool transposed, bool interleaved, float alpha, float limit) -> Tensor")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "sigmoid": torch.sigmoid,
}
GPT_OSS = "gpt_oss"  # gated only; uses alpha and limit


def apply_gate(h: torch.Tensor, activation: str, gated: bool, interleaved: bool,
               alpha: float, limit: float) -> torch.Tensor:
    """(S, N) up-projection rows -> (S, I): the gate ``activation`` names (module docstring)."""
    if not gated:
        return ACTIVATIONS[activation](h)
    gate, up = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
    if math.isfinite(limit):
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if activation == GPT_OSS:
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return ACTIVATIONS[activation](gate) * up


# ----------------------------------------------------------------------------- spec

def _shape(name: str, t: torch.Tensor, want: tuple[Any, ...], holds: Holds, what: str) -> Reason | None:
    if t.dim() == len(want) and all(holds(a == b) for a, b in zip(t.shape, want)):
        return None
    return Reason(ValueError, f"{NAME}: {name} must have shape {what} = {list(want)}, got {list(t.shape)}")


def unsupported(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_proj: torch.Tensor,
                down_bias: Optional[torch.Tensor], activation: str, gated: bool, transposed: bool,
                interleaved: bool, alpha: float, limit: float, *, holds: Holds = bool) -> Reason | None:
    """Why these (real or fake) inputs don't fit the op, or None. Shapes, dtypes, devices,
    layouts and the activation; expert id *values* are :func:`check_ids`'."""
    x, idx, w, w1, w2 = hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj

    def ranks() -> Reason | None:
        if x.dim() != 2:
            return Reason(ValueError, f"{NAME}: hidden_states must be 2-D (T, H), got shape {list(x.shape)}")
        if idx.dim() != 2 or not holds(idx.shape[0] == x.shape[0]):
            return Reason(ValueError, f"{NAME}: top_k_index must have shape (T, k) with T = {x.shape[0]}, "
                                      f"got {list(idx.shape)}")
        if w1.dim() != 3 or w2.dim() != 3:
            bad = "gate_up_proj" if w1.dim() != 3 else "down_proj"
            return Reason(ValueError, f"{NAME}: {bad} must be 3-D (E, out, in), got shape "
                                      f"{list((w1 if w1.dim() != 3 else w2).shape)}")
        return None

    def shapes() -> Reason | None:
        e, h = w1.shape[0], x.shape[1]
        n = w1.shape[2] if transposed else w1.shape[1]
        i = n // 2 if gated else n
        if gated and not holds(n % 2 == 0):
            return Reason(ValueError, f"{NAME}: gate_up_proj's output width must be even (gate and up "
                                      f"halves), got {n}")
        io = (lambda a, b: (e, b, a)) if transposed else (lambda a, b: (e, a, b))
        form = "(E, in, out)" if transposed else "(E, out, in)"
        return first(lambda: _shape("top_k_weights", w, tuple(idx.shape), holds, "(T, k)"),
                     lambda: _shape("gate_up_proj", w1, io(n, h), holds, form),
                     lambda: _shape("down_proj", w2, io(h, i), holds, form),
                     lambda: None if gate_up_bias is None else _shape("gate_up_bias", gate_up_bias, (e, n),
                                                                      holds, "(E, N)"),
                     lambda: None if down_bias is None else _shape("down_bias", down_bias, (e, h), holds,
                                                                   "(E, H)"))

    return first(ranks, shapes, lambda: _dtypes(x, idx, w, w1, w2, gate_up_bias, down_bias),
                 lambda: _activation(activation, gated),
                 lambda: other_device(NAME, "hidden_states", x, **_named(idx, w, w1, w2, gate_up_bias, down_bias)),
                 lambda: not_strided(NAME, hidden_states=x, **_named(idx, w, w1, w2, gate_up_bias, down_bias)))


def _named(idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
           b1: Optional[torch.Tensor], b2: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    got = {"top_k_index": idx, "top_k_weights": w, "gate_up_proj": w1, "down_proj": w2,
           "gate_up_bias": b1, "down_bias": b2}
    return {k: v for k, v in got.items() if v is not None}


def _dtypes(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            b1: Optional[torch.Tensor], b2: Optional[torch.Tensor]) -> Reason | None:
    if idx.dtype not in INDEX_DTYPES:
        return Reason(TypeError, f"{NAME}: top_k_index must be int32 or int64, got {dt(idx)}")
    bad = not_float(NAME, "hidden_states", x) or not_float(NAME, "top_k_weights", w)
    for name, t in (("gate_up_proj", w1), ("down_proj", w2), ("gate_up_bias", b1), ("down_bias", b2)):
        if bad is None and t is not None and t.dtype != x.dtype:
            bad = Reason(TypeError, f"{NAME}: {name} must be {dt(x)} (like hidden_states), got {dt(t)}")
    return bad


def _activation(activation: str, gated: bool) -> Reason | None:
    if activation in ACTIVATIONS or (activation == GPT_OSS and gated):
        return None
    known = sorted(ACTIVATIONS) + [GPT_OSS + " (gated only)"]
    return Reason(ValueError, f"{NAME}: activation must be one of {known}, got {activation!r}"
                              f"{' with gated=False' if activation == GPT_OSS else ''}")


def check(*args: Any) -> None:
    """Raise what :func:`unsupported` finds (the op's positional arguments)."""
    raise_if(unsupported(*args))


def check_ids(top_k_index: torch.Tensor) -> None:
    """Raise IndexError naming the first negative expert id (synchronises on CUDA). Ids
    >= E are the expert-parallel sentinel, not an error."""
    if top_k_index.numel() == 0 or is_fake(top_k_index):
        return  # traced (the reference's gradients under AOT): no values to check
    bad = top_k_index < 0
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise IndexError(f"{NAME}: top_k_index[{t}, {j}] = {int(top_k_index[t, j])} is negative "
                         f"(expert ids are in [0, E); ids >= E are skipped)")


def _checks_ids_here(t: torch.Tensor) -> bool:
    # Not while Dynamo traces the differentiable path: a value check would break the graph.
    return (t.device.type != "cuda" or os.environ.get("OPREG_CHECK_INDICES") == "1") \
        and not torch.compiler.is_compiling()


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    y = x @ w if transposed else x @ w.T
    return y if b is None else y + b


# ----------------------------------------------------------------------------- meaning

def reference(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              gate_up_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_proj: torch.Tensor,
              down_bias: Optional[torch.Tensor], activation: str, gated: bool, transposed: bool,
              interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    """The meaning, written plainly: every token through every expert, weighted by the
    routing weight it gave that expert (0 where it didn't choose it), summed in float32
    (float64). E times the work of the grouped path, and no data-dependent shapes."""
    check(hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
          activation, gated, transposed, interleaved, alpha, limit)
    check_ids(top_k_index)
    acc = accumulate_dtype(hidden_states.dtype)
    out = hidden_states.new_zeros(hidden_states.shape, dtype=acc)
    for e in range(gate_up_proj.shape[0]):
        up = _linear(hidden_states, gate_up_proj[e], None if gate_up_bias is None else gate_up_bias[e],
                     transposed)
        act = apply_gate(up, activation, gated, interleaved, alpha, limit)
        y = _linear(act, down_proj[e], None if down_bias is None else down_bias[e], transposed)
        weight = (top_k_weights.to(acc) * (top_k_index == e)).sum(-1)  # ids >= E match no expert
        out = out + weight.unsqueeze(-1) * y.to(acc)
    return out.to(hidden_states.dtype)


def fake(hidden_states: torch.Tensor, *rest: Any) -> torch.Tensor:
    """Output metadata: (T, H) like hidden_states, after the same checks (``rest``: the
    other arguments of the schema, in order)."""
    check(hidden_states, *rest)
    return hidden_states.new_empty(hidden_states.shape)


# ----------------------------------------------------------------------------- grouped

class _Gather(torch.autograd.Function):
    """``x.index_select(0, idx)`` whose backward is scatter_combine (deterministic, fp32
    accumulation) rather than index_select's ``index_add_`` (atomics on CUDA)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.rows = x.shape[0]
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        (idx,) = ctx.saved_tensors
        ones = grad.new_ones(idx.shape[0])
        return torch.ops.opreg.scatter_combine(grad.contiguous(), idx, ones, ctx.rows), None


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for (R, C) ``x``, deterministic in backward."""
    return _Gather.apply(x, idx)


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def uses_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Does ``torch._grouped_mm`` run this (S, K) x (E, K, N) product without a host sync?
    bf16 on sm90+ (CUTLASS), rows 16-byte aligned (K, N multiples of 8). Elsewhere torch
    2.11 falls back to a loop that reads the offsets on the host, and CPU has no benefit."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm") and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0
            and _sm90_or_newer(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, b: Optional[torch.Tensor],
                   expert_of_row: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows of ``x`` (S, K) sorted by expert, group e = rows [offs[e-1], offs[e]), times
    expert e's weight (and + its bias). ``w`` is (E, N, K), or (E, K, N) if ``transposed``."""
    wk = w if transposed else w.transpose(-2, -1)  # (E, K, N), as grouped_mm takes it
    if uses_grouped_mm(x, wk):
        y = torch._grouped_mm(x, wk, offs=offs)
        return y if b is None else y + gather_rows(b, expert_of_row)
    # One GEMM per expert after one host read of the offsets. split/unbind (not slicing in
    # a loop) so that backward assembles each gradient once, not once per expert.
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    biases = b.unbind(0) if b is not None else [None] * len(sizes)
    pieces = [xe @ we if be is None else torch.addmm(be, xe, we)
              for xe, we, be in zip(x.split(sizes), wk.unbind(0), biases) if xe.shape[0] > 0]
    return torch.cat(pieces) if pieces else x.new_zeros(0, wk.shape[-1])


def grouped(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_proj: torch.Tensor,
            down_bias: Optional[torch.Tensor], activation: str, gated: bool, transposed: bool,
            interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    """The op from grouped GEMMs and scatter_combine; differentiable (module docstring)."""
    check(hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
          activation, gated, transposed, interleaved, alpha, limit)
    if _checks_ids_here(top_k_index):
        check_ids(top_k_index)
    (t, k), e = top_k_index.shape, gate_up_proj.shape[0]
    ids = top_k_index.reshape(-1).long()
    # A sentinel (or, unchecked, negative) id: computed by expert E-1 with weight 0, so the
    # row is finite and adds nothing. Vectors of S only: cheaper than masking rows later.
    valid = (ids >= 0) & (ids < e)
    ids = torch.where(valid, ids, e - 1)
    weights = torch.where(valid, top_k_weights.reshape(-1), 0)
    expert_of_row, perm = torch.sort(ids, stable=True)
    offs = torch.searchsorted(expert_of_row, torch.arange(e, device=ids.device), right=True).int()
    token_of_row = perm // k
    up = grouped_linear(gather_rows(hidden_states, token_of_row), gate_up_proj, offs, gate_up_bias,
                        expert_of_row, transposed)
    act = apply_gate(up, activation, gated, interleaved, alpha, limit)
    down = grouped_linear(act, down_proj, offs, down_bias, expert_of_row, transposed)
    # Half-precision rows are weighted in fp32, as transformers' fp32 routing weights are.
    gates = weights[perm]
    gates = gates.float() if down.dtype in (torch.float16, torch.bfloat16) else gates.to(down.dtype)
    return torch.ops.opreg.scatter_combine(down, token_of_row, gates, t)


def _grouped_impl(*args: Any) -> torch.Tensor:
    # The op's kernel: its autograd is the op's (the reference's), so record nothing here.
    with torch.no_grad():
        return grouped(*args)


def _define() -> None:
    from .. import registry

    registry.define_op(NAME, SCHEMA, reference, fake=fake)
    registry.add_impl(NAME, registry.Impl("grouped", NAME, ("cpu", "cuda"), priority=100, fn=_grouped_impl))


_define()

__all__ = ["ACTIVATIONS", "GPT_OSS", "NAME", "apply_gate", "check", "check_ids", "gather_rows", "grouped",
           "grouped_linear", "reference", "unsupported", "uses_grouped_mm"]
