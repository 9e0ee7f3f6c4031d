"""``opreg.optimize(model)``: rewrite Python-loop idioms Dynamo can't trace, then compile.

The loop it knows (Dynamo skips the whole frame: each row's index is data)::

    out = torch.zeros(T, H, dtype=x.dtype, device=x.device)
    for row in range(x.shape[0]):                    # or len(idx), or a count n
        out[idx[row]] += gates[row] * x[row]         # or out[i] = out[i] + ..., idx[row].item(),
                                                     # int(idx[row]), the product either way
becomes one ``torch.ops.opreg.scatter_combine(x, idx, gates, T)``.

Safety, proven from the source (the AST) before anything changes:

* the loop is ``for i in range(n)`` with one statement and no ``else``; ``i`` only indexes
  rows (``name[i]``) - if ``i`` is read elsewhere, it is set to ``n - 1`` afterwards, as
  Python leaves it;
* ``out`` is made fresh in the same block just before the loop (``torch.zeros``/
  ``zeros_like``/``new_zeros``, or ``ones``/``full``/``empty``/``clone``/...), and no
  statement in between mentions it, so nothing aliases it: the loop's in-place writes can
  become ``out = op(...)`` (zeros) or ``out = out + op(...)`` (anything else);
* ``out``, the index and both factors are distinct names.

And at run time, before the op runs (anything else runs the original loop instead, so
results never change): tensors of the right ranks and sizes (x (N, H), gates (N,) or
(N, 1), idx (N,) int32/int64, out (T, H), ``n == N``), out in x's dtype, gates in x's
dtype or float32, one device. Negative indices wrap as Python indexing does.

Functions whose source can't be read (``exec``'d code) are left as they are, with one
warning. The rewrite replaces methods on the *instance* (``module.forward = ...``), so the
model keeps its parameters, and ``module._opreg_loops`` lists what was rewritten.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import dis
import inspect
import textwrap
import types
import warnings
from typing import Any, Callable, Mapping, TypeVar

import torch

from ._log import logger

__all__ = ["LoopFinding", "find_loops", "loop_combine", "optimize", "rewrite_loops"]

T = TypeVar("T")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
ZEROS_FNS = ("zeros", "zeros_like")
FRESH_FNS = ZEROS_FNS + ("ones", "ones_like", "full", "full_like", "empty", "empty_like",
                         "rand", "rand_like", "randn", "randn_like", "clone")
ZEROS_METHODS = ("new_zeros",)
FRESH_METHODS = ZEROS_METHODS + ("new_ones", "new_full", "new_empty", "clone")
_warned: set[str] = set()


@dataclasses.dataclass
class LoopFinding:
    """A loop in a function's source: rewritten (``matched``) or why not."""

    function: str      # qualified name
    file: str
    line: int
    code: str          # the loop's body line
    matched: bool
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# ================================================================== the runtime half

