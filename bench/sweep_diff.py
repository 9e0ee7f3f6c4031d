"""Two ``bench/sweep.py --json`` runs side by side: the same rows' opreg times, B / A.

    python bench/sweep_diff.py A.json B.json [--op scatter_combine]

For an A/B of a kernel change on one machine (``STAGE=scatter SC_ALT=... bash
bench/device_run.sh`` writes both runs): per row, opreg's median time host-timed, B / A,
and, where the sweep replayed it from a CUDA graph (scatter_combine >= 16 MB), its fraction
of the copy bound in each run and the graph time's B / A; then the geometric means and the
rows below 70 % of copy in each. Rows in one run only are listed, not compared.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any

COPY_FRAC = 0.70  # sweep.py's bar


def rows_of(path: str, op: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    with open(path) as f:
        doc = json.load(f)
    return {(r["form"], r["mode"], r["label"]): r for r in doc["rows"] if r["op"] == op}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--op", default="scatter_combine")
    args = p.parse_args()
    a, b = rows_of(args.a, args.op), rows_of(args.b, args.op)
    common = [k for k in a if k in b]
    print(f"{'row':52s} {'A us':>8s} {'B us':>8s} {'B/A':>6s}  {'A graph':>7s} {'B graph':>7s} {'B/A':>6s}")
    logs, glogs = [], []
    for k in common:
        ta, tb = a[k]["median_us"]["opreg"], b[k]["median_us"]["opreg"]
        ga, gb = a[k].get("frac_copy_graph"), b[k].get("frac_copy_graph")
        logs.append(math.log(tb / ta))
        graph = ""
        if ga and gb:  # fractions of the same copy time: time B / time A = ga / gb
            glogs.append(math.log(ga / gb))
            graph = f"{ga:7.2f} {gb:7.2f} {ga / gb:6.3f}"
        print(f"{' '.join(k[1:]):52s} {ta:8.1f} {tb:8.1f} {tb / ta:6.3f}  {graph}")
    if logs:
        print(f"\n{len(common)} rows in both: geometric mean B / A {math.exp(sum(logs) / len(logs)):.3f} host-timed"
              + (f", {math.exp(sum(glogs) / len(glogs)):.3f} in a CUDA graph ({len(glogs)} rows)" if glogs else ""))
    for name, rows in (("A", a), ("B", b)):
        graph = [r for k, r in rows.items() if k in common and r.get("frac_copy_graph") is not None]
        below = sum(1 for r in graph if r["frac_copy_graph"] < COPY_FRAC)
        print(f"{name}: {below} of {len(graph)} common rows below {COPY_FRAC:.0%} of copy in a CUDA graph")
    for name, rows, other in (("A", a, b), ("B", b, a)):
        only = [k for k in rows if k not in other]
        if only:
            print(f"only in {name} ({len(only)}): " + "; ".join(" ".join(k[1:]) for k in only[:10]))


if __name__ == "__main__":
    main()
