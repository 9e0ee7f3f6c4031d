"""``moe_experts``' ``grouped`` implementation (CPU and CUDA), from torch's own ops; the op's
meaning, checks and reference are in :mod:`opreg.ops.moe_experts`.

Rows grouped by expert on the device (stable sort, offsets by ``searchsorted``: no host
sync), grouped GEMMs (``torch._grouped_mm`` for bf16 on sm90+, which is CUDA-graph
capturable, and on the CPU, where traced its non-bf16 calls are :func:`cpu_grouped_mm`;
elsewhere one GEMM per expert after one host read of the offsets), the gate, and
``scatter_combine`` for the weighted combine (deterministic, fp32 accumulation; traced by
``torch.compile``, the gather and the combine are torch's own ops instead, as deterministic:
see :func:`grouped`); sentinel rows are zero going in and zeroed coming out. As the op's
kernel it records no autograd (the op's gradients are its reference's); :func:`grouped` itself is differentiable (torch
autograd, scatter_combine's own; under ``torch.func`` transforms torch's ``index_add``
instead, and under ``torch.compile`` one GEMM per expert of unbacked size), which the
transformers integration trains through where the fused kernels don't run, and the
``triton`` implementation falls back to for inputs its kernels don't take.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .moe_experts import (NAME, accumulate_dtype, apply_gate, check, check_ids, checked_ids, checks_ids_here,
                          tracing)

__all__ = ["cpu_grouped_mm", "gather_rows", "grouped", "grouped_linear", "grouped_traces_whole", "register",
           "uses_grouped_mm"]


def _in_functorch() -> bool:
    """Inside a torch.func transform (grad, vjp, vmap, jvp), where scatter_combine's C++
    autograd refuses to run ("cannot use C++ torch::autograd::Function with functorch")."""
    return torch._C._functorch.maybe_current_level() is not None


def _all_real_experts(top_k_index: torch.Tensor, e: int) -> bool:
    """Eager on the CPU: is every id in [0, e)? A negative one raises :func:`check_ids`'s
    IndexError; one >= e is a sentinel (False)."""
    if top_k_index.numel() == 0:
        return True
    lo, hi = (int(v) for v in torch.aminmax(top_k_index))
    if lo < 0:
        check_ids(top_k_index)
    return hi < e


def _scatter_add_rows(rows: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, n: int) -> torch.Tensor:
    """``out[idx[r]] += gates[r] * rows[r]``, (n, C), in rows' dtype, accumulated in float32
    (float64): scatter_combine (deterministic), or inside torch.func transforms the same
    sum from torch's own ops (``index_add``), which every transform differentiates."""
    if not _in_functorch():
        return torch.ops.opreg.scatter_combine(rows.contiguous(), idx, gates, n)
    acc = accumulate_dtype(rows.dtype)
    out = rows.new_zeros((n, rows.shape[-1]), dtype=acc)
    return out.index_add(0, idx, rows.to(acc) * gates.to(acc).unsqueeze(-1)).to(rows.dtype)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, idx)`` whose backward is scatter_combine (deterministic, fp32
    accumulation) rather than index_select's ``index_add_`` (atomics on CUDA). Written in
    torch.func's form (``setup_context``, a generated vmap rule); :class:`_Gather` adds
    forward mode. This one is what ``torch.compile`` traces: Dynamo refuses an
    autograd.Function with a custom ``jvp``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, idx)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        x, idx = inputs
        ctx.save_for_backward(idx)
        ctx.rows = x.shape[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        (idx,) = ctx.saved_tensors
        return _scatter_add_rows(grad, idx, grad.new_ones(idx.shape[0]), ctx.rows), None


class _Gather(_GatherRows):
    """:class:`_GatherRows` with forward mode (``torch.func.jvp``, ``forward_ad``)."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
        _GatherRows.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def jvp(ctx: Any, x_t: Optional[torch.Tensor], _idx_t: Any) -> Optional[torch.Tensor]:
        (idx,) = ctx.saved_tensors
        return None if x_t is None else x_t.index_select(0, idx)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for (R, C) ``x``, deterministic in backward."""
    if torch.compiler.is_compiling():
        return _GatherRows.apply(x, idx)
    if not _in_functorch() and (not (x.requires_grad and torch.is_grad_enabled())
                                or x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)):
        # The plain gather, without the autograd.Function's apply, which binds its arguments
        # through inspect.signature (~20 us of host a call on the 2-core box): where there is
        # no backward to make deterministic (forward mode differentiates it as _Gather.jvp
        # does), or on the CPU in float32 / float64, where index_select's backward
        # (index_add) sums each row's gradients in order, in that dtype, as scatter_combine
        # does; it is atomics on CUDA, and in bf16 / fp16 would round each of the k terms.
        return x.index_select(0, idx)
    return _Gather.apply(x, idx)


