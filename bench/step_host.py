"""Where a MoE block's training step spends its host time (CUDA), per phase.

    python bench/step_host.py [--tokens 4096] [--configs mixtral] [--variants ...]

For each variant (``bench_moe_block.variant``), one training step at a time on an idle GPU
(a sync before each): the host's wall clock until the forward returns, the sum, and until
``backward()`` returns (medians of ``--reps``). Then the same with a ~20 ms GPU sleep queued
before the step: a phase that waits on the GPU (a hidden sync, a blocking copy or
allocation) takes the sleep's time there; one that only enqueues does not. Last, cProfile
over ``--reps`` such steps (``bench_moe_block.step``), by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import bench_moe_block as bb
from opreg.testing.timing import median_us


def phases(fn, xg, leaves, reps: int, sleep_cycles: int = 0) -> tuple[float, float, float]:
    out = []
    for _ in range(reps + 3):
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        y = fn(xg)
        t1 = time.perf_counter()
        loss = y.sum()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        out.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6))
    torch.cuda.synchronize()
    out = out[3:]
    return tuple(statistics.median(o[i] for o in out) for i in range(3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--configs", nargs="*", default=["mixtral"])
    p.add_argument("--variants", nargs="*", default=["hf_grouped_mm_inductor", "opreg", "opreg_inductor"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="also cProfile the steps")
    a = p.parse_args()
    # ~20 ms at the H200's ~1.98 GHz
    cycles = 40_000_000
    for config in a.configs:
        block, x = bb.inputs(config, a.tokens, False)
        for name in a.variants:
            torch._dynamo.reset()
            fn = bb.variant(block, name)
            xg = x.detach().requires_grad_()
            leaves = [xg] + (list(fn.parameters()) if isinstance(fn, torch.nn.Module) else [])
            f, s, b = phases(fn, xg, leaves, a.reps)
            fs, ss, bs = phases(fn, xg, leaves, a.reps, cycles)
            call = bb.step(fn, x, "fwd+bwd")  # the gradients set to None, then forward and backward
            gpu = median_us(call, a.reps, True)
            print(f"{config} T={a.tokens} {name:24s} GPU {gpu:7.0f}  host us: forward {f:7.0f}  sum {s:5.0f}"
                  f"  backward {b:7.0f}"
                  f"  | behind a 20 ms GPU sleep: forward {fs:7.0f}  sum {ss:5.0f}  backward {bs:7.0f}", flush=True)
            if a.profile:
                pr = cProfile.Profile()
                for _ in range(a.reps):  # a sync before each: the host's own time, not the GPU's
                    torch.cuda.synchronize()
                    pr.enable()
                    call()
                    pr.disable()
                torch.cuda.synchronize()
                pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
