"""The fused MoE GEMMs alone, per block config, with and without tensor-descriptor (TMA) loads,
beside ``torch._grouped_mm`` (CUTLASS, what HF's ``grouped_mm`` runs) on the same sorted rows.

    python bench/moe_gemms.py [--configs mixtral qwen3_moe olmoe] [--tokens 4096,16384]

Per config and T (bf16, uniform routing, SiLU-gated, transformers' layout; CUDA only):
GEMM1 (gathered rows x gate_up, the gate in the epilogue) for each candidate of ``GEMM1``,
GEMM2 (activation x down, the routing weight on the store) for each of ``GEMM2`` at each
BLOCK_M (both GEMMs' tiles walk the same padded pair list, so they share it); each candidate's output
against the first one's (bit-identical expected: same tiles, same order); then
GEMM1 on a sorted copy of its rows (``PREGATHER``: the copy and the GEMM timed apart), then
``torch._grouped_mm`` on the gathered copy of the same sorted rows, and the whole fused
forward with its default configs, TMA on and off, and GEMM1 pregathered. GPU time: CUDA events around back-to-back
launches (the GEMMs are GPU-bound), median of ``--reps``.

``--half-tail``: only the A/B of ``HALF_TAIL`` (half a tile where a block's second half is
padding): the fused forward with the table's configs given, against the same with HALF_TAIL
on GEMM1, and on both GEMMs (GEMM2 then not PERSISTENT, and the table's GEMM2 not persistent
beside it, the control of that change), side by side in interleaved rounds (bench/_timing.py).

``--gluon``: only the A/B of GEMM1 on the Gluon kernels (``configs["gemm1"]["GLUON"]`` 1
ping-pong, 2 cooperative; backends/triton/moe_gemm1_gluon.py): GEMM1 alone on the same sorted
rows (the table's Triton config pregathered, each Gluon kernel storing from the accumulators'
layout, the cooperative one with ``COALESCE`` too, ``torch._grouped_mm`` without the gate),
then GEMM2 on GEMM1's act rows (the table's Triton GEMM2, the cooperative Gluon kernel with and
without ``COALESCE``, the ping-pong one), then the fused forward, no grad and saving for the
backward, with the table's configs, with each GLUON, with the cooperative kernel's ``COALESCE``
stores, and with GEMM2 on each Gluon kernel too, in interleaved rounds.

``--dgrad2``: only GEMM2's dgrad with the gate's backward on the Gluon kernels
(``configs["dgrad2"]["GLUON"]`` 2 cooperative, 1 ping-pong), taken apart: CUTLASS's g alone, then
each kernel with no output, each output alone and both (the cooperative one per layout of
down_proj) (``dgrad2_ab``). On the H100 the
whole kernel took 537-576 us at T = 4096 against the split default's 337-374 (GEMM and gate
pass): this says whether its MMA loop or its epilogue holds the difference.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import moe_routing
from opreg.backends.triton import moe_tiles
from opreg.backends.triton import tune
from opreg.testing.timing import graph_us, median_us

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing as tm  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, TMA)
GEMM1 = [(128, 128, 64, 8, 8, 4, 0), (128, 128, 64, 8, 8, 4, 1), (128, 128, 64, 8, 8, 3, 1), (128, 64, 64, 8, 4, 4, 1),
         (64, 128, 64, 8, 4, 4, 0), (64, 128, 64, 8, 4, 4, 1), (64, 256, 64, 8, 8, 3, 1)]
# (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, TMA)
GEMM2 = [(128, 64, 8, 8, 4, 0), (128, 64, 8, 8, 4, 1), (256, 64, 8, 8, 3, 1), (256, 64, 8, 8, 4, 1),
         (128, 128, 8, 8, 3, 1), (64, 64, 8, 4, 4, 1)]
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "TMA")


def timed(label: str, call: Callable[[], Any], flops: float, reps: int) -> float:
    try:
        us = median_us(call, reps, True)
    except moe_tiles.triton.runtime.errors.OutOfResources as e:  # e.g. shared memory
        print(f"  {label}: does not fit ({str(e)[:90]})")
        return float("inf")
    print(f"  {label}: {us:8.1f} us {flops / us / 1e6:5.0f} TF/s", end="")
    return us


def one(name: str, t: int, reps: int) -> None:
    e, h, i, k = tune.SHAPES[name]
    args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
    x, ids, rw, w1, w2 = args[0], args[1], args[2], args[3], args[5]
    s = t * k
    f1, f2 = 2 * s * h * 2 * i, 2 * s * i * h
    print(f"\n{name} T={t} (E {e}, H {h}, I {i}, k {k})")
    for bm in sorted({c[0] for c in GEMM1}, reverse=True):
        spi, be, tables = moe_routing.routing_tables(ids, e, bm)
        routing = dict(rw=rw, sorted_pair_ids=spi, block_expert=be, shift=tables[4], top_k=k)
        real = slice(0, int(tables[0, -1]))  # the sorted rows in use (unpadded)
        first = None
        for c in (c for c in GEMM1 if c[0] == bm):
            cfg = dict(zip(KEYS, c))
            act = torch.full((s, i), float("nan"), dtype=x.dtype, device="cuda")
            us = timed(f"gemm1 {c}", lambda: F.launch_gemm(cfg, a=x, w_nk=w1, bias=None, out=act, pre=None, n=i,
                                                           k=h, gather=True, routed=False, gated=True, act=0,
                                                           **routing), f1, reps)
            if us < float("inf"):
                first = act.clone() if first is None else first
                print(f"   max |diff| vs the first {float((act[real] - first[real]).abs().max()):.3g}")
        if first is None:
            continue
        # GEMM1 on a sorted copy of its rows (the PREGATHER config): the copy, then the GEMM
        # with its A through a tensor descriptor, at this BLOCK_M's first TMA tile
        c = next(c for c in GEMM1 if c[0] == bm and c[6])
        cfg = dict(zip(KEYS, c))
        xsorted = F.sorted_rows(x, rw, spi, be, tables, k, False)
        act = torch.full((s, i), float("nan"), dtype=x.dtype, device="cuda")
        copy_us = median_us(lambda: F.sorted_rows(x, rw, spi, be, tables, k, False), reps, True)
        us = timed(f"gemm1 pregathered {c}", lambda: F.launch_gemm(
            cfg, a=xsorted, w_nk=w1, bias=None, out=act, pre=None, n=i, k=h, gather=False, routed=False, gated=True,
            act=0, **routing), f1, reps)
        if us < float("inf"):
            print(f"   + the sorted copy {copy_us:.1f} us; max |diff| vs the first "
                  f"{float((act[real] - first[real]).abs().max()):.3g}")
        ref = None
        for c in GEMM2:
            cfg = dict(zip(KEYS[1:], c), BLOCK_M=bm)
            pairs = torch.full((s, h), float("nan"), dtype=x.dtype, device="cuda")
            us = timed(f"gemm2 BLOCK_M {bm} {c}",
                       lambda: F.launch_gemm(cfg, a=first, w_nk=w2, bias=None, out=pairs, pre=None, n=h, k=i,
                                             gather=False, routed=True, scaled=True, **routing), f2, reps)
            if us < float("inf"):
                ref = pairs.clone() if ref is None else ref
                print(f"   max |diff| vs the first {float((pairs - ref).abs().max()):.3g}")
        # CUTLASS's grouped GEMM on the gathered copy of the same sorted rows
        tok = (spi[spi < s] // k).long()
        offs = tables[0]
        xs = x[tok]
        timed("torch._grouped_mm gemm1", lambda: torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs), f1, reps)
        timed("   gemm2", lambda: torch._grouped_mm(first, w2.transpose(1, 2), offs=offs), f2, reps)
        print(f"   (the gathered copy itself: {median_us(lambda: x[tok], reps, True):.1f} us)")
    d1 = F.pick_config("gemm1", s / e, 2 * i, h, torch.bfloat16)
    d2 = F.pick_config("gemm2", s / e, h, i, torch.bfloat16, block_m=d1["BLOCK_M"])
    on = median_us(lambda: F.fused_experts_forward(*args), reps, True)
    off = median_us(lambda: F.fused_experts_forward(*args, configs={"gemm1": {**d1, "TMA": 0},
                                                                    "gemm2": {**d2, "TMA": 0}}), reps, True)
    pre = median_us(lambda: F.fused_experts_forward(*args, configs={"gemm1": {**d1, "PREGATHER": 1},
                                                                    "gemm2": d2}), reps, True)
    print(f"  the fused forward, default configs: TMA on {on:.1f} us, off {off:.1f} us, "
          f"GEMM1 pregathered {pre:.1f} us")


def half_tail(name: str, t: int, rounds: int) -> None:
    """The fused forward with and without HALF_TAIL, interleaved (the module docstring)."""
    e, h, i, k = tune.SHAPES[name]
    args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
    s = t * k
    d1 = F.pick_config("gemm1", s / e, 2 * i, h, torch.bfloat16)
    d2 = F.pick_config("gemm2", s / e, h, i, torch.bfloat16, block_m=d1["BLOCK_M"])
    flat2 = {**d2, "PERSISTENT": 0}
    variants = {"table's configs": (d1, d2), "GEMM2 not persistent": (d1, flat2),
                "HALF_TAIL GEMM1": ({**d1, "HALF_TAIL": 1}, d2),
                "HALF_TAIL both": ({**d1, "HALF_TAIL": 1}, {**flat2, "HALF_TAIL": 1})}
    want = F.fused_experts_forward(*args, configs={"gemm1": d1, "gemm2": d2})
    calls = {}
    for v, (c1, c2) in variants.items():
        got = F.fused_experts_forward(*args, configs={"gemm1": c1, "gemm2": c2})
        print(f"  {v}: max |diff| vs the table's {float((got.float() - want.float()).abs().max()):.3g}")
        calls[v] = tm.Variant(lambda j, c1=c1, c2=c2: F.fused_experts_forward(*args, configs={"gemm1": c1,
                                                                                            "gemm2": c2}))
    times = tm.interleaved(calls, "cuda", rounds=rounds, target_us=5000.0, min_batch=5)
    base = times["table's configs"]
    print(f"\n{name} T={t}: the fused forward, {rounds} interleaved rounds (median us a call; ratio to the "
          f"table's, paired by round)")
    for v, us in times.items():
        print(f"  {tm.median(us):8.1f} us  {tm.paired_ratio(us, base):.3f}  {v}")


def gluon_ab(name: str, t: int, rounds: int, reps: int) -> None:
    """GEMM1 on the Gluon kernel against the table's Triton GEMM1 (the module docstring)."""
    from opreg.backends.triton import moe_gemm1_gluon as G1

    e, h, i, k = tune.SHAPES[name]
    args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
    x, ids, rw, w1 = args[0], args[1], args[2], args[3]
    s = t * k
    f1 = 2 * s * h * 2 * i
    d1 = {**F.pick_config("gemm1", s / e, 2 * i, h, torch.bfloat16), "PREGATHER": 1}
    d2 = F.pick_config("gemm2", s / e, h, i, torch.bfloat16, block_m=d1["BLOCK_M"])
    g2 = {**d2, "BLOCK_M": G1.BLOCK_M}
    print(f"\n{name} T={t} (E {e}, H {h}, I {i}, k {k}): the table's GEMM1 {d1}")
    spi, be, tables = moe_routing.routing_tables(ids, e, G1.BLOCK_M)
    flat = tables.reshape(-1)
    xs = F.sorted_rows(x, rw, spi, be, tables, k, False)
    routing = dict(rw=rw, sorted_pair_ids=spi, block_expert=be, shift=tables[4], top_k=k)
    real = slice(0, int(tables[0, -1]))
    outs = {}
    pre = torch.full((s, 2 * i), float("nan"), dtype=x.dtype, device="cuda")  # the training forward's save
    for label, cfg in (("Triton (the table's, pregathered)", {**d1, "BLOCK_M": G1.BLOCK_M}),
                       ("Triton, no HALF_TAIL", {**d1, "BLOCK_M": G1.BLOCK_M, "HALF_TAIL": 0})):
        act = torch.full((s, i), float("nan"), dtype=x.dtype, device="cuda")
        for save in (None, pre):
            timed(f"gemm1 {label}{', saving pre' * (save is not None)}",
                  lambda p=save: F.launch_gemm(cfg, a=xs, w_nk=w1, bias=None, out=act, pre=p, n=i, k=h, gather=False,
                                               routed=False, gated=True, act=0, used=flat[4 * e - 1:4 * e],
                                               **routing), f1, reps)
            print()
            # act as each save mode leaves it (saving, the gate reads the rounded pre)
            outs[label, save is not None] = act.clone()
    base = {saving: outs["Triton (the table's, pregathered)", saving] for saving in (False, True)}
    kernels = {"pingpong": 1, "coop": 2}
    for label, pp, coalesce in (("pingpong", True, False), ("coop", False, False),
                                ("coop, coalesced stores (COALESCE 1)", False, True)):
        act = torch.full((s, i), float("nan"), dtype=x.dtype, device="cuda")
        for save in (None, pre):
            timed(f"gemm1 Gluon {label}{', saving pre' * (save is not None)}",
                  lambda p=save, pp=pp, co=coalesce: G1.gemm1(xs, w1, act, p, spi, be, flat[4 * e:],
                                                                flat[4 * e - 1:4 * e], s, i, 0, pingpong=pp,
                                                                coalesce=co), f1, reps)
            ref = base[save is not None]  # Triton's act in the same save mode
            print(f"   max |diff| vs Triton {float((act[real].float() - ref[real].float()).abs().max()):.3g}, "
                  f"NaN rows {int(act[real].isnan().any(1).sum())}")
    # the cooperative kernel gathering the token rows itself (PREGATHER 0): no sorted copy, whose
    # own time is the next row
    act = torch.full((s, i), float("nan"), dtype=x.dtype, device="cuda")
    timed("gemm1 Gluon coop, COALESCE, gathered (no sorted copy)",
          lambda: G1.gemm1(x, w1, act, None, spi, be, flat[4 * e:], flat[4 * e - 1:4 * e], s, i, 0, coalesce=True,
                           gather=True, top_k=k), f1, reps)
    print(f"   max |diff| vs Triton {float((act[real].float() - base[False][real].float()).abs().max()):.3g}, "
          f"NaN rows {int(act[real].isnan().any(1).sum())}")
    # in a CUDA graph: one Python call of it takes longer on the host than the kernel on the
    # GPU (Mixtral: ~45 us against 15), which CUDA events around each call would time instead
    copy_us = graph_us(lambda: F.sorted_rows(x, rw, spi, be, tables, k, False), reps)
    print(f"  the rows' sorted copy (PREGATHER's, which the gathered kernel saves), in a CUDA graph: "
          f"{copy_us:8.1f} us")
    timed("torch._grouped_mm gemm1 (no gate)", lambda: torch._grouped_mm(xs, w1.transpose(1, 2), offs=tables[0]),
          f1, reps)
    print()
    # GEMM2 on the same act rows (the Triton GEMM1's): the table's Triton GEMM2, the Gluon one
    w2 = args[5]
    act = base[False]
    f2 = 2 * s * i * h
    pairs = {}
    for label, run in (("Triton (the table's)", lambda out: F.launch_gemm(
            g2, a=act, w_nk=w2, bias=None, out=out, pre=None, n=h, k=i, gather=False, routed=True, scaled=True,
            used=flat[4 * e - 1:4 * e], **routing)),
                       ("Gluon coop", lambda out: G1.gemm2(act, w2, out, rw, spi, be, flat[4 * e:],
                                                            flat[4 * e - 1:4 * e], s, k, coalesce=False)),
                       ("Gluon coop, COALESCE", lambda out: G1.gemm2(act, w2, out, rw, spi, be, flat[4 * e:],
                                                                      flat[4 * e - 1:4 * e], s, k, coalesce=True)),
                       ("Gluon pingpong, COALESCE", lambda out: G1.gemm2(act, w2, out, rw, spi, be, flat[4 * e:],
                                                                          flat[4 * e - 1:4 * e], s, k, pingpong=True,
                                                                          coalesce=True))):
        out = torch.full((s, h), float("nan"), dtype=x.dtype, device="cuda")
        timed(f"gemm2 {label}", lambda run=run, out=out: run(out), f2, reps)
        pairs[label] = out
        ref = pairs["Triton (the table's)"]
        print(f"   max |diff| vs Triton {float((out.float() - ref.float()).abs().max()):.3g}, "
              f"NaN rows {int(out.isnan().any(1).sum())} of {s}")
    print()
    calls = {}
    variants = {"table": {"gemm1": d1, "gemm2": d2}}
    for label, gluon in kernels.items():
        variants[label] = {"gemm1": {**d1, "BLOCK_M": G1.BLOCK_M, "HALF_TAIL": 0, "PERSISTENT": 0, "GLUON": gluon},
                           "gemm2": g2}
    variants["coop+coalesce"] = variants["coop"]
    kernels["coop+coalesce"] = 2
    # GEMM1 on the cooperative kernel gathering its rows (no grad: the saving forward here keeps
    # the rows' sorted copy for the backward, so it pregathers)
    variants["gathered+coalesce"] = {"gemm1": {**variants["coop"]["gemm1"], "PREGATHER": 0}, "gemm2": g2}
    kernels["gathered+coalesce"] = 2
    # and GEMM2 on a Gluon kernel too (GEMM1 on the cooperative one): cooperative, ping-pong
    for label, gluon2 in (("both+coalesce", 2), ("gemm2 pp+coalesce", 1)):
        variants[label] = {"gemm1": variants["coop"]["gemm1"],
                           "gemm2": {**g2, "HALF_TAIL": 0, "PERSISTENT": 0, "GLUON": gluon2}}
        kernels[label] = 2

    def forward(cfgs: dict, coalesce: bool, **kw: Any) -> Any:
        held, G1.COALESCE = G1.COALESCE, coalesce  # read at each call: the coalesced epilogue's rows
        try:
            return F.fused_experts_forward(*args, configs=cfgs, **kw)
        finally:
            G1.COALESCE = held

    for label, cfgs in variants.items():
        co = label.endswith("+coalesce")  # the module's COALESCE, read by both GEMMs' wrappers
        calls[f"forward, {label}"] = tm.Variant(lambda j, c=cfgs, co=co: forward(c, co))
        calls[f"forward save, {label}"] = tm.Variant(
            lambda j, c=cfgs, co=co: forward(c, co, save=True, keep_rows=True))
    times = tm.interleaved(calls, "cuda", rounds=rounds, target_us=5000.0, min_batch=5)
    print(f"{name} T={t}: the fused forward, {rounds} interleaved rounds (median us a call; Gluon / table, "
          f"paired by round)")
    for mode in ("forward", "forward save"):
        a_us = times[f"{mode}, table"]
        print(f"  {mode:12s} table {tm.median(a_us):8.1f}" + "".join(
            f"  {label} {tm.median(times[f'{mode}, {label}']):8.1f} "
            f"{tm.paired_ratio(times[f'{mode}, {label}'], a_us):.3f}" for label in kernels))


