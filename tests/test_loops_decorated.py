"""Decorated functions under ``opreg.optimize`` (issue 13, item 3): a ``functools.wraps``
decorator that holds the function in one closure variable is seen through (the function
is rewritten and the wrapper rebuilt around it, so the decorator still does what it did:
transformers' ``@use_experts_implementation`` dispatch, ``torch.no_grad()``, a user's
counter); any other decorator leaves the function alone, and explain says why."""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch

import opreg
from _util import assert_matches
from opreg.loops import find_loops, rewrite_function, rewrite_loops

OP = "opreg::scatter_combine"
T, F, H = 5, 3, 8
N = T * F


@pytest.fixture(autouse=True)
def reference_ops() -> Any:
    with opreg.use("reference"):
        yield


def inputs() -> list[Any]:
    """x (N, H), idx (N,) int64, gates (N,), T: every token gets F rows, in random order."""
    idx = torch.arange(T).repeat_interleave(F)[torch.randperm(N)]
    return [torch.randn(N, H, dtype=torch.float64), idx, torch.rand(N, dtype=torch.float64) + 0.5, T]


def ops_ran(fn: Callable[[], Any]) -> tuple[Any, set[str]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("opreg::")}


calls: list[str] = []


def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's decorator: records each call, then calls ``fn``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(fn.__name__)
        return fn(*args, **kwargs)
    return wrapper


class Registry:
    """A decorator that keeps the function in a table, not in its wrapper's closure."""
    table: dict[str, Callable[..., Any]] = {}

    @classmethod
    def wrap(cls, fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        cls.table[name] = fn

        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return cls.table[name](*args)
        return wrapper


@counted
def combine(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, t: int) -> torch.Tensor:
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return out


@torch.no_grad()
def combine_no_grad(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, t: int) -> torch.Tensor:
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(len(x)):
        out[idx[i]] = out[idx[i]] + g[i] * x[i]
    return out


@counted
@counted
def combine_twice(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, t: int) -> torch.Tensor:
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(x.size(0)):
        out[idx[i]] += g[i] * x[i]
    return out


def test_wrapper_is_rebuilt_and_still_runs() -> None:
    """The user's decorator still records the call; the loop ran as scatter_combine."""
    new, found = rewrite_function(combine)
    assert [(f.matched, f.function) for f in found] == [(True, "combine")], found
    assert new is not combine and new.__wrapped__ is not combine.__wrapped__
    assert "test_loops_decorated.py" in found[0].file and found[0].code == "out[idx[i]] += g[i] * x[i]"
    args = inputs()
    want = combine(*args)
    calls.clear()
    got, ran = ops_ran(lambda: new(*args))
    assert calls == ["combine"] and OP in ran
    assert_matches(got, want, torch.float64)
    _, ran = ops_ran(lambda: combine(*args))
    assert calls == ["combine", "combine"] and OP not in ran  # the original is untouched


def test_no_grad_decorator_still_applies() -> None:
    x, idx, g, t = inputs()
    x.requires_grad_(True)
    new, found = rewrite_function(combine_no_grad)
    assert [f.matched for f in found] == [True], found
    got, ran = ops_ran(lambda: new(x, idx, g, t))
    assert OP in ran and not got.requires_grad  # no_grad still wraps the rewritten body
    assert_matches(got, combine_no_grad(x, idx, g, t), torch.float64)


def test_two_decorators_are_both_rebuilt() -> None:
    new, found = rewrite_function(combine_twice)
    assert [f.matched for f in found] == [True], found
    args = inputs()
    want = combine_twice(*args)
    calls.clear()
    got, ran = ops_ran(lambda: new(*args))
    assert calls == ["combine_twice", "combine_twice"] and OP in ran  # wraps copies the name
    assert_matches(got, want, torch.float64)


def test_decorator_not_holding_the_function_is_left_with_the_reason() -> None:
    def plain(x: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, t: int) -> torch.Tensor:
        out = torch.zeros(t, x.shape[1], dtype=x.dtype)
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out

    wrapped = Registry.wrap(plain)
    new, found = rewrite_function(wrapped)
    assert new is wrapped
    assert [f.matched for f in found] == [False], found
    assert "decorated" in found[0].reason and "closure" in found[0].reason, found[0].reason
    assert [f.matched for f in find_loops(wrapped)] == [False]  # explain says the same


# ======================================================= transformers' experts classes

def hf_experts(family: str) -> torch.nn.Module:
    """The real (decorated) experts class of ``family``, dispatching to HF's eager loop."""
    transformers = pytest.importorskip("transformers")
    if family == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as mod
        cls, cfg = mod.MixtralExperts, transformers.MixtralConfig(
            hidden_size=H, intermediate_size=6, num_local_experts=4, num_experts_per_tok=2)
    else:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mod
        cls, cfg = mod.Qwen3MoeExperts, transformers.Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=6, num_experts=4, num_experts_per_tok=2)
    assert hasattr(cls.forward, "__wrapped__"), "transformers no longer decorates the experts forward"
    cfg._experts_implementation = "eager"
    m = cls(cfg).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4)
    return m


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hf_experts_dispatch_survives(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewritten loop runs while the config says "eager"; another implementation set
    afterwards is still dispatched to (the wrapper was rebuilt, not bypassed). The loop
    idiom alone: transformers' module rewrite (moe_experts) is taken out."""
    m = hf_experts(family)
    from opreg.integrations import transformers as oi
    from opreg.loops import registry

    monkeypatch.delitem(registry._MODULE_REWRITES, oi.OPTIMIZE_NAME)
    ref = copy.deepcopy(m)
    found = rewrite_loops(m)
    assert [(f.matched, f.idiom) for f in found] == [(True, "experts")], found
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(T)])
    w = torch.rand(T, 2, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    got, ran = ops_ran(lambda: m(x, ids, w))
    want = ref(x, ids, w)
    assert OP in ran
    assert_matches(got, want, torch.float64)
    cot = torch.randn_like(want)
    g_got = torch.autograd.grad(got, [x, w, *m.parameters()], cot)
    g_want = torch.autograd.grad(want, [x, w, *ref.parameters()], cot)
    for a, b in zip(g_got, g_want):
        assert_matches(a, b, torch.float64)

    seen: list[str] = []
    import transformers.integrations.moe as moe

    def spy(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(type(self).__name__)
        return torch.full_like(args[0], 7.0)

    moe.ALL_EXPERTS_FUNCTIONS["opreg_test_spy"] = spy
    try:
        m.config._experts_implementation = "opreg_test_spy"
        out, ran = ops_ran(lambda: m(x, ids, w))
    finally:
        del moe.ALL_EXPERTS_FUNCTIONS["opreg_test_spy"]
        m.config._experts_implementation = "eager"
    assert seen == [type(m).__name__] and OP not in ran and bool((out == 7.0).all())
