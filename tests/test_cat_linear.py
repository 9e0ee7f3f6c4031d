"""cat_linear: every implementation against the float64 reference, opcheck, gradcheck,
bad input."""
from __future__ import annotations

import pytest
import torch

import opreg
from opreg.ops.cat_linear import reference

from _util import DEVICES, FLOAT_DTYPES, assert_matches, poison, skip_without

OP = torch.ops.opreg.cat_linear.default
IMPLS = ["default", "reference", "native"]


def make_inputs(lead: tuple[int, ...], widths: list[int], k: int, dtype: torch.dtype,
                device: str, bias: bool = True):
    parts = [torch.randn(*lead, w, dtype=dtype, device=device) for w in widths]
    weight = torch.randn(k, sum(widths), dtype=dtype, device=device) / sum(widths) ** 0.5
    b = torch.randn(k, dtype=dtype, device=device) if bias else None
    return parts, weight, b


def expected(parts, weight, bias) -> torch.Tensor:
    return reference([p.double() for p in parts], weight.double(),
                     None if bias is None else bias.double())


def run(impl: str, device: str, *args) -> torch.Tensor:
    if impl == "default":
        return OP(*args)
    return opreg.get("cat_linear", impl=device if impl == "native" else impl)(*args)


SHAPES = [((12,), [32] * 4, 56), ((3, 5), [7, 1, 16], 9), ((), [3, 5], 4), ((64,), [256] * 4, 100),
          ((0,), [4, 4], 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(device, impl, dtype, bias, shape):
    skip_without(device)
    lead, widths, k = shape
    args = make_inputs(lead, widths, k, dtype, device, bias)
    poison(k * dtype.itemsize * max(1, torch.Size(lead).numel()), device)
    assert_matches(run(impl, device, *args), expected(*args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_parts(device, impl):
    skip_without(device)
    x = torch.randn(4, 16, 12, device=device)
    parts = [x[i, :, ::2] for i in range(4)] + [x[0].t()[:6].t()]  # strided slices
    weight = torch.randn(10, 4 * 6 + 6, device=device)
    args = (parts, weight.t().contiguous().t(), torch.randn(10, device=device))
    assert_matches(run(impl, device, *args), expected(*args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    skip_without(device)
    parts, weight, bias = make_inputs((3, 2), [4, 5, 3], 6, torch.float32, device)
    torch.library.opcheck(OP, ([p.requires_grad_() for p in parts], weight.requires_grad_(),
                               bias.requires_grad_()))
    torch.library.opcheck(OP, ([p.detach() for p in parts], weight.detach(), None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gradcheck(device, bias):
    skip_without(device)
    parts, weight, b = make_inputs((2, 3), [2, 3, 1], 4, torch.float64, device, bias)
    inputs = [*parts, weight] + ([b] if bias else [])
    for t in inputs:
        t.requires_grad_()
    f = lambda *a: OP(list(a[:3]), a[3], a[4] if bias else None)  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(inputs))


BAD = [
    ("empty parts", lambda p, w, b: ([], w, b), ValueError, "parts"),
    ("leading shape", lambda p, w, b: ([p[0], p[1][:-1], p[2]], w, b), ValueError, r"parts\[1\]"),
    ("part dtype", lambda p, w, b: ([p[0], p[1].double(), p[2]], w, b), TypeError, r"parts\[1\]"),
    ("weight width", lambda p, w, b: (p, w[:, :-1], b), ValueError, "weight"),
    ("weight rank", lambda p, w, b: (p, w[0], b), ValueError, "weight"),
    ("weight dtype", lambda p, w, b: (p, w.double(), b), TypeError, "weight"),
    ("bias shape", lambda p, w, b: (p, w, b[:-1]), ValueError, "bias"),
    ("int parts", lambda p, w, b: ([x.int() for x in p], w.int(), b.int()), TypeError, "parts"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("what,mutate,exc,word", BAD, ids=[b[0] for b in BAD])
def test_bad_input(device, impl, what, mutate, exc, word):
    skip_without(device)
    args = mutate(*make_inputs((5,), [3, 4, 2], 6, torch.float32, device))
    with pytest.raises(exc, match=word):
        run(impl, device, *args)


@pytest.mark.cuda
def test_device_mismatch():
    skip_without("cuda")
    parts, weight, bias = make_inputs((5,), [3, 4], 6, torch.float32, "cuda")
    with pytest.raises(ValueError, match="weight"):
        OP(parts, weight.cpu(), bias)


@pytest.mark.cuda
def test_cuda_graph_capture():
    skip_without("cuda")
    args = make_inputs((12,), [32] * 4, 56, torch.float32, "cuda")
    OP(*args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = OP(*args)
    for p in args[0]:
        p.copy_(torch.randn_like(p))
    g.replay()
    torch.cuda.synchronize()
    assert_matches(captured, expected(*args), torch.float32)
