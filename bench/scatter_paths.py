"""scatter_combine's CUDA forward paths side by side, each call's device time from a CUDA
graph (the host taken out): the tiny, small and large paths forced
(``OPREG_SCATTER_COMBINE_PATH``), the sizes' own pick (``auto``), and eager's
``zeros.index_add_``. What the paths' bounds (backends/cuda/scatter_combine.cuh) are set and
checked against where the host does not hide the device.

    python bench/scatter_paths.py [--json out.json]

Shapes: T x fan-out x H over the one-launch paths' range (N = T k <= 32768), fp32 and bf16,
int32 indices in expert order (an MoE dispatch's), plus the seeds' T1536 k2 H128 fp32. Every
variant's output is checked against the float64 reference first.
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

import opreg  # noqa: F401  (loads the ops)
from opreg.ops.scatter_combine import reference
from opreg.testing import timing

ENV = "OPREG_SCATTER_COMBINE_PATH"
PATHS = ("tiny", "small", "large")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 1e-2}


def shapes() -> list[tuple[int, int, int, str]]:
    grid = itertools.product((16, 64, 256, 1024, 4096), (1, 2, 8), (128, 1024, 4096), DTYPES)
    out = [s for s in grid if s[0] * s[1] <= 32768]
    return [(1536, 2, 128, "fp32"), *out]


def measure(shape: tuple[int, int, int, str], reps: int) -> dict[str, Any]:
    t, k, h, d = shape
    dt = DTYPES[d]
    n = t * k
    expert = torch.randint(0, 64, (n,), device="cuda")
    idx = torch.arange(t, device="cuda").repeat_interleave(k)[torch.sort(expert, stable=True).indices].int()
    x = torch.randn(n, h, device="cuda", dtype=dt)
    g = torch.rand(n, device="cuda", dtype=dt)
    want = reference(x.double(), idx, g.double(), t)

    def op() -> torch.Tensor:
        return torch.ops.opreg.scatter_combine(x, idx, g, t)

    def eager() -> torch.Tensor:
        return torch.zeros(t, h, device="cuda", dtype=dt).index_add_(0, idx, x * g[:, None])

    variants: dict[str, tuple[str | None, Callable[[], Any]]] = {"auto": (None, op), "eager": (None, eager)}
    variants.update({p: (p, op) for p in PATHS if p != "small" or n <= 8192})
    row: dict[str, Any] = {"shape": f"T{t} k{k} H{h} {d}", "us": {}}
    for name, (path, call) in variants.items():
        if path is not None:
            os.environ[ENV] = path
        try:
            err = ((call().double() - want).norm() / want.norm()).item()
            if not err <= TOL[d]:
                raise AssertionError(f"{row['shape']} {name}: relative error {err:.2e} > {TOL[d]}")
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
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args(argv)
    rows = []
    names = ("auto", *PATHS, "eager")
    print(f"{'shape':<22} " + " ".join(f"{n:>8}" for n in names) + "  best  auto/best auto/eager", flush=True)
    for s in shapes():
        row = measure(s, a.reps)
        rows.append(row)
        us = row["us"]
        cols = " ".join(f"{us[n]:8.2f}" if n in us else f"{'-':>8}" for n in names)
        print(f"{row['shape']:<22} {cols}  {row['best']:<5} {row['auto/best']:9.3f} {row['auto/eager']:10.3f}",
              flush=True)
    behind = [r for r in rows if r["auto/best"] > 1.03]
    print(f"\n{len(rows)} shapes; auto > 3 % behind the fastest forced path at {len(behind)}, "
          f"slower than eager at {sum(r['auto/eager'] > 1 for r in rows)} (CUDA graphs)")
    for r in sorted(behind, key=lambda r: -r["auto/best"])[:25]:
        print(f"  behind: {r['shape']} auto/best {r['auto/best']:.3f} (best {r['best']})")
    if a.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
