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
* ``"choose"``: with ``inner="auto"``, whether to time the candidates at compile time and run
  the fastest: the rewritten graph and the one Dynamo captured, each as is and through
  Inductor (:mod:`opreg.compile.choose`; a rewrite must lead by ``choose.REWRITE_MARGIN``).
  ``"auto"`` (default): graphs on a CUDA device; ``"time"``: every graph; ``"rules"``:
  never (the rule above decides).
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

That graph is not functional, so mutation is handled by the patterns and the framework
(:mod:`opreg.compile.mutation`): an
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

Custom patterns: :func:`opreg.backend.register_pattern` adds one from outside the
package, either a search/replacement pair of plain functions or a
:class:`~opreg.compile.pattern.GraphPattern` subclass.
"""
from __future__ import annotations

import collections
import operator
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from . import choose
from .pass_manager import apply_patterns, patterns_uuid, registered_patterns
from .pattern import GraphPattern

__all__ = ["BACKEND_NAME", "inductor_config_patches", "opreg_backend", "stats"]

BACKEND_NAME = "opreg"
INNER_COMPILERS = ("auto", "inductor", "aot_eager", "eager")
# What may sit beside opreg ops in a graph that "auto" runs without Inductor: views and
# indexing only (nothing that computes, so nothing for Inductor to fuse or schedule).
_VIEW_CALLS = {operator.getitem, torch.unbind, torch.select, torch.narrow, torch.t,
               torch.transpose, torch.permute, torch.reshape, torch.squeeze, torch.unsqueeze}
_VIEW_METHODS = {"unbind", "select", "narrow", "t", "transpose", "permute", "view", "reshape",
                 "squeeze", "unsqueeze", "size", "dim", "contiguous", "expand"}

#: Totals since import (tests reset them): "graphs" compiled, "rewrites" made.
stats: collections.Counter[str] = collections.Counter()


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


def parse_options(mode: str | None, options: Mapping[str, Any] | None
                  ) -> tuple[str, list[str] | None, str | None, dict[str, Any], str]:
    opts = dict(options or {})
    inner = opts.pop("inner", "auto")
    names = opts.pop("patterns", None)
    mode = opts.pop("mode", mode)
    how = opts.pop("choose", "auto")
    if inner not in INNER_COMPILERS:
        raise ValueError(f"opreg backend: inner must be one of {INNER_COMPILERS}, got {inner!r}")
    if how not in choose.CHOICES:
        raise ValueError(f"opreg backend: choose must be one of {choose.CHOICES}, got {how!r}")
    if names is not None:
        names = [] if names is False else [names] if isinstance(names, str) else list(names)
    if inner == "auto" and (opts or (mode and mode != "default")):
        inner = "inductor"
    if inner != "inductor" and (opts or (mode and mode != "default")):
        raise ValueError(f"opreg backend: Inductor options/mode given with inner={inner!r}: "
                         f"{sorted(opts)} {mode or ''}".strip())
    if how == "time" and inner != "auto":
        raise ValueError(f"opreg backend: choose='time' picks the inner compiler, but inner={inner!r} was given")
    return inner, names, mode, opts, how


def compile_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], inner: str,
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
    inner, names, mode, opts, how = parse_options(mode, options)
    timed = inner == "auto" and (how == "time" or (how == "auto" and _on_cuda(example_inputs)))
    captured = _copy(gm) if timed else None
    ctx = apply_patterns(gm, example_inputs, only=names)
    stats["graphs"] += 1
    stats["rewrites"] += ctx.rewrites
    if inner != "auto":
        return compile_inner(gm, example_inputs, inner, names, mode, opts)
    rule = "eager" if ctx.rewrites and _nothing_to_generate(gm) else "inductor"
    refusal = choose.timing_refusal(captured, example_inputs, ctx.fake_mode) if captured is not None else None
    if captured is None or refusal is not None:
        if refusal is not None:
            choose.record_refusal(gm, f"{'rewritten' if ctx.rewrites else 'captured'}/{rule}", refusal)
        return compile_inner(gm, example_inputs, rule, names, mode, opts)

    def compiled(g: fx.GraphModule, compiler: str) -> Callable[[], Callable[..., Any]]:
        def make() -> Callable[..., Any]:
            # The backward compiled now, not at its first run: that run (the timing's)
            # happens inside this compile, where a lazy backward compile fails
            # ("Metric(s) {'is_forward'} have already been set").
            with choose.eager_backward():
                return compile_inner(g, example_inputs, compiler, names, mode, opts)
        return make

    # The rule's pick first (the default if the others fail), then the rest.
    candidates = {f"rewritten/{rule}": compiled(gm, rule)} if ctx.rewrites else {}
    if ctx.rewrites and rule == "inductor":
        candidates["rewritten/eager"] = compiled(gm, "eager")
    candidates["captured/inductor"] = compiled(captured, "inductor")
    candidates["captured/eager"] = compiled(captured, "eager")
    _, fn, _ = choose.choose(candidates, example_inputs, gm, captured=lambda name: name.startswith("captured/"))
    return fn


def _on_cuda(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)


# What Dynamo leaves on its GraphModule and on its placeholders beyond the graph and the
# nodes' meta, which AOTAutograd reads to recognise a Dynamo graph (torch's "Note [Assumption on
# Dynamo Metadata]": the parameters' sources, hence the static inputs, and the sources of the
# inputs for its dedup guards). A copy without them compiled differently through Inductor:
# another order of the saved tensors and another fusion of the backward's kernels
# (ln-cat8-linear-gelu fwd+bwd, CPU, torch 2.14: `cpp_fused_gelu_backward_0` + a kernel
# instead of torch.compile's own `cpp_fused_gelu_backward_native_layer_norm_sum_0` + a kernel),
# where "captured/inductor" must be exactly what torch.compile's Inductor runs.
_DYNAMO_MODULE_ATTRS = ("_param_name_to_source", "_source_to_user_stacks", "compile_subgraph_reason")
_DYNAMO_NODE_ATTRS = ("_dynamo_source",)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A second module over a copy of ``gm``'s graph (the nodes' meta shared, shallowly; the
    attributes, parameters included, are ``gm``'s own, not copies), with Dynamo's metadata
    on the module and its nodes carried over."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    values: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, values)
    for node in gm.graph.nodes:
        if node.op == "output":
            graph.node_copy(node, lambda n: values[n])
        for attr in _DYNAMO_NODE_ATTRS:
            if node in values and hasattr(node, attr):
                setattr(values[node], attr, getattr(node, attr))
    out = fx.GraphModule(gm, graph)
    out.meta = dict(gm.meta)
    for attr in _DYNAMO_MODULE_ATTRS:
        if hasattr(gm, attr):
            setattr(out, attr, getattr(gm, attr))
    return out


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
