"""cat_linear and cat_linear_stacked: their samples and bad-input tables, run through
the generic harness (:mod:`opreg.testing`: every implementation against the float64
reference, gradients, gradcheck, opcheck, determinism, bad-input parity, CUDA graphs), then
what is specific: the no-autograd-node fast path, CUDA device mismatch, both CUDA paths."""
from __future__ import annotations

import pytest
import torch

from opreg.ops.cat_linear import reference, reference_stacked
from opreg.testing import OpTestSuite, Sample

from _util import (DEVICES, FLOAT_DTYPES, assert_matches, cuda_kernels, host_picks, poison, set_requires_grad,
                   skip_without)

OP = torch.ops.opreg.cat_linear.default
STACKED = torch.ops.opreg.cat_linear_stacked.default
MARKS = {"cuda": [pytest.mark.cuda]}


def make_inputs(lead: tuple[int, ...], widths: list[int], k: int, dtype: torch.dtype,
                device: str, bias: bool = True):
    parts = [torch.randn(*lead, w, dtype=dtype, device=device) for w in widths]
    weight = torch.randn(k, sum(widths), dtype=dtype, device=device) / sum(widths) ** 0.5
    b = torch.randn(k, dtype=dtype, device=device) if bias else None
    return parts, weight, b


SHAPES = [((12,), [32] * 4, 56), ((3, 5), [7, 1, 16], 9), ((), [3, 5], 4), ((64,), [256] * 4, 100),
          ((3, 2), [4, 5, 3], 6), ((2, 3), [2, 3, 1], 4),
          ((0,), [4, 4], 3), ((4,), [0, 0], 3)]  # no rows; zero-width parts (y = bias)


def non_contiguous(dtype: torch.dtype, device: str):
    """Strided slices of one tensor as parts, a transposed-contiguous weight."""
    x = torch.randn(4, 16, 12, dtype=dtype, device=device)
    parts = [x[i, :, ::2] for i in range(4)] + [x[0].t()[:6].t()]
    weight = torch.randn(10, 4 * 6 + 6, dtype=dtype, device=device) / 30 ** 0.5
    assert not any(p.is_contiguous() for p in parts)
    return parts, weight.t().contiguous().t(), torch.randn(10, dtype=dtype, device=device)


