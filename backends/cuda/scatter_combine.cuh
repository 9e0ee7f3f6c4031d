// What the scatter_combine translation units share (the map of the parts and
// the design notes are at the top of scatter_combine.cu): the constants the
// host uses to pick a path and size the workspace, the one device helper both
// forward paths use, and the launch functions, defined (and explicitly
// instantiated for OPREG_SC_INSTANTIATE's list) in the kernels' own files.
//
// Light on includes on purpose, like cuda_common.cuh: the kernel files include
// only this, ATen/OpMathType.h and c10/cuda/CUDAException.h, never the ATen
// operator or dispatcher headers, which cost most of a TU's compile time.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "scatter_combine_paths.h"

namespace opreg {
namespace sc_detail {

using cuda::Vec;
using cuda::fma_acc;
using cuda::load_gate;
using cuda::load_index;

constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------
// Small path: one launch (kernel in scatter_combine_small.cu). The host's choice between the
// paths, and the bounds it uses, are in backends/common/scatter_combine_paths.h.
namespace paths = scatter_combine_paths;
constexpr int kSmallTok = static_cast<int>(paths::kSmallTok);  // tokens (= warps) per block
constexpr int kSmallThreads = kSmallTok * 32;
// Column vectors per lane per block (2 for 16-bit types: 204 -> ~110 registers).
template <int V>
constexpr int small_nv() {
  return static_cast<int>(paths::small_nv(V));
}
constexpr int kSmallMaxRows = static_cast<int>(paths::kSmallMaxRows);  // list entry (row << 3 | token) fits 16 bits
constexpr int kSmallU = 4;                   // rows whose loads are in flight together
constexpr int kSmallPer = 32;                // rows per thread in the index scan (a 32-bit mask)
static_assert(kSmallTok == 8, "list entries pack the local token in 3 bits");

// ---------------------------------------------------------------------------
// Tiny path: one launch, a warp per token (kernel in scatter_combine_tiny.cu).
constexpr int kTinyWarps = static_cast<int>(paths::kTinyWarps);  // tokens (= warps) per block
constexpr int kTinyLoads = 8;   // 16-byte index loads per lane in flight: 1024 int32 rows a batch

// ---------------------------------------------------------------------------
// Large path (kernels and their design notes in scatter_combine_large.cu):
// what the host needs to size the workspace.
constexpr int kEll = 8;
constexpr int kScanThreads = 1024;
constexpr int kScanPerThread = 16;
constexpr int kScanTile = kScanThreads * kScanPerThread;  // tokens per scan block

// acc[k][:] += gate(r) * x[r, j0 + js k] for r = row_at(u), u in [0, nvalid)
// (nvalid <= U), in order. Every load of those rows is issued before the first
// FMA, so up to U rows are in flight together. Used by both paths (small: rows
// from a ballot, warp-uniform; large: rows from a token's list, per thread in
// LaneReduce, whose js is its threads a token); the one FMA chain of every
// reducer, so the same bits.
template <typename scalar_t, int V, int NV, int U, typename acc_t, typename RowFn>
__device__ __forceinline__ void accumulate_rows(
    RowFn row_at, int nvalid, const Vec<scalar_t, V>* __restrict__ x, const void* gates,
    bool g32, int hvec, int j0, acc_t (&acc)[NV][V], int js = 32) {
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
        const int j = j0 + js * k;
        if (j < hvec) xv[u][k] = xr[j];
      }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (u < nvalid) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (j0 + js * k < hvec) {
#pragma unroll
          for (int e = 0; e < V; ++e)
            acc[k][e] = fma_acc(g[u], static_cast<acc_t>(xv[u][k].v[e]), acc[k][e]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Launch functions: raw pointers and sizes only (the host side, scatter_combine.cu,
// unpacks the tensors), on `stream`, each launch checked.

// Small path: grid gx_small x gy_small, computed by the host to pick the path.
template <typename scalar_t, int V>
void launch_small(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                  scalar_t* op, int n, int64_t num_tokens, int hvec, int64_t gx_small,
                  int64_t gy_small, cudaStream_t stream);

// Tiny path: grid ceil(T / kTinyWarps) x gy; token_idx 16-byte aligned.
template <typename scalar_t, int V>
void launch_tiny(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                 scalar_t* op, int n, int64_t num_tokens, int hvec, int64_t gy, cudaStream_t stream);

// The large path's forms (scatter_combine_large.cu says which runs when):
// kAuto lets the sizes and the device pick; the others force one where it can
// run (OPREG_SCATTER_COMBINE_LARGE, read per call by the host).
enum class LargeForm { kAuto, kMulti, kFused, kLocal };

// The global workspace of the fused and multi-kernel forms (the local form
// keeps its lists in shared memory and needs none): flag | counts[T] |
// ell[T][kEll] | ooff[T] | slot[N] | operm[N] | tile_sums[ntiles].
struct LargeWorkspace {
  int64_t ntiles;
  int* flag;
  int* counts;
  int* ell;
  int* ooff;
  int* slot;
  int* operm;
  int* tile_sums;
};

// How launch_large gets that workspace, only when a form needs it: carve(ctx)
// allocates it (the host's allocator, stream-ordered) and keeps it alive in ctx.
struct WorkspaceSource {
  LargeWorkspace (*carve)(void* ctx);
  void* ctx;
};

// Large path: the local kernel, one cooperative launch (fused) or the
// multi-kernel fallback (memset, count, scan, place, reduce).
template <typename scalar_t, int V>
void launch_large(const scalar_t* xp, const void* idx, bool idx64, const void* gates, bool g32,
                  scalar_t* op, int n, int64_t num_tokens, int hvec, WorkspaceSource ws,
                  LargeForm form, c10::DeviceIndex dev, cudaStream_t stream);

// Backward (scatter_combine_backward.cu): gx = g * gy[idx], gg = <gy[idx], x>.
template <typename scalar_t, int V>
void launch_scatter_backward(const scalar_t* gy, const scalar_t* x, const void* idx, bool idx64,
                             const void* gates, bool g32, scalar_t* gx, void* gg, int n,
                             int64_t num_tokens, int hvec, cudaStream_t stream);

// Every (scalar_t, V) the host dispatches to: the four floating types
// (AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16)), each with V = 1 and
// V = cuda::vec16<scalar_t>(). Each kernel file instantiates its launch
// function with OPREG_SC_INSTANTIATE(name) at namespace sc_detail scope, so
// the list is written once. (decltype(f<T, V>) is f's function type: the
// parameter lists are not repeated.)
#define OPREG_SC_INSTANTIATE_T(FN, T) \
  template decltype(FN<T, 1>) FN<T, 1>; \
  template decltype(FN<T, cuda::vec16<T>()>) FN<T, cuda::vec16<T>()>;
#define OPREG_SC_INSTANTIATE(FN) OPREG_FOR_FLOAT_TYPES(OPREG_SC_INSTANTIATE_T, FN)

} // namespace sc_detail
} // namespace opreg
