// opreg::scatter_combine forward, large path (every call the tiny and small
// paths of scatter_combine_tiny.cu / _small.cu do not take; the host picks and
// calls launch_large, scatter_combine.cu). Three forms, the same reducer code
// and the same bits (the choice is in launch_with):
//  * local (the default where token_idx is short: paths::local_pays): ONE
//    launch, no workspace, no grid barrier: each block reads all of token_idx
//    and builds its own tokens' lists in shared memory, then sums them;
//  * fused (the default otherwise): ONE cooperative launch, grid.sync()
//    between the phases zero -> count -> [overflow offsets -> place, only
//    when a token has more than kEll rows] -> reduce, on a global workspace;
//  * multi-kernel (the fallback): memset(counts) -> count -> overflow scan +
//    place -> reduce, 5-6 launches. It runs where the fused kernel cannot
//    (no cudaDevAttrCooperativeLaunch, not one block per SM, or the driver
//    refuses the grid: launch_fused).
// OPREG_SCATTER_COMBINE_LARGE=multi|fused|local forces a form where it can run
// (read per call in scatter_combine.cu: the tests compare the three bit for
// bit). No host sync in any. kEll and the scan constants are in
// scatter_combine.cuh (the host sizes the workspace with them).
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <type_traits>

#include "pdl.cuh"
#include "scatter_combine.cuh"

namespace opreg {
namespace sc_detail {
namespace {

// ---------------------------------------------------------------------------
// Large path: per-token row lists built on the device.
//
// The first version (CSR: offsets -> perm -> block-wide sort -> gates -> x,
// one 128-thread block per token) reached only 59 % / 69 % of copy bandwidth
// (163 us for 16384 x 2 x 4096 bf16, 367 us for 8192 x 8 x 7168): each block
// spent 3-4 dependent memory round trips before its first data load and only
// ~4 blocks fit per SM. Now the first kEll rows of each token go straight
// into a fixed-width table ell[t][0..8) by the counting kernel (slot = the
// integer-atomic return value), so a reducer needs ONE round trip
// (count + ell, independent loads) before its data loads; only rows beyond
// the 8th go through an overflow CSR (scan + place). Work items are
// (token, column chunk) pairs, one per warp, no block-wide barriers.
// (kEll = 8, kScanThreads, kScanPerThread, kScanTile: scatter_combine.cuh.)
constexpr int kRedWarps = 4;         // warps (= work items) per block of the multi-kernel reduce
constexpr int kWarpSortCap = 1024;   // longest row list sorted in shared memory (per warp, 4 KB)

// Dynamic shared memory a block of `threads` needs: kWarpSortCap rows a warp, the sort
// scratch of accumulate_long_token. Dynamic because the fused kernel's block is as many
// warps as an SM holds (launch_fused): up to 128 KB, past a block's 48 KB of static memory.
constexpr size_t sort_smem_bytes(int threads) {
  return size_t(threads / 32) * kWarpSortCap * sizeof(int);
}

// Warps a block has: kWarps where the kernel fixes it (the multi-kernel reduce's kRedWarps),
// else (0: the fused kernel's blocks past 128 threads, which the host sizes to the work,
// launch_fused) blockDim's.
// Work items are numbered by warp across the grid (block * warps + warp).
template <int kWarps>
__device__ __forceinline__ int block_warps() {
  return kWarps > 0 ? kWarps : int(blockDim.x >> 5);
}

// This warp's sort scratch.
__device__ __forceinline__ int* warp_sort_rows() {
  extern __shared__ int s_sort_rows[];
  return s_sort_rows + (threadIdx.x >> 5) * kWarpSortCap;
}

// Column vectors per lane per item: an item covers 512 elements for 16-bit
// types (NV = 2: 80 registers instead of 127 with NV = 4, 6 vs 4 blocks per SM)
// and 512 / 256 elements for fp32 / fp64.
template <int V>
constexpr int red_nv() {
  return V >= 8 ? 2 : 4;
}

// Where a reducer's per-token lists (counts, ell, overflow offsets and rows)
// come from, which fixes how it reads them and which tokens a warp sums:
//  * kLaunch: the global workspace, written by an earlier launch (the
//    multi-kernel path): plain loads; the grid's warps over every token;
//  * kGrid: the global workspace, written earlier in this launch before a grid
//    barrier (the fused kernel): L2 loads (ld.global.cg), which no stale L1 or
//    read-only-cache line can serve; the grid's warps over every token;
//  * kBlock: this block's shared memory (the local kernel): plain loads; the
//    block's warps over its own tokens [t0, t1) only, whose entries sit at
//    t - t0, and a token with more than kEll rows has ALL its rows in its
//    overflow segment (BlockLists, below).
enum class Lists { kLaunch, kGrid, kBlock };

template <Lists kL>
__device__ __forceinline__ int ws_load(const int* p) {
  if constexpr (kL == Lists::kGrid) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

// What a reducer is given besides the pointers: the wide-row reducer's work
// items (token, column chunk) and chunks per token (the short-row reducer
// needs neither: it walks num_tokens), and the tokens a block owns in the
// local kernel (block_tokens, a multiple of the reducer's kLocalAlign; 0 elsewhere).
struct ReduceWork {
  int64_t items;
  int chunks;
  int64_t block_tokens = 0;
};

// The tokens this block's warps sum and whose list entries it reads at
// t - t0: all of them from 0 (kLaunch, kGrid: the grid's warps take turns),
// or its own [t0, t1) (kBlock).
struct TokenSpan {
  int64_t t0, t1;
};

template <Lists kL>
__device__ __forceinline__ TokenSpan block_span(const ReduceWork& w, int64_t num_tokens) {
  if constexpr (kL == Lists::kBlock) {
    const int64_t t0 = int64_t(blockIdx.x) * w.block_tokens;
    return {t0, min(num_tokens, t0 + w.block_tokens)};
  } else {
    return {0, num_tokens};
  }
}

// A warp's first unit of work and its stride, units numbered from `lo` (a
// reducer's items or token groups): the grid's warps in turn (kLaunch, kGrid;
// lo is 0 there), or this block's (kBlock).
struct Walk {
  int64_t first, stride;
};

template <Lists kL, int kWarps>
__device__ __forceinline__ Walk warp_walk(int64_t lo) {
  const int64_t warp = threadIdx.x >> 5, warps = block_warps<kWarps>();
  if constexpr (kL == Lists::kBlock) {
    return {lo + warp, warps};
  } else {
    return {int64_t(blockIdx.x) * warps + warp, int64_t(gridDim.x) * warps};
  }
}

// Grid-strided over rows: counts[t] += 1 per row of t (integer atomics, the
// return value is the row's slot), slots < kEll go into ell[t][slot].
// flag[0] is set when some token has more than kEll rows; the overflow scan
// and place kernels return at once otherwise (they cost 4.8 + 1.1 us of
// device time at 16384 tokens, for nothing in the common fan-out <= 8 case).
__device__ __forceinline__ void count_rows(
    const void* __restrict__ idx, bool idx64, int n, int64_t num_tokens, int* counts, int* ell,
    int* slot, int* flag) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) {
    const int64_t t = load_index(idx, r, idx64);
    int s = -1;
    if (t >= 0 && t < num_tokens) {
      s = atomicAdd(counts + t, 1);
      if (s < kEll) {
        ell[t * kEll + s] = r;
      } else if (s == kEll) {
        *flag = 1;  // benign race: every writer stores 1
      }
    }
    slot[r] = s;
  }
}

__global__ void count_kernel(
    const void* __restrict__ idx, bool idx64, int n, int64_t num_tokens,
    int* __restrict__ counts, int* __restrict__ ell, int* __restrict__ slot, int* __restrict__ flag) {
  count_rows(idx, idx64, n, num_tokens, counts, ell, slot, flag);
}

// Block-wide sum (1024 threads); result valid in every thread.
__device__ __forceinline__ int block_sum_1024(int v, int* s_w) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s_w[threadIdx.x >> 5] = v;
  __syncthreads();
  int s = 0;
#pragma unroll
  for (int w = 0; w < 32; ++w) s += s_w[w];
  return s;
}

__device__ __forceinline__ int overflow_of(const int* counts, int64_t t) {
  return max(counts[t] - kEll, 0);
}

__global__ void __launch_bounds__(kScanThreads) tile_sum_kernel(
    const int* __restrict__ counts, int64_t num_tokens, int* __restrict__ tile_sums,
    const int* __restrict__ flag) {
  if (*flag == 0) return;
  __shared__ int s_w[32];
  const int64_t base = int64_t(blockIdx.x) * kScanTile;
  int s = 0;
  for (int i = threadIdx.x; i < kScanTile; i += kScanThreads)
    if (base + i < num_tokens) s += overflow_of(counts, base + i);
  s = block_sum_1024(s, s_w);
  if (threadIdx.x == 0) tile_sums[blockIdx.x] = s;
}

// ooff[t] = sum over t' < t of max(counts[t'] - kEll, 0); one block per tile,
// each block adds the sums of the tiles before it (few: num_tokens / 16384).
// Warp w owns 512 consecutive tokens, read and written coalesced, 32 at a
// time (a thread-owns-16-consecutive layout took 18.7 us for 16384 tokens).
__global__ void __launch_bounds__(kScanThreads) scan_kernel(
    const int* __restrict__ counts, int64_t num_tokens, const int* __restrict__ tile_sums,
    int* __restrict__ ooff, const int* __restrict__ flag) {
  if (*flag == 0) return;
  __shared__ int s_w[32];
  int pre = 0;
  for (int i = threadIdx.x; i < int(blockIdx.x); i += kScanThreads) pre += tile_sums[i];
  pre = block_sum_1024(pre, s_w);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t wbase = int64_t(blockIdx.x) * kScanTile + int64_t(warp) * (32 * kScanPerThread);
  int v[kScanPerThread];
#pragma unroll
  for (int e = 0; e < kScanPerThread; ++e) {
    const int64_t i = wbase + e * 32 + lane;
    v[e] = i < num_tokens ? overflow_of(counts, i) : 0;
  }
  int excl[kScanPerThread];
  int carry = 0;
#pragma unroll
  for (int e = 0; e < kScanPerThread; ++e) {
    const int incl = cuda::warp_inclusive_scan(v[e]);
    excl[e] = carry + incl - v[e];
    carry += __shfl_sync(kFull, incl, 31);
  }
  __syncthreads();  // s_w reuse
  if (lane == 0) s_w[warp] = carry;
  __syncthreads();
  int wpre = pre;
  for (int w = 0; w < warp; ++w) wpre += s_w[w];
#pragma unroll
  for (int e = 0; e < kScanPerThread; ++e) {
    const int64_t i = wbase + e * 32 + lane;
    if (i < num_tokens) ooff[i] = wpre + excl[e];
  }
}

// Grid-strided over rows: each row beyond its token's kEll-th goes to
// operm[ooff[t] + slot - kEll].
template <Lists kL>
__device__ __forceinline__ void place_rows(
    const void* __restrict__ idx, bool idx64, int n, const int* slot, const int* ooff, int* operm) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) {
    const int s = ws_load<kL>(slot + r);
    if (s >= kEll) operm[ws_load<kL>(ooff + load_index(idx, r, idx64)) + (s - kEll)] = r;
  }
}

