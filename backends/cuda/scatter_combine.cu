// CUDA kernels for opreg::scatter_combine and opreg::scatter_combine_backward:
// the design, where each part lives (below), the host side and the registration.
//
// Forward is a gather, not a scatter: every output row is produced by exactly
// one warp/block that sums that token's rows in increasing row order with
// fp32 (fp64 for double) fused multiply-adds. No float atomics, no separate
// zero fill, and every path visits rows in the same order with the same FMA
// chain, so results are bitwise reproducible for any row order and any path.
//
// Three paths, chosen on the host from sizes alone (never from data):
//  * tiny (N x T x column chunks <= kTinyMaxWork, T x column chunks <= kTinyMaxWarps,
//    token_idx 16-byte aligned): ONE launch, no shared memory, no barrier: a warp per token
//    reads all of token_idx in 16-byte loads and ballots out its rows in row order
//    (scatter_combine_tiny.cu). The bounds and the choice: backends/common/scatter_combine_paths.h.
//  * small (N <= 8192, little total index-scan work, and fewer than 4 tokens an SM or
//    token_idx past the large path's local form): ONE launch. Each
//    block owns 8 tokens, reads all of token_idx itself (redundant across
//    blocks, served by L2) and compacts the rows of its tokens in row order (a block-wide scan of per-thread counts
//    over contiguous row ranges keeps the order stable), then one warp per
//    token gathers and sums. (The seeds' 1536 x 2 x 128 runs the local form.)
//  * large: zero counts -> count (integer atomicAdd; its return value is
//    the row's slot within its token; slots < 8 are written straight into a
//    fixed-width table ell[t][8]) -> overflow offsets + place (only rows
//    beyond a token's 8th, only when some token has them: a device-side
//    flag) -> reduce (a short-row reducer, several tokens per warp, for rows
//    of <= 1 KB in 16-byte vectors; a wide-row one, a warp per token and
//    column chunk, otherwise). Slots from integer atomics are in arbitrary
//    order, so each reducer sorts its token's rows by row index (in
//    registers for <= 8 rows, in shared memory up to 1024) before summing;
//    tokens with > 1024 rows (degenerate routing) instead rescan token_idx in
//    row order: slower, equally deterministic.
//    Where token_idx is short (<= 64 KB, >= 4 tokens an SM) it runs as ONE
//    launch of the local kernel: each block (one an SM) reads all of
//    token_idx and builds the lists of its own run of tokens in shared
//    memory, then sums them: no workspace, no grid barrier. Elsewhere as ONE
//    cooperative launch (grid.sync() between the phases, the grid = every
//    co-resident block, capped by the work) wherever the device supports
//    cooperative launch and one block fits an SM: the 5-6 launches of the multi-kernel form cost several us of host
//    time each on the H200 box, which made calls host-bound (20-35 us where
//    the bytes need 5-10, e.g. T16384 k8 H128 bf16 at 23-26 % of copy
//    bandwidth). The multi-kernel form (memset, count, tile sums + scan,
//    place, reduce) is the fallback elsewhere. OPREG_SCATTER_COMBINE_LARGE=
//    multi|fused|local forces a form where it can run (read per call; the
//    tests compare the three bit for bit). All run the same reducer code.
//  No host sync anywhere, so CUDA-graph capture works (cooperative kernels
//  are capturable: CUDA 12+ has cooperative kernel graph nodes; the tests
//  capture and replay each large form).
//
// Indices outside [0, num_tokens) are ignored (their rows contribute nothing;
// backward gives them zero gradients). With OPREG_CHECK_INDICES=1 in the
// environment at call time, indices are validated first (this synchronizes)
// and an IndexError names token_idx.
//
// Where the parts live (one translation unit each, so that ninja compiles
// them in parallel). Measured with nvcc 13.0 (sm_90), one file at a time on a
// 2-core box: the former single file took 30.2 s, ~90 % of it for its
// #includes alone, so the kernel files include no ATen operator or dispatcher
// header (5-8 s each), and this host-only file takes 17.4 s (25.1 s without
// the __CUDA_ARCH__ guard below).
//  * scatter_combine.cu (this file): the host side of both ops (checks, path
//    choice, workspace, dtype dispatch) and the TORCH_LIBRARY_IMPL registration.
//  * scatter_combine.cuh: what the host shares with the kernels (path and
//    workspace constants, the launch functions' declarations, the list of
//    (dtype, vector width) instantiations) and accumulate_rows, the device
//    helper of both forward paths.
//  * scatter_combine_tiny.cu: the tiny-path kernel and launch_tiny.
//  * scatter_combine_small.cu: the small-path kernel and launch_small.
//  * scatter_combine_large.cu: the large path's phases (count / scan / place /
//    reduce), its fused cooperative kernel and multi-kernel fallback, and
//    launch_large (which of the two runs).
//  * scatter_combine_backward.cu: the backward kernel and launch_scatter_backward.
//
// Host code only: nvcc's device pass (__CUDA_ARCH__ defined) skips this whole
// file, which would otherwise parse the ATen and dispatcher headers once more
// for nothing (~8 s). A __global__ or __device__ function put here would get
// no device code: kernels go in the files above.
#if !defined(__CUDA_ARCH__)
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "scatter_combine_checks.h"
#include "scatter_combine.cuh"

