"""Each GEMM of the fused MoE training step against CUTLASS's on the same shape (CUDA).

    python bench/moe_launches.py [--tokens 4096] [--configs mixtral qwen3_moe olmoe]

Per config (bf16, uniform routing, transformers' layout), in one process:

* the fused op's forward+backward with GEMM2's split dgrad on ``torch._grouped_mm`` and on
  Triton by default (``DGRAD2_GROUPED_MIN_ROWS`` moved), in turn over several rounds (CUDA
  events; the default path, host work memoised);
* the fused op's forward+backward, profiled once (torch.profiler): every kernel in launch
  order with its device time, so each GEMM's time is its own (the profiler's table sums a
  kernel name's launches);
* with ``--block-m``, the same profile with the forward's tiles of other block sizes (before
  the thirty-third session the sorted rows were padded to the block, and the weight
  gradients reduced over the padding: 17-19 % slower at Qwen3-MoE's ~256 rows per expert
  in 128-row blocks);
* with ``--variant NAME=JSON`` (repeatable), the step with those block configs over the
  table's (``{"gemm1": {"PERSISTENT": 1}}``: forward GEMMs' keys merged into the table's pick,
  the backward's ``dgrad2`` / ``dgrad1`` / ``wgrad`` / ``combine`` passed as they are) in the
  same rounds, beside the table's configs passed the same way (the control: a call given
  configs skips the launch memo, so its host path differs from the default's), then each
  variant's kernels profiled once;
* with ``--forward``, instead of all the above: the no-grad forward (the default path, as a
  block's inference runs it), its CUDA-events time beside one profiled call's kernels in
  launch order and their sum (the difference: the GPU's idle gaps between them);
* the six GEMMs of a MoE training step on ``torch._grouped_mm`` (CUTLASS: what HF's
  ``grouped_mm`` runs) over the same rows sorted by expert, each timed alone (CUDA events,
  median): forward GEMM1 and GEMM2, the two dgrads, the two weight gradients; with TF/s.

The question it answers: which of the fused path's Triton GEMMs trails CUTLASS on its
shape, and by how much (the training step's GEMMs are ~85 % of its GPU time).
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

import opreg  # noqa: F401
from opreg.backends.triton import moe_experts as fused
from opreg.backends.triton import moe_experts_backward as B
from opreg.backends.triton import tune
from opreg.testing.timing import median_us


def launches(run) -> list[tuple[str, float]]:
    """(kernel name, device µs) of one call of ``run``, in launch order (after a warm-up)."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evs]


def forward_kernels(name: str, args: list, t: int, reps: int) -> None:
    """The no-grad forward's time (CUDA events, back-to-back calls) and one profiled call's
    kernels in launch order: what the block's forward spends where."""
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]

    def fwd() -> None:  # the op's no-grad path: nothing saved for a backward
        fused.fused_experts_forward(*plain)

    us = median_us(fwd, reps, True)
    ks = launches(fwd)
    total = sum(k_us for _, k_us in ks)
    print(f"\n{name} T={t}: no-grad forward {us:.1f} us (CUDA events, median of {reps}); its kernels:")
    for kname, k_us in ks:
        print(f"  {k_us:8.1f} us  {kname[:90]}")
    print(f"  {total:8.1f} us  sum of kernels; {us - total:.1f} us of the call without one")


def cutlass_gemms(e: int, h: int, i: int, k: int, t: int, reps: int) -> list[tuple[str, float, float]]:
    """(GEMM, µs, GFLOP) of the six grouped GEMMs of a training step on torch._grouped_mm,
    uniform random routing, rows sorted by expert (no padding)."""
    dev, dt = "cuda", torch.bfloat16
    s = t * k
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(s, h, device=dev, dtype=dt)
    act = torch.randn(s, i, device=dev, dtype=dt)
    dout = torch.randn(s, h, device=dev, dtype=dt)
    dpre = torch.randn(s, 2 * i, device=dev, dtype=dt)
    w1 = torch.randn(e, 2 * i, h, device=dev, dtype=dt)  # transformers' gate_up_proj (E, 2I, H)
    w2 = torch.randn(e, h, i, device=dev, dtype=dt)  # down_proj (E, H, I)
    gemms = {
        "fwd GEMM1 x @ W1^T": (lambda: torch._grouped_mm(x, w1.transpose(1, 2), offs=offs), s * h * 2 * i),
        "fwd GEMM2 act @ W2^T": (lambda: torch._grouped_mm(act, w2.transpose(1, 2), offs=offs), s * i * h),
        "dgrad2 dout @ W2": (lambda: torch._grouped_mm(dout, w2, offs=offs), s * h * i),
        "dgrad1 dpre @ W1": (lambda: torch._grouped_mm(dpre, w1, offs=offs), s * 2 * i * h),
        "wgrad2 dout^T @ act": (lambda: torch._grouped_mm(dout.t(), act, offs=offs), s * h * i),
        "wgrad1 dpre^T @ x": (lambda: torch._grouped_mm(dpre.t(), x, offs=offs), s * 2 * i * h),
    }
    out = []
    for name, (fn, macs) in gemms.items():
        try:
            us = median_us(fn, reps, True)
        except Exception as err:  # noqa: BLE001 - a layout grouped_mm refuses: say so, go on
            print(f"  {name}: not run ({type(err).__name__}: {err})")
            continue
        out.append((name, us, 2 * macs / 1e9))
    return out


