"""Which launch path hung a HALF_TAIL GEMM on the GPU (CUDA; one process per run).

    for v in default oldkey noraw nocache hold; do
      timeout 40 python3 bench/raw_launch_hang.py $v "half tail blocks"; echo "rc $?"; done

Three forwards of one of ``tests/test_moe_triton.py``'s cases (bf16), each synchronised:
a hang shows as the last "call i ok" line before the timeout (rc 124). What it found (H200,
triton 3.6, 2026-12-05): the raw launcher (``launch._RawLaunch``) reused an encoded tensor
descriptor across the kernel's descriptor parameters. A launch without a spec key (given
configs: the tests, the tuner, these benches) passes built descriptors, whose cache key was
(address, shape, strides, padding); the encoding also reads the parameter's TMA metadata
(its block size, swizzle), and a HALF_TAIL GEMM passes one A in full and in half tiles: the
half-tile parameter got the full tile's encoding, TMA delivered boxes of another size than
the kernel waited for, and it never finished. Keyed by the parameter as well (``default``, since the
forty-first session) the raw launcher ran every case; ``oldkey`` hung at the second call,
as before. (The table's launches pass lazy descriptors, whose keys carry the box: they never
hung.) Variants:

* ``default``: as main launches (the raw launcher for every hit, HALF_TAIL included);
* ``oldkey``: the encoded descriptors keyed as before, without the parameter;
* ``noraw``: no raw launcher for any kernel (``kernel.run`` on every hit);
* ``triton``: Triton's whole path on every launch (``fn[grid](...)``);
* ``nocache``: the raw launcher, every descriptor encoded on every launch;
* ``hold``: encoded on every launch, every encoding kept alive.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_moe_triton as T  # noqa: E402

from opreg.backends.triton import launch as L  # noqa: E402


def _patch(variant: str) -> None:
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
    elif variant != "default":
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
