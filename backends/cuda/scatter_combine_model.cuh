// Which CUDA path opreg::scatter_combine and its backward run, and the token blocks'
// geometry, from a model of the time each path adds to moving the op's bytes once.
// Plain C++ on sizes only (no data, no sync, a few dozen operations on the host),
// included by the kernel files (scatter_combine_forward.cu, _backward.cu), which add
// what only the device can say (SMs, L2, resident clusters).
//
// THE PATHS (kernels in scatter_combine_tokens.cuh; all deterministic, same bits
// every run; the forward's paths give the same bits as each other):
//   forward scan   ONE launch. Thread block clusters of cs = 8 blocks (sm_90; 1 before)
//                  each own cs * tb consecutive tokens per round; every block scans
//                  1/cs of token_idx and appends each matching row into the owning
//                  block's shared memory (distributed shared memory), then each block
//                  sorts its tokens' rows and sums them, 16-byte vectors through a
//                  per-lane cp.async ring (192 bytes in flight per lane).
//   forward map    memset + count + overflow scan + place (the global map: every row
//                  read once, integer atomics) and then the same token blocks, filled
//                  from the map instead of by scanning.
//   backward scan  the forward's scan, then each token's rows in turn: grad_out[t] is
//                  read from DRAM once for all of the token's rows.
//   backward rows  one lane group per row, ONE launch, no lists: grad_out[idx[r]] is
//                  read once per row, so a token's row may come from DRAM k times.
//
// THE MODEL (us of device time each path adds to the same bytes at the copy rate):
//   scan      rounds * (R + ceil(n / cs) * ie / S)
//             a block (one per SM) scans n / cs indices per round from L2, and each
//             round costs R of barriers and list building before its first data load.
//   map       L * (4 + [T > 16384]) + (n * (ie + 8) + 36 T) / BW + rounds_map * R
//             the map's launches (memset, count, scan, place, and the tile sums past one
//             scan tile) and its bytes (indices read, slots and ell written, counts and
//             ell read back), then the token blocks' rounds, one block per SM.
//   rows      (n - T) * row_bytes * p_miss / BW,  p_miss = max(0, 1 - l2 / 2 / (T * row_bytes))
//             grad_out re-read for every row after a token's first (rows in random order
//             are the case the op cannot rule out), missing the half of L2 that the
//             streams of x and grad_x leave it.
//   forward: scan iff scan <= map.  backward: scan iff scan < rows and the tokens fill
//   every lane group of the grid (a token's rows go one after the other in its group:
//   with fewer tokens than groups, lanes idle that the row-parallel kernel would use).
//   The host's side (a launch costs ~2 us of host time on the H200's VM) only adds to
//   the map path, which the model picks at large n only, where the device is the bound.
//
// CONSTANTS (H200; BW and L are measured, S and R are estimates the forced
// OPREG_SCATTER_COMBINE_PATH runs of bench/sweep.py check):
//   BW  4.17e6 bytes/us  the sweep's device-to-device copy rate (2026-12-01, 4169.5 GB/s).
//   L   1.0 us           per extra launch on the device: the map's five small launches cost
//                        ~5 us in bench/RESULTS.md's first session.
//   S   5.0e4 bytes/us   one SM's scan of token_idx from L2: 512 threads x 4 x 16 bytes =
//                        32 KB in flight per ~0.6 us L2 round trip under load, ~ the 132 SMs'
//                        share of an L2 of 7-10 TB/s.
//   R   1.5 us           per round: two cluster barriers, four block barriers, the first
//                        round trip of the scan and of the data.
//   ie  4 or 8 bytes     an index.
//
// PICKS on bench/sweep.py's grid (its 232 shapes whose backward moves >= 16 MB), for the
// H200 (132 SMs, 16 resident clusters of 8, 50 MB L2): forward scan everywhere but three
// shapes with int64 indices, T65536 k8 (bf16 H128, bf16 H1024, fp32 H128: 524288 indices
// of 8 bytes, 512 KB per SM to scan, 12 vs 8.6 us), which take the map; one round per
// cluster everywhere. Backward token blocks where grad_out outgrows half of L2 at k >= 2
// (bf16 H4096 k2/k8 T >= 4096, H1024 k2 T65536 and k8 T >= 16384, fp32 alike, fp32 H128
// k8 T65536), the row-parallel kernel elsewhere (k = 1: nothing to share).
#pragma once

#include <algorithm>
#include <cstdint>

