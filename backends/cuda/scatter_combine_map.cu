// The global map of opreg::scatter_combine's forward, for calls with so many rows
// that scanning token_idx in every cluster would cost more (the model that decides is
// scatter_combine_model.cuh): memset(counts) -> count (integer atomicAdd; its return
// value is the row's slot within its token; slots < kEll = 8 are written straight
// into a fixed-width table ell[t][8]) -> overflow scan + place (only rows beyond a
// token's 8th, into a CSR). Slots from integer atomics are in arbitrary order: the
// token blocks that read the map (scatter_combine_tokens.cuh) sort each token's rows.
// No host sync; the host carves the workspace (scatter_combine.cu).
//
// History: a CSR-only first version (offsets -> perm -> sort -> gates -> x) spent 3-4
// dependent memory round trips per token before its first data load; with ell a
// token's first 8 rows are one round trip away, and the overflow kernels return at
// once unless some token has more than 8 rows.
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "scatter_combine.cuh"

namespace opreg {
namespace sc_detail {
namespace {

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

int grid_for(int64_t work, int threads) {
  const int64_t b = (work + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(b, 132 * 16)));
}

} // namespace

void launch_map(const void* idx, bool idx64, int n, int64_t num_tokens, int64_t ntiles, int* flag,
                int* counts, int* ell, int* ooff, int* slot, int* operm, int* tile_sums,
                cudaStream_t stream) {
  C10_CUDA_CHECK(cudaMemsetAsync(flag, 0, (1 + num_tokens) * sizeof(int), stream));
  if (n == 0) return;
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

} // namespace sc_detail
} // namespace opreg
