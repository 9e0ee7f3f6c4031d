"""The view-sum spellings of the MoE combine (part of :mod:`.scatter_combine`'s pattern):
rows grouped by token, k per token, summed over the group.

    (x.view(T, k, H) * g.view(T, k, 1)).sum(1)      rows token-major: idx = r // k
    (x * g[:, None]).view(T, k, H).sum(1)           the same (HF's batched_mm experts)
    (x * g[:, None])[inv].view(T, k, H).sum(1)      x sorted by a permutation perm, inv its
                                                    inverse: idx = perm // k (HF's grouped_mm)

also ``index_select(0, inv)`` for the gather, and every way ``inv`` is provably the
inverse permutation (:mod:`opreg.compile.permutation`). Also the row helpers the
scatter spellings share (gated products, gate columns, order-keeping views).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from opreg.compile.fx_utils import (MUL, VIEW_FUNCTIONS, VIEW_METHODS, bind, is_call, known_equal,
                                    provable, shape_is, tensor_value)
from opreg.compile.pattern import GraphEditor, Match, Miss
from opreg.compile.permutation import inverse_permutation
from opreg.ops.scatter_combine import unsupported


def _is_view_like(node: Any) -> bool:
    """A reshape/unsqueeze, or an indexing with only full slices, None and ``...``."""
    if is_call(node, VIEW_FUNCTIONS, VIEW_METHODS):
        # view(dtype) reinterprets bits: shapes then differ in numel or dtype, caught by unview
        return True
    if is_call(node, (operator.getitem,)):
        idx = node.args[1]
        items = idx if isinstance(idx, tuple) else (idx,)
        return all(i is None or i is Ellipsis or i == slice(None) for i in items)
    return False


def unview(node: fx.Node, shape_ok: Callable[[torch.Tensor], bool]) -> fx.Node | None:
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


def chain(node: fx.Node, base: fx.Node) -> list[fx.Node]:
    """The nodes from ``node`` back to ``base`` along :func:`unview`'s walk."""
    out = [node]
    while out[-1] is not base and out[-1].args and isinstance(out[-1].args[0], fx.Node):
        out.append(out[-1].args[0])
    return out


def gated_product(src: Any) -> tuple[fx.Node, fx.Node] | str:
    """``src`` = hidden (N, H) times a per-row gate column (N, 1), in either order.
    Returns (hidden, gate column) or why not."""
    a = bind(src, ("self", "other")) if is_call(src, MUL, ("mul",)) else None
    if a is None or not all(isinstance(a[k], fx.Node) for k in ("self", "other")):
        return "source is not a gated product x * g[:, None]"
    s = tensor_value(src)
    for hidden, col in ((a["self"], a["other"]), (a["other"], a["self"])):
        h, c = tensor_value(hidden), tensor_value(col)
        if h is not None and c is not None and s is not None and h.dim() == 2 \
                and shape_is(s, h.shape) and shape_is(c, (h.shape[0], 1)):
            return hidden, col
    return "the multiplier is not a per-row gate: expected x (N, H) * g (N, 1)"


def row_vector(col: fx.Node) -> tuple[fx.Node, bool]:
    """An (N, 1) column as an (N,) vector: the 1-D tensor it was made from (g[:, None],
    g.unsqueeze(-1), g.view(-1, 1)), else the column itself, flagged to be squeezed."""
    n = tensor_value(col).shape[0]
    base = unview(col, lambda v: v.dim() == 1 and known_equal(v.shape[0], n))
    return (base, False) if base is not None else (col, True)


def as_rows(ed: GraphEditor, col: fx.Node) -> fx.Node:
    """An (N,) vector from an (N,) or (N, 1) node, reusing the vector it was made from."""
    if tensor_value(col).dim() == 1:
        return col
    vec, squeeze = row_vector(col)
    return ed.call_method("squeeze", (vec, -1)) if squeeze else vec


# ============================================================================ spellings

@dataclasses.dataclass
class ViewSumMatch(Match):
    hidden: fx.Node = None  # type: ignore[assignment]   (N, H)
    gates: fx.Node = None  # type: ignore[assignment]    (N,) or (N, 1)
    grouped: fx.Node = None  # type: ignore[assignment]  (T, k, H)
    perm: fx.Node | None = None  # rows sorted: row r belongs to token perm[r] // k


def read(node: fx.Node) -> ViewSumMatch | Miss | None:
    """``node`` = ``grouped.sum(1)`` of a (T, k, H) ``grouped`` made in one of the ways above."""
    a = bind(node, ("self", "dim", "keepdim", "dtype"), {"keepdim": False, "dtype": None})
    if a is None or a["keepdim"] is not False or a["dtype"] is not None:
        return None
    dim = a["dim"]
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    grouped = a["self"]
    g = tensor_value(grouped)
    if dim not in (1, -2) or g is None or g.dim() != 3:
        return None
    if is_call(grouped, MUL, ("mul",)):
        return _read_product_of_views(node, grouped)
    return _read_view_of_rows(node, grouped)


