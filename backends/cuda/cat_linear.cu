// CUDA kernel for opreg::cat_linear: linear(cat(parts, -1), weight, bias).
//
// Two paths, chosen on the host from shapes alone (no data, no sync):
//  * SIMT (small problems): ONE launch that reads every part in place (part
//    pointers travel in a __grid_constant__ kernel-argument struct, up to
//    kMaxParts), so there is no cat, no extra allocation, no second kernel.
//    Block tile 16 (rows) x 32 (outputs); the reduction dimension is walked
//    in chunks that never straddle a part, staged through an 8-deep cp.async
//    shared-memory pipeline (16-byte copies, zero-filled at the edges); the
//    8 warps split each chunk's k range and their partial 4x4 micro-tiles are
//    summed in a fixed order at the end (deterministic). fp32 accumulation
//    (fp64 for double), exact fp32 FMAs: never TF32, so it is at least as
//    accurate as what allow_tf32 would permit.
//  * GEMM: exactly what eager F.linear(torch.cat(parts, -1)) runs: at::cat
//    (skipped for one part) and one cuBLAS addmm/mm with the bias fused in its
//    epilogue, honouring allow_tf32 like F.linear. The stacked op builds the
//    matrix the same way, at::cat(x.unbind(d), -1). Measured on the H200: our
//    own single-launch cat kernel was no faster than at::cat (381.5 vs 381.6 us,
//    221.5 vs 221.3 us end to end), so it was dropped. Per-part accumulating
//    GEMMs (beta=1) were rejected: each one re-reads and re-writes the output.
//
// Which path: a model of the work, not thresholds (namespace model, below).
// Per call, back to back, a path costs max(host, device): the host runs ahead
// while the device is busy.
//   host:   SIMT one launch, 10 us from Python on the H200 (cat_linear_stacked
//           9.7, list 11.2); GEMM one more ATen op + launch (the cat), +4 us;
//           one part: no cat, the same 10 us.
//   SIMT device: 3 us fixed + one block's walk over all of K (16 x 32 x K
//           FMAs at 52e3 fp32 / 58e3 16-bit per us) x max(1, blocks / (1.12
//           x SMs)). It is issue-bound on its FMAs, so bytes don't enter; rows
//           are padded to 16, so B = 1 costs what B = 16 does. This is why
//           B = 1 was slow: R32 H512 K2048 fp32 is 64 blocks each walking
//           K = 16384, 161 us predicted (188 measured, eager 68).
//   GEMM device: cat (R > 1): 1 us + M*K written and read again at 4.0 TB/s;
//           cuBLAS: 2 us + max(bytes (M*K + N*K + M*N) / 4.0 TB/s, 2*M*N*K /
//           flop rate (bf16 700, tf32 350, fp32 50, fp64 60 TFLOP/s), and for
//           M >= 32 one CTA's walk over K: min(K, 1024) x 25 ns exact fp32,
//           3 ns tensor cores). For small M (a GEMV: B = 1, decode) the bytes term is the
//           weight read, the bound eager's cuBLAS GEMV works against.
// Rule: SIMT iff its predicted cost x 1.10 <= the GEMM path's (the model is
// within 6 % at the three fitted SIMT points, 13.1/37.9/34.3 vs 13.8/36.3/32.5
// us, and at the two fp32 cat + cuBLAS points, 28.7/29.1 vs 26.8/29.3; the 10 %
// keeps a misprediction from costing more than eager).
// What it picks on the H200 grid: the GEMM path for every bf16/fp16 problem
// that is not host-bound (a tensor-core GEMM beats a SIMT walk over K) and for
// every B = 1..16 problem whose K is past ~1K (the walk over K exceeds the
// host time the single launch saves); SIMT for host-bound problems of >= 2
// parts (one launch instead of two: ~4 us of a ~14 us call) and for exact-fp32
// problems of 32+ rows where cuBLAS can't fill the GPU (R4 B64 H256 K1024:
// SIMT 13.8 vs 26.8 us). The same choice inside CUDA-graph capture (see
// use_simt_path), though there the host saving is gone (12 x 56 x 128 fp32:
// 4.4 us SIMT vs 3.5 replayed): a capture must record what its warm-up ran.
// What bench/sweep.py must show to confirm it: no shape > 3 % slower than
// eager (list and stacked, no_grad and forward+backward), and at the forced
// paths (OPREG_CAT_LINEAR_PATH=simt|gemm, its `simt`/`gemm` columns) the
// automatic choice within 3 % of the faster one; a shape where it is not names
// the constant to re-fit (host constants if host-bound, rates if not).
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cat_linear_checks.h"
#include "cuda_common.cuh"

