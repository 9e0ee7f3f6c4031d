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

from _util import DEVICES, assert_matches, poison, set_requires_grad, skip_without

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


# ---------------------------------------------------------------------------------------
# The CUDA token-block kernels (backends/cuda/scatter_combine_tokens.cuh): every path forced
# through OPREG_SCATTER_COMBINE_PATH (forward: scan, map; backward: scan, rows) and the
# automatic choice, on the shapes that pick their code paths: short rows several to a warp
# (H <= 256: lane groups of 1..16 lanes), H not a multiple of 16 bytes and misaligned
# storage (the register path instead of the cp.async ring), one row per token (k = 1), token
# lists longer than the rank sort takes or than a block's shared memory holds (the rescan),
# more tokens than one round of the resident clusters, indices outside [0, T). Each result
# against the float64 reference, poisoned outputs, two calls bit-identical, and every path
# bit-identical to the others (one FMA chain per element in row order; one dot-product order).

BWD = torch.ops.opreg.scatter_combine_backward.default
PATH_ENV = "OPREG_SCATTER_COMBINE_PATH"
CUDA_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# (tokens, fanout, H): lane groups of 2 (bf16 H128), 1 (H8, fp32 H16), odd widths (V = 1),
# long rows (several column chunks per token), k = 1.
TOKEN_SHAPES = [(300, 2, 8), (257, 3, 64), (1000, 1, 128), (200, 8, 128), (129, 4, 256), (64, 3, 130),
                (50, 2, 7), (33, 5, 1), (40, 2, 4096), (17, 8, 1000), (512, 1, 2048)]


def _expected_backward(go, h, idx, g):
    """float64 gradients of scatter_combine; rows with an index outside [0, T) get zeros."""
    t = go.shape[0]
    valid = (idx >= 0) & (idx < t)
    gy = go.double()[idx.long().clamp(0, max(t - 1, 0))] * valid[:, None]
    return gy * g.double()[:, None], (gy * h.double()).sum(-1)


def _on_each_path(monkeypatch, paths, call):
    """{path: call()} with each path forced, and "auto" with none."""
    out = {}
    for path in paths:
        monkeypatch.setenv(PATH_ENV, path)
        out[path] = call()
    monkeypatch.delenv(PATH_ENV, raising=False)
    out["auto"] = call()
    return out


def _check_forward(monkeypatch, args, dtype, paths=("scan", "map")):
    """Every forward path: the float64 reference on poisoned memory, the same bits twice,
    the same bits as each other."""
    hidden, idx, gates, t = args
    keep = (idx >= 0) & (idx < t)
    want = expected(hidden[keep], idx[keep], gates[keep], t)

    def call():
        poison(max(want.numel(), 1) * dtype.itemsize, "cuda")
        first = OP(hidden, idx, gates, t)
        assert_matches(first, want, dtype)
        assert torch.equal(first, OP(hidden, idx, gates, t)), "two calls differ"
        return first

    outs = _on_each_path(monkeypatch, paths, call)
    base = outs["auto"]
    for path, got in outs.items():
        assert torch.equal(got, base), f"path {path} differs from auto"
    return base


def _check_backward(monkeypatch, args, dtype, paths=("scan", "rows")):
    hidden, idx, gates, t = args
    go = torch.randn(t, hidden.shape[1], dtype=dtype, device="cuda")
    want_h, want_g = _expected_backward(go, hidden, idx, gates)

    def call():
        poison(max(want_h.numel(), 1) * dtype.itemsize, "cuda")
        gh, gg = BWD(go, hidden, idx, gates)
        assert_matches(gh, want_h, dtype)
        assert_matches(gg, want_g, gates.dtype)
        gh2, gg2 = BWD(go, hidden, idx, gates)
        assert torch.equal(gh, gh2) and torch.equal(gg, gg2), "two calls differ"
        return gh, gg

    outs = _on_each_path(monkeypatch, paths, call)
    for path, (gh, gg) in outs.items():
        assert torch.equal(gh, outs["auto"][0]) and torch.equal(gg, outs["auto"][1]), f"path {path} differs"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_token_paths_forward(monkeypatch, dtype):
    skip_without("cuda")
    torch.manual_seed(0)
    for shape in TOKEN_SHAPES:
        for order in ("random", "token", "uneven", "expert"):
            for idx_dtype in (torch.int32, torch.int64):
                args = make_inputs(*shape, dtype, idx_dtype, order, "cuda")
                try:
                    _check_forward(monkeypatch, args, dtype)
                except AssertionError as e:
                    raise AssertionError(f"{shape} {order} {idx_dtype}: {e}") from None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
def test_cuda_token_paths_backward(monkeypatch, dtype):
    skip_without("cuda")
    torch.manual_seed(1)
    for shape in TOKEN_SHAPES:
        for order in ("random", "token", "uneven"):
            for idx_dtype in (torch.int32, torch.int64):
                args = make_inputs(*shape, dtype, idx_dtype, order, "cuda")
                try:
                    _check_backward(monkeypatch, args, dtype)
                except AssertionError as e:
                    raise AssertionError(f"{shape} {order} {idx_dtype}: {e}") from None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_fp32_gates(monkeypatch, dtype):
    skip_without("cuda")
    for shape in [(300, 2, 128), (40, 8, 1024)]:
        args = make_inputs(*shape, dtype, torch.int32, "random", "cuda", gates_dtype=torch.float32)
        _check_forward(monkeypatch, args, dtype)
        _check_backward(monkeypatch, args, dtype)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values one element into a larger buffer: not 16-byte aligned."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(300, 2, 128), (64, 4, 1024), (1000, 1, 64)], ids=str)