def _hidden_and_gates(h: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if h.dim() != 2:
        return None
    if g.dim() == 1:
        return h, g
    if g.dim() == 2 and g.shape[1] == 1:
        return h, g.reshape(-1)
    return None


def loop_combine(out: Any, idx: Any, a: Any, b: Any, n: Any, zeros: bool) -> torch.Tensor | None:
    """What ``for i in range(n): out[idx[i]] += a[i] * b[i]`` leaves in ``out``, as one
    op - or None when the values don't fit the op exactly (the caller then runs the
    loop). ``zeros``: out is a fresh zeros, so the result replaces it.

    Shapes: one of a/b is the hidden (N, H), the other the gates (N,) or (N, 1);
    idx (N,) int32/int64; out (T, H).
    """
    if not all(isinstance(t, torch.Tensor) for t in (out, idx, a, b)):
        return None
    if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
        return None
    pair = _hidden_and_gates(a, b) or _hidden_and_gates(b, a)
    if pair is None:
        return None
    hidden, gates = pair
    rows, width = hidden.shape
    if n != rows or gates.shape[0] != rows or idx.dim() != 1 or idx.shape[0] != rows:
        return None
    if out.dim() != 2 or out.shape[1] != width or idx.dtype not in (torch.int32, torch.int64):
        return None
    if out.dtype != hidden.dtype or out.dtype not in FLOAT_DTYPES \
            or gates.dtype not in (hidden.dtype, torch.float32):
        return None  # the op returns hidden's dtype and takes gates in it or in float32
    if not (out.device == hidden.device == gates.device == idx.device):
        return None
    if out.requires_grad and out.is_leaf:
        return None  # the loop's in-place write raises; let it
    if any(t.layout != torch.strided for t in (out, hidden, gates, idx)):
        return None
    t = out.shape[0]
    idx = torch.where(idx < 0, idx + t, idx)  # out[-1] is the last row, as in Python
    combined = torch.ops.opreg.scatter_combine.default(hidden, idx, gates, t)
    return combined if zeros else out + combined


# ================================================================== the source half

@dataclasses.dataclass
class _Plan:
    loop: ast.For
    out: str
    idx: str
    a: str
    b: str
    zeros: bool


class _Reject(Exception):
    pass


def _sub_of(node: ast.AST, var: str) -> str:
    """``name`` of ``name[var]``, else reject."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
            and isinstance(node.slice, ast.Name) and node.slice.id == var:
        return node.value.id
    raise _Reject("loop body is not out[idx[i]] += gates[i] * x[i]")


def _row_index(node: ast.AST, var: str, resolve: Callable[[str], Any]) -> str:
    """idx of ``idx[i]``, ``idx[i].item()`` or ``int(idx[i])``."""
    if isinstance(node, ast.Call) and not node.keywords:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "item" and not node.args:
            return _sub_of(node.func.value, var)
        if isinstance(node.func, ast.Name) and node.func.id == "int" and len(node.args) == 1 \
                and resolve("int") is int:
            return _sub_of(node.args[0], var)
        raise _Reject("the row index is not idx[i], idx[i].item() or int(idx[i])")
    return _sub_of(node, var)


def _names(node: ast.AST) -> list[ast.Name]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Name)]


def _own_nodes(fn: ast.FunctionDef) -> list[ast.AST]:
    """Nodes of ``fn``'s own scope (not inside nested functions, lambdas, classes)."""
    out, todo = [], list(ast.iter_child_nodes(fn))
    while todo:
        n = todo.pop()
        out.append(n)
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))
    return out


def _fresh_kind(value: ast.AST, resolve: Callable[[str], Any]) -> str | None:
    """"zeros" / "fresh" if ``value`` makes a new tensor nothing else refers to."""
    if isinstance(value, ast.BinOp):
        return "fresh"  # tensor arithmetic (out = x * 2) allocates its result
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
        return None
    attr, base = value.func.attr, value.func.value
    if any(k.arg in ("out", None) for k in value.keywords):
        return None  # out= writes into (aliases) another tensor; **kwargs could hold it
    if isinstance(base, ast.Name) and resolve(base.id) is torch:
        return "zeros" if attr in ZEROS_FNS else "fresh" if attr in FRESH_FNS else None
    if attr in FRESH_METHODS:
        return "zeros" if attr in ZEROS_METHODS else "fresh"
    return None


