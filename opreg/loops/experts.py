"""The eager MoE expert loop, as a loop idiom: rows grouped by expert once, the user's
per-expert body run on each expert's contiguous slice, one ``opreg::scatter_combine``.

    final = torch.zeros_like(hidden_states)
    for expert_idx in expert_hit:                 # or range(E), a list: any iterable
        expert_idx = expert_idx[0]                # (optional) or expert_idx.item()
        if expert_idx == self.num_experts:        # (optional) a skipped id
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])   # or (ids == e), nonzero(as_tuple=True)
        if token_idx.numel() == 0:                # (optional) len(), .shape[0], .size(0)
            continue
        current = hidden_states[token_idx]
        h = <row-wise per-expert body>            # F.linear with self.w[e], self.experts[e](..), act_fn, ...
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, h.to(final.dtype))

The proof (:func:`prove`): the body is straight-line: the optional unpack and guards, one
``where``, assignments, one ``index_add_(0, token, value)`` into ``final``, fresh zeros
(:func:`~opreg.loops.idiom.prove_fresh`). Every assignment is row-wise (:class:`Rows`:
row ``r`` of a value depends only on row ``r`` of the gathered rows and on values that
don't change in the loop): linear maps and matmuls by loop-invariant weights, elementwise
functions, column slices, gathers by the where's own indices, and calls of loop-invariant
callables, which the run-time guard checks (row-wise modules: Linear, activations,
Sequential of those, a module whose forward passes the same proof). No reductions, no
``.shape`` of rows, no branches on values, no calls with effects, nothing loop-carried,
no name the body binds read after the loop, no ``try`` around it. So the loop's only
effects are ``final``'s rows and the loop variable.

The fast path (:func:`grouped_experts`) evaluates the where of all experts at once (one
``nonzero`` of the selected masks, in the loop's order: by expert, then as ``where``
orders), calls the body (a nested ``def`` of the user's statements) once per expert on
exactly the indices the loop would give it, and combines with ``scatter_combine``
(gates split off the final product when they are (N, 1) columns). The guard: torch's own
tensors, experts strictly increasing ints in the mask's range, a (T, H) ``final``, the
values' shapes and dtypes as ``index_add_`` needs them; otherwise the user's loop runs.
"""
from __future__ import annotations

import ast
import copy
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._log import log_once, logger
from ..ops.scatter_combine import unsupported
from .rowwise import PARAM, ROW, Rows, is_rowwise, method_name, stored_names, unparsed
from .idiom import (
    LoopIdiom,
    LoopSite,
    Plan,
    Reject,
    fresh_origin,
    names_in,
    plain_tensors,
    prove_fresh,
    value_of,
)

__all__ = ["IDIOM", "OP", "grouped_experts", "prove"]

OP = "opreg::scatter_combine"

# ========================================================================= the shape

def candidate(loop: ast.For) -> bool:
    """A loop whose body ends in ``<name>.index_add_(...)``: worth a finding."""
    last = loop.body[-1]
    return isinstance(last, ast.Expr) and method_name(last.value) == "index_add_"


def _is_continue_if(s: ast.stmt) -> bool:
    return isinstance(s, ast.If) and not s.orelse and len(s.body) == 1 and isinstance(s.body[0], ast.Continue)


def _skip_id(s: ast.stmt, var: str) -> ast.expr | None:
    """K of ``if var == K: continue`` (K a name, attribute or constant)."""
    t = s.test if _is_continue_if(s) else None
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
        return None
    a, b = t.left, t.comparators[0]
    other = b if isinstance(a, ast.Name) and a.id == var else a if isinstance(b, ast.Name) and b.id == var else None
    ok = other is not None and all(isinstance(n, (ast.Name, ast.Attribute, ast.Constant, ast.Load))
                                   for n in ast.walk(other))
    return other if ok and var not in names_in(other) else None


def _skip_empty(s: ast.stmt, names: tuple[str, str]) -> bool:
    """``if q.numel() == 0`` / ``len(q) == 0`` / ``q.shape[0] == 0`` / ``q.size(0) == 0``: continue."""
    t = s.test if _is_continue_if(s) else None
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)
            and isinstance(t.comparators[0], ast.Constant) and t.comparators[0].value == 0):
        return False
    return unparsed(t.left) in {f for n in names for f in (f"{n}.numel()", f"len({n})", f"{n}.shape[0]",
                                                       f"{n}.size(0)")}


