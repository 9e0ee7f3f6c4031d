"""GPU time of the MoE copy of token rows into sorted order, by tile (CUDA).

    python bench/sorted_rows.py [--tokens 4096] [--configs mixtral qwen3_moe olmoe]

:func:`opreg.backends.triton.moe_experts.sorted_rows` makes GEMM1's sorted A (``PREGATHER``,
and every training forward whose dW1 runs on ``torch._grouped_mm``) and the backward's
rw * dout copy. Each (rows, columns, warps) tile per program is timed as 20 copies
captured in one CUDA graph (so the host's launch cost is out of it: one copy's host time
exceeds its GPU time on the H200 box), median of the replays, beside the bytes it moves:
the rows in use written, and read (each token row once per slot, mostly from L2, so the
rate can pass HBM's).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import moe_routing
from opreg.backends.triton import tune

TILES = [(32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8), (64, 128, 8), (4, 1024, 4)]


def graph_us(call, reps: int = 20, replays: int = 15) -> float:
    """Median GPU µs of one ``call``: ``reps`` calls captured in a CUDA graph, replayed."""
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                call()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--configs", nargs="*", default=list(tune.SHAPES))
    a = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, T = {a.tokens}; default tile "
          f"{F.ROWS_TILE}")
    for name in a.configs:
        e, h, i, k = tune.SHAPES[name]
        x, ids, rw = tune.inputs(e, h, i, k, a.tokens, torch.bfloat16, "cuda")[:3]
        spi, be, tables = moe_routing.routing_tables(ids, e, 128)
        used = int(tables[0, -1])  # the sorted rows written (unpadded)
        moved = used * h * 2 + a.tokens * k * h * 2  # written + read (bytes)
        want = F.sorted_rows(x, rw, spi, be, tables, k, False, tile=F.ROWS_TILE)[:used]
        print(f"\n{name}: {used} rows written ({spi.shape[0]} padded rows walked), {moved / 1e6:.0f} MB moved")
        for tile in TILES:
            for scaled in (False, True):
                us = graph_us(lambda: F.sorted_rows(x, rw, spi, be, tables, k, scaled, tile=tile))
                if not scaled:
                    got = F.sorted_rows(x, rw, spi, be, tables, k, False, tile=tile)[:used]
                    assert torch.equal(got, want), f"tile {tile} copied other bits"
                print(f"  tile {tile}{' scaled' if scaled else '       '}: {us:7.1f} us  "
                      f"{moved / us / 1e3:6.0f} GB/s")  # bytes / us / 1e3 = GB/s


if __name__ == "__main__":
    main()
