"""The gate of a transformers experts module, as ``moe_experts`` arguments: proved from
what the module is, never by calling it (the transformers integration asks :func:`decision`
on every call).

The gate is recognised from what the module *is*, never by calling it (:func:`decision`):
its ``_apply_gate`` must be transformers' own function (found by its qualified name in its
module, by identity) whose source is one of the gate forms the op computes (split or
interleaved halves, optional clamps by a number, ``act(gate) * up`` or GPT-OSS's
``(up + 1) * gate * sigmoid(alpha * gate)``); ``alpha`` / ``limit`` are read from the
module's attributes the source names; the activation must be a known class (its own
``forward``, no parameters, buffers, submodules or hooks, no global module hooks) or a known
function by identity (:data:`_FUNCTIONS`, :data:`_ACT_RULES`). The decision is re-checked
on every call against what it read (the module's class and gate method, the activation
object, its type, forward and hook / parameter / buffer counts, alpha and limit): any change
re-decides. Under ``torch.compile`` the same check is traced, with no eager call needed
first (attribute reads, counts and identity tests; the gate method's form is computed at
trace time, once per function): Dynamo's guards on those reads recompile on a change.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import inspect
import math
import sys
import textwrap
import types
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.modules.module as _nn_module
from transformers import activations as hf_act

from ..ops import moe_experts as spec

__all__ = ["Plan", "decision", "plan_for"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The op's gate arguments for one experts module."""

    activation: str
    gated: bool
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = math.inf


# ----------------------------------------------------------------------------- activations
# What an activation object computes, from what it is. Equivalent means the same real
# function (transformers' Python formulas of GELU differ from torch's kernels by rounding
# only); a different constant (FastGELU's 0.7978845608), a clip, or another function
# (QuickGELU, Mish, ...) is not the op's activation, however close.

_FUNCTIONS: tuple[tuple[Any, str], ...] = (  # plain functions, by identity
    (F.silu, "silu"), (F.gelu, "gelu"), (F.relu, "relu"), (torch.relu, "relu"),
    (torch.sigmoid, "sigmoid"), (F.sigmoid, "sigmoid"),
)
_GELU_TANH = math.sqrt(2 / math.pi)


def _function_act(f: Any) -> Optional[str]:
    for known, name in _FUNCTIONS:
        if f is known:
            return name
    if type(f) is functools.partial and f.func is F.gelu and not f.args:  # GELUTanh's own act
        approximate = f.keywords.get("approximate", "none") if set(f.keywords) <= {"approximate"} else None
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)  # type: ignore[arg-type]
    return None


def _bound(f: Any, owner: Any, func: Any) -> bool:
    """Is ``f`` ``owner``'s own method ``func`` (bound to it)?"""
    return getattr(f, "__func__", None) is func and getattr(f, "__self__", None) is owner


@dataclasses.dataclass(frozen=True)
class _ActRule:
    """A known activation class: its forward (by identity), the instance attributes that
    forward reads, and what it computes from them (an op activation name, or None)."""

    cls: type
    forward: Callable[..., Any]
    reads: tuple[str, ...]
    name: Callable[[nn.Module], Optional[str]]