def dgrad2_ab(name: str, t: int, reps: int) -> None:
    """GEMM2's dgrad on the Gluon kernels (``configs["dgrad2"]["GLUON"]``) taken apart (the
    module docstring): CUTLASS's g alone (the split default's GEMM, whose gate pass then reads
    g), then each Gluon kernel with no output (its MMAs and g's trip through shared memory), with
    the partial sums of d top_k_weights alone, with d_pre alone, with both: the cooperative one
    for down_proj as transformers store it ((E, H, I): W's tiles N-contiguous) and as a
    contiguous (E, I, H) copy (K-contiguous, as GEMM2's), the ping-pong one for the first."""
    from opreg.backends.triton import moe_gemm1_gluon as G1
    from opreg.backends.triton import moe_experts_backward as B

    e, h, i, k = tune.SHAPES[name]
    args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
    ids, rw, w2 = args[1], args[2], args[5]
    s = t * k
    print(f"\n{name} T={t} (E {e}, H {h}, I {i}, k {k}): GEMM2's dgrad, {2 * s * h * i / 1e9:.0f} GFLOP")
    spi, be, tables = moe_routing.routing_tables(ids, e, G1.BLOCK_M)
    flat = tables.reshape(-1)
    dout = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    a2 = F.sorted_rows(dout, rw, spi, be, tables, k, False)
    pre = torch.randn(s, 2 * i, dtype=torch.bfloat16, device="cuda")
    f = 2 * s * h * i
    timed("CUTLASS g = dout @ down (the split default's GEMM)",
          lambda: torch._grouped_mm(a2, w2, offs=tables[0]), f, reps)
    print()
    routing = (spi, be, flat[4 * e:], flat[4 * e - 1:4 * e], s, k, 0, 1.0, float("inf"), B.clamp_ties())
    outs = {}
    for kernel, pp, layout, w_nk in (("coop", False, "down (E, H, I)", w2.transpose(1, 2)),
                                     ("coop", False, "down (E, I, H) copy", w2.transpose(1, 2).contiguous()),
                                     ("pingpong", True, "down (E, H, I)", w2.transpose(1, 2))):
        bn = G1.DGRAD2_PP_BLOCK_N if pp else G1.DGRAD2_BLOCK_N
        for label, want_dpre, want_part in (("no output", False, False), ("part", False, True),
                                            ("d_pre", True, False), ("d_pre + part", True, True)):
            d_pre = torch.full((s, 2 * i), float("nan"), dtype=torch.bfloat16, device="cuda") if want_dpre else None
            part = torch.full((s, i // bn), float("nan"), device="cuda") if want_part else None
            timed(f"Gluon dgrad2 {kernel}, {layout}, {label}",
                  lambda d=d_pre, q=part, w=w_nk, pp=pp: G1.dgrad2(a2, w, pre, rw, d, q, *routing, pingpong=pp), f,
                  reps)
            print()
            if want_dpre and want_part:
                outs[kernel, layout] = (d_pre, part)
    real = slice(0, int(tables[0, -1]))
    d0, q0 = outs["coop", "down (E, H, I)"]
    for key, (d1, q1) in outs.items():
        same = all(bool(((a == b) | (a.isnan() & b.isnan())).all()) for a, b in ((d0[real], d1[real]),))
        # the partial sums: one a 256-column tile (coop) or a 128-column one (ping-pong), added in order
        sums = (q1[:, 0::2] + q1[:, 1::2]) if q1.shape[1] != q0.shape[1] else q1
        print(f"  {key}: d_pre bit-identical to coop's {same}, NaN rows {int(d1[real].isnan().any(1).sum())}; "
              f"partial sums' max |diff| {float((sums.sum(1) - q0.sum(1)).abs().max()):.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(tune.SHAPES), choices=list(tune.SHAPES))
    p.add_argument("--tokens", default="4096")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--half-tail", action="store_true", help="only the HALF_TAIL A/B (the module docstring)")
    p.add_argument("--gluon", action="store_true", help="only the Gluon GEMM1 A/B (the module docstring)")
    p.add_argument("--dgrad2", action="store_true", help="only GEMM2's dgrad on the Gluon kernel, taken apart "
                   "(the module docstring)")
    p.add_argument("--rounds", type=int, default=9, help="with --half-tail or --gluon: interleaved rounds")
    a = p.parse_args()
    if not torch.cuda.is_available() or moe_tiles.interpreting():
        p.error("needs a CUDA GPU (the interpreter's times mean nothing)")
    for name in a.configs:
        for t in (int(v) for v in a.tokens.split(",")):
            if a.dgrad2:
                dgrad2_ab(name, t, a.reps)
            elif a.gluon:
                gluon_ab(name, t, a.rounds, a.reps)
            elif a.half_tail:
                half_tail(name, t, a.rounds)
            else:
                one(name, t, a.reps)


if __name__ == "__main__":
    main()
