"""A loop idiom added through the public plug-in API only (opreg.register_op,
opreg.loops.register_loop_idiom and the proof/run-time helpers): ``opreg.optimize`` and
``explain`` handle it like the built-in one, and the registry refuses bad idioms."""
from __future__ import annotations

import ast
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn

import opreg
import opreg.loops as loops
from _util import assert_matches
from opreg.explain import explain
from test_loops_effects import OpLog

OP = "opreg::loops_toy_double"


@opreg.register_op("loops_toy_double", "(Tensor a) -> Tensor")
def toy_double(a: torch.Tensor) -> torch.Tensor:
    """What ``for i in range(len(a)): out[i] = a[i] * 2`` leaves in out."""
    return a * 2


def toy_candidate(loop: ast.For) -> bool:
    body = loop.body
    return len(body) == 1 and isinstance(body[0], ast.Assign) and isinstance(body[0].value, ast.BinOp)


def toy_prove(site: loops.LoopSite) -> loops.Plan:
    var, bound = loops.range_loop(site)
    stmt = site.loop.body[0]
    value = stmt.value
    out = loops.subscript_of(stmt.targets[0], var) if len(stmt.targets) == 1 else None
    a = loops.subscript_of(value.left, var)
    if out is None or a is None or out == a or not isinstance(value.op, ast.Mult) \
            or not (isinstance(value.right, ast.Constant) and value.right.value == 2):
        raise loops.Reject("loop body is not out[i] = a[i] * 2")
    fresh = loops.prove_fresh(site, out)
    return loops.Plan(source=bound, args=[out, a, *fresh.origin], result=out, before=fresh.before)


def toy_runtime(n: Any, out: Any, a: Any, *origin: Any) -> torch.Tensor | None:
    if not (loops.plain_tensors(out, a) and loops.fresh_origin(*origin)):
        return None
    if out.shape != a.shape or out.dtype != a.dtype or out.device != a.device or n != a.shape[0]:
        return None  # every row written, in out's dtype, as the loop would
    return torch.ops.opreg.loops_toy_double(a)


TOY = loops.LoopIdiom(name="toy_double", op=OP, candidate=toy_candidate, prove=toy_prove,
                      runtime=toy_runtime, note="a toy loop")


@pytest.fixture
def toy() -> Iterator[loops.LoopIdiom]:
    loops.register_loop_idiom(TOY)
    try:
        yield TOY
    finally:
        loops.unregister_loop_idiom(TOY.name)


class Doubler(nn.Module):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(a)
        for i in range(a.shape[0]):
            out[i] = a[i] * 2
        return out + 1


class NotToy(nn.Module):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(a)
        for i in range(a.shape[0]):
            out[i] = a[i] * 3
        return out


def test_optimize_uses_the_plugged_in_idiom(toy: loops.LoopIdiom) -> None:
    a = torch.randn(5, 3)
    expected = Doubler()(a.double())
    m = opreg.optimize(Doubler(), compile=False)
    assert [(f.matched, f.op, f.idiom) for f in m._opreg_loops] == [(True, OP, "toy_double")]
    with OpLog() as log:
        got = m(a)
    assert log.ops[OP] == 1
    assert_matches(got, expected, torch.float32)
    torch._dynamo.reset()
    compiled = opreg.optimize(Doubler(), options={"inner": "eager"})
    assert_matches(compiled(a), expected, torch.float32)


def test_explain_names_the_idioms_op(toy: loops.LoopIdiom, capsys: pytest.CaptureFixture[str]) -> None:
    report = explain(Doubler(), [torch.randn(4, 3)])
    assert [(f.matched, f.op) for f in report.loops] == [(True, OP)]
    printed = capsys.readouterr().out
    assert f"a toy loop; opreg.optimize(model) rewrites it to {OP}" in printed
    report = explain(NotToy(), [torch.randn(4, 3)])
    assert [(f.matched, f.op) for f in report.loops] == [(False, OP)]
    assert f"not rewritable by opreg.optimize ({OP}): loop body is not out[i] = a[i] * 2" \
        in capsys.readouterr().out


def test_unregistered_idiom_is_not_used() -> None:
    assert "toy_double" not in [i.name for i in loops.registered_loop_idioms()]
    assert loops.find_loops(Doubler.forward) == []
    assert [i.name for i in loops.registered_loop_idioms()][:1] == ["scatter_combine"]


def test_registry_refuses_bad_idioms(toy: loops.LoopIdiom) -> None:
    with pytest.raises(ValueError, match="already registered"):
        loops.register_loop_idiom(TOY)
    with pytest.raises(ValueError, match="identifier"):
        loops.register_loop_idiom(loops.LoopIdiom("not a name", OP, toy_candidate, toy_prove, toy_runtime))
    with pytest.raises(TypeError, match="must be a LoopIdiom"):
        loops.register_loop_idiom(object())  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="no_such_idiom"):
        loops.unregister_loop_idiom("no_such_idiom")


def test_an_integration_that_fails_to_import_is_skipped(monkeypatch, caplog) -> None:
    """A library the program imported whose opreg integration can't load (another version):
    optimize goes on with the loop idioms, and says so once."""
    import logging
    import sys
    import types

    from opreg.loops import registry

    monkeypatch.setitem(sys.modules, "opreg_fake_lib", types.ModuleType("opreg_fake_lib"))
    monkeypatch.setitem(registry._INTEGRATIONS, "opreg_fake_lib", "opreg.integrations.opreg_fake_lib")
    monkeypatch.setattr(registry, "_FAILED", set())
    with caplog.at_level(logging.WARNING, logger="opreg"):
        before = registry.registered_module_rewrites()
        again = registry.registered_module_rewrites()
    assert before == again
    said = [r.getMessage() for r in caplog.records if "opreg_fake_lib" in r.getMessage()]
    assert len(said) == 1 and "loop idioms" in said[0], said
