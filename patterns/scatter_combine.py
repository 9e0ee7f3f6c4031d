"""Pattern: the Mixture-of-Experts combine -> ``torch.ops.opreg.scatter_combine``.

    out[t] = sum over rows r with idx[r] == t of g[r] * x[r]
    x (N, H) float, idx (N,) int32/int64, g (N,), out (T, H)

Runs on the Dynamo graph (see :mod:`opreg.backend` for why). This file holds, in order:
the spellings it matches, the replacement, the safety checks, then the pass.
``PATTERN.matches`` counts rewrites by spelling (what tests assert on);
``PATTERN.near_misses`` counts refusals by reason.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from opreg.backend import (FLOAT_DTYPES, GraphEditor, GraphPattern, PassContext, RewriteRejected,
                           bind, erase_dead, is_call, known_equal, meta_value, mutation_between,
                           position, shape_is, tensor_value)

# ============================================================================= spellings
#   out.index_add_(0, idx, x * g[:, None])          index_add / torch.index_add, alpha=
#   out.scatter_add_(0, idx[:, None].expand(-1, H), x * g[:, None])
#                                                   scatter_add, scatter_reduce(.., "sum")
#   out.index_put_((idx,), x * g[:, None], accumulate=True)              index_put
#   (x.view(T, k, H) * g.view(T, k, 1)).sum(1)      rows token-major: idx = r // k
# The gate multiply in either order; the gate column g[:, None], g.unsqueeze(-1),
# g.view(-1, 1), or gates already shaped (N, 1); out a fresh zeros (then dropped) or any
# tensor (then out + op(...), in place where the original was in place).


@dataclasses.dataclass(frozen=True)
class Spelling:
    name: str       # as reported, e.g. "index_add_", "torch.index_add"
    kind: str       # "index_add" | "scatter_add" | "scatter_reduce" | "index_put"
    inplace: bool


# Parameters of each kind (self first) and their defaults, as in the Tensor methods.
PARAMS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "index_add": (("self", "dim", "index", "source", "alpha"), {"alpha": 1}),
    "scatter_add": (("self", "dim", "index", "src"), {}),
    "scatter_reduce": (("self", "dim", "index", "src", "reduce", "include_self"),
                       {"include_self": True}),
    "index_put": (("self", "indices", "values", "accumulate"), {"accumulate": False}),
}


def _spellings() -> dict[Any, Spelling]:
    table: dict[Any, Spelling] = {}
    for kind in PARAMS:
        for inplace in (False, True):
            method = kind + ("_" if inplace else "")
            table[method] = Spelling(method, kind, inplace)
            fn = getattr(torch.Tensor, method, None)
            if fn is not None:
                table[fn] = Spelling(f"Tensor.{method}", kind, inplace)
            fn = getattr(torch, method, None)
            if fn is not None:
                table[fn] = Spelling(f"torch.{method}", kind, inplace)
    return table


SPELLINGS = _spellings()
MUL = (operator.mul, torch.mul, torch.Tensor.mul)
ADD = (operator.add, operator.iadd, torch.add, torch.Tensor.add)
SUM = (torch.sum, torch.Tensor.sum)
EXPAND = (torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to)
# Reshapes that keep row-major element order (so a row of the result is a run of input rows).
VIEWS = (torch.reshape, torch.Tensor.view, torch.Tensor.reshape, torch.unsqueeze,
         torch.Tensor.unsqueeze, torch.flatten, torch.Tensor.flatten, torch.Tensor.unflatten)
VIEW_METHODS = ("view", "reshape", "unsqueeze", "flatten", "unflatten")
ZEROS = (torch.zeros, torch.zeros_like)


def spelling_of(node: fx.Node) -> Spelling | None:
    if node.op == "call_method" and isinstance(node.target, str):
        return SPELLINGS.get(node.target)
    if node.op == "call_function":
        try:
            return SPELLINGS.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


def _is_view_like(node: Any) -> bool:
    """A reshape/unsqueeze, or an indexing with only full slices, None and ``...``."""
    if is_call(node, VIEWS, VIEW_METHODS):
        # view(dtype) reinterprets bits: shapes then differ in numel or dtype, caught below
        return True
    if is_call(node, (operator.getitem,)):
        idx = node.args[1]
        items = idx if isinstance(idx, tuple) else (idx,)
        return all(i is None or i is Ellipsis or i == slice(None) for i in items)
    return False


def unview(node: fx.Node, shape_ok: Any) -> fx.Node | None:
    """Walk back through order-keeping reshapes from ``node`` to the first tensor whose
    fake value satisfies ``shape_ok``. Every step keeps numel by construction (it ran),
    which is what callers rely on; a dtype change (view(dtype)) stops the walk."""
    v0 = tensor_value(node)
    cur: Any = node
    while True:
        v = tensor_value(cur)
        if v is None or v0 is None or v.dtype != v0.dtype:
            return None
        if shape_ok(v):
            return cur
        if not _is_view_like(cur) or not isinstance(cur.args[0], fx.Node):
            return None
        cur = cur.args[0]


def gated_product(src: Any) -> tuple[fx.Node, fx.Node] | str:
    """``src`` = hidden (N, H) times a per-row gate column (N, 1), in either order.
    Returns (hidden, gate column) or why not."""
    if not is_call(src, MUL, ("mul",)):
        return "source is not a gated product x * g[:, None]"
    a = bind(src, ("self", "other"))
    if a is None or not all(isinstance(a[k], fx.Node) for k in ("self", "other")):
        return "source is not a gated product x * g[:, None]"
    s = tensor_value(src)
    for hidden, col in ((a["self"], a["other"]), (a["other"], a["self"])):
        h, c = tensor_value(hidden), tensor_value(col)
        if h is None or c is None or s is None:
            continue
        if h.dim() == 2 and shape_is(s, h.shape) and shape_is(c, (h.shape[0], 1)):
            return hidden, col
    return "the multiplier is not a per-row gate: expected x (N, H) * g (N, 1)"


def row_vector(col: fx.Node) -> tuple[fx.Node, bool]:
    """An (N, 1) column as an (N,) vector: the 1-D tensor it was made from (g[:, None],
    g.unsqueeze(-1), g.view(-1, 1)), else the column itself, flagged to be squeezed."""
    n = tensor_value(col).shape[0]
    base = unview(col, lambda v: v.dim() == 1 and known_equal(v.shape[0], n))
    return (base, False) if base is not None else (col, True)


def scatter_row_index(index: Any, src: fx.Node) -> fx.Node | str:
    """The (N, 1) column of ``idx[:, None].expand(-1, H)``: a row index broadcast along
    the row, of exactly src's shape (scatter would silently use a narrower index)."""
    if not is_call(index, EXPAND, ("expand", "expand_as")) or not isinstance(index.args[0], fx.Node):
        return "scatter index is not idx[:, None].expand(-1, H)"
    i, col, s = tensor_value(index), tensor_value(index.args[0]), tensor_value(src)
    if i is None or col is None or s is None or not shape_is(i, s.shape) or s.dim() != 2 \
            or not shape_is(col, (s.shape[0], 1)):
        return "scatter index is not a per-row index of the source's shape (N, H)"
    return index.args[0]


