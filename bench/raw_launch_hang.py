"""Which launch path hangs a HALF_TAIL GEMM on the GPU (CUDA; one process per run).

    for v in default rawhalf oldkey noraw nocache hold; do
      timeout 40 python3 bench/raw_launch_hang.py $v "half tail blocks"; echo "rc $?"; done

Three forwards of one of ``tests/test_moe_triton.py``'s cases (bf16), each synchronised:
a hang shows as the last "call i ok" line before the timeout (rc 124). On the H200
(triton 3.6, 2026-12-05) what is now ``rawhalf`` hung at the second or third call in each
of 5 processes whose GEMMs had tensor descriptors (three half-tile cases, the suite's two
among them); ``noraw``, ``triton`` and ``nocache`` ran all three calls in 7 of 7.
launch_gemm now sends HALF_TAIL through Triton's own launcher (what ``noraw`` does), so
``default`` should no longer hang; the variants below patch the raw launcher itself, where
the cause is:

* ``default``: as main launches (for HALF_TAIL: ``kernel.run``);
* ``rawhalf``: the raw launcher for HALF_TAIL too, its encoded descriptors keyed by their
  parameter as well (since the forty-first session: each parameter's encoding reads its own
  TMA metadata);
* ``oldkey`` (with ``rawhalf``): keyed as before, without the parameter (what hung);
* ``noraw``: no raw launcher for any kernel (``kernel.run`` on every hit);
* ``triton``: Triton's whole path on every launch (``fn[grid](...)``);
* ``nocache`` (with ``rawhalf``): the raw launcher, every descriptor encoded on every launch;
* ``hold`` (with ``rawhalf``): encoded on every launch, every encoding kept alive.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_moe_triton as T  # noqa: E402

from opreg.backends.triton import launch as L  # noqa: E402
from opreg.backends.triton import moe_experts as F  # noqa: E402


def _raw_for_half() -> None:
    """launch_gemm's use_raw=False for HALF_TAIL undone: every hit through the raw launcher."""
    launch_args = F.launch_args
    F.launch_args = lambda fn, grid, args, spec, kwargs, use_raw=True: launch_args(fn, grid, args, spec, kwargs)


def _patch(variant: str) -> None:
    if variant in ("rawhalf", "oldkey", "nocache", "hold"):
        _raw_for_half()
    if variant == "noraw":
        L._raw_launcher = lambda kernel: None
    elif variant == "triton":
        L._direct_ok = False
    elif variant == "nocache":
        L._RawLaunch._expand = lambda self, pos, d, meta: self.encode(
            d.build() if type(d) is L.LazyDescriptor else d, meta)
    elif variant == "hold":
        held = []

        def expand(self: L._RawLaunch, pos: int, d: object, meta: object) -> list:
            held.append(self.encode(d.build() if type(d) is L.LazyDescriptor else d, meta))
            return held[-1]
        L._RawLaunch._expand = expand
    elif variant == "oldkey":
        expand = L._RawLaunch._expand
        L._RawLaunch._expand = lambda self, pos, d, meta: expand(self, 0, d, meta)  # every parameter as one
    elif variant not in ("default", "rawhalf"):
        raise SystemExit(f"unknown variant {variant!r}")


def main() -> None:
    variant, case = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "half tail blocks"
    _patch(variant)
    c = T.CASES[case]
    torch.manual_seed(0)
    args, _ = T._special(T.make(*c["dims"], torch.bfloat16, "cuda", **c["opts"]), c.get("special"))
    for i in range(3):
        t = time.perf_counter()
        T.TM.fused_experts_forward(*args, configs=c.get("configs"))
        torch.cuda.synchronize()
        print(f"{variant} | {case} | call {i} ok ({time.perf_counter() - t:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
