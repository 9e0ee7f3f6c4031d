"""scatter_combine: every implementation against the float64 reference, plus opcheck,
gradcheck, determinism, bad input, and (on a GPU) CUDA graphs and checked mode."""
from __future__ import annotations

import pytest
import torch

import opreg
from opreg.ops.scatter_combine import reference

from _util import DEVICES, FLOAT_DTYPES, assert_matches, poison, skip_without

OP = torch.ops.opreg.scatter_combine.default
IMPLS = ["default", "reference", "native"]  # native = the device's own C++ kernel


def make_inputs(t: int, fanout: int, h: int, dtype: torch.dtype, idx_dtype: torch.dtype,
                order: str, device: str, gates_dtype: torch.dtype | None = None):
    """Rows for ``t`` tokens: ``fanout`` each, or random destinations (some tokens get
    none, some several) for ``order="uneven"``."""
    n = t * fanout
    if order == "uneven":
        idx = torch.randint(0, max(t, 1), (n,))
    else:
        idx = torch.arange(t).repeat_interleave(fanout)
        if order == "random":
            idx = idx[torch.randperm(n)]
        elif order == "expert":  # grouped by a random expert id, as after an MoE dispatch
            idx = idx[torch.sort(torch.randint(0, 8, (n,)), stable=True).indices]
    hidden = torch.randn(n, h, dtype=dtype)
    gates = torch.rand(n, dtype=gates_dtype or dtype) + 0.1
    return hidden.to(device), idx.to(idx_dtype).to(device), gates.to(device), t


def expected(hidden, idx, gates, t) -> torch.Tensor:
    return reference(hidden.double(), idx, gates.double(), t)