__global__ void place_kernel(
    const void* __restrict__ idx, bool idx64, int n, const int* __restrict__ slot,
    const int* __restrict__ ooff, int* __restrict__ operm, const int* __restrict__ flag) {
  if (*flag == 0) return;
  place_rows<Lists::kLaunch>(idx, idx64, n, slot, ooff, operm);
}

// The fused kernel's overflow offsets, instead of the two scan kernels: every
// token with more than kEll rows takes a contiguous segment of operm from a
// cursor (one integer atomicAdd per warp of 32 tokens: a warp scan of their
// overflows). Segments land in arbitrary order, which changes nothing in the
// result: a reducer finds its token's segment through ooff[t] and sorts the
// rows by row index before summing, so the bits are those of the scan's
// layout. Grid-strided by warps; ooff[t] is written only for tokens that
// overflow, the only ones whose ooff a reducer reads.
__device__ __forceinline__ void alloc_overflow(
    const int* counts, int64_t num_tokens, int* ooff, int* cursor) {
  const int lane = threadIdx.x & 31;
  const int64_t wstride = int64_t(gridDim.x) * (blockDim.x / 32) * 32;
  for (int64_t base = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * 32;
       base < num_tokens; base += wstride) {  // warp-uniform
    const int64_t t = base + lane;
    const int ov = t < num_tokens ? max(__ldcg(counts + t) - kEll, 0) : 0;
    const int incl = cuda::warp_inclusive_scan(ov);
    const int total = __shfl_sync(kFull, incl, 31);
    if (total == 0) continue;
    int b = 0;
    if (lane == 31) b = atomicAdd(cursor, total);
    b = __shfl_sync(kFull, b, 31);
    if (ov > 0) ooff[t] = b + incl - ov;
  }
}

// acc[k][:] += gate(rows[i]) * x[rows[i], j0 + 32 k] for i in [0, cnt), in
// order; rows[] is warp-uniform (shared memory or a broadcast register copy).
template <typename scalar_t, int V, int NV, int U, typename acc_t, typename RowFn>
__device__ __forceinline__ void warp_accumulate(
    RowFn row_at, int cnt, const Vec<scalar_t, V>* __restrict__ x, const void* gates, bool g32,
    int hvec, int j0, acc_t (&acc)[NV][V]) {
  for (int i = 0; i < cnt; i += U) {
    accumulate_rows<scalar_t, V, NV, U>([&](int u) { return row_at(i + u); }, cnt - i, x, gates,
                                        g32, hvec, j0, acc);
  }
}

// A token with more than kEll rows, summed by the whole warp (lane owns
// vectors j0 + 32 k): its ell rows (`mine`, lanes < kEll) and its overflow rows
// (kBlock: all its rows, in its overflow segment) are bitonic-sorted in the
// warp's shared-memory scratch `rows` (<= 1024 rows), or, past that, token_idx
// is walked in row order. Shared by every reduce so that a token's sum is the
// same code, hence the same bits, whichever kernel owns it. lt: the token's
// list entry (t - t0, TokenSpan).
template <Lists kL, typename scalar_t, int V, int NV, int U, typename acc_t>
__device__ __forceinline__ void accumulate_long_token(
    int64_t t, int64_t lt, int cnt, int mine, int* rows, const Vec<scalar_t, V>* __restrict__ xv,
    const void* __restrict__ idx, bool idx64, const void* __restrict__ gates, bool g32,
    const int* __restrict__ ooff, const int* __restrict__ operm, int n, int hvec, int j0,
    acc_t (&acc)[NV][V]) {
  const int lane = threadIdx.x & 31;
  if (cnt <= kWarpSortCap) {
    int P = 1;
    while (P < cnt) P <<= 1;
    const int o0 = ws_load<kL>(ooff + lt);
    if constexpr (kL == Lists::kBlock) {
      for (int i = lane; i < P; i += 32) rows[i] = i < cnt ? operm[o0 + i] : INT_MAX;
    } else {
      if (lane < kEll) rows[lane] = mine;
      for (int i = kEll + lane; i < P; i += 32) rows[i] = i < cnt ? ws_load<kL>(operm + o0 + i - kEll) : INT_MAX;
    }
    __syncwarp();
    for (int k = 2; k <= P; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = lane; i < P; i += 32) {
          const int ixj = i ^ j;
          if (ixj > i) {
            const int a = rows[i], b = rows[ixj];
            if (((i & k) == 0) == (a > b)) {
              rows[i] = b;
              rows[ixj] = a;
            }
          }
        }
        __syncwarp();
      }
    }
    warp_accumulate<scalar_t, V, NV, U>([&](int i) { return rows[i]; }, cnt, xv, gates, g32, hvec, j0, acc);
    __syncwarp();  // rows[] is rewritten by this warp's next item
  } else {
    // Degenerate fan-in: walk token_idx in row order (ballots keep the order);
    // the matches of each 32-row window are summed U rows at a time.
    for (int rb = 0; rb < n; rb += 32) {
      const int r = rb + lane;
      const unsigned m = __ballot_sync(kFull, r < n && load_index(idx, r, idx64) == t);
      if (m) {
        warp_accumulate<scalar_t, V, NV, U>(
            [&](int i) { return rb + int(__fns(m, 0, i + 1)); }, __popc(m), xv, gates, g32, hvec, j0, acc);
      }
    }
  }
}

// The short-row reducer's tokens with more than kEll rows (flag set by
// count_rows), after its own loop, by the same warps: one warp per long token,
// each lane NV vectors of the row (32 NV >= hvec), each warp reading 32 of its
// tokens' counts at once and balloting out the long ones (every count read
// once more, 4 bytes a token, and only when flag says some token is long).
// Why not in ShortReduce's loop, where it was until 2026-12-05: there this
// path's shared-memory sort, overflow walk and their addresses were live
// beside the rows in flight (ShortReduce's registers, below). A token's sum is
// the same FMA chain over its sorted rows (accumulate_long_token), so the same
// bits.
template <Lists kL, int kWarps, typename scalar_t, int V, int NV, bool kChunked = false>
__device__ __forceinline__ void reduce_long_tokens(
    const int* flag, const Vec<scalar_t, V>* __restrict__ xv, const void* __restrict__ idx, bool idx64,
    const void* __restrict__ gates, bool g32, const int* __restrict__ counts, const int* __restrict__ ell,
    const int* __restrict__ ooff, const int* __restrict__ operm, scalar_t* __restrict__ out, int n,
    int64_t num_tokens, int hvec, int* rows, ReduceWork w) {
  // written before the last grid barrier / launch / __syncthreads: uniform over the warps that read it
  if (ws_load<kL>(flag) == 0) return;
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x & 31;
  // Token t is warp (t mod warps)'s: neighbouring tokens on different warps, so that many long
  // tokens (at fan-out > kEll every token is one) spread over the grid as run()'s tokens do.
  const TokenSpan sp = block_span<kL>(w, num_tokens);
  const Walk wk = warp_walk<kL, kWarps>(sp.t0);
  const int64_t warps = wk.stride;
  for (int64_t tb = wk.first; tb < sp.t1; tb += 32 * warps) {
    const int64_t t_l = tb + lane * warps;
    const int c_l = t_l < sp.t1 ? ws_load<kL>(counts + (t_l - sp.t0)) : 0;
    unsigned longs = __ballot_sync(kFull, c_l > kEll);
    while (longs) {  // warp-uniform
      const int src = __ffs(longs) - 1;
      longs &= longs - 1;
      const int64_t t = tb + src * warps;
      const int cnt = __shfl_sync(kFull, c_l, src);
      const int mine = lane < kEll ? ws_load<kL>(ell + (t - sp.t0) * kEll + lane) : 0;
      // Column chunks of 32 NV vectors where kChunked (LaneReduce), else one (hvec <= 32 NV).
      for (int c0 = 0; kChunked ? c0 < hvec : c0 == 0; c0 += 32 * NV) {  // warp-uniform
        acc_t acc[NV][V];
#pragma unroll
        for (int k = 0; k < NV; ++k)
#pragma unroll
          for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);
        accumulate_long_token<kL, scalar_t, V, NV, kChunked ? 1 : 2>(t, t - sp.t0, cnt, mine, rows, xv, idx, idx64,
                                                                     gates, g32, ooff, operm, n, hvec, c0 + lane,
                                                                     acc);
        cuda::store_row<scalar_t, V, NV>(out, t, hvec, c0 + lane, acc);
      }
    }
  }
}

