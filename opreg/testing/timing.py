"""The median time of back-to-back calls, as the benchmarks and ``opreg tune`` take it, and the
host time to enqueue a call."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def median_us(call: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Median of ``reps`` back-to-back calls after 3 warm-ups, in µs: CUDA events around
    each call where ``cuda`` (the GPU's time, launches queued back to back), the wall clock
    elsewhere."""
    for _ in range(3):
        call()
    if not cuda:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def captured(call: Callable[[], Any], calls: int = 1, warmups: int = 3) -> tuple[Any, Any]:
    """``calls`` calls captured in one CUDA graph, after ``warmups`` calls on a side stream (as
    capture needs): the graph, not yet replayed, and the last call's output (the tensors the
    replays write)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = call()
    return graph, out


def graph_us(call: Callable[[], Any], reps: int, calls: int = 20) -> float:
    """Device time of one call, in µs: ``calls`` calls captured in one CUDA graph (after
    warm-ups on a side stream, as capture needs), the graph replayed ``reps`` times under
    CUDA events, the median replay divided by ``calls``. For calls that are all host where
    they run eagerly (the MoE decode path: ~76 µs a call on the H200 box whatever the
    shape, its kernels' bytes ~16-21 µs at the HBM's rate), whose back-to-back events
    (:func:`median_us`) time the host instead. ``call`` must be capturable."""
    graph, _ = captured(call, calls)
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events) / calls


def host_us(call: Callable[[], Any], reps: int = 20, warmup: int = 3) -> float:
    """Host time to enqueue one call on CUDA, in µs: the wall clock of a batch of ``reps``
    calls with no sync inside (after ``warmup`` calls and a sync). A call whose host time
    exceeds its GPU time is launch-bound, and events then measure the host."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def host_once_us(call: Callable[[], Any], reps: int = 10, warmup: int = 3) -> float:
    """Host time to enqueue one call on an idle GPU, in µs: the median over ``reps`` of the
    wall clock of a single call, each after a sync. Unlike :func:`host_us`, whose batch can
    fill the launch queue of a GPU-bound call and then wait on the GPU (its figure tends to
    the GPU time), no call here waits on queued work, unless it syncs by itself."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)
