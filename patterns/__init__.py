"""The built-in patterns of the opreg backend, one file per op, in the order they run."""
from __future__ import annotations

from . import cat_linear, scatter_combine

#: What :func:`opreg.backend.registered_patterns` starts with.
BUILTIN = (scatter_combine.PATTERN, cat_linear.PATTERN)

__all__ = ["BUILTIN", "cat_linear", "scatter_combine"]
