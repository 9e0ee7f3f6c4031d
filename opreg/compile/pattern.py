"""The pattern framework: one shape for every rewrite of the Dynamo graph into an op.

A pattern declares how to read a spelling into a :class:`Match` and how to emit the
replacement; the framework owns the loop, the same for every pattern::

    for each node:   match(node) -> Match | Miss | None      (None: not this pattern's)
                     check(match) -> reason | None           (the pattern's own rules)
                     mutation safety (opreg.compile.mutation) over match.reads
                     emit(editor, match) -> replacement node  (rolled back if rejected)
                     count, replace the anchor, erase what died

Every refusal is a near miss with its reason and the user's ``file:line``
(:class:`Finding`), for ``explain`` and ``PATTERN.near_misses``.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from .._log import logger
from . import mutation
from .cache_key import pattern_digest
from .fx_utils import meta_value, order, tensor_value, user_frame

__all__ = ["Finding", "GraphEditor", "GraphPattern", "Match", "Miss", "PassContext", "RewriteRejected"]


@dataclasses.dataclass
class Finding:
    """One match (``matched``) or near miss (``reason`` says why not) of a pattern."""

    pattern: str          # the pattern's name, e.g. "scatter_combine"
    spelling: str         # how the user wrote it, e.g. "index_add_", "x @ W.T + b"
    matched: bool
    reason: str           # "" for a match
    file: str             # the user's source, from the node's stack trace
    line: int
    code: str             # that source line, stripped
    node: str             # the FX node's name
    op: str = ""          # for a match, the op emitted if not the pattern's own ``op``

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else "<unknown location>"


@dataclasses.dataclass
class Match:
    """One occurrence of a pattern, read from the graph. Patterns subclass it to carry
    what their ``emit`` needs.

    ``anchor``: the node replaced by the emitted value (the rewrite point).
    ``reads``: every value the replacement reads there, and the original's own
    intermediate values (a write to any of their storages between the original's first
    read and the anchor rejects the match).
    ``dead``: the original's nodes before the anchor (they may die with it: erased if
    unused). The first read is the earliest of ``dead`` and ``start``.
    ``redirect``: a node whose later uses (after the anchor) read the result instead.
    ``own_writes``: nodes that write what the match reads as part of the spelling itself
    (e.g. ``inv[perm] = arange(n)`` making an inverse permutation): not hazards.
    """

    spelling: str
    anchor: fx.Node
    reads: Sequence[Any]
    dead: Sequence[Any] = ()
    start: fx.Node | None = None
    report_at: fx.Node | None = None   # the node whose source line a finding names
    redirect: fx.Node | None = None
    own_writes: Sequence[fx.Node] = ()  # writes the pattern proved part of the spelling


@dataclasses.dataclass
class Miss:
    """A spelling the pattern recognised but cannot rewrite, and why."""

    spelling: str
    reason: str
    at: fx.Node


class RewriteRejected(Exception):
    """Raised while emitting a replacement (e.g. the op's own shape check failed): the
    emitted nodes are rolled back and the match becomes a near miss."""


def _find_fake_mode(gm: fx.GraphModule) -> Any:
    for n in gm.graph.nodes:
        v = meta_value(n)
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


class PassContext:
    """State of one run of the passes over one graph: findings, the fake mode used to
    compute the metadata of emitted nodes, and what each node may write."""

    def __init__(self, gm: fx.GraphModule, fake_mode: Any = None) -> None:
        self.gm = gm
        self.fake_mode = fake_mode if fake_mode is not None else _find_fake_mode(gm)
        self.findings: list[Finding] = []
        self.rewrites = 0
        self.writes: dict[fx.Node, Any] = {}

    def matched(self, pattern: "GraphPattern", node: fx.Node, spelling: str, op: str = "") -> None:
        """Record a rewrite; ``op``: the registry op emitted, if not ``pattern.op``."""
        pattern.matches[spelling] += 1
        self.rewrites += 1
        self.findings.append(Finding(pattern.name, spelling, True, "", *user_frame(node), node.name, op))
        logger.debug("opreg: %s matched %s at %s", pattern.name, spelling, node.name)

    def near_miss(self, pattern: "GraphPattern", node: fx.Node, spelling: str, reason: str) -> int:
        """Record why ``node`` was left alone; returns 0 (the number of rewrites made)."""
        pattern.near_misses[reason] += 1
        self.findings.append(Finding(pattern.name, spelling, False, reason, *user_frame(node), node.name))
        logger.debug("opreg: %s left %s (%s) alone: %s", pattern.name, node.name, spelling, reason)
        return 0

    def writes_between(self, reads: Sequence[Any], start: fx.Node, anchor: fx.Node,
                       own: Sequence[fx.Node] = ()) -> fx.Node | None:
        """The first node after ``start`` and before ``anchor`` that may write memory of
        ``reads`` (or whose writes are unknown), ``own`` excepted; None if there is none."""
        return mutation.hazard(reads, start, anchor, self.fake_mode, self.writes, own)

    def mutation_hazard(self, m: Match) -> str | None:
        """Why a node between the match's first read and its anchor makes it unsafe."""
        pos = order(m.anchor.graph)
        firsts = [n for n in (*m.dead, m.start) if isinstance(n, fx.Node) and n in pos]
        start = min(firsts, key=pos.__getitem__, default=m.anchor)
        bad = self.writes_between(m.reads, start, m.anchor, m.own_writes)
        if bad is None:
            return None
        unknown = mutation.written(bad, self.fake_mode, self.writes) == mutation.ANYTHING
        file, line, _ = user_frame(bad)
        return (f"{bad.name}{f' ({file}:{line})' if file else ''} "
                f"{'may write any memory' if unknown else 'writes memory the match reads'} between "
                f"the match's first read and the rewrite point (the op would read it later)")

    def may_write(self, node: fx.Node) -> bool:
        return mutation.may_write(node, self.fake_mode, self.writes)


class GraphEditor:
    """Emits replacement nodes before ``anchor``: each gets its fake value (computed by
    running its target on the inputs' fake values) and the anchor's stack trace, so
    later passes, explain and Inductor see them as if the user had written them.
    :meth:`rollback` erases everything emitted."""

    def __init__(self, ctx: PassContext, anchor: fx.Node) -> None:
        self.ctx = ctx
        self.graph = anchor.graph
        self.anchor = anchor
        self.created: list[fx.Node] = []

    def _emit(self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Node:
        value = self.fake_value(op, target, args, kwargs)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        self.created.append(node)
        if value is not None:
            node.meta["example_value"] = value
        for key in ("stack_trace", "nn_module_stack"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node

    def fake_value(self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """What ``target(*args, **kwargs)`` returns on the fake values of its inputs (None
        if an input has none); raises :class:`RewriteRejected` if it fails."""
        if op == "get_attr":
            return self._attr_value(target)
        missing = []

        def val(a: Any) -> Any:
            if isinstance(a, fx.Node):
                v = meta_value(a)
                if v is None:
                    missing.append(a)
                # Detached: the emitted ops' autograd kernels must not run (or build) here.
                return v.detach() if isinstance(v, torch.Tensor) else v
            return a

        vargs = fx.node.map_aggregate(args, val)
        vkwargs = fx.node.map_aggregate(kwargs, val)
        if missing:
            return None
        fn = (lambda *a, **k: getattr(a[0], target)(*a[1:], **k)) if op == "call_method" else target
        try:
            with self.ctx.fake_mode if self.ctx.fake_mode is not None else _no_mode():
                return fn(*vargs, **vkwargs)
        except Exception as e:  # noqa: BLE001 - any failure means: don't rewrite
            raise RewriteRejected(f"{getattr(target, '__name__', target)}: {e}") from e

    def _attr_value(self, qualname: str) -> Any:
        v: Any = self.ctx.gm
        for part in qualname.split("."):
            v = getattr(v, part)
        fm = self.ctx.fake_mode
        return fm.from_tensor(v) if fm is not None and isinstance(v, torch.Tensor) else v

    def call_function(self, target: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any] | None = None) -> fx.Node:
        return self._emit("call_function", target, args, dict(kwargs or {}))

    def call_method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
                    ) -> fx.Node:
        return self._emit("call_method", name, args, dict(kwargs or {}))

    def get_attr(self, qualname: str) -> fx.Node:
        return self._emit("get_attr", qualname, (), {})

    def size(self, node: fx.Node, dim: int) -> Any:
        """``node.size(dim)``: a plain int when static, else an emitted ``size`` node."""
        v = tensor_value(node)
        if v is not None and isinstance(v.shape[dim], int):
            return v.shape[dim]
        return self.call_method("size", (node, dim))

    def rollback(self) -> None:
        for n in reversed(self.created):
            if not getattr(n, "_erased", False):
                self.graph.erase_node(n)
        self.created.clear()


class _no_mode:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def erase_dead(ctx: PassContext, nodes: Iterable[Any]) -> None:
    """Erase those of ``nodes`` (and, transitively, their inputs) that are now unused
    and write no memory. Only the nodes a pattern matched, and their inputs, are considered."""
    pending = [n for n in nodes if isinstance(n, fx.Node)]
    while pending:
        n = pending.pop()
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method") \
                or ctx.may_write(n) or _is_random(n):
            continue
        inputs = n.all_input_nodes
        ctx.gm.graph.erase_node(n)
        pending.extend(inputs)


def _is_random(node: fx.Node) -> bool:
    """Dropping an unused random op would shift the random stream of later ones."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return any(w in str(name) for w in ("rand", "bernoulli", "dropout", "normal", "multinomial"))


class GraphPattern:
    """A rewrite of the Dynamo graph into a registry op.

    Subclasses set ``name`` (unique; what ``options={"patterns": [...]}`` selects) and
    ``op`` (the registry op the replacement calls), and implement :meth:`match` and
    :meth:`emit` (and optionally :meth:`check`, :meth:`candidates`, :meth:`begin`).
    A pattern that needs a loop of its own may override :meth:`apply` instead (then it
    does its own checks: see :meth:`PassContext.mutation_hazard`).
    ``matches`` (spelling -> count) and ``near_misses`` (reason -> count) accumulate
    over the process, for tests and explain.
    """

    name: str = ""
    op: str | None = None

    def __init__(self) -> None:
        if not self.name:
            raise ValueError(f"{type(self).__name__} must set a name")
        self.matches: collections.Counter[str] = collections.Counter()
        self.near_misses: collections.Counter[str] = collections.Counter()

    # -- what a pattern says
    def begin(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        """Called once per graph before matching (e.g. to read graph-wide state)."""

    def candidates(self, gm: fx.GraphModule) -> Iterable[fx.Node]:
        return list(gm.graph.nodes)

    def match(self, node: fx.Node, ctx: PassContext) -> Match | Miss | None:
        """Read ``node`` as one of the pattern's spellings: a Match, a Miss (recognised,
        not rewritable: why), or None (not this pattern's business)."""
        return None

    def check(self, m: Match, ctx: PassContext) -> str | Miss | None:
        """The pattern's own reason to refuse a match (a Miss to report it elsewhere than
        at ``m.report_at``), or None."""
        return None

    def emit(self, ed: GraphEditor, m: Match) -> fx.Node:
        """Emit the replacement with ``ed``; return the node that replaces ``m.anchor``."""
        raise NotImplementedError(f"{type(self).__name__} matched but defines no emit()")

    def emitted_op(self, result: fx.Node) -> str:
        """The registry op name a finding reports ("" = the pattern's ``op``)."""
        return ""

    # -- the loop, the same for every pattern
    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        """Rewrite every match in ``gm``; return how many."""
        self.begin(gm, ctx)
        count = 0
        for node in self.candidates(gm):
            if not getattr(node, "_erased", False):
                count += self._one(node, ctx)
        return count

    def _one(self, node: fx.Node, ctx: PassContext) -> int:
        m = self.match(node, ctx)
        if m is None:
            return 0
        if isinstance(m, Miss):
            return ctx.near_miss(self, m.at, m.spelling, m.reason)
        at = m.report_at or m.anchor
        reason = self.check(m, ctx) or ctx.mutation_hazard(m)
        if isinstance(reason, Miss):
            return ctx.near_miss(self, reason.at, reason.spelling, reason.reason)
        if reason:
            return ctx.near_miss(self, at, m.spelling, reason)
        ed = GraphEditor(ctx, m.anchor)
        try:
            result = self.emit(ed, m)
        except RewriteRejected as e:
            ed.rollback()
            return ctx.near_miss(self, at, m.spelling, f"replacement rejected: {e}")
        self._replace(ctx, ed, m, result)
        ctx.matched(self, at, m.spelling, self.emitted_op(result))
        return 1

    @staticmethod
    def _replace(ctx: PassContext, ed: GraphEditor, m: Match, result: fx.Node) -> None:
        if m.redirect is not None:
            pos = order(m.anchor.graph)
            for u in list(m.redirect.users):
                if u is not m.anchor and u not in ed.created and pos[u] > pos[m.anchor]:
                    u.replace_input_with(m.redirect, result)
        dead = [*m.dead, *m.anchor.all_input_nodes]
        m.anchor.replace_all_uses_with(result)
        ctx.gm.graph.erase_node(m.anchor)
        erase_dead(ctx, dead)
        GraphPattern._erase_own_writes(ctx, m.own_writes)

    @staticmethod
    def _erase_own_writes(ctx: PassContext, own: Sequence[fx.Node]) -> None:
        """A write that was part of the spelling (``inv[perm] = arange``) goes once
        nothing but such writes reads what it wrote."""
        for w in own:
            target = w.args[0] if w.args else None
            if getattr(w, "_erased", False) or w.users or not isinstance(target, fx.Node) \
                    or any(u not in own for u in target.users if u is not w):
                continue
            inputs = w.all_input_nodes
            ctx.gm.graph.erase_node(w)
            erase_dead(ctx, inputs)

    # -- bookkeeping
    @property
    def total(self) -> int:
        return sum(self.matches.values())

    def reset_counters(self) -> None:
        self.matches.clear()
        self.near_misses.clear()

    def sources(self) -> list[Any]:
        """What this pattern's behaviour depends on, for the cache key: its class."""
        return [type(self)]

    def uuid(self) -> str:
        """Hash of :meth:`sources` and of every opreg module they use (its op spec too)."""
        return pattern_digest(self.sources())