def test_cuda_misaligned_storage(monkeypatch, dtype, shape):
    """Storage offsets: misaligned rows take the register path, a misaligned token_idx the
    scalar scan. The forward's bits are the aligned call's (the same chain per element),
    and so are grad_x's; grad_gates sums its dot product over other lane groups (scalars,
    not 16-byte vectors), so only its tolerance holds."""
    skip_without("cuda")
    hidden, idx, gates, t = make_inputs(*shape, dtype, torch.int64, "random", "cuda")
    go = torch.randn(t, hidden.shape[1], dtype=dtype, device="cuda")
    aligned = OP(hidden, idx, gates, t)
    grads = BWD(go, hidden, idx, gates)
    for h2, i2, g2 in [(_misaligned(hidden), idx, gates), (hidden, _misaligned(idx), gates),
                       (hidden, idx, _misaligned(gates)), (_misaligned(hidden), _misaligned(idx), gates)]:
        got = _check_forward(monkeypatch, (h2, i2, g2, t), dtype)
        assert torch.equal(got, aligned)
        _check_backward(monkeypatch, (h2, i2, g2, t), dtype)
        gh, gg = BWD(_misaligned(go), h2, i2, g2)
        assert torch.equal(gh, grads[0])
        assert_matches(gg, _expected_backward(go, hidden, idx, gates)[1], gates.dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_heavy_and_overflowing_tokens(monkeypatch, dtype):
    """Token lists past the rank sort (> 1024 rows), past a block's shared memory (~9800
    entries: the whole list dropped, the token rescanned) and past the map's 8-row table
    (its overflow CSR), beside ordinary tokens."""
    skip_without("cuda")
    g = torch.Generator().manual_seed(3)
    for t, heavy_rows, h in [(64, 3000, 64), (3, 15000, 16), (512, 40, 128)]:
        normal = torch.randint(0, t, (4 * t,), generator=g)
        heavy = torch.full((heavy_rows,), t // 2, dtype=torch.long)
        idx = torch.cat([normal, heavy])[torch.randperm(4 * t + heavy_rows, generator=g)]
        n = idx.numel()
        hidden = torch.randn(n, h, generator=g).to(dtype).cuda()
        gates = (torch.rand(n, generator=g) + 0.1).to(dtype).cuda()
        for idx_dtype in (torch.int32, torch.int64):
            args = (hidden, idx.to(idx_dtype).cuda(), gates, t)
            _check_forward(monkeypatch, args, dtype)
            _check_backward(monkeypatch, args, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_many_rounds(monkeypatch, dtype):
    """More tokens than the resident clusters take in one round at 16 rows per token
    (tb ~486 tokens per block): the clusters loop, and the lists are reset between rounds."""
    skip_without("cuda")
    args = make_inputs(70000, 16, 16 // dtype.itemsize, dtype, torch.int32, "expert", "cuda")
    _check_forward(monkeypatch, args, dtype)
    _check_backward(monkeypatch, args, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_out_of_range_rows(monkeypatch, dtype):
    """Unchecked indices outside [0, T): forward skips their rows, backward zeroes them
    (in both backward paths), on poisoned memory."""
    skip_without("cuda")
    for shape in [(64, 2, 16), (300, 3, 130), (40, 8, 2048)]:
        hidden, idx, gates, t = make_inputs(*shape, dtype, torch.int64, "random", "cuda")
        bad = idx.clone()
        bad[::7] = t + 3
        bad[3::11] = -1
        _check_forward(monkeypatch, (hidden, bad, gates, t), dtype)
        _check_backward(monkeypatch, (hidden, bad, gates, t), dtype)
        every = torch.full_like(idx, -5)  # no row valid: zeros everywhere
        _check_forward(monkeypatch, (hidden, every, gates, t), dtype)
        _check_backward(monkeypatch, (hidden, every, gates, t), dtype)


@pytest.mark.cuda
def test_cuda_empty_shapes(monkeypatch):
    skip_without("cuda")
    hidden, idx, gates, _ = make_inputs(8, 2, 16, torch.float32, torch.int32, "random", "cuda")
    for path in ("scan", "map", "rows"):
        monkeypatch.setenv(PATH_ENV, path)
        assert OP(hidden, idx, gates, 0).shape == (0, 16)  # no tokens
        assert torch.equal(OP(hidden[:0], idx[:0], gates[:0], 5), torch.zeros(5, 16, device="cuda"))
        assert OP(hidden[:, :0], idx, gates, 8).shape == (8, 0)
        gh, gg = BWD(torch.randn(0, 16, device="cuda"), hidden, idx, gates)  # every row out of range
        assert torch.equal(gh, torch.zeros_like(hidden)) and torch.equal(gg, torch.zeros_like(gates))
        gh, gg = BWD(torch.randn(8, 0, device="cuda"), hidden[:, :0], idx, gates)
        assert gh.shape == (16, 0) and torch.equal(gg, torch.zeros_like(gates))


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["scan", "map", "rows"])
def test_cuda_graph_capture_each_path(monkeypatch, path):
    """Each path (a cluster launch; the map's memset and kernels) captured and replayed
    with new indices, bit for bit an eager call; the backward too."""
    skip_without("cuda")
    monkeypatch.setenv(PATH_ENV, path)
    args = make_inputs(1536, 2, 128, torch.bfloat16, torch.int32, "expert", "cuda")
    go = torch.randn(1536, 128, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OP(*args)
        BWD(go, *args[:3])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = OP(*args)
        gh, gg = BWD(go, *args[:3])
    new = make_inputs(1536, 2, 128, torch.bfloat16, torch.int32, "expert", "cuda")
    for dst, src in zip(args[:3], new[:3]):
        dst.copy_(src)
    go.copy_(torch.randn_like(go))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, OP(*args))
    want = BWD(go, *args[:3])
    assert torch.equal(gh, want[0]) and torch.equal(gg, want[1])
