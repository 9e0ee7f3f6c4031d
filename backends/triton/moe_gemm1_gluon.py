"""The MoE forward's GEMM1 on Hopper as a warp-specialised persistent grouped GEMM, in Gluon.

    act[r] = gate(A[r] @ W[e, :I]^T, A[r] @ W[e, I:]^T)     A (S, K) sorted rows, W (E, 2I, K) -> act (S, I)

The same product, gate and stores as :func:`.moe_experts._moe_gemm` with ``PREGATHER`` (GEMM1
on a sorted copy of the token rows, loaded through TMA): the tiles walk the routing's padded
pair list (each expert's run padded to 128 rows, so a tile is one expert's), padded row r of
expert e is sorted row r + shift[e], and a padding row (pair id = the pair count) is never
stored. With ``pre`` the pre-activation is saved too (both halves, in ``pre``'s dtype, the
gate then reading the rounded values, as the Triton kernel does).

Why: at Qwen3-MoE's and OLMoE's T = 4096 the Triton GEMM1 ran 12 % behind CUTLASS's
grouped GEMM on the same sorted rows (473 / 421 and 543 / 484 us, H100, thirty-seventh
session), with the gate in its epilogue against none; the Triton kernel is one tile a
program, no warp specialisation (Triton's own does nothing on sm90), so each tile's fill and
epilogue stall its tensor cores. Here a program per SM walks its tiles, a 1-warp TMA loader
streams A's 128 rows and W's gate and up tiles through a ring of stages, and two 4-warp
consumers take them in one of two ways (as the weight gradients' kernels,
:mod:`.moe_wgrad_gluon`):

* ping-pong (``pingpong=True``, ``configs["gemm1"]["GLUON"] = 1``): the consumers alternate
  tiles of 128 rows x (64 gate + 64 up) columns, so one's epilogue (the gate, the stores of
  act and of the saved pre-activation) runs under the other's MMAs; 6 stages of 32 KB;
* cooperative (``GLUON = 2``): both on one tile of 128 rows x (128 gate + 128 up) columns, 64
  rows each (two m64n128 wgmma chains), so W's tiles are read from L2 half as often; the
  loader fills the next tile's stages under this tile's epilogue, but the tensor cores wait
  for it; 4 stages of 48 KB.

The cooperative kernel can also read the token rows themselves (``gemm1(gather=True)``,
``GATHER``; ``configs["gemm1"]["PREGATHER"] = 0`` with ``GLUON = 2``): its loader warps
(:func:`_gather_loader`, :data:`GATHER_LOADER_WARPS`) copy each stage's 128 rows from x through
the tile's pair ids with cp.async, 16 bytes a lane, and count their arrival on the stage's
barrier beside W's TMA bytes, so the sorted copy of the rows (``sorted_rows``: a write of S x K,
8 x the tokens' rows at Qwen3-MoE's and OLMoE's k = 8) is never made: what the issue asked of
GEMM1, for the no-grad forward (the training forward keeps the copy for the weight gradients).
Correct (the same bits as on the sorted copy) and not a default: the cp.asyncs cost what the
copy saves. H200, 2026-12-06 (``bench/moe_gemms.py --gluon``, T = 4096, the fused forward with
no grad against the table's, 7 interleaved rounds): 0.987 / 0.967 / 0.963 gathered against
0.949 / 0.947 / 0.935 on the sorted copy (Qwen3-MoE / OLMoE / Mixtral); at T = 16384 0.939 /
0.934 / 0.966 against 0.964 / 0.940 / 0.937.

GEMM2 runs on the same kernels (``gemm_kernel`` with ``GATED`` off, :func:`gemm2`,
``configs["gemm2"]["GLUON"]`` 2 cooperative, 1 ping-pong):

    pairs[p] = rw[p] * (act[r] @ W2[e]^T)     act (S, I) sorted rows, W2 (E, H, I) -> pairs (S, H)

one m64n256 chain a consumer on 128 x 256 tiles (the Triton GEMM2's tile), 3 stages of 48 KB,
each row scaled by its pair's routing weight in fp32 and stored to the pair's own row, as the
Triton GEMM2's ``ROUTED`` and ``SCALED`` epilogue: the same bits as the Triton GEMM2 at
Qwen3-MoE's, OLMoE's and Mixtral's T = 4096. Not a default: on the H100 (2026-12-06,
``bench/moe_gemms.py --gluon``, COALESCE) it ran 258 / 260 / 227 us against the table's Triton
GEMM2's 242 / 247 / 225 (persistent 128 x 256 tiles, 4 stages at the first two), and the fused
forward with both GEMMs on Gluon was no faster than with GEMM1 alone on it (no grad 0.963 /
0.946 / 0.924 against 0.935 / 0.935 / 0.922 of the table's). The cooperative consumers wait
through each tile's epilogue, a larger share of GEMM2's short K loop (I = 768-4096): so the
ping-pong kernel too (128 x 128 tiles a consumer, one m64n128 chain a 64-row half, 5 stages of
32 KB), whose epilogue runs under the other consumer's MMAs. GEMM2's default on the H200,
beside GEMM1's Gluon default (:func:`.moe_experts.gluon_gemm2_default`, which has the figures:
the fused forward 0.5-3.7 % faster there at T = 4096 and 16384 on all three configs, in
interleaved rounds), and not on the H100, where it lost at two of three (GEMM2 alone against
the table's Triton GEMM2, 2026-12-06: 238.8 / 302.6 / 231.6 us against 241.1 / 249.6 / 256.2
at T = 4096, Qwen3-MoE / OLMoE / Mixtral; 889.4 / 1098.2 / 1134.9 against 738.3 / 854.6 /
782.9 at T = 16384). Its narrower tiles read more shared memory per MMA (as GEMM1's
ping-pong); why the overlap repays that on one device and not the other is not known yet (no
profile of it). GEMM2 alone, timed one kernel after another, does not show the H200's gain
(222 / 246 / 223 against Triton's 220 / 242 / 260 at T = 4096; 743 / 909 / 1062 against 778 /
842 / 819 at T = 16384), which the fused forward's interleaved rounds do.

GEMM2's dgrad with the gate's backward in its epilogue runs on the cooperative kernel too
(``DGRAD``, :func:`dgrad2`, ``configs["dgrad2"]["GLUON"] = 2``, opt-in; ping-pong ``1``):

    d_pre[r] = gate'(pre[r], rw[p] * g[r]),  g[r] = bf16(dout[t] @ W2[e])     W2 (E, H, I)

A is dout's sorted copy, W2's tiles come as stored: down_proj (E, H, I) gives [64, 256] tiles
with N contiguous (four 128-byte TMA boxes, read by the wgmmas N-major), (E, I, H) the
K-major tiles of GEMM2. g goes through the consumer's shared buffer, rounded to bf16 (the
split path's g), and the epilogue reads both ``pre`` halves, writes both d_pre halves and
each row's partial sum of g * gate(pre) for d top_k_weights, 16 bytes a thread, a few rows at
a time. Correct (its CUDA cases against float64 and the split path) and slower: on the H100
(2026-12-06, ``bench/moe_launches.py``, T = 4096) 537 / 576 / 554 us against the split path's
GEMM and gate pass together, 337 / 366 / 374 (Qwen3-MoE / OLMoE / Mixtral). Taken apart on the
H200 (``bench/moe_gemms.py --dgrad2``): its MMA loop alone 189 / 194 us at Qwen3-MoE / Mixtral,
ahead of CUTLASS's g (225 / 215), the same with either layout of down_proj; the epilogue adds
100-110 us with the partial sums alone, 210-245 with d_pre alone, 275-315 with both. The
cooperative consumers wait through it, and its ``pre`` loads wait on the previous rows' stores
(they may alias). Running each tile's epilogue under the next tile's first K steps instead
(a chunk a step, loads a step ahead) ran slower still on the H100 (575 / 620 / 590 us; not
kept). So the ping-pong kernel takes it too (``pingpong=True``, ``GLUON = 1``: a consumer's
128 x 128 tile, 5 stages of 32 KB, the epilogue under the other consumer's MMAs). Correct (the
cooperative kernel's d_pre bit for bit) and slower still than the split path: on the H100
(2026-12-06, ``bench/moe_gemms.py --dgrad2``, T = 4096) 206 / 234 / 195 us with no output, 464
/ 525 / 485 with both (Qwen3-MoE / OLMoE / Mixtral), against CUTLASS's g alone 242 / 252 / 222
and the cooperative kernel's 525 / 565 / 542: the overlap hides 40-60 us of an epilogue of
~260-290.

Scope: bf16 rows and weights, gated with gate and up halves concatenated (transformers'
layout: W (E, 2I, K), K contiguous), no bias, I a multiple of the tile's 64 or 128 gate
columns and K of 64, sm90 (GEMM2: W2 (E, H, I) contiguous, H a multiple of 256, I of 64, no
bias): :func:`unfit` and :func:`unfit2` say which is missing; the caller
(:func:`.moe_experts.fused_experts_forward`, ``configs["gemm1"]["GLUON"]``, whose default is
:func:`.moe_experts.gluon_gemm1_default`, and ``configs["gemm2"]["GLUON"]``, whose default is
:func:`.moe_experts.gluon_gemm2_default`) checks them first.
Gluon has no interpreter: the kernel runs on the GPU only (``tests/test_moe_gemm1_gluon.py``'s
CUDA cases; its CPU case compiles it for sm90).
"""
from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from opreg.backends.triton.launch import launch
# the Triton GEMM1's tile order and gate, and the gate's backward of the Triton dgrad2's
# epilogue (Triton functions: Gluon calls them as they are)
from opreg.backends.triton.moe_tiles import gate_tile, gate_tile_grad, tile_of

