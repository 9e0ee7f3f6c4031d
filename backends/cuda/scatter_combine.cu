// CUDA kernels for opreg::scatter_combine and opreg::scatter_combine_backward.
//
// Forward is a gather, not a scatter: every output row is produced by exactly
// one warp/block that sums that token's rows in increasing row order with
// fp32 (fp64 for double) fused multiply-adds. No float atomics, no separate
// zero fill, and every path visits rows in the same order with the same FMA
// chain, so results are bitwise reproducible for any row order and any path.
//
// Two paths, chosen on the host from sizes alone (never from data):
//  * small (N <= 8192 and little total index-scan work): ONE launch. Each
//    block owns 8 tokens, reads all of token_idx itself (redundant across
//    blocks, served by L2) and compacts the rows of its tokens in row order (a block-wide scan of per-thread counts
//    over contiguous row ranges keeps the order stable), then one warp per
//    token gathers and sums. This is what makes 1536 x 2 x 128 one kernel.
//  * large: memset(counts) -> count (integer atomicAdd; its return value is
//    the row's slot within its token; slots < 8 are written straight into a
//    fixed-width table ell[t][8]) -> overflow scan + place (only rows beyond
//    a token's 8th) -> reduce. Slots from integer atomics are in arbitrary
//    order, so each reducer sorts its token's rows by row index (in
//    registers for <= 8 rows, in shared memory up to 1024) before summing;
//    tokens with > 1024 rows (degenerate routing) instead rescan token_idx in
//    row order: slower, equally deterministic. No host sync anywhere, so
//    CUDA-graph capture works.
//
// Indices outside [0, num_tokens) are ignored (their rows contribute nothing;
// backward gives them zero gradients). With OPREG_CHECK_INDICES=1 in the
// environment at call time, indices are validated first (this synchronizes)
// and an IndexError names token_idx.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>

#include "scatter_combine_checks.h"
#include "cuda_common.cuh"

namespace opreg {
namespace {

using cuda::Vec;
using cuda::fma_acc;
using cuda::load_gate;
using cuda::load_index;

constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------
// Small path: one launch.
constexpr int kSmallTok = 8;                 // tokens (= warps) per block
constexpr int kSmallThreads = kSmallTok * 32;
// Column vectors per lane per block (2 for 16-bit types: 204 -> ~110 registers).
template <int V>
constexpr int small_nv() {
  return V >= 8 ? 2 : 4;
}
constexpr int kSmallMaxRows = 8192;          // list entry (row << 3 | token) fits 16 bits
constexpr int64_t kSmallMaxWork = int64_t(1) << 21;  // N * blocks index reads
constexpr int kSmallU = 4;                   // rows whose loads are in flight together
static_assert(kSmallTok == 8, "list entries pack the local token in 3 bits");

// acc[k][:] += gate(r) * x[r, j0 + 32 k] for r = row_at(u), u in [0, nvalid)
// (nvalid <= U), in order. Every load of those rows is issued before the first
// FMA, so up to U rows are in flight together. Rows are warp-uniform. Used by
// both paths (small: rows from a ballot; large: rows from a token's list).
template <typename scalar_t, int V, int NV, int U, typename acc_t, typename RowFn>
__device__ __forceinline__ void accumulate_rows(
    RowFn row_at, int nvalid, const Vec<scalar_t, V>* __restrict__ x, const void* gates,
    bool g32, int hvec, int j0, acc_t (&acc)[NV][V]) {
  using vec_t = Vec<scalar_t, V>;
  acc_t g[U];
  vec_t xv[U][NV];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < nvalid) {
      const int r = row_at(u);
      g[u] = load_gate<acc_t, scalar_t>(gates, r, g32);
      const vec_t* xr = x + int64_t(r) * hvec;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int j = j0 + 32 * k;
        if (j < hvec) xv[u][k] = xr[j];
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < nvalid) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (j0 + 32 * k < hvec) {
#pragma unroll
          for (int e = 0; e < V; ++e)
            acc[k][e] = fma_acc(g[u], static_cast<acc_t>(xv[u][k].v[e]), acc[k][e]);
        }
      }
    }
  }
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kSmallThreads) scatter_small_kernel(
    const scalar_t* __restrict__ x,
    const void* __restrict__ idx,
    bool idx64,
    const void* __restrict__ gates,
    bool g32,
    scalar_t* __restrict__ out,
    int n,
    int64_t num_tokens,
    int hvec) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int kSmallVecPerLane_ = small_nv<V>();
  // (row << 3) | local token of this block's rows, in row order.
  extern __shared__ unsigned short s_list[];
  __shared__ int s_warp_tot[kSmallTok];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t0 = int64_t(blockIdx.x) * kSmallTok;
  const int64_t tlim = min(int64_t(kSmallTok), num_tokens - t0);

  // Phase 1: thread tid owns the contiguous rows [r0, r1); an exclusive scan
  // of the per-thread match counts gives every match its place in row order.
  // (Staging token_idx in shared memory with coalesced loads first measured
  // slower: 6.25 vs ~4 us per call in a CUDA graph.)
  const int per = (n + kSmallThreads - 1) / kSmallThreads;
  const int r0 = min(n, tid * per), r1 = min(n, r0 + per);
  int cnt = 0;
