// Argument checks of opreg::cat_linear and opreg::cat_linear_stacked, shared by
// the CPU and CUDA kernels (same messages and exception types as
// opreg/ops/cat_linear.py), and the checked entry point both backends register.
#pragma once

#include "checks.h"

#include <optional>

namespace opreg {

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
