"""Pattern: a linear layer over a concatenation -> ``torch.ops.opreg.cat_linear``.

    y = F.linear(torch.cat(parts, -1), W, b)      parts (..., H_i), W (K, sum H_i), b (K,)

Runs on the Dynamo graph (see :mod:`opreg.backend` for why). This file holds, in order:
the spellings it matches, the replacement, the safety checks, then the pass.
``PATTERN.matches`` counts rewrites by spelling (what tests assert on);
``PATTERN.near_misses`` counts refusals by reason.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from opreg.backend import (FLOAT_DTYPES, GraphEditor, GraphPattern, PassContext, RewriteRejected,
                           bind, erase_dead, is_call, known_equal, known_le, mutation_between,
                           shape_is, tensor_value)

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
BIAS_ADD = (operator.add, operator.iadd, torch.add, torch.Tensor.add)
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


def transposed_weight(node: Any) -> fx.Node | None:
    """W, if ``node`` is the transpose of a 2-D W (W.T, W.t(), W.transpose(0, 1), ...)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    w, v = tensor_value(node.args[0]), tensor_value(node)
    if w is None or v is None or w.dim() != 2 or v.dim() != 2:
        return None
    rest = list(node.args[1:])
    if node.kwargs:
        return None
    if node.op == "call_function" and node.target in _NUMPY_T and not rest:
        return node.args[0]
    if node.op == "call_function" and node.target is getattr and rest in (["T"], ["mT"]):
        return node.args[0]
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if not (node.op == "call_method" or is_call(node, TRANSPOSE_FNS)):
        return None
    if name == "t" and not rest:
        return node.args[0]
    if name == "transpose" and len(rest) == 2 and all(isinstance(d, int) for d in rest) \
            and {d % 2 for d in rest} == {0, 1}:
        return node.args[0]
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if len(dims) == 2 and all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0]:
            return node.args[0]
    return None


