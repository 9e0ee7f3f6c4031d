"""The public harness (:mod:`opreg.testing`) on third-party implementations: a correct
plug-in passes every check; a wrong one fails the check it breaks, naming itself and
only itself. Plug-ins are registered per test and removed after."""
from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch

import opreg
from opreg.ops import scatter_combine as spec
from opreg.testing import OpTestSuite, Sample, Unavailable

from test_scatter_combine import BAD, make_inputs, small_samples


def combine(h: torch.Tensor, i: torch.Tensor, g: torch.Tensor, t: int) -> torch.Tensor:
    """An independent scatter_combine (index_add_, not the reference's index_put_),
    checking its input with the op's own spec, as a plug-in author would."""
    spec.check(h, i, g, t)
    spec.check_range(i, t)
    acc = spec.accumulate_dtype(h.dtype)
    out = torch.zeros(t, h.shape[1], dtype=acc, device=h.device)
    return out.index_add_(0, i.long(), h.to(acc) * g.to(acc)[:, None]).to(h.dtype)


def samples(device: str, dtype: torch.dtype, requires_grad: bool = False) -> Iterator[Sample]:
    for shape, order in [((7, 2, 5), "random"), ((33, 8, 8), "uneven"), ((64, 3, 130), "expert")]:
        h, i, g, t = make_inputs(*shape, dtype, torch.int64, order, device)
        yield Sample((h.requires_grad_(requires_grad), i, g.requires_grad_(requires_grad), t), str(shape))


SUITE = OpTestSuite("scatter_combine", samples, small_samples=small_samples, bad=BAD,
                    bad_context=opreg.check_indices)


@pytest.fixture
def plug_in() -> Iterator[Callable[[str, Callable[..., torch.Tensor]], str]]:
    """``plug_in(name, fn)`` registers ``fn`` for the CPU at low priority (the default
    path stays the built-in); every one is unregistered after the test."""
    names: list[str] = []

    def add(name: str, fn: Callable[..., torch.Tensor]) -> str:
        opreg.register_impl("scatter_combine", name, devices=("cpu",), priority=1)(fn)
        names.append(name)
        return name

    yield add
    for name in names:
        opreg.unregister_impl("scatter_combine", name)
    assert not set(names) & {r["impl"] for r in opreg.implementations("scatter_combine")}


