// opreg::scatter_combine forward, large path (every call the small path of
// scatter_combine_small.cu does not take; the host picks, sizes the workspace
// and calls launch_large, scatter_combine.cu): memset(counts) -> count ->
// overflow scan + place -> reduce, no host sync. kEll and the scan constants
// are in scatter_combine.cuh (the host sizes the workspace with them).
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <climits>
#include <type_traits>

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

// A token with more than kEll rows, summed by the whole warp (lane owns
// vectors j0 + 32 k): its ell rows (`mine`, lanes < kEll) and its overflow rows
// are bitonic-sorted in the warp's shared-memory scratch `rows` (<= 1024
// rows), or, past that, token_idx is walked in row order. Shared by both
// reduce kernels so that a token's sum is the same code, hence the same bits,
// whichever kernel owns it.
template <typename scalar_t, int V, int NV, int U, typename acc_t>
__device__ __forceinline__ void accumulate_long_token(
    int64_t t, int cnt, int mine, int* rows, const Vec<scalar_t, V>* __restrict__ xv,
    const void* __restrict__ idx, bool idx64, const void* __restrict__ gates, bool g32,
    const int* __restrict__ ooff, const int* __restrict__ operm, int n, int hvec, int j0,
    acc_t (&acc)[NV][V]) {
  const int lane = threadIdx.x & 31;
  if (cnt <= kWarpSortCap) {
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
}

// The whole of a long token's output row, summed by one warp.
template <typename scalar_t, int V, int NV>
__device__ __forceinline__ void reduce_long_token(
    int64_t t, int cnt, int mine, int* rows, const Vec<scalar_t, V>* __restrict__ xv,
    const void* __restrict__ idx, bool idx64, const void* __restrict__ gates, bool g32,
    const int* __restrict__ ooff, const int* __restrict__ operm, scalar_t* __restrict__ out,
    int n, int hvec) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x & 31;
  acc_t acc[NV][V];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);
  accumulate_long_token<scalar_t, V, NV, 2>(t, cnt, mine, rows, xv, idx, idx64, gates, g32, ooff,
                                            operm, n, hvec, lane, acc);
  cuda::store_row<scalar_t, V, NV>(out, t, hvec, lane, acc);
}

// Lane k of each aligned group of kEll lanes gets the k-th smallest of the
// group's `row` values (INT_MAX pads a list shorter than kEll): rank = number
// of smaller rows in the group (rows are distinct), then one ballot per rank.
__device__ __forceinline__ int sort_ell_groups(int row) {
  const int lane = threadIdx.x & 31, k = lane & (kEll - 1), base = lane & ~(kEll - 1);
  int rank = 0;
#pragma unroll
  for (int j = 0; j < kEll; ++j) rank += __shfl_sync(kFull, row, j, kEll) < row;
  int sorted = INT_MAX;
#pragma unroll
  for (int q = 0; q < kEll; ++q) {
    const unsigned m = (__ballot_sync(kFull, row != INT_MAX && rank == q) >> base) & 0xffu;
    const int v = __shfl_sync(kFull, row, m ? __ffs(m) - 1 : 0, kEll);
    if (k == q && m) sorted = v;
  }
  return sorted;
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
      // Sort <= 8 rows by row index in registers; sorted[k] lives in lane k.
      const int sorted = sort_ell_groups(lane < cnt ? mine : INT_MAX);
      warp_accumulate<scalar_t, V, NV, U>(
          [&](int i) { return __shfl_sync(kFull, sorted, i); }, cnt, xv, gates, g32, hvec, j0, acc);
    } else {
      accumulate_long_token<scalar_t, V, NV, U>(t, cnt, mine, s_rows[warp], xv, idx, idx64, gates,
                                                g32, ooff, operm, n, hvec, j0, acc);
    }

    cuda::store_row<scalar_t, V, NV>(out, t, hvec, j0, acc);
    if (next >= nitems) break;
    item = next;
    t = tn;
    cnt = cnt_n;
    mine = mine_n;
  }
}

