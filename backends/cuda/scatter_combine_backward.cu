// opreg::scatter_combine_backward on CUDA: grad_x[r] = gate[r] * grad_out[t(r)] and
// grad_gates[r] = <grad_out[t(r)], x[r]>; rows with an index outside [0, num_tokens)
// get zeros. Two paths (the model that picks one is scatter_combine_model.cuh), both
// ONE launch and both computing each row with backward_row (scatter_combine_tokens.cuh),
// so they give the same bits:
//  * rows: one lane group per row, nothing to build first. grad_out[idx[r]] is read
//    once per row: at k rows per token in random order, with grad_out larger than L2,
//    most of those reads come from DRAM again (bf16 H4096 k8 T16384 random: 75 % of
//    the copy rate in the 2026-12-01 sweep, 88 % sorted).
//  * scan: the token blocks, each token's rows in turn, so grad_out[t] comes from DRAM
//    once.
// The host side (checks, allocation, dtype dispatch) is scatter_combine.cu.
#include "scatter_combine_model.cuh"
#include "scatter_combine_tokens.cuh"

namespace opreg {
namespace sc_detail {

namespace {

constexpr int kRowThreads = 256;

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kRowThreads, 4) scatter_backward_rows_kernel(const TokParams p) {
  const Group g = make_group(p.g_log2);
  const int64_t row = int64_t(blockIdx.x) * (kRowThreads >> p.g_log2) + (threadIdx.x >> p.g_log2);
  if (row >= p.n) return;  // the whole group
  const int64_t t = load_index(p.idx, row, p.idx64);
  if (t < 0 || t >= p.num_tokens) {
    zero_row<scalar_t, V>(p, g, static_cast<int>(row));
    return;
  }
  backward_one<scalar_t, V>(p, g, t, static_cast<int>(row));
}

} // namespace

template <typename scalar_t, int V>
TokPlan plan_backward(int n, int64_t num_tokens, int hvec, bool idx64, PathOverride force,
                      const DeviceFacts& dev, c10::DeviceIndex device) {
  namespace m = sc_model;
  constexpr int nve = m::kBackwardNve;
  TokPlan plan;
  TokParams& p = plan.p;
  p.num_tokens = num_tokens;
  p.n = n;
  p.hvec = hvec;
  p.idx64 = idx64;
  const double row_bytes = double(hvec) * V * sizeof(scalar_t);
  // Token blocks need a token and a column (and zero invalid rows in their first round).
  bool scan = num_tokens > 0 && hvec > 0 && n > 0 && force != PathOverride::kRows;
  if (scan) {
    const KernelFacts& kf = token_kernel_facts<scalar_t, V, true>(dev, device);
    const m::Geometry g = m::token_blocks(n, num_tokens, hvec, true, nve, kf.cs, kf.slots,
                                          tok_lcap(kf.smem, kTokMaxTb, kf.ring));
    if (force != PathOverride::kScan) {
      scan = num_tokens >= g.groups &&
             m::scan_us(n, idx64 ? 8 : 4, kf.cs, g.rounds) <
                 m::rows_us(n, num_tokens, row_bytes, double(dev.l2_bytes));
    }
    if (scan) {
      plan.grid = g.grid;
      plan.smem = kf.smem;
      p.tb = g.tb;
      p.lcap = tok_lcap(kf.smem, g.tb, kf.ring);
      p.g_log2 = g.g_log2;
      p.nve = g.nve;
      p.chunks = g.chunks;
      p.cs = kf.cs;
      p.ring = kf.ring;
      return plan;
    }
  }
  plan.rows = true;
  p.g_log2 = std::min(5, m::log2_pow2ceil(m::cdiv(std::max(hvec, 1), nve)));
  p.nve = nve;
  plan.grid = static_cast<int>(std::max<int64_t>(1, m::cdiv(n, kRowThreads >> p.g_log2)));
  p.cs = 1;
  return plan;
}

template <typename scalar_t, int V>
void launch_backward(const TokPlan& plan, cudaStream_t stream) {
  if (!plan.rows) return launch_token_kernel<scalar_t, V, true>(plan, stream);
  scatter_backward_rows_kernel<scalar_t, V>
      <<<static_cast<unsigned>(plan.grid), kRowThreads, 0, stream>>>(plan.p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

OPREG_SC_INSTANTIATE(plan_backward)
OPREG_SC_INSTANTIATE(launch_backward)

} // namespace sc_detail
} // namespace opreg