def _read_product_of_views(node: fx.Node, prod: fx.Node) -> ViewSumMatch | Miss | None:
    m = bind(prod, ("self", "other"))
    if m is None or not all(isinstance(m[k], fx.Node) for k in ("self", "other")):
        return None
    for grouped, gcol in ((m["self"], m["other"]), (m["other"], m["self"])):
        p, xv, gv = tensor_value(prod), tensor_value(grouped), tensor_value(gcol)
        if xv is not None and gv is not None and xv.dim() == 3 and shape_is(p, xv.shape) \
                and shape_is(gv, (xv.shape[0], xv.shape[1], 1)):
            hidden = _rows_of(grouped)
            gates = unview(gcol, lambda v: v.dim() == 1 or (v.dim() == 2 and known_equal(v.shape[1], 1)))
            if hidden is None or gates is None:
                return Miss("view-sum", "rows or gates are not a token-major view of (N, H) and (N,) "
                                        "tensors", node)
            dead = [prod, *chain(grouped, hidden), *chain(gcol, gates)]
            return ViewSumMatch("view-sum", node, reads=[hidden, gates, *dead], dead=dead, hidden=hidden,
                                gates=gates, grouped=prod)
    return None


def _rows_of(grouped: fx.Node) -> fx.Node | None:
    """The (N, H) tensor a (T, k, H) ``grouped`` is an order-keeping view of. unview keeps
    numel equal, so with H >= 1 it has N = T * k rows (compared that way because Dynamo
    may know T*k*H == N*H but not T*k == N)."""
    h = tensor_value(grouped).shape[2]
    if not provable(h >= 1):
        return None
    return unview(grouped, lambda v: v.dim() == 2 and known_equal(v.shape[1], h))


def _gather(rows: fx.Node) -> tuple[fx.Node, Any] | None:
    """(src, index) of ``src[index]`` or ``src.index_select(0, index)``."""
    if is_call(rows, (operator.getitem,)) and isinstance(rows.args[0], fx.Node):
        return rows.args[0], rows.args[1]
    a = bind(rows, ("self", "dim", "index")) if is_call(
        rows, (torch.index_select, torch.Tensor.index_select), ("index_select",)) else None
    return (a["self"], a["index"]) if a is not None and a["dim"] == 0 else None


def _read_view_of_rows(node: fx.Node, grouped: fx.Node) -> ViewSumMatch | Miss | None:
    rows = _rows_of(grouped)
    if rows is None:
        return None
    views = chain(grouped, rows)
    gated = gated_product(rows)
    if not isinstance(gated, str):
        dead = [rows, *views, *chain(gated[1], row_vector(gated[1])[0])]
        return ViewSumMatch("(x * g).view-sum", node, reads=[gated[0], *dead], dead=dead,
                            hidden=gated[0], gates=gated[1], grouped=grouped)
    got = _gather(rows)
    if got is None or not isinstance(got[0], fx.Node) or isinstance(gated := gated_product(got[0]), str):
        return None
    inv = inverse_permutation(got[1], rows)
    if inv is None:
        return Miss("(x * g)[inv].view-sum", "the gather's index is not provably the inverse of a "
                    "sort permutation (perm = sort(...).indices; inv[perm] = arange)", node)
    if not known_equal(tensor_value(got[0]).shape[0], tensor_value(inv.perm).shape[0]):
        return Miss("(x * g)[inv].view-sum", "the permutation does not cover every row", node)
    dead = [got[0], rows, *views, *chain(gated[1], row_vector(gated[1])[0])]
    return ViewSumMatch("(x * g)[inv].view-sum", node, reads=[gated[0], inv.perm, got[1], *dead],
                        dead=dead, own_writes=inv.writes, hidden=gated[0], gates=gated[1],
                        grouped=grouped, perm=inv.perm)


# ========================================================================= safety checks

def check(m: ViewSumMatch) -> str | None:
    x, g = tensor_value(m.hidden), tensor_value(m.gates)
    if x.dtype != g.dtype:
        return f"dtypes differ (source {x.dtype}, gates {g.dtype})"
    # The replacement makes the index itself (arange(N) // k or perm // k), one per row.
    rows = tensor_value(m.perm) if m.perm is not None else x.new_empty((x.shape[0],), dtype=torch.int64)
    return unsupported(x, rows, g.reshape(-1), tensor_value(m.grouped).shape[0], holds=provable)


# ============================================================================ replacement

def emit(ed: GraphEditor, m: ViewSumMatch) -> fx.Node:
    """op(x, rows // k, g, T): rows = arange(N) (token-major) or perm (sorted)."""
    k, t = ed.size(m.grouped, 1), ed.size(m.grouped, 0)
    gates = m.gates
    if tensor_value(gates).dim() == 2:
        gates = ed.call_method("reshape", (gates, -1))
    rows = m.perm
    if rows is None:
        rows = ed.call_function(torch.arange, (ed.size(m.hidden, 0),),
                                {"device": tensor_value(m.hidden).device})
    idx = ed.call_function(torch.div, (rows, k), {"rounding_mode": "floor"})
    return ed.call_function(torch.ops.opreg.scatter_combine.default, (m.hidden, idx, gates, t))
