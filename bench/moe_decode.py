"""The MoE decode kernels' own time (CUDA): a few tokens, replayed from a CUDA graph.

    python bench/moe_decode.py [--configs mixtral qwen3_moe olmoe] [--tokens 1,2,4,8,16]

Why: an eager call at T = 1 is all host on the H200 box (~76 µs a call for all three configs,
twenty-second session), so back-to-back events time the host and say nothing of the kernels.
Replayed from a graph, a call costs its kernels. Per config and T, bf16, µs per call:

* ``decode``: the decode kernels (two launches), pinned at every T (``configs={"decode": the
  table's}``); a ``*`` marks the T where the forward takes them by default
  (``moe_experts.decodes``: 1 <= T <= ``DECODE_MAX_TOKENS``);
* ``GEMM path``: the routing, the two routed GEMMs and the combine (four launches), the path
  the decode kernels replace;
* ``grouped``: the op's grouped path (``torch._grouped_mm``, as transformers' ``grouped_mm``
  experts), where it can be captured;
* the bytes floor: the chosen experts' weights (each read once) at 4.8 TB/s, the H200's HBM rate.

``--block``: also the whole eager transformers block (``experts_implementation="opreg"``, no
grad) at each T with the forward's decode bound (``moe_experts.DECODE_MAX_TOKENS``) at 1 and
at T, each in every one of ``--rounds`` interleaved rounds (median, µs per call back to back:
what a serving loop's eager step costs, host included).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.testing.timing import graph_us

import _timing as tm

HBM_BYTES_PER_S = 4.8e12


def gemm_path(args: tuple[Any, ...]) -> torch.Tensor:
    """The fused forward with the decode kernels turned off (the GEMM path at any T)."""
    real = F.decodes
    F.decodes = lambda *a: False
    try:
        return F.fused_experts_forward(*args)
    finally:
        F.decodes = real


def block_rows(configs: list[str], tokens: list[int], rounds: int) -> None:
    """The eager block with the decode bound at 1 and at T, interleaved (see the docstring)."""
    import opreg.integrations.transformers  # noqa: F401  (registers "opreg")

    import bench_moe_block as bm

    print("| config | T | block, decode bound 1 | block, decode bound T | ratio |")
    print("|---|---|---|---|---|")
    saved = F.DECODE_MAX_TOKENS
    for name in configs:
        block = bm.make_block(name, torch.bfloat16, "cuda", False)
        block.experts.config._experts_implementation = "opreg"
        for t in tokens:
            x = torch.randn(1, t, bm.CONFIGS[name][2], dtype=torch.bfloat16, device="cuda")

            def call(_: int) -> None:
                with torch.no_grad():
                    block(x)

            def bound(n: int) -> tm.Variant:
                def before() -> None:
                    F.DECODE_MAX_TOKENS = n

                return tm.Variant(call, before=before, after=lambda: setattr(F, "DECODE_MAX_TOKENS", saved))

            got = tm.interleaved({"1": bound(1), "T": bound(t)}, "cuda", rounds=rounds)
            one, at_t = tm.median(got["1"]), tm.median(got["T"])
            print(f"| {name} | {t} | {one:.0f} | {at_t:.0f} | {one / at_t:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(tune.SHAPES))
    p.add_argument("--tokens", default="1")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block", action="store_true", help="also the eager block with the decode bound at 1 and at T")
    p.add_argument("--rounds", type=int, default=7, help="--block's interleaved rounds")
    a = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, µs per call from a CUDA graph "
          f"(median of {a.reps} replays of 20 calls)")
    print("| config | T | decode | GEMM path | grouped | weight bytes floor |")
    print("|---|---|---|---|---|---|")
    for name in a.configs:
        e, h, i, k = tune.SHAPES[name]
        for t in (int(v) for v in a.tokens.split(",")):
            args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
            want = F.M.grouped(*args).double()
            rows = {}
            pinned = {"decode": F.pick_config("decode", 0.0, 2 * i, h, torch.bfloat16)}
            for label, fn in (("decode", lambda: F.fused_experts_forward(*args, configs=pinned)),
                              ("GEMM path", lambda: gemm_path(args)),
                              ("grouped", lambda: F.M.grouped(*args))):
                err = float((fn().double() - want).norm() / want.norm())
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
            print(f"| {name} | {t} | {rows['decode']}{default} | {rows['GEMM path']} | {rows['grouped']} | "
                  f"{floor:.1f} ({weight_bytes / 1e6:.0f} MB) |", flush=True)
    if a.block:
        block_rows(a.configs, [int(v) for v in a.tokens.split(",")], a.rounds)


if __name__ == "__main__":
    main()
