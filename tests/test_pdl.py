"""Programmatic dependent launch (backends/cuda/pdl.cuh; on by default on sm_90+, off with
``OPREG_PDL=0``, read per call) on the ops' single-launch kernels: cat_linear's dot and SIMT
kernels, scatter_combine's tiny and small forward kernels and its backward kernel.

A kernel launched with PDL may start while the kernel before it on the stream still runs, so
each must wait (griddepcontrol.wait) before its first load and store. These tests run chains
of dependent calls back to back, each call's input the previous call's output (directly, so
that each kernel follows one of its own, or through a foreign kernel): a kernel that read
before the wait would read memory its predecessor had not written yet. Every chain must give
the bits of the same chain without PDL, and its first step float64's values; and the same
inside a CUDA graph that begins with a memcpy node (``copy_``) before the op's kernel.
(The whole CUDA suite of both ops runs with PDL, the default; without it: ``OPREG_PDL=0 pytest
tests/test_cat_linear.py tests/test_scatter_combine.py``.)"""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import opreg  # noqa: F401  (loads the ops)
from opreg.ops.cat_linear import reference as cat_reference
from opreg.ops.scatter_combine import reference as sc_reference

from _util import assert_matches, skip_without

pytestmark = pytest.mark.cuda
CAT = torch.ops.opreg.cat_linear.default
SC = torch.ops.opreg.scatter_combine.default
SC_BWD = torch.ops.opreg.scatter_combine_backward.default
STEPS = 24
DTYPES = [torch.float32, torch.bfloat16]


