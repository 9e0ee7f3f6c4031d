// Argument validation shared by the CPU and CUDA kernels of opreg.
//
// Kept to light ATen/c10 headers so that .cu files including it compile fast.
// Exception macros are chosen so that Python sees the right built-in type:
//   TORCH_CHECK_VALUE -> ValueError  (ranks, shapes, lengths, devices, counts)
//   TORCH_CHECK_TYPE  -> TypeError   (dtypes)
// Every message starts with the op name and names the offending argument.
// Index *range* checks are not here: they need to read token_idx, which is
// device-specific, so each backend does them in its own kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

namespace opreg {

// Numbers and shapes go into messages as std::string, never streamed: on the H200 box
// (torch 2.11, g++ 13.3) an extension that streamed an int64_t into a c10 error message
// segfaulted inside std::ostream::_M_insert<long> (2026-11-29), a libstdc++ mismatch
// between the extension and the process. Strings stream safely.
inline std::string num(int64_t v) {
  return std::to_string(v);
}

inline std::string shape(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(s[i]);
  }
  return out + "]";
}

namespace detail {

inline bool is_supported_float(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf ||
      t == at::kBFloat16;
}

inline void check_float_dtype(
    const char* op,
    const char* name,
    const at::Tensor& t) {
  TORCH_CHECK_TYPE(
      is_supported_float(t.scalar_type()),
      op, ": ", name,
      " must be float32, float16, bfloat16 or float64, got ",
      t.scalar_type());
}

// All inputs of an op must live on one device: the dispatcher picks the
// kernel from the highest-priority device, so a mixed call would otherwise
// read foreign memory.
inline void check_same_device(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const char* ref_name,
    const at::Tensor& ref) {
  TORCH_CHECK_VALUE(
      t.device() == ref.device(),
      op, ": ", name, " is on ", t.device().str(), " but ", ref_name, " is on ",
      ref.device().str());
}

// Shared by forward and backward (op differs only in the message prefix).
inline void check_combine_inputs(
    const char* op,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  TORCH_CHECK_VALUE(
      expert_hidden.dim() == 2,
      op, ": expert_hidden must be 2-D (N, H), got shape ",
      shape(expert_hidden.sizes()));
  check_float_dtype(op, "expert_hidden", expert_hidden);
  const int64_t n = expert_hidden.size(0);

  const auto it = token_idx.scalar_type();
  TORCH_CHECK_TYPE(
      it == at::kInt || it == at::kLong,
      op, ": token_idx must be int32 or int64, got ", it);
  TORCH_CHECK_VALUE(
      token_idx.dim() == 1 && token_idx.size(0) == n,
      op, ": token_idx must have shape (N,) = (", num(n), ",), got ",
      shape(token_idx.sizes()));

  // float32 gates are allowed with low-precision hidden states because
  // routers usually produce fp32 probabilities.
  const auto gt = gates.scalar_type();
  TORCH_CHECK_TYPE(
      gt == expert_hidden.scalar_type() || gt == at::kFloat,
      op, ": gates must have expert_hidden's dtype (",
      expert_hidden.scalar_type(), ") or float32, got ", gt);
  TORCH_CHECK_VALUE(
      gates.dim() == 1 && gates.size(0) == n,
      op, ": gates must have shape (N,) = (", num(n), ",), got ", shape(gates.sizes()));

  check_same_device(op, "token_idx", token_idx, "expert_hidden", expert_hidden);
  check_same_device(op, "gates", gates, "expert_hidden", expert_hidden);
}

} // namespace detail

inline void check_scatter_combine(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    int64_t num_tokens) {
  constexpr const char* op = "scatter_combine";
  detail::check_combine_inputs(op, expert_hidden, token_idx, gates);
  TORCH_CHECK_VALUE(
      num_tokens >= 0, op, ": num_tokens must be >= 0, got ", num(num_tokens));
}

inline void check_scatter_combine_backward(
    const at::Tensor& grad_out,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  constexpr const char* op = "scatter_combine_backward";
  detail::check_combine_inputs(op, expert_hidden, token_idx, gates);
  const int64_t h = expert_hidden.size(1);
  TORCH_CHECK_VALUE(
      grad_out.dim() == 2 && grad_out.size(1) == h,
      op, ": grad_out must have shape (num_tokens, H) with H = ", num(h),
      ", got ", shape(grad_out.sizes()));
  TORCH_CHECK_TYPE(
      grad_out.scalar_type() == expert_hidden.scalar_type(),
      op, ": grad_out must have expert_hidden's dtype (",
      expert_hidden.scalar_type(), "), got ", grad_out.scalar_type());
  detail::check_same_device(op, "grad_out", grad_out, "expert_hidden",
                            expert_hidden);
}

