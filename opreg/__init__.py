"""opreg: a pluggable operator registry with fused kernels and a torch.compile backend.

>>> import opreg
>>> out = opreg.get("scatter_combine")(expert_hidden, token_idx, gates, num_tokens)
>>> y = opreg.get("cat_linear")([x0, x1, x2], weight, bias)

Every op is also ``torch.ops.opreg.<name>``. See :mod:`opreg.registry` for how
implementations are chosen, and the README for the list of ops.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Sequence

import torch

from . import ops as _ops  # noqa: F401  (defines torch.ops.opreg.*)
from ._build import BuildError
from ._log import logger
from ._version import __version__
from .optimize import optimize  # eager: the function shadows its submodule's name
from .registry import Impl, autograd_kind, bound, get, implementations, use
from .registry import add_impl as _add_impl
from .registry import define_op as _define_op
from .registry import remove_impl as unregister_impl

__all__ = [
    "BuildError", "Impl", "__version__", "autograd_kind", "bound", "check_indices", "get",
    "implementations", "logger", "optimize", "register_impl", "register_op", "unregister_impl", "use",
]


def register_impl(op: str, name: str, *, devices: Sequence[str] = ("cpu", "cuda"),
                  priority: int = 10, dtypes: Sequence[torch.dtype] | None = None,
                  train: Callable[..., Any] | None = None
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: add a Python implementation ``name`` of ``op``.

    It runs when asked for (``get(op, impl=name)``, ``use(op=name)``), or by default on
    ``devices`` if its ``priority`` beats the built-ins (100; the reference is 0).
    With ``dtypes``, other dtypes go to the reference. Duplicate names raise ValueError.
    ``train`` (ops whose gradients are their reference's, e.g. from :func:`register_op`):
    where a call that gradients can flow through binds this implementation, ``train(*args)``
    runs it recording its own backward (an ``autograd.Function``; returns the output), or
    returns None where it does not take those arguments (the reference's gradients then).
    """
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _add_impl(op, Impl(name, op, tuple(devices), priority, fn=fn,
                           dtypes=frozenset(dtypes) if dtypes else None, train=train))
        return fn

    return deco


def register_op(name: str, schema: str, *, fake: Callable[..., Any] | None = None
                ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: define a new op ``torch.ops.opreg.<name>`` whose meaning (and first
    implementation, ``reference``) is the decorated plain-PyTorch function.

    ``schema`` is the signature, e.g. ``"(Tensor x, float alpha) -> Tensor"``. Gradients
    are those of the reference. Duplicate names raise ValueError.
    """
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _define_op(name, schema, fn, fake=fake)
        return fn

    return deco


@contextlib.contextmanager
def check_indices(enabled: bool = True) -> Iterator[None]:
    """Validate scatter_combine's token_idx on CUDA too (raises IndexError; synchronises).

    CPU kernels and the reference always check. The CUDA kernel, unchecked by default,
    never writes out of bounds: it skips out-of-range rows. Sets ``OPREG_CHECK_INDICES``.
    """
    old = os.environ.get("OPREG_CHECK_INDICES")
    os.environ["OPREG_CHECK_INDICES"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OPREG_CHECK_INDICES", None)
        else:
            os.environ["OPREG_CHECK_INDICES"] = old
