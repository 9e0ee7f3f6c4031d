"""Pattern: a linear layer over a concatenation -> ``torch.ops.opreg.cat_linear``.

    y = F.linear(torch.cat(parts, -1), W, b)      parts (..., H_i), W (K, sum H_i), b (K,)

Runs on the Dynamo graph (see :mod:`opreg.compile.backend` for why). This file holds, in
order: the spellings it matches and how each reads into a match, the replacement, the
safety checks, then the pattern. The loop, mutation safety and counting are the
framework's (:mod:`opreg.compile.pattern`).
``PATTERN.matches`` counts rewrites by spelling (what tests assert on);
``PATTERN.near_misses`` counts refusals by reason.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from opreg.compile.fx_utils import ADD, bind, is_call, known_equal, known_le, provable, tensor_value
from opreg.compile.pattern import GraphEditor, GraphPattern, Match, Miss, PassContext
from opreg.ops.cat_linear import STACKED_MAX_MACS, unsupported

# ============================================================================= spellings
# The cat: torch.cat / concat / concatenate(parts, dim=-1) of a list of tensors, however
# the list was made: [x[i] for i in range(R)], list(x.unbind(0)), [a, b, c]
# (Dynamo records each as separate nodes). Then, on the cat's result:
#   F.linear(cat, W, b)            also nn.Linear (inlined by Dynamo, or a call_module)
#   cat @ W.T (+ b)                @ / matmul / mm; W.T, W.t(), W.transpose(0, 1), W.permute(1, 0)
#   torch.addmm(b, cat, W.t())     beta = alpha = 1
# with or without bias, parts 2-D or more.

CAT = (torch.cat, torch.concat, torch.concatenate)
LINEAR = (F.linear, torch._C._nn.linear)
MATMUL = (operator.matmul, torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm)
ADDMM = (torch.addmm, torch.Tensor.addmm)
TRANSPOSE_FNS = (torch.t, torch.Tensor.t, torch.transpose, torch.Tensor.transpose,
                 torch.permute, torch.Tensor.permute)
_NUMPY_T = tuple(x for x in (getattr(torch.ops.aten, "numpy_T", None),
                             getattr(getattr(torch.ops.aten, "numpy_T", None), "default", None))
                 if x is not None)


def cat_parts(node: Any) -> tuple[list[Any], Any] | None:
    """(parts, dim) of a cat node, else None."""
    if not is_call(node, CAT):
        return None
    kwargs = dict(node.kwargs)
    if "out" in kwargs:
        return None
    if "axis" in kwargs:  # torch.concatenate's spelling
        kwargs["dim"] = kwargs.pop("axis")
    args = list(node.args)
    tensors = args[0] if args else kwargs.pop("tensors", None)
    dim = args[1] if len(args) > 1 else kwargs.pop("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(args) > 2 or set(kwargs) - {"dim"}:
        return None
    return list(tensors), dim


def _swaps_two_dims(name: str, rest: list[Any]) -> bool:
    """Do ``.t()``, ``.transpose(*rest)`` or ``.permute(*rest)`` swap the two dims of a 2-D tensor?"""
    if name == "t":
        return not rest
    dims = rest[0] if name == "permute" and len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    if len(dims) != 2 or not all(type(d) is int for d in dims):
        return False
    if name == "transpose":
        return {d % 2 for d in dims} == {0, 1}
    return name == "permute" and [d % 2 for d in dims] == [1, 0]


def transposed_weight(node: Any) -> fx.Node | None:
    """W, if ``node`` is the transpose of a 2-D W (W.T, W.t(), W.transpose(0, 1), ...)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node) \
            or node.kwargs:
        return None
    w, v = tensor_value(node.args[0]), tensor_value(node)
    if w is None or v is None or w.dim() != 2 or v.dim() != 2:
        return None
    rest = list(node.args[1:])
    if node.op == "call_function" and ((node.target in _NUMPY_T and not rest)
                                       or (node.target is getattr and rest in (["T"], ["mT"]))):
        return node.args[0]
    if not (node.op == "call_method" or is_call(node, TRANSPOSE_FNS)):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.args[0] if _swaps_two_dims(name, rest) else None


