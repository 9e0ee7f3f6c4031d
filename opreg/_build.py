"""JIT building of the C++/CUDA kernel libraries under ``opreg/backends``.

Each :class:`Extension` is one shared library, built with ninja through
``torch.utils.cpp_extension`` into a cache private to the user (:mod:`opreg._cache`) and
loaded with the dispatcher (``TORCH_LIBRARY_IMPL`` registrations run when it loads).

:func:`build` raises nothing but :class:`BuildError`, which the registry turns into one
warning and the next implementation:

- a library whose stamp says it is current is loaded directly (no ninja run, no hashing);
- otherwise ninja rebuilds what changed (a hash of the headers is part of the compile
  flags, so a header edit rebuilds too) and the stamp is rewritten;
- a cached library that does not load (truncated, corrupt) is rebuilt once: relinked
  from its objects, and if that fails too, from scratch;
- an ``OSError`` (a file where the cache should be, a dangling link, a read-only or
  foreign directory, a full disk) becomes a BuildError naming the problem and the fix.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from . import _cache, _toolchain
from ._cache import CacheProblem  # noqa: F401  (re-exported: registry, cli)
from ._log import logger
from ._toolchain import cuda_home

def _backends_dir() -> Path:
    # Installed as the package opreg.backends (from the repo's top-level backends/ folder,
    # via setuptools package-dir), so locate it by import, not relative to this file.
    import opreg.backends

    return Path(opreg.backends.__file__).resolve().parent


BACKENDS_DIR = _backends_dir()


class BuildError(RuntimeError):
    """A kernel library failed to compile or load. ``key`` is shared by the failures of
    every library with one cause (a bad cache location), so they are reported once."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


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


# CPU kernels, CUDA kernels, and the C++ autograd of every op: device-agnostic (it calls
# the ops through the dispatcher), so CPU and CUDA users both load it; one file per op
# (backends/autograd/<op>.cpp), built in parallel, ~30 s on 2 cores once.
CPU = Extension("opreg_cpu", "cpu")
CUDA = Extension("opreg_cuda", "cuda", cuda=True)
AUTOGRAD = Extension("opreg_autograd", "autograd")


def cache_root() -> Path:
    """``$OPREG_CACHE_DIR``, else ``$XDG_CACHE_HOME/opreg``, else ``~/.cache/opreg``."""
    return _cache.root()


def _private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (parents too) and refuse one another user could write into.

    cpp_extension's default build dir sits in a shared /tmp; a library planted there by
    another local user would be loaded into this process. Ours must be ours alone.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        msg = f"kernel cache {path} is owned by uid {st.st_uid}, not you: {_cache.FIX}"
        raise BuildError(msg, key=msg)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        path.chmod(stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    return path


def build_dir(ext: Extension) -> Path:
    """``ext``'s build directory, created private (0700) if needed."""
    tagged = _private_dir(_private_dir(cache_root()) / _cache.tag())
    return _private_dir(tagged / ext.name)


def extensions() -> list[Extension]:
    """Every built-in kernel library (this module's Extension constants), host ones first."""
    found = dict.fromkeys(v for v in globals().values() if isinstance(v, Extension))
    return sorted(found, key=lambda e: e.cuda)  # stable: definition order otherwise


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
    did, before torch 2.12). Opened read-only: an existing lock file also works in a
    read-only cache (which can still serve current libraries)."""
    fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


@dataclass
class _Plan:
    """What a build of ``ext`` uses: sources, flags (without the header hash, which only
    the ninja path computes) and the toolchain's environment."""

    ext: Extension
    sources: list[Path]
    cflags: list[str]
    cuda_cflags: list[str]
    env: dict[str, str]

    @property
    def library(self) -> Path:
        return _cache.library_dir(self.ext.name) / f"{self.ext.name}.so"

    def inputs(self) -> list[Path]:
        return [*self.sources, *self.ext.headers()]

    def key(self) -> dict[str, Any]:
        return _cache.key(name=self.ext.name, sources=[str(s) for s in self.sources],
                          cflags=self.cflags, cuda_cflags=self.cuda_cflags, env=self.env,
                          include=str(BACKENDS_DIR / "common"))

    def current(self) -> bool:
        return _cache.current(self.library.parent, self.library, self.key(), self.inputs())

    def stamp(self, before: dict[str, list[int] | None]) -> None:
        toolkit = [Path(self.env["CUDA_HOME"])] if "CUDA_HOME" in self.env else []
        _cache.write(self.library.parent, self.library, self.key(), before, toolkit)


