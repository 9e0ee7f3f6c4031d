"""Shared fixtures: a fresh random seed per session (printed, overridable with
OPREG_TEST_SEED so a failure can be replayed), and the property tests' example counts
in the terminal summary."""
from __future__ import annotations

import collections
import os
import random
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

import _fresh as fresh

# No `import torch` here: under pytest-xdist this module is imported by the controller too,
# which runs no test, and it imported torch and Dynamo (~5 s of CPU on the 2-core box)
# before starting the workers. Only the processes that run tests import them (below).

# Dynamo times each new graph's guards after flushing the CPU caches (a latency metric for
# its debug log: guards.py calls profile_guard_manager on every compile, torch 2.11 and
# 2.14). The flush costs ~35 ms a compile on the 2-core box: 124 -> 83 ms per mutation-trap
# case (40 cases, 2026-12-01), and the suite compiles ~1000 graphs. No test reads the
# metric; the guards themselves, and Dynamo's same-frame check of them, are untouched.
def _no_guard_latency_profile() -> None:
    import torch._dynamo.guards as guards

    if hasattr(guards, "profile_guard_manager"):
        guards.profile_guard_manager = lambda *args, **kwargs: 0.0


# In the environment, so that pytest-xdist's workers (started after this) draw the same one.
SEED = int(os.environ.setdefault("OPREG_TEST_SEED", str(random.randrange(2**31))))
# Each Triton launch found by a spec key is checked against the full key it stands for
# (backends/triton/launch.py, CHECK_SPEC; read at its import, after this): a test that
# changes what a spec means (configs, a knob) fails, naming the launch, instead of running a
# binary compiled for an earlier test's arguments (the H200 suite of 2026-12-05).
os.environ.setdefault("OPREG_CHECK_SPEC", "1")


def pytest_configure(config: pytest.Config) -> None:
    # pytest rewrites the asserts of every module of a package that ships a pytest plugin,
    # when imported: all of hypothesis (73 modules, ~1.3 s of CPU in each process that
    # imports it; the rewritten code is not cached where bytecode is not written, e.g. a
    # fresh clone or PYTHONDONTWRITEBYTECODE). Their asserts are their own invariants (they
    # still run, with plain messages); this suite's files are rewritten as before. Through
    # pytest's internals: where those differ, nothing changes.
    try:
        from _pytest.assertion import assertstate_key
    except ImportError:
        assertstate_key = None
    hook = getattr(config.stash.get(assertstate_key, None), "hook", None) if assertstate_key else None
    must = getattr(hook, "_must_rewrite", None)
    if isinstance(must, set):
        must.difference_update({"hypothesis", "pytest_benchmark", "xdist", "anyio"})
    # xdist >= 3.7 hands files out by their number of tests, most first, unless told not to
    # (--no-loadscope-reorder, an option older versions refuse): that ignored LONGEST_FIRST
    # and left files of a few long tests (the cache, first-use and sweep children) to the end.
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_report_header(config: pytest.Config) -> str:
    import torch

    return (f"opreg: OPREG_TEST_SEED={SEED}, torch {torch.__version__}, "
            f"cuda {'yes: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no'}")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    import torch

    # Fresh inputs every session, yet each test replayable from the printed seed.
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


# --dist loadfile hands whole files to the workers in collection order (pytest_configure
# turns off xdist's own order, below), so a long file handed out last leaves the other
# worker idle at the end. These go first, longest first (seconds of wall on the 2-core box,
# 2026-12-02: 50, 37, 33, 30, 22, 22, 19, 15, 15, 15, 15, 14, 11, 9, 9, 8, 8, 8, 7, 7, 6, 6,
# 5); the rest (4 s or less each) keep their order.
LONGEST_FIRST = ("test_transformers", "test_moe_triton_backward", "test_property", "test_mutation_traps",
                 "test_cat_linear", "test_moe_triton", "test_moe_experts", "test_scatter_combine",
                 "test_distributed", "test_patterns_cat_linear", "test_cache", "test_autograd",
                 "test_moe_hostile", "test_transformers_families", "test_patterns_scatter_combine",
                 "test_threads", "test_backend", "test_moe_gate", "test_sweep", "test_loops_forms",
                 "test_optimize", "test_moe_tune", "test_cli")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _no_guard_latency_profile()  # where tests run (not in xdist's controller), before any of them
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: files stay whole


_WORKER_EXAMPLES: collections.Counter[str] = collections.Counter()  # from xdist workers


def _examples() -> collections.Counter[str]:
    prop = sys.modules.get("test_property")
    return collections.Counter(getattr(prop, "EXAMPLES", None) or {})


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker hands its counts to the controller, which prints the summary.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["opreg_examples"] = dict(_examples())


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without it
def pytest_testnodedown(node: Any, error: Any) -> None:
    _WORKER_EXAMPLES.update(getattr(node, "workeroutput", {}).get("opreg_examples", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # How many examples hypothesis ran (tests/test_property.py), for the record: a bounded
    # budget that silently ran nothing would otherwise look like a pass.
    counts = _examples() + _WORKER_EXAMPLES
    if counts:
        terminalreporter.write_sep("-", f"opreg property tests: {sum(counts.values())} examples")
        for name, n in sorted(counts.items()):
            terminalreporter.write_line(f"  {n:4d}  {name}")


@pytest.fixture(scope="session")
def host_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel cache holding a current build of every host library, made once per test
    run and shared (tests copy it): seeded from the user's cache (under its lock) where
    that has one, built otherwise. Tests about the cache or first use start from a copy
    instead of building (a cold host build takes 30-60 s on 2 cores)."""
    from opreg import _build, _cache

    root = tmp_path_factory.mktemp("host-cache")
    src = _cache.root() / _cache.tag()
    for ext in _build.extensions():
        if not ext.cuda and (src / ext.name).is_dir() and (src / f"{ext.name}.lock").exists():
            with _build._exclusive(src / f"{ext.name}.lock"):
                shutil.copytree(src / ext.name, root / _cache.tag() / ext.name, symlinks=True)
    code = "import opreg._build as b; [b.build(e) for e in b.extensions() if not e.cuda]"
    out = fresh.run(["-c", code], timeout=900, env={**os.environ, "OPREG_CACHE_DIR": str(root)})
    if out.returncode != 0:
        pytest.skip(f"the host libraries do not build here: {out.stderr[-2000:]}")
    return root
