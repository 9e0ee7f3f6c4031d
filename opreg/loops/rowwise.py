"""What "row-wise" means for the expert-loop idiom (:mod:`opreg.loops.experts`): row ``r``
of a value depends only on row ``r`` of the gathered rows and on values that don't change in
the loop. From the source (:class:`Rows`, over a body's statements) and at run time for the
callables a body calls (:func:`is_rowwise`: modules and functions known or proven row-wise)."""
from __future__ import annotations

import ast
import copy
import builtins
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .idiom import Reject, value_of

ROW, PARAM = "row", "param"

__all__ = ["ELEMENTWISE", "HF_ACTIVATIONS", "MATMULS", "PARAM", "PARAM_METHODS", "ROW", "ROWWISE_MODULES", "ROW_ATTRS",
           "ROW_METHODS", "Rows", "is_rowwise", "method_name", "stored_names", "unparsed"]

ELEMENTWISE = {F.silu, F.gelu, F.relu, F.relu6, F.sigmoid, F.tanh, F.softplus, F.mish, F.elu,
               F.leaky_relu, F.hardswish, F.selu, torch.sigmoid, torch.tanh, torch.relu, torch.exp,
               torch.square, torch.abs, torch.neg, torch.erf, torch.clamp, torch.rsqrt, torch.sqrt}
MATMULS = {F.linear, torch.matmul, torch.mm}
ROW_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "sigmoid", "relu", "tanh",
               "exp", "square", "pow", "clamp", "neg", "abs", "contiguous", "mul", "add", "sub",
               "div", "chunk"}
PARAM_METHODS = {"t", "transpose", "contiguous", "to", "float", "half", "bfloat16", "double",
                 "view", "reshape", "unsqueeze", "squeeze"}
ROW_ATTRS = {"dtype", "device"}
ROWWISE_MODULES = (nn.Linear, nn.Identity, nn.SiLU, nn.GELU, nn.ReLU, nn.ReLU6, nn.Tanh, nn.Sigmoid,
                   nn.Mish, nn.Softplus, nn.LeakyReLU, nn.ELU, nn.SELU, nn.Hardswish)
HF_ACTIVATIONS = {"SiLUActivation", "GELUActivation", "GELUTanh", "PytorchGELUTanh", "NewGELUActivation",
                  "FastGELUActivation", "QuickGELUActivation", "ReLUSquaredActivation", "MishActivation",
                  "AccurateGELUActivation", "LinearActivation"}



# ===================================================================== row-wise proof

class Rows:
    """Kinds of the body's values: ROW (row r depends only on the rows' row r) or PARAM
    (the same for every row: loop-invariant, the expert id, constants). ``callables``:
    loop-invariant things called on rows (checked at run time)."""

    def __init__(self, resolve: Callable[[str], Any], local: frozenset[str], bound: set[str],
                 env: dict[str, str], index: tuple[str, ...]) -> None:
        self.resolve, self.local, self.bound, self.env, self.index = resolve, local, bound, env, index
        self.defs: dict[str, ast.expr] = {}
        self.callables: list[ast.expr] = []

    def assign(self, stmt: ast.stmt) -> None:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            raise Reject(f"{unparsed(stmt)}: only plain assignments may come between the where and the index_add_")
        target, kind = stmt.targets[0], self.kind(stmt.value)
        if isinstance(target, ast.Name):
            self.env[target.id] = kind
            if kind == PARAM:
                self.defs[target.id] = stmt.value
        elif isinstance(target, ast.Tuple) and all(isinstance(t, ast.Name) for t in target.elts) \
                and kind == ROW and method_name(stmt.value) == "chunk":
            self.env.update({t.id: ROW for t in target.elts})
        else:
            raise Reject(f"{unparsed(stmt)}: assigns something other than names")

    def _name(self, node: ast.Name) -> str:
        if node.id in self.env:
            return self.env[node.id]
        if node.id in self.bound:
            raise Reject(f"{node.id} is read before the body assigns it: a value carried between experts")
        return PARAM

    def kind(self, node: ast.expr) -> str:
        if isinstance(node, (ast.Constant, ast.Name)):
            return PARAM if isinstance(node, ast.Constant) else self._name(node)
        if isinstance(node, ast.Attribute):
            if self.kind(node.value) == ROW and node.attr not in ROW_ATTRS:
                raise Reject(f"{unparsed(node)} is not row-wise (it depends on all the rows)")
            return PARAM
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return self.kind(node.operand)
        if isinstance(node, ast.BinOp):
            return self._binop(node)
        if isinstance(node, ast.Subscript):
            return self._subscript(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        raise Reject(f"{unparsed(node)} is not a row-wise operation opreg knows")

    def _binop(self, node: ast.BinOp) -> str:
        left, right = self.kind(node.left), self.kind(node.right)
        if isinstance(node.op, ast.MatMult):
            if right == ROW:
                raise Reject(f"{unparsed(node)}: a matmul with rows on the right mixes rows")
            return left
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
            raise Reject(f"{unparsed(node)} is not a row-wise operation opreg knows")
        return ROW if ROW in (left, right) else PARAM

    def _parts(self, node: ast.Subscript) -> list[ast.expr]:
        return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]

    def _index_kind(self, part: ast.expr) -> str:
        if isinstance(part, ast.Slice):
            for p in (part.lower, part.upper, part.step):
                if p is not None and self.kind(p) == ROW:
                    raise Reject(f"{unparsed(part)}: a slice bounded by row values")
            return PARAM
        if isinstance(part, ast.Name) and part.id in self.index:
            return ROW
        if self.kind(part) == ROW:
            raise Reject(f"{unparsed(part)}: rows indexed by computed values")
        return PARAM

    def _subscript(self, node: ast.Subscript) -> str:
        parts = self._parts(node)
        kinds = [self._index_kind(p) for p in parts]
        if self.kind(node.value) == ROW:
            full = isinstance(parts[0], ast.Slice) and parts[0].lower is parts[0].upper is parts[0].step is None
            if not full or ROW in kinds:
                raise Reject(f"{unparsed(node)}: only columns of rows may be selected (x[:, ...])")
            return ROW
        if ROW not in kinds:
            return PARAM
        if kinds[0] != ROW:
            raise Reject(f"{unparsed(node)}: the gathered rows must be the first index")
        return ROW

    def _call(self, node: ast.Call) -> str:
        args = [*node.args, *(k.value for k in node.keywords)]
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise Reject(f"{unparsed(node)}: *args/**kwargs")
        fn = value_of(node.func, self.local, self.resolve)
        if fn is not None and any(fn is f for f in ELEMENTWISE | MATMULS):
            kinds = [self.kind(a) for a in args]
            if kinds[:1] != [ROW] or ROW in kinds[1:]:
                raise Reject(f"{unparsed(node)}: rows only as the first argument")
            return ROW
        if isinstance(node.func, ast.Attribute) and self.kind(node.func.value) == ROW:
            return self._row_method(node, args)
        if fn is not None and not isinstance(fn, nn.Module) and not inspect.ismethod(fn):
            raise Reject(f"{unparsed(node.func)} is not a function opreg knows to be row-wise")
        kinds = [self.kind(a) for a in args]
        if self.kind(node.func) != PARAM:
            raise Reject(f"{unparsed(node)} is not row-wise")
        if ROW not in kinds:
            if method_name(node) in PARAM_METHODS:
                return PARAM
            raise Reject(f"{unparsed(node)}: a call that could have side effects")
        if len(node.args) != 1 or node.keywords:
            raise Reject(f"{unparsed(node)}: a loop-invariant callable called with more than the rows")
        self.callables.append(self._expand(node.func))
        return ROW

    def _row_method(self, node: ast.Call, args: list[ast.expr]) -> str:
        name = node.func.attr  # type: ignore[attr-defined]
        if name not in ROW_METHODS:
            raise Reject(f"{unparsed(node)}: .{name}() is not a row-wise operation opreg knows")
        if name == "chunk":
            dims = node.args[1:] + [k.value for k in node.keywords if k.arg == "dim"]
            if len(dims) != 1 or not (isinstance(dims[0], ast.UnaryOp) or isinstance(dims[0], ast.Constant)) \
                    or ast.literal_eval(dims[0]) not in (-1, 1):
                raise Reject(f"{unparsed(node)}: chunks other than along the columns (dim=-1)")
        for a in args:
            self.kind(a)
        return ROW

    def _expand(self, node: ast.expr) -> ast.expr:
        """``node`` with names the body bound to parameters replaced by their definitions."""
        node = copy.deepcopy(node)
        for n in ast.walk(node):
            for field, child in ast.iter_fields(n):
                if isinstance(child, ast.Name) and child.id in self.defs:
                    setattr(n, field, self._expand(self.defs[child.id]))
        if isinstance(node, ast.Name) and node.id in self.defs:
            return self._expand(self.defs[node.id])
        return node


