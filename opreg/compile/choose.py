"""The backend's choice per graph: the rewritten graph or the one Dynamo captured, each run
as is or through Inductor, timed at compile time on the graph's own inputs; the fastest runs.

Why time: a rewrite pays only where the fused op beats what it replaces at the graph's shapes,
and Inductor itself can lose to eager (H200, 2026-12-02, ``bench/backend_models.py``: a
trainable LayerNorm -> cat of 8 slices -> Linear head, bf16, T 4096: eager 0.175 ms, Inductor
0.207; the same without the LayerNorm, eager 0.115, Inductor 0.256). No model of Inductor's
generated code predicts that; one run of each candidate does.

When it times (``options={"choose": ...}`` of the backend):

* ``"auto"`` (default): graphs on a CUDA device. On the CPU, compiling a second Inductor graph
  costs seconds for tiny kernels, and the rules decide (the backend's ``inner="auto"``);
* ``"time"``: every graph (tests use it on the CPU);
* ``"rules"``: never.

It never times a graph in a process group of several ranks (each would time on its own, and
could choose, or run a collective, differently), nor one that may write into its inputs or the
module's attributes (an in-place op on them, batch norm's running stats; a module call, whose
writes are unknown: running it again would repeat the write; writes into tensors the graph
makes itself are made afresh by every run) or whose inputs are fake (no data to
run on); the rules decide there, and the report says why. The random number generators'
states are restored afterwards, so the user's random stream is the one it would have been.
With gradients flowing out of the graph, a candidate is timed as forward + backward
(``torch.autograd.grad``: nothing accumulates into any ``.grad``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .._log import logger
from .fx_utils import meta_value, user_frame
from .mutation import ANYTHING, storage, written

__all__ = ["CHOICES", "Choice", "choose", "record_refusal", "timing_refusal"]

CHOICES = ("auto", "time", "rules")
# Per candidate: warm-up calls, then ROUNDS interleaved rounds of a batch each; a batch runs
# about BATCH_S, and the whole timing stops starting rounds after BUDGET_S.
WARMUP, ROUNDS, BATCH_S, BUDGET_S = 2, 5, 2e-3, 1.0
# A candidate that is not the graph as captured (a rewrite) runs only where it beats the
# fastest captured one by this fraction: when in doubt, don't rewrite. Why 5 %: the timing
# is a handful of ~2 ms batches, and a rewrite's lead over the same graph moved by 1.5-4.6
# points between two runs on the H200 (bench/backend_models.py, 2026-12-03: the MoE
# index_add forward's rewrite led by 2.2 % in one run, 6.8 % in the other; cat8-linear
# fwd+bwd's by 3.2 % and 4.7 %): a smaller lead is within that noise.
REWRITE_MARGIN = 0.05


@dataclasses.dataclass
class Choice:
    """One graph's choice: ``where`` (the user's first line in it), ``chosen`` (a
    candidate's name, or ``"rules"``), the median ms per call of each candidate timed, and
    ``why`` (the times compared, or why nothing was timed)."""

    where: str
    chosen: str
    times_ms: dict[str, float]
    why: str

    def __str__(self) -> str:
        return f"{self.where}: ran {self.chosen} ({self.why})"


#: Every choice since import, newest last (tests and ``explain`` read it).
log: list[Choice] = []


def timing_refusal(gm: fx.GraphModule, example_inputs: Sequence[Any], fake_mode: Any) -> str | None:
    """Why this graph can't be timed on its inputs, or None."""
    if world_size() > 1:
        # each rank would time on its own: their choices (and the number of timed runs of a
        # graph holding a collective) could differ between ranks
        return "torch.distributed is initialized: ranks could choose differently"
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and (isinstance(x, torch._subclasses.FakeTensor) or x.is_meta):
            return "its inputs are fake"
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph is being captured (timing synchronizes)"
    if fake_mode is None:
        return "it holds no fake values to check its writes on"
    # Memory a rerun could change: the inputs' and the module attributes' (views share their
    # storage). A write into a tensor the graph made itself (zeros(...).index_add_(...)) is
    # made afresh by every run.
    outside = _outside_storages(gm)
    cache: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        w = written(node, fake_mode, cache)
        if w == ANYTHING or (w and (outside is None or outside & w)):  # type: ignore[operator]
            file, line, _ = user_frame(node)
            what = "may write memory" if w == ANYTHING else "writes into an input"
            return f"it {what} ({node.format_node()[:80]} at {file}:{line}): running it again would repeat that"
    return None


def _outside_storages(gm: fx.GraphModule) -> set[Any] | None:
    """The storages of the graph's inputs and attributes (from their recorded values), or
    None where one has no recorded value (then every write counts as reaching them)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            v = meta_value(n)
            if v is None:
                return None
            st = storage(v)
            if st is not None:
                out.add(st)
    return out


def eager_backward() -> Any:
    """A context in which AOTAutograd compiles a graph's backward with its forward."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return functorch_config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def where(gm: fx.GraphModule) -> str:
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            file, line, _ = user_frame(node)
            if file:
                return f"{file}:{line}"
    return "<graph>"


def choose(candidates: dict[str, Callable[[], Callable[..., Any]]], example_inputs: Sequence[Any],
           gm: fx.GraphModule, captured: Callable[[str], bool] = lambda name: False
           ) -> tuple[str, Callable[..., Any], Choice]:
    """Compile each candidate (name -> a function compiling it), time each on
    ``example_inputs`` and return the fastest's name, callable and the recorded choice.
    The first candidate is the default: a candidate that fails to compile or run is left
    out (logged), and if only the default is left it runs. Where some candidates run the
    graph as captured (``captured(name)``), another wins only by :data:`REWRITE_MARGIN`."""
    compiled: dict[str, Callable[..., Any]] = {}
    for name, make in candidates.items():
        try:
            compiled[name] = make()
        except Exception as e:  # noqa: BLE001 - a candidate that fails is not a choice
            if not compiled:
                raise  # the default itself: the user's error, as without the choice
            logger.info("opreg backend: candidate %s failed to compile: %s", name, e)
    t0 = time.perf_counter()
    times = _time(compiled, example_inputs, gm)
    best = min(times, key=times.__getitem__) if times else next(iter(compiled))
    why = ", ".join(f"{k} {v:.4g} ms" for k, v in sorted(times.items(), key=lambda kv: kv[1]))
    why += f"; timed in {time.perf_counter() - t0:.2f} s"
    as_is = [k for k in times if captured(k)]
    if not captured(best) and as_is:
        alt = min(as_is, key=times.__getitem__)
        if times[best] > (1 - REWRITE_MARGIN) * times[alt]:
            why += (f"; {best} is ahead by less than {REWRITE_MARGIN:.0%} of {alt}: "
                    f"the graph runs as captured")
            best = alt
    c = Choice(where(gm), best, times, why)
    log.append(c)
    logger.info("opreg backend: %s", c)
    return best, compiled[best], c


def record_refusal(gm: fx.GraphModule, rule: str, why: str) -> Choice:
    """Record (and log) that ``gm`` was not timed, ``why``, and that ``rule`` runs."""
    c = Choice(where(gm), f"rules: {rule}", {}, f"not timed: {why}")
    log.append(c)
    logger.info("opreg backend: %s", c)
    return c


def _time(fns: dict[str, Callable[..., Any]], inputs: Sequence[Any], gm: fx.GraphModule) -> dict[str, float]:
    """Median ms per call of each fn on ``inputs`` (forward, or forward + backward where
    gradients flow), interleaved rounds; a fn that raises is left out."""
    devices = sorted({x.device.index or 0 for x in inputs if isinstance(x, torch.Tensor) and x.is_cuda})
    cuda = bool(devices)
    grads_wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads_wrt += [p for p in gm.parameters() if p.requires_grad]

    def step(fn: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = fn(*inputs)
            flat = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if flat and grads_wrt:
                torch.autograd.grad(flat, grads_wrt, [torch.ones_like(o) for o in flat], allow_unused=True)
            return out
        return run

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    runs = {k: step(f) for k, f in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in runs}
    with torch.random.fork_rng(devices=devices):
        for name in list(runs):
            try:
                for _ in range(WARMUP):
                    runs[name]()
                sync()
            except Exception as e:  # noqa: BLE001
                logger.info("opreg backend: candidate %s failed on the graph's inputs: %s", name, e)
                del runs[name], samples[name]
        reps = {}
        for name, run in runs.items():  # calls per batch: about BATCH_S each
            sync()
            t = time.perf_counter()
            run()
            sync()
            reps[name] = max(1, min(100, int(BATCH_S / max(time.perf_counter() - t, 1e-6))))
        deadline = time.perf_counter() + BUDGET_S
        for _ in range(ROUNDS):
            for name, run in runs.items():
                sync()
                t = time.perf_counter()
                for _ in range(reps[name]):
                    run()
                sync()
                samples[name].append((time.perf_counter() - t) / reps[name] * 1e3)
            if time.perf_counter() > deadline:
                break
    return {k: statistics.median(v) for k, v in samples.items() if v}
