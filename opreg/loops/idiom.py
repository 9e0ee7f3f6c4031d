"""The loop-idiom plug-in API: what an idiom declares, what its proof is given, and the
proof and run-time helpers idioms share.

An idiom (one file: :mod:`opreg.loops.scatter_combine` is the example to copy) is a
:class:`LoopIdiom`. The rewriter (:mod:`opreg.loops.rewriter`) finds each ``for`` loop
the idiom's ``candidate`` accepts, asks its ``prove`` for a :class:`Plan` (or a
:class:`Reject` naming why not: a near miss), and replaces the loop by::

    _opreg_s = <plan.source>                       # evaluated once, as the loop did
    _opreg_r = run(_opreg_s, *plan.args, **plan.flags) if runs(_opreg_s) else None
    if _opreg_r is None:
        for <target> in <plan.iterate>:            # the user's loop, verbatim
            <body>
    else:
        <plan.result> = _opreg_r                   # the fast path: the op's result
        <target> = <plan.last>                     # where Python leaves the loop variable

So every fast path leaves the loop variable as Python would, and any value the run-time
guard doesn't accept runs the original loop. What the proof must establish is the rest:
that, whenever ``run`` returns a value, binding it to ``plan.result`` leaves every state
the loop could have changed, as seen by any code that can run afterwards (including code
that catches an exception part-way), the way the loop would. The helpers below cover the
Python half of that (aliases, closures, exceptions); the idiom covers its own arithmetic.
Not modelled: frame introspection (``sys._getframe``, a traceback's ``f_locals``).
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any, Callable

import torch

__all__ = ["Fresh", "LoopFinding", "LoopIdiom", "LoopSite", "Plan", "Reject", "fresh_origin", "names_in",
           "plain_tensors", "positive_count", "prove_fresh", "range_loop", "subscript_of"]

NESTED_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
TRY_NODES = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)
# Builtins that read or write a frame's locals by name: code using them could reach any
# local without naming it, so no alias proof holds.
DYNAMIC_LOCALS = ("eval", "exec", "locals", "vars")
# Context managers whose __exit__ never swallows an exception (it returns None/False).
QUIET_MANAGERS = (torch.no_grad, torch.enable_grad, torch.inference_mode, torch.set_grad_enabled,
                  torch.autocast, torch.autograd.profiler.record_function)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat)

ZEROS_FNS = ("zeros", "zeros_like")
FRESH_FNS = ZEROS_FNS + ("ones", "ones_like", "full", "full_like", "empty", "empty_like",
                         "rand", "rand_like", "randn", "randn_like", "clone")
ZEROS_METHODS = ("new_zeros",)
FRESH_METHODS = ZEROS_METHODS + ("new_ones", "new_full", "new_empty", "clone")


class Reject(Exception):
    """Raised by a proof: the loop is left as written; the message is the near miss."""


@dataclasses.dataclass
class Plan:
    """How to replace one loop (see the module docstring for the code it becomes).

    ``source``: the expression evaluated once where the loop was (the bound of
    ``range(n)``); ``args``: names (or expressions) passed to the run-time helper after
    it, in the order the loop would first read them; ``flags``: constant keywords;
    ``result``: the name bound to the helper's result. ``iterate``/``last``: the
    fallback's iterable and the loop variable's final value, as format strings of ``{s}``
    (the source's value). ``before``: replacements for statements that run before the
    loop, keyed by the statement (e.g. to keep a value the guard must check, see
    :func:`prove_fresh`). ``setup``: statements run where the loop was, before everything
    else (e.g. a nested ``def`` of the loop's body, which the run-time helper calls).
    """

    source: ast.expr
    args: list[str | ast.expr]
    result: str
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    iterate: str = "range({s})"
    last: str = "{s} - 1"
    before: dict[ast.stmt, list[ast.stmt]] = dataclasses.field(default_factory=dict)
    setup: list[ast.stmt] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LoopSite:
    """One loop as its proof sees it: the function, the loop, the block holding it
    (``block[pos] is loop``), the compound statements around it (``outer``: each one's
    block and position, outermost first), and how the function's names resolve
    (``resolve``: closure, globals, builtins; ``local``: names the function binds).
    ``key`` makes temporary names unique."""

    fn_def: ast.FunctionDef
    loop: ast.For
    block: list[ast.stmt]
    pos: int
    outer: tuple[tuple[list[ast.stmt], int], ...]
    resolve: Callable[[str], Any]
    local: frozenset[str]
    key: int

    @property
    def enclosing(self) -> tuple[ast.stmt, ...]:
        """The compound statements around the loop, outermost first."""
        return tuple(block[pos] for block, pos in self.outer)

    def resolves_to(self, name: str, obj: Any) -> bool:
        """Is ``name`` (not a local) ``obj`` here, e.g. ``range`` the builtin?"""
        return name not in self.local and self.resolve(name) is obj

    def temp(self, tag: str) -> str:
        return f"_opreg_{tag}{self.key}"

    def escapes(self, name: str) -> bool:
        """Can code outside this frame's own statements reach the binding of ``name``: a
        nested function, lambda or class mentions it, or it is declared global/nonlocal?"""
        for node in ast.walk(self.fn_def):
            if isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names:
                return True
            if node is not self.fn_def and isinstance(node, NESTED_SCOPES) \
                    and name in names_in(node):
                return True
        return False

    def dynamic_locals(self) -> bool:
        """Does the function use eval/exec/locals/vars (reach locals without naming them)?"""
        return any(n in names_in(self.fn_def) and n not in self.local for n in DYNAMIC_LOCALS)

    def exceptions_observable(self) -> bool:
        """Could this frame run more code after an exception part-way through the loop: a
        ``try`` around it (handlers, ``finally``), or a ``with`` whose manager may swallow
        it? (``torch.no_grad()`` and the like never do.)"""
        for s in self.enclosing:
            if isinstance(s, TRY_NODES):
                return True
            if isinstance(s, (ast.With, ast.AsyncWith)) \
                    and not all(self._quiet(item.context_expr) for item in s.items):
                return True
        return False

    def _quiet(self, expr: ast.expr) -> bool:
        if not isinstance(expr, ast.Call):
            return False
        obj = value_of(expr.func, self.local, self.resolve)
        return any(obj is m for m in QUIET_MANAGERS)


def value_of(expr: ast.expr, local: frozenset[str], resolve: Callable[[str], Any]) -> Any:
    """The object a dotted name (``torch.no_grad``) refers to, or None (a local of the
    function, or not a dotted name)."""
    if isinstance(expr, ast.Name):
        return None if expr.id in local else resolve(expr.id)
    if isinstance(expr, ast.Attribute):
        base = value_of(expr.value, local, resolve)
        return None if base is None else getattr(base, expr.attr, None)
    return None


# ================================================================ run-time helpers

def positive_count(n: Any) -> bool:
    """Is ``n`` an int (or SymInt) count > 0? (``range(n)`` then runs at least once.)"""
    return isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) and n > 0


def plain_tensors(*ts: Any) -> bool:
    """Are these torch's own tensors (or Parameters)? A subclass or a look-alike could
    run any code on each row access."""
    return all(type(t) in PLAIN_TENSORS for t in ts)


def fresh_origin(*origin: Any) -> bool:
    """Did the creation :func:`prove_fresh` split run torch's own code (so it allocated):
    a method of a real tensor, or an operator on real tensors and numbers?"""
    if not origin:
        return True
    tensors = [type(o) in PLAIN_TENSORS for o in origin]
    return any(tensors) and all(t or type(o) in NUMBERS for t, o in zip(tensors, origin))


@dataclasses.dataclass(frozen=True)
class LoopIdiom:
    """A loop idiom: ``name`` (an identifier), the ``op`` its fast path emits
    (``"opreg::scatter_combine"``), ``candidate(loop) -> bool`` (is this ``for`` loop
    worth a finding, match or near miss?), ``prove(site) -> Plan`` (or raise
    :class:`Reject`), ``runtime(source, *args, **flags)`` (the new value of
    ``plan.result``, or None when the values don't fit: the loop then runs) and
    ``runs(source) -> bool`` (does the loop run at least once? If not, nothing else is
    evaluated and the user's loop runs: default, a positive int count). ``note``: what
    ``explain`` says about a loop it rewrites (why it is worth it)."""

    name: str
    op: str
    candidate: Callable[[ast.For], bool]
    prove: Callable[[LoopSite], Plan]
    runtime: Callable[..., Any]
    runs: Callable[[Any], bool] = positive_count
    note: str = ""


@dataclasses.dataclass
class LoopFinding:
    """A loop in a function's source: rewritten (``matched``) to ``op`` by ``idiom``, or
    left as written and why (``reason``; ``op``/``idiom`` then name the idiom that came
    closest)."""

    function: str      # qualified name
    file: str
    line: int
    code: str          # the loop's first body line
    matched: bool
    reason: str = ""
    op: str = ""       # "opreg::scatter_combine"
    idiom: str = ""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# ================================================================== proof helpers

def names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def range_loop(site: LoopSite) -> tuple[str, ast.expr]:
    """(loop variable, bound) of ``for i in range(n)`` / ``range(0, n)`` with the builtin
    ``range`` and no ``else``; reject anything else."""
    loop, it = site.loop, site.loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
            and site.resolves_to(it.func.id, range) and not it.keywords
            and (len(it.args) == 1 or (len(it.args) == 2 and _is_zero(it.args[0])))):
        raise Reject("not a loop over range(n)")
    if not isinstance(loop.target, ast.Name):
        raise Reject("the loop variable is not a plain name")
    if loop.orelse:
        raise Reject("the loop has an else clause")
    return loop.target.id, it.args[-1]


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 0


def subscript_of(node: ast.AST, var: str) -> str | None:
    """``name`` of ``name[var]``, else None."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
            and isinstance(node.slice, ast.Name) and node.slice.id == var:
        return node.value.id
    return None


@dataclasses.dataclass
class Fresh:
    """What :func:`prove_fresh` proved: ``zeros`` (the tensor starts as zeros),
    ``origin`` (names the run-time guard passes to :func:`fresh_origin`) and ``before``
    (the rewritten creation statement, for :attr:`Plan.before`)."""

    zeros: bool
    origin: list[str]
    before: dict[ast.stmt, list[ast.stmt]]


def prove_fresh(site: LoopSite, name: str) -> Fresh:
    """Prove that, when the loop starts, ``name`` is a tensor nothing else refers to, so
    rebinding it instead of writing into it changes nothing anyone can see: it is made by
    an allocating call (``torch.zeros``, ``x.new_zeros``, ``x.clone()``, ``x * 1.0``, ...)
    before the loop, in its block or in a block around it that runs once per loop (the
    body of an ``if``, ``with`` or ``try``, not of another loop); nothing in between nor
    the loop's range mentions it; no nested function can reach it; and the function
    doesn't reach its locals by string (eval/exec/locals/vars). Reject otherwise."""
    if site.escapes(name):
        raise Reject(f"{name} is used by a nested function or lambda, or declared global/nonlocal: "
                     f"other code could hold it while the loop writes into it")
    if site.dynamic_locals():
        raise Reject("the function uses eval/exec/locals/vars: its locals could be aliased")
    if name in names_in(site.loop.iter):
        raise Reject(f"{name} is used in the loop's range")
    levels = [(site.block, site.pos), *reversed(site.outer)]
    for k, (block, pos) in enumerate(levels):
        if k and not _runs_once(block[pos], levels[k - 1][0], name):
            break
        for j in range(pos - 1, -1, -1):
            s = block[j]
            if isinstance(s, ast.Assign) and len(s.targets) == 1 \
                    and isinstance(s.targets[0], ast.Name) and s.targets[0].id == name:
                fresh = _allocation(site, s, name)
                if fresh is None:
                    raise Reject(f"{name} is not a fresh tensor (torch.zeros(...), x.new_zeros(...), "
                                 f"...): it could alias the loop's inputs")
                return fresh
            if name in names_in(s):
                raise Reject(f"{name} is used between its creation and the loop")
    raise Reject(f"{name} is not created just before the loop, in its block or an if/with/try "
                 f"around it (out = torch.zeros(...)): it could alias the loop's inputs")


def _runs_once(parent: ast.stmt, inner: list[ast.stmt], name: str) -> bool:
    """Does ``inner`` (a block of ``parent``) run at most once each time ``parent`` does,
    with nothing of ``parent`` that runs before it mentioning ``name``?"""
    if isinstance(parent, (ast.With, ast.AsyncWith)) and inner is parent.body:
        head: list[ast.AST] = list(parent.items)
    elif isinstance(parent, ast.If) and (inner is parent.body or inner is parent.orelse):
        head = [parent.test]
    elif isinstance(parent, TRY_NODES) and inner is parent.body:
        head = []
    else:
        return False
    if any(name in names_in(h) for h in head):
        raise Reject(f"{name} is used between its creation and the loop")
    return True


def _assign(name: str, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=value)


def _load(name: str) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Load())


def _allocation(site: LoopSite, stmt: ast.Assign, name: str) -> Fresh | None:
    """Fresh if ``value`` allocates. A method or an operator allocates only if what it
    runs on is a real tensor, which only the run-time value says: the creation is split
    (``_b = x; out = _b.new_zeros(..)``, same order of evaluation) so the guard can check."""
    value = stmt.value
    if isinstance(value, ast.BinOp):
        left, right = site.temp("fl"), site.temp("fr")
        made = ast.BinOp(left=_load(left), op=value.op, right=_load(right))
        return Fresh(False, [left, right],
                     {stmt: [_assign(left, value.left), _assign(right, value.right), _assign(name, made)]})
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return None
    attr, base = value.func.attr, value.func.value
    if any(k.arg in ("out", None) for k in value.keywords):
        return None  # out= writes into (aliases) another tensor; **kwargs could hold it
    if isinstance(base, ast.Name) and site.resolves_to(base.id, torch):
        return Fresh(attr in ZEROS_FNS, [], {}) if attr in FRESH_FNS else None
    if attr not in FRESH_METHODS:
        return None
    b = site.temp("fb")
    made = ast.Call(func=ast.Attribute(value=_load(b), attr=attr, ctx=ast.Load()),
                    args=value.args, keywords=value.keywords)
    return Fresh(attr in ZEROS_METHODS, [b], {stmt: [_assign(b, base), _assign(name, made)]})
