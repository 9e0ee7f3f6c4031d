// The token-block kernel of opreg::scatter_combine (forward) and of its grouped
// backward, shared by scatter_combine_forward.cu and scatter_combine_backward.cu,
// which instantiate it. The paths, the model that picks them and the geometry are in
// scatter_combine_model.cuh; the host side is scatter_combine.cu.
//
// A block (512 threads, one per SM: it takes all of an SM's shared memory) owns tb
// consecutive tokens per round. A round:
//   1. fill: the block's (row, local token) entries go into its shared memory, either
//      from a scan of token_idx (scan mode: the cs blocks of a thread block cluster
//      each scan 1/cs of the indices and append every match into the owning block's
//      shared memory through distributed shared memory, so the cluster reads
//      token_idx once per round instead of cs times) or from the global map.
//   2. lists: a counting sort by token (shared-memory atomics: per-token segments,
//      rows in arbitrary order), then, forward only, each row's rank among its
//      token's rows puts every segment in increasing row order (O(rows) per row).
//   3. work: lane groups of G lanes (G = 1..32, so that short rows do not leave most
//      of a warp idle) take (token, column chunk) items. Each lane streams its rows'
//      16-byte vectors (and their gates) through a ring of p.ring slots in shared
//      memory with cp.async: kRing = 12 where the shared memory allows, 192 bytes in
//      flight per lane whatever the rows per token, and no registers held for them
//      (a first version held 8 vectors per lane in registers: 16-bit types take twice
//      their bytes as fp32 accumulators, and it spilled up to 600 bytes). Forward:
//      sum the token's rows in increasing row order, one fp32 (fp64) FMA chain per
//      element from 0: the same chain, and so the same bits, in every path, for any
//      row order. Backward: for each of the token's rows, grad_x = gate * grad_out[t]
//      and grad_gates = <grad_out[t], x[r]>, the dot product in a fixed order (each
//      lane walks its vectors in order, then an xor butterfly over the group): the
//      token's grad_out row is read from DRAM once, then from L1/L2.
//   Rows whose width is not a multiple of 16 bytes, or not 16-byte aligned (V = 1),
//   take a plain register path (no cp.async), as do the tokens below.
// Tokens whose rows did not fit (more rows than the entries left, or forward a
// list longer than kRankMax, whose rank sort would be quadratic) are summed by
// rescanning token_idx in row order: slower, exact, never wrong.
//
// Indices outside [0, num_tokens) match no token: forward ignores them, backward
// zeroes their rows (each cluster's first round walks a slice of the rows).
// No global atomics, no host sync, no writes outside the outputs: CUDA-graph safe.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <mutex>

#include "scatter_combine.cuh"