__all__ = ["COALESCE", "GEMM2_BLOCK_N", "GEMM2_PP_BLOCK_N", "GEMM2_PP_STAGES", "GEMM2_STAGES", "PP_STAGES", "STAGES",
           "dgrad2", "gemm1", "gemm2", "unfit", "unfit2", "unfit_dgrad2"]

# a partition-wide barrier: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # a tile's rows, its gate (and up) columns; K per step
PP_BLOCK_N = 64  # the ping-pong tile's gate (and up) columns: 128 x 128 fp32 accumulators a consumer
# the cooperative ring: 4 stages of 48 KB (A 16 KB, W's gate and up tiles 16 KB each);
# ping-pong: 6 of 32 KB (W's tiles 8 KB each); 196,608 bytes either way. The epilogue
# stores from registers (a tile's rows are ragged at an expert's end: no TMA store)
STAGES, PP_STAGES = 4, 6
# GEMM2 cooperative: 128 rows x 256 columns a tile (m64n256 chains, as the Triton GEMM2's 128 x 256
# tiles on 8 warps), 3 stages of 48 KB (A 16 KB, W's tile 32 KB) and the epilogue's two 64 x 256
# bf16 buffers (64 KB); ping-pong: 128 x 128 tiles a consumer, 5 stages of 32 KB and two 128 x 128
# buffers (64 KB). 229,376 bytes at most
GEMM2_BLOCK_N, GEMM2_STAGES = 256, 3
GEMM2_PP_BLOCK_N, GEMM2_PP_STAGES = 128, 5
# GEMM2's dgrad (DGRAD): GEMM2's cooperative tile and ring (128 x 256, 3 stages of 48 KB, W's tile
# [64, 256] where N is contiguous); its epilogue walks a consumer's 64 rows this many at a time
# (g, both pre halves and both gradients in registers: 16 values each a thread at 8 rows; no
# spills under CONSUMER_REGS, triton 3.6 for sm90)
DGRAD2_BLOCK_N, DGRAD2_STAGES = GEMM2_BLOCK_N, GEMM2_STAGES
# ping-pong: GEMM2's ping-pong tile and ring (a consumer's 128 x 128 tile, 5 stages of 32 KB, two
# 128 x 128 epilogue buffers: 229,664 bytes of shared memory), the epilogue under the other
# consumer's MMAs
DGRAD2_PP_BLOCK_N, DGRAD2_PP_STAGES = GEMM2_PP_BLOCK_N, GEMM2_PP_STAGES
_DGRAD_ROWS = gl.constexpr(8)
# tiles walk GROUP_M row blocks of one column block, so W's tiles come from L2 (the Triton
# GEMM1's order)
GROUP_M = gl.constexpr(8)
# registers a thread: the loader warp 40, the second consumer 216 (Triton raises the default
# partition, the first consumer, to 256: 4 x 32 x (256 + 216) + 32 x 40 <= 65,536)
CONSUMER_REGS, LOADER_REGS = 216, 40
# the gathering loader (_gather_loader): 4 warps at 40 registers (4 x 32 x (256 + 216 + 40) =
# 65,536; compiled for sm90 with no spills), each warp's cp.asyncs a quarter of each round's 32
# rows. Its cp.asyncs, not the gathered rows' addresses, are what cost: on the H100 (2026-12-06,
# T = 4096, GEMM1 alone, no save) the kernel gathering the token rows with one loader warp ran
# 524 / 575 / 506 us (Qwen3-MoE / OLMoE / Mixtral) and the same loader reading the sorted copy
# through identity ids 529 / 580 / 500, against 415 / 441 / 401 for TMA on the sorted copy; 4
# warps: 514 / 548 / 470. H200: one warp 489 / 544 / 483, 4 warps 452-457 / 487-492 / 427-438,
# 8 warps (24 registers) 455 / 522 / 451, TMA 383-386 / 441 / 398-410 (the copy's kernel 51 /
# 47 / 15 us: ROWS_TILE's figures in moe_experts)
GATHER_LOADER_WARPS, GATHER_LOADER_REGS = 4, 40
# the epilogue's bf16 tiles stored through a shared buffer, 16 bytes a thread (:func:`_epilogue`),
# not from the accumulators' layout (2 columns a thread: a warp's 4-byte stores touch 8 rows).
# H100, T = 4096, the cooperative kernel (bench/moe_gemms.py --gluon, 2026-12-06): GEMM1 saving
# the pre-activation 527 -> 461 / 635 -> 568 / 565 -> 497 us (Qwen3-MoE / OLMoE / Mixtral), with
# no save 422 -> 413 / 518 -> 503 / 434 -> 437; the fused forward against the Triton GEMM1's
# 0.958 -> 0.952 / 0.978 -> 0.942 / 0.946 -> 0.911 with no grad, 1.078 -> 0.995 / 1.037 -> 0.961 /
# 1.029 -> 0.950 saving. ``gemm1(coalesce=False)`` stores as held (its tests cover both)
COALESCE = True


@gluon.jit
def _staged_store(buf, val, ptrs, mask, layout: gl.constexpr):
    """``val`` stored at ``ptrs`` (in ``layout``, 16 bytes a thread) through the consumer's
    shared buffer ``buf`` (the accumulator's layout holds 2 consecutive columns a thread: its
    own 4-byte stores touch 8 rows a warp)."""
    _barrier()  # every warp of this consumer has read the buffer's previous tile
    buf.store(val)
    _barrier()
    gl.store(ptrs, buf.load(layout), mask=mask)


