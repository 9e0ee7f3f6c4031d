"""The loop rewrite preserves every observable effect of the loop, or doesn't happen
(issue 10): the loop variable's final value (closures, nested functions, zero trips,
``del``, augmented assignment), partial writes before an exception (try/except, with,
finally, a closure holding the variable), aliases of ``out`` (closures, eval, escapes,
generators, look-alike allocators and operators), aliasing inputs, tensor subclasses,
live closure cells. Each case runs the original eagerly and the rewrite, and compares."""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opreg
from _util import assert_matches
from opreg.loops import rewrite_function

OP = "opreg::scatter_combine"
T, F, H = 5, 3, 8
N = T * F


class OpLog(TorchDispatchMode):
    """Counts the ops dispatched inside it (``log.ops["opreg::scatter_combine"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def reference_ops() -> Any:
    with opreg.use("reference"):
        yield


def inputs(bad_row: int | None = None) -> list[Any]:
    """x (N, H), idx (N,) int64 (idx[bad_row] out of range), gates (N,), T."""
    idx = torch.arange(T).repeat_interleave(F)[torch.randperm(N)]
    if bad_row is not None:
        idx[bad_row] = T + 2
    return [torch.randn(N, H), idx, torch.rand(N) + 0.5, T]


def as64(args: list[Any]) -> list[Any]:
    return [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """fn's result, or the type of what it raised."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the exception is the outcome compared
        return type(e)


def assert_same(got: Any, expected: Any, dtype: torch.dtype | None = None) -> None:
    """Equal outcomes: tensors within ``dtype``'s tolerance of a float64 ``expected``
    (bit-equal when ``dtype`` is None), everything else ==."""
    if isinstance(expected, (tuple, list)):
        assert type(got) is type(expected) and len(got) == len(expected), (got, expected)
        for g, e in zip(got, expected):
            assert_same(g, e, dtype)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), got
        if dtype is None:
            assert torch.equal(got, expected)
        else:
            assert_matches(got, expected, dtype)
    else:
        assert got == expected, (got, expected)


def check(fn: Callable[..., Any], args: list[Any], *, matched: bool = True, op_runs: bool = True
          ) -> OpLog:
    """Rewrite ``fn``; its outcome on ``args`` equals the original's, eager, in float64
    (bit-equal to the original in float32 when the op doesn't run: the loop itself ran)."""
    new, found = rewrite_function(fn)
    assert [f.matched for f in found] == [matched], found
    assert (new is not fn) == matched
    expected = outcome(fn, *(args if not op_runs else as64(args)))
    with OpLog() as log:
        got = outcome(new, *args)
    assert_same(got, expected, torch.float32 if op_runs else None)
    assert log.ops[OP] == (1 if op_runs else 0), log.ops
    return log


# =============================================================== the loop variable