def is_fresh_zeros(node: Any) -> bool:
    """torch.zeros / zeros_like / new_zeros, strided, not requires_grad, no out=."""
    if not is_call(node, ZEROS, ("new_zeros",)):
        return False
    if "out" in node.kwargs or node.kwargs.get("requires_grad"):
        return False
    v = tensor_value(node)
    return v is not None and v.layout == torch.strided


def zeros_rows(ed: GraphEditor, zeros: fx.Node) -> Any:
    """T of a fresh (T, H) zeros without keeping the zeros alive for it: the int, or the
    SymInt node the user passed as its first size."""
    t = tensor_value(zeros).shape[0]
    if isinstance(t, int):
        return t
    if zeros.op == "call_function" and zeros.target is torch.zeros and zeros.args:
        first = zeros.args[0]
        first = first[0] if isinstance(first, (list, tuple)) and first else first
        if isinstance(first, fx.Node) and known_equal(meta_value(first), t):
            return first
    return ed.size(zeros, 0)


def _is_setitem_accumulate(node: fx.Node) -> bool:
    """``out[idx] += src`` as Dynamo records it: setitem(out, idx, getitem(out, idx) + src)."""
    if not is_call(node, (operator.setitem,)) or len(node.args) != 3:
        return False
    out, index, value = node.args
    iv = tensor_value(index)
    if iv is None or iv.dtype not in (torch.int32, torch.int64):
        return False
    if not is_call(value, ADD, ("add", "add_")):
        return False
    return any(is_call(a, (operator.getitem,)) and a.args[0] is out and a.args[1] is index
               for a in value.args if isinstance(a, fx.Node))


