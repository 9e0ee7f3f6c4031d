"""scatter_combine's forward under several settings of environment variables that the op
reads per call (a candidate's knobs, e.g. ``OPREG_SC_PREFETCH_MB`` and ``OPREG_SC_MEMSET`` of
the seventy-first session's prefetch_x.diff, run and dropped in the seventy-third), side by
side in one process: each setting's calls captured in a CUDA graph of their own (the host
reads the variables while the graph is captured, so the setting is in the graph's
launches), then the graphs replayed in interleaved rounds, the
order reversed every other round, beside a graph of the copy of the same bytes. Prints per
shape and setting the device time per call, its fraction of the copy's, and the median over
rounds of its ratio to the first setting's.

    python bench/scatter_env_ab.py --env OPREG_SC_PREFETCH_MB --values 0,8,16,-16 \\
        --shapes "65536,2,128;16384,1,1024" [--rounds 9] [--json out.json]
    python bench/scatter_env_ab.py --values "A=0,A=1+B=16" --shapes ...

A setting is a value of ``--env``, or ``NAME=value`` assignments joined by ``+`` (variables
a setting does not name are unset while it runs).

Shapes: ``T,k,H[,dtype[,order]]`` (dtype bf16 by default, order random: the sweep's
``scatter_sets``, int32 indices, enough input sets that they don't sit in L2 between calls).
Every value's output is checked bit for bit against the first value's, and the first value's
against the float64 reference, before anything is timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing as tm  # noqa: E402
import sweep  # noqa: E402

import opreg  # noqa: E402
from opreg.ops.scatter_combine import reference  # noqa: E402


def parse_shape(s: str) -> tuple:
    f = [x.strip() for x in s.split(",")]
    t, k, h = (int(x) for x in f[:3])
    return (t, k, h, f[3] if len(f) > 3 else "bf16", f[4] if len(f) > 4 else "random", "int32")


def parse_setting(text: str, env: str | None) -> dict[str, str]:
    """``"A=1+B=2"`` -> {A: 1, B: 2}; a bare value is ``env``'s."""
    if "=" not in text:
        if env is None:
            raise SystemExit(f"setting {text!r}: a bare value needs --env")
        return {env: text}
    return dict(a.split("=", 1) for a in text.split("+"))


def with_env(setting: dict[str, str], names: set[str], fn: Any) -> Any:
    """fn() with ``setting``'s variables set and the others of ``names`` unset."""
    old = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(setting)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_shape(shape: tuple, settings: dict[str, dict[str, str]], rounds: int) -> dict[str, Any]:
    op = opreg.get("scatter_combine")
    sets = sweep.scatter_sets(shape, "cuda")
    nbytes = sweep.scatter_bytes_of(shape, False)
    calls = sweep.graph_calls(nbytes)

    def call(i: int) -> torch.Tensor:
        s = sets[i]
        return op(s["h"], s["idx"], s["g"], s["t"])

    values = list(settings)
    names = {k for st in settings.values() for k in st}

    def env_of(v: str, fn: Any) -> Any:
        return with_env(settings[v], names, fn)

    s0 = sets[0]
    want = reference(s0["h"].double(), s0["idx"], s0["g"].double(), s0["t"])
    first = env_of(values[0], lambda: call(0))
    err = sweep.rel_err(first, want)
    if err > sweep.TOL[shape[3]]:
        raise SystemExit(f"{sweep.shape_label('scatter_combine', shape)}: {values[0]} off the "
                         f"float64 reference by {err:.2e}")
    for v in values[1:]:
        got = env_of(v, lambda: call(0))
        if not torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                           first.view(torch.int16 if first.element_size() == 2 else torch.int32)):
            raise SystemExit(f"{sweep.shape_label('scatter_combine', shape)}: {v} changes the bits")
    graphs = {v: env_of(v, lambda: tm.capture(call, len(sets), calls)) for v in values}
    copy = sweep.copy_variant(sets, nbytes)
    graphs["copy"] = tm.capture(copy.call, len(sets), calls)
    order = list(graphs)
    times: dict[str, list[float]] = {k: [] for k in order}
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            times[k].append(tm.replay_us(graphs[k], calls))
    del graphs
    med = {k: statistics.median(x) for k, x in times.items()}
    return dict(shape=sweep.shape_label("scatter_combine", shape), mb=round(nbytes / 2**20, 1), us=med,
                frac_copy={v: round(med["copy"] / med[v], 4) for v in values},
                ratio={v: round(tm.paired_ratio(times[v], times[values[0]]), 4) for v in values},
                err=err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default=None, help="the variable a bare value of --values sets")
    ap.add_argument("--values", required=True,
                    help="comma-separated settings (a value of --env, or NAME=v+NAME2=w); the first is the baseline")
    ap.add_argument("--shapes", required=True, help="T,k,H[,dtype[,order]];...")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scatter_env_ab.py needs a CUDA device")
    settings = {v.strip(): parse_setting(v.strip(), a.env) for v in a.values.split(",")}
    values = list(settings)
    rows = []
    print(f"{a.env or 'settings'}: " + " | ".join(values) + f" ({a.rounds} rounds; us per call in CUDA graphs, "
          f"fraction of the copy's time, ratio to {values[0]})")
    for spec in a.shapes.split(";"):
        row = run_shape(parse_shape(spec), settings, a.rounds)
        rows.append(row)
        cells = "  ".join(f"{v}: {row['us'][v]:.1f} us {100 * row['frac_copy'][v]:.0f}% x{row['ratio'][v]:.3f}"
                          for v in values)
        print(f"{row['shape']} ({row['mb']} MB; copy {row['us']['copy']:.1f} us)  {cells}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(env=a.env, settings=settings, rows=rows,
                                                device=torch.cuda.get_device_name()), indent=1))


if __name__ == "__main__":
    main()