namespace opreg {
namespace sc_detail {

constexpr int kRankMax = 1024;  // longest per-token list the forward rank-sorts
constexpr int kRing = 12;       // 16-byte ring slots per lane (192 bytes in flight)
constexpr int kRingSmall = 4;   // where a block's shared memory is < 160 KB (sm_86/89: 99 KB)

// ---------------------------------------------------------------------------
// Shared memory of a block: the host sizes it with tok_smem_bytes, the kernel
// carves it in the same order.
struct TokSmem {
  int* n;                 // entries appended this round (may exceed lcap: the rest dropped)
  int* scratch;           // 32 ints: the block scan's warp totals
  int* cnt;               // [tb] rows per local token
  int* off;               // [tb] first entry of the token's segment
  int* pos;               // [tb] placement cursor
  int* ent_r;             // [lcap] appended rows; forward, after ranking: rows sorted per token
  int* seg_r;             // [lcap] rows in per-token segments
  unsigned short* ent_t;  // [lcap] appended local tokens
  unsigned short* seg_t;  // [lcap]
  unsigned char* bad;     // [tb] 1: rescan this token
  int4* ring;             // [kTokThreads][p.ring] cp.async slots
  unsigned* gring;        // [kTokThreads][kRing] the ring's gates, one 32-bit word a tuple
};

__host__ __device__ inline size_t tok_align16(size_t b) {
  return (b + 15) & ~size_t(15);
}

__host__ __device__ inline size_t tok_smem_bytes(int tb, int lcap, int ring) {
  return size_t(kTokThreads) * ring * 20 + 16 + 128 + 3 * tok_align16(size_t(tb) * 4) +
         2 * tok_align16(size_t(lcap) * 4) + 2 * tok_align16(size_t(lcap) * 2) + tok_align16(size_t(tb));
}

// Entries that fit beside tb tokens' arrays in `bytes` (a multiple of 8).
__host__ __device__ inline int tok_lcap(size_t bytes, int tb, int ring) {
  const size_t fixed = tok_smem_bytes(tb, 0, ring) + 64;  // + the alignment of the four arrays
  return bytes > fixed ? static_cast<int>((bytes - fixed) / 12) & ~7 : 0;
}

__device__ inline TokSmem tok_carve(unsigned char* base, int tb, int lcap, int ring) {
  TokSmem s;
  size_t o = 0;
  s.ring = reinterpret_cast<int4*>(base + o);
  o += size_t(kTokThreads) * ring * 16;
  s.gring = reinterpret_cast<unsigned*>(base + o);
  o += size_t(kTokThreads) * ring * 4;
  s.n = reinterpret_cast<int*>(base + o);
  o += 16;
  s.scratch = reinterpret_cast<int*>(base + o);
  o += 128;
  s.cnt = reinterpret_cast<int*>(base + o);
  o += tok_align16(size_t(tb) * 4);
  s.off = reinterpret_cast<int*>(base + o);
  o += tok_align16(size_t(tb) * 4);
  s.pos = reinterpret_cast<int*>(base + o);
  o += tok_align16(size_t(tb) * 4);
  s.ent_r = reinterpret_cast<int*>(base + o);
  o += tok_align16(size_t(lcap) * 4);
  s.seg_r = reinterpret_cast<int*>(base + o);
  o += tok_align16(size_t(lcap) * 4);
  s.ent_t = reinterpret_cast<unsigned short*>(base + o);
  o += tok_align16(size_t(lcap) * 2);
  s.seg_t = reinterpret_cast<unsigned short*>(base + o);
  o += tok_align16(size_t(lcap) * 2);
  s.bad = base + o;
  return s;
}

// ---------------------------------------------------------------------------
// Cluster helpers: with cs == 1 (no cluster, or a build for an arch before sm_90,
// where the host never asks for clusters) they are the block's own.
__device__ __forceinline__ int cluster_rank(int cs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cs > 1 ? static_cast<int>(__clusterRelativeBlockRank()) : 0;
#else
  (void)cs;
  return 0;
#endif
}

// A barrier over the cluster (release/acquire: the remote appends before it are
// visible after it), or over the block.
__device__ __forceinline__ void cluster_or_block_sync(int cs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cs > 1) {
    __cluster_barrier_arrive();
    __cluster_barrier_wait();
    return;
  }
#endif
  (void)cs;
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ T* in_block(T* local, int owner, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (owner != rank) return static_cast<T*>(__cluster_map_shared_rank(static_cast<void*>(local), owner));
#endif
  (void)owner;
  (void)rank;
  return local;
}

// One bulk prefetch of a row into L2 (sm_90's cp.async.bulk; a no-op before).
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

// The ring's cp.async, with "memory" clobbers (cuda_common.cuh's versions have none,
// and its users order their reads with __syncthreads): here each lane reads back its
// own slots with no barrier, so the compiler must not move shared-memory reads across
// the copy or the wait.
__device__ __forceinline__ void ring_copy16(int4* slot, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(slot));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
// A row's gate into the ring beside its vectors (float accumulation): 32-bit gates as
// they are, 16-bit ones as the aligned 32-bit word that holds them (a 4-byte aligned
// word never crosses a page, nor the caching allocator's 512-byte blocks).
template <typename scalar_t>
__device__ __forceinline__ const void* gate_word(const void* gates, int r, bool g32) {
  if (g32 || sizeof(scalar_t) == 4) return static_cast<const char*>(gates) + int64_t(r) * 4;
  const uintptr_t a = reinterpret_cast<uintptr_t>(gates) + uintptr_t(r) * 2;
  return reinterpret_cast<const void*>(a & ~uintptr_t(3));
}
template <typename scalar_t>
__device__ __forceinline__ void ring_copy_gate(unsigned* slot, const void* gates, int r, bool g32) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(slot));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gate_word<scalar_t>(gates, r, g32))
               : "memory");
}
template <typename scalar_t>
__device__ __forceinline__ float ring_gate(unsigned word, const void* gates, int r, bool g32) {
  if (g32 || sizeof(scalar_t) == 4) return __uint_as_float(word);
  const bool high = ((reinterpret_cast<uintptr_t>(gates) + uintptr_t(r) * 2) & 2) != 0;  // little-endian
  const unsigned short bits = static_cast<unsigned short>(high ? word >> 16 : word & 0xffffu);
  scalar_t v;
  memcpy(&v, &bits, sizeof(v) < 2 ? sizeof(v) : 2);
  return static_cast<float>(v);
}
__device__ __forceinline__ void ring_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void ring_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Wait until at most n (< kRing, uniform) groups are pending.
__device__ __forceinline__ void ring_wait(int n) {
  switch (n) {
    case 0: return ring_wait<0>();
    case 1: return ring_wait<1>();
    case 2: return ring_wait<2>();
    case 3: return ring_wait<3>();
    case 4: return ring_wait<4>();
    case 5: return ring_wait<5>();
    default: return ring_wait<0>();  // never with kRing = 12 (D <= 6)
  }
}

// Append (row r, local token lt) to block `owner`'s list; a full list marks the token.
__device__ __forceinline__ void tok_append(const TokSmem& s, int lcap, int owner, int rank, int lt, int r) {
  const int q = atomicAdd(in_block(s.n, owner, rank), 1);
  if (q < lcap) {
    in_block(s.ent_r, owner, rank)[q] = r;
    in_block(s.ent_t, owner, rank)[q] = static_cast<unsigned short>(lt);
  } else {
    in_block(s.bad, owner, rank)[lt] = 1;
  }
}

