// CPU kernels for opreg::scatter_combine and opreg::scatter_combine_backward.
//
// Forward is a gather, not a scatter: rows are bucketed by token with a
// stable counting sort (CSR), then each token sums its own rows in increasing
// row order. No atomics, no shared writes, and the summation order does not
// depend on how tokens are split across threads, so results are bitwise
// reproducible for any thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

#include "scatter_combine_checks.h"

namespace opreg {
namespace {

// Calls f with token_idx's data pointer typed as int32_t or int64_t.
template <typename F>
void with_index_ptr(const at::Tensor& token_idx, F&& f) {
  if (token_idx.scalar_type() == at::kInt) {
    f(token_idx.const_data_ptr<int32_t>());
  } else {
    f(token_idx.const_data_ptr<int64_t>());
  }
}

// Calls f with gates' data pointer typed as float or scalar_t (the two
// dtypes scatter_combine_checks.h admits); for scalar_t == float both branches coincide.
template <typename scalar_t, typename F>
void with_gate_ptr(const at::Tensor& gates, F&& f) {
  if (gates.scalar_type() == at::kFloat) {
    f(gates.const_data_ptr<float>());
  } else {
    f(gates.const_data_ptr<scalar_t>());
  }
}

// Rows of token t are order[offsets[t] .. offsets[t+1]), ascending.
struct TokenRows {
  std::vector<int64_t> offsets;
  std::vector<int64_t> order;
};

// Serial range check, before anything is indexed by token: a bad index can
// never cause an out-of-bounds access, and the message names the first bad row.
template <typename idx_t>
void check_rows_in_range(const char* op, const idx_t* idx, int64_t n, int64_t num_tokens) {
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK_INDEX(
        idx[r] >= 0 && idx[r] < num_tokens,
        op, ": token_idx[", num(r), "] = ", num(idx[r]),
        " is out of range [0, num_tokens=", num(num_tokens), ")");
  }
}

// Serial O(N + T) counting sort of rows already range-checked.
template <typename idx_t>
TokenRows build_token_rows(const idx_t* idx, int64_t n, int64_t num_tokens) {
  TokenRows csr;
  csr.offsets.assign(num_tokens + 1, 0);
  csr.order.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    ++csr.offsets[idx[r] + 1];
  }
  std::partial_sum(csr.offsets.begin(), csr.offsets.end(), csr.offsets.begin());
  std::vector<int64_t> cursor(csr.offsets.begin(), csr.offsets.end() - 1);
  for (int64_t r = 0; r < n; ++r) {
    csr.order[cursor[idx[r]]++] = r;
  }
  return csr;
}

// Rows per parallel chunk so that a chunk touches ~GRAIN_SIZE elements.
int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elems_per_item));
}

// Hints the next token's rows into cache while the current token is summed:
// rows are visited in token order, i.e. at addresses the hardware prefetcher
// cannot predict (measured 48 vs 70 us at N=3072, H=128, fp32, 2 threads).
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* x, const int64_t* rows, int64_t count, int64_t h) {
#if defined(__GNUC__)
  constexpr int64_t line = 64 / sizeof(scalar_t);
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* xr = x + rows[j] * h;
    for (int64_t k = 0; k < h; k += line) {
      __builtin_prefetch(xr + k);
    }
  }
#endif
}

// acc = sum_j gates[rows[j]] * x[rows[j]], as the left fold
// ((g0 x0 + g1 x1) + g2 x2) + ..., i.e. exactly the row-by-row sum from 0.
// Rows are consumed two per pass to halve the loads/stores of acc.
template <typename acc_t, typename scalar_t, typename gate_t>
inline void sum_rows(
    acc_t* __restrict__ acc,
    const scalar_t* __restrict__ x,
    const gate_t* __restrict__ gates,
    const int64_t* rows,
    int64_t count,
    int64_t h) {
  if (count == 0) {
    std::fill(acc, acc + h, acc_t(0));
    return;
  }
  const auto row = [&](int64_t j) { return x + rows[j] * h; };
  const auto gate = [&](int64_t j) { return static_cast<acc_t>(gates[rows[j]]); };
  if (count == 1) {
    const scalar_t* __restrict__ x0 = row(0);
    const acc_t g0 = gate(0);
    for (int64_t k = 0; k < h; ++k) acc[k] = g0 * static_cast<acc_t>(x0[k]);
    return;
  }
  {  // first pair initialises acc (no zero fill, no read of acc)
    const scalar_t* __restrict__ x0 = row(0);
    const scalar_t* __restrict__ x1 = row(1);
    const acc_t g0 = gate(0), g1 = gate(1);
    for (int64_t k = 0; k < h; ++k) {
      acc[k] = g0 * static_cast<acc_t>(x0[k]) + g1 * static_cast<acc_t>(x1[k]);
    }
  }
  int64_t j = 2;
  for (; j + 1 < count; j += 2) {
    const scalar_t* __restrict__ x0 = row(j);
    const scalar_t* __restrict__ x1 = row(j + 1);
    const acc_t g0 = gate(j), g1 = gate(j + 1);
    for (int64_t k = 0; k < h; ++k) {
      acc[k] = (acc[k] + g0 * static_cast<acc_t>(x0[k])) + g1 * static_cast<acc_t>(x1[k]);
    }
  }
  if (j < count) {
    const scalar_t* __restrict__ x0 = row(j);
    const acc_t g0 = gate(j);
    for (int64_t k = 0; k < h; ++k) acc[k] += g0 * static_cast<acc_t>(x0[k]);
  }
}

