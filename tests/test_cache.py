"""The kernel cache can't break the ops (issue 10) and a warm start runs no ninja (issue 11).

Each bad location, corrupt library and killed build runs in a fresh process with its own
``OPREG_CACHE_DIR`` under tmp_path, and must give at most one RuntimeWarning (naming the
problem and the fix), an op value equal to the float64 reference, and the reason in
``implementations()`` -- before the op is called (a probe, nothing built) and after.
A built cache is shared by copying it (a cold build takes 30-90 s on 2 cores).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from opreg import _build, _cache

import _fresh as fresh
from _util import assert_matches

TESTS = Path(__file__).resolve().parent
FIX = "OPREG_CACHE_DIR"
HOST = [e for e in _build.extensions() if not e.cuda]

# A child that rebuilds a library takes 5-20 s (2 cores; the H200 box under 14 xdist
# workers). Past this it is hung: it exits printing every thread's stack.
HANG_S = 180

# The child: (preamble), then list -> call scatter_combine -> list, recording warnings.
CHILD = r'''
import faulthandler, json, sys, warnings
faulthandler.dump_traceback_later({hang_s}, exit=True)  # a hang fails with its stack, not a timeout
sys.path.insert(0, {tests!r})
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
{preamble}
    import torch, opreg
    from _util import poison

    def why(): return {{r["impl"]: r["why_not"] for r in opreg.implementations("scatter_combine")}}

    before = why()
    torch.manual_seed({seed})
    n, h, t = 300, 24, 37
    x, idx, g = torch.randn(n, h), torch.randint(0, t, (n,)), torch.rand(n) + 0.5
    poison(4 * t * h, "cpu")
    out = torch.ops.opreg.scatter_combine(x, idx, g, t)
    after = why()
torch.save({{"x": x, "idx": idx, "g": g, "t": t, "out": out}}, {result!r})
print(json.dumps({{"before": before, "after": after, "bound": opreg.bound("scatter_combine", "cpu"),
                  "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}}))
'''


def run_child(tmp_path: Path, cache: Path, preamble: str = "", env: dict[str, str] | None = None,
              drop_dac: bool = False) -> tuple[dict, subprocess.CompletedProcess[str]]:
    result = tmp_path / f"result-{uuid.uuid4().hex[:8]}.pt"
    code = CHILD.format(tests=str(TESTS), seed=int(torch.randint(0, 2**31, ())), hang_s=HANG_S,
                        result=str(result), preamble=textwrap.indent(preamble or "pass", "    "))
    full_env = {**os.environ, "OPREG_CACHE_DIR": str(cache), **(env or {})}
    proc = fresh.run(["-c", (DROP_DAC if drop_dac else "") + code], timeout=HANG_S + 60, env=full_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    r = torch.load(result)
    ref = torch.zeros(r["t"], r["x"].shape[1], dtype=torch.float64).index_add_(
        0, r["idx"], r["x"].double() * r["g"].double()[:, None])
    assert_matches(r["out"], ref, torch.float32)
    return got, proc


# Root writes into a 0500 directory anyway (CAP_DAC_OVERRIDE). The child first drops that
# capability and DAC_READ_SEARCH from its effective, permitted and inheritable sets
# (capset(2): no exec needed, so it is forked like the others instead of a new interpreter
# importing torch again, ~3.5 s of CPU): the kernel then enforces the mode bits, as for any
# other user (access(2) too: for a root real uid it uses the permitted set).
DROP_DAC = r'''
import ctypes as _c
class _Head(_c.Structure):
    _fields_ = [("version", _c.c_uint32), ("pid", _c.c_int)]
class _Data(_c.Structure):
    _fields_ = [("effective", _c.c_uint32), ("permitted", _c.c_uint32), ("inheritable", _c.c_uint32)]
_libc, _head, _data = _c.CDLL(None, use_errno=True), _Head(0x20080522, 0), (_Data * 2)()  # version 3
if _libc.capget(_c.byref(_head), _data) != 0:
    raise OSError(_c.get_errno(), "capget")
for _f in ("effective", "permitted", "inheritable"):
    setattr(_data[0], _f, getattr(_data[0], _f) & ~((1 << 1) | (1 << 2)))  # CAP_DAC_OVERRIDE, _READ_SEARCH
if _libc.capset(_c.byref(_head), _data) != 0:
    raise OSError(_c.get_errno(), "capset")
for _line in open("/proc/self/status"):
    if _line.startswith(("CapEff:", "CapPrm:")):
        assert not int(_line.split()[1], 16) & 0b110, _line
'''


def _drop_dac() -> None:
    # The same from the bounding set, before an exec (_as_root_without_dac: whether the
    # test runs, as before it dropped them this way).
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def one_warning(got: dict, *words: str) -> str:
    assert len(got["warnings"]) == 1, got["warnings"]
    msg = got["warnings"][0]
    for w in words:
        assert w in msg, msg
    return msg


@pytest.fixture(scope="session")
def built(host_cache: Path) -> Path:
    """A cache holding a current build of every host library (conftest's, shared)."""
    return host_cache


def copy_of(built: Path, dest: Path) -> Path:
    shutil.copytree(built, dest, symlinks=True)
    return dest


def lib_dir(cache: Path, name: str = "opreg_cpu") -> Path:
    return cache / _cache.tag() / name


# ---------------------------------------------------------------------------- bad locations

def _file(tmp: Path) -> Path:
    (tmp / "cache").write_text("not a directory\n")
    return tmp / "cache"


def _dangling(tmp: Path) -> Path:
    (tmp / "cache").symlink_to(tmp / "gone")
    return tmp / "cache"


def _under_a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("x")
    return tmp / "file" / "cache"


@pytest.mark.parametrize("make, reason", [
    (_file, "is not a directory"),
    (_dangling, "is a dangling symlink"),
    (_under_a_file, "is not a directory"),
], ids=["regular-file", "dangling-symlink", "parent-is-a-file"])
def test_bad_location_warns_once_and_falls_back(tmp_path, make, reason):
    cache = make(tmp_path)
    got, _ = run_child(tmp_path, cache)
    one_warning(got, reason, FIX)
    assert got["bound"] == "reference"
    assert reason in got["before"]["cpu"] and FIX in got["before"]["cpu"]  # probe, no build
    assert reason in got["after"]["cpu"]


def _as_root_without_dac() -> bool:
    """Whether a child can run as root without CAP_DAC_OVERRIDE (needs CAP_SETPCAP)."""
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True, preexec_fn=_drop_dac)
    except (subprocess.SubprocessError, OSError):
        return False
    return True


