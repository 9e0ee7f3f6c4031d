"""Fused Triton backward of ``moe_experts`` (the forward: :mod:`.moe_experts`; the meaning:
:mod:`opreg.ops.moe_experts`).

The forward with ``save=True`` keeps the routing (the padded, expert-sorted pair list,
each expert's padded start, count, run end and shift), GEMM1's output ``act`` and its
pre-activation ``pre`` (at the sorted rows: the real pairs alone, by expert, unpadded;
padded row r of expert e is sorted row r + shift[e]); the backward recomputes no GEMM.
Its tiles walk the padded list as the forward's do; what it writes in sorted order (g,
d_pre, the sorted copies) is unpadded too. With dout = the output's gradient (T, H), per
row r of expert e holding pair p = t*k + j (rw = top_k_weights[t, j]):

1. **dgrad of GEMM2** (:func:`_dgrad_act_kernel`, grid = M blocks x I blocks like the
   forward's): g[r] = dout[t] @ down_proj[e] (dout rows gathered through the pair ids),
   then in the epilogue the gate's backward on ``pre``: d_pre[r] (gate_up_proj's column
   order) from dact = rw * g, and per row and I block the partial sum of g * gate(pre)
   for d top_k_weights into a (S, I blocks) fp32 buffer at the pair's row. **Split**
   (``configs["dgrad2"]["SPLIT"]``, the table's default at many rows per expert): g comes
   from the forward's GEMM (``_moe_gemm``, gathered rows, any tile width) into a (sorted
   rows, I) buffer in the saved ``pre``'s dtype (fp32; bf16 under
   ``moe_experts.PRE_BF16``), and :func:`_gate_grad_kernel` runs the same epilogue as its own
   pass (one partial per pair). **On torch._grouped_mm** (``configs["dgrad2"]["GROUPED_MM"]``;
   default :func:`grouped_mm_dgrad2_default`: bf16 g on sm90 from
   :data:`DGRAD2_GROUPED_MIN_ROWS` rows per expert): g from CUTLASS over a sorted copy of
   dout's rows (:func:`.moe_experts.sorted_rows`, unscaled), then the same pass. (The
   2026-12-03 try, fp32 ``pre`` then, took 7-22 % longer; with bf16 ``pre``
   and g, Mixtral's GEMM went 307 -> 233 us plus the copy's 15, thirty-second session.) The
   fused kernel's tile is 64 wide (its epilogue holds g, both pre halves and both gradient
   halves) and ran at ~190 TF/s on the H200; ``SUBTILE`` 2 or 4 runs its epilogue in
   column slices, so that the tile can be 128 wide, and ``PREGATHER`` reads dout's rows
   from a sorted copy, through a tensor descriptor: tuner candidates, none faster than the
   split default on the three configs (H200, T = 4096, thirty-second session:
   bench/RESULTS.md). Split, the op's forward + backward took 2400 / 2689 / 2792 us
   against 2564 / 2795 / 2980 fused (Mixtral / Qwen3-MoE / OLMoE, T = 4096, 2026-12-02),
   g's extra write and read included. **On the Gluon kernels**
   (``configs["dgrad2"]["GLUON"]`` 2 cooperative, 1 ping-pong, :func:`.moe_gemm1_gluon.dgrad2`;
   opt-in, bf16 ``pre`` on sm90, I a multiple of 256 or 128): g over dout's sorted copy with
   down_proj's tiles read as stored (N-contiguous for (E, H, I)), rounded to bf16 in shared
   memory, and the gate's backward in the same kernel's epilogue. The cooperative one is
   slower than the split default on the H100 (2026-12-06, ``bench/moe_launches.py``): 537 /
   576 / 554 us against the split's GEMM + gate pass 252 + 85 / 252 + 114 / 244 + 130
   (Qwen3-MoE / OLMoE / Mixtral, T = 4096). Its MMA loop alone beats CUTLASS's g (H200, 189
   against 225 us at Qwen3-MoE); its epilogue, which its consumers wait through, costs the
   rest (``bench/moe_gemms.py --dgrad2``). The ping-pong one runs that epilogue under the
   other consumer's MMAs, which hides 40-60 us of it: 464 / 525 / 485 us on the H100 for the
   kernel alone (2026-12-06), still slower than the split path.
2. **d top_k_weights** (:func:`_route_grad_kernel`): each valid slot's partials summed in
   block order, plus dout[t] . down_bias[e]; 0 at a slot whose id is outside [0, E).
3. **dgrad of GEMM1** (the forward's ``_moe_gemm``, ROUTED without the routing weight):
   d_pre[r] @ gate_up_proj[e] at the pair's row of a (S, H) buffer, then the forward's
   combine: d hidden_states[t] = the sum of t's valid slots in slot order, fp32.
   **bf16 on sm90** (:func:`grouped_mm_dgrad1_default`; ``configs["dgrad1"]["GROUPED_MM"]``
   forces it either way): ``torch._grouped_mm`` (CUTLASS) over d_pre's sorted rows
   instead, its (S, H) result in that order, and the combine reads each pair's row through
   the inverse of the pair list (:func:`.moe_experts.pair_rows`). The same rounding: each
   row's dot accumulates in fp32 and is rounded once to bf16, and the sum over slots is the
   combine's, in slot order. The op's forward + backward at T = 4096 (H200, 2026-12-03,
   ``bench/moe_backward_profile.py``): Mixtral 2332 against 2426 us on Triton, Qwen3-MoE
   2576 / 2677, OLMoE 2731 / 2818; faster by 9-177 us in all 12 pairs of four runs.
4. **wgrad** (:func:`_moe_wgrad`, grid = output tiles x E): out[e][m, n] = sum over e's
   rows of L[r, m] * R[r, n], each operand read directly or gathered through pair ->
   token, L optionally times rw; written through the weight's own strides, so either
   layout comes out as the weight's. d down_proj[e] = (rw * dout[t])^T act, d
   gate_up_proj[e] = d_pre^T x[t]; the bias gradients are the column sums of L, in a
   separate bias-only launch. An expert with no rows writes exact zeros.
   **bf16 on sm90** (:func:`grouped_mm_wgrad_default`; ``configs["wgrad"]["GROUPED_MM"]``
   forces it either way): the weight gradients are ``torch._grouped_mm`` (CUTLASS) in its
   2-D x 2-D form instead, groups along the reduction dim = each expert's run of sorted
   rows (``offs`` = the run ends: no padding to reduce over). The gathered operands
   (x[t], and rw * dout[t] rounded to bf16 as ``_moe_wgrad`` rounds it) are first copied
   into sorted order by :func:`.moe_experts.sorted_rows`. Rows past the last run end (the
   ``offs[-1]``-th on) are unwritten in ``act`` and ``d_pre``: this assumes ``torch._grouped_mm`` reads no row past
   ``offs[-1]`` (its groups end there), which the tests check with NaN-filled buffers (the
   CPU's bf16 path in the interpreter cases, torch 2.14; CUTLASS in the CUDA tests).
   The bias gradients stay on ``_moe_wgrad``'s bias-only launch. From
   :data:`GLUON_WGRAD_MIN_ROWS` rows per expert on (:func:`gluon_wgrad_default`;
   ``configs["wgrad"]["GLUON"]`` 0 / 1 / 2 forces CUTLASS / ping-pong / cooperative, a kernel
   whose tiles don't fit the shapes raising ValueError) the same product runs on a Gluon
   kernel of :mod:`.moe_wgrad_gluon` instead (eager only: under Dynamo, CUTLASS).

Deterministic (every sum in a fixed order, no atomics), fp32 accumulation, fp32 GEMMs in
IEEE fp32; every launch on the current stream, no host sync, static buffer sizes (CUDA-graph
capturable). Sentinel slots are never read (a NaN routing weight there reaches no
gradient); a padding row of the list has no sorted row, and no GEMM stores one. Kernels
run under
``TRITON_INTERPRET=1`` as the forward's do (``tests/test_moe_triton_backward.py``).

**The transformers integration's training path** (:mod:`.moe_experts_train`; tests and
tuning call :func:`fused_experts` / :class:`FusedExperts`). On the H200 (2026-12-02, bf16,
T = 4096, ``bench/moe_backward_profile.py``, the op alone) forward + backward takes 2400 /
2689 / 2792 us (Mixtral / Qwen3-MoE / OLMoE) against 2888 / 3605 / 3799 for the grouped
path under torch autograd; with the weight gradients on Triton's ``_moe_wgrad`` (~210
TF/s) it was 4111 / 4014 (2026-12-01).
"""
import functools
import logging
import math
from typing import Any, Callable

import torch