namespace opreg {
namespace {

using cuda::Vec;
using cuda::vec16;

constexpr int kMaxParts = 64;
constexpr int kFewParts = 8;

// Passed by value as a __grid_constant__ parameter: indexing it with a
// block-uniform part number reads the constant bank, no copy to local memory.
// Two sizes, so that the common few-part call launches with 192 bytes of
// parameters instead of 1.5 KB.
template <int MAXR>
struct PartArgs {
  const void* ptr[MAXR];
  int64_t row_stride[MAXR];  // elements between consecutive rows (leading dims flattened)
  int width[MAXR];           // H_i
  int kstart[MAXR];          // column of weight where part i starts
};

// ---------------------------------------------------------------------------
// SIMT kernel.
constexpr int kTM = 16;       // output rows per block
constexpr int kTN = 32;       // output columns per block
constexpr int kKG = 8;        // warps; each takes 1/8 of every k chunk
// 8 stages x 12 KB = 96 KB of dynamic shared memory: with 4 stages (48 KB,
// the static limit) the 64 x 1024 x 1024 fp32 case took 12.8 us per call in
// a CUDA graph, stalled on load latency (~3 chunks in flight, ~0.13 us of
// math per chunk); all chunks of the 12 x 56 x 128 case now load at once.
constexpr int kStages = 8;
constexpr int kVPR = 16;      // 16-byte vectors per tile row per chunk: TK = 16 * V
constexpr int kSimtThreads = kKG * 32;
constexpr int kTileRows = kTM + kTN;
static_assert(kTileRows * kVPR == 3 * kSimtThreads, "each thread copies 3 vectors per chunk");

// Row r of a stage stores its 16 vectors XOR-swizzled by (r / 4) % 8: the 4
// x-rows (8 w-rows) a warp reads together then hit distinct bank groups.
__device__ __forceinline__ int swz(int row, int kv) {
  return kv ^ ((row >> 2) & 7);
}

template <typename scalar_t>
constexpr int simt_smem_bytes() {
  return kStages * kTileRows * kVPR * 16;
}

template <typename scalar_t, bool VEC, int MAXR>
__global__ void __launch_bounds__(kSimtThreads) cat_linear_simt_kernel(
    const __grid_constant__ PartArgs<MAXR> pa,
    int nparts,
    const scalar_t* __restrict__ w,
    int64_t ldw,
    const scalar_t* __restrict__ bias,
    scalar_t* __restrict__ out,
    int M,
    int N,
    int nchunks) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int V = vec16<scalar_t>();
  constexpr int TK = kVPR * V;
  using vec_t = Vec<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto smem = reinterpret_cast<vec_t(*)[kTileRows][kVPR]>(smem_raw);

  const int tid = threadIdx.x, lane = tid & 31, kg = tid >> 5;
  const int mg = lane >> 3, ng = lane & 7;
  const int m0 = blockIdx.y * kTM, n0 = blockIdx.x * kTN;

  // Load cursor: chunk = (part lp, columns [lk, lk + TK) of it).
  int lp = 0, lk = 0;
  while (lp < nparts && pa.width[lp] == 0) ++lp;
  // Compute cursor: the same walk, to know each chunk's valid length.
  int cp = lp, ck = 0;

