"""The fused MoE kernels as a training path: two ops, the forward's autograd calling the backward.

``opreg::moe_experts_fused`` runs the fused forward (:func:`.moe_experts.fused_experts_forward`
with ``save=True``) and returns, beside the output, what the backward reads: the routing
buffer, GEMM1's activation and its pre-activation, and GEMM1's sorted copy of the token rows
where ``keep_rows`` (:func:`.moe_experts_backward.keeps_rows`; else an empty (0, H)).
``opreg::moe_experts_fused_backward`` runs :func:`.moe_experts_backward.fused_experts_backward`
on them. As custom ops they are one opaque node each in a traced graph: under
``torch.compile`` AOT autograd puts the first in the forward graph and the second in the
backward graph, and Inductor compiles the rest of the model around them (the launcher's
direct kernel calls are not traceable, and the saved tensors' sizes are static, so the fake
kernels can give them).

:func:`fused_trains` says whether a call takes this path; :func:`train` runs it: the
custom ops when traced, in eager :class:`.moe_experts_backward.FusedExperts` (an
``autograd.Function`` over the same two functions, cheaper on the host; it also takes
block configs, for tests and tuning).

With :data:`INLINE_KERNELS` (the default; False restores the two ops), a compiled call does
not reach the custom ops: Dynamo traces ``FusedExperts`` (and the no-grad forward,
:func:`inline_forward`), so Inductor's wrapper launches the kernels itself; except where
eager runs Gluon kernels, which Dynamo does not trace (:func:`_eager_gluon`): there the
no-grad forward is the op, one node, and the training step, there and where only its weight
gradients run on Gluon (:func:`_trains_on_gluon`), the two custom ops
(:data:`GLUON_TRAINING_OPS`).

No forward mode (``forward_ad``, ``torch.func.jvp``) or ``torch.func`` transforms here:
:func:`fused_trains` sends those to the op's differentiable grouped path. A double backward
(``create_graph``) in eager differentiates the op's reference inside ``FusedExperts``'
backward. The op itself called with gradients takes this path too, through the ``triton``
implementation's ``train`` (:func:`.moe_experts.moe_experts_triton_train`).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
from torch import Tensor

from opreg import registry
from opreg._dispatch import plain_eager
from opreg._log import log_once
from opreg.ops import moe_experts as M

from . import moe_experts as F
from . import moe_experts_backward as B
from .launch import dynamo_tracing
from .moe_routing import routing_size, routing_views
from .moe_tiles import interpreting

__all__ = ["GLUON_TRAINING_OPS", "INLINE_KERNELS", "TRACED_MIN_FLOPS", "fused_trains", "inline_forward", "runs_fused",
           "traced_host_bound", "train"]


def _layout(x: Tensor, ids: Tensor, w1: Tensor, gated: bool, transposed: bool
            ) -> Optional[tuple[int, int, int, int]]:
    """(sorted rows S = T*k, routing buffer length, I, N1) of the forward's saved tensors, or
    None where it saves nothing (no slot, or H = 0). The same config pick as the forward's."""
    t, h = x.shape
    k, e = ids.shape[1], w1.shape[0]
    n1 = w1.shape[2] if transposed else w1.shape[1]
    i = n1 // 2 if gated else n1
    s = t * k
    if s == 0 or h == 0:
        return None
    bm = _block_m(x, ids, w1, gated, transposed)
    return s, routing_size(s, e, bm), i, n1


