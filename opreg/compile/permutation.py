"""Proving from a graph that an index tensor is a permutation, or the inverse of one.

What MoE code writes to sort rows by expert and put them back (Hugging Face's
``grouped_mm`` experts, transformers 5.x)::

    _, perm = torch.sort(expert_ids)            # perm: a permutation of 0..S-1
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0))      # inv: its inverse
    rows = rows_sorted[inv]                     # back to the original order

also ``inv = perm.argsort()`` and ``inv = torch.empty_like(perm).scatter_(0, perm,
arange)``. Every proof is structural (from how the tensors were made, on their fake
values' shapes), never from data.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .fx_utils import bind, is_call, known_equal, order, tensor_value

__all__ = ["Inverse", "inverse_permutation", "is_permutation"]


def _is_1d_index(node: Any) -> bool:
    v = tensor_value(node)
    return v is not None and v.dim() == 1 and v.dtype in (torch.int32, torch.int64)


def is_permutation(node: Any) -> bool:
    """Is ``node`` the indices of a sort (or an argsort) of a 1-D tensor: a permutation
    of ``0 .. len - 1``?"""
    if not _is_1d_index(node):
        return False
    if is_call(node, (operator.getitem,)) and node.args[1] == 1:
        src = node.args[0]
        return is_call(src, (torch.sort, torch.Tensor.sort), ("sort",)) and _sorts_1d(src)
    return is_call(node, (torch.argsort, torch.Tensor.argsort), ("argsort",)) and _sorts_1d(node)


def _sorts_1d(node: fx.Node) -> bool:
    x = tensor_value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    return x is not None and x.dim() == 1 and "out" not in node.kwargs


def _is_arange_of(node: Any, perm: fx.Node) -> bool:
    """``torch.arange(n)`` (start 0, step 1) with n == len(perm), integer."""
    if not is_call(node, (torch.arange,)):
        return False
    a, p = tensor_value(node), tensor_value(perm)
    plain = len(node.args) == 1 and not set(node.kwargs) - {"device", "dtype"}
    return plain and a is not None and p is not None and not a.is_floating_point() \
        and a.dim() == 1 and known_equal(a.shape[0], p.shape[0])


class Inverse:
    """``inv`` is the inverse of the permutation ``perm``; ``writes`` are the nodes of
    the proof that write ``inv`` (the match's own writes), ``made`` the nodes that made it."""

    def __init__(self, perm: fx.Node, writes: list[fx.Node], made: list[fx.Node]) -> None:
        self.perm, self.writes, self.made = perm, writes, made


def _empty_like(node: Any, perm: fx.Node) -> bool:
    return is_call(node, (torch.empty_like,)) and len(node.args) == 1 and node.args[0] is perm \
        and not set(node.kwargs) - {"device", "dtype"}


def _by_setitem(inv: fx.Node, reader: fx.Node) -> Inverse | None:
    """inv = empty_like(perm); inv[perm] = arange(len(perm)); ... reader(inv)."""
    pos = order(inv.graph)
    writes = [u for u in inv.users if pos[u] < pos[reader]]
    if len(writes) != 1 or not is_call(writes[0], (operator.setitem,)):
        return None
    w = writes[0]
    if len(w.args) != 3 or w.args[0] is not inv or w.kwargs:
        return None
    perm, values = w.args[1], w.args[2]
    if not (isinstance(perm, fx.Node) and is_permutation(perm) and _empty_like(inv, perm)
            and _is_arange_of(values, perm)):
        return None
    return Inverse(perm, [w], [inv, values])


def _by_scatter(inv: fx.Node) -> Inverse | None:
    """inv = empty_like(perm).scatter_(0, perm, arange(len(perm))) (or scatter)."""
    if not is_call(inv, (torch.Tensor.scatter_, torch.Tensor.scatter, torch.scatter), ("scatter_", "scatter")):
        return None
    a = bind(inv, ("self", "dim", "index", "src"))
    if a is None or a["dim"] not in (0, -1) or not isinstance(a["index"], fx.Node):
        return None
    perm = a["index"]
    if not (is_permutation(perm) and _empty_like(a["self"], perm) and _is_arange_of(a["src"], perm)):
        return None
    return Inverse(perm, [inv] if str(inv.target).endswith("_") else [], [a["self"], a["src"], inv])


def inverse_permutation(inv: Any, reader: fx.Node) -> Inverse | None:
    """How ``inv`` (as ``reader`` reads it) is provably the inverse of a permutation, or None."""
    if not isinstance(inv, fx.Node) or not _is_1d_index(inv):
        return None
    if is_call(inv, (torch.argsort, torch.Tensor.argsort), ("argsort",)) and _sorts_1d(inv) \
            and is_permutation(inv.args[0]):
        return Inverse(inv.args[0], [], [inv])
    return _by_setitem(inv, reader) or _by_scatter(inv)