def _plan(fn_def: ast.FunctionDef, loop: ast.For, block: list[ast.stmt], pos: int,
          resolve: Callable[[str], Any], local: set[str]) -> _Plan:
    """Prove ``loop`` (``block[pos]``) is the combine idiom; raise _Reject(why) if not."""
    it = loop.iter
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
            and "range" not in local and resolve("range") is range and not it.keywords
            and (len(it.args) == 1 or (len(it.args) == 2 and isinstance(it.args[0], ast.Constant)
                                       and it.args[0].value == 0 and type(it.args[0].value) is int))):
        raise _Reject("not a loop over range(n)")
    if not isinstance(loop.target, ast.Name):
        raise _Reject("the loop variable is not a plain name")
    var = loop.target.id
    if loop.orelse:
        raise _Reject("the loop has an else clause")
    if len(loop.body) != 1:
        raise _Reject(f"the loop body has {len(loop.body)} statements (one expected)")
    stmt = loop.body[0]
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add):
        target, prod = stmt.target, stmt.value
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, ast.BinOp) \
            and isinstance(stmt.value.op, ast.Add):
        target = stmt.targets[0]
        left, right = stmt.value.left, stmt.value.right
        if ast.dump(left) == ast.dump(target).replace("Store()", "Load()"):
            prod = right
        elif ast.dump(right) == ast.dump(target).replace("Store()", "Load()"):
            prod = left
        else:
            raise _Reject("loop body is not out[idx[i]] = out[idx[i]] + gates[i] * x[i]")
    else:
        raise _Reject("loop body is not out[idx[i]] += gates[i] * x[i]")
    if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)):
        raise _Reject("the accumulated target is not out[...] of a named tensor")
    out = target.value.id
    idx = _row_index(target.slice, var, resolve)
    if not (isinstance(prod, ast.BinOp) and isinstance(prod.op, ast.Mult)):
        raise _Reject("the added value is not gates[i] * x[i]")
    a, b = _sub_of(prod.left, var), _sub_of(prod.right, var)
    if len({out, idx, a, b, var}) != 5:
        raise _Reject("out, the index, the two factors and the loop variable must be distinct names")
    for stmt_ in _own_nodes(fn_def):
        if isinstance(stmt_, (ast.Global, ast.Nonlocal)) and set(stmt_.names) & {out, idx, a, b}:
            raise _Reject("a name is declared global/nonlocal")

    # out: created fresh in this block before the loop, untouched in between.
    for j in range(pos - 1, -1, -1):
        s = block[j]
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
                and s.targets[0].id == out:
            kind = _fresh_kind(s.value, resolve)
            if kind is None:
                raise _Reject(f"{out} is not a fresh tensor (torch.zeros(...), x.new_zeros(...), "
                              f"...): it could alias the loop's inputs")
            return _Plan(loop, out, idx, a, b, zeros=(kind == "zeros"))
        if any(n.id == out for n in _names(s)):
            raise _Reject(f"{out} is used between its creation and the loop")
    raise _Reject(f"{out} is not created just before the loop in the same block "
                  f"(out = torch.zeros(...)): it could alias the loop's inputs")


_TEMPLATE = """
{n} = {bound}
{r} = {helper}({out}, {idx}, {a}, {b}, {n}, {zeros})
if {r} is None:
    for {var} in range({n}):
        pass
else:
    {out} = {r}
"""
_SET_VAR = """
if {n} > 0:  # where Python leaves the loop variable
    {var} = {n} - 1"""


def _replacement(plan: _Plan, k: int, helper: str, var_read_elsewhere: bool) -> list[ast.stmt]:
    loop = plan.loop
    n, r = f"_opreg_n{k}", f"_opreg_r{k}"
    src = _TEMPLATE.format(n=n, r=r, helper=helper, out=plan.out, idx=plan.idx, a=plan.a,
                           b=plan.b, zeros=plan.zeros, var=loop.target.id, bound="None")
    if var_read_elsewhere:
        src += _SET_VAR.format(n=n, var=loop.target.id).replace("\n", "\n    ")
    stmts = ast.parse(src).body
    for s in stmts:  # the new code sits at the loop's line, for tracebacks
        for node in ast.walk(s):
            ast.copy_location(node, loop)
    stmts[0].value = loop.iter.args[-1]          # the user's bound, evaluated once
    stmts[2].body[0].body = loop.body            # the fallback: the user's loop, verbatim
    return stmts


