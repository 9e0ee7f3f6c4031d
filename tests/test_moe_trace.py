"""bench/moe_trace.py's trace analysis on a made-up chrome trace (no GPU, no transformers):
busy and idle time, and the CPU ops charged with each gap."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("opreg_bench_moe_trace", ROOT / "bench" / "moe_trace.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        sys.modules.pop(spec.name, None)
    return mod


def X(cat: str, name: str, ts: float, dur: float, tid: int = 1, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_analyse_charges_each_gap_to_the_launching_ops(capsys):
    trace = {"traceEvents": [
        X("cpu_op", "outer", 0, 200), X("cpu_op", "inner", 10, 100), X("cpu_op", "other", 150, 40),
        X("cuda_runtime", "cudaLaunchKernel", 20, 5, corr=7),
        X("cuda_driver", "cuLaunchKernelEx", 160, 5, corr=8),
        X("kernel", "k0", 0, 10, tid=9, corr=6),
        X("kernel", "k1", 40, 10, tid=9, corr=7),      # 30 idle before it: launched inside outer > inner
        X("kernel", "k2", 45, 10, tid=9, corr=9),      # overlaps k1: no gap, busy counted once
        X("kernel", "k3", 170, 10, tid=9, corr=8),     # 115 idle before it: launched inside outer > other
        X("ac2g", "flow", 0, 0),                       # not an X event of interest
    ]}
    load().analyse(trace, steps=1, top=5)
    out = capsys.readouterr().out
    assert "GPU span 180 us/step, kernels busy 35, idle 145 (2 gaps)" in out
    assert "115  outer > other" in out and "30  outer > inner" in out
    assert out.index("115 us before k3") < out.index("30 us before k1")
