"""The no-grad MoE forward with its launches replayed and without (``moe_experts.REPLAY``), CUDA.

    python bench/moe_replay.py [--configs mixtral qwen3_moe olmoe] [--tokens 4096] [--rounds 12]

Per config and T, bf16, in one process:

* the fused forward's host time, one call after a sync (median of 30), replay off / on, twice
  (``fused_experts_forward`` on uniform routing, ``tune.inputs``);
* the transformers block (``experts_implementation="opreg"``) against HF's ``grouped_mm``
  block under ``torch.compile``: ``--rounds`` rounds, each a batch of ``--batch`` calls of HF's,
  then opreg's with the replay off and on in alternating order (CUDA events around each batch,
  after a sync: a batch starts on an idle GPU, as ``bench_moe_block.py``'s do); the medians,
  HF / opreg each way, and the median of the rounds' paired off / on ratios. One process: the
  GPU's clock sags under sustained load (2026-12-06, an H100: 1980 -> 1485-1755 MHz), so
  processes and their order differ by more than the replay does.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

import bench_moe_block as bb
from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.testing.timing import host_once_us


def batch_us(call: Callable[[], object], n: int, reps: int = 3) -> float:
    """µs per call of ``n`` calls after a sync (CUDA events), median of ``reps``."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            call()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(bb.CONFIGS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batch", type=int, default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_replay.py: needs a CUDA device")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, T = {a.tokens}, bf16")
    for name in a.configs:
        _, _, h, ffn, e, k = bb.CONFIGS[name]
        args = tune.inputs(e, h, ffn, k, a.tokens, torch.bfloat16, "cuda")
        with torch.no_grad():
            host = {False: [], True: []}
            for _ in range(2):
                for on in (False, True):
                    F.REPLAY = on
                    host[on].append(host_once_us(lambda: F.fused_experts_forward(*args), reps=30))
            block, x = bb.inputs(name, a.tokens, False)
            ours, hf = bb.variant(block, "opreg"), bb.variant(block, "hf_grouped_mm_inductor")
            for _ in range(3):
                ours(x)
                hf(x)
            times: dict[object, list[float]] = {"hf": [], False: [], True: []}
            for r in range(a.rounds):
                times["hf"].append(batch_us(lambda: hf(x), a.batch))
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    F.REPLAY = on
                    times[on].append(batch_us(lambda: ours(x), a.batch))
            F.REPLAY = True
        med = {key: statistics.median(v) for key, v in times.items()}
        paired = statistics.median(off / on for off, on in zip(times[False], times[True]))
        print(f"{name}: the fused forward's host, replay off / on: "
              f"{' / '.join(f'{u:.1f}' for pair in zip(host[False], host[True]) for u in pair)} us")
        print(f"{name}: block, batches of {a.batch}, median of {a.rounds} rounds: HF + Inductor {med['hf']:.0f} us, "
              f"opreg replay off {med[False]:.0f} ({med['hf'] / med[False]:.2f}x), on {med[True]:.0f} "
              f"({med['hf'] / med[True]:.2f}x); paired off / on {paired:.3f}", flush=True)


if __name__ == "__main__":
    main()
