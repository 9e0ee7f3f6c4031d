"""Seeing through decorators: a ``functools.wraps`` wrapper that holds the function it wraps
in one closure variable can be rebuilt around another function (same code, globals,
defaults, the rest of its closure shared), so the decorator still does what it did."""
from __future__ import annotations

import types
from typing import Any, Callable

__all__ = ["rebuild", "rewrap", "wrapped"]


def wrapped(wrapper: Callable[..., Any]) -> tuple[Callable[..., Any], int] | str:
    """(the function a ``functools.wraps`` wrapper wraps, the index of the closure cell
    holding it), or why the decorator can't be seen through."""
    inner = wrapper.__wrapped__
    if not isinstance(wrapper, types.FunctionType) or not isinstance(inner, types.FunctionType):
        return "it is decorated (by something other than a plain function wrapper)"
    held = []
    for i, cell in enumerate(wrapper.__closure__ or ()):
        try:
            if cell.cell_contents is inner:
                held.append(i)
        except ValueError:  # an empty cell
            continue
    if len(held) != 1:
        return "it is decorated (the wrapper does not hold the function in one closure variable)"
    return inner, held[0]


def rewrap(wrapper: Callable[..., Any], inner: Callable[..., Any]) -> Callable[..., Any] | str:
    """``wrapper`` (a ``functools.wraps`` decorator's function) rebuilt to call ``inner``
    where it called the function it wraps; or why it can't be (a str)."""
    got = wrapped(wrapper) if hasattr(wrapper, "__wrapped__") else "it is not decorated"
    return got if isinstance(got, str) else rebuild(wrapper, got[1], inner)


def rebuild(wrapper: Callable[..., Any], cell: int, inner: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` as it is, but calling ``inner`` through closure cell ``cell``."""
    closure = list(wrapper.__closure__ or ())
    closure[cell] = types.CellType(inner)
    new = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__,
                             wrapper.__defaults__, tuple(closure))
    new.__kwdefaults__ = wrapper.__kwdefaults__
    new.__dict__.update(wrapper.__dict__)  # what functools.wraps copied, __wrapped__ included
    new.__qualname__, new.__module__, new.__doc__ = wrapper.__qualname__, wrapper.__module__, wrapper.__doc__
    new.__annotations__ = dict(getattr(wrapper, "__annotations__", {}))
    new.__wrapped__ = inner
    new.__opreg_original__ = wrapper
    return new
