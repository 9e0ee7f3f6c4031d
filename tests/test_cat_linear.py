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
          ((0,), [4, 4], 3), ((4,), [0, 0], 3)]  # no rows; zero-width parts (y = bias)


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


# ------------------------------------------------------------------ cat_linear_stacked
# cat_linear_stacked(x, dim, W, b) == cat_linear(x.unbind(dim), W, b): what the backend
# emits for torch.cat([x[i] for i in range(R)], -1).

STACKED = torch.ops.opreg.cat_linear_stacked.default
from opreg.ops.cat_linear import reference_stacked  # noqa: E402


def run_stacked(impl: str, device: str, *args) -> torch.Tensor:
    if impl == "default":
        return STACKED(*args)
    return opreg.get("cat_linear_stacked", impl=device if impl == "native" else impl)(*args)


def stacked_inputs(shape: tuple[int, ...], dim: int, k: int, dtype: torch.dtype, device: str,
                   bias: bool = True):
    x = torch.randn(*shape, dtype=dtype, device=device)
    parts = x.unbind(dim)
    width = sum(p.shape[-1] for p in parts)
    weight = torch.randn(k, width, dtype=dtype, device=device) / max(width, 1) ** 0.5
    return x, dim, weight, torch.randn(k, dtype=dtype, device=device) if bias else None


def expected_stacked(x, dim, weight, bias) -> torch.Tensor:
    return reference_stacked(x.double(), dim, weight.double(), None if bias is None else bias.double())


# (x shape, dim, K): the reference model's (R, B, H) along 0; a middle dim; the last dim
# (slices are x[..., i]); a negative dim; 4-D; a large one (the GEMM path on CUDA).
STACKED_SHAPES = [((4, 12, 32), 0, 56), ((5, 3, 8), 1, 9), ((6, 7, 3), 2, 5), ((2, 3, 4), -2, 4),
                  ((2, 3, 4, 5), 0, 6), ((4, 64, 256), 0, 100), ((3, 0, 4), 0, 3), ((3, 4, 0), 0, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape,dim,k", STACKED_SHAPES, ids=str)
def test_stacked_matches_reference(device, impl, dtype, bias, shape, dim, k):
    skip_without(device)
    args = stacked_inputs(shape, dim, k, dtype, device, bias)
    want = expected_stacked(*args)
    poison(k * dtype.itemsize * max(1, want.numel() // max(k, 1)), device)
    assert_matches(run_stacked(impl, device, *args), want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_stacked_non_contiguous_x(device, impl):
    skip_without(device)
    x = torch.randn(16, 4, 12, device=device).transpose(0, 1)[:, :, ::2]  # (4, 16, 6), strided
    weight = torch.randn(10, 4 * 6, device=device)
    args = (x, 0, weight, torch.randn(10, device=device))
    assert_matches(run_stacked(impl, device, *args), expected_stacked(*args), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_stacked_opcheck(device, dim):
    skip_without(device)
    x, d, weight, bias = stacked_inputs((3, 4, 5), dim, 6, torch.float32, device)
    torch.library.opcheck(STACKED, (x.requires_grad_(), d, weight.requires_grad_(),
                                    bias.requires_grad_()))
    torch.library.opcheck(STACKED, (x.detach(), d, weight.detach(), None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_stacked_gradcheck(device, dim, bias):
    skip_without(device)
    x, d, weight, b = stacked_inputs((3, 2, 4), dim, 5, torch.float64, device, bias)
    inputs = [x, weight] + ([b] if bias else [])
    for t in inputs:
        t.requires_grad_()
    f = lambda *a: STACKED(a[0], d, a[1], a[2] if bias else None)  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(inputs))


@pytest.mark.parametrize("device", DEVICES)
def test_no_autograd_node_without_grad(device):
    """No input requires grad (or grad mode is off): the kernels run without an autograd
    node, and the result is the same; with grad, the node is there."""
    skip_without(device)
    x, d, weight, bias = stacked_inputs((4, 12, 32), 0, 56, torch.float32, device)
    parts = list(x.unbind(0))
    plain = (STACKED(x, d, weight, bias), OP(parts, weight, bias))
    weight.requires_grad_()
    with torch.no_grad():
        no_grad = (STACKED(x, d, weight, bias), OP(parts, weight, bias))
    with_grad = (STACKED(x, d, weight, bias), OP(parts, weight, bias))
    for a, b, c in zip(plain, no_grad, with_grad):
        assert a.grad_fn is None and b.grad_fn is None and c.grad_fn is not None
        assert not b.requires_grad and c.requires_grad
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(c.detach(), a, rtol=0, atol=0)


STACKED_BAD = [
    ("x rank", lambda x, d, w, b: (x[0, 0], 0, w, b), ValueError, "x must have at least 2 dims"),
    ("dim range", lambda x, d, w, b: (x, 3, w, b), ValueError, "dim must be in"),
    ("no slices", lambda x, d, w, b: (x[:0], 0, w, b), ValueError, r"x.size\(dim\)"),
    ("x dtype", lambda x, d, w, b: (x.int(), 0, w, b), TypeError, "x must be float"),
    ("weight width", lambda x, d, w, b: (x, 1, w, b), ValueError, "weight has 12 columns"),
    ("weight rank", lambda x, d, w, b: (x, 0, w[0], b), ValueError, "weight must be 2-D"),
    ("weight dtype", lambda x, d, w, b: (x, 0, w.double(), b), TypeError, "weight has dtype"),
    ("bias shape", lambda x, d, w, b: (x, 0, w, b[:-1]), ValueError, "bias must have shape"),
    ("bias dtype", lambda x, d, w, b: (x, 0, w, b.double()), TypeError, "bias has dtype"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("what,mutate,exc,word", STACKED_BAD, ids=[b[0] for b in STACKED_BAD])
def test_stacked_bad_input(device, impl, what, mutate, exc, word):
    skip_without(device)
    args = mutate(*stacked_inputs((3, 5, 4), 0, 6, torch.float32, device))
    with pytest.raises(exc, match=word):
        run_stacked(impl, device, *args)


@pytest.mark.cuda
def test_stacked_device_mismatch():
    skip_without("cuda")
    x, d, weight, bias = stacked_inputs((3, 5, 4), 0, 6, torch.float32, "cuda")
    with pytest.raises(ValueError, match="bias"):
        STACKED(x, d, weight, bias.cpu())


@pytest.mark.cuda
def test_stacked_cuda_graph_capture():
    skip_without("cuda")
    args = stacked_inputs((4, 12, 32), 0, 56, torch.float32, "cuda")
    STACKED(*args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = STACKED(*args)
    args[0].copy_(torch.randn_like(args[0]))
    g.replay()
    torch.cuda.synchronize()
    assert_matches(captured, expected_stacked(*args), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["simt", "gemm"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,k", STACKED_SHAPES[:5], ids=str)
def test_cuda_both_paths(monkeypatch, path, dtype, shape, dim, k):
    """Each CUDA path (single-launch SIMT, cat + cuBLAS), forced, for both ops: the
    stacked op describes flat slices straight from x's strides on the SIMT path."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", path)
    x, d, weight, bias = stacked_inputs(shape, dim, k, dtype, "cuda")
    want = expected_stacked(x, d, weight, bias)
    poison(want.numel() * dtype.itemsize, "cuda")
    assert_matches(STACKED(x, d, weight, bias), want, dtype)
    assert_matches(OP(list(x.unbind(d)), weight, bias), want, dtype)
