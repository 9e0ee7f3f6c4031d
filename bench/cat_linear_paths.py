"""cat_linear's CUDA paths side by side, each call's device time from a CUDA graph (the host
taken out): the dot, SIMT and GEMM paths forced (``OPREG_CAT_LINEAR_PATH``), the model's own
pick (``auto``), and eager's ``F.linear(torch.cat(parts, -1), W, b)``. What the path model
(backends/common/cat_linear_model.h) is fitted and checked against where the host does not
hide the device: CUDA graphs, and a busy GPU's queue.

    python bench/cat_linear_paths.py [--json out.json] [--max-macs 2**28]

Shapes: bench/sweep.py's full cat_linear grid (list form), its odd sizes, and the seeds'
(R4 B12 H32 K56), fp32 and bf16. The fused paths are forced only up to ``--max-macs``
multiply-adds (each walks K per warp or block: slow beyond). Every variant's output is
checked against the float64 reference first. Prints, per shape, µs per call and auto's ratio
to the fastest forced path and to eager, then the shapes where auto is > 3 % behind either.
"""
from __future__ import annotations

import argparse
import itertools
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
        "auto": (None, op), "eager": (None, lambda: F.linear(torch.cat(parts, -1), w, bias))}
    if b * k * r * h <= max_macs:
        variants.update({p: (p, op) for p in ("dot", "simt")})
    variants["gemm"] = ("gemm", op)
    return _paths.measure(f"R{r} B{b} H{h} K{k} {d}", variants, ENV, want, TOL[d], PATHS, reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--max-macs", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    rows = []
    names = ("auto", *PATHS, "eager")
    print(_paths.header(names, 26), flush=True)
    for s in shapes():
        rows.append(measure(s, a.max_macs, a.reps))
        print(_paths.line(rows[-1], names, 26), flush=True)
    _paths.report(rows, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
