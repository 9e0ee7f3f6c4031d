// CUDA kernels for opreg::scatter_combine and opreg::scatter_combine_backward:
// the design, where each part lives (below), the host side and the registration.
//
// Forward is a gather, not a scatter: every output row is produced by exactly one
// lane group that sums that token's rows in increasing row order with fp32 (fp64
// for double) fused multiply-adds from 0. No float atomics, no separate zero fill,
// and every path visits rows in the same order with the same FMA chain, so results
// are bitwise reproducible for any row order and any path. The backward computes
// each row's gradients with one routine and a fixed reduction tree in both of its
// paths, so it is reproducible too.
//
// The work is token blocks (scatter_combine_tokens.cuh): a block owns consecutive
// tokens, lists their rows in shared memory, sorts them, then lane groups (1 to 32
// lanes, by row length) sum each token's rows, 16-byte vectors streamed through a
// per-lane cp.async ring in shared memory (192 bytes in flight per lane, whatever the
// rows per token). The rows come from a scan of token_idx by the block's thread block
// cluster (ONE launch: what the sweep's shapes take) or, for very many rows, from a
// global map built by four small kernels first (scatter_combine_map.cu). The backward
// runs the same blocks (each token's grad_out row read once) or, where grad_out's
// re-reads cost less than the scan, one row per lane group. Which path, and the
// geometry, come from the model in scatter_combine_model.cuh; the env override
// OPREG_SCATTER_COMBINE_PATH=scan|map|rows forces one (benchmarks, tests).
//
// Why (the 2026-12-01 H200 sweep, 190 of the 440 shapes moving >= 16 MB below 70 %
// of the copy rate): the former forward had a small path (one launch, every block
// rescanning all of token_idx for 8 tokens, then 2 vectors per lane: 16 bytes in
// flight per row per lane at 16-bit types, ~3 dependent round trips before the first
// data load, 11-25 us at 16-25 MB) and a large path of 6 launches (memset, count,
// tile sums, scan, place, reduce: a ~15-25 us floor at 16-100 MB) whose persistent
// reduce warps took one (token, 512-column) item at a time with 32-64 bytes in flight
// per lane and lanes idle at short rows (H128 bf16: 16 of 32 lanes, 19 % of copy at
// T65536 k2). The backward read grad_out once per row (75 % at k8 random over L2).
//
// Indices outside [0, num_tokens) are ignored (their rows contribute nothing;
// backward gives them zero gradients). With OPREG_CHECK_INDICES=1 in the
// environment at call time, indices are validated first (this synchronizes)
// and an IndexError names token_idx.
//
// Where the parts live (one translation unit each, so that ninja compiles them in
// parallel; the kernel files include no ATen operator or dispatcher header, 5-8 s
// of compile time each):
//  * scatter_combine.cu (this file): the host side of both ops (checks, allocation,
//    the map's workspace, dtype dispatch) and the TORCH_LIBRARY_IMPL registration.
//  * scatter_combine.cuh: what the host shares with the kernel files (TokParams,
//    TokPlan, the plan and launch functions, the list of instantiations).
//  * scatter_combine_model.cuh: the path model and the token blocks' geometry.
//  * scatter_combine_tokens.cuh: the token-block kernel (both directions).
//  * scatter_combine_forward.cu / scatter_combine_backward.cu: the plans and the
//    launches (and the backward's row-parallel kernel).
//  * scatter_combine_map.cu: the global map's kernels.
//
// Host code only: nvcc's device pass (__CUDA_ARCH__ defined) skips this whole
// file, which would otherwise parse the ATen and dispatcher headers once more
// for nothing (~8 s). A __global__ or __device__ function put here would get
// no device code: kernels go in the files above.
#if !defined(__CUDA_ARCH__)
#include <ATen/core/Tensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/aminmax.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <unistd.h>

#include <climits>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>

#include "scatter_combine_checks.h"
#include "scatter_combine.cuh"

extern char** environ;  // POSIX: the process environment (unistd.h declares it under _GNU_SOURCE)

