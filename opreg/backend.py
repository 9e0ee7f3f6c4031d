"""opreg's ``torch.compile`` backend: rewrite the graph with opreg's pattern passes, then
compile what is left with Inductor (or run it eagerly).

    model = torch.compile(model, backend="opreg")                              # see "auto"
    model = torch.compile(model, backend="opreg", options={"inner": "inductor"})
    model = torch.compile(model, backend="opreg", options={"inner": "eager"})  # no codegen
    model = torch.compile(model, backend="opreg", mode="max-autotune")

``options`` (all optional; the rest are Inductor config options, as for the default backend):

* ``"inner"``: ``"auto"`` (default), ``"inductor"``, ``"aot_eager"`` (AOTAutograd, no
  codegen) or ``"eager"`` (run the rewritten graph as is). ``"auto"`` is Inductor, except
  for a rewritten graph left with nothing to generate code for (only opreg ops, views and
  indexing): that one runs as is, since Inductor's per-call wrapper would be its main
  cost (H200, reference cat_linear model: 91 µs per call through Inductor vs 52 eager).
  Giving ``mode`` or Inductor options means Inductor.
* ``"patterns"``: names of the patterns to run (default: all registered; ``[]``: none).
* ``"mode"``: an Inductor mode, like ``torch.compile(mode=...)`` (which can't be combined
  with ``options``).

Where the passes run, and why. They rewrite the graph Dynamo hands the backend (Torch IR,
before AOTAutograd), not Inductor's post-grad graph:

* Training: an opreg op put there goes through AOTAutograd like any custom op, with its
  own autograd formula, so ``loss.backward()`` works with no joint-graph patterns; a
  post-grad rewrite of the forward graph would leave the backward graph computing the
  gradients of the old ops from tensors the new forward no longer saves.
* One rewrite for every compiler underneath (Inductor, ``aot_eager``, ``eager``).
* The nodes still carry the user's stack traces, for :mod:`opreg.explain`.

That graph is not functional, so mutation is handled by the patterns themselves: an
in-place spelling (``out.index_add_(...)``, ``out`` perhaps a graph input) becomes an
in-place ``out.add_(op(...))``, which keeps the mutation, and every alias of ``out``,
exactly; AOTAutograd then functionalises it as it would have the original. Only when
``out`` is a fresh ``torch.zeros`` that nothing read before the mutation is the zeros
dropped and the op's result used directly.

Inductor's caches: the graph reaching :func:`~torch._inductor.compile_fx.compile_fx` is
already rewritten, so its AOTAutograd/FX-graph cache keys already differ when a pattern
changes what it emits. On top of that, each compile sets a ``CustomGraphPass`` whose
``uuid()`` hashes every pattern's source as Inductor's ``post_grad_custom_pre_pass``
(through ``config_patches``, for that compile only), so a cache entry is always keyed
on the exact pattern sources that produced it.

Custom patterns: :func:`register_pattern` adds one from outside the package, either a
search/replacement pair of plain functions or a :class:`GraphPattern` subclass.
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import hashlib
import inspect
import operator
import re
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ._log import logger

__all__ = [
    "Finding", "GraphEditor", "GraphPattern", "PassContext", "RecordingBackend", "RewriteRejected",
    "apply_patterns", "inductor_config_patches", "op_counts", "opreg_backend", "patterns_uuid",
    "register_pattern", "registered_patterns", "stats", "unregister_pattern",
]

BACKEND_NAME = "opreg"
INNER_COMPILERS = ("auto", "inductor", "aot_eager", "eager")
# What may sit beside opreg ops in a graph that "auto" runs without Inductor: views and
# indexing only (nothing that computes, so nothing for Inductor to fuse or schedule).
_VIEW_CALLS = {operator.getitem, torch.unbind, torch.select, torch.narrow, torch.t,
               torch.transpose, torch.permute, torch.reshape, torch.squeeze, torch.unsqueeze}
_VIEW_METHODS = {"unbind", "select", "narrow", "t", "transpose", "permute", "view", "reshape",
                 "squeeze", "unsqueeze", "size", "dim", "contiguous", "expand"}
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

#: Totals since import (tests reset them): "graphs" compiled, "rewrites" made.
stats: collections.Counter[str] = collections.Counter()


# =============================================================================== findings

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


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def user_frame(node: fx.Node) -> tuple[str, int, str]:
    """(file, line, code) of the innermost frame of ``node``'s stack trace, or ("", 0, "")."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return m["file"], int(m["line"]), code
    return "", 0, ""


