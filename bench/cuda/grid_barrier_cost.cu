// bench/grid_barrier_cost.py's kernels: what one cooperative launch and each grid barrier in
// it cost, by grid shape. Nothing here is on opreg's build.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <torch/extension.h>

namespace {

// `barriers` grid-wide barriers and nothing else; `sink` only keeps the kernel from being empty
// to the compiler.
__global__ void grid_barriers_kernel(int barriers, int* sink) {
  const cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  for (int i = 0; i < barriers; ++i) grid.sync();
  if (barriers < 0) sink[threadIdx.x] = int(blockIdx.x);
}

// The blocks of `threads` threads an SM that can be resident together (the grid's cap).
int64_t max_blocks_per_sm(int64_t threads) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grid_barriers_kernel,
                                                               static_cast<int>(threads), 0));
  return per_sm;
}

// One cooperative launch of `blocks` x `threads` on the current stream.
void launch(int64_t blocks, int64_t threads, int64_t barriers, torch::Tensor sink) {
  TORCH_CHECK(sink.is_cuda() && sink.scalar_type() == torch::kInt32 && sink.numel() >= threads,
              "sink: an int32 CUDA tensor of at least `threads` elements");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, grid_barriers_kernel, static_cast<int>(barriers),
                                    sink.data_ptr<int>()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("max_blocks_per_sm", &max_blocks_per_sm);
  m.def("launch", &launch);
}
