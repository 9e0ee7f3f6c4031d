// opreg::scatter_combine forward, small path (N <= 8192 and little total
// index-scan work; the host picks it, scatter_combine.cu): ONE launch. Each
// block owns 8 tokens, reads all of token_idx itself (redundant across blocks,
// served by L2) and compacts the rows of its tokens in row order, then one warp
// per token gathers and sums. Constants and accumulate_rows: scatter_combine.cuh.
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include "pdl.cuh"
#include "scatter_combine.cuh"

namespace opreg {
namespace sc_detail {
namespace {

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
  cuda::await_prior_grids();  // before any load or store (pdl.cuh)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t0 = int64_t(blockIdx.x) * kSmallTok;
  const int64_t tlim = min(int64_t(kSmallTok), num_tokens - t0);

  // Phase 1: thread tid owns the contiguous rows [r0, r1); an exclusive scan
  // of the per-thread match counts gives every match its place in row order.
  // All of a thread's (<= kSmallPer) index loads are issued before the first
  // compare, and the matches are kept as a bit mask, so the phase costs one
  // L2 round trip plus one (L1) reload per match; the former loop (unrolled 4,
  // then a second pass re-reading every index) was ~16 dependent round trips
  // at N = 8192, longer than the data phase at T1024 k8 H1024 fp32.
  // (Staging token_idx in shared memory with coalesced loads first measured
  // slower: 6.25 vs ~4 us per call in a CUDA graph.)
  static_assert(kSmallMaxRows <= kSmallThreads * kSmallPer, "a thread's rows fit its match mask");
  const int per = (n + kSmallThreads - 1) / kSmallThreads;
  const int r0 = min(n, tid * per), r1 = min(n, r0 + per);
  unsigned match = 0;
#pragma unroll
  for (int i = 0; i < kSmallPer; ++i) {
    if (r0 + i < r1) {
      const int64_t lt = load_index(idx, r0 + i, idx64) - t0;
      match |= unsigned(lt >= 0 && lt < tlim) << i;
    }
  }
  const int cnt = __popc(match);
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
  while (match) {
    const int r = r0 + __ffs(match) - 1;
    match &= match - 1;
    const int lt = int(load_index(idx, r, idx64) - t0);
    s_list[pos++] = static_cast<unsigned short>((r << 3) | lt);
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

} // namespace

template <typename scalar_t, int V>
void launch_small(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                  scalar_t* op, int n, int64_t num_tokens, int hvec, int64_t gx_small,
                  int64_t gy_small, cudaStream_t stream) {
  cuda::launch(scatter_small_kernel<scalar_t, V>,
               dim3(static_cast<unsigned>(gx_small), static_cast<unsigned>(gy_small)), dim3(kSmallThreads),
               n * sizeof(unsigned short), stream, cuda::pdl_wanted(), xp, idx, idx64, gates, g32, op, n,
               num_tokens, hvec);
}

OPREG_SC_INSTANTIATE(launch_small)

} // namespace sc_detail
} // namespace opreg
