"""Timing for the benchmarks (METHOD.md): warm-up, interleaved rounds, medians.

``interleaved(variants, ...)`` times several implementations of one computation side
by side: each round runs one batch of back-to-back calls of every variant (the order
reversed every other round), so host drift on the VM (±30 % within a minute, RESULTS.md)
hits them alike, and the ratio of two variants is taken round by round. Each call
gets its own input set by index (the caller rotates among enough sets that the inputs
don't sit in L2). On CUDA a batch is timed with events, after a synchronisation so
that the queue is empty when it starts: a batch then costs what a model sees, the
larger of host and device time per call (a host-bound variant timed right behind a
device-bound one would otherwise hide its host time under the other's queue).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

Call = Callable[[int], Any]  # call(i): one call on input set i


@dataclass
class Variant:
    call: Call
    before: Optional[Callable[[], None]] = None  # run before each batch, untimed (e.g. set an env var)
    after: Optional[Callable[[], None]] = None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class _Batch:
    """Start/stop of one timed batch: CUDA events, or the host clock on the CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.b.record()
        else:
            self.us = (time.perf_counter() - self.t0) * 1e6

    def elapsed_us(self) -> float:
        return self.a.elapsed_time(self.b) * 1e3 if self.cuda else self.us


def _run_batch(v: Variant, device: str, batch: int, first: int, nsets: int) -> _Batch:
    if v.before:
        v.before()
    sync(device)
    t = _Batch(device)
    t.start()
    for j in range(batch):
        v.call((first + j) % nsets)
    t.stop()
    if v.after:
        v.after()
    return t


def estimate_us(v: Variant, device: str, nsets: int, calls: int = 3) -> float:
    """Rough per-call time (after one untimed call): picks the batch size."""
    _run_batch(v, device, 1, 0, nsets)
    t = _run_batch(v, device, calls, 1, nsets)
    sync(device)
    return max(t.elapsed_us() / calls, 1e-3)


def batch_for(est_us: float, target_us: float, max_batch: int = 200, min_batch: int = 1) -> int:
    """Calls per batch so that a batch lasts about ``target_us`` (>= ``min_batch`` calls)."""
    return max(1, min_batch, min(max_batch, math.ceil(target_us / est_us)))


def interleaved(variants: dict[str, Variant], device: str, *, nsets: int = 1, rounds: int = 7,
                target_us: float = 1000.0, warmup: int = 2, min_batch: int = 1) -> dict[str, list[float]]:
    """Per-call µs of every variant in each of ``rounds`` rounds. Each variant's batch
    lasts about ``target_us`` (its own batch size: a host-bound variant timed over a
    handful of calls would be dominated by the first call's start-up). Round r starts at
    variant r mod n and goes round, so every variant takes every place in a round equally
    often: with the former order (forwards, then backwards) the middle one of three never
    ran first or last, so whatever a place costs (what ran just before it: the previous
    round's last variant, its allocations and its gradients' frees) fell on the other two
    only, and cat_linear's sweep compares opreg, the first, with eager, the middle one.
    ``min_batch``: at least this many calls a batch, however long a call is. A batch of one
    call starts on an empty queue and ends when its last kernel does, so it costs the host's
    time to its first kernels plus the device's time: the sum, where back-to-back calls (a
    model's layers) cost the larger of the two."""
    names = list(variants)
    batch = {k: batch_for(estimate_us(variants[k], device, nsets), target_us, min_batch=min_batch) for k in names}
    for _ in range(warmup):
        for k in names:
            _run_batch(variants[k], device, 1, 0, nsets)
    marks: dict[str, list[_Batch]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            marks[k].append(_run_batch(variants[k], device, batch[k], r * batch[k], nsets))
    sync(device)
    return {k: [m.elapsed_us() / batch[k] for m in ms] for k, ms in marks.items()}


def capture(call: Call, nsets: int, calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls (input sets in turn) captured in one CUDA graph, after a warm-up off
    the capture (allocator, lazy init) and one replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            call(i % nsets)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(calls):
            call(j % nsets)
    g.replay()
    torch.cuda.synchronize()
    return g


def replay_us(g: torch.cuda.CUDAGraph, calls: int) -> float:
    """One replay of ``g`` (``calls`` calls), timed with CUDA events: us per call."""
    t = _Batch("cuda")
    t.start()
    g.replay()
    t.stop()
    t.b.synchronize()
    return t.elapsed_us() / calls


def graph_us(v: Variant, nsets: int, calls: int = 20, reps: int = 9) -> float:
    """Device time per call with the host taken out: ``calls`` calls (input sets in turn)
    captured in one CUDA graph, replayed ``reps`` times, median per call. What a kernel
    costs where launches are free (a CUDA graph, a queue the host keeps full); the batches
    of :func:`interleaved` cost the larger of host and device time instead."""
    g = capture(v.call, nsets, calls)
    times = [replay_us(g, calls) for _ in range(reps)]
    del g
    return median(times)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[r] / b[r]: a's time relative to b's, drift cancelled."""
    return statistics.median(x / y for x, y in zip(a, b))


def copy_bandwidth(device: str, nbytes: Optional[int] = None, reps: int = 9) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written
    (the copy ceiling that bandwidth-bound kernels are compared with)."""
    nbytes = nbytes or ((1 << 30) if device == "cuda" else (64 << 20))
    src = torch.rand(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    v = Variant(lambda i: dst.copy_(src))
    times = interleaved({"copy": v}, device, rounds=reps, target_us=1.0, warmup=2)["copy"]
    return 2 * src.numel() * 4 / (median(times) * 1e-6)


def l2_bytes(device: str) -> int:
    """The last-level cache the rotation of input sets must exceed (a guess on the CPU)."""
    if device == "cuda":
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    return 32 << 20


def sets_needed(set_bytes: int, device: str, cap_sets: int = 8, cap_bytes: int = 4 << 30) -> int:
    """Input sets to rotate so that one pass over them is >= 2x the cache (bounded)."""
    want = math.ceil(2 * l2_bytes(device) / max(set_bytes, 1))
    return max(1, min(cap_sets, want, cap_bytes // max(set_bytes, 1)))