// Lane k of each aligned group of kEll lanes gets the k-th smallest of the
// group's `row` values (INT_MAX pads a list shorter than kEll; rows are
// distinct): a bitonic network of XOR shuffles over the first P lanes of each
// group, P = `longest` (warp-uniform: the warp's longest list, <= kEll)
// rounded up to a power of two; lanes at or past a list's count hold INT_MAX,
// so lanes >= P are already in place: no exchange at fan-out 1, 1 at 2, 6 at
// 8. It replaced a rank-and-ballot sort (8 shuffles for the ranks, then 8
// ballots + 8 shuffles whatever the fan-out; about 300 more SASS instructions
// in each bf16 reducer kernel, sm_90), which sat between a token's metadata
// and its first data load: on the H100 the op ran 0.4-1.9 us (1-5 %) faster
// with no sort at all (a timing experiment, bench/RESULTS.md, sixty-eighth
// session), the most at fan-out 1. The order, hence the bits, is the same:
// ascending row index.
__device__ __forceinline__ int sort_ell_groups(int row, int longest) {
  const int k = threadIdx.x & (kEll - 1);
#pragma unroll
  for (int size = 2; size <= kEll; size <<= 1) {
    if (size >= 2 * longest) break;  // warp-uniform: the lists fit in size / 2 lanes, sorted
#pragma unroll
    for (int j = size >> 1; j > 0; j >>= 1) {
      const int other = __shfl_xor_sync(kFull, row, j);
      row = (((k & j) == 0) == ((k & size) == 0)) ? min(row, other) : max(row, other);
    }
  }
  return row;
}

// Each reducer is a type with one device function, run<kL>, called by the
// multi-kernel path's reduce kernel (scatter_reduce_kernel<Red>, kLaunch), the
// fused kernel's last phase (kGrid) and the local kernel's (kBlock), so the
// three share the per-element FMA chain, hence the bits, and each kernel
// carries only its own reducer's registers (and long_tokens<kL>, the tokens
// run() leaves, after it).
//
// Wide rows: one warp per (token, column chunk). U = rows whose loads are in
// flight together. (Capping registers at 64 for 8 blocks per SM made ptxas
// spill up to 484 bytes, so no cap: 80 registers, 6 blocks = 24 warps per SM
// for bf16.)
template <typename scalar_t, int V, int U>
struct WideReduce {
  static constexpr int kMinBlocks = 0;  // none asked: 80 registers, no spills, as before
  // The fused kernel's block: an SM's warps as one block (launch bounds (kFusedThreads, 1),
  // capping the registers at 65536 / kFusedThreads) where ptxas keeps the former 128-thread
  // blocks' warps an SM without spills and it measured faster: fp32 768 (80 registers, 24
  // warps as before; H100, CUDA graphs: 0-8 % faster at 16-512 MB, seventy-fourth session),
  // fp64 640 (96, 20: the same warps; not timed). 16-bit and unvectorised rows keep the
  // former blocks (128 threads, every co-resident one, no register cap): bf16 at 768 threads
  // spilled 16 bytes and at 640 (90 registers) had 20 of the 24 warps, fp16 at 768 24 of 32;
  // each was 4-15 % faster at T = 4096 but 2-7 % slower at the rows of 64-512 MB
  // (T16384-65536 k1 and k8 H1024), where the reduce, not the barriers, is the time.
  static constexpr int kFusedThreads = V > 1 && sizeof(scalar_t) == 4 ? 768
                                       : V > 1 && sizeof(scalar_t) == 8 ? 640
                                                                        : kRedWarps * 32;
  static constexpr int kFusedMinBlocks = kFusedThreads > kRedWarps * 32 ? 1 : kMinBlocks;
  // The local kernel's block, one an SM (each block reads all of token_idx, so one an SM reads
  // it the fewest times): the fused block where that is one an SM, else 768 threads for 16-bit
  // rows (the fused kernel's 24 warps an SM; ptxas fits the local kernel's bf16 reducer in 80
  // registers without spills, nvcc 13.0, sm_90) and 512 unvectorised.
  static constexpr int kLocalThreads = kFusedThreads > kRedWarps * 32 ? kFusedThreads : V > 1 ? 768 : 512;
  static constexpr int kLocalAlign = 1;  // a local block's first token: any (items are per token)

  template <Lists kL, int kWarps>
  static __device__ __forceinline__ void run(
      const scalar_t* __restrict__ x,
      const void* __restrict__ idx,
      bool idx64,
      const void* __restrict__ gates,
      bool g32,
      const int* __restrict__ counts,
      const int* __restrict__ ell,
      const int* __restrict__ ooff,
      const int* __restrict__ operm,
      scalar_t* __restrict__ out,
      int n,
      int64_t num_tokens,
      int hvec,
      ReduceWork w) {
    using acc_t = at::opmath_type<scalar_t>;
    using vec_t = Vec<scalar_t, V>;
    constexpr int NV = red_nv<V>();
    const int chunks = w.chunks;
    const TokenSpan sp = block_span<kL>(w, num_tokens);
    const int64_t nitems = kL == Lists::kBlock ? sp.t1 * chunks : w.items;
    const int lane = threadIdx.x & 31;
    const vec_t* xv = reinterpret_cast<const vec_t*>(x);
    // Persistent warps: while an item's data loads are in flight, the next
    // item's (count, ell) loads are too, so the one metadata round trip per
    // item overlaps useful traffic (without this: 78 % of copy bandwidth at
    // fan-out 2).
    const Walk wk = warp_walk<kL, kWarps>(sp.t0 * chunks);
    const int64_t stride = wk.stride;
    int64_t item = wk.first;
    if (item >= nitems) return;  // warp-level only from here: no block barriers
    int64_t t = item / chunks;
    int cnt = ws_load<kL>(counts + (t - sp.t0));
    int mine = lane < kEll ? ws_load<kL>(ell + (t - sp.t0) * kEll + lane) : 0;
    for (;;) {
      const int64_t next = item + stride;
      int64_t tn = 0;
      int cnt_n = 0, mine_n = 0;
      if (next < nitems) {
        tn = next / chunks;
        cnt_n = ws_load<kL>(counts + (tn - sp.t0));
        mine_n = lane < kEll ? ws_load<kL>(ell + (tn - sp.t0) * kEll + lane) : 0;
      }
      const int j0 = int(item - t * chunks) * (32 * NV) + lane;
      acc_t acc[NV][V];
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);

      if (cnt <= kEll) {
        // Sort <= 8 rows by row index in registers; sorted[k] lives in lane k.
        const int sorted = sort_ell_groups(lane < cnt ? mine : INT_MAX, cnt);
        warp_accumulate<scalar_t, V, NV, U>(
            [&](int i) { return __shfl_sync(kFull, sorted, i); }, cnt, xv, gates, g32, hvec, j0, acc);
      } else {
        accumulate_long_token<kL, scalar_t, V, NV, U>(t, t - sp.t0, cnt, mine, warp_sort_rows(), xv, idx,
                                                      idx64, gates, g32, ooff, operm, n, hvec, j0, acc);
      }

      cuda::store_row<scalar_t, V, NV>(out, t, hvec, j0, acc);
      if (next >= nitems) break;
      item = next;
      t = tn;
      cnt = cnt_n;
      mine = mine_n;
    }
  }

  // run() sums every token itself, the long ones included (per item).
  template <Lists kL, int kWarps>
  static __device__ __forceinline__ void long_tokens(const int*, const scalar_t*, const void*, bool, const void*,
                                                     bool, const int*, const int*, const int*, const int*,
                                                     scalar_t*, int, int64_t, int, ReduceWork) {}
};