#pragma unroll 4
  for (int r = r0; r < r1; ++r) {
    const int64_t lt = load_index(idx, r, idx64) - t0;
    cnt += (lt >= 0 && lt < tlim);
  }
  const int incl = cuda::warp_inclusive_scan(cnt);
  if (lane == 31) s_warp_tot[warp] = incl;
  __syncthreads();
  int pos = incl - cnt, total = 0;
#pragma unroll
  for (int w = 0; w < kSmallTok; ++w) {
    const int c = s_warp_tot[w];
    pos += (w < warp) ? c : 0;
    total += c;
  }
  if (cnt > 0) {
    for (int r = r0; r < r1; ++r) {
      const int64_t lt = load_index(idx, r, idx64) - t0;
      if (lt >= 0 && lt < tlim) s_list[pos++] = static_cast<unsigned short>((r << 3) | int(lt));
    }
  }
  __syncthreads();

  // Phase 2: warp w sums the rows of token t0 + w, in list (= row) order.
  if (warp >= tlim) return;
  const int64_t t = t0 + warp;
  const int j0 = blockIdx.y * (32 * kSmallVecPerLane_) + lane;
  acc_t acc[kSmallVecPerLane_][V];
#pragma unroll
  for (int k = 0; k < kSmallVecPerLane_; ++k)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);

  for (int b = 0; b < total; b += 32) {
    const int ent = (b + lane < total) ? int(s_list[b + lane]) : -1;
    unsigned mask = __ballot_sync(kFull, ent >= 0 && (ent & 7) == warp);
    while (mask) {  // warp-uniform
      int rows[kSmallU];
      int nrows = 0;
#pragma unroll
      for (int u = 0; u < kSmallU; ++u) {
        if (mask) {
          const int src = __ffs(mask) - 1;
          mask &= mask - 1;
          rows[u] = __shfl_sync(kFull, ent, src) >> 3;
          nrows = u + 1;
        }
      }
      accumulate_rows<scalar_t, V, kSmallVecPerLane_, kSmallU>(
          [&](int u) { return rows[u]; }, nrows, reinterpret_cast<const vec_t*>(x), gates, g32,
          hvec, j0, acc);
    }
  }
  cuda::store_row<scalar_t, V, kSmallVecPerLane_>(out, t, hvec, j0, acc);
}

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
constexpr int kEll = 8;
constexpr int kScanThreads = 1024;
constexpr int kScanPerThread = 16;
constexpr int kScanTile = kScanThreads * kScanPerThread;  // tokens per scan block
constexpr int kRedWarps = 4;         // warps (= work items) per block
constexpr int kWarpSortCap = 1024;   // longest row list sorted in shared memory (per warp, 4 KB)
// Column vectors per lane per item: an item covers 512 elements for 16-bit
// types (NV = 2: 80 registers instead of 127 with NV = 4, 6 vs 4 blocks per SM)
// and 512 / 256 elements for fp32 / fp64.
template <int V>
constexpr int red_nv() {
  return V >= 8 ? 2 : 4;
}

