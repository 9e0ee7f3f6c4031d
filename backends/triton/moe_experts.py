"""Fused Triton forward of ``moe_experts`` (see :mod:`opreg.ops.moe_experts` for the meaning).

Four steps, all on the device, no host sync (CUDA-graph capturable), every launch on the
current stream (Triton launches on torch's current stream of the current device):

1. **Routing** (:mod:`.moe_routing`: a three-kernel counting sort of the ids, one
   kernel where T*k <= 512): the S = T*k (token, slot) pairs, pair = t*k + j, sorted by
   expert (stable), each expert's segment padded to BLOCK_M: the GEMMs' tiles walk this
   list, while the buffers of sorted rows hold the real pairs alone (:func:`.moe_routing.routing_tables`).
   Ids outside [0, E) (the expert-parallel sentinel >= E; negative ids, the caller's error)
   never enter the work list. Buffers have static worst-case sizes, so no size is read back.
2. **GEMM1** (:func:`_moe_gemm` with ``GATHER``): hidden_states rows read through the sorted
   pair ids (token = pair // k; no gathered copy) times gate_up_proj[e] (+ bias), the gate
   in the epilogue (two accumulators when gated), fp32 accumulation; writes the activation
   (sorted rows, I) in hidden_states' dtype.
3. **GEMM2** (:func:`_moe_gemm` with ``ROUTED``): activation rows times down_proj[e] (+ bias),
   times the pair's routing weight in fp32, stored at the pair's row of a (S, H) buffer:
   every row is written by one program, so no atomics.
4. **Combine** (:func:`_combine_kernel`): out[t] = sum over j = 0..k-1 in that order, fp32,
   of the pair rows whose id is in [0, E) (a NaN weight in a sentinel slot adds nothing).
   Same bits every run.

The device functions these kernels share with the backward's and the Gluon GEMM1's (the
gate and its backward, the tile order, a routed tile's main loop) are in :mod:`.moe_tiles`.

Up to 64 tokens without a backward to feed (decode, :func:`decodes`) take the decode
kernels instead (:func:`decode_forward`), with no routing kernels and no padded rows. One
token: two kernels, GEMM1 and the gate per (token, slot) pair as a matrix-vector product,
then GEMM2, the routing weights and the combine per token in one (its pairs are k distinct
experts: the same weight bytes in half the launches). From two tokens on, pairs may share
experts: each program takes one used expert (found from a histogram of the ids) and all of its pairs
through tensor cores, for GEMM1 and the gate, then GEMM2 and the routing weights into pair
rows, then the combine: each expert's weights read once.

On sm90+ both GEMMs load the weight's tiles, and GEMM2 its sorted activation rows, through
tensor descriptors (TMA) instead of pointer arithmetic (:func:`launch_gemm` decides per
launch): 11-14 % faster forward on the H200 (``bench/moe_gemms.py``); GEMM1's gathered token
rows stay pointer loads (a row gather by TMA needs Blackwell), unless its config says
``PREGATHER``: then one copy kernel (:func:`sorted_rows`) puts the rows in sorted
order first and GEMM1 loads them as GEMM2 loads its A (a config for the tuner to weigh:
the copy's bytes against GEMM1's faster loads; on for Mixtral's shape in the shipped
table). A training forward whose backward would make that copy for dW1 anyway
(``keep_rows``) always pregathers and keeps the copy for it.

On sm90 from :data:`GLUON_GEMM1_MIN_ROWS` rows per expert, bf16, GEMM1 runs on the
cooperative Gluon kernel of :mod:`.moe_gemm1_gluon` over the sorted copy
(:func:`gluon_gemm1_default`), and on the H200 GEMM2 on its ping-pong kernel beside it
(:func:`gluon_gemm2_default`); each says why with its measurements.

Block sizes come from ``moe_experts_configs.json`` (:func:`pick_config`), keyed by GEMM,
rows-per-expert bucket, N, K and dtype, so a tuning run can rewrite the data alone.

float16, bfloat16 and float32 (fp32 GEMMs in IEEE fp32, not TF32); other dtypes (float64)
and degenerate sizes run the op's ``grouped`` path (:func:`why_not_fused` says why, logged
once). The op's gradients are its reference's; ``fused_experts_forward(..., save=True)``
also keeps what the fused backward (:mod:`.moe_experts_backward`, GEMM1's pre-activation
included) needs, for the training path (:mod:`.moe_experts_train`).

Host time: a forward's launches, checks and configs follow from its inputs' metadata
(:func:`spec_of`), so they are worked out once per spec and reused: the launcher keys
each launch by the spec instead of by its ~45 arguments, and tensor descriptors are
copied from a validated one. A no-grad forward goes further: recorded once per spec, its
launches are then replayed on each call's tensors (:data:`REPLAY`, :mod:`.replay`), none
of this Python run.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernels run on CPU
tensors: that is how ``tests/test_moe_triton.py`` checks them without a GPU (float32 and
float16 only: the interpreter's bfloat16 is wrong).
"""
import contextlib
import functools
import itertools
import json
import logging
import math
import os
from typing import Any, NamedTuple, Optional

import torch

from opreg import registry
from opreg._log import log_once, logger
from opreg.ops import moe_experts as M
from opreg.ops import moe_experts_grouped as G

from .launch import (DESCRIPTORS, LazyDescriptor, cdiv, descriptor, dynamo_tracing, launch, launch_args, next_pow2,
                     traced_constant)
from . import moe_routing
from .moe_routing import MAX_EXPERTS, TABLES, route_flat
from .moe_tiles import (ACT_IDS, IDENTITY, NO_TRITON, gate_tile, gate_up_cols, interpreting, jit, program_tile,
                        routed_mma, tile_of, tl)
from .replay import Plans, make, plain

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # no triton, or an older one: pointer loads only
    _TensorDescriptor = None


CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_experts_configs.json")

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["CONFIG_FILE", "Saved", "TritonImpl", "checked", "fused_experts_forward", "moe_experts_triton",
           "pick_config", "register", "sorted_rows", "spec_of", "why_not_fused"]


# ----------------------------------------------------------------------------- kernels