class PassContext:
    """State of one run of the passes over one graph: findings and the fake mode used
    to compute the metadata of emitted nodes."""

    def __init__(self, gm: fx.GraphModule, fake_mode: Any = None) -> None:
        self.gm = gm
        self.fake_mode = fake_mode if fake_mode is not None else _find_fake_mode(gm)
        self.findings: list[Finding] = []
        self.rewrites = 0

    def matched(self, pattern: "GraphPattern", node: fx.Node, spelling: str, op: str = "") -> None:
        """Record a rewrite; ``op``: the registry op emitted, if not ``pattern.op``."""
        pattern.matches[spelling] += 1
        self.rewrites += 1
        self.findings.append(Finding(pattern.name, spelling, True, "", *user_frame(node), node.name,
                                     op))
        logger.debug("opreg: %s matched %s at %s", pattern.name, spelling, node.name)

    def near_miss(self, pattern: "GraphPattern", node: fx.Node, spelling: str, reason: str) -> int:
        """Record why ``node`` was left alone; returns 0 (the number of rewrites made)."""
        pattern.near_misses[reason] += 1
        self.findings.append(Finding(pattern.name, spelling, False, reason, *user_frame(node),
                                     node.name))
        logger.debug("opreg: %s left %s (%s) alone: %s", pattern.name, node.name, spelling, reason)
        return 0


def _find_fake_mode(gm: fx.GraphModule) -> Any:
    for n in gm.graph.nodes:
        v = meta_value(n)
        if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"):
            return v.fake_mode
    return None


# ======================================================================= pattern toolkit
# What the pattern files build on: reading a node's fake value and arguments, comparing
# (symbolic) sizes without adding guards, emitting replacement nodes with metadata.