def _rules() -> tuple[_ActRule, ...]:
    def rule(cls_name: str, name: Callable[[nn.Module], Optional[str]], *reads: str,
             where: Any = hf_act) -> list[_ActRule]:
        cls = getattr(where, cls_name, None)  # absent in some transformers versions
        return [_ActRule(cls, cls.__dict__["forward"], reads, name)] \
            if isinstance(cls, type) and "forward" in cls.__dict__ else []

    def fixed(n: str) -> Callable[[nn.Module], Optional[str]]:
        return lambda act: n

    def hf_gelu(act: nn.Module) -> Optional[str]:
        a = act.__dict__.get("act")
        return "gelu" if a is F.gelu or _bound(a, act, getattr(hf_act.GELUActivation, "_gelu_python", None)) \
            else None

    def hf_gelu_tanh(act: nn.Module) -> Optional[str]:
        a = act.__dict__.get("act")
        if _bound(a, act, getattr(hf_act.GELUTanh, "_gelu_tanh_python", None)):
            return "gelu_tanh"
        return "gelu_tanh" if _function_act(a) == "gelu_tanh" else None

    def torch_gelu(act: nn.Module) -> Optional[str]:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.__dict__.get("approximate"))  # type: ignore[arg-type]

    def accurate(act: nn.Module) -> Optional[str]:
        c = act.__dict__.get("precomputed_constant")
        return "gelu_tanh" if type(c) is float and c == _GELU_TANH else None

    return tuple(
        rule("SiLUActivation", fixed("silu")) + rule("SiLU", fixed("silu"), where=nn)
        + rule("ReLU", fixed("relu"), where=nn) + rule("Sigmoid", fixed("sigmoid"), where=nn)
        + rule("ReLUSquaredActivation", fixed("relu2")) + rule("NewGELUActivation", fixed("gelu_tanh"))
        + rule("GELUActivation", hf_gelu, "act") + rule("GELUTanh", hf_gelu_tanh, "act")
        + rule("AccurateGELUActivation", accurate, "precomputed_constant")
        + rule("GELU", torch_gelu, "approximate", where=nn))


_ACT_RULES = _rules()
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_ACT_READS = tuple(sorted({n for r in _ACT_RULES for n in r.reads}))  # instance attributes the rules read


def _act_rule(act: nn.Module) -> Optional[_ActRule]:
    for r in _ACT_RULES:
        if isinstance(act, r.cls):
            return r
    return None


def _describe(act: Any) -> str:
    if isinstance(act, nn.Module):
        return type(act).__name__
    f = getattr(act, "__func__", act)
    return f"function {getattr(f, '__qualname__', None) or type(act).__name__}"


def _activation(act: Any, where: str) -> str:
    """The op activation ``act`` computes (a key of spec.ACTIVATIONS), or why it is not
    known to be one (any other string). Reads attributes only: ``act`` is never called."""
    if act is None:
        return f"it has no {where}"
    what = f"its {where} ({_describe(act)})"
    if not isinstance(act, nn.Module):
        name = _function_act(act)
        return name if name is not None else f"{what} is none of moe_experts' activations (known by identity)"
    if any(len(getattr(act, h)) for h in _MODULE_HOOKS):
        return f"{what} has hooks, which must see its calls"
    if any(len(getattr(_nn_module, h)) for h in _GLOBAL_HOOKS):
        return f"{what} is a module and global module hooks are registered, which must see its calls"
    if len(act._parameters) or len(act._buffers) or len(act._modules):
        return f"{what} has a parameter, buffer or submodule (state moe_experts would not use)"
    r = _act_rule(act)
    if r is None:
        return f"{what} is none of moe_experts' activations"
    t = type(act)
    if t.forward is not r.forward or "forward" in act.__dict__ or t.__call__ is not nn.Module.__call__ \
            or t._call_impl is not nn.Module._call_impl:
        return f"{what} overrides forward (or __call__) of {r.cls.__name__}"
    name = r.name(act)
    return name if name is not None else f"{what} is a {r.cls.__name__} computing none of moe_experts' activations"


# ----------------------------------------------------------------------------- the gate method
# A gate method's form, from its source: (interleaved, act, limit, alpha) with act
# ("module", attribute name) | ("op", activation name) | ("gpt_oss", ""), and limit /
# alpha None | ("attr", name) | ("const", number). A str is why the method is not one.

Form = tuple[bool, tuple[str, str], Optional[tuple[str, Any]], Optional[tuple[str, Any]]]
_UNGATED: Form = (False, ("module", "act_fn"), None, None)  # has_gate False: act_fn(up)
_FORMS: dict[Any, "Form | str"] = {}


class _NotAGate(Exception):
    pass


def _transformers_own(fn: Any) -> bool:
    """Is ``fn`` the function transformers defines under its qualified name (by identity)?"""
    mod, qual = getattr(fn, "__module__", None) or "", getattr(fn, "__qualname__", None) or ""
    if not isinstance(fn, types.FunctionType) or not mod.startswith("transformers.") or "<" in qual:
        return False
    obj: Any = sys.modules.get(mod)
    for part in qual.split("."):
        obj = vars(obj).get(part) if isinstance(obj, (type, types.ModuleType)) else None
    return obj is fn


