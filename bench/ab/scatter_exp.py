"""scatter_combine's large-path experiment: each mode of OPREG_SCATTER_COMBINE_EXP (bits in
bench/ab/scatter_large_exp.diff) against mode 0, in CUDA graphs, interleaved, on the
>= 16 MB shapes that sat furthest below 70 % of a copy of the same bytes (issue 19), and two
controls. Needs the experiment's build (bench/ab/README.md):

    python3 bench/ab/scatter_exp.py [--modes 0,4,1,5,7,8,12,13,16,20] [--rounds 7] [--json F]

Per shape (sweep.py's inputs: random order, int32 indices, input sets rotated past twice the
L2): every mode's output on set 0 must equal mode 0's bit for bit (else the mode is marked
and not timed); then one CUDA graph per mode (the mode is read per call, so each graph's
launches carry the mode set while it was captured) and one of a copy of the same bytes
(sweep.copy_variant), replayed in rounds with the order rotated; median us per call, and
the copy's time over each mode's (the sweep's frac_copy_same_graph; >= 0.70 is the target).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _timing as tm  # noqa: E402
import sweep  # noqa: E402

import opreg  # noqa: E402

ENV = "OPREG_SCATTER_COMBINE_EXP"
SHAPES = [  # (T, k, H, dtype): random order, int32 indices
    (16384, 8, 128, "bf16"), (65536, 2, 128, "bf16"), (65536, 1, 128, "bf16"),
    (1024, 8, 1024, "bf16"), (4096, 1, 1024, "bf16"), (4096, 2, 1024, "bf16"), (16384, 1, 1024, "bf16"),
    (1024, 2, 4096, "bf16"), (4096, 1, 4096, "bf16"),
    (16384, 8, 128, "fp32"), (65536, 2, 128, "fp32"), (1024, 8, 1024, "fp32"),
    (16384, 2, 4096, "bf16"), (16384, 8, 1024, "bf16"),  # controls: large rows, >= 70 % before
]


def with_mode(mode: int, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(ENV)
    os.environ[ENV] = str(mode)
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = old


def capture(call: Callable[[int], Any], nsets: int, calls: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(i % nsets)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(calls):
            call(j % nsets)
    g.replay()
    torch.cuda.synchronize()
    return g


def replay_us(g: torch.cuda.CUDAGraph, calls: int, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return min(times)


def run_shape(shape: tuple, modes: list[int], rounds: int) -> dict[str, Any]:
    t, k, h, d = shape
    full = (t, k, h, d, "random", "int32")
    sets = sweep.scatter_sets(full, "cuda")
    op = opreg.get("scatter_combine")
    nbytes = sweep.scatter_bytes_of(full, False)
    calls = min(sweep.graph_calls(nbytes), 2 * len(sets))

    def call(i: int) -> torch.Tensor:
        s = sets[i]
        return op(s["h"], s["idx"], s["g"], s["t"])

    want = with_mode(0, lambda: call(0))
    row: dict[str, Any] = dict(shape=f"T{t} k{k} H{h} {d}", mb=nbytes / 1e6, modes={})
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for m in modes:
        try:
            got = with_mode(m, lambda: call(0))
        except RuntimeError as exc:
            row["modes"][str(m)] = dict(error=str(exc).splitlines()[0])
            continue
        if not torch.equal(got, want):
            row["modes"][str(m)] = dict(error="bits differ from mode 0")
            continue
        graphs[str(m)] = with_mode(m, lambda: capture(call, len(sets), calls))
    copy = sweep.copy_variant(sets, nbytes)
    graphs["copy"] = capture(copy.call, len(sets), calls)
    times: dict[str, list[float]] = {n: [] for n in graphs}
    names = list(graphs)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(replay_us(graphs[n], calls))
    med = {n: statistics.median(v) for n, v in times.items()}
    row["copy_us"] = med["copy"]
    for n in names:
        if n != "copy":
            row["modes"][n] = dict(us=med[n], frac_copy=med["copy"] / med[n],
                                   vs_mode0=tm.paired_ratio(times[n], times[names[0]]))
    graphs.clear()
    sets.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="0,4,1,5,7,8,12,13,16,20")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", default=None, help="comma-separated shape labels, e.g. 'T16384 k8 H128 bf16'")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    modes = [int(m) for m in a.modes.split(",")]
    assert modes[0] == 0, "mode 0 first: every mode is compared with it"
    shapes = [s for s in SHAPES if a.only is None or f"T{s[0]} k{s[1]} H{s[2]} {s[3]}" in a.only.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a call in a CUDA graph, "
          f"(copy of the same bytes / mode), median of {a.rounds} rounds")
    print("| shape | MB | copy | " + " | ".join(f"mode {m}" for m in modes) + " |")
    rows = []
    for s in shapes:
        row = run_shape(s, modes, a.rounds)
        rows.append(row)
        cells = []
        for m in modes:
            c = row["modes"].get(str(m), {})
            cells.append(c["error"][:30] if "error" in c else f"{c['us']:.1f} ({c['frac_copy']:.2f})")
        print(f"| {row['shape']} | {row['mb']:.0f} | {row['copy_us']:.1f} | " + " | ".join(cells) + " |", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
    below = {m: sum(1 for r in rows if r["modes"].get(str(m), {}).get("frac_copy", 0) < 0.70) for m in modes}
    print("below 70 % of copy: " + ", ".join(f"mode {m} {n}" for m, n in below.items()))


if __name__ == "__main__":
    main()