namespace opreg {
namespace {

using namespace sc_detail;

// ---------------------------------------------------------------------------
// Host side.

bool check_indices_requested() {
  const char* e = std::getenv("OPREG_CHECK_INDICES");
  return e != nullptr && e[0] == '1' && e[1] == '\0';
}

// Test/benchmark override: OPREG_SCATTER_COMBINE_LARGE=multi|fused|local forces
// the large path's form where it can run (the tests compare the three's bits);
// unset or empty, launch_large picks. Read per call, like OPREG_CAT_LINEAR_PATH;
// any other value is an error.
LargeForm forced_large_form() {
  const char* e = std::getenv("OPREG_SCATTER_COMBINE_LARGE");
  if (e == nullptr || e[0] == '\0') return LargeForm::kAuto;
  if (std::strcmp(e, "multi") == 0) return LargeForm::kMulti;
  if (std::strcmp(e, "fused") == 0) return LargeForm::kFused;
  if (std::strcmp(e, "local") == 0) return LargeForm::kLocal;
  TORCH_CHECK_VALUE(false, "OPREG_SCATTER_COMBINE_LARGE must be multi, fused or local, got '", e, "'");
}

// Benchmark/test override: OPREG_SCATTER_COMBINE_PATH=tiny|small|large forces the forward's
// path where it can take the call (tiny: token_idx 16-byte aligned; small: N <= 8192); unset
// or empty, the sizes decide. Read per call; any other value is an error.
paths::Path forced_forward_path() {
  const char* e = std::getenv("OPREG_SCATTER_COMBINE_PATH");
  if (e == nullptr || e[0] == '\0') return paths::Path::kAuto;
  if (std::strcmp(e, "tiny") == 0) return paths::Path::kTiny;
  if (std::strcmp(e, "small") == 0) return paths::Path::kSmall;
  if (std::strcmp(e, "large") == 0) return paths::Path::kLarge;
  TORCH_CHECK_VALUE(false, "OPREG_SCATTER_COMBINE_PATH must be tiny, small or large, got '", e, "'");
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

template <typename scalar_t, int V>
void launch_forward(
    const at::Tensor& x, const at::Tensor& idx, const at::Tensor& g, at::Tensor& out,
    int64_t num_tokens) {
  const int n = static_cast<int>(x.size(0));
  const int hvec = static_cast<int>(x.size(1) / V);
  const bool idx64 = idx.scalar_type() == at::kLong;
  const bool g32 = g.scalar_type() == at::kFloat;
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  const int64_t gx_small = (num_tokens + kSmallTok - 1) / kSmallTok;
  const int64_t gy_small = paths::column_chunks(hvec, V);
  const bool tiny_ok = cuda::aligned16(idx.const_data_ptr()) && gy_small <= 65535 &&
                       num_tokens < INT_MAX;
  const bool small_ok = n <= kSmallMaxRows && gy_small <= 65535;
  const int sms = cuda::device_attribute<cudaDevAttrMultiProcessorCount>(x.get_device());
  const bool local = paths::local_pays(n, idx64 ? 8 : 4, num_tokens, sms);  // the large path's local form
  const paths::Path path =
      paths::choose_forward(n, num_tokens, gy_small, tiny_ok, small_ok, local, forced_forward_path());
  if (path == paths::Path::kTiny) {
    launch_tiny<scalar_t, V>(xp, idx.const_data_ptr(), idx64, g.const_data_ptr(), g32, op, n,
                             num_tokens, hvec, gy_small, stream);
    return;
  }
  if (path == paths::Path::kSmall) {
    launch_small<scalar_t, V>(xp, idx.const_data_ptr(), idx64, g.const_data_ptr(), g32, op, n,
                              num_tokens, hvec, gx_small, gy_small, stream);
    return;
  }

  TORCH_CHECK(num_tokens < INT_MAX / kEll, "scatter_combine: num_tokens must be < 2^28 on CUDA");
  // The fused and multi-kernel forms' workspace, carved only if one of them runs: one int32
  // tensor from the caching allocator (stream-ordered, so it may go once the launches are
  // enqueued): flag | counts[T] | ell[T][8] | ooff[T] | slot[N] | operm[N] | tile_sums.
  struct Ctx {
    const at::Tensor* x;
    int64_t n, num_tokens;
    at::Tensor ws;
  } ctx{&x, n, num_tokens, {}};
  const WorkspaceSource source{[](void* p) -> LargeWorkspace {
    Ctx& c = *static_cast<Ctx*>(p);
    const int64_t ntiles = (c.num_tokens + kScanTile - 1) / kScanTile;
    c.ws = at::empty({1 + c.num_tokens * (2 + kEll) + 2 * c.n + ntiles}, c.x->options().dtype(at::kInt));
    LargeWorkspace w{ntiles};
    w.flag = c.ws.mutable_data_ptr<int>();
    w.counts = w.flag + 1;
    w.ell = w.counts + c.num_tokens;
    w.ooff = w.ell + c.num_tokens * kEll;
    w.slot = w.ooff + c.num_tokens;
    w.operm = w.slot + c.n;
    w.tile_sums = w.operm + c.n;
    return w;
  }, &ctx};
  launch_large<scalar_t, V>(xp, idx.const_data_ptr(), idx64, g.const_data_ptr(), g32, op, n,
                            num_tokens, hvec, source, forced_large_form(), x.get_device(), stream);
}

template <typename scalar_t>
bool can_vec16(std::initializer_list<const void*> ptrs, int64_t h) {
  if (h % cuda::vec16<scalar_t>() != 0) return false;
  for (const void* p : ptrs)
    if (!cuda::aligned16(p)) return false;
  return true;
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
  if (check_indices_requested()) validate_indices("scatter_combine", *idx, num_tokens);

  at::Tensor out = at::empty({num_tokens, h}, x->options());
  if (num_tokens == 0 || h == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x->scalar_type(), "scatter_combine_cuda", [&] {
    if (can_vec16<scalar_t>({x->const_data_ptr(), out.const_data_ptr()}, h)) {
      launch_forward<scalar_t, cuda::vec16<scalar_t>()>(*x, *idx, *g, out, num_tokens);
    } else {
      launch_forward<scalar_t, 1>(*x, *idx, *g, out, num_tokens);
    }
  });
  return out;
}

template <typename scalar_t, int V>
void launch_backward(
    const at::Tensor& gy, const at::Tensor& x, const at::Tensor& idx, const at::Tensor& g,
    at::Tensor& gx, at::Tensor& gg) {
  const int n = static_cast<int>(x.size(0));
  const int hvec = static_cast<int>(x.size(1) / V);
  launch_scatter_backward<scalar_t, V>(
      gy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), idx.const_data_ptr(),
      idx.scalar_type() == at::kLong, g.const_data_ptr(), g.scalar_type() == at::kFloat,
      gx.mutable_data_ptr<scalar_t>(), gg.mutable_data_ptr(), n, gy.size(0), hvec,
      c10::cuda::getCurrentCUDAStream());
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
  if (check_indices_requested()) validate_indices("scatter_combine_backward", *idx, gy->size(0));

  at::Tensor gx = at::empty({n, h}, x->options());
  at::Tensor gg = at::empty({n}, g->options());
  if (n == 0) return {gx, gg};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x->scalar_type(), "scatter_combine_backward_cuda", [&] {
    if (can_vec16<scalar_t>({gy->const_data_ptr(), x->const_data_ptr(), gx.const_data_ptr()}, h)) {
      launch_backward<scalar_t, cuda::vec16<scalar_t>()>(*gy, *x, *idx, *g, gx, gg);
    } else {
      launch_backward<scalar_t, 1>(*gy, *x, *idx, *g, gx, gg);
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
