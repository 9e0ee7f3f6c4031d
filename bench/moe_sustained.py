"""A MoE block's time per call over a long run of back-to-back calls, beside the GPU's clock
and power: does the block slow down as the GPU heats and meets its power cap, and does it
slow down as much as HF's?

    python bench/moe_sustained.py [--configs mixtral] [--tokens 4096] [--calls 400] [--mode fwd+bwd]

Why: on the H200 the same Mixtral forward read 719 us a call from 20 back-to-back calls
(``moe_profile.py``, CUDA events) and 851 us in ``bench_moe_block.py``'s batches of >= 20
calls interleaved with HF's (2026-12-04); the fused forward at T = 16384 ran 2435-2458 us in
its first ~65 ms after an idle gap and 2700-2750 after (2026-12-03). Per variant (bf16, no
grad), after a 0.5 s idle gap: ``--calls`` calls, each between CUDA events, reported per
window of ``--window`` calls (mean us a call, the window's first call left out: it starts on
the queue the window's NVML read drained), with the SM clock (MHz) and power (W) read
from NVML at each window's end (``torch.cuda.clock_rate`` / ``power_draw``: no sync, but
one NVML query each; absent where pynvml is missing). The variants run one after the other,
then again in the reverse order, so each meets the GPU both cold and warm. ``--mode
fwd+bwd``: the training step instead (``bench_moe_block.step``), e.g. eager opreg against
opreg + Inductor, whose steps ran the same kernels at T = 16384 on the H100 with the compute-
bound ones 2.5-4.5 % slower in the compiled step in either order (2026-12-06, sixty-fifth
session). Run so (OLMoE, 150 steps a run): both at their power cap, 1590-1665 MHz, the
compiled step 0.99x eager's (bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe_block as bb  # noqa: E402


def nvml() -> tuple[float, float]:
    """(SM clock MHz, power W) now, or NaNs where NVML can't be read."""
    try:
        return float(torch.cuda.clock_rate()), float(torch.cuda.power_draw()) / 1000.0
    except Exception:  # noqa: BLE001 - pynvml missing or unsupported: report without it
        return float("nan"), float("nan")


def run(call, calls: int, window: int) -> list[tuple[float, float, float]]:
    """(mean us a call, clock, power) per window of ``window`` calls, after an idle gap."""
    torch.cuda.synchronize()
    time.sleep(0.5)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    marks = []
    ev[0].record()
    for i in range(calls):
        call()
        ev[i + 1].record()
        if (i + 1) % window == 0:
            # the queue runs ahead of the host by at most a few calls: read NVML now, and
            # pin it to the window by waiting for this window's last call
            ev[i + 1].synchronize()
            marks.append(nvml())
    torch.cuda.synchronize()
    out = []
    for w, (clk, pw) in enumerate(marks):
        # a window's first call starts on the queue the sync drained (it pays the host's
        # start-up): the window is timed from its end
        a, b = w * window + 1, (w + 1) * window
        out.append((ev[a].elapsed_time(ev[b]) * 1e3 / (b - a), clk, pw))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["mixtral"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--window", type=int, default=25)
    p.add_argument("--variants", nargs="*", default=["hf_grouped_mm_inductor", "opreg"])
    p.add_argument("--mode", default="fwd", choices=bb.MODES, help="fwd (no grad) or fwd+bwd (a training step)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_sustained.py times a CUDA device; none is available")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {a.mode}; "
          f"{a.calls} back-to-back calls a run, mean us a call per window of {a.window}; clock MHz / W at "
          f"each window's end (NVML)")
    for config in a.configs:
        block, x = bb.inputs(config, a.tokens, False)
        calls = {}
        for name in a.variants:
            torch._dynamo.reset()
            fn = bb.variant(block, name)
            step = bb.step(fn, x, a.mode)
            for _ in range(3):
                step()
            calls[name] = step
        order = list(a.variants) + list(reversed(a.variants))
        for n, name in enumerate(order):
            rows = run(calls[name], a.calls, a.window)
            us = [r[0] for r in rows]
            print(f"\n{config} T={a.tokens} {name} (run {n + 1} of {len(order)}): first window {us[0]:.0f} us, "
                  f"last {us[-1]:.0f}, median {statistics.median(us):.0f}, min {min(us):.0f}")
            print("  " + " ".join(f"{u:.0f}" for u in us))
            print("  clock " + " ".join(f"{r[1]:.0f}" for r in rows))
            print("  power " + " ".join(f"{r[2]:.0f}" for r in rows))


if __name__ == "__main__":
    main()
