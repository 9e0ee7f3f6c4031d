"""The fused MoE kernels inline under ``torch.compile`` (``moe_experts_train.INLINE_KERNELS``):
Dynamo traces their Python, so each launch is a node of the graph that Inductor's wrapper
launches, with no Python of ours per call.

CPU: ``tests/_inline_trace.py`` (a fresh process) traces the training step, forward and
backward through AOT autograd, and the no-grad forward, fullgraph, and reports the kernels
in each graph; the custom ops must not be there. GPU: compiled with Inductor, the same
gradients and output as eager, bit for bit, and none of our Python runs per call.
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import zlib
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _fresh as fresh  # noqa: E402
from test_moe_experts import FAMILIES, make  # noqa: E402

try:
    from opreg.backends.triton import launch as L
    from opreg.backends.triton import moe_experts as TM
    from opreg.backends.triton import moe_experts_backward as B
    from opreg.backends.triton import moe_experts_train as TR
    from opreg.backends.triton import moe_tiles as TT
except ImportError:  # pragma: no cover - the package itself imports without triton
    L = TM = B = TR = TT = None

HAVE_TRITON = TM is not None and TT.triton is not None
FORWARD = ["_route_count_kernel", "_route_scan_kernel", "_route_place_kernel", "_moe_gemm", "_moe_gemm",
           "_combine_kernel"]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(not hasattr(torch.library, "wrap_triton"), reason="this torch has no torch.library.wrap_triton")
def test_traced_graphs_hold_the_kernels() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = fresh.run([os.path.join(HERE, "_inline_trace.py")], env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GRAPHS ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    graphs = json.loads(lines[-1][len("GRAPHS "):])
    # the backward graph is compiled (and so recorded) before a run only where torch can be
    # told to (force_non_lazy_backward_lowering); the GPU test below runs it elsewhere
    eager_bw = hasattr(functorch_config, "force_non_lazy_backward_lowering")
    want = {"forward", "forward (grouped_mm)", "no-grad forward", "no-grad forward (gluon)", "forward (gluon)",
            "forward (gluon, inline)"}
    assert set(graphs) == want | ({"backward", "backward (grouped_mm)", "backward (gluon)",
                                   "backward (gluon, inline)"} if eager_bw else set()), sorted(graphs)
    assert graphs["forward"]["kernels"] == FORWARD, graphs["forward"]
    # the H200's choices: GEMM1 on the sorted copy of the rows, which the forward keeps for dW1
    assert graphs["forward (grouped_mm)"]["kernels"] == FORWARD[:3] + ["_sorted_rows_kernel"] + FORWARD[3:], \
        graphs["forward (grouped_mm)"]
    assert graphs["no-grad forward"]["kernels"] == FORWARD, graphs["no-grad forward"]
    # the Gluon GEMMs' sizes: the op, one node, and none of its kernels
    gluon = graphs.pop("no-grad forward (gluon)")
    assert gluon["kernels"] == [] and "opreg.moe_experts.default" in gluon["other"], gluon
    # ... and the training step there: its kernels, and with GLUON_TRAINING_OPS the two custom
    # ops, which run what eager runs
    assert graphs["forward (gluon, inline)"]["kernels"] == FORWARD, graphs["forward (gluon, inline)"]
    gluon = graphs.pop("forward (gluon)")
    assert gluon["kernels"] == [] and "opreg.moe_experts_fused.default" in gluon["other"], gluon
    if eager_bw:
        gluon = graphs.pop("backward (gluon)")
        assert gluon["kernels"] == [] and "opreg.moe_experts_fused_backward.default" in gluon["other"], gluon
    for name, g in graphs.items():
        assert not [op for op in g["other"] if "moe_experts_fused" in op], f"{name}: a custom op is in the graph"
        # a kernel's write into a view, functionalized, would copy the view's base
        copies = [op for op in g["other"] if op.split(".")[1:2] in (["slice_scatter"], ["clone"], ["copy_"], ["copy"])]
        assert not copies, f"{name}: {copies}"
    if not eager_bw:
        return
    # the backward at these sizes on the CPU's choices (Triton weight gradients, split dgrad2) ...
    assert sorted(graphs["backward"]["kernels"]) == sorted(
        ["_moe_gemm", "_gate_grad_kernel", "_route_grad_kernel", "_moe_gemm", "_combine_kernel", "_moe_wgrad",
         "_moe_wgrad"]), graphs["backward"]
    # ... and on the H200's: GEMM1's dgrad and the weight gradients on torch._grouped_mm
    grouped = graphs["backward (grouped_mm)"]
    assert "aten._grouped_mm.default" in grouped["other"] and "_moe_wgrad" not in grouped["kernels"], grouped


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_TRITON, reason="needs CUDA and triton")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_gluon_sizes_keep_the_op_one_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_eager_gluon``, asked while Dynamo traces a no-grad forward: true exactly where the
    op's eager forward takes the Gluon GEMM1 by default (bf16, sm90, from
    ``GLUON_GEMM1_MIN_ROWS`` rows per expert, a triton with Gluon), which the graph could only
    hold as the Triton GEMMs."""
    module = object()  # stands for moe_gemm1_gluon
    monkeypatch.setattr(TM, "gluon_gemm1", lambda: module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    rows = TM.GLUON_GEMM1_MIN_ROWS
    assert TR._eager_gluon("cuda", 0, "bfloat16", float(rows))
    assert TR._eager_gluon("cuda", None, "bfloat16", rows * 4.5)
    assert not TR._eager_gluon("cuda", 0, "bfloat16", rows - 0.5)
    for dtype in ("float16", "float32"):
        assert not TR._eager_gluon("cuda", 0, dtype, float(rows))
    assert not TR._eager_gluon("cpu", None, "bfloat16", float(rows))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (10, 0))
    assert not TR._eager_gluon("cuda", 0, "bfloat16", float(rows))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(TM, "gluon_gemm1", lambda: "triton has no Gluon (...)")
    assert not TR._eager_gluon("cuda", 0, "bfloat16", float(rows))


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_gluon_wgrad_sizes_train_through_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_eager_gluon_wgrad``: true exactly where the op's eager backward takes Gluon weight
    gradients by default (bf16 on sm90, from ``GLUON_WGRAD_MIN_ROWS`` rows per expert, H, N1
    and I multiples of 128, a triton with Gluon); and ``_trains_on_gluon`` asks it, beside
    ``_eager_gluon``, only where a weight's gradient is wanted."""
    from opreg.backends.triton import tune
    monkeypatch.setattr(B, "_gluon_wgrad", lambda: object())  # stands for moe_wgrad_gluon
    monkeypatch.setattr(B, "is_sm90", lambda index: index == 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rows, h, n1, i = B.GLUON_WGRAD_MIN_ROWS, 2048, 1536, 768
    assert TR._eager_gluon_wgrad("cuda", 0, "bfloat16", float(rows), h, n1, i)
    assert TR._eager_gluon_wgrad("cuda", None, "bfloat16", rows + 0.5, h, n1, i)
    assert not TR._eager_gluon_wgrad("cuda", 0, "bfloat16", rows - 0.5, h, n1, i)
    assert not TR._eager_gluon_wgrad("cuda", 0, "bfloat16", float(rows), h, n1 + 64, i)
    for dtype in ("float16", "float32"):
        assert not TR._eager_gluon_wgrad("cuda", 0, dtype, float(rows), h, n1, i)
    assert not TR._eager_gluon_wgrad("cpu", None, "bfloat16", float(rows), h, n1, i)
    monkeypatch.setattr(B, "_gluon_wgrad", lambda: None)  # a triton without Gluon
    assert not TR._eager_gluon_wgrad("cuda", 0, "bfloat16", float(rows), h, n1, i)
    monkeypatch.setattr(B, "_gluon_wgrad", lambda: object())
    monkeypatch.setattr(B, "is_sm90", lambda index: False)
    assert not TR._eager_gluon_wgrad("cuda", 0, "bfloat16", float(rows), h, n1, i)

    # _trains_on_gluon's arguments: the rows per expert, H, N1 and I of the op's (CPU tensors
    # stand for CUDA ones: both predicates are replaced by recorders)
    asked: list[tuple] = []
    monkeypatch.setattr(TR, "_eager_gluon", lambda *a: asked.append(("gemm1", *a)) and False)
    monkeypatch.setattr(TR, "_eager_gluon_wgrad", lambda *a: asked.append(("wgrad", *a)) or True)
    e, h, i, k, t = 8, 256, 128, 2, 96
    args = list(tune.inputs(e, h, i, k, t, torch.bfloat16, "cpu"))
    assert not TR._trains_on_gluon(tuple(args)), "no weight's gradient is wanted: eager runs no weight gradients"
    assert asked == [("gemm1", "cpu", None, "bfloat16", t * k / e)], asked
    args[5] = args[5].detach().requires_grad_()  # down_proj's gradient
    asked.clear()
    assert TR._trains_on_gluon(tuple(args))
    gated, transposed = args[8], args[9]
    n1 = args[3].shape[2] if transposed else args[3].shape[1]
    assert asked[-1] == ("wgrad", "cpu", None, "bfloat16", t * k / e, h, n1, n1 // 2 if gated else n1), asked
    monkeypatch.setattr(TR, "_eager_gluon", lambda *a: True)
    monkeypatch.setattr(TR, "_eager_gluon_wgrad", lambda *a: False)
    assert TR._trains_on_gluon(tuple(args)), "eager's GEMM1 on Gluon alone sends the step through the ops"


def _grads(fn: Any, args: tuple, seed: int) -> list[torch.Tensor]:
    leaves = [args[j] for j in (0, 2, 3, 4, 5, 6) if isinstance(args[j], torch.Tensor)]
    args = tuple(a.detach().requires_grad_() if any(a is leaf for leaf in leaves) else a for a in args)
    out = fn(*args)
    gen = torch.Generator(device=out.device).manual_seed(seed)
    cot = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
    got = torch.autograd.grad(out, [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad], cot)
    return [out.detach(), *got]


def _half_tail_gemm1(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every gemm1 pick with HALF_TAIL (as a table entry may set it), BLOCK_M >= 32 as it
    needs. The inputs' specs start afresh: every memo and launcher entry keyed by a spec
    (configs, launch statics, each kernel's compiled specialisation) assumes the table's
    picks, so an earlier test's entry for the same inputs would launch a kernel compiled
    for other configs (on the H200, 2026-12-05: the routing's and GEMM1's, after this
    file's other mixtral case). Returns a list that grows by one per eager pick that set it
    (not per traced one: Dynamo guards a list it appends to, and the changed length recompiled
    every call, which ran the picks' Python per call: on the H100, 2026-12-05)."""
    pick, set_half = TM.pick_config, []

    def half(gemm: str, *args: Any, **kwargs: Any) -> dict[str, int]:
        cfg = pick(gemm, *args, **kwargs)
        if gemm == "gemm1" and not cfg.get("PERSISTENT", 0):
            cfg = {**cfg, "BLOCK_M": max(32, cfg["BLOCK_M"]), "HALF_TAIL": 1}
            if not torch.compiler.is_compiling():  # counted in eager: an append Dynamo traces
                set_half.append(1)  # guards the list's length, so every call recompiled
        return cfg
    monkeypatch.setattr(TM, "pick_config", half)
    monkeypatch.setattr(TM, "_SPEC_IDS", {})  # new ids (never reused): nothing keyed by an old one is hit
    return set_half


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family,half", [("mixtral silu", False), ("gpt_oss biases", False),
                                         ("mixtral silu", True)])
def test_cuda_inline_equals_eager(family: str, half: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor over the inlined kernels: the training step's output and every gradient, and
    the no-grad forward, equal eager's bit for bit; after compiling, a call runs none of the
    fused forward's or backward's Python. ``half``: GEMM1 with HALF_TAIL (its A in full and
    half tiles through two descriptors of one tensor)."""
    monkeypatch.setattr(TR, "INLINE_KERNELS", True)
    set_half = _half_tail_gemm1(monkeypatch) if half else []
    dims, opts = FAMILIES[family]
    seed = zlib.crc32(family.encode())
    torch.manual_seed(seed)
    args = make(*dims, torch.bfloat16, "cuda", **opts)
    assert TR.fused_trains(args)
    eager = _grads(lambda *a: B.FusedExperts.apply(*a), args, seed)
    with torch.no_grad():
        eager_fwd = TM.fused_experts_forward(*args)
    torch._dynamo.reset()
    step = torch.compile(TR.train, fullgraph=True)
    forward = torch.compile(TR.inline_forward, fullgraph=True)
    compiled = _grads(step, args, seed)  # compiles
    with torch.no_grad():
        forward(*args)  # compiles
    # functions defined in these modules' files (not torch's wrappers a module imports, whose
    # code torch.compile's own wrapper shares: on torch 2.11 that put its `_fn` here)
    files = {os.path.realpath(mod.__file__) for mod in (TM, B, TR, L)}
    defined = []
    for v in (v for mod in (TM, B, TR, L) for v in vars(mod).values()):
        members = vars(v).values() if inspect.isclass(v) else [v]  # a class: its methods
        defined += [m.__func__ if isinstance(m, (staticmethod, classmethod)) else m for m in members]
    ours = {f.__code__ for f in defined if inspect.isfunction(f)
            and os.path.realpath(f.__code__.co_filename) in files}
    assert {TR.train.__code__, B.FusedExperts.forward.__code__, B.FusedExperts.backward.__code__} <= ours
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in ours:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        again = _grads(step, args, seed)
        with torch.no_grad():
            got_fwd = forward(*args)
    finally:
        sys.setprofile(None)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "compiled training step differs from eager"
    assert all(torch.equal(a, b) for a, b in zip(compiled, again)), "two compiled runs differ"
    assert torch.equal(got_fwd, eager_fwd), "compiled no-grad forward differs from eager"
    assert calls == [], f"our Python ran per call: {sorted(set(calls))}"
    assert bool(set_half) == half, f"gemm1 picks with HALF_TAIL: {len(set_half)}, asked: {half}"


@pytest.mark.cuda
@cuda
def test_cuda_gluon_sizes_compile_to_the_op() -> None:
    """Where the eager forward runs the Gluon GEMM1 (sm90, bf16, >= GLUON_GEMM1_MIN_ROWS rows
    per expert), a compiled no-grad forward declines to inline (``_eager_gluon``) and the op,
    one node, runs what eager runs: the same bits, and the forward's Python per call."""
    from opreg.backends.triton import tune
    e, h, i, k = 8, 512, 256, 2
    t = TM.GLUON_GEMM1_MIN_ROWS * e // k
    torch.manual_seed(zlib.crc32(b"gluon sizes"))
    args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
    device = args[0].device
    if not TR._eager_gluon("cuda", device.index, "bfloat16", t * k / e):
        pytest.skip("the eager forward takes no Gluon GEMM1 here (not sm90, or no Gluon)")
    with torch.no_grad():
        eager = TM.fused_experts_forward(*args)
    picked = TM._CONFIGS.get((TM.spec_of(*args), False, False, None))
    assert picked is not None and picked[0].get("GLUON", 0) == 2, f"eager's GEMM1 is not the Gluon one: {picked}"

    def forward(*a: Any) -> torch.Tensor:
        out = TR.inline_forward(*a)
        return torch.ops.opreg.moe_experts(*a) if out is None else out

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True)
    with torch.no_grad():
        compiled(*args)  # compiles
        runs: list[int] = []
        real = TM._forward
        TM._forward = lambda *a, **kw: runs.append(1) or real(*a, **kw)
        try:
            TM._PLANS.memo.clear()  # the call runs (and records) the Python path
            got = compiled(*args)
        finally:
            TM._forward = real
    assert torch.equal(got, eager), "the compiled forward differs from eager's"
    assert runs, "the op's forward did not run: its kernels were inlined"


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("gemm1", [True, False], ids=["gemm1 and wgrad", "wgrad only"])
def test_cuda_gluon_sizes_train_through_the_ops(monkeypatch: pytest.MonkeyPatch, gemm1: bool) -> None:
    """With ``GLUON_TRAINING_OPS``, where eager runs Gluon kernels (GEMM1 and the weight
    gradients, or the weight gradients alone: ``GLUON_WGRAD_MIN_ROWS`` rows per expert), a
    compiled training step goes through the two custom ops, which run what eager runs: the
    output and every gradient the same bits, and the fused forward's and backward's Python
    runs per call."""
    from opreg.backends.triton import tune
    monkeypatch.setattr(TR, "INLINE_KERNELS", True)
    monkeypatch.setattr(TR, "GLUON_TRAINING_OPS", True)
    e, h, i, k = 8, 512, 256, 2
    t = (TM.GLUON_GEMM1_MIN_ROWS if gemm1 else B.GLUON_WGRAD_MIN_ROWS) * e // k
    seed = zlib.crc32(b"gluon sizes, training" + bytes(gemm1))
    torch.manual_seed(seed)
    args = tune.inputs(e, h, i, k, t, torch.bfloat16, "cuda")
    device = args[0].device
    if TR._eager_gluon("cuda", device.index, "bfloat16", t * k / e) != gemm1:
        pytest.skip(f"the eager forward's GEMM1 is {'not ' if gemm1 else ''}on Gluon here (not sm90, or no Gluon)")
    if not TR._eager_gluon_wgrad("cuda", device.index, "bfloat16", t * k / e, h, 2 * i, i):
        pytest.skip("the eager backward takes no Gluon weight gradients here (not sm90, or no Gluon)")
    assert TR.fused_trains(args)
    eager = _grads(lambda *a: B.FusedExperts.apply(*a), args, seed)
    torch._dynamo.reset()
    step = torch.compile(TR.train, fullgraph=True)
    compiled = _grads(step, args, seed)  # compiles
    runs: list[str] = []
    fwd, bwd = TM.fused_experts_forward, B.fused_experts_backward
    monkeypatch.setattr(TM, "fused_experts_forward", lambda *a, **kw: runs.append("forward") or fwd(*a, **kw))
    monkeypatch.setattr(B, "fused_experts_backward", lambda *a, **kw: runs.append("backward") or bwd(*a, **kw))
    again = _grads(step, args, seed)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "compiled training step differs from eager"
    assert all(torch.equal(a, b) for a, b in zip(compiled, again)), "two compiled runs differ"
    assert runs == ["forward", "backward"], f"the custom ops did not run (their kernels were inlined?): {runs}"
