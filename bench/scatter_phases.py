"""Where scatter_combine's forward spends its GPU time at >= 16 MB, by kernel (CUDA).

    python bench/scatter_phases.py [--shapes "T4096 k1 H1024 bf16,..."] [--calls 20]

Per shape (random routing, int32 indices): the default path's time per call replayed from a
CUDA graph (the host taken out), a copy of the same bytes the same way, the copy bound
(bytes over the 1 GiB copy rate); where the small path may run (<= 8192 rows), the same
sums through the large path (ignored rows appended); then the multi-kernel form of the large path
(``OPREG_SCATTER_COMBINE_LARGE=multi``: memset, count, scan, place, reduce, each its own
kernel) under torch.profiler, each kernel's device time per call: what the fused
cooperative kernel's phases cost, apart.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing as tm  # noqa: E402

import opreg  # noqa: E402

SHAPES = ["T4096 k1 H1024 bf16", "T16384 k1 H1024 bf16", "T65536 k1 H1024 bf16", "T16384 k2 H1024 bf16",
          "T4096 k8 H1024 bf16", "T65536 k1 H128 bf16", "T16384 k8 H128 bf16", "T65536 k2 H128 bf16",
          "T4096 k8 H128 fp32", "T16384 k2 H4096 bf16",
          # small-path shapes (<= 8192 rows)
          "T1024 k8 H1024 bf16", "T1024 k1 H4096 bf16", "T256 k8 H4096 bf16", "T1024 k2 H1024 bf16",
          "T512 k8 H1024 bf16", "T1024 k8 H128 bf16"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SMALL_MAX_ROWS = 8192  # kSmallMaxRows (backends/common/scatter_combine_paths.h): above it, the large path


def parse_shape(s: str) -> tuple[int, int, int, torch.dtype]:
    t, k, h, d = s.split()
    return int(t[1:]), int(k[1:]), int(h[1:]), DTYPES[d]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    op = opreg.get("scatter_combine")
    bps = tm.copy_bandwidth("cuda")
    print(f"copy {bps / 1e9:.0f} GB/s; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for label in a.shapes.split(","):
        t, k, h, dt = parse_shape(label.strip())
        n = t * k
        sets = []
        for _ in range(tm.sets_needed(n * h * dt.itemsize * 2, "cuda")):
            idx = torch.arange(t, device="cuda").repeat_interleave(k)[torch.randperm(n, device="cuda")]
            sets.append(dict(h=torch.randn(n, h, device="cuda", dtype=dt), idx=idx.to(torch.int32),
                             g=torch.rand(n, device="cuda", dtype=dt)))
        nbytes = n * h * dt.itemsize + n * (4 + dt.itemsize) + t * h * dt.itemsize
        src = torch.rand(max(1, int(nbytes // 8)), device="cuda")
        dst = torch.empty_like(src)
        v = tm.Variant(lambda i: op(sets[i]["h"], sets[i]["idx"], sets[i]["g"], t))
        us = tm.graph_us(v, len(sets), calls=a.calls)
        cus = tm.graph_us(tm.Variant(lambda i: dst.copy_(src)), 1, calls=a.calls)
        bound = nbytes / bps * 1e6
        print(f"\n{label}: {nbytes / 1e6:.1f} MB, bound {bound:.1f} us; default path {us:.1f} us in a graph "
              f"({100 * bound / us:.0f} % of copy; a copy of the same bytes {cus:.1f} us)")
        if n <= SMALL_MAX_ROWS:  # the small path may run: the same sums through the large one
            pad = SMALL_MAX_ROWS + 1 - n  # rows with an index outside [0, T): counted out, never read
            padded = [dict(h=torch.cat([s_["h"], s_["h"].new_zeros(pad, h)]),
                           idx=torch.cat([s_["idx"], s_["idx"].new_full((pad,), -1)]),
                           g=torch.cat([s_["g"], s_["g"].new_zeros(pad)])) for s_ in sets]
            lv = tm.Variant(lambda i: op(padded[i]["h"], padded[i]["idx"], padded[i]["g"], t))
            assert torch.equal(lv.call(0), v.call(0))
            lus = tm.graph_us(lv, len(padded), calls=a.calls)
            print(f"  the large path ({pad} ignored rows appended: > {SMALL_MAX_ROWS} rows) {lus:.1f} us "
                  f"({100 * bound / lus:.0f} % of copy)")
        os.environ["OPREG_SCATTER_COMBINE_LARGE"] = "multi"
        try:
            mus = tm.graph_us(v, len(sets), calls=a.calls)
            for i in range(3):
                v.call(i % len(sets))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(a.calls):
                    v.call(i % len(sets))
                torch.cuda.synchronize()
        finally:
            del os.environ["OPREG_SCATTER_COMBINE_LARGE"]
        print(f"  multi-kernel form {mus:.1f} us in a graph; its kernels, device us per call:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total > 0:
                print(f"    {e.device_time_total / a.calls:7.2f}  {e.key[:100]}")


if __name__ == "__main__":
    main()
