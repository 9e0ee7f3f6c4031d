// opreg::cat_linear's dot path, for the tiniest calls (the path choice: cat_linear.cu, the
// model: backends/common/cat_linear_model.h): ONE launch, no shared memory, no barrier.
//
// Warp g computes kDotCols outputs of one row: row g / G, columns kDotCols * (g % G) + c
// (G = ceil(N / kDotCols)). Its lanes split K in V-element vectors, lane l taking vectors
// l, l + 32, l + 64, ... in order; each lane sums its own products in k order, then a fixed
// butterfly of shuffles sums the 32 lanes (deterministic: the same order every run). All
// loads of kDotUnroll steps are issued before their first FMA, so a call with K <= 32 V
// kDotUnroll columns (256 fp32, 512 bf16) is one memory round trip.
//
// Why a third path: at the seeds' size (12 x 56 x 128 fp32, R4) the SIMT kernel is 2 blocks,
// each walking its 4 chunks through the cp.async pipeline with a barrier per chunk and a
// shared-memory reduction of 8 warps: 4.5 us per call in a CUDA graph on the H200, against
// eager's two kernels (at::cat + cuBLAS) at 3.5 (bench/gpu_report.py, 2026-12-04). Back to
// back the host hides it; in a CUDA graph the op was slower than what it replaces.
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include "cat_linear.cuh"
#include "pdl.cuh"

namespace opreg {
namespace cl_detail {
namespace {

constexpr unsigned kFull = 0xffffffffu;
static_assert(kDotThreads % 32 == 0, "whole warps");

template <typename scalar_t, bool VEC, int MAXR>
__global__ void __launch_bounds__(kDotThreads) cat_linear_dot_kernel(
    const __grid_constant__ PartArgs<MAXR> pa,
    int nparts,
    const scalar_t* __restrict__ w,
    int64_t ldw,
    const scalar_t* __restrict__ bias,
    scalar_t* __restrict__ out,
    int M,
    int N,
    int K) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int V = VEC ? vec16<scalar_t>() : 1;  // misaligned parts: one element per load
  using vec_t = Vec<scalar_t, V>;
  cuda::await_prior_grids();  // before any load or store (pdl.cuh)
  const int lane = threadIdx.x & 31;
  const int groups = (N + kDotCols - 1) / kDotCols;
  // 32-bit: the host keeps M * groups below INT_MAX / 2 (cat_linear_model.h, fits_dot)
  const int g = static_cast<int>(blockIdx.x) * (kDotThreads / 32) + (threadIdx.x >> 5);
  if (g >= M * groups) return;  // warp-uniform
  const int m = g / groups, n0 = (g % groups) * kDotCols;
  // Lane c's bias, loaded now: after the sums it would be one more memory round trip.
  const int n = n0 + lane;
  const acc_t b = bias != nullptr && lane < kDotCols && n < N ? static_cast<acc_t>(bias[n]) : acc_t(0);
  // Columns past N read row N - 1 (a valid address); their sums are never stored.
  const scalar_t* wrow[kDotCols];
#pragma unroll
  for (int c = 0; c < kDotCols; ++c) wrow[c] = w + int64_t(min(n0 + c, N - 1)) * ldw;

  acc_t acc[kDotCols];
#pragma unroll
  for (int c = 0; c < kDotCols; ++c) acc[c] = acc_t(0);
  int p = 0;  // the part holding this lane's current column (a lane's columns only grow)
  for (int k0 = lane * V; k0 < K; k0 += 32 * V * kDotUnroll) {
    vec_t xv[kDotUnroll], wv[kDotUnroll][kDotCols];
#pragma unroll
    for (int u = 0; u < kDotUnroll; ++u) {
      const int k = k0 + u * 32 * V;
      if (k < K) {
        // A vector never straddles two parts: every width is a multiple of V (VEC) or V = 1.
        while (p + 1 < nparts && k >= pa.kstart[p] + pa.width[p]) ++p;
        const scalar_t* xp = static_cast<const scalar_t*>(pa.ptr[p]) +
                             int64_t(m) * pa.row_stride[p] + (k - pa.kstart[p]);
        xv[u] = *reinterpret_cast<const vec_t*>(xp);
#pragma unroll
        for (int c = 0; c < kDotCols; ++c) wv[u][c] = *reinterpret_cast<const vec_t*>(wrow[c] + k);
      }
    }
#pragma unroll
    for (int u = 0; u < kDotUnroll; ++u) {
      if (k0 + u * 32 * V < K) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const acc_t xe = static_cast<acc_t>(xv[u].v[e]);
#pragma unroll
          for (int c = 0; c < kDotCols; ++c)
            acc[c] = cuda::fma_acc(xe, static_cast<acc_t>(wv[u][c].v[e]), acc[c]);
        }
      }
    }
  }
  // Butterfly over the lanes: every lane ends with the same sum (a + b == b + a exactly).
#pragma unroll
  for (int c = 0; c < kDotCols; ++c) {
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) acc[c] += __shfl_xor_sync(kFull, acc[c], off);
  }
  // Lane c stores column n0 + c (a select chain, not a dynamically indexed register array).
  acc_t s = acc[0];
#pragma unroll
  for (int c = 1; c < kDotCols; ++c) s = lane == c ? acc[c] : s;
  if (lane < kDotCols && n < N) out[int64_t(m) * N + n] = static_cast<scalar_t>(s + b);
}

} // namespace

template <typename scalar_t, bool VEC, int MAXR>
void launch_dot_kernel(const PartArgs<kMaxParts>& all, int R, const scalar_t* w, int64_t ldw,
                       const scalar_t* bias, scalar_t* out, int64_t M, int64_t N,
                       c10::DeviceIndex /*dev*/, cudaStream_t stream) {
  PartArgs<MAXR> pa;
  int64_t K = 0;
  for (int i = 0; i < R; ++i) {
    pa.ptr[i] = all.ptr[i];
    pa.row_stride[i] = all.row_stride[i];
    pa.width[i] = all.width[i];
    pa.kstart[i] = all.kstart[i];
    K += all.width[i];
  }
  const int64_t warps = M * ((N + kDotCols - 1) / kDotCols);
  const int64_t blocks = (warps + kDotThreads / 32 - 1) / (kDotThreads / 32);
  cuda::launch(cat_linear_dot_kernel<scalar_t, VEC, MAXR>, dim3(static_cast<unsigned>(blocks)), dim3(kDotThreads), 0,
               stream, cuda::pdl_wanted(), pa, R, w, ldw, bias, out, static_cast<int>(M), static_cast<int>(N),
               static_cast<int>(K));
}

OPREG_CL_INSTANTIATE(launch_dot_kernel)

} // namespace cl_detail
} // namespace opreg
