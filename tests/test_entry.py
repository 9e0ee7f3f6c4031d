"""The ops' C++ Python entries (``opreg.get(op)`` for cat_linear, cat_linear_stacked,
scatter_combine): the same call as ``torch.ops.opreg.<op>.default`` (values, gradients,
errors, ``use()`` scopes, modes, subclasses, ``torch.compile``), at less host cost."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import opreg
from opreg import registry

from _util import DispatchRecording, FunctionRecording, assert_matches

ENTRIES = ("cat_linear", "cat_linear_stacked", "scatter_combine")
_names = itertools.count()


def have_compiler() -> bool:
    return registry.lookup("scatter_combine").impls["cpu"].unavailable("cpu") is None


pytestmark = pytest.mark.skipif(not have_compiler(), reason="no C++ compiler: get() hands out the OpOverloads")


def args_of(name: str, dtype: torch.dtype = torch.float32, grad: bool = False) -> tuple[Any, ...]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype).requires_grad_(grad)

    if name == "cat_linear":
        return [r(5, 3), r(5, 4), r(5, 2)], r(6, 9), r(6)
    if name == "cat_linear_stacked":
        return r(3, 5, 4), 0, r(6, 12), r(6)
    idx = torch.arange(7).repeat_interleave(2)[torch.randperm(14)]
    return r(14, 8), idx, torch.rand(14, dtype=dtype).requires_grad_(grad), 7


def reference(name: str, args: tuple[Any, ...]) -> torch.Tensor:
    if name == "cat_linear":
        return F.linear(torch.cat(args[0], -1), args[1], args[2])
    if name == "cat_linear_stacked":
        return F.linear(torch.cat(args[0].unbind(args[1]), -1), args[2], args[3])
    h, idx, g, t = args
    return torch.zeros(t, h.shape[1], dtype=h.dtype).index_add(0, idx, h * g[:, None])


def leaves(args: tuple[Any, ...]) -> list[torch.Tensor]:
    flat = [t for a in args for t in (a if isinstance(a, list) else [a])]
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def to64(args: tuple[Any, ...]) -> tuple[Any, ...]:
    def one(t: Any) -> Any:
        if isinstance(t, list):
            return [one(x) for x in t]
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().double().requires_grad_(t.requires_grad)
        return t

    return tuple(one(a) for a in args)


@pytest.mark.parametrize("name", ENTRIES)
def test_get_hands_out_the_entry(name: str) -> None:
    fn = opreg.get(name)
    assert fn is not registry.lookup(name).torch_op
    assert type(fn).__name__ == "builtin_function_or_method", type(fn)
    assert opreg.get("moe_experts") is torch.ops.opreg.moe_experts.default  # no entry: the OpOverload


@pytest.mark.parametrize("name", ENTRIES)
def test_values_and_gradients_against_float64(name: str) -> None:
    fn = opreg.get(name)
    args = args_of(name, grad=True)
    args64 = to64(args)
    out, want = fn(*args), reference(name, args64)
    assert_matches(out, want, torch.float32)
    cot = torch.randn_like(want)
    for g, w, a in zip(torch.autograd.grad(out, leaves(args), cot.float()),
                       torch.autograd.grad(want, leaves(args64), cot), leaves(args)):
        assert_matches(g, w, a.dtype)
    with torch.no_grad():  # no node: the kernel straight away
        assert fn(*args).grad_fn is None
    torch.testing.assert_close(fn(*args), getattr(torch.ops.opreg, name).default(*args), rtol=0, atol=0)


def test_keywords_and_errors_name_the_argument() -> None:
    fn = opreg.get("cat_linear")
    parts, w, b = args_of("cat_linear")
    torch.testing.assert_close(fn(parts=parts, weight=w, bias=b), fn(parts, w, b), rtol=0, atol=0)
    with pytest.raises(ValueError, match="weight has 8 columns but the sum of the parts' widths is 9"):
        fn(parts, w[:, :8], b)
    with pytest.raises(TypeError, match="'weight'.*must be Tensor"):
        fn(parts, 3, b)
    with pytest.raises(TypeError, match="bias"):
        fn(parts, w)
    sc = opreg.get("scatter_combine")
    h, idx, g, t = args_of("scatter_combine")
    with pytest.raises(TypeError, match="'num_tokens'.*must be int"):
        sc(h, idx, g, "7")
    with pytest.raises(TypeError, match="token_idx"):
        sc(h, idx.float(), g, t)


def test_use_scope_reaches_the_entry() -> None:
    """A ``use()`` scope's choice runs through the entry (the dispatcher's router), here a
    plug-in that records its calls."""
    calls = []

    def plugin(h: torch.Tensor, idx: torch.Tensor, g: torch.Tensor, t: int) -> torch.Tensor:
        calls.append(t)
        return reference("scatter_combine", (h, idx, g, t))

    name = f"entry_test_plugin_{next(_names)}"
    opreg.register_impl("scatter_combine", name, devices=("cpu",), priority=-100)(plugin)
    try:
        sc = opreg.get("scatter_combine")
        args = args_of("scatter_combine")
        sc(*args)
        assert calls == []
        with opreg.use(scatter_combine=name):
            sc(*args)
        assert calls == [7]
    finally:  # others (opreg.testing's harness) walk every implementation registered
        opreg.unregister_impl("scatter_combine", name)


@pytest.mark.parametrize("name", ENTRIES)
def test_modes_see_the_op(name: str) -> None:
    """A dispatch mode and a function mode see the OpOverload, as they would from torch.ops."""
    fn, op = opreg.get(name), getattr(torch.ops.opreg, name).default
    args = args_of(name)
    with DispatchRecording() as rec:
        out = fn(*args)
    assert op in rec.seen
    assert_matches(out, reference(name, to64(args)), torch.float32)
    with FunctionRecording() as frec:
        fn(*args)
    assert op in frec.seen


class _Tagged(torch.Tensor):
    """A subclass with its own __torch_function__ (records what it is called with)."""
    seen: list[Any] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclass_torch_function_sees_the_op() -> None:
    parts, w, b = args_of("cat_linear")
    _Tagged.seen = []
    out = opreg.get("cat_linear")(parts, w.as_subclass(_Tagged), b)
    assert torch.ops.opreg.cat_linear.default in _Tagged.seen
    assert_matches(out.as_subclass(torch.Tensor), reference("cat_linear", to64((parts, w, b))), torch.float32)


@pytest.mark.parametrize("name", ENTRIES)
def test_compiled_graph_holds_the_op(name: str) -> None:
    """Under torch.compile (fullgraph) Dynamo traces the OpOverload in the entry's place."""
    fn, op = opreg.get(name), getattr(torch.ops.opreg, name).default
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def f(*args: Any) -> torch.Tensor:
        return fn(*args) * 2

    torch._dynamo.reset()
    args = args_of(name)
    out = torch.compile(f, backend=backend, fullgraph=True)(*args)
    assert_matches(out, reference(name, to64(args)) * 2, torch.float32)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert op in targets, targets
