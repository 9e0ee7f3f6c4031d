"""The no-grad MoE forward with its launches replayed and without (``moe_experts.REPLAY``), CUDA.

    python bench/moe_replay.py [--configs mixtral qwen3_moe olmoe] [--tokens 4096] [--rounds 12] [--training]

``--training``: the training forward (``save=True``) and the block's training step instead,
with ``moe_experts.REPLAY_TRAINING`` off and on (``REPLAY`` on in both).

Per config and T, bf16, in one process:

* the fused forward's host time, one call after a sync (median of 30), replay off / on, twice
  (``fused_experts_forward`` on uniform routing, ``tune.inputs``);
* the transformers block (``experts_implementation="opreg"``) against HF's ``grouped_mm``
  block under ``torch.compile``: HF's, then opreg's with the replay off and on, timed by the
  project's timer (``_timing.interleaved``: ``--rounds`` rounds, the order rotated, a batch of
  ``--batch`` calls each after a sync, as ``bench_moe_block.py``'s); the medians, HF / opreg
  each way, and the median of the rounds' paired off / on ratios. One process: the GPU's clock
  sags under sustained load (2026-12-06, an H100: 1980 -> 1485-1755 MHz), so processes and
  their order differ by more than the replay does.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import _timing as tm
import bench_moe_block as bb
from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.testing.timing import host_once_us


def replay(on: bool, training: bool) -> Callable[[], None]:
    def set_it() -> None:
        if training:
            F.REPLAY_TRAINING = on
        else:
            F.REPLAY = on
    return set_it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(bb.CONFIGS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batch", type=int, default=5)
    p.add_argument("--training", action="store_true",
                   help="the training forward and the block's training step, REPLAY_TRAINING off / on")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_replay.py: needs a CUDA device")
    train = a.training
    mode = "fwd+bwd" if train else "fwd"
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, T = {a.tokens}, bf16, {mode}")
    for name in a.configs:
        _, _, h, ffn, e, k = bb.CONFIGS[name]
        args = tune.inputs(e, h, ffn, k, a.tokens, torch.bfloat16, "cuda")
        host = {False: [], True: []}
        with torch.no_grad():
            for _ in range(2):
                for on in (False, True):
                    replay(on, train)()
                    host[on].append(host_once_us(lambda: F.fused_experts_forward(*args, save=train), reps=30))
        block, x = bb.inputs(name, a.tokens, False)
        ours, hf = bb.variant(block, "opreg"), bb.variant(block, "hf_grouped_mm_inductor")
        ours_step, hf_step = bb.step(ours, x, mode), bb.step(hf, x, mode)
        variants = {"hf": tm.Variant(lambda i: hf_step()),
                    "off": tm.Variant(lambda i: ours_step(), before=replay(False, train)),
                    "on": tm.Variant(lambda i: ours_step(), before=replay(True, train))}
        times = tm.interleaved(variants, "cuda", rounds=a.rounds, target_us=1.0, min_batch=a.batch)
        F.REPLAY, F.REPLAY_TRAINING = True, True  # the defaults
        med = {key: tm.median(v) for key, v in times.items()}
        what = "training" if train else "fused"
        print(f"{name}: the {what} forward's host, replay off / on: "
              f"{' / '.join(f'{u:.1f}' for pair in zip(host[False], host[True]) for u in pair)} us")
        print(f"{name}: block {mode}, batches of {a.batch}, median of {a.rounds} rounds: "
              f"HF + Inductor {med['hf']:.0f} us, "
              f"opreg replay off {med['off']:.0f} ({med['hf'] / med['off']:.2f}x), on {med['on']:.0f} "
              f"({med['hf'] / med['on']:.2f}x); paired off / on {tm.paired_ratio(times['off'], times['on']):.3f}",
              flush=True)


if __name__ == "__main__":
    main()