class _Rewriter:
    def __init__(self, fn_def: ast.FunctionDef, resolve: Callable[[str], Any], qualname: str,
                 file: str, lines: list[str]) -> None:
        self.fn_def, self.resolve, self.qualname = fn_def, resolve, qualname
        self.file, self.lines = file, lines
        self.findings: list[LoopFinding] = []
        self.plans: list[tuple[list[ast.stmt], int, _Plan]] = []
        self.local = self._locals()

    def _locals(self) -> set[str]:
        a = self.fn_def.args
        names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
        for n in _own_nodes(self.fn_def):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
        return names

    def scan(self) -> None:
        self._scan_block(self.fn_def.body)

    def _scan_block(self, block: list[ast.stmt]) -> None:
        for pos, s in enumerate(block):
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(s, ast.For) and self._candidate(s):
                code = self.lines[s.body[0].lineno - 1].strip() if s.body and \
                    s.body[0].lineno - 1 < len(self.lines) else ""
                try:
                    plan = _plan(self.fn_def, s, block, pos, self.resolve, self.local)
                except _Reject as e:
                    self.findings.append(LoopFinding(self.qualname, self.file, s.lineno, code, False, str(e)))
                else:
                    self.plans.append((block, pos, plan))
                    self.findings.append(LoopFinding(self.qualname, self.file, s.lineno, code, True))
                    continue
            for field in ("body", "orelse", "finalbody"):
                sub = getattr(s, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    self._scan_block(sub)
            for h in getattr(s, "handlers", []) or []:
                self._scan_block(h.body)

    @staticmethod
    def _candidate(loop: ast.For) -> bool:
        """A range loop that accumulates into a subscript (x[..] += .., x[..] = .. + ..):
        worth a finding, match or not."""
        it = loop.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"):
            return False
        for n in ast.walk(loop):
            if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add) \
                    and isinstance(n.target, ast.Subscript):
                return True
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Subscript) for t in n.targets) \
                    and isinstance(n.value, ast.BinOp) and isinstance(n.value.op, ast.Add):
                return True
        return False

    def apply(self, helper: str) -> None:
        # Replace from the end of each block so positions stay valid.
        for k, (block, pos, plan) in sorted(enumerate(self.plans), key=lambda e: -e[1][1]):
            var = plan.loop.target.id
            inside = {id(n) for n in ast.walk(plan.loop)}
            elsewhere = any(isinstance(n, ast.Name) and n.id == var and id(n) not in inside
                            for n in _own_nodes(self.fn_def))
            block[pos:pos + 1] = _replacement(plan, k, helper, elsewhere)


# ================================================================ whole functions

_HELPER = "_opreg_loop_combine"


def _source_of(fn: Callable[..., Any]) -> tuple[ast.FunctionDef, str, list[str]] | str:
    """(def, file, lines) of ``fn``'s source, or why it can't be had."""
    if hasattr(fn, "__wrapped__"):
        return "it is decorated"
    try:
        lines, first = inspect.getsourcelines(fn)
        file = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except (OSError, TypeError):
        return "its source is not available (exec'd or compiled code)"
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
    g = fn.__globals__
    closure = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))

    def resolve(name: str) -> Any:
        if name in closure:
            return closure[name]
        if name in g:
            return g[name]
        return getattr(builtins, name, None)

    return resolve


def find_loops(fn: Callable[..., Any]) -> list[LoopFinding]:
    """The loops :func:`optimize` would rewrite in ``fn`` (matched) or leave (with why)."""
    got = _source_of(fn)
    if isinstance(got, str):
        return []
    fn_def, file, lines = got
    rw = _Rewriter(fn_def, _resolver(fn), fn.__qualname__, file, lines)
    rw.scan()
    return rw.findings


def _rewrite_function(fn: Callable[..., Any]) -> tuple[Callable[..., Any] | None, list[LoopFinding], str]:
    """(rewritten fn or None, findings, why not rewritten)."""
    got = _source_of(fn)
    if isinstance(got, str):
        return None, [], got
    fn_def, file, lines = got
    if fn_def.decorator_list:
        return None, [], "it is decorated"
    if any((isinstance(n, ast.Name) and n.id.startswith("__") and not n.id.endswith("__"))
           or (isinstance(n, ast.Attribute) and n.attr.startswith("__") and not n.attr.endswith("__"))
           for n in ast.walk(fn_def)):
        return None, [], "it uses private (name-mangled) names"
    rw = _Rewriter(fn_def, _resolver(fn), fn.__qualname__, file, lines)
    rw.scan()
    if not rw.plans:
        return None, rw.findings, "no loop to rewrite"
    used = {n.id for n in ast.walk(fn_def) if isinstance(n, ast.Name)}
    if _HELPER in used or any(u.startswith("_opreg_") for u in used):
        return None, rw.findings, "it already uses _opreg_ names"
    rw.apply(_HELPER)
    # Annotations stay the original's (set below): evaluating them here could fail (names
    # imported under TYPE_CHECKING, postponed evaluation in the user's module).
    a = fn_def.args
    for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
        if arg is not None:
            arg.annotation = None
    fn_def.returns = None
    # def factory(helper, *free vars): def fn(...): ...; return fn  -- so the new function
    # sees the original's closure (incl. __class__ for super()) and the helper, while its
    # globals stay the original module's (live) namespace.
    free = list(fn.__code__.co_freevars)
    factory = ast.FunctionDef(
        name="_opreg_factory",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=a) for a in [_HELPER, *free]],
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
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    new = ns["_opreg_factory"](loop_combine, *cells)
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    new.__opreg_original__ = fn
    return new, rw.findings, ""


