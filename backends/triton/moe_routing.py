"""The fused MoE kernels' routing: the (T, k) expert ids -> the pairs sorted by expert, each
expert's run padded to the GEMMs' BLOCK_M, on the device, with no host sync
(:func:`routing_tables` says what each table holds and why a counting sort).
"""
import functools
from typing import Any, Optional

import torch

from .launch import cdiv, dynamo_tracing, launch, next_pow2, traced_constant
from .moe_tiles import jit, tl
from .replay import make, plain

__all__ = ["MAX_EXPERTS", "ROUTE_CHUNK", "ROUTE_ONE_PROGRAM_CHUNKS", "TABLES", "align_block_size", "int_buffer",
           "num_blocks", "route", "route_flat", "routing_size", "routing_tables", "routing_views"]


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static worst case of padded M blocks: each of at most min(E, S) non-empty experts
    wastes at most BLOCK_M - 1 rows, so sum ceil(c_e / BM) <= (S + min(E, S)(BM - 1)) / BM."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


MAX_EXPERTS = 8192  # the routing kernels hold one lane per expert (BINS = next power of 2 >= E)


TABLES = 5  # the routing's per-expert tables (routing_tables): run end, padded start, count, padded end, shift

ROUTE_CHUNK = 128  # pairs per program of the routing's count and place kernels
# Up to this many chunks (T*k <= 512: T = 64 at top-8), one program places every pair
# (_route_place_kernel's ONE_PROGRAM): two launches fewer where the call waits on its host
# (decode), for a serial walk of at most 4 chunks twice (a chunk is one program's work in
# the three-kernel form, whose kernels each cost a launch's gap on the device too).
ROUTE_ONE_PROGRAM_CHUNKS = 4


@jit
def _chunk_ids(ids_ptr, c, num_pairs, top_k, stride_t, stride_k, num_experts, CHUNK: tl.constexpr):
    """(pairs, ids, valid) of chunk c: pairs [c*CHUNK, (c+1)*CHUNK), their expert ids (-1
    past the end), and which ids are in [0, E)."""
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + (p // top_k).to(tl.int64) * stride_t + (p % top_k) * stride_k, mask=p < num_pairs,
                  other=-1)
    return p, ids, (ids >= 0) & (ids < num_experts)


@jit
def _chunk_counts(ids, valid, BINS: tl.constexpr):
    """How many of a chunk's pairs each expert has (invalid ids count nowhere)."""
    e = tl.arange(0, BINS)
    h = tl.histogram(tl.where(valid, ids, 0).to(tl.int32), BINS)
    return h - tl.where(e == 0, tl.sum((~valid).to(tl.int32), axis=0), 0)


@jit
def _chunk_ranks(ids, valid, CHUNK: tl.constexpr):
    """Each valid pair's rank among the chunk's earlier pairs of its expert."""
    q = tl.arange(0, CHUNK)
    b = tl.where(valid, ids, -1).to(tl.int32)
    return tl.sum(((b[:, None] == b[None, :]) & (q[None, :] < q[:, None])).to(tl.int32), axis=1)


@jit
def _route_count_kernel(ids_ptr, counts_ptr, num_pairs, top_k, stride_t, stride_k, num_experts, num_chunks,
                        CHUNK: tl.constexpr, BINS: tl.constexpr):
    """counts[e, c] = how many pairs of chunk c (pairs [c*CHUNK, (c+1)*CHUNK), pair = t*k + j)
    have expert id e (expert-major: the scan walks c contiguously). Ids outside [0, E) count
    nowhere (binned at 0, then taken off bin 0's count)."""
    c = tl.program_id(0)
    _, ids, valid = _chunk_ids(ids_ptr, c, num_pairs, top_k, stride_t, stride_k, num_experts, CHUNK)
    e = tl.arange(0, BINS)
    tl.store(counts_ptr + e * num_chunks + c, _chunk_counts(ids, valid, BINS), mask=e < num_experts)