@jit
def _moe_gemm(
    a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, pre_ptr, pair_ids_ptr, block_expert_ptr, shift_ptr, w_desc, a_desc,
    a_desc_half, used_ptr, num_pairs, top_k, N, K, num_m_blocks, alpha, limit,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_be, stride_bn,
    stride_rt, stride_rk,
    stride_om, stride_on,
    stride_pm, stride_pn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GATHER: tl.constexpr, ROUTED: tl.constexpr, SCALED: tl.constexpr, GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    SAVE_PRE: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    W_TMA: tl.constexpr, W_KMAJOR: tl.constexpr, A_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
    HALF_TAIL: tl.constexpr = False,
):
    """One (BLOCK_M sorted rows) x (BLOCK_N output columns) tile of an expert's GEMM, or
    with PERSISTENT every tile of the work list, a program per SM striding over them.

    The tiles walk the padded pair list (each expert's run padded to BLOCK_M, so a tile is
    one expert's); the sorted rows a GEMM reads or writes (not ``GATHER`` / not ``ROUTED``)
    are unpadded: padded row r of expert e is sorted row r + shift[e] (``shift_ptr``, the
    routing's fifth table), and a padding row has none.

    GEMM1 (GATHER, not ROUTED): A = hidden_states (T, K), row = pair // top_k; W = gate_up
    seen as (E, 2N or N, K) through strides; out = activation (sorted rows, N); with
    SAVE_PRE also the pre-activation (after the bias, before the gate) into ``pre`` (sorted
    rows, 2N or N) in gate_up's column order, for the backward. GEMM2 (ROUTED and SCALED,
    not GATHER): A = activation (sorted rows, K); W = down seen as (E, N, K); out = (S, N)
    pair buffer, row = pair, scaled by the routing weight. ROUTED without SCALED: the
    backward's dgrad of GEMM1 (no routing weight). Either layout of either weight is just
    strides (stride_wn, stride_wk). W_TMA / A_TMA: W's tiles / A's (sorted, not GATHER) rows
    come through the tensor descriptors ``w_desc`` / ``a_desc`` (see :func:`.moe_tiles.routed_mma`;
    ``launch_gemm`` decides where they apply).

    PERSISTENT: the grid is a program per SM, each walking tiles pid, pid + programs, ...
    of the blocks in use (``*used_ptr``: the last expert's padded end, a multiple of BLOCK_M;
    so no tile is past the work list), with the tile loop flattened into the K loop, so
    Triton's pipeliner can issue the next tile's first loads under this one's epilogue.

    HALF_TAIL (not with PERSISTENT): a block whose second half holds no pair computes its
    first BLOCK_M / 2 rows only (``a_desc_half``: A's descriptor with that box, where
    A_TMA). An expert's padding is the end of its run, so that is its last block when it
    has at most BLOCK_M / 2 rows; at T = 4096 with Qwen3-MoE's routing (E 128, k 8: ~256
    +- 20 rows an expert) 23 % of the padded rows a 128-row tile walks are padding, in the
    partial last blocks (``bench/moe_padding.py``).
    """
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        used_m = tl.load(used_ptr) // BLOCK_M
        for tile in tl.range(tl.program_id(0), used_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n, expert = tile_of(tile, block_expert_ptr, used_m, num_n, GROUP_M)
            _gemm_tile(pid_m * BLOCK_M, pid_n, expert, a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, pre_ptr,
                       pair_ids_ptr, shift_ptr, w_desc, a_desc, num_pairs, top_k, N, K, alpha, limit, stride_am,
                       stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_rt, stride_rk,
                       stride_om, stride_on, stride_pm, stride_pn, BLOCK_M, BLOCK_N, BLOCK_K, GATHER, ROUTED,
                       SCALED, GATED, INTERLEAVED, ACT, HAS_BIAS, HAS_LIMIT, SAVE_PRE, DOT_PRECISION, EVEN_K, W_TMA,
                       W_KMAJOR, A_TMA)
    else:
        # the same call as above, not one loop for both: a one-trip loop with the tile under
        # an `if` would change the default kernel's code (the K loop's pipelining) untimed
        pid_m, pid_n, expert = program_tile(block_expert_ptr, num_m_blocks, num_n, GROUP_M)
        if expert < 0:
            return  # past the padded work list: nothing to compute, nothing to write
        row0 = pid_m * BLOCK_M
        if HALF_TAIL:
            if tl.load(pair_ids_ptr + row0 + BLOCK_M // 2) >= num_pairs:  # the second half: padding
                _gemm_tile(row0, pid_n, expert, a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, pre_ptr,
                           pair_ids_ptr, shift_ptr, w_desc, a_desc_half, num_pairs, top_k, N, K, alpha, limit,
                           stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_rt,
                           stride_rk, stride_om, stride_on, stride_pm, stride_pn, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                           GATHER, ROUTED, SCALED, GATED, INTERLEAVED, ACT, HAS_BIAS, HAS_LIMIT, SAVE_PRE,
                           DOT_PRECISION, EVEN_K, W_TMA, W_KMAJOR, A_TMA)
            else:
                _gemm_tile(row0, pid_n, expert, a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, pre_ptr,
                           pair_ids_ptr, shift_ptr, w_desc, a_desc, num_pairs, top_k, N, K, alpha, limit,
                           stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_rt,
                           stride_rk, stride_om, stride_on, stride_pm, stride_pn, BLOCK_M, BLOCK_N, BLOCK_K,
                           GATHER, ROUTED, SCALED, GATED, INTERLEAVED, ACT, HAS_BIAS, HAS_LIMIT, SAVE_PRE,
                           DOT_PRECISION, EVEN_K, W_TMA, W_KMAJOR, A_TMA)
        else:
            _gemm_tile(row0, pid_n, expert, a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, pre_ptr, pair_ids_ptr,
                       shift_ptr, w_desc, a_desc, num_pairs, top_k, N, K, alpha, limit, stride_am, stride_ak,
                       stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_rt, stride_rk, stride_om,
                       stride_on, stride_pm, stride_pn, BLOCK_M, BLOCK_N, BLOCK_K, GATHER, ROUTED, SCALED, GATED,
                       INTERLEAVED, ACT, HAS_BIAS, HAS_LIMIT, SAVE_PRE, DOT_PRECISION, EVEN_K, W_TMA,
                       W_KMAJOR, A_TMA)


@jit
def _gemm_tile(row0, pid_n, expert, a_ptr, w_ptr, bias_ptr, route_w_ptr, out_ptr, pre_ptr, pair_ids_ptr,
               shift_ptr, w_desc, a_desc, num_pairs, top_k, N, K, alpha, limit, stride_am, stride_ak, stride_we,
               stride_wn, stride_wk, stride_be, stride_bn, stride_rt, stride_rk, stride_om, stride_on, stride_pm,
               stride_pn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr,
               ROUTED: tl.constexpr, SCALED: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
               ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, SAVE_PRE: tl.constexpr,
               DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, W_TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
               A_TMA: tl.constexpr):
    """:func:`_moe_gemm`'s tile of ``expert``: padded rows row0 .. row0 + BLOCK_M, columns
    pid_n * BLOCK_N ..: main loop, epilogue, store."""
    rows = row0 + tl.arange(0, BLOCK_M)  # < num_m_blocks * BLOCK_M: the pair list's size
    pair = tl.load(pair_ids_ptr + rows)
    row_ok = pair < num_pairs  # padding rows hold the sentinel num_pairs
    srow0 = row0 + tl.load(shift_ptr + expert)  # the tile's first sorted row
    srows = (srow0 + tl.arange(0, BLOCK_M)).to(tl.int64)  # a padding row's: the next expert's, never stored
    if GATHER:
        a_row = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    else:
        a_row = srows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wcol0, wcol1 = gate_up_cols(cols, N, INTERLEAVED)
    w_base = w_ptr + expert.to(tl.int64) * stride_we  # int64: E * N * K may pass 2**31
    acc0, acc1 = routed_mma(a_ptr, a_row, row_ok, stride_am, stride_ak, w_base, wcol0, wcol1, col_ok,
                            stride_wn, stride_wk, K, BLOCK_M, BLOCK_N, BLOCK_K, GATED, DOT_PRECISION, EVEN_K,
                            w_desc, expert, pid_n * BLOCK_N, N + pid_n * BLOCK_N, W_TMA, W_KMAJOR,
                            a_desc, srow0, A_TMA)

    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        acc0 += tl.load(b_base + wcol0 * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc1 += tl.load(b_base + wcol1 * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SAVE_PRE:  # the backward's input to the gate's derivative: no recompute of this GEMM
        if pre_ptr.dtype.element_ty != tl.float32:
            # a narrower pre (pre_dtype) is the gate's input here too, so the backward
            # differentiates at the values this gate saw (a clamp's side included)
            acc0 = acc0.to(pre_ptr.dtype.element_ty).to(tl.float32)
            if GATED:
                acc1 = acc1.to(pre_ptr.dtype.element_ty).to(tl.float32)
        pre_mask = row_ok[:, None] & col_ok[None, :]
        pre_rows = pre_ptr + srows[:, None] * stride_pm
        tl.store(pre_rows + wcol0[None, :] * stride_pn, acc0.to(pre_ptr.dtype.element_ty), mask=pre_mask)
        if GATED:
            tl.store(pre_rows + wcol1[None, :] * stride_pn, acc1.to(pre_ptr.dtype.element_ty), mask=pre_mask)
    y = gate_tile(acc0, acc1, alpha, limit, GATED, ACT, HAS_LIMIT)

    if ROUTED:
        p = tl.where(row_ok, pair, 0)
        if SCALED:
            # The routing weight in fp32 (transformers' routing weights are fp32), then one
            # rounding to the buffer's dtype; the row is the pair's own, written once.
            rw = tl.load(route_w_ptr + (p // top_k).to(tl.int64) * stride_rt + (p % top_k) * stride_rk,
                         mask=row_ok, other=0.0).to(tl.float32)
            y = y * rw[:, None]
        out_row = p.to(tl.int64)
    else:
        out_row = srows
    out_mask = row_ok[:, None] & col_ok[None, :]  # a padding row: no pair, no sorted row
    out_ptrs = out_ptr + out_row[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)



@jit
def _combine_kernel(
    pair_ptr, ids_ptr, out_ptr, rows_ptr, H, top_k, num_experts,
    stride_pm, stride_ph, stride_it, stride_ik, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, MAPPED: tl.constexpr,
):
    """out[t, cols] = sum over j = 0..top_k-1, in that order, in fp32, of pair p = t*k + j's
    row: row p, or where MAPPED row ``rows[p]`` (:func:`_pair_rows_kernel`: a sorted
    row), for the slots whose expert id is in [0, E); a skipped slot's row is never read (it
    was never written, and its weight may be NaN)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, top_k):
        eid = tl.load(ids_ptr + t * stride_it + j * stride_ik)
        use = (eid >= 0) & (eid < num_experts)
        row = t * top_k + j
        if MAPPED:
            row = tl.load(rows_ptr + row, mask=use, other=0).to(tl.int64)
        v = tl.load(pair_ptr + row * stride_pm + cols * stride_ph, mask=col_ok & use, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@jit
def _gemv(a_ptr, w_base, wcol0, wcol1, col_ok, K, stride_a, stride_wn, stride_wk,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr):
    """sum over k of a[k] * W[wcol0[n], k] for BLOCK_N columns, and with TWO the same for
    columns wcol1 in the same loop (a gated weight's up half: both halves' loads in flight
    together), fp32 (exact products, as the GEMMs' fp32 accumulation of 16-bit inputs):
    elementwise partial sums over the K loop, one reduction at the end. The decode kernels'
    main loop."""
    ks = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptr + (k0 + ks) * stride_a, mask=k_ok, other=0.0).to(tl.float32)
        m = col_ok[:, None] & k_ok[None, :]
        w0 = tl.load(w_base + wcol0[:, None] * stride_wn + (k0 + ks)[None, :] * stride_wk, mask=m, other=0.0)
        if TWO:
            w1 = tl.load(w_base + wcol1[:, None] * stride_wn + (k0 + ks)[None, :] * stride_wk, mask=m, other=0.0)
            acc1 += w1.to(tl.float32) * a[None, :]
        acc0 += w0.to(tl.float32) * a[None, :]
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1)


@jit
def _decode_up_kernel(
    x_ptr, ids_ptr, w_ptr, bias_ptr, act_ptr, top_k, num_experts, N, K, alpha, limit,
    stride_xt, stride_xk, stride_it, stride_ik, stride_we, stride_wn, stride_wk, stride_be, stride_bn,
    stride_am, stride_an,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """The decode path's GEMM1 (:func:`decode_forward`): program (p, n) computes pair p = t*k
    + j's activation row for BLOCK_N columns, act[p] = gate(x[t] @ gate_up[e]^T + bias[e]),
    e = the pair's id, as a matrix-vector product: no routing, no padded rows. A pair whose
    id is outside [0, E) is skipped: its row stays unwritten and nothing reads it."""
    p = tl.program_id(0)
    t = (p // top_k).to(tl.int64)
    e = tl.load(ids_ptr + t * stride_it + (p % top_k) * stride_ik)
    if (e < 0) | (e >= num_experts):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wcol0, wcol1 = gate_up_cols(cols, N, INTERLEAVED)
    w_base = w_ptr + e.to(tl.int64) * stride_we  # int64: E * N * K may pass 2**31
    x_row = x_ptr + t * stride_xt
    acc0, acc1 = _gemv(x_row, w_base, wcol0, wcol1, col_ok, K, stride_xk, stride_wn, stride_wk, BLOCK_N, BLOCK_K,
                       GATED)  # acc1: the up half, unused unless GATED
    if HAS_BIAS:
        b_base = bias_ptr + e.to(tl.int64) * stride_be
        acc0 += tl.load(b_base + wcol0 * stride_bn, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            acc1 += tl.load(b_base + wcol1 * stride_bn, mask=col_ok, other=0.0).to(tl.float32)
    y = gate_tile(acc0, acc1, alpha, limit, GATED, ACT, HAS_LIMIT)
    tl.store(act_ptr + p.to(tl.int64) * stride_am + cols * stride_an, y.to(act_ptr.dtype.element_ty), mask=col_ok)


@jit
def _decode_down_kernel(
    act_ptr, ids_ptr, rw_ptr, w_ptr, bias_ptr, out_ptr, top_k, num_experts, N, K,
    stride_am, stride_ak, stride_it, stride_ik, stride_rt, stride_rk, stride_we, stride_wn, stride_wk,
    stride_be, stride_bn, stride_ot, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """The decode path's GEMM2 and combine in one (:func:`decode_forward`): program (t, n)
    sums, over token t's slots j = 0..k-1 in that order, pair p's row of the down projection
    times its routing weight (fp32, rounded to out's dtype as GEMM2 stores a pair row), in
    fp32, for BLOCK_N columns, as :func:`_moe_gemm` then :func:`_combine_kernel` do. A slot
    whose id is outside [0, E) is skipped (its activation row and weight are never read)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, top_k):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik)
        if (e >= 0) & (e < num_experts):
            w_base = w_ptr + e.to(tl.int64) * stride_we
            y, _ = _gemv(act_ptr + (t * top_k + j) * stride_am, w_base, cols, cols, col_ok, K, stride_ak, stride_wn,
                         stride_wk, BLOCK_N, BLOCK_K, False)
            if HAS_BIAS:
                y += tl.load(bias_ptr + e.to(tl.int64) * stride_be + cols * stride_bn, mask=col_ok,
                             other=0.0).to(tl.float32)
            rw = tl.load(rw_ptr + t * stride_rt + j * stride_rk).to(tl.float32)
            total += (y * rw).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols * stride_on, total.to(out_ptr.dtype.element_ty), mask=col_ok)


@jit
def _expert_pairs(ids_ptr, i, num_pairs, top_k, num_experts, stride_it, stride_ik,
                  BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """The grouped decode kernels' work item: of the experts some pair is routed to, the
    ``i``-th in ascending id (-1 past the last), with the pairs' ids (BLOCK_P,: -1 past the
    S = T*k pairs) and which of them go to it. Found from the ids alone, so no routing
    kernel runs first; ids outside [0, E) belong to no expert. Which experts are used is a
    histogram of the ids (~P log E work per program; the (E, P) comparison it replaces cost
    each program of Qwen3-MoE's T = 64 65536 compares, and left the grouped kernels 7.5 %
    behind the GEMM path on the H200); the pairs of no expert fall in bin BLOCK_E, past every
    expert (the bins must hold every input: a mask is not on every Triton this runs on)."""
    ps = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + (ps // top_k) * stride_it + (ps % top_k) * stride_ik, mask=ps < num_pairs, other=-1)
    ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1).to(tl.int32)  # int32 compares, no wrap-around
    counts = tl.histogram(tl.where(ids >= 0, ids, BLOCK_E), 2 * BLOCK_E)
    es = tl.arange(0, 2 * BLOCK_E)
    used = ((counts > 0) & (es < num_experts)).to(tl.int32)
    mine = (used > 0) & (tl.cumsum(used, axis=0) - 1 == i)
    e = tl.sum(tl.where(mine, es, 0), axis=0) - (1 - tl.max(mine.to(tl.int32), axis=0)) * (2 * BLOCK_E + 1)
    return tl.maximum(e, -1), ids, ids == e


@jit
def _expert_slots(hit, rank, m0, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Slots m0 .. m0 + BLOCK_M - 1 of an expert's pairs, in pair order: each slot's pair
    index and whether it has one (``hit``: the expert's pairs, ``rank``: their ranks)."""
    ms = m0 + tl.arange(0, BLOCK_M)
    sel = hit[None, :] & (rank[None, :] == ms[:, None])
    pair = tl.sum(tl.where(sel, tl.arange(0, BLOCK_P)[None, :], 0), axis=1)
    return pair, tl.max(sel.to(tl.int32), axis=1) > 0


@jit
def _decode_grouped_kernel(
    a_ptr, ids_ptr, rw_ptr, w_ptr, bias_ptr, out_ptr, num_pairs, top_k, num_experts, N, K, alpha, limit,
    stride_at, stride_ak, stride_it, stride_ik, stride_rt, stride_rk, stride_we, stride_wn, stride_wk,
    stride_be, stride_bn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr, UP: tl.constexpr, GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The grouped decode path (:func:`decode_forward` with GROUPED): program (i, n) takes
    the i-th used expert e (:func:`_expert_pairs`) and BLOCK_N output columns, and runs all
    of e's pairs through them, BLOCK_M at a time, with tensor cores: each weight tile is read
    once per call, however many pairs share the expert (the ungrouped kernels read it once
    per pair). UP: GEMM1 and the gate, A = hidden_states rows (token = pair // k), out =
    the (S, I) activation; else GEMM2, A = the activation rows, out = the (S, H) pair rows
    times the routing weight, rounded to out's dtype as the GEMM path's GEMM2 stores them
    (:func:`combine` sums them). Pair rows of ids outside [0, E) are never written."""
    e, ids, hit = _expert_pairs(ids_ptr, tl.program_id(0), num_pairs, top_k, num_experts, stride_it, stride_ik,
                                BLOCK_E, BLOCK_P)
    if e < 0:
        return
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    count = tl.sum(hit.to(tl.int32), axis=0)
    w_base = w_ptr + e.to(tl.int64) * stride_we  # int64: E * N * K may pass 2**31
    for m0 in range(0, count, BLOCK_M):
        pair, ok = _expert_slots(hit, rank, m0, BLOCK_M, BLOCK_P)
        row = ((pair // top_k) if UP else pair).to(tl.int64)
        if not UP:
            rw = tl.load(rw_ptr + (pair // top_k).to(tl.int64) * stride_rt + (pair % top_k) * stride_rk, mask=ok,
                         other=0.0).to(tl.float32)
        # this program's column tiles: n, n + programs along dim 1, ... (one each unless the
        # launch has fewer programs than tiles: then the search above is paid once for several)
        for nt in range(tl.program_id(1), tl.cdiv(N, BLOCK_N), tl.num_programs(1)):
            cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            if UP:
                wcol0, wcol1 = gate_up_cols(cols, N, INTERLEAVED)
            else:
                wcol0, wcol1 = cols, cols
            acc0, acc1 = routed_mma(a_ptr, row, ok, stride_at, stride_ak, w_base, wcol0, wcol1, col_ok, stride_wn,
                                    stride_wk, K, BLOCK_M, BLOCK_N, BLOCK_K, GATED, DOT_PRECISION)
            if HAS_BIAS:
                b_base = bias_ptr + e.to(tl.int64) * stride_be
                acc0 += tl.load(b_base + wcol0 * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    acc1 += tl.load(b_base + wcol1 * stride_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if UP:
                y = gate_tile(acc0, acc1, alpha, limit, GATED, ACT, HAS_LIMIT)
            else:
                y = acc0 * rw[:, None]
            tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on,
                     y.to(out_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])

@jit
def _sorted_rows_kernel(
    src_ptr, route_w_ptr, out_ptr, pair_ids_ptr, block_expert_ptr, shift_ptr, used_ptr, num_pairs, top_k, C,
    block_m, stride_st, stride_sc, stride_rt, stride_rk, stride_om, stride_oc,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCALED: tl.constexpr,
):
    """Token rows in sorted order: out[r + shift[e]] = src[t] for padded row r (of a block of
    expert e) holding pair p = t*k + j (GEMM1's pre-gathered A; the grouped weight
    gradients' gathered operand); SCALED: times rw[t, j] in fp32, then rounded to out's
    dtype (the backward's ``_moe_wgrad`` L_SCALED operand, the same bits). A padding row (its
    id is the sentinel) has no sorted row: nothing read, nothing written, and a sentinel
    slot's weight is never read. Padded rows at or past ``*used_ptr`` (the last expert's
    padded end) hold no pair: those programs return. Grid: (padded row blocks, C blocks)."""
    r0 = tl.program_id(0) * BLOCK_R
    used = tl.load(used_ptr)
    if r0 >= used:
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_list = rows < used
    pair = tl.load(pair_ids_ptr + rows, mask=in_list, other=num_pairs)
    row_ok = pair < num_pairs
    p = tl.where(row_ok, pair, 0)
    expert = tl.load(block_expert_ptr + rows // block_m, mask=row_ok, other=0)
    srow = (rows + tl.load(shift_ptr + expert, mask=row_ok, other=0)).to(tl.int64)
    tok = (p // top_k).to(tl.int64)
    col_ok = cols < C
    m = row_ok[:, None] & col_ok[None, :]
    v = tl.load(src_ptr + tok[:, None] * stride_st + cols[None, :] * stride_sc, mask=m, other=0.0)
    if SCALED:
        w = tl.load(route_w_ptr + tok * stride_rt + (p % top_k) * stride_rk, mask=row_ok, other=0.0)
        v = v.to(tl.float32) * w.to(tl.float32)[:, None]
    tl.store(out_ptr + srow[:, None] * stride_om + cols[None, :] * stride_oc, v.to(out_ptr.dtype.element_ty),
             mask=m)


@jit
def _act_kernel(
    pre_ptr, act_ptr, pair_ids_ptr, block_expert_ptr, shift_ptr, num_pairs, N, block_m, alpha, limit,
    stride_pm, stride_pn, stride_am, stride_an,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    GATED: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
):
    """GEMM1's epilogue as a pass of its own, where GEMM1 ran on ``torch._grouped_mm``
    (``configs["gemm1"]["GROUPED_MM"]``): act[r, cols] = the gate of ``pre``'s row r (the
    GEMM's 16-bit output, which is the gate's input, as the fused epilogue's rounded one
    under ``PRE_BF16``), for the sorted rows of BLOCK_R padded rows (a slice of one M block
    of ``block_m`` rows; padded row r of expert e is sorted row r + shift[e], a padding row
    none) x BLOCK_N columns. Rows of blocks past the work list: nothing."""
    r0 = tl.program_id(0) * BLOCK_R
    expert = tl.load(block_expert_ptr + r0 // block_m)
    if expert < 0:
        return
    rows = r0 + tl.arange(0, BLOCK_R)
    row_ok = tl.load(pair_ids_ptr + rows) < num_pairs
    srows = (rows + tl.load(shift_ptr + expert)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    c0, c1 = gate_up_cols(cols, N, INTERLEAVED)
    m = row_ok[:, None] & col_ok[None, :]
    pre_rows = pre_ptr + srows[:, None] * stride_pm
    p0 = tl.load(pre_rows + c0[None, :] * stride_pn, mask=m, other=0.0).to(tl.float32)
    p1 = p0
    if GATED:
        p1 = tl.load(pre_rows + c1[None, :] * stride_pn, mask=m, other=0.0).to(tl.float32)
    y = gate_tile(p0, p1, alpha, limit, GATED, ACT, HAS_LIMIT)
    tl.store(act_ptr + srows[:, None] * stride_am + cols[None, :] * stride_an, y.to(act_ptr.dtype.element_ty),
             mask=m)


@jit
def _pair_rows_kernel(pair_ids_ptr, block_expert_ptr, shift_ptr, used_ptr, rows_ptr, num_pairs, block_m,
                      BLOCK: tl.constexpr):
    """rows[p] = the sorted row of pair p: r + shift[e] for the padded row r holding it
    (``pair_ids[r] == p``, in a block of expert e), for each padded row before ``*used_ptr``
    (the last expert's padded end) that holds a pair; a pair routed nowhere (a sentinel
    slot) keeps its entry unwritten, and its readers skip it by its id. Each pair sits at
    one row, so every entry is written at most once."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    used = tl.load(used_ptr)
    ok = r < used
    p = tl.load(pair_ids_ptr + r, mask=ok, other=num_pairs)
    ok = ok & (p < num_pairs)
    expert = tl.load(block_expert_ptr + r // block_m, mask=ok, other=0)
    tl.store(rows_ptr + tl.where(ok, p, 0), r + tl.load(shift_ptr + expert, mask=ok, other=0), mask=ok)


# ----------------------------------------------------------------------------- configs

@functools.lru_cache(maxsize=None)
def _config_table(path: str = CONFIG_FILE) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def rows_bucket(rows_per_expert: float, keys: list[str]) -> str:
    bounds = sorted(float(k) for k in keys if k != "inf")
    for b in bounds:
        if rows_per_expert <= b:
            return str(int(b))
    return "inf"


_SMEM_BUDGET = 200 * 1024  # bytes; H200 has 227 KB per block, leave room for the epilogue


def fit_smem(cfg: dict[str, int], itemsize: int, operands_b: int) -> dict[str, int]:
    """Shrink num_stages, then BLOCK_K, until the pipelined A and B tiles fit in shared
    memory (fp32 halves what bf16 defaults fit): a config must never fail to compile."""
    cfg = dict(cfg)

    def smem() -> int:
        return cfg["num_stages"] * cfg["BLOCK_K"] * (cfg["BLOCK_M"] + operands_b * cfg["BLOCK_N"]) * itemsize

    while smem() > _SMEM_BUDGET and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while smem() > _SMEM_BUDGET and cfg["BLOCK_K"] > 16:
        cfg["BLOCK_K"] //= 2
    return cfg


_UNBUCKETED = ("combine", "decode", "decode_grouped")  # one config whatever the rows per expert


def pick_config(gemm: str, rows_per_expert: float, n: int, k: int, dtype: torch.dtype,
                block_m: Optional[int] = None, table: Optional[dict[str, Any]] = None) -> dict[str, int]:
    """The block config of ``gemm`` ("gemm1": N = gate_up width, K = H; "gemm2": N = H,
    K = I; "combine" and "decode", one config each; the backward's "dgrad2", "dgrad1", "wgrad")
    for this rows-per-expert
    (S / E), shape and dtype: the table's tuned
    entry for (dtype, N, K) if any, else its default for the bucket. ``block_m`` forces
    BLOCK_M (gemm2 walks gemm1's padded rows)."""
    if table is None:  # the package's table: cached per bucket (it runs on every op call)
        if dynamo_tracing():  # a constant to Dynamo, which need not read the file
            return dict(_picked(gemm, float(rows_per_expert), n, k, str(dtype).split(".")[-1], block_m))
        return _pick_package(gemm, rows_per_expert, n, k, dtype, block_m)
    return _pick(gemm, rows_per_expert, n, k, dtype, block_m, table)


def _pick_package(gemm: str, rows_per_expert: float, n: int, k: int, dtype: torch.dtype,
                  block_m: Optional[int]) -> dict[str, int]:
    t = _config_table()
    bucket = "-" if gemm in _UNBUCKETED else rows_bucket(rows_per_expert, list(t["default"][gemm]))
    return dict(_pick_cached(gemm, bucket, n, k, dtype, block_m))


@torch.compiler.assume_constant_result
def _picked(gemm: str, rows_per_expert: float, n: int, k: int, dtype: str, block_m: Optional[int]
            ) -> tuple[tuple[str, int], ...]:
    """:func:`pick_config`'s package-table pick as a constant for Dynamo: (key, value) pairs."""
    return tuple(_pick_package(gemm, rows_per_expert, n, k, getattr(torch, dtype), block_m).items())


@functools.lru_cache(maxsize=1024)
def _pick_cached(gemm: str, bucket: str, n: int, k: int, dtype: torch.dtype,
                 block_m: Optional[int]) -> dict[str, int]:
    rows = 0.0 if bucket == "-" else (math.inf if bucket == "inf" else float(bucket))
    return _pick(gemm, rows, n, k, dtype, block_m, _config_table())


def _pick(gemm: str, rows_per_expert: float, n: int, k: int, dtype: torch.dtype, block_m: Optional[int],
          table: dict[str, Any]) -> dict[str, int]:
    dname = str(dtype).replace("torch.", "")
    if gemm in _UNBUCKETED:  # one config; "decode" may be tuned per shape (bucket "-")
        tuned = table.get("tuned", {}).get(dname, {}).get(f"N={n},K={k}", {}).get(gemm, {})
        return dict(tuned.get("-", table["default"][gemm]))
    default = table["default"][gemm]
    bucket = rows_bucket(rows_per_expert, list(default))
    tuned = table.get("tuned", {}).get(dname, {}).get(f"N={n},K={k}", {}).get(gemm, {})
    # The default's buckets for both: a shape tuned at 256 rows per expert says nothing of decode.
    cfg = dict(tuned.get(bucket, default[bucket]))
    cfg.setdefault("BLOCK_M", block_m or 64)
    if block_m is not None:
        cfg["BLOCK_M"] = block_m
    return fit_smem(cfg, dtype.itemsize, 2 if gemm == "gemm1" else 1)


# ----------------------------------------------------------------------------- launcher

@plain  # a replay carves the scratch ones from one allocation (.replay)
def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every float buffer the launcher fills (tests replace this with a NaN-filled one, so
    an element a kernel forgets to write shows up)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`new_buffer`'s buffer, noted where a call is recorded (:func:`.replay.make`)."""
    return make(new_buffer, shape, dtype, device)


def nk_view(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A (E, out, in) weight, or an (E, in, out) one when ``transposed``, seen as (E, N, K):
    the kernels see both layouts through this view's strides."""
    return w.transpose(1, 2) if transposed else w


# Read once at import (a plain constant: torch.compile traces why_not_fused on the training path).
_HAVE_CONFIG_FILE = os.path.exists(CONFIG_FILE)


def why_not_fused(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_proj: torch.Tensor,
                  down_bias: Optional[torch.Tensor], activation: str, gated: bool, transposed: bool,
                  *rest: Any) -> Optional[str]:
    """Why the fused kernels don't take these (checked) inputs, or None. The message names
    no sizes, so logging it once per message is once per cause."""
    if NO_TRITON is not None:
        return NO_TRITON
    if hidden_states.dtype not in _FUSED_DTYPES:
        return f"hidden_states is {hidden_states.dtype}; the fused kernels take float16, bfloat16, float32"
    if not hidden_states.is_cuda and not interpreting():
        return f"hidden_states is on {hidden_states.device.type}, not CUDA"
    if gate_up_proj.shape[0] == 0 or down_proj.shape[1 if transposed else 2] == 0:
        return "no experts, or an intermediate size of 0"
    if gate_up_proj.shape[0] > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    if top_k_index.numel() >= 2**30:  # pair ids and padded rows are int32
        return "2**30 or more (token, slot) pairs"
    if not _HAVE_CONFIG_FILE:  # an install without the package data: don't fail the call
        return f"the block-size table {CONFIG_FILE} is missing"
    return None


def device_ctx(x: torch.Tensor) -> Any:
    # Triton launches on the *current* device's current stream: make it the tensors' device
    # (entering torch.cuda.device costs two device switches of host time: only when needed).
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


class Saved(NamedTuple):
    """What :func:`fused_experts_forward` keeps for the backward (``save=True``): the
    routing (``sorted_pair_ids`` (R,) padded, ``block_expert`` (R / BLOCK_M,), ``tables``
    (5, E): run end, padded start, count, padded end, shift; int32: :func:`.moe_routing.routing_tables`),
    GEMM1's output ``act`` (S, I) in hidden_states' dtype and its pre-activation ``pre``
    (S, N) float32, or bf16 (:func:`pre_dtype`) in gate_up_proj's column order (S = T*k
    sorted rows, the real pairs' by expert; rows past the last run end unwritten), the
    block configs used, ``routing``, the one buffer the three routing tables view
    (:func:`.moe_routing.routing_views` rebuilds them from it; None where the caller kept the views), and
    ``rows``, GEMM1's sorted copy of the token rows (S, H) where the forward kept it
    (``keep_rows``; else None): the backward's dW1 reads it instead of making it again."""

    sorted_pair_ids: torch.Tensor
    block_expert: torch.Tensor
    tables: torch.Tensor
    act: torch.Tensor
    pre: torch.Tensor
    configs: dict[str, dict[str, int]]
    routing: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None


# The saved pre-activation's dtype for every call but bf16 ones without a clamp (PRE_BF16
# below): float32, the forward's own accumulators, so the backward evaluates the gate's
# derivative at exactly the values the forward's gate saw. Rounded to bfloat16 (2**-9
# relative) it would (a) flip a clamp's derivative between 0 and 1 for a value within one
# rounding of the limit (a whole element of the gradient wrong), and (b) carry the rounding
# into d top_k_weights = dout . expert(x), a dot over H that can cancel: in the float16
# interpreter tests, 1 seed in 40 of the T=1 case missed the float16 tolerance that way (0
# of 40 with float32). Cost: 4 bytes per padded row and gate_up column,
# twice a half-precision copy's: on the H200 the gate's backward pass reads it at the copy
# bound (137 µs of Mixtral's T = 4096 step).
PRE_DTYPE = torch.float32

# True: a bfloat16 call whose gate has no clamp saves ``pre`` in bfloat16 (:func:`pre_dtype`),
# and the training forward's gate then runs on those rounded values (GEMM1's epilogue), as
# HF's bf16 autograd does: no clamp side to flip (the reason above), and the backward
# differentiates exactly what the forward computed. The split dgrad2's g is then bf16 too
# (HF's grouped_mm writes it so). Accuracy, emulated (`python bench/pre_dtype_numerics.py
# --seeds 40`, silu and gelu_tanh, T = 1 / 64 / 1024; bench/RESULTS.md, thirty-first
# session): at or below HF's bf16 error in every output and gradient but one, d
# top_k_weights at T = 1, where its dot cancels: against its own size 7.2 / 207 times the
# tolerance (silu / gelu_tanh) against HF's 5.2 / 100, against the magnitude of its terms
# 0.06 against HF's 0.09 (the tests measure it so). Speed (H200, T = 4096, the compiled training step,
# `bench/moe_profile.py --inductor --modes fwd+bwd --pre-bf16 {0,1}`, GPU events, thirty-first
# session): Mixtral 2402 -> 2290 µs (GEMMs 1064 -> 1000, the gate's pass 138 -> 115), Qwen3-MoE
# 2635 -> 2549, OLMoE 2710 -> 2631, against HF's 2549 / 2507, 3221 / 3194 and 3296 / 3295 in
# the same processes. A training call's output thus differs from the same no-grad call's by that
# rounding (both within the bf16 tolerance of float64). False: pre and g in float32.
PRE_BF16 = True


def pre_dtype(dtype: torch.dtype, gated: bool, limit: float) -> torch.dtype:
    """The saved pre-activation's dtype for inputs of ``dtype`` (:data:`PRE_BF16`)."""
    if PRE_BF16 and dtype == torch.bfloat16 and not (gated and math.isfinite(limit)):
        return torch.bfloat16
    return PRE_DTYPE


def grouped_mm_unfit(x: torch.Tensor, n1: int, i: int, w: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why a GEMM of the op can't run on ``torch._grouped_mm`` for these inputs, or None: the
    weight gradients, or given the weight ``w`` it reads, a forward GEMM or a dgrad. It takes
    bfloat16 only here (fp16 and fp32 keep the Triton kernels: fp16 grouped_mm needs
    cuBLASLt's, and fp32 GEMMs stay IEEE), and rows 16-byte aligned: H, the gate_up width N1
    and I multiples of 8, as :func:`opreg.ops.moe_experts_grouped.uses_grouped_mm` asks;
    ``w`` with one of its last two dims contiguous, the other's stride and its address
    16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no _grouped_mm"
    if x.dtype != torch.bfloat16:
        return f"hidden_states is {x.dtype}, not bfloat16"
    if x.shape[1] % 8 or n1 % 8 or i % 8:
        return f"H = {x.shape[1]}, N1 = {n1}, I = {i}: not all multiples of 8 (16-byte rows)"
    if w is not None:
        s0, s1, s2 = w.stride()
        if not ((s2 == 1 and s1 % 8 == 0) or (s1 == 1 and s2 % 8 == 0)) or s0 % 8 or misaligned(w):
            return f"the weight's strides {w.stride()}: neither of its last two dims contiguous and 16-byte aligned"
    return None


def grouped_gemm1(c1: dict[str, int], x: torch.Tensor, w1: torch.Tensor, bias: Optional[torch.Tensor], n1: int,
                  i: int, pre_dt: Optional[torch.dtype], keep_rows: bool) -> bool:
    """Does a training forward's GEMM1 run on ``torch._grouped_mm`` (CUTLASS) over the sorted
    copy of the rows, its bf16 output being ``pre``, with the gate as a pass of its own
    (:func:`_act_kernel`)? Only where ``c1["GROUPED_MM"]`` asks (default off), and then it
    needs the copy kept for the grouped weight gradients (``keep_rows``: sm90, bf16), ``pre``
    saved in bf16 (:func:`pre_dtype`: no clamp), no gate_up_bias (torch._grouped_mm adds
    none here), and the weight's layout as :func:`grouped_mm_unfit` asks: else ValueError.
    Why off: on the H200 at T = 4096 (``bench/moe_launches.py``, thirty-second session)
    CUTLASS alone ran GEMM1 in 403 / 421 / 484 us (Mixtral / Qwen3-MoE / OLMoE, unpadded
    rows) against the fused epilogue's 512 / 473 / 543, but in the step, over the padded
    rows, 445 / 459 / 521 plus the gate's pass 50 / 42 / 53: 495 / 501 / 573 against 512 /
    473 / 543; the step's median over 5 rounds of each setting moved by +41 / -7 (Mixtral,
    dgrad2 on CUTLASS / Triton), +53 / +23 (Qwen3-MoE), +43 / +16 us (OLMoE) with it."""
    forced = c1.get("GROUPED_MM")
    if not forced:
        return False
    why = ("no sorted copy of the rows (keep_rows: the grouped weight gradients')" if not keep_rows
           else "gate_up_bias is given (torch._grouped_mm adds none here)" if bias is not None
           else f"pre is saved in {pre_dt}, not bfloat16 (a clamp, or PRE_BF16 off)" if pre_dt != torch.bfloat16
           else grouped_mm_unfit(x, n1, i, w1))
    if why is not None:
        raise ValueError(f"fused_experts_forward: configs['gemm1']['GROUPED_MM'] = 1, but {why}")
    return True


def misaligned(t: torch.Tensor) -> bool:
    """Is ``t``'s base off a 16-byte boundary? Traced by Dynamo the address is not known
    (False): Inductor's buffers are aligned, and it copies an input found misaligned at run
    time where it was aligned when compiled."""
    return not dynamo_tracing() and t.data_ptr() % 16 != 0


def tma_ok(t: torch.Tensor, dims: tuple[int, ...]) -> bool:
    """Whether a tensor descriptor can walk ``t`` (its last dim contiguous, base and other
    strides 16-byte aligned) with a box of ``dims``. TMA needs sm90+; the interpreter
    emulates it."""
    if _TensorDescriptor is None or t.stride(-1) != 1 or misaligned(t):
        return False
    if any(s * t.element_size() % 16 for s in t.stride()[:-1]) or any(d > 256 for d in dims):
        return False
    if interpreting():
        return True
    return t.is_cuda and _has_tma(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index) >= (9, 0)


_has_tma = traced_constant(_has_tma)


_descriptor = descriptor  # a tensor descriptor from a validated template (see .launch)
_DESCRIPTORS = DESCRIPTORS


def launch_gemm(cfg: dict[str, int], *, a: torch.Tensor, w_nk: torch.Tensor,
                bias: Optional[torch.Tensor], rw: torch.Tensor, out: torch.Tensor, pre: Optional[torch.Tensor],
                sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, shift: torch.Tensor, top_k: int, n: int,
                k: int, gather: bool, routed: bool, scaled: bool = False, gated: bool = False,
                interleaved: bool = False,
                act: int = IDENTITY, alpha: float = 1.0, limit: float = math.inf, spec: Any = None,
                used: Optional[torch.Tensor] = None) -> None:
    """One :func:`_moe_gemm` launch over the padded rows (``cfg["BLOCK_M"]`` = the routing's
    BLOCK_M); ``shift``: the routing's fifth table (sorted row = padded row + shift[e]),
    for ``a`` where not ``gather`` and ``out`` and ``pre`` where not ``routed``.
    ``w_nk``: the weight seen as (E, N, K) (a view: either layout); ``bias``/``pre``
    None: none. ``cfg["TMA"]`` (default 1): load W's tiles, and A's where A is the sorted
    rows (not ``gather``), through tensor descriptors where :func:`tma_ok` allows (not
    for interleaved gate/up columns). ``cfg["PERSISTENT"]`` (default 0): a program per SM
    walks the tiles; it needs ``used``, the routing tables' last padded end
    (``tables[3, -1:]``). ``cfg["HALF_TAIL"]`` (default 0): a block whose second half is
    padding computes half a tile (:func:`_moe_gemm`; BLOCK_M >= 32, not PERSISTENT).
    ``spec``: a key that determines every argument's metadata (see
    :func:`.launch.launch`): what follows from metadata alone is then reused."""
    if cfg.get("PERSISTENT", 0) and used is None:
        raise ValueError("launch_gemm: a PERSISTENT config needs `used` (the routing's tables[3, -1:])")
    if (why := half_tail_unfit(cfg)) is not None:
        raise ValueError(f"launch_gemm: {why}")
    b = bias if bias is not None else w_nk  # a valid pointer, never read
    p = pre if pre is not None else out  # likewise, never written
    static = _GEMM_STATIC.get(spec) if spec is not None else None
    if static is None:
        static = _gemm_static(cfg, a, w_nk, b, rw, out, p, block_expert, top_k, n, k, gather, routed, scaled,
                              gated, interleaved, act, bias is not None, pre is not None, limit)
        if spec is not None:
            remember(_GEMM_STATIC, spec, static)
    grid, kmajor, w_box, a_box, w_key, a_key, head, tail, kwargs = static
    # built only where the launch needs the descriptor objects (not Triton's C launcher)
    w_desc = None if w_box is None else LazyDescriptor(w_nk if kmajor else w_nk.transpose(1, 2), w_box, w_key)
    a_desc = None if a_box is None else LazyDescriptor(a, a_box, a_key)
    a_half = None  # HALF_TAIL's: A's rows in boxes of half the block
    if a_box is not None and kwargs["HALF_TAIL"]:
        box = [a_box[0] // 2, a_box[1]]
        a_half = LazyDescriptor(a, box, a_key[:-1] + (tuple(box),))
    finite = kwargs["HAS_LIMIT"]
    u = used if used is not None else block_expert  # a valid pointer, read only when PERSISTENT
    launch_args(_moe_gemm, grid, (a, w_nk, b, rw, out, p, sorted_pair_ids, block_expert, shift, w_desc, a_desc,
                                  a_half, u, *head, float(alpha), float(limit) if finite else 0.0, *tail), spec,
                kwargs)


def half_tail_unfit(cfg: dict[str, int]) -> Optional[str]:
    """Why a GEMM config's ``HALF_TAIL`` can't run as asked, or None (also where it is off)."""
    if not cfg.get("HALF_TAIL", 0):
        return None
    if cfg.get("PERSISTENT", 0):
        return "HALF_TAIL needs PERSISTENT = 0 (the persistent tile loop has no half tile)"
    if cfg["BLOCK_M"] < 32:
        return (f"HALF_TAIL needs BLOCK_M >= 32, not {cfg['BLOCK_M']} (half a tile is at least 16 rows, a "
                "tensor-core product's least)")
    return None


_GEMM_STATIC: dict[Any, tuple[Any, ...]] = {}


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """The programs of a persistent launch: the device's SMs (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_num_sms = traced_constant(_num_sms)


def _gemm_static(cfg: dict[str, int], a: torch.Tensor, w_nk: torch.Tensor, b: torch.Tensor, rw: torch.Tensor,
                 out: torch.Tensor, p: torch.Tensor, block_expert: torch.Tensor, top_k: int, n: int, k: int,
                 gather: bool, routed: bool, scaled: bool, gated: bool, interleaved: bool, act: int,
                 has_bias: bool, save_pre: bool, limit: float) -> tuple[Any, ...]:
    """What :func:`launch_gemm` derives from metadata alone: (grid, W k-major, W's
    descriptor box or None, A's or None, the int arguments before and after the two
    floats, the constexprs and launch options)."""
    nb = block_expert.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tma = bool(cfg.get("TMA", 1))
    persistent = bool(cfg.get("PERSISTENT", 0))
    kmajor = w_nk.stride(2) == 1
    w_tiles = w_nk if kmajor else w_nk.transpose(1, 2)  # last dim contiguous, if either is
    w_box = [1, bn, bk] if kmajor else [1, bk, bn]
    # a (E, K, N) weight's up half starts at column N: a tile's first column must sit on 16
    # bytes (Triton's interpreter asserts it; a gated I = 18 transposed fp32 weight failed there)
    up_ok = kmajor or not gated or (n * w_nk.element_size()) % 16 == 0
    use_w = tma and not (gated and interleaved) and up_ok and tma_ok(w_tiles, tuple(w_box))
    # (a box past the last sorted row reads the descriptor's zeros: only padding rows meet them)
    use_a = tma and not gather and tma_ok(a, (bm, bk)) and a.shape[0] >= bm
    sw = w_nk.stride()
    head = (rw.shape[0] * top_k, top_k, n, k, nb)
    tail = (a.stride(0), a.stride(1), sw[0], sw[1], sw[2], b.stride(0), b.stride(-1),
            rw.stride(0), rw.stride(1), out.stride(0), out.stride(1), p.stride(0), p.stride(1))
    # fp32 stays fp32 (IEEE), as torch's default matmul is; half types ignore the setting.
    kwargs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
                  GATHER=gather, ROUTED=routed, SCALED=scaled, GATED=gated, INTERLEAVED=gated and interleaved,
                  ACT=act, HAS_BIAS=has_bias, HAS_LIMIT=gated and math.isfinite(limit), SAVE_PRE=save_pre,
                  DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", EVEN_K=k % bk == 0,
                  W_TMA=use_w, W_KMAJOR=kmajor, A_TMA=use_a, PERSISTENT=persistent,
                  HALF_TAIL=bool(cfg.get("HALF_TAIL", 0)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # what a descriptor's encoding reads besides the address (LazyDescriptor.key)
    w_key = (w_tiles.dtype, tuple(w_tiles.shape), w_tiles.stride(), tuple(w_box)) if use_w else None
    a_key = (a.dtype, tuple(a.shape), a.stride(), (bm, bk)) if use_a else None
    tiles = nb * cdiv(n, bn)  # the static worst case; a persistent program per SM at most
    grid = (min(tiles, _num_sms(a.device)) if persistent else tiles,)
    return (grid, kmajor, w_box if use_w else None, [bm, bk] if use_a else None, w_key, a_key,
            head, tail, kwargs)


# The copy's tile (rows, columns, warps) per program. H200, T = 4096, bf16 (bench/sorted_rows.py,
# 2026-12-02): seven tiles from 4 x 1024 to 64 x 128 all within 4 % of this one (Mixtral 15.1,
# Qwen3-MoE 51.4, OLMoE 47.4 us; 166 MB of Qwen3-MoE's rows written in 51 us).
ROWS_TILE = (32, 128, 4)


def sorted_rows(src: torch.Tensor, rw: torch.Tensor, sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor,
                tables: torch.Tensor, top_k: int, scaled: bool, spec: Any = None,
                tile: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """(S, C) copy of ``src``'s token rows (T, C) in sorted order (times the routing weight
    if ``scaled``), S = T*k, unwritten past the last run end (``tables[0, -1]``; the
    routing's, :func:`.moe_routing.routing_tables`) (:func:`_sorted_rows_kernel`): GEMM1's A where its
    config says ``PREGATHER``, and a grouped weight gradient's gathered operand. ``spec``:
    as :func:`launch_gemm`'s; ``tile``: (rows, columns, warps) per program, default
    :data:`ROWS_TILE` (``bench/sorted_rows.py`` times others)."""
    r, c = sorted_pair_ids.shape[0], src.shape[1]
    s = rw.shape[0] * top_k
    out = _buffer((s, c), src.dtype, src.device)
    br, bc, warps = tile or ROWS_TILE
    bc = min(bc, next_pow2(c))
    used = tables[3, -1:]  # the last expert's padded end: the padded rows in use
    launch(_sorted_rows_kernel, (cdiv(r, br), cdiv(c, bc)),
           src, rw, out, sorted_pair_ids, block_expert, tables[4], used, s, top_k, c, r // block_expert.shape[0],
           src.stride(0), src.stride(1), rw.stride(0), rw.stride(1), out.stride(0), out.stride(1), spec_key=spec,
           BLOCK_R=br, BLOCK_C=bc, SCALED=scaled, num_warps=warps)
    return out


ACT_TILE = (8, 256, 4)  # _act_kernel's (rows, columns, warps) per program: the gate's backward pass's tile


def act_pass(pre: torch.Tensor, act: torch.Tensor, sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor,
             shift: torch.Tensor, num_pairs: int, i: int, block_m: int, gated: bool, interleaved: bool,
             activation: str, alpha: float, limit: float, spec: Any = None) -> None:
    """act (S, I) = the gate of ``pre`` (S, N1) at every sorted row (``shift``: the
    routing's fifth table) (:func:`_act_kernel`): GEMM1's epilogue where GEMM1 ran on
    ``torch._grouped_mm``. ``spec``: as :func:`launch_gemm`'s."""
    br, bn, warps = ACT_TILE
    br, bn = min(br, block_m), min(bn, next_pow2(i))
    finite = gated and math.isfinite(limit)
    launch(_act_kernel, (cdiv(sorted_pair_ids.shape[0], br), cdiv(i, bn)),
           pre, act, sorted_pair_ids, block_expert, shift, num_pairs, i, block_m, float(alpha),
           float(limit) if finite else 0.0, pre.stride(0), pre.stride(1), act.stride(0), act.stride(1),
           spec_key=spec, BLOCK_R=br, BLOCK_N=bn, GATED=gated, INTERLEAVED=gated and interleaved,
           ACT=ACT_IDS[activation], HAS_LIMIT=finite, num_warps=warps)


def pair_rows(sorted_pair_ids: torch.Tensor, block_expert: torch.Tensor, tables: torch.Tensor, num_pairs: int,
              spec: Any = None) -> torch.Tensor:
    """(S,) int32: each routed pair's sorted row (:func:`_pair_rows_kernel`), unwritten at a
    sentinel slot's pair. ``block_expert``, ``tables``: the routing's. ``spec``: as
    :func:`launch_gemm`'s."""
    r = sorted_pair_ids.shape[0]
    out = new_buffer((num_pairs,), torch.int32, sorted_pair_ids.device)
    block = 1024
    launch(_pair_rows_kernel, (cdiv(r, block),), sorted_pair_ids, block_expert, tables[4], tables[3, -1:], out,
           num_pairs, r // block_expert.shape[0], spec_key=spec, BLOCK=block, num_warps=4)
    return out


def combine(pairs: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_experts: int,
            cfg: dict[str, int], spec: Any = None, rows: Optional[torch.Tensor] = None) -> None:
    """out[t] = the sum over t's slots with an id in [0, E) of pair p = t*k + j's row of
    ``pairs``, in slot order, fp32 (:func:`_combine_kernel`); a token with none gets 0. The
    row is p, or ``rows[p]`` where given (:func:`pair_rows`: ``pairs`` in sorted
    order). ``spec``: as :func:`launch_gemm`'s."""
    t, h = out.shape
    bh = min(cfg["BLOCK_H"], next_pow2(h))
    launch(_combine_kernel, (t, cdiv(h, bh)),
           pairs, ids, out, ids if rows is None else rows, h, ids.shape[1], num_experts, pairs.stride(0),
           pairs.stride(1), ids.stride(0), ids.stride(1), out.stride(0), out.stride(1), spec_key=spec, BLOCK_H=bh,
           MAPPED=rows is not None, num_warps=cfg["num_warps"])


# The most tokens whose forward takes the decode kernels by default (see decodes). H200,
# bf16, 2026-12-03, twenty-seventh session (`bench/moe_decode.py --tokens 8,16,32,64
# --block`): the grouped decode kernels (_decode_config; the expert search a histogram, the
# pairs per step from _grouped_rows) against the GEMM path from CUDA graphs, µs, table
# default / GEMM path (Mixtral, Qwen3-MoE, OLMoE): T = 8 101.0 / 100.1, 132.4 / 134.5,
# 147.0 / 142.9; T = 16 108.8 / 108.8, 211.9 / 197.2, 196.8 / 186.6; T = 32 111.0 / 109.2,
# 282.3 / 274.6, 215.3 / 207.9; T = 64 118.9 / 118.6, 308.8 / 304.4, 216.8 / 215.5. The GPU
# alone is at most 7.5 % slower (Qwen3-MoE at T = 16, where ~1.3 pairs share an expert and
# the GEMM path's routing packs them better), within 4 % elsewhere; the eager block, which
# waits on its host at these sizes (H200: 290-620 µs a call against 100-310 of kernels), ran
# 1.11-1.32x faster with them at every T and config: three launches and ~a third of the
# GEMM path's Python. Past 64 the rows per expert reach the GEMM path's tiles.
DECODE_MAX_TOKENS = 64
# The most tokens for the per-pair decode kernels (two launches, each pair reading its
# expert's weights) where the grouped ones can't take the call (GROUPED_MAX_SCAN): their
# measured win over the GEMM path (H200, twenty-second session); at T = 8 they were 26-60 %
# slower on the GPU, so past this the GEMM path runs instead.
PER_PAIR_MAX_TOKENS = 2


def decodes(t: int, save: bool, configs: Optional[dict[str, dict[str, int]]], pairs: Optional[int] = None,
            experts: Optional[int] = None) -> bool:
    """Does a forward of ``t`` tokens run :func:`decode_forward`? Without ``save`` (the
    backward reads the routing tables that only the GEMM path builds), for 1 <= T <=
    :data:`DECODE_MAX_TOKENS` where the grouped kernels take ``pairs`` (T*k) x ``experts``
    (:func:`grouped_fits`; not given: they do), else for T <= :data:`PER_PAIR_MAX_TOKENS`;
    ``configs`` pins the path for tests and tuning: with a "decode" entry the decode kernels
    at any T, without one the GEMM path.
    Why: at decode sizes the block is host-bound (H200: 300-650 µs against 30-150 µs of
    weight reads), and the decode kernels are 2-3 launches against the GEMM path's 4-5
    (routing, GEMM1, GEMM2, combine) with a third of the Python; from two tokens they read
    each used expert's weights once, as the GEMM path does, with tensor cores on all of its
    pairs. Past a few rows per expert the GEMM path's tiles win on the GPU (the
    measurements at DECODE_MAX_TOKENS)."""
    if save or t < 1:
        return False
    if configs is not None:
        return "decode" in configs
    if t <= PER_PAIR_MAX_TOKENS:
        return True
    return t <= DECODE_MAX_TOKENS and (pairs is None or experts is None or grouped_fits(pairs, experts))


def grouped_fits(pairs: int, experts: int) -> bool:
    """Do the grouped decode kernels take ``pairs`` (T*k) pairs over ``experts`` experts
    (:data:`GROUPED_MAX_SCAN`)?"""
    return next_pow2(max(1, experts)) * next_pow2(max(1, pairs)) <= GROUPED_MAX_SCAN


def decode_forward(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1: torch.Tensor,
                   b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor], activation: str,
                   gated: bool, transposed: bool, interleaved: bool, alpha: float, limit: float,
                   cfg: Optional[dict[str, int]] = None, spec: Any = None) -> torch.Tensor:
    """The op's forward for few tokens (:func:`decodes`), (T, H) in x's dtype, no routing
    kernels. Per pair, GEMM1 and the gate as a matrix-vector product into an activation row
    (:func:`_decode_up_kernel`); per token, GEMM2, the routing weights and the combine in one
    (:func:`_decode_down_kernel`). With the config's GROUPED, per used expert instead
    (:func:`_decode_grouped_kernel`, for each GEMM: each weight tile read once however many
    pairs share the expert) into pair rows, then :func:`combine` (a third launch). The same
    results as :func:`fused_experts_forward`'s GEMM path but for the order of each dot
    product's fp32 sums. ``cfg``: each kernel's columns and reduction step per program and
    warps (UP_BLOCK_N, UP_BLOCK_K, UP_WARPS, DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_WARPS),
    num_stages, GROUPED, WAVES (:func:`_columns_programs`) and, grouped, BLOCK_M (pairs
    per step; :func:`_grouped_rows` unless given) (default:
    :func:`_decode_config`). ``spec``: as :func:`launch_gemm`'s."""
    static = _DECODE_STATIC.get(spec) if spec is not None else None
    if static is None:
        cfg = cfg or _decode_config(x, ids, w1, transposed)
        static = _decode_static(x, ids, rw, w1, b1, w2, b2, activation, gated, transposed, interleaved, limit, cfg)
        if spec is not None:
            remember(_DECODE_STATIC, spec, static)
    (g1, head1, tail1, opts1), (g2, head2, tail2, opts2), act_shape, combined = static
    w1v, w2v = nk_view(w1, transposed), nk_view(w2, transposed)
    bias1, bias2 = b1 if b1 is not None else w1v, b2 if b2 is not None else w2v
    lim = float(limit) if opts1["HAS_LIMIT"] else 0.0
    act = _buffer(act_shape, x.dtype, x.device)
    out = _buffer(tuple(x.shape), x.dtype, x.device)
    with device_ctx(x):
        if combined is None:
            launch_args(_decode_up_kernel, g1, (x, ids, w1v, bias1, act, *head1, float(alpha), lim, *tail1),
                        spec and (spec, "decode up"), opts1)
            launch_args(_decode_down_kernel, g2, (act, ids, rw, w2v, bias2, out, *head2, *tail2),
                        spec and (spec, "decode down"), opts2)
            return out
        pairs_shape, gc, argc, optc = combined
        pairs = _buffer(pairs_shape, x.dtype, x.device)
        launch_args(_decode_grouped_kernel, g1, (x, ids, rw, w1v, bias1, act, *head1, float(alpha), lim, *tail1),
                    spec and (spec, "decode up"), opts1)
        launch_args(_decode_grouped_kernel, g2, (act, ids, rw, w2v, bias2, pairs, *head2, 0.0, 0.0, *tail2),
                    spec and (spec, "decode down"), opts2)
        launch_args(_combine_kernel, gc, (pairs, ids, out, ids, *argc), spec and (spec, "decode combine"), optc)
    return out


def _decode_config(x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, transposed: bool) -> dict[str, int]:
    """The table's decode config for this forward: "decode_grouped" from 2 tokens on, where
    the tokens may share experts and grouping reads each used expert's weights once (H200,
    bf16, from CUDA graphs, 2026-12-03, ``bench/moe_decode.py``: faster than the per-pair
    kernels, which read a shared expert's weights once per pair, by 3 and 9 % at T = 2 on
    Mixtral and Qwen3-MoE (2 % slower on OLMoE), by 9-14 % at T = 4, 17-36 % at T = 8);
    "decode" (the per-pair kernels) at one token, whose k pairs are k distinct experts: the
    same weight bytes in two launches instead of three (the eager block, host-bound there,
    ran 6-38 % slower grouped in three runs), and where the pairs and experts are too many
    for a grouped program (:data:`GROUPED_MAX_SCAN`; by default only up to
    :data:`PER_PAIR_MAX_TOKENS` there, :func:`decodes`)."""
    n1, e = (w1.shape[2] if transposed else w1.shape[1]), w1.shape[0]
    if x.shape[0] > 1 and grouped_fits(ids.numel(), e):
        return pick_config("decode_grouped", 0.0, n1, x.shape[1], x.dtype)
    return pick_config("decode", 0.0, n1, x.shape[1], x.dtype)


# The grouped decode kernels' reach, E x T*k (both rounded up to powers of two): each program
# holds all T*k pair ids, a histogram of them over 2 E bins and, per step, a (BLOCK_M, T*k)
# selection of its expert's pairs. Measured up to here (Qwen3-MoE at T = 64: 128 x 512);
# past it the per-pair kernels run up to PER_PAIR_MAX_TOKENS, then the GEMM path, and a
# pinned grouped config is refused.
GROUPED_MAX_SCAN = 1 << 16
# tl.dot's smallest tile side: the grouped kernels' default rows (pairs) per step, and
# their narrowest column and reduction blocks.
_DOT_MIN = 16
# The grouped kernels' pairs per step a config may ask (BLOCK_M): each step runs the whole
# K loop, so an expert with more pairs than BLOCK_M reads its weight tiles once per step.
_GROUPED_ROWS = (16, 32, 64)


def _decode_static(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1: torch.Tensor,
                   b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor], activation: str,
                   gated: bool, transposed: bool, interleaved: bool, limit: float,
                   cfg: dict[str, int]) -> tuple[Any, ...]:
    """What :func:`decode_forward` derives from metadata alone: per GEMM launch its grid, int
    arguments and constexprs; the activation buffer's shape; with GROUPED, the pair rows'
    shape and the combine's launch (else None)."""
    t, h = x.shape
    k, e = ids.shape[1], w1.shape[0]
    s = t * k
    w1v, w2v = nk_view(w1, transposed), nk_view(w2, transposed)
    n1 = w1v.shape[1]
    i = n1 // 2 if gated else n1
    grouped = bool(cfg.get("GROUPED", 0))
    least = _DOT_MIN if grouped else 1
    bk1, bk2 = max(least, min(cfg["UP_BLOCK_K"], next_pow2(h))), max(least, min(cfg["DOWN_BLOCK_K"], next_pow2(i)))
    bn1, bn2 = max(least, min(cfg["UP_BLOCK_N"], next_pow2(i))), max(least, min(cfg["DOWN_BLOCK_N"], next_pow2(h)))
    bias1, bias2 = b1 if b1 is not None else w1v, b2 if b2 is not None else w2v
    s1, s2 = w1v.stride(), w2v.stride()
    ids_s, rw_s = (ids.stride(0), ids.stride(1)), (rw.stride(0), rw.stride(1))
    opts1 = dict(BLOCK_N=bn1, BLOCK_K=bk1, GATED=gated, INTERLEAVED=gated and interleaved, ACT=ACT_IDS[activation],
                 HAS_BIAS=b1 is not None, HAS_LIMIT=gated and math.isfinite(limit), num_warps=cfg["UP_WARPS"],
                 num_stages=cfg["num_stages"])
    opts2 = dict(BLOCK_N=bn2, BLOCK_K=bk2, HAS_BIAS=b2 is not None, num_warps=cfg["DOWN_WARPS"],
                 num_stages=cfg["num_stages"])
    # act is a fresh (S, I) buffer; out a fresh (T, H) one, or with GROUPED pair rows (S, H)
    tail2 = (i, 1, *ids_s, *rw_s, *s2, bias2.stride(0), bias2.stride(-1), h, 1)
    if not grouped:
        tail1 = (x.stride(0), x.stride(1), *ids_s, *s1, bias1.stride(0), bias1.stride(-1), i, 1)
        return (((s, cdiv(i, bn1)), (k, e, i, h), tail1, opts1), ((t, cdiv(h, bn2)), (k, e, h, i), tail2, opts2),
                (s, i), None)
    bm = cfg.get("BLOCK_M") or _grouped_rows(s, e)
    if bm not in _GROUPED_ROWS:
        raise ValueError(f"moe_experts' grouped decode kernels: BLOCK_M (pairs per step) must be one of "
                         f"{_GROUPED_ROWS}, got {bm!r}")
    scan = dict(BLOCK_M=bm, BLOCK_E=next_pow2(e), BLOCK_P=next_pow2(s),
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    if not grouped_fits(s, e):
        raise ValueError(f"moe_experts' grouped decode kernels: {s} pairs x {e} experts is past what one "
                         f"program holds (GROUPED_MAX_SCAN = {GROUPED_MAX_SCAN}): pin GROUPED 0 (the per-pair "
                         "kernels) or fewer tokens")
    used = min(e, s)  # programs along dim 0: the used experts at most (the rest return at once)
    tail1 = (x.stride(0), x.stride(1), *ids_s, *rw_s, *s1, bias1.stride(0), bias1.stride(-1), i, 1)
    up = ((used, _columns_programs(cfg, used, cdiv(i, bn1), x.device)), (s, k, e, i, h), tail1,
          dict(opts1, **scan, UP=True))
    down = ((used, _columns_programs(cfg, used, cdiv(h, bn2), x.device)), (s, k, e, h, i), tail2,
            dict(opts2, **scan, UP=False, GATED=False, INTERLEAVED=False, ACT=0, HAS_LIMIT=False))
    cc = pick_config("combine", 0.0, h, k, x.dtype)
    bh = min(cc["BLOCK_H"], next_pow2(h))
    # _combine_kernel's arguments after (pairs, ids, out, rows): a fresh (S, H) pairs and (T, H) out
    combine_launch = ((s, h), (t, cdiv(h, bh)), (h, k, e, h, 1, *ids_s, h, 1),
                      dict(BLOCK_H=bh, MAPPED=False, num_warps=cc["num_warps"]))
    return up, down, (s, i), combine_launch


def _grouped_rows(pairs: int, experts: int) -> int:
    """The grouped kernels' pairs per step where the config does not say: the fewest of
    :data:`_GROUPED_ROWS` that hold the busiest expert's pairs in one step, by uniform
    routing (mean m = S / min(E, S) pairs per used expert, the busiest ~m + 2 sqrt(m)): a
    second step reads the expert's weight tiles again, a larger step wastes tensor-core rows.
    H200, bf16, from CUDA graphs (``bench/moe_decode.py --block-m 16,32``, 2026-12-03):
    Mixtral at T = 64 (m = 16) 160.8 µs with 16 pairs a step, 113.5 with 32; at T = 16 and 32
    (m = 4, 8) and OLMoE at T = 64 (m = 8) 16 was the faster, by 1-17 % (best of each)."""
    m = pairs / max(1, min(experts, pairs))
    busiest = m + 2.0 * math.sqrt(m)
    # a step selects its pairs from all of them, (BLOCK_M, T*k) in registers: within what was
    # measured (GROUPED_MAX_SCAN), never below tl.dot's 16
    fit = [r for r in _GROUPED_ROWS if r == _DOT_MIN or r * next_pow2(max(1, pairs)) <= GROUPED_MAX_SCAN]
    return next((r for r in fit if busiest <= r), fit[-1])


def _columns_programs(cfg: dict[str, int], experts: int, tiles: int, device: torch.device) -> int:
    """Programs per expert along the grouped decode kernels' columns: one per column tile,
    or with the config's WAVES about WAVES programs per SM over all ``experts`` (then each
    walks several tiles and pays its expert search once for them)."""
    waves = cfg.get("WAVES", 0)
    if not waves:
        return tiles
    return max(1, min(tiles, cdiv(waves * _num_sms(device), experts)))


_DECODE_STATIC: dict[Any, tuple[Any, ...]] = {}


def _meta(a: Any) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    return (a.device, a.dtype, a.shape, a.stride(), a.data_ptr() % 16 == 0)


def spec_of(*args: Any) -> Optional[int]:
    """The op's arguments' metadata, what the checks and every launch of one forward follow
    from: each tensor's device, dtype, shape, strides and 16-byte alignment, the other
    arguments by value (the buffers the forward allocates are aligned, and their views'
    offsets follow from the shapes); as an int interned per distinct metadata (never 0,
    never reused), so the memos and the launcher each hash an int instead of the nested
    tuple (~0.8 us a hash on the 2-core box, about ten per forward). None under
    Dynamo: the traced launches keep no memo (:func:`.launch.traced_launch`)."""
    if dynamo_tracing():
        return None
    full = tuple(map(_meta, args))
    got = _SPEC_IDS.get(full)
    if got is None:
        if len(_SPEC_IDS) >= _MEMO_LIMIT:  # serving sees many T: a cleared spec gets a new id
            _SPEC_IDS.clear()
        got = _SPEC_IDS[full] = next(_SPEC_COUNTER)
    return got


_SPEC_IDS: dict[tuple[Any, ...], int] = {}
_SPEC_COUNTER = itertools.count(1)


_CONFIGS: dict[Any, tuple[dict[str, int], dict[str, int], dict[str, int]]] = {}
_MEMO_LIMIT = 4096  # entries per memo (one per distinct input metadata: serving sees many T)

# A no-grad forward's launches replayed per spec (:mod:`.replay`). H100 host, T = 4096,
# 2026-12-06: this forward's host time 187 -> 82 us a call (the experts call's ~290 -> ~125),
# the eager block's forward 2.5-4 % faster in batches of 5 calls, interleaved
# (bench/RESULTS.md, sixty-first session). False: every call runs the Python path.
REPLAY = True
# With REPLAY, a forward that saves for the backward (the training path's, ``save=True``) is
# replayed too: its output and what :class:`Saved` holds (the routing's views, GEMM1's act and
# pre-activation, the sorted rows) are the replay's buffers. Why: an eager training step at
# T <= 512 waits on its host, and this forward's Python was ~0.45 ms a step of it under
# cProfile (H100 host, T = 64, sixty-second session). H100, T = 4096, 2026-12-06 (sixty-third
# session, bench/moe_replay.py --training): this forward's host 164-182 -> 82-90 us a call,
# the block's training step 0.998-1.020x off / on (no slower); output and every gradient bit
# for bit on vs off (test_cuda_replay_training). False: the saving forward runs the Python path.
REPLAY_TRAINING = True
_PLANS = Plans(_MEMO_LIMIT)


def _plan_state() -> tuple[Any, ...]:
    """The module state a forward's launches follow from besides its spec: a plan recorded
    under other values is not replayed (a test or benchmark that rebinds one records anew)."""
    return (DECODE_MAX_TOKENS, PER_PAIR_MAX_TOKENS, pick_config, _CONFIGS, _DECODE_STATIC, _GEMM_STATIC,
            new_buffer, GLUON_GEMM1_MIN_ROWS, GLUON_GEMM2_DEVICES, gluon_gemm1_default, gluon_gemm2_default,
            _device_name, ROWS_TILE, moe_routing.ROUTE_CHUNK, moe_routing.ROUTE_ONE_PROGRAM_CHUNKS, PRE_BF16)


def remember(memo: dict[Any, Any], key: Any, value: Any) -> None:
    if len(memo) >= _MEMO_LIMIT:
        memo.clear()
    memo[key] = value


_GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")  # a forward GEMM config's own


def forward_configs(picked: dict[str, dict[str, int]], rows_per_expert: float, n1: int, h: int, i: int, k: int,
                    dtype: torch.dtype) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(gemm1, gemm2, combine) configs: each given one whole, in place of the table's (a
    partial one is a ValueError naming what it lacks); gemm2's BLOCK_M is gemm1's."""
    for gemm, keys in (("gemm1", _GEMM_KEYS + ("BLOCK_M",)), ("gemm2", _GEMM_KEYS)):
        if picked.get(gemm) and (missing := [key for key in keys if key not in picked[gemm]]):
            raise ValueError(f"fused_experts_forward: configs[{gemm!r}] lacks {missing}: a forward GEMM's config "
                             "is given whole (pick_config's, with the keys to change)")
    c1 = picked.get("gemm1") or pick_config("gemm1", rows_per_expert, n1, h, dtype)
    c2 = dict(picked.get("gemm2") or pick_config("gemm2", rows_per_expert, h, i, dtype, block_m=c1["BLOCK_M"]))
    c2["BLOCK_M"] = c1["BLOCK_M"]
    cc = picked.get("combine") or pick_config("combine", rows_per_expert, h, k, dtype)
    return c1, c2, cc


@functools.lru_cache(maxsize=None)
def gluon_gemm1() -> Any:
    """:mod:`.moe_gemm1_gluon`, or the ImportError's message where triton has no Gluon."""
    try:
        from . import moe_gemm1_gluon
    except ImportError as e:  # triton without Gluon (< 3.5)
        return f"triton has no Gluon ({e})"
    return moe_gemm1_gluon


def describe_configs(picked: tuple[dict[str, int], dict[str, int], dict[str, int]]) -> str:
    """The forward's (gemm1, gemm2, combine) configs in one line, GEMM1's kernel named first
    (what the ``opreg`` logger says at DEBUG when a forward's configs are picked)."""
    c1, c2, cc = picked
    kernel = ("CUTLASS (torch._grouped_mm) + the gate's pass" if c1.get("GROUPED_MM", 0)
              else {1: "Gluon ping-pong", 2: "Gluon cooperative"}.get(c1.get("GLUON", 0), "Triton"))
    kernel2 = {1: "Gluon ping-pong", 2: "Gluon cooperative"}.get(c2.get("GLUON", 0), "Triton")
    return f"GEMM1 on {kernel} {dict(c1)}, GEMM2 on {kernel2} {dict(c2)}, combine {dict(cc)}"


# GEMM1 runs on the cooperative Gluon kernel by default (with no grad and in the training forward) from
# this many rows per expert on (gluon_gemm1_default says why)
GLUON_GEMM1_MIN_ROWS = 256


def gluon_gemm1_default(rows_per_expert: float) -> int:
    """``configs["gemm1"]["GLUON"]`` by default: 2 (the cooperative Gluon kernel of
    :mod:`.moe_gemm1_gluon`, where :func:`_gluon_gemm1_unfit` allows it) for a forward with
    at least :data:`GLUON_GEMM1_MIN_ROWS` rows per expert, saving for the backward or not, else
    0 (the table's Triton GEMM1).

    The model: the same MMAs as the Triton GEMM1 (128-row tiles, gate and up as two 64 x 128
    wgmma chains a warpgroup), but a program per SM walks its tiles with a TMA loader warp, so
    each tile's pipeline fill and the loads under its epilogue cost nothing: a fixed saving a
    tile, the same share of the GEMM at any number of tiles. Measured (H100, T = 4096,
    ``bench/moe_gemms.py --gluon``, 2026-12-06, the epilogue's stores coalesced,
    :data:`.moe_gemm1_gluon.COALESCE`): the fused forward against the same on the table's
    Triton GEMM1, 5 interleaved rounds, 0.952 / 0.942 / 0.911x with no grad and 0.995 / 0.961
    / 0.950x saving for the backward (Qwen3-MoE, 256 rows an expert, where the table has
    HALF_TAIL / OLMoE, 512 / Mixtral, 1024); the training step (``moe_launches.py``, 7
    rounds) 2570 -> 2570 / 2858 -> 2843 / 2537 -> 2493 us, its GEMM1 482 -> 466 / 565 -> 527 /
    534 -> 462. Before the stores were coalesced the saving forward lost (1.019-1.074x): three
    tiles stored (act and both pre halves) from the accumulators' layout. Below 256 rows (T <=
    512 at these shapes) the forward waits on its host, and the Gluon launch costs more host
    time than Triton's (``moe_wgrad.py --host``: ~30 us a Gluon launch)."""
    return 2 if rows_per_expert >= GLUON_GEMM1_MIN_ROWS else 0


# GEMM2 runs on the ping-pong Gluon kernel by default beside GEMM1's Gluon default on the devices
# whose name starts with one of these (gluon_gemm2_default says why; not a GH200, not measured)
GLUON_GEMM2_DEVICES = ("NVIDIA H200",)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gluon_gemm2_default(rows_per_expert: float, device: torch.device) -> int:
    """``configs["gemm2"]["GLUON"]`` by default: 1 (GEMM2 on the ping-pong Gluon kernel of
    :mod:`.moe_gemm1_gluon`, where :func:`_gluon_gemm2_unfit` allows it) where GEMM1 takes its
    Gluon default (:func:`gluon_gemm1_default`) on a device whose name starts with one of
    :data:`GLUON_GEMM2_DEVICES`, else 0 (the table's Triton GEMM2).

    The model: GEMM2's K loop is short (I = 768-4096) and each 128 x 256 tile ends in an
    epilogue (the routing weight, a 64 KB store) that the cooperative and Triton kernels wait
    through; the ping-pong kernel runs one consumer's epilogue under the other's MMAs, for
    narrower tiles (more shared-memory reads an MMA). Which side wins is the device's, so it is
    the sweep's (``bench/moe_gemms.py --gluon``: the fused forward, interleaved rounds, GEMM1 on
    the cooperative kernel with COALESCE, GEMM2 on the table's Triton kernel or on ping-pong).
    H200 (2026-12-06): at T = 4096 no grad 0.949 -> 0.934 / 0.947 -> 0.924 / 0.935 -> 0.911
    of the table's Triton pair (Qwen3-MoE / OLMoE / Mixtral), saving 0.994 -> 0.972 / 0.965 ->
    0.931 / 0.942 -> 0.908; at T = 16384 0.964 -> 0.928 / 0.940 -> 0.919 / 0.937 -> 0.907, saving
    0.937 -> 0.910 / 0.927 -> 0.922 / 0.942 -> 0.920. H100 (the same day, T = 4096): no grad
    0.965 -> 0.975 / 0.945 -> 0.967 / 0.955 -> 0.921, saving 0.994 -> 0.991 / 0.963 -> 0.977 /
    0.914 -> 0.914: a loss at two of three, so not there."""
    if rows_per_expert < GLUON_GEMM1_MIN_ROWS or device.type != "cuda":
        return 0
    name = _device_name(device.index if device.index is not None else torch.cuda.current_device())
    return 1 if name.startswith(GLUON_GEMM2_DEVICES) else 0


def _gluon_for(c: dict[str, int]) -> Any:
    """:mod:`.moe_gemm1_gluon` for a GEMM config that asks for it, or why it can't take the
    config (no Gluon; the Triton kernels' HALF_TAIL or PERSISTENT asked for too)."""
    module = gluon_gemm1()
    if not isinstance(module, str) and (c.get("HALF_TAIL", 0) or c.get("PERSISTENT", 0)):
        return "the Gluon kernel is persistent with whole tiles: HALF_TAIL and PERSISTENT must be 0"
    return module


def _gluon_gemm1_unfit(c1: dict[str, int], x: torch.Tensor, w1: torch.Tensor, bias: Optional[torch.Tensor],
                       i: int, gated: bool, transposed: bool, interleaved: bool,
                       pre_dt: Optional[torch.dtype]) -> Optional[str]:
    """Why GEMM1 can't run on the Gluon kernel ``configs["gemm1"]["GLUON"]`` asks for (1
    ping-pong, 2 cooperative: :mod:`.moe_gemm1_gluon`) here, or None. Its A is the sorted copy
    of ``x``'s rows (a fresh contiguous buffer of x's dtype)."""
    if c1["GLUON"] not in (1, 2):
        return f"GLUON must be 0 (off), 1 (ping-pong) or 2 (cooperative), got {c1['GLUON']!r}"
    module = _gluon_for(c1)
    if isinstance(module, str):
        return module
    if pre_dt is not None and pre_dt not in (torch.bfloat16, torch.float32):
        return f"the saved pre-activation's dtype {pre_dt} is neither bf16 nor fp32"
    return module.unfit(x, nk_view(w1, transposed), i, gated=gated, interleaved=interleaved,
                        has_bias=bias is not None, block_m=c1["BLOCK_M"], pingpong=c1["GLUON"] == 1,
                        gather=not c1.get("PREGATHER", 1))


def _gluon_gemm2_unfit(c1: dict[str, int], c2: dict[str, int], x: torch.Tensor, w2: torch.Tensor,
                       bias: Optional[torch.Tensor], i: int, transposed: bool) -> Optional[str]:
    """Why GEMM2 can't run on the Gluon kernel ``configs["gemm2"]["GLUON"]`` asks for (1
    ping-pong, 2 cooperative: :func:`.moe_gemm1_gluon.gemm2`) here, or None. Its A is GEMM1's
    output (a fresh contiguous buffer of x's dtype, I columns)."""
    if c2["GLUON"] not in (1, 2):
        return f"GLUON must be 0 (off), 1 (ping-pong) or 2 (cooperative), got {c2['GLUON']!r}"
    module = _gluon_for(c2)
    if isinstance(module, str):
        return module
    return module.unfit2(x, nk_view(w2, transposed), i, has_bias=bias is not None, block_m=c1["BLOCK_M"],
                         pingpong=c2["GLUON"] == 1)


def fused_experts_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
                          down_proj: torch.Tensor, down_bias: Optional[torch.Tensor], activation: str,
                          gated: bool, transposed: bool, interleaved: bool, alpha: float, limit: float,
                          *, configs: Optional[dict[str, dict[str, int]]] = None,
                          save: bool = False, keep_rows: bool = False, spec: Any = None) -> Any:
    """The op's forward with the fused kernels: (T, H) in hidden_states' dtype. Arguments as
    the op's (checked by the caller; :func:`why_not_fused` must be None). ``configs``
    overrides :func:`pick_config` ({"gemm1": ..., "gemm2": ..., "combine": ...}; gemm2's
    BLOCK_M is gemm1's), for tests and tuning. ``save``: returns ``(out, saved)``, with
    ``saved`` the :class:`Saved` the backward
    (:func:`opreg.backends.triton.moe_experts_backward.fused_experts_backward`) reads, or
    None when there is no slot (every gradient is then zero). ``keep_rows`` (with ``save``):
    GEMM1 reads a sorted copy of the token rows (``PREGATHER``, whatever the table says) and
    ``saved.rows`` keeps it: for a backward whose dW1 runs on ``torch._grouped_mm``, which
    reads the same copy (:func:`.moe_experts_backward.keeps_rows`), so it is made once, and
    GEMM1 loads it through TMA (H200, T = 4096: 5-14 % faster GEMM1, ``bench/moe_gemms.py``).
    ``spec``: :func:`spec_of` these arguments, if the caller has it."""
    x, ids, rw, w1, w2 = hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj
    t, h = x.shape
    if t * ids.shape[1] == 0 or h == 0:
        out0 = x.new_zeros((t, h))  # no slot: an empty sum
        return (out0, None) if save else out0
    # The launches' specialisation follows from the inputs' metadata (and ``save``, with the
    # saved pre-activation's dtype, which PRE_BF16 can change in a process): one key
    # for the host-side work of every launch (configs, grids, descriptor checks, launcher
    # keys). Given configs (tests, tuning) take the full path.
    keep_rows = keep_rows and save
    pre_dt = pre_dtype(x.dtype, gated, limit) if save else None
    if configs is not None or dynamo_tracing():  # traced: no memo (.launch.traced_launch)
        spec = None
    else:
        spec = (spec or spec_of(x, ids, rw, w1, gate_up_bias, w2, down_bias, activation, gated, transposed,
                                interleaved, alpha, limit), save, keep_rows, pre_dt)
    args = (x, ids, rw, w1, gate_up_bias, w2, down_bias, activation, gated, transposed, interleaved, alpha, limit)
    if spec is not None and REPLAY:  # the launches replayed (.replay)
        if not save:
            return _PLANS.call(spec, _plan_state(), args[:7], functools.partial(_forward, *args, None, False, False,
                                                                                 None, spec))
        # (its configs, for Saved, from the memo: a spec's first call fills it, on the Python path)
        if REPLAY_TRAINING and (picked := _CONFIGS.get(spec)) is not None:
            got = _PLANS.call(spec, _plan_state(), args[:7], functools.partial(_saving_forward, args, keep_rows,
                                                                                pre_dt, spec))
            c1, c2, cc = picked
            return got[0], Saved(*got[1:6], {"gemm1": dict(c1), "gemm2": c2, "combine": dict(cc)}, *got[6:])
    return _forward(*args, configs, save, keep_rows, pre_dt, spec)


def _saving_forward(args: tuple[Any, ...], keep_rows: bool, pre_dt: torch.dtype, spec: Any
                    ) -> tuple[Optional[torch.Tensor], ...]:
    """A saving forward (:func:`_forward` with ``save``) as a flat tuple for :mod:`.replay`: the
    output, then :class:`Saved`'s tensors (its configs follow from ``spec``: ``_CONFIGS``)."""
    out, saved = _forward(*args, None, True, keep_rows, pre_dt, spec)
    return (out, saved.sorted_pair_ids, saved.block_expert, saved.tables, saved.act, saved.pre, saved.routing,
            saved.rows)


def sizes(x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, gated: bool,
          transposed: bool) -> tuple[int, int, int, int, int, int, int]:
    """(T, H, k, E, N1, I, S) of the op's hidden states (T, H), ids (T, k) and gate_up_proj:
    N1 GEMM1's columns, I the activation's, S = T*k pairs."""
    t, h = x.shape
    k = ids.shape[1]
    n1 = w1.shape[2] if transposed else w1.shape[1]
    return t, h, k, w1.shape[0], n1, n1 // 2 if gated else n1, t * k


def _forward(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1: torch.Tensor,
             gate_up_bias: Optional[torch.Tensor], w2: torch.Tensor, down_bias: Optional[torch.Tensor],
             activation: str, gated: bool, transposed: bool, interleaved: bool, alpha: float, limit: float,
             configs: Optional[dict[str, dict[str, int]]], save: bool, keep_rows: bool,
             pre_dt: Optional[torch.dtype], spec: Any) -> Any:
    """:func:`fused_experts_forward` past its key (``spec``, None: unkeyed) and the saved
    pre-activation's dtype ``pre_dt`` (None: no ``save``)."""
    t, h, k, e, n1, i, s = sizes(x, ids, w1, gated, transposed)
    if decodes(t, save, configs, s, e):
        return decode_forward(x, ids, rw, w1, gate_up_bias, w2, down_bias, activation, gated, transposed,
                              interleaved, alpha, limit, configs["decode"] if configs is not None else None, spec)
    picked = _CONFIGS.get(spec) if spec is not None else None
    if picked is None:
        picked = forward_configs(configs or {}, s / e, n1, h, i, k, x.dtype)
        if keep_rows and not picked[0].get("PREGATHER", 0):
            picked = ({**picked[0], "PREGATHER": 1},) + picked[1:]
        # GEMM1 on CUTLASS where the config asks (a training forward's, keep_rows), or fused
        g1 = grouped_gemm1(picked[0], x, w1, gate_up_bias, n1, i, pre_dt, keep_rows)
        if g1 and picked[0].get("HALF_TAIL", 0):
            raise ValueError("fused_experts_forward: configs['gemm1']['HALF_TAIL'] = 1, but GEMM1 runs on "
                             "torch._grouped_mm (GROUPED_MM), which has no such mode")
        for gemm, c in zip(("gemm1", "gemm2"), picked[:2]):  # before any launch
            if (why := half_tail_unfit(c)) is not None:
                raise ValueError(f"fused_experts_forward: configs[{gemm!r}]: {why}")
        picked = ({**picked[0], "GROUPED_MM": int(g1)},) + picked[1:]
        if dynamo_tracing():  # Gluon's kernels don't trace: under Dynamo, the Triton GEMMs
            picked = ({**picked[0], "GLUON": 0}, {**picked[1], "GLUON": 0}, picked[2])
        elif not (configs or {}).get("gemm1") and not g1 and gluon_gemm1_default(s / e):
            fit = {**picked[0], "GLUON": 2, "PREGATHER": 1, "HALF_TAIL": 0, "PERSISTENT": 0}
            if _gluon_gemm1_unfit(fit, x, w1, gate_up_bias, i, gated, transposed, interleaved, pre_dt) is None:
                picked = (fit,) + picked[1:]
                if not (configs or {}).get("gemm2") and (g2 := gluon_gemm2_default(s / e, x.device)):
                    fit2 = {**picked[1], "GLUON": g2, "HALF_TAIL": 0, "PERSISTENT": 0}
                    if _gluon_gemm2_unfit(fit, fit2, x, w2, down_bias, i, transposed) is None:
                        picked = (fit, fit2, picked[2])
        if picked[0].get("GLUON", 0):  # asked for: runs, or says why not
            if picked[0].get("GROUPED_MM", 0):
                raise ValueError("fused_experts_forward: configs['gemm1'] asks for GEMM1 on both the Gluon kernel "
                                 "(GLUON) and torch._grouped_mm (GROUPED_MM): give one")
            # PREGATHER 0: the cooperative kernel gathers the rows on its load (no sorted copy)
            picked = ({"PREGATHER": 1, **picked[0]},) + picked[1:]
            if (why := _gluon_gemm1_unfit(picked[0], x, w1, gate_up_bias, i, gated, transposed, interleaved,
                                          pre_dt)) is not None:
                raise ValueError(f"fused_experts_forward: configs['gemm1']['GLUON'] = {picked[0]['GLUON']!r}, "
                                 f"but {why}")
        if picked[1].get("GLUON", 0) and (why := _gluon_gemm2_unfit(picked[0], picked[1], x, w2, down_bias, i,
                                                                     transposed)) is not None:
            raise ValueError(f"fused_experts_forward: configs['gemm2']['GLUON'] = {picked[1]['GLUON']!r}, but {why}")
        if spec is not None:
            remember(_CONFIGS, spec, picked)
        # once a spec (its configs are remembered above); not under Dynamo (spec None), which
        # can't trace the logger, nor for given configs (the caller's own)
        if spec is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("opreg: moe_experts/triton forward, T %d, E %d, H %d, I %d, k %d, %s: %s", t, e, h, i, k,
                         "saving for the backward" if save else "no save", describe_configs(picked))
    c1, c2, cc = picked
    grouped1 = bool(c1.get("GROUPED_MM", 0))
    bm = c1["BLOCK_M"]
    with device_ctx(x):
        route_buf, sorted_pair_ids, block_expert, tables = route_flat(ids, e, bm, spec and (spec, "routing"))
        # GEMM1's output and pre-activation (and the sorted copies) hold the real pairs' rows
        # alone, unpadded: S rows (routing_tables)
        act = _buffer((s, i), x.dtype, x.device)
        pre = _buffer((s, n1), pre_dt, x.device) if save and not grouped1 else None
        pairs = _buffer((s, h), x.dtype, x.device)
        out = _buffer((t, h), x.dtype, x.device)
        # tables: one (5 E,) view; its last padded end tables[3, E - 1], its shifts tables[4]
        # (the (5, E) view only where read: a view is ~3 us of host on the 2-core box)
        routing = dict(rw=rw, sorted_pair_ids=sorted_pair_ids, block_expert=block_expert, top_k=k,
                       used=tables[4 * e - 1:4 * e], shift=tables[4 * e:])
        # PREGATHER: GEMM1 reads a sorted copy of the token rows (its A then loads through a
        # tensor descriptor, as GEMM2's does) instead of gathering them on its load
        pregather = bool(c1.get("PREGATHER", 0))
        if save or pregather or grouped1:
            tables = tables.view(TABLES, e)
        a1 = sorted_rows(x, rw, sorted_pair_ids, block_expert, tables, k, False,
                         spec and (spec, "rows")) if pregather else x
        if grouped1:
            # CUTLASS over the sorted rows (unwritten past the last run end, which it does
            # not read: its groups end there), then the gate
            pre = torch._grouped_mm(a1, nk_view(w1, transposed).transpose(1, 2), offs=tables[0])
            act_pass(pre, act, sorted_pair_ids, block_expert, tables[4], s, i, bm, gated, interleaved, activation,
                     alpha, limit, spec and (spec, "act"))
        elif c1.get("GLUON", 0):
            gluon_gemm1().gemm1(a1, nk_view(w1, transposed), act, pre, sorted_pair_ids, block_expert,
                                 routing["shift"], routing["used"], s, i, ACT_IDS[activation], alpha, limit,
                                 pingpong=c1["GLUON"] == 1, gather=not pregather, top_k=k,
                                 spec=spec and (spec, "gemm1"))
        else:
            launch_gemm(c1, a=a1, w_nk=nk_view(w1, transposed), bias=gate_up_bias, out=act, pre=pre,
                        n=i, k=h, gather=not pregather, routed=False, gated=gated, interleaved=interleaved,
                        act=ACT_IDS[activation], alpha=alpha, limit=limit, spec=spec and (spec, "gemm1"),
                        **routing)
        if c2.get("GLUON", 0):
            gluon_gemm1().gemm2(act, nk_view(w2, transposed), pairs, rw, sorted_pair_ids, block_expert,
                                 routing["shift"], routing["used"], s, k, pingpong=c2["GLUON"] == 1,
                                 spec=spec and (spec, "gemm2"))
        else:
            launch_gemm(c2, a=act, w_nk=nk_view(w2, transposed), bias=down_bias, out=pairs, pre=None,
                        n=h, k=i, gather=False, routed=True, scaled=True, spec=spec and (spec, "gemm2"), **routing)
        combine(pairs, ids, out, e, cc, spec=spec and (spec, "combine"))
    if not save:
        return out
    return out, Saved(sorted_pair_ids, block_expert, tables, act, pre,
                      {"gemm1": dict(c1), "gemm2": c2, "combine": dict(cc)}, route_buf,
                      a1 if keep_rows else None)


# ----------------------------------------------------------------------------- registration

class TritonImpl(registry.Impl):
    """An :class:`opreg.registry.Impl` that says why it can't run: no triton, torch without
    CUDA, no CUDA device, or a GPU older than sm80 (``python -m opreg list`` shows it)."""

    def unavailable(self, device: Optional[str] = None) -> Optional[str]:
        return super().unavailable(device) or _why_not_here()


def _why_not_here() -> Optional[str]:
    if NO_TRITON is not None:
        return NO_TRITON
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "torch was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.version.cuda is not None and torch.cuda.get_device_capability() < (8, 0):
        return "needs a GPU of compute capability 8.0 or newer"
    return None


def moe_experts_triton(*args: Any) -> torch.Tensor:
    """The ``triton`` implementation's kernel (the op's positional arguments): the fused
    kernels, or the ``grouped`` path for inputs they don't take (logged once per cause).
    The checks follow from the arguments' metadata (:func:`spec_of`): run once per spec."""
    spec, why = checked(args)
    # Negative ids raise as in the op's other paths: always off CUDA, on CUDA only when
    # asked (the check synchronises); unchecked, they contribute nothing.
    if M.checks_ids_here(args[1]):
        M.check_ids(args[1])
    if why is not None:
        log_once((M.NAME, "triton", why), logging.INFO, "opreg: moe_experts/triton runs the grouped path: %s", why)
    if torch.is_grad_enabled():  # the op's autograd is its own (the reference's): record nothing
        with torch.no_grad():
            return G.grouped(*args) if why is not None else fused_experts_forward(*args, spec=spec)
    return G.grouped(*args) if why is not None else fused_experts_forward(*args, spec=spec)  # no context: ~3 us


def moe_experts_triton_train(*args: Any) -> Optional[torch.Tensor]:
    """The ``triton`` implementation's training run (``Impl.train``: the op called with
    gradients): the fused kernels forward and backward
    (:func:`.moe_experts_train.train`) where they take the inputs (:func:`why_not_fused`),
    else None (the op's reference gradients). Traced calls keep the op's traced
    reference (the transformers integration traces the fused custom ops itself), and so do
    ``torch.func`` transforms and forward mode, before anything reads a data pointer."""
    if M.tracing(args[0]) or torch._C._functorch.maybe_current_level() is not None \
            or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return None  # traced, inside a torch.func transform, or forward mode: the reference
    from . import moe_experts_train as T  # imports this module

    # What else moe_experts_train.fused_trains asks holds here: this is the bound
    # implementation, and the call is eager, outside torch.func, in reverse mode.
    return None if checked(args)[1] is not None else T.train(*args)


def checked(args: tuple[Any, ...]) -> tuple[int, Optional[str]]:
    """(:func:`spec_of` the op's arguments, :func:`why_not_fused` them) after the op's
    checks (raising what they find), each run once per spec: the checks read metadata only.
    Eager calls only (a traced call has no data pointers to key by)."""
    spec = spec_of(*args)
    why = _CHECKED.get(spec, _UNCHECKED)
    if why is _UNCHECKED:
        M.check(*args)
        why = why_not_fused(*args)
        remember(_CHECKED, spec, why)
    return spec, why


_CHECKED: dict[Any, Optional[str]] = {}  # spec -> why_not_fused (passed M.check)
_UNCHECKED = object()


def register() -> None:
    """Add the ``triton`` implementation of moe_experts (CUDA, priority 110: above
    ``grouped``). Idempotent."""
    if "triton" in registry.lookup(M.NAME).impls:
        return
    registry.add_impl(M.NAME, TritonImpl("triton", M.NAME, ("cuda",), priority=110, fn=moe_experts_triton,
                                         train=moe_experts_triton_train))
