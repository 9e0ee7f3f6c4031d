// CUDA kernel for opreg::cat_linear: linear(cat(parts, -1), weight, bias).
//
// Three paths, chosen on the host from shapes (no data, no sync; while a CUDA graph is
// captured, also from that: choose_path below):
//  * SIMT (small problems): ONE launch that reads every part in place (part
//    pointers travel in a __grid_constant__ kernel-argument struct, up to
//    kMaxParts), so there is no cat, no extra allocation, no second kernel.
//    Block tile 16 (rows) x 32 (outputs); the reduction dimension is walked
//    in chunks that never straddle a part, staged through an 8-deep cp.async
//    shared-memory pipeline (16-byte copies, zero-filled at the edges); the
//    8 warps split each chunk's k range and their partial 4x4 micro-tiles are
//    summed in a fixed order at the end (deterministic). fp32 accumulation
//    (fp64 for double), exact fp32 FMAs: never TF32, so it is at least as
//    accurate as what allow_tf32 would permit.
//  * dot (the tiniest calls, cat_linear_dot.cu): one warp per 4 outputs of a row, its
//    lanes splitting K in 16-byte vectors, a fixed shuffle tree for the sum.
//  * GEMM: exactly what eager F.linear(torch.cat(parts, -1)) runs: at::cat
//    (skipped for one part) and one cuBLAS addmm/mm with the bias fused in its
//    epilogue, honouring allow_tf32 like F.linear. The stacked op builds the
//    matrix the same way, at::cat(x.unbind(d), -1). Measured on the H200: our
//    own single-launch cat kernel was no faster than at::cat (381.5 vs 381.6 us,
//    221.5 vs 221.3 us end to end), so it was dropped. Per-part accumulating
//    GEMMs (beta=1) were rejected: each one re-reads and re-writes the output.
//
// Which path: the cost model in backends/common/cat_linear_model.h (shared with the
// autograd kernel), from the SIMT kernel's walk over K per block, its blocks against the
// SMs, the GEMM path's bytes, FLOPs, launches and host time; its constants, where each comes
// from, and its check against the H200 sweep are written there. It replaced size thresholds
// (SIMT up to 2^27 multiply-adds fp32/fp64, 2^24 16-bit), whose picks were up to 5x slower
// than eager where many parts make a long K walk for few blocks (R32 B4 H512 K256 fp32:
// SIMT 186 us, eager 36); on the 2026-12-01 sweep's 180 list-form shapes the model's picks
// are > 3 % slower than the better forced path at 11 shapes (thresholds: 34) and than eager
// at 46 (thresholds: 59; the better path itself: 40), never more than 1.26x (thresholds: 16
// shapes over 1.5x). An earlier model (host terms of 10-14 us) lost to the thresholds: the
// GEMM path's host time at small shapes is 23-37 us on the H200's host, and that term is
// now taken from the sweep's forced-GEMM column.
//
// Where the parts live (separate translation units, compiled in parallel by
// ninja; the kernel file includes no ATen operator or dispatcher header):
//  * cat_linear.cu (this file): the path choice, describing the parts, the
//    GEMM path, the dtype dispatch and the TORCH_LIBRARY_IMPL registration.
//  * cat_linear.cuh: PartArgs, the SIMT block tile, launch_simt_kernel's
//    declaration and the list of its instantiations.
//  * cat_linear_simt.cu: the SIMT kernel and launch_simt_kernel.
//
// Host code only: nvcc's device pass (__CUDA_ARCH__ defined) skips this whole
// file, which would otherwise parse the ATen and dispatcher headers once more
// for nothing (17.4 s instead of 24.1 s; the former single file: 28.8 s,
// nvcc 13.0, 2-core box). A __global__ or __device__ function put here would
// get no device code: kernels go in cat_linear_simt.cu.
#if !defined(__CUDA_ARCH__)
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cat_linear_checks.h"
#include "cat_linear_model.h"
#include "cat_linear.cuh"

