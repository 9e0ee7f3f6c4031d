"""The toolchain around ``torch.utils.cpp_extension``: where CUDA is, the environment a
build runs in, and progress lines for builds that take a while."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator


def cuda_home() -> str | None:
    """The CUDA toolkit root: ``$CUDA_HOME``/``$CUDA_PATH``, else derived from ``nvcc`` on PATH.

    The ``nvcc`` on PATH may be a wrapper script (``exec /opt/cuda-X/bin/nvcc "$@"``);
    torch would then guess the wrapper's grandparent. Follow the script to the real one.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "/usr/local/cuda" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    real = Path(nvcc).resolve()
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = real.read_text()[:4096]
        if text.startswith("#!"):
            m = re.search(r"exec\s+\"?([^\s\"]+/bin/nvcc)\b", text)
            if m:
                real = Path(m.group(1)).resolve()
    return str(real.parent.parent)


@contextlib.contextmanager
def progress(what: str, estimate: str) -> Iterator[None]:
    """Say what is being built once the work takes more than a moment (a ninja no-op
    takes ~0.1 s and prints nothing), then a line every 15 s."""
    start = time.monotonic()
    done = threading.Event()
    spoke = threading.Event()

    def heartbeat() -> None:
        if done.wait(2.0):
            return
        spoke.set()
        print(f"opreg: building {what} ({estimate}) ...", file=sys.stderr, flush=True)
        while not done.wait(15.0):
            print(f"opreg: ... still building ({time.monotonic() - start:.0f} s)",
                  file=sys.stderr, flush=True)

    t = threading.Thread(target=heartbeat, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        if spoke.is_set():
            print(f"opreg: built in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def using_cpp_extension(env: dict[str, str], cuda: bool) -> Iterator[Any]:
    """``torch.utils.cpp_extension``, imported and run with ``env`` set (for a CUDA
    build, its ``CUDA_HOME`` too)."""
    saved = {k: os.environ.get(k) for k in env}
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    try:
        os.environ.update(env)
        # Imported here, with CUDA_HOME already right: it reads the toolkit root once
        # (and on a machine without a GPU warns that it found no CUDA runtime: noise).
        quiet.setLevel(logging.ERROR)
        try:
            from torch.utils import cpp_extension
        finally:
            quiet.setLevel(level)
        old_home = getattr(cpp_extension, "CUDA_HOME", None)
        if cuda:
            cpp_extension.CUDA_HOME = env["CUDA_HOME"]  # read once at its import
        try:
            yield cpp_extension
        finally:
            if cuda:
                cpp_extension.CUDA_HOME = old_home
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
