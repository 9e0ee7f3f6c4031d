// Autograd of opreg::cat_linear and opreg::cat_linear_stacked, for every device.
//
// y = cat(parts, -1) W^T + b is linear in the parts and in (W, b):
//   reverse:  d parts = split(g W), dW = g^T cat(parts), db = sum(g), in ATen ops,
//             so double backward differentiates them as usual;
//   forward:  dy = lin(d parts, W) + lin(parts, dW, db), with lin the op itself.
// The forwards re-enter the dispatcher below the autograd keys (the torchvision
// roi_align idiom), so the CPU or CUDA kernel is picked by the inputs' device.
// Sizes are handled as SymInts so that AOTAutograd can trace these functions
// with dynamic shapes.
//
// One exception: where the CUDA kernel's SIMT path loses to its GEMM path
// (cat_linear_model.h's grad_runs_eager: there a call without gradients runs the GEMM path
// or the dot kernel), a call that needs gradients runs eager's own ops,
// at::linear(at::cat(parts, -1), W, b), and autograd records what eager records. The GEMM path's forward is those kernels anyway,
// and the op's node (CatLinear, below) would add to them: its backward re-makes the cat for
// dW (eager saves the one its forward made) and it saves R + 1 tensors. On the H200 sweep
// (2026-12-01, forward + backward, the former size thresholds' paths) the op was > 3 %
// slower than eager at 59 of the 74 list-form shapes on the GEMM path (median 1.09x at R2,
// 1.11x R8, 1.13x R32) and 39 of the 74 stacked ones, against 21 of the 106 list shapes on
// the SIMT path.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "autograd_util.h"
#include "cat_linear_checks.h"
#include "cat_linear_model.h"

