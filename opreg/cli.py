"""``python -m opreg {list,build,demo,explain,tune}``: what exists, build it, see it work, tune it."""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import torch

import opreg
from opreg import _build, registry


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]),
                      *(fmt.format(*map(str, r)) for r in rows)])


def cmd_list(args: argparse.Namespace) -> int:
    """Ops x implementations, available or why not; builds and loads nothing."""
    rows = [[r["op"], r["impl"], r["devices"], r["priority"], "yes" if r["available"] else "no",
             r["why_not"]] for r in registry.implementations()]
    print(_table(rows, ["op", "implementation", "devices", "priority", "available", "why not"]))
    bad = [p for p in map(_build.why_not, _build.extensions())
           if isinstance(p, _build.CacheProblem)]
    print(f"\n{bad[0]}" if bad else
          f"\nkernel cache: {_build.cache_root()} (set OPREG_CACHE_DIR to move it)")
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    """Build every kernel library this machine can build, each with its time and whether it
    was compiled or already current ("cached": no ninja run); non-zero exit on any failure.
    Two or more libraries build side by side, one process each (they share no object, and
    ninja keeps each one's own files in order); then each is loaded here."""
    exts = [e for e in _build.extensions() if args.lib in (None, e.name)
            and args.only in (None, "cuda" if e.cuda else "cpu")]
    todo = []
    for ext in exts:
        why = _build.why_not(ext, cuda_arch=args.cuda_arch) if ext.cuda else None
        if why is not None and not isinstance(why, _build.CacheProblem):  # CUDA can't build here
            print(f"{ext.name}: skipped ({why})")
        else:
            todo.append(ext)
    # Side by side only what must compile: a child process costs an `import torch` (2-15 s
    # on 2 cores), while a current library loads here in ~0.1 s with no ninja run.
    stale = [e for e in todo if not _build.is_current(e, cuda_arch=args.cuda_arch if e.cuda else None)]
    if len(stale) > 1:
        _build_side_by_side(stale, args)
    failed = 0
    for i, ext in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {ext.name}: {', '.join(s.name for s in ext.sources())}", flush=True)
        t0 = time.monotonic()
        try:
            registry.load(ext, cuda_arch=args.cuda_arch if ext.cuda else None, verbose=args.verbose)
        except _build.BuildError as e:
            failed += 1
            print(f"  FAILED ({time.monotonic() - t0:.1f} s): {e}", file=sys.stderr)
            continue
        how = _build.last_outcome(ext) or "already loaded"
        print(f"  ok, {how} ({time.monotonic() - t0:.1f} s): {_build.build_dir(ext)}")
    return 1 if failed else 0


def _build_side_by_side(exts: list[_build.Extension], args: argparse.Namespace) -> None:
    """Compile ``exts`` in parallel child processes (``build --lib NAME``), reporting each
    one's time; a failure is reported again by the in-process load that follows."""
    t0 = time.monotonic()
    procs = {}
    for ext in exts:
        cmd = [sys.executable, "-m", "opreg", "build", "--lib", ext.name]
        if ext.cuda and args.cuda_arch:
            cmd += ["--cuda-arch", args.cuda_arch]
        print(f"building {ext.name} ...", flush=True)
        procs[ext.name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for name, p in procs.items():
        out, _ = p.communicate()
        line = next((x.strip() for x in out.splitlines() if x.strip().startswith(("ok,", "FAILED"))), "")
        print(f"  {name}: {line or out.strip()[-300:]} (done at {time.monotonic() - t0:.1f} s)", flush=True)
    print(f"all libraries built side by side in {time.monotonic() - t0:.1f} s", flush=True)


def _median_us(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def cmd_demo(args: argparse.Namespace) -> int:
    """Run both reference models eagerly and through opreg; check and time them."""
    from opreg.models import cat_linear as cat_model
    from opreg.models import moe_combine_loop as moe_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=device).manual_seed(0)
    rows, ok = [], True

    moe = moe_model.Model().to(device)
    eh, idx, gates, t = moe_model.get_inputs(device=str(device), generator=gen)
    sc = opreg.get("scatter_combine")
    expected, got = moe(eh, idx, gates, t), sc(eh, idx, gates, t)
    rows.append(["moe_combine_loop", "scatter_combine", _check(got, expected),
                 _median_us(lambda: moe(eh, idx, gates, t), device, 3),
                 _median_us(lambda: sc(eh, idx, gates, t), device, 50)])

    cat = cat_model.Model().to(device)
    (x,) = cat_model.get_inputs(device=str(device), generator=gen)
    cl = opreg.get("cat_linear")
    w, b = cat.proj.weight, cat.proj.bias
    with torch.no_grad():
        expected, got = cat(x), cl(list(x.unbind(0)), w, b)
        rows.append(["cat_linear", "cat_linear", _check(got, expected),
                     _median_us(lambda: cat(x), device, 200),
                     _median_us(lambda: cl(list(x.unbind(0)), w, b), device, 200)])
    ok = all(r[2] == "match" for r in rows)
    print(f"device: {device} (torch {torch.__version__}, opreg {opreg.__version__})")
    print(_table([[r[0], r[1], r[2], f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[3] / r[4]:.1f}x"]
                  for r in rows],
                 ["model", "opreg op", "result", "eager µs", "opreg µs", "speed-up"]))
    print("implementations used: " + ", ".join(
        f"{op}={registry.bound(op, device.type)}" for op in ("scatter_combine", "cat_linear")))
    return 0 if ok else 1


def _check(got: torch.Tensor, expected: torch.Tensor) -> str:
    try:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        return "match"
    except AssertionError as e:
        print(e, file=sys.stderr)
        return "MISMATCH"


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["explain"]:  # its own parser, --help included (a REMAINDER stub can't take "-h")
        from opreg import explain

        return explain.main(args_in[1:])
    p = argparse.ArgumentParser(prog="python -m opreg", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="ops x implementations, available or why not")
    b = sub.add_parser("build", help="build every kernel library available on this machine")
    b.add_argument("--only", choices=["cpu", "cuda"],
                   help="only the host libraries (cpu: kernels and autograd) or only CUDA")
    b.add_argument("--lib", help="only the library of this name (e.g. opreg_cuda)")
    b.add_argument("--cuda-arch", help="CUDA target, e.g. 9.0 (compiles without a GPU)")
    b.add_argument("--verbose", action="store_true", help="show the compiler commands")
    d = sub.add_parser("demo", help="run the reference models against opreg, with timings")
    d.add_argument("--device", help="cpu or cuda (default: cuda if present)")
    e = sub.add_parser("explain", help="show what the opreg backend rewrites in a model")
    e.add_argument("rest", nargs=argparse.REMAINDER)
    t = sub.add_parser("tune", help="choose an op's fused-kernel block configs on this GPU (--help after the op)")
    t.add_argument("op", choices=["moe_experts"])
    t.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(args_in)
    if args.cmd == "tune":
        from opreg.backends.triton import tune

        return tune.main(args.rest)
    return {"list": cmd_list, "build": cmd_build, "demo": cmd_demo}[args.cmd](args)