def _both(monkeypatch, chain: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The chain's outputs without PDL and with it (each run from the same inputs)."""
    monkeypatch.setenv("OPREG_PDL", "0")
    plain = chain()
    monkeypatch.setenv("OPREG_PDL", "1")
    pdl = chain()
    torch.cuda.synchronize()
    return plain, pdl


def _same_bits(plain: list[torch.Tensor], pdl: list[torch.Tensor]) -> None:
    assert len(plain) == len(pdl)
    for i, (a, b) in enumerate(zip(plain, pdl)):
        assert torch.equal(a, b), f"step {i}: PDL changed the result (max diff {(a - b).abs().max().item():.3g})"


def _cat_inputs(dtype: torch.dtype):
    r, b, h = 4, 48, 64  # out (48, 256) splits into the next call's 4 parts of 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    parts = [torch.randn(b, h, device="cuda", dtype=dtype, generator=gen) for _ in range(r)]
    w = torch.randn(r * h, r * h, device="cuda", dtype=dtype, generator=gen) / (r * h) ** 0.5
    bias = 0.1 * torch.randn(r * h, device="cuda", dtype=dtype, generator=gen)
    return parts, w, bias


@pytest.mark.parametrize("via", ["direct", "foreign"])
@pytest.mark.parametrize("path", ["dot", "simt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cat_linear_chain(path, dtype, via, monkeypatch):
    """cat_linear's fused kernels, forced, in a chain: call i + 1's parts are views of call i's
    output (direct), or a copy of it made by a foreign kernel (foreign)."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", path)
    parts0, w, bias = _cat_inputs(dtype)
    with torch.no_grad():
        want = cat_reference([p.double() for p in parts0], w.double(), bias.double())

    def chain() -> list[torch.Tensor]:
        parts, outs = parts0, []
        with torch.no_grad():
            for _ in range(STEPS):
                out = CAT(parts, w, bias)
                outs.append(out)
                src = out if via == "direct" else out * 1  # the multiply: a foreign kernel
                parts = list(src.chunk(len(parts0), -1))
        return outs

    plain, pdl = _both(monkeypatch, chain)
    assert_matches(pdl[0], want, dtype)
    _same_bits(plain, pdl)


def _permutation(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randperm(n, generator=gen).to(torch.int32).cuda()


@pytest.mark.parametrize("via", ["direct", "foreign"])
@pytest.mark.parametrize("path", ["tiny", "small"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_combine_chain(path, dtype, via, monkeypatch):
    """scatter_combine's one-launch forward kernels, forced: one row per token (token_idx a
    permutation), so call i + 1's rows are call i's output (direct); or two rows per token,
    call i's output and its reverse, joined by a foreign kernel (torch.cat)."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_SCATTER_COMBINE_PATH", path)
    t, h = 1024, 128
    fan = 1 if via == "direct" else 2
    idx = _permutation(t * fan) % t
    gen = torch.Generator(device="cuda").manual_seed(2)
    x0 = torch.randn(t * fan, h, device="cuda", dtype=dtype, generator=gen)
    g = (0.9 + 0.2 * torch.rand(t * fan, device="cuda", generator=gen)).to(dtype)
    want = sc_reference(x0.double(), idx, g.double(), t)

    def chain() -> list[torch.Tensor]:
        x, outs = x0, []
        for _ in range(STEPS):
            out = SC(x, idx, g, t)
            outs.append(out)
            x = out if via == "direct" else torch.cat([out, out.flip(0)])
        return outs

    plain, pdl = _both(monkeypatch, chain)
    assert_matches(pdl[0], want, dtype)
    _same_bits(plain, pdl)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_combine_backward_chain(dtype, monkeypatch):
    """scatter_combine's backward kernel: grad_x of call i (one row per token) is call
    i + 1's grad_out; both gradients, every step."""
    skip_without("cuda")
    t, h = 1024, 256
    idx = _permutation(t)
    gen = torch.Generator(device="cuda").manual_seed(3)
    gy0 = torch.randn(t, h, device="cuda", dtype=dtype, generator=gen)
    x = torch.randn(t, h, device="cuda", dtype=dtype, generator=gen)
    g = (0.9 + 0.2 * torch.rand(t, device="cuda", generator=gen)).to(dtype)
    gy64 = gy0.double()[idx.long()]
    want_gx, want_gg = g.double()[:, None] * gy64, (gy64 * x.double()).sum(1)

    def chain() -> list[torch.Tensor]:
        gy, outs = gy0, []
        for _ in range(STEPS):
            gx, gg = SC_BWD(gy, x, idx, g)
            outs += [gx, gg]
            gy = gx
        return outs

    plain, pdl = _both(monkeypatch, chain)
    assert_matches(pdl[0], want_gx, dtype)
    assert_matches(pdl[1], want_gg, dtype)
    _same_bits(plain, pdl)


def _captured(monkeypatch, src: torch.Tensor, steps: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``steps`` of ``src``'s copy captured with PDL (a memcpy node, then the op's kernels),
    replayed after ``src`` is rewritten in place; the replay's output."""
    monkeypatch.setenv("OPREG_PDL", "1")
    static = torch.empty_like(src)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static.copy_(src)
        steps(static)  # warm-up off the capture (allocator, lazy init)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(src)
        out = steps(static)
    src.normal_()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("path", ["dot", "simt"])
def test_cat_linear_graph(path, monkeypatch):
    """A captured chain of four dot or SIMT calls after a memcpy node: the replay's bits are
    the eager chain's without PDL."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", path)
    parts, w, bias = _cat_inputs(torch.float32)
    src = torch.cat(parts, -1)

    def steps(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(4):
                x = CAT(list(x.chunk(len(parts), -1)), w, bias)
        return x

    got = _captured(monkeypatch, src, steps)
    monkeypatch.setenv("OPREG_PDL", "0")
    assert torch.equal(got, steps(src.clone()))


@pytest.mark.parametrize("path", ["tiny", "small"])
def test_scatter_combine_graph(path, monkeypatch):
    """A captured chain of four tiny- or small-path calls and a backward after a memcpy node:
    the replay's bits are the eager chain's without PDL."""
    skip_without("cuda")
    monkeypatch.setenv("OPREG_SCATTER_COMBINE_PATH", path)
    t, h = 1536, 128
    idx = _permutation(t)
    gen = torch.Generator(device="cuda").manual_seed(4)
    src = torch.randn(t, h, device="cuda", generator=gen)
    g = 0.9 + 0.2 * torch.rand(t, device="cuda", generator=gen)

    def steps(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = SC(x, idx, g, t)
        gx, gg = SC_BWD(x, src, idx, g)
        return gx + gg[:, None]

    got = _captured(monkeypatch, src, steps)
    monkeypatch.setenv("OPREG_PDL", "0")
    assert torch.equal(got, steps(src.clone()))


@pytest.mark.parametrize("value", ["2", "on", "1 "])
def test_bad_value_is_an_error(value, monkeypatch):
    """OPREG_PDL takes 0 or 1 (unset: 1); anything else raises, naming the variable, rather
    than launching one way or the other unannounced."""
    skip_without("cuda")
    parts, w, bias = _cat_inputs(torch.float32)
    monkeypatch.setenv("OPREG_CAT_LINEAR_PATH", "dot")
    monkeypatch.setenv("OPREG_PDL", value)
    with pytest.raises(RuntimeError, match="OPREG_PDL must be 0 or 1"):
        with torch.no_grad():
            CAT(parts, w, bias)
    monkeypatch.setenv("OPREG_PDL", "")  # empty: the default
    with torch.no_grad():
        got = CAT(parts, w, bias)
    assert_matches(got, cat_reference([p.double() for p in parts], w.double(), bias.double()), torch.float32)
