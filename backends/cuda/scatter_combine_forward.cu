// opreg::scatter_combine forward on CUDA: the plan (scan or map, the token blocks'
// geometry; the model is scatter_combine_model.cuh) and the launch of the token-block
// kernel (scatter_combine_tokens.cuh). The host side, which allocates, runs the map's
// pre-pass when the plan says so and calls these, is scatter_combine.cu.
#include <algorithm>
#include <climits>

#include "scatter_combine_model.cuh"
#include "scatter_combine_tokens.cuh"

namespace opreg {
namespace sc_detail {

template <typename scalar_t, int V>
TokPlan plan_forward(int n, int64_t num_tokens, int hvec, bool idx64, PathOverride force,
                     const DeviceFacts& dev, c10::DeviceIndex device) {
  namespace m = sc_model;
  TokPlan plan;
  const KernelFacts& kf = token_kernel_facts<scalar_t, V, false>(dev, device);
  const int ielt = idx64 ? 8 : 4;
  // The ring path's tuples hold NH vectors; the register path (V = 1) takes 8 at a time.
  const int nve_min = V > 1 ? RingShape<scalar_t, V>::NH : m::kForwardNveMax;
  const int lcap_min = tok_lcap(kf.smem, kTokMaxTb, kf.ring);
  const m::Geometry scan = m::token_blocks(n, num_tokens, hvec, false, nve_min, kf.cs, kf.slots, lcap_min);
  const m::Geometry map = m::token_blocks(n, num_tokens, hvec, false, nve_min, 1, kf.blocks, lcap_min);
  // The map's tables are indexed t * kEll in int.
  const bool map_ok = num_tokens < INT_MAX / kEll;
  bool use_map = map_ok && m::scan_us(n, ielt, kf.cs, scan.rounds) >
                               m::map_us(n, num_tokens, ielt, map.rounds, kScanTile);
  if (force == PathOverride::kScan) use_map = false;
  if (force == PathOverride::kMap) use_map = map_ok;
  const m::Geometry& g = use_map ? map : scan;
  plan.map = use_map;
  plan.grid = g.grid;
  plan.smem = kf.smem;
  TokParams& p = plan.p;
  p.num_tokens = num_tokens;
  p.n = n;
  p.hvec = hvec;
  p.tb = g.tb;
  p.lcap = tok_lcap(kf.smem, g.tb, kf.ring);
  p.g_log2 = g.g_log2;
  p.nve = g.nve;
  p.chunks = g.chunks;
  p.cs = use_map ? 1 : kf.cs;
  p.ring = kf.ring;
  p.idx64 = idx64;
  p.map = use_map;
  const int64_t row_bytes = int64_t(hvec) * V * sizeof(scalar_t);
  p.row_bytes = static_cast<unsigned>(std::min<int64_t>(row_bytes, UINT_MAX & ~15u));
  // The bulk prefetch needs 16-byte aligned rows of a multiple of 16 bytes: V > 1.
  const bool prefetch = !use_map && V > 1 && kf.sm90 && row_bytes < (int64_t(1) << 31);
  p.pf_tok = prefetch ? m::prefetch_tokens(n, num_tokens, double(row_bytes), g.grid, g.tb, double(dev.l2_bytes))
                      : 0;
  return plan;
}

template <typename scalar_t, int V>
void launch_forward(const TokPlan& plan, cudaStream_t stream) {
  launch_token_kernel<scalar_t, V, false>(plan, stream);
}

OPREG_SC_INSTANTIATE(plan_forward)
OPREG_SC_INSTANTIATE(launch_forward)

} // namespace sc_detail
} // namespace opreg