// ---------------------------------------------------------------------------
// 1. Fill by scanning: this block's 1/cs of token_idx, rows [r0, r1) (r0 a
// multiple of 4, so 16-byte loads stay aligned). 4 loads of 16 bytes in flight
// per thread: 32 KB per block per L2 round trip.
template <bool PREFETCH>
__device__ void fill_by_scan(const TokParams& p, const TokSmem& s, int rank, int64_t tc0, int r0, int r1) {
  const int64_t span = min(int64_t(p.cs) * p.tb, p.num_tokens - tc0);
  const char* xb = static_cast<const char*>(p.x);
  auto handle = [&](int r, int64_t t) {
    const int64_t d = t - tc0;
    if (d >= 0 && d < span) {
      const int di = static_cast<int>(d);  // < cs * tb <= 8192: a 32-bit division
      const int owner = di / p.tb;
      const int lt = di - owner * p.tb;
      tok_append(s, p.lcap, owner, rank, lt, r);
      if (PREFETCH && lt < p.pf_tok) prefetch_l2(xb + int64_t(r) * p.row_bytes, p.row_bytes);
    }
  };
  constexpr int kU = 4;
  int r = r0;
  if (p.idx_vec) {
    const int per = p.idx64 ? 2 : 4;  // indices per 16 bytes
    const int nvec = (r1 - r0) / per;
    const int4* base = reinterpret_cast<const int4*>(static_cast<const char*>(p.idx) +
                                                     int64_t(r0) * (p.idx64 ? 8 : 4));
    for (int v0 = threadIdx.x; v0 < nvec; v0 += kU * kTokThreads) {
      int4 buf[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = v0 + u * kTokThreads;
        if (v < nvec) buf[u] = __ldg(base + v);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int v = v0 + u * kTokThreads;
        if (v < nvec) {
          const int rv = r0 + v * per;
          if (p.idx64) {  // two little-endian int64 in the four words
            handle(rv, static_cast<int64_t>((uint64_t(unsigned(buf[u].y)) << 32) | unsigned(buf[u].x)));
            handle(rv + 1, static_cast<int64_t>((uint64_t(unsigned(buf[u].w)) << 32) | unsigned(buf[u].z)));
          } else {
            handle(rv, buf[u].x);
            handle(rv + 1, buf[u].y);
            handle(rv + 2, buf[u].z);
            handle(rv + 3, buf[u].w);
          }
        }
      }
    }
    r = r0 + nvec * per;
  }
  for (int r2 = r + threadIdx.x; r2 < r1; r2 += kU * kTokThreads) {
    int64_t t[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int ru = r2 + u * kTokThreads;
      t[u] = ru < r1 ? load_index(p.idx, ru, p.idx64) : -1;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int ru = r2 + u * kTokThreads;
      if (ru < r1) handle(ru, t[u]);
    }
  }
}

// 1. Fill from the global map (scatter_combine_map.cu): a token's first kEll rows in
// ell[t][.], the rest at operm[ooff[t] ..] (written only when some token has more).
__device__ inline void fill_from_map(const TokParams& p, const TokSmem& s, int64_t t0, int tbl) {
  for (int lt = threadIdx.x; lt < tbl; lt += kTokThreads) {
    const int64_t t = t0 + lt;
    const int c = p.counts[t];
    if (c > p.lcap) {
      s.bad[lt] = 1;
      continue;
    }
    int mine[kEll];
#pragma unroll
    for (int k = 0; k < kEll; ++k) mine[k] = p.ell[t * kEll + k];
#pragma unroll
    for (int k = 0; k < kEll; ++k)
      if (k < c) tok_append(s, p.lcap, 0, 0, lt, mine[k]);
    if (c > kEll) {
      const int o = p.ooff[t];
      for (int k = kEll; k < c; ++k) tok_append(s, p.lcap, 0, 0, lt, p.operm[o + k - kEll]);
    }
  }
}

