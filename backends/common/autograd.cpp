// Autograd for opreg::scatter_combine and opreg::cat_linear, for every device.
//
// The forwards re-enter the dispatcher below the autograd keys (the
// torchvision roi_align idiom), so the CPU or CUDA kernel is picked by the
// inputs' device. Sizes are handled as SymInts so that AOTAutograd can trace
// these functions with dynamic shapes.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

namespace opreg {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Typed handles are looked up once: the schemas are defined from Python
// before this library is loaded, so they exist by the first call.
at::Tensor call_scatter_combine(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    c10::SymInt num_tokens) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("opreg::scatter_combine", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::SymInt)>();
  return op.call(expert_hidden, token_idx, gates, std::move(num_tokens));
}

std::tuple<at::Tensor, at::Tensor> call_scatter_combine_backward(
    const at::Tensor& grad_out,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("opreg::scatter_combine_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(grad_out, expert_hidden, token_idx, gates);
}

at::Tensor call_cat_linear(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("opreg::cat_linear", "")
          .typed<at::Tensor(at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(parts, weight, bias);
}

at::Tensor call_cat_linear_stacked(
    const at::Tensor& x,
    int64_t dim,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("opreg::cat_linear_stacked", "")
          .typed<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&,
                            const std::optional<at::Tensor>&)>();
  return op.call(x, dim, weight, bias);
}

// Does this call need an autograd node? Without one the kernel is called directly:
// building the node (and saving inputs) cost 2-6 us per call on the H200's host
// (cat_linear R4 B12 under no_grad: 18.0 vs 16.2 and 16.4 vs 10.5 us per call,
// bench/model_overhead.py) and buys nothing when no gradient can flow.
bool any_requires_grad(std::initializer_list<const at::Tensor*> ts, at::TensorList more = {}) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts) {
    if (t->defined() && t->requires_grad()) return true;
  }
  for (const at::Tensor& t : more) {
    if (t.requires_grad()) return true;
  }
  return false;
}

// Gradients of y = cat(parts, -1) W^T + b, flattened over leading dims: one slot per
// part, then weight, then bias; a slot is filled only where needs[slot].
variable_list cat_linear_grads(
    const at::Tensor& grad_out,
    at::TensorList parts,
    const at::Tensor& weight,
    const std::vector<bool>& needs) {
  const size_t r = parts.size();
  // M from the leading dims rather than numel / K, which breaks for K == 0.
  c10::SymInt m = 1;
  for (int64_t d = 0; d + 1 < parts[0].dim(); ++d) {
    m *= parts[0].sym_size(d);
  }
  const at::Tensor g = grad_out.reshape_symint({m, weight.sym_size(0)});
  variable_list grads(r + 2);
  bool any_part = false;
  for (size_t i = 0; i < r; ++i) {
    any_part = any_part || needs[i];
  }
  if (any_part) {
    // dX = g W once, then split by column blocks: one GEMM instead of R.
    const at::Tensor gx = g.mm(weight);
    c10::SymInt off = 0;
    for (size_t i = 0; i < r; ++i) {
      const c10::SymInt w = parts[i].sym_size(-1);
      if (needs[i]) {
        grads[i] = gx.narrow_symint(1, off, w).reshape_symint(parts[i].sym_sizes());
      }
      off += w;
    }
  }
  if (needs[r]) {
    std::vector<at::Tensor> parts2d;
    parts2d.reserve(r);
    for (size_t i = 0; i < r; ++i) {
      parts2d.push_back(parts[i].reshape_symint({m, parts[i].sym_size(-1)}));
    }
    grads[r] = g.t().mm(at::cat(parts2d, 1));  // dW = g^T x
  }
  if (needs[r + 1]) {
    grads[r + 1] = g.sum(0);
  }
  return grads;
}

class ScatterCombine : public torch::autograd::Function<ScatterCombine> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& expert_hidden,
      const at::Tensor& token_idx,
      const at::Tensor& gates,
      c10::SymInt num_tokens) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({expert_hidden, token_idx, gates});
    return call_scatter_combine(expert_hidden, token_idx, gates, std::move(num_tokens));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    // One fused kernel yields both grads, so needs_input_grad saves nothing.
    auto [grad_hidden, grad_gates] =
        call_scatter_combine_backward(grad_outputs[0], saved[0], saved[1], saved[2]);
    // One slot per forward argument; token_idx and num_tokens get none.
    return {grad_hidden, at::Tensor(), grad_gates, at::Tensor()};
  }
};

class CatLinear : public torch::autograd::Function<CatLinear> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      at::TensorList parts,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::vector<at::Tensor> to_save(parts.begin(), parts.end());
    to_save.push_back(weight);
    ctx->save_for_backward(to_save);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return call_cat_linear(parts, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t r = saved.size() - 1;
    std::vector<bool> needs(r + 2);
    for (size_t i = 0; i < r + 2; ++i) {
      // bias has an input edge only when defined: query its slot only then.
      needs[i] = (i < r + 1 || ctx->saved_data["has_bias"].toBool()) && ctx->needs_input_grad(i);
    }
    return cat_linear_grads(grad_outputs[0], at::TensorList(saved).slice(0, r), saved[r], needs);
  }
};

class CatLinearStacked : public torch::autograd::Function<CatLinearStacked> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& x,
      int64_t dim,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["dim"] = dim < 0 ? dim + x.dim() : dim;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return call_cat_linear_stacked(x, dim, weight, bias);
  }

  // The slices' gradients, stacked back along dim.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const std::vector<at::Tensor> parts = saved[0].unbind(dim);
    const size_t r = parts.size();
    std::vector<bool> needs(r + 2, false);
    const bool need_x = ctx->needs_input_grad(0);
    for (size_t i = 0; i < r; ++i) needs[i] = need_x;
    // Edges exist for tensor arguments only: x 0, weight 1, bias 2 (when defined).
    needs[r] = ctx->needs_input_grad(1);
    needs[r + 1] = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2);
    variable_list g = cat_linear_grads(grad_outputs[0], parts, saved[1], needs);
    // Returned slots are per forward argument: x, dim, weight, bias.
    at::Tensor gx = need_x ? at::stack(at::TensorList(g).slice(0, r), dim) : at::Tensor();
    return {gx, at::Tensor(), g[r], g[r + 1]};
  }
};

at::Tensor scatter_combine_autograd(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    c10::SymInt num_tokens) {
  if (!any_requires_grad({&expert_hidden, &gates})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_scatter_combine(expert_hidden, token_idx, gates, std::move(num_tokens));
  }
  return ScatterCombine::apply(expert_hidden, token_idx, gates, std::move(num_tokens));
}

at::Tensor cat_linear_autograd(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const at::Tensor none;
  if (!any_requires_grad({&weight, bias.has_value() ? &*bias : &none}, parts)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_cat_linear(parts, weight, bias);
  }
  return CatLinear::apply(parts, weight, bias);
}

at::Tensor cat_linear_stacked_autograd(
    const at::Tensor& x,
    int64_t dim,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const at::Tensor none;
  if (!any_requires_grad({&x, &weight, bias.has_value() ? &*bias : &none})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_cat_linear_stacked(x, dim, weight, bias);
  }
  return CatLinearStacked::apply(x, dim, weight, bias);
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, Autograd, m) {
  m.impl("scatter_combine", &opreg::scatter_combine_autograd);
  m.impl("cat_linear", &opreg::cat_linear_autograd);
  m.impl("cat_linear_stacked", &opreg::cat_linear_stacked_autograd);
}