// Short rows (16-byte vectors, hvec <= 64: H <= 256 for fp32, <= 512 for
// 16-bit types): scatter_reduce_kernel gives each token a whole warp and
// loads U = 2 rows at a time, so at H = 128 bf16 (hvec 16) only half the
// lanes load anything and a warp has 2 x 256 B in flight: ~20 % of copy
// bandwidth. Here a warp owns TPW tokens at once (L = 32 / TPW lanes each,
// NV vectors per lane, L * NV >= hvec); lanes 8s..8s+7 fetch token s's
// (count, ell) together and sort them in registers (sort_ell_groups), then
// every lane loads U of its token's rows before the first FMA (U * NV = 8
// vectors = 32 registers in flight per lane, whatever the row width). At
// fan-out 2 a warp has 4 tokens x 2 rows in flight (2 KB at H = 128 bf16,
// 4 KB at H = 128 fp32) instead of 512 B. Tokens with more than kEll rows are
// then summed one at a time by the whole warp, with the helper the other
// kernel uses. The per-element FMA chain is the same: same bits.
// ptxas gives this kernel 96-167 registers (bf16 highest; the long-token
// sort and row walk are inlined). Pinning 6 blocks per SM (80 registers)
// spilled 200-800 bytes and measured slower on the H200 (T16384 k8 H128 bf16:
// 55 vs 38 us), so no minimum is asked for.
template <typename scalar_t, int V, int TPW, int NV, int U>
__global__ void __launch_bounds__(kRedWarps * 32) scatter_reduce_short_kernel(
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
    int hvec) {
  static_assert(TPW == 2 || TPW == 4, "a token's kEll metadata lanes must fit in its lanes");
  static_assert(kEll % U == 0, "row batches must tile the kEll sorted rows");
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int L = 32 / TPW;              // lanes per token in the common case
  constexpr int NVW = (NV * L + 31) / 32;  // vectors per lane when the whole warp sums one token
  __shared__ int s_rows[kRedWarps][kWarpSortCap];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const vec_t* xv = reinterpret_cast<const vec_t*>(x);
  const int64_t ngroups = (num_tokens + TPW - 1) / TPW;
  const int64_t stride = int64_t(gridDim.x) * kRedWarps;
  int64_t grp = int64_t(blockIdx.x) * kRedWarps + warp;
  if (grp >= ngroups) return;  // warp-level only from here

  // Metadata lanes: token ms = lane / kEll of the group, its ell entry lane % kEll.
  const int ms = lane / kEll;
  auto meta = [&](int64_t g, int& cnt, int& mine) {
    const int64_t tk = g * TPW + ms;
    cnt = 0;
    mine = INT_MAX;
    if (ms < TPW && tk < num_tokens) {
      cnt = counts[tk];
      mine = ell[tk * kEll + (lane & (kEll - 1))];
    }
  };
  int cnt, mine;
  meta(grp, cnt, mine);
  // Data lanes: token s = lane / L, vectors jl + L k.
  const int s = lane / L, jl = lane % L;
  for (;;) {
    // Persistent warps, as in scatter_reduce_kernel: the next group's
    // metadata loads are in flight during this group's data loads.
    const int64_t next = grp + stride;
    int cnt_n = 0, mine_n = INT_MAX;
    if (next < ngroups) meta(next, cnt_n, mine_n);

    const int64_t t = grp * TPW + s;
    const int sorted = sort_ell_groups((lane & (kEll - 1)) < cnt && cnt <= kEll ? mine : INT_MAX);
    // This lane's token's row count; tokens with > kEll rows are left for later.
    const int c_all = __shfl_sync(kFull, cnt, s * kEll);
    const int c = c_all <= kEll ? c_all : 0;
    const int cmax = __reduce_max_sync(kFull, unsigned(c));
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
    if (t < num_tokens && c_all <= kEll) {
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

    // Tokens of this group with more than kEll rows: one at a time, whole warp.
    unsigned long_tok = __ballot_sync(kFull, (lane & (kEll - 1)) == 0 && cnt > kEll);
    while (long_tok) {  // warp-uniform
      const int src = __ffs(long_tok) - 1;
      long_tok &= long_tok - 1;
      const int64_t tl = grp * TPW + src / kEll;
      const int cl = __shfl_sync(kFull, cnt, src);
      const int ml = __shfl_sync(kFull, mine, src + (lane & (kEll - 1)));
      reduce_long_token<scalar_t, V, NVW>(tl, cl, ml, s_rows[warp], xv, idx, idx64, gates, g32,
                                          ooff, operm, out, n, hvec);
    }

    if (next >= ngroups) break;
    grp = next;
    cnt = cnt_n;
    mine = mine_n;
  }
}

int grid_for(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 132 * 16)));
}

