"""moe_experts: the generic op suite (correctness vs float64, gradients, gradcheck, opcheck,
determinism, bad input), then what is specific: the differentiable grouped path the
transformers integration trains with, expert-parallel sentinels, the listing, and on CUDA
the grouped_mm path, CUDA-graph capture and bit-identical reruns."""
from __future__ import annotations

import math

import pytest
import torch

import opreg
from opreg.ops import moe_experts as M
from opreg.ops import moe_experts_grouped as G
from opreg.testing import OpTestSuite, Sample

from _util import assert_matches, set_requires_grad

OP = torch.ops.opreg.moe_experts.default
ARGS = ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "gate_up_bias", "down_proj",
        "down_bias", "activation", "gated", "transposed", "interleaved", "alpha", "limit")


def make(t: int, k: int, h: int, i: int, e: int, dtype: torch.dtype, device: str, *,
         activation: str = "silu", gated: bool = True, transposed: bool = False, interleaved: bool = False,
         bias: bool = False, alpha: float = 1.0, limit: float = math.inf, idx_dtype: torch.dtype = torch.int64,
         sentinels: int = 0, gain: float = 1.0) -> tuple:
    """Random inputs in the op's argument order: each token picks k distinct experts (the
    first ``sentinels`` tokens' last slot an id >= E), routing weights in (0.1, 1.1)."""
    n = 2 * i if gated else i
    ids = torch.rand(t, e).argsort(-1)[:, :k]
    ids[:sentinels, -1] = e + torch.arange(min(sentinels, t)) % 3
    w1 = torch.randn(e, n, h) * gain / math.sqrt(h)
    w2 = torch.randn(e, h, i) / math.sqrt(i)
    if transposed:
        w1, w2 = w1.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    b1 = torch.randn(e, n) * 0.5 if bias else None
    b2 = torch.randn(e, h) * 0.5 if bias else None
    to = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return (to(torch.randn(t, h)), ids.to(device=device, dtype=idx_dtype), to(torch.rand(t, k) + 0.1),
            to(w1), to(b1), to(w2), to(b2), activation, gated, transposed, interleaved, alpha, limit)


FAMILIES = {  # name: (t, k, h, i, e), options -- the layouts transformers' families use
    "mixtral silu": ((13, 2, 16, 8, 4), {}),
    "gelu_tanh transposed": ((11, 2, 16, 8, 4), dict(activation="gelu_tanh", transposed=True)),
    "gpt_oss biases": ((12, 2, 16, 8, 4), dict(activation="gpt_oss", transposed=True, interleaved=True,
                                               bias=True, alpha=1.702, limit=1.5, gain=4.0)),
    "clamped silu": ((9, 2, 16, 8, 4), dict(limit=0.7, gain=4.0)),
    "relu2 ungated": ((10, 2, 16, 8, 4), dict(activation="relu2", gated=False)),
    "gelu interleaved bias": ((8, 3, 16, 8, 5), dict(activation="gelu", interleaved=True, bias=True)),
    "k=1 empty experts": ((6, 1, 16, 8, 8), {}),
    "sentinels": ((10, 2, 16, 8, 4), dict(sentinels=4)),
    "int32 ids, k=4 of 16": ((33, 4, 24, 16, 16), dict(idx_dtype=torch.int32)),
}


def sample_inputs(device: str, dtype: torch.dtype, requires_grad: bool = False):
    for name, (dims, opts) in FAMILIES.items():
        yield Sample(set_requires_grad(make(*dims, dtype, device, **opts), requires_grad), name)
    yield Sample(set_requires_grad(make(0, 2, 16, 8, 4, dtype, device), requires_grad), "no tokens")


