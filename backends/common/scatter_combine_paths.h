// Which CUDA forward path opreg::scatter_combine runs (backends/cuda/scatter_combine.cu, the
// map of the paths at its top): the tiny kernel (a warp per token, every warp scanning all of
// token_idx), the small kernel (a block per 8 tokens, every block scanning it), or the large
// path (its local kernel, a block an SM scanning it, or count, place, reduce in one
// cooperative launch). Plain C++ on sizes only: no CUDA, no
// data, no sync, so that the choice can be compiled and checked on any machine
// (tests/cpp/scatter_combine_picks.cpp: tests/test_scatter_combine.py, and
// bench/scatter_paths.py --evaluate against an earlier run's forced paths).
#pragma once

#include <cstdint>

namespace opreg {
namespace scatter_combine_paths {

// The kernels' geometry (backends/cuda/scatter_combine.cuh takes these).
constexpr int64_t kSmallTok = 8;         // small path: tokens (= warps) per block
constexpr int64_t kSmallMaxRows = 8192;  // small path: a list entry (row << 3 | token) fits 16 bits
constexpr int64_t kTinyWarps = 4;        // tiny path: tokens (= warps) per block

// Column vectors of 16 bytes per lane per block of the small and tiny kernels (2 for 16-bit
// elements: 204 -> ~110 registers), for V elements per vector.
constexpr int64_t small_nv(int64_t v) {
  return v >= 8 ? 2 : 4;
}

// Column chunks (the grid's y) of the small and tiny kernels for rows of hvec vectors.
constexpr int64_t column_chunks(int64_t hvec, int64_t v) {
  return hvec <= 32 * small_nv(v) ? 1 : (hvec + 32 * small_nv(v) - 1) / (32 * small_nv(v));
}

// N * blocks index reads: every block scans all N indices, so the small path's time grows
// with this product while the large path pays a fixed ~5-8 us (zeroing, counting, grid
// barriers). H200, 2026-12-03, each shape's sums timed through both paths in a CUDA graph
// (bench/scatter_phases.py; the large path by appending ignored rows), small / large us:
// work 2^21: T1024 k8 H1024 bf16 17.3 / 13.1, fp32 20.7 / 15.9, T1024 k2 H4096 bf16 17.0 /
// 14.8; 2^20: T1024 k8 H128 bf16 10.3 / 8.4, T1024 k1 H4096 bf16 12.8 / 12.3; 589824:
// T1536 k2 H128 fp32 (the seeds' size) 4.6 / 5.7; 524288: T512 k8 H1024 bf16 10.0 / 11.2,
// T256 k8 H4096 bf16 10.6 / 13.2. The small path's slope there (~12 us per 2^20 reads)
// meets the large path's fixed cost between 0.65 and 0.9 x 2^20; this bound is in between.
// (It was 2^21 until then.)
constexpr int64_t kSmallMaxWork = int64_t(3) << 18;

// The tiny path's two costs against the small path's block-wide compaction (its index scan,
// a block scan and two barriers before the first row load):
//  * N * T * column chunks index reads: every warp scans all N indices, 8x the small path's
//    N * T / 8 * chunks. Where that passes ~2^20 the redundant scan outgrows the barriers it
//    saves (T1024 k2 H1024, 2^22: 6.1 us against 5.0; the seeds' T1536 k2 H128 fp32, 2^22.2:
//    4.6 against 4.1; T256 k8 H4096 bf16, 2^22: 11.4 against 6.9 on the H200).
//  * T * column chunks warps: from 2048 the tiny path loses even with short scans, where the
//    small path's 8-token blocks share one (T256 k1 H4096 bf16, N = 256, 2^19 reads: 4.19 us
//    against 3.65 on the H200, 4.18 against 3.73 on the H100; T1024 k1 H1024 bf16, 2^21:
//    4.16 against 3.89 on the H100).
// Both bounds from each path forced on the 91 shapes of bench/scatter_paths.py in CUDA graphs
// (int32 indices in expert order). The H200 (2026-12-04) set the first at 2^18, where it found
// no loss; two H100 runs (2026-12-05, forty-seventh and forty-eighth sessions) then showed the
// tiny path 13-21 % faster than the small one at six shapes between 2^19 and 2^20 with at most
// 1024 warps (T256 k8 H128 fp32 3.85 us against 4.58, bf16 4.65 against 5.78; T256 k8 H1024;
// T1024 k1 H128 fp32 2.54 against 3.20), and no shape within both bounds where it was slower
// than the small or large path (python bench/scatter_paths.py --evaluate <a run's JSON>; the
// forty-eighth session's run: bench/data/scatter_paths_h100_2026-12-05.json).
constexpr int64_t kTinyMaxWork = int64_t(1) << 20;
constexpr int64_t kTinyMaxWarps = 1024;

// Within the large path: its local form (backends/cuda/scatter_combine_large.cu, one block an
// SM, each reading all of token_idx and building its own tokens' lists in shared memory) or
// its fused cooperative kernel. The local form saves what the fused kernel pays beyond its
// reduce whatever the bytes (zeroing the counts, two grid barriers, the count's global
// atomics) and pays each block's read of token_idx, n x index bytes: where there are fewer
// than 4 tokens an SM, a whole scan for little reduce (and below one an SM, SMs left idle; the
// local blocks then owned multiples of 4 tokens, so T <= 256 ran 16-64 blocks).
// H100, each form forced in CUDA graphs (bench/scatter_paths.py --max-rows 65536, 103 shapes,
// int32 indices; bench/data/scatter_paths_forms_h100_2026-12-07.json), local / fused: <= 16
// KB 0.47-0.98 wherever the blocks cover the SMs (T4096 k1 H1024 bf16 7.2 against 10.6 us),
// 1.06-1.28 at T <= 256 with H4096 k8 (16-64 blocks); 32 KB 0.81-1.11; 64 KB 1.03-1.35; 128 KB
// 1.08-2.24. Then each block's scan started at its own row (the SMs no longer ask the same L2
// lines in step) and 16-bit wide rows got 768-thread blocks: on 37 shapes with N = T k in
// {2048 .. 16384} (H100, bench/scatter_paths.py --rows, tree and change in one call), local /
// fused at 32 KB 0.91-0.99 at 11 of 12 shapes (T4096 k2 H1024 bf16 9.25 against 11.21 us) and
// 1.09 at T1024 k8 H128 bf16 (8.38 against 7.69); at 64 KB 0.98-1.01 on wide rows, 1.15-1.38
// on H128. So the bound was 32 KB. Then the scan read token_idx in 16-byte loads, 2 a thread in
// flight (build_block_lists): on 42 shapes with N in {1024 .. 16384} (H100, 2026-12-07,
// bench/data/scatter_paths_scan_vec2_{tree,cand}_h100_2026-12-07.json, forms forced, one
// call) the local form 0.60-0.99x of its time before, and at 64 KB (T16384 k1, the sweep's
// only N there) local / fused H128 0.76-0.82, H1024 0.89-0.98, H4096 0.97-0.99. So the bound is
// 64 KB. Checked in a second call with the bound at 64 KB (H100, 2026-12-07,
// bench/data/scatter_paths_local64_h100_2026-12-07.json, int32 indices): local / fused at
// 64 KB 0.75-0.99 at all 18 shapes (T2048 k8, T8192 k2, T16384 k1; H128 0.75-0.93), at
// 128 KB (T4096 k8, T16384 k2) 0.97-1.22 (H128 k8 1.09-1.22).
constexpr int64_t kLocalMaxScanBytes = 64 * 1024;
constexpr int64_t kLocalMinTokensPerSm = 4;

// Does the local form pay for n rows of index_bytes indices into t tokens on sms SMs?
inline bool local_pays(int64_t n, int64_t index_bytes, int64_t t, int64_t sms) {
  return double(n) * double(index_bytes) <= double(kLocalMaxScanBytes) && t >= kLocalMinTokensPerSm * sms;
}

enum class Path { kAuto, kTiny, kSmall, kLarge };

// a * b * c <= limit, without the product overflowing int64 at absurd sizes (doubles are exact
// well past the limits compared here).
inline bool product_at_most(int64_t a, int64_t b, int64_t c, int64_t limit) {
  return double(a) * double(b) * double(c) <= double(limit);
}

// The forward's path for n rows into t tokens, gy column chunks: `forced` (OPREG_SCATTER_COMBINE_PATH,
// kAuto when unset) where that path can take the call, else the sizes' choice. tiny_ok: the
// tiny kernel can take it (token_idx 16-byte aligned, gy and t within its grid); small_ok: the
// small kernel can (n <= kSmallMaxRows, gy within its grid); local: the large path would run
// its local form (local_pays on this device). A forced tiny call the tiny kernel cannot take
// runs the small one where it can.
//
// Where the large path runs its local form, the small path is not chosen: kSmallMaxWork weighs
// the small path's scans against the fused kernel's fixed cost, which the local form does not
// pay (each of its blocks scans token_idx once, as each small block does, and there is one an
// SM where the small path has t / 8 x gy). H100, each path forced in CUDA graphs, local / small
// at the 30 shapes both take with t >= 4 an SM: 0.18-1.02, above 0.97 only at T1024 k1-k2
// H1024 (0.98-1.02: T1024 k1 H1024 bf16 3.56 against 3.48 us; T1024 k2 H128 fp32 2.88 against
// 3.33) (bench/data/scatter_paths_scan_vec2_cand_h100_2026-12-07.json); the seeds' T1536 k2 H128
// fp32 3.55 against 3.86 before the local scan's 16-byte loads, which made the local form
// faster everywhere (bench/data/scatter_paths_forms_h100_2026-12-07.json). With both rules in
// (bench/data/scatter_paths_local64_h100_2026-12-07.json): local / small 0.65-0.99 at the
// 12 T768 shapes (5.8 tokens an SM), and the seeds' 3.06 against 3.90 us.
inline Path choose_forward(int64_t n, int64_t t, int64_t gy, bool tiny_ok, bool small_ok, bool local,
                           Path forced) {
  if (tiny_ok && (forced == Path::kTiny ||
                  (forced == Path::kAuto && product_at_most(n, t, gy, kTinyMaxWork) &&
                   double(t) * double(gy) <= double(kTinyMaxWarps)))) {
    return Path::kTiny;
  }
  const int64_t gx = (t + kSmallTok - 1) / kSmallTok;
  if (small_ok && (forced == Path::kSmall || forced == Path::kTiny ||
                   (forced == Path::kAuto && !local && product_at_most(n, gx, gy, kSmallMaxWork)))) {
    return Path::kSmall;
  }
  return Path::kLarge;
}

}  // namespace scatter_combine_paths
}  // namespace opreg