// Short rows (16-byte vectors, hvec <= 64: H <= 256 for fp32, <= 512 for
// 16-bit types): WideReduce gives each token a whole warp and loads U = 2
// rows at a time, so at H = 128 bf16 (hvec 16) only half the lanes load
// anything and a warp has 2 x 256 B in flight: ~20 % of copy bandwidth. Here
// a warp owns TPW tokens at once (L = 32 / TPW lanes each, NV vectors per
// lane, L * NV >= hvec); lanes 8s..8s+7 fetch token s's (count, ell) together
// and sort them in registers (sort_ell_groups), then every lane loads U of
// its token's rows before the first FMA (U * NV = 8 vectors = 32 registers in
// flight per lane, whatever the row width). At fan-out 2 a warp has 4 tokens
// x 2 rows in flight (2 KB at H = 128 bf16, 4 KB at H = 128 fp32) instead of
// 512 B. Tokens with more than kEll rows are left to long_tokens(), which the
// kernels call after run(): whole warps, with the helper WideReduce uses. The
// per-element FMA chain is the same: same bits.
// Registers (ptxas, nvcc 13.0, sm_90): 72-80 for 32- and 64-bit elements,
// 84-109 for fp16, 115-128 for bf16, without spills (4-8 bytes in two bf16
// kernels). They were 94-168, bf16 at H <= 128 with 76-188 bytes of spills,
// while the long tokens were summed inside run()'s loop (bench/RESULTS.md,
// forty-fourth session). Pinning 6 blocks per SM (80 registers) for bf16
// spilled 200-800 bytes and measured slower on the H200 (T16384 k8 H128 bf16:
// 55 vs 38 us), hence kMinBlocks by element size.
template <typename scalar_t, int V, int TPW, int NV, int U>
struct ShortReduce {
  static_assert(TPW == 2 || TPW == 4, "a token's kEll metadata lanes must fit in its lanes");
  static_assert(kEll % U == 0, "row batches must tile the kEll sorted rows");
  // Blocks per SM asked of ptxas (__launch_bounds__): 6 (<= 80 registers) for 32- and 64-bit
  // elements, which it then fits in 72-80 without spills (unasked it chose 64 and spilled 16-56
  // bytes); 4 (<= 128) for 16-bit ones, which need 84-128 (80 spilled 280 bytes).
  static constexpr int kMinBlocks = sizeof(scalar_t) >= 4 ? 6 : 4;
  // The fused kernel's block (see WideReduce): for 32- and 64-bit elements 5 x 128 threads, as
  // before the registers came down, not the 6-7 x 128 that now fit. Short rows are
  // bandwidth-bound with 5, and each extra block (then 128 threads each) added to every grid
  // barrier and to the count phase's atomics: on the H100 the fp32 H = 128 forward rows at
  // T = 16384 ran 3-8 % faster in CUDA graphs with 5 (two A/B runs, the unchanged backward and
  // wide-row rows as controls; T = 4096 and 65536 within 1 %; bench/RESULTS.md, forty-seventh
  // session). fp64 was not timed: the same registers, so the same occupancy. 16-bit
  // elements: the 128-thread blocks an SM held at ptxas' registers (nvcc 13.0, sm_90): 4 (512
  // threads, <= 128 registers) for bf16 and for fp16 at NV = 4 (107-109), 5 (640, <= 96) for
  // fp16 at NV <= 2 (84-92; at 512 threads T65536 k8 H128 fp16 ran 1-3 % slower on the H100,
  // seventy-fourth session).
  static constexpr int kFusedThreads = sizeof(scalar_t) >= 4 || (std::is_same_v<scalar_t, at::Half> && NV <= 2)
                                           ? 640
                                           : 512;
  static constexpr int kFusedMinBlocks = 1;
  static constexpr int kLocalThreads = kFusedThreads;  // the local kernel's block, one an SM
  static constexpr int kLocalAlign = TPW;  // a local block's first token starts a token group

  template <Lists kL, int kWarps>
  static __device__ __forceinline__ void run(
      const scalar_t* __restrict__ x,
      const void* __restrict__ idx,
      bool idx64,
      const void* __restrict__ gates,
      bool g32,
      const int* __restrict__ counts,
      const int* __restrict__ ell,
      const int* __restrict__ ooff,
      const int* __restrict__ operm,
      scalar_t* __restrict__ out,
      int n,
      int64_t num_tokens,
      int hvec,
      ReduceWork w) {
    using acc_t = at::opmath_type<scalar_t>;
    using vec_t = Vec<scalar_t, V>;
    constexpr int L = 32 / TPW;  // lanes per token
    const int lane = threadIdx.x & 31;
    const vec_t* xv = reinterpret_cast<const vec_t*>(x);
    const TokenSpan sp = block_span<kL>(w, num_tokens);  // kBlock: t0 a multiple of TPW (kLocalAlign)
    const int64_t ngroups = (sp.t1 + TPW - 1) / TPW;
    const Walk wk = warp_walk<kL, kWarps>(sp.t0 / TPW);
    const int64_t stride = wk.stride;
    int64_t grp = wk.first;
    if (grp >= ngroups) return;  // warp-level only from here

    // Metadata lanes: token ms = lane / kEll of the group, its ell entry lane % kEll.
    const int ms = lane / kEll;
    auto meta = [&](int64_t g, int& cnt, int& mine) {
      const int64_t tk = g * TPW + ms;
      cnt = 0;
      mine = INT_MAX;
      if (ms < TPW && tk < sp.t1) {
        cnt = ws_load<kL>(counts + (tk - sp.t0));
        mine = ws_load<kL>(ell + (tk - sp.t0) * kEll + (lane & (kEll - 1)));
      }
    };
    int cnt, mine;
    meta(grp, cnt, mine);
    // Data lanes: token s = lane / L, vectors jl + L k.
    const int s = lane / L, jl = lane % L;
    for (;;) {
      // Persistent warps, as in WideReduce: the next group's metadata loads
      // are in flight during this group's data loads.
      const int64_t next = grp + stride;
      int cnt_n = 0, mine_n = INT_MAX;
      if (next < ngroups) meta(next, cnt_n, mine_n);

      const int64_t t = grp * TPW + s;
      // This lane's token's row count; tokens with > kEll rows are left for later.
      const int c_all = __shfl_sync(kFull, cnt, s * kEll);
      const int c = c_all <= kEll ? c_all : 0;
      const int cmax = __reduce_max_sync(kFull, unsigned(c));  // also the longest list any metadata lane holds
      const int sorted = sort_ell_groups((lane & (kEll - 1)) < cnt && cnt <= kEll ? mine : INT_MAX, cmax);
      acc_t acc[NV][V];
#pragma unroll
      for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);
      for (int ub = 0; ub < cmax; ub += U) {  // warp-uniform
        acc_t g[U];
        vec_t xr[U][NV];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int r = __shfl_sync(kFull, sorted, s * kEll + ub + u);
          if (ub + u < c) {
            g[u] = load_gate<acc_t, scalar_t>(gates, r, g32);
            const vec_t* row = xv + int64_t(r) * hvec;
#pragma unroll
            for (int k = 0; k < NV; ++k)
              if (jl + L * k < hvec) xr[u][k] = row[jl + L * k];
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (ub + u < c) {
#pragma unroll
            for (int k = 0; k < NV; ++k) {
              if (jl + L * k < hvec) {
#pragma unroll
                for (int e = 0; e < V; ++e)
                  acc[k][e] = fma_acc(g[u], static_cast<acc_t>(xr[u][k].v[e]), acc[k][e]);
              }
            }
          }
        }
      }
      if (t < sp.t1 && c_all <= kEll) {
        vec_t* orow = reinterpret_cast<vec_t*>(out) + t * hvec;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          if (jl + L * k < hvec) {
            vec_t o;
#pragma unroll
            for (int e = 0; e < V; ++e) o.v[e] = static_cast<scalar_t>(acc[k][e]);
            orow[jl + L * k] = o;
          }
        }
      }

      if (next >= ngroups) break;
      grp = next;
      cnt = cnt_n;
      mine = mine_n;
    }
  }

  // The tokens run() left (more than kEll rows), after it, whole warps.
  template <Lists kL, int kWarps>
  static __device__ __forceinline__ void long_tokens(
      const int* flag, const scalar_t* __restrict__ x, const void* __restrict__ idx, bool idx64,
      const void* __restrict__ gates, bool g32, const int* __restrict__ counts, const int* __restrict__ ell,
      const int* __restrict__ ooff, const int* __restrict__ operm, scalar_t* __restrict__ out, int n,
      int64_t num_tokens, int hvec, ReduceWork w) {
    constexpr int NVW = (NV * (32 / TPW) + 31) / 32;  // vectors per lane when the whole warp sums one token
    reduce_long_tokens<kL, kWarps, scalar_t, V, NVW>(flag, reinterpret_cast<const Vec<scalar_t, V>*>(x), idx, idx64,
                                               gates, g32, counts, ell, ooff, operm, out, n, num_tokens, hvec,
                                               warp_sort_rows(), w);
  }
};

