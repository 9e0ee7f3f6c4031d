"""cat_linear's CUDA paths side by side, each call's device time from a CUDA graph (the host
taken out): the dot, SIMT and GEMM paths forced (``OPREG_CAT_LINEAR_PATH``), the model's own
pick (``auto``; its dot and SIMT kernels launch with programmatic dependent launch,
backends/cuda/pdl.cuh), that pick without PDL (``no_pdl``: ``OPREG_PDL=0``; the GEMM path's
kernels are eager's and take no PDL either way), and eager's
``F.linear(torch.cat(parts, -1), W, b)``. What the path model (backends/common/cat_linear_model.h)
is fitted and checked against where the host does not hide the device: CUDA graphs, and a busy
GPU's queue.

    python bench/cat_linear_paths.py [--json out.json] [--max-macs 2**28] [--only 'R2 B4 H512 K2048 fp32,...']
    python bench/cat_linear_paths.py --evaluate bench/data/cat_linear_paths_h200_2026-12-05.json

``--evaluate`` needs no GPU: the model as this checkout has it (the header compiled with the
host's C++ compiler, through tests/cpp/cat_linear_model_picks.cpp) picks a path per shape of
an earlier run's JSON, and each pick is charged that run's time of the path forced; prints the
shapes where that is > 3 % slower than eager (two checkouts' outputs side by side: what a
change to the model moves).

Shapes: bench/sweep.py's full cat_linear grid (list form), its odd sizes, and the seeds'
(R4 B12 H32 K56), fp32 and bf16. The fused paths are forced only up to ``--max-macs``
multiply-adds (each walks K per warp or block: slow beyond). Every variant's output is
checked against the float64 reference first; each variant is timed twice, the order reversed
the second time, and keeps the better time (``_paths.measure``: a place in the order cost
some shapes 4-10 %). Prints, per shape, µs per call and auto's ratio
to the fastest forced path and to eager, then the shapes where auto is > 3 % behind either,
and auto against no_pdl (a graph replays 20 calls of the op: with PDL each launch overlaps the
previous call's kernel).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _paths  # noqa: E402
from sweep import CAT_ODD, DTYPES, GRIDS, TOL  # noqa: E402

import opreg  # noqa: E402,F401  (loads the ops)
from opreg.ops.cat_linear import reference  # noqa: E402

ENV = "OPREG_CAT_LINEAR_PATH"
PATHS = ("dot", "simt", "gemm")
SEEDS = (4, 12, 32, 56)


def shapes() -> list[tuple[int, int, int, int, str]]:
    g = GRIDS["full"]
    base = list(itertools.product(g["R"], g["B"], g["H"], g["K"])) + list(CAT_ODD) + [SEEDS]
    return [(*s, d) for s in base for d in DTYPES]


def measure(shape: tuple[int, int, int, int, str], max_macs: int, reps: int) -> dict[str, Any]:
    r, b, h, k, d = shape
    dt = DTYPES[d]
    parts = [torch.randn(b, h, device="cuda", dtype=dt) for _ in range(r)]
    w = torch.randn(k, r * h, device="cuda", dtype=dt) / (r * h) ** 0.5
    bias = torch.randn(k, device="cuda", dtype=dt)
    want = reference([p.double() for p in parts], w.double(), bias.double())

    def op() -> torch.Tensor:
        return torch.ops.opreg.cat_linear(parts, w, bias)

    variants: _paths.Variants = {
        "auto": (None, op), "no_pdl": ({"OPREG_PDL": "0"}, op),
        "eager": (None, lambda: F.linear(torch.cat(parts, -1), w, bias))}
    if b * k * r * h <= max_macs:
        variants.update({p: (p, op) for p in ("dot", "simt")})
    variants["gemm"] = ("gemm", op)
    return _paths.measure(f"R{r} B{b} H{h} K{k} {d}", variants, ENV, want, TOL[d], PATHS, reps)


def evaluate(path: str) -> int:
    """The model's picks in a CUDA graph, charged the forced paths' times of the run in ``path``."""
    rows = json.loads(Path(path).read_text())["rows"]
    elt = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
    shapes = [r["shape"].split() for r in rows]  # "R8 B16 H64 K256 fp32"
    lines = "".join(f"{r[1:]} {b[1:]} {h[1:]} {k[1:]} {elt[d]}\n" for r, b, h, k, d in shapes)
    out = _paths.host_picks("cat_linear_model_picks.cpp", lines, ENV)
    slower, count, same = [], {}, 0
    for row, picks in zip(rows, out):
        us, pick = row["us"], picks.split()[1]  # the pick in a graph
        t = us.get(pick)
        if t is None:  # a fused path not forced at this size (--max-macs): the run's own pick
            pick, t = "auto", us["auto"]
        count[pick] = count.get(pick, 0) + 1
        if t / us["eager"] > 1.03:
            e = us["eager"]
            # the GEMM path in a graph launches eager's own kernels (at::cat, cuBLAS): what
            # separates the two columns there is the timing, not the pick
            note = "  (eager's kernels: the timing's spread)" if pick == "gemm" else ""
            same += pick == "gemm"
            slower.append(f"  {row['shape']:<26} {pick:<5} {t:8.2f} us, eager {e:8.2f} ({t / e:.3f}x){note}")
    print(f"{len(rows)} shapes of {path}: the model's picks in a graph {count}, each charged that run's time "
          f"of the path forced")
    print(f"> 3 % slower than eager: {len(slower)} ({same} of them on the GEMM path, eager's own kernels)",
          *slower, sep="\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--max-macs", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--evaluate", metavar="JSON", help="no GPU: this checkout's model against an earlier run")
    p.add_argument("--only", help="comma-separated shapes as printed, e.g. 'R2 B4 H512 K2048 fp32'")
    a = p.parse_args(argv)
    if a.evaluate:
        return evaluate(a.evaluate)
    rows = []
    names = ("auto", "no_pdl", *PATHS, "eager")
    todo = _paths.only(shapes(), a.only, lambda s: "R{} B{} H{} K{} {}".format(*s))
    print(_paths.header(names, 26), flush=True)
    for s in todo:
        rows.append(measure(s, a.max_macs, a.reps))
        print(_paths.line(rows[-1], names, 26), flush=True)
    _paths.report(rows, a.json, no_pdl_paths=("gemm",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
