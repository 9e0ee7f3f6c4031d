// Programmatic dependent launch (PDL, sm_90+) for the ops' single-launch kernels (cat_linear's
// dot and SIMT kernels, scatter_combine's tiny, small and backward kernels).
//
// Why: at the seeds' sizes these kernels are each one memory round trip, and in a CUDA graph
// a call costs about as much again in the gap between one kernel's end and the next one's
// start (H200, 2026-12-05, bench/cat_linear_paths.py: cat_linear's dot kernel 2.05 us a
// replayed call, a copy of the same bytes 1.4; issue 19 asks <= 2 us). Launched with PDL, a
// kernel may be scheduled while the kernel before it on the stream still runs, and waits in
// griddepcontrol.wait for that kernel to complete and its writes to be visible; so the launch
// overlaps the previous kernel's tail instead of following it.
//
// The device side is await_prior_grids(), the first statement of every such kernel: every
// global load AND store comes after the wait (a store must not land while the kernel before
// still reads that memory: the caching allocator hands freed blocks to the next op at once).
// Without PDL it returns at once; below sm_90 it is compiled out.
//
// No kernel calls griddepcontrol.launch_dependents, so the next PDL launch is released as
// this kernel's blocks exit (the implicit trigger), not at its start. Why: with the release
// as the first statement, after the wait, cat_linear's dot kernel ran 15-42 % slower in a
// CUDA graph at three fp32 shapes with B = 4 (R2 B4 H512 K2048 1.416x, R32 B4 H64 K2048
// 1.322, R8 B4 H64 K2048 1.148; the same three in two runs, H100, 2026-12-05); with no
// explicit release, over the same 48 B = 2 / 4 shapes, none was slower by more than 0.3 %,
// and the median gain stayed (0.956 against 0.952 of the time without PDL), as did the seeds'
// (bench/RESULTS.md, forty-sixth session). Why the early release costs there is not known:
// those grids fit the GPU in one wave.
//
// The host side is launch(): with `pdl`, the kernel is launched through cudaLaunchKernelEx with
// cudaLaunchAttributeProgrammaticStreamSerialization; a stream capture records the relation as
// a programmatic edge of the graph (CUDA 12.3+). pdl_wanted() decides: a device of compute
// capability 9.0 or newer, unless OPREG_PDL=0 (read per call, as OPREG_CAT_LINEAR_PATH, so a
// benchmark compares both in one process). On by default since 2026-12-05 (forty-eighth
// session), from two H100 runs of every path (bench/RESULTS.md): where the op runs a PDL
// kernel, PDL was never more than 0.3 % slower in a CUDA graph (cat_linear's dot and SIMT
// kernels, 73 shapes: median 0.914 of the time without; scatter_combine's tiny and small
// kernels, 63 shapes: median 0.894, max 0.963), nor after a cuBLAS GEMM of several waves (the
// seeds' calls after one, replayed: 14.9 and 12.8 us with PDL, 14.9 and 12.9 without); both
// ops' CUDA tests pass with it. The H200 has not timed it: none has been lent since the
// forty-second session.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

#include "cuda_common.cuh"

namespace opreg {
namespace cuda {

// The first statement of a kernel that may be launched with PDL (see above).
__device__ __forceinline__ void await_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launch with PDL on the current device? Compute capability >= 9 (read once per device: an
// attribute query, legal while a stream captures), unless OPREG_PDL=0 (read per call; unset,
// empty or 1 mean on; any other value is an error, not a silent default).
inline bool pdl_wanted() {
  const char* e = std::getenv("OPREG_PDL");
  if (e != nullptr && e[0] != '\0') {
    const bool off = e[0] == '0' && e[1] == '\0';
    TORCH_CHECK(off || (e[0] == '1' && e[1] == '\0'), "OPREG_PDL must be 0 or 1 (unset: 1), got '", e, "'");
    if (off) return false;
  }
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(dev) >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with PDL where `pdl`; checked.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

} // namespace cuda
} // namespace opreg
