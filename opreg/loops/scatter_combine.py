"""The row loop of MoE combine, as a loop idiom: one ``opreg::scatter_combine``.

    out = torch.zeros(T, H, dtype=x.dtype)   # or zeros_like, x.new_zeros; ones/full/empty/
    for r in range(n):                       #   clone/x * 1.0 (then out + op); n: len(t),
        out[idx[r]] += gates[r] * x[r]       #   t.shape[0], t.size(0), an int (n == N is checked)

also ``out[idx[r]] = out[idx[r]] + ...`` (either side), the product either way,
``idx[r].item()``, ``int(idx[r])``, gates of shape (N,) or (N, 1).

The proof, from the source (:func:`prove`): ``for r in range(n)`` / ``range(0, n)`` of
the builtin range, no ``else``, one statement of the shape above; ``out``, the index, both
factors and ``r`` are distinct names; ``out`` is fresh (:func:`~opreg.loops.idiom.prove_fresh`:
made by an allocating call before the loop, in its block or an if/with/try around it,
unmentioned in between, out of reach of nested functions and of eval/locals). So the loop's only effects are ``out``'s rows and
``r``; the inputs can't change under it, and rebinding ``out`` to the op's result is
what the in-place writes would have left. ``r`` is set as Python leaves it (by the
rewriter). An exception part-way (an out-of-range index) would leave the rows written
before it: when code in this frame could see them (a ``try`` or a ``with`` that might
swallow it around the loop) or could see ``r`` (a closure, ``global``), the run-time
guard first checks every index and runs the loop itself if one is out of range, so the
same rows are written and the same error raised (``checked``; a synchronisation on CUDA).

The run-time guard (:func:`loop_combine`): torch's own tensors, the creation ran torch's
code, the op's own spec (:func:`opreg.ops.scatter_combine.unsupported`) accepts the
hidden, index and gates, and the loop-specific rules: ``n == N``, gates (N,) or (N, 1),
out (T, H) in the hidden's dtype and device, not a leaf that requires grad (the loop's
in-place write raises there; so does the fallback). Negative indices wrap as Python's do.
Anything else runs the user's loop.
"""
from __future__ import annotations

import ast
from typing import Any

import torch

from ..ops.scatter_combine import unsupported
from .idiom import (LoopIdiom, LoopSite, Plan, Reject, fresh_origin, plain_tensors, prove_fresh,
                    range_loop, subscript_of)

__all__ = ["IDIOM", "OP", "loop_combine", "prove"]

OP = "opreg::scatter_combine"
_SHAPE = "out[idx[i]] += gates[i] * x[i]"


# ======================================================================== the proof

def candidate(loop: ast.For) -> bool:
    """A range loop that accumulates into a subscript (``x[..] += ..``, ``x[..] = .. + ..``):
    worth a finding, match or not."""
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
        return False
    for n in ast.walk(loop):
        if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add) and isinstance(n.target, ast.Subscript):
            return True
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) for t in n.targets) \
                and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Add):
            return True
    return False


def _same(a: ast.AST, b: ast.AST) -> bool:
    """The same expression, one read and one written (``out[i]`` both sides of ``=``)?"""
    return ast.dump(a).replace("Store()", "Load()") == ast.dump(b).replace("Store()", "Load()")


def _accumulation(stmt: ast.stmt) -> tuple[ast.expr, ast.expr]:
    """(target, added value) of ``t += v``, ``t = t + v`` or ``t = v + t``."""
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add):
        return stmt.target, stmt.value
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.BinOp) \
            and isinstance(stmt.value.op, ast.Add):
        target, (left, right) = stmt.targets[0], (stmt.value.left, stmt.value.right)
        if _same(left, target):
            return target, right
        if _same(right, target):
            return target, left
        raise Reject("loop body is not out[idx[i]] = out[idx[i]] + gates[i] * x[i]")
    raise Reject(f"loop body is not {_SHAPE}")


