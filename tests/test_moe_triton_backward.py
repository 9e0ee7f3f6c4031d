"""moe_experts' fused Triton backward (backends/triton/moe_experts_backward.py).

As tests/test_moe_triton.py: without a GPU the kernels run under Triton's interpreter on CPU
tensors, in ONE child process started with ``TRITON_INTERPRET=1`` (this file run as a
script, forked from tests/_fresh.py's server), one pytest test per case reading the child's
verdict. float32 and float16; bfloat16 only for the cases of the weight gradients on
``torch._grouped_mm`` (bf16-only), with the interpreter's two bfloat16 bugs fixed in the
child (:func:`_fix_interpreter_bfloat16`). bfloat16 runs on the GPU (``cuda``-marked tests,
with determinism and CUDA-graph capture).

Each case: fresh random inputs, every buffer the kernels fill NaN first, a random upstream
gradient; every gradient of :class:`FusedExperts` against ``torch.autograd.grad`` of the
op's reference in float64; inputs unmodified.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import zlib
from typing import Any, Callable

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as the interpreter child: `python tests/test_moe_triton_backward.py`
    sys.path.insert(0, HERE)

from test_moe_experts import ARGS, FAMILIES, make, sub  # noqa: E402
from test_moe_triton import GATES, SMALL, _nan_buffer, interpreter_child, interpreter_verdicts  # noqa: E402

from opreg.ops import moe_experts as M  # noqa: E402
from opreg.testing import assert_matches  # noqa: E402
from opreg.testing.timing import captured  # noqa: E402

try:
    from opreg.backends.triton import moe_experts as TM
    from opreg.backends.triton import moe_experts_backward as TB
    from opreg.backends.triton import moe_tiles as TT
except ImportError:  # pragma: no cover - the package itself imports without triton
    TM = TB = TT = None

HAVE_TRITON = TM is not None and TT.triton is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
GRAD_ARGS = ("hidden_states", "top_k_weights", "gate_up_proj", "gate_up_bias", "down_proj", "down_bias")

# Small blocks: several M, N and K blocks (the weight gradients' K = an expert's rows),
# ragged edges, GROUP_M swizzles with a partial last group.
SMALL_BWD = {**SMALL,
             "dgrad2": dict(BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2),
             "dgrad1": dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=3, num_warps=4, num_stages=2),
             "wgrad": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2)}
# The weight gradients forced onto torch._grouped_mm (the sm90 bf16 default; here the CPU's
# bf16 grouped_mm), the rest as SMALL_BWD: BLOCK_M = 16 padded runs.
GROUPED_BWD = {**SMALL_BWD, "wgrad": {**SMALL_BWD["wgrad"], "GROUPED_MM": 1}}
# GEMM1's dgrad forced onto torch._grouped_mm (the sm90 bf16 default; here the CPU's): its
# rows come back in sorted order and the combine reads them through pair_rows
GROUPED_DGRAD1 = {**SMALL_BWD, "dgrad1": {**SMALL_BWD["dgrad1"], "GROUPED_MM": 1}}
# The gradients each GEMM's torch._grouped_mm path changes, and whether it is one call per
# gradient (the weight gradients) or one call for all
GROUPED_PATHS = {"wgrad": (("down_proj", "gate_up_proj"), True), "dgrad1": (("hidden_states",), False)}
# GEMM2's dgrad split (the table's default at many rows per expert): the forward's GEMM into
# a buffer of g, then the gate's backward as its own pass (_gate_grad_kernel)
SPLIT_BWD = {**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "SPLIT": 1}}


# Every GEMM that can run persistent so: the forward's two, dgrad2's split GEMM, dgrad1 on
# Triton (on the GPU bf16's dgrad1 would run on torch._grouped_mm, which has no such mode)
PERSISTENT_BWD = {g: {**SPLIT_BWD[g], "PERSISTENT": 1} for g in ("gemm1", "gemm2", "dgrad2", "dgrad1")}
PERSISTENT_BWD["dgrad1"]["GROUPED_MM"] = 0
# Half a tile where a block's second half is padding (HALF_TAIL) on the same GEMMs, in
# 32-row blocks (the forward's HALF cases' shapes)
HALF_BWD = {g: {**SPLIT_BWD[g], "HALF_TAIL": 1} for g in ("gemm1", "gemm2", "dgrad2", "dgrad1")}
HALF_BWD["gemm1"]["BLOCK_M"] = 32
HALF_BWD["dgrad1"]["GROUPED_MM"] = 0


# ------------------------------------------------------------------ interpreted cases

def _gate_cases() -> dict[str, dict]:
    """Every gate x {gated, not} x {transposed, not}; interleaved, biases and the limit vary
    along (each seen both ways), as the forward's cases."""
    cases, n = {}, 0
    kinds = [(g, True) for g in GATES] + [(g, False) for g in GATES] + [(M.GPT_OSS, True)]
    for act, gated in kinds:
        for transposed in (False, True):
            n += 1
            opts = dict(activation=act, gated=gated, transposed=transposed, bias=n % 4 in (0, 1),
                        interleaved=gated and (n // 2) % 2 == 1)
            clamps = act == M.GPT_OSS or (act == "silu" and gated and transposed)
            if act == M.GPT_OSS:
                opts.update(alpha=1.702, limit=1.5, gain=4.0)
            elif clamps:
                opts.update(limit=0.7, gain=4.0)
            dtypes = ["float32", "float16"] if n % 4 == 1 or act == M.GPT_OSS else ["float32"]
            name = f"{act} {'gated' if gated else 'ungated'}{' transposed' if transposed else ''}"
            cases[name] = dict(dims=(6, 2, 40, 24, 3), opts=opts, dtypes=dtypes, clamps=clamps)
    return cases


CASES: dict[str, dict] = {
    **_gate_cases(),
    # ragged H, I; several blocks in M, N and K of every kernel (24 rows per expert: 2 row
    # blocks of the weight gradients), swizzle groups
    "ragged small blocks": dict(dims=(24, 3, 40, 24, 3), opts=dict(bias=True), configs=SMALL_BWD),
    "ragged gpt_oss small blocks": dict(dims=(21, 2, 50, 18, 3), configs=SMALL_BWD, clamps=True, opts=dict(
        activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True, alpha=1.702, limit=1.0, gain=3.0)),
    "ragged relu2 ungated small blocks": dict(dims=(17, 2, 33, 20, 2), configs=SMALL_BWD, dtypes=["float32"],
                                              opts=dict(activation="relu2", gated=False, bias=True)),
    "default configs, more rows": dict(dims=(64, 2, 48, 32, 4), opts=dict(bias=True), dtypes=["float32"]),
    # values exactly at the clamps (and relu's 0): the derivative there is torch's
    "ties silu": dict(dims=(12, 2, 16, 8, 3), opts=dict(limit=1.0, bias=True), special="ties", configs=SMALL_BWD),
    "ties gpt_oss": dict(dims=(12, 2, 16, 8, 3), special="ties", configs=SMALL_BWD, opts=dict(
        activation=M.GPT_OSS, interleaved=True, transposed=True, bias=True, alpha=1.702, limit=1.0)),
    "ties relu ungated": dict(dims=(12, 2, 16, 8, 3), opts=dict(activation="relu", gated=False, bias=True),
                              special="ties", dtypes=["float32"]),
    "sentinels, NaN weights there": dict(dims=(10, 2, 16, 8, 4), opts=dict(sentinels=6, bias=True),
                                         special="nan"),
    "all slots sentinel": dict(dims=(5, 2, 16, 8, 4), opts=dict(bias=True), special="all_out"),
    "empty expert": dict(dims=(6, 2, 16, 8, 8), opts=dict(bias=True), special="skip_expert"),
    "T=1": dict(dims=(1, 2, 24, 16, 4), opts=dict(bias=True)),
    # moe_experts.REPLAY_TRAINING on (the default, set here so that the case says so), default
    # configs: the saving forward goes through the replay's Plans (the interpreter's launches
    # refuse a plan: its flat result, rebuilt)
    "replay training": dict(dims=(10, 2, 16, 8, 4), opts=dict(sentinels=3, bias=True), special="nan",
                            replay_training=True, dtypes=["float32"]),
    # GEMM2's dgrad loads down_proj's tiles through a tensor descriptor by default (here the
    # interpreter's); this case keeps its pointer loads covered, both weight layouts
    "dgrad2 pointer loads": dict(dims=(11, 2, 16, 8, 3), opts=dict(bias=True),
                                 configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "TMA": 0}}),
    "dgrad2 pointer loads, transposed": dict(dims=(11, 2, 16, 8, 3), opts=dict(transposed=True),
                                             dtypes=["float32"],
                                             configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "TMA": 0}}),
    "dgrad2 split": dict(dims=(24, 3, 40, 24, 3), opts=dict(bias=True), configs=SPLIT_BWD,
                         forbid=("TB._dgrad_act_kernel",)),
    "dgrad2 split gpt_oss": dict(dims=(21, 2, 50, 18, 3), configs=SPLIT_BWD, clamps=True,
                                 forbid=("TB._dgrad_act_kernel",), opts=dict(
        activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True, alpha=1.702, limit=1.0, gain=3.0)),
    "dgrad2 split, sentinels, empty expert": dict(dims=(6, 2, 16, 8, 8), opts=dict(bias=True, sentinels=3),
                                                  special="nan+skip_expert", configs=SPLIT_BWD,
                                                  forbid=("TB._dgrad_act_kernel",)),
    "dgrad2 split ungated, routing weights only": dict(
        dims=(9, 2, 24, 16, 3), opts=dict(activation="relu2", gated=False, bias=True), dtypes=["float32"],
        configs=SPLIT_BWD, requires=("top_k_weights",), forbid=("TB._dgrad_act_kernel", "TB._moe_wgrad")),
    # the fused dgrad2's epilogue in column slices (SUBTILE): I = 24 over 16- and 32-wide
    # tiles of 8-wide slices, the last slices past I masked; gated, interleaved and not
    "dgrad2 fused, 2 epilogue slices": dict(
        dims=(24, 3, 40, 24, 3), opts=dict(bias=True, sentinels=2), special="nan", dtypes=["float32", "bfloat16"],
        configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "SUBTILE": 2}}, forbid=("TB._gate_grad_kernel",)),
    "dgrad2 fused, 4 epilogue slices, gelu interleaved": dict(
        dims=(17, 2, 40, 24, 3), opts=dict(activation="gelu", interleaved=True, bias=True),
        configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "BLOCK_N": 32, "SUBTILE": 4}},
        forbid=("TB._gate_grad_kernel",)),
    "dgrad2 fused, 2 epilogue slices, relu2 ungated": dict(
        dims=(13, 2, 24, 24, 3), opts=dict(activation="relu2", gated=False, transposed=True), dtypes=["float32"],
        configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "SUBTILE": 2}}, forbid=("TB._gate_grad_kernel",)),
    # dgrad2 on a sorted copy of dout's rows (PREGATHER): fused (rows through a tensor
    # descriptor, and through pointers with TMA off) and split; sentinels, an empty expert
    "dgrad2 pregathered, fused": dict(
        dims=(24, 3, 40, 24, 3), opts=dict(bias=True, sentinels=2), special="nan", dtypes=["float32", "bfloat16"],
        configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "PREGATHER": 1, "SUBTILE": 2}},
        forbid=("TB._gate_grad_kernel",)),
    "dgrad2 pregathered, fused, pointer loads, empty expert": dict(
        dims=(6, 2, 16, 8, 8), opts=dict(activation="gelu_tanh", interleaved=True, bias=True), special="skip_expert",
        configs={**SMALL_BWD, "dgrad2": {**SMALL_BWD["dgrad2"], "PREGATHER": 1, "TMA": 0}},
        forbid=("TB._gate_grad_kernel",)),
    "dgrad2 pregathered, split": dict(
        dims=(24, 3, 40, 24, 3), opts=dict(bias=True, sentinels=2, transposed=True), special="nan",
        configs={**SPLIT_BWD, "dgrad2": {**SPLIT_BWD["dgrad2"], "PREGATHER": 1}}, forbid=("TB._dgrad_act_kernel",)),
    # the forward's GEMM1 on a sorted copy of its rows: the backward reads the same saved tensors
    "pregathered forward": dict(dims=(11, 2, 16, 8, 3), opts=dict(bias=True),
                                configs={**SMALL_BWD, "gemm1": {**SMALL["gemm1"], "PREGATHER": 1}}),
    # persistent GEMMs: the forward's two, dgrad2's split GEMM and dgrad1's Triton GEMM
    "persistent": dict(dims=(24, 3, 40, 24, 3), opts=dict(bias=True), forbid=("TB._dgrad_act_kernel",), configs={
        **SPLIT_BWD, **PERSISTENT_BWD}),
    "persistent, sentinels, empty expert": dict(
        dims=(6, 2, 16, 8, 8), opts=dict(bias=True, sentinels=3), special="nan+skip_expert", dtypes=["float32"],
        forbid=("TB._dgrad_act_kernel",), configs={
            **SPLIT_BWD, **PERSISTENT_BWD}),
    # half tiles: the forward's two GEMMs, dgrad2's split GEMM and dgrad1's Triton GEMM
    "half tail blocks": dict(dims=(50, 3, 40, 24, 4), opts=dict(bias=True), forbid=("TB._dgrad_act_kernel",),
                             configs={**SPLIT_BWD, **HALF_BWD}),
    "half tail blocks, sentinels, empty expert": dict(
        dims=(60, 2, 16, 8, 8), opts=dict(bias=True, sentinels=3), special="nan+skip_expert", dtypes=["float32"],
        forbid=("TB._dgrad_act_kernel",), configs={**SPLIT_BWD, **HALF_BWD}),
    "k=1": dict(dims=(7, 1, 24, 16, 4), opts=dict(activation="gelu", interleaved=True)),
    "T=0": dict(dims=(0, 2, 16, 8, 4), opts=dict(bias=True), dtypes=["float32"]),
    "int32 ids, strided inputs, expanded grad": dict(dims=(8, 4, 24, 16, 8), opts=dict(idx_dtype=torch.int32),
                                                     special="strided"),
    # out.sum()'s gradient: one value expanded, strides (0, 0) (the backward copies it into rows)
    "a sum's gradient": dict(dims=(9, 2, 24, 16, 3), opts=dict(bias=True), special="sum_grad"),
    "mixtral family": dict(dims=FAMILIES["mixtral silu"][0], opts=FAMILIES["mixtral silu"][1],
                           dtypes=["float32"]),
    # only some inputs require grad: the others' kernels must not run
    "frozen weights": dict(dims=(9, 2, 24, 16, 3), opts=dict(bias=True), dtypes=["float32"],
                           requires=("hidden_states", "top_k_weights"), forbid=("TB._moe_wgrad",)),
    "down_proj only": dict(dims=(9, 2, 24, 16, 3), opts=dict(bias=True, transposed=True), dtypes=["float32"],
                           requires=("down_proj", "down_bias"),
                           forbid=("TB._dgrad_act_kernel", "TB._route_grad_kernel", "TM._moe_gemm")),
    "routing weights only": dict(dims=(9, 2, 24, 16, 3), opts=dict(bias=True), dtypes=["float32"],
                                 requires=("top_k_weights",), forbid=("TB._moe_wgrad", "TM._moe_gemm")),
    "gate_up_bias only": dict(dims=(9, 2, 24, 16, 3), opts=dict(bias=True, activation="gelu_tanh"),
                              dtypes=["float32"], requires=("gate_up_bias",), forbid=("TM._moe_gemm",)),
    # The weight gradients on torch._grouped_mm (bf16; H, N1, I multiples of 8). By
    # construction, whatever the seed: 12 slots over 8 experts with BLOCK_M = 16, so every
    # run is padded, expert 2 has no rows, 3 sentinel slots with NaN weights; 60 slots over 3
    # experts, so some expert spans two blocks (>= 20 rows) and no padding-free split exists;
    # expert 0 with exactly one full block (16 rows, no padding) beside padded runs.
    "grouped_mm wgrad, sentinels, empty experts": {
        "dims": (6, 2, 16, 8, 8), "opts": {"bias": True, "sentinels": 3}, "special": "nan+skip_expert",
        "configs": GROUPED_BWD, "dtypes": ["bfloat16"], "grouped": True},
    "grouped_mm wgrad ungated transposed": {
        "dims": (30, 2, 24, 16, 3), "opts": {"activation": "relu2", "gated": False, "transposed": True, "bias": True},
        "configs": GROUPED_BWD, "dtypes": ["bfloat16"], "grouped": True},
    "grouped_mm wgrad gated transposed interleaved, default blocks": {
        "dims": (30, 2, 24, 16, 3), "opts": {"transposed": True, "interleaved": True, "bias": True},
        "configs": {"wgrad": {"GROUPED_MM": 1}}, "dtypes": ["bfloat16"], "grouped": True},
    "grouped_mm wgrad, dgrad2 split (the sm90 default at many rows)": {
        "dims": (30, 2, 24, 16, 3), "opts": {"bias": True}, "configs": {**GROUPED_BWD, "dgrad2": SPLIT_BWD["dgrad2"]},
        "dtypes": ["bfloat16"], "grouped": True, "forbid": ("TB._dgrad_act_kernel",)},
    # GEMM1's dgrad on torch._grouped_mm, by construction as the wgrad cases: padded runs, an
    # empty expert, sentinel slots with NaN weights (their pairs get no row in pair_rows),
    # an expert spanning two blocks, a full block; transposed and interleaved gate_up_proj
    "grouped_mm dgrad1, sentinels, empty experts": {
        "dims": (6, 2, 16, 8, 8), "opts": {"bias": True, "sentinels": 3}, "special": "nan+skip_expert",
        "configs": GROUPED_DGRAD1, "dtypes": ["bfloat16"], "grouped1": True},
    "grouped_mm dgrad1 and wgrad, transposed interleaved, split dgrad2": {
        "dims": (30, 2, 24, 16, 3), "opts": {"transposed": True, "interleaved": True, "bias": True},
        "configs": {**GROUPED_DGRAD1, "wgrad": GROUPED_BWD["wgrad"], "dgrad2": SPLIT_BWD["dgrad2"]},
        "dtypes": ["bfloat16"], "grouped": True, "grouped1": True},
    "grouped_mm dgrad1, hidden_states only, a full block": {
        "dims": (16, 2, 24, 16, 3), "opts": {"activation": "gelu_tanh", "gated": False}, "special": "full_block",
        "configs": GROUPED_DGRAD1, "dtypes": ["bfloat16"], "grouped1": True, "requires": ("hidden_states",)},
    # the gate's pass in another tile than the default 8 x 256 (configs GATE_R / GATE_N /
    # GATE_WARPS): 16 rows, and I = 24 in two column steps, the second partly masked
    # the gate's pass over column groups (GATE_GROUPS), a partial sum each: I = 40 in 16-wide
    # steps, 3 groups of 16 columns (the last 8 wide), and more groups than steps
    "dgrad2 split, gate pass in column groups": {
        "dims": (9, 3, 40, 40, 5), "opts": {"bias": True, "sentinels": 2}, "special": "nan",
        "configs": {**SMALL_BWD, "dgrad2": {**SPLIT_BWD["dgrad2"], "GATE_N": 16, "GATE_GROUPS": 3}},
        "forbid": ("TB._dgrad_act_kernel",)},
    "dgrad2 split, gate pass in more groups than steps, gelu interleaved": {
        "dims": (7, 2, 24, 24, 3), "opts": {"activation": "gelu", "interleaved": True}, "dtypes": ["float32"],
        "configs": {**SMALL_BWD, "dgrad2": {**SPLIT_BWD["dgrad2"], "GATE_N": 16, "GATE_GROUPS": 8}},
        "forbid": ("TB._dgrad_act_kernel",)},
    "dgrad2 split, other gate tiles": {
        "dims": (9, 3, 40, 24, 5), "opts": {"bias": True, "sentinels": 2}, "special": "nan",
        "configs": {**SMALL_BWD, "dgrad2": {**SPLIT_BWD["dgrad2"], "GATE_R": 16, "GATE_N": 16, "GATE_WARPS": 2}},
        "forbid": ("TB._dgrad_act_kernel",)},
    # moe_experts.PRE_BF16 (on by default): bf16 inputs whose gate has no clamp save pre
    # (and the split dgrad2's g) in bf16, rounded before the forward's gate; d top_k_weights
    # measured against its terms (it cancels at T = 1: bench/pre_dtype_numerics.py); with a
    # clamp, or the flag off, pre stays float32
    "pre_bf16 fused dgrad2": {"dims": (30, 2, 24, 16, 3), "opts": {"bias": True}, "configs": SMALL_BWD,
                              "dtypes": ["bfloat16"], "pre_bf16": True, "pre": torch.bfloat16},
    "pre_bf16 split dgrad2, gelu_tanh transposed interleaved": {
        "dims": (30, 2, 24, 16, 3), "opts": {"activation": "gelu_tanh", "transposed": True, "interleaved": True},
        "configs": SPLIT_BWD, "dtypes": ["bfloat16"], "pre_bf16": True, "pre": torch.bfloat16,
        "forbid": ("TB._dgrad_act_kernel",)},
    "pre_bf16 relu2 ungated, sentinels, T=1": {
        "dims": (1, 3, 24, 16, 4), "opts": {"activation": "relu2", "gated": False, "bias": True, "sentinels": 1},
        "special": "nan", "dtypes": ["bfloat16"], "pre_bf16": True, "pre": torch.bfloat16},
    "pre_bf16 off: float32 for bf16, split dgrad2": {
        "dims": (30, 2, 24, 16, 3), "opts": {"bias": True}, "configs": SPLIT_BWD, "dtypes": ["bfloat16"],
        "pre_bf16": False, "pre": torch.float32},
    "pre_bf16 gpt_oss with a limit: float32": {
        "dims": (21, 2, 50, 18, 3), "configs": SPLIT_BWD, "clamps": True, "dtypes": ["bfloat16"],
        "pre_bf16": True, "pre": torch.float32, "opts": dict(activation=M.GPT_OSS, transposed=True, interleaved=True,
                                                           bias=True, alpha=1.702, limit=1.0, gain=3.0)},
    # GEMM1 of the training forward on torch._grouped_mm over the kept sorted rows, its bf16
    # output pre, the gate as its own pass (_act_kernel), where forced (off by default: it
    # measured slower in the step); by construction as the wgrad cases (padded runs, an
    # empty expert, sentinels with NaN weights, an expert over two blocks); ungated,
    # transposed, interleaved
    "grouped_mm gemm1, sentinels, empty experts": {
        "dims": (6, 2, 16, 8, 8), "opts": {"sentinels": 3}, "special": "nan+skip_expert",
        "configs": {**GROUPED_BWD, "gemm1": {**SMALL["gemm1"], "GROUPED_MM": 1}}, "dtypes": ["bfloat16"],
        "grouped": True, "pre_bf16": True, "pre": torch.bfloat16, "gemm1_grouped": True},
    "grouped_mm gemm1 ungated relu2 transposed": {
        "dims": (30, 2, 24, 16, 3), "opts": {"activation": "relu2", "gated": False, "transposed": True},
        "configs": {**GROUPED_BWD, "gemm1": {**SMALL["gemm1"], "GROUPED_MM": 1}}, "dtypes": ["bfloat16"],
        "grouped": True, "pre_bf16": True, "pre": torch.bfloat16, "gemm1_grouped": True},
    "grouped_mm gemm1, gelu_tanh interleaved, down_bias": {
        "dims": (30, 2, 24, 16, 3), "opts": {"activation": "gelu_tanh", "interleaved": True, "bias": True},
        "special": "no_gate_up_bias", "configs": {**GROUPED_BWD, "gemm1": {**SMALL["gemm1"], "GROUPED_MM": 1}},
        "dtypes": ["bfloat16"], "grouped": True, "pre_bf16": True, "pre": torch.bfloat16, "gemm1_grouped": True},
    "grouped_mm wgrad keeps the rows, gemm1 fused by default": {
        "dims": (30, 2, 24, 16, 3), "opts": {}, "configs": {"wgrad": {"GROUPED_MM": 1}},
        "dtypes": ["bfloat16"], "grouped": True, "pre_bf16": True, "pre": torch.bfloat16, "gemm1_grouped": False},
    # GEMM2's split dgrad on torch._grouped_mm over a sorted copy of dout (g bf16), then the
    # gate's pass; sentinels, an empty expert, biases; transposed interleaved with GEMM1 too
    "grouped_mm dgrad2, sentinels, empty experts": {
        "dims": (6, 2, 16, 8, 8), "opts": {"bias": True, "sentinels": 3}, "special": "nan+skip_expert",
        "configs": {**GROUPED_BWD, "dgrad2": {**SPLIT_BWD["dgrad2"], "GROUPED_MM": 1}}, "dtypes": ["bfloat16"],
        "grouped": True, "grouped2": True, "pre_bf16": True, "pre": torch.bfloat16,
        "forbid": ("TB._dgrad_act_kernel",)},
    "grouped_mm dgrad2 and gemm1, transposed interleaved, no wgrad": {
        "dims": (30, 2, 24, 16, 3), "opts": {"transposed": True, "interleaved": True},
        "configs": {**GROUPED_BWD, "gemm1": {**SMALL["gemm1"], "GROUPED_MM": 1},
                    "dgrad2": {**SPLIT_BWD["dgrad2"], "GROUPED_MM": 1}},
        "dtypes": ["bfloat16"], "grouped": True, "grouped2": True, "pre_bf16": True, "pre": torch.bfloat16,
        "gemm1_grouped": True, "forbid": ("TB._dgrad_act_kernel",)},
    "grouped_mm wgrad, down_proj only, a full block": {
        "dims": (16, 2, 24, 16, 3), "opts": {"bias": True}, "special": "full_block", "configs": GROUPED_BWD,
        "dtypes": ["bfloat16"], "grouped": True, "requires": ("down_proj", "down_bias"),
        "forbid": ("TB._dgrad_act_kernel", "TM._moe_gemm")},
}
for _c in CASES.values():
    _c.setdefault("dtypes", ["float32", "float16"])
