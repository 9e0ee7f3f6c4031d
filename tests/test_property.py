"""Property-based tests (hypothesis, bounded budget): random shapes (0 and 1 sizes
included), dtypes, strides (non-contiguous and broadcast views) and index patterns, every
implementation of every op against the float64 reference; then random spellings of the
two rewrites compiled with the opreg backend, against eager on the same inputs (result
and input mutations), with the rewrite counted where it must happen.

The number of examples run is printed in pytest's terminal summary (``conftest.py``).
Replay a failure with the printed ``OPREG_TEST_SEED``.
"""
from __future__ import annotations

import collections
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import opreg
from opreg.backend import RecordingBackend
from opreg.ops.cat_linear import reference as cl_reference
from opreg.ops.cat_linear import reference_stacked
from opreg.ops.scatter_combine import reference as sc_reference
from opreg.testing import assert_matches, map_tensors, to_float64

from conftest import SEED

EXAMPLES: collections.Counter[str] = collections.Counter()  # reported by conftest.py
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
LAYOUTS = ["contiguous", "strided", "transposed", "broadcast"]
OPS_BUDGET = settings(max_examples=200, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REWRITE_BUDGET = settings(max_examples=15, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])


def tensor(draw: Any, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
           layouts: list[str] = LAYOUTS) -> torch.Tensor:
    """A random tensor of ``shape`` laid out as drawn: contiguous, a step-2 slice of a
    wider tensor, the transpose of a contiguous one, or a stride-0 broadcast of one row."""
    layout = draw(st.sampled_from(layouts))
    if layout == "strided":
        return torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)[..., ::2]
    if layout == "transposed" and len(shape) >= 2:
        return torch.randn(*shape[::-1], generator=gen).to(dtype).permute(*range(len(shape) - 1, -1, -1))
    if layout == "broadcast" and len(shape) >= 1:
        return torch.randn(tuple(shape[1:]), generator=gen).to(dtype).expand(*shape)
    return torch.randn(tuple(shape), generator=gen).to(dtype)


def check_all_impls(op: str, args: tuple, reference: Callable[..., torch.Tensor], dtype: torch.dtype
                    ) -> None:
    """The dispatcher's default and every implementation available on the CPU, against
    ``reference`` in float64. Errors are measured against the magnitude of the summed terms
    (the reference on the inputs' absolute values): these ops are sums (dot products,
    gated row sums), and an output element whose terms cancel has only their precision."""
    args64 = to_float64(args)
    ref64 = reference(*args64)
    scale = reference(*map_tensors(lambda t: t.abs() if t.is_floating_point() else t, args64))
    impls = [i["impl"] for i in opreg.implementations(op) if "cpu" in i["devices"] or i["devices"] == "*"]
    runs = [("default", opreg.get(op))] + [(i, opreg.get(op, impl=i)) for i in impls]
    for name, fn in runs:
        try:
            assert_matches(fn(*args), ref64, dtype, scale)
        except AssertionError as e:
            raise AssertionError(f"{op}/{name}: {e}") from None
    EXAMPLES[op] += 1


# ------------------------------------------------------------------------------ ops

