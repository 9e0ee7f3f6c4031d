"""The fused forward's block configs under sustained load: which is fastest once the GPU sits
at its power cap?

    python bench/moe_power.py [--configs mixtral] [--tokens 4096] [--calls 1500] [--window 50]
                              [--variant 'NAME={"gemm1": {"GROUP_M": 8}}' ...] [--json F]

Why: the tuner (``python -m opreg tune moe_experts``) times its candidates in alternating
short rounds, so every candidate meets the same clock. Over a long run the GPU caps its power
(NVML's "SW Power Capping"; 2026-12-05 on an H100: Mixtral's fused forward at T = 4096 ran
753 us a call in its first 50 calls at 1980 MHz and ~848 after, at 1545-1650 MHz, while HF's
grouped_mm + Inductor went from 890 to ~925 at 1770-1785 MHz, ``bench/moe_sustained.py``).
Under a cap the clock follows the kernels' energy per call, so a config that moves fewer
bytes per FLOP could win alone where it ties in alternation. Per config (bf16, no grad,
uniform routing, the op alone through ``fused_experts_forward(configs=...)``): ``--calls``
back-to-back calls after a 0.5 s idle gap, mean us a call per window of ``--window``, with
the SM clock and power at each window's end (NVML's power is a ~1 s average: it lags); the
verdict is each run's median over its second half (the steady state). The configs run in one
order, then in reverse, so that each meets the GPU cold and warm; each one's output is
compared bit for bit with the table's (GROUP_M and pipeline depth keep each tile's K order).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import moe_tiles
from opreg.backends.triton import tune

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_sustained import run  # noqa: E402  (windows of CUDA events beside NVML's clock and power)


# Without --variant: GEMM1's swizzle group and pipeline depth (its tile is already 128 x 256:
# BLOCK_N is each of the gate's and the up projection's halves; BLOCK_N 256, a 128 x 512
# tile, spilled and ran 5-9x slower on the H100, 2026-12-05)
DEFAULT_VARIANTS = {"gemm1 GROUP_M 8": {"gemm1": {"GROUP_M": 8}}, "gemm1 3 stages": {"gemm1": {"num_stages": 3}}}


def candidates(table: tuple[dict[str, int], dict[str, int], dict[str, int]],
               variants: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, Any]]:
    """The table's configs, and each variant's keys over them, as ``configs``."""
    c1, c2, cc = (dict(c) for c in table)
    out = {"table": {"gemm1": c1, "gemm2": c2, "combine": cc}}
    for label, spec in variants.items():
        out[label] = {"gemm1": {**c1, **spec.get("gemm1", {})}, "gemm2": {**c2, **spec.get("gemm2", {})},
                      "combine": cc}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["mixtral"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=1500)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help='GEMM keys over the table\'s, e.g. \'GROUP_M 8={"gemm1": {"GROUP_M": 8}}\' (repeatable)')
    p.add_argument("--json", default=None)
    a = p.parse_args()
    variants = {}
    for v in a.variant:
        label, _, spec = v.partition("=")
        try:
            variants[label] = json.loads(spec)
        except json.JSONDecodeError as err:
            p.error(f"--variant {v!r}: NAME=JSON expected, the JSON after '=' does not parse ({err})")
    variants = variants or DEFAULT_VARIANTS
    if not torch.cuda.is_available():
        raise SystemExit("moe_power.py times a CUDA device; none is available")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, no grad; {a.calls} calls a "
          f"run, us a call per window of {a.window}; clock MHz / W at each window's end (NVML)", flush=True)
    report: dict[str, Any] = {}
    for name in a.configs:
        e, h, i, k = tune.SHAPES[name]
        args = tune.inputs(e, h, i, k, a.tokens, torch.bfloat16, "cuda")
        table = F.forward_configs({}, a.tokens * k / e, 2 * i, h, i, k, torch.bfloat16)
        cands = candidates(table, variants)
        want = F.fused_experts_forward(*args, configs=cands["table"])
        calls = {}
        for label, cfg in cands.items():
            try:
                got = F.fused_experts_forward(*args, configs=cfg)
            except moe_tiles.triton.runtime.errors.OutOfResources as err:
                print(f"{name} {label}: does not fit ({str(err)[:80]})")
                continue
            same = torch.equal(got, want)
            print(f"{name} {label}: {json.dumps(cfg['gemm1'])} | gemm2 {json.dumps(cfg['gemm2'])}; "
                  f"bit-identical to the table's: {same}", flush=True)
            calls[label] = (lambda c=cfg: F.fused_experts_forward(*args, configs=c))
        order = list(calls) + list(reversed(calls))
        steady: dict[str, list[float]] = {label: [] for label in calls}
        for n, label in enumerate(order):
            rows = run(calls[label], a.calls, a.window)
            us = [r[0] for r in rows]
            st = statistics.median(us[len(us) // 2:])
            steady[label].append(st)
            print(f"\n{name} T={a.tokens} {label} (run {n + 1} of {len(order)}): first window {us[0]:.0f} us, "
                  f"steady (median of the second half) {st:.0f}")
            print("  " + " ".join(f"{u:.0f}" for u in us))
            print("  clock " + " ".join(f"{r[1]:.0f}" for r in rows))
            print("  power " + " ".join(f"{r[2]:.0f}" for r in rows), flush=True)
        base = statistics.mean(steady["table"])
        print(f"\n{name} T={a.tokens}: steady us (both runs) and mean / the table's")
        for label, v in steady.items():
            print(f"  {label:20s} {' '.join(f'{x:.0f}' for x in v)}  {statistics.mean(v) / base:.3f}")
        report[name] = steady
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
