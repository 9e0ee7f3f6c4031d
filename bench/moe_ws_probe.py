"""Probe: Triton's automatic warp specialization (``WS`` config key) on the fused forward's
descriptor-only GEMMs (GEMM2; GEMM1 with PREGATHER), against the same configs without it.

    python bench/moe_ws_probe.py CONFIG [--tokens 4096] [--reps 30]

One config per process: a compile that aborts takes only its own process with it. Prints
the whole fused forward's time per variant and whether its output is bit-identical to
the default's (same tiles, same K order: it should be).
"""
from __future__ import annotations

import argparse

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.testing.timing import median_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", choices=list(tune.SHAPES))
    p.add_argument("--tokens", default="4096")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    e, h, i, k = tune.SHAPES[a.config]
    for t in (int(v) for v in a.tokens.split(",")):
        args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
        s = t * k
        d1 = F.pick_config("gemm1", s / e, 2 * i, h, torch.bfloat16)
        d2 = F.pick_config("gemm2", s / e, h, i, torch.bfloat16, block_m=d1["BLOCK_M"])
        flops = 2 * s * h * 3 * i
        variants = {
            "default": {},
            "gemm1 pregathered": {"gemm1": {**d1, "PREGATHER": 1}},
            "gemm2 WS": {"gemm2": {**d2, "WS": 1}},
            "gemm1 pregathered WS": {"gemm1": {**d1, "PREGATHER": 1, "WS": 1}},
            "both WS": {"gemm1": {**d1, "PREGATHER": 1, "WS": 1}, "gemm2": {**d2, "WS": 1}},
            "gemm2 WS, 4 warps": {"gemm2": {**d2, "WS": 1, "num_warps": 4}},
        }
        print(f"\n{a.config} T={t}: gemm1 {d1}, gemm2 {d2}", flush=True)
        ref = F.fused_experts_forward(*args)
        for name, cfg in variants.items():
            print(f"  {name}: ", end="", flush=True)
            try:
                out = F.fused_experts_forward(*args, configs=cfg)
                us = median_us(lambda: F.fused_experts_forward(*args, configs=cfg), a.reps, True)
            except Exception as ex:  # a compile error: say which, go on
                print(f"failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                continue
            same = torch.equal(out, ref)
            print(f"{us:8.1f} us {flops / us / 1e6:5.0f} TF/s, bit-identical to default's: {same}, "
                  f"max |diff| {float((out.float() - ref.float()).abs().max()):.3g}", flush=True)


if __name__ == "__main__":
    main()
