"""opreg.optimize: the loop idioms it rewrites (and proves safe from the source), the
ones it must leave alone, run-time fallbacks, training, dynamic sizes, and the
reference model end to end (Inductor, default kernels, visible in the profiler)."""
from __future__ import annotations

import textwrap
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import opreg
from opreg.backend import RecordingBackend, stats
from opreg.models import moe_combine_loop as moe
from opreg.ops.scatter_combine import reference as sc_reference
from opreg.optimize import LoopFinding, find_loops, loop_combine, optimize, rewrite_loops

OP = "opreg::scatter_combine"
T, F, H = 6, 2, 8          # tokens, fan-out, hidden
N = T * F


def moe_inputs(dtype: torch.dtype = torch.float32, t: int = T, idx_dtype: torch.dtype = torch.int32
               ) -> list[Any]:
    n = t * F
    idx = torch.arange(t).repeat_interleave(F)[torch.randperm(n)].to(idx_dtype)
    return [torch.randn(n, H, dtype=dtype), idx, torch.rand(n, dtype=dtype), t]


@pytest.fixture
def reference_ops() -> Any:
    torch._dynamo.reset()
    with opreg.use("reference"):
        yield


# ------------------------------------------------------------------------ loop variants

class Reference(moe.Model):
    pass


class LenAndRebind(nn.Module):
    def forward(self, x, idx, g, num_tokens: int):
        out = torch.zeros(num_tokens, x.shape[1], dtype=x.dtype)
        for i in range(len(idx)):
            out[idx[i]] = out[idx[i]] + x[i] * g[i]
        return out


class CountItemGateFirst(nn.Module):
    def forward(self, x, idx, g, num_tokens: int):
        n = x.shape[0]
        out = x.new_zeros(num_tokens, x.shape[1])
        for r in range(n):
            out[idx[r].item()] += g[r] * x[r]
        return out


class IntIndexGatesColumn(nn.Module):
    def forward(self, x, idx, g, num_tokens: int):
        gates = g[:, None]
        acc = torch.zeros_like(x[:num_tokens])
        with torch.no_grad():
            pass
        for j in range(0, x.shape[0]):
            acc[int(idx[j])] += x[j] * gates[j]
        return acc


class NonZeroOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(H))

    def forward(self, x, idx, g, num_tokens: int):
        out = self.bias.expand(num_tokens, -1) * 1.0
        for row in range(x.shape[0]):
            out[idx[row]] += g[row] * x[row]
        return out


VARIANTS = [Reference, LenAndRebind, CountItemGateFirst, IntIndexGatesColumn, NonZeroOut]