// ---------------------------------------------------------------------------
// 2. Lists: per-token segments (cnt, off); the rows are at seg_r (backward) or, in
// increasing order, at ent_r (forward). Ends with the block synchronised.
template <bool BWD>
__device__ void build_lists(const TokParams& p, const TokSmem& s) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int ne = min(*s.n, p.lcap);
  for (int e = tid; e < ne; e += kTokThreads) atomicAdd(&s.cnt[s.ent_t[e]], 1);
  __syncthreads();
  // Exclusive scan of cnt[0 .. tb): each thread owns <= 2 consecutive tokens.
  const int per = (p.tb + kTokThreads - 1) / kTokThreads;
  const int i0 = tid * per;
  int local = 0;
  for (int k = 0; k < per; ++k)
    if (i0 + k < p.tb) local += s.cnt[i0 + k];
  const int incl = cuda::warp_inclusive_scan(local);
  if (lane == 31) s.scratch[warp] = incl;
  __syncthreads();
  int run = incl - local;
  for (int w = 0; w < warp; ++w) run += s.scratch[w];
  for (int k = 0; k < per; ++k) {
    const int i = i0 + k;
    if (i < p.tb) {
      const int c = s.cnt[i];
      s.off[i] = run;
      s.pos[i] = run;
      if (!BWD && c > kRankMax) s.bad[i] = 1;
      run += c;
    }
  }
  __syncthreads();
  for (int e = tid; e < ne; e += kTokThreads) {
    const int lt = s.ent_t[e];
    const int q = atomicAdd(&s.pos[lt], 1);
    s.seg_r[q] = s.ent_r[e];
    s.seg_t[q] = static_cast<unsigned short>(lt);
  }
  __syncthreads();
  if (!BWD) {
    // Rank sort: rows are distinct, so the ranks within a segment are too.
    for (int q = tid; q < ne; q += kTokThreads) {
      const int lt = s.seg_t[q];
      if (s.bad[lt]) continue;
      const int o = s.off[lt], c = s.cnt[lt], r = s.seg_r[q];
      int k = 0;
      for (int i = 0; i < c; ++i) k += s.seg_r[o + i] < r;
      s.ent_r[o + k] = r;
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// Lane groups: G lanes (a power of two) at lanes [gbase, gbase + G) of the warp.
struct Group {
  int G, sub;
  unsigned mask;
};

__device__ __forceinline__ Group make_group(int g_log2) {
  Group g;
  g.G = 1 << g_log2;
  const int lane = threadIdx.x & 31;
  g.sub = lane & (g.G - 1);
  g.mask = g.G == 32 ? kFull : ((1u << g.G) - 1u) << (lane & ~(g.G - 1));
  return g;
}

// The group's lanes matching pred in rows [base, base + G), as bits 0..G-1 (row order).
__device__ __forceinline__ unsigned group_ballot(const Group& g, bool pred) {
  const unsigned b = __ballot_sync(g.mask, pred) & g.mask;
  return g.G == 32 ? b : b >> ((threadIdx.x & 31) & ~(g.G - 1));
}

// Every row r in [lo, hi) with pred(idx[r]), in increasing order, to fn(r) (called by
// the whole group). 8 windows of G indices in flight per step; the matches are kept
// as one bit mask.
template <typename Pred, typename Fn>
__device__ __forceinline__ void group_walk(const TokParams& p, const Group& g, int64_t lo, int64_t hi,
                                           Pred pred, Fn fn) {
  constexpr int kW = 8;
#pragma unroll 1
  for (int64_t base = lo; base < hi; base += int64_t(kW) * g.G) {
    unsigned mine = 0;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      const int64_t r = base + int64_t(w) * g.G + g.sub;
      if (r < hi && pred(load_index(p.idx, r, p.idx64))) mine |= 1u << w;
    }
#pragma unroll 1
    for (int w = 0; w < kW; ++w) {
      unsigned b = group_ballot(g, (mine >> w) & 1u);
      while (b) {
        const int k = __ffs(b) - 1;
        b &= b - 1;
        fn(static_cast<int>(base + int64_t(w) * g.G + k));
      }
    }
  }
}

// The lane's vectors of an item: j0 + G m for m < nve, below hvec.
__device__ __forceinline__ int lane_vectors(int j0, int G, int nve, int hvec) {
  return j0 < hvec ? min(nve, (hvec - j0 + G - 1) / G) : 0;
}

// ---------------------------------------------------------------------------
// 3. Forward work, the register path (V = 1, and tokens that need a rescan):
// acc[m][:] += gate(r) * x[r, j + G m], m < NH, one row at a time.
template <typename scalar_t, int V, int NH, typename acc_t>
__device__ __forceinline__ void add_row(const TokParams& p, const Group& g, int r, int j, int nv,
                                        acc_t (&acc)[NH][V]) {
  using vec_t = Vec<scalar_t, V>;
  const acc_t gate = load_gate<acc_t, scalar_t>(p.gates, r, p.g32);
  const vec_t* xr = static_cast<const vec_t*>(p.x) + int64_t(r) * p.hvec + j;
  vec_t xv[NH];
#pragma unroll
  for (int m = 0; m < NH; ++m)
    if (m < nv) xv[m] = xr[int64_t(m) * g.G];
#pragma unroll
  for (int m = 0; m < NH; ++m)
    if (m < nv) {
#pragma unroll
      for (int e = 0; e < V; ++e) acc[m][e] = fma_acc(gate, static_cast<acc_t>(xv[m].v[e]), acc[m][e]);
    }
}

template <typename scalar_t, int V, int NH, typename acc_t>
__device__ __forceinline__ void store_vectors(const TokParams& p, const Group& g, int64_t t, int j, int nv,
                                              const acc_t (&acc)[NH][V]) {
  using vec_t = Vec<scalar_t, V>;
  vec_t* orow = static_cast<vec_t*>(p.out) + t * p.hvec + j;
#pragma unroll
  for (int m = 0; m < NH; ++m)
    if (m < nv) {
      vec_t o;
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = static_cast<scalar_t>(acc[m][e]);
      orow[int64_t(m) * g.G] = o;
    }
}

// One item's vectors, NH at a time, from a row source: rows(i) for i < c (sorted), or
// (c < 0) token_idx walked in row order.
template <typename scalar_t, int V, typename Rows>
__device__ __forceinline__ void forward_item_regs(const TokParams& p, const Group& g, int64_t t, int j0,
                                                  Rows rows, int c) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int NH = V == 1 ? 8 : 2;
  const int nve = lane_vectors(j0, g.G, p.nve, p.hvec);
#pragma unroll 1
  for (int h = 0; h < p.nve; h += NH) {  // group-uniform (the walk's ballots need the group)
    const int j = j0 + g.G * h;
    const int nv = min(NH, max(0, nve - h));
    acc_t acc[NH][V];
#pragma unroll
    for (int m = 0; m < NH; ++m)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[m][e] = acc_t(0);
    if (c >= 0) {
#pragma unroll 1
      for (int i = 0; i < c; ++i) add_row<scalar_t, V, NH>(p, g, rows(i), j, nv, acc);
    } else {
      group_walk(p, g, 0, p.n, [&](int64_t v) { return v == t; },
                 [&](int r) { add_row<scalar_t, V, NH>(p, g, r, j, nv, acc); });
    }
    store_vectors<scalar_t, V, NH>(p, g, t, j, nv, acc);
  }
}

// 3. Forward work, the ring path (V > 1). A lane's work is one stream of tuples
// (item, set of NH of its vectors, row): each tuple's NH vectors are copied into the
// ring D = p.ring / NH tuples ahead of the FMAs that use them, so p.ring vectors are
// in flight per lane across rows, sets and items (a token with one row keeps the
// stream as full as one with eight). NH keeps the accumulators at 16 registers.
template <typename scalar_t, int V>
struct RingShape {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr int kAccRegs = V * static_cast<int>(sizeof(acc_t) / 4);  // per vector
  static constexpr int NH = 16 / kAccRegs < 1 ? 1 : 16 / kAccRegs;         // bf16 2, fp32 4, fp64 4
};

// Where a lane stands in its tuple stream.
struct Cursor {
  int it;       // item (>= items: done)
  int lt, c;    // local token, its rows
  int off;      // its segment
  int j0;       // the lane's first vector
  int h, i;     // set (first vector index) and row
};

