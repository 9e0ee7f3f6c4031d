"""The MoE decode kernels' own time (CUDA): one token, replayed from a CUDA graph.

    python bench/moe_decode.py [--configs mixtral qwen3_moe olmoe] [--tokens 1,2,4]

Why: an eager call at T = 1 is all host on the H200 box (~76 µs a call for all three configs,
twenty-second session), so back-to-back events time the host and say nothing of the kernels.
Replayed from a graph, a call costs its kernels. Per config and T, bf16, µs per call:

* ``decode``: the decode kernels (two launches; T = 1 only, where the forward takes them);
* ``GEMM path``: the routing, the two routed GEMMs and the combine (four launches), the path
  the decode kernels replace;
* ``grouped``: the op's grouped path (``torch._grouped_mm``, as transformers' ``grouped_mm``
  experts), where it can be captured;
* the bytes floor: the chosen experts' weights (each read once) at 4.8 TB/s, the H200's HBM rate.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.testing.timing import graph_us

HBM_BYTES_PER_S = 4.8e12


def gemm_path(args: tuple[Any, ...]) -> torch.Tensor:
    """The fused forward with the decode kernels turned off (the GEMM path at any T)."""
    real = F.decodes
    F.decodes = lambda *a: False
    try:
        return F.fused_experts_forward(*args)
    finally:
        F.decodes = real


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(tune.SHAPES))
    p.add_argument("--tokens", default="1")
    p.add_argument("--reps", type=int, default=20)
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
            for label, fn in (("decode", lambda: F.fused_experts_forward(*args)),
                              ("GEMM path", lambda: gemm_path(args)),
                              ("grouped", lambda: F.M.grouped(*args))):
                if label == "decode" and not F.decodes(t, False, None):
                    rows[label] = "-"
                    continue
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
            print(f"| {name} | {t} | {rows['decode']} | {rows['GEMM path']} | {rows['grouped']} | "
                  f"{floor:.1f} ({weight_bytes / 1e6:.0f} MB) |", flush=True)


if __name__ == "__main__":
    main()
