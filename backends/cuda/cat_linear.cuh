// What the cat_linear translation units share (the map of the parts and the
// design notes are at the top of cat_linear.cu): the part descriptors, the
// SIMT block tile (the host bounds M with it), the dot path's warp tile, and
// launch_simt_kernel / launch_dot_kernel, defined and explicitly instantiated in
// cat_linear_simt.cu / cat_linear_dot.cu.
//
// Light on includes on purpose, like cuda_common.cuh: cat_linear_simt.cu
// includes only this, ATen/OpMathType.h and c10/cuda/CUDAException.h, never the
// ATen operator or dispatcher headers, which cost most of a TU's compile time.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_common.cuh"

namespace opreg {
namespace cl_detail {

using cuda::Vec;
using cuda::vec16;

constexpr int kMaxParts = 64;
constexpr int kFewParts = 8;

// Passed by value as a __grid_constant__ parameter: indexing it with a
// block-uniform part number reads the constant bank, no copy to local memory.
// Two sizes, so that the common few-part call launches with 192 bytes of
// parameters instead of 1.5 KB.
template <int MAXR>
struct PartArgs {
  const void* ptr[MAXR];
  int64_t row_stride[MAXR];  // elements between consecutive rows (leading dims flattened)
  int width[MAXR];           // H_i
  int kstart[MAXR];          // column of weight where part i starts
};

// SIMT block tile and k chunk (the rest of the kernel's constants: cat_linear_simt.cu;
// the host's cost model counts chunks with kVPR).
constexpr int kTM = 16;       // output rows per block
constexpr int kTN = 32;       // output columns per block
constexpr int kVPR = 16;      // 16-byte vectors per tile row per k chunk: TK = 16 * V columns

// The dot path's geometry (cat_linear_dot.cu; the host's cost model counts with it):
constexpr int kDotCols = 4;     // outputs of one row per warp
constexpr int kDotUnroll = 2;   // k steps (32 vectors each) whose loads are issued together
constexpr int kDotThreads = 128;

// The SIMT path's launch: the first R parts of `all` copied into a
// PartArgs<MAXR>, (M, N) output out = parts x w^T (+ bias), w's rows ldw
// elements apart; on `stream`, checked. The host picks VEC and MAXR.
template <typename scalar_t, bool VEC, int MAXR>
void launch_simt_kernel(const PartArgs<kMaxParts>& all, int R, const scalar_t* w, int64_t ldw,
                        const scalar_t* bias, scalar_t* out, int64_t M, int64_t N,
                        c10::DeviceIndex dev, cudaStream_t stream);

// The dot path's launch, the same arguments (VEC false: one element per load).
template <typename scalar_t, bool VEC, int MAXR>
void launch_dot_kernel(const PartArgs<kMaxParts>& all, int R, const scalar_t* w, int64_t ldw,
                       const scalar_t* bias, scalar_t* out, int64_t M, int64_t N,
                       c10::DeviceIndex dev, cudaStream_t stream);

// Every (scalar_t, VEC, MAXR) run_simt (cat_linear.cu) dispatches to: the four
// floating types (AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16)), each as
// (true, kFewParts), (true, kMaxParts) and (false, kMaxParts).
// (decltype(f<...>) is f's function type: the parameter list is not repeated.)
#define OPREG_CL_INSTANTIATE_T(FN, T) \
  template decltype(FN<T, true, kFewParts>) FN<T, true, kFewParts>; \
  template decltype(FN<T, true, kMaxParts>) FN<T, true, kMaxParts>; \
  template decltype(FN<T, false, kMaxParts>) FN<T, false, kMaxParts>;
#define OPREG_CL_INSTANTIATE(FN) OPREG_FOR_FLOAT_TYPES(OPREG_CL_INSTANTIATE_T, FN)

} // namespace cl_detail
} // namespace opreg
