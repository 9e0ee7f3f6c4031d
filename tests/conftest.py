"""Shared fixtures: a fresh random seed per session (printed, overridable with
OPREG_TEST_SEED so a failure can be replayed) and the devices to test on."""
from __future__ import annotations

import os
import random
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
