// CPU kernel for opreg::cat_linear: linear(cat(parts, -1), weight, bias)
// without materialising the concatenation. cat(parts) @ W^T splits by column
// blocks of W: sum_i parts[i] @ W[:, off_i : off_i + H_i]^T, so each part is
// fed to one GEMM that accumulates into the same output (beta = 1). The
// column block of W is a strided view; BLAS consumes it via its leading
// dimension, so nothing is copied (except for small problems: see below).
#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <vector>

#include "cat_linear_checks.h"
#include "cat_linear_cpu.h"

namespace opreg {
namespace {

// x2d (M, K) @ weight^T + bias, as F.linear computes it.
at::Tensor linear2d(const at::Tensor& x2d, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? at::addmm(*bias, x2d, weight.t())
                                             : at::mm(x2d, weight.t());
}

// Inputs already checked.
at::Tensor cat_linear_impl(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const auto lead = parts[0].sizes().slice(0, parts[0].dim() - 1);
  const int64_t m = c10::multiply_integers(lead);  // 1 for 1-D parts
  const int64_t k = weight.size(0);
  std::vector<int64_t> out_shape(lead.begin(), lead.end());
  out_shape.push_back(k);

  // Small fp32/fp64 problems, and bf16/fp16 where torch's GEMM runs natively in them
  // (cat_linear_cpu.h): what F.linear(cat(parts)) runs, one cat and one GEMM, with
  // nothing else around them. At small sizes the call is a handful of ATen
  // dispatches, and each one counts: the general path below (reshapes, no-op
  // casts, narrow, an out= GEMM) cost 27 us per call against eager's 13 (R4 B12
  // H32 K56, 2 cores, bench/model_overhead.py).
  if (cat_linear_cpu::one_gemm(weight, m)) {
    const at::Tensor x = parts.size() == 1 ? parts[0] : at::cat(parts, -1);
    return linear2d(x.reshape({m, weight.size(1)}), weight, bias).view(out_shape);
  }
  const at::ScalarType dtype = weight.scalar_type();

  // fp16/bf16 (where the CPU's GEMMs in them are emulated: cat_linear_cpu.h) are computed
  // in fp32 and rounded once at the end: accumulating part by part in the low-precision
  // output would round once per part, and such fp16/bf16 GEMMs measured 1.4-14x slower
  // than upcasting to fp32 GEMMs. Parts are upcast one at a time to bound the extra memory.
  const at::ScalarType acc_type = at::isReducedFloatingType(dtype) ? at::kFloat : dtype;
  const at::Tensor w_acc = weight.to(acc_type);  // no copy when acc_type == dtype
  at::Tensor out2d = at::empty({m, k}, w_acc.options());

  // Small problems take one GEMM over the concatenated parts: below ~4M multiply-adds
  // each GEMM call's fixed cost outweighs copying the parts (R4 B12 H32 K56 fp32, 2 cores:
  // 31.8 µs as four GEMMs vs 12.2 as cat + one GEMM; equal from B64 H256 K1024 up).
  std::vector<at::Tensor> blocks;
  blocks.reserve(parts.size());
  for (const at::Tensor& p : parts) {
    blocks.push_back(p.reshape({m, p.size(-1)}));
  }
  if (blocks.size() > 1 && m * k * weight.size(1) < (int64_t(1) << 22)) {
    blocks = {at::cat(blocks, 1)};
  }

  int64_t off = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t w = blocks[i].size(1);
    const at::Tensor a = blocks[i].to(acc_type);
    const at::Tensor wt = w_acc.narrow(1, off, w).t();
    if (i > 0) {
      out2d.addmm_(a, wt);
    } else if (has_bias) {
      at::addmm_out(out2d, bias->to(acc_type), a, wt);  // bias broadcasts over rows
    } else {
      at::mm_out(out2d, a, wt);
    }
    off += w;
  }
  return out2d.to(dtype).view(out_shape);
}

// cat_linear(x.unbind(dim), weight, bias). On the one-GEMM path (cat_linear_cpu.h):
// cat(x.unbind(d), -1) is x with dim d moved next to the last one, flattened, so one copy
// and one GEMM.
at::Tensor cat_linear_stacked_cpu(
    const at::Tensor& x,
    int64_t dim,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const int64_t d = check_cat_linear_stacked(x, dim, weight, bias);
  const int64_t last = d == x.dim() - 1 ? x.dim() - 2 : x.dim() - 1;  // the slices' width
  std::vector<int64_t> out_shape;  // x without dims d and last, then K
  int64_t m = 1;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != d && i != last) {
      out_shape.push_back(x.size(i));
      m *= x.size(i);
    }
  }
  out_shape.push_back(weight.size(0));
  if (cat_linear_cpu::one_gemm(weight, m)) {
    const at::Tensor x2d = x.movedim(d, -2).reshape({m, weight.size(1)});
    return linear2d(x2d, weight, bias).view(out_shape);
  }
  return cat_linear_impl(x.unbind(d), weight, bias);
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, CPU, m) {
  m.impl("cat_linear", &opreg::cat_linear_entry<opreg::cat_linear_impl>);
  m.impl("cat_linear_stacked", &opreg::cat_linear_stacked_cpu);
}