def _where(site: LoopSite, s: ast.stmt, var: str) -> tuple[tuple[str, str], str, ast.expr]:
    """((first, second) index names, form "mask" | "eq", the mask M or the ids X)."""
    if not (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Tuple)
            and len(s.targets[0].elts) == 2 and all(isinstance(t, ast.Name) for t in s.targets[0].elts)
            and isinstance(s.value, ast.Call)):
        raise Reject("no `a, b = torch.where(mask[e])` (or nonzero(as_tuple=True)) after the guards")
    call, names = s.value, tuple(t.id for t in s.targets[0].elts)
    fn = value_of(call.func, site.local, site.resolve)
    tuple_kw = [k for k in call.keywords if k.arg == "as_tuple"]
    if fn is torch.where and len(call.args) == 1 and not call.keywords or fn is torch.nonzero and len(call.args) == 1 and _true(tuple_kw, call):
        cond = call.args[0]
    elif method_name(call) == "nonzero" and not call.args and _true(tuple_kw, call):
        cond = call.func.value  # type: ignore[attr-defined]
    else:
        raise Reject(f"{unparsed(call)} is not torch.where(mask) or nonzero(as_tuple=True)")
    if isinstance(cond, ast.Subscript) and isinstance(cond.slice, ast.Name) and cond.slice.id == var:
        form, mask = "mask", cond.value
    elif isinstance(cond, ast.Compare) and len(cond.ops) == 1 and isinstance(cond.ops[0], ast.Eq) \
            and var in (unparsed(cond.left), unparsed(cond.comparators[0])):
        form, mask = "eq", cond.comparators[0] if unparsed(cond.left) == var else cond.left
    else:
        raise Reject(f"{unparsed(cond)} is not mask[e] or (ids == e)")
    if var in names_in(mask) or not isinstance(mask, (ast.Name, ast.Attribute)):
        raise Reject(f"{unparsed(mask)}: the mask must be a loop-invariant name")
    return names, form, mask  # type: ignore[return-value]


def _true(kws: list[ast.keyword], call: ast.Call) -> bool:
    return len(kws) == 1 == len(call.keywords) and isinstance(kws[0].value, ast.Constant) \
        and kws[0].value.value is True


def _combine(stmt: ast.stmt, names: tuple[str, str]) -> tuple[str, int, ast.expr, bool]:
    """(final, which where index is the token, the added value, cast to final.dtype?)"""
    call = stmt.value  # type: ignore[attr-defined]
    final = call.func.value
    if not (isinstance(final, ast.Name) and len(call.args) == 3 and not call.keywords
            and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0
            and isinstance(call.args[1], ast.Name) and call.args[1].id in names):
        raise Reject("the combine is not final.index_add_(0, token_idx, value) with token_idx from the where")
    value, cast = call.args[2], False
    if method_name(value) == "to" and len(value.args) == 1 and not value.keywords \
            and unparsed(value.args[0]) == f"{final.id}.dtype":
        value, cast = value.func.value, True
    return final.id, names.index(call.args[1].id), value, cast


# ========================================================================= the proof

def _read_elsewhere(site: LoopSite, names: set[str]) -> str | None:
    inside = {id(n) for n in ast.walk(site.loop)}
    for n in ast.walk(site.fn_def):
        if isinstance(n, ast.Name) and n.id in names and id(n) not in inside:
            return n.id
    return next((x for x in sorted(names) if site.escapes(x)), None)


# How the loop variable is unpacked first: "" (not), "index" (``e = e[0]``: rows of a 2-D
# nonzero()), "item" (``e = e.item()``: elements of a 1-D one); and what it ends as.
UNPACKS = {"": "{s}[-1]", "index": "{s}[-1][0]", "item": "{s}[-1].item()"}


def _head(site: LoopSite, var: str) -> tuple[list[ast.stmt], str, ast.expr | None]:
    body, unpack, skip = list(site.loop.body), "", None
    first = body[0]
    if isinstance(first, ast.Assign) and len(first.targets) == 1 and unparsed(first.targets[0]) == var:
        unpack = {f"{var}[0]": "index", f"{var}.item()": "item"}.get(unparsed(first.value), "")
        body = body[1:] if unpack else body
    if body and _skip_id(body[0], var) is not None and not names_in(_skip_id(body[0], var)) & stored_names(body):
        skip, body = _skip_id(body[0], var), body[1:]
    return body, unpack, skip


