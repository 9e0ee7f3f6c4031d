// Argument-validation helpers shared by every op's checks (<op>_checks.h) and
// by the CPU and CUDA kernels of opreg.
//
// Kept to light ATen/c10 headers so that .cu files including it compile fast.
// Exception macros are chosen so that Python sees the right built-in type:
//   TORCH_CHECK_VALUE -> ValueError  (ranks, shapes, lengths, devices, counts)
//   TORCH_CHECK_TYPE  -> TypeError   (dtypes)
// Every message starts with the op name and names the offending argument.
// Each op's own checks live next to it in <op>_checks.h, in the wording of its
// Python spec (opreg/ops/<op>.py), so that every implementation fails alike.
// Index *range* checks are not here: they need to read token_idx, which is
// device-specific, so each backend does them in its own kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>

namespace opreg {

// Numbers and shapes go into messages as std::string, never streamed: on the H200 box
// (torch 2.11, g++ 13.3) an extension that streamed an int64_t into a c10 error message
// segfaulted inside std::ostream::_M_insert<long> (2026-11-29), a libstdc++ mismatch
// between the extension and the process. Strings stream safely.
inline std::string num(int64_t v) {
  return std::to_string(v);
}

inline std::string shape(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(s[i]);
  }
  return out + "]";
}

namespace detail {

inline bool is_supported_float(c10::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf ||
      t == at::kBFloat16;
}

inline void check_float_dtype(
    const char* op,
    const char* name,
    const at::Tensor& t) {
  TORCH_CHECK_TYPE(
      is_supported_float(t.scalar_type()),
      op, ": ", name,
      " must be float32, float16, bfloat16 or float64, got ",
      t.scalar_type());
}

// All inputs of an op must live on one device: the dispatcher picks the
// kernel from the highest-priority device, so a mixed call would otherwise
// read foreign memory.
inline void check_same_device(
    const char* op,
    const char* name,
    const at::Tensor& t,
    const char* ref_name,
    const at::Tensor& ref) {
  TORCH_CHECK_VALUE(
      t.device() == ref.device(),
      op, ": ", name, " is on ", t.device().str(), " but ", ref_name, " is on ",
      ref.device().str());
}

} // namespace detail
} // namespace opreg
