"""``opreg._entry.python_call``: ``torch.ops.opreg.<op>.default`` for an integration's own
calls, calling a Python implementation directly on plain eager calls. It must mean what the
OpOverload means: the same values, the calling ``use()`` scope's choice, and everything that
is not a plain eager no-grad call (modes, subclasses, gradients, functorch, a compiled
graph) through the OpOverload itself."""
from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest
import torch

import opreg
from opreg import registry
from opreg._entry import python_call
from opreg.ops import moe_experts as M

from _util import DispatchRecording, FunctionRecording, assert_matches

OP = torch.ops.opreg.moe_experts.default
_names = itertools.count()


def moe_args(grad: bool = False, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    t, h, i, e, k = 5, 12, 6, 4, 2
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, dtype=dtype) * scale).requires_grad_(grad)

    return (r(t, h), ids, torch.rand(t, k, dtype=dtype).requires_grad_(grad), r(e, 2 * i, h, scale=h ** -0.5), None,
            r(e, h, i, scale=i ** -0.5), None, "silu", True, False, False, 1.0, float("inf"))


def to64(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.detach().double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


@pytest.fixture
def recorder() -> Any:
    """A Python implementation of moe_experts on the CPU that records its calls (the
    reference's values), preferred by no default: only a ``use()`` scope reaches it."""
    calls: list[tuple[int, bool]] = []

    def plugin(*args: Any) -> torch.Tensor:
        # (rows, called through the dispatcher: by its device stub or use() router)
        via = any(f.function in ("stub", "route") and f.filename.endswith("_binding.py") for f in inspect.stack(0))
        calls.append((args[0].shape[0], via))
        return M.reference(*args)

    name = f"python_call_test_{next(_names)}"
    opreg.register_impl("moe_experts", name, devices=("cpu",), priority=-100)(plugin)
    try:
        yield name, calls
    finally:  # others (opreg.testing's harness) walk every implementation registered
        opreg.unregister_impl("moe_experts", name)


def test_values_match_the_op_and_float64() -> None:
    args = moe_args()
    f = python_call("moe_experts")
    with torch.no_grad():
        got, want = f(*args), OP(*args)
    assert torch.equal(got, want)
    assert_matches(got, M.reference(*to64(args)), torch.float32)


def test_use_scope_reaches_the_call(recorder: Any) -> None:
    name, calls = recorder
    f = python_call("moe_experts")
    args = moe_args()
    with torch.no_grad():
        f(*args)
        assert calls == []
        with opreg.use(moe_experts=name):
            out = f(*args)
    assert [c[0] for c in calls] == [args[0].shape[0]]
    assert_matches(out, M.reference(*to64(args)), torch.float32)


def test_plain_calls_skip_the_dispatcher(recorder: Any) -> None:
    """A plain no-grad call runs the implementation directly, and so does torch.ops (its
    Python autograd kernel calls it, as a compiled graph's wrapper code does); a call under
    a dispatch mode reaches it through the dispatcher (the use() scope's router)."""
    name, calls = recorder
    f = python_call("moe_experts")
    args = moe_args()
    with torch.no_grad(), opreg.use(moe_experts=name):
        f(*args)
        OP(*args)
        with DispatchRecording() as rec:
            f(*args)
        assert OP in rec.seen
    rows = args[0].shape[0]
    assert calls == [(rows, False), (rows, False), (rows, True)]


@pytest.mark.parametrize("mode", [DispatchRecording, FunctionRecording])
def test_modes_see_the_op(mode: type) -> None:
    f = python_call("moe_experts")
    args = moe_args()
    with torch.no_grad(), mode() as rec:
        out = f(*args)
    assert OP in rec.seen
    assert_matches(out, M.reference(*to64(args)), torch.float32)


def test_gradients_go_through_the_op() -> None:
    """A call that can carry a gradient is the OpOverload's (its autograd), with gradients
    that match float64."""
    f = python_call("moe_experts")
    args = moe_args(grad=True)
    out = f(*args)
    assert out.grad_fn is not None
    cot = torch.randn_like(out)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    got = torch.autograd.grad(out, leaves, cot)
    args64 = tuple(a.detach().double().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                   and a.is_floating_point() else a for a in args)
    leaves64 = [a for a in args64 if isinstance(a, torch.Tensor) and a.requires_grad]
    want = torch.autograd.grad(M.reference(*args64), leaves64, cot.double())
    for g, w in zip(got, want):
        assert_matches(g, w, torch.float32)


def test_functorch_goes_through_the_op() -> None:
    f = python_call("moe_experts")
    args = moe_args()
    x = args[0]

    def g(x: torch.Tensor) -> torch.Tensor:
        return f(x, *args[1:]).sum()

    got = torch.func.grad(g)(x)
    x64 = x.double().requires_grad_()
    want, = torch.autograd.grad(M.reference(x64, *to64(args)[1:]).sum(), x64)
    assert_matches(got, want, torch.float32)


def test_compiled_graph_holds_the_op() -> None:
    f = python_call("moe_experts")
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    args = moe_args()
    with torch.no_grad():
        out = torch.compile(lambda *a: f(*a) * 2, backend=backend, fullgraph=True)(*args)
    assert any(n.target is OP for g in graphs for n in g.graph.nodes)
    assert_matches(out, 2 * M.reference(*to64(args)), torch.float32)


def test_a_kernel_library_default_goes_through_the_op() -> None:
    """Where the bound implementation is a kernel library (no Python function), the call is
    the OpOverload's: scatter_combine's C++ default on the CPU."""
    if registry.lookup("scatter_combine").impls["cpu"].unavailable("cpu") is not None:
        pytest.skip("no C++ compiler: scatter_combine's CPU library does not build here")
    f = python_call("scatter_combine")
    h, idx, g = torch.randn(6, 4), torch.tensor([0, 1, 1, 2, 0, 2]), torch.rand(6)
    with torch.no_grad(), DispatchRecording() as rec:
        got = f(h, idx, g, 3)
    assert torch.ops.opreg.scatter_combine.default in rec.seen
    want = torch.zeros(3, 4).index_add(0, idx, h * g[:, None])
    assert_matches(got, want, torch.float32)
    with torch.no_grad():  # and plain: the same values without the mode
        assert torch.equal(f(h, idx, g, 3), got)


def test_a_list_argument_that_carries_a_gradient_is_not_plain() -> None:
    """``plain_eager`` is what lets the op's Autograd kernel (and ``python_call``) skip the
    gradient check, so a tensor inside a ``Tensor[]`` argument counts like a top-level one:
    one that requires grad, under grad mode, makes the call not plain (a plugin op with a
    list argument would otherwise run its implementation with no autograd recorded)."""
    from opreg._dispatch import differentiating, plain_eager

    x = torch.randn(3)
    parts = [torch.randn(2), torch.randn(2, requires_grad=True)]
    assert differentiating((x, parts)) and not plain_eager((x, parts))
    assert plain_eager((x, [p.detach() for p in parts]))
    with torch.no_grad():
        assert plain_eager((x, parts))
    fake = torch._subclasses.FakeTensorMode()
    assert not plain_eager((x, [fake.from_tensor(parts[0])]))