# The two ops are defined on a Library of their own, not with torch.library.custom_op: in a
# compiled training step Inductor's wrapper calls them through torch.ops, and custom_op's
# Python layers (its autograd kernel, the redispatch below autograd, the backend wrapper with
# its aliasing check, the disabled-Dynamo frame) took a no-grad forward call through torch.ops
# 47 µs against 43-44 now and 31-33 for the function itself, the backward 79-89 against 63-70
# (2-core box, launches stubbed, T = 64, min of 25 interleaved rounds, 2026-12-03; the H200
# box's host runs such Python ~4-5x slower). Here the forward's Autograd kernel is
# one Python function (:func:`_fused_autograd`), which a plain no-grad eager call (a compiled
# graph's runtime) passes straight to the kernel, and the backward op has no Python kernel
# above its implementation.
_LIB = torch.library.Library("opreg", "FRAGMENT")  # alive for the process: it holds the ops
_LIB.define("moe_experts_fused(Tensor hidden_states, Tensor top_k_index, Tensor top_k_weights, "
            "Tensor gate_up_proj, Tensor? gate_up_bias, Tensor down_proj, Tensor? down_bias, str activation, "
            "bool gated, bool transposed, bool interleaved, float alpha, float limit, bool keep_rows=False) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("moe_experts_fused_backward(Tensor grad, Tensor hidden_states, Tensor top_k_index, "
            "Tensor top_k_weights, Tensor gate_up_proj, Tensor? gate_up_bias, Tensor down_proj, "
            "Tensor? down_bias, Tensor routing, Tensor act, Tensor pre, Tensor rows, str activation, bool gated, "
            "bool transposed, bool interleaved, float alpha, float limit, bool[] needs) -> Tensor[]",
            tags=(torch.Tag.pt2_compliant_tag,))


def _fused(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
           gate_up_bias: Optional[Tensor], down_proj: Tensor, down_bias: Optional[Tensor], activation: str,
           gated: bool, transposed: bool, interleaved: bool, alpha: float, limit: float, keep_rows: bool = False
           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out (T, H), routing (int32), act (S, I), pre (S, N1) (``pre_dtype``), rows (S, H) or (0, H)):
    the fused forward and what its backward reads (empty where it saves nothing; ``rows``
    where ``keep_rows``; S = T*k sorted rows)."""
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
            activation, gated, transposed, interleaved, alpha, limit)
    out, saved = F.fused_experts_forward(*args, save=True, keep_rows=keep_rows)
    if saved is None:
        return (out, *_nothing_saved(hidden_states, gate_up_proj, gated, transposed, limit))
    rows = saved.rows if saved.rows is not None else hidden_states.new_empty((0, hidden_states.shape[1]))
    return out, saved.routing, saved.act, saved.pre, rows


def _nothing_saved(x: Tensor, w1: Tensor, gated: bool, transposed: bool,
                   limit: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n1 = w1.shape[2] if transposed else w1.shape[1]
    i = n1 // 2 if gated else n1
    return (x.new_empty((0,), dtype=torch.int32), x.new_empty((0, i)),
            x.new_empty((0, n1), dtype=F.pre_dtype(x.dtype, gated, limit)), x.new_empty((0, x.shape[1])))


@torch.library.register_fake("opreg::moe_experts_fused", lib=_LIB)
def _(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
      gate_up_bias: Optional[Tensor], down_proj: Tensor, down_bias: Optional[Tensor], activation: str,
      gated: bool, transposed: bool, interleaved: bool, alpha: float, limit: float, keep_rows: bool = False
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = hidden_states.new_empty(hidden_states.shape)
    lay = _layout(hidden_states, top_k_index, gate_up_proj, gated, transposed)
    if lay is None:
        return (out, *_nothing_saved(hidden_states, gate_up_proj, gated, transposed, limit))
    rows, length, i, n1 = lay
    x = hidden_states
    return (out, x.new_empty((length,), dtype=torch.int32), x.new_empty((rows, i)),
            x.new_empty((rows, n1), dtype=F.pre_dtype(x.dtype, gated, limit)),
            x.new_empty((rows if keep_rows else 0, x.shape[1])))


_GRAD_INPUTS = (0, 2, 3, 4, 5, 6)  # hidden_states, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias


def _fused_backward(grad: Tensor, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                    gate_up_proj: Tensor, gate_up_bias: Optional[Tensor], down_proj: Tensor,
                    down_bias: Optional[Tensor], routing: Tensor, act: Tensor, pre: Tensor, rows: Tensor,
                    activation: str, gated: bool, transposed: bool, interleaved: bool, alpha: float, limit: float,
                    needs: list[bool]) -> list[Tensor]:
    """Gradients for (hidden_states, top_k_weights, gate_up_proj, gate_up_bias, down_proj,
    down_bias), each where ``needs`` asks and the input is present, else an empty tensor."""
    x, ids, w1 = hidden_states, top_k_index, gate_up_proj
    saved = None
    if act.shape[0] > 0:  # else nothing was saved: no slot, or H = 0 (every gradient 0)
        s, e = ids.shape[0] * ids.shape[1], w1.shape[0]
        bm = _block_m(x, ids, w1, gated, transposed)
        spi, block_expert, tables = routing_views(routing, s, e, bm)
        saved = F.Saved(spi, block_expert, tables, act, pre, {"gemm1": {"BLOCK_M": bm}}, routing,
                        rows if rows.shape[0] > 0 else None)
    grads = B.fused_experts_backward(grad, x, ids, top_k_weights, w1, gate_up_bias, down_proj, down_bias,
                                     activation, gated, transposed, interleaved, alpha, limit, saved,
                                     needs=tuple(needs))
    return [g if g is not None else x.new_empty(0) for g in grads]


def _block_m(x: Tensor, ids: Tensor, w1: Tensor, gated: bool, transposed: bool) -> int:
    """The forward's BLOCK_M: its own config pick (:func:`.moe_experts.forward_configs`), from the sizes alone."""
    n1 = w1.shape[2] if transposed else w1.shape[1]
    (t, k), e = ids.shape, w1.shape[0]
    return _block_m_of(t, k, e, n1, x.shape[1], gated, x.dtype)


@functools.lru_cache(maxsize=1024)
def _block_m_of(t: int, k: int, e: int, n1: int, h: int, gated: bool, dtype: torch.dtype) -> int:
    # cached: the backward's custom op asks on every call (~20 us of host on the 2-core box)
    return F.forward_configs({}, t * k / e, n1, h, n1 // 2 if gated else n1, k, dtype)[0]["BLOCK_M"]


@torch.library.register_fake("opreg::moe_experts_fused_backward", lib=_LIB)
def _(grad: Tensor, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
      gate_up_bias: Optional[Tensor], down_proj: Tensor, down_bias: Optional[Tensor], routing: Tensor,
      act: Tensor, pre: Tensor, rows: Tensor, activation: str, gated: bool, transposed: bool, interleaved: bool,
      alpha: float, limit: float, needs: list[bool]) -> list[Tensor]:
    inputs = (hidden_states, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias)
    return [t.new_empty(t.shape) if t is not None and need else hidden_states.new_empty(0)
            for t, need in zip(inputs, needs)]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _, routing, act, pre, rows = output
    ctx.save_for_backward(*inputs[:7], routing, act, pre, rows)
    ctx.rest = inputs[7:13]  # activation .. limit (not keep_rows: the backward reads ``rows``)
    # The saved tensors are outputs only for the backward's sake: without this, autograd
    # fills a zero gradient for each (the pre-activation alone is R x N1 float32, 268 MB at
    # Mixtral's T = 4096) before every backward, ~4x this path's host time on the CPU.
    ctx.mark_non_differentiable(routing, act, pre, rows)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad: Tensor, *_unused: Any) -> tuple[Optional[Tensor], ...]:
    x, ids, rw, w1, b1, w2, b2, routing, act, pre, rows = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[j]) for j in _GRAD_INPUTS]
    grads = torch.ops.opreg.moe_experts_fused_backward(grad, x, ids, rw, w1, b1, w2, b2, routing, act, pre,
                                                       rows, *ctx.rest, needs)
    out: list[Optional[Tensor]] = [None] * len(ctx.needs_input_grad)
    for j, g, need in zip(_GRAD_INPUTS, grads, needs):
        out[j] = g if need else None
    return tuple(out)