def _row_index(site: LoopSite, node: ast.expr, var: str) -> str:
    """idx of ``idx[i]``, ``idx[i].item()`` or ``int(idx[i])`` (the builtin int)."""
    inner: ast.AST = node
    if isinstance(node, ast.Call) and not node.keywords:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "item" and not node.args:
            inner = node.func.value
        elif isinstance(node.func, ast.Name) and site.resolves_to(node.func.id, int) and len(node.args) == 1:
            inner = node.args[0]
        else:
            raise Reject("the row index is not idx[i], idx[i].item() or int(idx[i])")
    name = subscript_of(inner, var)
    if name is None:
        raise Reject(f"loop body is not {_SHAPE}")
    return name


def _factors(prod: ast.expr, var: str) -> tuple[str, str]:
    if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        raise Reject("the added value is not gates[i] * x[i]")
    a, b = subscript_of(prod.left, var), subscript_of(prod.right, var)
    if a is None or b is None:
        raise Reject(f"loop body is not {_SHAPE}")
    return a, b


def prove(site: LoopSite) -> Plan:
    """Prove ``site.loop`` is the combine loop (see the module docstring); reject why not."""
    var, bound = range_loop(site)
    body = site.loop.body
    if len(body) != 1:
        raise Reject(f"the loop body has {len(body)} statements (one expected)")
    target, prod = _accumulation(body[0])
    if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)):
        raise Reject("the accumulated target is not out[...] of a named tensor")
    out = target.value.id
    idx = _row_index(site, target.slice, var)
    a, b = _factors(prod, var)
    if len({out, idx, a, b, var}) != 5:
        raise Reject("out, the index, the two factors and the loop variable must be distinct names")
    fresh = prove_fresh(site, out)
    checked = site.exceptions_observable() or site.escapes(var)
    return Plan(source=bound, args=[out, idx, a, b, *fresh.origin], result=out,
                flags={"zeros": fresh.zeros, "checked": checked}, before=fresh.before)


# =================================================================== the run-time guard

def _hidden_and_gates(h: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden (N, H), gates (N,)) if ``h``, ``g`` can be those (gates (N, 1) flattened)."""
    if h.dim() != 2:
        return None
    if g.dim() == 1:
        return h, g
    if g.dim() == 2 and g.shape[1] == 1:
        return h, g.reshape(-1)
    return None


def _fits_out(n: Any, out: torch.Tensor, hidden: torch.Tensor) -> bool:
    """The loop-specific rules: n rows, out (T, H) like the hidden, out writable in place."""
    return (n == hidden.shape[0] and out.dim() == 2 and out.shape[1] == hidden.shape[1]
            and out.dtype == hidden.dtype and out.device == hidden.device
            and out.layout == torch.strided
            and not (out.requires_grad and out.is_leaf))  # the loop's in-place write raises; let it


def _in_range(idx: torch.Tensor, t: int) -> bool:
    return bool(((idx >= -t) & (idx < t)).all())


def loop_combine(n: Any, out: Any, idx: Any, a: Any, b: Any, *origin: Any, zeros: bool,
                 checked: bool = False) -> torch.Tensor | None:
    """What ``for i in range(n): out[idx[i]] += a[i] * b[i]`` leaves in ``out``, as one
    op, or None when the values don't fit the op exactly (the caller then runs the loop).

    Shapes: one of a/b is the hidden (N, H), the other the gates (N,) or (N, 1); idx (N,)
    int32/int64; out (T, H). ``origin``: the values out was made from
    (:func:`~opreg.loops.idiom.fresh_origin`). ``zeros``: out starts as zeros, so the
    result replaces it (else ``out + op``). ``checked``: an out-of-range index must run
    the loop (its partial writes are observable).
    """
    if not (plain_tensors(out, idx, a, b) and fresh_origin(*origin)):
        return None
    pair = _hidden_and_gates(a, b) or _hidden_and_gates(b, a)
    if pair is None or not _fits_out(n, out, pair[0]):
        return None
    hidden, gates = pair
    t = out.shape[0]
    if unsupported(hidden, idx, gates, t) is not None:
        return None
    if checked and not _in_range(idx, t):
        return None
    idx = torch.where(idx < 0, idx + t, idx)  # out[-1] is the last row, as in Python
    combined = torch.ops.opreg.scatter_combine.default(hidden, idx, gates, t)
    return combined if zeros else out + combined


IDIOM = LoopIdiom(name="scatter_combine", op=OP, candidate=candidate, prove=prove, runtime=loop_combine,
                  note="Dynamo can't trace this loop (each row's index is data)")
