"""What a gather of scatter_combine's rows costs at the >= 16 MB shapes: is 70 % of a copy
within reach where the rows are short?

    python bench/scatter_gather_floor.py [--rounds 7] [--json F]     (CUDA)

Issue 19 asks scatter_combine to move its bytes at >= 70 % of a copy of the same bytes at
every shape >= 16 MB. The op reads each token's rows where the routing put them (random
rows of ``expert_hidden``, H elements each), so beside the op and a copy of the same bytes
(``sweep.copy_variant``) this times ``x.index_select(0, order)``: every row read once, in the
order the op's reducers read them (grouped by token), written contiguously. Its bytes over
its time, against the copy's rate, was to be how fast this GPU moves rows of that length
read at random; it is that only where index_select itself is fast (wide rows; see below).
Per shape (sweep.py's inputs: random order, int32 indices, input sets rotated past
twice the L2), each in its own CUDA graph, rounds with the order rotated, median us a call.

``index_select`` is no floor where rows are short: at H = 128 it ran at 0.31-0.61 of the
copy's rate on the H100, slower than the op (bench/RESULTS.md, sixty-sixth session). So a
second reference, ``lists``: the op's reduce with its lists given (each token's k rows, in
row order, precomputed), in Triton: ``out[t] = sum_j g[o] * x[o]`` for o in the token's rows,
fp32 accumulation, one program per BLOCK_T tokens and a column block. It moves the op's
bytes (every row read once, each token's sum written once), so its rate against the copy's
is what a combine reaches with no list building at all; the op's time beyond it is the
building (count, grid barriers) and its own reducer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing as tm  # noqa: E402
import sweep  # noqa: E402

import opreg  # noqa: E402

SHAPES = [  # (T, k, H, dtype): the >= 16 MB shapes furthest below 70 % (sixty-fifth session's A/B), and two above
    (16384, 8, 128, "bf16"), (65536, 2, 128, "bf16"), (65536, 1, 128, "bf16"), (16384, 8, 128, "fp32"),
    (65536, 2, 128, "fp32"), (1024, 8, 1024, "bf16"), (4096, 1, 1024, "bf16"), (4096, 2, 1024, "bf16"),
    (16384, 1, 1024, "bf16"), (1024, 2, 4096, "bf16"), (16384, 2, 4096, "bf16"), (16384, 8, 1024, "bf16"),
]


@triton.jit
def _reduce_lists(x, order, g, out, H: tl.constexpr, T, K: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """out[t, cols] = sum over j < K of g[o] * x[o, cols], o = order[t * K + j] (rows of t, in order)."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = ts < T
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for j in range(K):
        o = tl.load(order + ts * K + j, mask=tmask, other=0).to(tl.int64)
        w = tl.load(g + o, mask=tmask, other=0.0).to(tl.float32)
        v = tl.load(x + o[:, None] * H + cols[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        acc += w[:, None] * v
    tl.store(out + ts[:, None].to(tl.int64) * H + cols[None, :], acc.to(out.dtype.element_ty), mask=tmask[:, None])


def reduce_lists(x: torch.Tensor, order: torch.Tensor, g: torch.Tensor, t: int, k: int,
                 out: torch.Tensor) -> torch.Tensor:
    """The op's result from lists given in advance: ``order`` (T k,) holds each token's k rows,
    grouped by token (every token has exactly k, as sweep.py's inputs do); x (T k, H), g (T k,),
    out (T, H)."""
    h = x.shape[1]
    block_h = triton.next_power_of_2(min(h, 512))
    block_t = max(1, min(64, 8192 // block_h))  # 8K elements a program: 16-32 KB of rows a load
    _reduce_lists[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
        x, order, g, out, h, t, k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=8)
    return out


def replay_us(g: torch.cuda.CUDAGraph, calls: int, reps: int = 3) -> float:
    return min(tm.replay_us(g, calls) for _ in range(reps))


def run_shape(shape: tuple, rounds: int) -> dict[str, Any]:
    t, k, h, d = shape
    full = (t, k, h, d, "random", "int32")
    sets = sweep.scatter_sets(full, "cuda")
    for s in sets:  # the reducers' read order: the rows grouped by token, in row order within each
        s["order"] = torch.sort(s["idx"], stable=True).indices
        s["rows"] = torch.empty_like(s["h"])
        s["out"] = torch.empty(t, h, device="cuda", dtype=s["h"].dtype)
    op = opreg.get("scatter_combine")
    nbytes = sweep.scatter_bytes_of(full, False)
    gather_bytes = 2 * sets[0]["h"].numel() * sets[0]["h"].element_size()
    calls = min(sweep.graph_calls(nbytes), 2 * len(sets))
    copy = sweep.copy_variant(sets, nbytes)
    graphs = {
        "op": tm.capture(lambda i: op(sets[i]["h"], sets[i]["idx"], sets[i]["g"], t), len(sets), calls),
        "copy": tm.capture(copy.call, len(sets), calls),
        "gather": tm.capture(lambda i: torch.index_select(sets[i]["h"], 0, sets[i]["order"], out=sets[i]["rows"]),
                          len(sets), calls),
        "lists": tm.capture(lambda i: reduce_lists(sets[i]["h"], sets[i]["order"], sets[i]["g"], t, k, sets[i]["out"]),
                         len(sets), calls),
    }
    for s in sets[:1]:  # a wrong reference would be a false floor: its result against the op's
        want = op(s["h"], s["idx"], s["g"], t).float()
        got = reduce_lists(s["h"], s["order"], s["g"], t, k, s["out"]).float()
        tol = 1e-2 if s["h"].element_size() == 2 else 1e-4
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            raise SystemExit(f"T{t} k{k} H{h} {d}: reduce_lists differs from the op by {(got - want).abs().max():.3g}")
    times: dict[str, list[float]] = {n: [] for n in graphs}
    names = list(graphs)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(replay_us(graphs[n], calls))
    us = {n: statistics.median(v) for n, v in times.items()}
    copy_rate = nbytes / us["copy"]  # bytes per us
    row = dict(shape=f"T{t} k{k} H{h} {d}", mb=nbytes / 1e6, us=us,
               op_frac=us["copy"] / us["op"], gather_frac=(gather_bytes / us["gather"]) / copy_rate,
               lists_frac=us["copy"] / us["lists"])
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
    print("| shape | MB | copy | op (of copy) | gather of the rows (rate / copy) | reduce, lists given (of copy) |")
    print("|---|---|---|---|---|---|")
    rows = []
    for s in SHAPES:
        r = run_shape(s, a.rounds)
        rows.append(r)
        print(f"| {r['shape']} | {r['mb']:.0f} | {r['us']['copy']:.1f} | {r['us']['op']:.1f} ({r['op_frac']:.2f}) | "
              f"{r['us']['gather']:.1f} ({r['gather_frac']:.2f}) | {r['us']['lists']:.1f} ({r['lists_frac']:.2f}) |",
              flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
