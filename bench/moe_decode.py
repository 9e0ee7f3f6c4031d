"""The MoE decode kernels' own time (CUDA): a few tokens, replayed from a CUDA graph.

    python bench/moe_decode.py [--configs mixtral qwen3_moe olmoe] [--tokens 1,2,4,8,16]

Why: an eager call at T = 1 is all host on the H200 box (~76 µs a call for all three configs,
twenty-second session), so back-to-back events time the host and say nothing of the kernels.
Replayed from a graph, a call costs its kernels. Per config and T, bf16, µs per call:

* ``decode``: the per-pair decode kernels (two launches), pinned at every T
  (``configs={"decode": the table's}``); a ``*`` marks the T where the forward takes decode
  kernels by default (``moe_experts.decodes``: 1 <= T <= ``DECODE_MAX_TOKENS``);
* ``g<n>``: the decode kernels grouped by expert (``GROUPED``: each weight tile read once per
  call, then the combine; three launches), pinned with each of ``GROUPED_CANDIDATES``
  (``--block-m 16,32``: each of them with each number of pairs per step);
  ``--kernels``: each kernel's time in the fastest of them;
* ``GEMM path``: the routing, the two routed GEMMs and the combine (four launches), the path
  the decode kernels replace;
* ``grouped``: the op's grouped path (``torch._grouped_mm``, as transformers' ``grouped_mm``
  experts), where it can be captured;
* the bytes floor: the chosen experts' weights (each read once) at 4.8 TB/s, the H200's HBM rate.

``--block``: also the whole eager transformers block (``experts_implementation="opreg"``, no
grad) at each T with the forward's decode bound (``moe_experts.DECODE_MAX_TOKENS``) at 1, and
at T with the per-pair decode kernels and with the grouped ones (the config fastest in the
graph rows above), each in every one of ``--rounds`` interleaved rounds (median, µs per call back to back: what
a serving loop's eager step costs, host included).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.ops import moe_experts_grouped as G
from opreg.testing.timing import graph_us

import _timing as tm

HBM_BYTES_PER_S = 4.8e12
# The grouped decode kernels' candidates: what `opreg tune moe_experts --decode` tries.
GROUPED_CANDIDATES = tune.DECODE_GROUPED


def _us(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:  # "failed (...)", "not capturable (...)"
        return float("inf")


def gemm_path(args: tuple[Any, ...]) -> torch.Tensor:
    """The fused forward with the decode kernels turned off (the GEMM path at any T)."""
    real = F.decodes
    F.decodes = lambda *a: False
    try:
        return F.fused_experts_forward(*args)
    finally:
        F.decodes = real


def kernel_times(fn: Any, calls: int = 20) -> str:
    """Each CUDA kernel's mean device µs per call of ``fn`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
    per_call = max(1, len(kernels) // calls)
    total: dict[str, float] = {}
    for n, ev in enumerate(kernels):  # labelled by place in the call: one kernel may launch twice
        label = f"{n % per_call + 1}:{ev.name[:32]}"
        total[label] = total.get(label, 0.0) + ev.time_range.elapsed_us() / calls
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(total.items()))


