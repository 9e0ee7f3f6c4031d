"""A pattern given as two plain functions, search and replacement (what
:func:`opreg.backend.register_pattern` makes of them)."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from .._log import logger
from .fx_utils import meta_value, order
from .pattern import GraphEditor, GraphPattern, Match, Miss, PassContext, RewriteRejected

__all__ = ["ReplacementPattern"]


class ReplacementPattern(GraphPattern):
    """A pattern given as plain functions: every occurrence of ``search``'s computation
    in the Dynamo graph is replaced by ``replacement``'s (same parameters).

    Matching is structural, via :func:`torch.fx.subgraph_rewriter.replace_pattern_with_filters`:
    ``search`` is traced with :func:`torch.fx.symbolic_trace`, so write it the way models
    spell the computation (``torch.relu(x)`` and ``x.relu()`` are different spellings:
    register one pattern per spelling). A match is only rewritten if every tensor bound to
    a parameter has a known value, all share one device, nothing between the match's
    first node and its last may write what it reads, and ``check`` (if given) returns
    True for ``{parameter name: fake tensor or value}``.
    """

    def __init__(self, name: str, search: Callable[..., Any], replacement: Callable[..., Any],
                 check: Callable[[dict[str, Any]], bool] | None = None, op: str | None = None) -> None:
        self.name = name
        self.op = op
        super().__init__()
        self.search, self.replacement, self.user_check = search, replacement, check
        self._params = list(inspect.signature(search).parameters)
        if list(inspect.signature(replacement).parameters) != self._params:
            raise ValueError(f"opreg: pattern {name!r}: search and replacement must take the "
                             f"same parameters, got {self._params} and "
                             f"{list(inspect.signature(replacement).parameters)}")
        self._ctx: PassContext | None = None

    def sources(self) -> list[Any]:
        return [f for f in (self.search, self.replacement, self.user_check) if f]

    def match(self, node: fx.Node, ctx: PassContext) -> Match | Miss | None:
        raise NotImplementedError("ReplacementPattern matches through the subgraph rewriter")

    def emit(self, ed: GraphEditor, m: Match) -> fx.Node:
        raise NotImplementedError("ReplacementPattern emits through the subgraph rewriter")

    def _accept(self, match: Any, _graph: fx.Graph, _pattern: fx.Graph) -> bool:
        values = {p: meta_value(n) for p, n in zip(self._params, match.placeholder_nodes)}
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if any(v is None for v in values.values()) or len({t.device for t in tensors}) > 1:
            return False
        inner = [n for n in match.nodes_map.values() if n.op not in ("placeholder", "output")
                 and n not in match.placeholder_nodes]
        if inner and self._ctx is not None:
            pos = order(inner[0].graph)
            last = max(inner, key=pos.__getitem__)
            m = Match(self.name, last, match.placeholder_nodes, dead=inner)
            reason = self._ctx.mutation_hazard(m)
            if reason:
                self._ctx.near_miss(self, last, self.name, reason)
                return False
        try:
            return bool(self.user_check(values)) if self.user_check is not None else True
        except Exception:  # noqa: BLE001 - a failing check means "don't"
            logger.debug("opreg: check of pattern %s raised", self.name, exc_info=True)
            return False

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        self._ctx = ctx
        try:
            replaced = replace_pattern_with_filters(gm, self.search, self.replacement,
                                                    match_filters=[self._accept])
        finally:
            self._ctx = None
        for r in replaced:
            # The rewriter leaves new nodes without values: fill them in, in order.
            for n in r.replacements:
                if meta_value(n) is None and n.op in ("call_function", "call_method"):
                    try:
                        n.meta["example_value"] = GraphEditor(ctx, n).fake_value(n.op, n.target, n.args,
                                                                                 n.kwargs)
                    except RewriteRejected:
                        pass
            ctx.matched(self, r.anchor, self.name)
        return len(replaced)
