"""JIT building of the C++/CUDA kernel libraries under ``opreg/backends``.

Each :class:`Extension` is one shared library, built with ninja through
``torch.utils.cpp_extension`` into a cache private to the user and loaded with the
dispatcher (``TORCH_LIBRARY_IMPL`` registrations run when it loads). The cache is
keyed by torch/Python/CUDA versions; ninja rebuilds only what changed, and a hash
of the headers is part of the compile flags so a header edit rebuilds too.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ._log import logger

def _backends_dir() -> Path:
    # Installed as the package opreg.backends (from the repo's top-level backends/ folder,
    # via setuptools package-dir), so locate it by import, not relative to this file.
    import opreg.backends

    return Path(opreg.backends.__file__).resolve().parent


BACKENDS_DIR = _backends_dir()


class BuildError(RuntimeError):
    """A kernel library failed to compile or load."""


@dataclass(frozen=True)
class Extension:
    """One shared library: every ``.cpp`` (or ``.cu``) in ``folder`` plus ``extra``.

    ``folder`` is relative to ``opreg/backends`` or absolute (a third party's kernels).
    """

    name: str
    folder: str
    cuda: bool = False
    extra: tuple[str, ...] = ()

    @property
    def root(self) -> Path:
        return BACKENDS_DIR / self.folder  # an absolute folder stays as it is

    def sources(self) -> list[Path]:
        srcs = sorted(self.root.glob("*.cu" if self.cuda else "*.cpp"))
        return srcs + [BACKENDS_DIR / e for e in self.extra]

    def headers(self) -> list[Path]:
        return sorted(p for d in (BACKENDS_DIR / "common", self.root)
                      for p in d.glob("*") if p.suffix in (".h", ".cuh"))


# The host library carries the C++ autograd of every op (device-agnostic; it calls the
# ops through the dispatcher), so CUDA users load it too: ~30 s to build on 2 cores once.
CPU = Extension("opreg_cpu", "cpu", extra=("common/autograd.cpp",))
CUDA = Extension("opreg_cuda", "cuda", cuda=True)


def cache_root() -> Path:
    """``$OPREG_CACHE_DIR``, else ``$XDG_CACHE_HOME/opreg``, else ``~/.cache/opreg``."""
    env = os.environ.get("OPREG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "opreg"


def _private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (parents too) and refuse one another user could write into.

    cpp_extension's default build dir sits in a shared /tmp; a library planted there by
    another local user would be loaded into this process. Ours must be ours alone.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise BuildError(f"opreg cache dir {path} is owned by uid {st.st_uid}, not you; "
                         "set OPREG_CACHE_DIR to a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        path.chmod(stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    return path


def build_dir(ext: Extension) -> Path:
    cuda = torch.version.cuda or "cpu"
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-cu{cuda}"
    tagged = _private_dir(_private_dir(cache_root()) / tag.replace("+", "_"))
    return _private_dir(tagged / ext.name)


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


def _source_hash(ext: Extension) -> str:
    h = hashlib.sha256()
    for p in ext.headers():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An OS-level lock: released by the kernel if the holder dies, so a build killed
    half-way never makes the next one wait forever (cpp_extension's own ``lock`` file
    did, before torch 2.12)."""
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress(what: str, estimate: str) -> Iterator[None]:
    """Say what is being built once the work takes more than a moment (a cached load
    is a ninja no-op of ~0.2 s and prints nothing), then a line every 15 s."""
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


def build(ext: Extension, cuda_arch: str | None = None, verbose: bool = False) -> Path:
    """Compile (if needed) and load ``ext``; returns the library's path.

    ``cuda_arch`` (e.g. ``"9.0"``) overrides the target of a CUDA build; by default
    ``$TORCH_CUDA_ARCH_LIST``, else the visible devices' capabilities.
    Raises :class:`BuildError` with the compiler's output on failure.
    """
    sources = ext.sources()
    if not sources:
        raise BuildError(f"{ext.name}: no sources under {ext.root}")
    flags = ["-O3", f"-DOPREG_HEADERS_HASH={_source_hash(ext)}"]
    cuda_flags: list[str] = []
    home = cuda_home()
    env: dict[str, str] = {"CUDA_HOME": home} if home else {}
    if ext.cuda:
        if home is None:
            raise BuildError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
        arch = cuda_arch or os.environ.get("TORCH_CUDA_ARCH_LIST")
        if not arch:
            if not torch.cuda.is_available():
                raise BuildError("no CUDA device to pick an arch for: pass --cuda-arch "
                                 "(e.g. 9.0) or set TORCH_CUDA_ARCH_LIST")
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            arch = ";".join(f"{a}.{b}" for a, b in sorted(caps))
        env["TORCH_CUDA_ARCH_LIST"] = arch
        cuda_flags = ["-O3", "-lineinfo", f"-DOPREG_HEADERS_HASH={_source_hash(ext)}"]
    else:
        flags.append("-fopenmp")  # at::parallel_for uses torch's OpenMP pool

    out = build_dir(ext)
    names = ", ".join(s.name for s in sources)
    estimate = ("CUDA: ~2 min per file on 2 cores" if ext.cuda else "~30 s on 2 cores")
    saved = {k: os.environ.get(k) for k in env}
    with _exclusive(out.parent / f"{ext.name}.lock"):
        stale = out / "lock"  # cpp_extension < 2.12 waits forever on a leftover one
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
        os.environ.update(env)
        # Imported here, with CUDA_HOME already right: it reads the toolkit root once
        # (and on a machine without a GPU warns that it found no CUDA runtime: noise).
        quiet = logging.getLogger("torch.utils.cpp_extension")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            from torch.utils import cpp_extension
        finally:
            quiet.setLevel(level)

        old_home = getattr(cpp_extension, "CUDA_HOME", None)
        if ext.cuda:
            cpp_extension.CUDA_HOME = env["CUDA_HOME"]  # read once at its import
        try:
            with _progress(f"{ext.name} [{names}] into {out}", estimate):
                path = cpp_extension.load(
                    name=ext.name,
                    sources=[str(s) for s in sources],
                    extra_cflags=flags,
                    extra_cuda_cflags=cuda_flags or None,
                    extra_include_paths=[str(BACKENDS_DIR / "common")],
                    build_directory=str(out),
                    is_python_module=False,
                    verbose=verbose,
                )
        except Exception as e:  # compiler errors arrive as RuntimeError/CalledProcessError
            raise BuildError(f"{ext.name} failed to build: {e}") from e
        finally:
            if ext.cuda:
                cpp_extension.CUDA_HOME = old_home
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    logger.info("loaded %s from %s", ext.name, path)
    return Path(str(path))