def _body_def(site: LoopSite, var: str, names: tuple[str, str], stmts: list[ast.stmt],
              value: ast.expr, rows: Rows) -> ast.FunctionDef:
    """def _opreg_eb(var, a, b): <stmts>; return (hidden, gates) or (value, None)."""
    last = stmts[-1] if stmts else None
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
        ret = [value.left, value.right]
    elif isinstance(value, ast.Name) and isinstance(last, ast.Assign) and unparsed(last.targets[0]) == value.id \
            and isinstance(last.value, ast.BinOp) and isinstance(last.value.op, ast.Mult):
        stmts, ret = stmts[:-1], [last.value.left, last.value.right]
    else:
        ret = [value, ast.Constant(None)]
    args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=a) for a in (var, *names)], vararg=None,
                         kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    fn = ast.FunctionDef(name=site.temp("eb"), args=args, body=[*copy.deepcopy(stmts),
                         ast.Return(value=ast.Tuple(elts=copy.deepcopy(ret), ctx=ast.Load()))],
                         decorator_list=[], returns=None, type_comment=None)
    if hasattr(ast, "TypeAlias"):
        fn.type_params = []
    return fn


def _rowwise_body(site: LoopSite, var: str, names: tuple[str, str], final: str, mask: ast.expr,
                  rest: list[ast.stmt], value: ast.expr) -> Rows:
    """Prove every statement between the where and the combine row-wise (and the rest)."""
    bound = stored_names(site.loop.body) - {var}
    if len({var, final, *names}) != 4 or final in bound or final in names_in(mask):
        raise Reject("the loop variable, the where's indices and the output must be distinct names")
    rows = Rows(site.resolve, site.local, bound, {var: PARAM, names[0]: ROW, names[1]: ROW}, names)
    for s in rest:
        if final in names_in(s):
            raise Reject(f"{unparsed(s)}: the body reads the output it accumulates into")
        rows.assign(s)
    if final in names_in(value) or rows.kind(value) != ROW:
        raise Reject(f"{unparsed(value)}: the added value is not rows of the body")
    seen = _read_elsewhere(site, bound)
    if seen:
        raise Reject(f"{seen}, which the loop body binds, is used outside the loop")
    return rows


def prove(site: LoopSite) -> Plan:
    """Prove ``site.loop`` is the expert loop (module docstring); reject why not."""
    loop = site.loop
    if not isinstance(loop.target, ast.Name) or loop.orelse:
        raise Reject("the loop variable is not a plain name, or the loop has an else clause")
    var = loop.target.id
    if site.exceptions_observable() or site.escapes(var):
        raise Reject("code here could see a part-way loop (a try/with around it, or a closure over the loop variable)")
    body, unpack, skip = _head(site, var)
    if len(body) < 2:
        raise Reject("no where(...) and index_add_ in the loop body")
    names, form, mask = _where(site, body[0], var)
    rest, skip_empty = body[1:-1], False
    if rest and _skip_empty(rest[0], names):
        rest, skip_empty = rest[1:], True
    final, token, value, cast = _combine(body[-1], names)
    rows = _rowwise_body(site, var, names, final, mask, rest, value)
    fresh = prove_fresh(site, final)
    if not fresh.zeros:
        raise Reject(f"{final} does not start as zeros (torch.zeros / zeros_like / new_zeros)")
    fn = _body_def(site, var, names, rest, value, rows)
    checks = ast.Lambda(args=copy.deepcopy(fn.args), body=ast.Tuple(elts=rows.callables, ctx=ast.Load()))
    checks.args.args = checks.args.args[:1]
    return Plan(source=loop.iter, args=[final, mask, fn.name, skip or ast.Constant(None), checks, *fresh.origin],
                result=final, iterate="{s}", last=UNPACKS[unpack], before=fresh.before,
                setup=[fn], flags={"unpack": unpack, "form": form, "token": token, "skip_empty": skip_empty,
                                   "cast": cast})


# ============================================================== run-time: the guard

def _runs(s: Any) -> bool:
    """Does ``for e in s`` run at least once (for values the fast path takes)?"""
    if isinstance(s, range):
        return len(s) > 0
    if type(s) is torch.Tensor:
        return s.dim() >= 1 and s.numel() > 0
    return isinstance(s, (list, tuple)) and len(s) > 0


