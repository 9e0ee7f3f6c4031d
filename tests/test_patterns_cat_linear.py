"""The cat_linear pattern, spelling by spelling: the ops before and after the pass, the
match count, and equality with eager. Then the spellings it must leave alone.

Graphs run eagerly after the pass and the op is bound to its reference (see
test_backend.py for Inductor and the default kernels).
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import opreg
from opreg.backend import RecordingBackend, apply_patterns
from opreg.ops.cat_linear import reference as cl_reference
from opreg.patterns import cat_linear as pattern

OP = "opreg::cat_linear"
STACKED = "opreg::cat_linear_stacked"   # what a cat of all of one tensor's slices becomes
R, B, S, H, K = 3, 5, 2, 4, 6
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    torch._dynamo.reset()
    pattern.PATTERN.reset_counters()
    with opreg.use("reference"):
        yield


def run(fn: Callable[..., Any], args: list[Any], rec: RecordingBackend | None = None) -> RecordingBackend:
    """Compile ``fn`` (one graph) and check its result == eager."""
    rec = rec or RecordingBackend()
    expected = fn(*[a.clone() for a in args])
    got = torch.compile(fn, backend=rec, fullgraph=True)(*[a.clone() for a in args])
    torch.testing.assert_close(got, expected)
    return rec


# ------------------------------------------------------------------------------ spellings
# The cat (list comprehension / unbind / separate tensors) x the linear (nn.Linear,
# F.linear, @ W.T + b, addmm) x bias or not x 2-D or 3-D parts.

def cat_comprehension(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[i] for i in range(R)], -1)


def cat_unbind(x: torch.Tensor) -> torch.Tensor:
    return torch.cat(list(x.unbind(0)), dim=-1)


def cat_separate(x: torch.Tensor) -> torch.Tensor:
    a, b, c = x[0] * 2, x[1].sin(), x[2].neg()   # three unrelated tensors
    return torch.concat([a, b, c], dim=x.dim() - 2)


CATS = [cat_comprehension, cat_unbind, cat_separate]
EMITS = {cat_comprehension: STACKED, cat_unbind: STACKED, cat_separate: OP}


def _linears(dtype: torch.dtype) -> dict[str, tuple[Callable[..., Any], str, str]]:
    """name -> (linear(cat_result), the op it replaces, spelling counted)."""
    lin = nn.Linear(R * H, K).to(dtype)
    lin_nobias = nn.Linear(R * H, K, bias=False).to(dtype)
    w, b = torch.randn(K, R * H, dtype=dtype), torch.randn(K, dtype=dtype)
    return {
        "nn.Linear": (lambda c: lin(c), "linear", "linear"),
        "nn.Linear-nobias": (lambda c: lin_nobias(c), "linear", "linear"),
        "F.linear": (lambda c: F.linear(c, w, b), "linear", "linear"),
        "F.linear-nobias": (lambda c: F.linear(c, w), "linear", "linear"),
        "matmul-T-bias": (lambda c: c @ w.T + b, "matmul", "cat @ W.T + b"),
        "matmul-t-nobias": (lambda c: torch.matmul(c, w.t()), "matmul", "cat @ W.T"),
        "bias-first-transpose": (lambda c: b + c @ w.transpose(0, 1), "matmul", "cat @ W.T + b"),
        "addmm": (lambda c: torch.addmm(b, c, w.t()), "addmm", "addmm"),
        "mm-permute": (lambda c: torch.mm(c, w.permute(1, 0)), "mm", "cat @ W.T"),
    }


# addmm/mm take 2-D operands only
CASES = [pytest.param(cat, lin, d3, id=f"{cat.__name__}-{lin}-{'3d' if d3 else '2d'}")
         for cat in CATS for lin in _linears(torch.float32) for d3 in (False, True)
         if not (d3 and lin in ("addmm", "mm-permute"))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cat,linear,parts_3d", CASES)
def test_spelling(cat: Callable[..., Any], linear: str, parts_3d: bool, dtype: torch.dtype) -> None:
    fn_lin, before_op, spelling = _linears(dtype)[linear]

    def model(x: torch.Tensor) -> torch.Tensor:
        return fn_lin(cat(x))

    x = torch.randn(R, B, S, H, dtype=dtype) if parts_3d else torch.randn(R, B, H, dtype=dtype)
    rec = run(model, [x])
    assert rec.before[0]["cat"] + rec.before[0]["concat"] == 1
    assert rec.before[0][before_op] == 1 and rec.before[0][OP] == rec.before[0][STACKED] == 0
    after, emitted = rec.after[0], EMITS[cat]
    other = STACKED if emitted == OP else OP
    assert after[emitted] == 1 and after[other] == 0, after
    assert after["cat"] == after["concat"] == after[before_op] == 0, after
    assert after["add"] == 0 and after["numpy_T"] == after["t"] == 0, after
    if emitted == STACKED:  # the slices are gone from the graph, not just unused
        assert after["getitem"] == after["unbind"] == 0, after
    assert pattern.matches[spelling] == 1 == pattern.PATTERN.total


def test_reference_model() -> None:
    from opreg.models import cat_linear as ref

    m = ref.Model()
    (x,) = ref.get_inputs()
    rec = run(m, [x])
    assert rec.after[0][STACKED] == 1 and rec.after[0]["cat"] == 0
    assert sum(rec.after[0].values()) == 1, rec.after[0]  # nothing else runs
    w, b = m.proj.weight, m.proj.bias
    torch.testing.assert_close(torch.compile(m, backend=rec)(x),
                               cl_reference(list(x.unbind(0)), w, b))


def test_gradients_match_eager() -> None:
    lin = nn.Linear(R * H, K).double()
    x0 = torch.randn(R, B, H, dtype=torch.float64)
    grads = []
    for compiled in (False, True):
        lin.zero_grad()
        x = x0.clone().requires_grad_()
        f = torch.compile(lambda t: lin(cat_comprehension(t)),
                          backend=RecordingBackend(inner="aot_eager"), fullgraph=True) \
            if compiled else (lambda t: lin(cat_comprehension(t)))
        (f(x).sin().sum()).backward()
        grads.append((x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
    torch.testing.assert_close(grads[1], grads[0])
    assert pattern.PATTERN.total == 1


def test_dynamic_batch_one_graph() -> None:
    lin = nn.Linear(R * H, K)
    rec = RecordingBackend()
    f = torch.compile(lambda t: lin(cat_unbind(t)), backend=rec)
    for b in (5, 9, 3, 17):
        x = torch.randn(R, b, H)
        torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(f(x), lin(cat_unbind(x)))
    # A dynamic batch can be any size: the list form, which suits every size.
    assert len(rec.before) == 1 and rec.after[0][OP] == 1 and rec.after[0][STACKED] == 0


# ----------------------------------------------------------- the stacked form, and when not

def _slices_dim1(x: torch.Tensor) -> list[torch.Tensor]:
    return [x[:, i] for i in range(S)]


@pytest.mark.parametrize("parts,dim", [
    (lambda x: [x[:, i] for i in range(S)], 1),
    (lambda x: [x.select(1, i) for i in range(S)], 1),
    (lambda x: list(torch.unbind(x, 1)), 1),
    (lambda x: list(x.unbind(dim=-2)), 1),
    (lambda x: [x[i] for i in range(B)], 0),
], ids=["getitem-dim1", "select-dim1", "torch.unbind-dim1", "unbind-neg-dim", "getitem-dim0"])
def test_stacked_spellings(parts: Callable[..., Any], dim: int) -> None:
    x = torch.randn(B, S, H)
    w, b = torch.randn(K, x.shape[dim] * H), torch.randn(K)  # width = slices * H
    rec = run(lambda t: F.linear(torch.cat(parts(t), -1), w, b), [x])
    assert rec.after[0][STACKED] == 1 and rec.after[0][OP] == 0, rec.after[0]
    call = next(n for n in rec.graphs[0].graph.nodes if n.op == "call_function"
                and n.target is torch.ops.opreg.cat_linear_stacked.default)
    assert call.args[1] == dim


@pytest.mark.parametrize("parts", [
    lambda x: [x[0], x[1]],                 # not every slice (x has R = 3)
    lambda x: [x[1], x[0], x[2]],           # out of order
    lambda x: [x[0], x[1], x[-1]],          # negative index
    lambda x: [x[0], x[1], x[2] + 0],       # one is not a slice
    lambda x: [x[0], x[1], x[2].clone()],
], ids=["partial", "out-of-order", "negative", "computed", "clone"])
def test_not_all_slices_keeps_the_list_form(parts: Callable[..., Any]) -> None:
    x = torch.randn(R, B, H)
    n = len(parts(x))
    w = torch.randn(K, n * H)
    rec = run(lambda t: F.linear(torch.cat(parts(t), -1), w), [x])
    assert rec.after[0][OP] == 1 and rec.after[0][STACKED] == 0, rec.after[0]


@pytest.mark.parametrize("rows,stacked", [(1024, True), (1025, False)])
def test_stacked_only_for_small_problems(rows: int, stacked: bool) -> None:
    """Up to STACKED_MAX_MACS multiply-adds (here 1024 rows x 1024 in x 16 out = 2^24)
    the stacked form; above, the list form (its CUDA GEMM path measured faster)."""
    x = torch.randn(4, rows, 256)
    w = torch.randn(16, 4 * 256)
    assert 1024 * 4 * 256 * 16 == pattern.STACKED_MAX_MACS
    rec = run(lambda t: F.linear(torch.cat([t[i] for i in range(4)], -1), w), [x])
    assert rec.after[0][STACKED if stacked else OP] == 1, rec.after[0]
    assert rec.after[0][OP if stacked else STACKED] == 0, rec.after[0]


def test_slices_of_two_tensors_keep_the_list_form() -> None:
    w = torch.randn(K, 4 * H)
    rec = run(lambda a, c: F.linear(torch.cat([a[0], a[1], c[0], c[1]], -1), w),
              [torch.randn(2, B, H), torch.randn(2, B, H)])
    assert rec.after[0][OP] == 1 and rec.after[0][STACKED] == 0, rec.after[0]


def test_slice_also_used_elsewhere_stays() -> None:
    lin = nn.Linear(R * H, K)

    def fn(x: torch.Tensor) -> torch.Tensor:
        parts = [x[i] for i in range(R)]
        return lin(torch.cat(parts, -1)) + parts[0].sum(-1, keepdim=True)
    rec = run(fn, [torch.randn(R, B, H)])
    assert rec.after[0][STACKED] == 1 and rec.after[0]["getitem"] == 1, rec.after[0]


def test_stacked_gradients_match_eager() -> None:
    lin = nn.Linear(S * H, K).double()
    x0 = torch.randn(B, S, H, dtype=torch.float64)
    f_eager = lambda t: lin(torch.cat(_slices_dim1(t), -1))  # noqa: E731
    grads = []
    for f in (f_eager, torch.compile(f_eager, backend=RecordingBackend(inner="aot_eager"),
                                     fullgraph=True)):
        lin.zero_grad()
        x = x0.clone().requires_grad_()
        f(x).sin().sum().backward()
        grads.append((x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
    torch.testing.assert_close(grads[1], grads[0])
    assert pattern.PATTERN.total == 1


# --------------------------------------------------------------------- must not rewrite

def _no_rewrite(fn: Callable[..., Any], args: list[Any], reason: str) -> None:
    rec = run(fn, args)
    assert rec.after[0][OP] == rec.after[0][STACKED] == 0 and pattern.PATTERN.total == 0, \
        rec.after[0]
    reasons = [f.reason for f in rec.near_misses]
    assert any(reason in r for r in reasons), reasons


def test_cat_on_dim_0() -> None:
    lin = nn.Linear(H, K)
    _no_rewrite(lambda x: lin(torch.cat([x[0], x[1]], 0)), [torch.randn(R, B, H)], "cat on dim 0")


def test_cat_on_a_middle_dim() -> None:
    lin = nn.Linear(H, K)
    _no_rewrite(lambda x: lin(torch.cat([x[0], x[1]], dim=1)), [torch.randn(R, B, S, H)],
                "cat on dim 1")


def test_cat_result_used_elsewhere() -> None:
    lin = nn.Linear(R * H, K)

    def fn(x: torch.Tensor) -> torch.Tensor:
        c = cat_comprehension(x)
        return lin(c) + c.sum(-1, keepdim=True)
    _no_rewrite(fn, [torch.randn(R, B, H)], "used elsewhere")


def test_matmul_with_an_untransposed_square_weight() -> None:
    """cat @ W (no .T) with W square: reading W as a linear's weight would transpose it."""
    w = torch.randn(R * H, R * H)
    _no_rewrite(lambda x: cat_comprehension(x) @ w, [torch.randn(R, B, H)], "not a transposed")