// Resident blocks of a persistent reduce kernel (128 threads per block) on
// the whole device, computed once per kernel and device.
template <auto kKernel>
int64_t reduce_grid_cap(c10::DeviceIndex dev) {
  static int64_t cap[C10_COMPILE_TIME_MAX_GPUS] = {};
  if (cap[dev] == 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kRedWarps * 32, 0));
    cap[dev] = int64_t(sms) * std::max(per_sm, 1);
  }
  return cap[dev];
}

// Short-row reduce for hvec <= kShortMaxVec 16-byte vectors; a template
// parameter pack of one lane layout (TPW tokens per warp, NV vectors per lane).
constexpr int kShortMaxVec = 64;

template <typename scalar_t, int V, int TPW, int NV>
void launch_short_reduce(const scalar_t* xp, const void* idx, bool idx64, const void* gates,
                         bool g32, const int* counts, const int* ell, const int* ooff,
                         const int* operm, scalar_t* op, int n, int64_t num_tokens, int hvec,
                         c10::DeviceIndex dev, cudaStream_t stream) {
  // U * NV = 8: eight 16-byte vectors (32 registers) of loads in flight per lane.
  constexpr auto kernel = scatter_reduce_short_kernel<scalar_t, V, TPW, NV, 8 / NV>;
  const int64_t groups = (num_tokens + TPW - 1) / TPW;
  const int64_t blocks = (groups + kRedWarps - 1) / kRedWarps;
  const int64_t grid = std::min<int64_t>(blocks, reduce_grid_cap<kernel>(dev));
  kernel<<<static_cast<unsigned>(grid), kRedWarps * 32, 0, stream>>>(
      xp, idx, idx64, gates, g32, counts, ell, ooff, operm, op, n, num_tokens, hvec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

template <typename scalar_t, int V>
void launch_large(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                  scalar_t* op, int n, int64_t num_tokens, int hvec, int64_t ntiles, int* flag,
                  int* counts, int* ell, int* ooff, int* slot, int* operm, int* tile_sums,
                  c10::DeviceIndex dev, cudaStream_t stream) {
  C10_CUDA_CHECK(cudaMemsetAsync(flag, 0, (1 + num_tokens) * sizeof(int), stream));
  if (n > 0) {
    count_kernel<<<grid_for(n, 256), 256, 0, stream>>>(idx, idx64, n, num_tokens, counts, ell, slot, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (ntiles > 1) {
      tile_sum_kernel<<<static_cast<unsigned>(ntiles), kScanThreads, 0, stream>>>(counts, num_tokens, tile_sums, flag);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    scan_kernel<<<static_cast<unsigned>(ntiles), kScanThreads, 0, stream>>>(counts, num_tokens, tile_sums, ooff, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    place_kernel<<<grid_for(n, 256), 256, 0, stream>>>(idx, idx64, n, slot, ooff, operm, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if constexpr (V > 1) {
    if (hvec <= kShortMaxVec) {
      // 8 lanes per token (its kEll metadata lanes) and up to 4 vectors per
      // lane; 16 lanes per token for hvec 33..64.
      auto go = [&](auto tpw, auto nv) {
        launch_short_reduce<scalar_t, V, decltype(tpw)::value, decltype(nv)::value>(
            xp, idx, idx64, gates, g32, counts, ell, ooff, operm, op, n, num_tokens, hvec, dev,
            stream);
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
  const int64_t blocks = (nitems + kRedWarps - 1) / kRedWarps;
  // U = 4 (more rows in flight) measured slower at fan-out 8: 361 vs 293 us
  // for the reduce, because 126 registers left 16 warps per SM; so U = 2.
  constexpr int U = 2;
  constexpr auto kernel = scatter_reduce_kernel<scalar_t, V, U>;
  const int64_t grid = std::min<int64_t>(blocks, reduce_grid_cap<kernel>(dev));
  kernel<<<static_cast<unsigned>(grid), kRedWarps * 32, 0, stream>>>(
      xp, idx, idx64, gates, g32, counts, ell, ooff, operm, op, n, nitems, chunks, hvec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

OPREG_SC_INSTANTIATE(launch_large)

} // namespace sc_detail
} // namespace opreg
