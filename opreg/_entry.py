"""The ops' C++ Python entries (``backends/autograd/python_entry.cpp``): what
:func:`opreg.get` returns for an op that has one.

An entry means exactly what ``torch.ops.opreg.<op>.default`` means (it calls the op through
the dispatcher) at less host cost: its arguments are parsed as torch's own bindings parse
theirs, not boxed by walking the schema. Calls with anything but plain eager tensors (a
``__torch_function__`` or ``__torch_dispatch__`` mode, fake or functional tensors) go to the
OpOverload itself; under ``torch.compile`` Dynamo traces the OpOverload in its place, so a
graph holds the op, never the entry.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from . import _build
from ._binding import direct, load
from ._dispatch import run_python
from ._log import logger
from ._state import Op, _extensions, _lock, _ops

_modules: dict[str, ModuleType] = {}   # extension name -> its module
_entries: dict[str, Callable[..., Any]] = {}  # op -> entry


def entry(op: Op) -> Callable[..., Any] | None:
    """``op``'s C++ entry, or None (no entry for it, or its library does not build here:
    the caller then hands out the OpOverload, whose first call reports why)."""
    fn = _entries.get(op.name)
    if fn is not None:
        return fn
    ext = op.autograd_extension
    if ext is None:
        return None
    with _lock:
        try:
            load(ext)
        except _build.BuildError:
            return None
        mod = _modules.get(ext.name) or _import(ext.name, Path(str(_extensions[ext])))
        if mod is None:
            return None
        fn = getattr(mod, op.name, None)
        if fn is None:
            return None
        mod.set_fallback(op.name, op.torch_op)
        _traced_as(fn, op.torch_op)
        _entries[op.name] = fn
        return fn


def _import(name: str, path: Path) -> ModuleType | None:
    """The loaded library ``path`` as a Python module (the same library: the dynamic loader
    hands back the handle torch.ops.load_library opened), or None if it has no module init
    (a third party's autograd library)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        return None
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError as e:  # no PyInit_<name>: not ours
        logger.debug("%s has no Python entries: %s", path, e)
        return None
    _modules[name] = mod
    return mod


def _traced_as(fn: Callable[..., Any], op: Any) -> None:
    """Make Dynamo trace ``op`` wherever ``fn`` is called (``fn`` is a C function: Dynamo
    would otherwise break the graph at it)."""
    import torch._dynamo  # the first entry handed out pays Dynamo's import (~0.7 s, dev box)

    def traced(*args: Any, **kwargs: Any) -> Any:
        return op(*args, **kwargs)

    torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(traced)


# ----------------------------------------------------------------------------- Python implementations


def python_call(op_name: str) -> Callable[..., Any]:
    """``torch.ops.opreg.<op_name>.default`` for callers that build its arguments themselves
    (positional, of the schema's types: an integration), with less host cost where the
    dispatcher would run a Python implementation: a plain eager call (:func:`opreg._dispatch.plain_eager`)
    calls it directly, as the op's router and device stub would (the calling scope's
    :func:`opreg.use` choice, else the device's bound default). Everything else -- a kernel
    library's implementation, a traced call, a mode, a subclass, a call that can carry a
    gradient, a running profiler -- goes through the OpOverload. Why: the two Python
    dispatcher crossings of a no-grad call (the autograd key's kernel, then the device stub)
    cost moe_experts 37-223 us of host per call on the H200 (``bench/moe_profile.py``,
    2026-12-02; 18 against 6.5 us on the 2-core box, ``bench/dispatch_overhead.py``), where
    an eager MoE block's forward waits on its host."""
    op = _ops[op_name]
    torch_op = op.torch_op

    def call(*args: Any) -> Any:
        impl = None if torch.compiler.is_compiling() else direct(op, args)  # the router's or stub's pick
        return torch_op(*args) if impl is None else run_python(op, impl, args)

    call.__name__ = call.__qualname__ = f"{op_name}[python_call]"
    return call