// Lane reduce (16-bit rows at mean fan-out in (1.5, 2]): each thread owns
// NVT 16-byte column vectors of one token (lt = hvec / NVT threads a token,
// vectors j + lt k), as the lists-given Triton reduce of
// bench/scatter_gather_floor.py lays its programs out, which moves these
// shapes at 0.92-0.95 of a copy where ShortReduce / WideReduce reach
// 0.57-0.69 (H100, sixty-sixth to sixty-eighth sessions): ncu has ours
// issue-bound at 80-123 registers and 23-35 % occupancy, the Triton kernel
// waiting on memory at 34-54 registers and 42-58 %. Each thread reads its
// token's count and ell entries itself (the token's threads read the same
// addresses: one L1 request), sorts them in registers with a network sized
// by the count, and sums its columns over the rows in ascending row order
// with the same FMA chain as the other reducers: the same bits. Tokens with
// more than kEll rows are left to long_tokens(), as in ShortReduce.
// U = rows whose loads are in flight together per thread.

__device__ __forceinline__ void cas(int& a, int& b) {
  const int lo = min(a, b);
  b = max(a, b);
  a = lo;
}

// r[0, c) ascending; r[c, kEll) are INT_MAX on entry (rows are distinct).
__device__ __forceinline__ void sort_rows(int (&r)[kEll], int c) {
  static_assert(kEll == 8, "the networks below are for 8 rows");
  if (c <= 1) return;
  if (c == 2) {
    cas(r[0], r[1]);
    return;
  }
  if (c <= 4) {
    cas(r[0], r[1]); cas(r[2], r[3]); cas(r[0], r[2]); cas(r[1], r[3]); cas(r[1], r[2]);
    return;
  }
  // Batcher's odd-even merge sort of 8: 19 compare-exchanges.
  cas(r[0], r[1]); cas(r[2], r[3]); cas(r[4], r[5]); cas(r[6], r[7]);
  cas(r[0], r[2]); cas(r[1], r[3]); cas(r[4], r[6]); cas(r[5], r[7]);
  cas(r[1], r[2]); cas(r[5], r[6]);
  cas(r[0], r[4]); cas(r[1], r[5]); cas(r[2], r[6]); cas(r[3], r[7]);
  cas(r[2], r[4]); cas(r[3], r[5]);
  cas(r[1], r[2]); cas(r[3], r[4]); cas(r[5], r[6]);
}

template <typename scalar_t, int V, int NVT, int U>
struct LaneReduce {
  static_assert(kEll % U == 0, "row batches must tile the kEll sorted rows");
  // <= 80 registers (ptxas -v, sm_90, nvcc 13.0): 72-80 and no spills at NVT = 2, U = 2 (6 blocks,
  // 24 warps an SM, 64 B of loads in flight a thread at fan-out 2: ~48 KB an SM against
  // ShortReduce's ~32 KB). Unasked, ptxas chose 40-56 and spilled 24-108 bytes (the long-token
  // phase in the same kernel); NVT = 4, U = 1 needs 96-112 (4 blocks); NVT = 1 or 2 at U = 1-2
  // fits 64 (8 blocks) but spills 12 bytes for bf16, with 32 B a thread in flight.
  static constexpr int kMinBlocks = 6;
  static constexpr int kFusedThreads = 768;  // the fused kernel's block (see WideReduce): 6 x 128
  static constexpr int kFusedMinBlocks = 1;
  static constexpr int kLocalThreads = kFusedThreads;  // the local kernel's block, one an SM
  static constexpr int kLocalAlign = 1;  // a local block's first token: any (threads are per token)
  static constexpr int kPre = 4;  // ell entries read beside the count; the rest only where the count says

  template <Lists kL, int kWarps>
  static __device__ __forceinline__ void run(
      const scalar_t* __restrict__ x,
      const void* __restrict__ /*idx*/,
      bool /*idx64*/,
      const void* __restrict__ gates,
      bool g32,
      const int* __restrict__ counts,
      const int* __restrict__ ell,
      const int* __restrict__ /*ooff*/,
      const int* __restrict__ /*operm*/,
      scalar_t* __restrict__ out,
      int /*n*/,
      int64_t num_tokens,
      int hvec,
      ReduceWork w) {
    using acc_t = at::opmath_type<scalar_t>;
    using vec_t = Vec<scalar_t, V>;
    const vec_t* xv = reinterpret_cast<const vec_t*>(x);
    vec_t* ov = reinterpret_cast<vec_t*>(out);
    // Thread -> (token t0 + pass * per_pass, vectors j + LT k for k < NVT): LT threads a token,
    // fixed per thread, no division in the loop. The grid's threads (kLaunch, kGrid) or this
    // block's over its own tokens (kBlock).
    const TokenSpan sp = block_span<kL>(w, num_tokens);
    const int lt = (hvec + NVT - 1) / NVT;
    const int nthreads = kL == Lists::kBlock ? int(blockDim.x) : int(gridDim.x) * blockDim.x;
    const int per_pass = nthreads / lt;  // the host launches >= lt threads (a block of them for kBlock)
    const int gt = kL == Lists::kBlock ? int(threadIdx.x) : int(blockIdx.x) * blockDim.x + threadIdx.x;
    if (gt >= per_pass * lt) return;  // thread-level only from here
    const int j = gt % lt;
    for (int64_t t = sp.t0 + gt / lt; t < sp.t1; t += per_pass) {
      const int* et = ell + (t - sp.t0) * kEll;
      const int c = ws_load<kL>(counts + (t - sp.t0));
      int r[kEll];
#pragma unroll
      for (int e = 0; e < kPre; ++e) r[e] = ws_load<kL>(et + e);
      if (c > kEll) continue;  // long_tokens() sums it
#pragma unroll
      for (int e = kPre; e < kEll; ++e) r[e] = e < c ? ws_load<kL>(et + e) : INT_MAX;
#pragma unroll
      for (int e = 0; e < kPre; ++e)
        if (e >= c) r[e] = INT_MAX;
      sort_rows(r, c);
      acc_t acc[NVT][V];
#pragma unroll
      for (int k = 0; k < NVT; ++k)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);
#pragma unroll
      for (int b = 0; b < kEll; b += U) {
        if (b >= c) break;
        acc_t g[U];
        vec_t xr[U][NVT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (b + u < c) {
            g[u] = load_gate<acc_t, scalar_t>(gates, r[b + u], g32);
            const vec_t* row = xv + int64_t(r[b + u]) * hvec;
#pragma unroll
            for (int k = 0; k < NVT; ++k)
              if (j + lt * k < hvec) xr[u][k] = row[j + lt * k];
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (b + u < c) {
#pragma unroll
            for (int k = 0; k < NVT; ++k)
              if (j + lt * k < hvec) {
#pragma unroll
                for (int e = 0; e < V; ++e)
                  acc[k][e] = fma_acc(g[u], static_cast<acc_t>(xr[u][k].v[e]), acc[k][e]);
              }
          }
        }
      }
      vec_t* orow = ov + t * hvec;
#pragma unroll
      for (int k = 0; k < NVT; ++k) {
        if (j + lt * k < hvec) {
          vec_t o;
#pragma unroll
          for (int e = 0; e < V; ++e) o.v[e] = static_cast<scalar_t>(acc[k][e]);
          orow[j + lt * k] = o;
        }
      }
    }
  }

  // The tokens run() left (more than kEll rows), after it: whole warps, 32-vector column chunks
  // (one vector a lane: this phase's registers count for the whole kernel).
  template <Lists kL, int kWarps>
  static __device__ __forceinline__ void long_tokens(
      const int* flag, const scalar_t* __restrict__ x, const void* __restrict__ idx, bool idx64,
      const void* __restrict__ gates, bool g32, const int* __restrict__ counts, const int* __restrict__ ell,
      const int* __restrict__ ooff, const int* __restrict__ operm, scalar_t* __restrict__ out, int n,
      int64_t num_tokens, int hvec, ReduceWork w) {
    reduce_long_tokens<kL, kWarps, scalar_t, V, 1, true>(
        flag, reinterpret_cast<const Vec<scalar_t, V>*>(x), idx, idx64, gates, g32, counts, ell, ooff, operm, out, n,
        num_tokens, hvec, warp_sort_rows(), w);
  }
};

// The multi-kernel path's reduce: one launch of reducer Red.
template <typename scalar_t, typename Red>
__global__ void __launch_bounds__(kRedWarps * 32, Red::kMinBlocks) scatter_reduce_kernel(
    const scalar_t* __restrict__ x,
    const void* __restrict__ idx,
    bool idx64,
    const void* __restrict__ gates,
    bool g32,
    const int* __restrict__ flag,
    const int* __restrict__ counts,
    const int* __restrict__ ell,
    const int* __restrict__ ooff,
    const int* __restrict__ operm,
    scalar_t* __restrict__ out,
    int n,
    int64_t num_tokens,
    int hvec,
    ReduceWork w) {
  Red::template run<Lists::kLaunch, kRedWarps>(x, idx, idx64, gates, g32, counts, ell, ooff, operm, out, n,
                           num_tokens, hvec, w);
  Red::template long_tokens<Lists::kLaunch, kRedWarps>(flag, x, idx, idx64, gates, g32, counts, ell, ooff, operm,
                                                        out, n, num_tokens, hvec, w);
}