def _plan(ext: Extension, cuda_arch: str | None) -> _Plan:
    sources = ext.sources()
    if not sources:
        raise BuildError(f"{ext.name} failed to build: no sources under {ext.root}")
    home = cuda_home()
    env: dict[str, str] = {"CUDA_HOME": home} if home else {}
    if not ext.cuda:
        # -fopenmp: at::parallel_for uses torch's OpenMP pool
        return _Plan(ext, sources, ["-O3", "-fopenmp"], [], env)
    if torch.version.cuda is None:
        raise BuildError("torch was built without CUDA")
    if home is None:
        raise BuildError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    env["TORCH_CUDA_ARCH_LIST"] = _cuda_arch(cuda_arch)
    return _Plan(ext, sources, ["-O3"], ["-O3", "-lineinfo"], env)


def is_current(ext: Extension, cuda_arch: str | None = None) -> bool:
    """Whether ``ext``'s cached library is current (its stamp matches: loading it runs no
    ninja). False where it can't be planned here (no toolkit, no arch) or isn't built."""
    try:
        return _plan(ext, cuda_arch).current()
    except (BuildError, OSError):
        return False


def _cuda_arch(cuda_arch: str | None) -> str:
    arch = cuda_arch or os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch:
        return arch
    if not torch.cuda.is_available():
        raise BuildError("no CUDA device to pick an arch for: pass --cuda-arch "
                         "(e.g. 9.0) or set TORCH_CUDA_ARCH_LIST")
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{a}.{b}" for a, b in sorted(caps))


def why_not(ext: Extension, cuda_arch: str | None = None) -> str | None:
    """Why ``ext`` can't be loaded here, found without building or loading anything (a
    few stat calls): a cache it can't use (a :class:`CacheProblem`) or a missing
    toolchain. None when the cache holds a current build of it, or it can be built."""
    bad = _cache.problem(ext.name, writable=False)
    if bad is not None:
        return bad
    try:
        plan = _plan(ext, cuda_arch)
    except BuildError as e:
        return str(e)
    if plan.current():
        return None  # loads as it is: needs neither a writable cache nor a compiler
    if (bad := _cache.problem(ext.name)) is not None:
        return bad
    if shutil.which("ninja") is None:
        return "ninja not found (pip install ninja)"
    if not ext.cuda and shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (set CXX)"
    return None


_outcomes: dict[str, str] = {}


def last_outcome(ext: Extension) -> str | None:
    """How this process's last :func:`build` of ``ext`` went: ``"cached"`` (loaded as
    it was, no ninja run), ``"up to date"`` (ninja found nothing to do), ``"compiled"``,
    or ``"rebuilt"`` (a cached library that did not load was replaced)."""
    return _outcomes.get(ext.name)


def build(ext: Extension, cuda_arch: str | None = None, verbose: bool = False) -> Path:
    """Load ``ext``, building it first unless the cache holds a current build; returns
    the library's path.

    ``cuda_arch`` (e.g. ``"9.0"``) overrides the target of a CUDA build; by default
    ``$TORCH_CUDA_ARCH_LIST``, else the visible devices' capabilities. Raises
    :class:`BuildError` on any failure (with the compiler's output, or the cache's
    problem and its fix), never another exception.
    """
    plan = _plan(ext, cuda_arch)
    try:
        out = build_dir(ext)
        with _exclusive(out.parent / f"{ext.name}.lock"):
            path, how = _load_or_build(plan, verbose)
    except OSError as e:
        msg = _cache.explain(e, ext.name)
        raise BuildError(msg, key=msg) from e
    _outcomes[ext.name] = how
    logger.info("loaded %s from %s (%s)", ext.name, path, how)
    return path


class _Unloadable(Exception):
    """The dynamic loader refused a library file (truncated, corrupt, wrong format)."""


