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

  // y = x W^T + b with x = cat(parts) (M, sum H_i), flattened over leading dims.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t r = saved.size() - 1;
    const at::Tensor& weight = saved[r];
    const bool has_bias = ctx->saved_data["has_bias"].toBool();

    // M from the leading dims rather than numel / K, which breaks for K == 0.
    c10::SymInt m = 1;
    for (int64_t d = 0; d + 1 < saved[0].dim(); ++d) {
      m *= saved[0].sym_size(d);
    }
    const at::Tensor g = grad_outputs[0].reshape_symint({m, weight.sym_size(0)});

    // Slots: parts..., weight, bias. Input-edge indices equal slot indices
    // because every part and the weight are tensors; bias has an edge only
    // when defined, so it is queried only then.
    variable_list grads(r + 2);
    bool any_part = false;
    for (size_t i = 0; i < r; ++i) {
      any_part = any_part || ctx->needs_input_grad(i);
    }
    if (any_part) {
      // dX = g W once, then split by column blocks: one GEMM instead of R.
      const at::Tensor gx = g.mm(weight);
      c10::SymInt off = 0;
      for (size_t i = 0; i < r; ++i) {
        const c10::SymInt w = saved[i].sym_size(-1);
        if (ctx->needs_input_grad(i)) {
          grads[i] = gx.narrow_symint(1, off, w).reshape_symint(saved[i].sym_sizes());
        }
        off += w;
      }
    }
    if (ctx->needs_input_grad(r)) {
      std::vector<at::Tensor> parts2d;
      parts2d.reserve(r);
      for (size_t i = 0; i < r; ++i) {
        parts2d.push_back(saved[i].reshape_symint({m, saved[i].sym_size(-1)}));
      }
      grads[r] = g.t().mm(at::cat(parts2d, 1));  // dW = g^T x
    }
    if (has_bias && ctx->needs_input_grad(r + 1)) {
      grads[r + 1] = g.sum(0);
    }
    return grads;
  }
};

at::Tensor scatter_combine_autograd(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    c10::SymInt num_tokens) {
  return ScatterCombine::apply(expert_hidden, token_idx, gates, std::move(num_tokens));
}

at::Tensor cat_linear_autograd(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  return CatLinear::apply(parts, weight, bias);
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, Autograd, m) {
  m.impl("scatter_combine", &opreg::scatter_combine_autograd);
  m.impl("cat_linear", &opreg::cat_linear_autograd);
}
