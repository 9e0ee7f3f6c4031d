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
slots accumulates in float32 (float64 for float64). As transformers' eager loop: only the
(token, slot) pairs that chose an expert go through it. A slot whose expert id is >= E
contributes nothing, its routing weight unread (a NaN there is harmless): transformers'
expert-parallel sentinel (an expert on another rank). An expert no token chose is never
run (its values, an fp16 overflow say, reach neither output nor gradients). A NaN or inf
weight in a real slot reaches that token's output, as in transformers. E = 0 experts: zeros
(every id a sentinel). A negative id raises IndexError on the CPU and in the reference, on
every path (eager, ``torch.compile`` with or without gradients, the differentiable grouped
path); on CUDA the grouped kernel does not check it (that would synchronise) unless
``opreg.check_indices()`` is on, and it contributes nothing. A required tensor that is
None: TypeError naming it.

Implementations: ``reference`` (the meaning: per expert, the rows that chose it; traced, the
op forward and the reference's gradients from an op of their own, see :func:`reference`),
``grouped`` (CPU and CUDA; :mod:`opreg.ops.moe_experts_grouped`: grouped GEMMs and
``scatter_combine``, differentiable by torch) and ``triton`` (CUDA; ``backends/triton``:
the fused kernels). Gradients of the op are its reference's, except where the bound
implementation trains itself (``Impl.train``: ``triton``'s fused kernels, eager). This
module is the op's meaning only: its schema, checks, gates and reference.
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
    bad = _not_tensors(hidden_states=x, top_k_index=idx, top_k_weights=w, gate_up_proj=w1, down_proj=w2,
                       gate_up_bias=gate_up_bias, down_bias=down_bias)
    if bad is not None:
        return bad

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


def _not_tensors(**args: Any) -> Reason | None:
    """A required tensor that is None (or not a tensor), or an optional bias that is neither."""
    for name, t in args.items():
        if not isinstance(t, torch.Tensor) and not (t is None and name.endswith("_bias")):
            want = "a Tensor or None" if name.endswith("_bias") else "a Tensor"
            return Reason(TypeError, f"{NAME}: {name} must be {want}, got "
                                     f"{'None' if t is None else type(t).__name__}")
    return None


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
    >= E are the expert-parallel sentinel, not an error. Does nothing on fake tensors:
    traced code checks with :func:`checked_ids` instead, which the graph runs."""
    if top_k_index.numel() == 0 or is_fake(top_k_index):
        return
    bad = top_k_index < 0
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise IndexError(f"{NAME}: top_k_index[{t}, {j}] = {int(top_k_index[t, j])} is negative "
                         f"(expert ids are in [0, E); ids >= E are skipped)")


@torch.library.custom_op("opreg::moe_experts_check_ids", mutates_args=())
def _check_ids_op(top_k_index: torch.Tensor) -> torch.Tensor:
    """:func:`check_ids` as an op of its own, for traced code: the graph holds the check and
    runs it on the real ids. It returns a copy (an op may not return its input) that the
    caller uses, so the check cannot be dead code."""
    check_ids(top_k_index)
    return top_k_index.clone()


@_check_ids_op.register_fake
def _(top_k_index: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(top_k_index)


def tracing(t: torch.Tensor) -> bool:
    """Traced (``torch.compile``, or fake tensors): no data to read."""
    return torch.compiler.is_compiling() or is_fake(t)


def checked_ids(top_k_index: torch.Tensor) -> torch.Tensor:
    """``top_k_index`` after :func:`check_ids`: now in eager, at run time in a traced graph
    (``torch.compile``, AOT autograd of the op's reference), so that a negative id raises
    the same IndexError on every path."""
    if tracing(top_k_index):
        return _check_ids_op(top_k_index)
    check_ids(top_k_index)
    return top_k_index


def checks_ids_here(t: torch.Tensor) -> bool:
    """Whether an implementation checks expert id values for ``t``'s device: always off
    CUDA; on CUDA only under ``opreg.check_indices()`` (the check synchronises)."""
    return t.device.type != "cuda" or os.environ.get("OPREG_CHECK_INDICES") == "1"


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
    """The meaning, written plainly, as transformers' eager loop: for each expert, the
    (token, slot) pairs that chose it (ids in [0, E)) -- and nothing else -- through it,
    times their routing weights, in float32 (float64); then each token's k slots summed in
    slot order (deterministic). A sentinel slot (id >= E) is never read, weight included:
    a NaN there contributes nothing; an expert no token chose is never run, so its values
    (an fp16 overflow) can't reach the output or the gradients. The work is the grouped
    path's. Its shapes are data-dependent (``nonzero``): fine in eager (and under
    ``torch.func``: vmap over anything but the ids). Traced -- ``torch.compile``'s fake
    propagation of the op, AOT autograd -- unbacked sizes would escape the op's kernel, so
    there the reference is :class:`_TracedReference`: the op forward, and backward
    :func:`_reference_backward`, an op that runs this function's gradients in eager at run
    time (same gradients, same work; no forward mode or double backward when compiled)."""
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
            activation, gated, transposed, interleaved, alpha, limit)
    check(*args)
    if tracing(hidden_states):
        return _TracedReference.apply(*args)
    ids = checked_ids(top_k_index).reshape(-1)
    (t, k), e = top_k_index.shape, gate_up_proj.shape[0]
    acc = accumulate_dtype(hidden_states.dtype)
    weights = top_k_weights.reshape(-1)
    # One row per (token, slot): written by the expert it chose; sentinel rows stay 0.
    slots = hidden_states.new_zeros((t * k, hidden_states.shape[1]), dtype=acc)
    if e == 0:  # zeros, still attached to hidden_states' graph (as the grouped path's)
        slots = slots.index_copy(0, ids.new_zeros(0, dtype=torch.long), hidden_states[:0].to(acc))
    for ex in range(e):
        rows = (ids == ex).nonzero().squeeze(1)  # its (token, slot) pairs, as flat slot numbers
        h = hidden_states.index_select(0, rows // k)
        up = _linear(h, gate_up_proj[ex], None if gate_up_bias is None else gate_up_bias[ex], transposed)
        act = apply_gate(up, activation, gated, interleaved, alpha, limit)
        y = _linear(act, down_proj[ex], None if down_bias is None else down_bias[ex], transposed)
        slots = slots.index_copy(0, rows, y.to(acc) * weights.index_select(0, rows).to(acc).unsqueeze(-1))
    return slots.view(t, k, hidden_states.shape[1]).sum(1).to(hidden_states.dtype)


# Traced (torch.compile, AOT autograd), the loop above would leave unbacked sizes in the
# op's fake propagation (torch refuses: "pending unbacked symbols not in returned outputs").
# So there the reference is the op itself forward and, backward, an op that runs the
# reference's gradients in eager, at run time: no data-dependent shape in the graph, the
# same gradients, and the work stays the grouped path's (not every expert on every token).

_GRAD_ARGS = (0, 2, 3, 4, 5, 6)  # hidden_states, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias


@torch.library.custom_op("opreg::moe_experts_reference_backward", mutates_args=())
def _reference_backward(grad: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                        gate_up_bias: Optional[torch.Tensor], down_proj: torch.Tensor,
                        down_bias: Optional[torch.Tensor], activation: str, gated: bool, transposed: bool,
                        interleaved: bool, alpha: float, limit: float) -> list[torch.Tensor]:
    """Gradients of :func:`reference` for hidden_states, top_k_weights, gate_up_proj,
    gate_up_bias, down_proj, down_bias (an empty tensor for an absent bias)."""
    args = [hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
            activation, gated, transposed, interleaved, alpha, limit]
    present = [j for j in _GRAD_ARGS if args[j] is not None]

    def run(*diff: torch.Tensor) -> torch.Tensor:
        a = list(args)
        for j, v in zip(present, diff):
            a[j] = v
        return reference(*a)

    # torch.func, not torch.autograd: a custom op's kernel runs below the autograd keys.
    _, vjp = torch.func.vjp(run, *(args[j] for j in present))
    got = dict(zip(present, vjp(grad)))
    return [got[j] if j in got else hidden_states.new_empty(0) for j in _GRAD_ARGS]


@_reference_backward.register_fake
def _(grad: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
      gate_up_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_proj: torch.Tensor,
      down_bias: Optional[torch.Tensor], *_: Any) -> list[torch.Tensor]:
    return [hidden_states.new_empty(0) if t is None else torch.empty_like(t)
            for t in (hidden_states, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias)]


class _TracedReference(torch.autograd.Function):
    """The reference as traced: forward the op (its bound kernel, below autograd),
    backward :func:`_reference_backward`. No forward mode or double backward here."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:
        ctx.save_for_backward(*(a if isinstance(a, torch.Tensor) else None for a in args[:7]))
        ctx.rest = args[7:]
        return torch.ops.opreg.moe_experts(*args)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        saved = ctx.saved_tensors
        grads = _reference_backward(grad, *saved, *ctx.rest)
        out: list[Optional[torch.Tensor]] = [None] * (len(saved) + len(ctx.rest))
        for j, g in zip(_GRAD_ARGS, grads):
            out[j] = g if saved[j] is not None and ctx.needs_input_grad[j] else None
        return tuple(out)


def fake(hidden_states: torch.Tensor, *rest: Any) -> torch.Tensor:
    """Output metadata: (T, H) like hidden_states, after the same checks (``rest``: the
    other arguments of the schema, in order)."""
    check(hidden_states, *rest)
    return hidden_states.new_empty(hidden_states.shape)


def _define() -> None:
    from .. import registry

    registry.define_op(NAME, SCHEMA, reference, fake=fake)
    from . import moe_experts_grouped  # reads this module's checks: imported once they exist

    moe_experts_grouped.register()
    try:  # the fused Triton forward (CUDA); it lists itself as unavailable without triton or a GPU
        from ..backends.triton import moe_experts as fused
    except ImportError:
        return
    fused.register()


_define()

__all__ = ["ACTIVATIONS", "GPT_OSS", "NAME", "accumulate_dtype", "apply_gate", "check", "check_ids", "checked_ids",
           "checks_ids_here", "reference", "tracing", "unsupported"]
