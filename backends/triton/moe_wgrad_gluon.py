"""The MoE weight gradients on Hopper as grouped GEMMs (ping-pong and cooperative), in Gluon.

    out[e] = A[start_e:end_e]^T @ B[start_e:end_e]     A (S, M), B (S, N) bf16 -> out (E, M, N) bf16

with end_e = offs[e] and start_e = offs[e - 1] (0 for e = 0): ``torch._grouped_mm(A.t(), B,
offs=offs)``, the form :mod:`.moe_experts_backward` computes d gate_up_proj and d down_proj in.
fp32 accumulation over the rows in order, rounded once (on the H100 every result so far equals
CUTLASS's bit for bit); an expert with no rows gets zeros; no row at or past ``offs[-1]`` reaches
a result (those rows may hold anything, NaN included).

Why: each expert's reduction is short (Qwen3-MoE at T = 4096: ~256 rows, 4-5 steps of 64), so
a tile's epilogue (storing its output tile: the gradients are 1.2 GB of bf16 there) and its
pipeline fill cost as much as its MMAs. torch's CUTLASS kernel at these shapes is the
cooperative one (two warpgroups on one 128 x 256 tile): fitted to the kept times, 3.1 us per
tile that no MMA hides plus 0.71 us per step (H100; 3.3 + 0.76 on the H200). Here two 4-warp
consumers alternate 128 x 128 tiles, so one's epilogue and TMA store run under the other's
MMAs: ~0.4 us per tile plus 0.49-0.58 per (half as wide) step (H100, 2026-12-05,
bench/RESULTS.md). Faster where the reductions are short, slower where they are long (the
MMA loop of one warpgroup on 128 x 128 tiles runs at ~70 % of CUTLASS's: per 128 x 128 x 64
step it moves 48 KB of wgmma operand reads and 32 KB of TMA writes through shared memory, a
cooperative 128 x 256 tile 64 KB for the same work).

So there is a second kernel, :func:`wgrad_coop_kernel` (``cooperative=True``): both consumers
on one 128 x 256 tile, each a 64 x 256 half (m64n256 wgmmas sharing B's stage), CUTLASS's
cooperative split, but every tile walks one descriptor per operand (no per-expert descriptor
updates) and an expert's last step is fixed by both consumers, each its half. H100, 2026-12-05
and 06 (``bench/moe_wgrad.py --sweep``, two runs): 1.07-1.35x CUTLASS from 384 to 2048 rows
per expert on all six shapes, where ping-pong fell to 0.77-1.11x at 2048; ping-pong is the
faster of the two at 256-512 rows on most shapes. The caller picks
(``moe_experts_backward.gluon_wgrad_default``).

The ping-pong kernel: a persistent program per SM walks its tiles (expert-major, t = pid + i * grid);
a 1-warp TMA loader streams both consumers' steps, 64 rows of A and of B each, through one
ring of ``stages`` buffers (ready / empty mbarriers); consumer c takes the program's tiles
i = c mod 2 and starts a tile's MMAs only once the other has issued its previous tile's
(the order mbarriers, as CUTLASS's ping-pong: this also keeps each consumer within one lap of
the ring, so a parity wait cannot pass on a stale phase). The last step of an expert zeroes
its rows past the expert's end in both operands' shared memory before the MMA. Each consumer
stores its tile through its own shared buffer and TMA, waiting for that store only before its
next tile's epilogue.

Launched through ``launch.py``'s cache (Triton's generated C launcher on a hit), not Triton's
own ``kernel[grid]``: host time to enqueue a call 28-34 us against 55-63 (H100 host,
``bench/moe_wgrad.py --host``; ``torch._grouped_mm``'s 20-23). Steps that wait on their host
(T <= 512) still pay the difference, which is why the caller's default starts at 192 rows per
expert (``moe_experts_backward.gluon_wgrad_default``).

Needs sm90 (wgmma, TMA), triton's Gluon (3.6; 3.8 compiles it too), bf16, contiguous
operands, M and N multiples of 128 (N of 256 for the cooperative kernel), S >= 64: :func:`unfit`
says which is missing. Gluon has
no interpreter: the kernel runs on the GPU only (``tests/test_moe_triton_backward.py``'s CUDA
cases).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from opreg.backends.triton.launch import launch

__all__ = ["COOP_STAGES", "STAGES", "stages_for", "unfit", "wgrad"]

# a partition-wide barrier: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # an output tile; rows (the reduction) per step
COOP_BLOCK_N = 256  # the cooperative kernel's tile: 128 x 256, a 64 x 256 half a consumer
# its ring: 3 stages of 48 KB with the two 32 KB store buffers (212,992 bytes); 4 do not fit
COOP_STAGES = 3
# the ring's depth: 5 (229,656 bytes of shared memory with the two epilogue buffers) up to 512
# rows per expert, 4 from 768 on: the faster of the two in 40 of 48 shapes of one H100 sweep
# (bench/moe_wgrad.py --sweep, 2026-12-05), within 5 % in the rest
STAGES = 5


def stages_for(rows_per_expert: float) -> int:
    """The ring's depth for this mean number of rows per expert."""
    return STAGES if rows_per_expert <= 512 else 4
