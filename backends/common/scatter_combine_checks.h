// Argument checks of opreg::scatter_combine and opreg::scatter_combine_backward,
// shared by the CPU and CUDA kernels (same messages and exception types as
// opreg/ops/scatter_combine.py). Index values are checked by each kernel.
#pragma once

#include "checks.h"

namespace opreg {
namespace detail {

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

} // namespace opreg