# Traced by torch.compile, :func:`grouped` gathers and combines with torch's own ops (True)
# rather than through scatter_combine (False: the form before 2026-12-04, kept for A/B
# runs, ``bench/bench_moe_block.py --traced-combine``).
TRACED_TORCH_COMBINE = True

_SM90_OR_NEWER: dict[int, bool] = {}


@torch.compiler.assume_constant_result
def _sm90_or_newer(device_index: int) -> bool:
    # A constant to Dynamo, which calls it once while tracing (an lru_cache here made Dynamo
    # warn on every compiled model that reached it: it traces through such caches).
    if device_index not in _SM90_OR_NEWER:
        _SM90_OR_NEWER[device_index] = torch.cuda.get_device_capability(device_index) >= (9, 0)
    return _SM90_OR_NEWER[device_index]


# torch's CPU kernel of _grouped_mm: from torch 2.9 (none before); before 2.11 it needs
# 16-byte aligned operands (transformers' grouped_mm checks the same), which a trace can't
# see, so traced it is taken from 2.11.
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_CPU_GROUPED_MM = hasattr(torch, "_grouped_mm") and _TORCH >= (2, 9)
_CPU_GROUPED_MM_TRACED = _CPU_GROUPED_MM and _TORCH >= (2, 11)
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def _rows16(x: torch.Tensor, w: torch.Tensor) -> bool:
    """K and N multiples of 16 bytes: torch's kernels (CUTLASS's, the CPU's) take no other
    row strides."""
    v = 16 // x.element_size()
    return x.shape[-1] % v == 0 and w.shape[-1] % v == 0


def uses_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Does ``torch._grouped_mm`` run this (S, K) x (E, K, N) product (no host sync)? Its
    kernels take rows of 16-byte multiples only (K, N).

    * CUDA: bf16 on sm90+ (CUTLASS); elsewhere torch 2.11 falls back to a loop that reads
      the offsets on the host.
    * CPU (torch >= 2.9): float32, bfloat16 and float16 eager; traced (``torch.compile``)
      bf16 only, the one dtype its meta function takes (:func:`cpu_grouped_mm` runs the
      others). One call instead of a GEMM per expert, their split and cat."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or not _rows16(x, w):
        return False
    if x.is_cuda:
        return (x.dtype == torch.bfloat16
                and _sm90_or_newer(x.device.index if x.device.index is not None else torch.cuda.current_device()))
    if x.device.type != "cpu" or not _CPU_GROUPED_MM:
        return False
    if tracing(x):
        return _CPU_GROUPED_MM_TRACED and x.dtype == torch.bfloat16
    return x.dtype in _CPU_DTYPES and (_TORCH >= (2, 11) or _aligned(x, w))