def test_read_only_cache(tmp_path, built):
    """A read-only cache: one warning if it must build there; loads what is current in it."""
    if os.getuid() == 0 and not _as_root_without_dac():
        pytest.skip("running as root and cannot drop CAP_DAC_OVERRIDE: 0500 would not bind")
    empty, full = tmp_path / "empty", copy_of(built, tmp_path / "full")
    empty.mkdir()
    dirs = [empty, *(p for p in full.rglob("*") if p.is_dir()), full]
    for d in dirs:
        d.chmod(0o500)
    try:
        got, _ = run_child(tmp_path, empty, drop_dac=os.getuid() == 0)
        one_warning(got, "is not writable", FIX)
        assert got["bound"] == "reference" and "is not writable" in got["before"]["cpu"]
        got, _ = run_child(tmp_path, full, drop_dac=os.getuid() == 0)
        assert got["warnings"] == [] and got["bound"] == "cpu", got
    finally:
        for d in dirs:
            d.chmod(0o700)


def test_someone_elses_cache_is_refused_even_if_current(tmp_path, built):
    cache = copy_of(built, tmp_path / "cache")
    if os.getuid() == 0:
        os.chown(cache, 65534, 65534)
        preamble = ""
    else:  # can't give it away: make this process someone else instead
        preamble = f"import os; os.getuid = lambda: {os.getuid() + 1}"
    got, _ = run_child(tmp_path, cache, preamble)
    one_warning(got, "is owned by uid", "not you", FIX)
    assert got["bound"] == "reference" and "is owned by uid" in got["before"]["cpu"]