def _load_or_build(plan: _Plan, verbose: bool) -> tuple[Path, str]:
    lib = plan.library
    if lib.exists() and not _cache.intact(lib):  # loading it could crash the process
        _say_corrupt(lib, "it is truncated")
        return _repair(plan, verbose), "rebuilt"
    if plan.current():
        try:
            torch.ops.load_library(str(lib))
            return lib, "cached"
        except OSError as e:  # any loader failure (torch wraps it as a plain OSError)
            _say_corrupt(lib, e.__cause__ or e)
            return _repair(plan, verbose), "rebuilt"
    before = _cache.snapshot(lib.parent, plan.inputs())
    _cache.discard(lib.parent)
    old = _cache.signature(lib)
    try:
        path = _compile_and_load(plan, verbose)
    except _Unloadable as e:
        if old is None or _cache.signature(lib) != old:  # freshly linked: a real error
            raise BuildError(f"{plan.ext.name} was built but does not load: {e}") from e
        _say_corrupt(lib, e)  # ninja judged the cached library current, yet it won't load
        return _repair(plan, verbose), "rebuilt"
    plan.stamp(before)
    return path, "up to date" if _cache.signature(lib) == old else "compiled"


def _say_corrupt(lib: Path, e: BaseException) -> None:
    print(f"opreg: cached {lib} does not load ({e}); rebuilding it", file=sys.stderr,
          flush=True)


def _repair(plan: _Plan, verbose: bool) -> Path:
    """Rebuild a cached library that does not load: relink it from its objects, and if
    that fails too (they may be damaged as well), rebuild everything from scratch."""
    out = plan.library.parent
    before = _cache.snapshot(out, plan.inputs())
    _cache.discard(out)
    error: Exception | None = None
    for scrub in (_remove_library, _remove_build):
        scrub(out, plan.library)
        try:
            path = _compile_and_load(plan, verbose)
        except (BuildError, _Unloadable) as e:
            error = e
            continue
        plan.stamp(before)
        return path
    raise BuildError(f"{plan.ext.name}: the cached library does not load, and rebuilding "
                     f"it failed: {error}") from error


def _remove_library(out: Path, lib: Path) -> None:
    lib.unlink(missing_ok=True)


def _remove_build(out: Path, lib: Path) -> None:
    for p in out.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _compile_and_load(plan: _Plan, verbose: bool) -> Path:
    """``cpp_extension.load``: ninja (rebuilding what changed), then load. Compiler
    failures become BuildError, loader failures _Unloadable; file-system errors pass."""
    ext, out = plan.ext, plan.library.parent
    hashed = [f"-DOPREG_HEADERS_HASH={_source_hash(ext)}"]
    names = ", ".join(s.name for s in plan.sources)
    estimate = "CUDA: ~35 s on 2 cores" if ext.cuda else "~30 s on 2 cores"
    with _toolchain.using_cpp_extension(plan.env, ext.cuda) as cpp_extension, \
            _toolchain.progress(f"{ext.name} [{names}] into {out}", estimate):
        # A second load() of one name in a process only reloads what it loaded before:
        # forget it, so that a repair really rebuilds.
        versions = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
        getattr(versions, "entries", {}).pop(ext.name, None)
        # cpp_extension < 2.12 waits forever on a leftover ``lock`` file (its holder was
        # killed); every path here (first build, rebuild, repair) holds _exclusive, so no
        # other opreg process is building into ``out`` and the file is stale.
        with contextlib.suppress(FileNotFoundError):
            (out / "lock").unlink()
        try:
            path = cpp_extension.load(
                name=ext.name,
                sources=[str(s) for s in plan.sources],
                extra_cflags=[*plan.cflags, *hashed],
                extra_cuda_cflags=[*plan.cuda_cflags, *hashed] if ext.cuda else None,
                extra_include_paths=[str(BACKENDS_DIR / "common")],
                build_directory=str(out),
                is_python_module=False,
                verbose=verbose,
            )
        except OSError as e:
            if e.errno is None:  # the dynamic loader's refusal, not the file system's
                raise _Unloadable(e.__cause__ or e) from e
            raise
        except Exception as e:  # compiler errors arrive as RuntimeError/CalledProcessError
            raise _compile_error(ext, e) from e
    return Path(str(path))


def _compile_error(ext: Extension, e: Exception) -> BuildError:
    msg = f"{ext.name} failed to build: {e}"
    if "No space left on device" in msg:  # the compiler or linker could not write
        full = _cache.disk_full()
        return BuildError(f"{full}\n{msg}", key=full)
    return BuildError(msg)
