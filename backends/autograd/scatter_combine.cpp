// Autograd of opreg::scatter_combine and opreg::scatter_combine_backward, for
// every device.
//
// out = S(g * h), out[t] = sum over rows r with idx[r] == t of g[r] h[r], is
// linear in h and in g, and so is its backward B(go, h, g) = (g * go[idx],
// <go[idx], h>) in each argument. Every derivative is therefore S or B again:
//   reverse:  d(h, g) = B(go, h, g)
//   B's:      d go = S(a, g) + S(h, b),  d(h, g) = B(go, a, b)  for grads (a, b)
//   forward:  d out = S(dh, g) + S(h, dg)
//             d B   = B(dgo, h, g) + B(go, dh, dg)
// called through the dispatcher, so double backward and forward-over-reverse
// work to any order with the fused kernels. The forwards re-enter the
// dispatcher below the autograd keys (the torchvision roi_align idiom), so the
// CPU or CUDA kernel is picked by the inputs' device. Sizes are SymInts so that
// AOTAutograd can trace these functions with dynamic shapes.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "autograd_util.h"

namespace opreg {
namespace {

using namespace opreg::autograd;  // any_requires_grad, tangent, primal, plus, or_zeros
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Typed handles are looked up once: the schemas are defined from Python
// before this library is loaded, so they exist by the first call.
at::Tensor call_forward(
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

std::tuple<at::Tensor, at::Tensor> call_backward(
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
    return call_forward(expert_hidden, token_idx, gates, std::move(num_tokens));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    // One fused kernel yields both grads, so needs_input_grad saves nothing. Under
    // create_graph the call records scatter_combine_backward's own node.
    auto [grad_hidden, grad_gates] = call_backward(grad_outputs[0], saved[0], saved[1], saved[2]);
    // One slot per forward argument; token_idx and num_tokens get none.
    return {grad_hidden, at::Tensor(), grad_gates, at::Tensor()};
  }
};

class ScatterCombineBackward : public torch::autograd::Function<ScatterCombineBackward> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
      const at::Tensor& grad_out,
      const at::Tensor& expert_hidden,
      const at::Tensor& token_idx,
      const at::Tensor& gates) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({grad_out, expert_hidden, token_idx, gates});
    ctx->set_materialize_grads(false);  // an unused output's zeros would cost two kernels
    auto [gh, gg] = call_backward(grad_out, expert_hidden, token_idx, gates);
    return {gh, gg};
  }

  // a, b: gradients w.r.t. (grad_hidden, grad_gates); either may be undefined.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &go = s[0], &h = s[1], &idx = s[2], &g = s[3];
    const at::Tensor &a = grads[0], &b = grads[1];
    at::Tensor d_go, d_h, d_g;
    if (ctx->needs_input_grad(0)) {
      if (a.defined()) d_go = call_forward(a, idx, g, go.sym_size(0));
      if (b.defined()) d_go = plus(d_go, call_forward(h, idx, b, go.sym_size(0)));
    }
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(3)) {
      std::tie(d_h, d_g) = call_backward(go, or_zeros(a, h), idx, or_zeros(b, g));
    }
    return {d_go, d_h, at::Tensor(), d_g};
  }
};

// The reverse-mode part: a node only when an input needs a gradient.
at::Tensor forward_reverse(
    const at::Tensor& h, const at::Tensor& idx, const at::Tensor& g, c10::SymInt t) {
  if (!any_requires_grad({&h, &g})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_forward(h, idx, g, std::move(t));
  }
  return ScatterCombine::apply(h, idx, g, std::move(t));
}

std::tuple<at::Tensor, at::Tensor> backward_reverse(
    const at::Tensor& go, const at::Tensor& h, const at::Tensor& idx, const at::Tensor& g) {
  if (!any_requires_grad({&go, &h, &g})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_backward(go, h, idx, g);
  }
  const variable_list out = ScatterCombineBackward::apply(go, h, idx, g);
  return {out[0], out[1]};
}

at::Tensor scatter_combine_autograd(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    c10::SymInt num_tokens) {
  const at::Tensor dh = tangent(expert_hidden), dg = tangent(gates);
  if (!dh.defined() && !dg.defined()) {
    return forward_reverse(expert_hidden, token_idx, gates, std::move(num_tokens));
  }
  const at::Tensor h = primal(expert_hidden), g = primal(gates);
  at::Tensor out = forward_reverse(h, token_idx, g, num_tokens);
  at::Tensor d_out;
  if (dh.defined()) d_out = call_forward(dh, token_idx, g, num_tokens);
  if (dg.defined()) d_out = plus(d_out, call_forward(h, token_idx, dg, num_tokens));
  out._set_fw_grad(d_out, /*level=*/0, /*is_inplace_op=*/false);
  return out;
}

std::tuple<at::Tensor, at::Tensor> scatter_combine_backward_autograd(
    const at::Tensor& grad_out,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  const at::Tensor dgo = tangent(grad_out), dh = tangent(expert_hidden), dg = tangent(gates);
  if (!dgo.defined() && !dh.defined() && !dg.defined()) {
    return backward_reverse(grad_out, expert_hidden, token_idx, gates);
  }
  const at::Tensor go = primal(grad_out), h = primal(expert_hidden), g = primal(gates);
  auto [gh, gg] = backward_reverse(go, h, token_idx, g);
  at::Tensor d_gh, d_gg;
  if (dgo.defined()) std::tie(d_gh, d_gg) = call_backward(dgo, h, token_idx, g);
  if (dh.defined() || dg.defined()) {
    auto [th, tg] = call_backward(go, or_zeros(dh, h), token_idx, or_zeros(dg, g));
    d_gh = plus(d_gh, th);
    d_gg = plus(d_gg, tg);
  }
  gh._set_fw_grad(d_gh, /*level=*/0, /*is_inplace_op=*/false);
  gg._set_fw_grad(d_gg, /*level=*/0, /*is_inplace_op=*/false);
  return {gh, gg};
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, Autograd, m) {
  m.impl("scatter_combine", &opreg::scatter_combine_autograd);
  m.impl("scatter_combine_backward", &opreg::scatter_combine_backward_autograd);
}
