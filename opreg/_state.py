"""The registry's state and its two types, shared by :mod:`opreg.registry` (defining ops,
the public API) and :mod:`opreg._binding` (putting implementations into the dispatcher).
Every container is mutated in place, never rebound, under ``_lock``."""
from __future__ import annotations

import contextvars
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import _build
from ._build import BuildError, Extension
from ._dispatch import NAMESPACE

DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
ANY_DEVICE = "*"

_lock = threading.RLock()
_defs = torch.library.Library(NAMESPACE, "FRAGMENT")


@dataclass
class Impl:
    """One implementation of an op.

    ``fn`` is a Python kernel with the op's signature; ``extension`` a kernel library
    whose ``TORCH_LIBRARY_IMPL`` registers the kernel itself. ``devices`` are device
    types (``"cpu"``, ``"cuda"``) or ``"*"`` for any. ``dtypes=None`` means all.
    ``train`` (ops whose autograd is the Python fallback's): where a call that gradients
    can flow through binds this implementation, a run with the op's arguments that records
    its own backward (returns the output), or None where it does not take them (the
    reference's gradients then).
    """

    name: str
    op: str
    devices: tuple[str, ...]
    priority: int
    fn: Callable[..., Any] | None = None
    extension: Extension | None = None
    dtypes: frozenset[torch.dtype] | None = None
    train: Callable[..., Any] | None = None

    def supports(self, device: str) -> bool:
        return ANY_DEVICE in self.devices or device in self.devices

    def unavailable(self, device: str | None = None) -> str | None:
        """Why this implementation can't run (on ``device``), or None if it can. Builds
        and loads nothing: a library not loaded yet is probed (a few stat calls) for a
        cache location it can't use or a missing toolchain."""
        if device is not None and not self.supports(device):
            return f"does not run on {device}"
        ext = self.extension
        if ext is None:
            return None
        state = _extensions.get(ext)
        if isinstance(state, BuildError):
            return str(state).splitlines()[0][:300]  # says what failed: build, load, cache
        if ext.cuda and torch.version.cuda is None:
            return "torch was built without CUDA"
        if ext.cuda and not torch.cuda.is_available():
            return "no CUDA device"
        return None if state is not None else _build.why_not(ext)


@dataclass
class Op:
    """A registered op: its schema, reference (the meaning) and implementations."""

    name: str
    schema: str
    reference: Callable[..., Any]
    impls: dict[str, Impl] = field(default_factory=dict)
    autograd_extension: Extension | None = None

    @property
    def torch_op(self) -> torch._ops.OpOverload:
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default


_ops: dict[str, Op] = {}
_extensions: dict[Extension, "os.PathLike[str] | BuildError"] = {}
_bound: dict[tuple[str, str], Impl] = {}            # (op, device) -> default impl there
_autograd: dict[str, str] = {}                      # op -> "cpp" | "python"
# The calling thread's/task's open use() scopes, innermost last.
_scope: contextvars.ContextVar[tuple[dict[str, str], ...]] = contextvars.ContextVar(
    "opreg_scope", default=())
_open: dict[str, int] = {}                          # op -> open scopes naming it, all threads
# op -> None: its router is live; a Library: the fallthrough covering it; absent: no router
_routers: dict[str, torch.library.Library | None] = {}