  auto load_chunk = [&](int stage) {
    const int len = min(TK, pa.width[lp] - lk);
    const scalar_t* xb = static_cast<const scalar_t*>(pa.ptr[lp]);
    const int64_t rs = pa.row_stride[lp];
    const int64_t wk = int64_t(pa.kstart[lp]) + lk;
    if constexpr (VEC) {
#pragma unroll
      for (int l = 0; l < 3; ++l) {
        const int q = tid + l * kSimtThreads;
        const int row = q >> 4, kv = q & 15;
        const bool kin = kv * V < len;
        const scalar_t* src;
        bool valid;
        if (row < kTM) {
          const int m = m0 + row;
          valid = kin && m < M;
          src = valid ? xb + int64_t(m) * rs + lk + kv * V : xb;
        } else {
          const int nn = n0 + row - kTM;
          valid = kin && nn < N;
          src = valid ? w + int64_t(nn) * ldw + wk + kv * V : w;
        }
        cuda::cp_async16(&smem[stage][row][swz(row, kv)], src, valid);
      }
    } else {
      // Misaligned parts: plain element loads (correct, slower).
      for (int q = tid; q < kTileRows * TK; q += kSimtThreads) {
        const int row = q / TK, kk = q % TK;
        scalar_t val = scalar_t(0);
        if (kk < len) {
          if (row < kTM) {
            const int m = m0 + row;
            if (m < M) val = xb[int64_t(m) * rs + lk + kk];
          } else {
            const int nn = n0 + row - kTM;
            if (nn < N) val = w[int64_t(nn) * ldw + wk + kk];
          }
        }
        smem[stage][row][swz(row, kk / V)].v[kk % V] = val;
      }
    }
    lk += TK;
    if (lk >= pa.width[lp]) {
      lk = 0;
      do {
        ++lp;
      } while (lp < nparts && pa.width[lp] == 0);
    }
  };

  acc_t acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = acc_t(0);

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nchunks) load_chunk(s);
    cuda::cp_async_commit();
  }
  for (int c = 0; c < nchunks; ++c) {
    cuda::cp_async_wait<kStages - 2>();  // chunk c has landed (this thread's copies)
    __syncthreads();                     // ... everyone's; and chunk c-1 is consumed
    if (c + kStages - 1 < nchunks) load_chunk((c + kStages - 1) % kStages);
    cuda::cp_async_commit();
    const int st = c % kStages;
    const int clen = min(TK, pa.width[cp] - ck);
    ck += TK;
    if (ck >= pa.width[cp]) {
      ck = 0;
      do {
        ++cp;
      } while (cp < nparts && pa.width[cp] == 0);
    }
    // Warps whose k slice lies past a short part's end skip the math.
    if (kg * 2 * V >= clen) continue;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int kv = kg * 2 + s;
      vec_t xv[4], wv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) xv[i] = smem[st][mg * 4 + i][swz(mg * 4 + i, kv)];
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[j] = smem[st][kTM + ng * 4 + j][swz(kTM + ng * 4 + j, kv)];
#pragma unroll
      for (int e = 0; e < V; ++e) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const acc_t xi = static_cast<acc_t>(xv[i].v[e]);
#pragma unroll
          for (int j = 0; j < 4; ++j)
            acc[i][j] = cuda::fma_acc(xi, static_cast<acc_t>(wv[j].v[e]), acc[i][j]);
        }
      }
    }
  }
  cuda::cp_async_wait<0>();
  __syncthreads();

  // Sum the 8 warps' partial tiles in a fixed order (deterministic).
  acc_t* red = reinterpret_cast<acc_t*>(&smem[0][0][0]);  // [kKG][kTM][kTN], <= 32 KB
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) red[(kg * kTM + mg * 4 + i) * kTN + ng * 4 + j] = acc[i][j];
  __syncthreads();
  for (int o = tid; o < kTM * kTN; o += kSimtThreads) {
    const int m = o / kTN, nn = o % kTN;
    acc_t s = red[m * kTN + nn];
#pragma unroll
    for (int g = 1; g < kKG; ++g) s += red[(g * kTM + m) * kTN + nn];
    if (m0 + m < M && n0 + nn < N) {
      if (bias != nullptr) s += static_cast<acc_t>(bias[n0 + nn]);
      out[int64_t(m0 + m) * N + n0 + nn] = static_cast<scalar_t>(s);
    }
  }
}

// ---------------------------------------------------------------------------
// Host side.