def test_disk_full(tmp_path):
    """The build fails with ENOSPC (simulated: cpp_extension.load raises it, as its first
    write into a full disk would): one warning saying so, and the reference."""
    preamble = textwrap.dedent("""
        import errno, torch.utils.cpp_extension as ce
        def full(**kw):
            raise OSError(errno.ENOSPC, "No space left on device", kw["build_directory"])
        ce.load = full
    """)
    got, _ = run_child(tmp_path, tmp_path / "cache", preamble)
    one_warning(got, "no space left", FIX)
    assert got["bound"] == "reference" and "no space left" in got["after"]["cpu"]


# ---------------------------------------------------------------------------- corrupt, killed

def _truncate(lib: Path) -> None:
    with open(lib, "r+b") as f:
        f.truncate(lib.stat().st_size // 2)


def _garble_keeping_size_and_mtime(lib: Path) -> None:
    st = lib.stat()
    with open(lib, "r+b") as f:
        f.write(b"\0" * 64)  # no ELF header any more
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", [_truncate, _garble_keeping_size_and_mtime],
                         ids=["truncated", "garbled-same-stamp"])
def test_corrupt_library_is_rebuilt(tmp_path, built, damage):
    """Truncated: ninja thinks it current, the load fails. Garbled with size and mtime
    kept: the stamp matches, the load fails. Either way: rebuilt once, no warning."""
    cache = copy_of(built, tmp_path / "cache")
    lib = lib_dir(cache) / "opreg_cpu.so"
    damage(lib)
    got, proc = run_child(tmp_path, cache)
    assert got["warnings"] == [] and got["bound"] == "cpu", got
    assert "rebuilding it" in proc.stderr
    stamp = json.loads((lib.parent / _cache.STAMP).read_text())
    assert stamp["library"] == _cache.signature(lib)  # the next start loads it directly


def test_corrupt_library_whose_rebuild_fails_warns_once(tmp_path, built):
    cache = copy_of(built, tmp_path / "cache")
    _garble_keeping_size_and_mtime(lib_dir(cache) / "opreg_cpu.so")
    if os.sep in os.environ.get("CXX", ""):
        pytest.skip("CXX is a path: a failing compiler can't be put first on PATH")
    bad_cc = tmp_path / "bin" / os.environ.get("CXX", "c++")
    bad_cc.parent.mkdir()
    bad_cc.write_text("#!/bin/sh\necho 'simulated compiler failure' >&2\nexit 1\n")
    bad_cc.chmod(0o755)
    got, _ = run_child(tmp_path, cache, env={"PATH": f"{bad_cc.parent}:{os.environ['PATH']}"})
    one_warning(got, "does not load, and rebuilding it failed")
    assert got["bound"] == "reference" and "rebuilding it failed" in got["after"]["cpu"]


