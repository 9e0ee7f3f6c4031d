"""Host cost of calling moe_experts through ``torch.ops`` against ``opreg._entry.python_call``
(what the transformers integration uses), with the bound implementation replaced by a stub
that returns at once, so only the way in is timed.

    python bench/dispatch_overhead.py [--rounds 10] [--calls 3000]

CPU tensors, no grad; the two ways alternate in one process, min and median of the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from opreg import registry
from opreg._entry import python_call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=3000)
    a = p.parse_args()
    t, h, i, e, k = 4, 16, 8, 4, 2
    x = torch.randn(t, h)
    args = (x, torch.randint(0, e, (t, k)), torch.rand(t, k), torch.randn(e, 2 * i, h), None,
            torch.randn(e, h, i), None, "silu", True, False, False, 1.0, float("inf"))
    op, direct = torch.ops.opreg.moe_experts.default, python_call("moe_experts")
    with torch.no_grad():
        op(*args)  # binds the default on the CPU
        impl = registry.lookup("moe_experts").impls[registry.bound("moe_experts", "cpu")]
        real, impl.fn = impl.fn, lambda *_: x
        try:
            times: dict[str, list[float]] = {"python_call": [], "torch.ops": []}
            for _ in range(3):
                direct(*args), op(*args)
            for _ in range(a.rounds):
                for name, fn in (("python_call", direct), ("torch.ops", op)):
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn(*args)
                    times[name].append((time.perf_counter() - t0) / a.calls * 1e6)
        finally:
            impl.fn = real
    for name, v in times.items():
        print(f"{name:12s} min {min(v):6.1f} us  median {statistics.median(v):6.1f} us per call")


if __name__ == "__main__":
    main()
