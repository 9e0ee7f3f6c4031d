"""The scatter_combine pattern, spelling by spelling: the ops before and after the pass,
the match count, and equality with eager (same results, same mutations of inputs).
Then the spellings it must leave alone, each checked against eager too.

Graphs run eagerly after the pass (RecordingBackend's default) and the op is bound to
its reference: these tests are about the rewrite, not about codegen or the kernels.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.fx as fx

import opreg
from opreg.backend import RecordingBackend, apply_patterns
from opreg.ops.scatter_combine import reference as sc_reference
from opreg.patterns import scatter_combine as pattern

OP = "opreg::scatter_combine"
N, H, T, K = 12, 8, 4, 3          # N = T * K rows, so the view-sum spellings fit too
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    torch._dynamo.reset()
    pattern.PATTERN.reset_counters()
    with opreg.use("reference"):
        yield


def make(dtype: torch.dtype, idx_dtype: torch.dtype = torch.int64) -> dict[str, torch.Tensor]:
    return {
        "out": torch.randn(T, H, dtype=dtype),
        "idx": torch.randint(0, T, (N,), dtype=idx_dtype),   # N > T: indices repeat
        "x": torch.randn(N, H, dtype=dtype),
        "g": torch.rand(N, dtype=dtype),
    }


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def run(fn: Callable[..., Any], args: list[Any], rec: RecordingBackend | None = None,
        **tol: float) -> RecordingBackend:
    """Compile ``fn`` (one graph, no breaks) and check result and input mutations == eager."""
    rec = rec or RecordingBackend()
    eager_args, comp_args = [_clone(a) for a in args], [_clone(a) for a in args]
    expected = fn(*eager_args)
    got = torch.compile(fn, backend=rec, fullgraph=True)(*comp_args)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(comp_args, eager_args, **tol)
    return rec


# ------------------------------------------------------------------------------ spellings
# (id, fn(out, idx, x, g), the op it replaces, spelling counted, ops that must be gone)

def index_add_inplace(out, idx, x, g):
    out.index_add_(0, idx, x * g[:, None])
    return out


def index_add_fresh_zeros(out, idx, x, g):
    return torch.zeros(T, H, dtype=x.dtype).index_add(0, idx, g.unsqueeze(-1) * x)


def index_add_alpha(out, idx, x, g):
    out.index_add_(0, idx, x * g[:, None], alpha=0.5)
    return out


def index_add_function(out, idx, x, g):
    return torch.index_add(out, 0, idx, x * g.view(-1, 1))


def index_add_dim_minus_2(out, idx, x, g):
    return out.index_add(-2, idx, x * g.reshape(N, 1))


def index_add_inplace_zeros(out, idx, x, g):
    acc = torch.zeros(T, H, dtype=x.dtype)
    acc.index_add_(0, idx, g[:, None] * x)
    return acc


def index_add_new_zeros_twice(out, idx, x, g):
    acc = x.new_zeros(T, H)
    acc.index_add_(0, idx, x * g[:, None])
    acc.index_add_(0, idx.flip(0), x * g[:, None])   # accumulates into the op's result
    return acc * 2


def index_add_gates_column(out, idx, x, g):
    col = g.view(N, 1).contiguous() + 0.5     # gates already shaped (N, 1)
    out.index_add_(0, idx, x * col)
    return out


def scatter_add_inplace(out, idx, x, g):
    out.scatter_add_(0, idx[:, None].expand(-1, H), x * g[:, None])
    return out


def scatter_add_expand_as(out, idx, x, g):
    src = x * g[:, None]
    return torch.zeros_like(out).scatter_add(0, idx.unsqueeze(1).expand_as(src), src)


def scatter_reduce_sum(out, idx, x, g):
    return out.scatter_reduce(0, idx[:, None].expand(-1, H), x * g[:, None], "sum")


def scatter_reduce_exclude_self_zeros(out, idx, x, g):
    acc = torch.zeros(T, H, dtype=x.dtype)
    acc.scatter_reduce_(0, idx[:, None].expand(N, H), g[:, None] * x, reduce="sum",
                        include_self=False)
    return acc


def index_put_accumulate(out, idx, x, g):
    out.index_put_((idx - T * (idx % 2),), x * g[:, None], accumulate=True)  # negatives wrap
    return out


def index_put_functional(out, idx, x, g):
    return out.index_put([idx], g.unsqueeze(1) * x, accumulate=True)


def view_sum(out, idx, x, g):
    return (x.view(T, K, H) * g.view(T, K, 1)).sum(1)


def view_sum_gate_first_into_out(out, idx, x, g):
    return out + (g.view(T, K).unsqueeze(-1) * x.reshape(T, K, H)).sum(dim=-2)


def view_sum_gates_column(out, idx, x, g):
    return (x.view(T, K, H) * g[:, None].view(T, K, 1)).sum(1)


def flat_view_sum(out, idx, x, g):
    """HF batched_mm experts: rows token-major, weighted, then summed per token."""
    return (x * g.unsqueeze(-1)).view(T, K, H).sum(dim=1)


def _sorted(x, g):
    """x and g sorted by a random expert id, as HF's grouped_mm experts does."""
    _, perm = torch.sort(torch.randint(0, 3, (N,)))
    return x[perm // 1], g[perm], perm


def sorted_setitem_inverse(out, idx, x, g):
    xs, gs, perm = _sorted(x, g)
    weighted = xs * gs.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0))
    return weighted[inv].view(T, K, H).sum(dim=1)


