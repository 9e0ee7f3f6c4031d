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
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import CAT_ODD, DTYPES, GRIDS, TOL  # noqa: E402

import opreg  # noqa: E402,F401  (loads the ops)
from opreg.ops.cat_linear import reference  # noqa: E402
from opreg.testing import timing  # noqa: E402

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

    # name -> (OPREG_CAT_LINEAR_PATH while it runs, the call); the variable is read per call,
    # so it is held through the check, the capture and the replays
    variants: dict[str, tuple[str | None, Callable[[], Any]]] = {
        "auto": (None, op), "eager": (None, lambda: F.linear(torch.cat(parts, -1), w, bias))}
    if b * k * r * h <= max_macs:
        variants.update({p: (p, op) for p in ("dot", "simt")})
    variants["gemm"] = ("gemm", op)
    row: dict[str, Any] = {"shape": f"R{r} B{b} H{h} K{k} {d}", "us": {}, "err": {}}
    for name, (path, call) in variants.items():
        if path is not None:
            os.environ[ENV] = path
        try:
            got = call()
            err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            if not err <= TOL[d]:
                raise AssertionError(f"{row['shape']} {name}: relative error {err:.2e} > {TOL[d]}")
            row["err"][name] = err
            row["us"][name] = timing.graph_us(call, reps, 20)
        finally:
            os.environ.pop(ENV, None)
    forced = {p: row["us"][p] for p in PATHS if p in row["us"]}
    row["best"] = min(forced, key=forced.__getitem__)
    row["auto/best"] = row["us"]["auto"] / forced[row["best"]]
    row["auto/eager"] = row["us"]["auto"] / row["us"]["eager"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--max-macs", type=int, default=1 << 28)
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    rows = []
    print(f"{'shape':<26} {'auto':>8} {'dot':>8} {'simt':>8} {'gemm':>8} {'eager':>8}  best  auto/best auto/eager",
          flush=True)
    for s in shapes():
        row = measure(s, a.max_macs, a.reps)
        rows.append(row)
        us = row["us"]
        cols = " ".join(f"{us[n]:8.2f}" if n in us else f"{'-':>8}" for n in ("auto", "dot", "simt", "gemm", "eager"))
        print(f"{row['shape']:<26} {cols}  {row['best']:<5} {row['auto/best']:9.3f} {row['auto/eager']:10.3f}",
              flush=True)
    behind = [r for r in rows if r["auto/best"] > 1.03]
    slower = [r for r in rows if r["auto/eager"] > 1.03]
    print(f"\n{len(rows)} shapes; auto > 3 % behind the fastest forced path at {len(behind)}, "
          f"> 3 % slower than eager at {len(slower)} (CUDA graphs)")
    for r in sorted(slower, key=lambda r: -r["auto/eager"])[:20]:
        print(f"  slower than eager: {r['shape']} auto/eager {r['auto/eager']:.3f} (best {r['best']})")
    for r in sorted(behind, key=lambda r: -r["auto/best"])[:20]:
        print(f"  behind: {r['shape']} auto/best {r['auto/best']:.3f} (best {r['best']})")
    if a.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
