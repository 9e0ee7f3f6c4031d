"""Shared fixtures: a fresh random seed per session (printed, overridable with
OPREG_TEST_SEED so a failure can be replayed), and the property tests' example counts
in the terminal summary."""
from __future__ import annotations

import os
import random
import sys
import zlib

import pytest
import torch

SEED = int(os.environ.get("OPREG_TEST_SEED", random.randrange(2**31)))


def pytest_report_header(config: pytest.Config) -> str:
    return (f"opreg: OPREG_TEST_SEED={SEED}, torch {torch.__version__}, "
            f"cuda {'yes: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no'}")


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    # Fresh inputs every session, yet each test replayable from the printed seed.
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # How many examples hypothesis ran (tests/test_property.py), for the record: a bounded
    # budget that silently ran nothing would otherwise look like a pass.
    prop = sys.modules.get("test_property")
    counts = getattr(prop, "EXAMPLES", None)
    if counts:
        terminalreporter.write_sep("-", f"opreg property tests: {sum(counts.values())} examples")
        for name, n in sorted(counts.items()):
            terminalreporter.write_line(f"  {n:4d}  {name}")
