// Which CPU path opreg::cat_linear (and cat_linear_stacked) runs: eager's own computation,
// at::cat of the parts and one GEMM in the parts' dtype ("one GEMM"), or a GEMM per part
// into one float32 (float64) output, without the concatenation ("per part"), from sizes
// and dtype (backends/cpu/cat_linear.cpp).
//
// * float32 / float64: one GEMM below ~4M multiply-adds, where each GEMM call's fixed cost
//   outweighs copying the parts (R4 B12 H32 K56 fp32, 2 cores: 31.8 us as four GEMMs
//   against 12.2 as cat + one GEMM; equal from B64 H256 K1024 up).
// * bfloat16 / float16 where torch's own GEMM in that dtype runs on oneDNN
//   (mkldnn::_is_mkldnn_bf16_supported / _fp16_supported: AVX512 or AMX): one GEMM at every
//   size, eager's computation. The per-part path has to accumulate in float32, so it
//   converts the weight and every part to float32 on every call: on the 2-core AMD EPYC box
//   (AVX512-BF16, 2026-12-04) it took 1.2-4.2x eager's time in bf16 from ~250K
//   multiply-adds up (R8 B2 H64 K256: 168 us against 41; R8 B256 H64 K256: 746 against
//   343), where torch's bf16 GEMM ran ~2x its float32 one.
// * bfloat16 / float16 elsewhere: per part, in float32, rounded once: there torch's
//   half-precision GEMMs are emulated (fp16 on that box, no AVX512-FP16: eager took
//   1.4-4.2x the per-part path's time from R8 B16 H64 K256 to R8 B256 H64 K256).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>

namespace opreg {
namespace cat_linear_cpu {

// torch's own answer to "does oneDNN run GEMMs in this dtype", asked once per process
// through the dispatcher (false in a torch built without oneDNN).
inline bool onednn_supports(const char* op) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  return handle.has_value() && handle->typed<bool()>().call();
}

inline bool native_half_gemm(at::ScalarType t) {
  static const bool bf16 = onednn_supports("mkldnn::_is_mkldnn_bf16_supported");
  static const bool fp16 = onednn_supports("mkldnn::_is_mkldnn_fp16_supported");
  return t == at::kBFloat16 ? bf16 : t == at::kHalf ? fp16 : false;
}

// One GEMM over the concatenated parts (eager's computation) for m rows of weight (N, K)?
inline bool one_gemm(const at::Tensor& weight, int64_t m) {
  const at::ScalarType t = weight.scalar_type();
  if (at::isReducedFloatingType(t)) return native_half_gemm(t);
  return m * weight.size(0) * weight.size(1) < (int64_t(1) << 22);
}

}  // namespace cat_linear_cpu
}  // namespace opreg