def sorted_argsort_index_select(out, idx, x, g):
    xs, gs, perm = _sorted(x, g)
    return (gs[:, None] * xs).index_select(0, perm.argsort()).view(T, K, H).sum(1)


def sorted_scatter_inverse(out, idx, x, g):
    xs, gs, perm = _sorted(x, g)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(N))
    return (xs * gs[:, None])[inv].view(T, K, H).sum(1)


SPELLINGS = [
    (index_add_inplace, "index_add_", "index_add_", ()),
    (index_add_fresh_zeros, "index_add", "index_add", ("zeros",)),
    (index_add_alpha, "index_add_", "index_add_", ()),
    (index_add_function, "index_add", "torch.index_add", ()),
    (index_add_dim_minus_2, "index_add", "index_add", ()),
    (index_add_inplace_zeros, "index_add_", "index_add_", ("zeros", "add_")),
    (index_add_new_zeros_twice, "index_add_", "index_add_", ("new_zeros",)),
    (index_add_gates_column, "index_add_", "index_add_", ()),
    (scatter_add_inplace, "scatter_add_", "scatter_add_", ("expand",)),
    (scatter_add_expand_as, "scatter_add", "scatter_add", ("expand_as", "zeros_like")),
    (scatter_reduce_sum, "scatter_reduce", "scatter_reduce", ()),
    (scatter_reduce_exclude_self_zeros, "scatter_reduce_", "scatter_reduce_", ("zeros",)),
    (index_put_accumulate, "index_put_", "index_put_", ()),
    (index_put_functional, "index_put", "index_put", ()),
    (view_sum, "sum", "view-sum", ("mul",)),
    (view_sum_gate_first_into_out, "sum", "view-sum", ("mul",)),
    (view_sum_gates_column, "sum", "view-sum", ("mul",)),
    (flat_view_sum, "sum", "(x * g).view-sum", ("mul",)),
    (sorted_setitem_inverse, "sum", "(x * g)[inv].view-sum", ("setitem", "empty_like", "arange", "mul")),
    (sorted_argsort_index_select, "sum", "(x * g)[inv].view-sum", ("argsort", "index_select", "mul")),
    (sorted_scatter_inverse, "sum", "(x * g)[inv].view-sum", ("scatter_", "empty_like", "mul")),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn,before_op,spelling,gone", SPELLINGS, ids=[s[0].__name__ for s in SPELLINGS])
def test_spelling(fn: Callable[..., Any], before_op: str, spelling: str, gone: tuple[str, ...],
                  dtype: torch.dtype) -> None:
    a = make(dtype)
    rec = run(fn, [a["out"], a["idx"], a["x"], a["g"]])
    n = rec.before[0][before_op]
    assert n >= 1 and rec.before[0][OP] == 0
    assert rec.after[0][before_op] == 0, rec.after[0]
    assert rec.after[0][OP] == n
    assert pattern.matches[spelling] == n == pattern.PATTERN.total
    for op in gone:
        assert rec.after[0][op] == 0, f"{op} left in {rec.after[0]}"


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
def test_index_dtypes(idx_dtype: torch.dtype) -> None:
    a = make(torch.float32, idx_dtype)
    rec = run(index_add_inplace, [a["out"], a["idx"], a["x"], a["g"]])
    assert rec.after[0][OP] == 1


def test_zeros_read_before_the_mutation_keeps_in_place_form() -> None:
    """A view of the zeros taken before index_add_ sees the mutation: the zeros must stay."""
    def fn(out, idx, x, g):
        acc = torch.zeros(T, H, dtype=x.dtype)
        first = acc[0]
        acc.index_add_(0, idx, x * g[:, None])
        return first * 1, acc
    a = make(torch.float32)
    a["idx"][0] = 0
    rec = run(fn, [a["out"], a["idx"], a["x"], a["g"]])
    assert rec.after[0][OP] == 1 and rec.after[0]["add_"] == 1 and rec.after[0]["zeros"] == 1


def test_mutated_graph_input_aliasing() -> None:
    """index_add_ into a view of a graph input: the base sees it, as in eager."""
    def fn(base, idx, x, g):
        base[1:].index_add_(0, idx, x * g[:, None])
        return base.sum()
    a = make(torch.float32)
    rec = run(fn, [torch.randn(T + 1, H), a["idx"], a["x"], a["g"]])
    assert rec.after[0][OP] == 1


def test_half_precision_output_dtype_and_accuracy() -> None:
    """bf16: the op accumulates in fp32 (more accurate); the output dtype is eager's."""
    a = make(torch.bfloat16)
    fn = index_add_inplace_zeros
    expected = fn(*[_clone(v) for v in a.values()])
    rec = RecordingBackend()
    got = torch.compile(fn, backend=rec, fullgraph=True)(*a.values())
    assert rec.after[0][OP] == 1
    assert got.dtype == expected.dtype == torch.bfloat16
    ref64 = sc_reference(a["x"].double(), a["idx"], a["g"].double(), T)
    torch.testing.assert_close(got.double(), ref64, rtol=1.6e-2, atol=1e-2)
    assert (got.double() - ref64).abs().max() <= (expected.double() - ref64).abs().max() + 1e-2


# --------------------------------------------------------------------- must not rewrite

def _no_rewrite(fn: Callable[..., Any], args: list[Any], reason: str) -> None:
    rec = run(fn, args)
    assert rec.after[0][OP] == 0 and pattern.PATTERN.total == 0, rec.after[0]
    reasons = [f.reason for f in rec.near_misses]
    assert any(reason in r for r in reasons), reasons


def test_setitem_plus_equals_is_not_accumulate() -> None:
    def fn(out, idx, x, g):
        out[idx] += x * g[:, None]
        return out
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "without accumulate")