def meta_value(x: Any) -> Any:
    """The (fake) value of a node, from Dynamo's ``example_value`` or FX's ``val``;
    a non-node argument is its own value."""
    if isinstance(x, fx.Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def tensor_value(x: Any) -> torch.Tensor | None:
    v = meta_value(x)
    return v if isinstance(v, torch.Tensor) else None


def _provable(compare: Callable[[], Any]) -> bool:
    """The comparison's result if it is a bool, or provable from what the shape
    environment knows now (SymInts); False otherwise. Never adds a guard."""
    try:
        r = compare()
    except Exception:  # noqa: BLE001 - incomparable means "not known"
        return False
    if isinstance(r, bool):
        return r
    try:
        return statically_known_true(r)
    except Exception:  # noqa: BLE001
        return False


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts, True only if provable now: never adds a guard."""
    return _provable(lambda: a == b)


def known_le(a: Any, b: Any) -> bool:
    """``a <= b`` for ints or SymInts, True only if provable now: never adds a guard."""
    return _provable(lambda: a <= b)


def shape_is(t: torch.Tensor, shape: Sequence[Any]) -> bool:
    return t.dim() == len(shape) and all(known_equal(a, b) for a, b in zip(t.shape, shape))


def bind(node: fx.Node, params: Sequence[str], defaults: Mapping[str, Any] | None = None
         ) -> dict[str, Any] | None:
    """Arguments of a call by parameter name (``params[0]`` is ``self``/``input``).

    None when they don't fit: too many, an unknown keyword (e.g. ``out=``), a missing
    one without a default. Patterns then leave the node alone.
    """
    defaults = defaults or {}
    if len(node.args) > len(params):
        return None
    bound = dict(zip(params, node.args))
    for key, v in node.kwargs.items():
        key = params[0] if key in ("input", "self") else key
        if key not in params or key in bound:
            return None
        bound[key] = v
    for p in params:
        if p not in bound:
            if p not in defaults:
                return None
            bound[p] = defaults[p]
    return bound


def is_call(node: Any, functions: Iterable[Any] = (), methods: Iterable[str] = ()) -> bool:
    """Is ``node`` a call of one of ``functions`` or of a method named in ``methods``?"""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target is f or node.target == f for f in functions)
    if node.op == "call_method":
        return node.target in tuple(methods)
    return False


def position(node: fx.Node) -> int:
    """Index of ``node`` in its graph (program order)."""
    for i, n in enumerate(node.graph.nodes):
        if n is node:
            return i
    raise ValueError(f"{node} is not in its graph")


_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imatmul}


def is_pure(node: fx.Node) -> bool:
    """Conservatively: can ``node`` be dropped once unused? (No in-place or out= calls.)"""
    if node.op not in ("call_function", "call_method", "get_attr"):
        return False
    if "out" in node.kwargs:
        return False
    if node.op == "call_method":
        return not (node.target.endswith("_") and not node.target.endswith("__"))
    if node.op == "get_attr":
        return True
    t = node.target
    if t in _INPLACE_OPERATORS:
        return False
    if isinstance(t, torch._ops.OpOverload):
        return not t._schema.is_mutable
    name = getattr(t, "__name__", "")
    return not (name.endswith("_") and not name.endswith("__"))


def mutation_between(chain: Iterable[Any], anchor: fx.Node) -> fx.Node | None:
    """The first possibly-mutating node after the earliest node of ``chain`` and before
    ``anchor``. A replacement reads its inputs at ``anchor``, where the original read
    them along ``chain``; an in-place op in between (on them or on an alias) could make
    the two differ, so patterns refuse then."""
    chain = {n for n in chain if isinstance(n, fx.Node) and n.op in ("call_function", "call_method")}
    inside = False
    for n in anchor.graph.nodes:
        if n is anchor:
            return None
        if n in chain:
            inside = True
        elif inside and (n.op == "call_module" or (n.op in ("call_function", "call_method")
                                                   and not is_pure(n))):
            return n
    return None


def erase_dead(graph: fx.Graph, nodes: Iterable[Any]) -> None:
    """Erase those of ``nodes`` (and, transitively, their inputs among ``nodes``) that
    are now unused and pure. Only the nodes a pattern matched are considered."""
    pending = [n for n in nodes if isinstance(n, fx.Node)]
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if getattr(n, "_erased", False):
                pending.remove(n)
            elif not n.users and is_pure(n):
                graph.erase_node(n)
                pending.remove(n)
                changed = True


class RewriteRejected(Exception):
    """Raised while emitting a replacement (e.g. the op's own shape check failed): the
    emitted nodes are rolled back and the match becomes a near miss."""


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
        value = self._fake_value(op, target, args, kwargs)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        self.created.append(node)
        if value is not None:
            node.meta["example_value"] = value
        for key in ("stack_trace", "nn_module_stack"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node

    def _fake_value(self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op == "get_attr":
            v = self.ctx.gm
            for part in target.split("."):
                v = getattr(v, part)
            fm = self.ctx.fake_mode
            return fm.from_tensor(v) if fm is not None and isinstance(v, torch.Tensor) else v
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
        fm = self.ctx.fake_mode
        try:
            if fm is not None:
                with fm:
                    return fn(*vargs, **vkwargs)
            return fn(*vargs, **vkwargs)
        except Exception as e:  # noqa: BLE001 - any failure means: don't rewrite
            raise RewriteRejected(f"{getattr(target, '__name__', target)}: {e}") from e

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


# ====================================================================== patterns: base

class GraphPattern(abc.ABC):
    """A rewrite of the Dynamo graph into a registry op.

    Subclasses set ``name`` (unique; what ``options={"patterns": [...]}`` selects) and
    ``op`` (the registry op the replacement calls), and implement :meth:`apply`, which
    rewrites every match in place, records each match and near miss on ``ctx``, and
    returns the number of rewrites. ``matches`` (spelling -> count) and ``near_misses``
    (reason -> count) accumulate over the process, for tests and explain.
    """

    name: str = ""
    op: str | None = None

    def __init__(self) -> None:
        if not self.name:
            raise ValueError(f"{type(self).__name__} must set a name")
        self.matches: collections.Counter[str] = collections.Counter()
        self.near_misses: collections.Counter[str] = collections.Counter()

    @abc.abstractmethod
    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        """Rewrite every match in ``gm``; return how many."""

    @property
    def total(self) -> int:
        return sum(self.matches.values())

    def reset_counters(self) -> None:
        self.matches.clear()
        self.near_misses.clear()

    def uuid(self) -> str:
        """A hash of the source that defines this pattern (its class's module file)."""
        return _hash_sources([type(self)])


def _hash_sources(objs: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for obj in objs:
        try:
            path = inspect.getsourcefile(obj)
            with open(path, "rb") as f:  # type: ignore[arg-type]
                h.update(f.read())
            continue
        except (OSError, TypeError):
            pass
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            code = getattr(obj, "__code__", None)
            # No source (exec'd): the bytecode and constants still identify it.
            h.update(repr((getattr(obj, "__qualname__", repr(obj)),
                           code.co_code if code else b"", code.co_consts if code else ()))
                     .encode())
    return h.hexdigest()


class ReplacementPattern(GraphPattern):
    """A pattern given as plain functions: every occurrence of ``search``'s computation
    in the Dynamo graph is replaced by ``replacement``'s (same parameters).

    Matching is structural, via :func:`torch.fx.subgraph_rewriter.replace_pattern_with_filters`:
    ``search`` is traced with :func:`torch.fx.symbolic_trace`, so write it the way models
    spell the computation (``torch.relu(x)`` and ``x.relu()`` are different spellings:
    register one pattern per spelling). A match is only rewritten if every tensor bound to
    a parameter has a known value, all share one device, and ``check`` (if given) returns
    True for ``{parameter name: fake tensor or value}``.
    """

    def __init__(self, name: str, search: Callable[..., Any], replacement: Callable[..., Any],
                 check: Callable[[dict[str, Any]], bool] | None = None, op: str | None = None) -> None:
        self.name = name
        self.op = op
        super().__init__()
        self.search, self.replacement, self.check = search, replacement, check
        self._params = list(inspect.signature(search).parameters)
        if list(inspect.signature(replacement).parameters) != self._params:
            raise ValueError(f"opreg: pattern {name!r}: search and replacement must take the "
                             f"same parameters, got {self._params} and "
                             f"{list(inspect.signature(replacement).parameters)}")

    def uuid(self) -> str:
        return _hash_sources([f for f in (self.search, self.replacement, self.check) if f])

    def _accept(self, match: Any, _graph: fx.Graph, _pattern: fx.Graph) -> bool:
        values = {p: meta_value(n) for p, n in zip(self._params, match.placeholder_nodes)}
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        if any(v is None for v in values.values()) or len({t.device for t in tensors}) > 1:
            return False
        try:
            return bool(self.check(values)) if self.check is not None else True
        except Exception:  # noqa: BLE001 - a failing check means "don't"
            logger.debug("opreg: check of pattern %s raised", self.name, exc_info=True)
            return False

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> int:
        from torch.fx.subgraph_rewriter import replace_pattern_with_filters

        replaced = replace_pattern_with_filters(gm, self.search, self.replacement,
                                                match_filters=[self._accept])
        for r in replaced:
            # The rewriter leaves new nodes without values: fill them in, in order.
            for n in r.replacements:
                if meta_value(n) is None and n.op in ("call_function", "call_method"):
                    ed = GraphEditor(ctx, n)
                    try:
                        n.meta["example_value"] = ed._fake_value(n.op, n.target, n.args, n.kwargs)
                    except RewriteRejected:
                        pass
            ctx.matched(self, r.anchor, self.name)
        return len(replaced)


# ================================================================= patterns: registry

_lock = threading.RLock()
_user_patterns: dict[str, GraphPattern] = {}


def _builtin_patterns() -> list[GraphPattern]:
    # Imported lazily: the pattern files import this module's toolkit.
    from opreg.patterns import cat_linear, scatter_combine

    return [scatter_combine.PATTERN, cat_linear.PATTERN]


def registered_patterns() -> list[GraphPattern]:
    """Every pattern, in the order they run: the built-ins, then user ones by registration."""
    with _lock:
        return _builtin_patterns() + list(_user_patterns.values())


def register_pattern(pattern: GraphPattern | Callable[..., Any],
                     replacement: Callable[..., Any] | None = None, *, name: str | None = None,
                     check: Callable[[dict[str, Any]], bool] | None = None,
                     op: str | None = None) -> GraphPattern:
    """Add a pattern to the opreg backend (for every later compile; idempotent per name
    only via :func:`unregister_pattern` - duplicates raise ValueError).

    Either a :class:`GraphPattern` instance, or a reference computation and its
    replacement as two functions with the same parameters::

        opreg.register_op("scaled_tanh", "(Tensor x, float s) -> Tensor")(
            lambda x, s: torch.tanh(x) * s)

        def search(x):                      # how models write it
            return torch.tanh(x) * 2.0
        def replacement(x):
            return torch.ops.opreg.scaled_tanh(x, 2.0)

        opreg.backend.register_pattern(search, replacement, name="scaled_tanh",
                                       check=lambda v: v["x"].dtype == torch.float32)

    ``check`` gets ``{parameter: fake tensor or value}`` of a match and returns whether
    to rewrite it. Inductor's caches are keyed on the functions' source (see the module
    docstring), so editing them never serves stale compiled code.
    """
    if isinstance(pattern, GraphPattern):
        if replacement is not None or check is not None:
            raise TypeError("opreg: register_pattern(GraphPattern) takes no replacement/check")
        obj = pattern
    else:
        if replacement is None:
            raise TypeError("opreg: register_pattern(search, replacement): replacement missing")
        obj = ReplacementPattern(name or getattr(pattern, "__name__", "pattern"), pattern,
                                 replacement, check=check, op=op)
    with _lock:
        if obj.name in _user_patterns or obj.name in {p.name for p in _builtin_patterns()}:
            raise ValueError(f"opreg: a pattern named {obj.name!r} is already registered")
        _user_patterns[obj.name] = obj
    return obj


def unregister_pattern(name: str) -> None:
    """Remove a pattern added with :func:`register_pattern`."""
    with _lock:
        if name not in _user_patterns:
            raise ValueError(f"opreg: no user pattern named {name!r}; "
                             f"user patterns: {sorted(_user_patterns)}")
        del _user_patterns[name]


def patterns_uuid(patterns: Sequence[GraphPattern] | None = None) -> str:
    """Hash of this file and of every pattern's source: what Inductor's caches key on."""
    h = hashlib.sha256(_hash_sources([_hash_sources]).encode())  # this module's own source
    for p in registered_patterns() if patterns is None else patterns:
        h.update(f"{p.name}:{p.uuid()};".encode())
    return h.hexdigest()


# ========================================================================= running them

def apply_patterns(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *,
                   only: Iterable[str] | None = None) -> PassContext:
    """Run the registered patterns (or those named in ``only``) over ``gm`` in place.

    ``gm`` is normally a Dynamo graph, whose nodes carry fake values. For any other
    graph without them, ``example_inputs`` are propagated through it first (as fakes).
    Returns the :class:`PassContext`: ``.rewrites`` and ``.findings``.
    """
    pats = registered_patterns()
    if only is not None:
        only = list(only)
        unknown = set(only) - {p.name for p in pats}
        if unknown:
            raise ValueError(f"opreg: unknown pattern(s) {sorted(unknown)}; "
                             f"registered: {[p.name for p in pats]}")
        pats = [p for p in pats if p.name in only]
    ctx = PassContext(gm)
    if ctx.fake_mode is None and example_inputs is not None and _needs_values(gm):
        ctx.fake_mode = _propagate_fakes(gm, example_inputs)
    for p in pats:
        p.apply(gm, ctx)
    if ctx.rewrites:
        gm.graph.lint()
        gm.recompile()
    return ctx


def _needs_values(gm: fx.GraphModule) -> bool:
    return any(meta_value(n) is None for n in gm.graph.nodes if n.op == "placeholder")


def _propagate_fakes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) and not hasattr(x, "fake_mode")
             else x for x in example_inputs]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return mode


# ============================================================================ backend

def _as_passes(value: Any) -> tuple[Any, ...]:
    """A config value of custom passes as a tuple (None, one pass, or a list of them)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _cache_key_pass_type() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class OpregCacheKey(CustomGraphPass):
        """Inductor ``post_grad_custom_pre_pass`` for one opreg compile. It rewrites
        nothing (opreg's rewrite ran before AOTAutograd); its ``uuid()`` puts the
        patterns' sources into Inductor's FX-graph/AOTAutograd cache keys. A pass the
        user had configured there still runs, first, and its uuid is part of ours."""

        def __init__(self, key: str, chained: Any) -> None:
            self.key = key
            self.chained = _as_passes(chained)

        def __call__(self, graph: fx.Graph) -> None:
            for p in self.chained:
                p(graph)
            stats["inductor_opreg_nodes"] += sum(
                1 for n in graph.nodes
                if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "opreg")

        def uuid(self) -> Any:
            theirs = []
            for p in self.chained:
                u = p.uuid() if isinstance(p, CustomGraphPass) else None
                if u is None:
                    return None  # theirs can't be keyed: no caching at all, as without opreg
                theirs.append(u)
            return (self.key, *theirs) if theirs else self.key

    return OpregCacheKey


_CACHE_KEY_PASS: type | None = None


def inductor_config_patches(mode: str | None = None, options: Mapping[str, Any] | None = None,
                            patterns: Sequence[GraphPattern] | None = None) -> dict[str, Any]:
    """The Inductor config one opreg compile runs under: ``mode``'s settings, the user's
    options, and the cache-key pass (see the module docstring)."""
    global _CACHE_KEY_PASS
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options

    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(list_mode_options(mode))
    for k, v in (options or {}).items():
        patches[k.replace("-", "_")] = v
    if _CACHE_KEY_PASS is None:
        _CACHE_KEY_PASS = _cache_key_pass_type()
    existing = patches.get("post_grad_custom_pre_pass", inductor_config.post_grad_custom_pre_pass)
    patches["post_grad_custom_pre_pass"] = _CACHE_KEY_PASS(patterns_uuid(patterns), existing)
    return patches


def _parse_options(mode: str | None, options: Mapping[str, Any] | None
                   ) -> tuple[str, list[str] | None, str | None, dict[str, Any]]:
    opts = dict(options or {})
    inner = opts.pop("inner", "auto")
    names = opts.pop("patterns", None)
    mode = opts.pop("mode", mode)
    if inner not in INNER_COMPILERS:
        raise ValueError(f"opreg backend: inner must be one of {INNER_COMPILERS}, got {inner!r}")
    if names is not None:
        names = [] if names is False else [names] if isinstance(names, str) else list(names)
    if inner == "auto" and (opts or (mode and mode != "default")):
        inner = "inductor"
    if inner != "inductor" and (opts or (mode and mode != "default")):
        raise ValueError(f"opreg backend: Inductor options/mode given with inner={inner!r}: "
                         f"{sorted(opts)} {mode or ''}".strip())
    return inner, names, mode, opts


def _compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str,
                   names: list[str] | None, mode: str | None, opts: dict[str, Any]
                   ) -> Callable[..., Any]:
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    used = [p for p in registered_patterns() if names is None or p.name in names]
    return compile_fx(gm, example_inputs, config_patches=inductor_config_patches(mode, opts, used))


def opreg_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                  options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The ``"opreg"`` Dynamo backend: the pattern passes, then ``options["inner"]``.

    ``gm``: the graph Dynamo captured (rewritten in place); ``example_inputs``: its
    inputs. ``mode``/``options`` are what ``torch.compile`` forwards; see the module
    docstring for the keys.
    """
    inner, names, mode, opts = _parse_options(mode, options)
    ctx = apply_patterns(gm, example_inputs, only=names)
    stats["graphs"] += 1
    stats["rewrites"] += ctx.rewrites
    if inner == "auto":
        inner = "eager" if ctx.rewrites and _nothing_to_generate(gm) else "inductor"
    return _compile_inner(gm, example_inputs, inner, names, mode, opts)


def _nothing_to_generate(gm: fx.GraphModule) -> bool:
    """Only opreg ops, views and indexing: Inductor would add overhead and no speed."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            t = node.target
            if not (t in _VIEW_CALLS or (isinstance(t, torch._ops.OpOverload)
                                         and t.namespace == "opreg")):
                return False
        elif node.op == "call_method" and node.target not in _VIEW_METHODS:
            return False
        elif node.op == "call_module":
            return False
    return True


def op_name(node: fx.Node) -> str:
    """A readable name for what ``node`` calls: ``"opreg::scatter_combine"``,
    ``"index_add_"`` (a method), ``"cat"``, ``"linear"``, ``"mul"``."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if isinstance(t, torch._ops.OpOverload):
        return t.name()
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name
    return getattr(t, "__name__", str(t))


def op_counts(gm: fx.GraphModule) -> collections.Counter[str]:
    """How many times each op is called in ``gm`` (see :func:`op_name`)."""
    return collections.Counter(op_name(n) for n in gm.graph.nodes
                               if n.op in ("call_function", "call_method", "call_module"))


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
        inner, names, mode, opts = _parse_options(None, self.options)
        self.before.append(op_counts(gm))
        ctx = apply_patterns(gm, example_inputs, only=names)
        self.after.append(op_counts(gm))
        self.findings.extend(ctx.findings)
        self.graphs.append(gm)
        return _compile_inner(gm, example_inputs, inner, names, mode, opts)

    @property
    def near_misses(self) -> list[Finding]:
        return [f for f in self.findings if not f.matched]


def _register_backend() -> None:
    """Make ``backend="opreg"`` work once this module is imported.

    Without the entry point installed, register directly. With it, Dynamo's
    ``lookup_backend`` imports this module and then registers ``opreg_backend`` itself;
    registering here too would make it raise "duplicate name", so leave it to Dynamo
    whenever the entry point is known and not yet loaded.
    """
    from torch._dynamo.backends import registry

    compiler_fns = getattr(registry, "_COMPILER_FNS", {})
    if BACKEND_NAME in compiler_fns:
        return
    if getattr(registry, "_BACKENDS", {}).get(BACKEND_NAME) is not None:
        return  # the entry point: lookup_backend() registers us once we're loaded
    try:
        registry.register_backend(opreg_backend, name=BACKEND_NAME)
    except AssertionError:  # registered concurrently by another path: fine
        pass


_register_backend()
