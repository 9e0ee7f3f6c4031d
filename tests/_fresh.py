"""Fresh Python processes for the tests whose subject is a process's first start with opreg
(the kernel cache, first use from threads, the CLI, a build without a compiler).

Each one is forked from a server process, one per test worker, that has imported torch and
nothing of opreg: what those tests check starts after ``import torch``, and a fork starts
exactly there. Why: ``import torch`` costs 3.3-3.5 s of CPU (2-core box, torch 2.14); the
suite started 33 children, ~110 s of its ~630 s of CPU, on a box where CPU is the limit.
The child gets its own process group, environment, working directory, argv and
``sys.path[0]`` (as ``python -c`` / ``-m`` / a script would set them), stdin from
/dev/null, stdout and stderr to files; it exits as the interpreter does (SystemExit's code,
1 and a traceback for an exception, atexit handlers run); a signal that kills it gives
``-signal`` as :mod:`subprocess` does.

What a fork does not give: a torch imported under the child's environment (no test here
sets a variable that torch reads at import), a ``sys.path`` from the child's
``PYTHONPATH``, nor an exec (capabilities are recomputed only there): the entry-point test
of ``tests/test_backend.py`` where it needs a stand-in dist-info on ``PYTHONPATH``, and the
read-only cache test (root without CAP_DAC_OVERRIDE) keep :mod:`subprocess`. (The Triton
interpreter's children and the distributed ranks are forked: triton, which reads
``TRITON_INTERPRET``, is imported in the child.)

    out = fresh.run(["-c", code], env=env, timeout=300)      # like subprocess.run(..., text=True)
    p = fresh.Popen([script, "worker"], env=env); out, err = p.communicate(timeout=60)
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Optional, Sequence

# ---------------------------------------------------------------------------- the server


def _serve() -> None:
    import torch  # noqa: F401  (the point: every child starts with it imported)

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        if op == "spawn":
            reply: dict[str, Any] = {"pid": _spawn(**req)}
        elif op == "wait":
            reply = _wait(**req)
        else:  # kill: the child's whole group (a compiler or ninja it started too)
            try:
                os.killpg(req["pid"], 9)
            except ProcessLookupError:
                pass
            reply = {}
        replies.write(json.dumps(reply) + "\n")


def _spawn(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        os.closerange(3, 1 << 16)  # as subprocess's close_fds: the server's pipes stay behind
        os.chdir(cwd)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
            f = os.open(path, flags)
            os.dup2(f, fd)
            os.close(f)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        code = _run(argv)
    except BaseException:  # noqa: BLE001  (setting the child up failed: say why, exit 1)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(argv: list[str]) -> int:
    import runpy
    import traceback

    try:
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (as the interpreter: print it, exit 1)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def _wait(pid: int, timeout: Optional[float]) -> dict[str, Any]:
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)}
        if deadline is not None and time.monotonic() > deadline:
            return {"timeout": True}
        time.sleep(0.02)


# ---------------------------------------------------------------------------- the client

_lock = threading.Lock()
_server: Optional[subprocess.Popen] = None


def _request(**req: Any) -> dict[str, Any]:
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
            atexit.register(_server.stdin.close)
        _server.stdin.write(json.dumps(req) + "\n")
        _server.stdin.flush()
        line = _server.stdout.readline()
    if not line:
        raise RuntimeError(f"the fresh-process server exited ({_server.wait()})")
    return json.loads(line)


class Popen:
    """A child forked from the server; the subset of :class:`subprocess.Popen` the tests use
    (text mode, stdout and stderr captured)."""

    def __init__(self, argv: Sequence[str], env: Optional[dict[str, str]] = None,
                 cwd: Optional[os.PathLike | str] = None) -> None:
        self.args = [sys.executable, *argv]
        self._dir = Path(tempfile.mkdtemp(prefix="opreg-fresh-"))
        # the outputs' folder goes when this object does (a run left 300 of them in /tmp)
        weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._out, self._err = self._dir / "stdout", self._dir / "stderr"
        self._out.touch()
        self._err.touch()
        self.returncode: Optional[int] = None
        self.pid = _request(op="spawn", argv=list(argv), env=dict(os.environ if env is None else env),
                            cwd=str(cwd or os.getcwd()), stdout=str(self._out), stderr=str(self._err))["pid"]

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            reply = _request(op="wait", pid=self.pid, timeout=timeout)
            if reply.get("timeout"):
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = reply["returncode"]
        return self.returncode

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    def kill(self) -> None:
        if self.returncode is None:
            _request(op="kill", pid=self.pid)


def run(argv: Sequence[str], env: Optional[dict[str, str]] = None, cwd: Optional[os.PathLike | str] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` in a
    forked child; raises :class:`subprocess.TimeoutExpired` (the child killed) past ``timeout``."""
    p = Popen(argv, env=env, cwd=cwd)
    try:
        out, err = p.communicate(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