namespace detail {

// weight (K, width) and bias (K,) of a cat_linear whose input rows are `width` wide and
// whose input dtype/device are those of `ref` (named `ref_name` in messages).
inline void check_linear_params(
    const char* op,
    const char* ref_name,
    const at::Tensor& ref,
    int64_t width,
    const char* width_desc,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(
      weight.dim() == 2,
      op, ": weight must be 2-D (K, ", width_desc, "), got shape ", shape(weight.sizes()));
  TORCH_CHECK_TYPE(
      weight.scalar_type() == ref.scalar_type(),
      op, ": weight has dtype ", weight.scalar_type(), " but ", ref_name, " has dtype ",
      ref.scalar_type());
  TORCH_CHECK_VALUE(
      weight.size(1) == width,
      op, ": weight has ", num(weight.size(1)), " columns but ", width_desc, " is ",
      num(width));
  check_same_device(op, "weight", weight, ref_name, ref);

  if (bias.has_value() && bias->defined()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK_VALUE(
        b.dim() == 1 && b.size(0) == weight.size(0),
        op, ": bias must have shape (K,) = (", num(weight.size(0)), ",), got ",
        shape(b.sizes()));
    TORCH_CHECK_TYPE(
        b.scalar_type() == ref.scalar_type(),
        op, ": bias has dtype ", b.scalar_type(), " but ", ref_name, " has dtype ",
        ref.scalar_type());
    check_same_device(op, "bias", b, ref_name, ref);
  }
}

} // namespace detail

inline void check_cat_linear(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "cat_linear";
  TORCH_CHECK_VALUE(
      !parts.empty(), op, ": parts must be a non-empty list of tensors");
  const at::Tensor& p0 = parts[0];
  TORCH_CHECK_VALUE(
      p0.dim() >= 1, op, ": parts[0] must have at least 1 dim, got a 0-d tensor");
  detail::check_float_dtype(op, "parts[0]", p0);
  const auto lead = p0.sizes().slice(0, p0.dim() - 1);

  int64_t width = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    TORCH_CHECK_TYPE(
        p.scalar_type() == p0.scalar_type(),
        op, ": parts[", num(i), "] has dtype ", p.scalar_type(),
        " but parts[0] has dtype ", p0.scalar_type());
    // Leading dims must match exactly (no broadcasting), like torch.cat.
    TORCH_CHECK_VALUE(
        p.dim() == p0.dim() && p.sizes().slice(0, p.dim() - 1) == lead,
        op, ": parts[", num(i), "] has shape ", shape(p.sizes()),
        " whose leading dims differ from parts[0]'s shape ", shape(p0.sizes()));
    TORCH_CHECK_VALUE(
        p.device() == p0.device(),
        op, ": parts[", num(i), "] is on ", p.device().str(), " but parts[0] is on ",
        p0.device().str());
    width += p.size(-1);
  }
  detail::check_linear_params(op, "parts[0]", p0, width, "the sum of the parts' widths",
                              weight, bias);
}

// cat_linear_stacked(x, dim, weight, bias) = cat_linear(x.unbind(dim), weight, bias).
// Returns dim made non-negative.
inline int64_t check_cat_linear_stacked(
    const at::Tensor& x,
    int64_t dim,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "cat_linear_stacked";
  const int64_t nd = x.dim();
  TORCH_CHECK_VALUE(
      nd >= 2, op, ": x must have at least 2 dims (the slices are 1-D or more), got shape ",
      shape(x.sizes()));
  TORCH_CHECK_VALUE(
      dim >= -nd && dim < nd,
      op, ": dim must be in [", num(-nd), ", ", num(nd - 1), "] for x of shape ",
      shape(x.sizes()), ", got ", num(dim));
  const int64_t d = dim < 0 ? dim + nd : dim;
  TORCH_CHECK_VALUE(
      x.size(d) >= 1, op, ": x.size(dim) must be >= 1 (at least one slice), got x of shape ",
      shape(x.sizes()), " and dim ", num(dim));
  detail::check_float_dtype(op, "x", x);
  // Each slice is x without dim d; its last dim is the slices' width.
  const int64_t last = d == nd - 1 ? nd - 2 : nd - 1;
  detail::check_linear_params(op, "x", x, x.size(d) * x.size(last),
                              "x.size(dim) * the slices' width", weight, bias);
  return d;
}

// cat_linear's device entry point around an unchecked kernel
// `impl(parts, weight, bias)`: shared by the CPU and CUDA backends.
using CatLinearImpl = at::Tensor (*)(
    at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&);

template <CatLinearImpl impl>
at::Tensor cat_linear_entry(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  check_cat_linear(parts, weight, bias);
  return impl(parts, weight, bias);
}

} // namespace opreg
