"""What pattern files build on: reading a node's fake value and arguments, comparing
(symbolic) sizes without adding guards, the spelling tables shared by patterns.

Nothing here changes a graph except :func:`erase_dead`.
"""
from __future__ import annotations

import collections
import operator
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = [
    "ADD", "MUL", "SUM", "VIEW_FUNCTIONS", "VIEW_METHODS", "bind", "is_call", "known_equal", "known_le",
    "meta_value", "op_counts", "op_name", "order", "provable", "shape_is", "tensor_value", "user_frame",
]

# Spellings several patterns share (functions, then the method names Dynamo records).
MUL = (operator.mul, torch.mul, torch.Tensor.mul)
ADD = (operator.add, operator.iadd, torch.add, torch.Tensor.add)
SUM = (torch.sum, torch.Tensor.sum)
# Reshapes that keep row-major element order (a row of the result is a run of input rows).
VIEW_FUNCTIONS = (torch.reshape, torch.Tensor.view, torch.Tensor.reshape, torch.unsqueeze,
                  torch.Tensor.unsqueeze, torch.flatten, torch.Tensor.flatten, torch.Tensor.unflatten)
VIEW_METHODS = ("view", "reshape", "unsqueeze", "flatten", "unflatten")


def meta_value(x: Any) -> Any:
    """The (fake) value of a node, from Dynamo's ``example_value`` or FX's ``val``;
    a non-node argument is its own value."""
    if isinstance(x, fx.Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def tensor_value(x: Any) -> torch.Tensor | None:
    v = meta_value(x)
    return v if isinstance(v, torch.Tensor) else None


def provable(cond: Any) -> bool:
    """``cond`` (a bool, or a SymBool from comparing SymInts) if it is provable from what
    the shape environment knows now; False otherwise. Never adds a guard: it is the
    ``holds`` the op specs (:mod:`opreg.ops`) are asked with from a pattern."""
    if isinstance(cond, bool):
        return cond
    try:
        return statically_known_true(cond)
    except Exception:  # noqa: BLE001 - incomparable means "not known"
        return False


def _compare(fn: Callable[[], Any]) -> bool:
    try:
        return provable(fn())
    except Exception:  # noqa: BLE001
        return False


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts, True only if provable now: never adds a guard."""
    return _compare(lambda: a == b)


def known_le(a: Any, b: Any) -> bool:
    """``a <= b`` for ints or SymInts, True only if provable now: never adds a guard."""
    return _compare(lambda: a <= b)


def shape_is(t: torch.Tensor, shape: Sequence[Any]) -> bool:
    return t.dim() == len(shape) and all(known_equal(a, b) for a, b in zip(t.shape, shape))


def bind(node: fx.Node, params: Sequence[str], defaults: Mapping[str, Any] | None = None
         ) -> dict[str, Any] | None:
    """Arguments of a call by parameter name (``params[0]`` is ``self``/``input``).

    None when they don't fit: too many, an unknown keyword (e.g. ``out=``), a missing
    one without a default. Patterns then leave the node alone.
    """
    defaults = defaults or {}
    if len(node.args) > len(params):
        return None
    bound = dict(zip(params, node.args))
    for key, v in node.kwargs.items():
        key = params[0] if key in ("input", "self") else key
        if key not in params or key in bound:
            return None
        bound[key] = v
    for p in params:
        if p not in bound:
            if p not in defaults:
                return None
            bound[p] = defaults[p]
    return bound


def is_call(node: Any, functions: Iterable[Any] = (), methods: Iterable[str] = ()) -> bool:
    """Is ``node`` a call of one of ``functions`` or of a method named in ``methods``?"""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target is f or node.target == f for f in functions)
    if node.op == "call_method":
        return node.target in tuple(methods)
    return False


def order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Program order: node -> index."""
    return {n: i for i, n in enumerate(graph.nodes)}


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def user_frame(node: fx.Node) -> tuple[str, int, str]:
    """(file, line, code) of the innermost frame of ``node``'s stack trace, or ("", 0, "")."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return m["file"], int(m["line"]), code
    return "", 0, ""


def op_name(node: fx.Node) -> str:
    """A readable name for what ``node`` calls: ``"opreg::scatter_combine"``,
    ``"index_add_"`` (a method), ``"cat"``, ``"linear"``, ``"mul"``."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t.name()
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    return getattr(t, "__name__", str(t))


def op_counts(gm: fx.GraphModule) -> collections.Counter[str]:
    """How many times each op is called in ``gm`` (see :func:`op_name`)."""
    return collections.Counter(op_name(n) for n in gm.graph.nodes
                               if n.op in ("call_function", "call_method", "call_module"))
