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

from _util import (DEVICES, FLOAT_DTYPES, assert_matches, cuda_kernels, host_picks, set_requires_grad,
                   skip_without)

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
# CUDA forward paths give the same bits (backends/cuda/scatter_combine*.cu): the small
# one-launch path (N <= 8192); the large path in each of its forms (OPREG_SCATTER_COMBINE_LARGE
# forces one): the local kernel (lists in each block's shared memory, the default for short
# token_idx), one cooperative kernel (the default otherwise) and the multi-kernel fallback,
# each with a lane, short-row (16-byte vectors, H * itemsize <= 1 KB: several tokens per
# warp) or wide-row reduce. A token's sum depends only on its own rows, and a column only on
# its own column, so the same sums can be routed through each path: (a) the short-row call
# against the first H columns of a wide-row call on [x | more columns]; (b) a few tokens'
# rows, kept in row order, alone in a small call; (c) the same call with each form forced.
# Inputs are fresh random numbers, outputs land on NaN-poisoned memory, and the routing
# covers empty tokens, out-of-range indices (ignored), a token with 9..1024 rows (overflow
# list) and one with > 1024 rows (row walk).

LARGE_PATH_ENV = "OPREG_SCATTER_COMBINE_LARGE"


def _routing(t: int, fanout: int, order: str, idx_dtype: torch.dtype):
    idx = torch.arange(t).repeat_interleave(fanout)
    idx[idx == 3] = 1          # token 3 empty, token 1 has 2 * fanout rows
    idx[idx == 4] = 2
    idx[idx == 5] = 2
    idx[100:120] = 2           # token 2: 3 * fanout + ~20 rows: the overflow list
    idx[torch.arange(idx.numel()) % 7 == 0] = 6   # token 6: > 1024 rows at >= 8192 rows
    idx[11], idx[12] = -1, t + 3                   # out of range: ignored
    if order == "random":
        idx = idx[torch.randperm(idx.numel())]
    return idx.to(idx_dtype)


def _wide_pad(dtype: torch.dtype) -> int:
    return 2048 // (torch.finfo(dtype).bits // 8) + 64   # > 1 KB of extra row: wide-row reduce


LARGE_FORMS = ("multi", "fused", "local")


def _form(form: str, x, idx, g, t, monkeypatch) -> torch.Tensor:
    """The large path forced into one form (the variable is read per call), on poisoned memory."""
    from opreg.testing.compare import poison
    with monkeypatch.context() as m:
        m.setenv(LARGE_PATH_ENV, form)
        poison(t * x.shape[1] * 8, "cuda")
        return OP(x, idx, g, t)


def _multi(x, idx, g, t, monkeypatch) -> torch.Tensor:
    """The large path's multi-kernel fallback."""
    return _form("multi", x, idx, g, t, monkeypatch)