namespace opreg {
namespace {

using namespace cl_detail;


// ---------------------------------------------------------------------------
// Host side.

// Leading dims of a part (sizes, strides) flatten to rows with one stride?
// (Views such as x[i] of a contiguous (R, B, H) tensor, or expanded rows with
// stride 0, qualify.)
bool flat_rows(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t* rs) {
  const int64_t d = static_cast<int64_t>(sizes.size());
  if (sizes[d - 1] > 1 && strides[d - 1] != 1) return false;
  *rs = 0;
  bool first = true;
  int64_t expect = 0;
  for (int64_t i = d - 2; i >= 0; --i) {
    if (sizes[i] == 1) continue;
    if (first) {
      *rs = strides[i];
      expect = strides[i] * sizes[i];
      first = false;
    } else {
      if (strides[i] != expect) return false;
      expect *= sizes[i];
    }
  }
  return true;
}

namespace model = cat_linear_model;
static_assert(model::kTileM == kTM && model::kTileN == kTN && model::kMaxParts == kMaxParts &&
                  model::kChunkBytes == kVPR * 16,
              "cat_linear_model.h describes the SIMT kernel's tile, chunk and part limit");
static_assert(model::kDotCols == kDotCols && model::kDotUnroll == kDotUnroll &&
                  model::kDotWarpsPerSm * 32 == 2048,
              "cat_linear_model.h describes the dot kernel's warp tile and residency");

// The device's SM count, read once per device (an attribute query: legal while capturing).
int sm_count(c10::DeviceIndex dev) {
  return cuda::device_attribute<cudaDevAttrMultiProcessorCount>(dev);
}

// The tensors unpacked for launch_dot_kernel (cat_linear_dot.cu) or launch_simt_kernel
// (cat_linear_simt.cu), on the current stream.
template <typename scalar_t, bool VEC, int MAXR>
void launch_fused(
    bool dot, const PartArgs<kMaxParts>& all, int R, const at::Tensor& w, int64_t ldw,
    const scalar_t* bias, at::Tensor& out, int64_t M, int64_t N) {
  const auto launch = dot ? launch_dot_kernel<scalar_t, VEC, MAXR> : launch_simt_kernel<scalar_t, VEC, MAXR>;
  launch(all, R, w.const_data_ptr<scalar_t>(), ldw, bias, out.mutable_data_ptr<scalar_t>(), M, N,
         w.get_device(), c10::cuda::getCurrentCUDAStream());
}

// Is the current stream capturing a CUDA graph? 1 yes, 0 no, -1 unknown (the query failed:
// e.g. the legacy stream while another thread captures in global mode; its error is cleared).
int capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return st == cudaStreamCaptureStatusNone ? 0 : 1;
}

// Per thread and device: has a call outside any capture run the GEMM path here, so that
// cuBLAS's handles exist (cublasCreate inside a capture fails it: seen on the H200,
// 2026-12-01, tests/test_cat_linear.py::test_cuda_graphs under xdist)?
bool& cublas_ready(c10::DeviceIndex dev) {
  thread_local bool ready[C10_COMPILE_TIME_MAX_GPUS] = {};
  return ready[dev];
}

// The model (cat_linear_model.h), or the OPREG_CAT_LINEAR_PATH override, for the current
// device. While the stream captures a CUDA graph, where the model says cuBLAS is faster
// without the host's cost (graph_prefers_gemm), a fused pick gives way to the GEMM path,
// but only on a thread where the GEMM path has run outside a capture: a call outside one
// that would switch inside one sets *warm_gemm, once per thread and device, and its caller
// runs the GEMM path on the call's inputs before the fused pick (the warm-up before a
// capture is such a call). Else the sizes' pick runs, captured or not. The capture query
// runs only where the model would switch: a few of the fused picks.
model::Path choose_path(const model::Work& w, const at::Tensor& weight, bool* warm_gemm) {
  *warm_gemm = false;
  const c10::DeviceIndex dev = weight.get_device();
  const int sms = sm_count(dev);
  const model::Path sizes = model::choose_path(w, sms);
  if (!model::graph_prefers_gemm(w, sizes, sms)) return sizes;
  const int cap = capturing(c10::cuda::getCurrentCUDAStream(dev).stream());
  if (cap == 1) return cublas_ready(dev) ? model::Path::kGemm : sizes;
  if (cap == 0 && !cublas_ready(dev)) {
    *warm_gemm = true;
    cublas_ready(dev) = true;
  }
  return sizes;
}

// Part i starts at ptr, its rows rs elements apart, wi wide; vec_ok stays true
// while every part allows 16-byte loads.
void set_part(PartArgs<kMaxParts>& pa, int64_t i, const void* ptr, int64_t rs, int64_t wi,
              int64_t kstart, int V, bool& vec_ok) {
  pa.ptr[i] = ptr;
  pa.row_stride[i] = rs;
  pa.width[i] = static_cast<int>(wi);
  pa.kstart[i] = static_cast<int>(kstart);
  vec_ok = vec_ok && wi % V == 0 && rs % V == 0 && (wi == 0 || cuda::aligned16(ptr));
}

// A fused kernel (dot or SIMT) over parts already described in pa: (M, N) output of shape
// out_shape.
at::Tensor run_fused(bool dot, const PartArgs<kMaxParts>& pa, int64_t R, bool vec_ok,
                     const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     c10::IntArrayRef out_shape, int64_t M, int64_t N) {
  at::Tensor out = at::empty(out_shape, weight.options());
  if (M == 0 || N == 0) return out;
  const int64_t K = weight.size(1);
  const at::ScalarType dt = weight.scalar_type();
  const int V = static_cast<int>(16 / c10::elementSize(dt));
  const bool has_bias = bias.has_value() && bias->defined();
  // Weight rows must be unit-stride; a padded row stride (ldw) is fine.
  const at::Tensor wc = weight.stride(1) == 1 || K <= 1 ? weight : weight.contiguous();
  const int64_t ldw = N <= 1 ? K : wc.stride(0);
  vec_ok = vec_ok && K % V == 0 && ldw % V == 0 && cuda::aligned16(wc.const_data_ptr());
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "cat_linear_cuda", [&] {
    const scalar_t* bp = has_bias ? bc.const_data_ptr<scalar_t>() : nullptr;
    const int r = static_cast<int>(R);
    if (vec_ok && R <= kFewParts) {
      launch_fused<scalar_t, true, kFewParts>(dot, pa, r, wc, ldw, bp, out, M, N);
    } else if (vec_ok) {
      launch_fused<scalar_t, true, kMaxParts>(dot, pa, r, wc, ldw, bp, out, M, N);
    } else {
      launch_fused<scalar_t, false, kMaxParts>(dot, pa, r, wc, ldw, bp, out, M, N);
    }
  });
  return out;
}

