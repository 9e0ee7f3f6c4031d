"""The scatter_combine row loop in every form people write it (issue 13, item 3): ``+=``
and ``out[j] = out[j] + ...`` (either side), the product either way, gates (N,) or (N, 1),
bounds from ``len()``/``.shape[0]``/``.size(0)`` of any indexed tensor or an int,
``range(0, n)``, ``idx[j].item()``, ``int(idx[j])``, each way of making ``out``. Each form
is written into a real source file (the rewriter reads source), rewritten, and compared
with the original run eagerly in float64; under torch.compile it leaves no graph break."""
from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

import opreg
from _util import assert_matches
from opreg.loops import find_loops, rewrite_function
from test_loops_effects import OP, OpLog, outcome

T, F, H = 7, 2, 6
N = T * F

PLUS_EQ = "out[idx[j]] += g[j] * x[j]"
STATEMENTS = [
    PLUS_EQ,
    "out[idx[j]] += x[j] * g[j]",
    "out[idx[j]] = out[idx[j]] + g[j] * x[j]",
    "out[idx[j]] = out[idx[j]] + x[j] * g[j]",
    "out[idx[j]] = g[j] * x[j] + out[idx[j]]",
    "out[idx[j].item()] += g[j] * x[j]",
    "out[int(idx[j])] += x[j] * g[j]",
    "out[int(idx[j])] = out[int(idx[j])] + g[j] * x[j]",
]
BOUNDS = ["len(x)", "len(idx)", "len(g)", "x.shape[0]", "idx.shape[0]", "g.shape[0]",
          "x.size(0)", "idx.size(0)", "g.size(0)", "n", "0, n"]
ZEROS = "torch.zeros(t, x.shape[1], dtype=x.dtype)"
MAKERS = [ZEROS, "torch.zeros_like(x[:t])", "x.new_zeros(t, x.shape[1])",
          "x.new_ones(t, x.shape[1])", "torch.full((t, x.shape[1]), 0.5, dtype=x.dtype)",
          "x[:t].clone()", "x[:t] * 2.0"]
# (statement, bound, how out is made); every statement and bound, the gates as a column.
FORMS = ([(s, "x.shape[0]", ZEROS) for s in STATEMENTS] + [(PLUS_EQ, b, ZEROS) for b in BOUNDS[1:]]
         + [(PLUS_EQ, "x.shape[0]", m) for m in MAKERS[1:]])
SOURCE = """
import torch

def combine(x, idx, g, t, n):
    out = {make}
    for j in range({bound}):
        {stmt}
    return out
"""


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """One module file per form, imported; its ``combine``."""
    root = tmp_path_factory.mktemp("loop_forms")
    fns = []
    for k, (stmt, bound, make) in enumerate(FORMS):
        path = root / f"loop_form_{k}.py"
        path.write_text(SOURCE.format(stmt=stmt, bound=bound, make=make))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        fns.append(mod.combine)
    return fns


@pytest.fixture(autouse=True)
def reference_ops() -> Any:
    with opreg.use("reference"):
        yield


def inputs(dtype: torch.dtype, column: bool) -> list[Any]:
    idx = torch.arange(T).repeat_interleave(F)[torch.randperm(N)].to(torch.int32)
    g = torch.rand(N, 1) if column else torch.rand(N)
    return [torch.randn(N, H, dtype=dtype), idx, (g + 0.5).to(dtype), T, N]


def as64(args: list[Any]) -> list[Any]:
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


IDS = [f"{s} | range({b}) | out = {m}" for s, b, m in FORMS]


@pytest.mark.parametrize("k", range(len(FORMS)), ids=IDS)
@pytest.mark.parametrize("column", [False, True], ids=["gates(N)", "gates(N,1)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_form(forms: list[Any], k: int, column: bool, dtype: torch.dtype) -> None:
    fn = forms[k]
    found = find_loops(fn)
    assert [f.matched for f in found] == [True] and found[0].op == OP, found
    new, _ = rewrite_function(fn)
    args = inputs(dtype, column)
    expected = fn(*as64(args))
    with OpLog() as log:
        got = new(*args)
    assert log.ops[OP] == 1, log.ops
    assert_matches(got, expected, dtype)


@pytest.mark.parametrize("k", range(len(FORMS)), ids=IDS)
def test_form_compiles_without_graph_break(forms: list[Any], k: int) -> None:
    new, _ = rewrite_function(forms[k])
    args = inputs(torch.float32, column=k % 2 == 1)
    torch._dynamo.reset()
    got = torch.compile(new, backend="eager", fullgraph=True)(*args)
    assert_matches(got, forms[k](*as64(args)), torch.float32)


def test_bound_that_is_not_n_runs_the_loop(forms: list[Any]) -> None:
    """``range(n)`` with n < N (a prefix) or a float n: the guard runs the loop as written."""
    fn = forms[FORMS.index((PLUS_EQ, "n", ZEROS))]
    new, _ = rewrite_function(fn)
    x, idx, g, t, _ = inputs(torch.float64, column=False)
    for n in (N - 3, 2.0):
        want = outcome(fn, x, idx, g, t, n)
        with OpLog() as log:
            got = outcome(new, x, idx, g, t, n)
        assert log.ops[OP] == 0
        assert got is want is TypeError if n == 2.0 else torch.equal(got, want)


def test_only_functions_with_a_loop_are_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewriter reads and parses a function's source only where its code, or code nested
    in it, has a for loop (most of a model's methods have none); a loop anywhere, even in a
    comprehension or an inner function, still gets the function parsed."""
    from opreg.loops import rewriter

    parsed: list[str] = []
    real = rewriter._source_of

    def spy(fn: Any) -> Any:
        parsed.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(rewriter, "_source_of", spy)

    def straight(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).relu()

    def comprehension(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x * 2 for x in xs]

    def inner(x: torch.Tensor) -> torch.Tensor:
        def f(ys: list[torch.Tensor]) -> torch.Tensor:
            for y in ys:
                x.add_(y)
            return x
        return f([x])

    def loop(xs: list[torch.Tensor]) -> torch.Tensor:
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out

    for fn in (straight, comprehension, inner, loop):
        assert find_loops(fn) == []  # none of these is an idiom
    assert parsed == ["comprehension", "inner", "loop"]
    assert rewrite_function(straight) == (straight, [])