# registers a thread: the loader warp 40, the second consumer 184 (no spills; Triton raises
# the default partition, the first consumer, to 256, and 4 x 32 x (256 + R) + 32 x 40 must fit
# the SM's 65,536 or setmaxnreg waits forever: R <= 216)
CONSUMER_REGS, LOADER_REGS = 184, 40


@gluon.jit
def _tile_info(t, offs_ptr, tiles_n, tiles_per_expert, BK: gl.constexpr):
    """Expert-major tile id -> (expert, tile_m, tile_n, first row, end row, k-steps).

    Every partition derives the step count from this one function, so the
    loader and both consumers agree on the ring position by construction.
    An empty (or, for bad offs, negative) row range gives 0 steps: the loader
    loads nothing and the owning consumer stores a zero tile.
    """
    e = t // tiles_per_expert
    r = t - e * tiles_per_expert
    tm = r // tiles_n
    tn = r - tm * tiles_n
    end = gl.load(offs_ptr + e)
    start = gl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    rows = gl.maximum(end - start, 0)
    nsteps = (rows + (BK - 1)) // BK
    return e, tm, tn, start, end, nsteps


@gluon.jit
def _zero_rows_past(buf, valid):
    """Rows >= valid of a [BK, n] stage zeroed (an expert's last step: rows past its end are the
    next expert's, rows past offs[-1] that the caller never wrote (NaN in the tests), or past S
    (TMA's zero fill); zeroed in both operands, as 0 * NaN is NaN), with 16-byte vectors along
    the contiguous dim, the partition's 4 warps stacked over rows."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, layout)), 1)
    x = buf.load(layout)
    buf.store(gl.where(rows < valid, x, gl.zeros_like(x)))


@gluon.jit
def _store_tile(acc, c_smem, c_desc, row, col):
    """A consumer's epilogue: ``acc`` rounded into its shared buffer and stored by TMA at (row,
    col). The previous tile's store from that buffer ran under this tile's MMAs: only now
    waited for."""
    tma.store_wait(0)
    _barrier()  # the issuing thread's wait covers every warp's writes
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _barrier()  # all warps' smem writes precede the TMA store
    tma.async_copy_shared_to_global(c_desc, [row, col], c_smem)


@gluon.jit
def _schedule(M, N, total_tiles, BM: gl.constexpr, BN: gl.constexpr):
    """This program's share of the persistent grid: (pid, programs, tiles along N, tiles an
    expert, its tile count; the wrapper launches at most total_tiles programs, so >= 1)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tiles_n = N // BN
    return pid, nprog, tiles_n, (M // BM) * tiles_n, (total_tiles - pid + nprog - 1) // nprog


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, pid, nprog, n_local, tiles_n,
            tiles_per_expert):
    # Sizes come from buffer/descriptor types (the ring's depth, the tiles of either kernel).
    STAGES: gl.constexpr = a_bufs.shape[0]
    BK: gl.constexpr = a_bufs.shape[1]
    BM: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[2]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes

    g = 0  # global k-step counter over all of this program's tiles (both consumers)
    for i in range(n_local):
        t = pid + i * nprog
        e, tm, tn, start, end, nsteps = _tile_info(t, offs_ptr, tiles_n, tiles_per_expert, BK)
        for j in range(nsteps):
            s = g % STAGES
            # A fresh mbarrier counts as having completed the phase before
            # phase 0, so waiting on parity 1 first lets the ring fill.
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            row = start + j * BK
            # rows past end (the next expert's, or past S: TMA's zero fill) are
            # loaded too; the consumer zeroes them on the last step
            tma.async_copy_global_to_shared(a_desc, [row, tm * BM], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [row, tn * BN], ready.index(s), b_bufs.index(s))
            g += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, c_smem, ready, empty, order, c_desc, offs_ptr, pid, nprog, n_local, M, tiles_n,
              tiles_per_expert, WHICH: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.shape[0]
    BK: gl.constexpr = a_bufs.shape[1]
    BM: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[2]
    # wgmma accumulator: one warpgroup, 128x128 fp32 -> 128 regs/thread.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])

    g = 0  # global k-step index of tile i's first step (same count as the loader's)
    for i in range(n_local):
        t = pid + i * nprog
        e, tm, tn, start, end, nsteps = _tile_info(t, offs_ptr, tiles_n, tiles_per_expert, BK)
        if i % 2 == WHICH:
            # Ping-pong order: start this tile's main loop only once the other
            # consumer has issued all of tile i-1's steps. Besides serializing
            # the two main loops (so one's epilogue hides under the other's
            # MMAs), this is what makes the ready[] parity waits sound: without
            # it a consumer whose partner lags can run two ring laps ahead of
            # the loader (any tile with >= STAGES steps) and a parity wait
            # would pass on a stale phase. With it, every step before ours has
            # been waited on, so ready[s] is at most one phase behind.
            if i > 0:
                mbarrier.wait(order.index(1 - WHICH), ((i - 1) // 2) & 1)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            for j in range(nsteps):
                s = (g + j) % STAGES
                mbarrier.wait(ready.index(s), ((g + j) // STAGES) & 1)
                a_s = a_bufs.index(s)
                b_s = b_bufs.index(s)
                valid = end - (start + j * BK)
                if valid < BK:  # the expert's last step
                    _zero_rows_past(a_s, valid)
                    _zero_rows_past(b_s, valid)
                    # the generic proxy's writes made visible to wgmma (the async proxy),
                    # every warp's done before any issues it
                    fence_async_shared()
                    _barrier()
                # A stage is [BK, BM] with M contiguous; the permuted view is
                # the [BM, BK] MN-major operand wgmma accepts for 16-bit types.
                acc = warpgroup_mma(a_s.permute((1, 0)), b_s, acc, is_async=True)
                # Keep one wgmma in flight; the one before it is finished, so
                # its stage can go back to the loader.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if j > 0:
                    mbarrier.arrive(empty.index((g + j - 1) % STAGES))
            # All of this tile's steps are waited on and issued: hand the
            # tensor core to the other consumer (order[WHICH] completes once
            # per tile of ours: completion #k+1 <=> our k-th tile).
            mbarrier.arrive(order.index(WHICH))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if nsteps > 0:
                mbarrier.arrive(empty.index((g + nsteps - 1) % STAGES))

            _store_tile(acc, c_smem, c_desc, e * M + tm * BM, tn * BN)
        g += nsteps
    # smem must stay valid until the last TMA store has read it.
    tma.store_wait(0)


@gluon.jit
def wgrad_kernel(a_desc, b_desc, c_desc, offs_ptr, M, N, total_tiles, STAGES: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    BK: gl.constexpr = a_desc.block_type.shape[0]
    BM: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    gl.static_assert(b_desc.block_type.shape[0] == BK)
    gl.static_assert(c_desc.block_type.shape[0] == BM)
    gl.static_assert(c_desc.block_type.shape[1] == BN)

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BK, BM], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    # One epilogue buffer per consumer so each store can drain independently.
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BM, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # count 1: ready gets the loader's single expect-arrive (+ TMA bytes);
        # empty gets one arrive from the owning consumer partition.
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    # order[c]: consumer c finished issuing a tile's main loop (one arrive per tile).
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(order.index(0), count=1)
    mbarrier.init(order.index(1), count=1)
    fence_async_shared()

    pid, nprog, tiles_n, tiles_per_expert, n_local = _schedule(M, N, total_tiles, BM, BN)

    # The partitions' arguments written out in the call (a tuple assigned to a name first would
    # turn the consumer's index, a constexpr, into a runtime value: CONTRIBUTING.md).
    # triton 3.6 signature: ([(fn, args) default first, workers...], worker warps, worker regs)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, c_bufs.index(0), ready, empty, order, c_desc, offs_ptr, pid, nprog, n_local, M,
                     tiles_n, tiles_per_expert, 0)),
        (_consumer, (a_bufs, b_bufs, c_bufs.index(1), ready, empty, order, c_desc, offs_ptr, pid, nprog, n_local, M,
                     tiles_n, tiles_per_expert, 1)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, pid, nprog, n_local, tiles_n,
                   tiles_per_expert)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _coop_consumer(a_bufs, b_bufs, c_smem, ready, fixed, empty, c_desc, offs_ptr, pid, nprog, n_local, M, tiles_n,
                   tiles_per_expert, WHICH: gl.constexpr):
    # Both consumers on one 128 x 256 tile: consumer c takes its rows [64 c, 64 c + 64) of
    # A's stage and all of B's, one m64n256 wgmma a 16-row slice (CUTLASS's cooperative
    # split). An expert's last step is fixed by both (rows past its end zeroed: each its
    # half of A's stage and of B's columns), then each waits for the other's half (fixed).
    STAGES: gl.constexpr = a_bufs.shape[0]
    BK: gl.constexpr = a_bufs.shape[1]
    BM: gl.constexpr = a_bufs.shape[2]
    BN: gl.constexpr = b_bufs.shape[2]
    HM: gl.constexpr = BM // 2
    HN: gl.constexpr = BN // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])

    g = 0
    tails = 0  # last steps fixed so far: fixed's phase (both consumers count the same ones)
    for i in range(n_local):
        t = pid + i * nprog
        e, tm, tn, start, end, nsteps = _tile_info(t, offs_ptr, tiles_n, tiles_per_expert, BK)
        acc = gl.zeros([HM, BN], gl.float32, acc_layout)
        for j in range(nsteps):
            s = (g + j) % STAGES
            mbarrier.wait(ready.index(s), ((g + j) // STAGES) & 1)
            a_s = a_bufs.index(s).slice(WHICH * HM, HM, dim=1)
            valid = end - (start + j * BK)
            if valid < BK:  # the expert's last step: this consumer's halves
                _zero_rows_past(a_s, valid)
                _zero_rows_past(b_bufs.index(s).slice(WHICH * HN, HN, dim=1), valid)
                fence_async_shared()
                _barrier()
                # fixed (count 2) completes once both halves are written; neither consumer
                # can arrive for the next last step before the other has arrived for this one
                mbarrier.arrive(fixed)
                mbarrier.wait(fixed, tails & 1)
                tails += 1
            acc = warpgroup_mma(a_s.permute((1, 0)), b_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if j > 0:
                mbarrier.arrive(empty.index((g + j - 1) % STAGES))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if nsteps > 0:
            mbarrier.arrive(empty.index((g + nsteps - 1) % STAGES))
        _store_tile(acc, c_smem, c_desc, e * M + tm * BM + WHICH * HM, tn * BN)
        g += nsteps
    tma.store_wait(0)


@gluon.jit
def wgrad_coop_kernel(a_desc, b_desc, c_desc, offs_ptr, M, N, total_tiles, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """:func:`wgrad_kernel` on 128 x 256 tiles, both consumers on each (c_desc's box: one
    consumer's half, 64 x 256); the same loader and tile order."""
    BK: gl.constexpr = a_desc.block_type.shape[0]
    BM: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[1]
    gl.static_assert(b_desc.block_type.shape[0] == BK)
    gl.static_assert(c_desc.block_type.shape[0] * 2 == BM)
    gl.static_assert(c_desc.block_type.shape[1] == BN)

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BK, BM], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BK, BN], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BM // 2, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release a stage
    fixed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(fixed, count=2)  # both consumers' halves of a last step zeroed
    fence_async_shared()

    pid, nprog, tiles_n, tiles_per_expert, n_local = _schedule(M, N, total_tiles, BM, BN)

    gl.warp_specialize([
        (_coop_consumer, (a_bufs, b_bufs, c_bufs.index(0), ready, fixed, empty, c_desc, offs_ptr, pid, nprog, n_local,
                          M, tiles_n, tiles_per_expert, 0)),
        (_coop_consumer, (a_bufs, b_bufs, c_bufs.index(1), ready, fixed, empty, c_desc, offs_ptr, pid, nprog, n_local,
                          M, tiles_n, tiles_per_expert, 1)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, pid, nprog, n_local, tiles_n,
                   tiles_per_expert)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@functools.cache
def _layouts(bn: int = BLOCK_N, cm: int = BLOCK_M) -> tuple[object, object, object]:
    """The NVMMA shared layouts of A's stage ([64, 128]), B's ([64, bn]) and a store's tile ([cm, bn])."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BLOCK_K, bn], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([cm, bn], gl.bfloat16))


@functools.cache
def _device(index: int) -> tuple[tuple[int, int], int]:
    p = torch.cuda.get_device_properties(index)
    return (p.major, p.minor), p.multi_processor_count


def unfit(a: torch.Tensor, b: torch.Tensor, cooperative: bool = False) -> str | None:
    """Why :func:`wgrad` can't take A (S, M) and B (S, N), or None."""
    for name, t in (("A", a), ("B", b)):
        if not t.is_cuda or t.dtype != torch.bfloat16 or t.dim() != 2:
            return f"{name} is not a 2-D bf16 CUDA tensor ({t.dtype}, {tuple(t.shape)}, {t.device})"
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} is not contiguous and 16-byte aligned (TMA)"
    if a.device != b.device:
        return "A and B are on different devices"
    if b.shape[0] != a.shape[0] or a.shape[0] < BLOCK_K:
        return f"A and B need the same rows, at least {BLOCK_K} (got {a.shape[0]} and {b.shape[0]})"
    bn = COOP_BLOCK_N if cooperative else BLOCK_N
    if a.shape[1] % BLOCK_M or b.shape[1] % bn or not (a.shape[1] and b.shape[1]):
        return f"the output's sides ({a.shape[1]}, {b.shape[1]}) are not positive multiples of ({BLOCK_M}, {bn})"
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    if _device(index)[0][0] != 9:
        return f"the GPU is sm{''.join(map(str, _device(index)[0]))}, not sm90 (wgmma)"
    return None


def wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out: torch.Tensor | None = None,
          stages: int | None = None, programs: int | None = None, cooperative: bool = False) -> torch.Tensor:
    """out (E, M, N) bf16: out[e] = A[start_e:end_e]^T @ B[start_e:end_e]. ``offs``: (E,) int32
    run ends on A's device (not read on the host). ``out``: a contiguous (E, M, N) bf16 buffer
    to write, every element. ``programs``: how many persistent programs (default one per SM;
    never more than the tiles). ``cooperative``: both consumers on each 128 x 256 tile
    (:func:`wgrad_coop_kernel`; N a multiple of 256) instead of ping-pong on 128 x 128 tiles.
    ``stages``: the ring's depth (default :data:`STAGES`, :data:`COOP_STAGES` cooperative).
    Raises ValueError naming what :func:`unfit` rejects."""
    if (why := unfit(a, b, cooperative)) is not None:
        raise ValueError(f"moe wgrad (Gluon): {why}")
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() < 1 or not offs.is_contiguous() \
            or offs.device != a.device:
        raise ValueError("moe wgrad (Gluon): offs must be a contiguous 1-D int32 tensor of run ends on A's device")
    depths = (2, 3) if cooperative else (3, 4, 5)  # what fits the shared memory with the epilogue's buffers
    stages = stages if stages is not None else COOP_STAGES if cooperative else STAGES
    if stages not in depths:
        raise ValueError(f"moe wgrad (Gluon): stages must be one of {depths}{' (cooperative)' * cooperative}, "
                         f"got {stages}")
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"moe wgrad (Gluon): programs must be a positive int, got {programs!r}")
    m, n, e = a.shape[1], b.shape[1], offs.numel()
    if out is None:
        out = torch.empty((e, m, n), device=a.device, dtype=torch.bfloat16)
    elif out.shape != (e, m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous() \
            or out.device != a.device or out.data_ptr() % 16:
        raise ValueError(f"moe wgrad (Gluon): out must be a contiguous bf16 ({e}, {m}, {n}) tensor on A's device")
    bn, cm = (COOP_BLOCK_N, BLOCK_M // 2) if cooperative else (BLOCK_N, BLOCK_M)  # a tile's N; a store's rows
    a_layout, b_layout, c_layout = _layouts(bn, cm)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_K, BLOCK_M], a_layout)
    b_desc = TensorDescriptor.from_tensor(b, [BLOCK_K, bn], b_layout)
    c_desc = TensorDescriptor.from_tensor(out.view(e * m, n), [cm, bn], c_layout)
    tiles = e * (m // BLOCK_M) * (n // bn)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid = (min(programs or _device(index)[1], tiles),)
    # what Triton specialises on beyond the fixed dtypes, boxes and layouts: the constexprs,
    # offs' alignment and total_tiles' int class (M and N are multiples of 128)
    spec = (stages, offs.data_ptr() % 16 == 0, tiles == 1, tiles % 16 == 0)
    launch(wgrad_coop_kernel if cooperative else wgrad_kernel, grid, a_desc, b_desc, c_desc, offs, m, n, tiles,
           spec_key=spec, STAGES=stages, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS, num_warps=4)
    return out