class _FusedFunction(torch.autograd.Function):
    """The forward op's autograd: the op below autograd, :func:`_backward` for its gradient.
    (What ``register_autograd`` would generate, without its per-call Python layers.)"""

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, ...]:
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.opreg.moe_experts_fused.default(*args)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Optional[Tensor], ...]:
        return _backward(ctx, *grads)  # one per input (keep_rows' is None)


def _fused_autograd(*args: Any) -> tuple[Tensor, ...]:
    """The forward op's Autograd kernel. A plain eager call (plain tensors, no mode or
    transform, nothing that can carry a gradient: :func:`opreg._dispatch.plain_eager`), as a
    compiled graph makes it at run time, goes straight to the implementation; anything else
    (tracing, a gradient to record) through :class:`_FusedFunction`, which records the
    backward where a gradient can flow and otherwise just redispatches below autograd."""
    if len(args) == 13:
        args = (*args, False)  # keep_rows' default (the dispatcher does not fill it in here)
    if plain_eager(args):
        return _fused(*args)
    return _FusedFunction.apply(*args)


_LIB.impl("moe_experts_fused", _fused, "CompositeExplicitAutograd")
_LIB.impl("moe_experts_fused", _fused_autograd, "Autograd")
_LIB.impl("moe_experts_fused_backward", _fused_backward, "CompositeExplicitAutograd")