@pytest.mark.parametrize("cls", VARIANTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_loop_variant(cls: type, dtype: torch.dtype, reference_ops: Any) -> None:
    m = cls().to(dtype)
    args = moe_inputs(dtype)
    expected = m(*args)
    found = rewrite_loops(m)
    assert [f.matched for f in found] == [True], found
    assert m._opreg_loops == found
    rec = RecordingBackend()
    got = torch.compile(m, backend=rec, fullgraph=True)(*args)   # no graph break left
    torch.testing.assert_close(got, expected)
    assert rec.before[0][OP] == 1 and len(rec.before) == 1
    if cls is Reference:
        torch.testing.assert_close(got, sc_reference(*args))


def test_optimize_api_eager_inner(reference_ops: Any) -> None:
    m = moe.Model()
    args = moe_inputs()
    expected = m(*args)
    before = stats["graphs"]
    om = optimize(m, options={"inner": "eager"})
    torch.testing.assert_close(om(*args), expected)
    assert stats["graphs"] == before + 1
    assert optimize(m, compile=False) is m            # idempotent, in place


def test_loop_variable_left_as_python_leaves_it(reference_ops: Any) -> None:
    class UsesVar(nn.Module):
        def forward(self, x, idx, g, num_tokens: int):
            out = torch.zeros(num_tokens, x.shape[1])
            for i in range(x.shape[0]):
                out[idx[i]] += g[i] * x[i]
            return out, i

    m = UsesVar()
    args = moe_inputs()
    expected = m(*args)
    assert rewrite_loops(m)[0].matched
    got = m(*args)
    torch.testing.assert_close(got[0], expected[0])
    assert got[1] == expected[1] == N - 1


def test_negative_indices_wrap_like_python(reference_ops: Any) -> None:
    m = Reference()
    x, idx, g, t = moe_inputs(idx_dtype=torch.int64)
    idx = idx - t * (idx % 2)                    # half of them negative
    expected = m(x, idx, g, t)
    rewrite_loops(m)
    torch.testing.assert_close(m(x, idx, g, t), expected)


def test_runtime_fallback_keeps_results(reference_ops: Any) -> None:
    """Values the op can't take exactly (out in float64, rows in float32; a prefix-only
    bound) run the original loop."""
    class Mixed(nn.Module):
        def forward(self, x, idx, g, n: int):
            out = torch.zeros(T, x.shape[1], dtype=torch.float64)
            for i in range(n):
                out[idx[i]] += g[i] * x[i]
            return out

    m = Mixed()
    x, idx, g, _ = moe_inputs()
    expected = [m(x, idx, g, N), m(x, idx, g, N - 3)]
    assert rewrite_loops(m)[0].matched
    torch.testing.assert_close([m(x, idx, g, N), m(x, idx, g, N - 3)], expected)


def test_super_and_closure(reference_ops: Any) -> None:
    scale = 3.0

    class Base(nn.Module):
        def forward(self, x):
            return x * scale

    class Child(Base):
        def forward(self, x, idx, g, num_tokens: int):
            out = torch.zeros(num_tokens, x.shape[1])
            for i in range(x.shape[0]):
                out[idx[i]] += g[i] * x[i]
            return super().forward(out)

    m = Child()
    args = moe_inputs()
    expected = m(*args)
    assert rewrite_loops(m)[0].matched
    torch.testing.assert_close(m(*args), expected)


def test_plain_function(reference_ops: Any) -> None:
    def combine(x, idx, g, num_tokens: int):
        out = torch.zeros(num_tokens, x.shape[1])
        for i in range(x.shape[0]):
            out[idx[i]] += x[i] * g[i]
        return out

    args = moe_inputs()
    fast = optimize(combine, options={"inner": "eager"})
    torch.testing.assert_close(fast(*args), combine(*args))


# -------------------------------------------------------------------- must not rewrite

class OutIsAnArgument(nn.Module):
    def forward(self, x, idx, g, out):
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out


class TwoStatements(nn.Module):
    def forward(self, x, idx, g, out):
        out = torch.zeros_like(out)
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
            out *= 1.0
        return out


class ShiftedRow(nn.Module):
    def forward(self, x, idx, g, out):
        out = torch.zeros_like(out)
        for i in range(x.shape[0] - 1):
            out[idx[i]] += g[i] * x[i + 1]
        return out


class OutAliasesInput(nn.Module):
    def forward(self, x, idx, g, out):
        out = x
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out


class OutViewedBeforeLoop(nn.Module):
    def forward(self, x, idx, g, out):
        out = torch.zeros_like(out)
        first = out[0]
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out + first


class ElseClause(nn.Module):
    def forward(self, x, idx, g, out):
        out = torch.zeros_like(out)
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        else:
            out = out * 2
        return out


NOT_REWRITTEN = [
    (OutIsAnArgument, "not created just before the loop"),
    (TwoStatements, "2 statements"),
    (ShiftedRow, "not out[idx[i]] += gates[i] * x[i]"),
    (OutAliasesInput, "not a fresh tensor"),
    (OutViewedBeforeLoop, "used between its creation and the loop"),
    (ElseClause, "else clause"),
]


@pytest.mark.parametrize("cls,reason", NOT_REWRITTEN, ids=[c.__name__ for c, _ in NOT_REWRITTEN])
def test_not_rewritten(cls: type, reason: str, reference_ops: Any) -> None:
    m = cls()
    x, idx, g, _ = moe_inputs()
    out = torch.randn(N, H) if cls is OutAliasesInput else torch.randn(T, H)
    expected = m(x.clone(), idx, g, out.clone())
    found = rewrite_loops(m)
    assert len(found) == 1 and not found[0].matched and reason in found[0].reason, found
    assert "forward" not in vars(m)
    torch.testing.assert_close(m(x.clone(), idx, g, out.clone()), expected)


def test_source_unavailable_warns_once(reference_ops: Any) -> None:
    ns: dict[str, Any] = {"torch": torch, "nn": nn}
    exec(textwrap.dedent("""
        class Execd(nn.Module):
            def forward(self, x, idx, g, num_tokens: int):
                out = torch.zeros(num_tokens, x.shape[1])
                for i in range(x.shape[0]):
                    out[idx[i]] += g[i] * x[i]
                return out
    """), ns)
    m1, m2 = ns["Execd"](), ns["Execd"]()
    with pytest.warns(RuntimeWarning, match="source is not available"):
        assert rewrite_loops(m1) == []
    assert "forward" not in vars(m1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewrite_loops(m2)                    # said once already
    args = moe_inputs()
    torch.testing.assert_close(optimize(m1, options={"inner": "eager"})(*args), m2(*args))


def test_find_loops_reports_without_rewriting() -> None:
    found = find_loops(moe.Model.forward)
    assert len(found) == 1 and found[0].matched and found[0].line > 0
    assert "out[token_idx[row]]" in found[0].code
    assert isinstance(found[0], LoopFinding) and found[0].op == OP
    assert loop_combine is opreg.loops.scatter_combine.IDIOM.runtime   # the old names still work


# ------------------------------------------------------------------ training and shapes

def test_gradients_match_eager_loop(reference_ops: Any) -> None:
    x0, idx, g0, t = moe_inputs(torch.float64)
    grads = []
    for optimized in (False, True):
        m = moe.Model()
        if optimized:
            m = optimize(m, options={"inner": "aot_eager"})
        x, g = x0.clone().requires_grad_(), g0.clone().requires_grad_()
        loss = (m(x, idx, g, t) ** 2).sum()
        loss.backward()
        grads.append((loss.detach(), x.grad, g.grad))
    torch.testing.assert_close(grads[1], grads[0])


def test_dynamic_num_tokens_no_recompile_per_size(reference_ops: Any) -> None:
    m = moe.Model()
    om = optimize(moe.Model(), options={"inner": "eager"})
    counters = torch._dynamo.utils.counters["stats"]
    before, unique = stats["graphs"], counters["unique_graphs"]
    for t in (6, 10, 14, 3, 21):
        args = moe_inputs(t=t)
        torch.testing.assert_close(om(*args), m(*args))
    assert stats["graphs"] - before <= 2     # static first, then one dynamic graph
    assert counters["unique_graphs"] - unique <= 2


# ------------------------------------------------------------------------- end to end

def test_reference_model_inductor_default_kernels() -> None:
    """The acceptance check: optimize(MoEModel()) == eager, running opreg::scatter_combine
    (the default binding, under Inductor)."""
    torch._dynamo.reset()
    m = moe.Model()
    gen = torch.Generator().manual_seed(0)
    args = moe.get_inputs(generator=gen)
    expected = m(*args)
    om = optimize(moe.Model())
    torch.testing.assert_close(om(*args), expected)
    with torch.profiler.profile() as prof:
        got = om(*args)
    torch.testing.assert_close(got, expected)
    assert OP in {e.name for e in prof.events()}