class _Gate:
    """Evaluates a gate method's straight-line body into terms (tuples)."""

    def __init__(self, fn: types.FunctionType, self_name: str, arg: str) -> None:
        self.globals = fn.__globals__
        self.env: dict[str, Any] = {self_name: ("self",), arg: ("in",)}

    def fail(self, node: ast.AST) -> _NotAGate:
        return _NotAGate(ast.unparse(node))

    def term(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            if node.id in self.globals:
                return ("obj", self.globals[node.id])
            if hasattr(builtins, node.id):
                return ("obj", getattr(builtins, node.id))
            raise self.fail(node)
        if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (int, float)):
            return ("const", node.value)
        if isinstance(node, ast.Attribute):
            base = self.term(node.value)
            if base == ("self",):
                return ("attr", node.attr)
            if base[0] == "obj" and hasattr(base[1], node.attr):
                return ("obj", getattr(base[1], node.attr))
            return ("method", base, node.attr)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return ("neg", self.term(node.operand))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            return ("mul" if isinstance(node.op, ast.Mult) else "add", self.term(node.left), self.term(node.right))
        if isinstance(node, ast.Subscript):
            return self.half(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        raise self.fail(node)

    def half(self, node: ast.Subscript) -> Any:
        """x[..., ::2] / x[..., 1::2] of the input: its interleaved halves."""
        s = node.slice
        if self.term(node.value) == ("in",) and isinstance(s, ast.Tuple) and len(s.elts) == 2 \
                and isinstance(s.elts[0], ast.Constant) and s.elts[0].value is Ellipsis \
                and isinstance(s.elts[1], ast.Slice) and s.elts[1].upper is None:
            lo, step = s.elts[1].lower, s.elts[1].step
            first = lo.value if isinstance(lo, ast.Constant) else (0 if lo is None else None)
            if isinstance(step, ast.Constant) and step.value == 2 and first in (0, 1):
                return ("half", first, True)
        raise self.fail(node)

    def call(self, node: ast.Call) -> Any:
        f = self.term(node.func)
        args, kw = node.args, {k.arg: k.value for k in node.keywords}
        if any(isinstance(a, ast.Starred) for a in args) or None in kw:
            raise self.fail(node)
        if f[0] == "method" and f[2] == "chunk" and f[1] == ("in",) and args:
            dim = args[1] if len(args) == 2 else kw.get("dim")
            if len(args) + len(kw) == 2 and self.term(args[0]) == ("const", 2) and dim is not None \
                    and self.term(dim) in (("neg", ("const", 1)), ("const", -1)):
                return ("chunk",)
        if f[0] == "method" and f[2] == "clamp" and len(args) + len(kw) <= 2 and set(kw) <= {"min", "max"}:
            bounds = dict(zip(("min", "max"), args), **kw)
            lo, hi = (self.term(bounds[k]) if k in bounds else ("const", None) for k in ("min", "max"))
            return ("clamp", f[1], lo, hi)
        if len(args) == 1 and not kw:
            if f[0] == "obj" and _function_act(f[1]) is not None:
                return ("act", ("op", _function_act(f[1])), self.term(args[0]))
            if f[0] == "attr":  # self.<name>(x): the module's activation, checked per call
                return ("act", ("module", f[1]), self.term(args[0]))
        raise self.fail(node)

    def run(self, body: list[ast.stmt]) -> Any:
        for i, st in enumerate(body):
            if i == 0 and isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) \
                    and isinstance(st.value.value, str):
                continue  # the docstring
            if isinstance(st, ast.Return) and st.value is not None and i == len(body) - 1:
                return self.term(st.value)
            if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
                raise self.fail(st)
            target = st.targets[0]
            if isinstance(target, ast.Name):
                self.env[target.id] = self.term(st.value)
                continue
            if not (isinstance(target, ast.Tuple) and len(target.elts) == 2
                    and all(isinstance(t, ast.Name) for t in target.elts)):
                raise self.fail(st)
            value = self.term(st.value) if not isinstance(st.value, ast.Tuple) else \
                tuple(self.term(v) for v in st.value.elts)
            if value == ("chunk",):
                value = (("half", 0, False), ("half", 1, False))
            if not (isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, tuple) for v in value)):
                raise self.fail(st)
            for t, v in zip(target.elts, value):
                self.env[t.id] = v  # type: ignore[attr-defined]
        raise _NotAGate("no return at the end")