// flag[0] is set when some token has more than kEll rows; the overflow scan
// and place kernels return at once otherwise (they cost 4.8 + 1.1 us of
// device time at 16384 tokens, for nothing in the common fan-out <= 8 case).
__global__ void count_kernel(
    const void* __restrict__ idx, bool idx64, int n, int64_t num_tokens,
    int* __restrict__ counts, int* __restrict__ ell, int* __restrict__ slot, int* __restrict__ flag) {
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

__global__ void place_kernel(
    const void* __restrict__ idx, bool idx64, int n, const int* __restrict__ slot,
    const int* __restrict__ ooff, int* __restrict__ operm, const int* __restrict__ flag) {
  if (*flag == 0) return;
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < n; r += gridDim.x * blockDim.x) {
    const int s = slot[r];
    if (s >= kEll) operm[ooff[load_index(idx, r, idx64)] + (s - kEll)] = r;
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

// U = rows whose loads are in flight together. (Capping registers at 64 for
// 8 blocks per SM made ptxas spill up to 484 bytes, so no cap: 80 registers,
// 6 blocks = 24 warps per SM for bf16.)
template <typename scalar_t, int V, int U>
__global__ void __launch_bounds__(kRedWarps * 32) scatter_reduce_kernel(
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
    int64_t nitems,
    int chunks,
    int hvec) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int NV = red_nv<V>();
  __shared__ int s_rows[kRedWarps][kWarpSortCap];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const vec_t* xv = reinterpret_cast<const vec_t*>(x);
  // Persistent warps: while an item's data loads are in flight, the next
  // item's (count, ell) loads are too, so the one metadata round trip per
  // item overlaps useful traffic (without this: 78 % of copy bandwidth at
  // fan-out 2).
  const int64_t stride = int64_t(gridDim.x) * kRedWarps;
  int64_t item = int64_t(blockIdx.x) * kRedWarps + warp;
  if (item >= nitems) return;  // warp-level only from here: no block barriers
  int64_t t = item / chunks;
  int cnt = counts[t];
  int mine = lane < kEll ? ell[t * kEll + lane] : 0;
  for (;;) {
    const int64_t next = item + stride;
    int64_t tn = 0;
    int cnt_n = 0, mine_n = 0;
    if (next < nitems) {
      tn = next / chunks;
      cnt_n = counts[tn];
      mine_n = lane < kEll ? ell[tn * kEll + lane] : 0;
    }
    const int j0 = int(item - t * chunks) * (32 * NV) + lane;
    acc_t acc[NV][V];
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);

    if (cnt <= kEll) {
      // Sort <= 8 rows by row index in registers: rank = #smaller rows.
      const int row = lane < cnt ? mine : INT_MAX;
      int rank = 0;
#pragma unroll
      for (int j = 0; j < kEll; ++j) rank += __shfl_sync(kFull, row, j) < row;
      // sorted[k] lives in lane k.
      int sorted = 0;
#pragma unroll
      for (int k = 0; k < kEll; ++k) {
        const unsigned m = __ballot_sync(kFull, lane < cnt && rank == k);
        const int v = __shfl_sync(kFull, row, m ? __ffs(m) - 1 : 0);
        if (lane == k) sorted = v;
      }
      warp_accumulate<scalar_t, V, NV, U>(
          [&](int i) { return __shfl_sync(kFull, sorted, i); }, cnt, xv, gates, g32, hvec, j0, acc);
    } else if (cnt <= kWarpSortCap) {
      // Overflowing token: gather ell + overflow rows, bitonic-sort in shared memory.
      int* rows = s_rows[warp];
      int P = 1;
      while (P < cnt) P <<= 1;
      const int o0 = ooff[t];
      if (lane < kEll) rows[lane] = mine;
      for (int i = kEll + lane; i < P; i += 32) rows[i] = i < cnt ? operm[o0 + i - kEll] : INT_MAX;
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

    cuda::store_row<scalar_t, V, NV>(out, t, hvec, j0, acc);
    if (next >= nitems) break;
    item = next;
    t = tn;
    cnt = cnt_n;
    mine = mine_n;
  }
}

// ---------------------------------------------------------------------------
// Backward: one fused pass. tpr (power of two) threads per row.
constexpr int kBwdThreads = 256;

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kBwdThreads) scatter_backward_kernel(
    const scalar_t* __restrict__ grad_out,
    const scalar_t* __restrict__ x,
    const void* __restrict__ idx,
    bool idx64,
    const void* __restrict__ gates,
    bool g32,
    scalar_t* __restrict__ grad_x,
    void* __restrict__ grad_gates,
    int n,
    int64_t num_tokens,
    int hvec,
    int tpr_log2) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  __shared__ acc_t s_part[kBwdThreads / 32];
  const int tpr = 1 << tpr_log2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = tid & (tpr - 1);
  const int row = blockIdx.x * (kBwdThreads >> tpr_log2) + (tid >> tpr_log2);

  acc_t dot = 0;
  if (row < n) {
    const int64_t t = load_index(idx, row, idx64);
    const bool valid = t >= 0 && t < num_tokens;
    const acc_t g = load_gate<acc_t, scalar_t>(gates, row, g32);
    const vec_t* gy = reinterpret_cast<const vec_t*>(grad_out) + (valid ? t : 0) * hvec;
    const vec_t* xr = reinterpret_cast<const vec_t*>(x) + int64_t(row) * hvec;
    vec_t* gxr = reinterpret_cast<vec_t*>(grad_x) + int64_t(row) * hvec;
    for (int j = sub; j < hvec; j += 2 * tpr) {
      const int j1 = j + tpr;
      const bool has1 = j1 < hvec;
      vec_t a[2], b[2];
      if (valid) {  // both rows' loads in flight before any math
        a[0] = gy[j];
        b[0] = xr[j];
        if (has1) {
          a[1] = gy[j1];
          b[1] = xr[j1];
        }
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (q == 1 && !has1) break;
        vec_t o;
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const acc_t d = valid ? static_cast<acc_t>(a[q].v[e]) : acc_t(0);
          o.v[e] = static_cast<scalar_t>(g * d);
          if (valid) dot = fma_acc(d, static_cast<acc_t>(b[q].v[e]), dot);
        }
        gxr[q == 0 ? j : j1] = o;
      }
    }
  }
  // Fixed reduction tree -> deterministic grad_gates.
  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) dot += __shfl_xor_sync(kFull, dot, o);
  } else {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(kFull, dot, o);
    if (lane == 0) s_part[warp] = dot;
    __syncthreads();
    if (sub == 0) {
      const int wpr = tpr >> 5, w0 = warp;  // sub == 0 -> first warp of the row
      dot = 0;
      for (int w = 0; w < wpr; ++w) dot += s_part[w0 + w];
    }
  }
  if (sub == 0 && row < n) {
    if (g32) {
      static_cast<float*>(grad_gates)[row] = static_cast<float>(dot);
    } else {
      static_cast<scalar_t*>(grad_gates)[row] = static_cast<scalar_t>(dot);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.

bool check_indices_requested() {
  const char* e = std::getenv("OPREG_CHECK_INDICES");
  return e != nullptr && e[0] == '1' && e[1] == '\0';
}

// Debug mode only: synchronizes (two scalar reads).
void validate_indices(const char* op, const at::Tensor& idx, int64_t num_tokens) {
  if (idx.numel() == 0) return;
  const auto mm = at::aminmax(idx);
  const int64_t lo = std::get<0>(mm).item<int64_t>();
  const int64_t hi = std::get<1>(mm).item<int64_t>();
  // Integers are formatted with std::to_string: streaming an int64_t into the
  // message (c10::str) from this nvcc-compiled TU segfaulted on the H200 box
  // (torch 2.11), inside std::ostream::_M_insert<long>.
  if (!(lo >= 0 && hi < num_tokens)) {
    const std::string msg = std::string(op) + ": token_idx has values outside [0, num_tokens=" +
        std::to_string(num_tokens) + "): min " + std::to_string(lo) + ", max " +
        std::to_string(hi) + " (checked because OPREG_CHECK_INDICES=1)";
    TORCH_CHECK_INDEX(false, msg);
  }
}

int grid_for(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 132 * 16)));
}