// cat(parts, -1) as the (M, K) matrix the GEMM reads; one part needs no copy at all
// (eager's torch.cat([p]) makes one).
at::Tensor cat_rows(at::TensorList parts, int64_t M, int64_t K) {
  return parts.size() == 1 ? parts[0].reshape({M, K}) : at::cat(parts, -1).reshape({M, K});
}

// The GEMM path: cuBLAS over the concatenated input xcat (M, K), bias fused in
// its epilogue, exactly what F.linear runs (and so honouring allow_tf32).
at::Tensor gemm_path(const at::Tensor& xcat, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, c10::IntArrayRef out_shape) {
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor out2d = has_bias ? at::addmm(*bias, xcat, weight.t()) : at::mm(xcat, weight.t());
  return out2d.view(out_shape);
}

// The parts as the SIMT kernel reads them, described in place (no copy is made here):
// pa, whether 16-byte loads apply, and the k chunks the kernel walks. A part whose rows do
// not flatten to one stride (rare) is left for a contiguous copy, made only if the SIMT path
// runs (describe_copies); it counts here as that copy will be.
struct Described {
  PartArgs<kMaxParts> pa;
  bool vec_ok = true;
  int64_t chunks = 0;
  bool all_flat = true;
};

Described describe_parts(at::TensorList parts, int V, int64_t TK) {
  Described d;
  int64_t kstart = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    const int64_t wi = p.size(-1);
    int64_t rs = 0;
    if (flat_rows(p.sizes(), p.strides(), &rs)) {
      set_part(d.pa, static_cast<int64_t>(i), p.const_data_ptr(), rs, wi, kstart, V, d.vec_ok);
    } else {
      d.all_flat = false;
      d.pa.kstart[i] = static_cast<int>(kstart);  // the rest: describe_copies
      d.vec_ok = d.vec_ok && wi % V == 0;  // a fresh contiguous copy: aligned, rows wi apart
    }
    d.chunks += (wi + TK - 1) / TK;
    kstart += wi;
  }
  return d;
}