def test_index_put_without_accumulate() -> None:
    def fn(out, idx, x, g):
        return out.index_put_((idx,), x * g[:, None])
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "without accumulate")


def test_index_add_on_dim_1() -> None:
    def fn(out, idx, x, g):  # out[:, idx[j]] += (x * g[:, None])[:, j]
        return out.index_add(1, idx, x * g[:, None])
    a = make(torch.float32)
    idx = torch.randint(0, T, (H,))
    _no_rewrite(fn, [torch.randn(N, T), idx, a["x"], a["g"]], "on dim 1")


def test_ungated_source() -> None:
    def fn(out, idx, x, g):
        return out.index_add(0, idx, x)
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "not a gated product")


def test_per_column_weights_are_not_gates() -> None:
    """x (N, N) * w (N,) scales columns, not rows: must not be read as gates."""
    def fn(out, idx, x, w):
        return out.index_add(0, idx, x * w)
    x, w = torch.randn(N, N), torch.rand(N)
    _no_rewrite(fn, [torch.randn(T, N), torch.randint(0, T, (N,)), x, w], "per-row gate")


def test_scatter_with_a_narrower_index() -> None:
    """scatter_add_ only reads index's columns: an (N, H/2) index leaves half the source out."""
    def fn(out, idx, x, g):
        return out.scatter_add(0, idx[:, None].expand(-1, H // 2), x * g[:, None])
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "scatter index")


def test_scatter_with_a_full_index() -> None:
    def fn(out, idx2d, x, g):
        return out.scatter_add(0, idx2d, x * g[:, None])
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], torch.randint(0, T, (N, H)), a["x"], a["g"]], "scatter index")


def test_scatter_reduce_exclude_self_into_nonzero_out() -> None:
    def fn(out, idx, x, g):
        return out.scatter_reduce(0, idx[:, None].expand(-1, H), x * g[:, None], "sum",
                                  include_self=False)
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "include_self=False")


def test_mixed_dtypes() -> None:
    """bf16 hidden times fp32 gates is an fp32 source; the op would return bf16."""
    def fn(out, idx, x, g):
        return out.index_add(0, idx, x * g[:, None])
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"].bfloat16(), a["g"]], "dtypes differ")