def unparsed(node: ast.AST) -> str:
    """``node`` as source text (what a rejection quotes)."""
    return ast.unparse(node)


def method_name(node: ast.expr) -> str:
    """The method a call ``x.name(...)`` calls, or "" for any other expression."""
    return node.func.attr if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else ""


def stored_names(nodes: list[ast.stmt]) -> set[str]:
    """Every name the statements assign (at any depth)."""
    return {n.id for s in nodes for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


# ============================================================== run-time: modules

@functools.cache
def _forward_rowwise(cls: type) -> tuple[str, ...] | None:
    """For a module class whose ``forward(self, x)`` is row-wise in ``x``: the attributes
    of ``self`` it calls on rows (each checked in turn); None if not provably row-wise."""
    fwd = cls.forward
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fwd))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    a = tree.args  # type: ignore[attr-defined]
    if not isinstance(tree, ast.FunctionDef) or tree.decorator_list or len(a.args) != 2 or a.vararg \
            or a.kwarg or a.kwonlyargs or a.posonlyargs:
        return None
    body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    self_, x = a.args[0].arg, a.args[1].arg
    g = fwd.__globals__
    rows = Rows(lambda n: g[n] if n in g else getattr(builtins, n, None), frozenset(stored_names(body) | {self_, x}),
                stored_names(body), {x: ROW, self_: PARAM}, ())
    try:
        for s in body[:-1]:
            rows.assign(s)
        if not (body and isinstance(body[-1], ast.Return) and body[-1].value is not None
                and rows.kind(body[-1].value) == ROW):
            return None
    except Reject:
        return None
    calls = [c.attr for c in rows.callables if isinstance(c, ast.Attribute) and unparsed(c.value) == self_]
    return tuple(calls) if len(calls) == len(rows.callables) else None


def is_rowwise(m: Any, depth: int = 0) -> bool:
    """Is calling ``m`` on rows row-wise (module or function)?"""
    if not isinstance(m, nn.Module):
        return any(m is f for f in ELEMENTWISE)
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or depth > 8:
        return False
    t = type(m)
    if t in ROWWISE_MODULES or (t.__module__ == "transformers.activations" and t.__name__ in HF_ACTIVATIONS):
        return True
    if t is nn.Sequential:
        return all(is_rowwise(c, depth + 1) for c in m)
    if t is nn.Dropout:
        return not m.training or m.p == 0
    calls = _forward_rowwise(t)
    return calls is not None and all(is_rowwise(getattr(m, c, None), depth + 1) for c in calls)