// Phases 0-2 of the fused kernel (below): zero flag | counts and the overflow
// cursor (the memset, folded in) -> count -> only when flag says some token
// has more than kEll rows (read after the barrier, so grid-uniform, and so
// are the barriers inside): overflow offsets -> place. Not inlined so that
// ptxas allocates the reducer that follows as it does in the standalone
// reduce kernel (inlined, the bf16 short-row reducer for hvec <= 16 got 150
// registers instead of 128, 3 blocks per SM instead of 4); the call costs
// nothing measurable next to a grid barrier.
__device__ __noinline__ void build_lists(
    const void* __restrict__ idx, bool idx64, int n, int64_t num_tokens, int* flag, int* counts,
    int* ell, int* ooff, int* slot, int* operm, int* cursor) {
  const cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = tid; i <= num_tokens; i += nthreads) flag[i] = 0;  // flag, counts[0, T)
  if (tid == 0) *cursor = 0;
  grid.sync();
  count_rows(idx, idx64, n, num_tokens, counts, ell, slot, flag);
  grid.sync();
  if (__ldcg(flag) != 0) {
    alloc_overflow(counts, num_tokens, ooff, cursor);
    grid.sync();
    place_rows<Lists::kGrid>(idx, idx64, n, slot, ooff, operm);
    grid.sync();
  }
}

// The whole large path in one cooperative launch (why: the H200 box's host
// spends several us per launch, so the 5-6 launches of the multi-kernel path
// made every call host-bound: ~20-35 us per call where the bytes need 5-10,
// e.g. T16384 k8 H128 bf16 37-41 us = 23-26 % of copy bandwidth, T4096 k2
// H1024 bf16 25 us = 24 %, T65536 k2 H128 fp32 43 us = 56 %). Every phase is
// grid-strided over a grid that is entirely resident (the cooperative launch
// guarantees it), separated by grid.sync(), which also orders the workspace
// writes before the next phase's reads (ws_load<kGrid>: L2 reads):
//   0-2. build_lists: zero, count (count_rows, as the multi-kernel path),
//        and, only if needed, overflow offsets (alloc_overflow) + place;
//   3.   reduce (Red::run<kGrid>, then Red::long_tokens<kGrid>: the same code
//        as scatter_reduce_kernel<Red>).
// Phases 0-2 need few registers; the kernel's count is its reducer's (one
// instantiation per reducer: the short-row reducers' 72-128 registers stay
// out of the wide-row kernels), so an SM holds as many of its warps as of the
// multi-kernel path's reduce kernel. Most reducers run them as ONE block an SM
// (Red::kFusedThreads; the sort scratch in dynamic shared memory), because a
// grid barrier's cost grows with the blocks it waits for, not their threads:
// H100, CUDA graphs, us a grid.sync() (bench/grid_barrier_cost.py,
// seventy-fourth session) 2.03 at 792 blocks x 128 threads (6 an SM, this
// kernel's former grid), 1.12 at 132 x 768; the empty launch 1.72 against
// 1.40. The H100 ran the >= 16 MB forward rows ~2 % faster so (geometric
// mean in CUDA graphs; the short-row and lane reducers' 4-11 %, the most at
// 16-32 MB; bench/RESULTS.md, seventy-fourth session); the wide-row reducer
// for 16-bit rows keeps 128-thread blocks (WideReduce::kFusedThreads says why).
template <typename scalar_t, typename Red>
__global__ void __launch_bounds__(Red::kFusedThreads, Red::kFusedMinBlocks) scatter_large_fused_kernel(
    const scalar_t* __restrict__ x,
    const void* __restrict__ idx,
    bool idx64,
    const void* __restrict__ gates,
    bool g32,
    int* flag,
    int* counts,
    int* ell,
    int* ooff,
    int* slot,
    int* operm,
    int* cursor,
    scalar_t* __restrict__ out,
    int n,
    int64_t num_tokens,
    int hvec,
    ReduceWork w) {
  build_lists(idx, idx64, n, num_tokens, flag, counts, ell, ooff, slot, operm, cursor);
  // warps a block: fixed for 128-thread blocks, else blockDim's (launch_fused sizes it)
  constexpr int kWarps = Red::kFusedThreads == kRedWarps * 32 ? kRedWarps : 0;
  Red::template run<Lists::kGrid, kWarps>(x, idx, idx64, gates, g32, counts, ell, ooff, operm, out, n,
                          num_tokens, hvec, w);
  // no barrier: the long tokens' rows are not the ones run() writes
  Red::template long_tokens<Lists::kGrid, kWarps>(flag, x, idx, idx64, gates, g32, counts, ell, ooff, operm, out,
                                                   n, num_tokens, hvec, w);
}

// The local kernel (the default where token_idx is short: launch_local): no
// workspace, no grid barrier, no global atomics. Each block owns a contiguous
// run of tokens [t0, t1), reads ALL of token_idx (from L2: every block reads
// it) and builds its tokens' lists in shared memory (BlockLists), then sums
// them with the same reducer code (Red::run<kBlock>, long_tokens<kBlock>), so
// the same bits. Where it pays against the fused kernel is a rule on sizes
// (paths::local_pays, backends/common/scatter_combine_paths.h, with the H100's
// figures). Each block starts its scan at its own row (build_block_lists): in
// step, every SM asked the same L2 lines at once, and the form lost to the fused
// kernel at 32 KB of token_idx on the wide rows (H100, local / fused, T1024 k8
// H4096 bf16 1.115 -> 0.959, T16384 k1 H1024 bf16 1.148 -> 0.982 with the
// rotation and 768-thread bf16 blocks; bench/RESULTS.md, seventy-seventh session).
//
// Tokens a block at most: its lists are 4 x (3 + kEll) bytes a token of shared memory.
constexpr int64_t kLocalMaxBlockTokens = 1024;

// A local block's lists, after the sort scratch in dynamic shared memory: flag
// (some token has more than kEll rows) | cursor (overflow segments) |
// counts[bt] | fill[bt] (rows placed in a segment) | ell[bt][kEll] | ooff[bt]
// | operm[n] (room for every row; used only past kEll rows a token).
struct BlockLists {
  int* flag;
  int* cursor;
  int* counts;
  int* fill;
  int* ell;
  int* ooff;
  int* operm;
};

__host__ __device__ constexpr size_t block_lists_bytes(int64_t bt, int n) {
  return size_t(2 + bt * (3 + kEll) + n) * sizeof(int);
}

__device__ __forceinline__ BlockLists carve_block_lists(int* s, int64_t bt) {
  BlockLists l;
  l.flag = s;
  l.cursor = s + 1;
  l.counts = s + 2;
  l.fill = l.counts + bt;
  l.ell = l.fill + bt;
  l.ooff = l.ell + bt * kEll;
  l.operm = l.ooff + bt;
  return l;
}

