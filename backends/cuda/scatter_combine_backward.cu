// opreg::scatter_combine_backward's kernel (the host side, with the checks and
// the dispatch, is in scatter_combine.cu): grad_x[r] = gate[r] * grad_out[t(r)]
// and grad_gates[r] = <grad_out[t(r)], x[r]> with a fixed reduction tree, so
// it is deterministic; rows with an index outside [0, num_tokens) get zeros.
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include "pdl.cuh"
#include "scatter_combine.cuh"

namespace opreg {
namespace sc_detail {
namespace {

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
  cuda::await_prior_grids();  // before any load or store (pdl.cuh)
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

} // namespace

template <typename scalar_t, int V>
void launch_scatter_backward(const scalar_t* gy, const scalar_t* x, const void* idx, bool idx64,
                             const void* gates, bool g32, scalar_t* gx, void* gg, int n,
                             int64_t num_tokens, int hvec, cudaStream_t stream) {
  // ~4 vectors per thread: enough 16-byte loads in flight, short tails.
  int tpr_log2 = 0;
  while ((1 << tpr_log2) < kBwdThreads && (1 << tpr_log2) * 4 < hvec) ++tpr_log2;
  const int rows_per_block = kBwdThreads >> tpr_log2;
  const int64_t blocks = (n + rows_per_block - 1) / rows_per_block;
  cuda::launch(scatter_backward_kernel<scalar_t, V>, dim3(static_cast<unsigned>(blocks)), dim3(kBwdThreads), 0,
               stream, cuda::pdl_wanted(), gy, x, idx, idx64, gates, g32, gx, gg, n, num_tokens, hvec, tpr_log2);
}

OPREG_SC_INSTANTIATE(launch_scatter_backward)

} // namespace sc_detail
} // namespace opreg
