"""What the fused MoE training path's saved pre-activation costs in accuracy at bf16 (CPU).

    python bench/pre_dtype_numerics.py [--seeds 20] [--tokens 1,64,1024]

The fused forward saves GEMM1's pre-activation ``pre`` in float32 and GEMM2's split dgrad
keeps ``g`` = dout @ down in float32 (``moe_experts.PRE_DTYPE``). Halving them would save
~60-110 µs of the ~2.3 ms Mixtral training step on the H200 (bench/RESULTS.md, thirtieth
session), at a cost in accuracy this script measures without the kernels: one expert, k = 1,
bf16 inputs, each variant's rounding points emulated in float64 arithmetic:

* ``fp32 pre`` (shipped): the gate on the fp32 accumulator, ``act`` rounded to bf16; the
  backward's gate derivative at the fp32 ``pre``; ``g`` fp32.
* ``bf16 pre``: ``pre`` rounded to bf16 *before* the gate, in the forward too, so the
  backward differentiates the function the forward computed (HF's order of rounding).
* ``bf16 pre, g``: the same with ``g`` rounded to bf16.
* ``HF bf16``: the reference in bf16 under torch autograd (what a user has without opreg).

Each gradient's error is measured as ``opreg.testing.assert_matches`` measures it (max error
over the max of the float64 reference, and normwise), in units of the bf16 tolerance (1.6e-2;
a test fails above 4 for max, 1 for normwise). ``d top_k_weights`` is a dot over the
intermediate size that can cancel, which is where a rounded ``pre`` shows first; its last
column measures it against the magnitude of its terms (sum over I of |g| |gate(pre)|, from
float64), as ``assert_matches(..., scale=)`` would: rounding error grows with the terms.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

TOL = 1.6e-2  # opreg.testing's bfloat16 tolerance
BF = torch.bfloat16


def r16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, back in float64."""
    return t.to(BF).double()


def r32(t: torch.Tensor) -> torch.Tensor:
    return t.float().double()


def gate(pre: torch.Tensor, act: str) -> torch.Tensor:
    g, u = pre.chunk(2, -1)
    return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u


def gate_vjp(pre: torch.Tensor, dy: torch.Tensor, act: str) -> torch.Tensor:
    p = pre.detach().requires_grad_()
    return torch.autograd.grad(gate(p, act), p, dy)[0]


def reference(x, w1, w2, rw, dout, act: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output and gradients (x, w1, w2, rw) of rw * gate(x w1^T) w2^T under autograd in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (x, w1, w2, rw)]
    xx, a, b, w = leaves
    out = (gate(xx @ a.T, act) @ b.T) * w[:, None]
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype))]


def emulated(x, w1, w2, rw, dout, act: str, pre16: bool, g16: bool) -> list[torch.Tensor]:
    """The fused kernels' rounding points (float64 arithmetic in between, fp32 accumulators
    as float64 rounded to fp32)."""
    pre = r32(x @ w1.T)
    if pre16:
        pre = r16(pre)
    a = r16(gate(pre, act))  # GEMM1's stored activation
    y = r32(a @ w2.T)  # GEMM2's fp32 tile, unweighted
    out = r16(y * rw[:, None])
    g = r32(dout @ w2)  # split dgrad2: dout @ down, fp32, before the routing weight
    if g16:
        g = r16(g)
    d_pre = r16(gate_vjp(pre, g * rw[:, None], act))
    d_rw = r32((g * gate(pre, act)).sum(-1))  # the gate pass's partial sums
    dx = r16(d_pre @ w1)
    dw1 = r16(d_pre.T @ x)
    dw2 = r16((r16(dout * rw[:, None])).T @ a)
    return [out, dx, dw1, dw2, d_rw]


def errors(got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[float, float]:
    """As opreg.testing.assert_matches, in units of TOL; ``scale``: the terms' magnitude."""
    got, ref = got.detach(), ref.detach()
    m = ref.abs() if scale is None else scale.detach().abs().maximum(ref.abs())
    d = (got - ref).abs()
    return float(d.max() / m.max()) / TOL, float(d.norm() / m.norm()) / TOL


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--tokens", default="1,64,1024")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    a = p.parse_args()
    names = ["out", "d x", "d gate_up", "d down", "d top_k_weights", "the same vs its terms"]
    variants = {"fp32 pre": (False, False), "bf16 pre": (True, False), "bf16 pre, g": (True, True)}
    print(f"errors in units of the bf16 tolerance {TOL} (max err / normwise err; a test fails above 4 / 1), "
          f"worst over {a.seeds} seeds; H {a.hidden}, I {a.inter}, one expert, k 1")
    print("| gate | T | variant | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for act in ("silu", "gelu_tanh"):
        for t in (int(s) for s in a.tokens.split(",")):
            worst: dict[str, list[list[float]]] = {}
            for seed in range(a.seeds):
                gen = torch.Generator().manual_seed(seed)
                h, i = a.hidden, a.inter
                x = r16(torch.randn(t, h, generator=gen, dtype=torch.float64))
                w1 = r16(torch.randn(2 * i, h, generator=gen, dtype=torch.float64) / math.sqrt(h))
                w2 = r16(torch.randn(h, i, generator=gen, dtype=torch.float64) / math.sqrt(i))
                rw = r32(torch.rand(t, generator=gen, dtype=torch.float64))
                dout = r16(torch.randn(t, h, generator=gen, dtype=torch.float64))
                ref = reference(x, w1, w2, rw, dout, act, torch.float64)
                runs = {v: emulated(x, w1, w2, rw, dout, act, *o) for v, o in variants.items()}
                runs["HF bf16"] = [r.double() for r in reference(x, w1, w2, rw, dout, act, BF)]
                g64 = dout @ w2
                terms = (g64.abs() * gate(x @ w1.T, act).abs()).sum(-1)
                for v, got in runs.items():
                    e = [errors(gg, rr) for gg, rr in zip(got, ref)] + [errors(got[4], ref[4], terms)]
                    w = worst.setdefault(v, [[0.0, 0.0] for _ in names])
                    for j, (mx, nw) in enumerate(e):
                        w[j] = [max(w[j][0], mx), max(w[j][1], nw)]
            for v, w in worst.items():
                print(f"| {act} | {t} | {v} | " + " | ".join(f"{mx:.2f} / {nw:.2f}" for mx, nw in w) + " |")


if __name__ == "__main__":
    main()