# ============================================================================ replacement
# op = scatter_combine(x, idx, g, T) with T = out.size(0), then, by the target:
#   fresh zeros            -> op (times alpha)        the zeros is dropped
#   in place on out        -> out.add_(op, alpha=a)   same mutation, same aliases
#   out-of-place on out    -> torch.add(out, op, alpha=a)
# index_put wraps negative indices like Python (index_add/scatter raise on them), so
# there idx becomes where(idx < 0, idx + T, idx): elementwise, no host sync.

def emit_combine(ed: GraphEditor, hidden: fx.Node, idx: fx.Node, gate_col: fx.Node,
                 num_tokens: Any, wrap_negative: bool) -> fx.Node:
    gate, squeeze = row_vector(gate_col)
    if squeeze:
        gate = ed.call_method("squeeze", (gate, -1))
    if wrap_negative:
        idx = ed.call_function(torch.where, (ed.call_function(operator.lt, (idx, 0)),
                                             ed.call_function(operator.add, (idx, num_tokens)),
                                             idx))
    return ed.call_function(torch.ops.opreg.scatter_combine.default, (hidden, idx, gate, num_tokens))


def emit_view_sum_combine(ed: GraphEditor, hidden: fx.Node, gates: fx.Node, squeeze: bool,
                          grouped: fx.Node) -> fx.Node:
    """op(x, arange(N) // k, g, T) for rows grouped token-major into ``grouped`` (T, k, H)."""
    n, k, t = ed.size(hidden, 0), ed.size(grouped, 1), ed.size(grouped, 0)
    if squeeze:
        gates = ed.call_method("reshape", (gates, -1))
    rows = ed.call_function(torch.arange, (n,), {"device": tensor_value(hidden).device})
    idx = ed.call_function(torch.div, (rows, k), {"rounding_mode": "floor"})
    return ed.call_function(torch.ops.opreg.scatter_combine.default, (hidden, idx, gates, t))


# ========================================================================= safety checks

def check_combine(spelling: str, o: torch.Tensor | None, dim: Any, x: torch.Tensor | None,
                  i: torch.Tensor | None, g: torch.Tensor | None) -> str | None:
    """Why scattering the rows of ``x * g`` into ``o`` along ``dim`` at ``i`` is not
    exactly scatter_combine (fake values; ``i`` (N,) or an (N, 1) column, ``g`` the
    gate column (N, 1)), or None if it is."""
    if o is None or x is None or i is None or g is None:
        return "no shape information"
    if not isinstance(dim, int) or isinstance(dim, bool):
        return f"{spelling} with a non-constant dim"
    if o.dim() != 2:
        return f"out is {o.dim()}-D; the op produces (T, H)"
    if dim % 2 != 0:
        return f"{spelling} on dim {dim}: the op combines rows (dim 0)"
    n, h = x.shape
    if not known_equal(o.shape[1], h):
        return "out's width differs from the source's"
    if not (shape_is(i, (n,)) or shape_is(i, (n, 1))):
        return "index is not one token per source row (N,)"
    if i.dtype not in (torch.int32, torch.int64):
        return f"index dtype {i.dtype} (the op takes int32/int64; bool would be a mask)"
    if not (o.dtype == x.dtype == g.dtype):
        return (f"dtypes differ (out {o.dtype}, source {x.dtype}, gates {g.dtype}): the op "
                f"returns the source's dtype, so the result would change")
    if o.dtype not in FLOAT_DTYPES:
        return f"dtype {o.dtype} is not a float dtype"
    if len({o.device, x.device, i.device, g.device}) > 1:
        return "mixed devices"
    if any(t.layout != torch.strided for t in (o, x, i, g)):
        return "a sparse operand"
    return None