def test_correct_plug_in_passes_every_check(plug_in):
    name = plug_in("t_good", combine)
    assert name in SUITE.implementations("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        SUITE.check_correctness("cpu", dtype, impl=name)
    SUITE.check_gradients("cpu", impl=name)
    SUITE.check_gradcheck("cpu", impl=name)
    SUITE.check_opcheck("cpu", impl=name)
    SUITE.check_deterministic("cpu", impl=name)
    SUITE.check_bad_input("cpu", impl=name)
    SUITE.check_correctness("cpu", torch.float32)  # all together, the plug-in among them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_off_by_a_factor_fails_correctness(plug_in, dtype):
    """5 % too large: outside every dtype's tolerance (bf16's is 1.6 %). Only the wrong
    implementation is reported."""
    plug_in("t_scaled", lambda h, i, g, t: combine(h, i, g, t) * 1.05)
    with pytest.raises(AssertionError, match="correctness") as e:
        SUITE.check_correctness("cpu", dtype)
    lines = str(e.value).splitlines()[1:]
    assert lines and all(line.strip().startswith("t_scaled ") for line in lines)
    assert len(lines) == len(SUITE.samples("cpu", dtype))


def test_wrong_rows_and_wrong_dtype_fail_correctness(plug_in):
    plug_in("t_shifted", lambda h, i, g, t: combine(h, (i + 1) % t, g, t))
    plug_in("t_fp32_out", lambda h, i, g, t: combine(h.float(), i, g.float(), t))
    with pytest.raises(AssertionError) as e:
        SUITE.check_correctness("cpu", torch.bfloat16)
    msg = str(e.value)
    assert "t_shifted" in msg and "t_fp32_out" in msg and "dtype torch.float32" in msg
    SUITE.check_correctness("cpu", torch.float32, impl="t_fp32_out")  # right in fp32


def test_input_mutation_fails_correctness(plug_in):
    def scribbles(h, i, g, t):
        out = combine(h, i, g, t)
        g.mul_(1.0)
        g[0] = 2.0
        return out

    plug_in("t_scribbles", scribbles)
    with pytest.raises(AssertionError, match="input was modified"):
        SUITE.check_correctness("cpu", torch.float32, impl="t_scribbles")


def test_unchecked_plug_in_fails_bad_input_parity(plug_in):
    """No input checks: torch's own errors (other types, other words) or no error."""
    def unchecked(h, i, g, t):
        return torch.zeros(t, h.shape[-1], dtype=h.dtype).index_add_(0, i.long(), h * g[:, None])

    plug_in("t_unchecked", unchecked)
    with pytest.raises(AssertionError, match="bad input") as e:
        SUITE.check_bad_input("cpu")
    failed = str(e.value).splitlines()[1:]
    assert failed and all(line.strip().startswith("t_unchecked ") for line in failed)
    SUITE.check_bad_input("cpu", case="hidden rank", impl="default")


def test_nondeterministic_plug_in_fails_determinism(plug_in):
    """Noise far inside fp32's tolerance: correct, but not the same bits twice."""
    def noisy(h, i, g, t):
        out = combine(h, i, g, t)
        return out + 1e-7 * out.abs().max() * torch.randn_like(out)

    plug_in("t_noisy", noisy)
    SUITE.check_correctness("cpu", torch.float32, impl="t_noisy")
    with pytest.raises(AssertionError, match="different bits"):
        SUITE.check_deterministic("cpu", impl="t_noisy")


def test_no_samples_is_a_failure_not_a_pass():
    empty = OpTestSuite("scatter_combine", lambda device, dtype, requires_grad=False: [])
    with pytest.raises(AssertionError, match="nothing to check"):
        empty.check_correctness("cpu", torch.float32)


def test_unavailable_is_reported():
    with pytest.raises(Unavailable):
        SUITE.check_correctness("cpu", torch.float32, impl="cuda")  # does not run on the CPU
    if not torch.cuda.is_available():
        with pytest.raises(Unavailable, match="CUDA"):
            SUITE.check_cuda_graphs()


def test_a_fixed_list_of_samples():
    """Moved to the device and cast to each dtype asked for; index tensors kept."""
    fixed = [Sample(make_inputs(5, 2, 3, torch.float32, torch.int32, "random", "cpu"), "fixed"),
             make_inputs(3, 1, 4, torch.float64, torch.int64, "uneven", "cpu")]
    suite = OpTestSuite("scatter_combine", fixed)
    assert [s.args[0].dtype for s in suite.samples("cpu", torch.bfloat16)] == [torch.bfloat16] * 2
    assert suite.samples("cpu", torch.float16)[0].args[1].dtype == torch.int32
    suite.check_correctness("cpu", torch.bfloat16)
    suite.check_gradcheck("cpu")


# A new op through the public API only, as the module docstring's example does.
@opreg.register_op("t_rms_scale", "(Tensor x, float eps) -> Tensor")
def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() < 1:
        raise ValueError(f"t_rms_scale: x must have at least 1 dim, got shape {list(x.shape)}")
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_samples(device: str, dtype: torch.dtype, requires_grad: bool = False) -> Iterator[Sample]:
    for n in (0, 1, 7, 33):
        x = torch.randn(n, 8, dtype=dtype, device=device, requires_grad=requires_grad)
        yield Sample((x, 1e-6), name=f"n={n}")


RMS = OpTestSuite("t_rms_scale", rms_samples,
                  bad=[("x rank", lambda x, eps: (x.sum(), eps), ValueError, "x must have")])
globals().update(RMS.pytest_tests(prefix="new_op_", devices=("cpu",)))