namespace opreg {
namespace {

using namespace sc_detail;

// ---------------------------------------------------------------------------
// Host side.

// OPREG_CHECK_INDICES and OPREG_SCATTER_COMBINE_PATH, read per call (a test or
// opreg.check_indices may set them at any time) in one walk over the environment.
struct EnvFlags {
  bool check_indices = false;
  PathOverride path = PathOverride::kAuto;
};

EnvFlags read_env() {
  EnvFlags f;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* v = *e;
    if (std::strncmp(v, "OPREG_", 6) != 0) continue;
    v += 6;
    if (std::strncmp(v, "CHECK_INDICES=", 14) == 0) {
      f.check_indices = std::strcmp(v + 14, "1") == 0;
    } else if (std::strncmp(v, "SCATTER_COMBINE_PATH=", 21) == 0) {
      v += 21;
      f.path = std::strcmp(v, "scan") == 0 ? PathOverride::kScan
             : std::strcmp(v, "map") == 0  ? PathOverride::kMap
             : std::strcmp(v, "rows") == 0 ? PathOverride::kRows
                                           : PathOverride::kAuto;
    }
  }
  return f;
}

// Debug mode only: synchronizes (two scalar reads).
void validate_indices(const char* op, const at::Tensor& idx, int64_t num_tokens) {
  if (idx.numel() == 0) return;
  const auto mm = at::aminmax(idx);
  const int64_t lo = std::get<0>(mm).item<int64_t>();
  const int64_t hi = std::get<1>(mm).item<int64_t>();
  // Integers are formatted with std::to_string: streaming an int64_t into the
  // message (c10::str) from this nvcc-compiled TU segfaulted on the H200 box
  // (torch 2.11), inside std::ostream::_M_insert<long>.
  if (!(lo >= 0 && hi < num_tokens)) {
    const std::string msg = std::string(op) + ": token_idx has values outside [0, num_tokens=" +
        std::to_string(num_tokens) + "): min " + std::to_string(lo) + ", max " +
        std::to_string(hi) + " (checked because OPREG_CHECK_INDICES=1)";
    TORCH_CHECK_INDEX(false, msg);
  }
}

const DeviceFacts& device_facts(c10::DeviceIndex dev) {
  static DeviceFacts facts[C10_COMPILE_TIME_MAX_GPUS];
  static std::once_flag once[C10_COMPILE_TIME_MAX_GPUS];
  std::call_once(once[dev], [dev] {
    DeviceFacts f;
    int l2 = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    f.l2_bytes = l2;
    facts[dev] = f;
  });
  return facts[dev];
}

// Outputs straight from the CUDA allocator: at::empty's trip through the dispatcher
// is host time a call at 16-25 MB (4-6 us of data) cannot spare.
at::Tensor empty_on(const at::Tensor& like, at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cuda(sizes, dtype, like.device(), std::nullopt));
}

template <typename scalar_t>
bool can_vec16(std::initializer_list<const void*> ptrs, int64_t h) {
  if (h % cuda::vec16<scalar_t>() != 0) return false;
  for (const void* p : ptrs)
    if (!cuda::aligned16(p)) return false;
  return true;
}

template <typename scalar_t, int V>
void run_forward(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& g, at::Tensor& out,
                 int64_t num_tokens, PathOverride force, const DeviceFacts& facts, cudaStream_t stream) {
  const int n = static_cast<int>(x.size(0));
  const bool idx64 = idx.scalar_type() == at::kLong;
  TokPlan plan = plan_forward<scalar_t, V>(n, num_tokens, static_cast<int>(x.size(1) / V), idx64, force,
                                           facts, x.get_device());
  TokParams& p = plan.p;
  p.x = x.const_data_ptr();
  p.idx = idx.const_data_ptr();
  p.gates = g.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.g32 = g.scalar_type() == at::kFloat;
  p.idx_vec = cuda::aligned16(p.idx);
  at::Tensor ws;
  if (plan.map) {
    const int64_t ntiles = (num_tokens + kScanTile - 1) / kScanTile;
    // One int32 workspace from the caching allocator:
    // flag | counts[T] | ell[T][8] | ooff[T] | slot[N] | operm[N] | tile_sums.
    ws = empty_on(x, {1 + num_tokens * (2 + kEll) + 2 * int64_t(n) + ntiles}, at::kInt);
    int* flag = ws.mutable_data_ptr<int>();
    int* counts = flag + 1;
    int* ell = counts + num_tokens;
    int* ooff = ell + num_tokens * kEll;
    int* slot = ooff + num_tokens;
    int* operm = slot + n;
    int* tile_sums = operm + n;
    launch_map(p.idx, idx64, n, num_tokens, ntiles, flag, counts, ell, ooff, slot, operm, tile_sums, stream);
    p.counts = counts;
    p.ell = ell;
    p.ooff = ooff;
    p.operm = operm;
  }
  launch_forward<scalar_t, V>(plan, stream);
}

