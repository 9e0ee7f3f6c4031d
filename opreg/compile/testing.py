"""A backend for tests and pattern authors: the opreg backend, recording per graph the
ops before and after the passes and the findings."""
from __future__ import annotations

import collections
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from .backend import compile_inner, parse_options
from .fx_utils import op_counts
from .pass_manager import apply_patterns
from .pattern import Finding

__all__ = ["RecordingBackend", "op_counts"]


class RecordingBackend:
    """A backend for tests and pattern authors: the opreg backend, which also keeps,
    per graph Dynamo captures, the ops before and after the passes (``before``,
    ``after``: lists of :func:`op_counts`) and the findings. ``inner`` defaults to
    ``"eager"`` (no codegen)::

        rec = RecordingBackend()
        torch.compile(fn, backend=rec)(*args)
        assert rec.after[-1]["opreg::scatter_combine"] == 1
    """

    def __init__(self, inner: str = "eager", patterns: Sequence[str] | None = None,
                 options: Mapping[str, Any] | None = None) -> None:
        self.options = {**(options or {}), "inner": inner}
        if patterns is not None:
            self.options["patterns"] = list(patterns)
        self.before: list[collections.Counter[str]] = []
        self.after: list[collections.Counter[str]] = []
        self.findings: list[Finding] = []
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        inner, names, mode, opts, _ = parse_options(None, self.options)  # no timed choice here
        self.before.append(op_counts(gm))
        ctx = apply_patterns(gm, example_inputs, only=names)
        self.after.append(op_counts(gm))
        self.findings.extend(ctx.findings)
        self.graphs.append(gm)
        return compile_inner(gm, example_inputs, inner, names, mode, opts)

    @property
    def near_misses(self) -> list[Finding]:
        return [f for f in self.findings if not f.matched]
