"""Mutation traps: every input a rewrite reads, mutated in every way between the
original's read and the rewrite point, through every entry (``backend="opreg"``,
``opreg.optimize``, ``apply_patterns``). The compiled result and the inputs afterwards
must equal eager's; where the mutation could change the result the framework must
refuse the match and say why (:mod:`opreg.compile.mutation`).

Values are float64 and fresh per case; the ops run their reference (these tests are
about the rewrite, not the kernels).

The cases of one trap share one Dynamo compile (:func:`shared`): one function runs each
case on its own inputs, one after the other, and every assertion of a case (result and
input mutations equal eager's, the op counts after the passes, the findings) reads only
that case's part of the graph: the nodes Dynamo traced in it (``fx.traceback.annotate``)
and those the passes emitted from them. Why: a compile of one case costs ~80 ms on the
2-core box, ~40 ms of it per compile whatever the graph's size; 393 compiles took ~55 s
of the suite's ~280 s, 37 compiles ~35 s (2026-12-02). Where Dynamo does not keep the
annotation (torch < 2.10), each case compiles alone, as before.
"""
from __future__ import annotations

import collections
import contextlib
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import opreg
from opreg.backend import RecordingBackend, apply_patterns
from opreg.compile.fx_utils import op_name
from opreg.patterns import cat_linear as cat_pattern
from opreg.patterns import scatter_combine as sc_pattern

N, H, T, K = 12, 8, 4, 3        # N = T * K: the view-sum spelling fits too
SC, CL, CLS = "opreg::scatter_combine", "opreg::cat_linear", "opreg::cat_linear_stacked"

_lib = torch.library.Library("opreg_trap", "DEF")
_lib.define("bump_(Tensor(a!) x) -> ()")


def _bump(x: torch.Tensor) -> None:
    x.add_(0.5)


_lib.impl("bump_", _bump, "CompositeExplicitAutograd")
torch.library.register_fake("opreg_trap::bump_", lambda x: None, lib=_lib)

# Ways to write a tensor in place (each leaves it different).
TRAPS: dict[str, Callable[[torch.Tensor], Any]] = {
    "relu(inplace=True)": lambda t: F.relu(t, inplace=True),
    "leaky_relu(inplace=True)": lambda t: F.leaky_relu(t, 0.3, inplace=True),
    "elu(inplace=True)": lambda t: F.elu(t, inplace=True),
    "silu(inplace=True)": lambda t: F.silu(t, inplace=True),
    "hardtanh(inplace=True)": lambda t: F.hardtanh(t, -0.1, 0.1, inplace=True),
    "nn.ReLU(inplace=True)": nn.ReLU(inplace=True),
    "add_": lambda t: t.add_(1.0),
    "mul(out=)": lambda t: torch.mul(t.detach(), 3.0, out=t),
    "setitem": lambda t: t.__setitem__(0, 7.0),
    "view.mul_": lambda t: t.unsqueeze(0).mul_(2.0),
    "custom op Tensor(a!)": lambda t: torch.ops.opreg_trap.bump_(t),
}


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    torch._dynamo.reset()
    for p in (sc_pattern.PATTERN, cat_pattern.PATTERN):
        p.reset_counters()
    with opreg.use("reference"):
        yield


def _inputs() -> list[torch.Tensor]:
    d = torch.float64
    return [torch.randn(T, H, dtype=d), torch.randint(0, T, (N,)), torch.randn(N, H, dtype=d),
            torch.rand(N, dtype=d) + 0.1]


# ------------------------------------------------------- one compile for a trap's cases

@dataclass
class Case:
    """One case's part of a shared compile."""

    got: Any                    # its compiled result
    expected: Any               # eager's
    inputs: list[Any]           # its inputs after the compiled run
    eager_inputs: list[Any]     # after eager's
    after: collections.Counter[str]   # op counts of its part of the graph after the passes
    findings: list[Any]         # the passes' findings at its nodes