@st.composite
def token_idx(draw: Any, n: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """In [0, t): sorted, random, all one token, or clustered on a few (most tokens get
    no row); int32 or int64; contiguous or a step-2 slice."""
    kind = draw(st.sampled_from(["sorted", "random", "repeated", "clustered"]))
    idx_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    if n == 0:
        return torch.empty(0, dtype=idx_dtype)
    hi = {"repeated": 1, "clustered": max(1, t // 4)}.get(kind, t)
    idx = torch.randint(0, hi, (n,), generator=gen) + draw(st.integers(0, t - hi))
    if kind == "sorted":
        idx = idx.sort().values
    idx = idx.to(idx_dtype)
    if draw(st.booleans()):
        idx = torch.stack([idx, idx], 1)[:, 0]
    return idx


@seed(SEED)
@OPS_BUDGET
@given(st.data())
def test_scatter_combine_every_impl(data: Any) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n, h = draw(st.integers(0, 40)), draw(st.integers(0, 20))
    t = draw(st.integers(1 if n else 0, 24))
    dtype = draw(st.sampled_from(FLOATS))
    gates_dtype = draw(st.sampled_from([dtype, torch.float32]))
    hidden = tensor(draw, (n, h), dtype, gen)
    gates = tensor(draw, (n,), gates_dtype, gen, ["contiguous", "strided", "broadcast"])
    idx = draw(token_idx(n, t, gen))
    args = (hidden, idx, gates, t)
    check_all_impls("scatter_combine", args, sc_reference, dtype)


@seed(SEED)
@OPS_BUDGET
@given(st.data())
def test_cat_linear_every_impl(data: Any) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from(FLOATS))
    lead = tuple(draw(st.lists(st.integers(0, 5), max_size=2)))
    widths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4))
    k = draw(st.integers(0, 9))
    parts = [tensor(draw, (*lead, w), dtype, gen) for w in widths]
    weight = tensor(draw, (k, sum(widths)), dtype, gen, LAYOUTS[:3])
    bias = tensor(draw, (k,), dtype, gen) if draw(st.booleans()) else None
    args = (parts, weight, bias)
    check_all_impls("cat_linear", args, cl_reference, dtype)


@seed(SEED)
@OPS_BUDGET
@given(st.data())
def test_cat_linear_stacked_every_impl(data: Any) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from(FLOATS))
    shape = draw(st.lists(st.integers(0, 5), min_size=2, max_size=4))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    shape[dim] = max(shape[dim], 1)  # at least one slice
    x = tensor(draw, tuple(shape), dtype, gen)
    width = len(x.unbind(dim)) * x.unbind(dim)[0].shape[-1]
    k = draw(st.integers(0, 9))
    weight = tensor(draw, (k, width), dtype, gen, LAYOUTS[:3])
    bias = tensor(draw, (k,), dtype, gen) if draw(st.booleans()) else None
    args = (x, dim, weight, bias)
    check_all_impls("cat_linear_stacked", args, reference_stacked, dtype)


# ------------------------------------------------------------------------------ rewrites
# Each spelling builder takes the sizes and returns fn(out, idx, x, g) (scatter_combine)
# or fn(parts, x, w, b) (cat_linear): how people write the computation.

def combine_spellings(t: int, k: int, h: int, gate: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, Callable[..., Any]]:
    def index_add_(out, idx, x, g):
        out.index_add_(0, idx, x * gate(g))
        return out

    def zeros_index_add(out, idx, x, g):
        return torch.zeros(t, h, dtype=x.dtype).index_add(0, idx, gate(g) * x)

    def scatter_add_(out, idx, x, g):
        out.scatter_add_(0, idx.long()[:, None].expand(-1, h), x * gate(g))
        return out

    def index_put_(out, idx, x, g):
        out.index_put_((idx.long(),), x * gate(g), accumulate=True)
        return out

    def view_sum(out, idx, x, g):
        return out + (x.view(t, k, h) * g.view(t, k, 1)).sum(1)

    return {f.__name__: f for f in (index_add_, zeros_index_add, scatter_add_, index_put_, view_sum)}


GATES = {"g[:, None]": lambda g: g[:, None], "g.unsqueeze(-1)": lambda g: g.unsqueeze(-1),
         "g.view(-1, 1)": lambda g: g.view(-1, 1)}


def compile_and_compare(fn: Callable[..., Any], args: list[Any]) -> RecordingBackend:
    """Compiled (one graph) == eager on clones of the same inputs: result and mutations."""
    torch._dynamo.reset()
    rec = RecordingBackend()
    clone = lambda a: [x.clone() if isinstance(x, torch.Tensor) else clone(x) if isinstance(x, list) else x  # noqa: E731
                       for x in a]
    eager_args, comp_args = clone(args), clone(args)
    expected = fn(*eager_args)
    got = torch.compile(fn, backend=rec, fullgraph=True)(*comp_args)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(comp_args, eager_args)
    assert len(rec.after) == 1, f"{len(rec.after)} graphs"
    return rec


