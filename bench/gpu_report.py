"""One GPU session's report: the issue's cases, timed in one run, printed as a table.

    python bench/gpu_report.py [--json out.json]

Per case and variant: host-timed per-call µs of back-to-back calls (what a model
sees at small sizes), the same calls replayed from a CUDA graph, and the device time
from CUDA events (median of many); with GB/s (scatter) or TFLOP/s (cat_linear).
Every variant's output is checked against the float64 reference first.

The small (seed-size) cases also run the op without programmatic dependent launch
(``OPREG_PDL=0``; on by default, backends/cuda/pdl.cuh: its kernel may launch while the kernel
before it runs): alone, where a graph's calls follow one another (with PDL each launch overlaps
the previous call's kernel), and each call after a foreign kernel, with and without PDL, so the
gain is shown for each neighbour:
``z.add_(1)`` (one wave, no PDL of its own) and a cuBLAS bf16 GEMM of several waves (8192 x
256 @ 256 x 1024: 256-512 output tiles, ~10 us), as a model's op follows a Linear: a library
kernel that releases its dependents early would let the op's blocks sit resident, waiting,
beside its last waves.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

import opreg
from opreg.testing import timing
from opreg.ops.cat_linear import reference as cat_ref
from opreg.ops.scatter_combine import reference as sc_ref

DEV = "cuda"


def per_call_us(fn: Callable[[], Any], calls: int = 400, reps: int = 7) -> float:
    """Host time per call of ``calls`` back-to-back calls (median of ``reps``)."""
    import time

    for _ in range(min(calls, 20)):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def interleaved_times(fns: dict[str, Callable[[], Any]], calls: int = 300, rounds: int = 15
                      ) -> dict[str, list[float]]:
    """Per-call host µs of each of ``fns`` in each of ``rounds`` rounds; a round times one
    batch of ``calls`` of every fn back to back, so host drift hits all of them alike."""
    import time

    for f in fns.values():
        for _ in range(20):
            f()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def paired(times: dict[str, list[float]], a: str, b: str) -> str:
    """``a`` against ``b`` round by round: the median ratio and how often ``a`` won."""
    ratios = [x / y for x, y in zip(times[a], times[b])]
    wins = sum(r < 1 for r in ratios)
    return (f"{a} / {b}: median ratio {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}), faster in {wins}/{len(ratios)} rounds")


def graph_us(fn: Callable[[], Any], calls: int = 50, reps: int = 20) -> float:
    """Per-call time of ``calls`` calls captured in one CUDA graph and replayed."""
    return timing.graph_us(fn, reps, calls)


def device_us(fn: Callable[[], Any], reps: int = 15, batch: int = 10) -> float:
    """Device time of one call: CUDA events around ``batch`` back-to-back calls (so the
    host runs ahead and its own time stays out), median of ``reps``."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / batch)
    return statistics.median(times)


@contextlib.contextmanager
def env(setting: dict[str, str]) -> Any:
    """``setting`` in the environment while a variant is measured (the ops read OPREG_PDL per
    call: a capture records what it read); the variable's former value restored after."""
    before = {var: os.environ.get(var) for var in setting}
    os.environ.update(setting)
    try:
        yield
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


NO_PDL = {"OPREG_PDL": "0"}
_FOREIGN: dict[str, Callable[[], Any]] = {}


def _foreign(kind: str) -> Callable[[], Any]:
    """The foreign kernel ``kind`` ("add_" or "mm") on scratch tensors made once."""
    if kind not in _FOREIGN:
        if kind == "add_":
            z = torch.zeros(1024, device=DEV)
            _FOREIGN[kind] = lambda: z.add_(1)
        else:
            a = torch.randn(8192, 256, device=DEV, dtype=torch.bfloat16)
            b = torch.randn(256, 1024, device=DEV, dtype=torch.bfloat16)
            c = torch.empty(8192, 1024, device=DEV, dtype=torch.bfloat16)
            _FOREIGN[kind] = lambda: torch.mm(a, b, out=c)
    return _FOREIGN[kind]