template <typename scalar_t, typename gate_t>
void combine_tokens(
    const scalar_t* x,
    const gate_t* gates,
    const TokenRows& csr,
    int64_t num_tokens,
    int64_t h,
    scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;  // float for half/bf16/float, double for double
  // fp32/fp64 accumulate straight into the output row; bf16 needs an fp32
  // scratch row and a final rounding pass (fp16 is upcast before dispatch).
  constexpr bool in_place = std::is_same_v<acc_t, scalar_t>;
  const int64_t n = static_cast<int64_t>(csr.order.size());
  const int64_t avg_rows = num_tokens > 0 ? std::max<int64_t>(1, n / num_tokens) : 1;
  const int64_t* offsets = csr.offsets.data();
  const int64_t* order = csr.order.data();
  at::parallel_for(0, num_tokens, grain_for(avg_rows * h), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scratch(in_place ? 0 : h);
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {
        prefetch_rows(x, order + offsets[t + 1], offsets[t + 2] - offsets[t + 1], h);
      }
      scalar_t* o = out + t * h;
      // Tokens without rows get zeros here, so out needs no separate fill.
      if constexpr (in_place) {
        sum_rows(o, x, gates, order + offsets[t], offsets[t + 1] - offsets[t], h);
      } else {
        acc_t* acc = scratch.data();
        sum_rows(acc, x, gates, order + offsets[t], offsets[t + 1] - offsets[t], h);
        for (int64_t k = 0; k < h; ++k) o[k] = static_cast<scalar_t>(acc[k]);
      }
    }
  });
}

at::Tensor scatter_combine_cpu(
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates,
    int64_t num_tokens) {
  check_scatter_combine(expert_hidden, token_idx, gates, num_tokens);
  if (expert_hidden.scalar_type() == at::kHalf) {
    // Scalar c10::Half <-> float conversion is a software routine in a
    // baseline-ISA build (no F16C) and does not vectorize: a direct fp16
    // kernel measured several times slower. ATen's conversions are runtime-
    // dispatched to AVX2/F16C, and the math is fp32 either way, so upcasting
    // gives bit-identical results, faster.
    return scatter_combine_cpu(
               expert_hidden.to(at::kFloat), token_idx, gates.to(at::kFloat), num_tokens)
        .to(at::kHalf);
  }
  const at::Tensor x = expert_hidden.contiguous();
  const at::Tensor idx = token_idx.contiguous();
  const at::Tensor g = gates.contiguous();
  const int64_t n = x.size(0);
  const int64_t h = x.size(1);
  at::Tensor out = at::empty({num_tokens, h}, x.options());

  TokenRows csr;
  const bool empty_rows = h == 0;
  with_index_ptr(idx, [&](const auto* ip) {
    check_rows_in_range("scatter_combine", ip, n, num_tokens);
    // H == 0: nothing to sum, and the CSR's T + 1 offsets could not even be
    // allocated for a huge num_tokens (2^40) whose (T, 0) output is empty.
    if (!empty_rows) csr = build_token_rows(ip, n, num_tokens);
  });
  if (empty_rows) return out;

  AT_DISPATCH_FLOATING_TYPES_AND(
      at::kBFloat16, x.scalar_type(), "scatter_combine_cpu", [&] {
        with_gate_ptr<scalar_t>(g, [&](const auto* gp) {
          combine_tokens(
              x.const_data_ptr<scalar_t>(), gp, csr, num_tokens, h,
              out.mutable_data_ptr<scalar_t>());
        });
      });
  return out;
}