def _experts(s: Any, unpack: str) -> tuple[list[int], list[Any]] | None:
    """(expert ids as ints, the values the loop variable takes after the unpack), or None."""
    if type(s) is torch.Tensor:
        if s.dtype.is_floating_point or s.dtype.is_complex or s.dtype == torch.bool:
            return None
        if unpack == "item":  # e.item() needs one element per e: s (n,) or (n, 1)
            if not (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
                return None
            ids = s.reshape(-1).tolist()
            return ids, list(ids)
        if s.dim() != (2 if unpack else 1) or (unpack and s.shape[1] < 1):
            return None
        ids = (s[:, 0] if unpack else s).tolist()
        return ids, [r[0] for r in s] if unpack else list(s)
    if unpack or not isinstance(s, (range, list, tuple)) or not all(type(e) is int for e in s):
        return None
    return list(s), list(s)


def _ordered(ids: list[int], limit: int | None) -> bool:
    return all(a < b for a, b in zip(ids, ids[1:])) and (limit is None or (ids[0] >= 0 and ids[-1] < limit))


def _split(pieces: list[tuple[Any, Any]], final: torch.Tensor, cast: bool,
           counts: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hidden (N, H), gates (N,)) from the body's (left, right) per expert, or None."""
    width, hs, gs = final.shape[1], [], []
    for (a, b), n in zip(pieces, counts):
        if not all(type(t) in (torch.Tensor, type(None)) for t in (a, b)):
            return None
        if b is not None and a.shape == (n, 1) and b.shape == (n, width):
            a, b = b, a
        if b is not None and not (a.shape == (n, width) and b.shape == (n, 1) and a.dtype == final.dtype):
            a, b = a * b, None
        v = a.to(final.dtype) if cast and b is None else a
        if v.shape != (n, width) or v.dtype != final.dtype:
            return None
        hs.append(v)
        gs.append(b[:, 0] if b is not None else torch.ones(n, dtype=v.dtype, device=v.device))
    if len({g.dtype for g in gs}) > 1:
        return None
    return torch.cat(hs), torch.cat(gs)


def _all_rowwise(callables: Iterable[Any]) -> bool:
    """Are all the callables the body calls on rows row-wise? The first that isn't is
    named in the log, once."""
    for c in callables:
        if not is_rowwise(c):
            f = getattr(c, "__func__", c)
            name = getattr(f, "__qualname__", None) or type(c).__qualname__
            log_once(("not row-wise", name), logging.INFO, "opreg: expert loop: %s is not provably row-wise "
                     "(each output row from its input row alone); running the loop as written", name)
            return False
    return True


# torch._disable_dynamo is torch.compiler.disable imported on first call: the decorator
# itself imports torch._dynamo, 2 s of every `import opreg` (half of it) on the 2-core box.
@torch._disable_dynamo
def grouped_experts(s: Any, final: Any, mask: Any, body: Callable[..., Any], skip: Any,
                    checks: Callable[[Any], tuple[Any, ...]], *origin: Any, unpack: str, form: str,
                    token: int, skip_empty: bool, cast: bool) -> torch.Tensor | None:
    """What the expert loop leaves in ``final`` (fresh zeros), or None when the values
    don't fit (the caller then runs the loop). Runs eagerly (one host read of the
    experts and of the row counts)."""
    if not (plain_tensors(final, mask) and fresh_origin(*origin)) or final.dim() != 2 \
            or final.layout != torch.strided or (final.requires_grad and final.is_leaf) \
            or mask.dim() != (3 if form == "mask" else 2):
        return None
    got = _experts(s, unpack)
    if got is None or not got[0] or not _ordered(got[0], mask.shape[0] if form == "mask" else None):
        return None
    keep = [(i, v) for i, v in zip(*got) if skip is None or not bool(i == skip)]
    if not keep or not _all_rowwise(c for _, v in keep for c in checks(v)):
        return None
    if mask.shape[token + (1 if form == "mask" else 0)] > final.shape[0]:
        return None  # a token index could be out of range: the loop raises
    ids = torch.tensor([i for i, _ in keep], device=mask.device)
    sel = mask[ids] if form == "mask" else mask.unsqueeze(0) == ids.view(-1, 1, 1).to(mask.dtype)
    nz = sel.nonzero()
    counts = torch.bincount(nz[:, 0], minlength=len(keep)).tolist()
    cols, pieces, tokens, used, start = (nz[:, 1].contiguous(), nz[:, 2].contiguous()), [], [], [], 0
    for (_, v), n in zip(keep, counts):
        a, b, start = cols[0][start:start + n], cols[1][start:start + n], start + n
        if n == 0 and skip_empty:
            continue
        pieces.append(body(v, a, b))
        tokens.append((a, b)[token])
        used.append(n)
    if not pieces:
        return final
    split = _split(pieces, final, cast, used)
    if split is None:
        logger.debug("opreg: expert loop: the body's values don't fit index_add_; running the loop")
        return None
    hidden, idx = split[0], torch.cat(tokens)
    if unsupported(hidden, idx, split[1], final.shape[0]) is not None:
        return None
    return torch.ops.opreg.scatter_combine.default(hidden, idx, split[1], final.shape[0])


IDIOM = LoopIdiom(name="experts", op=OP, candidate=candidate, prove=prove, runtime=grouped_experts, runs=_runs,
                  note="Dynamo breaks the graph at each expert's where/nonzero; rows are grouped once instead")