def _cpu_op(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Traced on the CPU, where torch._grouped_mm's meta function refuses the dtype (float32,
    float16): the product runs as :func:`cpu_grouped_mm`, an op around torch's CPU kernel,
    one node with its own backward (transformers' grouped_mm does the same there)."""
    return (x.device.type == "cpu" and _CPU_GROUPED_MM_TRACED and tracing(x)
            and x.dtype == w.dtype and x.dtype in _CPU_DTYPES and _rows16(x, w))


def grouped_traces_whole(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                         transposed: bool) -> bool:
    """Does each of :func:`grouped`'s projections run as one grouped product (on
    ``torch._grouped_mm`` or, traced on the CPU, :func:`cpu_grouped_mm`)? Then it has no
    host read and traces with no data-dependent size; else each projection reads the group
    sizes on the host (one GEMM per expert)."""
    w1 = gate_up_proj if transposed else gate_up_proj.transpose(-2, -1)  # (E, H, N)
    w2 = down_proj if transposed else down_proj.transpose(-2, -1)        # (E, I, H)
    act = x.new_empty(0, w2.shape[-2])
    return all(uses_grouped_mm(a, w) or _cpu_op(a, w) for a, w in ((x, w1), (act, w2)))


# ----------------------------------------------------------------------------- the CPU's op

@torch.library.custom_op("opreg::cpu_grouped_mm", mutates_args=(), device_types="cpu")
def cpu_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs=offs)`` on the CPU: (S, K) rows grouped by ``offs``
    (E,) int32 run ends, times (E, K, N) -> (S, N)."""
    return torch._grouped_mm(x, w, offs=offs)


@cpu_grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def _k_major(w: torch.Tensor) -> bool:
    """Is (E, K, N) ``w`` a transposed view of an (E, N, K) tensor (its K dim the fast one)?
    Then its gradient is made in that layout: AccumulateGrad copied one of the other layout
    into the parameter's (~5 ms of a 17 ms compiled training step of a 512-wide block on
    the 2-core box). Decided when the forward is traced and passed on as a constant: the
    strides a compiled backward's saved ``w`` arrives with are Inductor's choice."""
    return w.stride(-2) == 1 and w.stride(-1) != 1


@torch.library.custom_op("opreg::cpu_grouped_mm_backward", mutates_args=(), device_types="cpu")
def _cpu_grouped_mm_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                             k_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """d x = grad (S, N) times each group's w (K, N) transposed; d w (E, K, N) = each group's
    rows of x transposed times its rows of grad (an empty group's: zeros), made as an
    (E, N, K) tensor and returned transposed where ``k_major``."""
    grad = grad.contiguous()  # torch's CPU kernel refuses an expanded (stride-0) gradient
    dx = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
    if k_major:
        return dx, torch._grouped_mm(grad.transpose(0, 1), x, offs=offs).transpose(-2, -1)
    return dx, torch._grouped_mm(x.transpose(0, 1), grad, offs=offs)


@_cpu_grouped_mm_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, k_major: bool
      ) -> tuple[torch.Tensor, torch.Tensor]:
    e, k, n = w.shape
    return x.new_empty(x.shape), (w.new_empty(e, n, k).transpose(-2, -1) if k_major else w.new_empty(e, k, n))


def _cpu_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)
    ctx.k_major = _k_major(inputs[1])


def _cpu_backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
    x, w, offs = ctx.saved_tensors
    dx, dw = _cpu_grouped_mm_backward(grad, x, w, offs, ctx.k_major)
    return dx, dw, None


cpu_grouped_mm.register_autograd(_cpu_backward, setup_context=_cpu_setup)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, b: Optional[torch.Tensor],
                   expert_of_row: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows of ``x`` (S, K) sorted by expert, group e = rows [offs[e-1], offs[e]), times
    expert e's weight (and + its bias). ``w`` is (E, N, K), or (E, K, N) if ``transposed``."""
    wk = w if transposed else w.transpose(-2, -1)  # (E, K, N), as grouped_mm takes it
    native = uses_grouped_mm(x, wk)
    if native or _cpu_op(x, wk):
        y = torch._grouped_mm(x, wk, offs=offs) if native else cpu_grouped_mm(x, wk, offs)
        return y if b is None else y + gather_rows(b, expert_of_row)
    # One GEMM per expert after one host read of the offsets. split/unbind (not slicing in
    # a loop) so that backward assembles each gradient once, not once per expert.
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    biases = b.unbind(0) if b is not None else [None] * len(sizes)
    if torch.compiler.is_compiling():
        # Traced, the sizes are unbacked symbols: tell the tracer what the sort guarantees
        # (each >= 0, together S) and make every GEMM, empty or not (no branch on a size).
        for size in sizes:
            torch._check(size >= 0)
        torch._check(sum(sizes) == x.shape[0])
        pieces = [xe @ we if be is None else torch.addmm(be, xe, we)
                  for xe, we, be in zip(x.split(sizes), wk.unbind(0), biases)]
    else:
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
    (t, k), e = top_k_index.shape, gate_up_proj.shape[0]
    # On the CPU, eager, the ids are read for free (no device to sync): one pass finds a
    # negative id (IndexError, as check_ids) and whether every slot is a real expert (then
    # the sentinel masking below is the identity and is left out: its four where()s, two
    # of them over S x H, took ~7 % of a 512-wide block's forward on the 2-core box, and
    # the masks' own ops ~8 us of a T = 1 call; bench/RESULTS.md).
    cpu_eager = top_k_index.device.type == "cpu" and not tracing(top_k_index) and not _in_functorch()
    if cpu_eager:
        all_real = _all_real_experts(top_k_index, e)
    elif checks_ids_here(top_k_index):
        top_k_index = checked_ids(top_k_index)
    # Half-precision rows are weighted in fp32, as transformers' fp32 routing weights are.
    half = hidden_states.dtype in (torch.float16, torch.bfloat16)
    gate_dtype = torch.float32 if half else hidden_states.dtype
    if e == 0:  # every slot a sentinel: zeros, attached to the graph like any output
        none = top_k_index.new_zeros(0, dtype=torch.long)
        return _scatter_add_rows(hidden_states[:0], none, hidden_states.new_zeros(0, dtype=gate_dtype), t)
    ids = top_k_index.reshape(-1).long()
    # A sentinel (or, unchecked, negative) slot: a row of expert E-1 that is zero going in
    # and zeroed coming out (torch.where: an inf or NaN of that expert's can't leak, in
    # forward or backward), with weight 0 (a NaN weight there is never read).
    masked = not (cpu_eager and all_real)
    valid = (ids >= 0) & (ids < e) if masked else None
    weights = top_k_weights.reshape(-1)
    if masked:
        ids = torch.where(valid, ids, e - 1)
        weights = torch.where(valid, weights, 0)
    expert_of_row, perm = torch.sort(ids, stable=True)
    offs = torch.searchsorted(expert_of_row, torch.arange(e, device=ids.device), right=True).int()
    token_of_row = perm // k
    real = valid[perm].unsqueeze(-1) if masked else None
    # Traced (torch.compile), the gather and the combine are torch's own ops, which Inductor
    # fuses with their neighbours; eager, the scatter_combine op does both in one kernel
    # each way. Under compile that op is a kernel and a dispatcher crossing of its own in
    # the forward and twice in the backward, and a compiled training step on this path
    # (below moe_experts_train.TRACED_MIN_FLOPS) waits on its host: at T = 64 on the H200,
    # Qwen3-MoE's step went from 0.93x to 0.975x of HF's compiled one (median of four
    # processes each; Mixtral's and OLMoE's within the processes' spread, RESULTS.md). Both
    # forms are deterministic: every token has k slots, and sorted row r is slot perm[r].
    traced = torch.compiler.is_compiling() and TRACED_TORCH_COMBINE
    if traced:
        # x's copy per slot, then sorted: backward puts each row's gradient at its own slot
        # (distinct positions) and sums a token's k slots
        h = hidden_states.shape[1]
        x = hidden_states.unsqueeze(1).expand(t, k, h).reshape(t * k, h)[perm]
    else:
        x = gather_rows(hidden_states, token_of_row)
    if real is not None:
        x = torch.where(real, x, 0)
    up = grouped_linear(x, gate_up_proj, offs, gate_up_bias, expert_of_row, transposed)
    act = apply_gate(up, activation, gated, interleaved, alpha, limit)
    down = grouped_linear(act, down_proj, offs, down_bias, expert_of_row, transposed)
    if real is not None:
        down = torch.where(real, down, 0)
    if not traced:
        return _scatter_add_rows(down, token_of_row, weights[perm].to(gate_dtype), t)
    # the rows back in slot order (a gather by the inverse permutation), weighted and summed
    # over each token's k slots in the accumulation dtype (fp32 for half), as scatter_combine
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], device=perm.device)
    acc = accumulate_dtype(down.dtype)
    slots = down[inv].to(acc) * weights.to(acc).unsqueeze(-1)
    return slots.view(t, k, -1).sum(1).to(down.dtype)


def _kernel(*args: Any) -> torch.Tensor:
    # The op's kernel: its autograd is the op's (the reference's), so record nothing here.
    # No context where grad is off already (a no-grad call): entering one cost ~7 us of a
    # T = 1 call on the 2-core box.
    if torch.is_grad_enabled():
        with torch.no_grad():
            return grouped(*args)
    return grouped(*args)


def register() -> None:
    """Add ``grouped`` to the op's implementations (``moe_experts``' own module calls this
    once it has defined the op)."""
    from .. import registry

    registry.add_impl(NAME, registry.Impl("grouped", NAME, ("cpu", "cuda"), priority=100, fn=_kernel))