def test_addmm_with_alpha() -> None:
    w, b = torch.randn(K, R * H), torch.randn(K)
    _no_rewrite(lambda x: torch.addmm(b, cat_comprehension(x), w.t(), alpha=2.0),
                [torch.randn(R, B, H)], "beta/alpha")


def test_autocast_region() -> None:
    """Under CPU autocast F.linear runs in bf16; the custom op would not."""
    lin = nn.Linear(R * H, K)

    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(cat_comprehension(x))
    _no_rewrite(fn, [torch.randn(R, B, H)], "autocast")


def test_broadcast_bias_is_left_as_an_add() -> None:
    """A (B, K) bias is no linear bias: cat @ W.T is rewritten, the add stays."""
    w, b = torch.randn(K, R * H), torch.randn(B, K)
    rec = run(lambda x: cat_comprehension(x) @ w.T + b, [torch.randn(R, B, H)])
    assert rec.after[0][STACKED] == 1 and rec.after[0]["add"] == 1
    assert pattern.matches["cat @ W.T"] == 1


def _traced_with_values(fn: Callable[..., Any], *args: torch.Tensor) -> tuple[fx.GraphModule, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[mode.from_tensor(a) for a in args])
    return gm, mode


def test_weight_width_mismatch() -> None:
    """The check refuses a weight whose width isn't the cat's (a graph eager would reject:
    built by hand, with the weight's value widened)."""
    gm, mode = _traced_with_values(lambda a, b, w: F.linear(torch.cat([a, b], -1), w),
                                   torch.randn(B, H), torch.randn(B, H), torch.randn(K, 2 * H))
    w_node = next(n for n in gm.graph.nodes if n.name == "w")
    with mode:
        w_node.meta["val"] = torch.empty(K, 2 * H + 1)
    ctx = apply_patterns(gm)
    assert ctx.rewrites == 0 and "does not match" in ctx.findings[0].reason


def test_mixed_devices() -> None:
    gm, mode = _traced_with_values(lambda a, b, w: F.linear(torch.cat([a, b], -1), w),
                                   torch.randn(B, H), torch.randn(B, H), torch.randn(K, 2 * H))
    w_node = next(n for n in gm.graph.nodes if n.name == "w")
    with mode:
        w_node.meta["val"] = torch.empty(K, 2 * H, device="meta")
    ctx = apply_patterns(gm)
    assert ctx.rewrites == 0 and [f.reason for f in ctx.findings] == [
        "cat_linear: weight is on meta but parts[0] is on cpu"]


def test_part_mutated_between_cat_and_linear() -> None:
    lin = nn.Linear(2 * H, K)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = torch.cat([a, b], -1)
        a.add_(1)
        return lin(c)
    _no_rewrite(fn, [torch.randn(B, H), torch.randn(B, H)], "writes memory the match reads")
