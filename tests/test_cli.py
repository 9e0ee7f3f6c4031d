"""The CLI a newcomer runs first: list, build, demo (in a fresh process each)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from opreg import _build

import _fresh as fresh


def opreg_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return fresh.run(["-m", "opreg", *args], timeout=900, env={**os.environ, **env})


def test_list():
    out = opreg_cli("list")
    assert out.returncode == 0, out.stderr
    for word in ("scatter_combine", "cat_linear", "reference", "cpu", "cuda"):
        assert word in out.stdout


def test_list_names_a_bad_cache_and_builds_nothing(tmp_path):
    (tmp_path / "file").write_text("")
    out = opreg_cli("list", OPREG_CACHE_DIR=str(tmp_path / "file"))
    assert out.returncode == 0, out.stderr
    row = next(ln for ln in out.stdout.splitlines() if re.match(r"scatter_combine +cpu ", ln))
    assert "no" in row.split() and "is not a directory" in row and "OPREG_CACHE_DIR" in row
    out = opreg_cli("list", OPREG_CACHE_DIR=str(tmp_path / "new"))
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "new").exists()  # a probe: nothing created, nothing built


def outcomes(stdout: str) -> dict[str, str]:
    """library -> its "ok, <how> (<s> s)" word, from ``opreg build``'s output."""
    found, lib = {}, None
    for line in stdout.splitlines():
        if m := re.match(r"\[\d+/\d+\] (\w+): ", line):
            lib = m.group(1)
        elif m := re.match(r"  ok, ([a-z ]+) \(\d+\.\d s\): ", line):
            found[lib] = m.group(1)
    return found


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return v >= (major, minor)


def test_build(tmp_path, host_cache):
    """Every host library is listed with its time and how it came: compiled (or up to
    date) the first time if needed, then "cached" (loaded with no ninja run). In a copy of
    the test run's host cache, host libraries only: building every library (CUDA's too,
    40 s on the H200) is ``.ci/run``'s and ``bench/device_run.sh``'s own first step."""
    cache = str(shutil.copytree(host_cache, tmp_path / "cache", symlinks=True))
    out = opreg_cli("build", "--only", "cpu", OPREG_CACHE_DIR=cache)
    assert out.returncode == 0, out.stdout + out.stderr
    host = {e.name for e in _build.extensions() if not e.cuda}
    assert set(outcomes(out.stdout)) >= host, out.stdout
    assert set(outcomes(out.stdout).values()) <= {"compiled", "up to date", "cached", "rebuilt"}
    if _torch_at_least(2, 12):
        # torch <= 2.11's dispatcher prints this C++ warning once per op and key when a
        # kernel library registers above the registry's Python stubs (by design: stubs are
        # never unregistered, see opreg/registry.py); 2.12+ doesn't.
        assert "Overriding a previously registered kernel" not in out.stderr
    again = opreg_cli("build", "--only", "cpu", OPREG_CACHE_DIR=cache)
    assert again.returncode == 0, again.stdout + again.stderr
    assert outcomes(again.stdout) == dict.fromkeys(host, "cached"), again.stdout


def test_demo():
    out = opreg_cli("demo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("match") >= 2 and "MISMATCH" not in out.stdout


def test_bad_subcommand_is_an_error(capsys):
    # In process: argparse's exit is the same here, and a child costs ~4 s of CPU.
    from opreg.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code != 0 and "invalid choice: 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_explain_help_lists_its_arguments(flag, capsys):
    # `explain` has its own parser (opreg/explain.py): its help names SPEC and --choose, not the
    # stub argument the top-level parser would show
    from opreg.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["explain", flag])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "spec" in out and "--choose" in out and "rest" not in out, out
