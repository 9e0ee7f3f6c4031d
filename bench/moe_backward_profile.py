"""The fused MoE backward on one GPU: where its time goes, and which block configs help.

    python bench/moe_backward_profile.py [--tokens 4096] [--configs mixtral qwen3_moe]

Per config (bf16, uniform routing, transformers' layout): forward+backward of the grouped
path (torch autograd over ``torch._grouped_mm``) and of the fused kernels
(``FusedExperts``), each timed alone (CUDA events, median); the fused forward+backward with
its weight gradients on each path (``torch._grouped_mm``, the sm90 bf16 default, and
Triton's ``_moe_wgrad``: ``configs["wgrad"]["GROUPED_MM"]``); the fused backward's kernels
by device time (torch.profiler, default path); then each backward GEMM's candidate configs (``--gemms``),
one at a time with the others at their defaults (the time of the whole forward+backward;
the wgrad candidates are Triton's, so they run with GROUPED_MM 0).
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import opreg  # noqa: F401
from opreg.backends.triton import moe_experts as fused
from opreg.backends.triton import moe_experts_backward as B
from opreg.backends.triton import tune
from opreg.ops import moe_experts_grouped as G
from opreg.testing.timing import median_us

SHAPES = tune.SHAPES
# the gate's backward pass (GEMM2's split dgrad): (rows, columns, warps, column groups) per
# program (GATE_R, GATE_N, GATE_WARPS, GATE_GROUPS); (8, 256, 4, 1) is the default
GATE_TILES = [(32, 64, 4, 1), (16, 128, 4, 1), (32, 128, 8, 1), (8, 256, 4, 1), (16, 256, 8, 1), (64, 64, 8, 1),
              (4, 512, 4, 1), (8, 256, 4, 4), (8, 256, 4, 16), (16, 256, 8, 8), (8, 512, 4, 8)]
CANDIDATES = {
    "wgrad": [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, GROUPED_MM=0)
              for m, n, k, w, s in [(128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4),
                                    (128, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 64, 64, 4, 4)]],
    # the tuner's (python -m opreg tune moe_experts --backward): SPLIT 0 the fused kernel,
    # 1 the forward's GEMM into a buffer of g, then the gate's backward as its own pass
    "dgrad2": [tune._dgrad(c) for c in tune.DGRAD2],
    "dgrad1": [{**tune._dgrad(c), "GROUPED_MM": 0} for c in tune.DGRAD1],  # Triton's, off grouped_mm
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096")
    p.add_argument("--configs", nargs="*", default=["mixtral", "qwen3_moe"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-tune", action="store_true")
    p.add_argument("--gemms", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES),
                   help="whose candidate configs to time (default: all)")
    a = p.parse_args()
    for name in a.configs:
        e, h, i, k = SHAPES[name]
        for t in (int(v) for v in a.tokens.split(",")):
            args = list(tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda"))
            for j in (0, 2, 3, 5):
                args[j] = args[j].detach().requires_grad_()
            leaves = [args[j] for j in (0, 2, 3, 5)]
            cot = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)

            def step(fn, **kw):
                def run() -> None:
                    torch.autograd.grad(fn(*args, **kw), leaves, cot)
                return run

            fwd_only = median_us(lambda: fused.fused_experts_forward(*[x.detach() if isinstance(x, torch.Tensor)
                                                                        else x for x in args]), a.reps, True)
            grouped = median_us(step(G.grouped), a.reps, True)
            base = median_us(step(lambda *x: B.FusedExperts.apply(*x)), a.reps, True)
            print(f"\n{name} T={t}: grouped fwd+bwd {grouped:.0f} us; fused fwd {fwd_only:.0f} us, "
                  f"fused fwd+bwd {base:.0f} us", flush=True)
            n1 = args[3].shape[2] if args[9] else args[3].shape[1]  # gate_up's width; I = n1 // 2 (gated)
            why = B.grouped_mm_unfit(args[0], n1, n1 // 2)
            default = "torch._grouped_mm" if B.grouped_mm_wgrad_default(args[0], n1, n1 // 2) else "Triton"
            for g, path in ((1, "torch._grouped_mm"), (0, "Triton _moe_wgrad")):
                if g and why is not None:
                    print(f"  weight gradients on {path}: not run ({why})", flush=True)
                    continue
                us = median_us(step(lambda *x, g=g: B.FusedExperts.apply(*x, {"wgrad": {"GROUPED_MM": g}})),
                               a.reps, True)
                print(f"  weight gradients on {path}: fused fwd+bwd {us:.0f} us (default: {default})", flush=True)
            d1 = "torch._grouped_mm" if B.grouped_mm_dgrad1_default(args[0], args[3], n1, n1 // 2) else "Triton"
            for g, path in ((1, "torch._grouped_mm"), (0, "Triton")):
                if g and why is not None:
                    continue
                # torch._grouped_mm has no persistent mode: a table's PERSISTENT dgrad1 is off there
                c1 = {"GROUPED_MM": g, **({"PERSISTENT": 0} if g else {})}
                us = median_us(step(lambda *x, c1=c1: B.FusedExperts.apply(*x, {"dgrad1": c1})), a.reps, True)
                print(f"  GEMM1's dgrad on {path}: fused fwd+bwd {us:.0f} us (default: {d1})", flush=True)
            # the gate's backward pass (split) alone, per tile shape: its device time under the
            # profiler (a kernel of ~100-200 us at T = 4096, below the step's run-to-run spread)
            base2 = B.backward_configs(t * k / e, torch.bfloat16, fused.pick_config("gemm1", t * k / e, n1, h,
                                       torch.bfloat16)["BLOCK_M"], n1, h, n1 // 2, {})["dgrad2"]
            for gr, gn, gw, gg in GATE_TILES:
                c2 = {"dgrad2": {**base2, "SPLIT": 1, "GATE_R": gr, "GATE_N": gn, "GATE_WARPS": gw,
                                 "GATE_GROUPS": gg}}
                run = step(lambda *x, c2=c2: B.FusedExperts.apply(*x, c2))
                run()
                times = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        run()
                        torch.cuda.synchronize()
                    times.append(sum(ev.self_device_time_total for ev in prof.key_averages()
                                     if ev.key == "_gate_grad_kernel"))
                print(f"  gate pass {gr} rows x {gn} cols, {gw} warps, {gg} column groups: {sorted(times)[1]:.1f} us "
                      f"(of 3 profiled steps, the median)", flush=True)
            # GEMM2's dgrad as one kernel (the gate's backward in its epilogue, 64-wide tiles)
            # beside the table's default (split where many rows per expert)
            split = base2.get("SPLIT", 0)
            fused_cfg = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, "SPLIT": 0}
            us = median_us(step(lambda *x: B.FusedExperts.apply(*x, {"dgrad2": fused_cfg})), a.reps, True)
            print(f"  GEMM2's dgrad fused (one kernel, 64-wide tiles): fused fwd+bwd {us:.0f} us "
                  f"(default: {'split' if split else 'fused'})", flush=True)
            step(lambda *x: B.FusedExperts.apply(*x))()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(lambda *x: B.FusedExperts.apply(*x))()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=40))
            if a.no_tune:
                continue
            for gemm in a.gemms:
                for c in CANDIDATES[gemm]:
                    try:
                        us = median_us(step(lambda *x, c=c, g=gemm: B.FusedExperts.apply(*x, {g: c})), a.reps, True)
                    except Exception as ex:  # noqa: BLE001 - out of resources: report and go on
                        print(f"  {gemm} {c}: {type(ex).__name__}", flush=True)
                        continue
                    print(f"  {gemm} {c}: fwd+bwd {us:.0f} us ({base / us:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
