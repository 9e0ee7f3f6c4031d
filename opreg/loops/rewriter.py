"""The generic loop rewriter: read a function's source, find the loops the registered
idioms prove, and build a new function whose loops run as ops (falling back to the
user's loop, verbatim, whenever the run-time guard says the values don't fit).

The replacement for each loop is :data:`TEMPLATE` (see :mod:`opreg.loops.idiom` for what
an idiom proves). The new function is compiled from the user's own source, inside a
factory that takes the original's free variables, so it sees the same closure (``super()``
included) and the same, live, module globals. Functions without source (``exec``'d) are
left alone with one warning; so are ones using name-mangled ``__names`` and ones already
using ``_opreg_`` names. A decorated function is seen through when its decorator is a
``functools.wraps`` wrapper holding the function in one closure variable (transformers'
``@use_experts_implementation``, ``torch.no_grad()``): the function is rewritten and the
wrapper rebuilt around it (same code, the rest of its closure shared), so the decorator
still does what it did (:mod:`opreg.loops.wrappers`); other decorated functions are left
alone, with the reason. A model's methods: :mod:`opreg.loops.modules`.
"""
from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import dis
import inspect
import textwrap
import types
import warnings
from typing import Any, Callable


from .._log import logger
from .idiom import NESTED_SCOPES, LoopFinding, LoopIdiom, LoopSite, Plan, Reject
from .registry import registered_loop_idioms
from .wrappers import rebuild, wrapped

__all__ = ["NO_SOURCE", "find_loops", "rewrite_function", "try_rewrite", "warn_unavailable"]

_warned: set[str] = set()
NO_SOURCE = "its source is not available (exec'd or compiled code)"


# ===================================================================== the source

def _source_of(fn: Callable[..., Any]) -> tuple[ast.FunctionDef, str, list[str]] | str:
    """(def, file, lines of the file) of ``fn``'s source, or why it can't be had."""
    try:
        lines, first = inspect.getsourcelines(fn)
        file = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except (OSError, TypeError):
        return NO_SOURCE
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return "its source could not be parsed"
    ast.increment_lineno(tree, first - 1)
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef) \
            or tree.body[0].name != fn.__name__:
        return "its source is not a plain def"
    try:
        with open(file, encoding="utf-8") as f:
            all_lines = f.read().splitlines()
    except OSError:
        all_lines = []
    return tree.body[0], file, all_lines


def _resolver(fn: Callable[..., Any]) -> Callable[[str], Any]:
    """Resolve a name as ``fn``'s code would (if it isn't a local): closure, globals,
    builtins; None if unbound."""
    g = fn.__globals__
    closure = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))

    def resolve(name: str) -> Any:
        if name in closure:
            return closure[name]
        if name in g:
            return g[name]
        return getattr(builtins, name, None)

    return resolve


def _locals_of(fn_def: ast.FunctionDef) -> frozenset[str]:
    a = fn_def.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    todo = list(ast.iter_child_nodes(fn_def))
    while todo:  # the function's own scope: not inside nested functions, lambdas, classes
        n = todo.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.id)
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(x.asname or x.name).split(".")[0] for x in n.names}
        if isinstance(n, NESTED_SCOPES):
            names.add(getattr(n, "name", ""))
        else:
            todo.extend(ast.iter_child_nodes(n))
    return frozenset(names)


# ======================================================================= the scan

@dataclasses.dataclass
class _Match:
    site: LoopSite
    idiom: LoopIdiom
    plan: Plan
    finding: LoopFinding


