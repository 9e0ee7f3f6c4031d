"""Test helpers: devices, float64 comparisons with per-dtype tolerances, poisoning."""
from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# Normwise relative error allowed against a float64 reference (METHOD.md's bands:
# fp32 arithmetic lands far under 1e-3, half-precision operands within 1e-2).
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def assert_matches(got: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (dtype) agrees with the float64 reference: same shape and dtype, every
    element finite (an unwritten, poisoned element fails here), and both the normwise
    and the worst elementwise error within the dtype's tolerance of the output's scale."""
    assert got.dtype == dtype, f"dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref64.shape, f"shape {tuple(got.shape)}, expected {tuple(ref64.shape)}"
    if got.numel() == 0:
        return
    g = got.detach().double().cpu()
    r = ref64.detach().double().cpu()
    assert torch.isfinite(g).all(), "non-finite output (unwritten element?)"
    scale = r.abs().max().clamp_min(1e-30)
    err = (g - r).abs().max() / scale
    rel = (g - r).norm() / r.norm().clamp_min(1e-30)
    tol = TOL[dtype]
    assert err <= 4 * tol and rel <= tol, f"{dtype}: max err {err:.3g}, norm err {rel:.3g}, tol {tol:g}"


def poison(nbytes: int, device: str) -> None:
    """Leave NaN-filled memory in the allocator's free lists, so an output that a kernel
    forgets to write comes back as NaN rather than as lucky zeros."""
    blob = torch.empty(max(nbytes, 1) // 4 + 1, dtype=torch.float32, device=device)
    blob.fill_(float("nan"))
    del blob
