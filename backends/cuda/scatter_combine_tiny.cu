// opreg::scatter_combine forward, tiny path (the host picks it, scatter_combine.cu): ONE
// launch, no shared memory, no barrier. Warp w of a block owns token blockIdx.x *
// kTinyWarps + w (and the column chunk blockIdx.y): it reads all of token_idx itself in
// 16-byte loads (kTinyLoads per lane in flight), finds its token's rows with a ballot per
// load in row order, and sums them with the FMA chain of the other paths (accumulate_rows:
// the same bits). Every warp reads all N indices, so the host bounds N x T.
//
// Why: the small path's block-wide compaction (its index scan, a block scan and two barriers
// before the first row load) is most of its time at small T: in a CUDA graph on the H200
// (bench/scatter_paths.py, 2026-12-04) this kernel takes 0.6-0.9x of its time where the
// host's bounds (backends/common/scatter_combine_paths.h) send calls here, e.g. T16 k8 H128
// bf16 3.6 us against 4.8.
// It does not reach the seeds' size (T1536 k2 H128 fp32: 4.6 us against the small path's 4.1,
// Inductor's memset + atomic index_add 3.1): there every warp reading all 3072 indices costs
// more than the barriers it saves.
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include "pdl.cuh"
#include "scatter_combine.cuh"

namespace opreg {
namespace sc_detail {
namespace {

template <typename scalar_t, int V, typename idx_t>
__global__ void __launch_bounds__(kTinyWarps * 32) scatter_tiny_kernel(
    const scalar_t* __restrict__ x,
    const idx_t* __restrict__ idx,
    const void* __restrict__ gates,
    bool g32,
    scalar_t* __restrict__ out,
    int n,
    int64_t num_tokens,
    int hvec) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int NV = small_nv<V>();
  constexpr int IPL = 16 / sizeof(idx_t);  // indices per 16-byte load
  using ivec_t = Vec<idx_t, IPL>;
  constexpr int kRows = 32 * IPL * kTinyLoads;  // rows a warp scans per batch
  cuda::await_prior_grids();  // before any load or store (pdl.cuh)
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kTinyWarps + (threadIdx.x >> 5);
  if (t >= num_tokens) return;  // warp-uniform
  const int j0 = blockIdx.y * (32 * NV) + lane;
  acc_t acc[NV][V];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = acc_t(0);

  // Rows found and not yet summed (warp-uniform), flushed kSmallU at a time.
  int rows[kSmallU] = {};
  int nrows = 0;
  auto flush = [&]() {
    accumulate_rows<scalar_t, V, NV, kSmallU>([&](int u) { return rows[u]; }, nrows,
                                             reinterpret_cast<const vec_t*>(x), gates, g32, hvec, j0, acc);
    nrows = 0;
  };
  const ivec_t* iv = reinterpret_cast<const ivec_t*>(idx);
  const int nfull = n / IPL;  // whole 16-byte vectors; the rest are read one by one
  for (int base = 0; base < n; base += kRows) {
    ivec_t v[kTinyLoads];
#pragma unroll
    for (int l = 0; l < kTinyLoads; ++l) {  // every load of the batch before the first compare
      const int q = (base / IPL) + l * 32 + lane;
      if (q < nfull) {
        v[l] = iv[q];
      } else {
#pragma unroll
        for (int c = 0; c < IPL; ++c) v[l].v[c] = q * IPL + c < n ? idx[q * IPL + c] : idx_t(-1);
      }
    }
#pragma unroll
    for (int l = 0; l < kTinyLoads; ++l) {
      unsigned mine = 0;  // which of this lane's IPL rows are token t's
#pragma unroll
      for (int c = 0; c < IPL; ++c) mine |= unsigned(static_cast<int64_t>(v[l].v[c]) == t) << c;
      // Rows base + l 32 IPL + lane IPL + c: ascending in (lane, c), so lanes in order, then c.
      unsigned lanes = __ballot_sync(kFull, mine != 0);
      while (lanes) {
        const int src = __ffs(lanes) - 1;
        lanes &= lanes - 1;
        unsigned m = __shfl_sync(kFull, mine, src);
        while (m) {
          const int row = base + (l * 32 + src) * IPL + __ffs(m) - 1;
          m &= m - 1;
#pragma unroll
          for (int u = 0; u < kSmallU; ++u) rows[u] = u == nrows ? row : rows[u];  // no local memory
          if (++nrows == kSmallU) flush();
        }
      }
    }
  }
  if (nrows > 0) flush();
  cuda::store_row<scalar_t, V, NV>(out, t, hvec, j0, acc);
}

} // namespace

template <typename scalar_t, int V>
void launch_tiny(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                 scalar_t* op, int n, int64_t num_tokens, int hvec, int64_t gy, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((num_tokens + kTinyWarps - 1) / kTinyWarps),
                  static_cast<unsigned>(gy));
  const bool pdl = cuda::pdl_wanted();
  if (idx64) {
    cuda::launch(scatter_tiny_kernel<scalar_t, V, long long>, grid, dim3(kTinyWarps * 32), 0, stream, pdl, xp,
                 static_cast<const long long*>(idx), gates, g32, op, n, num_tokens, hvec);
  } else {
    cuda::launch(scatter_tiny_kernel<scalar_t, V, int>, grid, dim3(kTinyWarps * 32), 0, stream, pdl, xp,
                 static_cast<const int*>(idx), gates, g32, op, n, num_tokens, hvec);
  }
}

OPREG_SC_INSTANTIATE(launch_tiny)

} // namespace sc_detail
} // namespace opreg
