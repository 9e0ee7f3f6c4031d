"""What bench/cat_linear_paths.py and bench/scatter_paths.py share: one shape's variants, each
run with its path forced through an environment variable (read per call by the op, so it is
held through the check, the capture and the replays), checked against float64 and timed from
a CUDA graph; and the report over the shapes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from opreg.testing import timing

# name -> (the variable's value while it runs, or None: unset, or a dict of variables and
# their values; the call)
Variants = dict[str, tuple[Optional[Union[str, dict[str, str]]], Callable[[], torch.Tensor]]]


def host_picks(source: str, lines: str, env: str) -> list[str]:
    """What a path choice in backends/common picks, with no GPU: tests/cpp/``source`` compiled
    with the host's C++ compiler, fed ``lines`` (one shape each), with the override ``env``
    unset; its output lines."""
    root = Path(__file__).resolve().parent.parent
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        raise SystemExit("--evaluate needs a C++ compiler (CXX, c++ or g++)")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "picks"
        subprocess.run([cxx, "-std=c++17", "-O1", f"-I{root / 'backends' / 'common'}",
                        str(root / "tests" / "cpp" / source), "-o", str(exe)], check=True)
        run_env = {k: v for k, v in os.environ.items() if k != env}
        return subprocess.run([str(exe)], input=lines, capture_output=True, text=True, check=True,
                              env=run_env).stdout.splitlines()


def measure(label: str, variants: Variants, env: str, want: torch.Tensor, tol: float,
            paths: Sequence[str], reps: int,
            floors: Optional[dict[str, Callable[[], Any]]] = None, orders: int = 2) -> dict[str, Any]:
    """One shape: each variant's relative error (raising past ``tol``) and its µs per call
    replayed from a CUDA graph; the fastest of ``paths`` and the ratios of ``auto`` to it and
    to ``eager``. ``floors``: reference kernels timed the same way (not checked: they compute
    something else), what no variant's kind of kernel can beat at the shape.

    Every variant is timed ``orders`` times, the order reversed each time, and keeps its
    best (``us_each``: every timing). Why: a place in the order cost some shapes 4-10 %. In
    the runs of 2026-12-05 (two on the H100, one on the H200), auto was timed first and eager
    third, on the same cuBLAS kernels as the GEMM path forced and timed last. Auto read
    1.04-1.10x of the forced path at three shapes: R5 B333 H80 K1000 fp32 and R32 B8192 H64
    K256 fp32 in all three runs, R32 B1 H64 K256 fp32 in both H100 runs. Eager read 1.02-1.05x
    at the first and third. Over the ~93 GEMM-path shapes the mean ratio was 1.00."""
    row: dict[str, Any] = {"shape": label, "us": {}, "err": {}, "bits": {}, "us_each": {}}
    calls: dict[str, tuple[dict[str, str], Callable[[], Any]]] = {
        name: ({}, call) for name, call in (floors or {}).items()}
    for name, (path, call) in variants.items():
        setting = {} if path is None else {env: path} if isinstance(path, str) else path
        # checked as called eagerly and as a graph's replay computes it, which is what is timed:
        # the two can run different paths (cat_linear moves some fused picks to the GEMM path
        # while a graph is captured: cat_linear_model.h's graph_prefers_gemm), and the bits that
        # tell auto's path apart are the replay's
        for out in (_with_env(setting, call), _with_env(setting, lambda: graph_output(call))):
            err = ((out.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
            if not err <= tol:
                raise AssertionError(f"{label} {name}: relative error {err:.2e} > {tol}")
        row["err"][name] = err
        row["bits"][name] = fingerprint(out)
        calls[name] = (setting, call)
    names = list(calls)
    for o in range(max(1, orders)):
        for name in names if o % 2 == 0 else names[::-1]:
            setting, call = calls[name]
            row["us_each"].setdefault(name, []).append(_with_env(setting, lambda: timing.graph_us(call, reps, 20)))
    row["us"] = {name: min(row["us_each"][name]) for name in names}
    forced = {p: row["us"][p] for p in paths if p in row["us"]}
    row["best"] = min(forced, key=forced.__getitem__)
    row["auto~"] = infer_auto(row, forced)
    row["auto/best"] = row["us"]["auto"] / forced[row["best"]]
    row["auto/eager"] = row["us"]["auto"] / row["us"]["eager"]
    return row


def graph_output(call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``call``'s output as a replay of it captured in a CUDA graph computes it (after a warm-up
    call on a side stream, as capture needs); the eager call's output where there is no CUDA."""
    if not torch.cuda.is_available():
        return call()
    graph, out = timing.captured(call, 1, warmups=1)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def _with_env(setting: dict[str, str], fn: Callable[[], Any]) -> Any:
    """``fn()`` with the variables of ``setting`` set (the op reads them per call), then unset."""
    os.environ.update(setting)
    try:
        return fn()
    finally:
        for var in setting:
            os.environ.pop(var, None)