def check_view_sum(hidden: fx.Node, gates: fx.Node) -> str | None:
    x, g = tensor_value(hidden), tensor_value(gates)
    if x.dtype != g.dtype or x.dtype not in FLOAT_DTYPES:
        return f"dtypes differ (source {x.dtype}, gates {g.dtype})"
    if x.device != g.device:
        return "mixed devices"
    return None  # k may be 0: then N = 0, arange(0) // 0 is empty and the result zeros


MUTATED = ("an in-place op between the product and the scatter could change its operands "
           "(the op would read them later)")


def _chain(node: fx.Node, base: fx.Node) -> list[fx.Node]:
    """The nodes from ``node`` back to ``base`` along :func:`unview`'s walk."""
    out = [node]
    while out[-1] is not base and out[-1].args and isinstance(out[-1].args[0], fx.Node):
        out.append(out[-1].args[0])
    return out


def statically_positive(v: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        r = v >= 1
        return r if isinstance(r, bool) else statically_known_true(r)
    except Exception:  # noqa: BLE001
        return False


# ============================================================================== the pass

class ScatterCombinePattern(GraphPattern):
    name = "scatter_combine"
    op = "scatter_combine"

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        count = 0
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False):
                continue
            sp = spelling_of(node)
            if sp is not None:
                count += self._scatter(ctx, node, sp)
            elif _is_setitem_accumulate(node):
                ctx.near_miss(self, node, "out[idx] += src",
                              "index_put_ without accumulate: with repeated indices, "
                              "out[idx] += src keeps the last write instead of summing "
                              "(write out.index_add_(0, idx, src))")
            elif is_call(node, SUM, ("sum",)):
                count += self._view_sum(ctx, node)
        return count

    # -- index_add / scatter_add / scatter_reduce / index_put
    def _scatter(self, ctx: PassContext, node: fx.Node, sp: Spelling) -> int:
        params, defaults = PARAMS[sp.kind]
        a = bind(node, params, defaults)
        if a is None:
            return ctx.near_miss(self, node, sp.name, "unsupported arguments (out= or unknown ones)")
        out, alpha, dim, wrap_negative = a["self"], a.get("alpha", 1), 0, False
        if not isinstance(out, fx.Node):
            return 0
        if sp.kind == "index_put":
            if a["accumulate"] is not True:
                return ctx.near_miss(self, node, sp.name,
                                     "index_put_ without accumulate=True: repeated indices "
                                     "keep the last write instead of summing")
            indices = a["indices"]
            if not (isinstance(indices, (list, tuple)) and len(indices) == 1
                    and isinstance(indices[0], fx.Node)):
                return ctx.near_miss(self, node, sp.name, "indexes more than one dimension")
            idx, src, wrap_negative = indices[0], a["values"], True
        else:
            dim, src = a["dim"], a["source" if sp.kind == "index_add" else "src"]
            if sp.kind == "index_add":
                idx = a["index"]
            else:
                idx = scatter_row_index(a["index"], src)
                if isinstance(idx, str):
                    return ctx.near_miss(self, node, sp.name, idx)
            if sp.kind == "scatter_reduce":
                if a["reduce"] != "sum":
                    return ctx.near_miss(self, node, sp.name,
                                         f"scatter_reduce with reduce={a['reduce']!r}, not 'sum'")
                if a["include_self"] is not True and not is_fresh_zeros(out):
                    return ctx.near_miss(self, node, sp.name,
                                         "scatter_reduce(include_self=False) into a non-zero out")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            return ctx.near_miss(self, node, sp.name, "alpha is not a constant number")
        gated = gated_product(src)
        if isinstance(gated, str):
            return ctx.near_miss(self, node, sp.name, gated)
        hidden, col = gated
        reason = check_combine(sp.name, tensor_value(out), dim, tensor_value(hidden),
                               tensor_value(idx), tensor_value(col))
        # The product read x and g where it ran; the op reads them (and idx, as the
        # original did) at the scatter.
        chain = [src, *_chain(col, row_vector(col)[0])]
        if not reason and mutation_between(chain, node) is not None:
            reason = MUTATED
        if reason:
            return ctx.near_miss(self, node, sp.name, reason)

        # A fresh zeros mutated in place can be dropped only if nothing used it before.
        fresh = is_fresh_zeros(out) and (not sp.inplace or all(
            u is node or position(u) > position(node) for u in out.users))
        ed = GraphEditor(ctx, node)
        try:
            if tensor_value(idx).dim() == 2:  # scatter's (N, 1) index column
                idx, squeeze = row_vector(idx)
                if squeeze:
                    idx = ed.call_method("squeeze", (idx, -1))
            t = zeros_rows(ed, out) if fresh else ed.size(out, 0)
            op = emit_combine(ed, hidden, idx, col, t, wrap_negative)
            kw = {"alpha": alpha} if alpha != 1 else {}
            if fresh:
                result = op if alpha == 1 else ed.call_function(operator.mul, (op, alpha))
            elif sp.inplace:
                result = ed.call_method("add_", (out, op), kw)
            else:
                result = ed.call_function(torch.add, (out, op), kw)
        except RewriteRejected as e:
            ed.rollback()
            return ctx.near_miss(self, node, sp.name, f"replacement rejected: {e}")
        if fresh and sp.inplace:
            # Later reads of the zeros saw the mutation: they read the result now.
            for u in list(out.users):
                if u is not node and u not in ed.created:
                    u.replace_input_with(out, result)
        ctx.matched(self, node, sp.name)
        matched = [src, col, *col.all_input_nodes, *node.all_input_nodes]
        node.replace_all_uses_with(result)
        ctx.gm.graph.erase_node(node)
        for n in list(matched):
            matched.extend(n.all_input_nodes if not getattr(n, "_erased", False) else ())
        erase_dead(ctx.gm.graph, matched)
        return 1

    # -- (x.view(T, k, H) * g.view(T, k, 1)).sum(1)
    def _view_sum(self, ctx: PassContext, node: fx.Node) -> int:
        a = bind(node, ("self", "dim", "keepdim", "dtype"), {"keepdim": False, "dtype": None})
        if a is None or a["keepdim"] is not False or a["dtype"] is not None:
            return 0
        dim = a["dim"]
        dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
        prod = a["self"]
        if dim not in (1, -2) or not is_call(prod, MUL, ("mul",)):
            return 0
        m = bind(prod, ("self", "other"))
        if m is None or not all(isinstance(m[k], fx.Node) for k in ("self", "other")):
            return 0
        p = tensor_value(prod)
        for grouped, gcol in ((m["self"], m["other"]), (m["other"], m["self"])):
            xv, gv = tensor_value(grouped), tensor_value(gcol)
            if p is None or xv is None or gv is None or xv.dim() != 3 or not shape_is(p, xv.shape) \
                    or not shape_is(gv, (xv.shape[0], xv.shape[1], 1)):
                continue
            # unview keeps numel equal, so with H >= 1 an (N, H) base has N = T * k rows
            # (compared that way because Dynamo may know T*k*H == N*H but not T*k == N).
            h = xv.shape[2]
            hidden = unview(grouped, lambda v, h=h: v.dim() == 2 and known_equal(v.shape[1], h))
            if hidden is None or not statically_positive(h):
                return ctx.near_miss(self, node, "view-sum",
                                     "rows are not a token-major view of an (N, H) tensor")
            gates = unview(gcol, lambda v: v.dim() == 1 or (v.dim() == 2 and known_equal(v.shape[1], 1)))
            if gates is None:
                return ctx.near_miss(self, node, "view-sum",
                                     "gates are not a token-major view of an (N,) tensor")
            reason = check_view_sum(hidden, gates)
            chain = [prod, *_chain(grouped, hidden), *_chain(gcol, gates)]
            if not reason and mutation_between(chain, node) is not None:
                reason = MUTATED
            if reason:
                return ctx.near_miss(self, node, "view-sum", reason)
            ed = GraphEditor(ctx, node)
            try:
                op = emit_view_sum_combine(ed, hidden, gates, tensor_value(gates).dim() == 2, grouped)
            except RewriteRejected as e:
                ed.rollback()
                return ctx.near_miss(self, node, "view-sum", f"replacement rejected: {e}")
            ctx.matched(self, node, "view-sum")
            node.replace_all_uses_with(op)
            ctx.gm.graph.erase_node(node)
            erase_dead(ctx.gm.graph, [prod, grouped, gcol])
            return 1
        return 0


PATTERN = ScatterCombinePattern()
#: rewrites by spelling, e.g. ``matches["index_add_"]``
matches = PATTERN.matches
near_misses = PATTERN.near_misses