@gluon.constexpr_function
def _out_layout(acc_layout, BN, COALESCE):
    """The layout the epilogue stores from: the accumulators' own, or (COALESCE) 8 consecutive
    elements a thread, a row's BN columns on BN / 8 threads, the 4 warps stacked over rows."""
    return gl.BlockedLayout([1, 8], [32 // (BN // 8), BN // 8], [4, 1], [1, 0]) if COALESCE else acc_layout


@gluon.jit
def _epilogue(acc_g, acc_u, buf, prow, col, expert, act_ptr, pre_ptr, pair_ids_ptr, shift_ptr, num_pairs, NI,
              stride_act, stride_pre, alpha, limit, ACT: gl.constexpr, HAS_LIMIT: gl.constexpr,
              SAVE_PRE: gl.constexpr, COALESCE: gl.constexpr):
    """A consumer's accumulators (padded rows ``prow``, gate columns ``col``, both in the
    layout it stores from: :func:`_out_layout`) through the gate into act's sorted rows,
    masked to the rows that hold a pair (and the pre-activation, both halves, where saved: the
    gate then reads its rounded values, as the Triton kernel's). COALESCE: the bf16 tiles go
    through the consumer's shared buffer ``buf`` ([rows, BN] bf16) and leave it 16 bytes a
    thread; an fp32 pre is stored as held."""
    out_layout: gl.constexpr = prow.type.layout.parent
    shift = gl.load(shift_ptr + expert)
    row_ok = gl.expand_dims(gl.load(pair_ids_ptr + prow) < num_pairs, 1)
    srows = gl.expand_dims((prow + shift).to(gl.int64), 1)
    c = gl.expand_dims(col, 0)
    mask = row_ok & (c < NI)
    if SAVE_PRE:  # the backward's input to the gate's derivative; a narrower pre is the gate's input too
        pg = acc_g.to(pre_ptr.dtype.element_ty)
        pu = acc_u.to(pre_ptr.dtype.element_ty)
        if COALESCE and pre_ptr.dtype.element_ty == gl.bfloat16:
            pre_rows = pre_ptr + srows * stride_pre
            _staged_store(buf, pg, pre_rows + c, mask, out_layout)
            _staged_store(buf, pu, pre_rows + (c + NI), mask, out_layout)
        elif COALESCE:  # an fp32 pre from the accumulators' layout (its indices converted, 1-D)
            acc_layout: gl.constexpr = acc_g.type.layout
            prow_a = gl.convert_layout(prow, gl.SliceLayout(1, acc_layout))
            c_a = gl.expand_dims(gl.convert_layout(col, gl.SliceLayout(0, acc_layout)), 0)
            pre_a = pre_ptr + gl.expand_dims((prow_a + shift).to(gl.int64), 1) * stride_pre
            mask_a = gl.expand_dims(gl.load(pair_ids_ptr + prow_a) < num_pairs, 1) & (c_a < NI)
            gl.store(pre_a + c_a, pg, mask=mask_a)
            gl.store(pre_a + (c_a + NI), pu, mask=mask_a)
        else:
            gl.store(pre_ptr + srows * stride_pre + c, pg, mask=mask)
            gl.store(pre_ptr + srows * stride_pre + (c + NI), pu, mask=mask)
        y = gate_tile(pg.to(gl.float32), pu.to(gl.float32), alpha, limit, True, ACT, HAS_LIMIT)
    else:
        y = gate_tile(acc_g, acc_u, alpha, limit, True, ACT, HAS_LIMIT)
    if COALESCE:
        _staged_store(buf, y.to(gl.bfloat16), act_ptr + srows * stride_act + c, mask, out_layout)
    else:
        gl.store(act_ptr + srows * stride_act + c, y.to(gl.bfloat16), mask=mask)


@gluon.jit
def _routed_epilogue(acc, buf, prow, col, out_ptr, pair_ids_ptr, route_w_ptr, num_pairs, top_k, N, stride_out,
                     stride_rt, stride_rk, COALESCE: gl.constexpr):
    """GEMM2's store: a consumer's accumulator (padded rows ``prow``, columns ``col``, in the
    layout it stores from) times each row's routing weight in fp32, rounded once to bf16,
    into the pair's own row of ``out`` (the Triton GEMM2's ``ROUTED`` and ``SCALED``: the same
    bits); a padding row (pair id = the pair count) is never stored."""
    out_layout: gl.constexpr = prow.type.layout.parent
    acc_layout: gl.constexpr = acc.type.layout
    # the weight, in the accumulator's row slice (the product is formed where the sums are)
    prow_a = gl.convert_layout(prow, gl.SliceLayout(1, acc_layout))
    pair_a = gl.load(pair_ids_ptr + prow_a)
    ok_a = pair_a < num_pairs
    p_a = gl.where(ok_a, pair_a, 0)
    rw = gl.load(route_w_ptr + (p_a // top_k).to(gl.int64) * stride_rt + (p_a % top_k) * stride_rk, mask=ok_a,
                 other=0.0).to(gl.float32)
    y = (acc * gl.expand_dims(rw, 1)).to(gl.bfloat16)
    pair = gl.load(pair_ids_ptr + prow)
    row_ok = gl.expand_dims(pair < num_pairs, 1)
    c = gl.expand_dims(col, 0)
    ptrs = out_ptr + gl.expand_dims(gl.where(pair < num_pairs, pair, 0).to(gl.int64), 1) * stride_out + c
    mask = row_ok & (c < N)
    if COALESCE:
        _staged_store(buf, y, ptrs, mask, out_layout)
    else:
        gl.store(ptrs, y, mask=mask)


@gluon.jit
def _dgrad_epilogue(acc, buf, row0, pid_n, expert, dpre_ptr, pre_ptr, part_ptr, pair_ids_ptr, shift_ptr, route_w_ptr,
                    num_pairs, top_k, NI, stride_dpre, stride_pre, stride_part, stride_rt, stride_rk, alpha, limit,
                    ACT: gl.constexpr, HAS_LIMIT: gl.constexpr, GATE_TIE: gl.constexpr, UP_LO_TIE: gl.constexpr,
                    UP_HI_TIE: gl.constexpr, WRITE_DPRE: gl.constexpr, ROUTE_GRAD: gl.constexpr):
    """GEMM2's dgrad epilogue (``DGRAD``): a consumer's accumulator g = dout[t] @ down[e] (its
    padded rows from ``row0``, the tile's columns ``pid_n`` x BN of I) rounded to bf16 into the
    consumer's shared buffer ``buf`` (the split path's g: the saved bf16 pre's dtype), then,
    :data:`_DGRAD_ROWS` rows at a time, 16 bytes a thread: the gate's backward of
    :func:`.moe_experts_backward._gate_grad_tile` from rw * g and the saved pre-activation's
    two halves (sorted rows, bf16) into d_pre's (the same layout), and part[pair, pid_n] = the
    sum over the tile's columns of g * gate(pre) (d top_k_weights' partial sum, one a column
    tile). A padding row (pair id = the pair count) is neither read nor written."""
    HM: gl.constexpr = buf.shape[0]
    BN: gl.constexpr = buf.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BN // 8), BN // 8], [4, 1], [1, 0])
    _barrier()  # every warp of this consumer has read the buffer's previous tile
    buf.store(acc.to(gl.bfloat16))
    _barrier()
    shift = gl.load(shift_ptr + expert)
    c = gl.expand_dims(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout)), 0)
    for r0 in gl.static_range(0, HM, _DGRAD_ROWS):
        prow = row0 + r0 + gl.arange(0, _DGRAD_ROWS, layout=gl.SliceLayout(1, layout))
        pair = gl.load(pair_ids_ptr + prow)
        ok = pair < num_pairs
        p = gl.where(ok, pair, 0)
        rw = gl.load(route_w_ptr + (p // top_k).to(gl.int64) * stride_rt + (p % top_k) * stride_rk, mask=ok,
                     other=0.0).to(gl.float32)
        srows = gl.expand_dims((prow + shift).to(gl.int64), 1)
        mask = gl.expand_dims(ok, 1) & (c < NI)
        g = buf.slice(r0, _DGRAD_ROWS, dim=0).load(layout).to(gl.float32)
        pre_rows = pre_ptr + srows * stride_pre
        p0 = gl.load(pre_rows + c, mask=mask, other=0.0).to(gl.float32)
        p1 = gl.load(pre_rows + (c + NI), mask=mask, other=0.0).to(gl.float32)
        d0, d1, y = gate_tile_grad(p0, p1, g * gl.expand_dims(rw, 1), alpha, limit, True, ACT, HAS_LIMIT, GATE_TIE,
                                   UP_LO_TIE, UP_HI_TIE)
        if WRITE_DPRE:
            d_rows = dpre_ptr + srows * stride_dpre
            gl.store(d_rows + c, d0.to(gl.bfloat16), mask=mask)
            gl.store(d_rows + (c + NI), d1.to(gl.bfloat16), mask=mask)
        if ROUTE_GRAD:
            part = gl.sum(gl.where(mask, g * y, gl.zeros_like(y)), axis=1)
            gl.store(part_ptr + p.to(gl.int64) * stride_part + pid_n, part, mask=ok)


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, block_expert_ptr, shift_ptr, pid, nprog,
            n_local, used_m, tiles_n, NI, N1, K, GATED: gl.constexpr, W_MN: gl.constexpr, GATHER: gl.constexpr,
            x_ptr, stride_x, pair_ids_ptr, num_pairs, top_k):
    if GATHER:  # A's rows from the token rows themselves (GEMM1, cooperative)
        _gather_loader(x_ptr, stride_x, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, pair_ids_ptr,
                       block_expert_ptr, num_pairs, top_k, pid, nprog, n_local, used_m, tiles_n, NI, N1, K)
    else:
        _tma_loader(a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, block_expert_ptr, shift_ptr, pid, nprog,
                    n_local, used_m, tiles_n, NI, N1, K, GATED, W_MN)


@gluon.jit
def _tma_loader(a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, block_expert_ptr, shift_ptr, pid, nprog,
                n_local, used_m, tiles_n, NI, N1, K, GATED: gl.constexpr, W_MN: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = g_bufs.shape[2] if W_MN else g_bufs.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if GATED else 1) * w_desc.block_type.nbytes
    g = 0  # k-steps issued over all of this program's tiles
    for i in range(n_local):
        pid_m, pid_n, expert = tile_of(pid + i * nprog, block_expert_ptr, used_m, tiles_n, GROUP_M)
        srow0 = pid_m * BM + gl.load(shift_ptr + expert)  # the tile's first sorted row
        wrow = expert * N1 + pid_n * BN  # its (gate) columns' first row of W (E * N1, K)
        for kb in range(K // BK):
            s = g % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            # rows past the expert's run are the next expert's (or TMA's zeros past S): they
            # feed only their own output rows, which are never stored
            tma.async_copy_global_to_shared(a_desc, [srow0, kb * BK], ready.index(s), a_bufs.index(s))
            if W_MN:  # W (E * K, N) with N contiguous: the tile's K rows of its expert, its BN columns
                tma.async_copy_global_to_shared(w_desc, [expert * K + kb * BK, pid_n * BN], ready.index(s),
                                                g_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(w_desc, [wrow, kb * BK], ready.index(s), g_bufs.index(s))
            if GATED:
                tma.async_copy_global_to_shared(w_desc, [wrow + NI, kb * BK], ready.index(s), u_bufs.index(s))
            g += 1


@gluon.jit
def _gather_loader(x_ptr, stride_x, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, pair_ids_ptr, block_expert_ptr,
                   num_pairs, top_k, pid, nprog, n_local, used_m, tiles_n, NI, N1, K):
    """GEMM1's loader with A gathered (GATHER): each stage's 128 rows read from the token rows
    ``x`` (T, K) through the tile's pair ids (token = pair // top_k; row 0 for a padding row,
    whose output is never stored) with cp.async, 32 rows a round over the partition's warps,
    16 bytes a lane, their arrival on the stage's ready barrier counted (every thread's
    cp.async.mbarrier.arrive, before the TMA's expect-arrive, so the phase can't complete
    without them); W's gate and up tiles through TMA, as :func:`_loader`'s. No sorted copy of
    the rows is made."""
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = g_bufs.shape[1]
    R: gl.constexpr = 32
    gl.static_assert(BM == 4 * R)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [gl.num_warps(), 1], [1, 0])
    cols = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, layout)), 0)
    rr = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes
    g = 0  # k-steps issued over all of this program's tiles
    for i in range(n_local):
        pid_m, pid_n, expert = tile_of(pid + i * nprog, block_expert_ptr, used_m, tiles_n, GROUP_M)
        wrow = expert * N1 + pid_n * BN
        # the tile's token rows, a round of 32 rows each (int32: kept, the pointers made per round)
        r0 = pid_m * BM + rr
        q0 = gl.load(pair_ids_ptr + r0)
        q1 = gl.load(pair_ids_ptr + r0 + R)
        q2 = gl.load(pair_ids_ptr + r0 + 2 * R)
        q3 = gl.load(pair_ids_ptr + r0 + 3 * R)
        t0 = gl.where(q0 < num_pairs, q0 // top_k, 0)
        t1 = gl.where(q1 < num_pairs, q1 // top_k, 0)
        t2 = gl.where(q2 < num_pairs, q2 // top_k, 0)
        t3 = gl.where(q3 < num_pairs, q3 // top_k, 0)
        for kb in range(K // BK):
            s = g % STAGES
            # a fresh mbarrier counts as having completed the phase before phase 0
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            buf = a_bufs.index(s)
            base = x_ptr + kb * BK + cols
            async_copy.async_copy_global_to_shared(buf.slice(0, R, dim=0),
                                                   base + gl.expand_dims(t0.to(gl.int64) * stride_x, 1))
            async_copy.async_copy_global_to_shared(buf.slice(R, R, dim=0),
                                                   base + gl.expand_dims(t1.to(gl.int64) * stride_x, 1))
            async_copy.async_copy_global_to_shared(buf.slice(2 * R, R, dim=0),
                                                   base + gl.expand_dims(t2.to(gl.int64) * stride_x, 1))
            async_copy.async_copy_global_to_shared(buf.slice(3 * R, R, dim=0),
                                                   base + gl.expand_dims(t3.to(gl.int64) * stride_x, 1))
            async_copy.mbarrier_arrive(ready.index(s))
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(w_desc, [wrow, kb * BK], ready.index(s), g_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [wrow + NI, kb * BK], ready.index(s), u_bufs.index(s))
            g += 1


@gluon.jit
def _b_operand(w_bufs, s, W_MN: gl.constexpr):
    """W's stage ``s`` as the wgmmas' B operand [BK, BN]: as loaded where N is contiguous
    (W_MN), else the K-major tile's transposed view."""
    if W_MN:
        b = w_bufs.index(s)
    else:
        b = w_bufs.index(s).permute((1, 0))
    return b


@gluon.jit
def _coop_consumer(a_bufs, g_bufs, u_bufs, o_buf, ready, empty, act_ptr, pre_ptr, pair_ids_ptr, block_expert_ptr,
                   shift_ptr, route_w_ptr, part_ptr, pid, nprog, n_local, used_m, tiles_n, num_pairs, top_k, NI, K,
                   stride_act, stride_pre, stride_part, stride_rt, stride_rk, alpha, limit, GATED: gl.constexpr,
                   ACT: gl.constexpr, HAS_LIMIT: gl.constexpr, SAVE_PRE: gl.constexpr, COALESCE: gl.constexpr,
                   DGRAD: gl.constexpr, W_MN: gl.constexpr, GATE_TIE: gl.constexpr, UP_LO_TIE: gl.constexpr,
                   UP_HI_TIE: gl.constexpr, WRITE_DPRE: gl.constexpr, ROUTE_GRAD: gl.constexpr,
                   GATHER: gl.constexpr, WHICH: gl.constexpr):
    # Consumer c takes rows [64 c, 64 c + 64) of each tile: GATED (GEMM1), two m64n128 wgmma
    # chains on its slice of A's stage, against the gate and the up tiles of W (K-major:
    # permuted views); else (GEMM2, its dgrad) one m64n256 chain against W's one tile (W_MN:
    # the tile as loaded, N contiguous).
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = g_bufs.shape[2] if W_MN else g_bufs.shape[1]
    HM: gl.constexpr = BM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    out_layout: gl.constexpr = _out_layout(acc_layout, BN, COALESCE)
    rows = gl.arange(0, HM, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    ksteps = K // BK
    g = 0
    for i in range(n_local):
        pid_m, pid_n, expert = tile_of(pid + i * nprog, block_expert_ptr, used_m, tiles_n, GROUP_M)
        acc_g = gl.zeros([HM, BN], gl.float32, acc_layout)
        if GATED:
            acc_u = gl.zeros([HM, BN], gl.float32, acc_layout)
        for kb in range(ksteps):
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            if GATHER:  # A came by cp.async (the generic proxy); the wgmmas read it through the async one
                fence_async_shared()
            a_s = a_bufs.index(s).slice(WHICH * HM, HM, dim=0)
            acc_g = warpgroup_mma(a_s, _b_operand(g_bufs, s, W_MN), acc_g, is_async=True)
            # keep this step's MMAs in flight; the previous step's are done: its stage goes back
            if GATED:
                acc_u = warpgroup_mma(a_s, u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g,))
            if kb > 0:
                mbarrier.arrive(empty.index((g - 1) % STAGES))
            g += 1
        if GATED:
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        else:
            acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
        if ksteps > 0:
            mbarrier.arrive(empty.index((g - 1) % STAGES))

        # the epilogue: this consumer's 64 rows
        if DGRAD:
            _dgrad_epilogue(acc_g, o_buf, pid_m * BM + WHICH * HM, pid_n, expert, act_ptr, pre_ptr, part_ptr,
                            pair_ids_ptr, shift_ptr, route_w_ptr, num_pairs, top_k, NI, stride_act, stride_pre,
                            stride_part, stride_rt, stride_rk, alpha, limit, ACT, HAS_LIMIT, GATE_TIE, UP_LO_TIE,
                            UP_HI_TIE, WRITE_DPRE, ROUTE_GRAD)
        elif GATED:
            _epilogue(acc_g, acc_u, o_buf, pid_m * BM + WHICH * HM + rows, pid_n * BN + cols, expert, act_ptr,
                      pre_ptr, pair_ids_ptr, shift_ptr, num_pairs, NI, stride_act, stride_pre, alpha, limit, ACT,
                      HAS_LIMIT, SAVE_PRE, COALESCE)
        else:
            _routed_epilogue(acc_g, o_buf, pid_m * BM + WHICH * HM + rows, pid_n * BN + cols, act_ptr, pair_ids_ptr,
                             route_w_ptr, num_pairs, top_k, NI, stride_act, stride_rt, stride_rk, COALESCE)


@gluon.jit
def _pp_consumer(a_bufs, g_bufs, u_bufs, o_buf, ready, empty, order, act_ptr, pre_ptr, pair_ids_ptr, block_expert_ptr,
                 shift_ptr, route_w_ptr, part_ptr, pid, nprog, n_local, used_m, tiles_n, num_pairs, top_k, NI, K,
                 stride_act, stride_pre, stride_part, stride_rt, stride_rk, alpha, limit, GATED: gl.constexpr,
                 ACT: gl.constexpr, HAS_LIMIT: gl.constexpr, SAVE_PRE: gl.constexpr, COALESCE: gl.constexpr,
                 DGRAD: gl.constexpr, W_MN: gl.constexpr, GATE_TIE: gl.constexpr, UP_LO_TIE: gl.constexpr,
                 UP_HI_TIE: gl.constexpr, WRITE_DPRE: gl.constexpr, ROUTE_GRAD: gl.constexpr, WHICH: gl.constexpr):
    # Consumer c takes the program's tiles i = c mod 2, all 128 rows: GATED (GEMM1), two m64n64
    # wgmma chains (gate, up) a 64-row half, on the whole of A's stage; else (GEMM2, its dgrad)
    # one m64n128 chain a 64-row half (W_MN: W's tile as loaded, N contiguous).
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = g_bufs.shape[2] if W_MN else g_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    out_layout: gl.constexpr = _out_layout(acc_layout, BN, COALESCE)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, out_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
    ksteps = K // BK
    for i in range(n_local):
        if i % 2 == WHICH:
            pid_m, pid_n, expert = tile_of(pid + i * nprog, block_expert_ptr, used_m, tiles_n, GROUP_M)
            g = i * ksteps  # every tile has K // BK steps: tile i's first ring position
            # Start this tile's MMAs only once the other consumer has issued all of tile i - 1's
            # (its epilogue then runs under ours), which also keeps this consumer within one
            # lap of the loader: a parity wait on ready cannot pass on a stale phase
            if i > 0:
                mbarrier.wait(order.index(1 - WHICH), ((i - 1) // 2) & 1)
            acc_g = gl.zeros([BM, BN], gl.float32, acc_layout)
            if GATED:
                acc_u = gl.zeros([BM, BN], gl.float32, acc_layout)
            for kb in range(ksteps):
                s = (g + kb) % STAGES
                mbarrier.wait(ready.index(s), ((g + kb) // STAGES) & 1)
                a_s = a_bufs.index(s)
                acc_g = warpgroup_mma(a_s, _b_operand(g_bufs, s, W_MN), acc_g, is_async=True)
                if GATED:
                    acc_u = warpgroup_mma(a_s, u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                else:
                    acc_g = warpgroup_mma_wait(num_outstanding=1, deps=(acc_g,))
                if kb > 0:
                    mbarrier.arrive(empty.index((g + kb - 1) % STAGES))
            # every step of this tile issued: the tensor cores go to the other consumer
            # (order[WHICH] completes once per tile of ours)
            mbarrier.arrive(order.index(WHICH))
            if GATED:
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            else:
                acc_g = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g,))
            if ksteps > 0:
                mbarrier.arrive(empty.index((g + ksteps - 1) % STAGES))
            if DGRAD:  # under the other consumer's MMAs
                _dgrad_epilogue(acc_g, o_buf, pid_m * BM, pid_n, expert, act_ptr, pre_ptr, part_ptr, pair_ids_ptr,
                                shift_ptr, route_w_ptr, num_pairs, top_k, NI, stride_act, stride_pre, stride_part,
                                stride_rt, stride_rk, alpha, limit, ACT, HAS_LIMIT, GATE_TIE, UP_LO_TIE, UP_HI_TIE,
                                WRITE_DPRE, ROUTE_GRAD)
            elif GATED:
                _epilogue(acc_g, acc_u, o_buf, pid_m * BM + rows, pid_n * BN + cols, expert, act_ptr, pre_ptr,
                          pair_ids_ptr, shift_ptr, num_pairs, NI, stride_act, stride_pre, alpha, limit, ACT,
                          HAS_LIMIT, SAVE_PRE, COALESCE)
            else:
                _routed_epilogue(acc_g, o_buf, pid_m * BM + rows, pid_n * BN + cols, act_ptr, pair_ids_ptr,
                                 route_w_ptr, num_pairs, top_k, NI, stride_act, stride_rt, stride_rk, COALESCE)


@gluon.jit
def gemm_kernel(a_desc, w_desc, out_ptr, pre_ptr, pair_ids_ptr, block_expert_ptr, shift_ptr, used_ptr, route_w_ptr,
                part_ptr, x_ptr, num_pairs, top_k, NI, N1, K, stride_out, stride_pre, stride_part, stride_rt, stride_rk,
                stride_x, alpha, limit, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
                HAS_LIMIT: gl.constexpr, SAVE_PRE: gl.constexpr, PINGPONG: gl.constexpr, COALESCE: gl.constexpr,
                CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr = 1,
                DGRAD: gl.constexpr = False,
                W_MN: gl.constexpr = False, GATE_TIE: gl.constexpr = False, UP_LO_TIE: gl.constexpr = False,
                UP_HI_TIE: gl.constexpr = False, WRITE_DPRE: gl.constexpr = False, ROUTE_GRAD: gl.constexpr = False,
                GATHER: gl.constexpr = False):
    """GATED: GEMM1 and its gate into ``out`` = act's sorted rows (NI = I columns, W's N1 = 2I
    rows an expert); else GEMM2: ``out`` = the pairs' rows, scaled by their
    routing weights (NI = N1 = H). ``route_w_ptr``, ``top_k`` and their strides are GEMM2's;
    ``pre_ptr``, ``alpha``, ``limit`` and the gate's constexprs GEMM1's. DGRAD (COALESCE):
    GEMM2's dgrad, g = A @ W (A = dout's sorted rows (S, H), NI = N1 = I columns,
    K = H; W_MN: W (E * H, I) tiles [BK, BN], else (E * I, H) ones [BN, BK]) with the gate's
    backward in its epilogue (:func:`_dgrad_epilogue`): ``out`` = d_pre (sorted rows, 2I), ``pre``
    the saved pre-activation, ``part`` the partial sums of d top_k_weights. GATHER (GEMM1,
    cooperative): A's rows gathered from the token rows ``x_ptr`` (T, K; row stride ``stride_x``)
    through the pair ids (:func:`_gather_loader`; ``top_k`` then GEMM1's too), ``a_desc`` only
    its box and layout. LOADER_WARPS: the loader partition's warps (LOADER_REGS registers
    each; :data:`GATHER_LOADER_WARPS` where gathered, else 1)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    # the tile's (gate and up) columns; W_MN: W's tile is [BK, BN], N contiguous
    BN: gl.constexpr = w_desc.block_type.shape[1] if W_MN else w_desc.block_type.shape[0]
    gl.static_assert(w_desc.block_type.shape[0 if W_MN else 1] == BK)
    gl.static_assert(not DGRAD or (COALESCE and not GATED))
    gl.static_assert(DGRAD or not W_MN)
    gl.static_assert(not GATHER or (GATED and not PINGPONG))

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, w_desc.block_type.shape[0], w_desc.block_type.shape[1]],
                                       w_desc.layout)
    if GATED:
        u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    else:
        u_bufs = g_bufs  # never read
    # each consumer's epilogue buffer (COALESCE): its rows of the tile, bf16 (32 bytes, unused, when off)
    o_rows: gl.constexpr = BM if PINGPONG else BM // 2
    o_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]) if COALESCE \
        else gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    o_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, o_rows if COALESCE else 1, BN if COALESCE else 8], o_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)  # the loader's expect-arrive (+ TMA bytes)
        # a stage goes back when its consumer (ping-pong) or both (cooperative) release it
        mbarrier.init(empty.index(s), count=1 if PINGPONG else 2)
    # ping-pong: order[c] completes once consumer c has issued a tile's MMAs (one arrive a tile)
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(order.index(0), count=1)
    mbarrier.init(order.index(1), count=1)
    fence_async_shared()  # the barriers' init visible to the async proxy (TMA) before any use

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    used_m = gl.load(used_ptr) // BM  # the padded list's blocks in use: a device value
    tiles_n = NI // BN
    n_local = gl.maximum(used_m * tiles_n - pid + nprog - 1, 0) // nprog

    # The partitions' arguments are written out in the call, not first assigned to a name: an
    # assignment turns the constexprs in a tuple into runtime values (triton 3.6), and ACT,
    # HAS_LIMIT, SAVE_PRE and the consumer's index must stay compile-time (each gate's code
    # alone; no pre branch; one function for both consumers).
    # triton 3.6 signature: ([(fn, args) default first, workers...], worker warps, worker regs)
    if PINGPONG:
        gl.warp_specialize([
            (_pp_consumer, (a_bufs, g_bufs, u_bufs, o_bufs.index(0), ready, empty, order, out_ptr, pre_ptr,
                            pair_ids_ptr, block_expert_ptr, shift_ptr, route_w_ptr, part_ptr, pid, nprog, n_local,
                            used_m, tiles_n, num_pairs, top_k, NI, K, stride_out, stride_pre, stride_part, stride_rt,
                            stride_rk, alpha, limit, GATED, ACT, HAS_LIMIT, SAVE_PRE, COALESCE, DGRAD, W_MN,
                            GATE_TIE, UP_LO_TIE, UP_HI_TIE, WRITE_DPRE, ROUTE_GRAD, 0)),
            (_pp_consumer, (a_bufs, g_bufs, u_bufs, o_bufs.index(1), ready, empty, order, out_ptr, pre_ptr,
                            pair_ids_ptr, block_expert_ptr, shift_ptr, route_w_ptr, part_ptr, pid, nprog, n_local,
                            used_m, tiles_n, num_pairs, top_k, NI, K, stride_out, stride_pre, stride_part, stride_rt,
                            stride_rk, alpha, limit, GATED, ACT, HAS_LIMIT, SAVE_PRE, COALESCE, DGRAD, W_MN,
                            GATE_TIE, UP_LO_TIE, UP_HI_TIE, WRITE_DPRE, ROUTE_GRAD, 1)),
            (_loader, (a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, block_expert_ptr, shift_ptr, pid,
                       nprog, n_local, used_m, tiles_n, NI, N1, K, GATED, W_MN, GATHER, x_ptr, stride_x,
                       pair_ids_ptr, num_pairs, top_k)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_coop_consumer, (a_bufs, g_bufs, u_bufs, o_bufs.index(0), ready, empty, out_ptr, pre_ptr, pair_ids_ptr,
                              block_expert_ptr, shift_ptr, route_w_ptr, part_ptr, pid, nprog, n_local, used_m,
                              tiles_n, num_pairs, top_k, NI, K, stride_out, stride_pre, stride_part, stride_rt,
                              stride_rk, alpha, limit, GATED, ACT, HAS_LIMIT, SAVE_PRE, COALESCE, DGRAD, W_MN,
                              GATE_TIE, UP_LO_TIE, UP_HI_TIE, WRITE_DPRE, ROUTE_GRAD, GATHER, 0)),
            (_coop_consumer, (a_bufs, g_bufs, u_bufs, o_bufs.index(1), ready, empty, out_ptr, pre_ptr, pair_ids_ptr,
                              block_expert_ptr, shift_ptr, route_w_ptr, part_ptr, pid, nprog, n_local, used_m,
                              tiles_n, num_pairs, top_k, NI, K, stride_out, stride_pre, stride_part, stride_rt,
                              stride_rk, alpha, limit, GATED, ACT, HAS_LIMIT, SAVE_PRE, COALESCE, DGRAD, W_MN,
                              GATE_TIE, UP_LO_TIE, UP_HI_TIE, WRITE_DPRE, ROUTE_GRAD, GATHER, 1)),
            (_loader, (a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, block_expert_ptr, shift_ptr, pid,
                       nprog, n_local, used_m, tiles_n, NI, N1, K, GATED, W_MN, GATHER, x_ptr, stride_x,
                       pair_ids_ptr, num_pairs, top_k)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


@functools.cache
def _layouts(block_n: int = BLOCK_N) -> tuple[object, object]:
    """The NVMMA shared layouts of A's stage ([128, 64]) and of a W tile ([block_n, 64])."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], gl.bfloat16))


@functools.cache
def _device(index: int) -> tuple[tuple[int, int], int]:
    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count


def _unfit_common(gemm: str, x: torch.Tensor, w_nk: torch.Tensor, weight: str, layout: str, bias: str,
                  has_bias: bool, block_m: int) -> str | None:
    """What both GEMMs need: no bias, the routing's 128-row blocks, bf16 on CUDA, the weight
    contiguous and 16-byte aligned (``weight`` named, seen as ``layout``)."""
    if has_bias:
        return f"the Gluon {gemm} takes no {bias} bias"
    if block_m != BLOCK_M:
        return f"the Gluon {gemm} needs the routing's BLOCK_M = {BLOCK_M}, got {block_m}"
    for name, t in (("hidden_states", x), (weight, w_nk)):
        if not t.is_cuda or t.dtype != torch.bfloat16:
            return f"{name} is not bf16 on CUDA ({t.dtype}, {t.device})"
    if w_nk.dim() != 3 or not w_nk.is_contiguous() or w_nk.data_ptr() % 16:
        return f"{weight} is not a contiguous {layout} tensor, 16-byte aligned (K-major tiles through TMA)"
    return None


def _not_sm90(x: torch.Tensor) -> str | None:
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if _device(index)[0][0] != 9:
        return f"the GPU is sm{''.join(map(str, _device(index)[0]))}, not sm90 (wgmma)"
    return None


def unfit(x: torch.Tensor, w_nk: torch.Tensor, i: int, *, gated: bool, interleaved: bool, has_bias: bool,
          block_m: int, pingpong: bool = False, gather: bool = False) -> str | None:
    """Why :func:`gemm1` can't take the token rows ``x`` (T, K) (their sorted copy, a fresh
    contiguous buffer, is its A; ``gather``: x itself) and the weight seen as (E, N1, K) ``w_nk``
    (I = ``i`` output columns), or None. ``block_m``: the routing's block; ``pingpong``: which
    kernel."""
    if gather and pingpong:
        return "only the cooperative Gluon GEMM1 gathers its rows (PREGATHER = 0)"
    if gather and (x.dim() != 2 or not x.is_contiguous() or x.data_ptr() % 16):
        return "hidden_states must be contiguous and 16-byte aligned to be gathered (PREGATHER = 0)"
    if not gated or interleaved:
        return "the Gluon GEMM1 needs a gated weight with gate and up halves concatenated"
    why = _unfit_common("GEMM1", x, w_nk, "gate_up_proj", "(E, 2I, K)", "gate_up", has_bias, block_m)
    if why is not None:
        return why
    k = x.shape[1]
    if w_nk.shape[1] != 2 * i or w_nk.shape[2] != k:
        return f"gate_up_proj's shape {tuple(w_nk.shape)} is not (E, 2 x {i}, {k})"
    bn = PP_BLOCK_N if pingpong else BLOCK_N
    if i % bn or k % BLOCK_K or not (i and k):
        return f"I = {i} and K = {k} must be positive multiples of {bn} and {BLOCK_K}"
    return _not_sm90(x)


def _operands(a: torch.Tensor, w_nk: torch.Tensor, block_expert: torch.Tensor, n: int, bn: int,
              programs: int | None, w_mn: bool = False) -> tuple[TensorDescriptor, TensorDescriptor, tuple[int]]:
    """A's and W's tensor descriptors ([128, 64] and [bn, 64] boxes; ``w_mn``: W (E, N, K) is
    (E, K, N) contiguous underneath, its box [64, bn]) and the persistent grid: one program per
    SM (or ``programs``), no more than the worst case's tiles (every padded block x the
    ``n // bn`` column tiles)."""
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    a_layout, w_layout = _layouts(bn)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K], a_layout)
    if w_mn:
        box = [BLOCK_K, bn]
        w_desc = TensorDescriptor.from_tensor(w_nk.transpose(1, 2).reshape(-1, n), box,
                                              gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))
    else:
        w_desc = TensorDescriptor.from_tensor(w_nk.view(-1, w_nk.shape[2]), [bn, BLOCK_K], w_layout)
    tiles = block_expert.shape[0] * (n // bn)
    return a_desc, w_desc, (max(1, min(programs or _device(index)[1], tiles)),)


def gemm1(a: torch.Tensor, w_nk: torch.Tensor, act: torch.Tensor, pre: torch.Tensor | None,
          sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, shift: torch.Tensor, used: torch.Tensor,
          num_pairs: int, i: int, act_id: int, alpha: float = 1.0, limit: float = math.inf,
          programs: int | None = None, pingpong: bool = False, coalesce: bool | None = None,
          gather: bool = False, top_k: int = 1, spec: object = None) -> None:
    """GEMM1 with the gate into ``act`` (S, I) (and the pre-activation into ``pre`` (S, 2I)
    where given), over the routing's padded pair list (``sorted_pair_ids``, ``block_expert``,
    ``shift``: sorted row = padded row + shift[e], ``used``: a 1-element view of its last
    padded end); ``pre`` bf16 or fp32. ``a``: the rows' sorted copy (S, K), or with ``gather``
    (the cooperative kernel) the token rows themselves (T, K, contiguous), read through the
    pair ids (token = pair // ``top_k``). The caller checks :func:`unfit` first (with the same
    ``pingpong`` and ``gather``: the ping-pong kernel, else the cooperative one). ``programs``:
    how many persistent programs (default one per SM). ``coalesce``: the epilogue's bf16 tiles
    stored 16 bytes a thread (default :data:`COALESCE`). ``spec``: a key that determines every
    argument's metadata."""
    coalesce = COALESCE if coalesce is None else coalesce
    a_desc, w_desc, grid = _operands(a, w_nk, block_expert, i, PP_BLOCK_N if pingpong else BLOCK_N, programs)
    has_limit = math.isfinite(limit)
    p = pre if pre is not None else act  # a valid pointer, never written
    # act: GEMM2's routing weights' and the dgrad's partial sums' pointer (never read here); the
    # token rows' pointer and top_k read only where gathered (else 1 and 0, as before GATHER)
    launch(gemm_kernel, grid, a_desc, w_desc, act, p, sorted_pair_ids, block_expert, shift, used, act, act, a,
           num_pairs, top_k if gather else 1, i, w_nk.shape[1], a.shape[1], act.stride(0), p.stride(0), 0, 0, 0,
           a.stride(0) if gather else 0, float(alpha), float(limit) if has_limit else 0.0,
           spec_key=None if spec is None else (spec, "gluon gemm1", pingpong, coalesce, gather),
           STAGES=PP_STAGES if pingpong else STAGES, GATED=True, ACT=act_id, HAS_LIMIT=has_limit,
           SAVE_PRE=pre is not None, PINGPONG=pingpong, COALESCE=coalesce, CONSUMER_REGS=CONSUMER_REGS,
           LOADER_REGS=GATHER_LOADER_REGS if gather else LOADER_REGS, GATHER=gather,
           LOADER_WARPS=GATHER_LOADER_WARPS if gather else 1, num_warps=4)


def unfit2(x: torch.Tensor, w_nk: torch.Tensor, i: int, *, has_bias: bool, block_m: int,
           pingpong: bool = False) -> str | None:
    """Why :func:`gemm2` can't take GEMM1's output (S, ``i``) of the token rows ``x``'s dtype
    and device (a fresh contiguous buffer: its A) and the down projection seen as (E, H, I)
    ``w_nk``, or None. ``pingpong``: which kernel."""
    why = _unfit_common("GEMM2", x, w_nk, "down_proj", "(E, H, I)", "down", has_bias, block_m)
    if why is not None:
        return why
    h = w_nk.shape[1]
    if w_nk.shape[2] != i:
        return f"down_proj's shape {tuple(w_nk.shape)} is not (E, H, {i})"
    bn = GEMM2_PP_BLOCK_N if pingpong else GEMM2_BLOCK_N
    if h % bn or i % BLOCK_K or not (h and i):
        return f"H = {h} and I = {i} must be positive multiples of {bn} and {BLOCK_K}"
    return _not_sm90(x)


def gemm2(a: torch.Tensor, w_nk: torch.Tensor, out: torch.Tensor, route_w: torch.Tensor,
          sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, shift: torch.Tensor, used: torch.Tensor,
          num_pairs: int, top_k: int, programs: int | None = None, pingpong: bool = False,
          coalesce: bool | None = None, spec: object = None) -> None:
    """GEMM2: ``out[p] = route_w[p // top_k, p % top_k] * (A[r] @ W[e]^T)`` for each pair p at
    sorted row r of expert e, ``out`` (S, H) bf16, ``a`` the activation's sorted rows (S, I),
    ``w_nk`` (E, H, I); the routing as :func:`gemm1`'s. The caller checks :func:`unfit2` first
    (with the same ``pingpong``). ``programs``, ``pingpong``, ``coalesce``, ``spec``: as
    :func:`gemm1`'s."""
    coalesce = COALESCE if coalesce is None else coalesce
    h = w_nk.shape[1]
    a_desc, w_desc, grid = _operands(a, w_nk, block_expert, h, GEMM2_PP_BLOCK_N if pingpong else GEMM2_BLOCK_N,
                                     programs)
    # out: GEMM1's pre-activation pointer and the dgrad's partial sums' (never read here)
    launch(gemm_kernel, grid, a_desc, w_desc, out, out, sorted_pair_ids, block_expert, shift, used, route_w, out, a,
           num_pairs, top_k, h, h, a.shape[1], out.stride(0), out.stride(0), 0, route_w.stride(0), route_w.stride(1),
           a.stride(0), 1.0, 0.0, spec_key=None if spec is None else (spec, "gluon gemm2", pingpong, coalesce),
           STAGES=GEMM2_PP_STAGES if pingpong else GEMM2_STAGES, GATED=False, ACT=0, HAS_LIMIT=False,
           SAVE_PRE=False, PINGPONG=pingpong, COALESCE=coalesce, CONSUMER_REGS=CONSUMER_REGS,
           LOADER_REGS=LOADER_REGS, num_warps=4)


def unfit_dgrad2(x: torch.Tensor, w_nk: torch.Tensor, i: int, *, gated: bool, interleaved: bool,
                 pre_dtype: torch.dtype, block_m: int, pingpong: bool = False) -> str | None:
    """Why :func:`dgrad2` can't take dout's sorted rows (of the token rows ``x``'s dtype and
    device, H columns: a fresh contiguous buffer) and the down projection seen as (E, I, H)
    ``w_nk`` (either layout: (E, H, I) or (E, I, H) contiguous underneath), or None.
    ``pingpong``: which kernel."""
    if not gated or interleaved:
        return "the Gluon dgrad2 needs a gated weight with gate and up halves concatenated"
    if pre_dtype != torch.bfloat16:
        return f"the pre-activation is saved in {pre_dtype} (a clamp's): the Gluon dgrad2 rounds g to bf16"
    w = w_nk if w_nk.stride(2) == 1 else w_nk.transpose(1, 2)
    why = _unfit_common("GEMM2's dgrad", x, w, "down_proj", "(E, H, I) or (E, I, H)", "down", False, block_m)
    if why is not None:
        return why
    h = x.shape[1]
    if tuple(w_nk.shape[1:]) != (i, h):
        return f"down_proj seen as (E, I, H) has shape {tuple(w_nk.shape)}, not (E, {i}, {h})"
    bn = DGRAD2_PP_BLOCK_N if pingpong else DGRAD2_BLOCK_N
    if i % bn or h % BLOCK_K or not (i and h):
        return f"I = {i} and H = {h} must be positive multiples of {bn} and {BLOCK_K}"
    return _not_sm90(x)


def dgrad2(a: torch.Tensor, w_nk: torch.Tensor, pre: torch.Tensor, route_w: torch.Tensor, d_pre: torch.Tensor | None,
           part: torch.Tensor | None, sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, shift: torch.Tensor,
           used: torch.Tensor, num_pairs: int, top_k: int, act_id: int, alpha: float, limit: float,
           ties: tuple[bool, bool, bool], programs: int | None = None, pingpong: bool = False,
           spec: object = None) -> None:
    """GEMM2's dgrad with the gate's backward in its epilogue, on the cooperative kernel (or
    the ping-pong one: ``pingpong``; the partial sums then one a 128-column tile): for
    each pair p at sorted row r of expert e, g = A[r] @ W[e]^T with ``a`` dout's sorted rows (S,
    H) and ``w_nk`` the down projection seen as (E, I, H), rounded to bf16; then ``d_pre`` (S,
    2I) from ``route_w``'s weight times g and the saved bf16 ``pre`` (S, 2I) (gate and up
    halves), and ``part`` (S, I / 256) fp32 = per column tile, the sum of g * gate(pre) (d
    top_k_weights' partial sums, in column order: :func:`.moe_experts_backward._route_grad_kernel`
    adds them). ``d_pre`` or ``part`` None: not computed. The routing as :func:`gemm1`'s;
    ``ties``: :func:`.moe_experts_backward.clamp_ties`. The caller checks :func:`unfit_dgrad2`
    first."""
    w_mn = w_nk.stride(2) != 1  # down_proj (E, H, I): its tiles [64, 256] (or 128), I contiguous
    i = w_nk.shape[1]
    a_desc, w_desc, grid = _operands(a, w_nk, block_expert, i, DGRAD2_PP_BLOCK_N if pingpong else DGRAD2_BLOCK_N,
                                     programs, w_mn)
    has_limit = math.isfinite(limit)
    out = d_pre if d_pre is not None else pre  # a valid pointer, never written without WRITE_DPRE
    q = part if part is not None else route_w  # likewise without ROUTE_GRAD
    if part is not None and part.stride(1) != 1:
        raise ValueError("dgrad2: part's columns must be contiguous")
    launch(gemm_kernel, grid, a_desc, w_desc, out, pre, sorted_pair_ids, block_expert, shift, used, route_w, q, a,
           num_pairs, top_k, i, i, a.shape[1], out.stride(0), pre.stride(0), q.stride(0), route_w.stride(0),
           route_w.stride(1), a.stride(0), float(alpha), float(limit) if has_limit else 0.0,
           spec_key=None if spec is None else (spec, "gluon dgrad2", pingpong, w_mn, d_pre is not None,
                                               part is not None),
           STAGES=DGRAD2_PP_STAGES if pingpong else DGRAD2_STAGES, GATED=False, ACT=act_id, HAS_LIMIT=has_limit,
           SAVE_PRE=False, PINGPONG=pingpong,
           COALESCE=True, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, DGRAD=True, W_MN=w_mn,
           GATE_TIE=ties[0], UP_LO_TIE=ties[1], UP_HI_TIE=ties[2], WRITE_DPRE=d_pre is not None,
           ROUTE_GRAD=part is not None, num_warps=4)
