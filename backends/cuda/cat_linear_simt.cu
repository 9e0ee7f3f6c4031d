// opreg::cat_linear's SIMT path (the path choice, describing the parts and the
// GEMM path are in cat_linear.cu, with the design notes): ONE launch that reads
// every part in place, block tile kTM x kTN (cat_linear.cuh), the reduction
// dimension walked in chunks that never straddle a part, through an 8-deep
// cp.async shared-memory pipeline; partial micro-tiles summed in a fixed order.
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include "cat_linear.cuh"
#include "pdl.cuh"

namespace opreg {
namespace cl_detail {
namespace {

// ---------------------------------------------------------------------------
// SIMT kernel. (kTM = 16 output rows, kTN = 32 output columns per block, kVPR = 16
// vectors per tile row per chunk: cat_linear.cuh.)
constexpr int kKG = 8;        // warps; each takes 1/8 of every k chunk
// 8 stages x 12 KB = 96 KB of dynamic shared memory: with 4 stages (48 KB,
// the static limit) the 64 x 1024 x 1024 fp32 case took 12.8 us per call in
// a CUDA graph, stalled on load latency (~3 chunks in flight, ~0.13 us of
// math per chunk); all chunks of the 12 x 56 x 128 case now load at once.
constexpr int kStages = 8;
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
  cuda::await_prior_grids();  // before any load or store (pdl.cuh)

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

} // namespace

template <typename scalar_t, bool VEC, int MAXR>
void launch_simt_kernel(const PartArgs<kMaxParts>& all, int R, const scalar_t* w, int64_t ldw,
                        const scalar_t* bias, scalar_t* out, int64_t M, int64_t N,
                        c10::DeviceIndex dev, cudaStream_t stream) {
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
  ensure_smem<scalar_t, VEC, MAXR>(dev);
  const dim3 grid(static_cast<unsigned>((N + kTN - 1) / kTN), static_cast<unsigned>((M + kTM - 1) / kTM));
  cuda::launch(cat_linear_simt_kernel<scalar_t, VEC, MAXR>, grid, dim3(kSimtThreads), simt_smem_bytes<scalar_t>(),
               stream, cuda::pdl_wanted(), pa, R, w, ldw, bias, out, static_cast<int>(M), static_cast<int>(N),
               nchunks);
}

OPREG_CL_INSTANTIATE(launch_simt_kernel)

} // namespace cl_detail
} // namespace opreg