def after(kind: str, call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` preceded by the foreign kernel ``kind``."""
    first = _foreign(kind)

    def both() -> Any:
        first()
        return call()
    return both


def with_pdl(variants: dict[str, Callable[[], Any]], name: str) -> dict[str, tuple[dict[str, str], Callable[[], Any]]]:
    """Each variant with no extra environment (PDL on, the default), plus ``name`` without PDL,
    and both after each foreign kernel."""
    out = {k: ({}, f) for k, f in variants.items()}
    out[f"{name}, OPREG_PDL=0"] = (NO_PDL, variants[name])
    for kind in ("add_", "mm"):
        out[f"{name} after {kind}"] = ({}, after(kind, variants[name]))
        out[f"{name} after {kind}, OPREG_PDL=0"] = (NO_PDL, after(kind, variants[name]))
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def timed_row(case: str, name: str, call: Callable[[], Any], want: torch.Tensor, small: bool,
              rate: str, work_per_us: float) -> dict[str, Any]:
    """One variant's row: its error against ``want``, device µs, ``rate`` (``work_per_us`` per
    device µs) and, for the small cases, µs per call back to back and replayed from a graph."""
    err = rel_err(call(), want)
    dev = device_us(call)
    return {"case": case, "variant": name, "rel_err": err, "device_us": dev, rate: work_per_us / dev,
            "per_call_us": per_call_us(call) if small else None,
            "graph_us": graph_us(call) if small else None}


def index_add(hidden, idx, gates, t):
    out = torch.zeros(t, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    return out.index_add_(0, idx, hidden * gates[:, None].to(hidden.dtype))


def cat_eager(parts, weight, bias):
    return F.linear(torch.cat(parts, -1), weight, bias)


SCATTER = [  # tokens, fanout, hidden, dtype, small (time per call + graph)
    (1536, 2, 128, torch.float32, True),
    (16384, 2, 4096, torch.bfloat16, False),
    (8192, 8, 7168, torch.bfloat16, False),
]
CAT = [  # R, B, H, K, dtype, small
    (4, 12, 32, 56, torch.float32, True),
    (4, 64, 256, 1024, torch.float32, True),
    (8, 8192, 512, 4096, torch.bfloat16, False),
    (32, 4096, 128, 4096, torch.bfloat16, False),
]


def scatter_rows() -> list[dict[str, Any]]:
    rows = []
    for t, k, h, dtype, small in SCATTER:
        n = t * k
        expert = torch.randint(0, 64, (n,), device=DEV)
        idx = torch.arange(t, device=DEV).repeat_interleave(k)[torch.sort(expert, stable=True).indices]
        idx = idx.to(torch.int32)
        hidden = torch.randn(n, h, device=DEV, dtype=dtype)
        gates = torch.rand(n, device=DEV, dtype=dtype)
        want = sc_ref(hidden.double(), idx, gates.double(), t)
        nbytes = (n * h + t * h) * hidden.element_size() + n * (4 + gates.element_size())
        torch._dynamo.reset()
        fns = {
            "eager index_add_": index_add,
            "inductor": torch.compile(index_add, dynamic=False),
            "opreg cuda": opreg.get("scatter_combine", impl="cuda"),  # pinned (a Python wrapper)
            "opreg": opreg.get("scatter_combine"),  # what users call: the C++ entry
        }
        calls = {name: (lambda fn: lambda: fn(hidden, idx, gates, t))(fn) for name, fn in fns.items()}
        variants = with_pdl(calls, "opreg") if small else {v: ({}, f) for v, f in calls.items()}
        case = f"scatter {t}x{k}x{h} {str(dtype)[6:]}"
        for name, (setting, call) in variants.items():
            with env(setting):
                rows.append(timed_row(case, name, call, want, small, "GB/s", nbytes / 1e3))
                if name == "opreg cuda":
                    rows[-1]["deterministic"] = all(torch.equal(call(), call()) for _ in range(3))
    return rows


def cat_rows() -> list[dict[str, Any]]:
    rows = []
    # what users call (the C++ entries; the CUDA kernels are the default on a GPU)
    cl = opreg.get("cat_linear")
    stacked = opreg.get("cat_linear_stacked")
    for r, b, h, k, dtype, small in CAT:
        x = torch.randn(r, b, h, device=DEV, dtype=dtype)
        parts = list(x.unbind(0))
        weight = torch.randn(k, r * h, device=DEV, dtype=dtype) / (r * h) ** 0.5
        bias = torch.randn(k, device=DEV, dtype=dtype)
        want = cat_ref([p.double() for p in parts], weight.double(), bias.double())
        flops = 2 * b * r * h * k
        torch._dynamo.reset()
        calls = {
            "eager": lambda: cat_eager(parts, weight, bias),
            "inductor": (lambda f: lambda: f(parts, weight, bias))(
                torch.compile(cat_eager, dynamic=False)),
            "opreg cuda": lambda: cl(parts, weight, bias),
            "opreg cuda stacked": lambda: stacked(x, 0, weight, bias),
        }
        variants = with_pdl(calls, "opreg cuda") if small else {v: ({}, f) for v, f in calls.items()}
        case = f"cat_linear R{r} B{b} H{h} K{k} {str(dtype)[6:]}"
        for name, (setting, call) in variants.items():
            with torch.no_grad(), env(setting):
                rows.append(timed_row(case, name, call, want, small, "TFLOP/s", flops / 1e6))
    return rows


PAIRED: list[str] = []  # the model comparisons, round by round (printed after the table)


def model_rows() -> list[dict[str, Any]]:
    """The two reference models: eager, Inductor, and opreg (backend / optimize)."""
    from opreg.models import cat_linear as cat_model
    from opreg.models import moe_combine_loop as moe_model

    rows = []
    cat = cat_model.Model().to(DEV)
    (x,) = cat_model.get_inputs(device=DEV)
    torch._dynamo.reset()
    with torch.no_grad():
        want = cat(x)
        twin = cat_model.Model().to(DEV)  # its own compiled module, same weights
        twin.load_state_dict(cat.state_dict())
        fns = {"eager": cat, "inductor": torch.compile(twin),
               "opreg backend": torch.compile(cat, backend="opreg")}
        for name, fn in fns.items():
            torch.testing.assert_close(fn(x), want)
        # Interleaved rounds: host drift during the run hits every variant alike.
        times = interleaved_times({k: (lambda f: lambda: f(x))(f) for k, f in fns.items()})
        for name, ts in times.items():
            rows.append({"case": "model cat_linear", "variant": name,
                         "per_call_us": statistics.median(ts), "min_us": min(ts), "max_us": max(ts)})
        PAIRED.extend([paired(times, "opreg backend", "eager"),
                       paired(times, "opreg backend", "inductor")])
    moe = moe_model.Model()
    args = moe_model.get_inputs(device=DEV)
    want = moe(*args)
    torch._dynamo.reset()
    for name, fn in {"eager loop": moe, "inductor": torch.compile(moe_model.Model()),
                     "opreg.optimize": opreg.optimize(moe_model.Model())}.items():
        torch.testing.assert_close(fn(*args), want)
        slow = name != "opreg.optimize"
        rows.append({"case": "model moe_combine_loop", "variant": name,
                     "per_call_us": per_call_us(lambda: fn(*args), calls=2 if slow else 200,
                                                reps=3 if slow else 7)})
    return rows


def baseline_rows() -> list[dict[str, Any]]:
    x = torch.randn(1024, device=DEV)
    return [{"case": "host floor", "variant": "aten x.add_(1)",
             "per_call_us": per_call_us(lambda: x.add_(1)), "graph_us": graph_us(lambda: x.add_(1))}]


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.1f}"
    return str(v)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rows = baseline_rows() + scatter_rows() + cat_rows() + model_rows()
    cols = ["case", "variant", "per_call_us", "min_us", "max_us", "graph_us", "device_us", "GB/s", "TFLOP/s", "rel_err",
            "deterministic"]
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | opreg {opreg.__version__}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    for line in PAIRED:
        print(f"model cat_linear, paired by round: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "paired": PAIRED}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