// The local kernel's lists for tokens [t0, t1): counts and ell as count_rows
// builds them (shared-memory atomics: a row's slot is arbitrary, the reducers
// sort), and, only when some token has more than kEll rows (flag, read after
// the barrier: block-uniform), a segment of operm per such token with ALL its
// rows (a second pass over token_idx cannot tell which rows the first put in
// ell; the reducer sorts the segment, so the bits are those of ell + overflow).
// Inlined: as a call (build_lists' way) ptxas gave the fp32 wide-row local
// kernel 28 bytes of spills at 768 threads, inlined none and 2-10 fewer
// registers in most local kernels (nvcc 13.0, sm_90).
__device__ __forceinline__ void build_block_lists(
    const void* __restrict__ idx, bool idx64, int n, int64_t t0, int64_t t1, BlockLists l) {
  const int tb = int(t1 - t0);  // <= the block_tokens the lists were carved for
  for (int i = threadIdx.x; i < tb; i += blockDim.x) l.counts[i] = l.fill[i] = 0;
  if (threadIdx.x == 0) *l.flag = *l.cursor = 0;
  __syncthreads();
  // Every block reads all of token_idx, kU loads a thread in flight before the first compare,
  // each block from its own starting row (a multiple of 32, rows wrapping around): in step,
  // every SM would ask the same L2 lines at once. (The order rows are counted in is free: a
  // row's slot is arbitrary anyway.)
  constexpr int kU = 8;
  const int rot = int(int64_t(blockIdx.x) * n / gridDim.x) & ~31;
  // One row's filing: counts, ell and the flag as count_rows files them.
  auto file = [&](int lt, int row) {
    const int slot = atomicAdd(l.counts + lt, 1);
    if (slot < kEll) {
      l.ell[lt * kEll + slot] = row;
    } else if (slot == kEll) {
      *l.flag = 1;  // benign race: every writer stores 1
    }
  };
  // 16-byte loads where token_idx is 16-byte aligned (4 int32 or 2 int64 rows a load, kV loads a
  // thread in flight): a quarter of the scalar loads (ncu, H100: the scan 1.5-4.6 us of a 10-15
  // us kernel at 1024-8192 rows, bench/RESULTS.md, seventy-eighth session). kV = 2, not 4: with 4
  // ptxas spilled 16 bytes in the bf16 wide-row local kernel at its 80-register cap (nvcc 13.0,
  // sm_90), which ran 14-27 % slower (seventy-ninth session). Rows past the last whole vector:
  // one by one below.
  int vrows = 0;  // rows the vector loop covers: a multiple of the rows a vector holds
  if (cuda::aligned16(idx)) {
    constexpr int kV = 2;
    const int per = idx64 ? 2 : 4;
    const int nvec = n / per;
    vrows = nvec * per;
    const int vrot = nvec > 0 ? (rot / per) % nvec : 0;  // rot: a multiple of 32 rows
    const int4* iv = static_cast<const int4*>(idx);
    for (int base = 0; base < nvec; base += kV * int(blockDim.x)) {
      int4 v[kV];
      int vi[kV];
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        const int i = base + u * int(blockDim.x) + int(threadIdx.x);
        vi[u] = i < nvec ? (i + vrot < nvec ? i + vrot : i + vrot - nvec) : -1;
        if (vi[u] >= 0) v[u] = __ldg(iv + vi[u]);
      }
#pragma unroll
      for (int u = 0; u < kV; ++u) {
        if (vi[u] < 0) continue;
        int64_t t[4] = {};
        if (idx64) {
          t[0] = int64_t((uint64_t(uint32_t(v[u].y)) << 32) | uint32_t(v[u].x));
          t[1] = int64_t((uint64_t(uint32_t(v[u].w)) << 32) | uint32_t(v[u].z));
        } else {
          t[0] = v[u].x;
          t[1] = v[u].y;
          t[2] = v[u].z;
          t[3] = v[u].w;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // unrolled: t[] stays in registers
          if (e < per && t[e] >= t0 && t[e] < t1) file(int(t[e] - t0), vi[u] * per + e);
        }
      }
    }
  }
  // The rest (all of token_idx where it is not 16-byte aligned): kU rows a thread in flight.
  const int rn = n - vrows;
  auto row_at = [&](int i) { return vrows + (i + rot < rn ? i + rot : (i + rot) % rn); };  // i < rn
  for (int base = 0; base < rn; base += kU * int(blockDim.x)) {
    int lt[kU];  // the row's token - t0, or -1: not this block's
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = base + u * int(blockDim.x) + int(threadIdx.x);
      const int64_t t = i < rn ? load_index(idx, row_at(i), idx64) : -1;
      lt[u] = t >= t0 && t < t1 ? int(t - t0) : -1;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (lt[u] >= 0) file(lt[u], row_at(base + u * int(blockDim.x) + int(threadIdx.x)));
    }
  }
  __syncthreads();
  if (*l.flag == 0) return;
  // Segments: a warp scan of 32 tokens' counts (those past kEll), one atomicAdd a warp.
  const int lane = threadIdx.x & 31;
  for (int base = int(threadIdx.x >> 5) * 32; base < tb; base += int(blockDim.x)) {  // warp-uniform
    const int lt = base + lane;
    const int c = lt < tb ? l.counts[lt] : 0;
    const int ov = c > kEll ? c : 0;
    const int incl = cuda::warp_inclusive_scan(ov);
    const int total = __shfl_sync(kFull, incl, 31);
    if (total == 0) continue;
    int b = 0;
    if (lane == 31) b = atomicAdd(l.cursor, total);
    b = __shfl_sync(kFull, b, 31);
    if (ov > 0) l.ooff[lt] = b + incl - ov;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < n; r += blockDim.x) {
    const int64_t t = load_index(idx, r, idx64);
    if (t >= t0 && t < t1) {
      const int lt = int(t - t0);
      if (l.counts[lt] > kEll) l.operm[l.ooff[lt] + atomicAdd(l.fill + lt, 1)] = r;
    }
  }
  __syncthreads();
}

template <typename scalar_t, typename Red>
__global__ void __launch_bounds__(Red::kLocalThreads, 1) scatter_large_local_kernel(
    const scalar_t* __restrict__ x,
    const void* __restrict__ idx,
    bool idx64,
    const void* __restrict__ gates,
    bool g32,
    scalar_t* __restrict__ out,
    int n,
    int64_t num_tokens,
    int hvec,
    ReduceWork w) {
  cuda::await_prior_grids();  // before any load or store (pdl.cuh)
  extern __shared__ int s_local[];
  const BlockLists l = carve_block_lists(s_local + (blockDim.x >> 5) * kWarpSortCap, w.block_tokens);
  const TokenSpan sp = block_span<Lists::kBlock>(w, num_tokens);
  build_block_lists(idx, idx64, n, sp.t0, sp.t1, l);
  Red::template run<Lists::kBlock, 0>(x, idx, idx64, gates, g32, l.counts, l.ell, l.ooff, l.operm, out, n,
                                      num_tokens, hvec, w);
  Red::template long_tokens<Lists::kBlock, 0>(l.flag, x, idx, idx64, gates, g32, l.counts, l.ell, l.ooff,
                                              l.operm, out, n, num_tokens, hvec, w);
}

int grid_for(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 132 * 16)));
}

// Blocks of kKernel resident per SM at kThreads threads a block (registers,
// and the sort scratch in dynamic shared memory, sort_smem_bytes), and SMs, on
// device dev; once per kernel and device. per_sm = 0: not one block fits (a GPU
// with less shared memory or fewer registers an SM than sm_90's: launch_fused
// then declines).
struct Residency {
  int sms = 0;
  int per_sm = 0;
};

template <auto kKernel, int kThreads>
const Residency& residency(c10::DeviceIndex dev) {
  static Residency cache[C10_COMPILE_TIME_MAX_GPUS] = {};
  Residency& r = cache[dev];
  if (r.sms == 0) {
    constexpr size_t smem = sort_smem_bytes(kThreads);
    int per_sm = 0;
    if (smem <= size_t(cuda::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(dev))) {
      if (smem > 48 * 1024) {  // past the default 48 KB: opt in, once, beside the occupancy query
        C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      }
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, smem));
    }
    r.per_sm = per_sm;
    // last: a concurrent first call at worst computes it twice
    r.sms = cuda::device_attribute<cudaDevAttrMultiProcessorCount>(dev);
  }
  return r;
}

// Does this device launch cooperative kernels (cudaDevAttrCooperativeLaunch)? Once per device.
bool cooperative_device(c10::DeviceIndex dev) {
  return cuda::device_attribute<cudaDevAttrCooperativeLaunch>(dev) != 0;
}

// The call's pointers and sizes, and the fused and multi-kernel forms'
// workspace (carved by launch_with, only for them).
template <typename scalar_t>
struct LargeCall {
  const scalar_t* xp;
  const void* idx;
  bool idx64;
  const void* gates;
  bool g32;
  scalar_t* op;
  int n;
  int64_t num_tokens;
  int hvec;
  WorkspaceSource source;
  c10::DeviceIndex dev;
  cudaStream_t stream;
  LargeWorkspace ws = {};
};