@jit
def _route_scan_kernel(counts_ptr, tables_ptr, num_experts, num_chunks, CB: tl.constexpr):
    """Program e (one per expert): expert e's row in place, counts[e, c] -> the rows of its
    pairs in chunks before c (an exclusive scan, CB chunks at a time), and its total into
    tables[2, e]. The padded starts need every expert's total: the place kernel adds them.
    (One program for the whole (E, chunks) matrix walked it serially: 17 us at E = 128,
    T = 4096, k = 8 on the H200, 2026-12-02.)"""
    e = tl.program_id(0)
    row = counts_ptr + e * num_chunks
    run = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        cs = c0 + tl.arange(0, CB)
        m = cs < num_chunks
        cnt = tl.load(row + cs, mask=m, other=0)
        tl.store(row + cs, run + tl.cumsum(cnt, 0) - cnt, mask=m)
        run += tl.sum(cnt, axis=0)
    tl.store(tables_ptr + 2 * num_experts + e, run)


@jit
def _route_place_kernel(ids_ptr, offsets_ptr, tables_ptr, out_ptr, block_expert_ptr,
                        num_pairs, top_k, stride_t, stride_k, num_experts, num_chunks, num_m_blocks,
                        CHUNK: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                        ONE_PROGRAM: tl.constexpr):
    """Program c: the experts' run ends (unpadded runs end to end), padded starts, padded
    ends (runs padded to BLOCK_M, laid end to end) and row shifts (run start - padded
    start) from their totals, into tables[0], [1], [3] and [4] (every program writes the
    same values); chunk c's pairs go to out[padded start of e + offsets[e, c] + their rank
    among the chunk's pairs of expert e] (pair order kept: a stable counting sort); then
    the expert of M blocks [c * bpp, (c+1) * bpp) (-1 past the last padded row) and the
    sentinel S in their padding rows. Every out entry is written once.

    ONE_PROGRAM (a grid of one, for a few chunks: :func:`route_flat`): this program walks
    every chunk twice, counting (the totals, written to tables[2] here), then placing, with
    each expert's offset so far kept in ``offsets[e]`` (its first E entries, scratch); the
    count and scan kernels don't run, and it owns every M block."""
    c = tl.program_id(0)
    e = tl.arange(0, BINS)
    real = e < num_experts
    if ONE_PROGRAM:
        total = tl.zeros((BINS,), dtype=tl.int32)
        for cc in range(0, num_chunks):
            _, ids, valid = _chunk_ids(ids_ptr, cc, num_pairs, top_k, stride_t, stride_k, num_experts, CHUNK)
            total += _chunk_counts(ids, valid, BINS)
        tl.store(tables_ptr + 2 * num_experts + e, total, mask=real)
        tl.store(offsets_ptr + e, tl.zeros((BINS,), dtype=tl.int32), mask=real)
    else:
        total = tl.load(tables_ptr + 2 * num_experts + e, mask=real, other=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pstart = tl.cumsum(padded, 0) - padded
    pend = pstart + padded
    end = tl.cumsum(total, 0)
    tl.store(tables_ptr + e, end, mask=real)
    tl.store(tables_ptr + num_experts + e, pstart, mask=real)
    tl.store(tables_ptr + 3 * num_experts + e, pend, mask=real)
    tl.store(tables_ptr + 4 * num_experts + e, end - total - pstart, mask=real)
    tl.debug_barrier()  # this program's stores seen by its own threads' loads below
    if ONE_PROGRAM:
        run = tl.zeros((BINS,), dtype=tl.int32)
        for cc in range(0, num_chunks):
            p, ids, valid = _chunk_ids(ids_ptr, cc, num_pairs, top_k, stride_t, stride_k, num_experts, CHUNK)
            bb = tl.where(valid, ids, 0)
            dest = (tl.load(tables_ptr + num_experts + bb, mask=valid, other=0)
                    + tl.load(offsets_ptr + bb, mask=valid, other=0) + _chunk_ranks(ids, valid, CHUNK))
            tl.store(out_ptr + dest, p, mask=valid)
            run += _chunk_counts(ids, valid, BINS)
            tl.debug_barrier()  # every thread has read offsets[] before it is overwritten
            tl.store(offsets_ptr + e, run, mask=real)
            tl.debug_barrier()  # ... and sees the new values in the next chunk
        first_b = 0
        b_end = num_m_blocks
    else:
        p, ids, valid = _chunk_ids(ids_ptr, c, num_pairs, top_k, stride_t, stride_k, num_experts, CHUNK)
        bb = tl.where(valid, ids, 0)
        dest = (tl.load(tables_ptr + num_experts + bb, mask=valid, other=0)
                + tl.load(offsets_ptr + bb * num_chunks + c, mask=valid, other=0) + _chunk_ranks(ids, valid, CHUNK))
        tl.store(out_ptr + dest, p, mask=valid)
        bpp = tl.cdiv(num_m_blocks, num_chunks)
        first_b = c * bpp
        b_end = tl.minimum((c + 1) * bpp, num_m_blocks)
    # this program's M blocks
    r = tl.arange(0, BLOCK_M)
    for b0 in range(first_b, b_end, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        bok = blk < b_end
        # the block's expert = how many experts' padded runs end at or before its first row
        ended = tl.sum(((pend[None, :] <= (blk * BLOCK_M)[:, None]) & real[None, :]).to(tl.int32), axis=1)
        ex = tl.where(ended < num_experts, ended, -1)
        tl.store(block_expert_ptr + blk, ex, mask=bok)
        sel = e[None, :] == ex[:, None]  # (BLOCK_B, BINS): the block's expert's lane
        ps = tl.sum(tl.where(sel, pstart[None, :], 0), axis=1)
        tot = tl.sum(tl.where(sel, total[None, :], 0), axis=1)
        rows = blk[:, None] * BLOCK_M + r[None, :]
        pad = (ex[:, None] < 0) | (rows - ps[:, None] >= tot[:, None])
        tl.store(out_ptr + rows, tl.full((BLOCK_B, BLOCK_M), 0, tl.int32) + num_pairs, mask=bok[:, None] & pad)


def routing_tables(top_k_index: torch.Tensor, num_experts: int,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(T, k) expert ids -> ``sorted_pair_ids`` (num_blocks * block_m,) int32,
    ``block_expert`` (num_blocks,) int32 and ``tables`` (5, E) int32, on the ids' device,
    without a host sync.

    ``sorted_pair_ids`` lists the pairs (t*k + j) whose id is in [0, E), grouped by expert
    in increasing pair order (a stable sort), each expert's run padded with the sentinel
    S = T*k to a multiple of block_m; unused tail entries are S too. ``block_expert[b]`` is
    the expert of rows [b*block_m, (b+1)*block_m), or -1 past the last padded row.
    ``tables`` = each expert's run end among the sorted real pairs (its group end for
    ``torch._grouped_mm``), its padded start (its first row in ``sorted_pair_ids``), its
    count (the backward's weight gradients walk an expert's rows [padded start, padded
    start + count): all real pairs), its padded end, and its shift: run start - padded
    start. The GEMMs' tiles walk the padded list (a tile is one expert's); the buffers of
    sorted rows they read and write (GEMM1's output and pre-activation, the sorted copies,
    the backward's d_pre) hold the real pairs only, S rows: padded row r of expert e is
    sorted row r + shift[e] (the grouped weight gradients reduce over no padding, and the
    buffers are S rows, not the padded worst case: on the H200, Qwen3-MoE's training step
    1.4 % faster, its sorted buffers a third smaller; Mixtral and OLMoE unchanged, thirty-third
    session, bench/RESULTS.md). Sizes are static
    (:func:`num_blocks`), so this can be captured in a CUDA graph. All three are views of
    one int32 buffer (:func:`routing_views`; the forward keeps it as ``Saved.routing``).

    A counting sort in three launches (per-chunk counts, a scan per expert, placement)
    into one int32 buffer; where the pairs fit a few chunks (T*k <= 512, decode) one
    program of the placement kernel counts and places them all, one launch. ``torch.sort``
    cost 100-250 us of host per call on the H200 box and 60 us of GPU at T = 4096, k = 8
    (eight radix passes over int64 keys)."""
    return route(top_k_index, num_experts, block_m)[1:]


def routing_views(buf: torch.Tensor, num_pairs: int, num_experts: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pair_ids, block_expert, tables) of :func:`routing_tables`, as views of the
    routing's one int32 buffer (a saved buffer is one tensor to keep)."""
    nb = num_blocks(num_pairs, num_experts, block_m)
    cap = nb * block_m
    return buf[:cap], buf[cap:cap + nb], buf[cap + nb:cap + nb + TABLES * num_experts].view(TABLES, num_experts)


def routing_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of the routing's int32 buffer: the padded pair list, the block
    experts, the (5, E) tables, then the count kernel's per-chunk counts (E per chunk)."""
    nb = num_blocks(num_pairs, num_experts, block_m)
    if nb == 0:
        return TABLES * num_experts
    return nb * block_m + nb + TABLES * num_experts + num_experts * cdiv(num_pairs, ROUTE_CHUNK)


def route(top_k_index: torch.Tensor, num_experts: int, block_m: int, spec: Any = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buffer, sorted_pair_ids, block_expert, tables). ``spec``: as :func:`.moe_experts.launch_gemm`'s."""
    buf, sorted_pair_ids, block_expert, flat = route_flat(top_k_index, num_experts, block_m, spec)
    return buf, sorted_pair_ids, block_expert, flat.view(TABLES, num_experts)


@functools.lru_cache(maxsize=4096)
def _route_layout(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int, int, int, int]:
    """(blocks, padded rows, buffer length, chunks, BINS) of the routing (see :func:`routing_size`)."""
    nb = num_blocks(num_pairs, num_experts, block_m)
    return (nb, nb * block_m, routing_size(num_pairs, num_experts, block_m), cdiv(num_pairs, ROUTE_CHUNK),
            next_pow2(num_experts))


_route_layout = traced_constant(_route_layout)


def route_flat(top_k_index: torch.Tensor, num_experts: int, block_m: int, spec: Any = None
                ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`route` with the tables as one (5 E,) view (each view is ~3 us of host on the
    2-core box, and the forward alone reads no table). Traced by Dynamo: four buffers of
    their own and no common one (None): functionalized, a kernel's write into a view of one
    buffer becomes a copy of that buffer with the view's part replaced."""
    t, k = top_k_index.shape
    s = t * k
    nb, cap, length, nc, bins = _route_layout(s, num_experts, block_m)
    dev = top_k_index.device
    if nb == 0:  # no real pair can be routed: empty lists, zero tables
        buf = torch.zeros((TABLES * num_experts,), dtype=torch.int32, device=dev)
        return buf, buf[:0], buf[:0], buf
    t0 = cap + nb
    if dynamo_tracing():
        buf = None
        sorted_pair_ids, block_expert, tables, counts = (
            torch.empty((n,), dtype=torch.int32, device=dev) for n in (cap, nb, TABLES * num_experts,
                                                                         length - t0 - TABLES * num_experts))
    else:
        buf = make(int_buffer, (length,), torch.int32, dev)
        sorted_pair_ids, block_expert, tables = buf[:cap], buf[cap:t0], buf[t0:t0 + TABLES * num_experts]
        counts = buf[t0 + TABLES * num_experts:]  # per (expert, chunk); one program's scratch (E entries)
    st, sk = top_k_index.stride()
    # decode-sized (T*k <= ROUTE_ONE_PROGRAM_CHUNKS * ROUTE_CHUNK): one launch instead of
    # three (each ~15-25 us of host on the H200 box), one program walking the chunks
    one = nc <= ROUTE_ONE_PROGRAM_CHUNKS
    if not one:
        launch(_route_count_kernel, (nc,), top_k_index, counts, s, k, st, sk, num_experts, nc, spec_key=spec,
               CHUNK=ROUTE_CHUNK, BINS=bins, num_warps=4)
        launch(_route_scan_kernel, (num_experts,), counts, tables, num_experts, nc, spec_key=spec,
               CB=min(next_pow2(nc), 1024), num_warps=4)
    launch(_route_place_kernel, (1 if one else nc,), top_k_index, counts, tables, sorted_pair_ids, block_expert, s,
           k, st, sk, num_experts, nc, nb, spec_key=spec, CHUNK=ROUTE_CHUNK, BINS=bins, BLOCK_M=block_m,
           BLOCK_B=max(1, min(64, 8192 // bins)), ONE_PROGRAM=one, num_warps=4)
    return buf, sorted_pair_ids, block_expert, tables


def align_block_size(top_k_index: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_pair_ids`` and ``block_expert`` of :func:`routing_tables`."""
    sorted_pair_ids, block_expert, _ = routing_tables(top_k_index, num_experts, block_m)
    return sorted_pair_ids, block_expert


@plain
def int_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The routing's buffer (int32: every element the routing kernels read, they write first)."""
    return torch.empty(shape, dtype=dtype, device=device)