// The contiguous copies describe_parts left out, into keep (which owns them).
void describe_copies(at::TensorList parts, Described& d, int V, std::vector<at::Tensor>& keep) {
  keep.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    int64_t rs = 0;
    if (flat_rows(parts[i].sizes(), parts[i].strides(), &rs)) continue;
    keep.push_back(parts[i].contiguous());
    const at::Tensor& c = keep.back();
    flat_rows(c.sizes(), c.strides(), &rs);
    set_part(d.pa, static_cast<int64_t>(i), c.const_data_ptr(), rs, c.size(-1),
             d.pa.kstart[i], V, d.vec_ok);
  }
}

// What the model reads about one call (the weight's own alignment, checked in run_simt, is
// left out: a misaligned weight is rare).
model::Work work_of(int64_t M, const at::Tensor& weight, int64_t R, const Described& d, int V) {
  const int64_t K = weight.size(1);
  return {M, weight.size(0), K, R, d.chunks, static_cast<int64_t>(weight.element_size()),
          d.vec_ok && K % V == 0};
}

// Could the SIMT path win at all? The model at its most favourable for SIMT, from sizes
// alone: the fewest k chunks the widths allow (their sum in whole chunks: each part's own
// rounding only adds chunks) and whichever load width the model prices lower (its SIMT
// time grows with the chunks either way). Where even that loses, the GEMM path runs without
// describe_parts' walk over the parts. The op's per-part walks (this one, the checks', the
// autograd kernel's) are what it adds to eager's at R32: B1024 H64 K2048 bf16, no grad, was
// 1.7 us over eager's 36.7 us per call on the H200's host (bench/sweep.py, 2026-12-02), and
// on the 2-core box the op's host time grows by ~55 ns a part.
bool fused_may_win(int64_t M, const at::Tensor& weight, int64_t R, int64_t TK) {
  const int64_t K = weight.size(1);
  model::Work best{M, weight.size(0), K, R, (K + TK - 1) / TK,
                   static_cast<int64_t>(weight.element_size()), true};
  const int sms = sm_count(weight.get_device());
  if (model::use_fused(best, sms)) return true;  // sizes only: a capture only moves fused -> GEMM
  best.vec = false;
  return model::use_fused(best, sms);
}