CASE_IDS = [f"{name}/{dt}" for name, c in CASES.items() for dt in c["dtypes"]]


def _pre(args: tuple) -> torch.Tensor:
    """The up projections (float64) of the pairs whose id is in [0, E): (pairs, N)."""
    x, ids, _, w1, b1, *_rest = args
    e, transposed = w1.shape[0], args[9]
    pre = []
    for p, ex in enumerate(ids.reshape(-1).tolist()):
        if 0 <= ex < e:
            w = w1[ex].double()
            y = x[p // ids.shape[1]].double() @ (w if transposed else w.T)
            pre.append(y if b1 is None else y + b1[ex].double())
    return torch.stack(pre) if pre else x.new_zeros((0, 1), dtype=torch.float64)


def _halves(args: tuple, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if args[10]:  # interleaved
        return pre[:, ::2], pre[:, 1::2]
    return pre.chunk(2, dim=-1)


def _special(args: tuple, special: str | None) -> tuple:
    if special and "+" in special:  # several, in order
        for one in special.split("+"):
            args = _special(args, one)
        return args
    e = args[3].shape[0]
    if special == "nan":  # the sentinel slots' weights NaN: the reference never reads them either
        w = args[2].clone()
        w[args[1] >= e] = float("nan")
        return sub(args, top_k_weights=w)
    if special == "all_out":
        return sub(args, top_k_index=args[1] + e)
    if special == "full_block":  # slot 0 of every token expert 0, slot 1 expert 1 or 2
        ids = args[1].clone()
        ids[:, 0] = 0
        ids[:, 1] = torch.randint(1, e, ids[:, 1].shape).to(ids)
        return sub(args, top_k_index=ids)
    if special == "no_gate_up_bias":  # down_bias alone
        return sub(args, gate_up_bias=None)
    if special == "skip_expert":
        ids = args[1].clone()
        ids[ids == 2] = 5  # expert 2 gets nothing; 5 gets more
        return sub(args, top_k_index=ids)
    if special == "strided":
        xs = args[0].t().contiguous().t()  # column-major views
        ws = args[2].t().contiguous().t()
        assert not xs.is_contiguous() and not ws.is_contiguous()
        return sub(args, hidden_states=xs, top_k_weights=ws)
    if special == "ties":
        # Small integers and quarters: every up projection is exact (fp16, fp32 and the
        # float64 reference alike), many of them exactly at +-limit (and at 0).
        x, w1, b1 = args[0], args[3], args[4]
        q = lambda t, lo, hi, scale: torch.randint(lo, hi, t.shape).to(t) * scale  # noqa: E731
        return sub(args, hidden_states=q(x, -1, 2, 1.0), gate_up_proj=q(w1, -2, 3, 0.25),
                   gate_up_bias=None if b1 is None else q(b1, -4, 5, 0.25))
    return args


def _requires(args: tuple, names: tuple[str, ...]) -> tuple:
    """Float tensor arguments detached, as leaves requiring grad if named."""
    return tuple(a.detach().requires_grad_(n in names) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for n, a in zip(ARGS, args))


class _Forbidden:
    """A kernel that must not launch."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: Any) -> Any:
        raise AssertionError(f"{self.name} launched, though no gradient needs it")


class _Launches:
    """A kernel whose launches are logged (each one's keyword arguments: the constexprs),
    then run."""

    def __init__(self, fn: Any, log: list[dict[str, Any]]) -> None:
        self.fn, self.log = fn, log

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.log.append(kwargs)
            return self.fn[grid](*args, **kwargs)
        return run


def _counted(fn: Any, log: list[int]) -> Any:
    """``fn`` with each call counted in ``log``."""
    def call(*args: Any, **kwargs: Any) -> Any:
        log.append(1)
        return fn(*args, **kwargs)
    return call


def _grouped_wgrad(args: tuple, configs: dict | None) -> bool:
    """Do the weight gradients run on torch._grouped_mm: as the configs force, else the
    default (bf16 on sm90 CUDA; never on the CPU). Never without a slot (T * k = 0 or H = 0:
    every gradient is a zero fill, nothing launches)."""
    w1, gated, transposed = args[3], args[8], args[9]
    if args[1].numel() == 0 or args[0].shape[1] == 0:
        return False
    n1 = w1.shape[2] if transposed else w1.shape[1]
    default = TB.grouped_mm_wgrad_default(args[0], n1, n1 // 2 if gated else n1)
    return bool(((configs or {}).get("wgrad") or {}).get("GROUPED_MM", default))


def _grouped_dgrad1(args: tuple, configs: dict | None) -> bool:
    """Does GEMM1's dgrad run on torch._grouped_mm: as the configs force, else the default
    (as the weight gradients', gate_up_proj's layout permitting). Never without a slot."""
    w1, gated, transposed = args[3], args[8], args[9]
    if args[1].numel() == 0 or args[0].shape[1] == 0:
        return False
    n1 = w1.shape[2] if transposed else w1.shape[1]
    default = TB.grouped_mm_dgrad1_default(args[0], w1, n1, n1 // 2 if gated else n1)
    return bool(((configs or {}).get("dgrad1") or {}).get("GROUPED_MM", default))


def _check_wgrad_path(grouped: bool, grouped1: bool, names: tuple[str, ...], args: tuple, mm_calls: list[int],
                      wgrad_log: list[dict[str, Any]], rows_log: list[dict[str, Any]],
                      fwd_rows_log: list[dict[str, Any]] | None, configs: dict | None) -> None:
    """The weight gradients ran where they should: ``grouped``, one torch._grouped_mm per
    weight gradient asked for, Triton's _moe_wgrad for the biases alone, and each gathered
    operand's rows copied once: dout (unscaled) first where dgrad2 reads a sorted copy
    (its config's PREGATHER, or GROUPED_MM: then one more torch._grouped_mm) and a gradient
    needs GEMM2's dgrad, then rw * dout (scaled)
    for down_proj in the backward, x for
    gate_up_proj in the forward (GEMM1 read that copy, and the backward reuses it:
    ``keeps_rows``; ``fwd_rows_log`` None: the forward was replayed, its launches not logged);
    else no torch._grouped_mm for them, and the forward copies x only where its table says
    PREGATHER. ``grouped1``: GEMM1's dgrad is one more torch._grouped_mm
    where hidden_states' gradient is asked for."""
    weights = [n for n in ("down_proj", "gate_up_proj") if n in names]
    # GEMM2's dgrad (every gradient but down_proj's and the biases' below it needs it): on
    # torch._grouped_mm where forced (the default needs >= DGRAD2_GROUPED_MIN_ROWS rows per
    # expert, more than any case has), reading a sorted copy of dout as PREGATHER does
    dgrad2 = any(n in names for n in ("hidden_states", "gate_up_proj", "gate_up_bias", "top_k_weights"))
    c2 = (configs or {}).get("dgrad2") or {}
    assert "GROUPED_MM" in c2 or args[1].numel() / args[3].shape[0] < TB.DGRAD2_GROUPED_MIN_ROWS
    grouped2 = bool(c2.get("GROUPED_MM", 0)) and dgrad2
    dgrads = int(grouped1 and "hidden_states" in names) + int(grouped2)
    if not grouped:
        assert len(mm_calls) == dgrads, f"torch._grouped_mm ran {len(mm_calls)} times, {dgrads} asked for"
        return
    biases = [n for n in ("down_bias", "gate_up_bias") if n in names and args[ARGS.index(n)] is not None]
    assert len(mm_calls) == len(weights) + dgrads, \
        f"torch._grouped_mm ran {len(mm_calls)} times for {weights} and {dgrads} dgrads"
    assert [kw["WEIGHT_GRAD"] for kw in wgrad_log] == [False] * len(biases), wgrad_log
    pregather = bool(c2.get("PREGATHER", 0)) or grouped2
    want = [False] * (pregather and dgrad2) + [True] * ("down_proj" in weights)
    assert [kw["SCALED"] for kw in rows_log] == want, rows_log
    if "gate_up_proj" in weights and fwd_rows_log is not None:
        assert [kw["SCALED"] for kw in fwd_rows_log] == [False], fwd_rows_log


def _route_grad_terms(args: tuple, cot: torch.Tensor) -> torch.Tensor:
    """(T, k) float64: the magnitude of the terms each d top_k_weights sums, for a pair of
    expert e: sum over I of |g| |gate(pre)| with g = cot[t] @ down[e], plus sum over H of
    |cot[t]| |down_bias[e]| (0 at a sentinel slot). Rounding error grows with these, not
    with their sum, which cancels (``assert_matches``' ``scale``)."""
    x, ids, _, w1, b1, w2, b2, act, gated, transposed, interleaved, alpha, limit = args
    e, k = w1.shape[0], ids.shape[1]
    terms = torch.zeros(ids.numel(), dtype=torch.float64, device=ids.device)
    for p, ex in enumerate(ids.reshape(-1).tolist()):  # values only: no graph
        if 0 <= ex < e:
            t = p // k
            pre = M._linear(x[t].detach().double(), w1[ex].detach().double(),
                            None if b1 is None else b1[ex].detach().double(), transposed)
            y = M.apply_gate(pre[None], act, gated, interleaved, alpha, limit)[0]
            d, c = w2[ex].detach().double(), cot[t].detach().double()
            g = d @ c if transposed else c @ d
            bias = 0 if b2 is None else (c.abs() * b2[ex].detach().double().abs()).sum()
            terms[p] = (g.abs() * y.abs()).sum() + bias
    return terms.view(ids.shape)


def _pre_bf16(args: tuple) -> bool:
    """Whether the forward saves ``pre`` (and the split dgrad2's g) in bf16 for ``args``
    (``moe_experts.pre_dtype``): d top_k_weights then carries their rounding, as HF's bf16
    autograd does, and is measured against its terms (:func:`_route_grad_terms`)."""
    return TM.pre_dtype(args[0].dtype, args[8], args[12]) == torch.bfloat16


def run_case(case_id: str, seed: int, device: str = "cpu") -> None:
    """One case: every gradient vs the float64 reference's, inputs untouched; on a device,
    a second backward bit-identical. A case with ``pre_bf16`` (``replay_training``) runs with
    ``moe_experts.PRE_BF16`` (``REPLAY_TRAINING``) so set."""
    c = CASES[case_id.rsplit("/", 1)[0]]
    flags = {flag: c[key] for key, flag in (("pre_bf16", "PRE_BF16"), ("replay_training", "REPLAY_TRAINING"))
             if key in c}
    old = {flag: getattr(TM, flag) for flag in flags}
    for flag, value in flags.items():
        setattr(TM, flag, value)
    try:
        return _run_case(case_id, seed, device)
    finally:
        for flag, value in old.items():
            setattr(TM, flag, value)


def _run_case(case_id: str, seed: int, device: str) -> None:
    name, dname = case_id.rsplit("/", 1)
    c = CASES[name]
    dtype = getattr(torch, dname)
    torch.manual_seed(seed ^ zlib.crc32(case_id.encode()))
    args = _special(make(*c["dims"], dtype, device, **c["opts"]), c.get("special"))
    specials = set((c.get("special") or "").split("+"))
    e, limit = args[3].shape[0], args[12]
    if c.get("clamps") or "ties" in specials:  # the case reaches what it is about
        pre = _pre(args)
        gate, up = _halves(args, pre) if args[8] else (pre, pre)
        if math.isfinite(limit):
            hit = ((gate > limit).any() and (up.abs() > limit).any()) if c.get("clamps") else \
                ((gate == limit).any() and (up.abs() == limit).any())
        else:
            hit = (pre == 0).any()
        assert hit, "the inputs do not reach the clamp (or tie) this case is about"
    names = c.get("requires", GRAD_ARGS)
    args = _requires(args, names)
    args64 = _requires(tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args), names)
    leaves = [a for n, a in zip(ARGS, args) if n in names and a is not None]
    leaves64 = [a for n, a in zip(ARGS, args64) if n in names and a is not None]
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    before = [a.detach().clone() for a in inputs]
    assert TM.why_not_fused(*args) is None
    configs = c.get("configs")
    grouped = _grouped_wgrad(args, configs)
    grouped1 = _grouped_dgrad1(args, configs)
    fwd_rows_log: list[dict[str, Any]] | None = []
    act_log: list[dict[str, Any]] = []  # GEMM1's gate as its own pass: GEMM1 ran on torch._grouped_mm
    if c.get("replay_training"):
        # a first call fills the configs' memo; the second is keyed for a replay (recorded
        # there, or replayed where a case of the same spec recorded it first). A replayed
        # call runs none of the Python path: no launches to log
        TB.FusedExperts.apply(*args, configs)
        out = TB.FusedExperts.apply(*args, configs)
        spec = TM.spec_of(*args)
        assert any(k[0] == spec and k[1] for k in TM._PLANS.memo), "the saving forward did not reach the replay"
        fwd_rows_log = None
    else:
        # the forward's launches logged: its Python path (REPLAY_TRAINING off for this call;
        # the second backward below runs the default, the replay where it applies)
        kernels, replaying = (TM._sorted_rows_kernel, TM._act_kernel), TM.REPLAY_TRAINING
        TM._sorted_rows_kernel, TM._act_kernel = _Launches(kernels[0], fwd_rows_log), _Launches(kernels[1], act_log)
        TM.REPLAY_TRAINING = False
        try:
            out = TB.FusedExperts.apply(*args, configs)
        finally:
            TM._sorted_rows_kernel, TM._act_kernel = kernels
            TM.REPLAY_TRAINING = replaying
    if "gemm1_grouped" in c:
        assert len(act_log) == int(c["gemm1_grouped"]), f"GEMM1's gate pass ran {len(act_log)} times"
    want = M.reference(*args64)
    assert_matches(out, want, dtype)
    cot = torch.randn(want.shape, dtype=torch.float64, device=device)
    # expanded upstream gradients, made in the op's dtype (.to(dtype) of the same dtype is
    # the view itself; from float64 it would be a contiguous copy)
    if "strided" in specials:  # a row broadcast, strides (0, 1)
        cot = torch.randn((1, want.shape[1]), dtype=dtype, device=device).expand(want.shape)
        assert cot.to(dtype).stride() == (0, 1)
    if "sum_grad" in specials:  # one value everywhere, strides (0, 0), as out.sum()'s
        cot = torch.randn((1, 1), dtype=dtype, device=device).expand(want.shape)
        assert cot.to(dtype).stride() == (0, 0)
    # Kernels that must not launch, and the weight gradients' path, seen from its calls.
    mm_calls: list[int] = []
    wgrad_log: list[dict[str, Any]] = []
    rows_log: list[dict[str, Any]] = []
    patch: dict[tuple[Any, str], Any] = {}
    if hasattr(torch, "_grouped_mm"):
        patch[(torch, "_grouped_mm")] = _counted(torch._grouped_mm, mm_calls)
    assert grouped or not c.get("grouped"), "a grouped_mm case whose weight gradients would not use it"
    assert grouped1 or not c.get("grouped1"), "a grouped_mm case whose GEMM1 dgrad would not use it"
    if grouped:
        patch[(TB, "_moe_wgrad")] = _Launches(TB._moe_wgrad, wgrad_log)
        patch[(TM, "_sorted_rows_kernel")] = _Launches(TM._sorted_rows_kernel, rows_log)
    for path in c.get("forbid", ()):
        patch[(TB, path[3:]) if path.startswith("TB.") else (TM, path[3:])] = _Forbidden(path)
    originals = {key: getattr(*key) for key in patch}
    for (mod, attr), fn in patch.items():
        setattr(mod, attr, fn)
    try:
        got = torch.autograd.grad(out, leaves, cot.to(dtype))
    finally:
        for (mod, attr), fn in originals.items():
            setattr(mod, attr, fn)
    _check_wgrad_path(grouped, grouped1, names, args, mm_calls, wgrad_log, rows_log, fwd_rows_log, configs)
    # The reference's cotangent is the one the op got (rounded to dtype): a fp16 rounding of
    # cot alone moved d top_k_weights' dot over H by > 0.002 of its size where it cancels
    # (T = 1, float16: 3 of 200 seeds, with or without TMA loads).
    ref = torch.autograd.grad(want, leaves64, cot.to(dtype).double())
    if "pre" in c:  # the saved pre-activation's dtype, as moe_experts.pre_dtype picks it
        n1 = args[3].shape[2] if args[9] else args[3].shape[1]
        keep = TB.keeps_rows(args[0], n1, args[8], "gate_up_proj" in names, configs)  # as FusedExperts asks
        _, saved = TM.fused_experts_forward(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                            configs=configs, save=True, keep_rows=keep)
        assert saved.pre.dtype == c["pre"], saved.pre.dtype
    for n, g, r, a in zip([n for n, a in zip(ARGS, args) if n in names and a is not None], got, ref, leaves):
        try:
            assert g.shape == a.shape
            scale = None
            if n == "top_k_weights" and _pre_bf16(args):
                scale = _route_grad_terms(args64, cot.to(dtype))
            assert_matches(g, r, a.dtype, scale)
        except AssertionError as err:
            raise AssertionError(f"d {n}: {err}") from None
    if "skip_expert" in specials:  # never run: exact zeros
        grads = dict(zip([n for n, a in zip(ARGS, args) if n in names and a is not None], got))
        for n in ("gate_up_proj", "gate_up_bias", "down_proj", "down_bias"):
            if n not in grads:  # no bias
                continue
            assert torch.equal(grads[n][2], torch.zeros_like(grads[n][2])), f"d {n}[2] is not zero"
    if specials & {"nan", "all_out"}:  # d top_k_weights is exactly 0 at a sentinel slot
        drw = got[[n for n in ARGS if n in names].index("top_k_weights")]
        assert torch.equal(drw[args[1] >= e], torch.zeros_like(drw[args[1] >= e]))
    for b, a in zip(before, inputs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg="an input was modified")
    if "requires" in c:  # the backward hands back only what is asked for
        _, saved = TM.fused_experts_forward(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                            configs=configs, save=True)
        needs = tuple(n in names for n in GRAD_ARGS)
        grads = TB.fused_experts_backward(cot.to(dtype), *args, saved, needs=needs, configs=configs)
        assert [g is not None for g in grads] == list(needs), [g is not None for g in grads]
    if device != "cpu":
        again = torch.autograd.grad(TB.FusedExperts.apply(*args, configs), leaves, cot.to(dtype))
        assert all(torch.equal(a, b) for a, b in zip(got, again)), "two backward runs differ"


def _fix_interpreter_bfloat16() -> None:
    """Make Triton's interpreter (3.8) compute bfloat16 as the GPU does, for the grouped_mm
    cases (the only bfloat16 ones here). It keeps a bf16 tensor as its uint16 bits, and (1)
    ``tl.dot`` multiplies those bits as integers (2.7e10 off on a 16x16 product), (2) an
    fp32 -> bf16 cast truncates (1 ulp off torch's round-to-nearest-even, which the GPU's
    cvt.rn does). Fixed: dot operands widened to fp32 first (exact; the products and the
    fp32 sum then are what an MMA computes), and the cast done by torch. Other dtypes, and
    everything else the interpreter does, are left alone."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = getattr(interp, "InterpreterBuilder", None)
    if (builder is None or not hasattr(builder, "create_dot") or not hasattr(builder, "cast_impl")
            or interp._get_np_dtype(tl.bfloat16) != np.dtype(np.uint16)):
        return  # another interpreter: its bfloat16 cases pass or fail on its own arithmetic
    dot, cast = builder.create_dot, builder.cast_impl

    def widen(h: Any) -> Any:
        if h.dtype != tl.bfloat16:
            return h
        return interp.TensorHandle((np.asarray(h.data).astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, *rest: Any) -> Any:
        return dot(self, widen(a), widen(b), *rest)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype == tl.float32 and dst_type.scalar == tl.bfloat16:
            bf = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(bf.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl


def _child_main() -> None:
    _fix_interpreter_bfloat16()
    interpreter_child(CASE_IDS, run_case)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return interpreter_verdicts(tmp_path_factory, __file__, "triton-interpreter-backward")


@needs_triton
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_interpreted(case_id: str, interpreted: dict[str, str]) -> None:
    assert interpreted.get(case_id) == "ok", interpreted.get(case_id, "not run")


# ------------------------------------------------------------------ in process

@needs_triton
def test_config_table_has_the_backward() -> None:
    for gemm in ("dgrad2", "dgrad1", "wgrad"):
        for rows in (1, 30, 200, 5000):
            cfg = TM.pick_config(gemm, rows, 1536, 2048, torch.bfloat16, block_m=None if gemm == "wgrad" else 64)
            assert cfg["BLOCK_N"] > 0 and cfg["BLOCK_K"] >= 16 and cfg["BLOCK_M"] >= 16


@needs_triton
def test_clamp_ties_are_torchs() -> None:
    gate_tie, lo_tie, hi_tie = TB.clamp_ties()
    x = torch.tensor([0.5, 0.5], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(M.apply_gate(x[None], "silu", True, False, 1.0, 0.5).sum(), x)
    assert (g[0] != 0) == gate_tie and (g[1] != 0) == hi_tie
    y = torch.tensor([0.5, -0.5], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(M.apply_gate(y[None], "silu", True, False, 1.0, 0.5).sum(), y)
    assert (g[1] != 0) == lo_tie


@needs_triton
def test_fused_experts_off_cuda_runs_grouped() -> None:
    """fused_experts (the training entry) takes the differentiable grouped path where the
    kernels don't run (here: CPU, float64), with the reference's gradients."""
    args = _requires(make(6, 2, 16, 8, 4, torch.float64, "cpu", bias=True), GRAD_ARGS)
    assert TM.why_not_fused(*args) is not None
    leaves = [a for n, a in zip(ARGS, args) if n in GRAD_ARGS]
    cot = torch.randn(6, 16, dtype=torch.float64)
    got = torch.autograd.grad(TB.fused_experts(*args), leaves, cot)
    want = torch.autograd.grad(M.reference(*args), leaves, cot)
    for g, w in zip(got, want):
        assert_matches(g, w, torch.float64)


@needs_triton
def test_grouped_mm_wgrad_choice() -> None:
    """Where the weight gradients may run on torch._grouped_mm: bf16 with 16-byte rows
    only; by default on sm90 CUDA only (so never here, on the CPU); forced onto it where
    it can't run, the backward raises before it launches anything."""
    x = torch.zeros(4, 40, dtype=torch.bfloat16)
    assert TB.grouped_mm_unfit(x, 48, 24) is None or not hasattr(torch, "_grouped_mm")
    for dtype in (torch.float16, torch.float32):
        assert "not bfloat16" in TB.grouped_mm_unfit(x.to(dtype), 48, 24)
    assert "multiples of 8" in TB.grouped_mm_unfit(torch.zeros(4, 20, dtype=torch.bfloat16), 48, 24)
    assert "multiples of 8" in TB.grouped_mm_unfit(x, 36, 18)
    assert not TB.grouped_mm_wgrad_default(x, 48, 24)  # CPU
    # GEMM1's dgrad reads gate_up_proj: one of its last two dims contiguous, 16-byte aligned
    w1 = torch.randn(3, 48, 80, dtype=torch.bfloat16)
    if hasattr(torch, "_grouped_mm"):
        assert TB.grouped_mm_unfit(x, 48, 24, w1[:, :, :40]) is None
        assert TB.grouped_mm_unfit(x, 48, 24, w1[:, :, :40].transpose(1, 2).contiguous().transpose(1, 2)) is None
        assert "strides" in TB.grouped_mm_unfit(x, 48, 24, w1[:, :, ::2])
        assert "strides" in TB.grouped_mm_unfit(x, 48, 24, w1[:, :, 1:41])  # a 2-byte offset
    assert not TB.grouped_mm_dgrad1_default(x, w1[:, :, :40], 48, 24)  # CPU
    args = make(4, 2, 40, 24, 3, torch.float16, "cpu")
    saved = TM.Saved(sorted_pair_ids=torch.full((16,), 8, dtype=torch.int32),
                     block_expert=torch.full((1,), -1, dtype=torch.int32),
                     tables=torch.zeros((3, 3), dtype=torch.int32), act=torch.zeros(16, 24, dtype=torch.float16),
                     pre=torch.zeros(16, 48), configs={"gemm1": dict(SMALL["gemm1"])})
    for gemm in ("wgrad", "dgrad1"):
        with pytest.raises(ValueError, match=f"{gemm}.*GROUPED_MM.*not bfloat16"):
            TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.float16), *args, saved,
                                      configs={gemm: {"GROUPED_MM": 1}})
    # PERSISTENT where the kernel that runs has no such mode: an error, not a silent no-op
    bf16 = make(4, 2, 40, 24, 3, torch.bfloat16, "cpu")
    for gemm, other in (("dgrad2", {"SPLIT": 0}), ("dgrad1", {"GROUPED_MM": 1})):
        with pytest.raises(ValueError, match=f"{gemm}.*PERSISTENT"):
            TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.bfloat16), *bf16, saved,
                                      configs={gemm: {"PERSISTENT": 1, **other}})
    # HALF_TAIL likewise: the forward's GEMM's, not persistent, BLOCK_M >= 32
    for gemm, other in (("dgrad2", {"SPLIT": 0}), ("dgrad1", {"GROUPED_MM": 1}), ("wgrad", {})):
        with pytest.raises(ValueError, match=f"{gemm}.*HALF_TAIL"):
            TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.bfloat16), *bf16, saved,
                                      configs={gemm: {"HALF_TAIL": 1, **other}})
    with pytest.raises(ValueError, match="dgrad1.*HALF_TAIL needs PERSISTENT = 0"):
        TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.bfloat16), *bf16, saved,
                                  configs={"dgrad1": {"HALF_TAIL": 1, "PERSISTENT": 1, "GROUPED_MM": 0}})
    # SUBTILE: the fused dgrad2 kernel's, 2 or 4 slices at least 8 wide; elsewhere an error
    for bad in ({"SPLIT": 1, "SUBTILE": 2}, {"SUBTILE": 3}, {"BLOCK_N": 16, "SUBTILE": 4}):
        with pytest.raises(ValueError, match="dgrad2.*SUBTILE"):
            TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.bfloat16), *bf16, saved,
                                      configs={"dgrad2": {**SMALL_BWD["dgrad2"], **bad}})
    for bad in ({"GATE_GROUPS": 2}, {"SPLIT": 1, "GATE_GROUPS": 0}):  # the split gate pass's only
        with pytest.raises(ValueError, match="dgrad2.*GATE_GROUPS"):
            TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.bfloat16), *bf16, saved,
                                      configs={"dgrad2": {**SMALL_BWD["dgrad2"], **bad}})
    # GEMM2's dgrad on torch._grouped_mm: the split path's, not persistent, g bf16 as pre
    # (saved here in float32)
    for bad, why in (({"GROUPED_MM": 1}, "SPLIT = 1"), ({"SPLIT": 1, "PERSISTENT": 1, "GROUPED_MM": 1}, "SPLIT = 1"),
                     ({"SPLIT": 1, "GROUPED_MM": 1}, "pre is saved in torch.float32")):
        with pytest.raises(ValueError, match=f"dgrad2.*GROUPED_MM.*{why}"):
            TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.bfloat16), *bf16, saved,
                                      configs={"dgrad2": {**SMALL_BWD["dgrad2"], **bad}})
    with pytest.raises(ValueError, match="dgrad2.*GROUPED_MM.*not bfloat16"):
        TB.fused_experts_backward(torch.zeros(4, 40, dtype=torch.float16), *args, saved,
                                  configs={"dgrad2": {**SMALL_BWD["dgrad2"], "SPLIT": 1, "GROUPED_MM": 1}})
    # GEMM1 on torch._grouped_mm: a training forward's, over the kept rows, bf16 pre, no
    # gate_up_bias; forced where it can't, an error that says why
    bias16 = make(4, 2, 40, 24, 3, torch.bfloat16, "cpu", bias=True)
    nobias = sub(bias16, gate_up_bias=None)
    for a, kw, why in ((nobias, {}, "keep_rows"), (nobias, {"save": True}, "keep_rows"),
                       (bias16, {"save": True, "keep_rows": True}, "gate_up_bias"),
                       (args, {"save": True, "keep_rows": True}, "not bfloat16")):
        with pytest.raises(ValueError, match=f"gemm1.*GROUPED_MM.*{why}"):
            TM.fused_experts_forward(*a, configs={"gemm1": {**SMALL["gemm1"], "GROUPED_MM": 1}}, **kw)
    # a forward GEMM's config is given whole: a partial one names what it lacks
    for gemm in ("gemm1", "gemm2"):
        with pytest.raises(ValueError, match=f"{gemm}.*lacks.*BLOCK_N"):
            TM.fused_experts_forward(*nobias, configs={gemm: {"GROUPED_MM": 1}}, save=True, keep_rows=True)