// grad_x[r] = gates[r] * grad_out[t_r];  grad_gates[r] = <grad_out[t_r], x[r]>.
// Each row is reduced by one thread with a fixed summation tree (8 lanes
// split by k % 8, then pairwise), so results do not depend on threading; the
// lanes break the serial add dependency and let the compiler vectorize.
template <typename scalar_t, typename gate_t, typename idx_t>
void combine_backward_rows(
    const scalar_t* __restrict__ grad_out,
    const scalar_t* __restrict__ x,
    const idx_t* __restrict__ idx,
    const gate_t* __restrict__ gates,
    int64_t n,
    int64_t h,
    scalar_t* __restrict__ grad_x,
    gate_t* __restrict__ grad_gates) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kLanes = 8;
  at::parallel_for(0, n, grain_for(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* __restrict__ gy = grad_out + static_cast<int64_t>(idx[r]) * h;
      const scalar_t* __restrict__ xr = x + r * h;
      scalar_t* __restrict__ gxr = grad_x + r * h;
      const acc_t g = static_cast<acc_t>(gates[r]);
      acc_t lane[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= h; k += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          const acc_t d = static_cast<acc_t>(gy[k + l]);
          gxr[k + l] = static_cast<scalar_t>(g * d);
          lane[l] += d * static_cast<acc_t>(xr[k + l]);
        }
      }
      for (int64_t l = 0; k < h; ++k, ++l) {  // tail (h % 8 elements)
        const acc_t d = static_cast<acc_t>(gy[k]);
        gxr[k] = static_cast<scalar_t>(g * d);
        lane[l] += d * static_cast<acc_t>(xr[k]);
      }
      const acc_t dot = ((lane[0] + lane[4]) + (lane[1] + lane[5])) +
          ((lane[2] + lane[6]) + (lane[3] + lane[7]));
      grad_gates[r] = static_cast<gate_t>(dot);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> scatter_combine_backward_cpu(
    const at::Tensor& grad_out,
    const at::Tensor& expert_hidden,
    const at::Tensor& token_idx,
    const at::Tensor& gates) {
  check_scatter_combine_backward(grad_out, expert_hidden, token_idx, gates);
  if (expert_hidden.scalar_type() == at::kHalf) {  // see scatter_combine_cpu
    auto [gx, gg] = scatter_combine_backward_cpu(
        grad_out.to(at::kFloat), expert_hidden.to(at::kFloat), token_idx, gates.to(at::kFloat));
    return {gx.to(at::kHalf), gg.to(gates.scalar_type())};
  }
  const at::Tensor gy = grad_out.contiguous();
  const at::Tensor x = expert_hidden.contiguous();
  const at::Tensor idx = token_idx.contiguous();
  const at::Tensor g = gates.contiguous();
  const int64_t n = x.size(0);
  const int64_t h = x.size(1);
  const int64_t num_tokens = gy.size(0);
  at::Tensor grad_x = at::empty({n, h}, x.options());
  at::Tensor grad_gates = at::empty({n}, g.options());

  with_index_ptr(idx, [&](const auto* ip) {
    // Checked first, so the parallel loop below can index grad_out unchecked.
    check_rows_in_range("scatter_combine_backward", ip, n, num_tokens);
    AT_DISPATCH_FLOATING_TYPES_AND(
        at::kBFloat16, x.scalar_type(), "scatter_combine_backward_cpu", [&] {
          with_gate_ptr<scalar_t>(g, [&](const auto* gp) {
            using gate_t = std::remove_const_t<std::remove_pointer_t<decltype(gp)>>;
            combine_backward_rows(
                gy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), ip, gp, n, h,
                grad_x.mutable_data_ptr<scalar_t>(), grad_gates.mutable_data_ptr<gate_t>());
          });
        });
  });
  return {grad_x, grad_gates};
}

} // namespace
} // namespace opreg

// Schemas are defined from Python (torch.library.define) before this library
// is loaded, so only implementations are registered here. num_tokens is a
// SymInt in the schema; a backend kernel may take it as int64_t because it
// only ever sees concrete values.
TORCH_LIBRARY_IMPL(opreg, CPU, m) {
  m.impl("scatter_combine", &opreg::scatter_combine_cpu);
  m.impl("scatter_combine_backward", &opreg::scatter_combine_backward_cpu);
}
