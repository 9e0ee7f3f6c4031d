"""Rewriting a model: every submodule's methods (:func:`rewrite_loops`), the registered
module rewrites first, then the loop idioms on each method's source; methods are replaced
on the instance, so parameters and the module itself stay the same objects, and
``module._opreg_loops`` lists what was found."""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

from .registry import ModuleRewrite, registered_module_rewrites
from .idiom import LoopFinding
from .rewriter import NO_SOURCE, try_rewrite, warn_unavailable

__all__ = ["module_findings", "rewrite_loops", "user_functions"]


def user_functions(cls: type) -> dict[str, Callable[..., Any]]:
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


def module_findings(mod: torch.nn.Module) -> list[LoopFinding]:
    """What the registered module rewrites would do to ``mod`` (the first that takes it)."""
    for r in registered_module_rewrites():
        found = r.check(mod)
        if found is not None:
            return [found]
    return []


def _rewrite_module(mod: torch.nn.Module, rewrites: list[ModuleRewrite]) -> list[LoopFinding]:
    """Apply the first module rewrite that takes ``mod``; its finding (or none)."""
    for r in rewrites:
        found = r.check(mod)
        if found is not None:
            r.apply(mod)
            return [found]
    return []


def _replaced(mod: torch.nn.Module, name: str) -> bool:
    """Is method ``name`` replaced on this instance (by anyone)? The class's own function,
    bound, is not a replacement."""
    v = vars(mod).get(name)
    return v is not None and not (isinstance(v, types.MethodType) and v.__func__ is getattr(type(mod), name, None))


def _still_rewritten(mod: torch.nn.Module) -> bool:
    """Are the methods opreg put on ``mod`` still there? A pickled module comes back with
    its class's own (pickle saves a method as its name), so it is rewritten again."""
    return all(hasattr(getattr(vars(mod).get(n), "__func__", None), "__opreg_original__")
               for n in getattr(mod, "_opreg_methods", ()))


def rewrite_loops(model: torch.nn.Module) -> list[LoopFinding]:
    """Rewrite the loops of every submodule's methods in place (instance attributes);
    return the findings (matched and not). Idempotent; a module saved with ``torch.save``
    and loaded again runs as written until this is called on it again."""
    findings: list[LoopFinding] = []
    rewritten: dict[Callable[..., Any], Callable[..., Any] | None] = {}
    unavailable: list[Callable[..., Any]] = []
    module_rewrites = registered_module_rewrites()
    for mod in model.modules():
        done = getattr(mod, "_opreg_loops", None)
        if done is not None and _still_rewritten(mod):
            findings.extend(done)
            continue
        for name in getattr(mod, "_opreg_methods", ()):
            vars(mod).pop(name, None)  # what unpickling left of them: the class's own
        mine = _rewrite_module(mod, module_rewrites)
        for name, fn in user_functions(type(mod)).items():
            if _replaced(mod, name):
                continue  # already replaced on this instance by someone
            if fn not in rewritten:
                new, found, why = try_rewrite(fn)
                rewritten[fn] = new
                if new is None and why == NO_SOURCE:
                    unavailable.append(fn)
                mine.extend(found)
            new = rewritten[fn]
            if new is not None:
                setattr(mod, name, types.MethodType(new, mod))
        mod._opreg_loops = mine  # type: ignore[assignment]
        mod._opreg_methods = tuple(n for n, v in vars(mod).items()  # type: ignore[assignment]
                                   if hasattr(getattr(v, "__func__", None), "__opreg_original__"))
        findings.extend(mine)
    warn_unavailable(unavailable)
    return findings