def test_mixed_devices() -> None:
    """The check refuses operands on different devices (this box has one device, so the
    index's fake value is moved to 'meta' by hand)."""
    gm = fx.symbolic_trace(index_add_inplace)
    a = make(torch.float32)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(a[k]) for k in ("out", "idx", "x", "g")]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    idx_node = next(n for n in gm.graph.nodes if n.name == "idx")
    with mode:
        idx_node.meta["val"] = torch.empty(N, dtype=torch.int64, device="meta")
    ctx = apply_patterns(gm)
    assert ctx.rewrites == 0
    # The op spec's own words (opreg/ops/scatter_combine.py:unsupported).
    assert [f.reason for f in ctx.findings] == ["scatter_combine: token_idx is on meta but "
                                                "expert_hidden is on cpu"]


# ------------------------------------------------------------------ training and shapes

@pytest.mark.parametrize("fn", [index_add_inplace_zeros, index_put_accumulate, view_sum],
                         ids=lambda f: f.__name__)
def test_gradients_match_eager(fn: Callable[..., Any]) -> None:
    """loss.backward() through the rewritten graph (AOTAutograd + the op's own autograd)."""
    a = make(torch.float64)
    grads = []
    for compiled in (False, True):
        x = a["x"].clone().requires_grad_()
        g = a["g"].clone().requires_grad_()
        f = torch.compile(fn, backend=RecordingBackend(inner="aot_eager"), fullgraph=True) \
            if compiled else fn
        loss = (f(a["out"].clone(), a["idx"], x, g) ** 2).sum()
        loss.backward()
        grads.append((loss.detach(), x.grad, g.grad))
    torch.testing.assert_close(grads[1], grads[0])
    assert pattern.PATTERN.total == 1


def test_dynamic_sizes_one_graph() -> None:
    """mark_dynamic'd rows/tokens: one graph serves every size, and each is right."""
    def fn(out, idx, x, g):
        acc = torch.zeros(out.shape[0], x.shape[1], dtype=x.dtype)
        acc.index_add_(0, idx, x * g[:, None])
        return acc + out
    rec = RecordingBackend()
    f = torch.compile(fn, backend=rec)
    for t, n in ((4, 12), (7, 30), (9, 5)):
        out, idx = torch.randn(t, H), torch.randint(0, t, (n,), dtype=torch.int32)
        x, g = torch.randn(n, H), torch.rand(n)
        for v in (out, idx, x, g):
            torch._dynamo.mark_dynamic(v, 0)
        torch.testing.assert_close(f(out, idx, x, g), fn(out, idx, x, g))
    assert len(rec.before) == 1 and rec.after[0][OP] == 1


def test_automatic_dynamic_no_recompile_per_size() -> None:
    rec = RecordingBackend()
    f = torch.compile(index_add_fresh_zeros, backend=rec)
    for n in (6, 10, 14, 18):
        a = {"out": None, "idx": torch.randint(0, T, (n,)), "x": torch.randn(n, H), "g": torch.rand(n)}
        torch.testing.assert_close(f(*a.values()), index_add_fresh_zeros(*a.values()))
    assert len(rec.before) == 2  # static first, then one dynamic graph for all later sizes
    assert all(c[OP] == 1 for c in rec.after)


def test_gather_by_a_non_permutation() -> None:
    """topk of all N is a permutation, but nothing proves it from the graph: left alone."""
    def fn(out, idx, x, g):
        perm = torch.topk(x[:, 0], N).indices
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(N)
        return (x[perm] * g[perm][:, None])[inv].view(T, K, H).sum(1)
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "not provably the inverse")


def test_inverse_written_again_before_the_gather() -> None:
    def fn(out, idx, x, g):
        xs, gs, perm = _sorted(x, g)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        inv[0] = inv[1]
        return (xs * gs[:, None])[inv].view(T, K, H).sum(1)
    a = make(torch.float32)
    rec = run(fn, [a["out"], a["idx"], a["x"], a["g"]])
    assert rec.after[0][OP] == 0, rec.after[0]


def test_permutation_written_after_the_inverse_is_made() -> None:
    def fn(out, idx, x, g):
        xs, gs, perm = _sorted(x, g)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        perm.add_(1)  # the op would read perm after this
        return (xs * gs[:, None])[inv].view(T, K, H).sum(1)
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "writes memory the match reads")


def test_operand_mutated_between_product_and_scatter() -> None:
    """The product read x before x.mul_(2); the op would read it after: no rewrite."""
    def fn(out, idx, x, g):
        src = x * g[:, None]
        x.mul_(2)
        return out.index_add(0, idx, src)
    a = make(torch.float32)
    _no_rewrite(fn, [a["out"], a["idx"], a["x"], a["g"]], "writes memory the match reads")