class _PartsBackend(RecordingBackend):
    """The recording backend, also noting which case each node belongs to before the
    passes (a finding names a node; a rewrite replaces it)."""

    def __init__(self, cases: int) -> None:
        super().__init__()
        self.cases = cases
        self.before_parts: dict[str, int] = {}

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.before_parts = _parts(gm, self.cases)
        return super().__call__(gm, example_inputs)


def _parts(gm: fx.GraphModule, cases: int) -> dict[str, int]:
    """Node name -> its case: the one Dynamo traced it in (``fx.traceback.annotate``), or,
    for a node the passes emitted, the case of the nodes it is connected to. A node of no
    case, or of two, fails every case of the compile."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if cases == 1:
        return {n.name: 0 for n in nodes}
    traced = {n: n.meta.get("custom", {}).get("case") for n in nodes}
    parent = {n: n for n in nodes}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if traced[n] is None or traced[a] is None:  # an emitted node joins what it reads
                parent[root(a)] = root(n)
    case_of_root: dict[fx.Node, int] = {}
    for n in nodes:
        if traced[n] is not None:
            other = case_of_root.setdefault(root(n), traced[n])
            assert other == traced[n], f"{n.format_node()}: connected to cases {other} and {traced[n]}"
    parts = {}
    for n in nodes:
        case = traced[n] if traced[n] is not None else case_of_root.get(root(n))
        assert case is not None, f"{n.format_node()} belongs to no case"
        parts[n.name] = case
    return parts


def _together(fns: Sequence[Callable[..., Any]], inputs: Sequence[list[Any]]) -> list[Case]:
    """``fns[i](*inputs[i])`` for every i, in one function compiled once (fullgraph) with a
    :class:`RecordingBackend` and run once, and eagerly; each case's part of it."""
    sizes = [len(a) for a in inputs]
    annotate = fx_traceback.annotate if len(fns) > 1 else lambda _: contextlib.nullcontext()

    def run_all(*flat: Any) -> list[Any]:
        outs, k = [], 0
        for i, (fn, n) in enumerate(zip(fns, sizes)):
            with annotate({"case": i}):  # each node Dynamo records says whose it is
                outs.append(fn(*flat[k:k + n]))
            k += n
        return outs

    flat = [a for args in inputs for a in args]
    eager_args = [a.clone() for a in flat]
    comp_args = [a.clone() for a in flat]
    expected = run_all(*eager_args)
    rec = _PartsBackend(len(fns))
    got = torch.compile(run_all, backend=rec, fullgraph=True)(*comp_args)
    assert len(rec.graphs) == 1, f"{len(rec.graphs)} graphs"
    gm = rec.graphs[0]
    after_parts = _parts(gm, len(fns))
    after = [collections.Counter[str]() for _ in fns]
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            after[after_parts[n.name]][op_name(n)] += 1
    findings: list[list[Any]] = [[] for _ in fns]
    for f in rec.findings:
        case = rec.before_parts.get(f.node, after_parts.get(f.node))
        assert case is not None, f"finding at a node of no case: {f}"
        findings[case].append(f)
    cases, k = [], 0
    for i, n in enumerate(sizes):
        cases.append(Case(got[i], expected[i], comp_args[k:k + n], eager_args[k:k + n], after[i], findings[i]))
        k += n
    return cases


_SHARED: dict[tuple[str, ...], tuple[list[Case], Exception | None]] = {}


