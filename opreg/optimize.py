"""``opreg.optimize(model)``: rewrite the Python loops Dynamo can't trace into opreg ops
(:mod:`opreg.loops`: each idiom proves from the source that the rewrite changes nothing
observable, and guards at run time), then ``torch.compile`` with the opreg backend.
"""
from __future__ import annotations

import types
from typing import Any, Mapping, TypeVar

import torch

from ._log import logger
from .loops import LoopFinding, find_loops, rewrite_function, rewrite_loops
from .loops.scatter_combine import loop_combine

__all__ = ["LoopFinding", "find_loops", "loop_combine", "optimize", "rewrite_loops"]

T = TypeVar("T")
# The backend by its registered name (the torch_dynamo_backends entry point, or
# opreg.compile.backend's registration): Dynamo resolves it when it compiles, so
# importing opreg doesn't import the compile stack.
BACKEND = "opreg"


def optimize(model: T, *, compile: bool = True, dynamic: bool | None = None,
             mode: str | None = None, options: Mapping[str, Any] | None = None) -> T:
    """Rewrite ``model``'s loop idioms into opreg ops, then ``torch.compile`` it with the
    opreg backend (``dynamic``/``mode``/``options`` as for ``torch.compile``; see
    :mod:`opreg.backend` for options such as ``{"inner": "eager"}``).

    ``model``: an ``nn.Module`` (its methods are rewritten on the instance: parameters
    and the module itself stay the same objects) or a plain function (a rewritten copy
    is returned). ``compile=False`` only rewrites. Returns what to call.
    """
    if isinstance(model, torch.nn.Module):
        found = rewrite_loops(model)
        target: Any = model
    elif isinstance(model, types.FunctionType):
        target, found = rewrite_function(model)
    else:
        raise TypeError(f"opreg.optimize: model must be an nn.Module or a function, "
                        f"got {type(model).__name__}")
    for f in found:
        if f.matched:
            logger.info("opreg.optimize: %s: loop rewritten to %s", f.where, f.op)
        else:
            logger.debug("opreg.optimize: %s: loop left as is: %s", f.where, f.reason)
    if not compile:
        return target
    kw: dict[str, Any] = {}
    if mode is not None:
        kw["mode"] = mode
    if options:
        kw["options"] = dict(options)
    return torch.compile(target, backend=BACKEND, dynamic=dynamic, **kw)  # type: ignore[return-value]