# ------------------------------------------------------------------ CUDA

needs_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
CUDA_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BIGGER = {"decode": (4, 8, 256, 128, 64), "prefill": (512, 4, 256, 192, 16), "many rows": (2048, 2, 128, 96, 8)}
BIG_FAMILIES = ("mixtral silu", "gpt_oss biases", "relu2 ungated", "gelu interleaved bias")


def _big_args(shape: str, family: str, dtype: torch.dtype) -> tuple:
    args = make(*BIGGER[shape], dtype, "cuda", **{**FAMILIES[family][1], "sentinels": 3})
    return _requires(_special(_clear_limit(args), "nan"), GRAD_ARGS)


def _clear_limit(args: tuple, *scales: dict[str, torch.Tensor]) -> tuple:
    """``args`` with a finite clamp limit moved to the middle of the widest gap between the
    float64 pre-activations it is compared with (gate values, |up| values), within 25 % of
    the drawn one, so as many values still clip. The kernels' pre-activations differ
    from float64's by their fp32 accumulation (~1e-6 here); a value within that of the
    limit clips in one and not the other, and its gradient is then 0 in one and the whole
    element in the other (the H200, 2026-12-02: 2 of 12 gpt_oss cases at these sizes,
    fp32 and bf16, a whole element off). The widest gap among ~10^5 values is ~1e-4 wide.

    ``scales``: other value sets the same limit must be clear of, each as factors by which
    named arguments get multiplied (the CUDA-graph test replays on inputs rescaled in place;
    a limit cleared for the captured values alone was 2e-3 off in fp32 there, the H200,
    2026-12-02)."""
    limit = args[12]
    if not math.isfinite(limit) or not args[8]:
        return args
    vals = []
    for factors in ({}, *scales):
        x, ids, _, w1, b1 = (a * factors[n] if n in factors else a for n, a in zip(ARGS[:5], args[:5]))
        flat, k, transposed = ids.reshape(-1), ids.shape[1], args[9]
        for ex in range(w1.shape[0]):
            pairs = (flat == ex).nonzero().squeeze(1)
            w = w1[ex].double()
            y = x[pairs // k].double() @ (w if transposed else w.T)
            gate, up = _halves(args, y if b1 is None else y + b1[ex].double())
            vals += [gate.flatten(), up.abs().flatten()]
    v = torch.cat(vals).sort().values
    v = v[(v > limit / 1.25) & (v < limit * 1.25)]
    j = int((v[1:] - v[:-1]).argmax())
    return sub(args, limit=float(v[j] + v[j + 1]) / 2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype,pre_bf16", [(d, d == torch.bfloat16) for d in CUDA_DTYPES] + [(torch.bfloat16, False)],
                         ids=lambda v: str(v) if isinstance(v, torch.dtype) else ("pre_bf16" if v else "pre_fp32"))
@pytest.mark.parametrize("family", BIG_FAMILIES)
@pytest.mark.parametrize("shape", list(BIGGER))
def test_cuda_gradients(shape: str, family: str, dtype: torch.dtype, pre_bf16: bool,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gradient at moderate shapes (every config bucket), default configs, vs float64,
    with ``moe_experts.PRE_BF16`` on (the default) and off for bf16: where the saved ``pre``
    is bf16 (:func:`_pre_bf16`; a clamp keeps it float32), d top_k_weights against its terms."""
    monkeypatch.setattr(TM, "PRE_BF16", pre_bf16)
    args = _big_args(shape, family, dtype)
    args64 = _requires(tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args), GRAD_ARGS)
    names = [n for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
    leaves = [a for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
    leaves64 = [a for n, a in zip(ARGS, args64) if n in GRAD_ARGS and a is not None]
    monkeypatch.setattr(TM, "new_buffer", _nan_buffer)
    out = TB.FusedExperts.apply(*args)
    want = M.reference(*args64)
    # the reference's cotangent is the one the op gets (rounded to dtype), as run_case's
    cot = torch.randn_like(want).to(dtype)
    got = torch.autograd.grad(out, leaves, cot)
    _, saved = TM.fused_experts_forward(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args), save=True)
    assert (saved.pre.dtype == torch.bfloat16) == _pre_bf16(args), saved.pre.dtype
    assert_matches(out, want, dtype)
    for n, g, r, a in zip(names, got, torch.autograd.grad(want, leaves64, cot.double()), leaves):
        scale = _route_grad_terms(args64, cot) if n == "top_k_weights" and _pre_bf16(args) else None
        try:
            assert_matches(g, r, a.dtype, scale)
        except AssertionError as err:
            raise AssertionError(f"d {n}: {err}") from None


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", [c.replace("float32", "bfloat16") for c in CASE_IDS if c.endswith("float32")]
                         + [c for c in CASE_IDS if CASES[c.rsplit("/", 1)[0]].get("grouped")
                            or CASES[c.rsplit("/", 1)[0]].get("grouped1") or "pre_bf16" in CASES[c.rsplit("/", 1)[0]]])
def test_cuda_cases(case_id: str) -> None:
    """The interpreted cases, compiled, in bfloat16, and a second backward bit-identical
    (the weight gradients on torch._grouped_mm where that is the default, sm90, or forced)."""
    old = TM.new_buffer
    TM.new_buffer = _nan_buffer
    try:
        run_case(case_id, 0, "cuda")
    finally:
        TM.new_buffer = old


REPLAY_TRAINED = {"prefill fp32": ("prefill", "gpt_oss biases", torch.float32),
                  "prefill bf16": ("prefill", "mixtral silu", torch.bfloat16),
                  "many rows": ("many rows", "relu2 ungated", torch.bfloat16),
                  "gluon gemm1": ((512, 4, 256, 128, 8), "mixtral silu", torch.bfloat16)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("buffers", ["nan", "pooled"])
@pytest.mark.parametrize("case", list(REPLAY_TRAINED))
def test_cuda_replay_training(case: str, buffers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``moe_experts.REPLAY_TRAINING``: a forward that saves for the backward replayed
    (backends/triton/replay.py, its result the output and :class:`Saved`'s tensors) gives the
    Python path's output and every gradient bit for bit, on new inputs each call (new
    addresses, routing, values, cotangent); on triton 3.6 an fp32 case (no GEMM1 on
    torch._grouped_mm, which a plan can't hold) is replayed from a plan. ``buffers``: NaN-filled,
    or the library's own (the scratch carved from one allocation)."""
    import triton

    from opreg.backends.triton import replay
    monkeypatch.setattr(TM, "REPLAY_TRAINING", True)
    if buffers == "nan":
        monkeypatch.setattr(TM, "new_buffer", _nan_buffer)
    shape, family, dtype = REPLAY_TRAINED[case]

    def fresh() -> tuple:
        if isinstance(shape, tuple):
            return _requires(make(*shape, dtype, "cuda", **{**FAMILIES[family][1], "sentinels": 1}), GRAD_ARGS)
        return _big_args(shape, family, dtype)

    def step(args: tuple, cot: torch.Tensor, on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(TM, "REPLAY", on)
        leaves = [a for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
        out = TB.FusedExperts.apply(*args)
        return [out.detach(), *torch.autograd.grad(out, leaves, cot)]

    for n in range(4):
        args = fresh()
        cot = torch.randn(args[0].shape, dtype=dtype, device="cuda")
        want, got = step(args, cot, False), step(args, cot, True)
        for j, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(_bits(a), _bits(b)), f"call {n}: {'output' if j == 0 else f'gradient {j}'} differs"
    spec = TM.spec_of(*args)
    plans = [v for k, v in TM._PLANS.memo.items() if k[0] == spec and k[1]]
    assert plans, "the saving forward was not keyed for a replay"
    if triton.__version__.startswith("3.6.") and dtype == torch.float32:
        assert type(plans[0]) is replay.Plan and not plans[0].single, f"no plan: {plans[0]}"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_deterministic(dtype: torch.dtype) -> None:
    for shape in BIGGER:
        for family in BIG_FAMILIES:
            args = _big_args(shape, family, dtype)
            leaves = [a for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
            cot = torch.randn(args[0].shape, dtype=dtype, device="cuda")
            first = torch.autograd.grad(TB.FusedExperts.apply(*args), leaves, cot)
            second = torch.autograd.grad(TB.FusedExperts.apply(*args), leaves, cot)
            for a, b in zip(first, second):
                assert torch.equal(a, b), f"{shape} {family}: two backward runs differ"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", BIG_FAMILIES)
@pytest.mark.parametrize("shape", list(BIGGER))
@pytest.mark.parametrize("gemm", list(GROUPED_PATHS))
def test_cuda_grouped_mm(gemm: str, shape: str, family: str) -> None:
    """bf16: the weight gradients (``gemm`` "wgrad") or GEMM1's dgrad ("dgrad1") on
    torch._grouped_mm (CUTLASS; the sm90 default) and on Triton both match float64 and each
    other; every other gradient is the same bits either way (the same kernels; the other
    GEMM pinned to Triton); two grouped runs are bit-identical. NaN-filled buffers: a
    sorted row left unwritten, one read past offs[-1], or a pair's row missed by
    pair_rows, fails."""
    args = _big_args(shape, family, torch.bfloat16)
    w1, gated, transposed = args[3], args[8], args[9]
    n1 = w1.shape[2] if transposed else w1.shape[1]
    i = n1 // 2 if gated else n1
    if (why := TB.grouped_mm_unfit(args[0], n1, i, w1)) is not None:
        pytest.skip(why)
    default = (TB.grouped_mm_wgrad_default(args[0], n1, i) if gemm == "wgrad"
               else TB.grouped_mm_dgrad1_default(args[0], w1, n1, i))
    assert default == (torch.cuda.get_device_capability()[0] == 9)
    affected, per_grad = GROUPED_PATHS[gemm]
    on_it = [n for n, a in zip(ARGS, args) if n in affected and a is not None]
    expected = len(on_it) if per_grad else int(bool(on_it))
    # CUTLASS's weight gradients (GLUON 0): test_cuda_gluon_wgrad_backward has the Gluon kernel's
    _two_paths(args, lambda g: {gm: {"GROUPED_MM": int(g and gm == gemm), **({"GLUON": 0} if gm == "wgrad" else {})}
                                for gm in GROUPED_PATHS},
               lambda g: g * expected, on_it, f"{gemm} GROUPED_MM")


def _two_paths(args: tuple, configs_of: Callable[[int], dict], calls_of: Callable[[int], int], on_it: list[str],
               label: str) -> None:
    """bf16 forward + backward on two paths, runs 1, 0, 1 with ``configs_of(run)``, every buffer
    NaN-filled, ``torch._grouped_mm`` counted (``calls_of(run)`` calls): both match float64, the
    gradients ``on_it`` names match each other, every other gradient is the same bits either
    way, and path 1's two runs are bit-identical."""
    names = [n for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
    leaves = [a for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
    cot = torch.randn(args[0].shape, dtype=torch.bfloat16, device="cuda")
    runs: dict[int, list[tuple[torch.Tensor, ...]]] = {1: [], 0: []}
    calls: list[int] = []
    old, old_mm = TM.new_buffer, torch._grouped_mm
    TM.new_buffer, torch._grouped_mm = _nan_buffer, _counted(torch._grouped_mm, calls)
    try:
        for g in (1, 0, 1):
            calls.clear()
            out = TB.FusedExperts.apply(*args, configs_of(g))
            runs[g].append(torch.autograd.grad(out, leaves, cot))
            assert len(calls) == calls_of(g), f"{label}={g}: torch._grouped_mm ran {len(calls)} times"
    finally:
        TM.new_buffer, torch._grouped_mm = old, old_mm
    (first, again), (other,) = runs[1], runs[0]
    args64 = _requires(tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args), GRAD_ARGS)
    leaves64 = [a for n, a in zip(ARGS, args64) if n in GRAD_ARGS and a is not None]
    ref = torch.autograd.grad(M.reference(*args64), leaves64, cot.double())
    for n, g, t, a, r in zip(names, first, other, again, ref):
        assert torch.equal(g, a), f"d {n}: two {label}=1 runs differ"
        assert g.shape == t.shape and g.is_contiguous(), f"d {n}: {tuple(g.shape)}, {g.stride()}"
        assert_matches(g, r, torch.bfloat16)
        assert_matches(t, r, torch.bfloat16)
        if n in on_it:
            assert_matches(g, t.double(), torch.bfloat16)
        else:
            assert torch.equal(g, t), f"d {n} differs between {label} 1 and 0"


def _gluon_wgrad_module() -> Any:
    """:mod:`moe_wgrad_gluon` where the GPU is sm90 and triton has Gluon, else skip."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon weight gradients need sm90")
    return pytest.importorskip("opreg.backends.triton.moe_wgrad_gluon")


# (rows of each expert, M, N): empty experts first, in the middle and last, 1-63-row tails,
# runs not starting on a 64-row boundary, fewer rows in all than one step (S < 64), an
# expert longer than the ring (5 stages x 64 rows), E = 1
GLUON_CASES = {"empties and tails": ([0, 1, 63, 64, 65, 0, 127, 200, 0], 256, 128),
               "fewer rows than a step": ([5, 0, 20, 7], 128, 384),
               "long runs": ([700, 333, 0, 1100], 128, 256),
               "one expert": ([129], 384, 128)}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("cooperative", [False, True])
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_cuda_gluon_wgrad_kernel(case: str, cooperative: bool) -> None:
    """:func:`moe_wgrad_gluon.wgrad` against float64 per expert: every element of a
    NaN-filled output written, NaN rows past offs[-1] (the backward leaves them unwritten)
    reaching nothing, an empty expert exact zeros, every stage count, grids of one and three
    programs and of one a tile, the same bits every time, a CUDA graph replayed on new values;
    ping-pong and cooperative (N rounded up to its 256-wide tiles)."""
    G = _gluon_wgrad_module()
    counts, m, n = GLUON_CASES[case]
    if cooperative:
        n = -(-n // G.COOP_BLOCK_N) * G.COOP_BLOCK_N
    s = sum(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.full((s + 70, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    b = torch.full((s + 70, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    a[:s], b[:s] = torch.randn(s, m), torch.randn(s, n)
    want = torch.zeros(len(counts), m, n, dtype=torch.float64)
    ends = offs.tolist()
    for ex, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        want[ex] = a[lo:hi].double().cpu().T @ b[lo:hi].double().cpu()
    first = None
    # one program (every tile through both consumers in turn), three, one a tile (or an SM)
    for stages, programs in itertools.product((2, 3) if cooperative else (3, 4, 5), (1, 3, None)):
        out = torch.full((len(counts), m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = G.wgrad(a, b, offs, out=out, stages=stages, programs=programs, cooperative=cooperative)
        assert got is out
        assert_matches(got, want.cuda(), torch.bfloat16)
        for ex, c in enumerate(counts):
            if c == 0:
                assert torch.equal(got[ex], torch.zeros_like(got[ex])), f"expert {ex} has no rows: not zeros"
        if first is None:
            first = got.clone()
        assert torch.equal(got, first), f"stages={stages}, programs={programs}: not the first run's bits"
    assert torch.equal(G.wgrad(a, b, offs, cooperative=cooperative), first), "a second run differs"
    # captured in a CUDA graph, replayed on new values in place
    graph, _ = captured(lambda: G.wgrad(a, b, offs, out=out, cooperative=cooperative))
    a[:s].copy_(torch.randn(s, m))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for ex, (lo, hi) in enumerate(zip([0] + ends[:-1], ends)):
        want[ex] = a[lo:hi].double().cpu().T @ b[lo:hi].double().cpu()
    assert_matches(out, want.cuda(), torch.bfloat16)


def test_gluon_wgrad_rejects_what_it_cannot_take() -> None:
    """Bad operands: a ValueError naming the argument (checked before any launch, so on
    any machine); the default rule follows the rows per expert and the tiles' fit."""
    G = pytest.importorskip("opreg.backends.triton.moe_wgrad_gluon")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(256, 128, dtype=torch.bfloat16, device=dev)
    offs = torch.tensor([100, 256], dtype=torch.int32, device=dev)
    bad = [((a.cpu(), a.cpu()), "A is not a 2-D bf16 CUDA tensor")]
    if dev == "cuda":
        bad += [((a, a.half()), "B is not a 2-D bf16"), ((a, a[:, :96].contiguous()), r"multiples of \(128, 128\)"),
                ((a, a[:200]), "same rows"), ((a[:32], a[:32]), "at least 64"),
                ((a[:, :64].t(), a), "A is not contiguous")]
    for (x, y), needle in bad:
        with pytest.raises(ValueError, match=needle):
            G.wgrad(x, y, offs)
    if dev == "cuda" and G.unfit(a, a) is None:
        with pytest.raises(ValueError, match="offs"):
            G.wgrad(a, a, offs.long())
        with pytest.raises(ValueError, match="out"):
            G.wgrad(a, a, offs, out=torch.empty(2, 128, 64, dtype=torch.bfloat16, device=dev))
        with pytest.raises(ValueError, match="programs"):
            G.wgrad(a, a, offs, programs=0)
        with pytest.raises(ValueError, match=r"multiples of \(128, 256\)"):  # the cooperative tile's N
            G.wgrad(a, a, offs, cooperative=True)
        with pytest.raises(ValueError, match="stages"):  # 4 don't fit the cooperative kernel's shared memory
            G.wgrad(a, torch.randn(256, 256, dtype=torch.bfloat16, device=dev), offs, cooperative=True, stages=4)
    if TB._gluon_wgrad() is None:
        return
    rule = TB.gluon_wgrad_default
    assert rule(256, 2048, 1536, 768) == TB.GLUON_PINGPONG  # Qwen3-MoE at T = 4096
    assert rule(512, 2048, 2048, 1024) == TB.GLUON_PINGPONG  # OLMoE at T = 4096
    assert rule(1024, 2048, 8192, 4096) == rule(8192, 2048, 8192, 4096) == TB.GLUON_COOP  # Mixtral, T >= 4096
    assert rule(TB.GLUON_WGRAD_MIN_ROWS - 1, 2048, 1536, 768) == TB.GLUON_OFF
    assert rule(256, 2048, 192, 96) == TB.GLUON_OFF  # I = 96: no 128-wide tiles
    # I = 1408: 128-wide tiles only, so ping-pong up to its bound
    assert rule(TB.GLUON_WGRAD_MAX_ROWS, 2048, 2816, 1408) == TB.GLUON_PINGPONG
    assert rule(TB.GLUON_WGRAD_MAX_ROWS + 1, 2048, 2816, 1408) == TB.GLUON_OFF


@pytest.mark.parametrize("cooperative", [False, True])
def test_gluon_wgrad_compiles_for_sm90(cooperative: bool) -> None:
    """The Gluon kernels have no interpreter: on any machine, compile each for sm90 at the
    ring depths the wrapper takes by default (:func:`moe_wgrad_gluon.stages_for`; the
    cooperative kernel's :data:`COOP_STAGES`; no GPU needed, the CUDA cases run them), its
    shared memory within the H100's 232,448 bytes a block."""
    G = pytest.importorskip("opreg.backends.triton.moe_wgrad_gluon")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    bn, cm = (G.COOP_BLOCK_N, G.BLOCK_M // 2) if cooperative else (G.BLOCK_N, G.BLOCK_M)
    a_layout, b_layout, c_layout = G._layouts(bn, cm)
    sig = {"a_desc": f"tensordesc<bf16[{G.BLOCK_K}, {G.BLOCK_M}],{a_layout!r}>",
           "b_desc": f"tensordesc<bf16[{G.BLOCK_K}, {bn}],{b_layout!r}>",
           "c_desc": f"tensordesc<bf16[{cm}, {bn}],{c_layout!r}>",
           "offs_ptr": "*i32", "M": "i32", "N": "i32", "total_tiles": "i32",
           "STAGES": "constexpr", "CONSUMER_REGS": "constexpr", "LOADER_REGS": "constexpr"}
    depths = [G.COOP_STAGES] if cooperative else sorted({G.stages_for(1), G.stages_for(10 ** 6)})
    for stages in depths:
        consts = {"STAGES": stages, "CONSUMER_REGS": G.CONSUMER_REGS, "LOADER_REGS": G.LOADER_REGS}
        src = GluonASTSource(G.wgrad_coop_kernel if cooperative else G.wgrad_kernel, signature=sig,
                             constexprs=consts, attrs={(j,): [["tt.divisibility", 16]] for j in (3, 4, 5)})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert "wgmma" in kernel.asm["ptx"] and "setmaxnreg" in kernel.asm["ptx"]
        assert kernel.metadata.shared <= 232448, (stages, kernel.metadata.shared)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", BIG_FAMILIES)
@pytest.mark.parametrize("shape", ["sparse", "gluon"])
@pytest.mark.parametrize("kernel", [1, 2])
def test_cuda_gluon_wgrad_backward(kernel: int, shape: str, family: str) -> None:
    """bf16, the weight gradients on a Gluon kernel (``configs["wgrad"]["GLUON"]`` 1: ping-pong,
    2: cooperative) and on CUTLASS (0) both match float64 and each other, every other gradient
    the same bits, two Gluon runs bit-identical, torch._grouped_mm not called for them;
    NaN-filled buffers (the Gluon output's among them). Gluon where the tiles don't fit raises."""
    _gluon_wgrad_module()
    # "sparse": ~2 rows per expert, most experts empty; "gluon": ~96 rows per expert; I = 256
    # for the cooperative kernel's 256-wide tiles
    i = 128 * kernel
    sizes = {"sparse": (16, 8, 256, i, 64), "gluon": (384, 4, 256, i, 16)}[shape]
    args = _requires(_special(_clear_limit(make(*sizes, torch.bfloat16, "cuda", **{**FAMILIES[family][1],
                                                                                   "sentinels": 3})), "nan"),
                     GRAD_ARGS)
    _two_paths(args, lambda g: {"wgrad": {"GROUPED_MM": 1, "GLUON": kernel * g}, "dgrad1": {"GROUPED_MM": 0}},
               lambda g: 0 if g else 2, ["down_proj", "gate_up_proj"], "GLUON")
    # I = 96 (no 128-wide tiles), or 128 for the cooperative kernel
    unfit = _requires(make(64, 2, 256, 96 if kernel == 1 else 128, 4, torch.bfloat16, "cuda",
                           **FAMILIES[family][1]), GRAD_ARGS)
    with pytest.raises(ValueError, match="GLUON"):
        out = TB.FusedExperts.apply(*unfit, {"wgrad": {"GROUPED_MM": 1, "GLUON": kernel}})
        torch.autograd.grad(out, [a for n, a in zip(ARGS, unfit) if n in GRAD_ARGS and a is not None],
                            torch.randn_like(out))


def _graph_once(family: str, dtype: torch.dtype) -> None:
    raw = make(*BIGGER["prefill"], dtype, "cuda", **{**FAMILIES[family][1], "sentinels": 3})
    # the factors the replay's inputs get, drawn first: the limit must be clear of both sets
    factors = {n: 0.5 + torch.rand_like(a) for n, a in zip(ARGS, raw)
               if n in GRAD_ARGS and isinstance(a, torch.Tensor)}
    args = _requires(_special(_clear_limit(raw, factors), "nan"), GRAD_ARGS)
    leaves = [a for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
    named = [n for n, a in zip(ARGS, args) if n in GRAD_ARGS and a is not None]
    cot = torch.randn(args[0].shape, dtype=dtype, device="cuda")

    def step() -> list[torch.Tensor]:
        out = TB.FusedExperts.apply(*args)
        return [out, *torch.autograd.grad(out, leaves, cot)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capture (compilation, allocator)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for n, a in zip(named, leaves):
            a.mul_(factors[n])
        cot.mul_(0.5 + torch.rand_like(cot))
    graph.replay()
    torch.cuda.synchronize()
    args64 = _requires(tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args), GRAD_ARGS)
    leaves64 = [a for n, a in zip(ARGS, args64) if n in GRAD_ARGS and a is not None]
    want = M.reference(*args64)
    ref = [want, *torch.autograd.grad(want, leaves64, cot.double())]
    for g, r, a in zip(captured, ref, [args[0], *leaves]):
        assert_matches(g, r, a.dtype)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("family", BIG_FAMILIES)
def test_cuda_graph_forward_backward(family: str, dtype: torch.dtype) -> None:
    """Forward and backward captured in one CUDA graph; the inputs and the upstream
    gradient rescaled in place; replayed: the output and every gradient are the float64
    reference's on the new values."""
    _graph_once(family, dtype)


def _gpt_oss_leaves(dtype: torch.dtype) -> tuple[tuple, list, tuple, list]:
    """gpt_oss-with-biases inputs on CUDA, their gradient leaves, and float64 copies of both."""
    args = _big_args("prefill", "gpt_oss biases", dtype)
    args64 = _requires(tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in args), GRAD_ARGS)

    def leaves(a: tuple) -> list:
        return [t for n, t in zip(ARGS, a) if n in GRAD_ARGS and t is not None]

    return args, leaves(args), args64, leaves(args64)


@pytest.mark.cuda
@needs_cuda
def test_cuda_fused_experts_trains_and_double_backward() -> None:
    """``fused_experts`` (the public entry) with gradients on CUDA: FusedExperts' backward,
    right against float64; and a double backward (``create_graph``: the reference
    differentiated inside the backward) right too, never zeros or an error."""
    args, leaves, args64, leaves64 = _gpt_oss_leaves(torch.bfloat16)
    want = M.reference(*args64)
    cot = torch.randn_like(want)
    ref = torch.autograd.grad(want, leaves64, cot)
    out = TB.fused_experts(*args)
    assert type(out.grad_fn).__name__ == "FusedExpertsBackward", out.grad_fn
    assert_matches(out, want, torch.bfloat16)
    for g, r, a in zip(torch.autograd.grad(out, leaves, cot.to(out.dtype)), ref, leaves):
        assert_matches(g, r, a.dtype)
    # the double backward in fp32: its reference is differentiated in the input dtype
    args, leaves, args64, leaves64 = _gpt_oss_leaves(torch.float32)
    want = M.reference(*args64)
    cot = torch.randn_like(want)
    (r,) = torch.autograd.grad(want, [args64[0]], cot, create_graph=True)
    out = TB.fused_experts(*args)
    (g,) = torch.autograd.grad(out, [args[0]], cot.float(), create_graph=True)
    assert_matches(g, r, torch.float32)
    v = torch.randn_like(r)
    # d(dx)/d(down_bias) is 0: no graph reaches it (None from both, as allow_unused says)
    second64 = torch.autograd.grad((r * v).sum(), leaves64, allow_unused=True)
    second = torch.autograd.grad((g * v.float()).sum(), leaves, allow_unused=True)
    for s2, r2, a in zip(second, second64, leaves):
        if r2 is None:
            assert s2 is None or not bool(s2.any())
            continue
        assert s2 is not None
        assert_matches(s2, r2, a.dtype)
    assert any(s2 is not None and bool(s2.abs().sum() > 0) for s2 in second)


if __name__ == "__main__":
    _child_main()
