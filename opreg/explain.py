"""``python -m opreg explain pkg.module:factory``: what the opreg backend would rewrite.

For each place in the user's source: a match (which op replaces it) or a near miss and
why not (``cat on dim 0``, ``index_put_ without accumulate``, ``cat result used
elsewhere``, ...), plus the Python loops Dynamo can't trace that :func:`opreg.optimize`
rewrites (or why it wouldn't).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Sequence

import torch

import opreg

from . import loops
from .backend import apply_patterns, registered_patterns

__all__ = ["ExplainReport", "explain", "main"]


@dataclasses.dataclass
class ExplainReport:
    """Findings of one :func:`explain` run. ``matches``/``near_misses``: from the graph
    passes (:class:`opreg.backend.Finding`); ``loops``: from the loop rewriter
    (:class:`opreg.loops.LoopFinding`); ``graphs``: graphs Dynamo captured;
    ``graph_breaks``: Dynamo's reasons for breaking or skipping frames; ``choices``: with
    ``choose=True``, what the backend ran for each graph and why
    (:class:`opreg.compile.choose.Choice`)."""

    matches: list[Any]
    near_misses: list[Any]
    loops: list[Any]
    graphs: int
    graph_breaks: list[str]
    choices: list[Any] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        out = [f"opreg explain: {self.graphs} graph(s) captured by Dynamo"
               + (f", {len(self.graph_breaks)} graph break(s)/skipped frame(s)"
                  if self.graph_breaks else "")]
        out.append(f"\nrewritten by the opreg backend ({len(self.matches)}):")
        out += [f"  {f.where}: {f.spelling} -> opreg::{_op_of(f)}" + (f"    {f.code}" if f.code else "")
                for f in self.matches] or ["  (nothing)"]
        out.append(f"\nnear misses, left as written ({len(self.near_misses)}):")
        out += [f"  {f.where}: {f.spelling}: {f.reason}" + (f"\n      {f.code}" if f.code else "")
                for f in self.near_misses] or ["  (none)"]
        good = [f for f in self.loops if f.matched]
        bad = [f for f in self.loops if not f.matched]
        if self.loops:
            out.append(f"\nPython loops ({len(self.loops)}):")
            notes = {i.name: i.note for i in [*loops.registered_loop_idioms(), *loops.registered_module_rewrites()]}
            out += [f"  {f.where}: {f.code}\n      "
                    + (f"{notes[f.idiom]}; " if notes.get(f.idiom) else "")
                    + f"opreg.optimize(model) rewrites it to {f.op}" for f in good]
            out += [f"  {f.where}: {f.code}\n      not rewritable by opreg.optimize ({f.op}): {f.reason}"
                    for f in bad]
        if self.choices:
            out.append(f"\nwhat the backend runs, timed per graph ({len(self.choices)}):")
            out += [f"  {c}" for c in self.choices]
        if self.graph_breaks:
            out.append("\nDynamo graph breaks:")
            out += [f"  {r[:240]}" for r in self.graph_breaks]
        return "\n".join(out)


def _op_of(f: Any) -> str:
    if f.op:
        return f.op
    for p in registered_patterns():
        if p.name == f.pattern:
            return p.op or p.name
    return f.pattern


def explain(model: Callable[..., Any], example_inputs: Sequence[Any], *, print_report: bool = True,
            choose: bool = False) -> ExplainReport:
    """Compile ``model`` with the opreg passes (graphs run eagerly, ops bound to the
    reference implementation: nothing is built) on ``example_inputs``, and report each
    match and near miss with its ``file:line``; scan the model's methods for loops
    :func:`opreg.optimize` would rewrite. Resets Dynamo first (as ``torch._dynamo.explain``
    does), so earlier compiles don't hide graphs.

    ``choose``: also compile it with the real backend, timing the candidates of every graph
    (``options={"choose": "time"}``: this builds the kernels and runs Inductor), and report
    what runs for each graph and why.
    """
    findings: list[Any] = []
    graphs = 0

    def backend(gm: torch.fx.GraphModule, example: Sequence[Any]) -> Callable[..., Any]:
        nonlocal graphs
        graphs += 1
        findings.extend(apply_patterns(gm, example).findings)
        return gm.forward

    counters = torch._dynamo.utils.counters
    before = {k: dict(counters[k]) for k in ("graph_break", "unimplemented")}
    torch._dynamo.reset()
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with opreg.use("reference"):
        torch.compile(model, backend=backend)(*args)
    breaks = list(dict.fromkeys(
        " - ".join(x.strip() for x in r.strip().splitlines()[:2]) for k in ("graph_break", "unimplemented")
        for r, n in counters[k].items() if n > before[k].get(r, 0) and r.strip()))
    torch._dynamo.reset()  # don't leave our throwaway backend's code cached

    choices: list[Any] = []
    if choose:
        from .compile import choose as choosing

        before_choices = len(choosing.log)
        args = [a.clone() if isinstance(a, torch.Tensor) else a for a in example_inputs]
        torch.compile(model, backend="opreg", options={"choose": "time"})(*args)
        choices = choosing.log[before_choices:]
        torch._dynamo.reset()
    report = ExplainReport([f for f in findings if f.matched], [f for f in findings if not f.matched],
                           _loops(model), graphs, breaks, choices)
    if print_report:
        print(report)
    return report


def _loops(model: Callable[..., Any]) -> list[loops.LoopFinding]:
    """What :func:`opreg.optimize` would do to ``model``'s loops: the module rewrites'
    findings (a module they take: its ``forward`` is theirs), then what the loop idioms find
    in the methods (each function, each location, once)."""
    if not isinstance(model, torch.nn.Module):
        return loops.find_loops(model)
    seen: set[Any] = set()
    found: dict[str, loops.LoopFinding] = {}
    for m in model.modules():
        by_module = loops.module_findings(m)
        for f in by_module:
            found.setdefault(f.where, f)
        for name, fn in loops.user_functions(type(m)).items():
            fn = getattr(fn, "__opreg_original__", fn)
            if (by_module and name == "forward") or fn in seen:
                continue
            seen.add(fn)
            for f in loops.find_loops(fn):
                found.setdefault(f.where, f)
    return list(found.values())


# ======================================================================== command line

def _load(spec: str) -> tuple[Any, Any]:
    """(module, attribute) of ``pkg.module:attr`` or ``path/to/file.py:attr``; attr
    defaults to ``Model``."""
    target, _, attr = spec.partition(":")
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(target)
        name = os.path.splitext(os.path.basename(path))[0]
        s = importlib.util.spec_from_file_location(name, path)
        if s is None or s.loader is None:
            raise ImportError(f"cannot load {path}")
        mod = importlib.util.module_from_spec(s)
        sys.modules[name] = mod
        s.loader.exec_module(mod)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        mod = importlib.import_module(target)
    attr = attr or "Model"
    if not hasattr(mod, attr):
        raise AttributeError(f"{mod.__name__} has no {attr!r}")
    return mod, getattr(mod, attr)


def _call_with_device(fn: Callable[..., Any], device: str) -> Any:
    try:
        if "device" in inspect.signature(fn).parameters:
            return fn(device=device)
    except (TypeError, ValueError):
        pass
    return fn()


def main(argv: Sequence[str] | None = None) -> int:
    """``explain SPEC [--inputs NAME] [--device DEV]``.

    SPEC is ``pkg.module:factory`` (or ``file.py:factory``; factory defaults to
    ``Model``). ``factory()`` returns a model, or ``(model, example_inputs)``; without
    inputs they come from the module's ``get_inputs()`` (or ``--inputs NAME``), as in the
    reference models. A class factory gets the module's ``get_init_inputs()``.
    """
    p = argparse.ArgumentParser(prog="python -m opreg explain",
                                description="Show what the opreg backend rewrites in a model.")
    p.add_argument("spec", help="pkg.module:factory or path/to/file.py:factory")
    p.add_argument("--inputs", default="get_inputs",
                   help="function in the module returning example inputs (default get_inputs)")
    p.add_argument("--device", default="cpu", help="device for the model and inputs (default cpu)")
    p.add_argument("--choose", action="store_true",
                   help="also compile with the backend, time each graph's candidates (rewritten or "
                        "not, eager or Inductor) and say which runs and why")
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        mod, factory = _load(args.spec)
    except (ImportError, AttributeError, OSError) as e:
        print(f"opreg explain: {e}", file=sys.stderr)
        return 2
    init = getattr(mod, "get_init_inputs", None) if inspect.isclass(factory) else None
    made = factory(*(init() if init else []))
    if isinstance(made, tuple) and len(made) == 2:
        model, inputs = made
    else:
        model, get = made, getattr(mod, args.inputs, None)
        if get is None:
            print(f"opreg explain: {factory!r} returned only a model and {mod.__name__} has no "
                  f"{args.inputs}() for example inputs", file=sys.stderr)
            return 2
        inputs = _call_with_device(get, args.device)
    if isinstance(model, torch.nn.Module):
        model = model.to(args.device)
    inputs = [x.to(args.device) if isinstance(x, torch.Tensor) else x for x in inputs]
    explain(model, inputs, choose=args.choose)
    return 0
