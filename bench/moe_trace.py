"""Where a MoE block's training step leaves the GPU idle, and what the host does then (CUDA).

    python bench/moe_trace.py [--configs mixtral] [--tokens 4096] [--variants opreg hf_grouped_mm_inductor]
                              [--steps 3] [--trace-dir DIR]

A step whose host time exceeds its kernels' time waits on its host: the GPU idles between
kernels while the host prepares the next launch. Per variant (``bench_moe_block.variant``),
``--steps`` training steps (``step(..., "fwd+bwd")``) under torch.profiler (CPU + CUDA): the
steps' wall time, the kernels' busy time (the union of their intervals) and the idle rest,
then the longest idle gaps, each with the kernel that ended it and the chain of CPU ops that
launched that kernel (outermost first): which part of the step the host was late in. The
chrome traces go to ``--trace-dir`` if given.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def analyse(trace: dict, steps: int, top: int) -> None:
    """Print a chrome trace's GPU busy and idle time per step, the idle time by the CPU ops
    that launched the kernel ending each gap, and the ``top`` longest gaps."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    runtime = {e["args"].get("correlation"): e for e in ev
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    ops = sorted((e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "python_function")),
                 key=lambda e: e["ts"])
    starts = [e["ts"] for e in ops]
    if not kernels:
        print("  no kernels in the trace")
        return
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy, end, gaps = 0.0, kernels[0]["ts"], []
    for k in kernels:
        if k["ts"] > end:
            gaps.append((k["ts"] - end, k))
        busy += max(0.0, k["ts"] + k["dur"] - max(k["ts"], end))
        end = max(end, k["ts"] + k["dur"])
    print(f"  {steps} steps: GPU span {span / steps:.0f} us/step, kernels busy {busy / steps:.0f}, "
          f"idle {(span - busy) / steps:.0f} ({len(gaps)} gaps)")

    def chain(t: float, tid: int) -> list[str]:
        """The CPU ops on thread ``tid`` open at time ``t``, outermost first."""
        out = []
        for e in ops[: bisect.bisect_right(starts, t)]:
            if e.get("tid") == tid and e["ts"] <= t <= e["ts"] + e["dur"]:
                out.append(e["name"][:60])
        return out

    by_phase: dict[str, float] = defaultdict(float)
    rows = []
    for g, k in gaps:
        r = runtime.get(k.get("args", {}).get("correlation"))
        names = chain(r["ts"], r["tid"]) if r else []
        by_phase[" > ".join(names[:2]) or "?"] += g
        rows.append((g, k["name"][:50], names))
    print("  idle by the launching CPU ops (outer two), us per step:")
    for name, g in sorted(by_phase.items(), key=lambda x: -x[1])[:12]:
        print(f"    {g / steps:8.0f}  {name}")
    print(f"  the {top} longest gaps:")
    for g, kname, names in sorted(rows, key=lambda x: -x[0])[:top]:
        print(f"    {g:8.0f} us before {kname}  <- {' > '.join(names[-4:])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["mixtral"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--variants", nargs="*", default=["opreg", "hf_grouped_mm_inductor"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace-dir", default=None)
    a = p.parse_args()
    import bench_moe_block as bb  # here: analyse() needs neither transformers nor a GPU

    for config in a.configs:
        block, x = bb.inputs(config, a.tokens, False)
        for name in a.variants:
            fn = bb.variant(block, name)
            step = bb.step(fn, x, "fwd+bwd")
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    step()
                torch.cuda.synchronize()
            path = os.path.join(a.trace_dir or tempfile.mkdtemp(), f"{config}_{a.tokens}_{name}.json")
            prof.export_chrome_trace(path)
            print(f"\n{config} T={a.tokens} {name} (trace {path})")
            with open(path) as f:
                analyse(json.load(f), a.steps, a.top)


if __name__ == "__main__":
    main()