// Resident blocks of the persistent reduce kernel on the whole device,
// computed once per instantiation and device.
template <typename scalar_t, int V, int U>
int64_t reduce_grid_cap(c10::DeviceIndex dev) {
  static int64_t cap[C10_COMPILE_TIME_MAX_GPUS] = {};
  if (cap[dev] == 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, scatter_reduce_kernel<scalar_t, V, U>, kRedWarps * 32, 0));
    cap[dev] = int64_t(sms) * std::max(per_sm, 1);
  }
  return cap[dev];
}

template <typename scalar_t, int V>
void launch_forward(
    const at::Tensor& x, const at::Tensor& idx, const at::Tensor& g, at::Tensor& out,
    int64_t num_tokens) {
  const int n = static_cast<int>(x.size(0));
  const int hvec = static_cast<int>(x.size(1) / V);
  const bool idx64 = idx.scalar_type() == at::kLong;
  const bool g32 = g.scalar_type() == at::kFloat;
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int64_t gx_small = (num_tokens + kSmallTok - 1) / kSmallTok;
  constexpr int snv = small_nv<V>();
  const int64_t gy_small = std::max<int64_t>(1, (hvec + 32 * snv - 1) / (32 * snv));
  if (n <= kSmallMaxRows && int64_t(n) * gx_small * gy_small <= kSmallMaxWork && gy_small <= 65535) {
    scatter_small_kernel<scalar_t, V>
        <<<dim3(static_cast<unsigned>(gx_small), static_cast<unsigned>(gy_small)), kSmallThreads,
           n * sizeof(unsigned short), stream>>>(
            xp, idx.const_data_ptr(), idx64, g.const_data_ptr(), g32, op, n, num_tokens, hvec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }

  TORCH_CHECK(num_tokens < INT_MAX / kEll, "scatter_combine: num_tokens must be < 2^28 on CUDA");
  const int64_t ntiles = (num_tokens + kScanTile - 1) / kScanTile;
  // One int32 workspace from the caching allocator:
  // flag | counts[T] | ell[T][8] | ooff[T] | slot[N] | operm[N] | tile_sums.
  at::Tensor ws = at::empty({1 + num_tokens * (2 + kEll) + 2 * int64_t(n) + ntiles},
                            x.options().dtype(at::kInt));
  int* flag = ws.mutable_data_ptr<int>();
  int* counts = flag + 1;
  int* ell = counts + num_tokens;
  int* ooff = ell + num_tokens * kEll;
  int* slot = ooff + num_tokens;
  int* operm = slot + n;
  int* tile_sums = operm + n;

  C10_CUDA_CHECK(cudaMemsetAsync(flag, 0, (1 + num_tokens) * sizeof(int), stream));
  if (n > 0) {
    count_kernel<<<grid_for(n, 256), 256, 0, stream>>>(
        idx.const_data_ptr(), idx64, n, num_tokens, counts, ell, slot, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (ntiles > 1) {
      tile_sum_kernel<<<static_cast<unsigned>(ntiles), kScanThreads, 0, stream>>>(counts, num_tokens, tile_sums, flag);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    scan_kernel<<<static_cast<unsigned>(ntiles), kScanThreads, 0, stream>>>(counts, num_tokens, tile_sums, ooff, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    place_kernel<<<grid_for(n, 256), 256, 0, stream>>>(idx.const_data_ptr(), idx64, n, slot, ooff, operm, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  constexpr int nv = red_nv<V>();
  const int chunks = (hvec + 32 * nv - 1) / (32 * nv);
  const int64_t nitems = num_tokens * chunks;
  const int64_t blocks = (nitems + kRedWarps - 1) / kRedWarps;
  auto launch = [&](auto u_tag) {
    constexpr int U = decltype(u_tag)::value;
    const int64_t grid = std::min<int64_t>(blocks, reduce_grid_cap<scalar_t, V, U>(x.get_device()));
    scatter_reduce_kernel<scalar_t, V, U><<<static_cast<unsigned>(grid), kRedWarps * 32, 0, stream>>>(
        xp, idx.const_data_ptr(), idx64, g.const_data_ptr(), g32, counts, ell, ooff, operm, op, n,
        nitems, chunks, hvec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // U = 4 (more rows in flight) measured slower at fan-out 8: 361 vs 293 us
  // for the reduce, because 126 registers left 16 warps per SM; so U = 2.
  launch(std::integral_constant<int, 2>());
}

template <typename scalar_t>
bool can_vec16(std::initializer_list<const void*> ptrs, int64_t h) {
  if (h % cuda::vec16<scalar_t>() != 0) return false;
  for (const void* p : ptrs)
    if (!cuda::aligned16(p)) return false;
  return true;
}

at::Tensor scatter_combine_cuda(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    int64_t num_tokens) {
  check_scatter_combine(expert_hidden, token_idx, gates, num_tokens);
  const c10::cuda::CUDAGuard guard(expert_hidden.device());
  const c10::MaybeOwned<at::Tensor> x = expert_hidden.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> idx = token_idx.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> g = gates.expect_contiguous();
  const int64_t n = x->size(0), h = x->size(1);
  TORCH_CHECK(n < INT_MAX && h < INT_MAX, "scatter_combine: CUDA kernel supports N, H < 2^31");
  if (check_indices_requested()) validate_indices("scatter_combine", *idx, num_tokens);

  at::Tensor out = at::empty({num_tokens, h}, x->options());
  if (num_tokens == 0 || h == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x->scalar_type(), "scatter_combine_cuda", [&] {
    if (can_vec16<scalar_t>({x->const_data_ptr(), out.const_data_ptr()}, h)) {
      launch_forward<scalar_t, cuda::vec16<scalar_t>()>(*x, *idx, *g, out, num_tokens);
    } else {
      launch_forward<scalar_t, 1>(*x, *idx, *g, out, num_tokens);
    }
  });
  return out;
}

template <typename scalar_t, int V>
void launch_backward(
    const at::Tensor& gy, const at::Tensor& x, const at::Tensor& idx, const at::Tensor& g,
    at::Tensor& gx, at::Tensor& gg) {
  const int n = static_cast<int>(x.size(0));
  const int hvec = static_cast<int>(x.size(1) / V);
  // ~4 vectors per thread: enough 16-byte loads in flight, short tails.
  int tpr_log2 = 0;
  while ((1 << tpr_log2) < kBwdThreads && (1 << tpr_log2) * 4 < hvec) ++tpr_log2;
  const int rows_per_block = kBwdThreads >> tpr_log2;
  const int64_t blocks = (n + rows_per_block - 1) / rows_per_block;
  scatter_backward_kernel<scalar_t, V>
      <<<static_cast<unsigned>(blocks), kBwdThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          gy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), idx.const_data_ptr(),
          idx.scalar_type() == at::kLong, g.const_data_ptr(), g.scalar_type() == at::kFloat,
          gx.mutable_data_ptr<scalar_t>(), gg.mutable_data_ptr(), n, gy.size(0), hvec, tpr_log2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> scatter_combine_backward_cuda(
    const at::Tensor& grad_out,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  check_scatter_combine_backward(grad_out, expert_hidden, token_idx, gates);
  const c10::cuda::CUDAGuard guard(expert_hidden.device());
  const c10::MaybeOwned<at::Tensor> gy = grad_out.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> x = expert_hidden.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> idx = token_idx.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> g = gates.expect_contiguous();
  const int64_t n = x->size(0), h = x->size(1);
  TORCH_CHECK(n < INT_MAX && h < INT_MAX,
              "scatter_combine_backward: CUDA kernel supports N, H < 2^31");
  if (check_indices_requested()) validate_indices("scatter_combine_backward", *idx, gy->size(0));

  at::Tensor gx = at::empty({n, h}, x->options());
  at::Tensor gg = at::empty({n}, g->options());
  if (n == 0) return {gx, gg};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x->scalar_type(), "scatter_combine_backward_cuda", [&] {
    if (can_vec16<scalar_t>({gy->const_data_ptr(), x->const_data_ptr(), gx.const_data_ptr()}, h)) {
      launch_backward<scalar_t, cuda::vec16<scalar_t>()>(*gy, *x, *idx, *g, gx, gg);
    } else {
      launch_backward<scalar_t, 1>(*gy, *x, *idx, *g, gx, gg);
    }
  });
  return {gx, gg};
}

} // namespace
} // namespace opreg

// Schemas are defined from Python (torch.library.define) before this library
// is loaded; num_tokens is a SymInt there, a backend kernel sees it concrete.
TORCH_LIBRARY_IMPL(opreg, CUDA, m) {
  m.impl("scatter_combine", &opreg::scatter_combine_cuda);
  m.impl("scatter_combine_backward", &opreg::scatter_combine_backward_cuda);
}