def _pairs(t: Any, op: str) -> list[tuple[Any, Any]]:
    """(a, b) and (b, a) of ``a op b`` (both commute exactly in floating point)."""
    return [(t[1], t[2]), (t[2], t[1])] if isinstance(t, tuple) and t and t[0] == op else []


def _number(t: Any) -> bool:
    return t[0] == "attr" or (t[0] == "const" and type(t[1]) in (int, float))


def _halves(gate: Any, up: Any) -> Optional[tuple[bool, Any]]:
    """(interleaved, limit) if ``gate``/``up`` are the input's halves, both clamped by one
    number (gate above, up both sides) or neither; else None."""
    if gate[0] == "half" and up[0] == "half":
        return (gate[2], None) if gate[1:] == (0, up[2]) and up[1] == 1 else None
    if gate[0] == "clamp" and up[0] == "clamp" and gate[2] == ("const", None) and _number(gate[3]) \
            and up[2] == ("neg", gate[3]) and up[3] == gate[3]:
        got = _halves(gate[1], up[1])
        return None if got is None or got[1] is not None else (got[0], gate[3])
    return None


def _match(ret: Any) -> Form:
    for a, up in _pairs(ret, "mul"):  # act(gate) * up
        if a[0] == "act":
            got = _halves(a[2], up)
            if got is not None:
                return (got[0], a[1], got[1], None)
    for left, right in _pairs(ret, "mul"):  # (up + 1) * (gate * sigmoid(gate * alpha))
        for up, one in _pairs(left, "add"):
            for gate, sig in _pairs(right, "mul"):
                if one not in (("const", 1), ("const", 1.0)) or sig[0] != "act" or sig[1] != ("op", "sigmoid"):
                    continue
                for g, alpha in _pairs(sig[2], "mul"):
                    got = _halves(gate, up) if g == gate and _number(alpha) else None
                    if got is not None:
                        return (got[0], ("gpt_oss", ""), got[1], alpha)
    raise _NotAGate("return: neither act(gate) * up nor GPT-OSS's (up + 1) * gate * sigmoid(gate * alpha)")


def _analyse(fn: Any) -> "Form | str":
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if not _transformers_own(fn):
        return f"its gate ({name}) is not transformers' own function"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return f"its gate ({name}) has no source to read"
    a = tree.args if isinstance(tree, ast.FunctionDef) else None
    if a is None or tree.decorator_list or len(a.args) != 2 or a.posonlyargs or a.vararg or a.kwonlyargs \
            or a.kwarg or a.defaults:
        return f"its gate ({name}) is not a plain method of one argument"
    try:
        return _match(_Gate(fn, a.args[0].arg, a.args[1].arg).run(tree.body))
    except _NotAGate as e:
        return f"its gate ({name}) is none of moe_experts' gates (at `{e}`)"
    except Exception as e:  # noqa: BLE001 - a name whose value can't be compared, ...: not proved
        return f"its gate ({name}) could not be read ({type(e).__name__}: {e})"


@torch.compiler.assume_constant_result  # Dynamo: computed at trace time, keyed on the function
def _gate_form(fn: Any) -> "Form | str":
    """The form of the gate method ``fn`` (once per function object), or why not one."""
    got = _FORMS.get(fn)
    if got is None:
        got = _FORMS[fn] = _analyse(fn)
    return got


# ----------------------------------------------------------------------------- the decision