namespace opreg {
namespace {

using namespace opreg::autograd;  // any_requires_grad, tangent, primal, plus, or_zeros
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

// Typed handles are looked up once: the schemas are defined from Python
// before this library is loaded, so they exist by the first call.
at::Tensor call_cat_linear(at::TensorList parts, const at::Tensor& weight, const OptTensor& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("opreg::cat_linear", "")
          .typed<at::Tensor(at::TensorList, const at::Tensor&, const OptTensor&)>();
  return op.call(parts, weight, bias);
}

at::Tensor call_cat_linear_stacked(
    const at::Tensor& x, int64_t dim, const at::Tensor& weight, const OptTensor& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("opreg::cat_linear_stacked", "")
          .typed<at::Tensor(const at::Tensor&, int64_t, const at::Tensor&, const OptTensor&)>();
  return op.call(x, dim, weight, bias);
}

bool has(const OptTensor& t) {
  return t.has_value() && t->defined();
}

// Sizes known (not symbolic, as under torch.compile with dynamic shapes)?
bool concrete(const at::Tensor& t) {
  for (const c10::SymInt& s : t.sym_sizes()) {
    if (!s.maybe_as_int().has_value()) return false;
  }
  return true;
}

// Would the CUDA kernel run its GEMM path for M rows of R parts of these widths? (The
// model's estimate of the SIMT kernel's 16-byte loads from the widths alone, and the H200's
// SM count: this library has no CUDA to ask the device.)
bool cuda_runs_gemm(int64_t M, const at::Tensor& weight, int64_t R, int64_t chunks, bool vec) {
  namespace model = cat_linear_model;
  const int64_t elt = static_cast<int64_t>(weight.element_size());
  const model::Work w{M, weight.size(0), weight.size(1), R, chunks, elt,
                      vec && weight.size(1) % (16 / elt) == 0};
  return model::grad_runs_eager(w, model::kH200Sms);
}

// cat_linear's call on CUDA with gradients: eager's ops where the kernel would run them
// (the header comment); checked first, so errors read as the op's own.
bool eager_route(at::TensorList parts, const at::Tensor& weight, const OptTensor& bias) {
  if (!weight.is_cuda() || !concrete(weight)) return false;
  for (const at::Tensor& p : parts) {
    if (!concrete(p)) return false;
  }
  check_cat_linear(parts, weight, bias);
  const at::Tensor& p0 = parts[0];
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < p0.dim(); ++d) M *= p0.size(d);
  const int64_t elt = static_cast<int64_t>(weight.element_size());
  const int64_t tk = cat_linear_model::chunk_cols(elt), v = 16 / elt;
  int64_t chunks = 0;
  bool vec = true;
  for (const at::Tensor& p : parts) {
    chunks += cat_linear_model::cdiv(p.size(-1), tk);
    vec = vec && p.size(-1) % v == 0;
  }
  return cuda_runs_gemm(M, weight, static_cast<int64_t>(parts.size()), chunks, vec);
}

at::Tensor eager_cat_linear(at::TensorList parts, const at::Tensor& weight, const OptTensor& bias) {
  return at::linear(parts.size() == 1 ? parts[0] : at::cat(parts, -1), weight, bias);
}

// The same for cat_linear_stacked(x, dim, ...): the slices are x without dim.
bool eager_route_stacked(const at::Tensor& x, int64_t dim, const at::Tensor& weight,
                         const OptTensor& bias) {
  if (!weight.is_cuda() || !concrete(weight) || !concrete(x)) return false;
  const int64_t d = check_cat_linear_stacked(x, dim, weight, bias);
  const int64_t R = x.size(d), last = d == x.dim() - 1 ? x.dim() - 2 : x.dim() - 1;
  const int64_t width = x.size(last);
  int64_t M = 1;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != d && i != last) M *= x.size(i);
  }
  const int64_t elt = static_cast<int64_t>(weight.element_size());
  const int64_t chunks = R * cat_linear_model::cdiv(width, cat_linear_model::chunk_cols(elt));
  return cuda_runs_gemm(M, weight, R, chunks, width % (16 / elt) == 0);
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
        // a 2-D part's gradient is the narrow itself (eager's CatBackward0 hands back the
        // same views): no reshape call per part, host time at many small parts
        const at::Tensor gi = gx.narrow_symint(1, off, w);
        grads[i] = parts[i].dim() == 2 ? gi : gi.reshape_symint(parts[i].sym_sizes());
      }
      off += w;
    }
  }
  if (needs[r]) {
    bool flat = true;  // every part already (M, w): cat them as they are
    for (size_t i = 0; i < r; ++i) {
      flat = flat && parts[i].dim() == 2;
    }
    if (flat) {
      grads[r] = g.t().mm(r == 1 ? parts[0] : at::cat(parts, 1));  // dW = g^T x
    } else {
      std::vector<at::Tensor> parts2d;
      parts2d.reserve(r);
      for (size_t i = 0; i < r; ++i) {
        parts2d.push_back(parts[i].reshape_symint({m, parts[i].sym_size(-1)}));
      }
      grads[r] = g.t().mm(at::cat(parts2d, 1));
    }
  }
  if (needs[r + 1]) {
    grads[r + 1] = g.sum(0);
  }
  return grads;
}

class CatLinear : public torch::autograd::Function<CatLinear> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx, at::TensorList parts, const at::Tensor& weight, const OptTensor& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::vector<at::Tensor> to_save(parts.begin(), parts.end());
    to_save.push_back(weight);
    ctx->save_for_backward(to_save);
    ctx->saved_data["has_bias"] = has(bias);
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
      const OptTensor& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["dim"] = dim < 0 ? dim + x.dim() : dim;
    ctx->saved_data["has_bias"] = has(bias);
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

// Forward-mode tangent of y = lin(X, W, b): dy = lin(dX, W, -) + lin(X, dW, db).
// lin(true, w, b) applies the op to the tangent input dX (only called when
// has_dx), lin(false, w, b) to the primal input X.
template <typename Lin>
at::Tensor linear_tangent(
    const Lin& lin, bool has_dx, const at::Tensor& w, const at::Tensor& dw,
    const at::Tensor& db, const at::Tensor& out) {
  at::Tensor t;
  if (has_dx) t = lin(true, w, std::nullopt);
  if (dw.defined()) {
    t = plus(t, lin(false, dw, db.defined() ? OptTensor(db) : std::nullopt));
  } else if (db.defined()) {
    t = plus(t, db.expand_symint(out.sym_sizes()));  // set_fw_grad copies an expanded one
  }
  return t;
}