at::Tensor scatter_combine_cuda(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    int64_t num_tokens) {
  check_scatter_combine(expert_hidden, token_idx, gates, num_tokens);
  const c10::cuda::CUDAGuard guard(expert_hidden.device());
  const c10::MaybeOwned<at::Tensor> x = expert_hidden.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> idx = token_idx.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> g = gates.expect_contiguous();
  const int64_t n = x->size(0), h = x->size(1);
  TORCH_CHECK(n < INT_MAX && h < INT_MAX, "scatter_combine: CUDA kernel supports N, H < 2^31");
  const EnvFlags env = read_env();
  if (env.check_indices) validate_indices("scatter_combine", *idx, num_tokens);

  at::Tensor out = empty_on(*x, {num_tokens, h}, x->scalar_type());
  if (num_tokens == 0 || h == 0) return out;
  const DeviceFacts& facts = device_facts(x->get_device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x->get_device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x->scalar_type(), "scatter_combine_cuda", [&] {
    if (can_vec16<scalar_t>({x->const_data_ptr(), out.const_data_ptr()}, h)) {
      run_forward<scalar_t, cuda::vec16<scalar_t>()>(*x, *idx, *g, out, num_tokens, env.path, facts, stream);
    } else {
      run_forward<scalar_t, 1>(*x, *idx, *g, out, num_tokens, env.path, facts, stream);
    }
  });
  return out;
}

template <typename scalar_t, int V>
void run_backward(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& idx, const at::Tensor& g,
                  at::Tensor& gx, at::Tensor& gg, PathOverride force, const DeviceFacts& facts,
                  cudaStream_t stream) {
  const bool idx64 = idx.scalar_type() == at::kLong;
  TokPlan plan = plan_backward<scalar_t, V>(static_cast<int>(x.size(0)), gy.size(0),
                                            static_cast<int>(x.size(1) / V), idx64, force, facts,
                                            x.get_device());
  TokParams& p = plan.p;
  p.gy = gy.const_data_ptr();
  p.x = x.const_data_ptr();
  p.idx = idx.const_data_ptr();
  p.gates = g.const_data_ptr();
  p.out = gx.mutable_data_ptr();
  p.gg = gg.mutable_data_ptr();
  p.g32 = g.scalar_type() == at::kFloat;
  p.idx_vec = cuda::aligned16(p.idx);
  launch_backward<scalar_t, V>(plan, stream);
}

std::tuple<at::Tensor, at::Tensor> scatter_combine_backward_cuda(
    const at::Tensor& grad_out,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  check_scatter_combine_backward(grad_out, expert_hidden, token_idx, gates);
  const c10::cuda::CUDAGuard guard(expert_hidden.device());
  const c10::MaybeOwned<at::Tensor> gy = grad_out.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> x = expert_hidden.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> idx = token_idx.expect_contiguous();
  const c10::MaybeOwned<at::Tensor> g = gates.expect_contiguous();
  const int64_t n = x->size(0), h = x->size(1);
  TORCH_CHECK(n < INT_MAX && h < INT_MAX,
              "scatter_combine_backward: CUDA kernel supports N, H < 2^31");
  const EnvFlags env = read_env();
  if (env.check_indices) validate_indices("scatter_combine_backward", *idx, gy->size(0));

  at::Tensor gx = empty_on(*x, {n, h}, x->scalar_type());
  at::Tensor gg = empty_on(*x, {n}, g->scalar_type());
  if (n == 0) return {gx, gg};
  const DeviceFacts& facts = device_facts(x->get_device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x->get_device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x->scalar_type(), "scatter_combine_backward_cuda", [&] {
    if (can_vec16<scalar_t>({gy->const_data_ptr(), x->const_data_ptr(), gx.const_data_ptr()}, h)) {
      run_backward<scalar_t, cuda::vec16<scalar_t>()>(*gy, *x, *idx, *g, gx, gg, env.path, facts, stream);
    } else {
      run_backward<scalar_t, 1>(*gy, *x, *idx, *g, gx, gg, env.path, facts, stream);
    }
  });
  return {gx, gg};
}

} // namespace
} // namespace opreg

// Schemas are defined from Python (torch.library.define) before this library
// is loaded; num_tokens is a SymInt there, a backend kernel sees it concrete.
TORCH_LIBRARY_IMPL(opreg, CUDA, m) {
  m.impl("scatter_combine", &opreg::scatter_combine_cuda);
  m.impl("scatter_combine_backward", &opreg::scatter_combine_backward_cuda);
}

#endif  // !defined(__CUDA_ARCH__)