def fingerprint(out: torch.Tensor) -> str:
    """The output's bits, hashed: two paths whose outputs hash alike computed the same bits."""
    raw = out.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def infer_auto(row: dict[str, Any], forced: dict[str, float]) -> str:
    """Which path ``auto`` ran in the timed graph (the op does not report it): among the forced
    paths whose replayed output has auto's bits, the one nearest auto's time; the nearest of all
    where none has them. Time alone misreads a shape whose auto timing is an outlier (the
    forty-ninth session: a cat_linear shape's auto at 3.00 us against its own dot kernel's
    2.31, read as the simt path's 3.18)."""
    bits = row.get("bits", {})
    same = [p for p in forced if "auto" in bits and bits.get(p) == bits["auto"]]
    return min(same or forced, key=lambda p: abs(forced[p] - row["us"]["auto"]))


def only(shapes: list[Any], spec: Optional[str], label: Callable[[Any], str]) -> list[Any]:
    """The shapes whose label is one of ``spec``'s comma-separated labels (all if no spec)."""
    if not spec:
        return shapes
    want = {w.strip() for w in spec.split(",")}
    picked = [s for s in shapes if label(s) in want]
    if len(picked) != len(want):
        raise SystemExit(f"--only: {sorted(want - {label(s) for s in picked})} are not among the shapes")
    return picked


def header(names: Sequence[str], width: int) -> str:
    return f"{'shape':<{width}} " + " ".join(f"{n:>8}" for n in names) + "  best  auto/best auto/eager"


def line(row: dict[str, Any], names: Sequence[str], width: int) -> str:
    us = row["us"]
    cols = " ".join(f"{us[n]:8.2f}" if n in us else f"{'-':>8}" for n in names)
    return f"{row['shape']:<{width}} {cols}  {row['best']:<5} {row['auto/best']:9.3f} {row['auto/eager']:10.3f}"


def pdl(rows: list[dict[str, Any]], no_pdl_paths: Sequence[str] = ()) -> None:
    """``auto`` (PDL on, the default; backends/cuda/pdl.cuh) against the ``no_pdl`` column (auto
    with OPREG_PDL=0): the ratio's spread over the shapes, and the shapes where PDL is slower by
    more than 3 %; separately where auto runs a PDL kernel and where it runs one of ``no_pdl_paths``
    (paths whose kernels take no PDL: there both columns launch the same kernels, and their
    ratio is the timing's own spread). Auto's path is inferred (``auto~``, :func:`infer_auto`). A
    slower shape is printed with auto against that path forced, the same kernels with PDL on: a
    ratio far from 1 there is the timing's spread at the shape, not PDL."""
    pairs = [(r["shape"], r["us"]["auto"] / r["us"]["no_pdl"], r.get("auto~")) for r in rows if "no_pdl" in r["us"]]
    same = {r["shape"]: r["us"]["auto"] / r["us"][r["auto~"]] for r in rows
            if "no_pdl" in r["us"] and r.get("auto~") in r["us"]}
    if not pairs:
        return
    groups = [("shapes", pairs)]
    if no_pdl_paths:
        groups += [(f"shapes where auto runs a PDL kernel (auto~ not {'/'.join(no_pdl_paths)})",
                    [q for q in pairs if q[2] not in no_pdl_paths]),
                   (f"shapes where auto runs {'/'.join(no_pdl_paths)} (no PDL kernel)",
                    [q for q in pairs if q[2] in no_pdl_paths])]
    for what, group in groups:
        ratios = sorted(q for _, q, _ in group)
        if not ratios:
            continue
        print(f"\nauto / no_pdl over {len(ratios)} {what}: median {ratios[len(ratios) // 2]:.3f}, "
              f"min {ratios[0]:.3f}, max {ratios[-1]:.3f}; PDL faster by > 3 % at {sum(q < 0.97 for q in ratios)}, "
              f"slower by > 3 % at {sum(q > 1.03 for q in ratios)}")
        if group is pairs and no_pdl_paths:  # its slower shapes are listed in their group below
            continue
        for shape, q, path in sorted(group, key=lambda sq: -sq[1])[:10]:
            if q > 1.03:
                spread = f", auto / {path} forced {same[shape]:.3f}" if shape in same else ""
                print(f"  PDL slower: {shape} auto/no_pdl {q:.3f} (auto~ {path}{spread})")


def report(rows: list[dict[str, Any]], json_path: Optional[str], no_pdl_paths: Sequence[str] = ()) -> None:
    """The shapes where ``auto`` is > 3 % behind the fastest forced path or slower than eager,
    auto (PDL) against no_pdl (:func:`pdl`), and the rows as JSON."""
    behind = [r for r in rows if r["auto/best"] > 1.03]
    slower = [r for r in rows if r["auto/eager"] > 1.03]
    print(f"\n{len(rows)} shapes; auto > 3 % behind the fastest forced path at {len(behind)}, "
          f"> 3 % slower than eager at {len(slower)} (CUDA graphs)")
    for r in sorted(slower, key=lambda r: -r["auto/eager"])[:20]:
        print(f"  slower than eager: {r['shape']} auto/eager {r['auto/eager']:.3f} (best {r['best']})")
    for r in sorted(behind, key=lambda r: -r["auto/best"])[:25]:
        print(f"  behind: {r['shape']} auto/best {r['auto/best']:.3f} (best {r['best']})")
    pdl(rows, no_pdl_paths)
    if json_path:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        Path(json_path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
