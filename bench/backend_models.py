"""The backend's regression benchmark: models whose only difference under
``backend="opreg"`` is its rewrites, timed against eager and Inductor in one run.

    python bench/backend_models.py [--device cuda] [--rounds 9] [--profile] [--json out.json]

Models (issue 11; on CUDA at the issue's sizes, bf16; on the CPU tiny, float32):

* ``cat8-linear``: ``Linear(cat([x[i] for i in range(8)], -1))``, x (8, T, D);
  frozen parameters and trainable ones (forward; and forward + backward);
* ``ln-cat8-linear``: LayerNorm before the cat (frozen, trainable, and forward + backward);
* ``ln-cat8-linear-gelu``: and a GELU after the linear (trainable; forward + backward).
  A trainable model's forward alone (grad enabled, no backward) is a row of its own: the
  backend times a graph whose outputs carry gradients as forward + backward
  (:mod:`opreg.compile.choose`), so there it picks for the training step;
* the two reference models (``opreg.models``): cat_linear, and the MoE loop through
  ``opreg.optimize``;
* ``moe index_add``: a top-2-of-8 MoE head combining with ``zeros.index_add_`` (T 4096,
  D 1024), forward and forward + backward.

Per model: median ms of back-to-back calls (bench/_timing.py: CUDA events around a batch,
rounds interleaved so drift hits every variant alike); the ratio opreg / min(eager, Inductor);
``dynamo``: the model under ``torch.compile(backend="eager")`` (Dynamo's own per-call cost,
which every backend pays); what the opreg backend chose per graph (its compile-time timing);
with ``--profile`` the top device kernels of the opreg and Inductor variants.
Every variant's output is checked against eager first.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing as tm  # noqa: E402

import opreg  # noqa: E402
from opreg.models import cat_linear as cat_model  # noqa: E402
from opreg.models import moe_combine_loop as moe_model  # noqa: E402


class CatLinear(nn.Module):
    def __init__(self, r: int, d: int, k: int, norm: bool, act: bool) -> None:
        super().__init__()
        self.r = r
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.proj = nn.Linear(r * d, k)
        self.act = nn.GELU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.act(self.proj(torch.cat([x[i] for i in range(self.r)], -1)))


class MoECombine(nn.Module):
    """A top-k MoE head whose combine is spelled ``zeros.index_add_`` (the scatter_combine
    pattern's input): router, top-k gates, an MLP on each routed copy of a token (one
    shared "expert": the shapes of the combine are an MoE's, without data-dependent sizes),
    then the weighted sum back per token. x (T, D) -> (T, D)."""

    def __init__(self, d: int, e: int, k: int, f: int) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, e, bias=False)
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates, _ = self.router(x).softmax(-1).topk(self.k, -1)
        tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.k)
        h = self.down(torch.nn.functional.silu(self.up(x[tok])))
        return torch.zeros_like(x).index_add_(0, tok, h * gates.reshape(-1, 1).to(h.dtype))


def _sizes(device: str) -> dict[str, int]:
    return dict(r=8, t=4096, d=512, k=2048) if device == "cuda" else dict(r=4, t=16, d=8, k=12)


def models(device: str) -> dict[str, tuple[Callable[[], nn.Module], list[Any], bool]]:
    """name -> (factory, inputs, backward?)."""
    s = _sizes(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(s["r"], s["t"], s["d"], device=device, dtype=dtype)

    def cat(norm: bool, act: bool, frozen: bool) -> Callable[[], nn.Module]:
        def make() -> nn.Module:
            torch.manual_seed(0)
            m = CatLinear(s["r"], s["d"], s["k"], norm, act).to(device, dtype)
            return m.requires_grad_(not frozen)
        return make

    out: dict[str, tuple[Callable[[], nn.Module], list[Any], bool]] = {
        "cat8-linear frozen": (cat(False, False, True), [x], False),
        "cat8-linear trainable": (cat(False, False, False), [x], False),
        "cat8-linear fwd+bwd": (cat(False, False, False), [x], True),
        "ln-cat8-linear frozen": (cat(True, False, True), [x], False),
        "ln-cat8-linear": (cat(True, False, False), [x], False),
        "ln-cat8-linear fwd+bwd": (cat(True, False, False), [x], True),
        "ln-cat8-linear-gelu": (cat(True, True, False), [x], False),
        "ln-cat8-linear-gelu fwd+bwd": (cat(True, True, False), [x], True),
    }

    def ref_cat() -> nn.Module:
        torch.manual_seed(0)
        return cat_model.Model().to(device)

    out["reference cat_linear"] = (ref_cat, list(cat_model.get_inputs(device=device)), False)

    # the MoE (index_add_ spelling) at T 4096, d 1024, top-2 of 8, bf16
    t, d = (4096, 1024) if device == "cuda" else (16, 8)
    xm = torch.randn(t, d, device=device, dtype=dtype)

    def moe() -> nn.Module:
        torch.manual_seed(0)
        return MoECombine(d, 8, 2, d).to(device, dtype)

    out["moe index_add"] = (moe, [xm], False)
    out["moe index_add fwd+bwd"] = (moe, [xm], True)
    return out


def variants(make: Callable[[], nn.Module], inputs: list[Any], backward: bool,
             choose: str = "auto") -> dict[str, Callable[[], Any]]:
    def step(fn: Callable[..., Any]) -> Callable[[], Any]:
        if not backward:
            return lambda: fn(*inputs)

        def fwd_bwd() -> Any:
            y = fn(*inputs)
            y.float().sum().backward()
            return y
        return fwd_bwd

    torch._dynamo.reset()
    # "dynamo": torch.compile with Dynamo's own "eager" backend (the captured graph run as
    # is): what any backend pays per call before its graph runs (guards, the frame)
    return {"eager": step(make()), "inductor": step(torch.compile(make())),
            "opreg": step(torch.compile(make(), backend="opreg", options={"choose": choose})),
            "dynamo": step(torch.compile(make(), backend="eager"))}


def time_rounds(fns: dict[str, Callable[[], Any]], device: str, rounds: int,
                target_us: float = 2000.0) -> dict[str, float]:
    """Median ms per call of each fn, timed by the project's timer (bench/_timing.py:
    interleaved rounds, CUDA events, a batch of about ``target_us`` per variant)."""
    for f in fns.values():  # warm up: compile, autotune, allocator
        for _ in range(3):
            f()
    variants = {k: tm.Variant(lambda i, f=f: f()) for k, f in fns.items()}
    times = tm.interleaved(variants, device, rounds=rounds, target_us=target_us)
    return {k: tm.median(v) / 1e3 for k, v in times.items()}


def check(fns: dict[str, Callable[[], Any]]) -> None:
    ref = fns["eager"]().detach()
    for name, f in fns.items():
        got = f().detach()
        tol = 2e-2 if ref.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol, msg=name)


def profile(fn: Callable[[], Any], device: str, top: int = 8) -> str:
    """The top ``top`` ops of 5 calls by device time (on CUDA), then by host self time:
    where two variants running the same kernels differ, the second table says why."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    avg = prof.key_averages()
    keys = (["device_time_total"] if device == "cuda" else []) + ["self_cpu_time_total"]
    return "\n".join(avg.table(sort_by=k, row_limit=top) for k in keys)


