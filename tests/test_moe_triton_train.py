"""moe_experts' fused training path (backends/triton/moe_experts_train.py): the custom ops
``opreg::moe_experts_fused`` / ``opreg::moe_experts_fused_backward``, the first's autograd
calling the second, and the transformers integration training through them.

As tests/test_moe_triton.py: without a GPU the kernels run under Triton's interpreter on CPU
tensors in ONE child process (this file run as a script), one pytest test per case reading
the child's verdict. Every case draws fresh inputs, fills every buffer the kernels allocate
with NaN first, and compares every gradient against ``torch.autograd.grad`` of the op's
reference in float64. On CUDA (``cuda``-marked) the same in bf16, against the grouped path,
with determinism.
"""
from __future__ import annotations

import copy
import os
import sys
import zlib
from typing import Any, Callable

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run as the interpreter child: `python tests/test_moe_triton_train.py`
    sys.path.insert(0, HERE)

from test_moe_experts import FAMILIES, make  # noqa: E402
from test_moe_triton import interpreter_child, interpreter_verdicts  # noqa: E402
from test_moe_triton_backward import _route_grad_terms  # noqa: E402

from opreg.ops import moe_experts as M  # noqa: E402
from opreg.testing import assert_matches  # noqa: E402

try:
    from opreg.backends.triton import moe_experts as TM
    from opreg.backends.triton import moe_experts_backward as B
    from opreg.backends.triton import moe_experts_train as TR
    from opreg.backends.triton import moe_routing as RT
    from opreg.backends.triton import moe_tiles as TT
except ImportError:  # pragma: no cover - the package itself imports without triton
    TM = B = TR = RT = TT = None

HAVE_TRITON = TM is not None and TT.triton is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
GRAD_POS = (0, 2, 3, 4, 5, 6)  # hidden_states, top_k_weights, gate_up_proj, gate_up_bias, down_proj, down_bias


def _leaves(args: tuple, only: tuple[int, ...] = GRAD_POS) -> tuple[tuple, list[torch.Tensor]]:
    """``args`` with the float tensors at ``only`` made leaves that require grad."""
    out = list(args)
    for j in only:
        if isinstance(out[j], torch.Tensor):
            out[j] = out[j].detach().requires_grad_()
    return tuple(out), [out[j] for j in only if isinstance(out[j], torch.Tensor)]


def _fused(*args: Any) -> torch.Tensor:
    return torch.ops.opreg.moe_experts_fused(*args)[0]


def _check_grads(fn: Callable[..., torch.Tensor], args: tuple, only: tuple[int, ...] = GRAD_POS,
                 seed: int = 0) -> list[torch.Tensor]:
    """``fn``'s output and the gradients of the leaves at ``only`` against the float64
    reference's, for a random cotangent; returns the gradients."""
    gen = torch.Generator().manual_seed(seed)
    args, leaves = _leaves(args, only)
    out = fn(*args)
    dtype = args[0].dtype
    cot = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=dtype)
    got = torch.autograd.grad(out, leaves, cot)
    a64, l64 = _leaves(tuple(a.detach().double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                             else a for a in args), only)
    ref = M.reference(*a64)
    assert_matches(out, ref, dtype)
    want = torch.autograd.grad(ref, l64, cot.double())
    # where the forward saves pre in bf16 (moe_experts.PRE_BF16), d top_k_weights carries
    # its rounding, as HF's bf16 autograd does: measured against its terms
    pre_bf16 = TM is not None and TM.pre_dtype(dtype, args[8], args[12]) == torch.bfloat16
    for j, g, w in zip([j for j in only if isinstance(args[j], torch.Tensor)], got, want):
        scale = _route_grad_terms(a64, cot) if j == 2 and pre_bf16 else None
        assert_matches(g, w, dtype, scale)
    return list(got)


# ------------------------------------------------------------------ interpreted cases

def _case_op(seed: int, family: str, dtype: torch.dtype, only: tuple[int, ...] = GRAD_POS) -> None:
    dims, opts = FAMILIES[family]
    torch.manual_seed(seed)
    _check_grads(_fused, make(*dims, dtype, "cpu", **opts), only, seed)