def _bound(device_type: str) -> str:
    """The moe_experts implementation a call on ``device_type`` runs now (a constant when
    traced: :func:`opreg.registry.running`)."""
    return registry.running(M.NAME, device_type)


def runs_fused(args: tuple[Any, ...]) -> bool:
    """Does the op run its fused kernels on the op's arguments ``args``: its ``triton``
    implementation bound for their device (:func:`_bound`), and the kernels take them
    (:func:`.moe_experts.why_not_fused`), not its grouped fallback?"""
    return F.why_not_fused(*args) is None and _bound(args[0].device.type) == "triton"


def fused_trains(args: tuple[Any, ...]) -> bool:
    """Does a differentiable call with the op's arguments ``args`` (checked) train through
    the fused kernels? Where the op runs its ``triton`` implementation on these inputs
    (:func:`.moe_experts.why_not_fused` None), in plain reverse mode (no forward-mode dual
    level, not inside a ``torch.func`` transform), and, traced, with static sizes (the
    saved tensors' sizes come from the block config, picked per size)."""
    x = args[0]
    if not runs_fused(args):
        return False
    if torch.compiler.is_compiling():  # traced: no functorch level or dual tensors here
        return not any(isinstance(d, torch.SymInt) for t in (x, args[1]) for d in t.shape)
    return (torch._C._functorch.maybe_current_level() is None
            and getattr(torch.autograd.forward_ad, "_current_level", -1) < 0)