template <typename scalar_t, int V, bool BWD>
__device__ __forceinline__ void cursor_item(const TokParams& p, const TokSmem& s, const Group& g, Cursor& u,
                                            int it, int items, int ngroups, int nve) {
  for (; it < items; it += ngroups) {
    const int lt = BWD ? it : it / p.chunks;
    if (!s.bad[lt]) break;
  }
  u.it = it;
  u.h = 0;
  u.i = 0;
  if (it >= items) return;
  u.lt = BWD ? it : it / p.chunks;
  u.c = s.cnt[u.lt];
  u.off = s.off[u.lt];
  u.j0 = BWD ? g.sub : (it - u.lt * p.chunks) * (g.G * p.nve) + g.sub;
  (void)nve;
}

template <typename scalar_t, int V>
__device__ void forward_items_ring(const TokParams& p, const TokSmem& s, int64_t t0, int tbl) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  using R = RingShape<scalar_t, V>;
  constexpr int NH = R::NH;
  const int D = p.ring / NH;  // tuples in flight (>= 1)
  const Group g = make_group(p.g_log2);
  const int group = threadIdx.x >> p.g_log2, ngroups = kTokThreads >> p.g_log2;
  const int items = tbl * p.chunks;
  const vec_t* x = static_cast<const vec_t*>(p.x);
  int4* ring = s.ring + threadIdx.x * p.ring;
  unsigned* gring = s.gring + threadIdx.x * p.ring;
  // The gate travels in the ring with its row (a load at use would stall the stream;
  // fp64 gates, 8 bytes, are read at use: a rare dtype).
  constexpr bool kGateInRing = sizeof(acc_t) == 4;
  // A tuple per (item, set, row); an item with no rows still has one (it stores zeros).
  auto step = [&](Cursor& u) {
    if (++u.i < max(u.c, 1)) return;
    u.i = 0;
    u.h += NH;
    if (u.h < p.nve) return;
    cursor_item<scalar_t, V, false>(p, s, g, u, u.it + ngroups, items, ngroups, p.nve);
  };
  auto issue = [&](const Cursor& u, int k) {  // k: the tuple's ring position, < D
    if (u.it < items && u.c > 0) {
      const int r = s.ent_r[u.off + u.i];
      const int nv = lane_vectors(u.j0, g.G, p.nve, p.hvec) - u.h;
      const vec_t* src = x + int64_t(r) * p.hvec + u.j0 + int64_t(g.G) * u.h;
      int4* slot = ring + k * NH;
#pragma unroll
      for (int m = 0; m < NH; ++m) ring_copy16(slot + m, m < nv ? src + int64_t(m) * g.G : x, m < nv);
      if (kGateInRing) ring_copy_gate<scalar_t>(gring + k, p.gates, r, p.g32);
    }
    ring_commit();  // empty past the end: the wait below counts groups
  };
  Cursor a, b;
  cursor_item<scalar_t, V, false>(p, s, g, a, group, items, ngroups, p.nve);
  b = a;
  int ka = 0, kb = 0;  // ring positions of the next tuple to copy and to use
#pragma unroll 1
  for (int d = 0; d < D - 1; ++d) {
    issue(a, ka);
    ka = ka + 1 == D ? 0 : ka + 1;
    if (a.it < items) step(a);
  }
  acc_t acc[NH][V];
#pragma unroll
  for (int m = 0; m < NH; ++m)
#pragma unroll
    for (int e = 0; e < V; ++e) acc[m][e] = acc_t(0);
#pragma unroll 1
  while (b.it < items) {
    issue(a, ka);
    ka = ka + 1 == D ? 0 : ka + 1;
    if (a.it < items) step(a);
    ring_wait(D - 1);  // b's copies (D tuples back) have landed
    const int nv = min(NH, lane_vectors(b.j0, g.G, p.nve, p.hvec) - b.h);
    if (b.c > 0) {
      const int r = s.ent_r[b.off + b.i];
      acc_t gate;
      if constexpr (kGateInRing) {
        gate = ring_gate<scalar_t>(gring[kb], p.gates, r, p.g32);
      } else {
        gate = load_gate<acc_t, scalar_t>(p.gates, r, p.g32);
      }
      const int4* slot = ring + kb * NH;
#pragma unroll
      for (int m = 0; m < NH; ++m)
        if (m < nv) {
          const int4 raw = slot[m];
          vec_t xv;
          static_assert(sizeof(vec_t) == 16, "ring slots hold one 16-byte vector");
          memcpy(&xv, &raw, 16);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[m][e] = fma_acc(gate, static_cast<acc_t>(xv.v[e]), acc[m][e]);
        }
    }
    if (b.i == max(b.c, 1) - 1) {
      store_vectors<scalar_t, V, NH>(p, g, t0 + b.lt, b.j0 + g.G * b.h, nv, acc);
#pragma unroll
      for (int m = 0; m < NH; ++m)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[m][e] = acc_t(0);
    }
    kb = kb + 1 == D ? 0 : kb + 1;
    step(b);
  }
  ring_wait<0>();
}

template <typename scalar_t, int V>
__device__ void forward_items(const TokParams& p, const TokSmem& s, int64_t t0, int tbl) {
  const Group g = make_group(p.g_log2);
  const int group = threadIdx.x >> p.g_log2, ngroups = kTokThreads >> p.g_log2;
  const int items = tbl * p.chunks;
  if constexpr (V > 1) forward_items_ring<scalar_t, V>(p, s, t0, tbl);
  // The register path: every item when V == 1, the rescans otherwise.
#pragma unroll 1
  for (int it = group; it < items; it += ngroups) {
    const int lt = it / p.chunks;
    const bool bad = s.bad[lt];
    if (V > 1 && !bad) continue;
    const int j0 = (it - lt * p.chunks) * (g.G * p.nve) + g.sub;
    const int* rows = s.ent_r + s.off[lt];
    forward_item_regs<scalar_t, V>(p, g, t0 + lt, j0, [&](int i) { return rows[i]; }, bad ? -1 : s.cnt[lt]);
  }
}