def sample_inputs(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """Every shape with and without bias, and strided parts."""
    for lead, widths, k in SHAPES:
        for bias in (True, False):
            args = make_inputs(lead, widths, k, dtype, device, bias)
            yield Sample(set_requires_grad(args, requires_grad), f"lead={lead} widths={widths} bias={bias}")
    yield Sample(set_requires_grad(non_contiguous(dtype, device), requires_grad), "non-contiguous")


def small_samples(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """For gradcheck and opcheck: 2-D and 3-D, with and without bias."""
    for lead, widths, k, bias in [((3, 2), [4, 5, 3], 6, True), ((2, 3), [2, 3, 1], 4, False), ((5,), [3, 4], 2, True)]:
        args = make_inputs(lead, widths, k, dtype, device, bias)
        yield Sample(set_requires_grad(args, requires_grad), f"lead={lead} bias={bias}")


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


SUITE = OpTestSuite("cat_linear", sample_inputs, small_samples=small_samples, bad=BAD,
                    bad_sample=lambda device: make_inputs((5,), [3, 4, 2], 6, torch.float32, device))
globals().update(SUITE.pytest_tests(device_marks=MARKS))


@pytest.mark.cuda
def test_device_mismatch():
    skip_without("cuda")
    parts, weight, bias = make_inputs((5,), [3, 4], 6, torch.float32, "cuda")
    with pytest.raises(ValueError, match="weight"):
        OP(parts, weight.cpu(), bias)


# (R, B, H, K): where the CUDA path choice (backends/common/cat_linear_model.h) gives the
# GEMM path (32 parts of 512 for 4 rows: the SIMT kernel's walk over K took 186 us on the H200
# where eager took 36) and where it gives the fused SIMT kernel.
GEMM_SIZE, SIMT_SIZE = (32, 4, 512, 256), (2, 4, 64, 256)


def _grad_fn_names(shape: tuple[int, int, int, int], device: str) -> tuple[str, str]:
    r, b, h, k = shape
    x = torch.randn(r, b, h, device=device, requires_grad=True)
    w = torch.randn(k, r * h, device=device, requires_grad=True)
    bias = torch.randn(k, device=device, requires_grad=True)
    return OP(list(x.unbind(0)), w, bias).grad_fn.name(), STACKED(x, 0, w, bias).grad_fn.name()


def test_grad_on_cuda_runs_eager_ops_where_the_gemm_path_would_run():
    """With gradients, a CUDA call the path choice gives the GEMM path runs eager's own ops
    (cat + linear: autograd records eager's nodes, and its backward needs no second cat); a
    call the fused kernel takes keeps the op's node. The choice reads sizes only, so this runs
    on fake CUDA tensors, on any machine."""
    if not torch.backends.cuda.is_built():
        pytest.skip("fake CUDA tensors need a CUDA build of torch")
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert "CatLinear" in _grad_fn_names(SIMT_SIZE, "cpu")[0]  # loads the kernels, outside the mode
    with FakeTensorMode():
        listed, stacked = _grad_fn_names(GEMM_SIZE, "cuda")
        assert listed == stacked == "AddmmBackward0"
        listed, stacked = _grad_fn_names(SIMT_SIZE, "cuda")
        assert "CatLinear>" in listed and "CatLinearStacked>" in stacked
        r, b, h, k = GEMM_SIZE  # the op's own checks still come first
        parts = [torch.randn(b, h, device="cuda", requires_grad=True) for _ in range(r)]
        with pytest.raises(ValueError, match=r"parts\[1\]"):
            OP([parts[0], parts[1][:-1], *parts[2:]], torch.randn(k, r * h, device="cuda"), None)
    assert "CatLinear" in _grad_fn_names(GEMM_SIZE, "cpu")[0]  # the CPU kernel: the op's node


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_half_is_eagers_gemm_where_torch_runs_it_natively(dtype):
    """bf16/fp16 on the CPU: where torch's own GEMM runs in that dtype on oneDNN, the op
    computes what eager does, cat + one GEMM (the same bits); elsewhere a GEMM per part
    accumulated in float32; within the dtype's tolerance of float64 either way
    (backends/common/cat_linear_cpu.h)."""
    native = (torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16
              else torch.ops.mkldnn._is_mkldnn_fp16_supported())
    r, b, h, k = 8, 16, 64, 256
    parts = [torch.randn(b, h, dtype=dtype) for _ in range(r)]
    w, bias = torch.randn(k, r * h, dtype=dtype) / 16, torch.randn(k, dtype=dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = OP(parts, w, bias)
    ran = {e.name for e in prof.events()}
    # eager's cat + one GEMM in the dtype, or the per-part path's float32 copies of the operands
    assert ("aten::cat" in ran and "aten::_to_copy" not in ran) == native, (native, sorted(ran))
    if native:
        assert torch.equal(out, torch.nn.functional.linear(torch.cat(parts, -1), w, bias))
    want = torch.nn.functional.linear(torch.cat([p.double() for p in parts], -1), w.double(), bias.double())
    assert_matches(out, want, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_grads_at_gemm_path_sizes(dtype):
    """The eager route's result and gradients are eager's (same kernels), list and stacked."""
    skip_without("cuda")
    r, b, h, k = GEMM_SIZE
    x = torch.randn(r, b, h, dtype=dtype, device="cuda")
    w = torch.randn(k, r * h, dtype=dtype, device="cuda") / (r * h) ** 0.5
    bias = torch.randn(k, dtype=dtype, device="cuda")
    go = torch.randn(b, k, dtype=dtype, device="cuda")

    def grads(fn, *args):
        leaves = [a.detach().requires_grad_() for a in args]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, go))

    eager = grads(lambda x, w, c: torch.nn.functional.linear(torch.cat(x.unbind(0), -1), w, c), x, w, bias)
    for got in (grads(lambda x, w, c: STACKED(x, 0, w, c), x, w, bias),
                grads(lambda x, w, c: OP(list(x.unbind(0)), w, c), x, w, bias)):
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


# ------------------------------------------------------------------ cat_linear_stacked
# cat_linear_stacked(x, dim, W, b) == cat_linear(x.unbind(dim), W, b): what the backend
# emits for torch.cat([x[i] for i in range(R)], -1).

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
# (slices are x[..., i]); a negative dim; 4-D; a large one (the GEMM path on CUDA); small
# ones along each dim; no rows; zero-width slices.
STACKED_SHAPES = [((4, 12, 32), 0, 56), ((5, 3, 8), 1, 9), ((6, 7, 3), 2, 5), ((2, 3, 4), -2, 4),
                  ((2, 3, 4, 5), 0, 6), ((4, 64, 256), 0, 100),
                  ((3, 2, 4), 0, 5), ((3, 2, 4), 1, 5), ((3, 2, 4), -1, 5), ((3, 4, 5), 2, 6),
                  ((3, 0, 4), 0, 3), ((3, 4, 0), 0, 5)]


def stacked_samples(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """Every shape and dim with and without bias, and a strided x."""
    for shape, dim, k in STACKED_SHAPES:
        for bias in (True, False):
            args = stacked_inputs(shape, dim, k, dtype, device, bias)
            yield Sample(set_requires_grad(args, requires_grad), f"x={shape} dim={dim} bias={bias}")
    x = torch.randn(16, 4, 12, dtype=dtype, device=device).transpose(0, 1)[:, :, ::2]  # (4, 16, 6)
    weight = torch.randn(10, 4 * 6, dtype=dtype, device=device) / 24 ** 0.5
    args = (x, 0, weight, torch.randn(10, dtype=dtype, device=device))
    yield Sample(set_requires_grad(args, requires_grad), "non-contiguous x")


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


def stacked_small(device: str, dtype: torch.dtype, requires_grad: bool = False):
    """For gradcheck and opcheck: every dim of a 3-D x (the last also negative), each with
    and without bias."""
    for dim, bias in [(0, True), (0, False), (1, True), (1, False), (2, True), (-1, False)]:
        shape, k = (3, 2, 4), 5
        args = stacked_inputs(shape, dim, k, dtype, device, bias)
        yield Sample(set_requires_grad(args, requires_grad), f"x={shape} dim={dim} bias={bias}")


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


STACKED_SUITE = OpTestSuite("cat_linear_stacked", stacked_samples, small_samples=stacked_small, bad=STACKED_BAD,
                            bad_sample=lambda device: stacked_inputs((3, 5, 4), 0, 6, torch.float32, device))
globals().update(STACKED_SUITE.pytest_tests(prefix="stacked_", device_marks=MARKS))


@pytest.mark.cuda
def test_stacked_device_mismatch():
    skip_without("cuda")
    x, d, weight, bias = stacked_inputs((3, 5, 4), 0, 6, torch.float32, "cuda")
    with pytest.raises(ValueError, match="bias"):
        STACKED(x, d, weight, bias.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["dot", "simt", "gemm"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape,dim,k", STACKED_SHAPES[:5], ids=str)
def test_cuda_both_paths(monkeypatch, path, dtype, shape, dim, k):
    """Each CUDA path (the single-launch dot and SIMT kernels, cat + cuBLAS), forced, for
    both ops: the stacked op describes flat slices straight from x's strides on the fused
    paths."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", path)
    x, d, weight, bias = stacked_inputs(shape, dim, k, dtype, "cuda")
    want = expected_stacked(x, d, weight, bias)
    poison(want.numel() * dtype.itemsize, "cuda")
    assert_matches(STACKED(x, d, weight, bias), want, dtype)
    assert_matches(OP(list(x.unbind(d)), weight, bias), want, dtype)


# The dot kernel's own edges: K over several rounds of 2 x 32 vectors per lane (fp32: 256
# columns a round), parts whose widths split a lane's vectors between parts, outputs not a
# multiple of its 4 columns per warp, one row, many rows, misaligned parts (one element per
# load), strided parts; plus the list SHAPES (zero-width parts, no rows).
DOT_SHAPES = [((5,), [300, 212, 500], 7), ((1,), [8] * 64, 3), ((2, 3), [1024, 8], 13),
              ((130,), [16, 48], 5), ((4,), [3, 7, 11], 6)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_dot_path(monkeypatch, dtype):
    """The dot kernel, forced, against float64 on every shape above, with and without bias,
    poisoned output memory; two runs bit-identical (a fixed reduction order)."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", "dot")
    cases = [make_inputs(lead, widths, k, dtype, "cuda", bias)
             for lead, widths, k in DOT_SHAPES + SHAPES for bias in (True, False)]
    cases.append(non_contiguous(dtype, "cuda"))
    for parts, weight, bias in cases:
        want = reference([p.double() for p in parts], weight.double(), None if bias is None else bias.double())
        poison(want.numel() * dtype.itemsize, "cuda")
        got = OP(parts, weight, bias)
        assert_matches(got, want, dtype)
        torch.testing.assert_close(OP(parts, weight, bias), got, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_path_override_rejects_unknown(monkeypatch):
    """A misspelt OPREG_CAT_LINEAR_PATH is an error naming it, not the model in silence."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", "simd")
    parts, weight, bias = make_inputs((12,), [32] * 4, 56, torch.float32, "cuda")
    with pytest.raises(ValueError, match="OPREG_CAT_LINEAR_PATH"):
        OP(parts, weight, bias)


@pytest.mark.cuda
def test_cuda_path_kernels(monkeypatch):
    """Which kernel each choice launches: the model picks the dot kernel at the seeds' size
    (R4 B12 H32 K56 fp32) and the SIMT one at R2 B64 H64 K2048 fp32 (there 1.5 x the dot
    kernel's modelled time is above SIMT's); each forced fused path runs its own kernel, the
    GEMM path neither."""
    skip_without("cuda")

    def kernels(args, path: str | None) -> list[str]:
        with monkeypatch.context() as m:
            if path is not None:
                m.setenv("OPREG_CAT_LINEAR_PATH", path)
            return cuda_kernels(lambda: OP(*args))

    seeds = make_inputs((12,), [32] * 4, 56, torch.float32, "cuda")
    wide = make_inputs((64,), [64] * 2, 2048, torch.float32, "cuda")
    for args, path, kernel in ((seeds, None, "cat_linear_dot_kernel"), (wide, None, "cat_linear_simt_kernel"),
                               (seeds, "simt", "cat_linear_simt_kernel"), (wide, "dot", "cat_linear_dot_kernel")):
        names = kernels(args, path)
        assert len(names) == 1 and kernel in names[0], (path, kernel, names)
    assert not any("cat_linear_" in k for k in kernels(seeds, "gemm"))


def _capture(call) -> torch.cuda.CUDAGraph:
    """``call`` captured in a CUDA graph (no warm-up here: the caller's); its output is the
    graph's ``out``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph.out = call()
    return graph


def _replay_kernels(graph: torch.cuda.CUDAGraph) -> list[str]:
    """The kernels one replay of ``graph`` launches, by name."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.cuda
@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_cuda_graph_capture_takes_gemm_path(stacked, monkeypatch):
    """Where cuBLAS beats the fused pick in a CUDA graph (cat_linear_model.h, GRAPH: R8 B1024
    H64 K256 bf16, SIMT 22.7 us a replayed call against 5.5 for at::cat + cuBLAS on the
    H200), a call made while the stream captures runs the GEMM path; the same call outside a
    capture keeps the fused kernel, and so does a capture with the path forced. The replay
    computes the float64 reference on new inputs."""
    skip_without("cuda")
    monkeypatch.delenv("OPREG_CAT_LINEAR_PATH", raising=False)
    parts, weight, bias = make_inputs((1024,), [64] * 8, 256, torch.bfloat16, "cuda")
    x = torch.stack(parts)
    views = list(x.unbind(0))

    def call():
        return STACKED(x, 0, weight, bias) if stacked else OP(views, weight, bias)

    eager = cuda_kernels(call)  # its warm-up call runs the GEMM path once (cuBLAS set up here)
    assert len(eager) == 1 and "cat_linear_simt_kernel" in eager[0], eager
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # the usual warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = _capture(call)
    names = _replay_kernels(graph)
    assert names and not any("cat_linear_" in k for k in names), names
    with torch.no_grad():
        x.mul_(0.5 + torch.rand_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = reference([p.double() for p in views], weight.double(), bias.double())
    assert_matches(graph.out, want, torch.bfloat16)

    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", "simt")
    forced = _replay_kernels(_capture(call))
    assert len(forced) == 1 and "cat_linear_simt_kernel" in forced[0], forced


@pytest.mark.cuda
def test_cuda_graph_capture_without_cublas_keeps_fused(monkeypatch):
    """A capture on a thread where the op never ran the GEMM path outside a capture keeps the
    fused pick: switching there would make cuBLAS's first call (cublasCreate) inside the
    capture, which fails it."""
    import threading

    skip_without("cuda")
    monkeypatch.delenv("OPREG_CAT_LINEAR_PATH", raising=False)
    parts, weight, bias = make_inputs((1024,), [64] * 8, 256, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    result: dict[str, object] = {}

    def capture() -> None:
        try:
            result["graph"] = _capture(lambda: OP(parts, weight, bias))
        except BaseException as e:  # noqa: BLE001 - reported below, in the test's thread
            result["error"] = e

    t = threading.Thread(target=capture)  # a fresh thread: the op never ran there
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    graph = result["graph"]
    names = _replay_kernels(graph)  # type: ignore[arg-type]
    assert len(names) == 1 and "cat_linear_simt_kernel" in names[0], names
    want = reference([p.double() for p in parts], weight.double(), bias.double())
    assert_matches(graph.out, want, torch.bfloat16)  # type: ignore[attr-defined]


def _model_picks(shapes: list[tuple[int, int, int, int, str]], env: dict[str, str], tmp_path) -> list[tuple]:
    """cat_linear_model.h's picks for (R, B, H, K, dtype) shapes, through tests/cpp's harness
    compiled here: (back to back, in a CUDA graph, with gradients eager's ops)."""
    elt = {"fp32": 4, "bf16": 2, "fp64": 8}
    lines = "".join(f"{r} {b} {h} {k} {elt[d]}\n" for r, b, h, k, d in shapes)
    out = host_picks("cat_linear_model_picks.cpp", lines, "OPREG_CAT_LINEAR_PATH", env, tmp_path)
    return [(s, g, e == "1") for s, g, e in (line.split() for line in out)]


def test_path_model_picks(tmp_path):
    """The path model's picks where the H200 measured each path (bench/RESULTS.md, 2026-12-04,
    the forced columns of bench/sweep.py back to back and of bench/cat_linear_paths.py in CUDA
    graphs), so that a change to the model shows here, without a GPU."""
    shapes = {
        # the seeds' size: the dot kernel everywhere (2.0 us in a graph against eager's 3.5)
        (4, 12, 32, 56, "fp32"): ("dot", "dot", False),
        # few rows, long K: the SIMT kernel (4.3 us in a graph, eager 6.2)
        (2, 64, 64, 2048, "fp32"): ("simt", "simt", False),
        # SIMT back to back, but cuBLAS in a graph (22.7 us against at::cat + cuBLAS's 5.5)
        (8, 1024, 64, 256, "bf16"): ("simt", "gemm", False),
        # 32 parts of 512 for 4 rows: the SIMT walk over K loses (186 us against eager's 36)
        (32, 4, 512, 256, "fp32"): ("gemm", "gemm", True),
        # the dot kernel's take from the GEMM path back to back (40.4 -> 15.0 us), not with
        # gradients, not in a graph
        (8, 2, 512, 2048, "bf16"): ("dot", "gemm", True),
        # large: eager's cat + cuBLAS
        (8, 8192, 512, 2048, "bf16"): ("gemm", "gemm", True),
        # one fp32 row: in a graph cuBLAS's matrix-vector kernel where it beats the dot kernel
        # (32 parts: 4.1 us against 7.5), not where the dot kernel is faster (2 parts: 1.9 / 3.4)
        (32, 1, 64, 256, "fp32"): ("dot", "gemm", False),
        (2, 1, 64, 256, "fp32"): ("dot", "dot", False),
        # in a graph the GEMM path (eager's kernels) where the model has it ahead at all
        # (margin 1.0): the dot kernel ran 1.24-1.34x and 1.05-1.10x of eager there in three runs
        (8, 64, 64, 256, "bf16"): ("dot", "gemm", False),
        (32, 1, 64, 2048, "fp32"): ("dot", "gemm", False),
        # fp32 rows at margin 1.4: the SIMT kernel ran 1.18-1.21x and 1.05-1.08x of eager in a
        # graph in five runs; the dot kernel's lead at 16 rows of 32 parts (0.77-0.82x) is
        # given up for them, the SIMT kernel's at 64 rows and long K kept (above)
        (8, 1024, 64, 256, "fp32"): ("simt", "gemm", False),
        (2, 16, 512, 2048, "fp32"): ("simt", "gemm", False),
        (32, 16, 64, 256, "fp32"): ("dot", "gemm", False),
    }
    assert _model_picks(list(shapes), {}, tmp_path) == list(shapes.values())
    forced = _model_picks(list(shapes), {"OPREG_CAT_LINEAR_PATH": "simt"}, tmp_path)
    assert forced == [("simt", "simt", False)] * len(shapes)  # forced: also in a graph
