"""Host time per call of the two fused ops at the seeds' sizes, and where it goes.

    python bench/seed_host.py [--calls 400] [--profile-calls 500]     (CUDA)

Issue 19's acceptance 4 asks <= 8 us a call at the seeds' sizes. On the H200 (2026-12-05,
``gpu_report.py``) cat_linear takes 7.4 us and scatter_combine 9.7, with the same layers in
front of one PDL launch each (the C++ entry, the autograd kernel, the CUDA kernel's checks):
this script finds the difference. Per case: ``gpu_report.per_call_us`` (the figure above),
beside ``x.add_(1)`` (the host's floor for one op) and ``torch.empty`` of the output's size;
then each op's top host ops and CUDA runtime calls by self time under ``torch.profiler``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

import opreg
from gpu_report import NO_PDL, env, per_call_us  # bench/ is the script's directory: on sys.path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--profile-calls", type=int, default=500)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("seed_host.py: needs a CUDA device (it times the CUDA kernels' host side)", file=sys.stderr)
        return 2
    dev = "cuda"
    torch.manual_seed(0)
    sc, cl = opreg.get("scatter_combine"), opreg.get("cat_linear")
    # the seeds' sizes (gpu_report.py's small cases): scatter 1536 x 2 x 128 fp32, rows in
    # expert order; cat_linear R4 B12 H32 K56 fp32
    t, k, h = 1536, 2, 128
    expert = torch.randint(0, 64, (t * k,), device=dev)
    idx = torch.arange(t, device=dev).repeat_interleave(k)[torch.sort(expert, stable=True).indices]
    idx = idx.to(torch.int32)
    hidden, gates = torch.randn(t * k, h, device=dev), torch.rand(t * k, device=dev)
    h16, i16, g16 = hidden[:32], (idx[:32] % 16).to(torch.int32), gates[:32]  # 16 tokens: the tiny path
    parts = list(torch.randn(4, 12, 32, device=dev).unbind(0))
    weight, bias = torch.randn(56, 128, device=dev), torch.randn(56, device=dev)
    x = torch.randn(8, device=dev)
    cases: dict[str, Callable[[], Any]] = {
        "x.add_(1)": lambda: x.add_(1),
        "torch.empty(1536, 128)": lambda: torch.empty(t, h, device=dev),
        "scatter_combine (entry)": lambda: sc(hidden, idx, gates, t),
        "scatter_combine (torch.ops)": lambda: torch.ops.opreg.scatter_combine(hidden, idx, gates, t),
        "scatter_combine, 16 tokens": lambda: sc(h16, i16, g16, 16),
        "cat_linear (entry)": lambda: cl(parts, weight, bias),
    }
    ops = ("scatter_combine (entry)", "cat_linear (entry)")
    print(f"{torch.__version__} {torch.cuda.get_device_name()}")
    for name, fn in cases.items():
        print(f"{name:32s} {per_call_us(fn, a.calls):6.2f} us a call", flush=True)
    with env(NO_PDL):  # the kernels read OPREG_PDL per call
        for name in ops:
            print(f"{name + ', OPREG_PDL=0':32s} {per_call_us(cases[name], a.calls):6.2f} us a call", flush=True)
    for name in ops:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.profile_calls):
                cases[name]()
            torch.cuda.synchronize()
        print(f"--- {name}: {a.profile_calls} calls\n"
              + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
