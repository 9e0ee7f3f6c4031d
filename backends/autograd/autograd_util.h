// Helpers shared by the per-op autograd files of the opreg_autograd library.
//
// Every op's autograd kernel has three parts: reverse mode (a
// torch::autograd::Function, built only when an input needs a gradient),
// forward mode (tangents read from the inputs' level-0 forward gradients, as
// ATen's generated VariableType kernels do; torch.func.jvp uses that level
// too), and dispatcher calls of the ops themselves, so that every formula is
// differentiable again (double backward, forward-over-reverse).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/forward_grad.h>

#include <initializer_list>
#include <optional>

namespace opreg {
namespace autograd {

// Does this call need an autograd node? Without one the kernel is called directly:
// building the node (and saving inputs) cost 2-6 us per call on the H200's host
// (cat_linear R4 B12 under no_grad: 18.0 vs 16.2 and 16.4 vs 10.5 us per call,
// bench/model_overhead.py) and buys nothing when no gradient can flow.
inline bool any_requires_grad(std::initializer_list<const at::Tensor*> ts, at::TensorList more = {}) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) return true;
  }
  for (const at::Tensor& t : more) {
    if (t.requires_grad()) return true;
  }
  return false;
}

// Can any tensor have a forward-mode tangent now? Only inside a dual level
// (torch.autograd.forward_ad.dual_level, torch.func.jvp): leaving it clears every
// tangent of that level, and level 0 is the only one (nested forward mode is not
// supported). One lookup instead of a _fw_grad call per tensor: at cat_linear's 32
// parts those calls were a measurable part of the op's host time.
inline bool forward_ad_active() {
  return torch::autograd::ForwardADLevel::try_get_by_idx(0) != nullptr;
}

// The forward-mode tangent of t (undefined when t has none, or is undefined).
inline at::Tensor tangent(const at::Tensor& t) {
  return t.defined() ? t._fw_grad(/*level=*/0) : at::Tensor();
}

inline at::Tensor tangent(const std::optional<at::Tensor>& t) {
  return t.has_value() ? tangent(*t) : at::Tensor();
}

// t without its tangent (a view that keeps t's reverse-mode history), so that a
// forward computed from primals carries no stale tangent of its own.
inline at::Tensor primal(const at::Tensor& t) {
  return tangent(t).defined() ? t._fw_primal(/*level=*/0) : t;
}

inline std::optional<at::Tensor> primal(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return primal(*t);
}

// a + b where an undefined tensor stands for zero.
inline at::Tensor plus(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined()) return b;
  return b.defined() ? a + b : a;
}

// t, or zeros like `like` where t is undefined (a missing tangent or gradient).
inline at::Tensor or_zeros(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : at::zeros_like(like);
}

} // namespace autograd
} // namespace opreg
