"""A toy op added end to end through public and plug-in APIs only, in one file: the op
(``opreg.register_op``), a second implementation (``opreg.register_impl``), a pattern
(``opreg.backend.register_pattern``) and a loop idiom (``opreg.loops.register_loop_idiom``).
The backend rewrites its spelling, ``explain`` reports the match and the loop, and
``opreg.testing`` checks both implementations (and fails a wrong one).

    row_scale(x (N, H), s (N,)) -> (N, H) = x * s[:, None]
"""
from __future__ import annotations

import ast
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn

import opreg
import opreg.loops as loops
import opreg.testing as ot
from opreg.backend import RecordingBackend, register_pattern, unregister_pattern
from opreg.explain import explain

NAME, OP = "toy_row_scale", "opreg::toy_row_scale"


@opreg.register_op(NAME, "(Tensor x, Tensor s) -> Tensor")
def row_scale(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The meaning: every row of x (N, H) times its s (N,)."""
    if x.dim() != 2 or s.shape != (x.shape[0],):
        raise ValueError(f"{NAME}: s must have shape (N,) = ({x.shape[0] if x.dim() else '?'},), "
                         f"got {list(s.shape)}")
    return x * s[:, None]


@opreg.register_impl(NAME, "einsum", devices=("cpu", "cuda"), priority=50)
def row_scale_einsum(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or s.shape != (x.shape[0],):
        raise ValueError(f"{NAME}: s must have shape (N,), got {list(s.shape)}")
    return torch.einsum("nh,n->nh", x, s)


# ------------------------------------------------------------------- the pattern

def search(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x * s.unsqueeze(-1)


def replacement(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.ops.opreg.toy_row_scale(x, s)


def fits(v: dict[str, Any]) -> bool:
    return v["x"].dim() == 2 and v["s"].dim() == 1 and v["x"].dtype == v["s"].dtype


# --------------------------------------------------------------- the loop idiom

def candidate(loop: ast.For) -> bool:
    return len(loop.body) == 1 and isinstance(loop.body[0], ast.Assign)


def prove(site: loops.LoopSite) -> loops.Plan:
    """for i in range(n): out[i] = x[i] * s[i]   with out fresh."""
    var, bound = loops.range_loop(site)
    stmt = site.loop.body[0]
    value = stmt.value
    if len(stmt.targets) != 1 or not isinstance(value, ast.BinOp) or not isinstance(value.op, ast.Mult):
        raise loops.Reject("loop body is not out[i] = x[i] * s[i]")
    out = loops.subscript_of(stmt.targets[0], var)
    x, s = loops.subscript_of(value.left, var), loops.subscript_of(value.right, var)
    if None in (out, x, s) or len({out, x, s}) != 3:
        raise loops.Reject("loop body is not out[i] = x[i] * s[i] over three names")
    fresh = loops.prove_fresh(site, out)
    return loops.Plan(source=bound, args=[out, x, s, *fresh.origin], result=out, before=fresh.before)


def runtime(n: Any, out: Any, x: Any, s: Any, *origin: Any) -> torch.Tensor | None:
    if not (loops.plain_tensors(out, x, s) and loops.fresh_origin(*origin)):
        return None
    if x.dim() != 2 or s.shape != (x.shape[0],) or out.shape != x.shape or out.dtype != x.dtype \
            or s.dtype != x.dtype or n != x.shape[0]:
        return None  # the loop runs instead
    return torch.ops.opreg.toy_row_scale(x, s)


IDIOM = loops.LoopIdiom(name=NAME, op=OP, candidate=candidate, prove=prove, runtime=runtime,
                        note="rows scaled one by one")


@pytest.fixture
def plugged() -> Iterator[None]:
    torch._dynamo.reset()
    register_pattern(search, replacement, name=NAME, check=fits, op=NAME)
    loops.register_loop_idiom(IDIOM)
    try:
        yield
    finally:
        unregister_pattern(NAME)
        loops.unregister_loop_idiom(NAME)
        torch._dynamo.reset()


class Spelled(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * s.unsqueeze(-1))


class Looped(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = x[i] * s[i]
        return out


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(7, 5, dtype=torch.float64), torch.randn(7, dtype=torch.float64)


def test_backend_rewrites_the_spelling(plugged: None) -> None:
    x, s = _inputs()
    rec = RecordingBackend()
    got = torch.compile(Spelled(), backend=rec, fullgraph=True)(x, s)
    torch.testing.assert_close(got, torch.relu(x * s[:, None]))
    assert rec.after[0][OP] == 1 and rec.after[0]["mul"] == 0, rec.after[0]


def test_optimize_rewrites_the_loop(plugged: None) -> None:
    x, s = _inputs()
    model = Looped()
    found = loops.rewrite_loops(model)
    assert [f.op for f in found if f.matched] == [OP]
    torch.testing.assert_close(model(x, s), x * s[:, None])
    torch.testing.assert_close(opreg.optimize(Looped(), options={"inner": "eager"})(x, s), x * s[:, None])


def test_explain_reports_both(plugged: None, capsys: pytest.CaptureFixture[str]) -> None:
    x, s = _inputs()
    report = explain(Spelled(), [x, s])
    assert [f.pattern for f in report.matches] == [NAME]
    assert OP in str(report)
    report = explain(Looped(), [x, s])
    assert [f.op for f in report.loops if f.matched] == [OP] and OP in str(report)


def samples(device: str, dtype: torch.dtype, requires_grad: bool = False) -> Iterator[ot.Sample]:
    for n, h in ((0, 3), (1, 1), (7, 5), (33, 64)):
        x = torch.randn(n, h, dtype=dtype, device=device, requires_grad=requires_grad)
        s = torch.randn(n, dtype=dtype, device=device, requires_grad=requires_grad)
        yield ot.Sample((x, s), name=f"n={n},h={h}")


BAD = [("s length", lambda x, s: (x, torch.cat([s, s.new_ones(1)])), ValueError, "s must have shape")]
SUITE = ot.OpTestSuite(NAME, samples, bad=BAD)


@pytest.mark.parametrize("impl", ["reference", "einsum"])
def test_harness_checks_both_implementations(impl: str) -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        SUITE.check_correctness("cpu", dtype, impl=impl)
    SUITE.check_bad_input("cpu", impl=impl)
    SUITE.check_deterministic("cpu", impl=impl)


def test_harness_fails_a_wrong_implementation() -> None:
    @opreg.register_impl(NAME, "wrong", devices=("cpu",), priority=1)
    def wrong(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s[:, None] * 1.001

    try:
        with pytest.raises(AssertionError):
            SUITE.check_correctness("cpu", torch.float32, impl="wrong")
    finally:
        opreg.unregister_impl(NAME, "wrong")
