"""The patterns the backend runs, in order, and the hash Inductor's caches key on.

Built-in patterns are listed in ``opreg/patterns/__init__.py`` (``BUILTIN``); users add
theirs with :func:`register_pattern`. :func:`apply_patterns` runs them over one graph.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from opreg.patterns import BUILTIN

from .cache_key import framework_digest
from .fx_utils import meta_value
from .pattern import GraphPattern, PassContext
from .replacement import ReplacementPattern

__all__ = ["apply_patterns", "patterns_uuid", "register_pattern", "registered_patterns",
           "unregister_pattern"]

_lock = threading.RLock()
_user_patterns: dict[str, GraphPattern] = {}

def registered_patterns() -> list[GraphPattern]:
    """Every pattern, in the order they run: the built-ins, then user ones by registration."""
    with _lock:
        return list(BUILTIN) + list(_user_patterns.values())


def register_pattern(pattern: GraphPattern | Callable[..., Any],
                     replacement: Callable[..., Any] | None = None, *, name: str | None = None,
                     check: Callable[[dict[str, Any]], bool] | None = None,
                     op: str | None = None) -> GraphPattern:
    """Add a pattern to the opreg backend (for every later compile; a name already
    registered raises ValueError: :func:`unregister_pattern` it first).

    Either a :class:`GraphPattern` instance, or a reference computation and its
    replacement as two functions with the same parameters::

        opreg.register_op("scaled_tanh", "(Tensor x, float s) -> Tensor")(
            lambda x, s: torch.tanh(x) * s)

        def search(x):                      # how models write it
            return torch.tanh(x) * 2.0
        def replacement(x):
            return torch.ops.opreg.scaled_tanh(x, 2.0)

        opreg.backend.register_pattern(search, replacement, name="scaled_tanh",
                                       check=lambda v: v["x"].dtype == torch.float32)

    ``check`` gets ``{parameter: fake tensor or value}`` of a match and returns whether
    to rewrite it. Inductor's caches are keyed on the functions' source (see
    :func:`patterns_uuid`), so editing them never serves stale compiled code.
    """
    if isinstance(pattern, GraphPattern):
        if replacement is not None or check is not None:
            raise TypeError("opreg: register_pattern(GraphPattern) takes no replacement/check")
        obj = pattern
    else:
        if replacement is None:
            raise TypeError("opreg: register_pattern(search, replacement): replacement missing")
        obj = ReplacementPattern(name or getattr(pattern, "__name__", "pattern"), pattern,
                                 replacement, check=check, op=op)
    with _lock:
        if obj.name in _user_patterns or obj.name in {p.name for p in BUILTIN}:
            raise ValueError(f"opreg: a pattern named {obj.name!r} is already registered")
        _user_patterns[obj.name] = obj
    return obj


def unregister_pattern(name: str) -> None:
    """Remove a pattern added with :func:`register_pattern`."""
    with _lock:
        if name not in _user_patterns:
            raise ValueError(f"opreg: no user pattern named {name!r}; "
                             f"user patterns: {sorted(_user_patterns)}")
        del _user_patterns[name]


def patterns_uuid(patterns: Sequence[GraphPattern] | None = None) -> str:
    """What Inductor's caches key on: the framework's files, and per pattern its name
    and :meth:`~GraphPattern.uuid` (its sources and every opreg module they use, op
    specs included), so an edit of any of them never serves a stale cache entry."""
    h = hashlib.sha256(framework_digest().encode())
    for p in registered_patterns() if patterns is None else patterns:
        h.update(f"{p.name}:{p.uuid()};".encode())
    return h.hexdigest()


# ========================================================================= running them

def apply_patterns(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *,
                   only: Iterable[str] | None = None) -> PassContext:
    """Run the registered patterns (or those named in ``only``) over ``gm`` in place.

    ``gm`` is normally a Dynamo graph, whose nodes carry fake values. For any other
    graph without them, ``example_inputs`` are propagated through it first (as fakes).
    Returns the :class:`PassContext`: ``.rewrites`` and ``.findings``.
    """
    pats = registered_patterns()
    if only is not None:
        only = list(only)
        unknown = set(only) - {p.name for p in pats}
        if unknown:
            raise ValueError(f"opreg: unknown pattern(s) {sorted(unknown)}; "
                             f"registered: {[p.name for p in pats]}")
        pats = [p for p in pats if p.name in only]
    ctx = PassContext(gm)
    if ctx.fake_mode is None and example_inputs is not None and _needs_values(gm):
        ctx.fake_mode = _propagate_fakes(gm, example_inputs)
    for p in pats:
        p.apply(gm, ctx)
    if ctx.rewrites:
        gm.graph.lint()
        gm.recompile()
    return ctx


def _needs_values(gm: fx.GraphModule) -> bool:
    return any(meta_value(n) is None for n in gm.graph.nodes if n.op == "placeholder")


def _propagate_fakes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) and not hasattr(x, "fake_mode")
             else x for x in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return mode