def var_in_lambda(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    last = lambda: i  # a closure over the loop variable, read after the loop
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return out, last()


def var_in_nested_def(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]

    def where() -> int:
        return i
    return out, where()


def var_deleted(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    del i
    return out


def var_augmented(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    i += 10
    return out, i


@pytest.mark.parametrize("fn", [var_in_lambda, var_in_nested_def, var_deleted, var_augmented],
                         ids=lambda f: f.__name__)
def test_loop_variable_after_the_loop(fn: Callable[..., Any]) -> None:
    check(fn, inputs())


def zero_trips_old_value(x, idx, g, t, n):
    i = -7
    out = x.new_zeros(t, x.shape[1])
    for i in range(n):
        out[idx[i]] += g[i] * x[i]
    return out, i


def zero_trips_unbound(x, idx, g, t, n):
    out = x.new_zeros(t, x.shape[1])
    for i in range(n):
        out[idx[i]] += g[i] * x[i]

    def read() -> int:
        return i
    return out, read()


@pytest.mark.parametrize("fn", [zero_trips_old_value, zero_trips_unbound], ids=lambda f: f.__name__)
def test_zero_trips_leave_the_variable_alone(fn: Callable[..., Any]) -> None:
    """n = 0: the variable keeps its old value, or stays unbound (NameError in both)."""
    check(fn, [*inputs(), 0], op_runs=False)
    check(fn, [*inputs(), N])


def nonlocal_var(x, idx, g, t):
    i = -1

    def combine():
        nonlocal i
        out = torch.zeros(t, x.shape[1], dtype=x.dtype)
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out

    return combine, lambda: i


def test_nonlocal_loop_variable_writes_the_shared_cell() -> None:
    args = inputs()
    combine, read = nonlocal_var(*args)
    new, found = rewrite_function(combine)
    assert found[0].matched
    with OpLog() as log:
        out = new()
    assert log.ops[OP] == 1 and read() == N - 1
    assert_matches(out, as64([combine()])[0], torch.float32)


def test_live_closure_cells() -> None:
    """The rewrite shares the original's cells: a later change is seen."""
    scale = 1.0

    def combine(x, idx, g, t):
        out = torch.zeros(t, x.shape[1], dtype=x.dtype)
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out * scale

    new, _ = rewrite_function(combine)
    args = inputs()
    scale = 3.0
    assert_matches(new(*args), combine(*as64(args)), torch.float32)


# ========================================================== exceptions part-way

def caught(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    try:
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
    except IndexError:
        return out, i
    return out, -1


def suppressed(x, idx, g, t):
    out = x.new_zeros(t, x.shape[1])
    with contextlib.suppress(IndexError):
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
    return out


def seen_in_finally(x, idx, g, t, seen):
    out = torch.ones(t, x.shape[1], dtype=x.dtype)
    try:
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
    finally:
        seen.append(out)
    return out


def var_held_by_caller(x, idx, g, t, seen):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    seen.append(lambda: i)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return out


@pytest.mark.parametrize("fn", [caught, suppressed], ids=lambda f: f.__name__)
def test_partial_writes_before_a_caught_error(fn: Callable[..., Any]) -> None:
    """Good indices: the op. A bad one at row 7: the rows before it, as eager leaves them."""
    check(fn, inputs())
    check(fn, inputs(bad_row=7), op_runs=False)


@pytest.mark.parametrize("fn", [seen_in_finally, var_held_by_caller], ids=lambda f: f.__name__)
def test_state_seen_after_an_error(fn: Callable[..., Any]) -> None:
    """A finally block, or a caller holding a closure over the loop variable, sees the
    state the loop left when it raised."""
    new, found = rewrite_function(fn)
    assert found[0].matched
    args = inputs(bad_row=7)
    eager: list[Any] = []
    mine: list[Any] = []
    assert outcome(fn, *args, eager) is outcome(new, *args, mine) is IndexError
    got, want = [(s() if callable(s) else s) for s in mine], [(s() if callable(s) else s) for s in eager]
    assert_same(got, want)
    check(fn, [*inputs(), []])


def under_no_grad(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    with torch.no_grad():
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
    return out


def uncaught(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return out


@pytest.mark.parametrize("fn", [under_no_grad, uncaught], ids=lambda f: f.__name__)
def test_error_nobody_can_catch_here(fn: Callable[..., Any]) -> None:
    """No handler in the frame (no_grad never swallows): the op itself raises
    IndexError, as the loop would; no index check up front."""
    check(fn, inputs())
    new, _ = rewrite_function(fn)
    args = inputs(bad_row=7)
    with OpLog() as log:
        got = outcome(new, *args)
    assert got is outcome(fn, *args) is IndexError and log.ops[OP] == 1


# ================================================================== aliases of out

def held_by_closure(x, idx, g, t):
    def peek():
        return out
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    early = peek()
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return early


def reached_by_eval(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    early = eval("out")  # the alias under test
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return early


def escapes_first(x, idx, g, t, seen):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    seen.append(out)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return seen[0]


def x_aliases_out(x, idx, g, t):
    out = torch.ones(N, x.shape[1], dtype=x.dtype)
    x = out
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return out


def gates_alias_out(x, idx, g, t):
    out = torch.ones(N, x.shape[1], dtype=x.dtype)
    g = out[:, 0]
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return out


def reads_out_in_loop(x, idx, g, t):
    out = torch.ones(N, x.shape[1], dtype=x.dtype)
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * out[i]
    return out


def yields_out_first(x, idx, g, t):
    out = torch.zeros(t, x.shape[1], dtype=x.dtype)
    yield out
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]


ALIASED = [(held_by_closure, "nested function"), (reached_by_eval, "eval/exec/locals/vars"),
           (x_aliases_out, "used between"), (gates_alias_out, "used between"),
           (reads_out_in_loop, "distinct names")]


@pytest.mark.parametrize("fn,reason", ALIASED, ids=[f.__name__ for f, _ in ALIASED])
def test_aliased_out_is_left_alone(fn: Callable[..., Any], reason: str) -> None:
    new, found = rewrite_function(fn)
    assert new is fn and not found[0].matched and reason in found[0].reason, found
    args = inputs()
    torch.testing.assert_close(new(*args), fn(*args), rtol=0, atol=0)


def test_escaping_out_is_left_alone() -> None:
    for fn in (escapes_first, yields_out_first):
        new, found = rewrite_function(fn)
        assert new is fn and "used between" in found[0].reason, found


def yields_after(x, idx, g, t):
    out = x.new_zeros(t, x.shape[1])
    yield x.shape[0]
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    yield out
    yield i


def test_generator() -> None:
    new, found = rewrite_function(yields_after)
    assert found[0].matched
    args = inputs()
    with OpLog() as log:
        got = list(new(*args))
    assert_same(got, list(yields_after(*as64(args))), torch.float32)
    assert log.ops[OP] == 1


class Pool:
    """Looks like a tensor factory, hands out one shared buffer."""

    def __init__(self) -> None:
        self.buf = torch.randn(T, H)

    def new_zeros(self, *size: int) -> torch.Tensor:
        return self.buf

    def __mul__(self, other: float) -> torch.Tensor:
        return self.buf


def pooled_method(x, idx, g, t, pool):
    out = pool.new_zeros(t, x.shape[1])
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return pool.buf


def pooled_operator(x, idx, g, t, pool):
    out = pool * 1.0
    for i in range(x.shape[0]):
        out[idx[i]] += g[i] * x[i]
    return pool.buf


@pytest.mark.parametrize("fn", [pooled_method, pooled_operator], ids=lambda f: f.__name__)
def test_look_alike_allocator_runs_the_loop(fn: Callable[..., Any]) -> None:
    """``out`` proved fresh from the source, but at run time not made by torch: the
    shared buffer must be written as the loop writes it."""
    new, found = rewrite_function(fn)
    assert found[0].matched
    args, pool, twin = inputs(), Pool(), Pool()
    twin.buf = pool.buf.clone()
    eager = fn(*args, twin)
    with OpLog() as log:
        got = new(*args, pool)
    assert log.ops[OP] == 0 and got is pool.buf and torch.equal(got, eager)


class Marked(torch.Tensor):
    pass


def test_tensor_subclass_runs_the_loop() -> None:
    x, idx, g, t = inputs()
    args = [x.as_subclass(Marked), idx, g, t]
    check(uncaught, args, op_runs=False)


def test_leaf_out_that_requires_grad_raises_as_eager() -> None:
    def leaf(x, idx, g, t):
        out = torch.zeros(t, x.shape[1], requires_grad=True)
        for i in range(x.shape[0]):
            out[idx[i]] += g[i] * x[i]
        return out

    check(leaf, inputs(), op_runs=False)
    assert outcome(leaf, *inputs()) is RuntimeError


def test_nonzero_out_then_augmented() -> None:
    def ones_then_add(x, idx, g, t):
        out = x.new_ones(t, x.shape[1])
        for i in range(x.shape[0]):
            out[idx[i]] = out[idx[i]] + g[i] * x[i]
        out += 1
        return out

    check(ones_then_add, inputs())