// Inputs already checked.
at::Tensor cat_linear_impl(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor& p0 = parts[0];
  const auto lead = p0.sizes().slice(0, p0.dim() - 1);
  int64_t M = 1;
  for (const int64_t s : lead) M *= s;
  const int64_t N = weight.size(0);
  const int64_t R = static_cast<int64_t>(parts.size());
  c10::SmallVector<int64_t, 6> out_shape(lead.begin(), lead.end());
  out_shape.push_back(N);

  const int V = static_cast<int>(16 / c10::elementSize(weight.scalar_type()));
  if (R <= kMaxParts && fused_may_win(M, weight, R, int64_t(kVPR) * V)) {
    Described d = describe_parts(parts, V, int64_t(kVPR) * V);
    bool warm = false;
    const model::Path path = choose_path(work_of(M, weight, R, d, V), weight, &warm);
    if (warm) (void)gemm_path(cat_rows(parts, M, weight.size(1)), weight, bias, out_shape);
    if (path != model::Path::kGemm) {
      std::vector<at::Tensor> keep;  // owns contiguous copies, if any (rare)
      if (!d.all_flat) describe_copies(parts, d, V, keep);
      return run_fused(path == model::Path::kDot, d.pa, R, d.vec_ok, weight, bias, out_shape, M, N);
    }
  }

  // GEMM path: at::cat (any R, any alignment) + one cuBLAS call.
  return gemm_path(cat_rows(parts, M, weight.size(1)), weight, bias, out_shape);
}

// cat_linear(x.unbind(dim), weight, bias). On the SIMT path the slices are
// described straight from x's strides: making them as tensors (x.unbind) cost
// ~2 us per call on the H200's host (15.3 vs 13.2 us, bench/model_overhead.py).
at::Tensor cat_linear_stacked_cuda(
    const at::Tensor& x,
    int64_t dim,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const int64_t d = check_cat_linear_stacked(x, dim, weight, bias);
  const c10::cuda::CUDAGuard guard(weight.device());
  c10::SmallVector<int64_t, 6> sizes, strides;  // one slice: x without dim d
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != d) {
      sizes.push_back(x.size(i));
      strides.push_back(x.stride(i));
    }
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) M *= sizes[i];
  const int64_t N = weight.size(0), R = x.size(d), width = sizes.back();
  c10::SmallVector<int64_t, 6> out_shape(sizes.begin(), sizes.end() - 1);
  out_shape.push_back(N);
  int64_t rs = 0;
  if (R <= kMaxParts && flat_rows(sizes, strides, &rs)) {
    const int V = static_cast<int>(16 / c10::elementSize(weight.scalar_type()));
    const int64_t TK = int64_t(kVPR) * V;
    const char* base = static_cast<const char*>(x.const_data_ptr());
    const int64_t step = x.stride(d) * static_cast<int64_t>(x.element_size());
    Described ds;
    for (int64_t i = 0; i < R; ++i) {
      set_part(ds.pa, i, base + i * step, rs, width, i * width, V, ds.vec_ok);
    }
    ds.chunks = R * ((width + TK - 1) / TK);
    bool warm = false;
    const model::Path path = choose_path(work_of(M, weight, R, ds, V), weight, &warm);
    if (warm) (void)gemm_path(cat_rows(x.unbind(d), M, weight.size(1)), weight, bias, out_shape);
    if (path != model::Path::kGemm) {
      return run_fused(path == model::Path::kDot, ds.pa, R, ds.vec_ok, weight, bias, out_shape, M, N);
    }
  } else if (R <= kMaxParts) {
    return cat_linear_impl(x.unbind(d), weight, bias);  // slices that need copies: rare
  }
  // What eager runs, cat(x.unbind(d), -1) + GEMM: x.movedim(d, -2).reshape(M, K), the
  // same matrix by one generic copy, measured 9-14 % slower per call (H200, R8 B8192
  // H512 K4096 bf16 502 vs 462 us, R32 B4096 H128 275 vs 242; bench/RESULTS.md).
  return gemm_path(cat_rows(x.unbind(d), M, weight.size(1)), weight, bias, out_shape);
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, CUDA, m) {
  m.impl("cat_linear", &opreg::cat_linear_entry<opreg::cat_linear_impl>);
  m.impl("cat_linear_stacked", &opreg::cat_linear_stacked_cuda);
}

#endif  // !defined(__CUDA_ARCH__)
