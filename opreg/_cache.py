"""The kernel cache: where it is, what is wrong with it, and which library in it is current.

Two cheap questions, answered with a few ``stat`` calls and without creating anything:

- :func:`problem` -- what stops a cache directory from being used (a regular file, a
  dangling symlink, another user's directory, one not writable), as a message naming the
  problem and the fix. ``python -m opreg list`` shows it; a build that meets an ``OSError``
  explains it with it.
- :func:`current` -- whether a built library matches its **stamp**: a small JSON file
  next to it recording the versions and flags it was built with and each input's (path,
  size, mtime_ns), the inputs being its sources, the headers of its folders and the
  project headers ninja saw it include. A current library is loaded directly
  (``torch.ops.load_library``), with no ninja run and no hashing of file contents: a warm
  start costs milliseconds. Anything else goes through ninja, which rebuilds what changed.
"""
from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

FIX = "set OPREG_CACHE_DIR to a writable directory of your own"
STAMP = "opreg.stamp"
_STAMP_FORMAT = 1


class CacheProblem(str):
    """Why the kernel cache can't be used: a message naming the problem and the fix."""


def root() -> Path:
    """``$OPREG_CACHE_DIR``, else ``$XDG_CACHE_HOME/opreg``, else ``~/.cache/opreg``."""
    env = os.environ.get("OPREG_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "opreg"


def tag() -> str:
    """The per-environment subfolder: built libraries only fit this torch/Python/CUDA."""
    cuda = torch.version.cuda or "cpu"
    t = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-cu{cuda}"
    return t.replace("+", "_")


def library_dir(name: str) -> Path:
    """Where the library ``name`` is built (nothing is created)."""
    return root() / tag() / name


# ---------------------------------------------------------------------------- location

def _problem_at(path: Path, writable: bool) -> str | None:
    """What is wrong with ``path`` as one of our cache directories, or None (fine, or it
    can be created: then its nearest existing ancestor must be a writable directory)."""
    at = path
    while not (at.exists() or at.is_symlink()):
        at = at.parent  # "/" exists
    if not at.exists():
        return f"{at} is a dangling symlink (to {os.readlink(at)})"
    if not at.is_dir():
        return f"{at} is not a directory"
    owner = at.stat().st_uid
    if at == path and owner != os.getuid():
        return f"{at} is owned by uid {owner}, not you"
    # os.access, not a trial write, so the probe creates nothing. It answers for this
    # process's credentials: root passes everywhere except on a read-only mount, unless
    # it runs without CAP_DAC_OVERRIDE (which is how the tests simulate a read-only dir).
    if writable and not os.access(at, os.W_OK | os.X_OK):
        return f"{at} is not writable"
    return None


def problem(name: str, writable: bool = True) -> CacheProblem | None:
    """What stops the library ``name``'s cache directories (root, tag, library) from being
    used, or None. ``writable=False`` asks only what also stops loading a library that is
    already there (a read-only cache holding current libraries is fine to load from)."""
    base = root()
    for d in (base, base / tag(), base / tag() / name):
        bad = _problem_at(d, writable)
        if bad is not None:
            return CacheProblem(f"kernel cache {bad}: {FIX}")
        if not d.exists():
            return None  # the rest would be created inside it
    return None


def disk_full() -> str:
    return (f"no space left on the device of the kernel cache {root()}: free some space, "
            "or set OPREG_CACHE_DIR to a directory on another disk")


def explain(e: OSError, name: str) -> str:
    """A message for an ``OSError`` met while building or loading ``name``: the problem the
    probe sees in the cache, else the error with the fix for its kind."""
    if e.errno == errno.ENOSPC:
        return disk_full()
    bad = problem(name)
    if bad is not None:
        return bad
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"kernel cache {e.filename or root()} is not writable ({e.strerror}): {FIX}"
    return f"kernel cache {root()}: {e}; if this persists, {FIX}"


# ---------------------------------------------------------------------------- stamp

def signature(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def key(**facts: Any) -> dict[str, Any]:
    """What a library's build depends on besides its input files: versions and ``facts``
    (flags, environment, the library's own sources)."""
    return {"format": _STAMP_FORMAT, "torch": torch.__version__,
            "torch_git": torch.version.git_version, "torch_dir": str(Path(torch.__file__).parent),
            "python": sys.version, "cxx": os.environ.get("CXX", "c++"), **facts}


def _read(out: Path) -> dict[str, Any] | None:
    try:
        got = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def current(out: Path, library: Path, build_key: dict[str, Any], inputs: Iterable[Path]) -> bool:
    """Whether ``library`` in ``out`` was built from these inputs with ``build_key``: its
    stamp matches them and every file it records (sources, headers, ``library``) still has
    the size and mtime it had. A new input (a header added) makes it stale too."""
    old = _read(out)
    if old is None or old.get("key") != json.loads(json.dumps(build_key)):
        return False
    files = old.get("files")
    if not isinstance(files, dict) or not {str(p) for p in inputs} <= files.keys():
        return False
    return (all(signature(Path(p)) == sig for p, sig in files.items())
            and signature(library) == old.get("library"))


def snapshot(out: Path, inputs: Iterable[Path]) -> dict[str, list[int] | None]:
    """The inputs' signatures, taken *before* a build: a file edited while it compiles
    then makes the stamp stale, so the next start rebuilds it."""
    old = _read(out) or {}
    paths = {str(p) for p in inputs} | set(old.get("files") or ())
    return {p: signature(Path(p)) for p in sorted(paths)}


def write(out: Path, library: Path, build_key: dict[str, Any],
          before: dict[str, list[int] | None], skip: Iterable[Path]) -> None:
    """Record that ``library`` is current. Best effort: without a stamp the next start
    only runs ninja (a full disk here must not fail a build that worked)."""
    files = dict(before)
    for dep in _ninja_deps(out, tuple(skip)):
        files.setdefault(str(dep), signature(dep))
    files = {p: s for p, s in files.items() if s is not None}
    text = json.dumps({"key": build_key, "files": files, "library": signature(library)},
                      indent=1, sort_keys=True)
    tmp = out / f"{STAMP}.{os.getpid()}"
    try:
        tmp.write_text(text)
        os.replace(tmp, out / STAMP)  # atomic: a reader sees the old stamp or the new one
    except OSError:
        tmp.unlink(missing_ok=True)


def intact(library: Path) -> bool:
    """Whether ``library``, if an ELF file, is whole: its section table and every segment
    lie inside it. A truncated library (a linker killed half-way) can crash the dynamic
    loader (SIGBUS) instead of failing, so it must never reach it. Other formats pass:
    the loader judges them (and refuses garbage with an error)."""
    try:
        with open(library, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF" or head[4:5] == b"\x01":
                return True  # not ELF, or 32-bit ELF: left to the loader
            if len(head) < 64:
                return False
            order = "<" if head[5:6] == b"\x01" else ">"
            phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
            size = os.fstat(f.fileno()).st_size
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError:
        return False
    if shoff + shnum * shentsize > size or len(table) < phnum * phentsize:
        return False
    segments = (struct.unpack_from(order + "QQQQ", table, i * phentsize + 8)
                for i in range(phnum))  # p_offset, p_vaddr, p_paddr, p_filesz
    return all(off + filesz <= size for off, _, _, filesz in segments)


def discard(out: Path) -> None:
    """Drop the stamp before a build touches the library: a build killed half-way must
    not leave a stamp claiming the result is current."""
    (out / STAMP).unlink(missing_ok=True)


def _ninja_deps(out: Path, skip: tuple[Path, ...]) -> list[Path]:
    """The headers ninja recorded for the objects (``ninja -t deps``), so the stamp covers
    every header a source includes, wherever it lives. Toolchain, Python and torch headers
    (under ``skip``) are left out: their versions are in the stamp's key."""
    try:
        res = subprocess.run(["ninja", "-C", str(out), "-t", "deps"], capture_output=True,
                             text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    prefixes = tuple(str(p).rstrip(os.sep) + os.sep for p in
                     (*skip, Path(torch.__file__).parent, Path(sys.prefix),
                      Path(sys.base_prefix), Path("/usr")))
    deps = {line.strip() for line in res.stdout.splitlines() if line.startswith(" ")}
    return sorted(Path(out, d) for d in deps if d and not d.startswith(prefixes))
