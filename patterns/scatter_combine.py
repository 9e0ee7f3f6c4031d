"""Pattern: the Mixture-of-Experts combine -> ``torch.ops.opreg.scatter_combine``.

    out[t] = sum over rows r with idx[r] == t of g[r] * x[r]
    x (N, H) float, idx (N,) int32/int64, g (N,), out (T, H)

Runs on the Dynamo graph (see :mod:`opreg.compile.backend` for why). This file holds, in
order: the spellings it matches and how each reads into a match, the safety checks,
then the replacement. The loop, mutation safety and counting are the framework's
(:mod:`opreg.compile.pattern`). ``PATTERN.matches`` counts rewrites by spelling (what
tests assert on); ``PATTERN.near_misses`` counts refusals by reason.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from opreg.compile.fx_utils import ADD, SUM, bind, is_call, known_equal, meta_value, provable, shape_is, tensor_value
from opreg.compile.pattern import GraphEditor, GraphPattern, Match, Miss, PassContext
from opreg.ops.scatter_combine import FLOAT_DTYPES, INDEX_DTYPES, unsupported

from . import scatter_combine_view_sum as view_sum
from .scatter_combine_view_sum import as_rows, chain, gated_product, row_vector

# ============================================================================= spellings
#   out.index_add_(0, idx, x * g[:, None])          index_add / torch.index_add, alpha=
#   out.scatter_add_(0, idx[:, None].expand(-1, H), x * g[:, None])
#                                                   scatter_add, scatter_reduce(.., "sum")
#   out.index_put_((idx,), x * g[:, None], accumulate=True)              index_put
#   (x.view(T, k, H) * g.view(T, k, 1)).sum(1)      rows token-major: idx = r // k
#   (x * g[:, None]).view(T, k, H).sum(1)           the same   (these: scatter_combine_view_sum.py)
#   (x * g[:, None])[inv].view(T, k, H).sum(1)      rows sorted by perm, inv its inverse:
#                                                   idx = perm // k (HF's grouped_mm experts)
# The gate multiply in either order; the gate column g[:, None], g.unsqueeze(-1),
# g.view(-1, 1), or gates already shaped (N, 1); out a fresh zeros (then dropped) or any
# tensor (then out + op(...), in place where the original was in place).


@dataclasses.dataclass(frozen=True)
class Spelling:
    name: str       # as reported, e.g. "index_add_", "torch.index_add"
    kind: str       # "index_add" | "scatter_add" | "scatter_reduce" | "index_put"
    inplace: bool


@dataclasses.dataclass
class Scatter:
    """A scatter spelling read into one shape: rows of ``src`` added at ``index`` along
    ``dim``, times ``alpha``; ``wrap``: negative indices count from the end."""

    dim: Any
    index: Any
    src: Any
    alpha: Any = 1
    wrap: bool = False


def _read_index_add(a: dict[str, Any]) -> Scatter | str:
    return Scatter(a["dim"], a["index"], a["source"], a["alpha"])


def _read_scatter_add(a: dict[str, Any]) -> Scatter | str:
    idx = scatter_row_index(a["index"], a["src"])
    return idx if isinstance(idx, str) else Scatter(a["dim"], idx, a["src"])


def _read_scatter_reduce(a: dict[str, Any]) -> Scatter | str:
    if a["reduce"] != "sum":
        return f"scatter_reduce with reduce={a['reduce']!r}, not 'sum'"
    return _read_scatter_add(a)


def _read_index_put(a: dict[str, Any]) -> Scatter | str:
    if a["accumulate"] is not True:
        return "index_put_ without accumulate=True: repeated indices keep the last write instead of summing"
    indices = a["indices"]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], fx.Node)):
        return "indexes more than one dimension"
    return Scatter(0, indices[0], a["values"], wrap=True)


# Parameters of each kind (self first), their defaults, and how to read them.
KINDS: dict[str, tuple[tuple[str, ...], dict[str, Any], Callable[[dict[str, Any]], Scatter | str]]] = {
    "index_add": (("self", "dim", "index", "source", "alpha"), {"alpha": 1}, _read_index_add),
    "scatter_add": (("self", "dim", "index", "src"), {}, _read_scatter_add),
    "scatter_reduce": (("self", "dim", "index", "src", "reduce", "include_self"),
                       {"include_self": True}, _read_scatter_reduce),
    "index_put": (("self", "indices", "values", "accumulate"), {"accumulate": False}, _read_index_put),
}


def _spellings() -> dict[Any, Spelling]:
    table: dict[Any, Spelling] = {}
    for kind in KINDS:
        for inplace in (False, True):
            method = kind + ("_" if inplace else "")
            table[method] = Spelling(method, kind, inplace)
            for owner, prefix in ((torch.Tensor, "Tensor."), (torch, "torch.")):
                fn = getattr(owner, method, None)
                if fn is not None:
                    table[fn] = Spelling(prefix + method, kind, inplace)
    return table


SPELLINGS = _spellings()
EXPAND = (torch.Tensor.expand, torch.Tensor.expand_as, torch.broadcast_to)
ZEROS = (torch.zeros, torch.zeros_like)


def spelling_of(node: fx.Node) -> Spelling | None:
    if node.op not in ("call_method", "call_function"):
        return None
    try:
        return SPELLINGS.get(node.target)
    except TypeError:  # unhashable target
        return None


def scatter_row_index(index: Any, src: Any) -> fx.Node | str:
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
    if not is_call(node, ZEROS, ("new_zeros",)) or "out" in node.kwargs \
            or node.kwargs.get("requires_grad"):
        return False
    v = tensor_value(node)
    return v is not None and v.layout == torch.strided


def _is_setitem_accumulate(node: fx.Node) -> bool:
    """``out[idx] += src`` as Dynamo records it: setitem(out, idx, getitem(out, idx) + src)."""
    if not is_call(node, (operator.setitem,)) or len(node.args) != 3:
        return False
    out, index, value = node.args
    iv = tensor_value(index)
    if iv is None or iv.dtype not in INDEX_DTYPES or not is_call(value, ADD, ("add", "add_")):
        return False
    return any(is_call(a, (operator.getitem,)) and a.args[0] is out and a.args[1] is index
               for a in value.args if isinstance(a, fx.Node))


SETITEM_REASON = ("index_put_ without accumulate: with repeated indices, out[idx] += src keeps "
                  "the last write instead of summing (write out.index_add_(0, idx, src))")


# ================================================================================ matches

@dataclasses.dataclass
class ScatterMatch(Match):
    out: fx.Node = None  # type: ignore[assignment]
    scatter: Scatter = None  # type: ignore[assignment]
    hidden: fx.Node = None  # type: ignore[assignment]
    col: fx.Node = None  # type: ignore[assignment]
    inplace: bool = False
    fresh: bool = False    # out is a fresh zeros nothing wrote or read before: dropped


def read_scatter(node: fx.Node, sp: Spelling, ctx: PassContext) -> ScatterMatch | Miss | None:
    params, defaults, reader = KINDS[sp.kind]
    a = bind(node, params, defaults)
    if a is None:
        return Miss(sp.name, "unsupported arguments (out= or unknown ones)", node)
    out = a["self"]
    if not isinstance(out, fx.Node):
        return None
    s = reader(a)
    if isinstance(s, str):
        return Miss(sp.name, s, node)
    gated = gated_product(s.src)
    if isinstance(gated, str):
        return Miss(sp.name, gated, node)
    hidden, col = gated
    fresh = zeros_intact(ctx, out, node, sp.inplace)
    if sp.kind == "scatter_reduce" and a["include_self"] is not True and not fresh:
        return Miss(sp.name, "scatter_reduce(include_self=False) into an out not proven to be zeros", node)
    dead = [s.src, *chain(col, row_vector(col)[0])]
    # The product read x and g where it ran; the op reads them at the scatter.
    return ScatterMatch(sp.name, node, reads=[hidden, *dead], dead=dead, out=out, scatter=s,
                        hidden=hidden, col=col, inplace=sp.inplace, fresh=fresh,
                        redirect=out if fresh and sp.inplace else None)


def zeros_intact(ctx: PassContext, out: fx.Node, node: fx.Node, inplace: bool) -> bool:
    """Is ``out`` a fresh zeros still all zeros at ``node``, and (for an in-place scatter,
    which the zeros is then replaced by) read by nothing before it?"""
    if not is_fresh_zeros(out):
        return False
    pos = {n: i for i, n in enumerate(node.graph.nodes)}
    if inplace and any(u is not node and pos[u] < pos[node] for u in out.users):
        return False
    return ctx.writes_between([out], out, node) is None


# ========================================================================= safety checks

def check_combine(m: ScatterMatch) -> str | None:
    """Why scattering the rows of ``x * g`` into ``out`` along ``dim`` at ``idx`` is not
    exactly scatter_combine, or None."""
    o, x, i, g = (tensor_value(n) for n in (m.out, m.hidden, m.scatter.index, m.col))
    dim, alpha = m.scatter.dim, m.scatter.alpha
    if o is None or x is None or i is None or g is None:
        return "no shape information"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return "alpha is not a constant number"
    if not isinstance(dim, int) or isinstance(dim, bool):
        return f"{m.spelling} with a non-constant dim"
    if o.dim() != 2 or dim % 2 != 0:
        return f"{m.spelling} into a {o.dim()}-D out on dim {dim}: the op combines rows (dim 0) of (T, H)"
    if not known_equal(o.shape[1], x.shape[1]):
        return "out's width differs from the source's"
    if not (o.dtype == x.dtype == g.dtype) or o.dtype not in FLOAT_DTYPES:
        return (f"dtypes differ or are not float (out {o.dtype}, source {x.dtype}, gates {g.dtype}): "
                f"the op returns the source's dtype, so the result would change")
    if o.device != x.device or o.layout != torch.strided:
        return "out is on another device or sparse"
    rows = i.select(-1, 0) if i.dim() == 2 and known_equal(i.shape[1], 1) else i
    return unsupported(x, rows, g.select(-1, 0), o.shape[0], holds=provable)


# ============================================================================ replacement
# op = scatter_combine(x, idx, g, T) with T = out.size(0), then, by the target:
#   fresh zeros            -> op (times alpha)        the zeros is dropped
#   in place on out        -> out.add_(op, alpha=a)   same mutation, same aliases
#   out-of-place on out    -> torch.add(out, op, alpha=a)
# index_put wraps negative indices like Python (index_add/scatter raise on them), so
# there idx becomes where(idx < 0, idx + T, idx): elementwise, no host sync.

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


def emit_combine(ed: GraphEditor, m: ScatterMatch) -> fx.Node:
    t = zeros_rows(ed, m.out) if m.fresh else ed.size(m.out, 0)
    idx, gate = as_rows(ed, m.scatter.index), as_rows(ed, m.col)
    if m.scatter.wrap:
        idx = ed.call_function(torch.where, (ed.call_function(operator.lt, (idx, 0)),
                                             ed.call_function(operator.add, (idx, t)), idx))
    op = ed.call_function(torch.ops.opreg.scatter_combine.default, (m.hidden, idx, gate, t))
    alpha = m.scatter.alpha
    if m.fresh:
        return op if alpha == 1 else ed.call_function(operator.mul, (op, alpha))
    kw = {"alpha": alpha} if alpha != 1 else {}
    if m.inplace:
        return ed.call_method("add_", (m.out, op), kw)
    return ed.call_function(torch.add, (m.out, op), kw)


# ============================================================================== the pattern

class ScatterCombinePattern(GraphPattern):
    name = "scatter_combine"
    op = "scatter_combine"

    def match(self, node: fx.Node, ctx: PassContext) -> Match | Miss | None:
        sp = spelling_of(node)
        if sp is not None:
            return read_scatter(node, sp, ctx)
        if _is_setitem_accumulate(node):
            return Miss("out[idx] += src", SETITEM_REASON, node)
        return view_sum.read(node) if is_call(node, SUM, ("sum",)) else None

    def check(self, m: Match, ctx: PassContext) -> str | None:
        return check_combine(m) if isinstance(m, ScatterMatch) else view_sum.check(m)  # type: ignore[arg-type]

    def emit(self, ed: GraphEditor, m: Match) -> fx.Node:
        return emit_combine(ed, m) if isinstance(m, ScatterMatch) else view_sum.emit(ed, m)  # type: ignore[arg-type]


PATTERN = ScatterCombinePattern()
#: rewrites by spelling, e.g. ``matches["index_add_"]``
matches = PATTERN.matches
near_misses = PATTERN.near_misses
