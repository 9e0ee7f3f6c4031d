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
// Then it lets the next PDL launch be scheduled (launch_dependents): that kernel also waits
// for this one to complete before it touches memory, so the release is safe anywhere. Without
// PDL both instructions return at once; below sm_90 they are compiled out.
//
// The host side is launch(): with `pdl`, the kernel is launched through cudaLaunchKernelEx with
// cudaLaunchAttributeProgrammaticStreamSerialization; a stream capture records the relation as
// a programmatic edge of the graph (CUDA 12.3+). pdl_wanted() decides: OPREG_PDL=1 in the
// environment (read per call, as OPREG_CAT_LINEAR_PATH, so a benchmark compares both in one
// process) and a device of compute capability 9.0 or newer. Off by default until a GPU run
// has measured it and its tests have passed there (bench/RESULTS.md, "Not yet run").
#pragma once

#include <c10/cuda/CUDAException.h>
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
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Launch with PDL on the current device? OPREG_PDL=1 (per call) and compute capability >= 9
// (read once per device: an attribute query, legal while a stream captures).
inline bool pdl_wanted() {
  const char* e = std::getenv("OPREG_PDL");
  if (e == nullptr || e[0] != '1' || e[1] != '\0') return false;
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
