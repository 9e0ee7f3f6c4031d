"""One call each of scatter_combine's multi-kernel reduce and the lists-given Triton reduce
(scatter_gather_floor.reduce_lists) at two shapes, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \\
        -k regex:"scatter_reduce_kernel|_reduce_lists" -c 8 python3 bench/scatter_reduce_ncu.py

At fan-out 1-2 the lists-given reduce moves the op's bytes at 0.93-0.96 of a copy and the op
at 0.57-0.69 (H100, bench/RESULTS.md, sixty-sixth session); the profiles say where the op's
reducer loses the difference. The multi-kernel form (OPREG_SCATTER_COMBINE_LARGE=multi) runs
the same reducer code as the fused kernel, in a launch of its own that ncu can pick out.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scatter_gather_floor as floor  # noqa: E402
import sweep  # noqa: E402

import opreg  # noqa: E402

SHAPES = [(16384, 1, 1024, "bf16"), (65536, 2, 128, "bf16")]  # (T, k, H, dtype), random order, int32


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("scatter_reduce_ncu.py profiles CUDA kernels; no CUDA device")
    # read per call by the op; set it to anything else (e.g. "fused") to profile the one
    # cooperative kernel instead
    os.environ.setdefault("OPREG_SCATTER_COMBINE_LARGE", "multi")
    op = opreg.get("scatter_combine")
    for t, k, h, d in SHAPES:
        s = sweep.scatter_sets((t, k, h, d, "random", "int32"), "cuda")[0]
        order = torch.sort(s["idx"], stable=True).indices
        out = torch.empty(t, h, device="cuda", dtype=s["h"].dtype)
        for _ in range(2):  # two launches of each kernel a shape: ncu's -c 8 takes all of them
            op(s["h"], s["idx"], s["g"], t)
            floor.reduce_lists(s["h"], order, s["g"], t, k, out)
        torch.cuda.synchronize()
        print(f"T{t} k{k} H{h} {d}: done", flush=True)


if __name__ == "__main__":
    main()