@pytest.fixture
def reference_kernels() -> Any:
    """Rewrites are about the graph, not the kernels: the ops run their reference."""
    with opreg.use("reference"):
        yield
    torch._dynamo.reset()


COMBINE_SPELLINGS = sorted(combine_spellings(1, 1, 1, GATES["g[:, None]"]))
LINEARS = {"F.linear": lambda c, w, b: F.linear(c, w, b),
           "@ W.T (+ b)": lambda c, w, b: c @ w.T if b is None else c @ w.T + b,
           "addmm": lambda c, w, b: torch.addmm(b, c, w.t())}  # 2-D, with a bias
PARTS = {  # how the parts are made: (builder(parts, x) -> list, the op the rewrite emits)
    "separate tensors": (lambda parts, x: parts, "opreg::cat_linear"),
    "x.unbind(0)": (lambda parts, x: list(x.unbind(0)), "opreg::cat_linear_stacked"),
    "[x[i] for i]": (lambda parts, x: [x[i] for i in range(x.shape[0])], "opreg::cat_linear_stacked"),
}


@pytest.mark.usefixtures("reference_kernels")
@pytest.mark.parametrize("spelling", COMBINE_SPELLINGS)
@seed(SEED)
@REWRITE_BUDGET
@given(data=st.data())
def test_scatter_combine_rewrites(spelling: str, data: Any) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t, k, h = draw(st.integers(1, 9)), draw(st.integers(1, 4)), draw(st.integers(1, 16))
    n = t * k  # so the token-major view-sum fits too
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gate = draw(st.sampled_from(sorted(GATES)))
    fn = combine_spellings(t, k, h, GATES[gate])[spelling]
    out = torch.zeros(t, h, dtype=dtype) if draw(st.booleans()) else torch.randn(t, h, generator=gen).to(dtype)
    idx = torch.randint(0, t, (n,), generator=gen)
    if spelling == "index_add_":  # the one spelling that takes int32 indices as they are
        idx = idx.to(draw(st.sampled_from([torch.int32, torch.int64])))
    args = [out, idx, torch.randn(n, h, generator=gen).to(dtype), torch.rand(n, generator=gen).to(dtype)]
    rec = compile_and_compare(fn, args)
    assert rec.after[-1]["opreg::scatter_combine"] == 1, (spelling, gate, rec.after[-1], rec.near_misses)
    EXAMPLES[f"rewrite scatter_combine/{spelling}"] += 1


@pytest.mark.usefixtures("reference_kernels")
@pytest.mark.parametrize("linear", sorted(LINEARS))
@pytest.mark.parametrize("how", sorted(PARTS))
@seed(SEED)
@REWRITE_BUDGET
@given(data=st.data())
def test_cat_linear_rewrites(how: str, linear: str, data: Any) -> None:
    draw = data.draw
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    r, h, k = draw(st.integers(2, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    lead = (draw(st.integers(1, 6)),) if linear == "addmm" else tuple(
        draw(st.lists(st.integers(1, 5), min_size=1, max_size=2)))  # 2-D or 3-D parts
    bias = linear == "addmm" or draw(st.booleans())
    make_parts, emitted = PARTS[how]
    lin = LINEARS[linear]

    def fn(parts, x, w, b):
        return lin(torch.cat(make_parts(parts, x), -1), w, b)

    rand = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    args = [[rand(*lead, h) for _ in range(r)], rand(r, *lead, h), rand(k, r * h), rand(k) if bias else None]
    rec = compile_and_compare(fn, args)
    assert rec.after[-1][emitted] == 1, (how, linear, lead, rec.after[-1], rec.near_misses)
    EXAMPLES[f"rewrite cat_linear/{how}/{linear}"] += 1
