// What backends/common/cat_linear_model.h picks, for tests/test_cat_linear.py on any machine
// (the model is plain C++ on sizes: no CUDA). Reads lines "R B H K elt" (R parts of width H,
// B rows, K outputs, elt bytes per element; 16-byte loads where the widths allow) and writes
// "<back to back> <in a CUDA graph> <with gradients: eager's ops 1/0>" for each, on the
// H200's 132 SMs. OPREG_CAT_LINEAR_PATH is read as the op reads it.
#include <cstdio>

#include "cat_linear_model.h"

namespace m = opreg::cat_linear_model;

static const char* name(m::Path p) {
  return p == m::Path::kDot ? "dot" : p == m::Path::kSimt ? "simt" : "gemm";
}

int main() {
  long long r, b, h, k, elt;
  while (std::scanf("%lld %lld %lld %lld %lld", &r, &b, &h, &k, &elt) == 5) {
    const long long v = 16 / elt, width = r * h;
    const m::Work w{b, k, width, r, r * m::cdiv(h, m::chunk_cols(elt)), elt, h % v == 0 && width % v == 0};
    const m::Path sizes = m::choose_path(w, m::kH200Sms);
    const bool gemm_in_graph = m::graph_prefers_gemm(w, sizes, m::kH200Sms);
    std::printf("%s %s %d\n", name(sizes), gemm_in_graph ? "gemm" : name(sizes),
                static_cast<int>(m::grad_runs_eager(w, m::kH200Sms)));
  }
  return 0;
}