// Leading dims of a part (sizes, strides) flatten to rows with one stride?
// (Views such as x[i] of a contiguous (R, B, H) tensor, or expanded rows with
// stride 0, qualify.)
bool flat_rows(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t* rs) {
  const int64_t d = static_cast<int64_t>(sizes.size());
  if (sizes[d - 1] > 1 && strides[d - 1] != 1) return false;
  *rs = 0;
  bool first = true;
  int64_t expect = 0;
  for (int64_t i = d - 2; i >= 0; --i) {
    if (sizes[i] == 1) continue;
    if (first) {
      *rs = strides[i];
      expect = strides[i] * sizes[i];
      first = false;
    } else {
      if (strides[i] != expect) return false;
      expect *= sizes[i];
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// The dispatch model (header comment: "Which path"). Predicted us per call;
// constants from the H200 figures in bench/RESULTS.md, each with its source.
namespace model {

constexpr double kBytesPerUs = 4.0e6;       // 4.0 TB/s: d2d copy measured 4.2-4.27 (read + write)
constexpr double kSimtFixedUs = 3.0;        // SIMT replays in 4.4 us in a graph at 1.2 us of math (12x56x128 fp32)
constexpr double kCatFixedUs = 1.0;         // at::cat's kernel at 12x56x128, graph replay
constexpr double kGemmFixedUs = 2.0;        // cuBLAS's kernel at 12x56x128, graph replay
constexpr double kHostOneLaunchUs = 10.0;   // Python -> op -> one launch: stacked 9.7, list 11.2 (run 3)
constexpr double kHostPerOpUs = 4.0;        // one more ATen op + launch from C++ (Python x.add_(0): 8.0)
constexpr double kSimtBlocksPerSm = 1.12;   // 2 blocks fit per SM (96 KB smem) but share its FMA pipes
constexpr double kMargin = 1.10;            // SIMT only if predicted >= 10 % faster (model error, below)

// One SIMT block's multiply-adds per us (its 16 x 32 tile times K), fitted to the three
// measured points (graph replay): 64 x 1024 x 1024 fp32, 128 blocks = one wave, 13.8 us
// (model 13.1); 256 x 1024 x 1024, 512 blocks = 3.5 waves of 148, fp32 36.3 (model 37.9),
// bf16 32.5 (34.3). fp64: half the fp32 rate (the H200's fp64 FMA pipes), not measured.
double simt_fma_per_us(at::ScalarType t) {
  if (t == at::kDouble) return 26e3;
  return t == at::kFloat ? 52e3 : 58e3;
}

// cuBLAS's arithmetic rate (flop per us): bf16/fp16 tensor cores ~714-790 TFLOP/s
// measured (KINDS.md), fp32 with allow_tf32 half that; exact fp32 on the FMA pipes
// ~50 (datasheet 67); fp64 on its tensor cores ~60 (datasheet 67).
double gemm_flop_per_us(at::ScalarType t, bool tf32) {
  if (t == at::kFloat) return tf32 ? 350e6 : 50e6;
  return t == at::kDouble ? 60e6 : 700e6;
}

// A cuBLAS GEMM (M >= 32) cannot finish faster than one CTA's walk over K: fp32 at
// 64 x 1024 x 1024 and 256 x 1024 x 1024 both took ~27 us (26.8, 29.3 in a graph, cat
// included) for 4x the work, i.e. ~25 ns per k step; bf16 256 x 1024 x 1024: 6.2 us,
// so <= 3 ns. Skinny problems (M < 32) get GEMV / split-K kernels: no such term. Past
// the measured K = 1024 cuBLAS may split K, so the walk counts at most 1024 steps:
// optimistic for cuBLAS, so an unmeasured case errs towards eager's kernels.
constexpr double kGemmMaxWalk = 1024;
double gemm_us_per_k(at::ScalarType t, bool tf32) {
  return (t == at::kFloat && !tf32) || t == at::kDouble ? 0.025 : 0.003;
}

struct Problem {
  double M, N, K, R, elt;
  at::ScalarType dt;
  bool tf32;
};

// Device time of the single-launch kernel: every block walks all of K (rows padded
// to 16, so M = 1 costs what M = 16 does), in waves once the grid exceeds the SMs.
double simt_device_us(const Problem& p, int sms) {
  const double blocks = std::ceil(p.M / kTM) * std::ceil(p.N / kTN);
  const double per_block = kTM * kTN * p.K / simt_fma_per_us(p.dt);
  return kSimtFixedUs + per_block * std::max(1.0, blocks / (sms * kSimtBlocksPerSm));
}

// Device time of eager's kernels: at::cat (reads and writes M x K once more) and one
// cuBLAS call bounded by its bytes (parts, weight, output), its flops and its k walk.
// At M = 1 this is the GEMV: weight bytes / bandwidth.
double gemm_device_us(const Problem& p) {
  const double cat = p.R > 1 ? kCatFixedUs + 2 * p.M * p.K * p.elt / kBytesPerUs : 0.0;
  const double bytes = (p.M * p.K + p.N * p.K + p.M * p.N) * p.elt;
  const double mm = std::max({bytes / kBytesPerUs, 2 * p.M * p.N * p.K / gemm_flop_per_us(p.dt, p.tf32),
                              p.M >= 32 ? std::min(p.K, kGemmMaxWalk) * gemm_us_per_k(p.dt, p.tf32) : 0.0});
  return cat + kGemmFixedUs + mm;
}

} // namespace model

// Multiprocessors of device dev, read once.
int sm_count(c10::DeviceIndex dev) {
  static int count[C10_COMPILE_TIME_MAX_GPUS] = {};
  if (count[dev] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    count[dev] = n > 0 ? n : 1;
  }
  return count[dev];
}

// Benchmark/debug override: OPREG_CAT_LINEAR_PATH=simt|gemm (0 = auto).
int forced_path() {
  const char* e = std::getenv("OPREG_CAT_LINEAR_PATH");
  if (e == nullptr || e[0] == '\0') return 0;
  if (std::strcmp(e, "simt") == 0) return 1;
  if (std::strcmp(e, "gemm") == 0) return 2;
  return 0;
}

// Opt each kernel instantiation into > 48 KB of dynamic shared memory, once
// per device (a plain attribute call; also legal during graph capture).
template <typename scalar_t, bool VEC, int MAXR>
void ensure_smem(c10::DeviceIndex dev) {
  static bool done[C10_COMPILE_TIME_MAX_GPUS] = {};
  if (!done[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        cat_linear_simt_kernel<scalar_t, VEC, MAXR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        simt_smem_bytes<scalar_t>()));
    done[dev] = true;
  }
}

template <typename scalar_t, bool VEC, int MAXR>
void launch_simt(
    const PartArgs<kMaxParts>& all, int R, const at::Tensor& w, int64_t ldw, const scalar_t* bias,
    at::Tensor& out, int64_t M, int64_t N) {
  PartArgs<MAXR> pa;
  int nchunks = 0;
  constexpr int TK = kVPR * vec16<scalar_t>();
  for (int i = 0; i < R; ++i) {
    pa.ptr[i] = all.ptr[i];
    pa.row_stride[i] = all.row_stride[i];
    pa.width[i] = all.width[i];
    pa.kstart[i] = all.kstart[i];
    nchunks += (all.width[i] + TK - 1) / TK;
  }
  ensure_smem<scalar_t, VEC, MAXR>(w.get_device());
  const dim3 grid(static_cast<unsigned>((N + kTN - 1) / kTN), static_cast<unsigned>((M + kTM - 1) / kTM));
  cat_linear_simt_kernel<scalar_t, VEC, MAXR>
      <<<grid, kSimtThreads, simt_smem_bytes<scalar_t>(), c10::cuda::getCurrentCUDAStream()>>>(
          pa, R, w.const_data_ptr<scalar_t>(), ldw, bias, out.mutable_data_ptr<scalar_t>(),
          static_cast<int>(M), static_cast<int>(N), nchunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The model's choice (header comment), or the override. Per call back to back a path
// costs max(host, device) (the host runs ahead while the device is busy). The choice
// never depends on whether the stream is capturing a CUDA graph: the warm-up before a
// capture must run the path the capture records, or the capture makes the first cuBLAS
// call of the process (handle, workspace) inside the graph, which fails it (seen on
// the H200, 2026-12-01, tests/test_cat_linear.py::test_cuda_graphs under xdist).
bool use_simt_path(int64_t M, int64_t N, int64_t K, int64_t R, at::ScalarType dt,
                   c10::DeviceIndex dev) {
  const int path = forced_path();
  const bool fits_simt = R <= kMaxParts && M < int64_t(65535) * kTM && N < INT_MAX && K < INT_MAX;
  if (!fits_simt || path == 2) return false;
  if (path == 1 || M == 0 || N == 0) return true;  // empty output: no launch either way
  const bool tf32 = dt == at::kFloat && at::globalContext().allowTF32CuBLAS();
  const model::Problem p{double(M), double(N), double(K), double(R),
                         double(c10::elementSize(dt)), dt, tf32};
  const double ds = model::simt_device_us(p, sm_count(dev)), dg = model::gemm_device_us(p);
  const double hs = model::kHostOneLaunchUs, hg = hs + (R > 1 ? model::kHostPerOpUs : 0.0);
  return std::max(hs, ds) * model::kMargin <= std::max(hg, dg);
}

// Part i starts at ptr, its rows rs elements apart, wi wide; vec_ok stays true
// while every part allows 16-byte loads.
void set_part(PartArgs<kMaxParts>& pa, int64_t i, const void* ptr, int64_t rs, int64_t wi,
              int64_t kstart, int V, bool& vec_ok) {
  pa.ptr[i] = ptr;
  pa.row_stride[i] = rs;
  pa.width[i] = static_cast<int>(wi);
  pa.kstart[i] = static_cast<int>(kstart);
  vec_ok = vec_ok && wi % V == 0 && rs % V == 0 && (wi == 0 || cuda::aligned16(ptr));
}

// The SIMT path over parts already described in pa: (M, N) output of shape out_shape.
at::Tensor run_simt(const PartArgs<kMaxParts>& pa, int64_t R, bool vec_ok, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, c10::IntArrayRef out_shape, int64_t M,
                    int64_t N) {
  at::Tensor out = at::empty(out_shape, weight.options());
  if (M == 0 || N == 0) return out;
  const int64_t K = weight.size(1);
  const at::ScalarType dt = weight.scalar_type();
  const int V = static_cast<int>(16 / c10::elementSize(dt));
  const bool has_bias = bias.has_value() && bias->defined();
  // Weight rows must be unit-stride; a padded row stride (ldw) is fine.
  const at::Tensor wc = weight.stride(1) == 1 || K <= 1 ? weight : weight.contiguous();
  const int64_t ldw = N <= 1 ? K : wc.stride(0);
  vec_ok = vec_ok && K % V == 0 && ldw % V == 0 && cuda::aligned16(wc.const_data_ptr());
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dt, "cat_linear_cuda", [&] {
    const scalar_t* bp = has_bias ? bc.const_data_ptr<scalar_t>() : nullptr;
    const int r = static_cast<int>(R);
    if (vec_ok && R <= kFewParts) {
      launch_simt<scalar_t, true, kFewParts>(pa, r, wc, ldw, bp, out, M, N);
    } else if (vec_ok) {
      launch_simt<scalar_t, true, kMaxParts>(pa, r, wc, ldw, bp, out, M, N);
    } else {
      launch_simt<scalar_t, false, kMaxParts>(pa, r, wc, ldw, bp, out, M, N);
    }
  });
  return out;
}

// cat(parts, -1) as the (M, K) matrix the GEMM reads; one part needs no copy at all
// (eager's torch.cat([p]) makes one).
at::Tensor cat_rows(at::TensorList parts, int64_t M, int64_t K) {
  return parts.size() == 1 ? parts[0].reshape({M, K}) : at::cat(parts, -1).reshape({M, K});
}

// The GEMM path: cuBLAS over the concatenated input xcat (M, K), bias fused in
// its epilogue, exactly what F.linear runs (and so honouring allow_tf32).
at::Tensor gemm_path(const at::Tensor& xcat, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, c10::IntArrayRef out_shape) {
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor out2d = has_bias ? at::addmm(*bias, xcat, weight.t()) : at::mm(xcat, weight.t());
  return out2d.view(out_shape);
}

// Inputs already checked.
at::Tensor cat_linear_impl(
    at::TensorList parts,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor& p0 = parts[0];
  const auto lead = p0.sizes().slice(0, p0.dim() - 1);
  int64_t M = 1;
  for (const int64_t s : lead) M *= s;
  const int64_t N = weight.size(0);
  const int64_t R = static_cast<int64_t>(parts.size());
  c10::SmallVector<int64_t, 6> out_shape(lead.begin(), lead.end());
  out_shape.push_back(N);

  if (use_simt_path(M, N, weight.size(1), R, weight.scalar_type(), weight.get_device())) {
    // Describe the parts in place; copy only those whose rows are not flat.
    const int V = static_cast<int>(16 / c10::elementSize(weight.scalar_type()));
    PartArgs<kMaxParts> pa;
    std::vector<at::Tensor> keep;  // owns contiguous copies, if any (rare)
    keep.reserve(parts.size());
    bool vec_ok = true;
    int64_t kstart = 0;
    for (int64_t i = 0; i < R; ++i) {
      const at::Tensor* p = &parts[i];
      int64_t rs = 0;
      if (!flat_rows(p->sizes(), p->strides(), &rs)) {
        keep.push_back(p->contiguous());
        p = &keep.back();
        flat_rows(p->sizes(), p->strides(), &rs);
      }
      set_part(pa, i, p->const_data_ptr(), rs, p->size(-1), kstart, V, vec_ok);
      kstart += p->size(-1);
    }
    return run_simt(pa, R, vec_ok, weight, bias, out_shape, M, N);
  }

  // GEMM path: at::cat (any R, any alignment) + one cuBLAS call.
  return gemm_path(cat_rows(parts, M, weight.size(1)), weight, bias, out_shape);
}

// cat_linear(x.unbind(dim), weight, bias). On the SIMT path the slices are
// described straight from x's strides: making them as tensors (x.unbind) cost
// ~2 us per call on the H200's host (15.3 vs 13.2 us, bench/model_overhead.py).
at::Tensor cat_linear_stacked_cuda(
    const at::Tensor& x,
    int64_t dim,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const int64_t d = check_cat_linear_stacked(x, dim, weight, bias);
  const c10::cuda::CUDAGuard guard(weight.device());
  c10::SmallVector<int64_t, 6> sizes, strides;  // one slice: x without dim d
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (i != d) {
      sizes.push_back(x.size(i));
      strides.push_back(x.stride(i));
    }
  }
  int64_t M = 1;
  for (size_t i = 0; i + 1 < sizes.size(); ++i) M *= sizes[i];
  const int64_t N = weight.size(0), R = x.size(d), width = sizes.back();
  c10::SmallVector<int64_t, 6> out_shape(sizes.begin(), sizes.end() - 1);
  out_shape.push_back(N);
  int64_t rs = 0;
  if (!use_simt_path(M, N, weight.size(1), R, weight.scalar_type(), weight.get_device())) {
    // What eager runs, cat(x.unbind(d), -1) + GEMM: x.movedim(d, -2).reshape(M, K), the
    // same matrix by one generic copy, measured 9-14 % slower per call (H200, R8 B8192
    // H512 K4096 bf16 502 vs 462 us, R32 B4096 H128 275 vs 242; bench/RESULTS.md).
    return gemm_path(cat_rows(x.unbind(d), M, weight.size(1)), weight, bias, out_shape);
  }
  if (flat_rows(sizes, strides, &rs)) {
    const int V = static_cast<int>(16 / c10::elementSize(weight.scalar_type()));
    const char* base = static_cast<const char*>(x.const_data_ptr());
    const int64_t step = x.stride(d) * static_cast<int64_t>(x.element_size());
    PartArgs<kMaxParts> pa;
    bool vec_ok = true;
    for (int64_t i = 0; i < R; ++i) {
      set_part(pa, i, base + i * step, rs, width, i * width, V, vec_ok);
    }
    return run_simt(pa, R, vec_ok, weight, bias, out_shape, M, N);
  }
  return cat_linear_impl(x.unbind(d), weight, bias);
}

} // namespace
} // namespace opreg

TORCH_LIBRARY_IMPL(opreg, CUDA, m) {
  m.impl("cat_linear", &opreg::cat_linear_entry<opreg::cat_linear_impl>);
  m.impl("cat_linear_stacked", &opreg::cat_linear_stacked_cuda);
}
