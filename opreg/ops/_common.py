"""Argument checks shared by the references and fake kernels.

They mirror ``backends/common/checks.h`` (same exception types, same wording), so an
op fails the same way whichever implementation runs: shapes and devices raise
ValueError, dtypes TypeError, out-of-range indices IndexError.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def require(cond: bool, exc: type[Exception], msg: str) -> None:
    if not cond:
        raise exc(msg)


def check_float(op: str, arg: str, t: torch.Tensor) -> None:
    require(t.dtype in FLOAT_DTYPES, TypeError,
            f"{op}: {arg} must be float32, float16, bfloat16 or float64, got {_dt(t)}")


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        require(t.device == ref.device, ValueError,
                f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def define_builtin(name: str, schema: str, reference: Callable[..., Any],
                   fake: Callable[..., Any], differentiable: bool = True) -> None:
    """Define a built-in op with its C++ implementations: ``cpu`` (backends/cpu) and
    ``cuda`` (backends/cuda), both above the reference; C++ autograd from the host library."""
    from .. import _build, registry

    registry.define_op(name, schema, reference, fake=fake, differentiable=differentiable,
                       autograd_extension=_build.CPU if differentiable else None)
    for impl, ext in (("cpu", _build.CPU), ("cuda", _build.CUDA)):
        registry.add_impl(name, registry.Impl(impl, name, (impl,), priority=100, extension=ext))