def _check_large_call(x, idx, g, t, dtype, idx_dtype, monkeypatch) -> torch.Tensor:
    """One large-path call, checked against the float64 reference, itself (twice), each
    forced form, the call without out-of-range rows and the small path on a subset."""
    from opreg.testing.compare import poison
    h = x.shape[1]
    poison(t * h * 8, "cuda")
    out = OP(x, idx, g, t)
    assert torch.equal(out, OP(x, idx, g, t))                       # deterministic
    keep = (idx >= 0) & (idx < t)
    assert_matches(out, expected(x[keep], idx[keep], g[keep], t), dtype)
    assert (out[3] == 0).all() and (out[t - 1] != 0).any()         # empty token: zeros
    assert int((idx == 6).sum()) > 1024 and 8 < int((idx == 2).sum()) <= 1024
    # (c) every form of the large path
    for form in LARGE_FORMS:
        assert torch.equal(_form(form, x, idx, g, t, monkeypatch), out), form
    # out-of-range rows dropped: the same bits
    assert torch.equal(OP(x[keep], idx[keep], g[keep], t), out)
    # (b) the small path on a few tokens (row order kept), the long ones included
    sub = torch.tensor([0, 1, 2, 3, 6, t // 2, t - 1], device="cuda")
    rows = torch.isin(idx.long(), sub).nonzero().squeeze(1)
    remap = torch.searchsorted(sub, idx.long()[rows]).to(idx_dtype)
    poison(sub.numel() * h * 8, "cuda")
    assert torch.equal(OP(x[rows], remap, g[rows], sub.numel()), out[sub])
    return out


# Every short-row lane layout (hvec <= 8, 16, 32, 64 vectors), rows not a multiple of a
# warp's vectors (200), and 37: not a multiple of 16 bytes, the unvectorised (V = 1) path.
SHORT_H = [32, 37, 64, 128, 200, 256]


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["sorted", "random"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("h", SHORT_H)
@pytest.mark.parametrize("fanout", [1, 2, 8])
def test_cuda_short_rows_same_bits_as_every_path(fanout, h, dtype, idx_dtype, order, monkeypatch):
    skip_without("cuda")
    from opreg.testing.compare import poison
    t = 12288 // fanout + 1                     # >= 12288 rows: the large path
    idx = _routing(t, fanout, order, idx_dtype).cuda()
    n = idx.numel()
    x_wide = torch.randn(n, h + _wide_pad(dtype), dtype=dtype, device="cuda")
    x = x_wide[:, :h].contiguous()
    g = (torch.rand(n, device="cuda") + 0.1).to(dtype)
    out = _check_large_call(x, idx, g, t, dtype, idx_dtype, monkeypatch)
    # (a) the wide-row reduce on the same columns, each form
    poison(t * (h + _wide_pad(dtype)) * 8, "cuda")
    assert torch.equal(OP(x_wide, idx, g, t)[:, :h], out)
    for form in LARGE_FORMS:
        assert torch.equal(_form(form, x_wide, idx, g, t, monkeypatch)[:, :h], out), form


# Fan-out above kEll = 8 (12 here; Qwen3-Next routes a token to 10 experts): all tokens but the
# few _routing empties or moves have more than 8 rows, so the short-row reducer leaves nearly
# every token to its long-token pass, which spreads them over the grid's warps
# (scatter_combine_large.cu, reduce_long_tokens); the wide-row reducer sums them in its loop.
@pytest.mark.cuda
@pytest.mark.parametrize("order,idx_dtype", [("sorted", torch.int64), ("random", torch.int32)], ids=str)
@pytest.mark.parametrize("h,dtype", [(128, torch.bfloat16), (128, torch.float32), (256, torch.float16),
                                     (1024, torch.bfloat16)], ids=str)
def test_cuda_every_token_long_same_bits_as_every_path(h, dtype, order, idx_dtype, monkeypatch):
    skip_without("cuda")
    t = 12288 // 12 + 1
    idx = _routing(t, 12, order, idx_dtype).cuda()
    x = torch.randn(idx.numel(), h, dtype=dtype, device="cuda")
    g = (torch.rand(idx.numel(), device="cuda") + 0.1).to(dtype)
    counts = torch.bincount(idx[(idx >= 0) & (idx < t)].long(), minlength=t)
    assert int((counts > 8).sum()) >= t - 8   # all but the tokens _routing empties or moves
    _check_large_call(x, idx, g, t, dtype, idx_dtype, monkeypatch)


# Wide rows: 16-byte vectors (1024), more than one column chunk per token (4096), and
# rows that are not a multiple of 16 bytes (1001: V = 1).
@pytest.mark.cuda
@pytest.mark.parametrize("order,idx_dtype", [("sorted", torch.int64), ("random", torch.int32)], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("h", [1001, 1024, 4096])
@pytest.mark.parametrize("fanout", [1, 2, 8])
def test_cuda_wide_rows_same_bits_as_every_path(fanout, h, dtype, order, idx_dtype, monkeypatch):
    skip_without("cuda")
    t = 9216 // fanout + 1                      # >= 9216 rows: the large path
    idx = _routing(t, fanout, order, idx_dtype).cuda()
    n = idx.numel()
    x = torch.randn(n, h, dtype=dtype, device="cuda")
    g = (torch.rand(n, device="cuda") + 0.1).to(dtype)
    _check_large_call(x, idx, g, t, dtype, idx_dtype, monkeypatch)


# token_idx not 16-byte aligned (a slice one element into its buffer) and of a length that is not
# a multiple of 4: the large path's forms read it row by row where vector loads would be
# misaligned; the same bits as the same indices in a buffer of their own.
@pytest.mark.cuda
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("t,fanout,h,dtype", [(4099, 2, 128, torch.bfloat16), (8195, 1, 1024, torch.float32)],
                         ids=str)
def test_cuda_large_path_unaligned_index_same_bits(t, fanout, h, dtype, idx_dtype, monkeypatch):
    skip_without("cuda")
    # 8198 and 8195 rows (_routing's long token needs > 7168), neither a multiple of 4
    idx = _routing(t, fanout, "random", idx_dtype).cuda()
    n = idx.numel()
    x = torch.randn(n, h, dtype=dtype, device="cuda")
    g = (torch.rand(n, device="cuda") + 0.1).to(dtype)
    buf = torch.empty(n + 1, dtype=idx_dtype, device="cuda")
    buf[1:] = idx
    unaligned = buf[1:]
    assert unaligned.data_ptr() % 16 != 0 and idx.data_ptr() % 16 == 0
    with monkeypatch.context() as m:
        m.setenv(PATH_ENV, "large")
        out = _check_large_call(x, idx, g, t, dtype, idx_dtype, monkeypatch)
        for form in LARGE_FORMS:
            assert torch.equal(_form(form, x, unaligned, g, t, monkeypatch), out), form


@pytest.mark.cuda
@pytest.mark.parametrize("path", LARGE_FORMS)
@pytest.mark.parametrize("h,dtype", [(128, torch.bfloat16), (1000, torch.float32)], ids=str)
def test_cuda_graph_capture_large_path(path, h, dtype, monkeypatch):
    """The large path captured in a CUDA graph in each form (the fused one is a cooperative
    launch), with the overflow phases live (tokens with > 8 and > 1024 rows); the replay
    reads new indices, rows and gates written in place, bit for bit what eager calls of the
    form and of the multi-kernel fallback give."""
    skip_without("cuda")
    monkeypatch.setenv(LARGE_PATH_ENV, path)
    t = 6145

    def inputs():
        idx = _routing(t, 2, "random", torch.int32).cuda()
        return (torch.randn(idx.numel(), h, dtype=dtype, device="cuda"), idx,
                (torch.rand(idx.numel(), device="cuda") + 0.1).to(dtype), t)

    args = inputs()
    eager = OP(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        OP(*args)  # warm-up off the capture (allocator, lazy init, occupancy queries)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = OP(*args)
    torch.cuda.synchronize()
    for _ in range(2):
        new = inputs()
        for dst, src in zip(args[:3], new[:3]):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, OP(*args))
        assert torch.equal(captured, _multi(*args, monkeypatch))
        assert not torch.equal(captured, eager)


def _kernels(args, env: dict[str, str | None], monkeypatch) -> list[str]:
    """The CUDA kernels one call of the op launches, with ``env``'s variables set (None: as is)."""
    with monkeypatch.context() as m:
        for var, value in env.items():
            if value is not None:
                m.setenv(var, value)
        return cuda_kernels(lambda: OP(*args))


def _only(names: list[str], kernel: str) -> None:
    assert len(names) == 1 and kernel in names[0], (kernel, names)


@pytest.mark.cuda
def test_cuda_large_path_is_one_launch(monkeypatch):
    """The large path is one kernel: the local one while token_idx is at most 64 KB and
    there are at least 4 tokens an SM (scatter_combine_large.cu, launch_local), the fused
    cooperative one otherwise, and either where forced (OPREG_SCATTER_COMBINE_LARGE); the
    forced fallback launches its memset, count, scan, place and reduce kernels. A forced local
    form the local kernel cannot take (more than 1024 tokens a block; rows past its shared
    memory) runs the fused kernel."""
    skip_without("cuda")

    def device_ops(args, form: str | None) -> list[str]:
        return _kernels(args, {LARGE_PATH_ENV: form}, monkeypatch)

    only = _only
    short = make_inputs(4096, 1, 128, torch.bfloat16, torch.int32, "random", "cuda")  # 16 KB of int32
    only(device_ops(short, None), "scatter_large_local_kernel")
    only(device_ops(short, "fused"), "scatter_large_fused_kernel")
    only(device_ops(short, "local"), "scatter_large_local_kernel")
    for at_bound in (make_inputs(8192, 1, 128, torch.bfloat16, torch.int64, "random", "cuda"),  # 64 KB
                     make_inputs(16384, 1, 128, torch.bfloat16, torch.int32, "random", "cuda")):  # 64 KB
        only(device_ops(at_bound, None), "scatter_large_local_kernel")
    longer = make_inputs(8192, 2, 128, torch.bfloat16, torch.int64, "random", "cuda")  # 128 KB
    only(device_ops(longer, None), "scatter_large_fused_kernel")
    only(device_ops(longer, "local"), "scatter_large_local_kernel")
    # 128 KB of int32 is 32768 rows: the overflow area alone (4 bytes a row) plus the lane
    # reducer's 24 warps of sort scratch pass a block's 227 KB, so only the default is pinned
    only(device_ops(make_inputs(16384, 2, 128, torch.bfloat16, torch.int32, "random", "cuda"), None),
         "scatter_large_fused_kernel")
    # fewer tokens than 4 an SM (the large path forced): blocks of 4 tokens would leave SMs idle
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    few = make_inputs(2 * sms, 8, 4096, torch.bfloat16, torch.int32, "random", "cuda")
    with monkeypatch.context() as m:
        m.setenv(PATH_ENV, "large")
        only(device_ops(few, None), "scatter_large_fused_kernel")
        only(device_ops(few, "local"), "scatter_large_local_kernel")
    multi = device_ops(short, "multi")
    assert not any("scatter_large" in k and "kernel" in k for k in multi), multi
    for name in ("count_kernel", "scan_kernel", "place_kernel", "scatter_reduce_kernel"):
        assert any(name in k for k in multi), (name, multi)
    x, idx, g, _ = make_inputs(1024, 8, 128, torch.bfloat16, torch.int32, "random", "cuda")
    only(device_ops((x, idx, g, sms * 1024 + 1), "local"), "scatter_large_fused_kernel")
    only(device_ops(make_inputs(32768, 2, 64, torch.bfloat16, torch.int32, "random", "cuda"), "local"),
         "scatter_large_fused_kernel")


# The one-launch paths (backends/cuda/scatter_combine_tiny.cu: a warp per token, each reading
# all of token_idx in 16-byte loads; scatter_combine_small.cu: 8 tokens a block) against the
# large path, each forced (OPREG_SCATTER_COMBINE_PATH, read per call) on the same call: the
# same bits, and float64's values. Rows past a batch of 1024 int32 / 512 int64 indices and a
# count not a multiple of 4 (the tail read one by one), empty tokens, out-of-range indices,
# a token with more rows than the tiny kernel sums at a time; and token_idx not 16-byte
# aligned (a slice), where the tiny path is not taken.
PATH_ENV = "OPREG_SCATTER_COMBINE_PATH"


def _forced(path: str, args, monkeypatch) -> torch.Tensor:
    from opreg.testing.compare import poison
    with monkeypatch.context() as m:
        m.setenv(PATH_ENV, path)
        x, idx, g, t = args
        poison(t * x.shape[1] * 8, "cuda")
        return OP(x, idx, g, t)


@pytest.mark.cuda
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("t,fanout,h", [(1, 1, 128), (7, 3, 37), (1536, 2, 128), (300, 7, 1000),
                                        (64, 8, 4096)], ids=str)
def test_cuda_one_launch_paths_same_bits(t, fanout, h, dtype, idx_dtype, monkeypatch):
    skip_without("cuda")
    idx = torch.arange(t).repeat_interleave(fanout)
    if t > 6:
        idx[idx == 3] = 1                          # token 3 empty, token 1 with 2 x fanout rows
        idx[torch.arange(idx.numel()) % 5 == 0] = 6  # token 6: a fifth of all rows
        idx[1], idx[2] = -1, t + 3                 # out of range: ignored
    idx = idx[torch.randperm(idx.numel())].to(idx_dtype).cuda()
    n = idx.numel()
    x = torch.randn(n, h, dtype=dtype, device="cuda")
    g = (torch.rand(n, device="cuda") + 0.1).to(dtype)
    args = (x, idx, g, t)
    tiny = _forced("tiny", args, monkeypatch)
    keep = (idx >= 0) & (idx < t)
    assert_matches(tiny, expected(x[keep], idx[keep], g[keep], t), dtype)
    assert torch.equal(_forced("tiny", args, monkeypatch), tiny)
    if n <= 8192:
        assert torch.equal(_forced("small", args, monkeypatch), tiny)
    assert torch.equal(_forced("large", args, monkeypatch), tiny)
    # token_idx one element into a buffer: not 16-byte aligned, the tiny path declines
    buf = torch.empty(n + 1, dtype=idx_dtype, device="cuda")
    buf[1:] = idx
    assert torch.equal(_forced("tiny", (x, buf[1:], g, t), monkeypatch), tiny)


@pytest.mark.cuda
@pytest.mark.parametrize("var,value,t", [(PATH_ENV, "tinny", 64), (LARGE_PATH_ENV, "fussed", 8192)])
def test_cuda_path_override_rejects_unknown(var, value, t, monkeypatch):
    """A misspelt OPREG_SCATTER_COMBINE_PATH (read on every call) or OPREG_SCATTER_COMBINE_LARGE
    (read on the large path's calls) is an error naming it, not the sizes' choice."""
    skip_without("cuda")
    monkeypatch.setenv(var, value)
    x, idx, g, t = make_inputs(t, 2, 16, torch.float32, torch.int32, "random", "cuda")
    with pytest.raises(ValueError, match=var):
        OP(x, idx, g, t)


@pytest.mark.cuda
def test_cuda_forward_path_kernels(monkeypatch):
    """Which kernel each choice launches (so the same-bits test above compares paths that
    really ran): the sizes pick the tiny kernel at T16 k2 H128 and the large path's local
    kernel at the seeds' T1536 k2 H128 (>= 4 tokens an SM); each forced path runs its own
    kernel; a misaligned token_idx sends a forced tiny call to the small kernel."""
    skip_without("cuda")

    def kernels(args, path: str | None) -> list[str]:
        return _kernels(args, {PATH_ENV: path}, monkeypatch)

    only = _only
    few = make_inputs(16, 2, 128, torch.float32, torch.int32, "random", "cuda")
    seeds = make_inputs(1536, 2, 128, torch.float32, torch.int32, "random", "cuda")
    only(kernels(few, None), "scatter_tiny_kernel")
    only(kernels(seeds, None), "scatter_large_local_kernel")
    for path, kernel in (("tiny", "scatter_tiny_kernel"), ("small", "scatter_small_kernel"),
                         ("large", "scatter_large_local_kernel")):
        only(kernels(seeds, path), kernel)
    x, idx, g, t = few
    buf = torch.empty(idx.numel() + 1, dtype=idx.dtype, device="cuda")
    buf[1:] = idx
    only(kernels((x, buf[1:], g, t), "tiny"), "scatter_small_kernel")
    # the tiny kernel up to 2^20 index reads in at most 1024 warps (T256 k8 H128), not past
    # 1024 warps (T256 k1 H4096 bf16: 2048, too few tokens for the local form: the small kernel):
    # backends/common/scatter_combine_paths.h
    only(kernels(make_inputs(256, 8, 128, torch.float32, torch.int32, "random", "cuda"), None),
         "scatter_tiny_kernel")
    only(kernels(make_inputs(256, 1, 4096, torch.bfloat16, torch.int32, "random", "cuda"), None),
         "scatter_small_kernel")


def _path_picks(shapes: list[tuple[int, ...]], env: dict[str, str], tmp_path) -> list[str]:
    """backends/common/scatter_combine_paths.h's forward paths for (T, k, H, element bytes[,
    index bytes: 4 unless given]) shapes, through tests/cpp's harness compiled here."""
    lines = "".join(" ".join(map(str, s)) + "\n" for s in shapes)
    return host_picks("scatter_combine_picks.cpp", lines, PATH_ENV, env, tmp_path)


def test_forward_path_picks(tmp_path):
    """The forward's choice where both GPUs measured each path forced in CUDA graphs
    (bench/scatter_paths.py; scatter_combine_paths.h has the figures), so that a change to the
    bounds shows here, without a GPU."""
    shapes = {
        (16, 8, 128, 2): "tiny",      # few tokens: 3.6 us against the small path's 4.8 (H200)
        (256, 8, 128, 4): "tiny",     # 2^19 reads, 256 warps: 3.85 against 4.58 (H100)
        (1024, 1, 128, 2): "tiny",    # 2^20 reads, 1024 warps: 2.62 against 3.30 (H100)
        (256, 1, 4096, 2): "small",   # 2048 warps: the tiny path 4.19 against 3.65 (H200)
        (512, 4, 1024, 4): "small",   # 2^21 reads; 512 tokens, < 4 an SM: no local form
        # >= 4 tokens an SM: the local form, not the small path (H100: T1024 k2 H1024 fp32 4.62
        # us against 4.72, the tiny path 5.83; the seeds' size 3.06 against 3.90, the tiny 4.37)
        (1024, 2, 1024, 4): "large local",
        (1536, 2, 128, 4): "large local",
        # the large path's local form: token_idx <= 64 KB and >= 4 tokens an SM (H100, each form
        # forced: T4096 k1 H128 fp32 3.3 us against the fused kernel's 6.0, the small path's 8.4)
        (4096, 1, 128, 4): "large local",
        (4096, 2, 1024, 2): "large local",   # 32 KB of int32: 7.7 us against the fused kernel's 11.4
        (16384, 1, 1024, 2): "large local",  # 64 KB: 30.1 us against the fused kernel's 33.7
        (8192, 4, 1024, 2): "large fused",   # 128 KB: local / fused 1.08-2.24 before the 16-byte scan
        (4096, 8, 128, 2): "large fused",    # N = 32768 > the small path's 8192 rows; 128 KB: 10.5 / 8.6
        (8192, 1, 128, 2, 8): "large local",  # the bound is in bytes: 64 KB of int64
        (8192, 2, 128, 2, 8): "large fused",  # 128 KB of int64
        (16, 1, 12, 2): "tiny",       # rows of 24 bytes (no 16-byte vectors): one chunk
    }
    assert _path_picks(list(shapes), {}, tmp_path) == list(shapes.values())
    # forced where the path can take the call; a forced small call past 8192 rows runs large
    forced = _path_picks([(1536, 2, 128, 4), (4096, 8, 128, 2)], {PATH_ENV: "tiny"}, tmp_path)
    assert forced == ["tiny", "tiny"]
    assert _path_picks([(16, 8, 128, 2), (4096, 8, 128, 2)], {PATH_ENV: "small"}, tmp_path) == \
        ["small", "large fused"]
    # forced large at 16 tokens: too few for a local block on every SM
    assert _path_picks([(16, 8, 128, 2), (1536, 2, 128, 4)], {PATH_ENV: "large"}, tmp_path) == \
        ["large fused", "large local"]