# Under torch.compile a training step through the two fused ops pays their Python kernels
# and launches (~16) on the host, where the differentiable grouped path, traced, pays only
# Inductor's generated wrapper. Both steps wait on the host until the GEMMs outgrow it: on
# the H200 box the compiled block's training step took 2.3-3.3 ms of host with the fused
# ops at T <= 64 (its kernels ~0.5 ms), 0.35-0.53 ms more than HF's compiled grouped_mm
# step (bench/RESULTS.md, twenty-fourth session, T = 1 and 64), and the fused step ran at
# ~250 TF/s of its GEMM FLOPs at the smallest size where it was GPU-bound (Qwen3-MoE, T =
# 4096). So the fused step is ahead only where its GEMMs take longer than that host time:
# ~2.3 ms x ~250 TF/s = 5.8e11, rounded down to 5e11 FLOPs (forward and backward: 6 T k H
# (N1 + I)). The two paths, each in its own process beside HF's compiled step
# (`STAGE=compiled bash bench/device_run.sh`, twenty-fifth session; µs, grouped / fused,
# Mixtral, Qwen3-MoE, OLMoE; HF's own step moved up to 15 % between the two processes):
# T = 64 (0.015-0.02 TFLOP) 2033 / 2905, 2531 / 3035, 2111 / 2107; T = 512 (0.12-0.16
# TFLOP) 2449 / 3174, 3185 / 2936, 2788 / 2535: no clear winner there, so the bound stays
# above it; T = 4096 Qwen3-MoE (0.93 TFLOP, grouped under the former bound of 1e12) 4200 /
# 3708, so the fused ops there now. At T = 4096 again (twenty-ninth session, HF's step in the
# same process as each): grouped / fused 1.02x / 1.01x of HF's (Mixtral), 1.07x / 1.10x
# (Qwen3-MoE), 1.08x / 1.16x (OLMoE). Not seen from here: a step replayed from CUDA graphs
# (mode="reduce-overhead") has no such host cost, but the choice is made while Dynamo
# traces, before the backend applies its mode, so such a step takes the grouped path too,
# whose GEMMs are HF's compiled grouped_mm step's: at T = 64 that step's kernels took ~7 %
# longer than the fused ones (Mixtral, 543 against 509 µs, bench/RESULTS.md, twenty-second
# session). With the kernels inline (INLINE_KERNELS, thirtieth session; ratio vs HF's step in
# the same process, grouped / fused, Mixtral, Qwen3-MoE, OLMoE): T = 1 0.98 / 0.91, 1.01 /
# 0.90, 0.98 / 0.91; T = 64 0.98 / 0.93, 0.98 / 0.98, 0.93 / 0.92; T = 512 (two runs) 0.99 /
# 0.94 and 0.98 / 0.93, 0.94 / 1.04 and 0.95 / 0.98, 0.88 / 1.07 and 0.90 / 0.96; T = 2048
# 0.97 / 0.96, 1.01 / 1.07, 0.90 / 1.01. The fused step still costs ~0.15 ms more host at
# T = 1, and below the bound it would gain on the many-expert configs but lose ~5 % on
# Mixtral at T = 512 at the same FLOPs as OLMoE's: FLOPs alone don't separate them, so the
# bound stays (above it, no config measured lost to the grouped path by more than 1 %).
TRACED_MIN_FLOPS = 5.0e11


