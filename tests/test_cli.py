"""The CLI a newcomer runs first: list, build, demo (in a fresh process each)."""
from __future__ import annotations

import subprocess
import sys


def opreg_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opreg", *args], capture_output=True,
                          text=True, timeout=900)


def test_list():
    out = opreg_cli("list")
    assert out.returncode == 0, out.stderr
    for word in ("scatter_combine", "cat_linear", "reference", "cpu", "cuda"):
        assert word in out.stdout


def test_build():
    out = opreg_cli("build")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "opreg_cpu" in out.stdout and "ok" in out.stdout
    assert "Overriding a previously registered kernel" not in out.stderr


def test_demo():
    out = opreg_cli("demo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("match") >= 2 and "MISMATCH" not in out.stdout


def test_bad_subcommand_is_an_error():
    assert opreg_cli("frobnicate").returncode != 0