def _case_compiled(seed: int) -> None:
    """Traced (Dynamo, AOT autograd, fullgraph): one node each way, the same bits as eager."""
    dims, opts = FAMILIES["gpt_oss biases"]
    torch.manual_seed(seed)
    args = make(*dims, torch.float32, "cpu", **opts)
    eager = _check_grads(_fused, args, seed=seed)
    torch._dynamo.reset()
    compiled = _check_grads(torch.compile(_fused, backend="aot_eager", fullgraph=True), args, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "compiled gradients differ from eager"


def _case_keep_rows(seed: int) -> None:
    """``keep_rows``: GEMM1 reads a sorted copy of the token rows and the op returns it for
    the backward's dW1. Right gradients eager and traced (the fake kernel gives the copy's
    shape; the same bits both ways), and the copy holds x's row for each real pair in sorted
    order (unpadded: S = T*k rows, the pairs of a sentinel slot's id past the last run end)."""
    dims, opts = FAMILIES["gpt_oss biases"]
    torch.manual_seed(seed)
    args = make(*dims, torch.float32, "cpu", **opts)

    def kept(*a: Any) -> torch.Tensor:
        return torch.ops.opreg.moe_experts_fused(*a, True)[0]

    eager = _check_grads(kept, args, seed=seed)
    x, ids, w1, gated, transposed = args[0], args[1], args[3], args[8], args[9]
    out, routing, _, _, rows = torch.ops.opreg.moe_experts_fused(*args, True)
    (t, k), e = ids.shape, w1.shape[0]
    spi, _, tables = RT.routing_views(routing, t * k, e, TR._block_m(x, ids, w1, gated, transposed))
    spi = spi.long()
    assert rows.shape == (t * k, x.shape[1]), rows.shape
    real = spi < t * k
    assert bool((~real[:int(tables[3, -1])]).any()), "no padding row: the case does not test the unpadded layout"
    n = int(tables[0, -1])  # the real pairs, in the list's order
    assert n == int(real.sum())
    assert torch.equal(rows[:n], x[spi[real] // k]), "a kept row is not x's row of its pair"
    assert torch.ops.opreg.moe_experts_fused(*args)[4].shape == (0, x.shape[1]), "rows kept, not asked for"
    torch._dynamo.reset()
    compiled = _check_grads(torch.compile(kept, backend="aot_eager", fullgraph=True), args, seed=seed)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "compiled gradients differ from eager"


def _case_opcheck(seed: int) -> None:
    """Schema, fake kernels (the saved tensors' sizes), autograd registration. Not opcheck's
    AOT-dispatch test: it compares every output of eager and traced runs, and the saved
    buffers' padding rows hold whatever the allocator gave (the backward never reads
    them); the "compiled" case compares the traced gradients with eager's bit for bit."""
    torch.manual_seed(seed)
    args, _ = _leaves(make(*FAMILIES["sentinels"][0], torch.float32, "cpu", **FAMILIES["sentinels"][1]))
    torch.library.opcheck(torch.ops.opreg.moe_experts_fused.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def _case_no_slot(seed: int) -> None:
    """No token: an empty output and zero gradients, nothing launched on the saved buffers."""
    args = make(0, 2, 16, 8, 4, torch.float32, "cpu", bias=True)
    args, leaves = _leaves(args)
    out = _fused(*args)
    grads = torch.autograd.grad(out.sum() + sum(t.sum() * 0 for t in leaves), leaves)
    assert out.shape == (0, 16) and all(bool((g == 0).all()) for g in grads)


def _case_transformers(seed: int) -> None:
    """A transformers MoE block (Qwen3-MoE layout) trained with experts_implementation
    "opreg" takes the fused path (counted) and matches HF's eager block in float64."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    import opreg.integrations.transformers  # noqa: F401  (registers "opreg")

    cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=16, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(cfg).float()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    ref = copy.deepcopy(block).double()
    ref.experts.config._experts_implementation = "eager"
    block.experts.config._experts_implementation = "opreg"
    calls = []
    real, bound = TR.train, TR._bound
    TR.train = lambda *a: calls.append(1) or real(*a)
    TR._bound = lambda device_type: "triton"  # the CPU binds "grouped"; the interpreter runs the kernels here
    try:
        x = torch.randn(1, 7, 32)
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        cot = torch.randn(out.shape)
        (out * cot).sum().backward()
    finally:
        TR.train, TR._bound = real, bound
    assert calls == [1], f"the fused training path ran {len(calls)} times"
    want = ref(x.double())
    want = want[0] if isinstance(want, tuple) else want
    (want * cot.double()).sum().backward()
    assert_matches(out, want, torch.float32)
    for (name, p), q in zip(block.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        assert_matches(p.grad, q.grad, torch.float32)


def _case_op_itself(seed: int) -> None:
    """The op called with gradients (``torch.ops.opreg.moe_experts``, what ``opreg.get``
    returns) where it binds ``triton`` trains through the same fused path (counted), not
    through its reference: the implementation's ``train`` (``Impl.train``). With a
    ``use("reference")`` scope it takes the reference's gradients again."""
    from opreg import registry

    op = registry.lookup(M.NAME)
    name = registry.bound(M.NAME, "cpu") or registry.resolve(M.NAME, "cpu").name
    calls = []
    real, bound, impl_train = TR.train, TR._bound, op.impls[name].train
    TR.train = lambda *a: calls.append(1) or real(*a)
    TR._bound = lambda device_type: "triton"  # the CPU binds another; the interpreter runs the kernels here
    op.impls[name].train = TM.moe_experts_triton_train  # as the triton implementation declares it on CUDA
    try:
        dims, opts = FAMILIES["gpt_oss biases"]
        torch.manual_seed(seed)
        _check_grads(torch.ops.opreg.moe_experts, make(*dims, torch.float32, "cpu", **opts), seed=seed)
        assert calls == [1], f"the fused training path ran {len(calls)} times"
        import opreg

        with opreg.use(moe_experts="reference"):
            _check_grads(torch.ops.opreg.moe_experts, make(*dims, torch.float32, "cpu", **opts), seed=seed)
        assert calls == [1], "a use('reference') scope still trained through the fused path"
        # inside torch.func (functorch's wrapped tensors have no data pointer), and forward
        # mode: the reference's derivatives, right, before anything reads a data pointer
        args = make(*dims, torch.float32, "cpu", **opts)
        w = args[2]
        got = torch.func.grad(lambda rw: torch.ops.opreg.moe_experts(*args[:2], rw, *args[3:]).sum())(w)
        want = torch.func.grad(lambda rw: M.reference(*args[:2], rw, *args[3:]).sum())(w)
        assert_matches(got, want, torch.float32)
        tangent = torch.randn_like(args[0])
        _, got_t = torch.func.jvp(lambda x: torch.ops.opreg.moe_experts(x, *args[1:]), (args[0],), (tangent,))
        _, want_t = torch.func.jvp(lambda x: M.reference(x, *args[1:]), (args[0],), (tangent,))
        assert_matches(got_t, want_t, torch.float32)
        assert calls == [1], "a torch.func transform trained through the fused path"
    finally:
        TR.train, TR._bound = real, bound
        op.impls[name].train = impl_train


def _case_double_backward(seed: int) -> None:
    """A second derivative through the fused path (``create_graph``): the backward then
    differentiates the reference, so it is right (vs float64), not zeros or an error."""
    dims, opts = FAMILIES["mixtral silu"]
    torch.manual_seed(seed)
    args = make(*dims, torch.float32, "cpu", **opts)

    def second(fn: Callable[..., torch.Tensor], a: tuple) -> tuple[torch.Tensor, ...]:
        a, leaves = _leaves(a, (0, 3))
        out = fn(*a)
        gen = torch.Generator().manual_seed(seed)
        v = torch.randn(out.shape, generator=gen).to(out.dtype)
        g = torch.autograd.grad(out, leaves, v, create_graph=True)
        w = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in g]
        s = sum((gi * wi).sum() for gi, wi in zip(g, w))
        return torch.autograd.grad(s, leaves)

    got = second(lambda *a: B.FusedExperts.apply(*a), args)
    want = second(M.reference, tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                     for a in args))
    for g, w in zip(got, want):
        assert_matches(g, w, torch.float32)
        assert bool(g.abs().sum() > 0)


CASES: dict[str, Callable[[int], None]] = {
    "op fp32 gpt_oss biases": lambda s: _case_op(s, "gpt_oss biases", torch.float32),
    "op fp16 relu2 ungated": lambda s: _case_op(s, "relu2 ungated", torch.float16),
    "op fp32 sentinels, hidden_states only": lambda s: _case_op(s, "sentinels", torch.float32, (0,)),
    "op fp32 empty experts, weights only": lambda s: _case_op(s, "k=1 empty experts", torch.float32, (3, 5)),
    "compiled": _case_compiled,
    "keep rows": _case_keep_rows,
    "opcheck": _case_opcheck,
    "no slot": _case_no_slot,
    "transformers block": _case_transformers,
    "the op itself trains fused": _case_op_itself,
    "double backward": _case_double_backward,
}
CASE_IDS = list(CASES)


def run_case(case_id: str, seed: int) -> None:
    CASES[case_id](seed ^ zlib.crc32(case_id.encode()))


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return interpreter_verdicts(tmp_path_factory, __file__, "triton-interpreter-train")


@needs_triton
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_interpreted(case_id: str, interpreted: dict[str, str]) -> None:
    assert interpreted.get(case_id) == "ok", interpreted.get(case_id, "not run")


# ------------------------------------------------------------------ in process

@needs_triton
def test_plain_no_grad_calls_skip_the_autograd_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled graph calls the forward op with plain tensors and no gradient to record:
    its Autograd kernel passes that call straight to the implementation (host time), and
    anything that can carry a gradient, or a traced call, through the autograd.Function."""
    args = make(5, 2, 16, 8, 4, torch.float32, "cpu")
    seen: list[int] = []

    def implementation(*a: Any) -> tuple[torch.Tensor, ...]:
        seen.append(len(a))
        return tuple(torch.zeros(1) for _ in range(5))

    class Recorded(Exception):
        pass

    def apply(*a: Any) -> Any:
        raise Recorded

    monkeypatch.setattr(TR, "_fused", implementation)
    monkeypatch.setattr(TR._FusedFunction, "apply", apply)
    with torch.no_grad():
        torch.ops.opreg.moe_experts_fused(*args)
    torch.ops.opreg.moe_experts_fused(*args)  # grad mode on, but nothing requires grad
    assert seen == [14, 14]  # keep_rows' default filled in
    leaves, _ = _leaves(args)
    with pytest.raises(Recorded):
        torch.ops.opreg.moe_experts_fused(*leaves)
    with torch._subclasses.FakeTensorMode() as mode, pytest.raises(Recorded):
        torch.ops.opreg.moe_experts_fused(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                             for a in args))


@needs_triton
def test_fused_trains_only_where_triton_runs() -> None:
    """On the CPU the op binds ``grouped``: the integration trains through the grouped path."""
    args = make(5, 2, 16, 8, 4, torch.float32, "cpu")
    assert not TR.fused_trains(args)


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_TRITON, reason="needs CUDA and triton")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["mixtral silu", "gpt_oss biases", "relu2 ungated", "sentinels"])
def test_cuda_train_matches_reference(family: str) -> None:
    """bf16 on the GPU (the weight gradients on torch._grouped_mm where it applies): every
    gradient against float64, and two runs bit-identical."""
    dims, opts = FAMILIES[family]
    torch.manual_seed(zlib.crc32(family.encode()))
    args = make(*dims, torch.bfloat16, "cuda", **opts)
    assert TR.fused_trains(args)
    first = _check_grads(_fused, args)
    second = _check_grads(_fused, args)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "two runs differ"


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family", ["mixtral silu", "sentinels"])
def test_cuda_keep_rows(family: str) -> None:
    """bf16 on the GPU with GEMM1's sorted copy of the rows kept for dW1 (``keep_rows``, as
    the traced training path asks where dW1 runs on torch._grouped_mm): every gradient
    against float64, and the same bits as without it (the same values reach the same MMAs
    and the same grouped_mm), run twice."""
    dims, opts = FAMILIES[family]
    torch.manual_seed(zlib.crc32(family.encode()) + 1)
    args = make(*dims, torch.bfloat16, "cuda", **opts)
    kept = _check_grads(lambda *a: torch.ops.opreg.moe_experts_fused(*a, True)[0], args)
    again = _check_grads(lambda *a: torch.ops.opreg.moe_experts_fused(*a, True)[0], args)
    plain = _check_grads(_fused, args)
    assert all(torch.equal(a, b) for a, b in zip(kept, again)), "two runs differ"
    assert all(torch.equal(a, b) for a, b in zip(kept, plain)), "kept rows changed a gradient's bits"


@pytest.mark.cuda
@cuda
def test_cuda_op_itself_trains_fused() -> None:
    """``torch.ops.opreg.moe_experts`` called with gradients on CUDA, where it binds
    ``triton``, trains through the fused kernels (``Impl.train``): counted, every gradient
    against float64, and the same bits as the fused path called directly."""
    dims, opts = FAMILIES["gpt_oss biases"]
    torch.manual_seed(11)
    args = make(*dims, torch.bfloat16, "cuda", **opts)
    calls, real = [], TR.train
    TR.train = lambda *a: calls.append(1) or real(*a)
    try:
        got = _check_grads(torch.ops.opreg.moe_experts, args)
    finally:
        TR.train = real
    assert calls == [1], f"the fused training path ran {len(calls)} times"
    assert all(torch.equal(a, b) for a, b in zip(got, _check_grads(lambda *a: B.FusedExperts.apply(*a), args)))


@pytest.mark.cuda
@cuda
def test_cuda_train_compiled_with_inductor() -> None:
    """Under Inductor the two ops stay single nodes: gradients equal eager's."""
    dims, opts = FAMILIES["mixtral silu"]
    torch.manual_seed(3)
    args = make(*dims, torch.bfloat16, "cuda", **opts)
    eager = _check_grads(_fused, args)
    torch._dynamo.reset()
    compiled = _check_grads(torch.compile(_fused, fullgraph=True), args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


if __name__ == "__main__":
    interpreter_child(CASE_IDS, run_case)
    sys.exit(0)