def run(impl: str, device: str, *args) -> torch.Tensor:
    if impl == "default":
        return OP(*args)
    return opreg.get("scatter_combine", impl=device if impl == "native" else impl)(*args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("order", ["token", "random", "expert", "uneven"])
@pytest.mark.parametrize("shape", [(7, 2, 5), (64, 3, 130), (300, 1, 64), (33, 8, 8)], ids=str)
def test_matches_reference(device, impl, dtype, idx_dtype, order, shape):
    skip_without(device)
    args = make_inputs(*shape, dtype, idx_dtype, order, device)
    poison(shape[0] * shape[2] * dtype.itemsize, device)
    assert_matches(run(impl, device, *args), expected(*args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_gates_with_half_hidden(device, impl, dtype):
    skip_without(device)
    args = make_inputs(40, 2, 24, dtype, torch.int64, "random", device, gates_dtype=torch.float32)
    assert_matches(run(impl, device, *args), expected(*args), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_and_empty(device, impl):
    skip_without(device)
    hidden, idx, gates, t = make_inputs(50, 2, 32, torch.float32, torch.int64, "random", device)
    wide = torch.randn(hidden.shape[0], 64, device=device)[:, ::2]  # strided rows
    idx2 = torch.stack([idx, idx], 1)[:, 0]
    gates2 = torch.stack([gates, gates], 1)[:, 1]
    assert not (wide.is_contiguous() or idx2.is_contiguous() or gates2.is_contiguous())
    assert_matches(run(impl, device, wide, idx2, gates2, t), expected(wide, idx2, gates2, t),
                   torch.float32)
    empty = run(impl, device, hidden[:0], idx[:0], gates[:0], 5)
    assert empty.shape == (5, 32) and bool((empty == 0).all())
    assert run(impl, device, hidden, idx, gates, t).shape == (t, 32)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    """Same bits every run, and (CPU) whatever the thread count."""
    skip_without(device)
    args = make_inputs(512, 4, 96, torch.float32, torch.int32, "uneven", device)
    first = OP(*args)
    assert torch.equal(first, OP(*args))
    if device == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(first, OP(*args))
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
def test_opcheck(device, idx_dtype):
    skip_without(device)
    hidden, idx, gates, t = make_inputs(9, 2, 6, torch.float32, idx_dtype, "random", device)
    torch.library.opcheck(OP, (hidden.requires_grad_(), idx, gates.requires_grad_(), t))
    torch.library.opcheck(OP, (hidden.detach(), idx, gates.detach(), t))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    skip_without(device)
    hidden, idx, gates, t = make_inputs(6, 3, 4, torch.float64, torch.int64, "uneven", device)
    hidden.requires_grad_()
    gates.requires_grad_()
    assert torch.autograd.gradcheck(lambda h, g: OP(h, idx, g, t), (hidden, gates))
    assert opreg.autograd_kind("scatter_combine") in ("cpp", "python")


@pytest.mark.parametrize("device", DEVICES)
def test_backward_matches_reference_gradients(device):
    skip_without(device)
    hidden, idx, gates, t = make_inputs(64, 2, 40, torch.float32, torch.int32, "random", device)
    grad = torch.randn(t, 40, device=device)
    h1, g1 = hidden.clone().requires_grad_(), gates.clone().requires_grad_()
    OP(h1, idx, g1, t).backward(grad)
    h2, g2 = hidden.double().requires_grad_(), gates.double().requires_grad_()
    reference(h2, idx, g2, t).backward(grad.double())
    assert_matches(h1.grad, h2.grad, torch.float32)
    assert_matches(g1.grad, g2.grad, torch.float32)


BAD = [
    # (what, mutate(hidden, idx, gates, t) -> args, exception, words in the message)
    ("hidden rank", lambda h, i, g, t: (h[0], i, g, t), ValueError, "expert_hidden"),
    ("idx length", lambda h, i, g, t: (h, i[:-1], g, t), ValueError, "token_idx"),
    ("gates shape", lambda h, i, g, t: (h, i, g[:, None], t), ValueError, "gates"),
    ("float idx", lambda h, i, g, t: (h, i.float(), g, t), TypeError, "token_idx"),
    ("gates dtype", lambda h, i, g, t: (h, i, g.double(), t), TypeError, "gates"),
    ("int hidden", lambda h, i, g, t: (h.int(), i, g, t), TypeError, "expert_hidden"),
    ("negative T", lambda h, i, g, t: (h, i, g, -1), ValueError, "num_tokens"),
    ("idx too big", lambda h, i, g, t: (h, torch.where(i == 0, t, i), g, t), IndexError, "token_idx"),
    ("idx negative", lambda h, i, g, t: (h, torch.where(i == 1, -1, i), g, t), IndexError, "token_idx"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("what,mutate,exc,word", BAD, ids=[b[0] for b in BAD])
def test_bad_input(device, impl, what, mutate, exc, word):
    """Every implementation raises the same exception type, naming the argument. CUDA
    checks index values only in checked mode (it would have to synchronise)."""
    skip_without(device)
    args = mutate(*make_inputs(8, 2, 4, torch.float32, torch.int64, "random", device))
    with opreg.check_indices(), pytest.raises(exc, match=word):
        run(impl, device, *args)


@pytest.mark.cuda
def test_device_mismatch():
    skip_without("cuda")
    hidden, idx, gates, t = make_inputs(8, 2, 4, torch.float32, torch.int64, "random", "cuda")
    with pytest.raises(ValueError, match="token_idx"):
        OP(hidden, idx.cpu(), gates, t)


@pytest.mark.cuda
def test_cuda_checked_mode_and_no_oob_write():
    skip_without("cuda")
    hidden, idx, gates, t = make_inputs(64, 2, 16, torch.float32, torch.int32, "random", "cuda")
    bad = idx.clone()
    bad[3] = t + 5
    bad[7] = -2
    with opreg.check_indices(), pytest.raises(IndexError, match="token_idx"):
        OP(hidden, bad, gates, t)
        torch.cuda.synchronize()
    # Unchecked: out-of-range rows are skipped, everything else is right.
    keep = (bad >= 0) & (bad < t)
    out = OP(hidden, bad, gates, t)
    assert_matches(out, expected(hidden[keep], bad[keep], gates[keep], t), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1536, 2, 128), (256, 8, 1000)], ids=str)
def test_cuda_graph_capture(shape):
    skip_without("cuda")
    args = make_inputs(*shape, torch.bfloat16, torch.int32, "expert", "cuda")
    eager = OP(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OP(*args)  # warm-up off the capture (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = OP(*args)
    new = make_inputs(*shape, torch.bfloat16, torch.int32, "expert", "cuda")
    for dst, src in zip(args[:3], new[:3]):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, OP(*args))
    assert not torch.equal(captured, eager)