def _has_loop(fn: Callable[..., Any]) -> bool:
    """Does ``fn``'s bytecode loop? (Only such functions are worth a warning.)"""
    try:
        return any(i.opname == "FOR_ITER" for i in dis.get_instructions(fn))
    except TypeError:
        return True


def _warn_unavailable(fns: list[Callable[..., Any]], why: str) -> None:
    """One warning per optimize() call for functions with loops but no source, and
    never twice for the same function."""
    new = [f.__qualname__ for f in fns if f.__qualname__ not in _warned and _has_loop(f)]
    if not new:
        return
    _warned.update(new)
    msg = (f"opreg.optimize: {', '.join(new)} left as is: {why}; their loops can't be "
           f"rewritten (torch.compile still runs them)")
    logger.info(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _user_functions(cls: type) -> dict[str, Callable[..., Any]]:
    """Methods of ``cls`` (through its MRO) that user code defines: torch's own are skipped."""
    out: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        for name, f in vars(klass).items():
            if isinstance(f, types.FunctionType):
                out[name] = f
            elif name in out:
                del out[name]  # overridden by a non-function
    return {k: v for k, v in out.items() if getattr(cls, k, None) is v}


def rewrite_loops(model: torch.nn.Module) -> list[LoopFinding]:
    """Rewrite the loops of every submodule's methods in place (instance attributes);
    return the findings (matched and not). Idempotent."""
    findings: list[LoopFinding] = []
    rewritten: dict[Callable[..., Any], Callable[..., Any] | None] = {}
    unavailable: list[Callable[..., Any]] = []
    for mod in model.modules():
        done = getattr(mod, "_opreg_loops", None)
        if done is not None:
            findings.extend(done)
            continue
        mine: list[LoopFinding] = []
        for name, fn in _user_functions(type(mod)).items():
            if name in vars(mod):
                continue  # already replaced on this instance by someone
            if fn not in rewritten:
                new, found, why = _rewrite_function(fn)
                rewritten[fn] = new
                if new is None and why.startswith("its source"):
                    unavailable.append(fn)
                mine.extend(found)
            new = rewritten[fn]
            if new is not None:
                setattr(mod, name, types.MethodType(new, mod))
        mod._opreg_loops = mine  # type: ignore[assignment]
        findings.extend(mine)
    _warn_unavailable(unavailable, "the source is not available (exec'd or compiled code)")
    return findings


def optimize(model: T, *, compile: bool = True, dynamic: bool | None = None,
             mode: str | None = None, options: Mapping[str, Any] | None = None) -> T:
    """Rewrite ``model``'s loop idioms into opreg ops, then ``torch.compile`` it with the
    opreg backend (``dynamic``/``mode``/``options`` as for ``torch.compile``; see
    :mod:`opreg.backend` for options such as ``{"inner": "eager"}``).

    ``model``: an ``nn.Module`` (its methods are rewritten on the instance: parameters
    and the module itself stay the same objects) or a plain function (a rewritten copy
    is returned). ``compile=False`` only rewrites. Returns what to call.
    """
    from .backend import opreg_backend

    if isinstance(model, torch.nn.Module):
        found = rewrite_loops(model)
        target: Any = model
    elif isinstance(model, types.FunctionType):
        new, found, why = _rewrite_function(model)
        if new is None and why.startswith("its source"):
            _warn_unavailable([model], "the source is not available (exec'd or compiled code)")
        target = new or model
    else:
        raise TypeError(f"opreg.optimize takes an nn.Module or a function, got {type(model).__name__}")
    for f in found:
        if f.matched:
            logger.info("opreg.optimize: %s: loop rewritten to opreg::scatter_combine", f.where)
        else:
            logger.debug("opreg.optimize: %s: loop left as is: %s", f.where, f.reason)
    if not compile:
        return target
    kw: dict[str, Any] = {}
    if mode is not None:
        kw["mode"] = mode
    if options:
        kw["options"] = dict(options)
    return torch.compile(target, backend=opreg_backend, dynamic=dynamic, **kw)  # type: ignore[return-value]
