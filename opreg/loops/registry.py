"""The registered loop idioms, tried in order on every loop :func:`opreg.optimize` sees."""
from __future__ import annotations

from .idiom import LoopIdiom

__all__ = ["register_loop_idiom", "registered_loop_idioms", "unregister_loop_idiom"]

_IDIOMS: dict[str, LoopIdiom] = {}


def register_loop_idiom(idiom: LoopIdiom) -> LoopIdiom:
    """Add ``idiom`` after those registered; loops it proves are rewritten from now on
    (modules already rewritten stay as they are). Returns it. A name already taken
    raises ValueError."""
    if not isinstance(idiom, LoopIdiom):
        raise TypeError(f"register_loop_idiom: idiom must be a LoopIdiom, got {type(idiom).__name__}")
    if not idiom.name.isidentifier():
        raise ValueError(f"register_loop_idiom: idiom.name must be an identifier, got {idiom.name!r}")
    if idiom.name in _IDIOMS:
        raise ValueError(f"register_loop_idiom: a loop idiom named {idiom.name!r} is already registered")
    _IDIOMS[idiom.name] = idiom
    return idiom


def unregister_loop_idiom(name: str) -> None:
    """Remove the idiom ``name`` (KeyError naming it if there is none)."""
    if name not in _IDIOMS:
        raise KeyError(f"unregister_loop_idiom: no loop idiom named {name!r}")
    del _IDIOMS[name]


def registered_loop_idioms() -> list[LoopIdiom]:
    """The idioms tried on each loop, in order (the first that proves it wins)."""
    return list(_IDIOMS.values())
