"""Where the per-call time of the reference cat_linear model goes (host-bound sizes).

    python bench/model_overhead.py [--device cuda] [--reps 15] [--calls 300]

Times, interleaved round by round (so host drift hits every variant alike), the model
eager and compiled, and the pieces a compiled call is made of: Dynamo's own cost
(``backend="eager"``), the rewritten graph called directly, the opreg op alone, with
and without its autograd kernel. Prints the median µs per call and the spread (min-max
over rounds) of each, under ``torch.no_grad()``. Every variant's output is checked
against eager first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import opreg
from gpu_report import paired  # this folder
from opreg.backend import RecordingBackend
from opreg.models import cat_linear as cat_model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def variants(device: str) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model = cat_model.Model().to(device)
    (x,) = cat_model.get_inputs(device=device)
    w, b = model.proj.weight, model.proj.bias
    parts = [x[i] for i in range(cat_model.R)]
    op = torch.ops.opreg.cat_linear.default
    R = cat_model.R

    def twin() -> torch.nn.Module:
        m = cat_model.Model().to(device)
        m.load_state_dict(model.state_dict())
        return m

    torch._dynamo.reset()
    rec = RecordingBackend(inner="eager")
    torch.compile(twin(), backend=rec)(x)
    gm = rec.graphs[0]
    v: dict[str, Callable[[], Any]] = {
        "eager model": lambda: model(x),
        "eager ops inline": lambda: F.linear(torch.cat([x[i] for i in range(R)], -1), w, b),
        "compile backend=eager": torch.compile(twin(), backend="eager"),
        "compile backend=opreg": torch.compile(twin(), backend="opreg"),
        "compile inductor": torch.compile(twin()),
        "rewritten graph, no Dynamo": lambda: gm.forward(x, w, b)[0],
        "op, slices each call": lambda: op([x[i] for i in range(R)], w, b),
        "op, unbind each call": lambda: op(x.unbind(0), w, b),
        "op, parts prebuilt": lambda: op(parts, w, b),
        "stacked op": lambda: torch.ops.opreg.cat_linear_stacked.default(x, 0, w, b),
        "cat+linear, parts prebuilt": lambda: F.linear(torch.cat(parts, -1), w, b),
        "host floor x.add_(0)": lambda: x.add_(0),
    }
    if device == "cuda":
        v["compile backend=opreg reduce-overhead"] = torch.compile(
            twin(), backend="opreg", mode="reduce-overhead")
        v["compile inductor reduce-overhead"] = torch.compile(twin(), mode="reduce-overhead")
    compiled = {k: f for k, f in v.items() if k.startswith("compile")}
    for k, f in compiled.items():  # compiled modules take x
        v[k] = (lambda f: lambda: f(x))(f)
    want = model(x)
    for k, f in v.items():
        if k.startswith("host"):
            continue
        for _ in range(3):
            got = f()
        torch.testing.assert_close(got, want, msg=lambda m, k=k: f"{k}: {m}")
    return v


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    with torch.no_grad():
        v = variants(args.device)
        times: dict[str, list[float]] = {k: [] for k in v}
        for f in v.values():
            for _ in range(50):
                f()
        sync(args.device)
        for _ in range(args.reps):
            for k, f in v.items():
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f()
                sync(args.device)
                times[k].append((time.perf_counter() - t0) / args.calls * 1e6)
        # The op without its autograd kernel: the dispatcher skips the Autograd key.
        op = torch.ops.opreg.cat_linear.default
        model = cat_model.Model().to(args.device)
        (x,) = cat_model.get_inputs(device=args.device)
        parts = [x[i] for i in range(cat_model.R)]
        below = []
        with torch._C._AutoDispatchBelowAutograd():
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    op(parts, model.proj.weight, model.proj.bias)
                sync(args.device)
                below.append((time.perf_counter() - t0) / args.calls * 1e6)
        times["op, parts prebuilt, below autograd"] = below
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {dev} | torch {torch.__version__} | opreg {opreg.__version__} | "
          f"{args.reps} rounds x {args.calls} calls, no_grad")
    print("| variant | median µs/call | min | max |")
    print("|---|---|---|---|")
    for k, ts in times.items():
        print(f"| {k} | {statistics.median(ts):.1f} | {min(ts):.1f} | {max(ts):.1f} |")
    for other in ("eager model", "compile inductor"):
        print("paired by round: " + paired(times, "compile backend=opreg", other))
    return 0


if __name__ == "__main__":
    sys.exit(main())
