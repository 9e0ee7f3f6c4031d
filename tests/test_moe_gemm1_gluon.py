"""moe_experts' GEMM1 on the Gluon kernels (backends/triton/moe_gemm1_gluon.py), asked for with
``configs["gemm1"]["GLUON"]``: 1 ping-pong, 2 cooperative (``PREGATHER`` 0: the cooperative one
gathering the token rows itself); GEMM2 on them (``configs["gemm2"]["GLUON"]``), and GEMM2's
dgrad with the gate's backward in their epilogue (``configs["dgrad2"]["GLUON"]``).

Gluon has no interpreter: on the CPU the kernel is compiled for sm90 (every gate, with and
without the saved pre-activation) and the wrapper's refusals are checked; on an sm90 GPU it runs
against float64 and against the Triton GEMM1 on the same sorted rows.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from test_moe_experts import FAMILIES, make, sub  # noqa: E402
from test_moe_triton import TM, _nan_buffer  # noqa: E402
from test_moe_triton import _special as _forward_special  # noqa: E402
from test_moe_triton_backward import (GRAD_ARGS, TB, _clear_limit, _requires, _special, _two_paths,  # noqa: E402
                                      needs_cuda)

from opreg.ops import moe_experts as M  # noqa: E402
from opreg.testing import assert_matches  # noqa: E402
from opreg.testing.timing import captured  # noqa: E402

# gate name -> make() options; every gate the kernel takes, gated with concatenated halves
GATES = {"silu": {}, "gelu": dict(activation="gelu"), "gelu_tanh": dict(activation="gelu_tanh"),
         "relu": dict(activation="relu"), "relu2": dict(activation="relu2"), "sigmoid": dict(activation="sigmoid"),
         "gpt_oss": dict(activation="gpt_oss", alpha=1.702, limit=1.5, gain=4.0),
         "clamped silu": dict(limit=0.7, gain=4.0)}
# (T, k, H, I, E): ragged runs (~150 rows an expert: a full tile and a partial one), sparse
# (most experts empty, 1-2 rows in the rest), more tiles than SMs (a program walks several)
SHAPES = {"ragged": (300, 4, 256, 256, 8), "sparse": (24, 2, 128, 128, 64), "many tiles": (1536, 8, 512, 384, 32)}
# GEMM2's: H a multiple of its 256-column tile
SHAPES2 = {"ragged": (300, 4, 256, 256, 8), "sparse": (24, 2, 256, 128, 64), "many tiles": (1536, 8, 512, 384, 32),
           "k=1": (200, 1, 512, 128, 4)}


def _gemm1_config(args: tuple, gluon: int) -> dict[str, dict[str, int]]:
    """A whole GEMM1 config (the table's, 128-row tiles, pregathered) with GLUON = ``gluon``."""
    x, ids, w1 = args[0], args[1], args[3]
    n1 = w1.shape[1]
    c1 = TM.pick_config("gemm1", ids.numel() / w1.shape[0], n1, x.shape[1], x.dtype, block_m=128)
    c1.update(PREGATHER=1, HALF_TAIL=0, PERSISTENT=0, GLUON=gluon)
    return {"gemm1": c1}


def _gemm2_config(args: tuple, gluon1: int = 0, gluon2: int = 2) -> dict[str, dict[str, int]]:
    """:func:`_gemm1_config` (GLUON = ``gluon1``) with GEMM2 on a Gluon kernel (``gluon2``: 1
    ping-pong, 2 cooperative)."""
    x, ids, w1, w2 = args[0], args[1], args[3], args[5]
    c2 = TM.pick_config("gemm2", ids.numel() / w1.shape[0], w2.shape[1], w2.shape[2], x.dtype, block_m=128)
    c2.update(HALF_TAIL=0, PERSISTENT=0, GLUON=gluon2)
    return {**_gemm1_config(args, gluon1), "gemm2": c2}


def _replays(args: tuple, configs: dict[str, dict[str, int]]) -> None:
    """The forward with ``configs`` captured once in a CUDA graph, replayed on new token rows
    and routing weights: the same bits as a call on those inputs."""
    x2, w2 = torch.randn_like(args[0]), args[2] * (0.5 + torch.rand_like(args[2]))
    x, rw = args[0].clone(), args[2].clone()
    live = sub(args, hidden_states=x, top_k_weights=rw)
    graph, out = captured(lambda: TM.fused_experts_forward(*live, configs=configs))
    x.copy_(x2)
    rw.copy_(w2)
    graph.replay()
    want2 = TM.fused_experts_forward(*sub(args, hidden_states=x2, top_k_weights=w2), configs=configs)
    assert torch.equal(out, want2), "the replayed graph differs from a call on the same inputs"


def _gluon_module() -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon GEMM1 needs sm90")
    return pytest.importorskip("opreg.backends.triton.moe_gemm1_gluon")


@pytest.mark.parametrize("act,save,pingpong",
                         [(a, s, pp) for pp in (True, False) for a in (0, 1, 2, 3, 4, 5, 6)
                          for s in (None, "bf16", "fp32") if s is None or a in (0, 6)]
                         + [("gemm2", w, pp) for w in ("fp32 weights", None) for pp in (True, False)]
                         + [("dgrad2", w, pp) for w in ("down (E, H, I)", "down (E, I, H)") for pp in (True, False)]
                         + [(a, f"gathered{', bf16' * (a == 0)}", False) for a in (0, 2)])
def test_gluon_gemm1_compiles_for_sm90(act: int | str, save: str | None, pingpong: bool) -> None:
    """Both kernels compiled for sm90 (no GPU needed): wgmma and setmaxnreg in its PTX, shared
    memory within the H100's 232,448 bytes a block, for each gate, with the
    pre-activation saved in bf16 or fp32 and without; GEMM2 (``act`` "gemm2", both
    kernels), its routing weights fp32 or bf16; and GEMM2's dgrad (``act`` "dgrad2", both
    kernels), W's tiles N-contiguous (down_proj (E, H, I): 128-byte-wide TMA boxes, four or two
    a tile) or K-contiguous."""
    G = pytest.importorskip("opreg.backends.triton.moe_gemm1_gluon")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    gated, dgrad = act not in ("gemm2", "dgrad2"), act == "dgrad2"
    gather = isinstance(save, str) and save.startswith("gathered")  # GEMM1's rows through the pair ids
    if gather:
        save = "bf16" if save.endswith("bf16") else None
    w_mn = dgrad and save == "down (E, H, I)"
    bn = (G.PP_BLOCK_N if pingpong else G.BLOCK_N) if gated else (G.GEMM2_PP_BLOCK_N if pingpong else G.GEMM2_BLOCK_N)
    if dgrad:
        bn = G.DGRAD2_PP_BLOCK_N if pingpong else G.DGRAD2_BLOCK_N
    a_layout, w_layout = G._layouts(bn)
    w_box = [G.BLOCK_K, bn] if w_mn else [bn, G.BLOCK_K]
    if w_mn:
        w_layout = gl.NVMMASharedLayout.get_default_for(w_box, gl.bfloat16)
    sig = {"a_desc": f"tensordesc<bf16[{G.BLOCK_M}, {G.BLOCK_K}],{a_layout!r}>",
           "w_desc": f"tensordesc<bf16[{w_box[0]}, {w_box[1]}],{w_layout!r}>",
           "out_ptr": "*bf16", "pre_ptr": f"*{save if gated and save else 'bf16'}", "pair_ids_ptr": "*i32",
           "block_expert_ptr": "*i32", "shift_ptr": "*i32", "used_ptr": "*i32",
           "route_w_ptr": "*fp32" if save == "fp32 weights" else "*bf16", "part_ptr": "*fp32", "x_ptr": "*bf16",
           "num_pairs": "i32", "top_k": "i32", "NI": "i32", "N1": "i32", "K": "i32", "stride_out": "i32",
           "stride_pre": "i32", "stride_part": "i32", "stride_rt": "i32", "stride_rk": "i32", "stride_x": "i32",
           "alpha": "fp32", "limit": "fp32"}
    stages = (G.PP_STAGES if pingpong else G.STAGES) if gated else (G.GEMM2_PP_STAGES if pingpong else G.GEMM2_STAGES)
    if dgrad:
        stages = G.DGRAD2_PP_STAGES if pingpong else G.DGRAD2_STAGES
    consts = {"STAGES": stages, "GATED": gated,
              "ACT": act if gated else 0, "HAS_LIMIT": act == 6, "SAVE_PRE": gated and save is not None,
              "PINGPONG": pingpong, "COALESCE": G.COALESCE or dgrad, "CONSUMER_REGS": G.CONSUMER_REGS,
              "LOADER_REGS": G.GATHER_LOADER_REGS if gather else G.LOADER_REGS,
              "LOADER_WARPS": G.GATHER_LOADER_WARPS if gather else 1, "DGRAD": dgrad, "W_MN": w_mn,
              "GATE_TIE": False, "UP_LO_TIE": False, "UP_HI_TIE": False, "WRITE_DPRE": dgrad, "ROUTE_GRAD": dgrad,
              "GATHER": gather}
    sig.update({name: "constexpr" for name in consts})
    # the pointers and K, the rows' stride: 16-aligned, as launches specialise them (K % 64 == 0)
    src = GluonASTSource(G.gemm_kernel, signature=sig, constexprs=consts,
                         attrs={(j,): [["tt.divisibility", 16]] for j in (2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 21)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    assert "wgmma" in ptx and "setmaxnreg" in ptx
    assert kernel.metadata.shared <= 232448, kernel.metadata.shared
    if gather:  # A's rows by cp.async, their arrival on the ready barrier, a proxy fence before the wgmmas
        assert "cp.async.cg" in ptx or "cp.async.ca" in ptx
        assert "cp.async.mbarrier.arrive" in ptx and "fence.proxy.async" in ptx
    if w_mn:  # the [64, 256] tile of W as four 128-byte-wide TMA boxes, B read N-major (tnspB = 1)
        assert kernel.metadata.tensordesc_meta[1]["block_size"] == [G.BLOCK_K, 64]
        assert all(line.rstrip(";").endswith("1, 1, 0, 1") for line in ptx.splitlines() if "wgmma.mma_async" in line)


def test_gluon_gemm1_refuses_what_it_cannot_take() -> None:
    """Asked for where it can't run, the forward raises a ValueError saying why (before any
    launch: CPU tensors reach it too); the kernel's own refusals name what is missing."""
    G = pytest.importorskip("opreg.backends.triton.moe_gemm1_gluon")
    args = make(40, 2, 128, 128, 4, torch.bfloat16, "cpu")
    for gluon in (1, 2):
        with pytest.raises(ValueError, match=rf"GLUON'\] = {gluon}.*not bf16 on CUDA"):
            TM.fused_experts_forward(*args, configs=_gemm1_config(args, gluon))
    with pytest.raises(ValueError, match=r"GLUON must be 0 \(off\), 1 \(ping-pong\) or 2"):
        TM.fused_experts_forward(*args, configs=_gemm1_config(args, 3))
    half = _gemm1_config(args, 1)
    half["gemm1"]["HALF_TAIL"] = 1
    with pytest.raises(ValueError, match="HALF_TAIL"):
        TM.fused_experts_forward(*args, configs=half)
    gather_pp = _gemm1_config(args, 1)
    gather_pp["gemm1"]["PREGATHER"] = 0
    with pytest.raises(ValueError, match="only the cooperative Gluon GEMM1 gathers"):
        TM.fused_experts_forward(*args, configs=gather_pp)
    both = _gemm1_config(args, 1)
    both["gemm1"]["GROUPED_MM"] = 1
    with pytest.raises(ValueError, match="GROUPED_MM"):
        TM.fused_experts_forward(*args, configs=both, save=True, keep_rows=True)
    with pytest.raises(ValueError, match=r"gemm2'\]\['GLUON'\] = 2.*not bf16 on CUDA"):
        TM.fused_experts_forward(*args, configs=_gemm2_config(args))
    for key, value, match in (("GLUON", 3, r"GLUON must be 0 \(off\), 1 \(ping-pong\) or 2"),
                              ("PERSISTENT", 1, "PERSISTENT"), ("HALF_TAIL", 1, "HALF_TAIL")):
        bad = _gemm2_config(args)
        bad["gemm2"][key] = value
        with pytest.raises(ValueError, match=match):
            TM.fused_experts_forward(*args, configs=bad)
    x, w, w2 = args[0], args[3], args[5]
    assert "bias" in G.unfit2(x, w2, 128, has_bias=True, block_m=128)
    assert "BLOCK_M" in G.unfit2(x, w2, 128, has_bias=False, block_m=64)
    assert "CUDA" in G.unfit2(x, w2, 128, has_bias=False, block_m=128)
    common = dict(gated=True, interleaved=False, has_bias=False, block_m=128)
    assert "concatenated" in G.unfit(x, w, 128, **{**common, "interleaved": True})
    assert "concatenated" in G.unfit(x, w, 128, **{**common, "gated": False})
    assert "bias" in G.unfit(x, w, 128, **{**common, "has_bias": True})
    assert "BLOCK_M" in G.unfit(x, w, 128, **{**common, "block_m": 64})
    assert "CUDA" in G.unfit(x, w, 128, **common)
    assert "contiguous" in G.unfit(torch.cat([x, x], 1)[:, ::2], w, 128, **common, gather=True)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        xc, w192 = x.cuda(), torch.zeros(4, 384, 128, dtype=torch.bfloat16, device="cuda")
        assert G.unfit(xc, w192, 192, **common, pingpong=True) is None
        assert "multiples of 128" in G.unfit(xc, w192, 192, **common)  # the cooperative tile: 128 gate columns
        w2c = torch.zeros(4, 384, 128, dtype=torch.bfloat16, device="cuda")  # H = 384: not a 256-column tile's
        assert "multiples of 256" in G.unfit2(xc, w2c, 128, has_bias=False, block_m=128)
        assert G.unfit2(xc, w2c, 128, has_bias=False, block_m=128, pingpong=True) is None  # 128-column tiles
        assert G.unfit2(xc, torch.zeros(4, 512, 128, dtype=torch.bfloat16, device="cuda"), 128, has_bias=False,
                        block_m=128) is None


def test_gluon_dgrad2_refuses_what_it_cannot_take() -> None:
    """GEMM2's dgrad on the Gluon kernel: asked for where it can't run, the backward's check
    says why (CPU tensors reach it too), and a flag of the Triton or CUTLASS kernels given with
    it is refused (it would do nothing)."""
    G = pytest.importorskip("opreg.backends.triton.moe_gemm1_gluon")
    args = make(40, 2, 256, 256, 4, torch.bfloat16, "cpu")
    x, w2 = args[0], args[5]
    c2 = {"GLUON": 2, "BLOCK_M": 128}
    why = TB._gluon_dgrad2_unfit(c2, {}, x, w2, 256, True, False, False, torch.bfloat16)
    assert why is not None and "not bf16 on CUDA" in why, why
    assert "GLUON must be 0 (off), 1 (ping-pong) or 2" in TB._gluon_dgrad2_unfit({**c2, "GLUON": 3}, {}, x, w2, 256,
                                                                                  True, False, False, torch.bfloat16)
    for given in ({"SPLIT": 1}, {"GROUPED_MM": 1}, {"HALF_TAIL": 1}, {"SUBTILE": 2}, {"PREGATHER": 0}):
        why = TB._gluon_dgrad2_unfit(c2, {**given, "GLUON": 2}, x, w2, 256, True, False, False, torch.bfloat16)
        assert why is not None and next(iter(given)) in why and "give GLUON alone" in why, why
    w_nk = w2.transpose(1, 2)  # down (E, H, I) seen as (E, I, H)
    common = dict(gated=True, interleaved=False, pre_dtype=torch.bfloat16, block_m=128)
    assert "concatenated" in G.unfit_dgrad2(x, w_nk, 256, **{**common, "interleaved": True})
    assert "concatenated" in G.unfit_dgrad2(x, w_nk, 256, **{**common, "gated": False})
    assert "float32" in G.unfit_dgrad2(x, w_nk, 256, **{**common, "pre_dtype": torch.float32})
    assert "BLOCK_M" in G.unfit_dgrad2(x, w_nk, 256, **{**common, "block_m": 64})
    assert "CUDA" in G.unfit_dgrad2(x, w_nk, 256, **common)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        xc = x.cuda()
        for layout in (torch.zeros(4, 256, 384).transpose(1, 2), torch.zeros(4, 384, 256)):  # (E, I, H), I = 384
            assert "multiples of 256" in G.unfit_dgrad2(xc, layout.to("cuda", torch.bfloat16), 384, **common)
        for layout in (w_nk, w_nk.contiguous()):  # down (E, H, I) or (E, I, H) underneath
            assert G.unfit_dgrad2(xc, layout.cuda(), 256, **common) is None
        i384 = torch.zeros(4, 256, 384, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        assert G.unfit_dgrad2(xc, i384, 384, **common, pingpong=True) is None  # 128-column tiles


# GEMM2's dgrad cases: (T, k, H, I, E), make() options; I a multiple of the 256-column tile
DGRAD2_CASES = {
    "silu": ((96, 2, 256, 256, 4), {}),
    "silu, down (E, I, H)": ((96, 2, 256, 256, 4), dict(transposed=True)),
    "gelu": ((96, 2, 256, 256, 4), dict(activation="gelu")),
    "gelu_tanh": ((96, 2, 256, 256, 4), dict(activation="gelu_tanh")),
    "relu": ((96, 2, 256, 256, 4), dict(activation="relu")),
    "relu2": ((96, 2, 256, 256, 4), dict(activation="relu2")),
    "sigmoid": ((96, 2, 256, 256, 4), dict(activation="sigmoid")),
    "gpt_oss, no clamp": ((96, 2, 256, 256, 4), dict(activation="gpt_oss", alpha=1.702)),
    "biases": ((96, 2, 256, 256, 4), dict(bias=True)),
    "sentinels": ((96, 2, 256, 256, 4), dict(sentinels=3)),
    "k=1 empty experts": ((40, 1, 128, 256, 8), {}),
    "many tiles": ((640, 8, 192, 512, 16), {}),
}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("gluon2", [1, 2], ids=["pingpong", "coop"])
@pytest.mark.parametrize("case", list(DGRAD2_CASES))
def test_cuda_gluon_dgrad2_training(case: str, gluon2: int) -> None:
    """bf16 forward + backward with GEMM2's dgrad and the gate's backward on a Gluon kernel
    (``configs["dgrad2"]["GLUON"]``: 1 ping-pong, 2 cooperative) and on the table's Triton kernels: each matches
    float64 (every buffer NaN-filled, sentinel slots' weights NaN), the gradients that go
    through d_pre and d top_k_weights match each other, the others are the same bits, two
    runs are bit-identical; and with only d top_k_weights, or only the others, asked for."""
    _gluon_module()
    dims, opts = DGRAD2_CASES[case]
    args = _requires(_special(make(*dims, torch.bfloat16, "cuda", **opts), "nan"), GRAD_ARGS)
    # the routing's 128-row blocks (the table picks 64 at these sizes)
    backward = {**_gemm1_config(args, 0), "wgrad": {"GROUPED_MM": 1, "GLUON": 0}, "dgrad1": {"GROUPED_MM": 0}}

    def configs_of(gluon: int) -> dict[str, dict[str, int]]:
        return {**backward, "dgrad2": {"GLUON": gluon2} if gluon else {"GROUPED_MM": 0}}

    _two_paths(args, configs_of, lambda g: 2, ["hidden_states", "top_k_weights", "gate_up_proj", "gate_up_bias"],
               "dgrad2 GLUON")
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    _, saved = TM.fused_experts_forward(*plain, configs=configs_of(1), save=True)
    cot = torch.randn(args[0].shape, dtype=torch.bfloat16, device="cuda")
    full = TB.fused_experts_backward(cot, *plain, saved, configs=configs_of(1))
    for asked in (("top_k_weights",), ("hidden_states", "gate_up_proj", "down_proj")):
        needs = tuple(n in asked for n in GRAD_ARGS)
        grads = TB.fused_experts_backward(cot, *plain, saved, needs=needs, configs=configs_of(1))
        for n, g, f in zip(GRAD_ARGS, grads, full):
            assert (g is not None) == (n in asked and f is not None), n
            if g is not None:
                assert torch.equal(g, f), f"d {n} with {asked} asked differs from all asked"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "as held"])
@pytest.mark.parametrize("gluon", [1, 2], ids=["pingpong", "coop"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gate", list(GATES))
def test_cuda_gluon_gemm1_forward(gate: str, shape: str, gluon: int, coalesce: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, no grad: the forward with GEMM1 on a Gluon kernel (``gluon``: 1 ping-pong, 2
    cooperative; its epilogue's stores through the shared buffer or as held) against float64
    and against the Triton GEMM1 on the same sorted rows; NaN-filled buffers (act's among
    them: a row left unwritten would show), sentinel slots with NaN weights and a negative id,
    the same bits twice, a CUDA graph replayed on new values."""
    monkeypatch.setattr(_gluon_module(), "COALESCE", coalesce)
    args, ref_args = _forward_special(make(*SHAPES[shape], torch.bfloat16, "cuda", **{**GATES[gate], "sentinels": 3}),
                                     "nan")
    want = M.reference(*tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in ref_args))
    old = TM.new_buffer
    TM.new_buffer = _nan_buffer
    try:
        got = TM.fused_experts_forward(*args, configs=_gemm1_config(args, gluon))
        again = TM.fused_experts_forward(*args, configs=_gemm1_config(args, gluon))
        triton_path = TM.fused_experts_forward(*args, configs=_gemm1_config(args, 0))
    finally:
        TM.new_buffer = old
    assert_matches(got, want, torch.bfloat16)
    assert_matches(triton_path, want, torch.bfloat16)
    assert_matches(got, triton_path.double(), torch.bfloat16)
    assert torch.equal(got, again), "two runs differ"
    _replays(args, _gemm1_config(args, gluon))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("save", [False, True], ids=["no grad", "saving pre"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gate", ["silu", "gelu_tanh", "gpt_oss", "clamped silu"])
def test_cuda_gluon_gemm1_gathered(gate: str, shape: str, save: bool) -> None:
    """bf16: the cooperative Gluon GEMM1 reading the token rows through the pair ids
    (``PREGATHER = 0``: cp.async, no sorted copy) against float64 and against the same kernel
    on the sorted copy (the same bits: the same rows, tiles and order), the pre-activation
    saved or not; NaN-filled buffers, sentinel slots with NaN weights and a negative id, the
    same bits twice, a CUDA graph replayed on new values."""
    _gluon_module()
    args, ref_args = _forward_special(make(*SHAPES[shape], torch.bfloat16, "cuda", **{**GATES[gate], "sentinels": 3}),
                                     "nan")
    want = M.reference(*tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in ref_args))
    gathered = _gemm1_config(args, 2)
    gathered["gemm1"]["PREGATHER"] = 0
    old = TM.new_buffer
    TM.new_buffer = _nan_buffer
    try:
        got = TM.fused_experts_forward(*args, configs=gathered, save=save)
        again = TM.fused_experts_forward(*args, configs=gathered, save=save)
        sorted_copy = TM.fused_experts_forward(*args, configs=_gemm1_config(args, 2), save=save)
    finally:
        TM.new_buffer = old
    if save:
        (got, saved), (again, _), (sorted_copy, saved_copy) = got, again, sorted_copy
        # bit for bit, the NaN-filled rows no pair writes too (torch.equal takes NaN != NaN)
        bits = {2: torch.int16, 4: torch.int32}[saved_copy.pre.element_size()]
        assert saved.pre is not None and torch.equal(saved.pre[:saved_copy.pre.shape[0]].view(bits),
                                                     saved_copy.pre.view(bits))
    assert_matches(got, want, torch.bfloat16)
    assert torch.equal(got, sorted_copy), "gathered rows give other bits than the sorted copy"
    assert torch.equal(got, again), "two runs differ"
    if not save:
        _replays(args, gathered)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "as held"])
@pytest.mark.parametrize("gluon1", [0, 2], ids=["GEMM1 on Triton", "GEMM1 on Gluon"])
@pytest.mark.parametrize("gluon2", [1, 2], ids=["pingpong", "coop"])
@pytest.mark.parametrize("rw_dtype", [torch.bfloat16, torch.float32], ids=["bf16 weights", "fp32 weights"])
@pytest.mark.parametrize("shape", list(SHAPES2))
def test_cuda_gluon_gemm2_forward(shape: str, rw_dtype: torch.dtype, gluon2: int, gluon1: int, coalesce: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, no grad: the forward with GEMM2 on a Gluon kernel (``gluon2``; each pair's row
    scaled by its routing weight, bf16 or fp32 as transformers' are) against float64 and the
    same forward on the Triton GEMM2; NaN-filled buffers (the pair rows among them: a row left
    unwritten would show), sentinel slots with NaN weights and a negative id, the same bits
    twice, a CUDA graph replayed on new values."""
    monkeypatch.setattr(_gluon_module(), "COALESCE", coalesce)
    args = make(*SHAPES2[shape], torch.bfloat16, "cuda", sentinels=3)
    args = sub(args, top_k_weights=args[2].to(rw_dtype))
    args, ref_args = _forward_special(args, "nan")
    want = M.reference(*tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                              for a in ref_args))
    gluon, triton_gemm2 = _gemm2_config(args, gluon1, gluon2), _gemm1_config(args, gluon1)
    old = TM.new_buffer
    TM.new_buffer = _nan_buffer
    try:
        got = TM.fused_experts_forward(*args, configs=gluon)
        again = TM.fused_experts_forward(*args, configs=gluon)
        triton_path = TM.fused_experts_forward(*args, configs=triton_gemm2)
    finally:
        TM.new_buffer = old
    assert_matches(got, want, torch.bfloat16)
    assert_matches(got, triton_path.double(), torch.bfloat16)
    assert torch.equal(got, again), "two runs differ"
    _replays(args, gluon)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "as held"])
@pytest.mark.parametrize("gluon,gluon2", [(1, 0), (2, 0), (2, 1), (2, 2)],
                         ids=["pingpong", "coop", "coop, GEMM2 pingpong", "coop, GEMM2 coop"])
@pytest.mark.parametrize("family", ["mixtral silu", "clamped silu", "k=1 empty experts"])
def test_cuda_gluon_gemm1_training(family: str, gluon: int, gluon2: int, coalesce: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 forward + backward with GEMM1 on the Gluon kernels (their saved pre-activation,
    bf16 or fp32 under a clamp, read by the backward; GEMM2 on Triton or on a Gluon kernel
    too, ``gluon2``) and on Triton: each matches float64, and Triton's path."""
    monkeypatch.setattr(_gluon_module(), "COALESCE", coalesce)
    t, k, _, _, e = FAMILIES[family][0]
    args = _requires(_special(_clear_limit(make(max(t, 96), k, 256, 128, e, torch.bfloat16, "cuda",
                                                **{**FAMILIES[family][1], "sentinels": 2})), "nan"), GRAD_ARGS)
    backward = {"wgrad": {"GROUPED_MM": 1, "GLUON": 0}, "dgrad1": {"GROUPED_MM": 0}, "dgrad2": {"GROUPED_MM": 0}}
    gluon_configs = _gemm2_config(args, gluon, gluon2) if gluon2 else _gemm1_config(args, gluon)
    _two_paths(args, lambda g: {**(gluon_configs if g else _gemm1_config(args, 0)), **backward}, lambda g: 2,
               ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj"], "GLUON")


def test_gluon_gemm1_default_rule() -> None:
    """The default asks for the cooperative kernel from GLUON_GEMM1_MIN_ROWS rows per expert
    on, and only where the kernel fits (CPU tensors never do)."""
    rows = TM.GLUON_GEMM1_MIN_ROWS
    assert TM.gluon_gemm1_default(rows) == 2
    assert TM.gluon_gemm1_default(rows - 1) == 0
    x, w = make(2 * rows, 4, 128, 128, 8, torch.bfloat16, "cpu")[0::3][:2]
    c1 = {"GLUON": 2, "BLOCK_M": 128, "PREGATHER": 1, "HALF_TAIL": 0, "PERSISTENT": 0}
    why = TM._gluon_gemm1_unfit(c1, x, w, None, 128, True, False, False, None)
    assert why is not None and ("CUDA" in why or "Gluon" in why), why


def test_describe_configs_names_gemm1s_kernel() -> None:
    """The DEBUG line of a forward's configs names the kernel GEMM1 runs on."""
    c2, cc = {"BLOCK_N": 128}, {"BLOCK_H": 256}
    for c1, kernel in (({"GLUON": 2}, "Gluon cooperative"), ({"GLUON": 1}, "Gluon ping-pong"),
                       ({"GROUPED_MM": 1}, "CUTLASS"), ({"BLOCK_M": 64}, "Triton")):
        line = TM.describe_configs(({**c1, "BLOCK_N": 64}, c2, cc))
        assert line.startswith(f"GEMM1 on {kernel}") and "'BLOCK_N': 64" in line and "BLOCK_H" in line, line


def test_gluon_gemm2_default_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMM2's default asks for the ping-pong kernel where GEMM1's asks for Gluon, on a CUDA
    device named in GLUON_GEMM2_DEVICES only (the device's name read, not its kernels run)."""
    rows = TM.GLUON_GEMM1_MIN_ROWS
    monkeypatch.setattr(TM, "_device_name", lambda index: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert TM.gluon_gemm2_default(rows, cuda) == 1
    assert TM.gluon_gemm2_default(rows - 1, cuda) == 0
    assert TM.gluon_gemm2_default(rows, torch.device("cpu")) == 0
    for other in ("NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB"):  # the latter unmeasured
        monkeypatch.setattr(TM, "_device_name", lambda index, other=other: other)
        assert TM.gluon_gemm2_default(rows, cuda) == 0, other


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("gemm2_device", [False, True], ids=["GEMM2 on Triton", "GEMM2's device"])
@pytest.mark.parametrize("save", [False, True], ids=["no grad", "training forward"])
def test_cuda_gluon_gemm1_default(save: bool, gemm2_device: bool, monkeypatch: pytest.MonkeyPatch,
                                  caplog: pytest.LogCaptureFixture) -> None:
    """On sm90 the op's forward with no configs, saving for the backward or not, runs GEMM1 on
    the cooperative kernel from GLUON_GEMM1_MIN_ROWS rows per expert on (and the Triton GEMM1
    below), and GEMM2 beside it on the ping-pong kernel where the device is one of
    GLUON_GEMM2_DEVICES (``gemm2_device``: every device's name starts with ""), matching float64
    and the Triton GEMMs' forward, every buffer NaN-filled; the ``opreg`` logger says which at
    DEBUG."""
    caplog.set_level("DEBUG", logger="opreg")
    G = _gluon_module()
    calls: list[bool] = []
    calls2: list[bool] = []
    real, real2 = G.gemm1, G.gemm2
    monkeypatch.setattr(G, "gemm1", lambda *a, **kw: (calls.append(kw.get("pingpong", False)), real(*a, **kw))[1])
    monkeypatch.setattr(G, "gemm2", lambda *a, **kw: (calls2.append(kw.get("pingpong", False)), real2(*a, **kw))[1])
    monkeypatch.setattr(TM, "new_buffer", _nan_buffer)
    monkeypatch.setattr(TM, "GLUON_GEMM2_DEVICES", ("",) if gemm2_device else ("no such device",))
    monkeypatch.setattr(TM, "_CONFIGS", {})  # picked afresh under this rule
    rows = TM.GLUON_GEMM1_MIN_ROWS
    for t, on in ((2 * rows + 40, True), (2 * rows - 80, False)):  # 4 of 8 experts' rows a token
        args = make(t, 4, 256, 256, 8, torch.bfloat16, "cuda")
        want = M.reference(*tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                  for a in args))
        calls.clear()
        calls2.clear()
        got = TM.fused_experts_forward(*args, save=save)
        got = got[0] if save else got
        assert calls == ([False] if on else []), (t, calls)
        assert calls2 == ([True] if on and gemm2_device else []), (t, calls2)
        said = [r.getMessage() for r in caplog.records if "moe_experts/triton forward, T %d," % t in r.getMessage()]
        assert len(said) == 1 and ("GEMM1 on Gluon cooperative" in said[0]) == on, said
        assert ("GEMM2 on Gluon ping-pong" in said[0]) == (on and gemm2_device), said
        assert_matches(got, want, torch.bfloat16)
        triton_path = TM.fused_experts_forward(*args, configs=_gemm1_config(args, 0))
        assert_matches(got, triton_path.double(), torch.bfloat16)
