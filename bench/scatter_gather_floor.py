"""What a gather of scatter_combine's rows costs at the >= 16 MB shapes: is 70 % of a copy
within reach where the rows are short?

    python bench/scatter_gather_floor.py [--rounds 7] [--json F]     (CUDA)

Issue 19 asks scatter_combine to move its bytes at >= 70 % of a copy of the same bytes at
every shape >= 16 MB. The op reads each token's rows where the routing put them (random
rows of ``expert_hidden``, H elements each), so beside the op and a copy of the same bytes
(``sweep.copy_variant``) this times ``x.index_select(0, order)``: every row read once, in the
order the op's reducers read them (grouped by token), written contiguously. Its bytes over
its time, against the copy's rate, is how fast this GPU moves rows of that length read at
random: the op cannot beat that rate, so where it is below 0.70 of the copy's, so is any
combine. Per shape (sweep.py's inputs: random order, int32 indices, input sets rotated past
twice the L2), each in its own CUDA graph, rounds with the order rotated, median us a call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402

import opreg  # noqa: E402

SHAPES = [  # (T, k, H, dtype): the >= 16 MB shapes furthest below 70 % (sixty-fifth session's A/B), and two above
    (16384, 8, 128, "bf16"), (65536, 2, 128, "bf16"), (65536, 1, 128, "bf16"), (16384, 8, 128, "fp32"),
    (65536, 2, 128, "fp32"), (1024, 8, 1024, "bf16"), (4096, 1, 1024, "bf16"), (4096, 2, 1024, "bf16"),
    (16384, 1, 1024, "bf16"), (1024, 2, 4096, "bf16"), (16384, 2, 4096, "bf16"), (16384, 8, 1024, "bf16"),
]


def capture(call: Callable[[int], Any], nsets: int, calls: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture
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
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / calls)
    return best


def run_shape(shape: tuple, rounds: int) -> dict[str, Any]:
    t, k, h, d = shape
    full = (t, k, h, d, "random", "int32")
    sets = sweep.scatter_sets(full, "cuda")
    for s in sets:  # the reducers' read order: the rows grouped by token, in row order within each
        s["order"] = torch.sort(s["idx"], stable=True).indices
        s["rows"] = torch.empty_like(s["h"])
    op = opreg.get("scatter_combine")
    nbytes = sweep.scatter_bytes_of(full, False)
    gather_bytes = 2 * sets[0]["h"].numel() * sets[0]["h"].element_size()
    calls = min(sweep.graph_calls(nbytes), 2 * len(sets))
    copy = sweep.copy_variant(sets, nbytes)
    graphs = {
        "op": capture(lambda i: op(sets[i]["h"], sets[i]["idx"], sets[i]["g"], t), len(sets), calls),
        "copy": capture(copy.call, len(sets), calls),
        "gather": capture(lambda i: torch.index_select(sets[i]["h"], 0, sets[i]["order"], out=sets[i]["rows"]),
                          len(sets), calls),
    }
    times: dict[str, list[float]] = {n: [] for n in graphs}
    names = list(graphs)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(replay_us(graphs[n], calls))
    us = {n: statistics.median(v) for n, v in times.items()}
    copy_rate = nbytes / us["copy"]  # bytes per us
    row = dict(shape=f"T{t} k{k} H{h} {d}", mb=nbytes / 1e6, us=us,
               op_frac=us["copy"] / us["op"], gather_frac=(gather_bytes / us["gather"]) / copy_rate)
    graphs.clear()
    sets.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scatter_gather_floor.py times CUDA graphs; no CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a call in a CUDA graph, median of "
          f"{a.rounds} rounds; op and gather as a fraction of the copy's rate")
    print("| shape | MB | copy | op (of copy) | gather of the rows (its rate / copy's) |")
    print("|---|---|---|---|---|")
    rows = []
    for s in SHAPES:
        r = run_shape(s, a.rounds)
        rows.append(r)
        print(f"| {r['shape']} | {r['mb']:.0f} | {r['us']['copy']:.1f} | {r['us']['op']:.1f} ({r['op_frac']:.2f}) | "
              f"{r['us']['gather']:.1f} ({r['gather_frac']:.2f}) |", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
