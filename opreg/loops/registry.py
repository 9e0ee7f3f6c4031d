"""The registered loop idioms, tried in order on every loop :func:`opreg.optimize` sees,
and the module rewrites, tried first on every module it sees."""
from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable, Optional

import torch

from .._log import logger
from .idiom import LoopFinding, LoopIdiom

__all__ = ["ModuleRewrite", "register_loop_idiom", "register_module_rewrite", "registered_loop_idioms",
           "registered_module_rewrites", "unregister_loop_idiom", "unregister_module_rewrite"]

_IDIOMS: dict[str, LoopIdiom] = {}


def register_loop_idiom(idiom: LoopIdiom) -> LoopIdiom:
    """Add ``idiom`` after those registered; loops it proves are rewritten from now on
    (modules already rewritten stay as they are). Returns it. A name already taken
    raises ValueError."""
    if isinstance(idiom, LoopIdiom) and not idiom.name.isidentifier():  # it names generated helpers
        raise ValueError(f"register_loop_idiom: idiom.name must be an identifier, got {idiom.name!r}")
    return _add(_IDIOMS, idiom, LoopIdiom, "register_loop_idiom", "idiom", "a loop idiom")


def unregister_loop_idiom(name: str) -> None:
    """Remove the idiom ``name`` (KeyError naming it if there is none)."""
    _remove(_IDIOMS, name, "unregister_loop_idiom", "loop idiom")


def _add(table: dict[str, Any], item: Any, kind: type, caller: str, arg: str, what: str) -> Any:
    """``table[item.name] = item``, refusing another type or a name already taken."""
    if not isinstance(item, kind):
        raise TypeError(f"{caller}: {arg} must be a {kind.__name__}, got {type(item).__name__}")
    if item.name in table:
        raise ValueError(f"{caller}: {what} named {item.name!r} is already registered")
    table[item.name] = item
    return item


def _remove(table: dict[str, Any], name: str, caller: str, what: str) -> None:
    if name not in table:
        raise KeyError(f"{caller}: no {what} named {name!r}")
    del table[name]


def registered_loop_idioms() -> list[LoopIdiom]:
    """The idioms tried on each loop, in order (the first that proves it wins)."""
    return list(_IDIOMS.values())


# ===================================================================== module rewrites

@dataclasses.dataclass(frozen=True)
class ModuleRewrite:
    """An integration's rewrite of a library's module class: ``check(module)`` returns the
    (matched) finding to report when it takes ``module``, else None; ``apply(module)`` then
    replaces the module's method on the instance. Tried before the loop idioms; a module it
    takes keeps the rest of its methods to them. ``check`` must decline a module whose method
    is already replaced on the instance (someone's hook, such as accelerate's)."""

    name: str
    op: str                                                      # the op the module then runs
    check: Callable[[torch.nn.Module], Optional[LoopFinding]]
    apply: Callable[[torch.nn.Module], None]
    note: str = ""                                               # for explain: what it does instead


_MODULE_REWRITES: dict[str, ModuleRewrite] = {}
# Libraries with an opreg integration that registers module rewrites: loaded only when the
# program has imported the library itself (opreg never imports it).
_INTEGRATIONS = {"transformers": "opreg.integrations.transformers"}
_FAILED: set[str] = set()


def register_module_rewrite(rewrite: ModuleRewrite) -> ModuleRewrite:
    """Add ``rewrite`` (a name already taken raises ValueError). Returns it."""
    return _add(_MODULE_REWRITES, rewrite, ModuleRewrite, "register_module_rewrite", "rewrite",
                "a module rewrite")


def unregister_module_rewrite(name: str) -> None:
    """Remove the module rewrite ``name`` (KeyError naming it if there is none)."""
    _remove(_MODULE_REWRITES, name, "unregister_module_rewrite", "module rewrite")


def registered_module_rewrites() -> list[ModuleRewrite]:
    """The module rewrites, in order, after loading the integrations of the libraries the
    program has imported."""
    for library, integration in _INTEGRATIONS.items():
        if library in sys.modules and integration not in sys.modules and integration not in _FAILED:
            try:
                importlib.import_module(integration)
            except ImportError as e:  # a version of the library the integration can't use
                _FAILED.add(integration)
                logger.warning("opreg: %s not loaded (%s): opreg.optimize leaves %s's modules to the "
                               "loop idioms", integration, e, library)
    return list(_MODULE_REWRITES.values())
