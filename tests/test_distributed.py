"""opreg under torch.distributed: 2 processes (forked from tests/_fresh.py's server; gloo on the CPU,
loopback only, and, where 2 GPUs exist, NCCL with one GPU per process) train a small
MoE + cat_linear model (tests/_dist_worker.py) with ``torch.compile(..., backend="opreg")``
under DDP and FSDP2, and every loss, gradient and parameter equals the single-process eager
run (one GPU for NCCL) on the same global batch.

DDP under torch.compile splits the Dynamo graph at bucket boundaries (DDPOptimizer) before
the backend sees it: scatter_combine (no parameter inside the pattern) survives any
split; cat_linear does not when the linear's parameters close a bucket, since the cat
lands in one subgraph and the linear in the next ("ddp_split", checked through the
counters and opreg.explain); with ``torch._dynamo.config.optimize_ddp = False`` it
matches again ("ddp_nosplit").

All scenarios run in one launch (about 15 s on 2 cores, most of it imports and Dynamo);
the launch has a hard deadline, after which the workers are killed and the tests fail.
"""
from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest
import torch

import _dist_worker as w
import _fresh as fresh
from _util import once_per_run

DEADLINE_S = 180   # the launch takes ~15 s; a hung collective times out in the workers at 60 s
TOL = {"rtol": 1e-5, "atol": 1e-6}

# What each scenario matches (graphs: at least this many, from the backend's counters).
MATCHED_ALL = {"scatter_combine": {"index_add_": 1}, "cat_linear": {"linear": 1}}
EXPECTED = {
    "ddp": (MATCHED_ALL, 1),
    "ddp_split": ({"scatter_combine": {"index_add_": 1}, "cat_linear": {}}, 2),
    "ddp_nosplit": (MATCHED_ALL, 1),
    "fsdp2": (MATCHED_ALL, 1),
}
OPS_ALL = ["opreg::cat_linear_stacked", "opreg::scatter_combine", "opreg::scatter_combine_backward"]
RAN = {"ddp": OPS_ALL, "ddp_split": OPS_ALL[1:], "ddp_nosplit": OPS_ALL, "fsdp2": OPS_ALL}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < w.WORLD, reason=f"NCCL run needs {w.WORLD} GPUs"))]


class _PortTaken(Exception):
    """The free port was taken between probing and binding."""


def _launch(out_dir: str, device: str) -> None:
    """Start the 2 workers and wait, at most DEADLINE_S; kill them past it. Each is forked
    from tests/_fresh.py's server, which has imported torch: a spawned worker spent ~3.5 s
    of CPU importing it again (2 of them, on a 2-core box where CPU is the limit)."""
    args = [str(w.free_port()), out_dir, ",".join(w.SCENARIOS), device]
    procs = [fresh.Popen([w.__file__, str(rank), *args]) for rank in range(w.WORLD)]
    deadline = time.monotonic() + DEADLINE_S
    try:
        # until both are done or one failed (the other would wait for it in a collective)
        while any(p.returncode is None for p in procs) and all(p.returncode in (None, 0) for p in procs):
            if time.monotonic() >= deadline:
                pytest.fail(f"distributed workers still running after {DEADLINE_S} s: killed")
            for p in procs:
                if p.returncode is None:
                    try:
                        p.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        pass
        for rank, p in enumerate(procs):
            if p.returncode not in (None, 0):
                err = p.communicate()[1]
                if "address already in use" in err.lower():
                    raise _PortTaken(err[-2000:])
                pytest.fail(f"rank {rank} exited with {p.returncode}:\n{err[-6000:]}")
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def results(device: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per rank: scenario -> what the worker recorded (or {"error": traceback}). One launch
    per device and test run, whichever xdist workers run the scenarios' tests."""
    def launch(folder: Any) -> None:
        try:
            _launch(str(folder), device)
        except _PortTaken:
            _launch(str(folder), device)   # the free port was taken between probing and binding: retry once

    out_dir = once_per_run(tmp_path_factory, f"distributed-{device}", launch)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(w.WORLD)]


