"""``python -m opreg tune moe_experts``: choose the fused MoE kernels' block configs on this GPU.

For each expert shape (E experts, hidden H, intermediate I, top-k) and token count T, on
random bf16 inputs (uniform routing, SiLU-gated, transformers' layout), it times the whole
fused forward (:func:`moe_experts.fused_experts_forward`) with each candidate config:
first GEMM1's (which also fixes BLOCK_M, the padded row block both GEMMs walk) with GEMM2
at its default, then GEMM1's best and two large tiles with ``PREGATHER`` (GEMM1 on a sorted
copy of its rows), then GEMM1's best as a persistent kernel (``PERSISTENT``: a program per SM walking the
tiles), and with ``HALF_TAIL`` (half a tile where a block's second half is padding), then GEMM2's with
GEMM1's best, and GEMM2's best persistent and with HALF_TAIL. Coordinate descent, not the full
product: 13 x 9 candidates would be 117 compiles per shape, this is 32. The winners go into the table
``moe_experts_configs.json`` under ``tuned[dtype]["N=<n>,K=<k>"][gemm][bucket]`` (the
bucket of T * k / E rows per expert), which :func:`moe_experts.pick_config` reads; a
config that does not beat the default by more than the timing noise (2 %) is not written.
Every comparison times the two side by side, in alternating rounds (``ROUNDS``): the GPU's
clock sags under sustained load, and what ran first would otherwise win.

``--decode`` tunes instead the decode kernels of one token (:func:`moe_experts.decode_forward`:
two matrix-vector kernels, no GEMM), per shape, into
``tuned[dtype]["N=<n>,K=<k>"]["decode"]["-"]``, and the grouped decode kernels (2 to
``DECODE_MAX_TOKENS`` tokens) at ``GROUPED_TOKENS`` into ``...["decode_grouped"]["-"]``.

``--backward`` also tunes the backward's dgrad GEMMs for the transformers integration's
training path: GEMM2's dgrad (fused, or split into the forward's GEMM and the gate's
backward) and GEMM1's, timed as the fused forward + backward (:class:`FusedExperts`) with
the forward at this run's winners; its winners are kept as the forward's are (faster by
more than the noise, gradients within the dtype's error of the grouped path's).

It is bounded: ``--budget-s`` stops it starting new candidates (what it found is still
written), and it runs only when asked -- a user's first call never tunes. On the CPU under
``TRITON_INTERPRET=1`` it runs (tiny shapes, for the tests); the times mean nothing there.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from opreg.ops import moe_experts_grouped as G
from opreg.testing.timing import graph_us, median_us

from . import moe_experts as fused
from . import moe_tiles

# name: (experts, hidden, intermediate, top-k): the configs of issue 18's table.
SHAPES = {"mixtral": (8, 2048, 4096, 2), "qwen3_moe": (128, 2048, 768, 8), "olmoe": (64, 2048, 1024, 8)}

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages); the defaults' "inf" entries
# among them. Large-M tiles for many rows per expert, 16/32-row tiles for decode.
# The last two of each list: wider swizzle groups (GROUP_M 32), as vLLM's H200 tables pick
# for fused_moe at 4096 tokens (E=8, N=4096: 128 x 256 x 64, GROUP_M 32, 8 warps, 4 stages;
# E=128, N=768: the same tile, GROUP_M 16); gate + up here are two 128-wide accumulators.
GEMM1 = [(64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3),
         (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3),
         (128, 128, 128, 8, 8, 3), (16, 64, 128, 1, 4, 4), (32, 128, 64, 8, 4, 4),
         (128, 128, 64, 16, 8, 4), (128, 128, 64, 32, 8, 4)]
# GEMM1 on a sorted copy of its rows (PREGATHER, see moe_experts.py): tried with the best
# gathered tile and these, after the gathered candidates. The wider swizzle groups and the
# 128-deep K step are for many rows per expert (Mixtral at T = 16384: 4096 rows per expert,
# where its pregathered GEMM1 ran at ~590 TF/s against CUTLASS's ~670, H200, 2026-12-02).
PREGATHER = [(128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3), (128, 128, 64, 16, 8, 4), (128, 128, 64, 32, 8, 4),
             (128, 128, 128, 8, 8, 3)]
# (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
GEMM2 = [(64, 64, 8, 4, 4), (128, 64, 8, 4, 4), (128, 64, 8, 8, 4), (256, 64, 8, 8, 4), (256, 64, 8, 8, 3),
         (128, 128, 8, 8, 3), (256, 128, 8, 8, 3), (256, 64, 16, 8, 4), (256, 64, 32, 8, 4)]
# The backward's (``--backward``), timed as forward + backward with the forward at this
# run's winners, one GEMM at a time (dgrad2, then dgrad1 with dgrad2's best); BLOCK_M is the
# forward's. dgrad2: (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT): SPLIT 0 the
# fused kernel (GEMM + the gate's backward in its epilogue, its epilogue holding five tiles
# of the slice it works on), 1 the forward's GEMM into a buffer of g and the gate's backward
# as its own pass; an optional seventh, SUBTILE, the fused kernel's epilogue in that many
# column slices, so that its GEMM can run 128 wide: ptxas for sm90 (triton 3.8, bf16, W
# through TMA, 8 warps, 4 stages) spills 1762 bytes at 128 x 128 in one slice, 816 in two,
# 64 in four, none at 64 wide; an optional eighth, PREGATHER, dout's rows copied into sorted
# order first and read through a tensor descriptor (the same spills: the epilogue holds the
# registers). dgrad1: (BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages).
DGRAD2 = [(64, 64, 8, 8, 4, 0), (64, 128, 8, 8, 3, 0), (32, 64, 8, 4, 4, 0), (128, 64, 8, 8, 4, 1),
          (128, 64, 8, 8, 3, 1), (256, 64, 8, 8, 3, 1), (128, 128, 8, 8, 3, 1), (64, 64, 8, 4, 4, 1),
          (128, 64, 8, 8, 4, 0, 4), (128, 64, 8, 8, 3, 0, 4), (128, 64, 8, 8, 4, 0, 2),
          (128, 64, 8, 8, 4, 0, 4, 1), (64, 64, 8, 8, 4, 0, 1, 1)]
DGRAD1 = [(128, 64, 8, 8, 4), (256, 64, 8, 8, 3), (128, 64, 8, 4, 4), (128, 128, 8, 8, 3)]
# The decode kernels' (``--decode``: T = 1, moe_experts.decode_forward): GEMM1 + gate
# candidates (UP_BLOCK_N, UP_BLOCK_K, UP_WARPS), then GEMM2 + combine ones (DOWN_BLOCK_N,
# DOWN_BLOCK_K, DOWN_WARPS) with the best of the first; all without register spills on sm90
# (ptxas, triton 3.8, bf16: 54-164 registers). At T = 1 the down kernel has only H / DOWN_BLOCK_N
# programs: narrow column blocks and deep reduction steps keep loads in flight. On the H200,
# from CUDA graphs (2026-12-03), all three SHAPES picked (16, 256, 4) then (8, 512, 8), 1.39-1.59x
# over the former default (16, 128, 4) / (8, 256, 4): the table's default since.
DECODE_UP = [(16, 128, 4), (32, 128, 8), (64, 128, 8), (8, 256, 4), (16, 256, 4)]
DECODE_DOWN = [(8, 256, 4), (16, 128, 4), (4, 512, 4), (8, 512, 8), (32, 128, 8)]
# The grouped decode kernels' (``--decode``, at GROUPED_TOKENS: the table's "decode_grouped",
# 2 to DECODE_MAX_TOKENS tokens): both GEMMs grouped (GROUPED), the columns and reduction
# step of each, warps, stages and WAVES (moe_experts.decode_forward). On the H200 at T = 1-16
# (bench/moe_decode.py, 2026-12-03) the first of the first three was the fastest at 10 of 15
# (shape, T) points, 0.4-3.1 µs behind at the others: the table's default. At T = 16-64 (the
# twenty-seventh session) the fourth was the fastest or within 1 % at all 9 points, up to 5 %
# ahead of the first.
DECODE_GROUPED = [
    dict(GROUPED=1, UP_BLOCK_N=64, UP_BLOCK_K=64, UP_WARPS=4, DOWN_BLOCK_N=64, DOWN_BLOCK_K=128, DOWN_WARPS=4,
         num_stages=4, WAVES=4),
    dict(GROUPED=1, UP_BLOCK_N=128, UP_BLOCK_K=64, UP_WARPS=4, DOWN_BLOCK_N=128, DOWN_BLOCK_K=64, DOWN_WARPS=4,
         num_stages=3, WAVES=2),
    dict(GROUPED=1, UP_BLOCK_N=64, UP_BLOCK_K=64, UP_WARPS=4, DOWN_BLOCK_N=32, DOWN_BLOCK_K=128, DOWN_WARPS=4,
         num_stages=4, WAVES=0),
    dict(GROUPED=1, UP_BLOCK_N=64, UP_BLOCK_K=128, UP_WARPS=4, DOWN_BLOCK_N=64, DOWN_BLOCK_K=128, DOWN_WARPS=4,
         num_stages=3, WAVES=4),
]
# The grouped decode kernels run 2 to DECODE_MAX_TOKENS (64) tokens with one config per
# shape: a candidate is timed as one call at each of these, back to back in one graph (their
# sum: the larger T weighs more, as it takes longer).
GROUPED_TOKENS = (4, 32)
NOISE = 0.02
# Normwise error of the winner against the grouped path (same inputs, same dtype): both
# round to the dtype, so about its epsilon times a small factor.
MAX_ERROR = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}
# Rounds of a comparison: the incumbent and a candidate are timed alternately (A B B A A B),
# never one after the other. The H200's clock sags under sustained load: the fused forward
# at T = 16384 ran at 2435-2458 us in its first ~0.1 s of back-to-back calls and at
# 2700-2750 after, whatever the config, routing or data (2026-12-03). Timed one after the
# other, the default (timed first) beat all 28 candidates by that sag alone.
ROUNDS = 3


def _compiled(fn: Callable[[], Any]) -> Optional[Callable[[], Any]]:
    """``fn`` after one call (Triton compiles it), or None where it does not fit the GPU
    (registers or shared memory: Triton's OutOfResources) or this Triton cannot compile it
    (its passes' failures surface as CompilationError or RuntimeError, e.g. triton 3.6 on a
    warp-specialized loop: "PassManager::run failed"); said on stdout."""
    try:
        fn()
    except moe_tiles.triton.runtime.errors.OutOfResources:
        return None
    except (moe_tiles.triton.compiler.errors.CompilationError, RuntimeError) as e:
        print(f"  a candidate did not compile ({type(e).__name__}: {str(e).splitlines()[0][:160]}): skipped",
              flush=True)
        return None
    return fn


def _versus(a: Callable[[], Any], b: Callable[[], Any], reps: int, device: str,
            graph: bool = False) -> tuple[float, float]:
    """Median µs per call of ``a`` and of ``b``, each the median of ROUNDS medians of
    ``reps`` back-to-back calls, the two timed alternately (see ROUNDS). ``graph`` (CUDA):
    each round's figure is the calls replayed from a CUDA graph (``graph_us``), the
    kernels' time where an eager call is all host."""
    def timed(fn: Callable[[], Any]) -> float:
        if graph and device == "cuda":
            return graph_us(fn, reps)
        return median_us(fn, reps, device == "cuda")

    if a is b:
        us = timed(a)
        return us, us
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(ROUNDS):
        for j in ((0, 1) if r % 2 == 0 else (1, 0)):
            times[j].append(timed((a, b)[j]))
    return statistics.median(times[0]), statistics.median(times[1])


def _beats(candidate: Optional[Callable[[], Any]], incumbent: Callable[[], Any], reps: int, device: str,
           graph: bool = False) -> bool:
    """Is ``candidate`` (None: it does not fit) faster than ``incumbent``, timed side by side?"""
    if candidate is None:
        return False
    inc_us, cand_us = _versus(incumbent, candidate, reps, device, graph)
    return cand_us < inc_us


def _gemm1(c: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"), c))


def _gemm2(c: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"), c))


def _dgrad(c: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT", "SUBTILE", "PREGATHER"),
                    c))


def inputs(e: int, h: int, i: int, k: int, t: int, dtype: torch.dtype, device: str) -> tuple[Any, ...]:
    """The op's arguments: random rows, uniform top-k routing, SiLU-gated experts."""
    x = torch.randn(t, h, device=device, dtype=dtype)
    ids = torch.rand(t, e, device=device).topk(k, dim=-1).indices
    rw = torch.rand(t, k, device=device, dtype=torch.float32).softmax(-1).to(dtype)
    w1 = torch.randn(e, 2 * i, h, device=device, dtype=dtype) * h ** -0.5
    w2 = torch.randn(e, h, i, device=device, dtype=dtype) * i ** -0.5
    return (x, ids, rw, w1, None, w2, None, "silu", True, False, False, 1.702, float("inf"))


def tune_shape(e: int, h: int, i: int, k: int, t: int, dtype: torch.dtype, device: str, reps: int,
               deadline: float, gemm1: list[tuple[int, ...]] = GEMM1,
               gemm2: list[tuple[int, ...]] = GEMM2, pregather: list[tuple[int, ...]] = PREGATHER) -> dict[str, Any]:
    """Time the candidates for one shape; returns {"default_us", "best_us", "gemm1", "gemm2",
    "rows_per_expert", "error"}: the winner's normwise error against the grouped path."""
    args = inputs(e, h, i, k, t, dtype, device)
    rpe = t * k / e

    itemsize = torch.empty((), dtype=dtype).element_size()

    def run(c1: Optional[dict[str, int]], c2: Optional[dict[str, int]]) -> Optional[Callable[[], Any]]:
        """The forward with these configs, compiled; None for one whose pipelined tiles do
        not fit in shared memory (pick_config would shrink it into another candidate)."""
        configs = {name: c for name, c in (("gemm1", c1), ("gemm2", c2)) if c is not None}
        for name, c in configs.items():
            c = {**c, "BLOCK_M": c.get("BLOCK_M", (c1 or {}).get("BLOCK_M", 64))}
            if fused.fit_smem(c, itemsize, 2 if name == "gemm1" else 1) != c:
                return None
        return _compiled(lambda: fused.fused_experts_forward(*args, configs=configs))

    default = run(None, None)
    if default is None:
        raise RuntimeError("moe_experts' tuning: the table's own configs do not fit this GPU")
    d1 = fused.pick_config("gemm1", rpe, 2 * i, h, dtype)
    best1, best1_run = d1, default
    tried = 0
    for c in gemm1:
        if time.monotonic() > deadline:
            break
        tried += 1
        cand = run(_gemm1(c), None)
        if _beats(cand, best1_run, reps, device):
            best1, best1_run = _gemm1(c), cand
    for c1 in [best1] + [_gemm1(c) for c in pregather]:
        if time.monotonic() > deadline:
            break
        tried += 1
        cand = run({**c1, "PREGATHER": 1}, None)
        if _beats(cand, best1_run, reps, device):
            best1, best1_run = {**c1, "PREGATHER": 1}, cand
    if time.monotonic() <= deadline and not best1.get("PERSISTENT", 0):  # the winner, a program per SM
        tried += 1
        cand = run({**best1, "PERSISTENT": 1}, None)
        if _beats(cand, best1_run, reps, device):
            best1, best1_run = {**best1, "PERSISTENT": 1}, cand
    halves = 0  # the HALF_TAIL candidates that apply (counted in "of")
    if _half_applies(best1):  # the winner, half tiles where a block's second half is padding
        halves += 1
        if time.monotonic() <= deadline:
            tried += 1
            cand = run({**best1, "HALF_TAIL": 1}, None)
            if _beats(cand, best1_run, reps, device):
                best1, best1_run = {**best1, "HALF_TAIL": 1}, cand
    d2 = fused.pick_config("gemm2", rpe, h, i, dtype, block_m=best1["BLOCK_M"])
    best2, best_run = d2, best1_run
    for c in gemm2 + ([None] if not d2.get("PERSISTENT", 0) else []):
        if time.monotonic() > deadline:
            break
        tried += 1
        # None: the best so far, persistent
        c2 = {**best2, "PERSISTENT": 1} if c is None else {**_gemm2(c), "BLOCK_M": best1["BLOCK_M"]}
        cand = run(best1, c2)
        if _beats(cand, best_run, reps, device):
            best2, best_run = c2, cand
    if _half_applies({**best2, "BLOCK_M": best1["BLOCK_M"]}):
        halves += 1
        if time.monotonic() <= deadline:
            tried += 1
            c2 = {**best2, "BLOCK_M": best1["BLOCK_M"], "HALF_TAIL": 1}
            cand = run(best1, c2)
            if _beats(cand, best_run, reps, device):
                best2, best_run = c2, cand
    default_us, best_us = _versus(default, best_run, reps, device)
    got = fused.fused_experts_forward(*args, configs={"gemm1": best1, "gemm2": best2}).double()
    want = G.grouped(*args).double()
    error = float((got - want).norm() / want.norm().clamp_min(1e-30))
    best2 = {key: v for key, v in best2.items() if key != "BLOCK_M"}  # gemm2 runs with gemm1's
    return {"default_us": default_us, "best_us": best_us, "gemm1": best1, "gemm2": best2, "rows_per_expert": rpe,
            "error": error, "tried": tried, "of": len(gemm1) + 1 + len(pregather) + 1 + len(gemm2) + 1 + halves}


def _half_applies(cfg: dict[str, int]) -> bool:
    """Whether ``cfg`` with HALF_TAIL is another candidate: not on already, and it can run."""
    return not cfg.get("HALF_TAIL", 0) and fused.half_tail_unfit({**cfg, "HALF_TAIL": 1}) is None


def tune_backward(e: int, h: int, i: int, k: int, t: int, dtype: torch.dtype, device: str, reps: int,
                  deadline: float, forward: dict[str, dict[str, int]], dgrad2: list[tuple[int, ...]] = DGRAD2,
                  dgrad1: list[tuple[int, ...]] = DGRAD1) -> dict[str, Any]:
    """The backward's dgrad configs for one shape, ``forward`` = {"gemm1", "gemm2"} the
    forward's (its BLOCK_M is theirs); returns {"default_us", "best_us", "dgrad2", "dgrad1",
    "rows_per_expert", "error", "tried", "of"}: times of forward + backward, the error the
    largest normwise one of the winner's gradients against the grouped path's."""
    from . import moe_experts_backward as B

    args = list(inputs(e, h, i, k, t, dtype, device))
    grad_at = (0, 2, 3, 5)  # hidden_states, top_k_weights, gate_up_proj, down_proj
    for j in grad_at:
        args[j] = args[j].detach().requires_grad_()
    leaves = [args[j] for j in grad_at]
    cot = torch.randn(t, h, device=device, dtype=dtype)
    rpe = t * k / e
    bm = forward["gemm1"]["BLOCK_M"]
    itemsize = torch.empty((), dtype=dtype).element_size()

    def grads(picked: dict[str, dict[str, int]]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(B.FusedExperts.apply(*args, {**forward, **picked}), leaves, cot)

    def run(picked: dict[str, dict[str, int]]) -> Optional[Callable[[], Any]]:
        for c in picked.values():  # as the forward's: tiles that don't fit are another candidate
            if fused.fit_smem({**c, "BLOCK_M": bm}, itemsize, 1) != {**c, "BLOCK_M": bm}:
                return None
        return _compiled(lambda: grads(picked))

    default = run({})
    if default is None:
        raise RuntimeError("moe_experts' tuning: the table's own backward configs do not fit this GPU")
    best: dict[str, dict[str, int]] = {}
    best_run, tried = default, 0
    defaults = B.backward_configs(rpe, dtype, bm, 2 * i, h, i, {})  # the table's, as the default runs them
    skipped = 0  # persistent candidates that don't apply (not counted in "of")
    # GEMM2's split dgrad on torch._grouped_mm: one more dgrad2 candidate where it can run
    # (B.grouped_mm_dgrad2_default's conditions but the rows per expert)
    grouped2 = (B.grouped_mm_wgrad_default(args[0], 2 * i, i) and B.grouped_mm_unfit(args[0], 2 * i, i, args[5]) is None
                and fused.pre_dtype(dtype, True, args[12]) == torch.bfloat16)

    def forward_gemm(gemm: str, c: dict[str, int]) -> bool:  # does it run on the forward's GEMM?
        if gemm == "dgrad2":
            return bool(c.get("SPLIT", 0)) and not c.get("GROUPED_MM", 0)
        return not c.get("GROUPED_MM", B.grouped_mm_dgrad1_default(args[0], args[3], 2 * i, i))

    for gemm, cands in (("dgrad2", dgrad2 + (["grouped"] if grouped2 else [])), ("dgrad1", dgrad1)):
        for c in cands + [None, "half"]:
            if time.monotonic() > deadline:
                break
            if c is None:  # the best so far, persistent: where it runs on the forward's GEMM
                now = best.get(gemm, defaults[gemm])
                if not forward_gemm(gemm, now) or now.get("PERSISTENT", 0):
                    skipped += 1
                    continue
                cand = {**now, "PERSISTENT": 1}
            elif c == "half":  # the best so far, half tiles (HALF_TAIL): likewise
                now = best.get(gemm, defaults[gemm])
                if not forward_gemm(gemm, now) or not _half_applies({**now, "BLOCK_M": bm}):
                    skipped += 1
                    continue
                cand = {**now, "HALF_TAIL": 1}
            else:
                # a candidate tile is the Triton GEMM's, so it runs off torch._grouped_mm (the
                # sm90 bf16 default of dgrad1, and of dgrad2 at many rows per expert): a winner
                # beat that default and keeps GROUPED_MM 0 in the table
                cand = ({**defaults["dgrad2"], "SPLIT": 1, "GROUPED_MM": 1} if c == "grouped"
                        else {**_dgrad(c), "GROUPED_MM": 0})
            tried += 1
            fn = run({**best, gemm: cand})
            if _beats(fn, best_run, reps, device):
                best, best_run = {**best, gemm: cand}, fn
    default_us, best_us = _versus(default, best_run, reps, device)
    got = grads(best)
    want = torch.autograd.grad(G.grouped(*args), leaves, cot)
    error = max(float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
                for g, w in zip(got, want))
    return {"default_us": default_us, "best_us": best_us, "dgrad2": best.get("dgrad2"),
            "dgrad1": best.get("dgrad1"), "rows_per_expert": rpe, "error": error, "tried": tried,
            "of": len(dgrad2) + int(grouped2) + len(dgrad1) + 4 - skipped}


def tune_decode(e: int, h: int, i: int, k: int, dtype: torch.dtype, device: str, reps: int, deadline: float,
                up: list[tuple[int, ...]] = DECODE_UP, down: list[tuple[int, ...]] = DECODE_DOWN) -> dict[str, Any]:
    """The decode kernels' config for one shape at T = 1 (coordinate descent: GEMM1's
    kernel, then GEMM2's with the first's best); see :func:`_tune_decode_at`."""
    steps = [(lambda best, p=prefix, c=c: {**best, f"{p}_BLOCK_N": c[0], f"{p}_BLOCK_K": c[1], f"{p}_WARPS": c[2]})
             for prefix, cands in (("UP", up), ("DOWN", down)) for c in cands]
    return _tune_decode_at("decode", (1,), e, h, i, k, dtype, device, reps, deadline, steps)


def tune_decode_grouped(e: int, h: int, i: int, k: int, dtype: torch.dtype, device: str, reps: int,
                        deadline: float, cands: list[dict[str, int]] = DECODE_GROUPED) -> dict[str, Any]:
    """The grouped decode kernels' config for one shape at GROUPED_TOKENS tokens (one call at
    each), for the table's "decode_grouped"; see :func:`_tune_decode_at`."""
    steps = [(lambda best, c=c: dict(c)) for c in cands]
    return _tune_decode_at("decode_grouped", GROUPED_TOKENS, e, h, i, k, dtype, device, reps, deadline, steps)


def _tokens(tokens: tuple[int, ...]) -> str:
    return ",".join(str(t) for t in tokens)


def _report_decode(shape: tuple[int, int, int, int], tokens: str, entry: str, found: dict[str, Any],
                   kept: bool) -> None:
    e, h, i, k = shape
    label = "decode" if entry == "decode" else "grouped decode"
    print(f"E={e} H={h} I={i} k={k} T={tokens} ({label}): default {found['default_us']:.1f} us, best "
          f"{found['best_us']:.1f} us ({found['default_us'] / found['best_us']:.2f}x) error {found['error']:.1e}, "
          f"{found['tried']} of {found['of']} candidates tried; {entry}={found['decode']}: "
          f"{'written' if kept else 'default kept'}", flush=True)


def _tune_decode_at(entry: str, tokens: tuple[int, ...], e: int, h: int, i: int, k: int, dtype: torch.dtype,
                    device: str, reps: int, deadline: float,
                    steps: list[Callable[[dict[str, int]], dict[str, int]]]) -> dict[str, Any]:
    """The table's ``entry`` config for one shape, timed as one forward at each of
    ``tokens`` tokens: each step makes a candidate from the best so far, timed side by side
    with it, from a CUDA graph: an eager decode call is all host on the H200 box (the first
    run, timed with events, read 75.8-78.2 µs for all three shapes and every candidate,
    2026-12-03); returns {"default_us", "best_us", "decode" (the winner), "error", "tried",
    "of"}."""
    calls = [inputs(e, h, i, k, t, dtype, device) for t in tokens]
    default_cfg = fused.pick_config(entry, 0.0, 2 * i, h, dtype)

    def run(cfg: dict[str, int]) -> Optional[Callable[[], Any]]:
        return _compiled(lambda: [fused.fused_experts_forward(*args, configs={"decode": cfg}) for args in calls])

    default = run(default_cfg)
    if default is None:
        raise RuntimeError(f"moe_experts' tuning: the table's own {entry} config does not fit this GPU")
    best, best_run, tried = default_cfg, default, 0
    for step in steps:
        if time.monotonic() > deadline:
            break
        cand = step(best)
        tried += 1
        if cand == best:  # the incumbent itself (the table's default is among the candidates)
            continue
        fn = run(cand)
        if _beats(fn, best_run, reps, device, graph=True):
            best, best_run = cand, fn
    default_us, best_us = _versus(default, best_run, reps, device, graph=True)
    error = 0.0
    for args in calls:
        got = fused.fused_experts_forward(*args, configs={"decode": best}).double()
        want = G.grouped(*args).double()
        error = max(error, float((got - want).norm() / want.norm().clamp_min(1e-30)))
    return {"default_us": default_us, "best_us": best_us, "decode": best, "error": error, "tried": tried,
            "of": len(steps)}


def record_decode(table: dict[str, Any], e: int, h: int, i: int, dtype: torch.dtype, found: dict[str, Any],
                  entry_name: str = "decode") -> bool:
    """As :func:`record`, for :func:`tune_decode`'s (or :func:`tune_decode_grouped`'s, with
    ``entry_name`` "decode_grouped") winner: under the shape's entry of that name (one
    config, bucket "-"; N = gate_up width, K = H, as pick_config is asked)."""
    if found["best_us"] > found["default_us"] * (1 - NOISE) or not found["error"] <= MAX_ERROR[dtype]:
        return False
    dname = str(dtype).replace("torch.", "")
    entry = table.setdefault("tuned", {}).setdefault(dname, {}).setdefault(f"N={2 * i},K={h}", {})
    entry[entry_name] = {"-": found["decode"]}
    return True


def record(table: dict[str, Any], e: int, h: int, i: int, k: int, t: int, dtype: torch.dtype,
           found: dict[str, Any]) -> bool:
    """Write ``found`` into ``table["tuned"]`` if it beats the default by more than NOISE
    and computes what the grouped path does (a config is never kept on speed alone)."""
    if found["best_us"] > found["default_us"] * (1 - NOISE) or not found["error"] <= MAX_ERROR[dtype]:
        return False
    dname = str(dtype).replace("torch.", "")
    rpe = found["rows_per_expert"]
    for gemm, n, kk in (("gemm1", 2 * i, h), ("gemm2", h, i)):
        bucket = fused.rows_bucket(rpe, list(table["default"][gemm]))
        entry = table.setdefault("tuned", {}).setdefault(dname, {}).setdefault(f"N={n},K={kk}", {})
        entry.setdefault(gemm, {})[bucket] = found[gemm]
    return True


def record_backward(table: dict[str, Any], e: int, h: int, i: int, k: int, t: int, dtype: torch.dtype,
                    found: dict[str, Any]) -> bool:
    """As :func:`record`, for :func:`tune_backward`'s winners (those that differ from the
    table's default: the others are not found, None)."""
    if found["best_us"] > found["default_us"] * (1 - NOISE) or not found["error"] <= MAX_ERROR[dtype]:
        return False
    dname = str(dtype).replace("torch.", "")
    rpe = found["rows_per_expert"]
    for gemm, n, kk in (("dgrad2", i, h), ("dgrad1", h, 2 * i)):  # N, K as pick_config is asked
        if found[gemm] is None:
            continue
        bucket = fused.rows_bucket(rpe, list(table["default"][gemm]))
        entry = table.setdefault("tuned", {}).setdefault(dname, {}).setdefault(f"N={n},K={kk}", {})
        entry.setdefault(gemm, {})[bucket] = found[gemm]
    return True


def shared_buckets(table: dict[str, Any], shape: tuple[int, int, int, int], tokens: list[int],
                   gemms: tuple[str, ...]) -> list[str]:
    """Lines naming the token counts of ``shape`` that fall in one bucket of a GEMM's table
    (e.g. Qwen3-MoE's T = 4096 and 16384: 256 and 1024 rows per expert, both in "1024"):
    there a later token count's winner, where written, replaces an earlier one's."""
    e, _, _, k = shape
    lines = []
    for gemm in gemms:
        by: dict[str, list[int]] = {}
        for t in tokens:
            by.setdefault(fused.rows_bucket(t * k / e, list(table["default"][gemm])), []).append(t)
        lines += [f"note: E={e} k={k}: T={', '.join(map(str, ts))} share {gemm}'s bucket '{b}': "
                  f"a later T's winner, where written, replaces an earlier one's there"
                  for b, ts in by.items() if len(ts) > 1]
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m opreg tune moe_experts", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"names ({', '.join(SHAPES)}) or E:H:I:k, comma-separated")
    p.add_argument("--tokens", default="4096", help="token counts, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=600.0, help="start no candidate after this")
    p.add_argument("--max-candidates", type=int, default=None, help="the first N of each list (tests)")
    p.add_argument("--out", default=fused.CONFIG_FILE, help="the table to update (default: the package's)")
    p.add_argument("--backward", action="store_true",
                   help="also the backward's dgrad configs (timed as forward + backward, the forward at "
                        "this run's winners)")
    p.add_argument("--decode", action="store_true",
                   help="instead, the decode kernels' configs per shape (a forward of one token, and the "
                        f"grouped kernels' at {_tokens(GROUPED_TOKENS)} tokens; --tokens and --backward do not "
                        "apply)")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not moe_tiles.interpreting() else "cpu"
    if device == "cpu" and not moe_tiles.interpreting():
        p.error("tuning needs a CUDA GPU (or TRITON_INTERPRET=1, for tests: its times mean nothing)")
    dtype = getattr(torch, a.dtype)
    shapes = [SHAPES[s] if s in SHAPES else tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
    if not a.decode and not a.backward and any(fused.decodes(int(v), False, None) for v in a.tokens.split(",")):
        # its table entries would never run: the op's forward there is the decode kernels
        p.error(f"--tokens {a.tokens}: a forward of 1 to {fused.DECODE_MAX_TOKENS} tokens runs the decode kernels "
                "(moe_experts.decodes), not the GEMMs tuned here: --decode tunes those")
    if a.decode and a.backward:
        p.error("--decode tunes a forward of one token: --backward does not apply")
    if moe_tiles.NO_TRITON is not None:
        p.error(moe_tiles.NO_TRITON)
    with open(a.out if os.path.exists(a.out) else fused.CONFIG_FILE) as f:  # update it, or start from ours
        table = json.load(f)
    # The first op call may build opreg's kernel libraries (~40 s): not out of the budget.
    G.grouped(*inputs(2, 8, 8, 1, 4, dtype, device))
    start = time.monotonic()
    if a.decode:
        print(f"tuning moe_experts' decode kernels ({a.dtype}) on "
              f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {len(DECODE_UP)} + {len(DECODE_DOWN)} "
              f"candidates per shape at T = 1 and {len(DECODE_GROUPED)} grouped at T = {_tokens(GROUPED_TOKENS)}, "
              f"budget {a.budget_s:.0f} s", flush=True)
        for n, (e, h, i, k) in enumerate(shapes):
            left = a.budget_s - (time.monotonic() - start)
            deadline = time.monotonic() + max(left, 0.0) / (len(shapes) - n)
            half = time.monotonic() + (deadline - time.monotonic()) / 2  # T = 1's share; the grouped, the rest
            found = tune_decode(e, h, i, k, dtype, device, a.reps, half, DECODE_UP[:a.max_candidates],
                                DECODE_DOWN[:a.max_candidates])
            _report_decode((e, h, i, k), "1", "decode", found, record_decode(table, e, h, i, dtype, found))
            # the grouped kernels (2 to DECODE_MAX_TOKENS tokens) with what is left of this shape's share
            found = tune_decode_grouped(e, h, i, k, dtype, device, a.reps, max(deadline, time.monotonic() + 1.0),
                                        DECODE_GROUPED[:a.max_candidates])
            _report_decode((e, h, i, k), _tokens(GROUPED_TOKENS), "decode_grouped", found,
                           record_decode(table, e, h, i, dtype, found, "decode_grouped"))
        return _write(table, a.out, device, argv)
    jobs = [(shape, t) for shape in shapes for t in (int(v) for v in a.tokens.split(","))]
    print(f"tuning moe_experts ({a.dtype}) on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"{len(GEMM1)} + {3 + len(PREGATHER)} GEMM1 and {2 + len(GEMM2)} GEMM2 candidates per shape, "
          f"budget {a.budget_s:.0f} s", flush=True)
    tokens = [int(v) for v in a.tokens.split(",")]
    for shape in shapes:
        for line in shared_buckets(table, shape, tokens, ("gemm1", "gemm2") + (("dgrad2", "dgrad1") if a.backward
                                                                                  else ())):
            print(line, flush=True)
    for n, ((e, h, i, k), t) in enumerate(jobs):
        # each shape gets an equal share of what is left of the budget: one global deadline
        # left the last shapes none (the first took every candidate it had time for)
        left = a.budget_s - (time.monotonic() - start)
        deadline = time.monotonic() + max(left, 0.0) / (len(jobs) - n)
        # with --backward the forward gets half of it, the dgrads the rest
        fwd_deadline = deadline - (deadline - time.monotonic()) / 2 if a.backward else deadline
        found = tune_shape(e, h, i, k, t, dtype, device, a.reps, fwd_deadline,
                           GEMM1[:a.max_candidates], GEMM2[:a.max_candidates], PREGATHER[:a.max_candidates])
        kept = record(table, e, h, i, k, t, dtype, found)
        print(f"E={e} H={h} I={i} k={k} T={t}: default {found['default_us']:.0f} us, "
              f"best {found['best_us']:.0f} us ({found['default_us'] / found['best_us']:.2f}x) "
              f"error {found['error']:.1e}, {found['tried']} of {found['of']} candidates tried; "
              f"gemm1={found['gemm1']} gemm2={found['gemm2']}: "
              f"{'written' if kept else 'default kept'}",
              flush=True)
        if not a.backward:
            continue
        fwd = {"gemm1": found["gemm1"], "gemm2": {**found["gemm2"], "BLOCK_M": found["gemm1"]["BLOCK_M"]}}
        back = tune_backward(e, h, i, k, t, dtype, device, a.reps, deadline, fwd,
                             DGRAD2[:a.max_candidates], DGRAD1[:a.max_candidates])
        kept = record_backward(table, e, h, i, k, t, dtype, back)
        print(f"  backward: default {back['default_us']:.0f} us, best {back['best_us']:.0f} us "
              f"({back['default_us'] / back['best_us']:.2f}x) error {back['error']:.1e}, "
              f"{back['tried']} of {back['of']} candidates tried; dgrad2={back['dgrad2']} "
              f"dgrad1={back['dgrad1']}: {'written' if kept else 'default kept'}", flush=True)
    return _write(table, a.out, device, argv)


def _write(table: dict[str, Any], out: str, device: str, argv: Optional[list[str]] = None) -> int:
    """The table to ``out``, with this run's command and date ahead of the runs recorded
    before it (``tuned_on.command``: where each entry came from)."""
    today = datetime.date.today().isoformat()
    args = sys.argv[1:] if argv is None else argv
    run = f"python -m opreg tune moe_experts {' '.join(args)}".rstrip() + f" ({today})"
    before = table.get("tuned_on", {}).get("command")
    table["tuned_on"] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                         "torch": torch.__version__, "triton": getattr(moe_tiles.triton, "__version__", None),
                         "date": today, "command": f"{run}; before it: {before}" if before else run}
    with open(out, "w") as f:
        json.dump(table, f, indent=2)
        f.write("\n")
    print(f"wrote {out}")
    return 0