def block_rows(configs: list[str], tokens: list[int], rounds: int, best: dict[tuple[str, int], dict[str, int]]
               ) -> None:
    """The eager block with the decode bound at 1 (the GEMM path past one token), and at T
    with the per-pair decode kernels and with the grouped ones (``best``: the config per
    (config, T)), interleaved (see the docstring)."""
    import opreg.integrations.transformers  # noqa: F401  (registers "opreg")

    import bench_moe_block as bm

    print("| config | T | block, decode bound 1 | bound T, per pair | ratio | bound T, grouped | ratio |")
    print("|---|---|---|---|---|---|---|")
    saved, saved_pick, saved_memo = F.DECODE_MAX_TOKENS, F.pick_config, F._DECODE_STATIC
    for name in configs:
        block = bm.make_block(name, torch.bfloat16, "cuda", False)
        block.experts.config._experts_implementation = "opreg"
        for t in tokens:
            x = torch.randn(1, t, bm.CONFIGS[name][2], dtype=torch.bfloat16, device="cuda")

            def call(_: int) -> None:
                with torch.no_grad():
                    block(x)

            def bound(n: int, grouped: dict[str, int] | None = None) -> tm.Variant:
                memo: dict = {}  # this variant's own decode statics (they hold the config)

                def pick(gemm: str, *a: Any, **kw: Any) -> dict[str, int]:
                    if gemm not in ("decode", "decode_grouped"):
                        return saved_pick(gemm, *a, **kw)
                    return dict(grouped) if grouped else saved_pick("decode", *a, **kw)

                def before() -> None:
                    F.DECODE_MAX_TOKENS, F.pick_config, F._DECODE_STATIC = n, pick, memo

                def after() -> None:
                    F.DECODE_MAX_TOKENS, F.pick_config, F._DECODE_STATIC = saved, saved_pick, saved_memo

                return tm.Variant(call, before=before, after=after)

            got = tm.interleaved({"1": bound(1), "T": bound(t), "G": bound(t, best[name, t])}, "cuda",
                                 rounds=rounds)
            one, at_t, grp = (tm.median(got[v]) for v in ("1", "T", "G"))
            print(f"| {name} | {t} | {one:.0f} | {at_t:.0f} | {one / at_t:.2f}x | {grp:.0f} | {one / grp:.2f}x |",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(tune.SHAPES))
    p.add_argument("--tokens", default="1")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block", action="store_true", help="also the eager block with the decode bound at 1 and at T")
    p.add_argument("--rounds", type=int, default=7, help="--block's interleaved rounds")
    p.add_argument("--block-m", default="16",
                   help="the grouped candidates' pairs per step (BLOCK_M), comma-separated: each candidate "
                        "is timed with each (16 is the kernels' default)")
    p.add_argument("--kernels", action="store_true",
                   help="also each kernel's device time (torch.profiler) of the fastest grouped config per row")
    a = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, µs per call from a CUDA graph "
          f"(median of {a.reps} replays of 20 calls)")
    cands = [c if m == 16 else dict(c, BLOCK_M=m) for m in (int(v) for v in a.block_m.split(","))
             for c in GROUPED_CANDIDATES]
    print("grouped candidates:", "; ".join(f"g{n}={c}" for n, c in enumerate(cands)))
    print("| config | T | decode | GEMM path | grouped | " + " | ".join(f"g{n}" for n in range(len(cands)))
          + " | weight bytes floor |")
    print("|---|---|---|---|---|" + "---|" * len(cands) + "---|")
    best: dict[tuple[str, int], dict[str, int]] = {}
    for name in a.configs:
        e, h, i, k = tune.SHAPES[name]
        for t in (int(v) for v in a.tokens.split(",")):
            args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
            want = G.grouped(*args).double()
            rows = {}
            pinned = {"decode": F.pick_config("decode", 0.0, 2 * i, h, torch.bfloat16)}
            runs = [("decode", lambda: F.fused_experts_forward(*args, configs=pinned)),
                    ("GEMM path", lambda: gemm_path(args)),
                    ("grouped", lambda: G.grouped(*args))]
            runs += [(f"g{n}", (lambda c: lambda: F.fused_experts_forward(*args, configs={"decode": c}))(c))
                     for n, c in enumerate(cands)]
            for label, fn in runs:
                try:
                    err = float((fn().double() - want).norm() / want.norm())
                except Exception as exc:  # noqa: BLE001 - a candidate that does not fit this GPU
                    rows[label] = f"failed ({type(exc).__name__})"
                    continue
                assert err < 2e-2, f"{name} T={t} {label}: relative error {err:.1e}"
                try:
                    rows[label] = f"{graph_us(fn, a.reps):.1f}"
                except RuntimeError as exc:  # a path that syncs on the host can't be captured
                    rows[label] = f"not capturable ({str(exc).splitlines()[0][:60]})"
                    torch.cuda.synchronize()
            chosen = int(torch.unique(args[1]).numel())
            weight_bytes = chosen * (args[3][0].numel() + args[5][0].numel()) * args[3].element_size()
            floor = weight_bytes / HBM_BYTES_PER_S * 1e6
            default = "*" if F.decodes(t, False, None) else ""
            g = [rows[f"g{n}"] for n in range(len(cands))]
            best[name, t] = cands[min(range(len(cands)), key=lambda n: _us(g[n]))]
            print(f"| {name} | {t} | {rows['decode']}{default} | {rows['GEMM path']} | {rows['grouped']} | "
                  + " | ".join(g) + f" | {floor:.1f} ({weight_bytes / 1e6:.0f} MB) |", flush=True)
            if a.kernels:
                c = best[name, t]
                print(f"  kernels, {name} T={t}, grouped {c}: " + kernel_times(
                    lambda: F.fused_experts_forward(*args, configs={"decode": c})), flush=True)
    if a.block:
        block_rows(a.configs, [int(v) for v in a.tokens.split(",")], a.rounds, best)


if __name__ == "__main__":
    main()
