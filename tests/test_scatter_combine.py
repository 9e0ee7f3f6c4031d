"""scatter_combine: its samples and bad-input table, run through the generic harness
(:mod:`opreg.testing`: every implementation against the float64 reference, gradients,
gradcheck, opcheck, determinism, bad-input parity, CUDA graphs), then what is specific to
this op: autograd kind, CUDA device mismatch, checked mode, graphs with new indices."""
from __future__ import annotations

import pytest
import torch

import opreg
from opreg.ops.scatter_combine import reference
from opreg.testing import OpTestSuite, Sample

from _util import DEVICES, assert_matches, set_requires_grad, skip_without

OP = torch.ops.opreg.scatter_combine.default


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


SHAPES = [(7, 2, 5), (64, 3, 130), (300, 1, 64), (33, 8, 8)]  # (tokens, fanout, H)
ORDERS = ["token", "random", "expert", "uneven"]


def non_contiguous(dtype: torch.dtype, device: str):
    """Strided hidden rows, strided idx and gates."""
    hidden, idx, gates, t = make_inputs(50, 2, 32, dtype, torch.int64, "random", device)
    wide = torch.randn(hidden.shape[0], 64, dtype=dtype, device=device)[:, ::2]
    idx2 = torch.stack([idx, idx], 1)[:, 0]
    gates2 = torch.stack([gates, gates], 1)[:, 1]
    assert not (wide.is_contiguous() or idx2.is_contiguous() or gates2.is_contiguous())
    return wide, idx2, gates2, t


def sample_inputs(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """Every shape x order x index dtype; fp32 gates with half hidden; strided inputs;
    no rows (tokens get zeros); a large uneven one (CPU threads, determinism)."""
    def s(name: str, args: tuple) -> Sample:
        return Sample(set_requires_grad(args, requires_grad), name)

    for shape in SHAPES:
        for order in ORDERS:
            for idx_dtype in (torch.int32, torch.int64):
                yield s(f"{shape} {order}", make_inputs(*shape, dtype, idx_dtype, order, device))
    if dtype in (torch.float16, torch.bfloat16):
        yield s("fp32 gates", make_inputs(40, 2, 24, dtype, torch.int64, "random", device,
                                          gates_dtype=torch.float32))
    yield s("non-contiguous", non_contiguous(dtype, device))
    h, i, g, _ = make_inputs(50, 2, 32, dtype, torch.int64, "random", device)
    yield s("no rows", (h[:0], i[:0], g[:0], 5))
    yield s("large uneven", make_inputs(512, 4, 96, dtype, torch.int32, "uneven", device))


def small_samples(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """For gradcheck and opcheck: both index dtypes, uneven destinations, no rows."""
    for idx_dtype in (torch.int32, torch.int64):
        args = make_inputs(9, 2, 6, dtype, idx_dtype, "random", device)
        yield Sample(set_requires_grad(args, requires_grad), f"random {idx_dtype}")
    args = make_inputs(6, 3, 4, dtype, torch.int64, "uneven", device)
    yield Sample(set_requires_grad(args, requires_grad), "uneven")
    h, i, g, _ = make_inputs(4, 2, 3, dtype, torch.int64, "random", device)
    yield Sample(set_requires_grad((h[:0], i[:0], g[:0], 5), requires_grad), "no rows")


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

# CUDA checks index values only in checked mode (it would have to synchronise).
SUITE = OpTestSuite(
    "scatter_combine", sample_inputs, small_samples=small_samples, bad=BAD, bad_context=opreg.check_indices,
    bad_sample=lambda device: make_inputs(8, 2, 4, torch.float32, torch.int64, "random", device),
    # The C++ kernels and the reference give the same bits whatever the CPU thread count
    # (the reference sums with index_add_ on the CPU: its index_put_(accumulate=True) adds
    # in a varying order, 2 results in 20 calls at 2048 rows x 96 into 512 tokens).
    thread_invariant=("default", "cpu", "reference"))
globals().update(SUITE.pytest_tests(devices=("cpu", "cuda"), device_marks={"cuda": [pytest.mark.cuda]}))


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_is_the_ops_own(device):
    skip_without(device)
    hidden, idx, gates, t = make_inputs(6, 3, 4, torch.float32, torch.int64, "uneven", device)
    OP(hidden.requires_grad_(), idx, gates, t).sum().backward()
    assert opreg.autograd_kind("scatter_combine") in ("cpp", "python")


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
def test_cuda_graph_capture_new_indices(shape):
    """Model-sized, expert-ordered bf16: the replay reads new indices too (the generic
    graph check only rescales float inputs), bit for bit what an eager call gives."""
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
