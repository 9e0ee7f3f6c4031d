"""scatter_combine's CUDA forward paths side by side, each call's device time from a CUDA
graph (the host taken out): the tiny, small and large paths forced
(``OPREG_SCATTER_COMBINE_PATH``), the large path's fused and local forms forced (``fused``,
``local``: ``OPREG_SCATTER_COMBINE_LARGE``; ``large`` is its own pick), the sizes' own pick
(``auto``; the tiny, small and local kernels launch with programmatic dependent launch,
backends/cuda/pdl.cuh, the fused kernel's cooperative launch takes none), that pick without PDL
(``no_pdl``: ``OPREG_PDL=0``), and eager's ``zeros.index_add_``. What the paths' bounds
(backends/common/scatter_combine_paths.h) are set and checked against where the host does not
hide the device.

    python bench/scatter_paths.py [--json out.json] [--only 'T1536 k2 H128 fp32,...'] [--max-rows N]
    python bench/scatter_paths.py --evaluate bench/data/scatter_paths_h100_2026-12-05.json
    python bench/scatter_paths.py --compare A.json B.json

``--rows 4096,8192`` keeps the shapes with N = T k among those (with ``--max-rows``).
``--compare`` needs no GPU: two runs' shared shapes, each variant's time in B over A (a kernel
candidate built in B, the tree in A: ``STAGE=scatter SC_CAND=...`` in bench/device_run.sh), and
local / fused in each run, by token_idx's bytes: what the local form's bound
(backends/common/scatter_combine_paths.h, ``local_pays``) is set from.

``--evaluate`` needs no GPU: the choice as this checkout has it
(backends/common/scatter_combine_paths.h, compiled with the host's C++ compiler through
tests/cpp/scatter_combine_picks.cpp) picks a path per shape of an earlier run's JSON (for the
large path, its form where that run timed the forms), and each pick is charged that run's time
of the path forced; prints where the pick differs from that
run's own (auto's path: the forced one nearest its time) and what it costs there, and the
picks > 3 % behind the fastest forced path.

Shapes: T x fan-out x H over the one-launch paths' range (N = T k <= 32768; ``--max-rows``
65536 adds T768, between 4 tokens an SM and 1024, where the local form runs in place of the
small path, and T2048, T8192 and T16384: N = 16384 (the local form's 64 KB bound in int32)
at each fan-out, 32768 past it), fp32 and bf16, int32 indices in expert order (an MoE
dispatch's; ``--index int64``: int64, the shapes named "... int64", so that the local form's
bound in bytes is checked at half the rows), plus the seeds' T1536 k2 H128 fp32. Every
variant's output is checked against the float64 reference first; each variant is timed twice,
the order reversed the second time, and keeps the better time (``_paths.measure``). Two floors
beside them, timed the same way: ``copy``, a copy of the rows (one round trip to memory, no dependence), and
``gather``, ``x.index_select(0, token_idx)`` (every row load waits for its index's load: the
least any combine that finds its rows through the indices does).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _paths  # noqa: E402

import opreg  # noqa: E402,F401  (loads the ops)
from opreg.ops.scatter_combine import reference  # noqa: E402

ENV = "OPREG_SCATTER_COMBINE_PATH"
PATHS = ("tiny", "small", "large")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 1e-2}


FORMS = ("fused", "local")  # the large path's forms (backends/cuda/scatter_combine_large.cu)


def shapes(max_rows: int = 32768) -> list[tuple[int, int, int, str]]:
    ts = (16, 64, 256, 1024, 4096) + ((768, 2048, 8192, 16384) if max_rows > 32768 else ())
    grid = itertools.product(ts, (1, 2, 8), (128, 1024, 4096), DTYPES)
    out = [s for s in grid if s[0] * s[1] <= max_rows]
    return [(1536, 2, 128, "fp32"), *out]


def label(shape: tuple[int, int, int, str], index: str = "int32") -> str:
    """"T1536 k2 H128 fp32", with " int64" after it for int64 indices."""
    t, k, h, d = shape
    return f"T{t} k{k} H{h} {d}" + (" int64" if index == "int64" else "")


def index_bytes(label: str) -> int:
    return 8 if label.endswith(" int64") else 4


def measure(shape: tuple[int, int, int, str], reps: int, index: str = "int32") -> dict[str, Any]:
    t, k, h, d = shape
    dt = DTYPES[d]
    n = t * k
    expert = torch.randint(0, 64, (n,), device="cuda")
    idx = torch.arange(t, device="cuda").repeat_interleave(k)[torch.sort(expert, stable=True).indices]
    idx = idx.long() if index == "int64" else idx.int()
    x = torch.randn(n, h, device="cuda", dtype=dt)
    g = torch.rand(n, device="cuda", dtype=dt)
    want = reference(x.double(), idx, g.double(), t)

    def op() -> torch.Tensor:
        return torch.ops.opreg.scatter_combine(x, idx, g, t)

    def eager() -> torch.Tensor:
        return torch.zeros(t, h, device="cuda", dtype=dt).index_add_(0, idx, x * g[:, None])

    variants: _paths.Variants = {"auto": (None, op), "no_pdl": ({"OPREG_PDL": "0"}, op), "eager": (None, eager)}
    variants.update({p: (p, op) for p in PATHS if p != "small" or n <= 8192})
    variants.update({f: ({ENV: "large", "OPREG_SCATTER_COMBINE_LARGE": f}, op) for f in FORMS})
    rows = torch.empty_like(x)
    floors = {"copy": lambda: rows.copy_(x), "gather": lambda: torch.index_select(x, 0, idx, out=rows)}
    return _paths.measure(label(shape, index), variants, ENV, want, TOL[d], PATHS, reps, floors)


def compare(path_a: str, path_b: str) -> int:
    """Run B against run A (no GPU): per variant both timed, B / A, and local / fused in each,
    geometric means by token_idx's bytes; then the shapes where a variant moved by > 3 %, the most first."""
    runs = [{r["shape"]: r["us"] for r in json.loads(Path(p).read_text())["rows"]} for p in (path_a, path_b)]
    common = [s for s in runs[0] if s in runs[1]]
    if not common:
        raise SystemExit(f"--compare: {path_a} and {path_b} share no shape")

    def idx_kb(shape: str) -> int:  # "T4096 k2 H1024 bf16[ int64]": N = T k indices
        t, k = (int(w[1:]) for w in shape.split()[:2])
        return -(-t * k * index_bytes(shape) // 1024)

    def gmean(xs: list[float]) -> float:
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    names = [n for n in ("auto", "large", *FORMS) if all(n in run[s] for run in runs for s in common)]
    print(f"{len(common)} shapes in both; B / A per variant, local / fused in A and in B (geometric means)")
    print(f"{'token_idx':>10} {'shapes':>6} " + " ".join(f"{n + ' B/A':>10}" for n in names)
          + f" {'local/fused A':>14} {'B':>6}")
    moved = []
    for kb in sorted({idx_kb(s) for s in common}):
        group = [s for s in common if idx_kb(s) == kb]
        cols = " ".join(f"{gmean([runs[1][s][n] / runs[0][s][n] for s in group]):10.3f}" for n in names)
        lf = [f"{gmean([run[s]['local'] / run[s]['fused'] for s in group]):.3f}" if {"local", "fused"} <= set(names)
              else "-" for run in runs]
        print(f"{kb:>7} KB {len(group):>6} {cols} {lf[0]:>14} {lf[1]:>6}")
    for s in common:
        for n in names:
            q = runs[1][s][n] / runs[0][s][n]
            if abs(q - 1) > 0.03:
                moved.append((abs(math.log(q)), f"  {s:<26} {n:<6} {runs[0][s][n]:7.2f} -> {runs[1][s][n]:7.2f} us "
                                                f"({q:.3f})"))
    print(f"moved by > 3 % (the most first): {len(moved)}", *(m for _, m in sorted(moved, reverse=True)), sep="\n")
    return 0


def evaluate(path: str) -> int:
    """This checkout's picks, charged the forced paths' times of the run in ``path``."""
    rows = json.loads(Path(path).read_text())["rows"]
    elt = {"fp32": 4, "bf16": 2}
    shapes = [r["shape"].split()[:4] for r in rows]  # "T1536 k2 H128 fp32[ int64]"
    lines = "".join(f"{t[1:]} {k[1:]} {h[1:]} {elt[d]} {index_bytes(r['shape'])}\n"
                    for (t, k, h, d), r in zip(shapes, rows))
    picks = _paths.host_picks("scatter_combine_picks.cpp", lines, ENV)
    moved, behind, count = [], [], {}
    for row, line in zip(rows, picks):
        us = row["us"]
        # "large local" / "large fused": the large path's form, charged its own forced time
        # where the run timed the forms (FORMS: they then stand for "large", which is one of
        # them), else the large path's as that run picked it
        kind, _, form = line.partition(" ")
        forms = [f for f in FORMS if f in us]
        pick = form if form and forms else kind
        forced = {p: us[p] for p in (*PATHS, *FORMS) if p in us and not (forms and p == "large")}
        count[pick] = count.get(pick, 0) + 1
        before = min(forced, key=lambda p: abs(forced[p] - us["auto"]))
        best = min(forced, key=forced.__getitem__)
        if pick != before:
            moved.append(f"  {row['shape']:<26} {before} -> {pick}: {forced[before]:6.2f} -> {forced[pick]:6.2f} us "
                         f"({forced[pick] / forced[before]:.3f})")
        if forced[pick] > 1.03 * forced[best]:
            behind.append(f"  {row['shape']:<26} {pick} {forced[pick]:6.2f} us, {best} {forced[best]:6.2f} "
                          f"({forced[pick] / forced[best]:.3f})")
    print(f"{len(rows)} shapes of {path}: this checkout's picks {count}, each charged that run's time of the "
          f"path forced")
    print(f"picks that differ from that run's own: {len(moved)}", *moved, sep="\n")
    print(f"picks > 3 % behind the fastest forced path: {len(behind)}", *behind, sep="\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--only", help="comma-separated shapes as printed, e.g. 'T1536 k2 H128 fp32'")
    p.add_argument("--max-rows", type=int, default=32768, help="shapes with N = T k up to this")
    p.add_argument("--rows", help="comma-separated N = T k: only the shapes with these, e.g. 4096,8192")
    p.add_argument("--evaluate", metavar="JSON", help="no GPU: this checkout's choice against an earlier run")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="no GPU: run B's times against run A's")
    p.add_argument("--index", choices=("int32", "int64"), default="int32", help="token_idx's dtype")
    a = p.parse_args(argv)
    if a.evaluate:
        return evaluate(a.evaluate)
    if a.compare:
        return compare(*a.compare)
    rows = []
    names = ("auto", "no_pdl", *PATHS, *FORMS, "eager", "copy", "gather")
    todo = _paths.only(shapes(a.max_rows), a.only, lambda s: label(s, a.index))
    if a.rows:
        want = {int(n) for n in a.rows.split(",")}
        todo = [s for s in todo if s[0] * s[1] in want]
        if not todo:
            raise SystemExit(f"--rows {a.rows}: no shape (up to --max-rows {a.max_rows}) has N = T k among them")
    width = 22 if a.index == "int32" else 28
    print(_paths.header(names, width), flush=True)
    for s in todo:
        rows.append(measure(s, a.reps, a.index))
        print(_paths.line(rows[-1], names, width), flush=True)
    _paths.report(rows, a.json, no_pdl_paths=("large",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
