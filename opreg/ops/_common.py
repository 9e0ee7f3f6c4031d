"""What every op spec shares: dtype sets, the :class:`Reason` a spec's ``unsupported``
returns, and the registration of a built-in op.

An op's spec (``opreg/ops/<op>.py``) says once what fits the op: ``unsupported(...)``
returns a :class:`Reason` (a message that also knows its exception type) or None. The
op's ``check`` raises it; a pattern or loop idiom reports it as the reason it left the
user's code alone. The rules mirror the op's C++ checks where it has C++ kernels
(``backends/common/<op>_checks.h``: same exception types, same wording), so an op fails
the same way whichever implementation runs: shapes and devices raise ValueError, dtypes
TypeError, out-of-range indices IndexError.

Sizes may be SymInts. ``holds(cond)`` turns a size comparison into a bool: plain ``bool``
at run time (a guard is fine there); a pattern passes a guard-free "provably true".
"""
from __future__ import annotations

from typing import Any, Callable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

Holds = Callable[[Any], bool]


class Reason(str):
    """Why inputs don't fit an op: the message, and the exception ``check`` raises."""

    exc: type[Exception]

    def __new__(cls, exc: type[Exception], message: str) -> "Reason":
        self = super().__new__(cls, message)
        self.exc = exc
        return self

    def raise_(self) -> None:
        raise self.exc(str(self))


def first(*reasons: Callable[[], Reason | None]) -> Reason | None:
    """The first rule (a thunk) that fails, or None."""
    for r in reasons:
        got = r()
        if got is not None:
            return got
    return None


def dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


_dt = dt  # older spelling


def not_float(op: str, arg: str, t: torch.Tensor) -> Reason | None:
    if t.dtype in FLOAT_DTYPES:
        return None
    return Reason(TypeError, f"{op}: {arg} must be float32, float16, bfloat16 or float64, got {dt(t)}")


def other_device(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> Reason | None:
    for name, t in others.items():
        if t.device != ref.device:
            return Reason(ValueError, f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")
    return None


def not_strided(op: str, **tensors: torch.Tensor) -> Reason | None:
    for name, t in tensors.items():
        if t.layout != torch.strided:
            return Reason(ValueError, f"{op}: {name} must be a dense (strided) tensor, got {t.layout}")
    return None


def raise_if(reason: Reason | None) -> None:
    if reason is not None:
        reason.raise_()


def define_builtin(name: str, schema: str, reference: Callable[..., Any],
                   fake: Callable[..., Any], differentiable: bool = True) -> None:
    """Define a built-in op with its C++ implementations: ``cpu`` (backends/cpu) and
    ``cuda`` (backends/cuda), both above the reference; C++ autograd (every device) from
    ``backends/autograd/<op>.cpp``, the ``opreg_autograd`` library."""
    from .. import _build, registry

    registry.define_op(name, schema, reference, fake=fake, differentiable=differentiable,
                       autograd_extension=_build.AUTOGRAD if differentiable else None)
    for impl, ext in (("cpu", _build.CPU), ("cuda", _build.CUDA)):
        registry.add_impl(name, registry.Impl(impl, name, (impl,), priority=100, extension=ext))