def bias_add(mm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(add node, b) if ``mm``'s only use is ``mm + b`` / ``b + mm`` (no alpha)."""
    if len(mm.users) != 1:
        return None
    add = next(iter(mm.users))
    if not is_call(add, ADD, ("add",)):
        return None
    a = bind(add, ("self", "other", "alpha"), {"alpha": 1})
    if a is None or a["alpha"] != 1:
        return None
    other = a["other"] if a["self"] is mm else a["self"] if a["other"] is mm else None
    if not isinstance(other, fx.Node) or other is mm:
        return None
    b, m = tensor_value(other), tensor_value(mm)
    if b is None or m is None or b.dim() != 1 or not known_equal(b.shape[0], m.shape[-1]):
        return None  # not a per-output bias: leave the add alone
    return add, other


@dataclasses.dataclass
class Consumer:
    """How a cat's result is consumed by a linear: the node to replace (``anchor``),
    the weight and bias nodes (or the nn.Linear ``module``), and the nodes that die with it."""

    spelling: str
    anchor: fx.Node
    weight: Any
    bias: Any
    dead: list[fx.Node]
    module: str | None = None


def _linear(cat: fx.Node, user: fx.Node, gm: fx.GraphModule) -> Consumer | str | None:
    a = bind(user, ("self", "weight", "bias"), {"bias": None})
    if a is None or a["self"] is not cat:
        return None
    return Consumer("linear", user, a["weight"], a["bias"], [])


def _module(cat: fx.Node, user: fx.Node, gm: fx.GraphModule) -> Consumer | str | None:
    if type(gm.get_submodule(user.target)) is not torch.nn.Linear or user.args != (cat,) or user.kwargs:
        return None  # a subclass may override forward
    return Consumer("nn.Linear", user, None, None, [], module=user.target)


def _matmul(cat: fx.Node, user: fx.Node, gm: fx.GraphModule) -> Consumer | str | None:
    a = bind(user, ("self", "other")) or bind(user, ("self", "mat2"))
    if a is None or a["self"] is not cat:
        return None
    right = a.get("other", a.get("mat2"))
    w = transposed_weight(right)
    if w is None:
        return "the matmul's right operand is not a transposed weight W.T"
    folded = bias_add(user)
    if folded is not None:
        return Consumer("cat @ W.T + b", folded[0], w, folded[1], [user, right])
    return Consumer("cat @ W.T", user, w, None, [right])


def _addmm(cat: fx.Node, user: fx.Node, gm: fx.GraphModule) -> Consumer | str | None:
    a = bind(user, ("self", "mat1", "mat2", "beta", "alpha"), {"beta": 1, "alpha": 1})
    if a is None or a["mat1"] is not cat:
        return None
    if a["beta"] != 1 or a["alpha"] != 1:
        return "addmm with beta/alpha other than 1"
    w = transposed_weight(a["mat2"])
    if w is None:
        return "addmm's mat2 is not a transposed weight W.t()"
    return Consumer("addmm", user, w, a["self"], [a["mat2"]])


def consumer_of(cat: fx.Node, user: fx.Node, gm: fx.GraphModule) -> Consumer | str | None:
    """The linear ``user`` applies to ``cat``; a reason if it looks like one but can't be
    expressed; None if ``user`` is no linear over ``cat`` at all."""
    if is_call(user, LINEAR):
        return _linear(cat, user, gm)
    if user.op == "call_module":
        return _module(cat, user, gm)
    if is_call(user, MATMUL, ("matmul", "mm")):
        return _matmul(cat, user, gm)
    if is_call(user, ADDMM, ("addmm",)):
        return _addmm(cat, user, gm)
    return None


# ============================================================================ replacement
# cat_linear(parts, W, b) in place of the linear (and of the bias add it absorbed); the
# cat, the transpose and the matmul die with it. nn.Linear's weight/bias become get_attr.
# When the parts are every slice of one tensor x along one dim, in order
# ([x[i] for i in range(R)] with R == x.size(0), list(x.unbind(d)), [x[:, 0], x[:, 1]]),
# and the problem is small (STACKED_MAX_MACS, provably: not for a dynamic size),
# cat_linear_stacked(x, d, W, b) instead: the same sum, but the slices are never made in
# Python (that is most of a small call's host time; see opreg/ops/cat_linear.py).

def slice_of(node: Any) -> tuple[fx.Node, int, int] | None:
    """(x, dim, index) if ``node`` is one slice of x along dim: x[i], x[:, i] (full
    slices then an int), x.select(dim, i), or element i of x.unbind(dim)."""
    if not isinstance(node, fx.Node) or node.kwargs or not node.args:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    if is_call(node, (operator.getitem,)) and len(node.args) == 2:
        idx = node.args[1]
        if is_call(src, (torch.unbind, torch.Tensor.unbind), ("unbind",)) and isinstance(idx, int):
            a = bind(src, ("self", "dim"), {"dim": 0})
            if a is None or not isinstance(a["self"], fx.Node) or not isinstance(a["dim"], int):
                return None
            return a["self"], a["dim"], idx
        if tensor_value(src) is None:
            return None
        idx = idx if isinstance(idx, tuple) else (idx,)
        full = slice(None, None, None)
        if not idx or not all(i == full for i in idx[:-1]) or type(idx[-1]) is not int:
            return None
        return src, len(idx) - 1, idx[-1]
    if is_call(node, (torch.select, torch.Tensor.select), ("select",)):
        a = bind(node, ("self", "dim", "index"))
        if a is None or not all(type(a[k]) is int for k in ("dim", "index")):
            return None
        return a["self"], a["dim"], a["index"]
    return None


def stacked_source(parts: list[Any]) -> tuple[fx.Node, int] | None:
    """(x, dim) if ``parts`` are x's slices 0, 1, ..., x.size(dim) - 1 along dim, in order."""
    found = [slice_of(p) for p in parts]
    if not found or any(f is None for f in found):
        return None
    x, dim = found[0][0], found[0][1]  # type: ignore[index]
    v = tensor_value(x)
    if v is None or v.dim() < 2 or not -v.dim() <= dim < v.dim():
        return None
    dim %= v.dim()
    for i, (src, d, idx) in enumerate(found):  # type: ignore[misc]
        if src is not x or d % v.dim() != dim or idx != i:
            return None
    return (x, dim) if known_equal(v.shape[dim], len(parts)) else None


@dataclasses.dataclass
class CatLinearMatch(Match):
    cat: fx.Node = None  # type: ignore[assignment]
    parts: list[Any] = dataclasses.field(default_factory=list)
    dim: Any = -1
    consumer: Consumer = None  # type: ignore[assignment]


def emit_cat_linear(ed: GraphEditor, m: CatLinearMatch) -> fx.Node:
    """cat_linear_stacked(x, d, W, b) for every slice of one x in order on a provably
    small problem (see STACKED_MAX_MACS), else cat_linear(parts, W, b)."""
    c = m.consumer
    weight, bias = c.weight, c.bias
    if c.module is not None:
        weight = ed.get_attr(f"{c.module}.weight")
        bias = ed.get_attr(f"{c.module}.bias") if ed.ctx.gm.get_submodule(c.module).bias is not None else None
    macs = tensor_value(m.cat).numel() * tensor_value(weight).shape[0]
    stacked = stacked_source(m.parts) if known_le(macs, STACKED_MAX_MACS) else None
    if stacked is not None:
        return ed.call_function(torch.ops.opreg.cat_linear_stacked.default,
                                (stacked[0], stacked[1], weight, bias))
    return ed.call_function(torch.ops.opreg.cat_linear.default, (list(m.parts), weight, bias))


# ========================================================================= safety checks

def linear_params(m: CatLinearMatch, ctx: PassContext) -> tuple[Any, Any, bool]:
    """Fake values of the linear's weight and bias, and whether it has a bias."""
    c = m.consumer
    if c.module is None:
        return tensor_value(c.weight), tensor_value(c.bias), c.bias is not None
    mod = ctx.gm.get_submodule(c.module)
    fake = ctx.fake_mode.from_tensor if ctx.fake_mode is not None else (lambda t: t)
    return fake(mod.weight), None if mod.bias is None else fake(mod.bias), mod.bias is not None


def check_cat(m: CatLinearMatch) -> str | None:
    """Why the cat itself can't be folded into the linear, or None."""
    c, dim, parts = tensor_value(m.cat), m.dim, m.parts
    if c is None:
        return "no shape information"
    if not isinstance(dim, int) or isinstance(dim, bool):
        return "cat with a non-constant dim"
    if dim % c.dim() != c.dim() - 1:
        return f"cat on dim {dim}, not the last"
    if len(m.cat.users) != 1:
        return "cat result used elsewhere (it would still be materialised)"
    if not parts or not all(isinstance(p, fx.Node) and tensor_value(p) is not None for p in parts):
        return "cat of a non-tensor list, or parts without shape information"
    return None


def check_cat_linear(m: CatLinearMatch, ctx: PassContext, autocast: bool) -> str | None:
    """Why ``linear(cat(parts, dim), weight, bias)`` is not exactly cat_linear, or None."""
    bad = check_cat(m)
    if bad:
        return bad
    weight, bias, has_bias = linear_params(m, ctx)
    c = tensor_value(m.cat)
    if weight is None or (has_bias and bias is None):
        return "no shape information"
    if weight.dim() != 2 or not known_equal(weight.shape[1], c.shape[-1]):
        return (f"weight width {weight.shape[-1] if weight.dim() else '?'} does not match the "
                f"cat's width {c.shape[-1]}")
    if autocast:
        # F.linear would run in the autocast dtype; a custom op is not autocast.
        return "inside an autocast region"
    return unsupported([tensor_value(p) for p in m.parts], weight, bias, holds=provable)


DDP_SPLIT_REASON = ("the cat is an output of this graph, one of those DDP's graph split "
                    "(DDPOptimizer, at a gradient-bucket boundary) makes: the linear it feeds "
                    "is in the next graph. torch._dynamo.config.optimize_ddp = False keeps "
                    "them in one graph (README, 'Distributed')")


def under_ddp_split() -> bool:
    """Is this graph one of the pieces DDPOptimizer splits a Dynamo graph into? (It
    compiles them under a TracingContext whose ddp_optimizer_ctx it has set.)"""
    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "ddp_optimizer_ctx", None) is not None


