"""How long a warm process takes to its first opreg op call, over ``import torch`` plus
CUDA init (issue 11: the goal is <= 1 s, with no ninja run when nothing changed).

    python bench/first_call.py [--device cuda] [--runs 5]

Each run is a fresh process against the current kernel cache (build it first:
``python -m opreg build``). Prints the median of: import torch + device init, then
import opreg + the first scatter_combine and cat_linear calls (synchronised).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import time, json, sys
t0 = time.perf_counter()
import torch
dev = sys.argv[1]
x = torch.randn(64, 32, device=dev)
if dev == "cuda":
    torch.cuda.synchronize()
t1 = time.perf_counter()
import opreg
idx = torch.randint(0, 16, (64,), device=dev)
out = torch.ops.opreg.scatter_combine(x, idx, torch.rand(64, device=dev), 16)
y = torch.ops.opreg.cat_linear([x, x], torch.randn(8, 64, device=dev), None)
if dev == "cuda":
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"torch_and_init": t1 - t0, "opreg_first_calls": t2 - t1}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args(argv)
    rows = []
    for _ in range(a.runs):
        out = subprocess.run([sys.executable, "-c", CHILD, a.device], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"first call ({a.device}, median of {a.runs} fresh processes): import torch + init "
          f"{med['torch_and_init']:.2f} s; then import opreg + first op calls "
          f"{med['opreg_first_calls']:.2f} s (goal <= 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