def variant_configs(spec: dict, rows: float, h: int, i: int) -> dict:
    """The step's configs for ``--variant``: ``spec``'s forward GEMM keys over the table's
    pick at this shape (GEMM2 at GEMM1's BLOCK_M), its backward entries as given."""
    bm = spec.get("gemm1", {}).get("BLOCK_M")
    out = {g: {**fused.pick_config(g, rows, n, kk, torch.bfloat16, block_m=bm), **spec.get(g, {})}
           for g, n, kk in (("gemm1", 2 * i, h), ("gemm2", h, i))}
    out["gemm2"]["BLOCK_M"] = out["gemm1"]["BLOCK_M"]
    out.update({g: dict(c) for g, c in spec.items() if g not in ("gemm1", "gemm2")})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--configs", nargs="*", default=["mixtral", "qwen3_moe", "olmoe"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block-m", type=int, nargs="*", default=[],
                   help="also profile the step's kernels with the forward's BLOCK_M at these values (the "
                        "padding of each expert's rows, which the weight gradients reduce over)")
    p.add_argument("--forward", action="store_true",
                   help="only the no-grad forward: its time and its kernels, in launch order")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="also time the step with these configs (JSON: {gemm: {key: value}}) beside the table's "
                        "given the same way, in the same rounds, and profile its kernels")
    a = p.parse_args()
    given = {"table's configs, given": {}}
    for v in a.variant:
        vname, _, js = v.partition("=")
        given[vname] = json.loads(js)
    t = a.tokens
    for name in a.configs:
        e, h, i, k = tune.SHAPES[name]
        args = list(tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda"))
        for j in (0, 2, 3, 5):
            args[j] = args[j].detach().requires_grad_()
        leaves = [args[j] for j in (0, 2, 3, 5)]
        cot = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)

        def run() -> None:
            torch.autograd.grad(B.FusedExperts.apply(*args), leaves, cot)

        if a.forward:
            forward_kernels(name, args, t, a.reps)
            continue

        step = median_us(run, a.reps, True)
        print(f"\n{name} T={t} (E {e}, H {h}, I {i}, k {k}): fused fwd+bwd {step:.0f} us (CUDA events)")
        # GEMM2's split dgrad on torch._grouped_mm or Triton by default (its rows-per-expert
        # bound moved; the default path, host work memoised as a user's), in turn, a.rounds
        # times (each a median of a.reps steps)
        bound = B.DGRAD2_GROUPED_MIN_ROWS
        variants = {"dgrad2 on CUTLASS": 0, "dgrad2 on Triton": float("inf")}
        cfgs = {v: variant_configs(spec, t * k / e, h, i) for v, spec in given.items()} if a.variant else {}
        times: dict[str, list[float]] = {v: [] for v in [*variants, *cfgs]}
        for _ in range(a.rounds):
            for v, rows in variants.items():
                B.DGRAD2_GROUPED_MIN_ROWS = rows
                B._PLANS.clear()
                times[v].append(median_us(run, a.reps, True))
            B.DGRAD2_GROUPED_MIN_ROWS = bound
            B._PLANS.clear()
            for v, cfg in cfgs.items():
                times[v].append(median_us(lambda cfg=cfg: torch.autograd.grad(B.FusedExperts.apply(*args, cfg),
                                                                              leaves, cot), a.reps, True))
        for v, us in times.items():
            print(f"  {sorted(us)[len(us) // 2]:8.1f} us  {v} (median of {a.rounds} rounds; "
                  f"min {min(us):.1f})")
        total = 0.0
        for kname, us in launches(run):
            total += us
            print(f"  {us:8.1f} us  {kname[:90]}")
        print(f"  {total:8.1f} us  sum of kernels (one profiled step)")
        for bm in a.block_m:  # the table's GEMM configs, the rows padded to bm
            cfg = {g: {**fused.pick_config(g, t * k / e, n, kk, torch.bfloat16, block_m=bm), "BLOCK_M": bm}
                   for g, n, kk in (("gemm1", 2 * i, h), ("gemm2", h, i))}
            ks = launches(lambda cfg=cfg: torch.autograd.grad(B.FusedExperts.apply(*args, cfg), leaves, cot))
            print(f"  BLOCK_M {bm}: {sum(us for _, us in ks):8.1f} us  sum of kernels; GEMMs "
                  + " ".join(f"{us:.0f}" for kn, us in ks if "gemm" in kn or "cutlass" in kn))
        for v, cfg in cfgs.items():
            ks = launches(lambda cfg=cfg: torch.autograd.grad(B.FusedExperts.apply(*args, cfg), leaves, cot))
            print(f"  {v}: {sum(us for _, us in ks):8.1f} us  sum of kernels; GEMMs "
                  + " ".join(f"{us:.0f}" for kn, us in ks if "gemm" in kn or "cutlass" in kn))
        print("  torch._grouped_mm (CUTLASS) on the same GEMMs, each alone:")
        for gname, us, gf in cutlass_gemms(e, h, i, k, t, a.reps):
            print(f"  {us:8.1f} us  {gf / us * 1e3:6.0f} TF/s  {gname} ({gf:.0f} GFLOP)")


if __name__ == "__main__":
    main()
