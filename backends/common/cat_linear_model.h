// Which CUDA path opreg::cat_linear (and cat_linear_stacked) runs: the fused single-launch
// SIMT kernel (backends/cuda/cat_linear_simt.cu), for the tiniest calls the warp-per-outputs
// dot kernel (backends/cuda/cat_linear_dot.cu), or eager's at::cat + cuBLAS (the "GEMM
// path"), from a model of each path's time per call. Shared by the CUDA kernel
// (backends/cuda/cat_linear.cu, the forward's choice) and the autograd kernel
// (backends/autograd/cat_linear.cpp: with gradients, where the GEMM path would run, it runs
// eager's own ops instead). Plain C++ on sizes only: no CUDA, no data, no sync; a few dozen
// floating-point operations (well under 1 us on the host).
//
// THE MODEL (us per call, back to back, so a call costs max(host, device)):
//
//   SIMT, device:  t0 + max(L * W * C,  ceil(T / S) * (s0 * C + s1 * K))  + e * W
//       T = ceil(M / 16) * ceil(N / 32) output tiles = blocks, S = SMs, W = ceil(T / (2 S))
//       waves (2 blocks fit per SM: 96 KB of shared memory each), C = sum over parts of
//       ceil(H_i / (256 bytes / element size)) k chunks each block walks in turn (a chunk never
//       straddles a part), K = sum H_i. Each block walks ALL of K itself (no split-K), so with
//       few tiles only T of the 132 SMs work; the first term is one block's pipeline step
//       (latency-bound while an SM holds one block), the second the SMs' issue rate (s1 * K:
//       the 16 x 32 tile's FMAs and shared-memory reads per k column, s0 per chunk), the third
//       each wave's epilogue (the 8 warps' partial tiles summed through shared memory).
//       With misaligned parts (no 16-byte loads): t0 + W * C * (256 / element size) * nv.
//   GEMM, per call: max(Hg0 + Hg1 * R,  cat + mm) with, on the device,
//       cat = tl + 2 M K e / BW (read + write; none for one part),
//       mm  = tl + max(2 M N K / F,  (M K + N K + M N) e / BW),  e = element size.
//       Hg is the host time of the op call on this path (argument parsing, at::cat of R
//       tensors, addmm): the GEMM path is host-bound at every small shape.
//   SIMT's own host time (op call + one launch) is below Hg, so SIMT is faster iff its device
//   time is below the GEMM path's whole time: a fused kernel runs iff simt_us < gemm_us.
//   DOT, device: d0 + dL * U * W + dI * E / S + dR * R * W, where the call's kDotCols-output
//       warp tiles number G = M ceil(N / 4), W = ceil(G / (64 S)) waves of them, each walking
//       ceil(K / 32 v) steps of one v-element vector per lane (v = 16 bytes, or 1 element on
//       misaligned parts), U = ceil(K / 64 v) rounds of 2 steps whose loads are in flight
//       together (a memory round trip each), E = G ceil(K / 32 v) v elements a lane multiplies
//       by 4 weight rows, R parts its cursor walks. It has SIMT's host time, so it replaces
//       SIMT where it is faster on the device: where a fused kernel runs, the dot kernel
//       does iff 1.5 dot_us < simt_us; and where the SIMT kernel loses to the GEMM path, the
//       dot kernel takes the call iff 2 dot_us < gemm_us (back to back: the GEMM path's
//       host time there; R8 B2 H512 K2048 bf16 40.7 -> 15.0 us). That take is for calls
//       without gradients outside a CUDA graph only: with gradients the GEMM path's shapes
//       run eager's ops (grad_runs_eager; its backward was never timed against the dot
//       kernel's), and a capture keeps the GEMM path there (graph_prefers_gemm).
//   IN A CUDA GRAPH (the call made while the stream captures one) nothing costs host time, and
//   cuBLAS, bf16 especially, beats a fused pick at some shapes (R8 B1024 H64 K256 bf16: the
//   SIMT kernel 22.7 us per replayed call, at::cat + cuBLAS 5.5). There the GEMM path's device
//   time is modelled alone,
//       gemm_graph = g0 + [R > 1] (gc + 2 M K e / BW) + max(2 M N K / Fg,  (M K + N K + M N) e / BW),
//   and a fused pick gives way to it iff margin x gemm_graph < the pick's modelled device time
//   (dot_us or simt_us): only that way, never GEMM -> fused, so a call eager would run on
//   cuBLAS still does. In a graph the GEMM path is eager's own kernels (at::cat + cuBLAS: forced
//   GEMM / eager 0.99-1.03 over the fiftieth session's 182 shapes on the H200, the rest timing
//   spread), so a move to it is never slower than eager; it can only give up a fused kernel's
//   lead. A margin above 1 keeps such leads where the GEMM model may under-predict; 1 trusts
//   the model. (backends/cuda/cat_linear.cu: the capture's switch needs cuBLAS set up on that
//   thread outside the capture, which a call that would switch does first.)
//
// CONSTANTS (H200, torch 2.11; the sweep is bench/sweep.py --json, 2026-12-01, its forced
// OPREG_CAT_LINEAR_PATH=simt|gemm columns, list form, no_grad):
//   S    132 SMs (the device's count in the CUDA kernel; the autograd kernel, which has no
//        CUDA, assumes the H200's 132).
//   t0   3.0 us   launch + pipeline fill: the intercept of the few-block SIMT rows (R2 B4 H512
//                 K256 fp32, 16 chunks: 14.1 us; R32 B4 H512 K256 fp32, 256 chunks: 186.0 us).
//   L    0.75 us  per chunk of a block alone on its SM: the slope of those two rows (0.72) and
//                 of R32 H64 fp32 (32 single-chunk parts: 28.3 us, 0.79).
//   s0   0.22 us, s1 4.7 ns (fp32) / 5.9 ns (16-bit) / 9.4 ns (fp64: half the FP32 FMA rate)
//                 per k column: an SM's issue time for one 16 x 32 tile, from the rows with two
//                 blocks per SM (R8 B1024 H512 K256 fp32 132.8 us and bf16 121.3 us, R8 B1024
//                 H64 K2048 bf16 172.9 us: half-empty 128-column chunks). s1 fp32 = 512 FMAs
//                 per 4.7 ns = 43 % of an SM's FP32 FMA peak (Nsight: issue-bound, 36 %).
//   e    0.9 us   per wave: R2 B8192 H64 K2048 fp32, 125 waves of 2 chunks, 385.9 us.
//   nv   42 ns    per k column of a chunk on the scalar path: R4 B1 H300 K700 bf16 60.9 us,
//                 R12 B50 H100 K300 bf16 74.6 us (12 chunks each).
//   Hg   22 + 0.4 R us: the forced-GEMM column at the smallest shapes (B <= 64, H64 K256):
//                 min..median R2 23.4..27.0, R8 24.5..30.5, R32 35.0..37.2 us; taken at the low
//                 end, so that host noise (+-30 % on this VM) errs towards the GEMM path, which
//                 is eager's own.
//   tl   2 us     per extra kernel on the device.
//   BW   4.17 MB/us  the sweep's measured device-to-device copy rate (spec 4.8 TB/s).
//   F    790 TFLOP/s 16-bit (0.8 x the 989 dense bf16 peak), 50 fp32 (0.75 x the 67 FP32
//                 peak: allow_tf32 off, as eager's default), 50 fp64 (0.75 x 67 FP64 tensor
//                 cores). Measured: bf16 R32 B8192 H512 K2048 ~800 after the cat, fp32 49.8.
//
// DOT constants (H200, torch 2.11; bench/cat_linear_paths.py, 2026-12-04: each path forced,
// device time from CUDA graphs, 134 shapes with the dot path timed; least squares on the
// relative error):
//   d0   1.54 us  launch and one round trip (the seeds' R4 B12 H32 K56: 2.2 us measured)
//   dL   0.44 us  per round of a wave
//   dI   4.1 ns fp32 / 4.8 ns 16-bit (bf16 timed; fp16 taken alike) / 8.2 ns fp64 (not timed:
//                 twice fp32, FP64 FMAs at half the FP32 rate) per lane element per SM: its 4
//                 FMAs, 5 loads and (16-bit) 5 conversions
//   dR   0.082 us per part per wave (the per-lane cursor over the parts)
//   1.5  the model's worst under-prediction where the SIMT kernel was the pick (measured /
//        modelled 0.81-1.51, R2 B16-B1024 H64); the rest of the sweep 0.59-1.41.
//   Checked with these in the next run of the same sweep (CUDA graphs, 182 shapes): 71 shapes
//   go from SIMT to the dot kernel, at a geometric mean 0.71x of the former pick's time; two
//   are slower by more than 3 % (R2 B16 H64 K2048 fp32 3.5 -> 4.6 us, R2 B64 H64 K256 bf16
//   3.7 -> 4.0: below the host's time per call back to back); the shapes more than 3 % slower
//   than eager's cat + linear in a graph go from 66 to 22 (the rest: cuBLAS, faster in a graph,
//   where the GEMM path's host time makes the model pick a fused kernel).
//
// GRAPH constants (H200, torch 2.11; bench/cat_linear_paths.py, 2026-12-04, thirty-sixth
// session: the forced GEMM column of 182 shapes, device time from CUDA graphs; a grid search
// on the log error):
//   16-bit  g0 4.0 us, gc 0.75 us, Fg 700 TFLOP/s; measured / modelled 0.79-1.70 (rms of the
//           log 0.18): margin 1.0 (1.2 until 2026-12-05, fiftieth session: see MARGINS below).
//   fp32    g0 2.5 us, gc 3.75 us, Fg 40 TFLOP/s; measured / modelled 0.54-7.5 (cuBLAS's
//           fp32 at small M: R8 B16 H512 K2048 109 us, R32 B16 H512 K2048 104): margin 1.4
//           (2.0 until 2026-12-05, fifty-second session: MARGINS below).
//   fp32, one row (M = 1): cuBLAS runs its matrix-vector kernel, bound by the weight's read,
//           without the spread of its fp32 GEMM kernels at small M: g0 2.75 us, gc 0.75 (16-bit's);
//           measured / modelled 0.81-1.41 over the 13 one-row fp32 shapes of 2026-12-05's
//           cat_linear_paths.py (R2-R32, H64-H512, K256-K2048; the worst, R32 H512 K256 at
//           10.6 us against 7.5, N = 256 rows of K = 16384): margin 1.4, that worst (1.0 since
//           the fiftieth session: MARGINS below). Of those 13
//           one pick moves, R32 B1 H64 K256 fp32, from the dot kernel (7.5 us; modelled 7.8)
//           to the GEMM path (4.1; modelled 4.0): the op had been 1.8x eager's time there.
//           Over that run's 182 shapes (python bench/cat_linear_paths.py --evaluate
//           bench/data/cat_linear_paths_h200_2026-12-05.json, each pick charged the run's time
//           of its path forced): picks > 3 % slower than eager in a graph 6 -> 5, no other moves.
//   fp64    not timed: a fused pick stays.
//   The dot's take from the GEMM path, margin 2 (kDotTakeMargin), checked against
//   bench/sweep.py's forced columns back to back (180 list-form forward shapes). With 1.5,
//   the margin of the take from SIMT, it moved 18 shapes, every one faster on the sweep it
//   was drawn from (2026-12-04, thirty-sixth session, call 4: R32 B4 H512 K256 bf16 53.3 ->
//   43.9 us); on the next machine (thirty-seventh session, call 1) three of them ran 1.3-1.5x
//   slower than the GEMM path (R32 B1 H512 K256 bf16: dot 45.6 us, GEMM path 30.3). Two
//   errors meet there: the dot model reads 19.4 us for that shape (measured / modelled up to
//   2.35 on that sweep: 32 parts of one round each, at < 2 warps an SM, each round a memory
//   latency no other warp hides), and the GEMM path's host time moves between machines (53.3
//   -> 33.7 us on the same shape). With margin 2 the take moves 11 of those shapes, 0.27-0.83x
//   of the GEMM path's time there (R8 B2 H512 K2048 bf16 40.7 -> 15.0 us), none slower.
//   The margins (16-bit's until the fiftieth session: MARGINS below) are the smallest whose
//   capture-time picks are nowhere > 3 % slower than the sizes' picks on that sweep (the
//   models evaluated per shape against its measured paths):
//   17 picks move to the GEMM path, and the shapes > 3 % slower than eager in a graph go
//   from 22 to 8 (R32 B16 H64 K2048 bf16 30.3 -> 6.8 us, R8 B1024 H64 K256 bf16 22.7 -> 5.5),
//   none slower than before. Left: fp32 shapes where cuBLAS is 5-50 % faster than the pick
//   (R32 B1 H64 K256 fp32: dot 7.9, eager 4.3), below what the fp32 model can tell, and two
//   GEMM picks within eager's own spread.
// MARGINS (2026-12-05, fiftieth session). Three runs of bench/cat_linear_paths.py in CUDA graphs
//   (bench/data/cat_linear_paths_{h200_2026-12-05,h200_2026-12-05_s50,h100_2026-12-05}.json: the
//   H200 in the forty-first and fiftieth sessions, the H100 in the forty-eighth), each pick
//   charged its run's time of the path forced (`cat_linear_paths.py --evaluate`): with 16-bit
//   1.2 and one fp32 row 1.4 the same 4-5 fused picks were > 3 % slower than eager in all three.
//   16-bit and one fp32 row at 1.0 move four picks to the GEMM path, the same four in each run:
//   R8 B64 H64 K256 bf16 (dot 5.8-6.3 us, eager 4.7: 1.24-1.34x -> 1.00) and R32 B1 H64 K2048
//   fp32 (dot 6.9-7.2, eager 6.5-6.8: 1.05-1.10x -> 1.00) stop losing; R2 B16 H64 K2048 bf16
//   gives up the SIMT kernel's lead (0.87-0.94x of eager -> 1.00) and R32 B1 H64 K2048 bf16
//   moves within 3 % of eager. No pick becomes slower than eager (none can: see the rule), and
//   below 1.0 nothing more moves on these runs. Fused picks > 3 % slower than eager, in the
//   runs' order above: 5, 4, 4 -> 3, 2, 2. fp32 (M > 1) stayed at 2.0 then, for its leads.
// fp32 (M > 1) at 1.4 (2026-12-05, fifty-second session; the issue is "never slower than
//   eager", and a lead kept is worth less than a loss removed). The two fused picks left
//   slower than eager were the same in every run: R8 B1024 H64 K256 fp32 (SIMT 1.18-1.21x of
//   eager) and R2 B16 H512 K2048 fp32 (SIMT 1.05-1.08x), in the three runs above and in two
//   more H100 runs (forty-seventh and fifty-first sessions: bench/data/
//   cat_linear_paths_h100_2026-12-05_{s47,s51}.json). Their modelled fused / GEMM ratios are
//   1.54 and 1.91. Of the margins tried (1.0, 1.2, 1.4, 1.6, 2.0), 1.4 is the largest at which
//   no run has a fused pick > 3 % slower than eager but one at 1.047x (R2 B1024 H64 K256 fp32,
//   one H200 run; 0.99-1.03x in the other four, and 2.0 makes that pick too); 1.2 and 1.0 give
//   up more leads (4 and 7 more than 1.4 in the fiftieth session's run) and remove no loss.
//   1.4 moves five picks to the GEMM path, the same five in each run: those two stop losing
//   (-> 1.00x), and three leads are given up, R2 B64 H512 K2048 (SIMT 0.65-0.67x of eager),
//   R32 B16 H64 K256 (dot 0.77-0.82x) and R32 B64 H64 K256 (dot 0.78-0.81x): cuBLAS's fp32
//   kernels at 16-64 rows run 1.4-2.6x the model there, which has no term for their few tiles
//   (how they walk K is cuBLAS's heuristics, not modelled). Fused picks > 3 % slower than
//   eager in a graph, the five runs: 2, 3, 2, 2, 2 -> 0, 1, 0, 0, 0.
//   Only capture-time picks change; back-to-back picks are the sizes' as before.
//
// CHECK against that sweep's 180 list-form forward shapes (152 with both paths forced; the
// other 28, above 2^31 MACs, run the GEMM path under both rules; counts from medians):
//   pick > 3 % slower than the better forced path: model 11, the former thresholds (SIMT up to
//     2^27 MACs fp32/fp64, 2^24 16-bit) 34;
//   pick > 3 % slower than eager: model 46, thresholds 59 (the op as measured: 56), the better
//     forced path itself 40: at those 40 shapes neither path is within 3 % of eager -- the GEMM
//     path is eager's kernels plus the op call's host time (median +1.7 us at R <= 8, +4.4 at
//     R32), and the SIMT kernel walks K alone (R8/R32 H512, few rows: 38-194 us).
//   worst pick vs eager: model 1.26x, thresholds 5.1x (R32 B4 H512 K256 fp32: SIMT 186 us,
//     eager 36); picks > 1.5x slower than eager: model 0, thresholds 16.
//   The model's 11 misses all take the GEMM path where SIMT was 3-56 % faster: host noise at
//   ~30-45 us (R2 B1024 H512 K256 bf16, R5 B333 H80 K1000, R8 B1/B4 H512 bf16) or cuBLAS far
//   below its roofline at small M in fp32 (R8 B16 H512 K2048 fp32: 116.5 vs SIMT 51.3 us;
//   R32 B64 H64 K2048 fp32: 54.2 vs 38.2), which no bytes/FLOPs term predicts. Missing the
//   fused kernel there costs nothing against eager, which runs those same kernels.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace opreg {
namespace cat_linear_model {

// The SIMT kernel's geometry (backends/cuda/cat_linear.cu static_asserts that these are the
// kernel's own constants).
constexpr int64_t kTileM = 16;       // output rows per block
constexpr int64_t kTileN = 32;       // output columns per block
constexpr int64_t kChunkBytes = 256; // one k chunk: 16 vectors of 16 bytes per tile row
constexpr int64_t kMaxParts = 64;    // parts one launch can describe
constexpr int64_t kBlocksPerSm = 2;  // 96 KB of shared memory per block, 228 KB per SM
constexpr int kH200Sms = 132;

// k columns per chunk for elements of elt bytes.
constexpr int64_t chunk_cols(int64_t elt) {
  return kChunkBytes / elt;
}

constexpr int64_t cdiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// One call: (M, K) x (K, N)^T over R parts.
struct Work {
  int64_t M;       // output rows (the parts' leading dims)
  int64_t N;       // outputs (weight rows)
  int64_t K;       // reduction: the sum of the parts' widths
  int64_t R;       // parts
  int64_t chunks;  // sum over parts of cdiv(width, chunk_cols(elt)): the SIMT walk over K
  int64_t elt;     // bytes per element: 2, 4 or 8
  bool vec;        // the SIMT kernel's 16-byte loads apply (widths, strides, alignment)
};

// The constants (see the header comment for where each comes from).
constexpr double kT0 = 3.0, kL = 0.75, kS0 = 0.22, kWaveEpilogue = 0.9, kScalarCol = 0.042;
constexpr double kHost0 = 22.0, kHostPerPart = 0.4, kKernel = 2.0;
constexpr double kBytesPerUs = 4.17e6;
// The dot kernel (cat_linear_dot.cu's constants, asserted there; the DOT section above).
constexpr int64_t kDotCols = 4, kDotUnroll = 2, kDotWarpsPerSm = 64;
constexpr double kDotT0 = 1.54, kDotRound = 0.44, kDotPart = 0.082, kDotMargin = 1.5, kDotTakeMargin = 2.0;

// The GEMM path in a CUDA graph (the GRAPH section above), per element size (and fp32's one
// row apart: cuBLAS's matrix-vector kernel): g0, gc, Fg (FLOPs per us) and the margin (0: a
// fused pick stays).
struct GraphGemm {
  double g0, gc, flops_per_us, margin;
};
constexpr GraphGemm graph_gemm(const Work& w) {
  return w.elt == 2 ? GraphGemm{4.0, 0.75, 700e6, 1.0}
       : w.elt == 4 && w.M == 1 ? GraphGemm{2.75, 0.75, 40e6, 1.0}
       : w.elt == 4 ? GraphGemm{2.5, 3.75, 40e6, 1.4}
                    : GraphGemm{0.0, 0.0, 1.0, 0.0};
}

constexpr double dot_us_per_elem(int64_t elt) {  // dI
  return elt == 8 ? 0.0082 : elt == 4 ? 0.0041 : 0.0048;
}

constexpr double simt_us_per_col(int64_t elt) {  // s1
  return elt == 8 ? 0.0094 : elt == 4 ? 0.0047 : 0.0059;
}

constexpr double gemm_flops_per_us(int64_t elt) {  // F
  return elt == 2 ? 790e6 : 50e6;
}

// Device time of the SIMT kernel, us.
inline double simt_us(const Work& w, int sms) {
  if (w.M == 0 || w.N == 0) return 0.0;  // nothing launches
  const int64_t sm = std::max(sms, 1);
  const int64_t tiles = cdiv(w.M, kTileM) * cdiv(w.N, kTileN);
  const double waves = static_cast<double>(cdiv(tiles, kBlocksPerSm * sm));
  const double per_sm = static_cast<double>(cdiv(tiles, sm));
  const double c = static_cast<double>(w.chunks);
  if (!w.vec) return kT0 + waves * c * static_cast<double>(chunk_cols(w.elt)) * kScalarCol;
  const double latency = kL * waves * c;
  const double issue = per_sm * (kS0 * c + simt_us_per_col(w.elt) * static_cast<double>(w.K));
  return kT0 + std::max(latency, issue) + kWaveEpilogue * waves;
}

// Time per call of at::cat + cuBLAS (host or device, whichever is longer), us.
inline double gemm_us(const Work& w) {
  const double m = static_cast<double>(w.M), n = static_cast<double>(w.N);
  const double k = static_cast<double>(w.K), e = static_cast<double>(w.elt);
  const double cat = w.R > 1 ? kKernel + 2.0 * m * k * e / kBytesPerUs : 0.0;
  const double mm = kKernel + std::max(2.0 * m * n * k / gemm_flops_per_us(w.elt),
                                       (m * k + n * k + m * n) * e / kBytesPerUs);
  const double host = kHost0 + kHostPerPart * static_cast<double>(w.R);
  return std::max(host, cat + mm);
}

// Device time of the dot kernel, us (the DOT section above).
inline double dot_us(const Work& w, int sms) {
  if (w.M == 0 || w.N == 0) return 0.0;
  const int64_t v = w.vec ? 16 / w.elt : 1, sm = std::max(sms, 1);
  const int64_t warps = w.M * cdiv(w.N, kDotCols);
  const double rounds = static_cast<double>(cdiv(w.K, 32 * v * kDotUnroll));
  const double waves = static_cast<double>(cdiv(warps, kDotWarpsPerSm * sm));
  const double elems = static_cast<double>(warps) * static_cast<double>(cdiv(w.K, 32 * v) * v);
  return kDotT0 + kDotRound * rounds * waves + dot_us_per_elem(w.elt) * elems / static_cast<double>(sm) +
         kDotPart * static_cast<double>(w.R) * waves;
}

// Device time of at::cat + cuBLAS replayed from a CUDA graph, us (the GRAPH section above).
inline double gemm_graph_us(const Work& w) {
  const GraphGemm g = graph_gemm(w);
  const double m = static_cast<double>(w.M), n = static_cast<double>(w.N);
  const double k = static_cast<double>(w.K), e = static_cast<double>(w.elt);
  const double cat = w.R > 1 ? g.gc + 2.0 * m * k * e / kBytesPerUs : 0.0;
  return g.g0 + cat + std::max(2.0 * m * n * k / g.flops_per_us, (m * k + n * k + m * n) * e / kBytesPerUs);
}

// Can one SIMT launch take this call (kernel-argument and grid limits)?
inline bool fits_simt(const Work& w) {
  return w.R <= kMaxParts && w.M < int64_t(65535) * kTileM && w.N < INT_MAX && w.K < INT_MAX;
}

// ... and one dot launch (its grid: one warp per kDotCols outputs)?
inline bool fits_dot(const Work& w) {
  return fits_simt(w) && w.M * cdiv(w.N, kDotCols) < int64_t(INT_MAX) / 2;
}

enum class Path { kDot, kSimt, kGemm };

// Benchmark/debug override: OPREG_CAT_LINEAR_PATH=dot|simt|gemm (empty = the model). Read per
// call: bench/sweep.py sets it between batches. An unknown value is an error, not the model.
inline bool forced_path(Path* out) {
  const char* e = std::getenv("OPREG_CAT_LINEAR_PATH");
  if (e == nullptr || e[0] == '\0') return false;
  if (std::strcmp(e, "dot") == 0) {
    *out = Path::kDot;
  } else if (std::strcmp(e, "simt") == 0) {
    *out = Path::kSimt;
  } else if (std::strcmp(e, "gemm") == 0) {
    *out = Path::kGemm;
  } else {
    throw std::invalid_argument(std::string("OPREG_CAT_LINEAR_PATH must be dot, simt or gemm, got '") +
                                e + "'");
  }
  return true;
}

// The choice: the override (where the path can take the call), else the model's fastest,
// from sizes only. (While a CUDA graph is captured, backends/cuda/cat_linear.cu may move a
// fused pick to the GEMM path: graph_prefers_gemm.)
inline Path choose_path(const Work& w, int sms) {
  if (!fits_simt(w)) return Path::kGemm;
  Path forced;
  if (forced_path(&forced)) return forced == Path::kDot && !fits_dot(w) ? Path::kSimt : forced;
  const double simt = simt_us(w, sms), gemm = gemm_us(w);
  const double dot = fits_dot(w) ? dot_us(w, sms) : HUGE_VAL;
  if (simt < gemm) return kDotMargin * dot < simt ? Path::kDot : Path::kSimt;
  return kDotTakeMargin * dot < gemm ? Path::kDot : Path::kGemm;
}

// With gradients (the autograd kernel, backends/autograd/cat_linear.cpp): does the call run
// eager's own ops? Where the override says GEMM, or the SIMT kernel does not beat the GEMM
// path: the dot kernel's take from the GEMM path is for calls without gradients.
inline bool grad_runs_eager(const Work& w, int sms) {
  if (!fits_simt(w)) return true;
  Path forced;
  if (forced_path(&forced)) return forced == Path::kGemm;
  return !(simt_us(w, sms) < gemm_us(w));
}

// Where the sizes' choice is `sizes`, would the call, made while a CUDA graph is captured,
// rather run the GEMM path? Only a fused pick gives way, and never one OPREG_CAT_LINEAR_PATH
// forced: the dot kernel's take from the GEMM path always (the graph keeps eager's kernels
// there, what the sizes picked before the take), another fused pick by the GRAPH model.
inline bool graph_prefers_gemm(const Work& w, Path sizes, int sms) {
  if (sizes == Path::kGemm) return false;
  Path forced;
  if (forced_path(&forced)) return false;
  if (!(simt_us(w, sms) < gemm_us(w))) return true;  // the dot's take: back to back only
  const double margin = graph_gemm(w).margin;
  if (!(margin > 0.0)) return false;
  const double fused = sizes == Path::kDot ? dot_us(w, sms) : simt_us(w, sms);
  return margin * gemm_graph_us(w) < fused;
}

// Does one of the fused kernels (dot or SIMT) take the call?
inline bool use_fused(const Work& w, int sms) {
  return choose_path(w, sms) != Path::kGemm;
}

}  // namespace cat_linear_model
}  // namespace opreg
