"""Test helpers: devices, and (from :mod:`opreg.testing`, re-exported) float64
comparisons with per-dtype tolerances and output poisoning."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import filelock
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from opreg.testing import TOL, assert_matches, map_tensors, poison

__all__ = ["DEVICES", "FLOAT_DTYPES", "TOL", "DispatchRecording", "FunctionRecording", "assert_matches",
           "cuda_kernels", "host_picks", "once_per_run", "poison", "set_requires_grad", "skip_without"]

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def host_picks(source: str, lines: str, override: str, env: dict[str, str], tmp_path: Path) -> list[str]:
    """The output lines of tests/cpp/``source`` (a path choice from backends/common, plain C++
    on sizes) compiled here and fed ``lines``: with the override variable ``override`` unset,
    then ``env`` set. Skips without a C++ compiler."""
    import shutil
    import subprocess

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    root = Path(__file__).resolve().parent
    exe = tmp_path / "picks"
    subprocess.run([cxx, "-std=c++17", "-O1", f"-I{root.parent / 'backends' / 'common'}",
                    str(root / "cpp" / source), "-o", str(exe)], check=True)
    run_env = {k: v for k, v in os.environ.items() if k != override} | env
    return subprocess.run([str(exe)], input=lines, capture_output=True, text=True, check=True,
                          env=run_env).stdout.splitlines()


def cuda_kernels(call: Callable[[], Any]) -> list[str]:
    """The CUDA kernels one ``call()`` launches, by name (the profiler's), after a warm-up call
    (lazy initialisation, allocator) outside the profile."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def set_requires_grad(args: tuple, flag: bool) -> tuple:
    """``args`` with every floating tensor (in lists too) made a leaf requiring grad if
    ``flag``: what a ``sample_inputs(..., requires_grad=True)`` returns."""
    return map_tensors(lambda t: t.requires_grad_(flag) if t.is_floating_point() else t, args)


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A folder ``make(folder)`` filled once per test run, shared by every pytest-xdist
    worker (their base temp folders share a parent): a costly child run (the Triton
    interpreter, a distributed launch) happens once, wherever its tests were scheduled. A
    ``make`` that raises leaves nothing behind, so the next worker tries again."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # workers: <base>/popen-gwN
    folder = shared / f"once-{name}"
    with filelock.FileLock(str(folder) + ".lock"):
        if not (folder / ".done").exists():
            folder.mkdir(exist_ok=True)
            make(folder)
            (folder / ".done").touch()
    return folder


class DispatchRecording(TorchDispatchMode):
    """A ``__torch_dispatch__`` mode that records every op it sees (``seen``) and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class FunctionRecording(TorchFunctionMode):
    """A ``__torch_function__`` mode that records every function it sees and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))