// ---------------------------------------------------------------------------
// 3. Backward work, the register path, one row: grad_x[r] = gate * gy_row and the
// group's <gy_row, x[r]> (each lane its vectors sub, sub + G, ... in increasing order,
// NB at a time), then reduced by an xor butterfly: every lane ends with the same bits.
// The ring path and the row-parallel kernel (scatter_combine_backward.cu) take each
// lane's vectors in the same order, so every backward path gives the same bits.
constexpr int kBwdNB = 2;  // vectors of each operand per step (ring: per tuple)

template <typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ void backward_step(const Vec<scalar_t, V>& a, const Vec<scalar_t, V>& b, acc_t gate,
                                              Vec<scalar_t, V>* out, acc_t& dot) {
  Vec<scalar_t, V> o;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const acc_t d = static_cast<acc_t>(a.v[e]);
    o.v[e] = static_cast<scalar_t>(gate * d);
    dot = fma_acc(d, static_cast<acc_t>(b.v[e]), dot);
  }
  *out = o;
}

template <typename scalar_t, int V, typename acc_t>
__device__ __forceinline__ acc_t backward_row(const Vec<scalar_t, V>* __restrict__ gy_row,
                                              const Vec<scalar_t, V>* __restrict__ x_row,
                                              Vec<scalar_t, V>* __restrict__ gx_row, acc_t gate, int hvec,
                                              const Group& g) {
  using vec_t = Vec<scalar_t, V>;
  acc_t dot = acc_t(0);
#pragma unroll 1
  for (int c0 = g.sub; c0 < hvec; c0 += g.G * kBwdNB) {
    vec_t a[kBwdNB], b[kBwdNB];
#pragma unroll
    for (int m = 0; m < kBwdNB; ++m) {
      const int j = c0 + g.G * m;
      if (j < hvec) {
        a[m] = gy_row[j];
        b[m] = x_row[j];
      }
    }
#pragma unroll
    for (int m = 0; m < kBwdNB; ++m) {
      const int j = c0 + g.G * m;
      if (j < hvec) backward_step<scalar_t, V>(a[m], b[m], gate, gx_row + j, dot);
    }
  }
  return dot;
}