def traced_host_bound(args: tuple[Any, ...]) -> bool:
    """Would a compiled training step with the op's arguments ``args`` (static sizes) wait on
    the fused ops' host work rather than their GEMMs (:data:`TRACED_MIN_FLOPS`)? Then the
    differentiable grouped path, compiled by Inductor, is the faster one there."""
    x, ids, w1, gated, transposed = args[0], args[1], args[3], args[8], args[9]
    n1 = w1.shape[2] if transposed else w1.shape[1]
    return _host_bound(x.shape[0], ids.shape[1], x.shape[1], n1, n1 // 2 if gated else n1)


@torch.compiler.assume_constant_result
def _host_bound(t: int, k: int, h: int, n1: int, i: int) -> bool:
    """:func:`traced_host_bound` from plain sizes, said once per size (a constant to Dynamo,
    which need not trace the logging)."""
    flops = 6.0 * t * k * h * (n1 + i)
    bound = flops < TRACED_MIN_FLOPS
    if bound:
        log_once(("traced host-bound", t, k, h, n1, i), logging.INFO,
                 "opreg: a compiled moe_experts training step at T=%d, k=%d, H=%d, N1=%d, I=%d (%.2g GEMM "
                 "FLOPs < %.2g) runs the grouped path under Inductor: the fused ops' host work would "
                 "outlast their kernels there", t, k, h, n1, i, flops, TRACED_MIN_FLOPS)
    return bound


# True: under torch.compile, Dynamo traces the fused kernels' Python (:class:`.moe_experts_
# backward.FusedExperts`, the no-grad forward: :func:`inline_forward`), each launch through
# ``wrap_triton`` (.launch.traced_launch), so each launch is a node of the graph that
# Inductor's generated wrapper makes, with none of our Python per call. False: the two custom
# ops above, one node each, whose Python runs on every call. Why: a compiled training step
# through the custom ops waited on their host work (H200, T = 4096: its host 3.2-3.5 ms
# against ~2.5 for HF's compiled step, bench/RESULTS.md, twenty-eighth session), and Dynamo
# records our tensor descriptors where a custom op's decomposition does not
# (bench/probe_inductor_tma.py). Measured (H200, T = 4096, compiled block, each process
# beside HF's compiled grouped_mm, `STAGE=inline bash bench/device_run.sh`, thirtieth
# session; ratio vs HF's, inline / custom ops): training 1.02x / 1.00x (Mixtral), 1.21x /
# 1.15x (Qwen3-MoE), 1.20x / 1.16x (OLMoE): 1-8 % less step time (2910 / 2929, 3040 / 3309,
# 3186 / 3297 µs); no-grad forward within 2 % either way. Compiled and eager agree bit for
# bit and a compiled call runs none of our Python (tests/test_moe_inline.py, on the H200).
# The price: the op is not one node in the graph but its kernels (a graph dump shows them).
INLINE_KERNELS = True


def _inlines() -> bool:
    """:data:`INLINE_KERNELS`, where Dynamo can trace the launches: not under Triton's
    interpreter (its kernels are no ``JITFunction``: the custom ops run them there)."""
    return INLINE_KERNELS and not interpreting()


def inline_forward(*args: Any) -> Optional[Tensor]:
    """Under ``torch.compile`` without gradients: the op (its positional arguments) as the
    fused forward's kernels in the graph (:data:`INLINE_KERNELS`), where the op would run its
    ``triton`` implementation on these inputs with static sizes and no Gluon kernel
    (:func:`_eager_gluon`); else None (the caller puts the op in the graph, one node)."""
    if not (dynamo_tracing() and _inlines()):
        return None
    x = args[0]
    if any(isinstance(d, torch.SymInt) for t in (x, args[1]) for d in t.shape):
        return None  # dynamic sizes: the configs and grids are picked per size
    if not runs_fused(args):
        return None
    if _eager_gluon_on(args):
        return None
    M.check(*args)
    if M.checks_ids_here(args[1]):
        args = (args[0], M.checked_ids(args[1]), *args[2:])
    return F.fused_experts_forward(*args)


def _rows_per_expert(args: tuple[Any, ...]) -> float:
    """The mean rows per expert (T k / E) of the op's positional arguments ``args``."""
    return args[0].shape[0] * args[1].shape[1] / max(args[3].shape[0], 1)


def _eager_gluon_on(args: tuple[Any, ...]) -> bool:
    """:func:`_eager_gluon` for the op's positional arguments ``args`` (static sizes)."""
    x = args[0]
    return _eager_gluon(x.device.type, x.device.index, str(x.dtype).split(".")[-1], _rows_per_expert(args))


def _trains_on_gluon(args: tuple[Any, ...]) -> bool:
    """Would the op's eager training step on the positional arguments ``args`` (static sizes)
    run a Gluon kernel: GEMM1 (:func:`_eager_gluon`) or, with a weight's gradient wanted, the
    weight gradients (:func:`_eager_gluon_wgrad`)? Then a compiled step goes through the two
    custom ops (:data:`GLUON_TRAINING_OPS`)."""
    if _eager_gluon_on(args):
        return True
    x, w1, w2, gated, transposed = args[0], args[3], args[5], args[8], args[9]
    if not (w1.requires_grad or w2.requires_grad):
        return False
    n1 = w1.shape[2] if transposed else w1.shape[1]
    return _eager_gluon_wgrad(x.device.type, x.device.index, str(x.dtype).split(".")[-1], _rows_per_expert(args),
                              x.shape[1], n1, n1 // 2 if gated else n1)


@torch.compiler.assume_constant_result
def _eager_gluon_wgrad(device_type: str, index: Optional[int], dtype: str, rows_per_expert: float, h: int,
                       n1: int, i: int) -> bool:
    """Would the op's eager backward run its weight gradients on a Gluon kernel here
    (:func:`.moe_experts_backward.gluon_wgrad_default`, on ``torch._grouped_mm``'s path: bf16
    on sm90, from ``GLUON_WGRAD_MIN_ROWS`` rows per expert, H, N1 and I multiples of 128)?
    Those sizes begin below the Gluon GEMM1's (:func:`_eager_gluon`: 192 against 256 rows
    per expert), and a traced backward takes CUTLASS's weight gradients (Gluon's kernels don't
    trace), which the Gluon ones beat by 13-20 % at 256 rows (Qwen3-MoE, H100,
    ``gluon_wgrad_default``). A constant to Dynamo, as :func:`_eager_gluon`. Measured there:
    :data:`GLUON_TRAINING_OPS`."""
    if device_type != "cuda" or dtype != "bfloat16" or not hasattr(torch, "_grouped_mm"):
        return False
    if not B.is_sm90(index if index is not None else torch.cuda.current_device()):
        return False
    if B.gluon_wgrad_default(rows_per_expert, h, n1, i) == B.GLUON_OFF:
        return False
    log_once(("train gluon wgrad", index, rows_per_expert, h, n1), logging.INFO,
             "opreg: a compiled moe_experts training step at %.0f rows per expert goes through its two custom "
             "ops, not its kernels inline: its weight gradients run Gluon kernels there, which Dynamo does not "
             "trace", rows_per_expert)
    return True


@torch.compiler.assume_constant_result
def _eager_gluon(device_type: str, index: Optional[int], dtype: str, rows_per_expert: float) -> bool:
    """Would the op's no-grad forward run GEMM1 (and on the H200 GEMM2) on the Gluon kernels
    here in eager (:func:`.moe_experts.gluon_gemm1_default`: bf16 on sm90, from
    ``GLUON_GEMM1_MIN_ROWS`` rows per expert, where triton has Gluon)? Then a compiled call
    keeps the op as one node (said once per size), whose run picks them as eager does:
    Dynamo does not trace Gluon's kernels, so inline the forward runs the Triton GEMMs
    (``fused_experts_forward`` under tracing), and Inductor's block ran 1-4 % slower than
    eager opreg's (H100, T = 4096, 2026-12-06, sixty-third session: 818 / 787, 984 / 977, 985 /
    954 us, Mixtral / Qwen3-MoE / OLMoE, bench/RESULTS.md), the Gluon GEMM1 being 5-9 %
    faster (:func:`.moe_experts.gluon_gemm1_default`). The node's cost is its host work, a
    replayed call's (~60-90 us on the H100 host, :data:`.moe_experts.REPLAY`), below the
    GPU's ~700 us there. Approximate where GEMM1's layout or a bias keeps the eager op off
    Gluon: the node then runs the same Triton kernels as inline, for its host work. Measured
    with the node (H100, T = 4096, 2026-12-06, sixty-fourth session): opreg + Inductor 794 /
    795, 928 / 931, 945 / 943 us against eager opreg, level. (A compiled training step at
    these sizes goes through the two custom ops likewise: :data:`GLUON_TRAINING_OPS`.)"""
    if device_type != "cuda" or dtype != "bfloat16" or not F.gluon_gemm1_default(rows_per_expert):
        return False
    if torch.cuda.get_device_capability(index)[0] != 9 or isinstance(F.gluon_gemm1(), str):
        return False
    log_once(("inline gluon", index, rows_per_expert), logging.INFO,
             "opreg: a compiled moe_experts call at %.0f rows per expert is the op in the graph (with gradients "
             "its two custom ops, where GLUON_TRAINING_OPS), not its kernels inline: the op runs Gluon kernels "
             "there, which Dynamo does not trace", rows_per_expert)
    return True


# True: a compiled training step at the sizes where eager runs Gluon kernels
# (:func:`_trains_on_gluon`: GEMM1 from 256 rows per expert, the weight gradients from 192) goes
# through the two custom ops, one node each, whose runs pick the Gluon kernels (GEMM1, the
# weight gradients) as eager does. Inline, Dynamo's trace takes the Triton GEMM1 and CUTLASS's
# weight gradients (Gluon's kernels don't trace). The model: at these sizes the step waits on
# its GPU (eager's whole step: 1.6 ms of host against 2.4 ms of GPU, Mixtral, T = 4096, H100),
# so the custom ops' host work (their forward replayed, ~85 us) costs nothing, and the Gluon
# kernels take 5-9 % off GEMM1 and 1.5-5 % off the step's weight gradients. Measured (H100, T =
# 4096, 2026-12-06, sixty-fourth session, `STAGE=inline bash bench/device_run.sh`, each a
# process beside HF's compiled block and eager opreg; us, opreg + Inductor / eager opreg):
# inline 2616 / 2566, 2931 / 2820, 3107 / 3070 (1.2-3.9 % slower; Mixtral / Qwen3-MoE /
# OLMoE); with this 2475 / 2517, 2760 / 2807, 2930 / 2987 and again 2543 / 2561, 2779 / 2834,
# 2933 / 2982 (0.7-1.9 % faster). Where only the weight gradients run on Gluon (192-255 rows per
# expert; H100, 2026-12-06, sixty-fifth session, the same bench): inline 2426 / 2355 (Qwen3-MoE, T
# = 3072, 192 rows), 1770 / 1746 (OLMoE, T = 1792, 224 rows), 1.4-3.0 % slower; through the ops
# 2322 / 2366, 1711 / 1721, 0.6-1.9 % faster. False: the step inline at every size.
GLUON_TRAINING_OPS = True


def train(*args: Any) -> Tensor:
    """The op (its positional arguments) with the fused kernels forward and backward; the
    caller has checked :func:`fused_trains`. Arguments are checked as the op checks them.
    Traced: the custom ops, or with :data:`INLINE_KERNELS` :class:`FusedExperts` traced by
    Dynamo (its launches become graph nodes), except, with :data:`GLUON_TRAINING_OPS`, where
    eager runs Gluon kernels (:func:`_trains_on_gluon`): the custom ops there. Eager: the same
    kernels through :class:`FusedExperts`, an ``autograd.Function``: a custom op's Python
    dispatch (argument defaults, redispatch, its generated Function) cost ~0.35 ms of host
    per forward + backward on the 2-core box (0.88 vs 0.53 ms with the launches stubbed), and
    an eager MoE step at T <= 4096 waits on its host."""
    traced = torch.compiler.is_compiling()
    spec = None
    if traced:
        M.check(*args)
    else:
        spec = F.checked(args)[0]  # the same checks, once per input metadata
    if M.checks_ids_here(args[1]):  # as the op's other paths: traced, the graph checks
        args = (args[0], M.checked_ids(args[1]), *args[2:])
    if traced and _inlines() and not (GLUON_TRAINING_OPS and _trains_on_gluon(args)):
        return B.FusedExperts.apply(*args, None, None)
    if traced:
        x, w1, gated, transposed = args[0], args[3], args[8], args[9]
        keep = w1.requires_grad and torch.is_grad_enabled() and _keeps_rows(
            str(x.dtype).split(".")[-1], x.device.type, x.device.index, x.shape[1],
            w1.shape[2] if transposed else w1.shape[1], gated)
        return torch.ops.opreg.moe_experts_fused(*args, keep)[0]
    return B.FusedExperts.apply(*args, None, spec)  # checked_ids' tensor is args[1] itself in eager


@torch.compiler.assume_constant_result
def _keeps_rows(dtype: str, device_type: str, index: Optional[int], h: int, n1: int, gated: bool) -> bool:
    """:func:`.moe_experts_backward.keeps_rows` (gate_up_proj's gradient wanted) from plain
    values, a constant to Dynamo (it need not trace the device query behind it)."""
    x = torch.empty((0, h), dtype=getattr(torch, dtype), device=torch.device(device_type, index))
    return B.keeps_rows(x, n1, gated, True)