at::Tensor cat_linear_reverse(at::TensorList parts, const at::Tensor& weight, const OptTensor& bias) {
  const at::Tensor none;
  if (!any_requires_grad({&weight, has(bias) ? &*bias : &none}, parts)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_cat_linear(parts, weight, bias);
  }
  if (eager_route(parts, weight, bias)) return eager_cat_linear(parts, weight, bias);
  return CatLinear::apply(parts, weight, bias);
}

at::Tensor cat_linear_autograd(at::TensorList parts, const at::Tensor& weight, const OptTensor& bias) {
  // No part has a tangent unless forward mode is on (asked once, not per part: see
  // forward_ad_active).
  bool has_dx = false;
  if (forward_ad_active()) {
    for (const at::Tensor& part : parts) {
      has_dx = has_dx || tangent(part).defined();
    }
  }
  const at::Tensor dw = tangent(weight), db = tangent(bias);
  // The common call (no forward mode) builds no per-part vectors: host time per call is
  // what this op competes on at small sizes.
  if (!has_dx && !dw.defined() && !db.defined()) return cat_linear_reverse(parts, weight, bias);
  std::vector<at::Tensor> p(parts.size()), dp(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    p[i] = primal(parts[i]);
    dp[i] = or_zeros(tangent(parts[i]), p[i]);
  }
  const at::Tensor w = primal(weight);
  at::Tensor out = cat_linear_reverse(p, w, primal(bias));
  const auto lin = [&](bool on_tangent, const at::Tensor& wt, const OptTensor& b) {
    return call_cat_linear(on_tangent ? dp : p, wt, b);
  };
  out._set_fw_grad(linear_tangent(lin, has_dx, w, dw, db, out), /*level=*/0, /*is_inplace_op=*/false);
  return out;
}

at::Tensor cat_linear_stacked_reverse(
    const at::Tensor& x, int64_t dim, const at::Tensor& weight, const OptTensor& bias) {
  const at::Tensor none;
  if (!any_requires_grad({&x, &weight, has(bias) ? &*bias : &none})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return call_cat_linear_stacked(x, dim, weight, bias);
  }
  if (eager_route_stacked(x, dim, weight, bias)) {
    const int64_t d = dim < 0 ? dim + x.dim() : dim;  // checked by eager_route_stacked
    return eager_cat_linear(x.unbind(d), weight, bias);  // eager's cat(x.unbind(d), -1)
  }
  return CatLinearStacked::apply(x, dim, weight, bias);
}

at::Tensor cat_linear_stacked_autograd(
    const at::Tensor& x, int64_t dim, const at::Tensor& weight, const OptTensor& bias) {
  const at::Tensor dx = tangent(x), dw = tangent(weight), db = tangent(bias);
  if (!dx.defined() && !dw.defined() && !db.defined()) {
    return cat_linear_stacked_reverse(x, dim, weight, bias);
  }
  const at::Tensor xp = primal(x), w = primal(weight);
  at::Tensor out = cat_linear_stacked_reverse(xp, dim, w, primal(bias));
  const auto lin = [&](bool on_tangent, const at::Tensor& wt, const OptTensor& b) {
    return call_cat_linear_stacked(on_tangent ? dx : xp, dim, wt, b);
  };
  out._set_fw_grad(linear_tangent(lin, dx.defined(), w, dw, db, out), /*level=*/0,
                   /*is_inplace_op=*/false);
  return out;
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, Autograd, m) {
  m.impl("cat_linear", &opreg::cat_linear_autograd);
  m.impl("cat_linear_stacked", &opreg::cat_linear_stacked_autograd);
}