def _value(module: nn.Module, t: Optional[tuple[str, Any]], what: str) -> "float | str | None":
    """The gate's ``what`` (alpha or limit) now, None if it has none, or why not a number."""
    if t is None:
        return None
    v = getattr(module, t[1], None) if t[0] == "attr" else t[1]
    # comparisons only (no math.isnan): under torch.compile v may be a symbolic float
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN
    if not ok or (what == "limit" and v == -math.inf) or (what == "alpha" and abs(v) == math.inf):
        where = f"self.{t[1]}" if t[0] == "attr" else "a constant"
        return f"its gate's {what} ({where}) is {v!r}, not a number moe_experts takes"
    return float(v)


def _form(module: nn.Module) -> "Form | str":
    if not getattr(module, "has_gate", True):
        return _UNGATED
    if "_apply_gate" in module.__dict__:
        return "its gate (_apply_gate) is replaced on the instance"
    return _gate_form(getattr(type(module), "_apply_gate", None))


def _decide(module: nn.Module) -> "Plan | str":
    """The module's gate as op arguments, or why it is not one (a str). Reads attributes
    only; calls nothing of the module's."""
    form = _form(module)
    if isinstance(form, str):
        return form
    interleaved, (kind, which), limit_t, alpha_t = form
    if kind == "module":
        act = _activation(getattr(module, which, None), which)
        if act not in spec.ACTIVATIONS:
            return act
    else:
        act = spec.GPT_OSS if kind == "gpt_oss" else which
    limit, alpha = _value(module, limit_t, "limit"), _value(module, alpha_t, "alpha")
    for v in (limit, alpha):
        if isinstance(v, str):
            return v
    gated = bool(getattr(module, "has_gate", True))
    return Plan(act, gated, interleaved, 1.0 if alpha is None else alpha, math.inf if limit is None else limit)


def _snapshot(module: nn.Module) -> tuple[Any, ...]:
    """Everything :func:`_decide` reads, by identity (objects) or value (numbers, counts:
    any change of a count re-decides)."""
    cls = type(module)
    key: list[Any] = [cls, getattr(cls, "_apply_gate", None), module.__dict__.get("_apply_gate"),
                      getattr(module, "has_gate", True)]
    form = _form(module)
    if not isinstance(form, str):
        _, (kind, which), limit_t, alpha_t = form
        for t in (limit_t, alpha_t):
            if t is not None and t[0] == "attr":
                key.append(getattr(module, t[1], None))
        if kind == "module":
            act = getattr(module, which, None)
            key += [act, type(act)]
            if isinstance(act, nn.Module):
                d = act.__dict__
                key += [getattr(type(act), "forward", None), d.get("forward"), *(d.get(n) for n in _ACT_READS),
                        len(act._forward_hooks) + len(act._forward_pre_hooks) + len(act._backward_hooks)
                        + len(act._backward_pre_hooks),
                        sum(len(getattr(_nn_module, h)) for h in _GLOBAL_HOOKS),
                        len(act._parameters) + len(act._buffers) + len(act._modules)]
    return tuple(key)


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and type(x) in (int, float, str, bool) and x == y) for x, y in zip(a, b))


class _Decided:
    """A module's cached decision and what it read (kept on the module, so nothing outside
    keeps the module alive; empty again after a copy or pickle: the copy re-decides)."""

    __slots__ = ("snapshot", "decision")

    def __init__(self, snapshot: tuple[Any, ...] = (), decision: "Plan | str | None" = None) -> None:
        self.snapshot, self.decision = snapshot, decision

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Decided, ())


def decision(module: nn.Module) -> "Plan | str":
    """:func:`_decide`, cached on the module and re-checked on every call against what it
    read. Under torch.compile it is traced instead (Dynamo's guards are the cache)."""
    if torch.compiler.is_compiling():
        return _decide(module)
    snap = _snapshot(module)
    hit = module.__dict__.get("_opreg_gate")
    if isinstance(hit, _Decided) and hit.decision is not None and _same(hit.snapshot, snap):
        return hit.decision
    got = _decide(module)
    module.__dict__["_opreg_gate"] = _Decided(snap, got)
    module.__dict__["_opreg_plan"] = got if isinstance(got, Plan) else None  # for inspection
    return got


def plan_for(module: nn.Module) -> Optional[Plan]:
    """The module's gate as op arguments now, or None: not provably one the op computes."""
    got = decision(module)
    return got if isinstance(got, Plan) else None