def cut_off_by_ddp(cat: fx.Node, dim: Any) -> bool:
    """A last-dim cat whose result leaves the graph, in a piece of DDP's graph split."""
    v = tensor_value(cat)
    return v is not None and v.dim() > 0 and isinstance(dim, int) and dim % v.dim() == v.dim() - 1 \
        and any(u.op == "output" for u in cat.users) and under_ddp_split()


def autocast_active(gm: fx.GraphModule) -> bool:
    """Autocast on now (Dynamo guards on it) or entered inside the graph."""
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                return True
        except (TypeError, RuntimeError):
            pass
    return any("autocast" in str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
               if n.op in ("call_function", "call_method", "call_module"))


# ============================================================================== the pattern

class CatLinearPattern(GraphPattern):
    name = "cat_linear"
    op = "cat_linear"

    def begin(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        self._autocast = autocast_active(gm)

    def match(self, node: fx.Node, ctx: PassContext) -> Match | Miss | None:
        cp = cat_parts(node)
        if cp is None:
            return None
        parts, dim = cp
        found = [(u, c) for u in list(node.users) if (c := consumer_of(node, u, ctx.gm)) is not None]
        if not found:
            # Not feeding a linear: nothing to say, unless DDP's graph split cut this
            # cat off from the linear that follows it in the next graph.
            return Miss("cat + linear", DDP_SPLIT_REASON, node) if cut_off_by_ddp(node, dim) else None
        user, c = found[0]
        if isinstance(c, str):
            return Miss("cat + linear", c, user)
        # The cat read the parts; the op reads them at the linear.
        return CatLinearMatch(c.spelling, c.anchor, reads=parts, dead=[node, *c.dead], report_at=user,
                              cat=node, parts=parts, dim=dim, consumer=c)

    def check(self, m: Match, ctx: PassContext) -> str | Miss | None:
        reason = check_cat_linear(m, ctx, self._autocast)  # type: ignore[arg-type]
        if reason is None:
            return None
        # Reported at the cat: most reasons are about it.
        spelling = m.spelling if m.spelling.startswith("cat") else f"cat + {m.spelling}"
        return Miss(spelling, reason, m.cat)  # type: ignore[attr-defined]

    def emit(self, ed: GraphEditor, m: Match) -> fx.Node:
        return emit_cat_linear(ed, m)  # type: ignore[arg-type]

    def emitted_op(self, result: fx.Node) -> str:
        return result.target.name().split("::", 1)[1]


PATTERN = CatLinearPattern()
#: rewrites by spelling, e.g. ``matches["linear"]``
matches = PATTERN.matches
near_misses = PATTERN.near_misses
