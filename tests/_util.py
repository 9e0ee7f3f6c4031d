"""Test helpers: devices, and (from :mod:`opreg.testing`, re-exported) float64
comparisons with per-dtype tolerances and output poisoning."""
from __future__ import annotations

import pytest
import torch

from opreg.testing import TOL, assert_matches, map_tensors, poison

__all__ = ["DEVICES", "FLOAT_DTYPES", "TOL", "assert_matches", "poison", "set_requires_grad", "skip_without"]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def set_requires_grad(args: tuple, flag: bool) -> tuple:
    """``args`` with every floating tensor (in lists too) made a leaf requiring grad if
    ``flag``: what a ``sample_inputs(..., requires_grad=True)`` returns."""
    return map_tensors(lambda t: t.requires_grad_(flag) if t.is_floating_point() else t, args)