namespace opreg {
namespace sc_model {

constexpr double kCopyBytesPerUs = 4.17e6;
constexpr double kLaunchUs = 1.0;
constexpr double kScanBytesPerUs = 5.0e4;
constexpr double kRoundUs = 1.5;

// The kernels' shape (scatter_combine.cuh's kTokThreads, kTokMaxTb).
constexpr int kThreads = 512;
constexpr int kMaxTb = 1024;

inline int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

inline int log2_pow2ceil(int64_t v) {
  int l = 0;
  while ((int64_t(1) << l) < v) ++l;
  return l;
}

// Vectors per lane per item. A lane's work is a stream of 16-byte vectors through its
// ring (scatter_combine_tokens.cuh), kRing in flight however they split into rows and
// items, so nve only sets how many lanes share a token (G = pow2ceil(hvec / nve) <= 32:
// short rows get short groups, H128 bf16 2 lanes) and how many items there are: the
// forward takes the largest nve in [nve_min, 8] whose items fill every lane group of
// every block (T1024 H4096 bf16: 8; T256 H4096: 2, else 3/4 of the groups would idle),
// never below the vectors a ring tuple holds (nve_min: 2 for 16-bit types, 4 for fp32).
// Backward: 4, for both of its paths (the same G walks each lane's vectors alike, so
// they give the same bits); its items are tokens.
constexpr int kForwardNveMax = 8;
constexpr int kBackwardNve = 4;

struct Geometry {
  int nve = 8;      // vectors per lane per item
  int g_log2 = 0;   // lanes per token group
  int chunks = 1;   // forward: column chunks (items) per token
  int tb = 1;       // tokens per block and round
  int grid = 1;     // blocks
  int64_t rounds = 1;
  int64_t groups = 0;  // lane groups on the device (grid * groups per block)
};

inline void lane_split(Geometry& g, int hvec, int nve) {
  g.nve = nve;
  g.g_log2 = std::min(5, log2_pow2ceil(cdiv(std::max(hvec, 1), nve)));
  g.chunks = static_cast<int>(std::max<int64_t>(1, cdiv(hvec, (int64_t(1) << g.g_log2) * nve)));
}

// Token blocks: as few rounds as the resident clusters allow (slots: clusters of cs
// blocks that fit at once), tokens spread over all of them, at most what lcap_min
// entries hold at 1.25x the mean rows per token (uneven routing overflows into the
// slow but exact rescan, not into wrong results).
inline Geometry token_blocks(int64_t n, int64_t num_tokens, int hvec, bool backward, int nve_min, int cs,
                             int64_t slots, int lcap_min) {
  Geometry g;
  slots = std::max<int64_t>(1, slots);
  const int64_t blocks = slots * cs;
  if (backward) {
    lane_split(g, hvec, kBackwardNve);
  } else {
    for (int nve = kForwardNveMax;; nve /= 2) {
      lane_split(g, hvec, nve);
      const int64_t groups = kThreads >> g.g_log2;
      if (nve / 2 < nve_min || num_tokens * g.chunks >= blocks * groups) break;
    }
  }
  const double kavg = num_tokens > 0 ? double(n) / double(num_tokens) : 0.0;
  const int64_t tb_lcap = std::max<int64_t>(1, static_cast<int64_t>((lcap_min - 64) / (1.25 * kavg + 1e-9)));
  const int64_t tb_target = cdiv(std::max<int64_t>(num_tokens, 1), blocks);
  g.tb = static_cast<int>(std::max<int64_t>(1, std::min({tb_target, int64_t(kMaxTb), tb_lcap})));
  const int64_t ncr = std::max<int64_t>(1, cdiv(num_tokens, int64_t(cs) * g.tb));
  const int64_t ncl = std::min(slots, ncr);
  g.grid = static_cast<int>(ncl * cs);
  g.rounds = cdiv(ncr, ncl);
  g.groups = int64_t(g.grid) * (kThreads >> g.g_log2);
  return g;
}

inline double scan_us(int64_t n, int ielt, int cs, int64_t rounds) {
  return double(rounds) * (kRoundUs + double(cdiv(n, cs)) * ielt / kScanBytesPerUs);
}

inline double map_us(int64_t n, int64_t num_tokens, int ielt, int64_t rounds_map, int64_t scan_tile) {
  const int launches = 4 + (num_tokens > scan_tile ? 1 : 0);
  return launches * kLaunchUs + (double(n) * (ielt + 8) + 36.0 * double(num_tokens)) / kCopyBytesPerUs +
         double(rounds_map) * kRoundUs;
}

inline double rows_us(int64_t n, int64_t num_tokens, double row_bytes, double l2_bytes) {
  const double gy = double(num_tokens) * row_bytes;
  if (gy <= 0.0 || n <= num_tokens) return 0.0;
  const double miss = std::max(0.0, 1.0 - 0.5 * l2_bytes / gy);
  return double(n - num_tokens) * row_bytes * miss / kCopyBytesPerUs;
}

// The L2 prefetch of the forward scan path (sm_90): while the blocks scan, their rows
// are fetched into the half of L2 the output stream leaves, so that DRAM works during
// the scan and the barriers; a block prefetches the rows of its first pf_tok tokens
// (all of them when the whole input fits).
inline int prefetch_tokens(int64_t n, int64_t num_tokens, double row_bytes, int grid, int tb,
                           double l2_bytes) {
  if (num_tokens <= 0 || row_bytes <= 0.0) return 0;
  const double kavg = std::max(1.0, double(n) / double(num_tokens));
  const double per_block = 0.5 * l2_bytes / std::max(grid, 1);
  return static_cast<int>(std::min<double>(tb, per_block / (kavg * row_bytes)));
}

} // namespace sc_model
} // namespace opreg
