// Small device helpers shared by the opreg CUDA kernels.
//
// Header-only and light on includes on purpose: every .cu that includes it is
// compiled on the user's machine by torch.utils.cpp_extension, so compile time
// is a user-facing cost.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cstdint>

// The floating types every kernel is built for, as the host dispatches them
// (AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16)): OPREG_FOR_FLOAT_TYPES(M, FN)
// expands to M(FN, T) for each T; the kernel files' explicit instantiations use it,
// so the list is written once.
#define OPREG_FOR_FLOAT_TYPES(M, FN) M(FN, float) M(FN, double) M(FN, c10::Half) M(FN, c10::BFloat16)

namespace opreg {
namespace cuda {

// V elements moved as one 16-byte (or smaller) access. Alignment makes nvcc
// emit a single LDG/STG.128 for the whole struct.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Elements per 16-byte access.
template <typename T>
constexpr int vec16() {
  return static_cast<int>(16 / sizeof(T));
}

// Rounds one lane's accumulators to scalar_t and stores them into output row
// `row` (hvec vectors wide): acc[k] is the row's vector j0 + 32 k, as every
// warp-per-row kernel lays them out; vectors past the row's end are skipped.
template <typename scalar_t, int V, int NV, typename acc_t>
__device__ __forceinline__ void store_row(
    scalar_t* __restrict__ out, int64_t row, int hvec, int j0, const acc_t (&acc)[NV][V]) {
  Vec<scalar_t, V>* orow = reinterpret_cast<Vec<scalar_t, V>*>(out) + row * hvec;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int j = j0 + 32 * k;
    if (j < hvec) {
      Vec<scalar_t, V> o;
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = static_cast<scalar_t>(acc[k][e]);
      orow[j] = o;
    }
  }
}

// Round-to-nearest fused multiply-add in the accumulation type. Every kernel
// uses exactly this for its sums so that different code paths that visit the
// same rows in the same order produce bit-identical results.
__device__ __forceinline__ float fma_acc(float a, float b, float c) {
  return __fmaf_rn(a, b, c);
}
__device__ __forceinline__ double fma_acc(double a, double b, double c) {
  return __fma_rn(a, b, c);
}

// token_idx may be int32 or int64; a run-time flag (uniform across the grid)
// instead of a template parameter halves the number of instantiations, and
// indices are read once per row, so the branch costs nothing measurable.
__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? static_cast<int64_t>(__ldg(static_cast<const long long*>(p) + i))
              : static_cast<int64_t>(__ldg(static_cast<const int*>(p) + i));
}

// gates are either scalar_t or float32 (scatter_combine_checks.h); same run-time-flag idea.
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ acc_t load_gate(const void* p, int64_t i, bool f32) {
  return f32 ? static_cast<acc_t>(static_cast<const float*>(p)[i])
             : static_cast<acc_t>(static_cast<const scalar_t*>(p)[i]);
}

// Warp-wide inclusive prefix sum of an int.
__device__ __forceinline__ int warp_inclusive_scan(int x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// ---- cp.async (sm_80+): global -> shared copies that bypass registers, so a
// thread can have many tile loads in flight without spending registers.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;  // 0 source bytes -> the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__host__ __device__ inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Device attribute A of device `dev`, queried once per device (an attribute query is legal
// while a stream captures; a concurrent first call at worst queries twice).
template <cudaDeviceAttr A>
int device_attribute(int dev) {
  static std::atomic<int> cached[C10_COMPILE_TIME_MAX_GPUS] = {};
  int v = cached[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, A, dev));
    cached[dev].store(v + 1, std::memory_order_relaxed);  // stored + 1: 0 means not queried yet
    return v;
  }
  return v - 1;
}

} // namespace cuda
} // namespace opreg
