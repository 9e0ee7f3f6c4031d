"""pytest-benchmark: cat_linear against eager and Inductor.

    pytest -n 0 bench/bench_cat_linear.py --benchmark-group-by=param:case

Each case is timed for ``F.linear(torch.cat(parts, -1), W, b)`` eagerly and under
``torch.compile`` (Inductor), and for every opreg implementation available here,
after checking each output against the float64 reference; ``opreg_stacked`` is
``cat_linear_stacked(x, 0, W, b)`` on the tensor the parts are slices of (what the
backend emits for the reference model). CPU runs the small cases.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opreg
from opreg.ops.cat_linear import reference

CASES = {  # name: (parts R, rows B, part width H, out features K, dtype)
    "R4-B12-H32-K56-fp32": (4, 12, 32, 56, torch.float32),
    "R4-B64-H256-K1024-fp32": (4, 64, 256, 1024, torch.float32),
    "R8-B8192-H512-K4096-bf16": (8, 8192, 512, 4096, torch.bfloat16),
    "R32-B4096-H128-K4096-bf16": (32, 4096, 128, 4096, torch.bfloat16),
}
CPU_CASES = ["R4-B12-H32-K56-fp32", "R4-B64-H256-K1024-fp32"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def eager(parts, weight, bias):
    return F.linear(torch.cat(parts, -1), weight, bias)


def make(case: str):
    r, b, h, k, dtype = CASES[case]
    x = torch.randn(r, b, h, device=DEVICE, dtype=dtype)  # the reference model's layout
    weight = torch.randn(k, r * h, device=DEVICE, dtype=dtype) / (r * h) ** 0.5
    return x, weight, torch.randn(k, device=DEVICE, dtype=dtype)


def variants() -> list[str]:
    names = ["eager", "inductor", "opreg_reference", "opreg_stacked"]
    op = opreg.registry.lookup("cat_linear")
    names += [f"opreg_{n}" for n, i in op.impls.items()
              if n != "reference" and i.unavailable(DEVICE) is None]
    return names


def fn_for(variant: str):
    if variant == "eager":
        return eager
    if variant == "inductor":
        torch._dynamo.reset()
        return torch.compile(eager, dynamic=False)
    if variant == "opreg_stacked":
        return opreg.get("cat_linear_stacked")
    return opreg.get("cat_linear", impl=variant.removeprefix("opreg_"))


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("case", CPU_CASES if DEVICE == "cpu" else list(CASES))
def test_cat_linear(benchmark, case, variant):
    x, weight, bias = make(case)
    parts = list(x.unbind(0))
    fn = fn_for(variant)
    args = (x, 0, weight, bias) if variant == "opreg_stacked" else (parts, weight, bias)
    want = reference([p.double() for p in parts], weight.double(), bias.double())
    with torch.no_grad():
        got = fn(*args)
    tol = 1e-5 if weight.dtype == torch.float32 else 1e-2
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < tol, f"{variant}: relative error {err:.3g}"
    benchmark.extra_info.update(case=case, device=DEVICE, torch=torch.__version__)

    def call():
        with torch.no_grad():
            fn(*args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark(call)