def moe_row(device: str, rounds: int) -> dict[str, float]:
    """The MoE loop reference model: eager loop vs opreg.optimize (Inductor skips the frame)."""
    torch.manual_seed(0)
    model = moe_model.Model().to(device)
    inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in moe_model.get_inputs()]
    fast = opreg.optimize(moe_model.Model().to(device))
    return time_rounds({"eager": lambda: model(*inputs), "opreg": lambda: fast(*inputs)}, device,
                       max(3, rounds // 3), target_us=1.0)  # the eager loop is slow: one call a batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-variants", default="opreg,inductor",
                   help="which variants --profile profiles (of eager, inductor, opreg, dynamo)")
    p.add_argument("--only", help="comma-separated model names (default: every model)")
    p.add_argument("--moe", action="store_true", help="also the MoE loop model (slow eager loop)")
    p.add_argument("--choose", default="auto", choices=("auto", "time", "rules"),
                   help="the opreg backend's options['choose'] (auto: timed on CUDA, rules on the CPU)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows: dict[str, dict[str, float]] = {}
    print(f"{'model':<28} {'eager':>9} {'inductor':>9} {'opreg':>9}  opreg/min  {'dynamo':>9}  dynamo/eager",
          flush=True)
    chosen = models(a.device)
    if a.only:
        names = [n.strip() for n in a.only.split(",")]
        unknown = [n for n in names if n not in chosen]
        if unknown:
            p.error(f"--only: no model named {unknown}; the models: {list(chosen)}")
        chosen = {n: chosen[n] for n in names}
    for name, (make, inputs, backward) in chosen.items():
        fns = variants(make, inputs, backward, a.choose)
        check(fns)
        t = time_rounds(fns, a.device, a.rounds)
        t["ratio"] = t["opreg"] / min(t["eager"], t["inductor"])
        rows[name] = t
        print(f"{name:<28} {t['eager']:9.4f} {t['inductor']:9.4f} {t['opreg']:9.4f}  {t['ratio']:.3f}"
              f"      {t['dynamo']:9.4f}  {t['dynamo'] / t['eager']:.3f}", flush=True)
        if a.profile:
            for v in a.profile_variants.split(","):
                print(f"--- {name}: {v}\n{profile(fns[v], a.device)}", flush=True)
    if a.moe:
        rows["reference moe loop"] = moe_row(a.device, a.rounds)
        print("reference moe loop", rows["reference moe loop"], flush=True)
    from opreg.compile import choose  # what the backend chose per graph, timed at compile time

    for c in choose.log:
        print(f"backend chose: {c}", flush=True)
    worst = max(rows.values(), key=lambda r: r.get("ratio", 0)).get("ratio", 0)
    print(f"worst opreg / min(eager, inductor): {worst:.3f} (goal <= 1.03)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "torch": torch.__version__, "rows": rows,
                       "choices": [dataclasses.asdict(c) for c in choose.log]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