@pytest.fixture(scope="module")
def references(device: str) -> dict[int, dict[str, Any]]:
    return {k: w.reference(k, device) for k in (w.K_SMALL, w.K_BIG)}


def _scenario(results: list[dict[str, Any]], scenario: str, rank: int) -> dict[str, Any]:
    got = results[rank].get(scenario)
    assert got is not None, f"rank {rank} recorded nothing for {scenario}"
    assert "error" not in got, f"rank {rank}, {scenario}:\n{got['error']}"
    return got


@pytest.mark.parametrize("scenario", list(w.SCENARIOS))
def test_training_matches_single_process_eager(scenario: str, results: list[dict[str, Any]],
                                               references: dict[int, dict[str, Any]]) -> None:
    """Each rank's loss on its shard, the averaged gradients of every step and the final
    parameters equal the single-process eager run on the whole batch (fp32)."""
    ref = references[w.SCENARIOS[scenario][0]]
    for rank in range(w.WORLD):
        got = _scenario(results, scenario, rank)
        for step in range(w.STEPS):
            torch.testing.assert_close(got["losses"][step], ref["losses"][step][rank], **TOL,
                                       msg=lambda m: f"rank {rank} step {step} loss: {m}")
            assert got["grads"][step].keys() == ref["grads"][step].keys()
            for name, g in ref["grads"][step].items():
                torch.testing.assert_close(got["grads"][step][name], g, **TOL,
                                           msg=lambda m: f"rank {rank} step {step} {name}.grad: {m}")
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, **TOL,
                                       msg=lambda m: f"rank {rank} {name} after training: {m}")


@pytest.mark.parametrize("scenario", list(w.SCENARIOS))
def test_patterns_matched_and_ops_ran(scenario: str, results: list[dict[str, Any]]) -> None:
    """The backend's counters (matches per pattern, graphs) and the profiler: the opreg
    ops ran in every step, forward and backward. Under "ddp_split" cat_linear is not
    matched: DDPOptimizer put the cat and the linear in different graphs."""
    matches, min_graphs = EXPECTED[scenario]
    for rank in range(w.WORLD):
        got = _scenario(results, scenario, rank)
        assert got["matches"] == matches, f"rank {rank}: {got['matches']}"
        assert got["graphs"] >= min_graphs, f"rank {rank}: {got['graphs']} graph(s)"
        for step, ran in enumerate(got["ran"]):
            assert ran == RAN[scenario], f"rank {rank} step {step}: ran {ran}"


def test_ddp_graph_split_reported_by_explain(results: list[dict[str, Any]]) -> None:
    """opreg.explain on the DDP model (no compile of its own beyond explain's) sees the
    graphs DDPOptimizer hands the backend: split in two under small buckets, scatter_combine
    matched, cat_linear a near miss that names the split (the cat is an output of one
    piece, the linear in the next); one graph, both matched and no near miss otherwise."""
    for rank in range(w.WORLD):
        split = _scenario(results, "ddp_split", rank)["explain"]
        assert split["graphs"] >= 2, split["text"]
        assert split["matches"] == [("scatter_combine", "index_add_")], split["text"]
        assert [p for p, _ in split["near_misses"]] == ["cat_linear"], split["text"]
        assert "DDP's graph split" in split["near_misses"][0][1], split["text"]
        assert "optimize_ddp = False" in split["text"], split["text"]
        for scenario in ("ddp", "ddp_nosplit"):
            whole = _scenario(results, scenario, rank)["explain"]
            assert whole["graphs"] == 1, whole["text"]
            assert whole["matches"] == [("cat_linear", "linear"), ("scatter_combine", "index_add_")], \
                whole["text"]
            assert whole["near_misses"] == [], whole["text"]
