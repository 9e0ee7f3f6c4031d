"""The experts' weight gradients: ``torch._grouped_mm`` (CUTLASS, what the fused backward and HF's
``grouped_mm`` run) against the persistent TMA kernel of ``backends/triton/moe_wgrad.py``.

    python bench/moe_wgrad.py [--configs mixtral qwen3_moe olmoe] [--tokens 4096,16384] [--op]

Per config and T (bf16, uniform random routing, each expert's rows padded to 128 as the fused
forward pads them, padding rows 0): the gradient of gate_up_proj (d_pre^T x, (E, 2I, H)) and
of down_proj (dout^T act, (E, H, I)), each by CUTLASS and by each Triton tile, timed in
alternating rounds (CUDA events around back-to-back calls, median of the rounds), with the
Triton result's error against CUTLASS's and, for the first expert, against float64. Rate:
the GEMM FLOPs over the time; floor: max(FLOPs at 790 TF/s, bytes at 4.2 TB/s).

``--op``: then the op's forward + backward (``FusedExperts``, transformers' layout, SiLU-gated,
uniform routing) with the weight gradients on CUTLASS and on the TMA kernel (default tile),
alternating rounds, and the two results' gradients compared.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

from opreg.backends.triton import moe_experts_backward as B
from opreg.backends.triton import moe_wgrad as W
from opreg.backends.triton import tune

SHAPES = {"mixtral": (8, 2048, 4096, 2), "qwen3_moe": (128, 2048, 768, 8), "olmoe": (64, 2048, 1024, 8)}
# BLOCK_M, BLOCK_N (the output tile), BLOCK_K (rows a step), num_warps, num_stages
TILES = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3),
         (128, 256, 64, 8, 2), (128, 128, 128, 8, 3)]
PEAK, BW = 790e12, 4.2e12


def rows(e: int, t: int, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ends (E,) int32 padded end rows, a (S,) bool mask of real rows, S)."""
    counts = torch.bincount(torch.stack([torch.randperm(e)[:k] for _ in range(t)]).flatten(), minlength=e)
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    s = int(ends[-1])
    real = torch.zeros(s, dtype=torch.bool)
    start = 0
    for c, end in zip(counts.tolist(), ends.tolist()):
        real[start:start + c] = True
        start = end
    return ends.to(torch.int32).cuda(), real.cuda(), s


def operand(s: int, n: int, real: torch.Tensor) -> torch.Tensor:
    x = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
    return x * real[:, None]


def alternating(calls: dict[str, Callable[[], Any]], rounds: int = 7, batch: int = 5) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    for c in calls.values():
        c()
    torch.cuda.synchronize()
    for r in range(rounds):
        names = list(calls)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(batch):
                calls[name]()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3 / batch)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(SHAPES))
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--op", action="store_true", help="also the op's forward + backward, CUTLASS vs TMA weight grads")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernels-alone table")
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {W.triton.__version__}; µs, "
          f"median of {a.rounds} alternating rounds")
    if not a.no_kernels:
        kernels(a)
    if a.op:
        op(a)


def op(a: argparse.Namespace) -> None:
    print("\n| config | T | fwd+bwd, weight grads on CUTLASS | on the TMA kernel | ratio | max grad diff / scale |")
    print("|---|---|---|---|---|---|")
    for name in a.configs:
        e, h, i, k = SHAPES[name]
        for t in (int(v) for v in a.tokens.split(",")):
            args = list(tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda"))
            for j in (0, 2, 3, 5):
                args[j] = args[j].detach().requires_grad_()
            leaves = [args[j] for j in (0, 2, 3, 5)]
            cot = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            cfgs = {"cutlass": {"wgrad": {"GROUPED_MM": 1, "TMA": 0}}, "tma": {"wgrad": {"GROUPED_MM": 1, "TMA": 1}}}
            grads = {n: torch.autograd.grad(B.FusedExperts.apply(*args, c), leaves, cot) for n, c in cfgs.items()}
            diff = max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
                       for x, y in zip(grads["tma"], grads["cutlass"]))
            again = torch.autograd.grad(B.FusedExperts.apply(*args, cfgs["tma"]), leaves, cot)
            same = all(torch.equal(x, y) for x, y in zip(again, grads["tma"]))
            calls = {n: (lambda c=c: torch.autograd.grad(B.FusedExperts.apply(*args, c), leaves, cot))
                     for n, c in cfgs.items()}
            got = alternating(calls, a.rounds, batch=3)
            print(f"| {name} | {t} | {got['cutlass']:.0f} | {got['tma']:.0f} | {got['cutlass'] / got['tma']:.3f}x | "
                  f"{diff:.1e}{'' if same else ' (TMA: two runs differ!)'} |", flush=True)


def kernels(a: argparse.Namespace) -> None:
    print("| config | T | gradient | CUTLASS | " + " | ".join(f"{t[0]}x{t[1]}x{t[2]} w{t[3]} s{t[4]}" for t in TILES)
          + " | floor |")
    print("|---" * (5 + len(TILES)) + "|")
    for name in a.configs:
        e, h, i, k = SHAPES[name]
        for t in (int(v) for v in a.tokens.split(",")):
            ends, real, s = rows(e, t, k)
            for grad, (pa, qb) in (("gate_up", (2 * i, h)), ("down", (h, i))):
                pm, qm = operand(s, pa, real), operand(s, qb, real)
                flops = 2.0 * int(real.sum()) * pa * qb
                nbytes = (s * (pa + qb) + e * pa * qb) * 2
                floor = max(flops / PEAK, nbytes / BW) * 1e6
                want = torch._grouped_mm(pm.t(), qm, offs=ends)
                calls: dict[str, Callable[[], Any]] = {"cutlass": lambda: torch._grouped_mm(pm.t(), qm, offs=ends)}
                notes = []
                for tile in TILES:
                    cfg = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), tile))
                    label = "x".join(map(str, tile))
                    why = W.unfit(128, (pa,), pm.dtype, cfg)
                    if why is not None:
                        notes.append(f"{label}: {why}")
                        continue
                    try:
                        out = W.wgrad(pm, qm, ends, e, cfg)
                    except Exception as ex:  # e.g. out of shared memory
                        notes.append(f"{label}: {type(ex).__name__} {str(ex)[:80]}")
                        continue
                    err = float((out.float() - want.float()).norm() / want.float().norm())
                    e0 = int(ends[0])
                    ref0 = pm[:e0].double().t() @ qm[:e0].double()
                    err64 = float((out[0].double() - ref0).norm() / ref0.norm())
                    notes.append(f"{label}: err vs CUTLASS {err:.1e}, expert 0 vs float64 {err64:.1e}, "
                                 f"nan {int(torch.isnan(out).sum())}")
                    calls[label] = (lambda c=cfg: W.wgrad(pm, qm, ends, e, c))
                got = alternating(calls, a.rounds)
                cells = []
                for tile in TILES:
                    label = "x".join(map(str, tile))
                    cells.append(f"{got[label]:.0f} ({got['cutlass'] / got[label]:.2f}x)" if label in got else "-")
                print(f"| {name} | {t} | {grad} | {got['cutlass']:.0f} ({flops / got['cutlass'] / 1e6:.0f} TF/s) | "
                      + " | ".join(cells) + f" | {floor:.0f} |", flush=True)
                for n in notes:
                    print(f"    {n}")


if __name__ == "__main__":
    main()
