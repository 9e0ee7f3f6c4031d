// What the scatter_combine translation units share (the map of the parts and
// the design notes are at the top of scatter_combine.cu): the kernels'
// parameter block, the plans the host gets from the kernel files, the launch
// functions (defined, and explicitly instantiated for OPREG_SC_INSTANTIATE's
// list, in the kernels' own files) and the global map's workspace layout.
//
// Light on includes on purpose, like cuda_common.cuh: the kernel files include
// only this, ATen/OpMathType.h and c10/cuda/CUDAException.h, never the ATen
// operator or dispatcher headers, which cost most of a TU's compile time.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_common.cuh"

namespace opreg {
namespace sc_detail {

using cuda::Vec;
using cuda::fma_acc;
using cuda::load_gate;
using cuda::load_index;

constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------
// The token-block kernel (scatter_combine_tokens.cuh; forward and grouped
// backward): every block owns `tb` consecutive tokens per round, lists their
// rows in shared memory and then works token by token.
constexpr int kTokThreads = 512;   // 16 warps, one block per SM (see kTokSmemTarget)
constexpr int kTokMaxTb = 1024;    // tokens per block and round (local ids are 16-bit)

// Global map (scatter_combine_map.cu), the forward's path for very many rows:
// the first kEll rows of each token in ell[t][0..8), the rest in an overflow CSR.
constexpr int kEll = 8;
constexpr int kScanThreads = 1024;
constexpr int kScanPerThread = 16;
constexpr int kScanTile = kScanThreads * kScanPerThread;  // tokens per scan block

// Everything a token-block kernel reads: raw pointers and sizes only (the host
// side, scatter_combine.cu, unpacks the tensors; the plan fills the geometry).
struct TokParams {
  const void* x;      // expert_hidden (n, H)
  const void* gy;     // backward: grad_out (T, H)
  const void* idx;    // token_idx (n,), int32 or int64
  const void* gates;  // (n,), scalar_t or float32
  void* out;          // forward: (T, H); backward: grad_expert_hidden (n, H)
  void* gg;           // backward: grad_gates (n,), the gates' dtype
  // The global map (map mode only): counts[t], ell[t][kEll], ooff[t], operm[].
  const int* counts;
  const int* ell;
  const int* ooff;
  const int* operm;
  int64_t num_tokens;
  int n;
  int hvec;           // H / V vectors per row
  int tb;             // tokens per block and round (<= kTokMaxTb)
  int lcap;           // row entries a block's shared memory holds per round
  int g_log2;         // lanes per token group: G = 1 << g_log2 (1..32)
  int nve;            // forward: vectors per lane per item (G * nve per chunk)
  int chunks;         // forward: column chunks per token, ceil(hvec / (G * nve))
  int cs;             // blocks per thread block cluster (1: no cluster)
  int ring;           // 16-byte cp.async ring slots per lane
  int pf_tok;         // forward, scan mode: prefetch into L2 the rows of local tokens < pf_tok
  unsigned row_bytes; // H * sizeof(scalar_t) (the prefetch's size)
  bool idx64;
  bool g32;           // gates are float32
  bool idx_vec;       // token_idx is 16-byte aligned: the scan reads it 16 bytes at a time
  bool map;           // rows come from the global map, not from scanning token_idx
};

// The device facts a plan needs, read once per device (scatter_combine.cu).
struct DeviceFacts {
  int sms = 0;
  int cc_major = 0;
  int64_t l2_bytes = 0;
  int smem_optin = 0;  // largest dynamic shared memory a block may opt into
};

// How one call runs: chosen by the plan functions below from sizes alone
// (never from data), with the model in scatter_combine_model.cuh.
struct TokPlan {
  bool rows = false;  // backward: the row-parallel kernel instead of token blocks
  bool map = false;   // forward: build the global map first (scatter_combine_map.cu)
  int grid = 0;       // blocks (a multiple of cs)
  size_t smem = 0;    // dynamic shared memory per block
  TokParams p{};      // geometry filled in (pointers are the caller's)
};

// Path override for benchmarks and tests: OPREG_SCATTER_COMBINE_PATH=scan|map|rows
// (forward: scan or map; backward: scan = token blocks, rows = row-parallel).
enum class PathOverride { kAuto, kScan, kMap, kRows };

// Forward plan and launch (scatter_combine_forward.cu). plan_forward fills p's
// geometry; the caller fills the pointers (and, for a map plan, runs launch_map
// on a workspace first) and calls launch_forward.
template <typename scalar_t, int V>
TokPlan plan_forward(int n, int64_t num_tokens, int hvec, bool idx64, PathOverride force,
                     const DeviceFacts& dev, c10::DeviceIndex device);
template <typename scalar_t, int V>
void launch_forward(const TokPlan& plan, cudaStream_t stream);

// Backward plan and launch (scatter_combine_backward.cu): token blocks (grouped
// by token: grad_out's rows are read once) or one row per lane group.
template <typename scalar_t, int V>
TokPlan plan_backward(int n, int64_t num_tokens, int hvec, bool idx64, PathOverride force,
                      const DeviceFacts& dev, c10::DeviceIndex device);
template <typename scalar_t, int V>
void launch_backward(const TokPlan& plan, cudaStream_t stream);

// The global map (scatter_combine_map.cu): memset -> count -> overflow scan +
// place, on the workspace the host carved (flag | counts | ell | ooff | slot |
// operm | tile_sums), no host sync.
void launch_map(const void* idx, bool idx64, int n, int64_t num_tokens, int64_t ntiles, int* flag,
                int* counts, int* ell, int* ooff, int* slot, int* operm, int* tile_sums,
                cudaStream_t stream);

// Every (scalar_t, V) the host dispatches to: the four floating types
// (AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16)), each with V = 1 and
// V = cuda::vec16<scalar_t>(). Each kernel file instantiates its functions
// with OPREG_SC_INSTANTIATE(name) at namespace sc_detail scope, so the list
// is written once. (decltype(f<T, V>) is f's function type: the parameter
// lists are not repeated.)
#define OPREG_SC_INSTANTIATE_T(FN, T) \
  template decltype(FN<T, 1>) FN<T, 1>; \
  template decltype(FN<T, cuda::vec16<T>()>) FN<T, cuda::vec16<T>()>;
#define OPREG_SC_INSTANTIATE(FN) OPREG_FOR_FLOAT_TYPES(OPREG_SC_INSTANTIATE_T, FN)

} // namespace sc_detail
} // namespace opreg
