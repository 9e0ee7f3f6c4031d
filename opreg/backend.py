"""opreg's ``torch.compile`` backend (the public face of :mod:`opreg.compile`).

    model = torch.compile(model, backend="opreg")
    opreg.backend.register_pattern(search, replacement)        # your own rewrite

See :mod:`opreg.compile.backend` for the options and where the passes run,
:mod:`opreg.compile.pattern` for writing a pattern class, and :mod:`opreg.compile.mutation`
for when a rewrite is refused as unsafe. This module is the entry point the
``torch_dynamo_backends`` entry point names (``opreg.backend:opreg_backend``).
"""
from __future__ import annotations

from .compile.backend import (BACKEND_NAME, _register_backend, inductor_config_patches,  # noqa: F401
                             opreg_backend, stats)
from .compile.fx_utils import op_counts
from .compile.pass_manager import (apply_patterns, patterns_uuid, register_pattern,
                                   registered_patterns, unregister_pattern)
from .compile.pattern import (Finding, GraphEditor, GraphPattern, Match, Miss, PassContext,
                              RewriteRejected)
from .compile.replacement import ReplacementPattern
from .compile.testing import RecordingBackend

__all__ = [
    "BACKEND_NAME", "Finding", "GraphEditor", "GraphPattern", "Match", "Miss", "PassContext",
    "RecordingBackend", "ReplacementPattern", "RewriteRejected", "apply_patterns",
    "inductor_config_patches", "op_counts", "opreg_backend", "patterns_uuid", "register_pattern",
    "registered_patterns", "stats", "unregister_pattern",
]
