"""moe_experts' fused Triton forward (backends/triton/moe_experts.py).

Without a GPU the kernels run under Triton's interpreter on CPU tensors. The interpreter is
chosen when ``@triton.jit`` runs (at the kernels' import, in triton 3.6 and 3.8 alike), so
the interpreted cases run in ONE child process started with ``TRITON_INTERPRET=1`` (this
file run as a script): the pytest process and every other test file keep compiled kernels.
Each case is one pytest test reading the child's verdict. float32 and float16 only (the
interpreter's bfloat16 is wrong); bfloat16 runs on the GPU (``cuda``-marked tests).

Also in process: the config table, availability and the fallback to ``grouped``.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from typing import Any, Callable

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as the interpreter child: `python tests/test_moe_triton.py`
    sys.path.insert(0, HERE)

import _fresh as fresh  # noqa: E402
from _util import once_per_run  # noqa: E402
from test_moe_experts import FAMILIES, make, sub  # noqa: E402

import opreg  # noqa: E402
from opreg import registry  # noqa: E402
from opreg.ops import moe_experts as M  # noqa: E402
from opreg.ops import moe_experts_grouped as G  # noqa: E402
from opreg.testing import OpTestSuite, Sample, assert_matches  # noqa: E402

try:
    from opreg.backends.triton import moe_experts as TM
    from opreg.backends.triton import moe_routing as RT
    from opreg.backends.triton import moe_tiles as TT
except ImportError:  # pragma: no cover - the package itself imports without triton
    TM = RT = TT = None

HAVE_TRITON = TM is not None and TT.triton is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
GATES = ["silu", "gelu", "gelu_tanh", "relu", "relu2", "sigmoid"]

# Small blocks so that small shapes still have several M, N and K blocks, ragged edges and a
# GROUP_M swizzle with a partial last group.
SMALL = {"gemm1": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2),
         "gemm2": dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=3, num_warps=4, num_stages=2),
         "combine": dict(BLOCK_H=32, num_warps=4)}
PREGATHERED = {**SMALL, "gemm1": {**SMALL["gemm1"], "PREGATHER": 1}}
# A program per SM (4 under the interpreter) walking several tiles each, past ragged edges.
PERSISTENT = {**SMALL, "gemm1": {**SMALL["gemm1"], "PERSISTENT": 1}, "gemm2": {**SMALL["gemm2"], "PERSISTENT": 1}}
# Half a tile where a block's second half is padding (HALF_TAIL), in 32-row blocks: the
# cases' experts hold ~37 rows (a full block, then one of ~5) or ~10-20 (one block either way)
HALF = {**SMALL, "gemm1": {**SMALL["gemm1"], "BLOCK_M": 32, "HALF_TAIL": 1},
        "gemm2": {**SMALL["gemm2"], "HALF_TAIL": 1}}


# ------------------------------------------------------------------ interpreted cases

def _gate_cases() -> dict[str, dict]:
    """Every gate x {gated, not} x {transposed, not}; interleaved, biases and the limit vary
    along (each seen both ways)."""
    cases, n = {}, 0
    kinds = [(g, True) for g in GATES] + [(g, False) for g in GATES] + [(M.GPT_OSS, True)]
    for act, gated in kinds:
        for transposed in (False, True):
            n += 1
            opts = dict(activation=act, gated=gated, transposed=transposed, bias=n % 4 in (0, 1),
                        interleaved=gated and (n // 2) % 2 == 1)
            if act == M.GPT_OSS:
                opts.update(alpha=1.702, limit=1.5, gain=4.0)
            elif act == "silu" and transposed:
                opts.update(limit=0.7, gain=4.0)
            # fp32 on all; fp16 on a quarter (every layout and gate family once) and gpt_oss
            dtypes = ["float32", "float16"] if n % 4 == 1 or act == M.GPT_OSS else ["float32"]
            name = f"{act} {'gated' if gated else 'ungated'}{' transposed' if transposed else ''}"
            cases[name] = dict(dims=(6, 2, 40, 24, 3), opts=opts, dtypes=dtypes)
    return cases


# The decode kernels (T = 1, TM.decode_forward) over several K steps and column blocks.
DECODE_SMALL = {"decode": dict(UP_BLOCK_N=16, UP_BLOCK_K=16, UP_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=8, DOWN_WARPS=2,
                               num_stages=2)}
# The grouped decode kernels (GROUPED: per used expert, tl.dot's 16-wide tiles) over several
# K steps, column blocks and, past 16 pairs of one expert, row steps.
GROUPED_SMALL = {"decode": dict(DECODE_SMALL["decode"], DOWN_BLOCK_K=16, GROUPED=1)}


def _decode_cases() -> dict[str, dict]:
    """T = 1, the decode kernels: every gate x {gated, not} x {transposed, not} at the
    table's decode config (one K step at these sizes) or small blocks (ragged H and I, several
    K steps and column blocks), biases, interleaving and the limit varying along."""
    cases, n = {}, 0
    kinds = [(g, True) for g in GATES] + [(g, False) for g in GATES] + [(M.GPT_OSS, True)]
    for act, gated in kinds:
        for transposed in (False, True):
            n += 1
            opts = dict(activation=act, gated=gated, transposed=transposed, bias=n % 3 != 0,
                        interleaved=gated and n % 2 == 1)
            if act == M.GPT_OSS:
                opts.update(alpha=1.702, limit=1.5, gain=4.0)
            elif act == "silu":
                opts.update(limit=0.7, gain=4.0)
            small = n % 2 == 0
            dims = (1, 3, 50, 18, 5) if small else (1, 3, 40, 24, 5)
            name = f"decode {act} {'gated' if gated else 'ungated'}{' transposed' if transposed else ''}"
            cases[name] = dict(dims=dims, opts=opts, configs=DECODE_SMALL if small else None,
                               dtypes=["float32", "float16"] if n % 4 == 1 or act == M.GPT_OSS else ["float32"])
    return cases


CASES: dict[str, dict] = {
    **_gate_cases(),
    **_decode_cases(),
    "decode, sentinel NaN weight, negative id": dict(dims=(1, 4, 24, 16, 6), opts=dict(sentinels=2), special="nan",
                                                     configs=DECODE_SMALL),
    "decode, all slots sentinel": dict(dims=(1, 2, 16, 8, 4), opts={}, special="all_out"),
    "decode, strided inputs": dict(dims=(1, 4, 24, 16, 8), opts=dict(idx_dtype=torch.int32),
                                   special="strided columns"),
    # the decode kernels at T > 1 (pinned by a "decode" config): tokens share experts (6
    # tokens x top-3 of 4), so two programs read one expert's weights; sentinel slots
    "decode by default, 2 tokens": dict(dims=(2, 3, 40, 24, 4), opts=dict(bias=True, sentinels=1)),
    "decode, 6 tokens sharing experts": dict(dims=(6, 3, 40, 24, 4), opts=dict(bias=True, sentinels=2),
                                             configs=DECODE_SMALL),
    "decode, 8 tokens gpt_oss": dict(dims=(8, 2, 50, 18, 3), configs=DECODE_SMALL, dtypes=["float32"], opts=dict(
        activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True, alpha=1.702, limit=1.0, gain=3.0)),
    # grouped by expert: tokens sharing experts, sentinels, two row steps of one expert (20
    # tokens x top-2 of 2), every slot elsewhere, a NaN weight in a sentinel slot
    "grouped decode, 6 tokens sharing experts": dict(dims=(6, 3, 40, 24, 4), opts=dict(bias=True, sentinels=2),
                                                     configs=GROUPED_SMALL),
    "grouped decode, T=1 gelu interleaved": dict(dims=(1, 3, 40, 24, 5), configs=GROUPED_SMALL, opts=dict(
        activation="gelu", interleaved=True)),
    "grouped decode, 8 tokens gpt_oss": dict(dims=(8, 2, 50, 18, 3), configs=GROUPED_SMALL, opts=dict(
        activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True, alpha=1.702, limit=1.0, gain=3.0)),
    "grouped decode, two row steps, relu2 ungated": dict(dims=(20, 2, 40, 24, 2), configs=GROUPED_SMALL,
                                                         opts=dict(activation="relu2", gated=False, bias=True)),
    "grouped decode, 32 pairs per step, two steps": dict(dims=(40, 2, 24, 16, 2), opts=dict(bias=True),
                                                         configs={"decode": dict(GROUPED_SMALL["decode"], BLOCK_M=32)},
                                                         dtypes=["float32"]),
    # the pairs per step from the routing's shape (_grouped_rows): 70 pairs per expert, 64 a step
    "grouped decode, 64 pairs per step, two steps": dict(dims=(70, 2, 24, 16, 2), opts=dict(sentinels=3),
                                                         configs=GROUPED_SMALL, dtypes=["float32"]),
    "grouped decode, int32 ids, strided inputs": dict(dims=(5, 4, 24, 16, 8), configs=GROUPED_SMALL,
                                                      opts=dict(idx_dtype=torch.int32), special="strided"),
    "grouped decode, sentinel NaN weight, negative id": dict(dims=(4, 3, 24, 16, 4), opts=dict(sentinels=2),
                                                             special="nan", configs=GROUPED_SMALL),
    "grouped decode, all slots sentinel": dict(dims=(3, 2, 16, 8, 4), opts={}, special="all_out",
                                               configs=GROUPED_SMALL),
    # fewer programs than column tiles (WAVES: one per SM, 4 under the interpreter): each
    # walks several, over ragged edges
    "grouped decode, programs walking column tiles": dict(
        dims=(6, 3, 72, 40, 4), opts=dict(bias=True, sentinels=1, interleaved=True),
        configs={"decode": dict(GROUPED_SMALL["decode"], WAVES=1)}),
    "T=1, GEMM path": dict(dims=(1, 2, 24, 16, 4), opts=dict(bias=True), configs=SMALL),
    # ragged H, I (not multiples of any block), several blocks in M, N and K, swizzle groups
    "ragged small blocks": dict(dims=(9, 3, 40, 24, 3), opts=dict(bias=True), configs=SMALL, dtypes=["float32"]),
    "ragged gpt_oss small blocks": dict(dims=(21, 2, 50, 18, 3), configs=SMALL, opts=dict(
        activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True, alpha=1.702, limit=1.0, gain=3.0)),
    # the same through pointer loads only (TMA 0: the path where a tensor descriptor can't
    # walk the weights, e.g. on sm80 or with strides not 16-byte aligned)
    "ragged small blocks, pointer loads": dict(dims=(9, 3, 40, 24, 3), opts=dict(bias=True, transposed=True),
                                               configs={g: {**c, "TMA": 0} if g != "combine" else c for g, c in SMALL.items()},
                                               dtypes=["float32"]),
    # GEMM1 on a sorted copy of its rows (PREGATHER): its A through a tensor descriptor (the
    # interpreter's), or, with TMA 0, through pointers at the sorted rows
    "pregathered rows": dict(dims=(9, 3, 40, 24, 3), opts=dict(bias=True), configs=PREGATHERED),
    "pregathered rows, gpt_oss transposed": dict(dims=(21, 2, 50, 18, 3), configs=PREGATHERED, opts=dict(
        activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True, alpha=1.702, limit=1.0, gain=3.0)),
    "pregathered rows, pointer loads, sentinel NaN weight": dict(
        dims=(10, 3, 24, 16, 4), opts=dict(sentinels=4), special="nan", dtypes=["float32"],
        configs={**PREGATHERED, "gemm1": {**PREGATHERED["gemm1"], "TMA": 0}}),
    # persistent GEMMs: gathered and pregathered GEMM1, sentinels and an unused expert's rows
    "persistent tiles": dict(dims=(9, 3, 40, 24, 3), opts=dict(bias=True), configs=PERSISTENT),
    "persistent tiles, pregathered gpt_oss transposed": dict(
        dims=(21, 2, 50, 18, 3), opts=dict(activation=M.GPT_OSS, transposed=True, bias=True, alpha=1.702,
                                           limit=1.0, gain=3.0),
        configs={**PERSISTENT, "gemm1": {**PERSISTENT["gemm1"], "PREGATHER": 1}}),
    "persistent tiles, sentinel NaN weight": dict(dims=(10, 3, 24, 16, 4), opts=dict(sentinels=4), special="nan",
                                                  configs=PERSISTENT, dtypes=["float32"]),
    "persistent tiles, empty experts": dict(dims=(6, 2, 16, 8, 8), opts={}, special="skip_expert",
                                            configs=PERSISTENT, dtypes=["float32"]),
    # half tiles: gathered and pregathered GEMM1, pointer loads, sentinels, an empty expert
    "half tail blocks": dict(dims=(50, 3, 40, 24, 4), opts=dict(bias=True), configs=HALF),
    "half tail blocks, pregathered gpt_oss transposed": dict(
        dims=(50, 3, 50, 18, 4), opts=dict(activation=M.GPT_OSS, transposed=True, interleaved=True, bias=True,
                                           alpha=1.702, limit=1.0, gain=3.0),
        configs={**HALF, "gemm1": {**HALF["gemm1"], "PREGATHER": 1}}),
    "half tail blocks, pointer loads, sentinel NaN weight": dict(
        dims=(50, 3, 24, 16, 4), opts=dict(sentinels=4), special="nan", dtypes=["float32"],
        configs={g: {**c, "TMA": 0} if g != "combine" else c for g, c in HALF.items()}),
    "half tail blocks, empty experts": dict(dims=(60, 2, 16, 8, 8), opts={}, special="skip_expert",
                                            configs={**HALF, "gemm1": {**HALF["gemm1"], "PREGATHER": 1}},
                                            dtypes=["float32"]),
    "default configs, more rows": dict(dims=(64, 2, 48, 32, 4), opts={}, dtypes=["float32"]),
    "sentinels": dict(dims=(10, 2, 16, 8, 4), opts=dict(sentinels=6)),
    "sentinel NaN weight, negative id": dict(dims=(10, 3, 24, 16, 4), opts=dict(sentinels=4), special="nan"),
    "all slots sentinel": dict(dims=(5, 2, 16, 8, 4), opts={}, special="all_out"),
    "empty experts": dict(dims=(6, 2, 16, 8, 8), opts={}, special="skip_expert"),
    "T=1": dict(dims=(1, 2, 24, 16, 4), opts=dict(bias=True)),
    "k=1": dict(dims=(7, 1, 24, 16, 4), opts=dict(activation="gelu", interleaved=True)),
    "T=0": dict(dims=(0, 2, 16, 8, 4), opts={}),
    "int32 ids, strided inputs": dict(dims=(8, 4, 24, 16, 8), opts=dict(idx_dtype=torch.int32),
                                      special="strided"),
    "mixtral family": dict(dims=FAMILIES["mixtral silu"][0], opts=FAMILIES["mixtral silu"][1]),
}
for _c in CASES.values():
    _c.setdefault("dtypes", ["float32", "float16"])
CASE_IDS = [f"{name}/{dt}" for name, c in CASES.items() for dt in c["dtypes"]]
# (t, k, E, BLOCK_M) of the routing checks (ids drawn from [-2, E + 3): negative ids and
# sentinels both left out)
ROUTING = {"routing 13x2 E4 bm16": (13, 2, 4, 16), "routing 1x8 E128 bm16": (1, 8, 128, 16),
           "routing 40x3 E5 bm4": (40, 3, 5, 4), "routing 0x2 E4": (0, 2, 4, 16),
           "routing 7x1 E1": (7, 1, 1, 16), "routing 300x2 E3 bm16": (300, 2, 3, 16),
           # one program over several chunks (RT.ROUTE_ONE_PROGRAM_CHUNKS): 4 chunks exactly,
           # then the smallest three-kernel case (5 chunks, ragged)
           "routing 64x8 E128 bm16": (64, 8, 128, 16), "routing 50x5 E7 bm4": (50, 5, 7, 4),
           "routing 129x4 E6 bm8": (129, 4, 6, 8),
           # 22 chunks of RT.ROUTE_CHUNK = 128 pairs: the scan kernel takes CB = 8192 // 512 = 16
           # chunks at a time, so two passes (and E is not a power of 2)
           "routing 700x4 E300 bm16": (700, 4, 300, 16)}
ALL_IDS = CASE_IDS + list(ROUTING)


def _special(args: tuple, special: str | None) -> tuple[tuple, tuple]:
    """(the args to run, the args whose reference is the expected output)."""
    e = args[3].shape[0]
    if special == "nan":
        # Sentinel slots get NaN weights and one id is negative: neither may contribute
        # (nor read out of bounds); expected = those slots' weights zeroed, ids made valid.
        ids, w = args[1].clone(), args[2].clone()
        ids[-1, 0] = -3
        out = (ids < 0) | (ids >= e)
        w[out] = float("nan")
        ref = sub(args, top_k_index=torch.where(out, 0, ids), top_k_weights=torch.where(out, 0, w))
        return sub(args, top_k_index=ids, top_k_weights=w), ref
    if special == "all_out":
        ids = args[1] + e  # every slot on another rank
        return sub(args, top_k_index=ids), sub(args, top_k_weights=torch.zeros_like(args[2]))
    if special == "skip_expert":
        ids = args[1].clone()
        ids[ids == 2] = 5  # expert 2 gets nothing; 5 gets more
        a = sub(args, top_k_index=ids)
        return a, a
    if special == "strided":
        x = args[0]
        xs = x.t().contiguous().t()  # column-major views
        ws = args[2].t().contiguous().t()
        assert not xs.is_contiguous() and not ws.is_contiguous()
        a = sub(args, hidden_states=xs, top_k_weights=ws)
        return a, a
    if special == "strided columns":  # every other element of a wider row (one row: no other stride to vary)
        def every_other(v: torch.Tensor) -> torch.Tensor:
            out = torch.empty(v.shape[0], 2 * v.shape[1], dtype=v.dtype, device=v.device)[:, ::2]
            return out.copy_(v)
        a = sub(args, hidden_states=every_other(args[0]), top_k_index=every_other(args[1]),
                top_k_weights=every_other(args[2]))
        assert all(t.stride(1) == 2 for t in a[:3])
        return a, a
    return args, args


def assert_half_and_full_blocks(ids: torch.Tensor, e: int, bm: int) -> None:
    """A HALF_TAIL case walks both kinds of block: some whose second half is padding (half a
    tile), and some whose isn't (a whole one)."""
    counts = torch.bincount(ids[(ids >= 0) & (ids < e)].reshape(-1).long(), minlength=e).tolist()
    last = [c - bm * ((c - 1) // bm) for c in counts if c]  # the rows of each expert's last block
    full = sum(c // bm for c in counts)  # blocks of bm rows
    assert any(r <= bm // 2 for r in last) and (full or any(r > bm // 2 for r in last)), (counts, bm)


def _nan_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh buffer poisoned: NaN, or an integer buffer's largest value (an index read
    there unwritten points far out of bounds)."""
    fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
    return torch.full(shape, fill, dtype=dtype, device=device)


def run_case(case_id: str, seed: int, device: str = "cpu") -> None:
    """One case: fresh random inputs, NaN-filled buffers, output vs the float64 reference,
    inputs untouched, and a second run bit-identical."""
    name, dname = case_id.rsplit("/", 1)
    c = CASES[name]
    dtype = getattr(torch, dname)
    torch.manual_seed(seed ^ zlib.crc32(case_id.encode()))
    args, ref_args = _special(make(*c["dims"], dtype, device, **c["opts"]), c.get("special"))
    want = M.reference(*tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in ref_args))
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    before = [a.clone() for a in inputs]
    assert TM.why_not_fused(*args) is None
    if (c.get("configs") or {}).get("gemm1", {}).get("HALF_TAIL"):
        assert_half_and_full_blocks(args[1], args[3].shape[0], c["configs"]["gemm1"]["BLOCK_M"])
    got = TM.fused_experts_forward(*args, configs=c.get("configs"))
    assert_matches(got, want, dtype)
    for b, a in zip(before, inputs):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg="an input was modified")
    if device != "cpu":  # (the interpreter is deterministic: save its time)
        assert torch.equal(got, TM.fused_experts_forward(*args, configs=c.get("configs"))), "two runs differ"


def _check_routing(ids: torch.Tensor, e: int, bm: int) -> None:
    """routing_tables against a plain-Python model of the padded, expert-sorted list."""
    sorted_ids, block_expert, tables = RT.routing_tables(ids, e, bm)
    s = ids.numel()
    flat = ids.reshape(-1).tolist()
    nb = RT.num_blocks(s, e, bm)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert sorted_ids.shape == (nb * bm,) and block_expert.shape == (nb,)
    want = []  # the valid pairs by expert, each run in increasing pair order, padded
    ends, pstarts, counts, pends, shifts = [], [], [], [], []
    for x in range(e):
        run = [p for p in range(s) if flat[p] == x]
        shifts.append(sum(counts) - len(want))  # its first sorted (unpadded) row - its first padded row
        pstarts.append(len(want))
        counts.append(len(run))
        ends.append(sum(counts))
        want += run + [s] * (-len(run) % bm)
        pends.append(len(want))
    assert tables.dtype == torch.int32 and tables.tolist() == [ends, pstarts, counts, pends, shifts], tables
    got = sorted_ids.tolist()
    assert got[:len(want)] == want and all(v == s for v in got[len(want):]), (got, want)
    used = len(want) // bm
    for b in range(nb):
        blk = [p for p in got[b * bm:(b + 1) * bm] if p < s]
        if b >= used:
            assert block_expert[b] == -1
        else:
            assert blk and all(flat[p] == block_expert[b] for p in blk)


def run_routing(name: str, seed: int, device: str = "cpu") -> None:
    t, k, e, bm = ROUTING[name]
    torch.manual_seed(seed ^ zlib.crc32(name.encode()))
    ids = torch.randint(-2, e + 3, (t, k), device=device)
    _check_routing(ids, e, bm)
    _check_routing(ids.int(), e, bm)
    _check_routing(ids.t().contiguous().t(), e, bm)  # (T, k) with strides (1, T)


def _fix_old_interpreter() -> None:
    """Triton 3.6's interpreter turns a runtime scalar (a 1-element array) into a loop bound
    with ``int(array)``, which numpy >= 2.5 refuses ("only 0-dimensional arrays can be
    converted to Python scalars"); 3.8 squeezes first. Give 3.6 the 3.8 behaviour."""
    import numpy as np
    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter
    patch = interpreter._patch_lang_tensor

    def patched(tensor, *args, **kwargs):
        patch(tensor, *args, **kwargs)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

    interpreter._patch_lang_tensor = patched


def _fast_device_calls() -> None:
    """Triton's interpreter re-patches the language modules a @jit function's globals hold
    (``inspect.getmembers`` over each) on every call of a @jit helper from a kernel
    (``program_tile``, ``routed_mma``, ``gate_tile``, triton's own ``sigmoid``...), once per program: 22 % of
    the backward child's time (2026-12-01, triton 3.8), though the launch around those calls
    keeps whatever was patched until it ends. So inside a launch each module's globals are
    patched once (the first call from functions of that module), and the launch still
    restores everything at its end. Only where the interpreter is built that way."""
    from triton.runtime import interpreter as interp

    grid, patch = getattr(interp, "GridExecutor", None), getattr(interp, "_patch_lang", None)
    scope = getattr(interp, "_LangPatchScope", None)
    if grid is None or patch is None or scope is None:
        return
    state: dict[str, Any] = {"depth": 0, "seen": set()}
    launch = grid.__call__

    def launch_once(self, *args, **kwargs):
        state["depth"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if state["depth"] == 0:
                state["seen"] = set()

    def patch_once(fn):
        if state["depth"] == 0:
            return patch(fn)
        key = id(fn.__globals__)
        if key in state["seen"]:
            return scope()  # this module's language is patched until the launch ends
        state["seen"].add(key)
        return patch(fn)

    grid.__call__ = launch_once
    interp._patch_lang = patch_once


def _fast_np_dtype() -> None:
    """Triton's interpreter maps a language dtype to numpy's (``_get_np_dtype``) by building
    a 19-entry dict of dtypes on every call: ~300,000 calls, 9 % of the backward child's
    time (2026-12-02, triton 3.8). The same mapping, its dict built once per dtype seen
    (the original still decides each dtype's entry). Only where the interpreter has it."""
    from triton.runtime import interpreter as interp

    import numpy as np
    import triton.language as tl

    slow = getattr(interp, "_get_np_dtype", None)
    if slow is None or not hasattr(tl, "block_type") or not hasattr(tl, "pointer_type"):
        return
    pointer, table = np.dtype(np.uint64), {}

    def fast(tt):
        if isinstance(tt, tl.pointer_type):
            return pointer
        if isinstance(tt, tl.block_type):
            if isinstance(tt.element_ty, tl.pointer_type):
                return pointer
            tt = tt.element_ty
        got = table.get(tt)
        if got is None:
            got = table[tt] = slow(tt)
        return got

    interp._get_np_dtype = fast


def _no_idle_overflow_check() -> None:
    """Triton's semantic layer recomputes every integer add, sub and mul in int64 to check
    for overflow (``binary_op_sanitize_overflow_impl``: two casts, the op, two compares, an
    and) and hands the result to ``device_assert``, which returns at once unless the
    builder's ``debug`` option is on. The interpreter's builder has it off
    (``InterpreterOptions()``; TRITON_DEBUG does not reach it), so that work checked
    nothing (a kernel storing an int32 ``x * x`` at x = 2**20 runs unreported with it on):
    a third of the backward child's time (2026-12-02, triton 3.8, 2-core box: backward
    child 47.8 -> 31.5 s of CPU, forward 20.5 -> 16.5 s). Turned off only where ``debug`` is
    off and ``device_assert`` is seen to return on it: no check is lost."""
    import dataclasses
    import inspect

    from triton.runtime import interpreter as interp

    builder = getattr(interp, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    semantic = getattr(interp, "interpreter_semantic", None)
    if (not dataclasses.is_dataclass(opts) or getattr(opts, "debug", True)
            or not getattr(opts, "sanitize_overflow", False) or semantic is None):
        return
    try:
        idle = "if not self.builder.options.debug:" in inspect.getsource(type(semantic).device_assert)
    except (AttributeError, OSError, TypeError):
        return
    if idle:
        builder.options = dataclasses.replace(opts, sanitize_overflow=False)


def interpreter_child(case_ids: list[str], run: Callable[[str, int], None]) -> None:
    """An interpreter child's body: ``run(case_id, seed)`` for every case, one JSON verdict
    per case on the last line (this file's and the backward's children)."""
    assert TT.interpreting(), "TRITON_INTERPRET=1 must be set before the kernels are imported"
    _fix_old_interpreter()
    _fast_device_calls()
    _fast_np_dtype()
    _no_idle_overflow_check()
    TM.new_buffer = _nan_buffer  # every buffer starts NaN: an unwritten element fails
    seed = int(os.environ.get("OPREG_TEST_SEED", "0"))
    verdicts = {}
    t_all = time.perf_counter()
    for case_id in case_ids:
        try:
            t0 = time.perf_counter()
            run(case_id, seed)
            print(f"{case_id}: {time.perf_counter() - t0:.2f} s", file=sys.stderr)
            verdicts[case_id] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per case by the parent
            verdicts[case_id] = f"{type(e).__name__}: {e}"[:2000]
    print(f"all cases: {time.perf_counter() - t_all:.1f} s", file=sys.stderr)
    print("VERDICTS " + json.dumps(verdicts))


def interpreter_verdicts(tmp_path_factory: pytest.TempPathFactory, script: str, name: str) -> dict[str, str]:
    """Run ``script`` (a test file whose ``__main__`` is :func:`interpreter_child`) under
    the interpreter once per test run (once across xdist workers); its verdicts by case id."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    seed = getattr(sys.modules.get("conftest"), "SEED", 0)

    def run_child(folder: Any) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", OPREG_TEST_SEED=str(seed))
        # forked from a process that has imported torch, not triton: the interpreter is still
        # chosen at the kernels' import in the child
        proc = fresh.run([os.path.abspath(script)], env=env, timeout=600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICTS ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(f"interpreter child failed (rc {proc.returncode}, seed {seed}):\n"
                        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        (folder / "verdicts.json").write_text(lines[-1][len("VERDICTS "):])

    folder = once_per_run(tmp_path_factory, name, run_child)
    return json.loads((folder / "verdicts.json").read_text())


def _child_main() -> None:
    interpreter_child(ALL_IDS, lambda case_id, seed: (run_routing if case_id in ROUTING else run_case)(case_id, seed))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return interpreter_verdicts(tmp_path_factory, __file__, "triton-interpreter")


@needs_triton
@pytest.mark.parametrize("case_id", ALL_IDS)
def test_interpreted(case_id: str, interpreted: dict[str, str]) -> None:
    assert interpreted.get(case_id) == "ok", interpreted.get(case_id, "not run")


# ------------------------------------------------------------------ in process

@needs_triton
def test_config_table() -> None:
    table = {"default": {"gemm1": {"16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4,
                                              num_stages=4),
                                   "inf": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8,
                                               num_stages=4)},
                         "gemm2": {"inf": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)},
                         "combine": {"BLOCK_H": 512, "num_warps": 4}},
             "tuned": {"bfloat16": {"N=256,K=128": {"gemm1": {"inf": dict(
                 BLOCK_M=64, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2)}}}}}
    assert TM.pick_config("gemm1", 2.0, 512, 512, torch.bfloat16, table=table)["BLOCK_M"] == 16
    assert TM.pick_config("gemm1", 17.0, 512, 512, torch.bfloat16, table=table)["BLOCK_M"] == 128
    assert TM.pick_config("gemm1", 99.0, 256, 128, torch.bfloat16, table=table)["BLOCK_N"] == 32  # tuned
    assert TM.pick_config("gemm1", 99.0, 256, 128, torch.float16, table=table)["BLOCK_N"] == 128
    c2 = TM.pick_config("gemm2", 99.0, 128, 128, torch.bfloat16, block_m=64, table=table)
    assert c2["BLOCK_M"] == 64
    f32 = TM.pick_config("gemm1", 999.0, 512, 512, torch.float32, table=table)  # shrunk to fit
    assert f32["num_stages"] * f32["BLOCK_K"] * (128 + 2 * 128) * 4 <= TM._SMEM_BUDGET
    # the shipped file parses and covers every bucket of both GEMMs, and the decode kernels
    for gemm in ("gemm1", "gemm2"):
        for rows in (1, 30, 200, 5000):
            assert TM.pick_config(gemm, rows, 1536, 2048, torch.bfloat16, block_m=16)["BLOCK_N"] > 0
    assert set(TM.pick_config("decode", 0.0, 1536, 2048, torch.bfloat16)) == {
        "UP_BLOCK_N", "UP_BLOCK_K", "UP_WARPS", "DOWN_BLOCK_N", "DOWN_BLOCK_K", "DOWN_WARPS", "num_stages"}
    decode = dict(UP_BLOCK_N=64, UP_BLOCK_K=64, UP_WARPS=8, DOWN_BLOCK_N=8, DOWN_BLOCK_K=512, DOWN_WARPS=4,
                  num_stages=2)
    table["default"]["decode"] = dict(decode, UP_BLOCK_N=16)
    table["tuned"]["bfloat16"]["N=256,K=128"]["decode"] = {"-": decode}  # decode: per shape, no bucket
    assert TM.pick_config("decode", 0.0, 256, 128, torch.bfloat16, table=table) == decode
    assert TM.pick_config("decode", 0.0, 512, 128, torch.bfloat16, table=table)["UP_BLOCK_N"] == 16


@needs_triton
def test_which_forward_decodes() -> None:
    """The decode kernels take a forward of 1 to DECODE_MAX_TOKENS tokens that saves nothing
    for a backward (which reads the GEMM path's routing tables), where the grouped kernels
    take its pairs and experts, else up to PER_PAIR_MAX_TOKENS (the per-pair kernels); a
    caller's configs pin the path (a "decode" entry: the decode kernels at any T; GEMM
    configs only: the GEMM path)."""
    assert TM.decodes(1, False, None) and TM.decodes(1, False, {"decode": {}})
    assert not TM.decodes(1, True, None) and not TM.decodes(0, False, None)
    assert TM.decodes(TM.DECODE_MAX_TOKENS, False, None) and not TM.decodes(TM.DECODE_MAX_TOKENS + 1, False, None)
    assert not TM.decodes(4096, False, None)
    assert TM.decodes(64, False, None, 64 * 8, 128)  # Qwen3-MoE's 128 experts, top-8: the grouped kernels' reach
    # 256 experts, top-8: past GROUPED_MAX_SCAN from 64 pairs, so the per-pair kernels, then the GEMM path
    assert TM.decodes(TM.PER_PAIR_MAX_TOKENS, False, None, 8 * TM.PER_PAIR_MAX_TOKENS, 4096)
    assert not TM.decodes(TM.PER_PAIR_MAX_TOKENS + 1, False, None, 8 * (TM.PER_PAIR_MAX_TOKENS + 1), 4096)
    assert not TM.decodes(64, False, None, 64 * 8, 256) and TM.decodes(8, False, None, 64, 256)
    assert not TM.decodes(1, False, {"gemm1": {}, "gemm2": {}, "combine": {}})
    assert TM.decodes(8, False, {"decode": {}}) and not TM.decodes(8, True, {"decode": {}})  # pinned: any T


@needs_triton
def test_which_decode_kernels() -> None:
    """One token takes the per-pair decode kernels (its k pairs are distinct experts), two to
    DECODE_MAX_TOKENS the grouped ones, unless E x T*k passes what a grouped program's search
    takes (GROUPED_MAX_SCAN): then the per-pair ones; a pinned grouped config there is
    refused with the reason, before any launch."""
    def mode(t: int, k: int, e: int) -> int:
        a = make(t, k, 16, 8, e, torch.float32, "cpu")
        return TM._decode_config(a[0], a[1], a[3], False).get("GROUPED", 0)

    assert mode(1, 2, 4) == 0 and mode(2, 2, 4) == 1 and mode(TM.DECODE_MAX_TOKENS, 8, 128) == 1
    assert mode(8, 16, 1024) == 0  # 1024 experts x 128 pairs
    big = make(8, 16, 16, 8, 1024, torch.float32, "cpu")
    with pytest.raises(ValueError, match="GROUPED_MAX_SCAN"):
        TM.fused_experts_forward(*big, configs=GROUPED_SMALL)
    # pairs per step: the busiest expert's in one step by uniform routing, within GROUPED_MAX_SCAN
    assert TM._grouped_rows(64 * 8, 128) == 16 and TM._grouped_rows(32 * 2, 8) == 16  # Qwen3-MoE T=64, Mixtral T=32
    assert TM._grouped_rows(64 * 2, 8) == 32 and TM._grouped_rows(70 * 2, 2) == 64  # Mixtral T=64; 70 pairs each
    assert TM._grouped_rows(2048, 32) == 32  # 64 a step would hold a (64, 2048) selection: past the bound
    small = make(4, 2, 16, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="BLOCK_M .* must be one of"):
        TM.fused_experts_forward(*small, configs={"decode": dict(GROUPED_SMALL["decode"], BLOCK_M=24)})


@needs_triton
def test_listed_and_unavailable_without_cuda() -> None:
    # opreg.ops.moe_experts registers it at import where triton imports: then it stays
    # (test_moe_experts, later on the same xdist worker, lists it)
    had = "triton" in registry.lookup("moe_experts").impls
    TM.register()
    try:
        rows = {r["impl"]: r for r in opreg.implementations("moe_experts")}
        assert rows["triton"]["devices"] == "cuda" and rows["triton"]["priority"] == 110
        if torch.cuda.is_available():
            assert rows["triton"]["available"], rows["triton"]["why_not"]
        else:
            assert not rows["triton"]["available"]
            assert "CUDA" in rows["triton"]["why_not"] or "triton" in rows["triton"]["why_not"]
    finally:
        if not had:  # leave the registry as this process found it
            registry.remove_impl("moe_experts", "triton")


@needs_triton
def test_float64_runs_grouped(caplog: pytest.LogCaptureFixture) -> None:
    args = make(6, 2, 16, 8, 4, torch.float64, "cpu", bias=True)
    assert "float64" in TM.why_not_fused(*args)
    with caplog.at_level("INFO", logger="opreg"):
        got = TM.moe_experts_triton(*args)
        TM.moe_experts_triton(*args)
    assert torch.equal(got, G.grouped(*args))
    assert sum("grouped path" in r.getMessage() for r in caplog.records) <= 1  # once per process


@needs_triton
def test_bad_input_raises_like_the_op() -> None:
    args = make(6, 2, 8, 4, 3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="down_proj"):
        TM.moe_experts_triton(*sub(args, down_proj=args[5][:, :, :-1]))
    with pytest.raises(ValueError, match="activation"):
        TM.moe_experts_triton(*sub(args, activation="tanh"))
    TM.moe_experts_triton(*args)  # a good call between two bad ones: its checks are remembered,
    with pytest.raises(ValueError, match="down_proj"):  # the bad call's are not
        TM.moe_experts_triton(*sub(args, down_proj=args[5][:, :, :-1]))


@needs_triton
def test_spec_tells_apart_what_launches_depend_on() -> None:
    """The host-side work of a forward (checks, configs, grids, launcher keys) is reused per
    spec_of(args): a spec must differ wherever a launch's specialisation or a check could."""
    args = make(6, 2, 16, 8, 4, torch.float32, "cpu")
    same = TM.spec_of(*make(6, 2, 16, 8, 4, torch.float32, "cpu"))
    assert TM.spec_of(*args) == same and hash(same) == hash(TM.spec_of(*args))
    x = args[0]
    unaligned = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape).copy_(x)
    w1t = args[3].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
    for changed in (sub(args, hidden_states=unaligned), sub(args, gate_up_proj=w1t),
                    sub(args, hidden_states=x.half()), sub(args, top_k_index=args[1].int()),
                    sub(args, activation="gelu"), sub(args, limit=1.0), make(7, 2, 16, 8, 4, torch.float32, "cpu")):
        assert TM.spec_of(*changed) != same


@needs_triton
def test_descriptor_copies_keep_no_tensor() -> None:
    if TM._TensorDescriptor is None:
        pytest.skip("this triton has no tensor descriptors")
    w = torch.randn(4, 32, 16)
    d = TM._descriptor(w, [1, 16, 16])
    assert d.base is w and list(d.block_shape) == [1, 16, 16] and list(d.strides) == list(w.stride())
    template = TM._DESCRIPTORS[(w.dtype, tuple(w.shape), w.stride(), (1, 16, 16))]
    assert template.base is None and TM._descriptor(torch.randn(4, 32, 16), [1, 16, 16]).base is not w


# ------------------------------------------------------------------ CUDA

needs_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
CUDA_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _suite(samples=None) -> OpTestSuite:
    from test_moe_experts import sample_inputs, BAD, make as mk
    TM.register()
    return OpTestSuite("moe_experts", samples or sample_inputs, bad=BAD, bad_context=opreg.check_indices,
                       bad_sample=lambda device: mk(6, 2, 8, 4, 3, torch.float32, device))


def _bigger(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """Shapes that reach every config bucket, with the families' layouts."""
    for name, dims in (("decode", (4, 8, 256, 128, 64)), ("prefill", (512, 4, 256, 192, 16)),
                       ("many rows", (2048, 2, 128, 96, 8))):
        for fam in ("mixtral silu", "gpt_oss biases", "relu2 ungated"):
            yield Sample(make(*dims, dtype, device, **FAMILIES[fam][1], sentinels=3), f"{name} {fam}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_correct(dtype: torch.dtype) -> None:
    _suite().check_correctness("cuda", dtype, impl="triton")
    _suite(_bigger).check_correctness("cuda", dtype, impl="triton")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", [c.replace("float32", "bfloat16") for c in CASE_IDS if c.endswith("float32")])
def test_cuda_cases(case_id: str) -> None:
    """The interpreted cases, compiled, in bfloat16 (the interpreter can't do bfloat16;
    float32 and float16 compiled: test_cuda_correct)."""
    old = TM.new_buffer
    TM.new_buffer = _nan_buffer
    try:
        run_case(case_id, 0, "cuda")
    finally:
        TM.new_buffer = old


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(ROUTING))
def test_cuda_routing(name: str) -> None:
    run_routing(name, 0, "cuda")


def _one_token(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """T = 1 to DECODE_MAX_TOKENS (the decode kernels by default) with the families' layouts
    and a sentinel slot; at T > 1 the tokens share experts (top-4 of 6)."""
    for fam in ("mixtral silu", "gpt_oss biases", "relu2 ungated"):
        yield Sample(make(1, 4, 256, 128, 16, dtype, device, **FAMILIES[fam][1], sentinels=1), f"one token {fam}")
        t = TM.DECODE_MAX_TOKENS
        if t > 1:
            yield Sample(make(t, 4, 256, 128, 6, dtype, device, **FAMILIES[fam][1], sentinels=1), f"{t} tokens {fam}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_decode(dtype: torch.dtype) -> None:
    """The decode kernels on the GPU (the default path at 1 to DECODE_MAX_TOKENS tokens):
    against float64, two runs bit-identical, CUDA-graph capture and replay."""
    suite = _suite(_one_token)
    suite.check_correctness("cuda", dtype, impl="triton")
    suite.check_deterministic("cuda", dtype, impl="triton")
    suite.check_cuda_graphs(dtype)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_grouped_decode(dtype: torch.dtype) -> None:
    """The grouped decode kernels (the table's config, programs walking several column
    tiles) at the sizes they are for (T = 1 to 16, up to 64 experts, several row
    steps of one expert at T = 40 of 4), against float64, two runs bit-identical, and
    captured in a CUDA graph: a replay on new inputs (written in place) gives what an eager
    call on them does."""
    grouped = {"decode": dict(TM.pick_config("decode_grouped", 0.0, 512, 256, dtype), WAVES=1)}
    for t, k, e in ((1, 2, 8), (4, 8, 64), (16, 2, 8), (40, 2, 4)):
        args = make(t, k, 256, 256, e, dtype, "cuda", sentinels=1, bias=True)
        want = M.reference(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])
        got = TM.fused_experts_forward(*args, configs=grouped)
        assert_matches(got, want, dtype)
        assert torch.equal(got, TM.fused_experts_forward(*args, configs=grouped)), f"T={t}: two runs differ"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        TM.fused_experts_forward(*args, configs=grouped)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TM.fused_experts_forward(*args, configs=grouped)
    args[0].normal_()
    args[1].copy_(torch.rand(args[1].shape[0], e, device="cuda").argsort(-1)[:, :k])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, TM.fused_experts_forward(*args, configs=grouped)), "the replay differs from eager"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_deterministic(dtype: torch.dtype) -> None:
    _suite(_bigger).check_deterministic("cuda", dtype, impl="triton")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_graphs(dtype: torch.dtype) -> None:
    suite = _suite()
    assert suite.default_impl("cuda") == "triton"
    suite.check_cuda_graphs(dtype)


# (tokens, top-k, experts, family): decode kernels per pair (T = 2) and grouped (T = 16), the
# GEMM path on Triton (past DECODE_MAX_TOKENS = 64; biases, transposed weights) and, on sm90,
# on the Gluon GEMMs (256 rows an expert, GLUON_GEMM1_MIN_ROWS)
REPLAYED = {"decode per pair": (2, 4, 8, "mixtral silu"), "decode grouped": (16, 4, 8, "gpt_oss biases"),
            "gemm": (128, 2, 8, "gpt_oss biases"), "gemm transposed": (256, 4, 8, "relu2 ungated"),
            "gluon gemms": (512, 4, 8, "mixtral silu")}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("buffers", ["nan", "pooled"])
@pytest.mark.parametrize("case", list(REPLAYED))
def test_cuda_replay(case: str, buffers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A no-grad forward's launches replayed (``TM.REPLAY``, backends/triton/replay.py) give
    the Python path's bits on new inputs every call (new addresses, routing and values;
    sentinel slots), through the op too; on triton 3.6 a plan is made and replayed (under
    OPREG_CHECK_SPEC each replay first checks the Python path still launches what it does); a
    CUDA graph captures a replayed call and replays it on new values. ``buffers``: NaN-filled
    (an element no kernel writes shows), or the library's own plain ones, which a plan carves
    from one allocation (``replay.plain``)."""
    import triton

    from opreg.backends.triton import replay
    assert TM.DECODE_MAX_TOKENS < REPLAYED["gemm"][0]
    if buffers == "nan":
        monkeypatch.setattr(TM, "new_buffer", _nan_buffer)
    t, k, e, family = REPLAYED[case]
    kw = {**FAMILIES[family][1], "sentinels": 1, "transposed": case == "gemm transposed"}

    def fresh_args() -> tuple:
        return make(t, k, 256, 128, e, torch.bfloat16, "cuda", **kw)

    def python_path(args: tuple) -> torch.Tensor:
        monkeypatch.setattr(TM, "REPLAY", False)
        try:
            return TM.fused_experts_forward(*args)
        finally:
            monkeypatch.setattr(TM, "REPLAY", True)

    for n in range(4):
        args = fresh_args()
        want = python_path(args)
        got = TM.fused_experts_forward(*args) if n % 2 else torch.ops.opreg.moe_experts(*args)
        assert torch.equal(got, want), f"call {n}: the replay differs from the Python path"
    plan = TM._PLANS.memo.get((TM.spec_of(*args), False, False, None))
    if triton.__version__.startswith("3.6."):
        assert type(plan) is replay.Plan, f"no plan: {plan}"
        # pooled: every buffer but the result; NaN-filled: the routing's (int32, always plain) alone
        if buffers == "pooled":
            assert [root for root, *_ in plan.made] == [plan.result] and plan.pooled
        else:
            assert all(plan.buffers[root - plan.inputs][2] == torch.int32 for root, _ in plan.pooled)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        TM.fused_experts_forward(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TM.fused_experts_forward(*args)
    new = fresh_args()
    for a, b in zip(args[:3], new[:3]):
        a.copy_(b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, python_path(args)), "the graph's replay differs from the Python path"


@pytest.mark.cuda
@needs_cuda
def test_cuda_launch_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached launch path (backends/triton/launch.py) runs what Triton's own would:
    repeated calls hit it (the compiled kernel called directly), and an argument that
    changes Triton's specialisation (hidden states 2 bytes off 16-byte alignment, a row
    stride not a multiple of 16) takes new entries, never another key's kernel: the
    forward keys its launches by its inputs' metadata (``spec_of``), so both GEMMs get one
    each; each result against float64. On triton 3.6 the hits call Triton's C launcher
    (``launch._raw_launcher``) with reused TMA descriptors: weights of the same shape at
    another address, and new values at the same address, must each be what is computed."""
    import triton

    from opreg.backends.triton import launch as L
    monkeypatch.setattr(TM, "REPLAY", False)  # every call through the launch cache (test_cuda_replay: replays)
    TM._moe_gemm._opreg_launch_cache = {}  # this test's entries only (a JITFunction's attribute)
    # past the decode bound: the GEMM path (64 tokens, until the grouped decode kernels took them)
    args = make(2 * TM.DECODE_MAX_TOKENS, 2, 256, 128, 8, torch.bfloat16, "cuda")

    def ref(a: tuple) -> torch.Tensor:
        return M.reference(*[v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in a])

    want = ref(args)
    for _ in range(3):
        assert_matches(TM.fused_experts_forward(*args), want, torch.bfloat16)
    cache = TM._moe_gemm._opreg_launch_cache
    raw = [entry[2] for entry in cache.values()]
    if triton.__version__.startswith("3.6."):
        assert all(r is not None for r in raw), "triton 3.6: the C launcher was not taken"
        assert all(r.descs for r in raw), "both GEMMs load their weights through tensor descriptors"
    else:
        assert all(r is not None for r in raw) or L._direct_ok is True, "the direct call was not taken"
    for _ in range(2):  # other weights of the same shapes (new addresses), then new values in place
        other = list(args)
        other[3], other[5] = args[3].clone().normal_(0, 0.1), args[5].clone().normal_(0, 0.1)
        assert_matches(TM.fused_experts_forward(*other), ref(tuple(other)), torch.bfloat16)
        args[3].normal_(0, 0.1)
        assert_matches(TM.fused_experts_forward(*args), ref(args), torch.bfloat16)
    want = ref(args)
    entries = len(cache)
    assert entries == 2  # GEMM1 and GEMM2, one key each
    x = args[0]
    off = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x)
    wide = torch.empty((x.shape[0], x.shape[1] + 3), dtype=x.dtype, device="cuda")[:, :x.shape[1]]
    for xv in (off, wide):
        xv.copy_(x)
        for _ in range(2):
            assert_matches(TM.fused_experts_forward(xv, *args[1:]), want, torch.bfloat16)
        assert len(cache) == entries + 2, "a changed specialisation reused another key's kernel"
        entries = len(cache)
    assert all(key[1] == "spec" for key in cache), "the forward's launches are keyed by spec"


@pytest.mark.cuda
@needs_cuda
def test_cuda_bad_input() -> None:
    _suite().check_bad_input("cuda", impl="triton")


@pytest.mark.cuda
@needs_cuda
def test_cuda_listed_and_bound() -> None:
    TM.register()
    rows = {r["impl"]: r for r in opreg.implementations("moe_experts")}
    assert rows["triton"]["available"], rows["triton"]["why_not"]
    torch.ops.opreg.moe_experts(*make(4, 2, 16, 8, 4, torch.bfloat16, "cuda"))
    assert opreg.bound("moe_experts", "cuda") == "triton"


@pytest.mark.cuda
@needs_cuda
def test_cuda_float64_falls_back() -> None:
    args = make(6, 2, 16, 8, 4, torch.float64, "cuda")
    assert torch.equal(TM.moe_experts_triton(*args), G.grouped(*args))


if __name__ == "__main__":
    _child_main()