def small_samples(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """For gradcheck and opcheck: tiny, one per gate kind, biases and sentinels."""
    for name, opts in (("silu", {}), ("gpt_oss", dict(activation="gpt_oss", interleaved=True, bias=True,
                                                      alpha=1.702, limit=1.0, gain=3.0)),
                       ("relu2 ungated transposed", dict(activation="relu2", gated=False, transposed=True)),
                       ("sentinel", dict(sentinels=2))):
        yield Sample(set_requires_grad(make(5, 2, 4, 3, 3, dtype, device, **opts), requires_grad), name)


def sub(args: tuple, **kw) -> tuple:
    """``args`` with the named arguments replaced."""
    return tuple(kw.get(name, a) for name, a in zip(ARGS, args))


def _neg(a: tuple) -> tuple:
    idx = a[1].clone()
    idx[1, 0] = -1
    return sub(a, top_k_index=idx)


BAD = [
    ("hidden rank", lambda *a: sub(a, hidden_states=a[0][0]), ValueError, "hidden_states"),
    ("index rows", lambda *a: sub(a, top_k_index=a[1][:-1]), ValueError, "top_k_index"),
    ("weights shape", lambda *a: sub(a, top_k_weights=a[2][:, :1]), ValueError, "top_k_weights"),
    ("float index", lambda *a: sub(a, top_k_index=a[1].float()), TypeError, "top_k_index"),
    ("int hidden", lambda *a: sub(a, hidden_states=a[0].int()), TypeError, "hidden_states"),
    ("weight dtype", lambda *a: sub(a, gate_up_proj=a[3].double()), TypeError, "gate_up_proj"),
    ("weight rank", lambda *a: sub(a, down_proj=a[5][0]), ValueError, "down_proj"),
    ("down shape", lambda *a: sub(a, down_proj=a[5][:, :, :-1]), ValueError, "down_proj"),
    ("odd gate_up", lambda *a: sub(a, gate_up_proj=a[3][:, :-1]), ValueError, "gate_up_proj.*even"),
    ("bias shape", lambda *a: sub(a, gate_up_bias=a[3][:, :-1, 0]), ValueError, "gate_up_bias"),
    ("activation", lambda *a: sub(a, activation="tanh"), ValueError, "activation"),
    ("gpt_oss ungated", lambda *a: sub(a, activation="gpt_oss", gated=False,
                                        gate_up_proj=a[3][:, :a[3].shape[1] // 2]), ValueError, "activation"),
    ("negative id", lambda *a: _neg(a), IndexError, r"top_k_index\[1, 0\]"),
]

SUITE = OpTestSuite("moe_experts", sample_inputs, small_samples=small_samples, bad=BAD,
                    bad_context=opreg.check_indices,
                    bad_sample=lambda device: make(6, 2, 8, 4, 3, torch.float32, device))
_tests = SUITE.pytest_tests(devices=("cpu", "cuda"), device_marks={"cuda": [pytest.mark.cuda]})
del _tests["test_cuda_graphs"]  # only the bf16 grouped_mm path is capturable: test_cuda_graph_bf16
globals().update(_tests)


def _grads(fn, args: tuple, cot: torch.Tensor) -> list[torch.Tensor]:
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return list(torch.autograd.grad(fn(*args), leaves, cot))


def _route_terms(args: tuple, cot: torch.Tensor) -> torch.Tensor:
    """(T, k) float64: the magnitude of the terms each d top_k_weights[t, j] sums,
    sum over H of |cot[t]| |y| with y slot j's expert output for token t (0 at a sentinel
    slot). The grouped path forms it as that dot over H, which cancels: its rounding grows
    with these terms, not with their sum (``assert_matches``' ``scale``)."""
    x, ids, _, w1, b1, w2, b2, act, gated, transposed, interleaved, alpha, limit = args
    e, k = w1.shape[0], ids.shape[1]
    terms = torch.zeros(ids.numel(), dtype=torch.float64)
    for p, ex in enumerate(ids.reshape(-1).tolist()):  # values only: no graph
        if 0 <= ex < e:
            t = p // k
            bias = (lambda b: None if b is None else b[ex].detach().double())  # noqa: E731
            pre = M._linear(x[t].detach().double(), w1[ex].detach().double(), bias(b1), transposed)
            y = M._linear(M.apply_gate(pre[None], act, gated, interleaved, alpha, limit)[0],
                          w2[ex].detach().double(), bias(b2), transposed)
            terms[p] = (cot[t].detach().double().abs() * y.abs()).sum()
    return terms.view(ids.shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_grouped_path_gradients(family, dtype):
    """The differentiable grouped path (what the integration trains with): output and every
    gradient equal the float64 reference's."""
    dims, opts = FAMILIES[family]
    args = set_requires_grad(make(*dims, dtype, "cpu", **opts), True)
    args64 = set_requires_grad(tuple(a.detach().double() if isinstance(a, torch.Tensor) and
                                     a.is_floating_point() else a for a in args), True)
    out = G.grouped(*args)
    want = M.reference(*args64)
    assert_matches(out, want, dtype)
    cot = torch.randn_like(want)
    for got, ref in zip(_grads(G.grouped, args, cot.to(dtype)), _grads(M.reference, args64, cot)):
        assert_matches(got, ref, dtype)


def test_sentinel_slots_contribute_nothing():
    args = make(10, 2, 16, 8, 4, torch.float64, "cpu", sentinels=5)
    ids, w = args[1], args[2]
    keep = (ids < 4).to(w.dtype)
    # The same call with the sentinel slots' weights zeroed and their ids made valid.
    fixed = sub(args, top_k_index=ids.clamp(max=3), top_k_weights=w * keep)
    assert_matches(OP(*args), M.reference(*fixed), torch.float64)
    assert not torch.equal(OP(*args), M.reference(*sub(args, top_k_index=ids.clamp(max=3))))


def test_listed_with_its_implementations():
    rows = {r["impl"]: r for r in opreg.implementations("moe_experts")}
    assert set(rows) == {"grouped", "reference", "triton"}
    assert rows["triton"]["devices"] == "cuda"
    assert rows["grouped"]["available"] and rows["grouped"]["devices"] == "cpu,cuda"
    OP(*make(4, 2, 8, 4, 3, torch.float32, "cpu"))
    assert opreg.bound("moe_experts", "cpu") == "grouped"


def test_grouped_impl_is_what_runs(monkeypatch):
    calls = []
    real = G.grouped
    monkeypatch.setattr(G, "grouped", lambda *a: calls.append(1) or real(*a))
    OP(*make(4, 2, 8, 4, 3, torch.float32, "cpu"))
    assert calls == [1]


# ------------------------------------------------------------------ torch._grouped_mm on the CPU

needs_cpu_grouped_mm = pytest.mark.skipif(not G._CPU_GROUPED_MM, reason="torch has no CPU _grouped_mm (< 2.9)")


@needs_cpu_grouped_mm
def test_cpu_takes_grouped_mm_where_its_kernel_runs(monkeypatch):
    """Eager on the CPU the grouped path's products are torch._grouped_mm for float32,
    bfloat16 and float16 rows of 16-byte multiples; float64, or other widths, one GEMM per
    expert (each way against the float64 reference)."""
    real, calls = torch._grouped_mm, []
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    # (t, k, h, i, e): h is GEMM1's K and GEMM2's N, i GEMM2's K (GEMM1's N is 2 i)
    for dtype, dims, takes in ((torch.float32, (13, 2, 16, 8, 4), 2), (torch.bfloat16, (13, 2, 16, 8, 4), 2),
                               (torch.float16, (13, 2, 16, 8, 4), 2), (torch.float64, (13, 2, 16, 8, 4), 0),
                               (torch.float32, (13, 2, 16, 6, 4), 1), (torch.float32, (13, 2, 10, 8, 4), 0),
                               (torch.bfloat16, (13, 2, 12, 8, 4), 0)):
        args = make(*dims, dtype, "cpu", bias=True)
        calls.clear()
        out = G.grouped(*args)
        assert calls == [dtype] * takes, (dtype, dims, calls)
        assert G.uses_grouped_mm(args[0], args[3].transpose(-2, -1)) == (takes > 0)
        args64 = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        assert_matches(out, M.reference(*args64), dtype)


@needs_cpu_grouped_mm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["mixtral silu", "gelu interleaved bias", "sentinels", "k=1 empty experts"])
def test_cpu_grouped_mm_half_gradients(family, dtype):
    """The grouped path in half precision on the CPU (torch._grouped_mm): output and every
    gradient within the dtype's tolerance of the float64 reference. (Not a clamped gate: a
    half-precision pre-activation within a rounding of the clamp flips its derivative, a
    whole element of the gradient, in 4 of 40 seeds of "gpt_oss biases" in bf16, as in any
    bf16 autograd; the fused kernels save it in float32 for that reason.)"""
    dims, opts = FAMILIES[family]
    args = set_requires_grad(make(*dims, dtype, "cpu", **opts), True)
    assert G.uses_grouped_mm(args[0], args[3] if opts.get("transposed") else args[3].transpose(-2, -1))
    args64 = set_requires_grad(tuple(a.detach().double() if isinstance(a, torch.Tensor) and
                                     a.is_floating_point() else a for a in args), True)
    want = M.reference(*args64)
    assert_matches(G.grouped(*args), want, dtype)
    # The reference's cotangent is the one the path gets (rounded to dtype), and d
    # top_k_weights (a dot over H that cancels) is measured against its terms: before both,
    # it went past float16's tolerance in 3 of 2400 seed x case runs (bench/RESULTS.md,
    # forty-fourth session); as test_moe_triton_backward.py does.
    cot = torch.randn_like(want).to(dtype)
    got, ref = _grads(G.grouped, args, cot), _grads(M.reference, args64, cot.double())
    for j, (g, r) in enumerate(zip(got, ref)):
        # d top_k_weights (leaf 1) against the terms it sums (assert_matches' scale)
        assert_matches(g, r, dtype, _route_terms(args64, cot.double()) if j == 1 else None)


def _per_group(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))])


@needs_cpu_grouped_mm
@pytest.mark.parametrize("transposed", [False, True], ids=["w (E, K, N)", "w a transposed view"])
def test_cpu_grouped_mm_op(transposed):
    """cpu_grouped_mm (the CPU's traced grouped product): opcheck, then output and both
    gradients against per-group float64 products, an empty group among them."""
    offs = torch.tensor([5, 5, 12, 16], dtype=torch.int32)
    x = torch.randn(16, 8, requires_grad=True)
    w = (torch.randn(4, 12, 8).transpose(-2, -1) if transposed else torch.randn(4, 8, 12)).requires_grad_(True)
    torch.library.opcheck(G.cpu_grouped_mm, (x, w, offs))
    out = G.cpu_grouped_mm(x, w, offs)
    xd, wd = (t.detach().double().requires_grad_(True) for t in (x, w))
    want = _per_group(xd, wd, offs)
    assert_matches(out, want, torch.float32)
    cot = torch.randn_like(want)
    got = torch.autograd.grad(out, (x, w), cot.float())
    for g, v in zip(got, torch.autograd.grad(want, (xd, wd), cot), strict=True):
        assert_matches(g, v, torch.float32)
    assert torch.count_nonzero(got[1][1]) == 0  # the empty group's weight gets no gradient


@pytest.mark.skipif(not G._CPU_GROUPED_MM_TRACED, reason="traced CPU grouped products need torch >= 2.11")
@pytest.mark.parametrize("family", ["gpt_oss biases", "sentinels"])
def test_cpu_grouped_path_compiled_whole(family):
    """The differentiable grouped path under torch.compile(fullgraph=True) on the CPU in
    float32: whole (each product one cpu_grouped_mm, no host read of the group sizes);
    output and every gradient equal the float64 reference's."""
    dims, opts = FAMILIES[family]
    args = set_requires_grad(make(*dims, torch.float32, "cpu", **opts), True)
    torch._dynamo.reset()
    fn = torch.compile(G.grouped, fullgraph=True)
    fn(*args)  # compiled here: the profile below sees the run alone
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run = fn(*args)
        torch.autograd.grad(run, args[0], torch.ones_like(run))
    # two products forward, two each backward: one torch._grouped_mm each, no per-expert GEMMs
    assert sum(e.name == "aten::_grouped_mm" for e in prof.events()) == 6
    out = fn(*args)
    args64 = set_requires_grad(tuple(a.detach().double() if isinstance(a, torch.Tensor) and
                                     a.is_floating_point() else a for a in args), True)
    want = M.reference(*args64)
    assert_matches(out, want, torch.float32)
    cot = torch.randn_like(want)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for got, ref in zip(torch.autograd.grad(out, leaves, cot.float()), _grads(M.reference, args64, cot)):
        assert_matches(got, ref, torch.float32)


# ------------------------------------------------------------------------------ CUDA

def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs a CUDA device of sm90 or newer")
BF16_FAMILIES = ["mixtral silu", "gpt_oss biases", "relu2 ungated", "sentinels", "int32 ids, k=4 of 16"]


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_cuda_bf16_grouped_mm(family):
    dims, opts = FAMILIES[family]
    args = make(*dims, torch.bfloat16, "cuda", **opts)
    assert G.uses_grouped_mm(args[0], args[3])
    args64 = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    out = OP(*args)
    assert_matches(out, M.reference(*args64), torch.bfloat16)
    assert torch.equal(out, OP(*args)), "two runs differ"


@pytest.mark.cuda
@needs_sm90
def test_cuda_bf16_grouped_path_gradients_deterministic():
    args = set_requires_grad(make(64, 2, 32, 16, 8, torch.bfloat16, "cuda", bias=True), True)
    cot = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    first, again = _grads(G.grouped, args, cot), _grads(G.grouped, args, cot)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "gradients differ between runs"
    args64 = set_requires_grad(tuple(a.detach().double() if isinstance(a, torch.Tensor) and
                                     a.is_floating_point() else a for a in args), True)
    for got, ref in zip(first, _grads(M.reference, args64, cot.double())):
        assert_matches(got, ref, torch.bfloat16)


@pytest.mark.cuda
@needs_sm90
def test_cuda_graph_bf16():
    """The grouped_mm path captured in a CUDA graph, replayed on new values (and new ids)."""
    def samples(device, dtype, requires_grad=False):
        for family in ("mixtral silu", "gpt_oss biases", "sentinels"):
            dims, opts = FAMILIES[family]
            yield Sample(make(*dims, dtype, device, **opts), family)

    OpTestSuite("moe_experts", samples).check_cuda_graphs(torch.bfloat16)