template <typename acc_t>
__device__ __forceinline__ acc_t group_sum(const Group& g, acc_t v) {
  for (int o = g.G >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(g.mask, v, o);
  return v;
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_grad_gate(const TokParams& p, int r, acc_t v) {
  if (p.g32) {
    static_cast<float*>(p.gg)[r] = static_cast<float>(v);
  } else {
    static_cast<scalar_t*>(p.gg)[r] = static_cast<scalar_t>(v);
  }
}

// Rows whose index matches no token: zero gradients.
template <typename scalar_t, int V>
__device__ __forceinline__ void zero_row(const TokParams& p, const Group& g, int r) {
  using vec_t = Vec<scalar_t, V>;
  vec_t z;
#pragma unroll
  for (int e = 0; e < V; ++e) z.v[e] = scalar_t(0);
  vec_t* gxr = static_cast<vec_t*>(p.out) + int64_t(r) * p.hvec;
#pragma unroll 1
  for (int j = g.sub; j < p.hvec; j += g.G) gxr[j] = z;
  if (g.sub == 0) store_grad_gate<scalar_t>(p, r, 0.0f);
}

template <typename scalar_t, int V>
__device__ __forceinline__ void backward_one(const TokParams& p, const Group& g, int64_t t, int r) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  const acc_t gate = load_gate<acc_t, scalar_t>(p.gates, r, p.g32);
  const acc_t dot = backward_row<scalar_t, V>(
      static_cast<const vec_t*>(p.gy) + t * p.hvec, static_cast<const vec_t*>(p.x) + int64_t(r) * p.hvec,
      static_cast<vec_t*>(p.out) + int64_t(r) * p.hvec, gate, p.hvec, g);
  const acc_t sum = group_sum(g, dot);
  if (g.sub == 0) store_grad_gate<scalar_t>(p, r, sum);
}

// 3. Backward work, the ring path (V > 1): tuples (token, row, set of kBwdNB of the
// lane's vectors), each copying kBwdNB vectors of grad_out[t] and of x[r] into the
// ring, D = p.ring / (2 kBwdNB) tuples ahead (3 with kRing); a row's last set reduces
// its dot.
template <typename scalar_t, int V>
__device__ void backward_items_ring(const TokParams& p, const TokSmem& s, int64_t t0, int tbl) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec<scalar_t, V>;
  constexpr int NB = kBwdNB;
  const int D = p.ring / (2 * NB);  // tuples in flight (>= 1)
  const Group g = make_group(p.g_log2);
  const int group = threadIdx.x >> p.g_log2, ngroups = kTokThreads >> p.g_log2;
  const int items = tbl;
  const int nvl = lane_vectors(g.sub, g.G, (p.hvec + g.G - 1) / g.G, p.hvec);  // the lane's vectors per row
  const int sets = ((p.hvec + g.G - 1) / g.G + NB - 1) / NB;                   // per row, group-uniform
  const vec_t* x = static_cast<const vec_t*>(p.x);
  const vec_t* gy = static_cast<const vec_t*>(p.gy);
  vec_t* gx = static_cast<vec_t*>(p.out);
  int4* ring = s.ring + threadIdx.x * p.ring;
  unsigned* gring = s.gring + threadIdx.x * p.ring;
  constexpr bool kGateInRing = sizeof(acc_t) == 4;  // as in the forward
  // Cursor: it = token item, i = row, h = set. Tokens with no rows have no tuples.
  auto skip_empty = [&](Cursor& u) {
    while (u.it < items && u.c == 0) cursor_item<scalar_t, V, true>(p, s, g, u, u.it + ngroups, items, ngroups, 0);
  };
  auto step = [&](Cursor& u) {
    if (++u.h < sets) return;
    u.h = 0;
    if (++u.i < u.c) return;
    cursor_item<scalar_t, V, true>(p, s, g, u, u.it + ngroups, items, ngroups, 0);
    skip_empty(u);
  };
  auto issue = [&](const Cursor& u, int k) {
    if (u.it < items) {
      const int r = s.seg_r[u.off + u.i];
      const int j = g.sub + g.G * NB * u.h;
      const vec_t* gs = gy + (t0 + u.lt) * p.hvec + j;
      const vec_t* xs = x + int64_t(r) * p.hvec + j;
      int4* slot = ring + k * 2 * NB;
#pragma unroll
      for (int m = 0; m < NB; ++m) {
        const bool ok = NB * u.h + m < nvl;
        ring_copy16(slot + m, ok ? gs + int64_t(m) * g.G : gy, ok);  // (no bytes read when !ok)
        ring_copy16(slot + NB + m, ok ? xs + int64_t(m) * g.G : x, ok);
      }
      if (kGateInRing) ring_copy_gate<scalar_t>(gring + k, p.gates, r, p.g32);
    }
    ring_commit();
  };
  Cursor a, b;
  cursor_item<scalar_t, V, true>(p, s, g, a, group, items, ngroups, 0);
  skip_empty(a);
  b = a;
  int ka = 0, kb = 0;
#pragma unroll 1
  for (int d = 0; d < D - 1; ++d) {
    issue(a, ka);
    ka = ka + 1 == D ? 0 : ka + 1;
    if (a.it < items) step(a);
  }
  acc_t dot = acc_t(0);
#pragma unroll 1
  while (b.it < items) {
    issue(a, ka);
    ka = ka + 1 == D ? 0 : ka + 1;
    if (a.it < items) step(a);
    ring_wait(D - 1);
    const int r = s.seg_r[b.off + b.i];
    acc_t gate;
    if constexpr (kGateInRing) {
      gate = ring_gate<scalar_t>(gring[kb], p.gates, r, p.g32);
    } else {
      gate = load_gate<acc_t, scalar_t>(p.gates, r, p.g32);
    }
    const int4* slot = ring + kb * 2 * NB;
    vec_t* out = gx + int64_t(r) * p.hvec + g.sub + g.G * NB * b.h;
#pragma unroll
    for (int m = 0; m < NB; ++m)
      if (NB * b.h + m < nvl) {
        vec_t av, bv;
        const int4 ra = slot[m], rb = slot[NB + m];
        memcpy(&av, &ra, 16);
        memcpy(&bv, &rb, 16);
        backward_step<scalar_t, V>(av, bv, gate, out + int64_t(m) * g.G, dot);
      }
    if (b.h == sets - 1) {
      const acc_t sum = group_sum(g, dot);
      if (g.sub == 0) store_grad_gate<scalar_t>(p, r, sum);
      dot = acc_t(0);
    }
    kb = kb + 1 == D ? 0 : kb + 1;
    step(b);
  }
  ring_wait<0>();
}

// Items: the block's tokens, then (each cluster's first round only) one slice per
// lane group of the rows this block scanned, [z0, z1): their invalid rows get zeros.
template <typename scalar_t, int V>
__device__ void backward_items(const TokParams& p, const TokSmem& s, int64_t t0, int tbl, bool zero_invalid,
                               int64_t z0, int64_t z1) {
  const Group g = make_group(p.g_log2);
  const int group = threadIdx.x >> p.g_log2, ngroups = kTokThreads >> p.g_log2;
  if constexpr (V > 1) backward_items_ring<scalar_t, V>(p, s, t0, tbl);
  const int items = tbl + (zero_invalid ? ngroups : 0);
  const int64_t T = p.num_tokens;
#pragma unroll 1
  for (int it = group; it < items; it += ngroups) {
    if (it < tbl) {
      const bool bad = s.bad[it];
      if (V > 1 && !bad) continue;
      const int64_t t = t0 + it;
      if (bad) {
        group_walk(p, g, 0, p.n, [&](int64_t v) { return v == t; },
                   [&](int r) { backward_one<scalar_t, V>(p, g, t, r); });
      } else {
        const int* rows = s.seg_r + s.off[it];
        const int c = s.cnt[it];
#pragma unroll 1
        for (int i = 0; i < c; ++i) backward_one<scalar_t, V>(p, g, t, rows[i]);
      }
    } else {
      const int k = it - tbl;
      const int64_t a = z0 + (z1 - z0) * k / ngroups, b = z0 + (z1 - z0) * (k + 1) / ngroups;
      group_walk(p, g, a, b, [&](int64_t v) { return v < 0 || v >= T; },
                 [&](int r) { zero_row<scalar_t, V>(p, g, r); });
    }
  }
}