def bias_add(mm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(add node, b) if ``mm``'s only use is ``mm + b`` / ``b + mm`` (no alpha)."""
    if len(mm.users) != 1:
        return None
    add = next(iter(mm.users))
    if not is_call(add, BIAS_ADD, ("add",)):
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


class Consumer:
    """How a cat's result is consumed by a linear: the node to replace (``anchor``),
    the weight and bias nodes, and the nodes that die with it."""

    def __init__(self, spelling: str, anchor: fx.Node, weight: Any, bias: Any,
                 dead: list[fx.Node], module: str | None = None) -> None:
        self.spelling, self.anchor, self.weight, self.bias = spelling, anchor, weight, bias
        self.dead, self.module = dead, module


def consumer_of(cat: fx.Node, user: fx.Node, gm: fx.GraphModule) -> Consumer | str | None:
    """The linear ``user`` applies to ``cat``; a reason if it looks like one but can't be
    expressed; None if ``user`` is no linear over ``cat`` at all."""
    if is_call(user, LINEAR):
        a = bind(user, ("self", "weight", "bias"), {"bias": None})
        if a is None or a["self"] is not cat:
            return None
        return Consumer("linear", user, a["weight"], a["bias"], [])
    if user.op == "call_module":
        mod = gm.get_submodule(user.target)
        if type(mod) is not torch.nn.Linear or user.args != (cat,) or user.kwargs:
            return None  # a subclass may override forward
        return Consumer("nn.Linear", user, None, None, [], module=user.target)
    if is_call(user, MATMUL, ("matmul", "mm")):
        a = bind(user, ("self", "other")) or bind(user, ("self", "mat2"))
        if a is None or a["self"] is not cat:
            return None
        right = a.get("other", a.get("mat2"))
        w = transposed_weight(right)
        if w is None:
            return "the matmul's right operand is not a transposed weight W.T"
        folded = bias_add(user)
        if folded is not None:
            add, b = folded
            return Consumer("cat @ W.T + b", add, w, b, [user, right])
        return Consumer("cat @ W.T", user, w, None, [right])
    if is_call(user, ADDMM, ("addmm",)):
        a = bind(user, ("self", "mat1", "mat2", "beta", "alpha"), {"beta": 1, "alpha": 1})
        if a is None or a["mat1"] is not cat:
            return None
        if a["beta"] != 1 or a["alpha"] != 1:
            return "addmm with beta/alpha other than 1"
        w = transposed_weight(a["mat2"])
        if w is None:
            return "addmm's mat2 is not a transposed weight W.t()"
        return Consumer("addmm", user, w, a["self"], [a["mat2"]])
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


# The stacked form saves host time (no Python-made slices), which only matters when the
# kernel is short. Above this many multiply-adds the CUDA op takes its GEMM path, where
# the list form's at::cat measured faster (see cat_linear_stacked_cuda); so the stacked
# form is used up to here, where both dtypes' CUDA calls run the single-launch kernel.
STACKED_MAX_MACS = 1 << 24


def emit_cat_linear(ed: GraphEditor, parts: list[fx.Node], c: Consumer, macs: Any) -> fx.Node:
    """``macs``: rows * in-features * out-features of the linear (int or SymInt)."""
    weight, bias = c.weight, c.bias
    if c.module is not None:
        mod = ed.ctx.gm.get_submodule(c.module)
        weight = ed.get_attr(f"{c.module}.weight")
        bias = ed.get_attr(f"{c.module}.bias") if mod.bias is not None else None
    small = known_le(macs, STACKED_MAX_MACS)
    stacked = stacked_source(parts) if small else None
    if stacked is not None:
        return ed.call_function(torch.ops.opreg.cat_linear_stacked.default,
                                (stacked[0], stacked[1], weight, bias))
    return ed.call_function(torch.ops.opreg.cat_linear.default, (list(parts), weight, bias))


# ========================================================================= safety checks

def check_cat_linear(cat: fx.Node, parts: list[Any], dim: Any, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, has_bias: bool, autocast: bool) -> str | None:
    """Why ``linear(cat(parts, dim), weight, bias)`` is not exactly cat_linear, or None."""
    c = tensor_value(cat)
    if c is None or weight is None or (has_bias and bias is None):
        return "no shape information"
    if not isinstance(dim, int) or isinstance(dim, bool):
        return "cat with a non-constant dim"
    if dim % c.dim() != c.dim() - 1:
        return f"cat on dim {dim}, not the last"
    if len(cat.users) != 1:
        return "cat result used elsewhere (it would still be materialised)"
    if not parts or not all(isinstance(p, fx.Node) for p in parts):
        return "cat of a non-tensor list"
    vals = [tensor_value(p) for p in parts]
    if any(v is None for v in vals):
        return "no shape information"
    p0 = vals[0]
    if p0.dtype not in FLOAT_DTYPES or any(v.dtype != p0.dtype for v in vals):
        return "parts of different (or non-float) dtypes"
    if any(v.dim() != c.dim() or not shape_is(v, (*c.shape[:-1], v.shape[-1])) for v in vals):
        return "parts' leading shapes differ (cat would broadcast or fail)"
    if weight.dim() != 2 or not known_equal(weight.shape[1], c.shape[-1]):
        return (f"weight width {weight.shape[-1] if weight.dim() else '?'} does not match the "
                f"cat's width {c.shape[-1]}")
    if weight.dtype != p0.dtype or (bias is not None and bias.dtype != p0.dtype):
        return "weight/bias dtype differs from the parts'"
    if bias is not None and not shape_is(bias, (weight.shape[0],)):
        return "bias is not (K,)"
    devices = {v.device for v in vals} | {weight.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        return "mixed devices"
    if any(t.layout != torch.strided for t in [*vals, weight]):
        return "a sparse operand"
    if autocast:
        # F.linear would run in the autocast dtype; a custom op is not autocast.
        return "inside an autocast region"
    return None


DDP_SPLIT_REASON = ("the cat is an output of this graph, one of those DDP's graph split "
                    "(DDPOptimizer, at a gradient-bucket boundary) makes: the linear it feeds "
                    "is in the next graph. torch._dynamo.config.optimize_ddp = False keeps "
                    "them in one graph (README, 'Distributed')")


def under_ddp_split() -> bool:
    """Is this graph one of the pieces DDPOptimizer splits a Dynamo graph into? (It
    compiles them under a TracingContext whose ddp_optimizer_ctx it has set.)"""
    ctx = torch._guards.TracingContext.try_get()
    return getattr(ctx, "ddp_optimizer_ctx", None) is not None


def cat_on_last_dim(cat: fx.Node, dim: Any) -> bool:
    v = tensor_value(cat)
    return v is not None and v.dim() > 0 and isinstance(dim, int) and dim % v.dim() == v.dim() - 1


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


# ============================================================================== the pass

class CatLinearPattern(GraphPattern):
    name = "cat_linear"
    op = "cat_linear"

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        count = 0
        autocast = autocast_active(gm)
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False):
                continue
            cp = cat_parts(node)
            if cp is None:
                continue
            parts, dim = cp
            found = [(u, consumer_of(node, u, gm)) for u in list(node.users)]
            found = [(u, c) for u, c in found if c is not None]
            if not found:
                # Not feeding a linear: nothing to say, unless DDP's graph split cut this
                # cat off from the linear that follows it in the next graph.
                if any(u.op == "output" for u in node.users) and under_ddp_split() \
                        and cat_on_last_dim(node, dim):
                    ctx.near_miss(self, node, "cat + linear", DDP_SPLIT_REASON)
                continue
            user, c = found[0]
            if isinstance(c, str):
                ctx.near_miss(self, user, "cat + linear", c)
                continue
            if c.module is not None:
                mod = gm.get_submodule(c.module)
                w = ctx.fake_mode.from_tensor(mod.weight) if ctx.fake_mode else mod.weight
                b = None if mod.bias is None else (
                    ctx.fake_mode.from_tensor(mod.bias) if ctx.fake_mode else mod.bias)
                has_bias = mod.bias is not None
            else:
                w, b, has_bias = tensor_value(c.weight), tensor_value(c.bias), c.bias is not None
            reason = check_cat_linear(node, parts, dim, w, b, has_bias, autocast)
            if not reason and mutation_between([node, *c.dead], c.anchor) is not None:
                reason = ("an in-place op between the cat and the linear could change the "
                          "parts (the op would read them later)")
            if reason:  # reported at the cat: most reasons are about it
                spelling = c.spelling if c.spelling.startswith("cat") else f"cat + {c.spelling}"
                ctx.near_miss(self, node, spelling, reason)
                continue
            ed = GraphEditor(ctx, c.anchor)
            try:
                op = emit_cat_linear(ed, parts, c, tensor_value(node).numel() * w.shape[0])
            except RewriteRejected as e:
                ed.rollback()
                ctx.near_miss(self, user, c.spelling, f"replacement rejected: {e}")
                continue
            ctx.matched(self, user, c.spelling, op=op.target.name().split("::", 1)[1])
            c.anchor.replace_all_uses_with(op)
            gm.graph.erase_node(c.anchor)
            # Slices the stacked form no longer reads go too (an unbind with them).
            sources = [p.args[0] for p in parts if isinstance(p, fx.Node) and p.args
                       and is_call(p.args[0], (torch.unbind, torch.Tensor.unbind), ("unbind",))]
            erase_dead(gm.graph, [*c.dead, node, *parts, *sources])
            count += 1
        return count


PATTERN = CatLinearPattern()
#: rewrites by spelling, e.g. ``matches["linear"]``
matches = PATTERN.matches
near_misses = PATTERN.near_misses
