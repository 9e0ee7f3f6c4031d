"""pytest-benchmark: scatter_combine against eager and Inductor.

    pytest -n 0 bench/bench_scatter_combine.py --benchmark-group-by=param:case

Each case is timed for: the eager spelling users write (``index_add_``), opreg's
reference, ``torch.compile`` (Inductor) of the eager spelling, and every opreg
implementation available here. Every benchmark first checks its output against the
float64 reference. CPU runs the small case (so CI exercises this file); a GPU adds
the sizes of the CUDA issue.
"""
from __future__ import annotations

import pytest
import torch

import opreg
from opreg.ops.scatter_combine import reference

CASES = {  # name: (tokens, fanout, hidden, dtype)
    "1536x2x128-fp32": (1536, 2, 128, torch.float32),
    "16384x2x4096-bf16": (16384, 2, 4096, torch.bfloat16),
    "8192x8x7168-bf16": (8192, 8, 7168, torch.bfloat16),
}
CPU_CASES = ["1536x2x128-fp32"]  # N=3072, H=128: the size the CPU kernel must win at
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def index_add(hidden, idx, gates, t):
    """The eager spelling MoE code uses (nondeterministic on CUDA: atomics)."""
    out = torch.zeros(t, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    return out.index_add_(0, idx, hidden * gates[:, None].to(hidden.dtype))


def make(case: str):
    t, k, h, dtype = CASES[case]
    n = t * k
    expert = torch.randint(0, 64, (n,), device=DEVICE)
    idx = torch.arange(t, device=DEVICE).repeat_interleave(k)[torch.sort(expert, stable=True).indices]
    hidden = torch.randn(n, h, device=DEVICE, dtype=dtype)
    gates = torch.rand(n, device=DEVICE, dtype=dtype)
    return hidden, idx.to(torch.int32), gates, t


def variants() -> list[str]:
    names = ["eager_index_add", "inductor_index_add", "opreg_reference"]
    op = opreg.registry.lookup("scatter_combine")
    names += [f"opreg_{n}" for n, i in op.impls.items()
              if n != "reference" and i.unavailable(DEVICE) is None]
    return names


def fn_for(variant: str):
    if variant == "eager_index_add":
        return index_add
    if variant == "inductor_index_add":
        torch._dynamo.reset()
        return torch.compile(index_add, dynamic=False)
    return opreg.get("scatter_combine", impl=variant.removeprefix("opreg_"))


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("case", CPU_CASES if DEVICE == "cpu" else list(CASES))
def test_scatter_combine(benchmark, case, variant):
    args = make(case)
    fn = fn_for(variant)
    want = reference(args[0].double(), args[1], args[2].double(), args[3])
    got = fn(*args)
    tol = 1e-5 if args[0].dtype == torch.float32 else 2e-2
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < tol, f"{variant}: relative error {err:.3g}"
    benchmark.extra_info.update(case=case, device=DEVICE, torch=torch.__version__)

    def call():
        fn(*args)
        _sync()

    benchmark(call)
