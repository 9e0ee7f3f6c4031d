// What backends/common/scatter_combine_paths.h picks, for tests/test_scatter_combine.py and
// bench/scatter_paths.py --evaluate on any machine (the choice is plain C++ on sizes: no CUDA).
// Reads lines "T k H elt [ib]" (T tokens, k rows each: N = T k; rows of H elements of elt
// bytes; token_idx 16-byte aligned, of ib-byte indices, 4 (int32) unless given; rows in 16-byte
// vectors where H elt is a multiple of 16) and
// writes the forward's path for each: tiny, small, or large with its form, "large local" or
// "large fused" (on 132 SMs: the H100's and the H200's). OPREG_SCATTER_COMBINE_PATH is read
// as the op reads it; OPREG_SCATTER_COMBINE_LARGE is not read (it forces a form, not a choice).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "scatter_combine_paths.h"

namespace p = opreg::scatter_combine_paths;

constexpr long long kSms = 132;  // the H100's and the H200's SMs

static p::Path forced() {
  const char* e = std::getenv("OPREG_SCATTER_COMBINE_PATH");
  if (e == nullptr || e[0] == '\0') return p::Path::kAuto;
  if (std::strcmp(e, "tiny") == 0) return p::Path::kTiny;
  if (std::strcmp(e, "small") == 0) return p::Path::kSmall;
  if (std::strcmp(e, "large") == 0) return p::Path::kLarge;
  std::fprintf(stderr, "OPREG_SCATTER_COMBINE_PATH must be tiny, small or large, got '%s'\n", e);
  std::exit(2);
}

int main() {
  long long t, k, h, elt, ib;
  const p::Path f = forced();
  char line[256];
  while (std::fgets(line, sizeof line, stdin) != nullptr) {
    const int got = std::sscanf(line, "%lld %lld %lld %lld %lld", &t, &k, &h, &elt, &ib);
    if (got < 4) break;
    if (got == 4) ib = 4;
    const long long v = (h * elt) % 16 == 0 ? 16 / elt : 1, n = t * k;
    const long long gy = p::column_chunks(h / v, v);
    const bool local = p::local_pays(n, ib, t, kSms);
    const p::Path path = p::choose_forward(n, t, gy, gy <= 65535, n <= p::kSmallMaxRows && gy <= 65535, local, f);
    const char* large = local ? "large local" : "large fused";
    std::printf("%s\n", path == p::Path::kTiny ? "tiny" : path == p::Path::kSmall ? "small" : large);
  }
  return 0;
}