// The fallback: memset(counts) -> count -> tile sums -> scan -> place (the
// last three return at once unless flag is set) -> reduce: 5-6 launches.
template <typename scalar_t, typename Red>
void launch_multi(const LargeCall<scalar_t>& c, ReduceWork w, int64_t reduce_blocks) {
  C10_CUDA_CHECK(cudaMemsetAsync(c.ws.flag, 0, (1 + c.num_tokens) * sizeof(int), c.stream));
  if (c.n > 0) {
    count_kernel<<<grid_for(c.n, 256), 256, 0, c.stream>>>(c.idx, c.idx64, c.n, c.num_tokens,
                                                           c.ws.counts, c.ws.ell, c.ws.slot, c.ws.flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (c.ws.ntiles > 1) {
      tile_sum_kernel<<<static_cast<unsigned>(c.ws.ntiles), kScanThreads, 0, c.stream>>>(
          c.ws.counts, c.num_tokens, c.ws.tile_sums, c.ws.flag);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    scan_kernel<<<static_cast<unsigned>(c.ws.ntiles), kScanThreads, 0, c.stream>>>(
        c.ws.counts, c.num_tokens, c.ws.tile_sums, c.ws.ooff, c.ws.flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    place_kernel<<<grid_for(c.n, 256), 256, 0, c.stream>>>(c.idx, c.idx64, c.n, c.ws.slot, c.ws.ooff,
                                                           c.ws.operm, c.ws.flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  constexpr auto kernel = scatter_reduce_kernel<scalar_t, Red>;
  const Residency& res = residency<kernel, kRedWarps * 32>(c.dev);
  const int64_t grid = std::min<int64_t>(reduce_blocks, int64_t(res.sms) * std::max(res.per_sm, 1));
  kernel<<<static_cast<unsigned>(grid), kRedWarps * 32, sort_smem_bytes(kRedWarps * 32), c.stream>>>(
      c.xp, c.idx, c.idx64, c.gates, c.g32, c.ws.flag, c.ws.counts, c.ws.ell, c.ws.ooff, c.ws.operm, c.op, c.n,
      c.num_tokens, c.hvec, w);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fused path, where it can run: false (nothing launched) on a device
// without cooperative launch, or where not even one block of the kernel fits
// an SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor = 0), or where the
// driver refuses the grid as too large (cudaErrorCooperativeLaunchTooLarge:
// fewer SMs available than the attribute says, e.g. under MPS limits).
// Grid: every co-resident block (residency), capped by the work (the reduce's
// threads or one row per thread for the count, whichever is more).
template <typename scalar_t, typename Red>
bool launch_fused(const LargeCall<scalar_t>& c, ReduceWork w, int64_t reduce_blocks) {
  if (!cooperative_device(c.dev)) return false;
  constexpr auto kernel = scatter_large_fused_kernel<scalar_t, Red>;
  constexpr int kThreads = Red::kFusedThreads;
  const Residency& res = residency<kernel, kThreads>(c.dev);
  if (res.per_sm < 1) return false;
  const int64_t want_threads = std::max<int64_t>({reduce_blocks * kRedWarps * 32, c.n, 1});
  const int64_t slots = int64_t(res.sms) * res.per_sm;
  // Work that fills fewer than every block: smaller blocks (whole warps, >= 128 threads) over
  // every SM, not full ones over some (T1024 k8 H1024 fp32, 2048 warps of work: 86 of the 132
  // SMs at 768 threads a block, 2-4 % slower than the former 128-thread grid on the H100).
  int threads = kThreads;
  if (kThreads > kRedWarps * 32 && want_threads < slots * kThreads) {
    const int64_t per_block = (want_threads + slots * 32 - 1) / (slots * 32) * 32;
    threads = static_cast<int>(std::max<int64_t>(kRedWarps * 32, per_block));
  }
  const int64_t grid = std::min<int64_t>((want_threads + threads - 1) / threads, slots);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = sort_smem_bytes(threads);
  cfg.stream = c.stream;
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeCooperative;  // = cudaLaunchCooperativeKernel, type-checked arguments
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // The overflow cursor: tile_sums[0] (the workspace has >= 1 tile; the
  // fused path has no tile sums of its own).
  const cudaError_t err = cudaLaunchKernelEx(
      &cfg, kernel, c.xp, c.idx, c.idx64, c.gates, c.g32, c.ws.flag, c.ws.counts, c.ws.ell, c.ws.ooff, c.ws.slot,
      c.ws.operm, c.ws.tile_sums, c.op, c.n, c.num_tokens, c.hvec, w);
  if (err == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // not sticky: clear it, run the fallback
    return false;
  }
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// The local kernel where it takes the call: false (nothing launched) where the sizes say the
// fused kernel is cheaper (paths::local_pays; not asked when `forced`), or where it cannot
// run: more than kLocalMaxBlockTokens tokens a block, or its shared memory past what a block
// may opt in to on this device. One block an SM (kLocalThreads), each owning a contiguous run
// of a multiple of Red::kLocalAlign tokens.
template <typename scalar_t, typename Red>
bool launch_local(const LargeCall<scalar_t>& c, ReduceWork w, bool forced) {
  const int sms = cuda::device_attribute<cudaDevAttrMultiProcessorCount>(c.dev);
  if (!forced && !paths::local_pays(c.n, c.idx64 ? 8 : 4, c.num_tokens, sms)) return false;
  constexpr auto kernel = scatter_large_local_kernel<scalar_t, Red>;
  constexpr int kThreads = Red::kLocalThreads;
  const int64_t per_sm = (c.num_tokens + sms - 1) / sms;
  constexpr int64_t kAlign = Red::kLocalAlign;
  const int64_t bt = (per_sm + kAlign - 1) / kAlign * kAlign;
  const int64_t blocks = (c.num_tokens + bt - 1) / bt;
  if (bt > kLocalMaxBlockTokens) return false;
  const size_t smem = sort_smem_bytes(kThreads) + block_lists_bytes(bt, c.n);
  const int optin = cuda::device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(c.dev);
  if (smem > size_t(optin)) return false;
  static std::once_flag opted[C10_COMPILE_TIME_MAX_GPUS];  // the kernel may take all of it, once a device
  std::call_once(opted[c.dev], [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  });
  w.block_tokens = bt;
  cuda::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, c.stream,
               cuda::pdl_wanted(), c.xp, c.idx, c.idx64, c.gates, c.g32, c.op, c.n, c.num_tokens, c.hvec, w);
  return true;
}

// The form: the local kernel where it takes the call (above), else the fused kernel where the
// device runs it, else the multi-kernel fallback; `form` forces one where it can run. The
// fused and multi-kernel forms' workspace is carved here, only for them.
template <typename scalar_t, typename Red>
void launch_with(LargeCall<scalar_t> c, LargeForm form, ReduceWork w, int64_t reduce_blocks) {
  if ((form == LargeForm::kAuto || form == LargeForm::kLocal) &&
      launch_local<scalar_t, Red>(c, w, form == LargeForm::kLocal)) {
    return;
  }
  c.ws = c.source.carve(c.source.ctx);
  if (form != LargeForm::kMulti && launch_fused<scalar_t, Red>(c, w, reduce_blocks)) return;
  launch_multi<scalar_t, Red>(c, w, reduce_blocks);
}

// Short-row reduce for hvec <= kShortMaxVec 16-byte vectors.
constexpr int kShortMaxVec = 64;
// Lane reduce: rows of up to 128 16-byte vectors (H <= 1024 for 16-bit types).
constexpr int kLaneMaxVec = 128;
// Vectors a thread (the lists-given Triton reduce holds 4 of a row) and rows in flight together.
constexpr int kLaneNVT = 2;
constexpr int kLaneU = 2;

} // namespace

template <typename scalar_t, int V>
void launch_large(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                  scalar_t* op, int n, int64_t num_tokens, int hvec, WorkspaceSource ws,
                  LargeForm form, c10::DeviceIndex dev, cudaStream_t stream) {
  const LargeCall<scalar_t> c{xp, idx, idx64, gates, g32, op, n, num_tokens, hvec, ws, dev, stream};
  if constexpr (V == 8) {
    // Lane reduce at mean fan-out in (1.5, 2], rows of <= kLaneMaxVec vectors. Why there: its
    // loads in flight an SM grow with the rows a token (6 blocks x 128 threads x 32 B a row, up
    // to its U = 2 rows: ~24 KB at fan-out 1, ~48 KB at 2), where WideReduce keeps ~24 KB and
    // ShortReduce ~32 KB whatever the fan-out; but each of its threads reads its token's count
    // and ell entries, where the warp reducers read them once a token, and at fan-out 1 that
    // work is spread over the fewest bytes. H100, bf16, in CUDA graphs (seventieth session,
    // bench/RESULTS.md): at fan-out 2 4-10 % faster than them (T65536 k2 H128 0.90-0.95,
    // T16384 / T65536 k2 H1024 0.94-0.96), at fan-out 1 1-6 % slower (T65536 k1 H128
    // 1.04-1.06, T4096 k1 H1024 1.03-1.04): so past the midpoint only.
    if (hvec <= kLaneMaxVec && 2 * int64_t(n) > 3 * num_tokens && int64_t(n) <= 2 * num_tokens) {
      const int64_t threads = num_tokens * ((hvec + kLaneNVT - 1) / kLaneNVT);  // >= one token's
      const int64_t blocks = (threads + kRedWarps * 32 - 1) / (kRedWarps * 32);
      launch_with<scalar_t, LaneReduce<scalar_t, V, kLaneNVT, kLaneU>>(c, form, ReduceWork{threads, 0},
                                                                       blocks);
      return;
    }
  }
  if constexpr (V > 1) {
    if (hvec <= kShortMaxVec) {
      // 8 lanes per token (its kEll metadata lanes) and up to 4 vectors per
      // lane; 16 lanes per token for hvec 33..64. U * NV = 8: eight 16-byte
      // vectors (32 registers) of loads in flight per lane.
      auto go = [&](auto tpw, auto nv) {
        constexpr int TPW = decltype(tpw)::value, NV = decltype(nv)::value;
        const int64_t groups = (num_tokens + TPW - 1) / TPW;
        launch_with<scalar_t, ShortReduce<scalar_t, V, TPW, NV, 8 / NV>>(
            c, form, ReduceWork{groups, 0}, (groups + kRedWarps - 1) / kRedWarps);
      };
      using c1 = std::integral_constant<int, 1>;
      using c2 = std::integral_constant<int, 2>;
      using c4 = std::integral_constant<int, 4>;
      if (hvec <= 8) go(c4(), c1());
      else if (hvec <= 16) go(c4(), c2());
      else if (hvec <= 32) go(c4(), c4());
      else go(c2(), c4());
      return;
    }
  }
  constexpr int nv = red_nv<V>();
  const int chunks = (hvec + 32 * nv - 1) / (32 * nv);
  const int64_t nitems = num_tokens * chunks;
  // U = 4 (more rows in flight) measured slower at fan-out 8: 361 vs 293 us
  // for the reduce, because 126 registers left 16 warps per SM; so U = 2.
  launch_with<scalar_t, WideReduce<scalar_t, V, 2>>(c, form, ReduceWork{nitems, chunks},
                                                    (nitems + kRedWarps - 1) / kRedWarps);
}

OPREG_SC_INSTANTIATE(launch_large)

} // namespace sc_detail
} // namespace opreg
