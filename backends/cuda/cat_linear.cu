// CUDA kernel for opreg::cat_linear: linear(cat(parts, -1), weight, bias).
//
// Two paths, chosen on the host from shapes alone (no data, no sync):
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
//  * GEMM: exactly what eager F.linear(torch.cat(parts, -1)) runs: at::cat
//    (skipped for one part) and one cuBLAS addmm/mm with the bias fused in its
//    epilogue, honouring allow_tf32 like F.linear. The stacked op builds the
//    matrix the same way, at::cat(x.unbind(d), -1). Measured on the H200: our
//    own single-launch cat kernel was no faster than at::cat (381.5 vs 381.6 us,
//    221.5 vs 221.3 us end to end), so it was dropped. Per-part accumulating
//    GEMMs (beta=1) were rejected: each one re-reads and re-writes the output.
//
// Which path: SIMT up to 2^27 multiply-adds for fp32/fp64 and 2^24 for 16-bit
// types (simt_max_macs, below, with the points it rests on). A cost model of host
// time, bytes, FLOPs and SIMT's walk over K was tried on 2026-12-01 and checked by
// bench/sweep.py on the H200 (bench/RESULTS.md): on the 152 list-form shapes with
// both paths forced, its picks were > 3 % slower than eager on 75, these thresholds'
// picks on 54, the better of the two paths on 38. Its host terms were the error: the
// op call with a Tensor[] argument costs far more than the 10-14 us it assumed (R2
// B16 H512 K256 fp32: GEMM path 47.9 us, SIMT 16.0, eager 42.7). A model re-fitted
// to that sweep's forced columns is the next step; until then, these thresholds.
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

// Single-launch SIMT vs at::cat + cuBLAS, measured on the H200 (torch 2.11),
// us per call inside a CUDA graph, MACs = M * N * K:
//   fp32 2^26 (M=64, K=1024, N=1024): SIMT 13.8, cat+cuBLAS 26.8
//   fp32 2^28 (M=256):                SIMT 36.3, cat+cuBLAS 29.3
//   bf16 2^28 (M=256):                SIMT 32.5, cat+cuBLAS  6.2 (tensor cores)
// so SIMT up to 2^27 MACs for fp32/fp64 and 2^24 for 16-bit types.
int64_t simt_max_macs(at::ScalarType t) {
  return (t == at::kFloat || t == at::kDouble) ? (int64_t(1) << 27) : (int64_t(1) << 24);
}

// Benchmark/debug override: OPREG_CAT_LINEAR_PATH=simt|gemm (0 = auto).
int forced_path() {
  const char* e = std::getenv("OPREG_CAT_LINEAR_PATH");
  if (e == nullptr || e[0] == '\0') return 0;
  if (std::strcmp(e, "simt") == 0) return 1;
  if (std::strcmp(e, "gemm") == 0) return 2;
  return 0;
}

// The tensors unpacked for launch_simt_kernel (cat_linear_simt.cu), on the current stream.
template <typename scalar_t, bool VEC, int MAXR>
void launch_simt(
    const PartArgs<kMaxParts>& all, int R, const at::Tensor& w, int64_t ldw, const scalar_t* bias,
    at::Tensor& out, int64_t M, int64_t N) {
  launch_simt_kernel<scalar_t, VEC, MAXR>(all, R, w.const_data_ptr<scalar_t>(), ldw, bias,
                                          out.mutable_data_ptr<scalar_t>(), M, N, w.get_device(),
                                          c10::cuda::getCurrentCUDAStream());
}

// The rule (header comment), or the override. The choice never depends on whether the
// stream is capturing a CUDA graph: the warm-up before a capture must run the path the
// capture records, or the capture makes the first cuBLAS call of the process (handle,
// workspace) inside the graph, which fails it (seen on the H200, 2026-12-01,
// tests/test_cat_linear.py::test_cuda_graphs under xdist).
bool use_simt_path(int64_t M, int64_t N, int64_t K, int64_t R, at::ScalarType dt) {
  const int path = forced_path();
  const bool fits_simt = R <= kMaxParts && M < int64_t(65535) * kTM && N < INT_MAX && K < INT_MAX;
  const int64_t macs = M * N * std::max<int64_t>(K, 1);
  return fits_simt && (path == 1 || (path == 0 && macs <= simt_max_macs(dt)));
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

// The SIMT path over parts already described in pa: (M, N) output of shape out_shape.
at::Tensor run_simt(const PartArgs<kMaxParts>& pa, int64_t R, bool vec_ok, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, c10::IntArrayRef out_shape, int64_t M,
                    int64_t N) {
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
      launch_simt<scalar_t, true, kFewParts>(pa, r, wc, ldw, bp, out, M, N);
    } else if (vec_ok) {
      launch_simt<scalar_t, true, kMaxParts>(pa, r, wc, ldw, bp, out, M, N);
    } else {
      launch_simt<scalar_t, false, kMaxParts>(pa, r, wc, ldw, bp, out, M, N);
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

  if (use_simt_path(M, N, weight.size(1), R, weight.scalar_type())) {
    // Describe the parts in place; copy only those whose rows are not flat.
    const int V = static_cast<int>(16 / c10::elementSize(weight.scalar_type()));
    PartArgs<kMaxParts> pa;
    std::vector<at::Tensor> keep;  // owns contiguous copies, if any (rare)
    keep.reserve(parts.size());
    bool vec_ok = true;
    int64_t kstart = 0;
    for (int64_t i = 0; i < R; ++i) {
      const at::Tensor* p = &parts[i];
      int64_t rs = 0;
      if (!flat_rows(p->sizes(), p->strides(), &rs)) {
        keep.push_back(p->contiguous());
        p = &keep.back();
        flat_rows(p->sizes(), p->strides(), &rs);
      }
      set_part(pa, i, p->const_data_ptr(), rs, p->size(-1), kstart, V, vec_ok);
      kstart += p->size(-1);
    }
    return run_simt(pa, R, vec_ok, weight, bias, out_shape, M, N);
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
  if (!use_simt_path(M, N, weight.size(1), R, weight.scalar_type())) {
    // What eager runs, cat(x.unbind(d), -1) + GEMM: x.movedim(d, -2).reshape(M, K), the
    // same matrix by one generic copy, measured 9-14 % slower per call (H200, R8 B8192
    // H512 K4096 bf16 502 vs 462 us, R32 B4096 H128 275 vs 242; bench/RESULTS.md).
    return gemm_path(cat_rows(x.unbind(d), M, weight.size(1)), weight, bias, out_shape);
  }
  if (flat_rows(sizes, strides, &rs)) {
    const int V = static_cast<int>(16 / c10::elementSize(weight.scalar_type()));
    const char* base = static_cast<const char*>(x.const_data_ptr());
    const int64_t step = x.stride(d) * static_cast<int64_t>(x.element_size());
    PartArgs<kMaxParts> pa;
    bool vec_ok = true;
    for (int64_t i = 0; i < R; ++i) {
      set_part(pa, i, base + i * step, rs, width, i * width, V, vec_ok);
    }
    return run_simt(pa, R, vec_ok, weight, bias, out_shape, M, N);
  }
  return cat_linear_impl(x.unbind(d), weight, bias);
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, CUDA, m) {
  m.impl("cat_linear", &opreg::cat_linear_entry<opreg::cat_linear_impl>);
  m.impl("cat_linear_stacked", &opreg::cat_linear_stacked_cuda);
}

#endif  // !defined(__CUDA_ARCH__)