// ---------------------------------------------------------------------------
// The kernel. Launched with cluster dimension p.cs (1: a plain launch); clusters
// take rounds cr = cluster id, + clusters, ... so every block of a cluster runs the
// same rounds (the cluster barriers need all of them).
template <typename scalar_t, int V, bool BWD>
__global__ void __launch_bounds__(kTokThreads, 1) scatter_tokens_kernel(const TokParams p) {
  extern __shared__ __align__(16) unsigned char tok_smem[];
  const TokSmem s = tok_carve(tok_smem, p.tb, p.lcap, p.ring);
  const int cs = p.cs;
  const int rank = cluster_rank(cs);
  const int64_t cid = blockIdx.x / cs, ncl = gridDim.x / cs;
  const int64_t span_cl = int64_t(cs) * p.tb;
  const int64_t ncr = (p.num_tokens + span_cl - 1) / span_cl;
  // Scan mode: this block's rows of token_idx (a multiple of 4 rows per block).
  const int64_t per = ((int64_t(p.n) + cs - 1) / cs + 3) & ~int64_t(3);
  const int r0 = static_cast<int>(min(int64_t(p.n), rank * per));
  const int r1 = static_cast<int>(min(int64_t(p.n), r0 + per));
#pragma unroll 1
  for (int64_t cr = cid; cr < ncr; cr += ncl) {
    const int64_t tc0 = cr * span_cl;
    const int64_t t0 = tc0 + int64_t(rank) * p.tb;
    const int tbl = static_cast<int>(max(int64_t(0), min(int64_t(p.tb), p.num_tokens - t0)));
    for (int i = threadIdx.x; i < p.tb; i += kTokThreads) {
      s.cnt[i] = 0;
      s.bad[i] = 0;
    }
    if (threadIdx.x == 0) *s.n = 0;
    cluster_or_block_sync(cs);  // every list of the cluster empty before anyone appends
    if (p.map) {
      fill_from_map(p, s, t0, tbl);
    } else if (!BWD && p.pf_tok > 0) {
      fill_by_scan<true>(p, s, rank, tc0, r0, r1);
    } else {
      fill_by_scan<false>(p, s, rank, tc0, r0, r1);
    }
    cluster_or_block_sync(cs);  // every append done and visible
    build_lists<BWD>(p, s);
    if constexpr (BWD) {
      const bool first = cr == cid;
      const int64_t z0 = r0 + (int64_t(r1) - r0) * cid / ncl, z1 = r0 + (int64_t(r1) - r0) * (cid + 1) / ncl;
      backward_items<scalar_t, V>(p, s, t0, tbl, first, z0, z1);
    } else {
      forward_items<scalar_t, V>(p, s, t0, tbl);
    }
    __syncthreads();  // the lists are reset next round
  }
}

// ---------------------------------------------------------------------------
// Host side: what a plan needs to know about one instantiation on one device, read
// once (attribute calls; the first call of a process makes them, before any capture).

// All an sm_90 block may have (227 KB): one block per SM (the scan costs each SM
// n / cs index reads per round whatever its blocks: two blocks per SM would double
// it), the ring's 96 KB and ~9900 entries beside 1024 tokens.
constexpr size_t kTokSmemTarget = 227 * 1024;

struct KernelFacts {
  size_t smem = 0;        // dynamic shared memory per block
  int ring = kRing;       // ring slots per lane
  int64_t blocks = 0;     // resident blocks on the device (no clusters)
  int cs = 1;             // cluster size to launch with (1: none)
  int64_t slots = 0;      // resident clusters of cs blocks
  bool sm90 = false;      // compiled for sm_90 or later (clusters, bulk prefetch)
};

template <typename Kernel>
KernelFacts read_kernel_facts(Kernel kernel, int threads, const DeviceFacts& dev) {
  KernelFacts f;
  f.smem = std::min<size_t>(kTokSmemTarget, static_cast<size_t>(dev.smem_optin));
  // 96 KB of ring leaves room for lists only with >= 160 KB (sm_80 163 KB, sm_90 227 KB).
  f.ring = f.smem >= 160 * 1024 ? kRing : kRingSmall;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(f.smem)));
  cudaFuncAttributes a{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, f.smem));
  f.blocks = int64_t(std::max(per_sm, 1)) * dev.sms;
  f.slots = f.blocks;
  f.sm90 = dev.cc_major >= 9 && a.ptxVersion >= 90;
  if (!f.sm90) return f;
  // Portable cluster sizes, largest first: 8 blocks read token_idx once for 8 SMs.
  for (int cs : {8, 4, 2}) {
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cs;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(cs);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = f.smem;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // not a sticky error: this size is just not usable
      clusters = 0;
    }
    if (clusters > 0) {
      f.cs = cs;
      f.slots = clusters;
      break;
    }
  }
  return f;
}

// read_kernel_facts for scatter_tokens_kernel<scalar_t, V, BWD>, once per device.
template <typename scalar_t, int V, bool BWD>
const KernelFacts& token_kernel_facts(const DeviceFacts& dev, c10::DeviceIndex device) {
  static KernelFacts facts[C10_COMPILE_TIME_MAX_GPUS];
  static std::once_flag once[C10_COMPILE_TIME_MAX_GPUS];
  std::call_once(once[device], [&] {
    facts[device] = read_kernel_facts(scatter_tokens_kernel<scalar_t, V, BWD>, kTokThreads, dev);
  });
  return facts[device];
}

// Launch on `stream`, as a cluster launch when plan.p.cs > 1; checked.
template <typename scalar_t, int V, bool BWD>
void launch_token_kernel(const TokPlan& plan, cudaStream_t stream) {
  auto* kernel = scatter_tokens_kernel<scalar_t, V, BWD>;
  if (plan.p.cs > 1) {
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(plan.p.cs);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.gridDim = dim3(static_cast<unsigned>(plan.grid));
    cfg.blockDim = dim3(kTokThreads);
    cfg.dynamicSmemBytes = plan.smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, plan.p));
  } else {
    kernel<<<static_cast<unsigned>(plan.grid), kTokThreads, plan.smem, stream>>>(plan.p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace sc_detail
} // namespace opreg