class _Scan:
    """Every loop of one function, tried against each idiom."""

    def __init__(self, fn: Callable[..., Any], fn_def: ast.FunctionDef, file: str,
                 lines: list[str], idioms: list[LoopIdiom]) -> None:
        self.fn_def, self.file, self.lines, self.idioms = fn_def, file, lines, idioms
        self.qualname, self.resolve, self.local = fn.__qualname__, _resolver(fn), _locals_of(fn_def)
        self.findings: list[LoopFinding] = []
        self.matches: list[_Match] = []
        self._block(fn_def.body, ())

    def _block(self, block: list[ast.stmt], outer: tuple[tuple[list[ast.stmt], int], ...]) -> None:
        for pos, s in enumerate(block):
            if isinstance(s, NESTED_SCOPES):
                continue
            if isinstance(s, ast.For) and self._loop(s, block, pos, outer):
                continue
            inner = outer + ((block, pos),)
            for field in ("body", "orelse", "finalbody"):
                sub = getattr(s, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    self._block(sub, inner)
            for part in (*getattr(s, "handlers", ()), *getattr(s, "cases", ())):
                self._block(part.body, inner)

    def _loop(self, loop: ast.For, block: list[ast.stmt], pos: int,
              outer: tuple[tuple[list[ast.stmt], int], ...]) -> bool:
        """Try the idioms on ``loop``; True if one proved it."""
        tried = [i for i in self.idioms if i.candidate(loop)]
        if not tried:
            return False
        site = LoopSite(self.fn_def, loop, block, pos, outer, self.resolve, self.local,
                        key=len(self.findings))
        line = loop.body[0].lineno - 1 if loop.body else -1
        code = self.lines[line].strip() if 0 <= line < len(self.lines) else ""
        reasons = []
        for idiom in tried:
            try:
                plan = idiom.prove(site)
            except Reject as e:
                reasons.append(f"{idiom.name}: {e}" if len(tried) > 1 else str(e))
                continue
            f = LoopFinding(self.qualname, self.file, loop.lineno, code, True, "", idiom.op, idiom.name)
            self.findings.append(f)
            self.matches.append(_Match(site, idiom, plan, f))
            return True
        self.findings.append(LoopFinding(self.qualname, self.file, loop.lineno, code, False,
                                         "; ".join(reasons), tried[0].op, tried[0].name))
        return False


# =================================================================== the rewrite

TEMPLATE = """
{s} = None
{r} = {run}({s}) if {runs}({s}) else None
if {r} is None:
    pass
else:
    {result} = {r}
    _ = {last}
"""


def _helper_names(idiom: LoopIdiom) -> tuple[str, str]:
    return f"_opreg_run_{idiom.name}", f"_opreg_runs_{idiom.name}"


def _expr(src: str) -> ast.expr:
    return ast.parse(src, mode="eval").body


def _at(stmts: list[ast.stmt], where: ast.AST, *, everywhere: bool) -> list[ast.stmt]:
    """Give new code the location of ``where`` (tracebacks point at the user's line);
    ``everywhere=False`` keeps the locations nodes already have (the user's own)."""
    for s in stmts:
        for node in ast.walk(s):
            if everywhere or getattr(node, "lineno", None) is None:
                ast.copy_location(node, where)
    return stmts


def _replacement(m: _Match) -> list[ast.stmt]:
    """:data:`TEMPLATE` filled in for one match."""
    site, plan = m.site, m.plan
    s, r = site.temp("s"), site.temp("r")
    run, runs = _helper_names(m.idiom)
    stmts = _at(ast.parse(TEMPLATE.format(s=s, r=r, run=run, runs=runs, result=plan.result,
                                          last=plan.last.format(s=s))).body, site.loop, everywhere=True)
    stmts[0].value = plan.source
    call = stmts[1].value.body
    call.args += [ast.Name(id=a, ctx=ast.Load()) if isinstance(a, str) else a for a in plan.args]
    call.keywords = [ast.keyword(arg=k, value=ast.Constant(v)) for k, v in plan.flags.items()]
    fallback = copy.copy(site.loop)  # the user's loop (its own body and locations)
    fallback.iter = _at([ast.Expr(_expr(plan.iterate.format(s=s)))], site.loop, everywhere=True)[0].value
    stmts[2].body = [fallback]
    stmts[2].orelse[1].targets = [copy.deepcopy(site.loop.target)]
    return _at([*plan.setup, *stmts], site.loop, everywhere=False)


def _blocks(fn_def: ast.FunctionDef) -> dict[int, tuple[list[ast.stmt], int]]:
    """id(statement) -> (its block, its position), for every statement of ``fn_def``."""
    where = {}
    for node in ast.walk(fn_def):
        for _, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                where.update({id(s): (value, j) for j, s in enumerate(value)})
    return where


def _apply(fn_def: ast.FunctionDef, matches: list[_Match]) -> list[_Match]:
    """Replace each matched loop (and the earlier statements its plan rewrites); a plan
    that would rewrite a statement another already does is dropped (its finding becomes
    a near miss). Returns the matches applied."""
    where = _blocks(fn_def)
    todo: dict[tuple[int, int], tuple[list[ast.stmt], list[ast.stmt]]] = {}
    applied = []
    for m in matches:
        wanted = {(id(m.site.block), m.site.pos): (m.site.block, _replacement(m))}
        for stmt, new in m.plan.before.items():
            block, j = where[id(stmt)]
            wanted[id(block), j] = (block, _at(new, stmt, everywhere=False))
        if wanted.keys() & todo.keys():
            m.finding.matched, m.finding.reason = False, "overlaps another loop rewritten here"
            continue
        todo.update(wanted)
        applied.append(m)
    for (_, j), (block, new) in sorted(todo.items(), key=lambda e: -e[0][1]):
        block[j:j + 1] = new  # from the end of each block: positions stay valid
    return applied


def _plain(fn_def: ast.FunctionDef) -> str:
    """Why the function can't be recompiled from its source as is ("" if it can)."""
    if fn_def.decorator_list:
        return "it is decorated"
    for n in ast.walk(fn_def):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if name.startswith("__") and not name.endswith("__"):
            return "it uses private (name-mangled) names"
        if name.startswith("_opreg_"):
            return "it already uses _opreg_ names"
    return ""


def _compile(fn: Callable[..., Any], fn_def: ast.FunctionDef, file: str,
             helpers: dict[str, Any]) -> Callable[..., Any]:
    """The function ``fn_def`` (rewritten) as ``fn`` would be: same closure, globals,
    defaults, names; ``helpers`` are visible to it."""
    # Annotations stay the original's (set below): evaluating them here could fail (names
    # imported under TYPE_CHECKING, postponed evaluation in the user's module).
    a = fn_def.args
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
        if arg is not None:
            arg.annotation = None
    fn_def.returns = None
    # def factory(*helpers, *free vars): def fn(...): ...; return fn  -- so the compiler
    # makes the original's free variables (incl. __class__ for super()) and the helpers
    # free variables of the new function, while its globals stay the original module's
    # (live) namespace.
    free = list(fn.__code__.co_freevars)
    factory = ast.FunctionDef(
        name="_opreg_factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=x) for x in [*helpers, *free]],
                           vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[fn_def, ast.Return(value=ast.Name(id=fn_def.name, ctx=ast.Load()))],
        decorator_list=[], returns=None, type_comment=None)
    if hasattr(ast, "TypeAlias"):  # 3.12+: FunctionDef has type_params
        factory.type_params = []
    mod = ast.Module(body=[factory], type_ignores=[])
    ast.copy_location(factory, fn_def)
    ast.fix_missing_locations(mod)
    ns: dict[str, Any] = {}
    exec(compile(mod, file, "exec"), fn.__globals__, ns)  # noqa: S102 - the user's own source
    made = ns["_opreg_factory"](*helpers.values(), *[None] * len(free))
    # The original's own cells, not copies of their values: a nonlocal the function writes,
    # or one its enclosing function changes later, stays shared as it was.
    cells = dict(zip(free, fn.__closure__ or ()))
    closure = tuple(cells.get(name, cell) for name, cell in zip(made.__code__.co_freevars,
                                                                 made.__closure__ or ()))
    new = types.FunctionType(made.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    new.__opreg_original__ = fn
    return new


def find_loops(fn: Callable[..., Any]) -> list[LoopFinding]:
    """The loops :func:`opreg.optimize` would rewrite in ``fn`` (matched) or leave (why)."""
    return try_rewrite(getattr(fn, "__opreg_original__", fn))[1]


def _left(findings: list[LoopFinding], why: str) -> list[LoopFinding]:
    """``findings`` with each proved loop marked as left, because of ``why``."""
    for f in findings:
        if f.matched:
            f.matched, f.reason = False, f"proved, but the function can't be rewritten: {why}"
    return findings


def try_rewrite(fn: Callable[..., Any], unwrapped: bool = False
                ) -> tuple[Callable[..., Any] | None, list[LoopFinding], str]:
    """(rewritten fn or None, findings, why not rewritten). ``unwrapped``: ``fn`` was
    reached through a wrapper's ``__wrapped__`` (its source's decorators are that wrapper,
    rebuilt by the caller)."""
    if hasattr(fn, "__wrapped__"):
        got_inner = wrapped(fn)
        if isinstance(got_inner, str):
            inner = inspect.unwrap(fn)
            found = try_rewrite(inner, unwrapped=True)[1] if isinstance(inner, types.FunctionType) else []
            return None, _left(found, got_inner), got_inner
        new_inner, found, why = try_rewrite(got_inner[0], unwrapped=True)
        return (None if new_inner is None else rebuild(fn, got_inner[1], new_inner)), found, why
    if not _loops(fn, nested=True):
        # No for loop in its code or any code nested in it: nothing the scan could match
        # (it matches for statements), so no parse. Most of a model's methods are these:
        # reading and parsing them was ~60 % of opreg.optimize's time on a tiny transformers
        # model (163 functions, 1.0-2.5 s on the 2-core box).
        return None, [], "no loop to rewrite"
    got = _source_of(fn)
    if isinstance(got, str):
        return None, [], got
    fn_def, file, lines = got
    if unwrapped:
        fn_def.decorator_list = []
    scan = _Scan(fn, fn_def, file, lines, registered_loop_idioms())
    why = _plain(fn_def)
    if why:
        return None, _left(scan.findings, why), why
    applied = _apply(fn_def, scan.matches)
    if not applied:
        return None, scan.findings, "no loop to rewrite"
    helpers: dict[str, Any] = {}
    for m in applied:
        run, runs = _helper_names(m.idiom)
        helpers[run], helpers[runs] = m.idiom.runtime, m.idiom.runs
    return _compile(fn, fn_def, file, helpers), scan.findings, ""


def _loops(fn: Callable[..., Any], nested: bool) -> bool:
    """Does ``fn``'s bytecode loop (a for or an async for), or with ``nested`` that of code
    nested in it (inner functions, comprehensions)? True where that can't be told."""
    try:
        todo = [dis.Bytecode(fn).codeobj]
    except TypeError:
        return True
    while todo:
        c = todo.pop()
        if any(i.opname in ("FOR_ITER", "GET_AITER") for i in dis.get_instructions(c)):
            return True
        if nested:
            todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return False


def warn_unavailable(fns: list[Callable[..., Any]]) -> None:
    """One warning per call for functions with loops but no source, never twice for the
    same function."""
    new = [f.__qualname__ for f in fns if f.__qualname__ not in _warned and _loops(f, nested=False)]
    if not new:
        return
    _warned.update(new)
    msg = (f"opreg.optimize: {', '.join(new)} left as is: the source is not available (exec'd or "
           f"compiled code); their loops can't be rewritten (torch.compile still runs them)")
    logger.info(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def rewrite_function(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[LoopFinding]]:
    """(a rewritten copy of ``fn``, or ``fn`` itself if nothing was rewritten; findings)."""
    new, found, why = try_rewrite(fn)
    if new is None and why == NO_SOURCE:
        warn_unavailable([fn])
    return new or fn, found