def test_build_killed_half_way_blocks_and_poisons_nothing(tmp_path, built):
    """A build SIGKILLed while linking, holding the lock, leaving a half-written library
    and cpp_extension < 2.12's lock file: the next process builds and runs, no warning."""
    cache = copy_of(built, tmp_path / "cache")
    out = lib_dir(cache)
    (out / _cache.STAMP).unlink()  # as if a source had changed: the ninja path runs
    dies = textwrap.dedent(f"""
        import os, signal, torch.utils.cpp_extension as ce
        def killed(**kw):
            with open({str(out / 'opreg_cpu.so')!r}, "r+b") as f:
                f.truncate(1000)
            open({str(out / 'lock')!r}, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        ce.load = killed
    """)
    code = CHILD.format(tests=str(TESTS), seed=0, result=str(tmp_path / "x.pt"), hang_s=HANG_S,
                        preamble=textwrap.indent(dies, "    "))
    proc = fresh.run(["-c", code], timeout=HANG_S + 60, env={**os.environ, "OPREG_CACHE_DIR": str(cache)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (out / _cache.STAMP).exists()
    t0 = time.monotonic()
    got, proc = run_child(tmp_path, cache)
    assert got["warnings"] == [] and got["bound"] == "cpu", got
    assert time.monotonic() - t0 < 300


# ---------------------------------------------------------------------------- the stamp

@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A library of one C function and headers in two places (no torch headers: builds
    in about a second), in its own cache."""
    monkeypatch.setenv("OPREG_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "kernels"
    (src / "inc").mkdir(parents=True)
    (src / "tiny.h").write_text("#define TINY_A 1\n")
    (src / "inc" / "deep.h").write_text("#define TINY_B 2\n")
    (src / "tiny.cpp").write_text('#include "tiny.h"\n#include "inc/deep.h"\n'
                                  'extern "C" int tiny_value() { return TINY_A + TINY_B; }\n')
    return _build.Extension(f"opreg_test_tiny_{uuid.uuid4().hex[:8]}", str(src))


def _no_ninja(*args, **kw):
    raise AssertionError("cpp_extension.load ran: the warm start should not run ninja")


def test_warm_start_runs_no_ninja_and_any_edit_rebuilds(tiny, monkeypatch):
    _build.build(tiny)
    assert _build.last_outcome(tiny) == "compiled"
    with monkeypatch.context() as m:
        m.setattr(cpp_extension, "load", _no_ninja)
        m.setattr(_build, "_source_hash", _no_ninja)  # and no hashing of contents
        _build.build(tiny)
    assert _build.last_outcome(tiny) == "cached" and _build.why_not(tiny) is None
    src = tiny.root
    # a source, a header of its folder, a header found only through ninja's deps
    for path, old, new in [(src / "tiny.cpp", "TINY_A + TINY_B", "TINY_A * TINY_B"),
                           (src / "tiny.h", "1", "3"), (src / "inc" / "deep.h", "2", "4")]:
        time.sleep(0.01)  # a distinct mtime on coarse-clock file systems
        path.write_text(path.read_text().replace(old, new))
        _build.build(tiny)
        assert _build.last_outcome(tiny) == "compiled", path
        _build.build(tiny)
        assert _build.last_outcome(tiny) == "cached", path
    (src / "new.h").write_text("#define UNUSED 1\n")  # a header added to the folder
    _build.build(tiny)
    assert _build.last_outcome(tiny) in ("up to date", "compiled")


def test_corrupt_objects_too_are_rebuilt_from_scratch(tiny):
    """Library and an object damaged: the relink fails, so everything is rebuilt."""
    code = f"import opreg._build as b; b.build(b.Extension({tiny.name!r}, {tiny.folder!r}))"
    out = fresh.run(["-c", code], timeout=300)  # not loaded here
    assert out.returncode == 0, out.stderr[-2000:]
    out = _cache.library_dir(tiny.name)
    (out / "tiny.o").write_bytes(b"\0" * 16)
    _garble_keeping_size_and_mtime(out / f"{tiny.name}.so")
    _build.build(tiny)  # the first load of it in this process
    assert _build.last_outcome(tiny) == "rebuilt"
    assert (out / "tiny.o").stat().st_size > 16


def test_compiler_out_of_space_names_the_disk(tiny, monkeypatch):
    def full(**kw):
        raise RuntimeError("Error building extension: tiny.cpp: fatal error: "
                           "error writing to /tmp/ccX.s: No space left on device")
    monkeypatch.setattr(cpp_extension, "load", full)
    with pytest.raises(_build.BuildError, match="^no space left on the device of the kernel cache"):
        _build.build(tiny)


def test_os_errors_are_build_errors(tiny, monkeypatch):
    """Whatever OSError the cache raises, build() raises a BuildError naming the fix."""
    for err in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EIO):
        def fail(err: int = err, **kw):
            raise OSError(err, os.strerror(err), kw["build_directory"])
        monkeypatch.setattr(cpp_extension, "load", fail)
        with pytest.raises(_build.BuildError) as info:
            _build.build(tiny)
        assert FIX in str(info.value) or "free some space" in str(info.value), info.value
        assert isinstance(info.value.__cause__, OSError)
