"""One call each of scatter_combine's multi-kernel reduce and the lists-given Triton reduce
(scatter_gather_floor.reduce_lists) at two shapes, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \\
        -k regex:"scatter_reduce_kernel|_reduce_lists" -c 8 python3 bench/scatter_reduce_ncu.py

At fan-out 1-2 the lists-given reduce moves the op's bytes at 0.93-0.96 of a copy and the op
at 0.57-0.69 (H100, bench/RESULTS.md, sixty-sixth session); the profiles say where the op's
reducer loses the difference. The multi-kernel form (OPREG_SCATTER_COMBINE_LARGE=multi) runs
the same reducer code as the fused kernel, in a launch of its own that ncu can pick out.

`--shapes T,k,H;...` (bf16, random order, int32) replaces the two shapes; `--no-lists` leaves
out the lists-given reduce (device_run.sh's STAGE=buildcost times the fused kernel alone).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scatter_gather_floor as floor  # noqa: E402
import sweep  # noqa: E402

import opreg  # noqa: E402

SHAPES = [(16384, 1, 1024, "bf16"), (65536, 2, 128, "bf16")]  # (T, k, H, dtype), random order, int32


def parse_shapes(text: str) -> list[tuple[int, int, int, str]]:
    """``"16384,1,1024;65536,2,128"`` -> [(16384, 1, 1024, "bf16"), (65536, 2, 128, "bf16")]."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            t, k, h = (int(v) for v in part.split(","))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r} is not T,k,H (e.g. 16384,1,1024)") from None
        shapes.append((t, k, h, "bf16"))
    return shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="", help="T,k,H;T,k,H... (bf16, random, int32)")
    p.add_argument("--no-lists", action="store_true", help="leave out the lists-given Triton reduce")
    args = p.parse_args()
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    if not torch.cuda.is_available():
        raise SystemExit("scatter_reduce_ncu.py profiles CUDA kernels; no CUDA device")
    # read per call by the op; set it to anything else (e.g. "fused") to profile the one
    # cooperative kernel instead
    os.environ.setdefault("OPREG_SCATTER_COMBINE_LARGE", "multi")
    op = opreg.get("scatter_combine")
    for t, k, h, d in shapes:
        s = sweep.scatter_sets((t, k, h, d, "random", "int32"), "cuda")[0]
        order = torch.sort(s["idx"], stable=True).indices
        out = torch.empty(t, h, device="cuda", dtype=s["h"].dtype)
        for _ in range(2):  # two launches of each kernel a shape: ncu's -c 8 takes all of them
            op(s["h"], s["idx"], s["g"], t)
            if not args.no_lists:
                floor.reduce_lists(s["h"], order, s["g"], t, k, out)
        torch.cuda.synchronize()
        print(f"T{t} k{k} H{h} {d}: done", flush=True)


if __name__ == "__main__":
    main()