from opreg._log import log_once
from opreg.backends.triton import moe_experts as F
from opreg.backends.triton.launch import (LazyDescriptor, cdiv, dynamo_tracing, launch_args, next_pow2,
                                         traced_constant)
from opreg.backends.triton.moe_tiles import (ACT_IDS, IDENTITY, gate_tile_grad, gate_up_cols, jit, program_tile,
                                            routed_mma, tl)
from opreg.ops import moe_experts as M
from opreg.ops import moe_experts_grouped as G

__all__ = ["FusedExperts", "clamp_ties", "fused_experts", "fused_experts_backward", "grouped_mm_dgrad1_default",
           "grouped_mm_unfit", "grouped_mm_wgrad_default", "keeps_rows"]


# ----------------------------------------------------------------------------- kernels

@jit
def _gate_grad_tile(g, rw, srows, row_ok, cols, col_ok, pre_ptr, stride_pm, stride_pn, dpre_ptr, stride_gm,
                    stride_gn, N, alpha, limit, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
                    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, GATE_TIE: tl.constexpr,
                    UP_LO_TIE: tl.constexpr, UP_HI_TIE: tl.constexpr, WRITE_DPRE: tl.constexpr):
    """GEMM2's dgrad epilogue on one (rows x cols) tile of g = dL/d(gate output) (fp32,
    before the routing weight ``rw``, one per row): d_pre (sorted rows ``srows`` (int64),
    N or 2N, gate_up's column order) from rw * g and ``pre``, at the rows that are
    ``row_ok`` (a padding row has no sorted row). Returns each row's sum over the tile's
    columns of g * gate(pre) (d top_k_weights' partial sum)."""
    pcol0, pcol1 = gate_up_cols(cols, N, INTERLEAVED)
    mask = row_ok[:, None] & col_ok[None, :]
    pre_rows = pre_ptr + srows[:, None] * stride_pm
    p0 = tl.load(pre_rows + pcol0[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
    if GATED:
        p1 = tl.load(pre_rows + pcol1[None, :] * stride_pn, mask=mask, other=0.0).to(tl.float32)
    else:
        p1 = p0
    d0, d1, y = gate_tile_grad(p0, p1, g * rw[:, None], alpha, limit, GATED, ACT, HAS_LIMIT,
                               GATE_TIE, UP_LO_TIE, UP_HI_TIE)
    if WRITE_DPRE:
        d_rows = dpre_ptr + srows[:, None] * stride_gm
        tl.store(d_rows + pcol0[None, :] * stride_gn, d0.to(dpre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(d_rows + pcol1[None, :] * stride_gn, d1.to(dpre_ptr.dtype.element_ty), mask=mask)
    return tl.sum(tl.where(mask, g * y, 0.0), axis=1)


@jit
def _column_halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``x`` (ROWS, COLS) as its columns [0, COLS / 2) and [COLS / 2, COLS)."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@jit
def _dgrad_act_kernel(
    dout_ptr, w_ptr, pre_ptr, route_w_ptr, dpre_ptr, part_ptr, pair_ids_ptr, block_expert_ptr, shift_ptr, w_desc,
    a_desc, num_pairs, top_k, N, K, num_m_blocks, alpha, limit,
    stride_dt, stride_dh,
    stride_we, stride_wn, stride_wk,
    stride_pm, stride_pn,
    stride_rt, stride_rk,
    stride_gm, stride_gn,
    stride_qm, stride_qn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    GATE_TIE: tl.constexpr, UP_LO_TIE: tl.constexpr, UP_HI_TIE: tl.constexpr,
    WRITE_DPRE: tl.constexpr, ROUTE_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr = False, W_TMA: tl.constexpr = False, W_KMAJOR: tl.constexpr = True,
    SUBTILE: tl.constexpr = 1, GATHER: tl.constexpr = True, A_TMA: tl.constexpr = False,
):
    """One (BLOCK_M padded rows) x (BLOCK_N of the I columns) tile of GEMM2's dgrad:
    g = dout[token] @ down[e] (W = down seen as (E, I, H): N = I, K = H), then the gate's
    backward: d_pre (sorted rows: padded row r of expert e is r + shift[e], N or 2N,
    gate_up's column order) from rw * g and ``pre`` (sorted rows too); and part[pair, pid_n]
    = sum over the tile's columns of g * gate(pre) (d top_k_weights' partial sum). Padding
    rows: nothing read or written. W_TMA: W's tiles
    through the descriptor ``w_desc``, as the forward's (:func:`.moe_tiles.routed_mma`). SUBTILE (1, 2 or 4):
    the epilogue walks the tile in that many column slices, left to right (the partial sum
    adds them in that order), so that a wide tile's epilogue holds one slice's g, pre halves
    and gradient halves at a time. GATHER: dout's rows gathered through the pair ids; else
    ``dout_ptr`` is their sorted copy (``configs["dgrad2"]["PREGATHER"]``), read at the
    tile's own sorted rows, through the descriptor ``a_desc`` where A_TMA."""
    pid_m, pid_n, expert = program_tile(block_expert_ptr, num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + rows)
    row_ok = pair < num_pairs
    p = tl.where(row_ok, pair, 0)
    srow0 = pid_m * BLOCK_M + tl.load(shift_ptr + expert)
    srows = (srow0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if GATHER:
        a_row = (p // top_k).to(tl.int64)
    else:
        a_row = srows
    g, _unused = routed_mma(dout_ptr, a_row, row_ok, stride_dt, stride_dh, w_base, cols, cols, col_ok, stride_wn,
                            stride_wk, K, BLOCK_M, BLOCK_N, BLOCK_K, False, DOT_PRECISION, EVEN_K, w_desc, expert,
                            pid_n * BLOCK_N, pid_n * BLOCK_N, W_TMA, W_KMAJOR, a_desc, srow0, A_TMA)

    rw = tl.load(route_w_ptr + (p // top_k).to(tl.int64) * stride_rt + (p % top_k) * stride_rk,
                 mask=row_ok, other=0.0).to(tl.float32)
    if SUBTILE == 1:
        part = _gate_grad_tile(g, rw, srows, row_ok, cols, col_ok, pre_ptr, stride_pm, stride_pn, dpre_ptr,
                               stride_gm, stride_gn, N, alpha, limit, GATED, INTERLEAVED, ACT, HAS_LIMIT, GATE_TIE,
                               UP_LO_TIE, UP_HI_TIE, WRITE_DPRE)
    else:
        g_lo, g_hi = _column_halves(g, BLOCK_M, BLOCK_N)
        if SUBTILE == 2:
            slices = (g_lo, g_hi)
        else:  # 4: each half halved again
            slices = _column_halves(g_lo, BLOCK_M, BLOCK_N // 2) + _column_halves(g_hi, BLOCK_M, BLOCK_N // 2)
        width: tl.constexpr = BLOCK_N // SUBTILE
        part = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(SUBTILE):
            cj = pid_n * BLOCK_N + j * width + tl.arange(0, width)
            part += _gate_grad_tile(slices[j], rw, srows, row_ok, cj, cj < N, pre_ptr, stride_pm, stride_pn,
                                    dpre_ptr, stride_gm, stride_gn, N, alpha, limit, GATED, INTERLEAVED, ACT,
                                    HAS_LIMIT, GATE_TIE, UP_LO_TIE, UP_HI_TIE, WRITE_DPRE)
    if ROUTE_GRAD:
        tl.store(part_ptr + p.to(tl.int64) * stride_qm + pid_n * stride_qn, part, mask=row_ok)


@jit
def _gate_grad_kernel(
    g_ptr, pre_ptr, route_w_ptr, dpre_ptr, part_ptr, pair_ids_ptr, block_expert_ptr, shift_ptr,
    num_pairs, top_k, N, block_m, alpha, limit, group_cols,
    stride_fm, stride_fn,
    stride_pm, stride_pn,
    stride_rt, stride_rk,
    stride_gm, stride_gn,
    stride_qm, stride_qn,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
    GATE_TIE: tl.constexpr, UP_LO_TIE: tl.constexpr, UP_HI_TIE: tl.constexpr,
    WRITE_DPRE: tl.constexpr, ROUTE_GRAD: tl.constexpr,
):
    """GEMM2's dgrad, split (``configs["dgrad2"]["SPLIT"]``), second pass: for BLOCK_R padded
    rows (a slice of one M block of ``block_m`` rows) the gate's backward of
    :func:`_dgrad_act_kernel`'s epilogue on g (sorted rows x N, the GEMM's output, in the
    saved pre-activation's dtype; padded row r of expert e is sorted row r + shift[e]):
    d_pre from rw * g and ``pre`` (at sorted rows; a padding row has none), and part[pair, q]
    = the sum of g *
    gate(pre) over the columns of group q = program_id(1) (``group_cols`` of them, a multiple
    of BLOCK_N, from q * group_cols), in column order. Rows of blocks past the work list:
    nothing."""
    r0 = tl.program_id(0) * BLOCK_R
    n_lo = tl.program_id(1) * group_cols
    expert = tl.load(block_expert_ptr + r0 // block_m)
    if expert < 0:
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    pair = tl.load(pair_ids_ptr + rows)
    row_ok = pair < num_pairs
    p = tl.where(row_ok, pair, 0)
    srows = (rows + tl.load(shift_ptr + expert)).to(tl.int64)
    rw = tl.load(route_w_ptr + (p // top_k).to(tl.int64) * stride_rt + (p % top_k) * stride_rk,
                 mask=row_ok, other=0.0).to(tl.float32)
    part = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for n0 in range(n_lo, tl.minimum(N, n_lo + group_cols), BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        g = tl.load(g_ptr + srows[:, None] * stride_fm + cols[None, :] * stride_fn,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        part += _gate_grad_tile(g, rw, srows, row_ok, cols, col_ok, pre_ptr, stride_pm, stride_pn, dpre_ptr,
                                stride_gm, stride_gn, N, alpha, limit, GATED, INTERLEAVED, ACT, HAS_LIMIT,
                                GATE_TIE, UP_LO_TIE, UP_HI_TIE, WRITE_DPRE)
    if ROUTE_GRAD:
        tl.store(part_ptr + p.to(tl.int64) * stride_qm + tl.program_id(1) * stride_qn, part, mask=row_ok)


@jit
def _route_grad_kernel(
    part_ptr, dout_ptr, bias_ptr, ids_ptr, out_ptr, num_pairs, top_k, num_experts, H, num_parts,
    stride_qm, stride_qn, stride_dt, stride_dh, stride_be, stride_bh, stride_it, stride_ik,
    stride_ot, stride_ok,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """d top_k_weights for BLOCK_P pairs: the partial sums in block order, plus
    dout[t] . down_bias[e] (fp32, in H order); 0 where the slot's id is outside [0, E)
    (its partials were never written)."""
    pr = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = pr < num_pairs
    t = (pr // top_k).to(tl.int64)
    j = pr % top_k
    eid = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=ok, other=-1)
    use = ok & (eid >= 0) & (eid < num_experts)
    acc = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for q in range(num_parts):
        acc += tl.load(part_ptr + pr.to(tl.int64) * stride_qm + q * stride_qn, mask=use, other=0.0)
    if HAS_BIAS:
        e = tl.where(use, eid, 0).to(tl.int64)
        hs = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            h_ok = use[:, None] & (h0 + hs < H)[None, :]
            d = tl.load(dout_ptr + t[:, None] * stride_dt + (h0 + hs)[None, :] * stride_dh, mask=h_ok, other=0.0)
            b = tl.load(bias_ptr + e[:, None] * stride_be + (h0 + hs)[None, :] * stride_bh, mask=h_ok, other=0.0)
            acc += tl.sum(d.to(tl.float32) * b.to(tl.float32), axis=1)
    tl.store(out_ptr + t * stride_ot + j * stride_ok, tl.where(use, acc, 0.0).to(out_ptr.dtype.element_ty), mask=ok)


@jit
def _moe_wgrad(
    l_ptr, r_ptr, route_w_ptr, out_ptr, bias_out_ptr, pair_ids_ptr, pstart_ptr, count_ptr, shift_ptr,
    top_k, M, N,
    stride_lr, stride_lm, stride_rr, stride_rn, stride_rt, stride_rk,
    stride_oe, stride_om, stride_on, stride_be, stride_bm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    L_GATHER: tl.constexpr, L_SCALED: tl.constexpr, R_GATHER: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """out[e][m, n] = sum over expert e's rows r (padded rows [pstart, pstart + count), all
    real pairs, in order) of L[r, m] * R[r, n], fp32; an operand's row is its sorted row
    r + shift[e] or, GATHERed, the pair's token; L_SCALED: L times the pair's routing weight (fp32, then the
    operand's dtype for the dot). BIAS_GRAD: bias_out[e][m] = sum over r of L[r, m] (the
    scaled fp32 values), written by the programs of N tile 0. Grid: (M tiles x N tiles, E)."""
    expert = tl.program_id(1)
    if WEIGHT_GRAD:
        num_n = tl.cdiv(N, BLOCK_N)
    else:
        num_n = 1
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    start = tl.load(pstart_ptr + expert)
    count = tl.load(count_ptr + expert)
    shift = tl.load(shift_ptr + expert)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    bsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for kb in range(tl.cdiv(count, BLOCK_K)):
        k_ok = kb * BLOCK_K + ks < count
        r = start + kb * BLOCK_K + ks
        pair = tl.load(pair_ids_ptr + r, mask=k_ok, other=0)
        tok = (pair // top_k).to(tl.int64)
        if L_GATHER:
            l_row = tok
        else:
            l_row = (r + shift).to(tl.int64)
        lt = tl.load(l_ptr + l_row[None, :] * stride_lr + ms[:, None] * stride_lm,
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        if L_SCALED:
            w = tl.load(route_w_ptr + tok * stride_rt + (pair % top_k) * stride_rk, mask=k_ok, other=0.0)
            l32 = lt.to(tl.float32) * w.to(tl.float32)[None, :]
            lt = l32.to(l_ptr.dtype.element_ty)
        else:
            l32 = lt.to(tl.float32)
        if BIAS_GRAD:
            bsum += tl.sum(l32, axis=1)
        if WEIGHT_GRAD:
            if R_GATHER:
                r_row = tok
            else:
                r_row = (r + shift).to(tl.int64)
            rt = tl.load(r_ptr + r_row[:, None] * stride_rr + ns[None, :] * stride_rn,
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
            acc = tl.dot(lt, rt, acc, input_precision=DOT_PRECISION)
    e64 = expert.to(tl.int64)
    if WEIGHT_GRAD:
        o = out_ptr + e64 * stride_oe + ms[:, None] * stride_om + ns[None, :] * stride_on
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    if BIAS_GRAD:
        tl.store(bias_out_ptr + e64 * stride_be + ms * stride_bm, bsum.to(bias_out_ptr.dtype.element_ty),
                 mask=m_ok & (pid_n == 0))


# ----------------------------------------------------------------------------- launcher

@functools.cache
def clamp_ties() -> tuple[bool, bool, bool]:
    """Whether torch's clamp passes the gradient at a value exactly at its bound: for
    ``clamp(max=l)`` at l (the gate's clamp), and ``clamp(min=-l, max=l)`` at -l and at l
    (the up half's). torch changed this (1 through 2.1x's earlier releases, 0 later), so
    the kernels ask the torch they run with, to match its autograd of ``apply_gate``.
    torch.func, not torch.autograd: the first call may come from a custom op's kernel
    (``moe_experts_train``), which runs below the autograd keys."""
    dg = torch.func.grad(lambda g: g.clamp(max=1.0))(torch.ones((), dtype=torch.float64))
    du = torch.func.grad(lambda u: u.clamp(min=-1.0, max=1.0).sum())(
        torch.tensor([-1.0, 1.0], dtype=torch.float64))
    return bool(dg == 1), bool(du[0] == 1), bool(du[1] == 1)


clamp_ties = traced_constant(clamp_ties)


def _oi_strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, out, in) strides of a weight stored (E, out, in), or (E, in, out) when
    ``transposed``: where the weight gradient's [e][m = out, n = in] goes."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transposed else (w.stride(0), w.stride(1), w.stride(2))


def backward_configs(rows_per_expert: float, dtype: torch.dtype, bm: int, n1: int, h: int, i: int,
                     picked: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The backward's block configs: ``picked`` (a test's or tuning run's) over the table's,
    key by key (so ``{"wgrad": {"GROUPED_MM": 0}}`` keeps the table's blocks). The dgrads
    walk the forward's padded rows, so their BLOCK_M is the forward's."""
    def over(gemm: str, table: dict[str, int]) -> dict[str, int]:
        return {**table, **(picked.get(gemm) or {})}

    cfg = {"dgrad2": over("dgrad2", F.pick_config("dgrad2", rows_per_expert, i, h, dtype, block_m=bm)),
           "dgrad1": over("dgrad1", F.pick_config("dgrad1", rows_per_expert, h, n1, dtype, block_m=bm)),
           "wgrad": over("wgrad", F.pick_config("wgrad", rows_per_expert, n1, h, dtype)),
           "combine": over("combine", F.pick_config("combine", rows_per_expert, h, 0, dtype))}
    cfg["dgrad2"]["BLOCK_M"] = cfg["dgrad1"]["BLOCK_M"] = bm
    return cfg


# Why a GEMM can't run on torch._grouped_mm (the weight gradients, or a dgrad given its
# weight): the forward's, which GEMM1 asks too
grouped_mm_unfit = F.grouped_mm_unfit


@functools.cache
def is_sm90(device_index: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index)[0] == 9


is_sm90 = traced_constant(is_sm90)


def grouped_mm_wgrad_default(x: torch.Tensor, n1: int, i: int) -> bool:
    """Whether the weight gradients run on ``torch._grouped_mm`` (CUTLASS) by default, else
    on ``_moe_wgrad``: where it can (:func:`grouped_mm_unfit`), on CUDA sm90 (H100/H200:
    ~600 vs ~210 TF/s of the Triton kernel on the H200). Not on sm100+ yet: there it gave
    non-zero weight gradients for an empty group (pytorch/pytorch#172439, open; an expert
    with no rows is one here), and elsewhere torch's grouped_mm is a loop that reads the
    offsets on the host (see ``uses_grouped_mm``)."""
    return (x.is_cuda and grouped_mm_unfit(x, n1, i) is None
            and is_sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def grouped_mm_dgrad1_default(x: torch.Tensor, w1: torch.Tensor, n1: int, i: int) -> bool:
    """Whether GEMM1's dgrad (d_pre @ gate_up_proj[e]) runs on ``torch._grouped_mm`` by
    default, else on the forward's Triton GEMM: where the weight gradients do
    (:func:`grouped_mm_wgrad_default`, the sm90 bf16 default) and gate_up_proj's layout
    suits it (:func:`grouped_mm_unfit`). Its rows come back in sorted order, so the combine
    reads them through :func:`.moe_experts.pair_rows`."""
    return grouped_mm_wgrad_default(x, n1, i) and grouped_mm_unfit(x, n1, i, w1) is None


# The weight gradients on a Gluon kernel (.moe_wgrad_gluon) instead of CUTLASS by default from
# GLUON_WGRAD_MIN_ROWS mean rows per expert on: ping-pong up to GLUON_COOP_MIN_ROWS, cooperative
# from there on where its 256-wide tiles fit, else ping-pong up to GLUON_WGRAD_MAX_ROWS
# (gluon_wgrad_default says why)
GLUON_WGRAD_MIN_ROWS, GLUON_COOP_MIN_ROWS, GLUON_WGRAD_MAX_ROWS = 192, 640, 768
GLUON_OFF, GLUON_PINGPONG, GLUON_COOP = 0, 1, 2  # configs["wgrad"]["GLUON"]'s values


@functools.cache
def _gluon_wgrad() -> Any:
    """:mod:`.moe_wgrad_gluon`, or None where this triton has no Gluon (logged once)."""
    try:
        from opreg.backends.triton import moe_wgrad_gluon
    except Exception as exc:  # noqa: BLE001 - a triton without Gluon, or another API: CUTLASS it is
        log_once((M.NAME, "gluon wgrad"), logging.INFO, "opreg: moe_experts' weight gradients stay on CUTLASS, "
                 "Gluon does not import: %s: %s", type(exc).__name__, exc)
        return None
    return moe_wgrad_gluon


def gluon_wgrad_default(rows_per_expert: float, h: int, n1: int, i: int) -> int:
    """Which kernel runs weight gradients that run on ``torch._grouped_mm``
    (:func:`grouped_mm_wgrad_default`) by default: :data:`GLUON_OFF` (CUTLASS),
    :data:`GLUON_PINGPONG` or :data:`GLUON_COOP` (:mod:`.moe_wgrad_gluon`'s two kernels). Gluon
    where triton has it, H, N1 and I are multiples of 128 and the mean rows per expert are at
    least :data:`GLUON_WGRAD_MIN_ROWS`; cooperative from :data:`GLUON_COOP_MIN_ROWS` on where
    they are multiples of 256 too, else ping-pong up to :data:`GLUON_WGRAD_MAX_ROWS`.

    The model: CUTLASS's cooperative kernel pays ~2.8 us per 128 x 256 output tile that no MMA
    hides, plus ~0.84-0.89 us per 64-row step (H100 fits, ``bench/moe_wgrad.py --sweep``); the
    ping-pong kernel hides most of the tile's cost (0-0.8 us per 128 x 128 tile) but its steps
    run 10-25 % slower for their area (0.46-0.53 us per 128 x 128 step); the Gluon cooperative kernel (both
    consumers on one 128 x 256 tile, as CUTLASS's) pays ~1.9 us a tile and ~0.77 per step, both
    below CUTLASS's (its tiles walk one descriptor per operand: no per-expert descriptor
    updates). So ping-pong wins where the reductions are short, cooperative where they are
    long, and every kernel is bound by writing the gradients where they are shortest. Checked
    on the H100 (2026-12-05/06, bench/RESULTS.md, fifty-fifth session), two sweeps of six
    shapes (every expert the same rows): ping-pong at 5 stages ahead of cooperative at 256-512
    rows on most shapes, cooperative ahead at 768 and beyond on all but one (a tie), and still
    1.07-1.14x CUTLASS at 2048 where ping-pong fell to 0.77-1.11x; routed T = 4096, two runs:
    Qwen3-MoE's (256 rows) 1.13-1.20x ping-pong, 1.01-1.04x cooperative, OLMoE's (512)
    1.03-1.09x ping-pong, 1.03-1.13x cooperative, Mixtral's (1024) 1.05-1.08x cooperative,
    0.93-0.99x ping-pong. Hence cooperative from 640 (between 512 and 768). Below 192 rows (T =
    64 and 512) the kernels are faster but those steps wait on their host, and a Gluon launch
    costs ~30 us of host against ``torch._grouped_mm``'s ~21
    (``moe_wgrad.py --host``): OLMoE and Mixtral's steps were slower with it."""
    if rows_per_expert < GLUON_WGRAD_MIN_ROWS or h % 128 or n1 % 128 or i % 128 or _gluon_wgrad() is None:
        return GLUON_OFF
    if rows_per_expert >= GLUON_COOP_MIN_ROWS and not (h % 256 or n1 % 256 or i % 256):
        return GLUON_COOP
    return GLUON_PINGPONG if rows_per_expert <= GLUON_WGRAD_MAX_ROWS else GLUON_OFF


def _gluon_dgrad2_unfit(c2: dict[str, Any], given: dict[str, Any], x: torch.Tensor, w2: torch.Tensor, i: int,
                        gated: bool, transposed: bool, interleaved: bool, pre_dtype: torch.dtype) -> str | None:
    """Why GEMM2's dgrad can't run on the Gluon kernel ``configs["dgrad2"]["GLUON"]`` asks for
    (:func:`.moe_gemm1_gluon.dgrad2` with the gate's backward in its epilogue: 2 the cooperative
    kernel, 1 the ping-pong one) here, or None. ``given``: the caller's own dgrad2 config (a
    flag of another kernel there would do nothing)."""
    if c2["GLUON"] not in (1, 2):
        return f"GLUON must be 0 (off), 1 (ping-pong) or 2 (cooperative), got {c2['GLUON']!r}"
    # its A is always dout's sorted copy, its tile and ring its own
    other = [key for key in ("SPLIT", "GROUPED_MM", "PERSISTENT", "HALF_TAIL") if given.get(key, 0)]
    other += [key for key, off in (("SUBTILE", 1), ("PREGATHER", 1)) if given.get(key, off) != off]
    if other:
        return f"{', '.join(other)} are the Triton and CUTLASS kernels' modes: give GLUON alone"
    module = F.gluon_gemm1()
    if isinstance(module, str):
        return module
    return module.unfit_dgrad2(x, F.nk_view(w2, not transposed), i, gated=gated, interleaved=interleaved,
                               pre_dtype=pre_dtype, block_m=c2["BLOCK_M"], pingpong=c2["GLUON"] == 1)


# GEMM2's split dgrad on torch._grouped_mm by default from this many rows per expert on
# (grouped_mm_dgrad2_default says why)
DGRAD2_GROUPED_MIN_ROWS = 1024


def grouped_mm_dgrad2_default(x: torch.Tensor, w2: torch.Tensor, n1: int, i: int, rows_per_expert: float,
                              pre_dtype: torch.dtype) -> bool:
    """Whether GEMM2's split dgrad (g = dout[t] @ down_proj[e]) runs on ``torch._grouped_mm``
    by default, over a sorted copy of dout's rows, else on the forward's Triton GEMM
    gathering them on its load: where the weight gradients do (the sm90 bf16 default), g
    is bf16 (the saved ``pre``'s dtype, :func:`.moe_experts.pre_dtype`), down_proj's layout
    suits it, and there are at least :data:`DGRAD2_GROUPED_MIN_ROWS` rows per expert. The
    copy costs a fixed 2 x S x H x 2 bytes; what CUTLASS saves grows with the rows per
    expert (its tiles fill, where the Triton GEMM's gathered loads run at ~440 TF/s at every
    size): on the H200 at T = 4096 (``bench/moe_launches.py``, thirty-second session),
    CUTLASS 219 us + 15 for the copy against 307 (Mixtral, 1024 rows per expert), 228 + 48
    against 238 (Qwen3-MoE, 256), 249 + 45 against 257 (OLMoE, 512); in the step, Qwen3-MoE
    and OLMoE ran 56 / 82 us slower with it. Mixtral's compiled training step (GPU events,
    ``bench/moe_profile.py --dgrad2-min-rows``): T = 16384, GPU-bound, 9048 -> 8870 us
    (kernels 8568 -> 8385); T = 4096, where that machine's step waited on its host, 2348 /
    2342 us without against 2351 / 2659 with (the host's time moved by as much). Three
    shapes: the bound sits between the last two and Mixtral's; ``opreg tune moe_experts
    --backward`` times both per shape (``configs["dgrad2"]["GROUPED_MM"]``)."""
    return (rows_per_expert >= DGRAD2_GROUPED_MIN_ROWS and pre_dtype == torch.bfloat16
            and grouped_mm_wgrad_default(x, n1, i) and grouped_mm_unfit(x, n1, i, w2) is None)


def keeps_rows(x: torch.Tensor, n1: int, gated: bool, needs_w1: bool,
               configs: dict[str, dict[str, int]] | None = None) -> bool:
    """Should a training forward keep GEMM1's sorted copy of the token rows
    (``fused_experts_forward(keep_rows=True)``)? Where the backward will make that copy
    anyway: gate_up_proj's gradient is wanted and runs on ``torch._grouped_mm`` (the
    default, :func:`grouped_mm_wgrad_default`, or ``configs["wgrad"]["GROUPED_MM"]``), which
    reads the rows in sorted order. Then the copy is made once, in the forward, where GEMM1
    reads it through TMA; the cost is holding it (R x H) until the backward, as transformers'
    grouped_mm path holds its gathered rows. Elsewhere (a frozen gate_up_proj, the Triton
    weight gradients, which gather on their loads) the forward's table decides alone.
    ``n1``: gate_up_proj's output width (2I gated, else I)."""
    if not needs_w1:
        return False
    i = n1 // 2 if gated else n1
    forced = ((configs or {}).get("wgrad") or {}).get("GROUPED_MM")
    if forced is not None:
        return bool(forced) and grouped_mm_unfit(x, n1, i) is None
    return grouped_mm_wgrad_default(x, n1, i)


def _w_tiles(w_nk: torch.Tensor, cfg: dict[str, int]) -> tuple[bool, list[int] | None, Any]:
    """(W k-major, the box of a tensor descriptor of W's tiles or None, what the descriptor's
    encoding reads besides the address) for a (E, N, K) weight view, as the forward's GEMMs
    load theirs (``cfg["TMA"]``, default 1, where :func:`F.tma_ok` allows). GEMM2's dgrad
    reads down_proj transposed (N = I, K = H): with the pointer loads it ran at ~230 TF/s on
    the H200, where the forward's GEMMs went 11-14 % faster with TMA."""
    kmajor = w_nk.stride(2) == 1
    tiles = w_nk if kmajor else w_nk.transpose(1, 2)
    box = [1, cfg["BLOCK_N"], cfg["BLOCK_K"]] if kmajor else [1, cfg["BLOCK_K"], cfg["BLOCK_N"]]
    if not cfg.get("TMA", 1) or not F.tma_ok(tiles, tuple(box)):
        return kmajor, None, None
    return kmajor, box, (tiles.dtype, tuple(tiles.shape), tiles.stride(), tuple(box))


_STATIC: dict[Any, Any] = {}  # (spec, launch site) -> what the launch derives from metadata alone


def _static(site: Any, make: Callable[[], Any]) -> Any:
    """``make()``: a launch's grid, int arguments and options, all derived from its inputs'
    metadata, once per spec and launch site (``site`` None: worked out on every call). The
    backward's Python took ~190 us a call on the 2-core box with its launches stubbed,
    54 ``stride()`` calls among it."""
    if site is None:
        return make()
    got = _STATIC.get(site)
    if got is None:
        got = make()
        F.remember(_STATIC, site, got)
    return got


# spec -> (configs, grouped wgrad, grouped dgrad1, Gluon wgrad)
_PLANS: dict[Any, tuple[dict[str, dict[str, int]], bool, bool, bool]] = {}


def fused_experts_backward(grad_out: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                           gate_up_bias: torch.Tensor | None, down_proj: torch.Tensor,
                           down_bias: torch.Tensor | None, activation: str, gated: bool, transposed: bool,
                           interleaved: bool, alpha: float, limit: float, saved: F.Saved | None, *,
                           needs: tuple[bool, ...] | None = None,
                           configs: dict[str, dict[str, int]] | None = None, fwd_spec: Any = None
                           ) -> tuple[torch.Tensor | None, ...]:
    """The gradients of the op's output for (hidden_states, top_k_weights, gate_up_proj,
    gate_up_bias, down_proj, down_bias), given ``grad_out`` (T, H) and the forward's
    ``saved`` (:func:`fused_experts_forward` with ``save=True``; None: no slot, all zeros).
    ``needs``: which of the six to compute (default: all present); the others are None,
    and the kernels only they need do not run. Each gradient in its input's dtype (a fresh
    tensor of the input's shape). ``configs``: block configs over the table's
    ({"dgrad2", "dgrad1", "wgrad", "combine"}); ``configs["wgrad"]["GROUPED_MM"]`` 1 / 0
    forces the weight gradients onto ``torch._grouped_mm`` or off it (default:
    :func:`grouped_mm_wgrad_default`; 1 where :func:`grouped_mm_unfit` says why not raises
    ValueError), ``configs["wgrad"]["GLUON"]`` 0 / 1 / 2 those on CUTLASS or the Gluon ping-pong
    or cooperative kernel (default: :func:`gluon_wgrad_default`), ``configs["dgrad1"]["GROUPED_MM"]``
    GEMM1's dgrad (default: :func:`grouped_mm_dgrad1_default`), ``configs["dgrad2"]["GLUON"]`` 2 / 1
    GEMM2's dgrad and the gate's backward on the cooperative / ping-pong Gluon kernel (off by
    default; where it can't run, a ValueError says why). ``fwd_spec``: :func:`F.spec_of` the op's
    arguments, if the caller has it."""
    x, ids, rw, w1, b1, w2, b2 = hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, \
        down_proj, down_bias
    inputs = (x, rw, w1, b1, w2, b2)
    want = [t is not None and (needs is None or bool(needs[j])) for j, t in enumerate(inputs)]
    need_x, need_rw, need_w1, need_b1, need_w2, need_b2 = want
    if saved is None:  # no slot (T*k = 0) or H = 0: every gradient is an empty sum
        return tuple(t.new_zeros(t.shape) if w else None for t, w in zip(inputs, want))

    t, h, k, e, n1, i, s = F.sizes(x, ids, w1, gated, transposed)
    dev = x.device
    bm = saved.configs["gemm1"]["BLOCK_M"]
    nb = saved.block_expert.shape[0]
    dout = grad_out if grad_out.dtype == x.dtype else grad_out.to(x.dtype)
    # Rows with unit column stride, as the GEMMs' gathered loads vectorise them: a loss such
    # as out.sum() hands back an expanded gradient (strides (0, 0)), which the Triton GEMM
    # then read one element per load. One (T, H) copy instead.
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    # Every launch's metadata follows from the inputs', the upstream gradient's, what is
    # asked and the saved pre-activation's dtype (F.pre_dtype; the saved tensors are
    # otherwise the forward's, of the same inputs): one launcher key for
    # each launch (see F.launch_gemm), and the configs picked once per key, unless a test or
    # tuning run passes configs. (The backward's host work was 162 us a call on the 2-core
    # box with every launch stubbed, ~40 of them picking configs; an eager MoE training step
    # at T <= 4096 waits on its host on the H200.)
    traced = dynamo_tracing()  # no memo: see .launch.traced_launch
    spec = None if configs or traced else (fwd_spec or F.spec_of(x, ids, rw, w1, b1, w2, b2, activation, gated,
                                                                  transposed, interleaved, alpha, limit),
                                           F.spec_of(dout), tuple(want), saved.pre.dtype)
    plan = _PLANS.get(spec) if spec is not None else None
    if plan is None:
        cfg = backward_configs(s / e, x.dtype, bm, n1, h, i, configs or {})
        grouped = bool(cfg["wgrad"].get("GROUPED_MM", grouped_mm_wgrad_default(x, n1, i)))
        if grouped and (why := grouped_mm_unfit(x, n1, i)) is not None:
            raise ValueError(f"fused_experts_backward: configs['wgrad']['GROUPED_MM'] = 1, but {why}")
        gluon = cfg["wgrad"].get("GLUON")
        if gluon is None:  # traced: CUTLASS (Gluon's kernels don't trace; nor does the default's cache)
            gluon = gluon_wgrad_default(s / e, h, n1, i) if grouped and not traced else GLUON_OFF
        elif gluon not in (GLUON_OFF, GLUON_PINGPONG, GLUON_COOP):
            raise ValueError(f"fused_experts_backward: configs['wgrad']['GLUON'] must be 0 (CUTLASS), 1 (ping-pong) "
                             f"or 2 (cooperative), got {gluon!r}")
        elif gluon and not grouped:
            raise ValueError(f"fused_experts_backward: configs['wgrad']['GLUON'] = {gluon} needs the weight gradients "
                             "on torch._grouped_mm's path (GROUPED_MM: bf16 on sm90), which these do not take")
        elif gluon and (h % (128 * gluon) or n1 % (128 * gluon) or i % (128 * gluon) or _gluon_wgrad() is None):
            raise ValueError(f"fused_experts_backward: configs['wgrad']['GLUON'] = {gluon}, but H = {h}, N1 = {n1}, "
                             f"I = {i} are not all multiples of {128 * gluon}, or this triton has no Gluon")
        grouped1 = bool(cfg["dgrad1"].get("GROUPED_MM", grouped_mm_dgrad1_default(x, w1, n1, i)))
        if grouped1 and (why := grouped_mm_unfit(x, n1, i, w1)) is not None:
            raise ValueError(f"fused_experts_backward: configs['dgrad1']['GROUPED_MM'] = 1, but {why}")
        # PERSISTENT is the forward's GEMM's (F.launch_gemm): the fused dgrad2 kernel and
        # CUTLASS have no such mode, and a flag that does nothing is an error
        if cfg["dgrad2"].get("PERSISTENT", 0) and not cfg["dgrad2"].get("SPLIT", 0):
            raise ValueError("fused_experts_backward: configs['dgrad2']['PERSISTENT'] = 1 needs SPLIT = 1 "
                             "(the fused dgrad kernel is not persistent)")
        sub = cfg["dgrad2"].get("SUBTILE", 1)
        if sub != 1 and (cfg["dgrad2"].get("SPLIT", 0) or sub not in (2, 4)
                         or cfg["dgrad2"]["BLOCK_N"] // sub < 8):
            raise ValueError(f"fused_experts_backward: configs['dgrad2']['SUBTILE'] = {sub}: the fused dgrad "
                             "kernel's epilogue slices (SPLIT 0), 2 or 4 of them, each at least 8 columns wide")
        groups = cfg["dgrad2"].get("GATE_GROUPS", 1)
        if groups != 1 and (not cfg["dgrad2"].get("SPLIT", 0) or not isinstance(groups, int) or groups < 1):
            raise ValueError(f"fused_experts_backward: configs['dgrad2']['GATE_GROUPS'] = {groups!r}: the split "
                             "gate pass's column groups (SPLIT 1), a positive int")
        split2, persistent2 = bool(cfg["dgrad2"].get("SPLIT", 0)), bool(cfg["dgrad2"].get("PERSISTENT", 0))
        gluon2 = cfg["dgrad2"].get("GLUON", 0)
        if gluon2:  # asked for: runs, or says why not
            if (why := _gluon_dgrad2_unfit(cfg["dgrad2"], (configs or {}).get("dgrad2") or {}, x, w2, i, gated,
                                           transposed, interleaved, saved.pre.dtype)) is not None:
                raise ValueError(f"fused_experts_backward: configs['dgrad2']['GLUON'] = {gluon2!r}, but {why}")
            split2 = persistent2 = False  # the table's split and persistent modes are the Triton kernels'
        grouped2 = bool(cfg["dgrad2"].get("GROUPED_MM", split2 and not persistent2 and grouped_mm_dgrad2_default(
            x, w2, n1, i, s / e, saved.pre.dtype)))
        if grouped2 and (not split2 or persistent2):
            raise ValueError("fused_experts_backward: configs['dgrad2']['GROUPED_MM'] = 1 needs SPLIT = 1 (the "
                             "gate's backward then runs as its own pass) and PERSISTENT = 0 (CUTLASS has no such mode "
                             "here)")
        if grouped2 and (why := grouped_mm_unfit(x, n1, i, w2)) is not None:
            raise ValueError(f"fused_experts_backward: configs['dgrad2']['GROUPED_MM'] = 1, but {why}")
        if grouped2 and saved.pre.dtype != torch.bfloat16:
            raise ValueError(f"fused_experts_backward: configs['dgrad2']['GROUPED_MM'] = 1, but pre is saved in "
                             f"{saved.pre.dtype}: torch._grouped_mm's g is bf16, and the gate's pass reads g "
                             "in pre's dtype")
        cfg = {**cfg, "dgrad2": {**cfg["dgrad2"], "GROUPED_MM": int(grouped2)}}
        if cfg["dgrad1"].get("PERSISTENT", 0) and grouped1:
            raise ValueError("fused_experts_backward: configs['dgrad1']['PERSISTENT'] = 1 needs GROUPED_MM = 0 "
                             "(torch._grouped_mm has no persistent mode here)")
        # HALF_TAIL too is the forward's GEMM's (F.launch_gemm): where another kernel runs,
        # a flag that would do nothing is an error
        if cfg["dgrad2"].get("HALF_TAIL", 0) and (not split2 or grouped2):
            raise ValueError("fused_experts_backward: configs['dgrad2']['HALF_TAIL'] = 1 needs SPLIT = 1 and "
                             "GROUPED_MM = 0 (the fused dgrad kernel and CUTLASS have no such mode)")
        if cfg["dgrad1"].get("HALF_TAIL", 0) and grouped1:
            raise ValueError("fused_experts_backward: configs['dgrad1']['HALF_TAIL'] = 1 needs GROUPED_MM = 0 "
                             "(torch._grouped_mm has no such mode)")
        for gemm in ("dgrad2", "dgrad1"):
            if (why := F.half_tail_unfit(cfg[gemm])) is not None:
                raise ValueError(f"fused_experts_backward: configs[{gemm!r}]: {why}")
        if cfg["wgrad"].get("HALF_TAIL", 0):
            raise ValueError("fused_experts_backward: configs['wgrad'] has no HALF_TAIL mode (its reduction runs "
                             "over the rows: no tile of rows to halve)")
        plan = (cfg, grouped, grouped1, gluon)
        if spec is not None:
            F.remember(_PLANS, spec, plan)
    cfg, grouped, grouped1, gluon = plan
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    sorted_pair_ids, block_expert = saved.sorted_pair_ids, saved.block_expert
    tables = saved.tables
    used = tables[3, -1:]  # the last expert's padded end (the persistent GEMMs' bound), one view for all
    out: list[torch.Tensor | None] = [None] * 6

    def key(name: Any) -> Any:
        return None if spec is None else (spec, name)

    need_dpre = need_x or need_w1 or need_b1
    finite = gated and math.isfinite(limit)
    fl = (float(alpha), float(limit) if finite else 0.0)

    def gate_options() -> dict[str, Any]:  # the gate's constexprs (a launch's static part)
        ties = clamp_ties()
        return dict(GATED=gated, INTERLEAVED=gated and interleaved, ACT=ACT_IDS[activation], HAS_LIMIT=finite,
                    GATE_TIE=ties[0], UP_LO_TIE=ties[1], UP_HI_TIE=ties[2], WRITE_DPRE=need_dpre,
                    ROUTE_GRAD=need_rw)

    with F.device_ctx(x):
        if (need_dpre or need_rw) and cfg["dgrad2"].get("GLUON", 0):
            # GEMM2's dgrad and the gate's backward in one Gluon kernel over dout's sorted rows
            # (_gluon_dgrad2_unfit has checked it can): one partial sum a column tile (256 wide
            # on the cooperative kernel, 128 on the ping-pong one)
            d_pre = F.new_buffer((s, n1), x.dtype, dev) if need_dpre else None
            G1, pp2 = F.gluon_gemm1(), cfg["dgrad2"]["GLUON"] == 1
            nnb = i // (G1.DGRAD2_PP_BLOCK_N if pp2 else G1.DGRAD2_BLOCK_N)
            part = F.new_buffer((s, nnb), torch.float32, dev) if need_rw else None
            a2 = F.sorted_rows(dout, rw, sorted_pair_ids, block_expert, tables, k, False, key("dout rows"))
            ties = clamp_ties()
            G1.dgrad2(a2, F.nk_view(w2, not transposed), saved.pre, rw, d_pre, part, sorted_pair_ids, block_expert,
                      tables[4], used, s, k, ACT_IDS[activation], alpha, limit, ties, pingpong=pp2,
                      spec=key("dgrad2"))
        elif need_dpre or need_rw:
            c = cfg["dgrad2"]
            split = bool(c.get("SPLIT", 0))
            # the split gate pass's columns in GATE_GROUPS groups, a program each per row
            # slice (more programs in flight; one partial sum per group): a tuning key
            gate_n = min(c.get("GATE_N", 256), next_pow2(i))
            group_cols = max(gate_n, cdiv(cdiv(i, c.get("GATE_GROUPS", 1)), gate_n) * gate_n)
            nnb = max(1, cdiv(i, group_cols)) if split else cdiv(i, c["BLOCK_N"])
            d_pre = F.new_buffer((s, n1), x.dtype, dev) if need_dpre else saved.act  # sorted rows
            part = F.new_buffer((s, nnb), torch.float32, dev) if need_rw else saved.act
            w_nk = F.nk_view(w2, not transposed)  # down seen as (E, I, H)
            pre = saved.pre
            # PREGATHER: dout's rows copied into sorted order first (as GEMM1's
            # PREGATHER copies x's), so that the GEMM reads them as plain rows, through a
            # tensor descriptor where it can, instead of gathering them on its load
            grouped2 = bool(c.get("GROUPED_MM", 0))
            pregather = bool(c.get("PREGATHER", 0)) or grouped2
            a2 = (F.sorted_rows(dout, rw, sorted_pair_ids, block_expert, tables, k, False, key("dout rows"))
                  if pregather else dout)
            if split:
                # g = dout[t] @ down[e] on the forward's GEMM (a plain tile, any width) at the
                # sorted rows, in the saved pre-activation's dtype (fp32; bf16 under
                # F.PRE_BF16, g's rounding then HF's bf16 autograd's and its write and the
                # gate pass's read half); then the gate's backward as its own pass (see the
                # table's about)
                if grouped2:  # CUTLASS over the sorted copy (past offs[-1] unwritten and unread)
                    g = torch._grouped_mm(a2, w_nk.transpose(1, 2), offs=tables[0])
                else:
                    g = F.new_buffer((s, i), pre.dtype, dev)
                    F.launch_gemm(c, a=a2, w_nk=w_nk, bias=None, rw=rw, out=g, pre=None,
                                  sorted_pair_ids=sorted_pair_ids, block_expert=block_expert, shift=tables[4],
                                  top_k=k, n=i, k=h,
                                  gather=not pregather, routed=False, act=IDENTITY, spec=key("dgrad2"),
                                  used=used)
                # the gate's pass: BLOCK_R rows (a power of 2 dividing BLOCK_M) x BLOCK_N
                # columns a step, over the columns of one of GATE_GROUPS groups (grid: row
                # slices x groups); the config's GATE_R / GATE_N / GATE_WARPS / GATE_GROUPS
                # for tuning. Default 8 x 256, 4 warps, one group: the fastest of 7 tiles on all
                # three configs (H200, T = 4096, kernel time 178 -> 137 us Mixtral, 114 -> 104
                # Qwen3-MoE, 144 -> 134 OLMoE against 32 x 64; ~94 % of a copy's rate on
                # Mixtral with fp32 pre and g, 2026-12-03; with both bf16, 115 us, 3.2 TB/s:
                # 1136 programs of 16 sequential steps each, whence the groups to try)
                br = min(bm, c.get("GATE_R", 8))
                site = key("gate grad")
                grid, tail, opts = _static(site, lambda: (
                    (nb * bm // br, nnb),
                    (s, k, i, bm, *fl, group_cols, g.stride(0), g.stride(1), pre.stride(0), pre.stride(1),
                     rw.stride(0), rw.stride(1), d_pre.stride(0), d_pre.stride(1), part.stride(0), part.stride(-1)),
                    dict(BLOCK_R=br, BLOCK_N=gate_n, num_warps=c.get("GATE_WARPS", 4), **gate_options())))
                launch_args(_gate_grad_kernel, grid,
                            (g, pre, rw, d_pre, part, sorted_pair_ids, block_expert, tables[4]) + tail, site, opts)
            else:
                site = key("dgrad2")

                def dgrad_static() -> tuple[Any, ...]:
                    sw = w_nk.stride()
                    kmajor, box, dkey = _w_tiles(w_nk, c)
                    a_box = [bm, c["BLOCK_K"]]
                    use_a = (pregather and c.get("TMA", 1) and F.tma_ok(a2, tuple(a_box))
                             and a2.shape[0] >= bm)
                    a_key = (a2.dtype, tuple(a2.shape), a2.stride(), tuple(a_box)) if use_a else None
                    return ((nb * nnb,),
                            (s, k, i, h, nb, *fl, a2.stride(0), a2.stride(1), sw[0], sw[1], sw[2],
                             pre.stride(0), pre.stride(1), rw.stride(0), rw.stride(1), d_pre.stride(0),
                             d_pre.stride(1), part.stride(0), part.stride(-1)),
                            dict(BLOCK_M=bm, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"],
                                 DOT_PRECISION=precision, EVEN_K=h % c["BLOCK_K"] == 0, W_TMA=box is not None,
                                 W_KMAJOR=kmajor, SUBTILE=c.get("SUBTILE", 1), GATHER=not pregather,
                                 A_TMA=bool(use_a), num_warps=c["num_warps"], num_stages=c["num_stages"],
                                 **gate_options()),
                            (kmajor, box, dkey, a_box if use_a else None, a_key))

                grid, tail, opts, (kmajor, box, dkey, a_box, a_key) = _static(site, dgrad_static)
                # built only where the launch needs the descriptor object (see .launch)
                w_desc = None if box is None else LazyDescriptor(w_nk if kmajor else w_nk.transpose(1, 2), box, dkey)
                a_desc = None if a_box is None else LazyDescriptor(a2, a_box, a_key)
                launch_args(_dgrad_act_kernel, grid,
                            (a2, w2, pre, rw, d_pre, part, sorted_pair_ids, block_expert, tables[4], w_desc,
                             a_desc) + tail,
                            site, opts)
        if need_rw:
            drw = F.new_buffer(tuple(rw.shape), rw.dtype, dev)
            bp, bh = 32, min(128, next_pow2(h))
            bias = b2 if b2 is not None else w2  # a valid pointer, never read
            site = key("route grad")
            grid, tail, opts = _static(site, lambda: (
                (cdiv(s, bp),),
                (s, k, e, h, nnb, part.stride(0), part.stride(-1), dout.stride(0), dout.stride(1), bias.stride(0),
                 bias.stride(-1), ids.stride(0), ids.stride(1), drw.stride(0), drw.stride(1)),
                dict(BLOCK_P=bp, BLOCK_H=bh, HAS_BIAS=b2 is not None, num_warps=4)))
            launch_args(_route_grad_kernel, grid, (part, dout, bias, ids, drw) + tail, site, opts)
            out[1] = drw
        if need_x:
            dx = F.new_buffer((t, h), x.dtype, dev)
            if grouped1:
                # CUTLASS over the sorted rows of d_pre (unwritten past offs[-1], which it
                # does not read), its result in that order: the combine finds each pair's
                # row through pair_rows
                rows = torch._grouped_mm(d_pre, w1.transpose(1, 2) if transposed else w1, offs=tables[0])
                where = F.pair_rows(sorted_pair_ids, block_expert, tables, s, key("pair rows"))
                F.combine(rows, ids, dx, e, cfg["combine"], spec=key(("combine", "rows")), rows=where)
            else:
                pairs = F.new_buffer((s, h), x.dtype, dev)
                F.launch_gemm(cfg["dgrad1"], a=d_pre, w_nk=F.nk_view(w1, not transposed), bias=None,
                              rw=rw, out=pairs, pre=None, sorted_pair_ids=sorted_pair_ids,
                              block_expert=block_expert, shift=tables[4], top_k=k, n=h, k=n1, gather=False, routed=True,
                              scaled=False, act=IDENTITY, spec=key("dgrad1"), used=used)
                F.combine(pairs, ids, dx, e, cfg["combine"], spec=key("combine"))
            out[0] = dx

        # torch._grouped_mm's groups along the reduction dim: each expert's run end (the
        # runs lie end to end from row 0, unpadded; the routing's first table). An expert
        # with no rows is an empty group: zeros from the CPU's grouped_mm (the interpreter
        # cases) and from CUTLASS on sm90 (pytorch/pytorch#172439 saw zeros on the H800; the
        # CUDA cases check it).
        offs = tables[0] if grouped and (need_w1 or need_w2) else None

        def wgrad(lhs: torch.Tensor, rhs: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, m: int, n: int,
                  l_gather: bool, l_scaled: bool, r_gather: bool, do_w: bool, do_b: bool) -> tuple[Any, Any]:
            c = cfg["wgrad"]
            dw = None
            if do_w and grouped:  # CUTLASS over the sorted rows (the module docstring)
                lrows = (F.sorted_rows(lhs, rw, sorted_pair_ids, block_expert, tables, k, l_scaled,
                                       key(("rows", l_scaled)))
                         if l_gather else lhs)
                # x's rows in sorted order: the forward's copy where it kept one (keeps_rows)
                rrows = ((saved.rows if saved.rows is not None
                          else F.sorted_rows(rhs, rw, sorted_pair_ids, block_expert, tables, k, False,
                                             key(("rows", False))))
                         if r_gather else rhs)
                # out[e] = L_e^T R_e is (E, out, in); the (E, in, out) weight takes R_e^T L_e
                a_rows, b_rows = (rrows, lrows) if transposed else (lrows, rrows)
                # Gluon's kernels don't trace: under Dynamo, CUTLASS
                coop = gluon == GLUON_COOP
                why = ("traced by Dynamo" if traced else _gluon_wgrad().unfit(a_rows, b_rows, coop) if gluon
                       else None)
                if gluon and why is None:
                    dw = _gluon_wgrad().wgrad(a_rows, b_rows, offs, out=F.new_buffer(
                        (e, a_rows.shape[1], b_rows.shape[1]), x.dtype, dev),
                        stages=None if coop else _gluon_wgrad().stages_for(s / e), cooperative=coop)
                else:
                    if gluon and not traced and "GLUON" in c:
                        raise ValueError(f"fused_experts_backward: configs['wgrad']['GLUON'] = {gluon}, but {why}")
                    dw = torch._grouped_mm(a_rows.t(), b_rows, offs=offs)
            elif do_w:
                dw = F.new_buffer(tuple(w.shape), w.dtype, dev)
            db = F.new_buffer(tuple(b.shape), b.dtype, dev) if do_b and b is not None else None
            # The weight and the bias gradient in separate launches: both in one (the
            # bias's row sums beside the dot) computed wrong, run-to-run different dW at
            # 128 x 256 x 64 tiles, 8 warps, 3 stages on the H200 with triton 3.6
            # (bench/RESULTS.md, seventh session); apart, every config is exact. The bias
            # pass reads L once more: (rows x M) elements, small next to the GEMM.
            for weight in (True, False):
                if (dw if weight else db) is None or (weight and grouped):
                    continue
                do = dw if weight else lhs  # valid pointers, never written
                dob = lhs if weight else db
                site = key(("wgrad", weight, l_gather))

                def wgrad_static() -> tuple[Any, ...]:
                    so = _oi_strides(dw, transposed) if dw is not None else (0, 0, 0)
                    nn = cdiv(n, c["BLOCK_N"]) if weight else 1
                    return ((cdiv(m, c["BLOCK_M"]) * nn, e),
                            (k, m, n, lhs.stride(0), lhs.stride(1), rhs.stride(0), rhs.stride(1), rw.stride(0),
                             rw.stride(1), so[0], so[1], so[2], dob.stride(0), dob.stride(-1)),
                            dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], L_GATHER=l_gather,
                                 L_SCALED=l_scaled, R_GATHER=r_gather, WEIGHT_GRAD=weight, BIAS_GRAD=not weight,
                                 DOT_PRECISION=precision, num_warps=c["num_warps"], num_stages=c["num_stages"]))

                grid, tail, opts = _static(site, wgrad_static)
                launch_args(_moe_wgrad, grid,
                            (lhs, rhs, rw, do, dob, sorted_pair_ids, tables[1], tables[2], tables[4]) + tail, site,
                            opts)
            return dw, db

        if need_w2 or need_b2:  # d down_proj[e] = (rw * dout[t])^T act, d down_bias[e] = sum rw * dout[t]
            out[4], out[5] = wgrad(dout, saved.act, w2, b2, h, i, True, True, False, need_w2, need_b2)
        if need_w1 or need_b1:  # d gate_up_proj[e] = d_pre^T x[t], d gate_up_bias[e] = sum d_pre
            out[2], out[3] = wgrad(d_pre, x, w1, b1, n1, h, False, False, True, need_w1, need_b1)
    return tuple(out)


class FusedExperts(torch.autograd.Function):
    """The op with the fused kernels forward and backward (:func:`fused_experts` checks the
    inputs and falls back; this takes inputs :func:`why_not_fused` accepts). ``configs``:
    block configs for both ({"gemm1", "gemm2", "combine", "dgrad2", "dgrad1", "wgrad"}).
    ``spec``: :func:`F.spec_of` the op's arguments, where the caller has it (~5 µs of host
    on the 2-core box to work out again)."""

    @staticmethod
    def forward(ctx: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, gate_up_bias: torch.Tensor | None, down_proj: torch.Tensor,
                down_bias: torch.Tensor | None, activation: str, gated: bool, transposed: bool,
                interleaved: bool, alpha: float, limit: float,
                configs: dict[str, dict[str, int]] | None = None, spec: Any = None) -> torch.Tensor:
        args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias,
                activation, gated, transposed, interleaved, alpha, limit)
        # the forward's and the backward's launch keys
        spec = None if configs else (spec if spec is not None else F.spec_of(*args))
        n1 = gate_up_proj.shape[2] if transposed else gate_up_proj.shape[1]
        keep = keeps_rows(hidden_states, n1, gated, ctx.needs_input_grad[3], configs)
        out, saved = F.fused_experts_forward(*args, configs=configs, save=True, keep_rows=keep, spec=spec)
        kept = () if saved is None else (saved.sorted_pair_ids, saved.block_expert, saved.tables, saved.act,
                                          saved.pre, saved.rows)
        ctx.save_for_backward(*args[:7], *kept)
        ctx.rest = args[7:]
        ctx.fwd_configs = None if saved is None else saved.configs
        ctx.configs, ctx.spec = configs, spec
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph: gradients that are differentiable themselves
            return _reference_grads(ctx, grad)
        tensors = ctx.saved_tensors
        args, kept = tensors[:7], tensors[7:]
        saved = F.Saved(*kept[:5], ctx.fwd_configs, None, kept[5]) if kept else None
        n = ctx.needs_input_grad
        grads = fused_experts_backward(grad, *args, *ctx.rest, saved, configs=ctx.configs,
                                       needs=(n[0], n[2], n[3], n[4], n[5], n[6]), fwd_spec=ctx.spec)
        dx, drw, dw1, db1, dw2, db2 = grads
        return (dx, None, drw, dw1, db1, dw2, db2) + (None,) * (len(n) - 7)


def _reference_grads(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """:class:`FusedExperts`' gradients where the graph of the backward is wanted
    (``create_graph``, a double backward): the op's reference recomputed from the saved
    inputs and differentiated by torch, so second derivatives are right (the fused kernels
    record no graph); slower than the kernels, but this is not the training step's path."""
    args = list(ctx.saved_tensors[:7]) + list(ctx.rest)
    n = ctx.needs_input_grad
    at = [j for j in (0, 2, 3, 4, 5, 6) if n[j] and args[j] is not None]
    with torch.enable_grad():
        out = M.reference(*args)
        got = torch.autograd.grad(out, [args[j] for j in at], grad, create_graph=True, allow_unused=True)
    grads: list[torch.Tensor | None] = [None] * len(n)
    for j, g in zip(at, got):
        grads[j] = torch.zeros_like(args[j]) if g is None else g
    return tuple(grads)


def fused_experts(*args: Any, configs: dict[str, dict[str, int]] | None = None) -> torch.Tensor:
    """The op (its positional arguments), differentiable, for training: :class:`FusedExperts`
    where the fused kernels take the inputs, else the op's differentiable ``grouped`` path."""
    M.check(*args)
    if M.checks_ids_here(args[1]):
        M.check_ids(args[1])
    if F.why_not_fused(*args) is not None:
        return G.grouped(*args)
    if not (torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return F.fused_experts_forward(*args, configs=configs)  # nothing to save: the forward alone
    return FusedExperts.apply(*args, configs)