def _annotates() -> bool:
    """Whether Dynamo keeps ``fx.traceback.annotate``'s marks on the nodes it records."""
    if "annotates" not in _SHARED_STATE:
        marks: list[Any] = []

        def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            marks.extend(n.meta.get("custom", {}).get("case") for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        def probe(x: torch.Tensor) -> torch.Tensor:
            with fx_traceback.annotate({"case": 7}):
                return x + 1

        try:
            torch.compile(probe, backend=backend, fullgraph=True)(torch.zeros(2))
        except Exception:  # noqa: BLE001 - no annotate, or Dynamo refuses it: one compile per case
            marks.clear()
        finally:
            torch._dynamo.reset()
        _SHARED_STATE["annotates"] = marks == [7]
    return _SHARED_STATE["annotates"]


_SHARED_STATE: dict[str, bool] = {}


def shared(key: tuple[str, ...], cases: Sequence[Any], make: Callable[[Any], tuple[Callable[..., Any], list[Any]]],
           case: Any) -> Case:
    """``case``'s part of the one compile of all of ``cases`` (made on the first call, with
    inputs from a seed of its own: the same whichever case asks first)."""
    if not _annotates():  # each case alone
        key, cases = (*key, repr(case)), [case]
    if key not in _SHARED:
        try:
            with torch.random.fork_rng():  # conftest.py's seed, which it puts in the environment
                torch.manual_seed(int(os.environ.get("OPREG_TEST_SEED", "0")) ^ zlib.crc32(repr(key).encode()))
                made = [make(c) for c in cases]
            _SHARED[key] = (_together([fn for fn, _ in made], [args for _, args in made]), None)
        except Exception as e:  # noqa: BLE001 - every case of the compile reports it
            _SHARED[key] = ([], e)
    parts, error = _SHARED[key]
    if error is not None:
        raise AssertionError(f"the shared compile of {key} failed: {type(error).__name__}: {error}") from error
    return parts[list(cases).index(case)]


def _check_case(c: Case) -> None:
    """_check_same_as_eager, for a case of a shared compile."""
    torch.testing.assert_close(c.got, c.expected)
    torch.testing.assert_close(c.inputs, c.eager_inputs)  # the same mutations of the inputs


# ----------------------------------------------------------------- scatter: the operands
# Each spelling computes src = x * g, then runs the trap on one of x, g, src (or a view of
# x), then scatters src: the op would read x and g after the trap.

def _target(which: str, x: torch.Tensor, g: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return {"x": x, "g": g, "src": src, "x[1]": x[1]}[which]


def _spellings(trap: Callable[[torch.Tensor], Any], which: str) -> dict[str, Callable[..., Any]]:
    def prod(x, g):
        src = x * g[:, None]
        trap(_target(which, x, g, src))
        return src

    def view_sum(x, g):
        src = x.view(T, K, H) * g.view(T, K, 1)
        trap(_target(which, x, g, src))
        return src.sum(1)

    return {
        "index_add_": lambda out, idx, x, g: out.index_add_(0, idx, prod(x, g)),
        "zeros.index_add": lambda out, idx, x, g: torch.zeros(T, H, dtype=x.dtype).index_add(
            0, idx, prod(x, g)),
        "scatter_add_": lambda out, idx, x, g: out.scatter_add_(0, idx[:, None].expand(-1, H), prod(x, g)),
        "scatter_reduce": lambda out, idx, x, g: out.scatter_reduce(
            0, idx[:, None].expand(-1, H), prod(x, g), "sum"),
        "index_put_": lambda out, idx, x, g: out.index_put_((idx,), prod(x, g), accumulate=True),
        "view-sum": lambda out, idx, x, g: view_sum(x, g),
    }


def _check_same_as_eager(compiled: Callable[..., Any], fn: Callable[..., Any], args: list[Any]) -> None:
    eager_args = [a.clone() for a in args]
    comp_args = [a.clone() for a in args]
    expected = fn(*eager_args)
    got = compiled(*comp_args)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(comp_args, eager_args)  # the same mutations of the inputs


def _assert_refused(findings: list[Any]) -> None:
    assert not any(f.matched for f in findings), [f for f in findings if f.matched]
    reasons = [f.reason for f in findings if not f.matched]
    assert any("writes memory the match reads" in r or "may write any memory" in r for r in reasons), reasons


SC_CASES = [(t, w, s) for t in TRAPS for w in ("x", "g", "src", "x[1]")
            for s in _spellings(lambda t: None, "x")]


@pytest.mark.parametrize("trap,which,spelling", SC_CASES, ids=["-".join(c) for c in SC_CASES])
def test_backend_refuses_scatter_with_a_mutated_operand(trap: str, which: str, spelling: str) -> None:
    c = shared(("scatter", trap), [w_s for t, *w_s in SC_CASES if t == trap],
               lambda w_s: (_spellings(TRAPS[trap], w_s[0])[w_s[1]], _inputs()), [which, spelling])
    _check_case(c)
    assert c.after[SC] == 0, c.after
    _assert_refused(c.findings)


@pytest.mark.parametrize("spelling", list(_spellings(lambda t: None, "x")))
def test_backend_rewrites_when_nothing_is_mutated(spelling: str) -> None:
    """The control: the same spellings, with a trap on an unrelated tensor, are rewritten."""
    def fn(out, idx, x, g, spare):
        F.relu(spare, inplace=True)
        return _spellings(lambda t: None, "x")[spelling](out, idx, x, g)

    rec = RecordingBackend()
    _check_same_as_eager(torch.compile(fn, backend=rec, fullgraph=True), fn,
                         [*_inputs(), torch.randn(5, dtype=torch.float64)])
    assert rec.after[0][SC] == 1, rec.after[0]


# ------------------------------------------------------ scatter: "out starts as zeros"
# An out-of-place scatter into a zeros (or include_self=False) is only the op if the
# zeros is still zeros at the scatter.

ZEROS_SPELLINGS: dict[str, Callable[..., Any]] = {
    "index_add": lambda z, idx, src: z.index_add(0, idx, src),
    "index_add_": lambda z, idx, src: z.index_add_(0, idx, src),
    "index_put": lambda z, idx, src: z.index_put((idx,), src, accumulate=True),
    "scatter_add": lambda z, idx, src: z.scatter_add(0, idx[:, None].expand(-1, H), src),
    "scatter_reduce_(include_self=False)": lambda z, idx, src: z.scatter_reduce_(
        0, idx[:, None].expand(-1, H), src, "sum", include_self=False),
}
ZERO_CASES = [(t, s) for t in TRAPS for s in ZEROS_SPELLINGS]


def _zeros_fn(trap: str, spelling: str) -> Callable[..., Any]:
    def fn(out, idx, x, g):
        z = torch.zeros(T, H, dtype=x.dtype)
        z2 = z[:, :]  # the mutation goes through an alias
        z2.add_(torch.arange(H, dtype=x.dtype))  # so that every trap below changes the zeros
        TRAPS[trap](z2)
        return ZEROS_SPELLINGS[spelling](z, idx, x * g[:, None])

    return fn


@pytest.mark.parametrize("trap,spelling", ZERO_CASES, ids=["-".join(c) for c in ZERO_CASES])
def test_backend_proves_zeros_at_the_scatter(trap: str, spelling: str) -> None:
    c = shared(("zeros", trap), list(ZEROS_SPELLINGS), lambda s: (_zeros_fn(trap, s), _inputs()), spelling)
    _check_case(c)
    # Either left alone, or rewritten as z + op: never "op alone", which assumes zeros.
    assert c.after[SC] == 0 or c.after["zeros"] == 1, c.after


def _zeros_trap_fn(trap: str) -> Callable[..., Any]:
    def fn(out, idx, x, g):
        z = torch.zeros(T, H, dtype=x.dtype)
        TRAPS[trap](z[1:])
        return z.index_add(0, idx, x * g[:, None])

    return fn


@pytest.mark.parametrize("trap", TRAPS)
def test_backend_zeros_mutated_only_by_the_trap(trap: str) -> None:
    """A trap alone on a fresh zeros (some leave zeros at zero: relu): the scatter must
    still not assume zeros, since the write could have changed them."""
    c = shared(("zeros alone",), list(TRAPS), lambda t: (_zeros_trap_fn(t), _inputs()), trap)
    _check_case(c)
    assert c.after[SC] == 0 or c.after["zeros"] == 1, c.after


# ------------------------------------------------------------------- cat_linear parts

def _cat_fn(trap: Callable[[torch.Tensor], Any], which: str) -> Callable[..., Any]:
    lin = nn.Linear(2 * H, K).double()

    def fn(a, b):
        c = torch.cat([a, b], -1)
        trap({"a": a, "b": b, "a[0]": a[0], "a.T": a.T}[which])
        return lin(c)

    return fn


# (Dynamo refuses out= into a non-contiguous tensor: that one case is left out.)
CAT_CASES = [(t, w) for t in TRAPS for w in ("a", "b", "a[0]", "a.T") if (t, w) != ("mul(out=)", "a.T")]


@pytest.mark.parametrize("trap,which", CAT_CASES, ids=["-".join(c) for c in CAT_CASES])
def test_backend_refuses_cat_linear_with_a_mutated_part(trap: str, which: str) -> None:
    c = shared(("cat", trap), [w for t, w in CAT_CASES if t == trap], lambda w: (_cat_fn(TRAPS[trap], w), [
        torch.randn(5, H, dtype=torch.float64), torch.randn(5, H, dtype=torch.float64)]), which)
    _check_case(c)
    assert c.after[CL] == c.after[CLS] == 0, c.after
    _assert_refused(c.findings)


def test_batch_norm_running_stats_count_as_writes() -> None:
    """F.batch_norm writes its running stats though its name says nothing of it."""
    lin = nn.Linear(2 * H, K).double()

    def fn(a, b, rm, rv):
        c = torch.cat([rm.expand(5, H), b], -1)
        F.batch_norm(a, rm, rv, training=True)
        return lin(c)

    rec = RecordingBackend()
    d = torch.float64
    _check_same_as_eager(torch.compile(fn, backend=rec, fullgraph=True), fn,
                         [torch.randn(5, H, dtype=d), torch.randn(5, H, dtype=d),
                          torch.randn(H, dtype=d), torch.rand(H, dtype=d) + 1])
    assert rec.after[0][CL] == rec.after[0][CLS] == 0, rec.after[0]
    _assert_refused(rec.findings)


# ------------------------------------------------------------ the other two entries

ENTRY_CASES = [("relu(inplace=True)", "x", "index_add_"), ("nn.ReLU(inplace=True)", "g", "zeros.index_add"),
               ("custom op Tensor(a!)", "src", "index_put_"), ("view.mul_", "x[1]", "view-sum"),
               ("mul(out=)", "g", "scatter_add_"), ("setitem", "x", "scatter_reduce")]


@pytest.mark.parametrize("trap,which,spelling", ENTRY_CASES, ids=["-".join(c) for c in ENTRY_CASES])
def test_backend_by_name_and_optimize(trap: str, which: str, spelling: str) -> None:
    fn = _spellings(TRAPS[trap], which)[spelling]
    _check_same_as_eager(torch.compile(fn, backend="opreg", options={"inner": "eager"}), fn, _inputs())
    torch._dynamo.reset()
    _check_same_as_eager(opreg.optimize(fn, options={"inner": "eager"}), fn, _inputs())
    assert sc_pattern.PATTERN.total == 0


class _Module(nn.Module):
    """nn.ReLU(inplace=True) as a submodule: symbolic_trace keeps it a call_module."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, out, idx, x, g):
        src = x * g[:, None]
        self.act(x)
        return out.index_add_(0, idx, src)


@pytest.mark.parametrize("trap,which,spelling", ENTRY_CASES, ids=["-".join(c) for c in ENTRY_CASES])
def test_apply_patterns_on_a_traced_graph(trap: str, which: str, spelling: str) -> None:
    if trap == "nn.ReLU(inplace=True)":
        pytest.skip("a module call in a traced graph: test_apply_patterns_refuses_across_a_module_call")
    fn = _spellings(TRAPS[trap], which)[spelling]
    _check_traced(fn)


def test_apply_patterns_refuses_across_a_module_call() -> None:
    _check_traced(_Module())


def _check_traced(fn: Callable[..., Any]) -> None:
    args = _inputs()
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*[mode.from_tensor(a) for a in args])
    ctx = apply_patterns(gm)
    assert ctx.rewrites == 0
    _assert_refused(ctx.findings)
    _check_same_as_eager(gm, fn, args)
