"""The launcher's direct call of Triton's C launcher (backends/triton/launch.py), without a GPU.

On triton 3.6 a cached launch calls the generated C ``launch`` itself, with the arguments
Triton's Python would hand it: ``CudaLauncher.__call__`` puts the grid, stream, function,
cooperative/PDL flags, scratch pointers, metadata and hooks first, and the tensor
descriptor wrapper (``wrap_handle_tensordesc``'s ``inner``) expands each descriptor
parameter into ``make_tensordesc_arg``'s list. Here a stand-in of that layout (its ``inner``
copied from triton 3.6's ``backends/nvidia/driver.py``) checks that :class:`_RawLaunch`
passes exactly what ``inner`` would, wherever the descriptors sit, that an encoded
descriptor is reused only for the same address and metadata, and that any other layout is
not taken (None: Triton's own path).
"""
from __future__ import annotations

import types
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from opreg.backends.triton import launch as L  # noqa: E402

_BASE = "iiiKKppOOOOOO"
_BASE_ARGS_FORMAT = _BASE  # this module stands in for triton 3.6's driver module (CudaLauncher's)


def _driver_namespace(encoded: list[Any]) -> dict[str, Any]:
    """A module namespace as triton 3.6's driver: the base format, and an encoder that
    records each encoding (so a reuse shows as a missing entry)."""
    def make_tensordesc_arg(arg: Any, metadata: Any) -> list[Any]:
        tmap = ("tmap", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), metadata["swizzle"])
        encoded.append(tmap)
        return [tmap, *arg.shape, *arg.strides]

    return {"_BASE_ARGS_FORMAT": _BASE, "_BASE_ARGS_FORMAT_LEN": len(_BASE),
            "make_tensordesc_arg": make_tensordesc_arg}


# triton 3.6's wrapper, as in its backends/nvidia/driver.py (the function body verbatim)
_WRAP = '''
def wrap_handle_tensordesc(launcher, signature, tensordesc_meta):
    has_tensor_desc_arg = any(isinstance(sig, str) and sig.startswith("tensordesc") for sig in signature.values())
    if not has_tensor_desc_arg:
        return launcher

    tensordesc_indices = set(
        [i for i, sig in enumerate(signature.values()) if isinstance(sig, str) and sig.startswith("tensordesc")])
    assert not tensordesc_meta or len(tensordesc_meta) == len(tensordesc_indices)
    if not tensordesc_meta:
        tensordesc_meta = [None] * len(tensordesc_indices)

    def inner(*args):
        final_args = list(args[:_BASE_ARGS_FORMAT_LEN])
        tensordesc_idx = 0
        for i, arg in enumerate(args[_BASE_ARGS_FORMAT_LEN:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                tensordesc_idx += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)

    return inner
'''


class CudaLauncher:  # the name _raw_launcher checks; __call__ as triton 3.6's
    def __init__(self, launch: Any, scratch: int = 0) -> None:
        self.launch = launch
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):  # noqa: ANN001, N803 - triton's names
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                    None, *args)


# triton 3.8's: hooks by name, one generic C launch taking the kernel's signature
_LAUNCHER_38 = '''
class CudaLauncher:
    def __init__(self, launch):
        self.launch, self.global_scratch_size, self.profile_scratch_size = launch, 0, 0
        self.launch_cooperative_grid, self.launch_pdl = False, False

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):
        pass
'''


def _kernel(signature: dict[str, str], metas: list[Any], c_launch: Any, encoded: list[Any],
            scratch: int = 0) -> Any:
    ns = _driver_namespace(encoded)
    exec(_WRAP, ns)
    inner = ns["wrap_handle_tensordesc"](c_launch, signature, metas)
    return types.SimpleNamespace(run=CudaLauncher(inner, scratch), function=0xF00,
                                 packed_metadata=(4, 1, 1024))


def _desc(t: torch.Tensor, box: list[int]) -> Any:
    if L._TensorDescriptor is None:
        pytest.skip("this triton has no tensor descriptors")
    return L.descriptor(t, box)


SIGNATURE = {"a": "*bf16", "w_desc": "tensordesc<bf16[1, 16, 16]>", "n": "i32", "a_desc": "tensordesc<bf16[16, 16]>",
             "s": "i32", "BLOCK": "constexpr", "tail_desc": "tensordesc<bf16[16, 16]>", "last": "i32"}
METAS = [{"swizzle": 128}, {"swizzle": 64}, {"swizzle": 32}]


def test_the_c_launcher_gets_what_tritons_wrapper_would_give_it() -> None:
    got_calls: list[tuple[Any, ...]] = []
    want_calls: list[tuple[Any, ...]] = []
    encoded: list[Any] = []
    kernel = _kernel(SIGNATURE, METAS, "{}".format, encoded)  # a builtin stands in for the C launcher
    raw = L._raw_launcher(kernel)
    assert raw is not None and [p for p, _ in raw.descs] == [1, 3, 6]
    raw.c_launch = lambda *a: got_calls.append(a)

    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    a = torch.randn(32, 16, dtype=torch.bfloat16)
    tail_t = torch.randn(48, 16, dtype=torch.bfloat16)
    args = (a, L.LazyDescriptor(w, [1, 16, 16], ("w", w.dtype, tuple(w.shape), w.stride())), 7,
            _desc(a, [16, 16]), 9)
    tail = ("BLOCK=64", _desc(tail_t, [16, 16]), 11)
    raw(3, 2, 1, 0xABC, args, tail)
    # Triton's own path: CudaLauncher.__call__ then inner, every descriptor built
    oracle = _kernel(SIGNATURE, METAS, lambda *x: want_calls.append(x), [])
    built = L._built(args)
    oracle.run.launch(3, 2, 1, 0xABC, 0xF00, False, True, None, None, (4, 1, 1024), None, None, None,
                      *built, *tail)
    assert got_calls == want_calls
    assert got_calls[0][:13] == (3, 2, 1, 0xABC, 0xF00, False, True, None, None, (4, 1, 1024), None, None, None)


def test_an_encoded_descriptor_is_reused_only_for_the_same_address() -> None:
    encoded: list[Any] = []
    kernel = _kernel({"w_desc": "tensordesc<bf16[1, 16, 16]>", "n": "i32"}, [{"swizzle": 128}], "{}".format,
                     encoded)
    raw = L._raw_launcher(kernel)
    calls: list[tuple[Any, ...]] = []
    raw.c_launch = lambda *a: calls.append(a)
    w = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    key = (w.dtype, tuple(w.shape), w.stride(), (1, 16, 16))
    for _ in range(3):
        raw(1, 1, 1, 0, (L.LazyDescriptor(w, [1, 16, 16], key), 5), ())
    assert len(encoded) == 1, "the same address and metadata: encoded once"
    other = w.clone()
    raw(1, 1, 1, 0, (L.LazyDescriptor(other, [1, 16, 16], key), 5), ())
    assert len(encoded) == 2 and calls[-1][13][1] == other.data_ptr() != w.data_ptr()
    raw(1, 1, 1, 0, (_desc(w, [1, 16, 16]), 5), ())  # a built descriptor of w: its own key
    assert calls[-1][13][1] == w.data_ptr()


@pytest.mark.parametrize("built", [False, True])
def test_each_descriptor_parameter_gets_its_own_metadata(built: bool) -> None:
    """The encoding reads the parameter's metadata (swizzle, block size) as well as the
    tensor: one tensor at two descriptor parameters is encoded once for each, as Triton's
    wrapper encodes it, on the first launch and on later ones. ``built``: descriptors built
    before the launch (a launch without a spec key: given configs), one tensor in two boxes,
    as a HALF_TAIL GEMM's A in full and half tiles; their key held no box, and on the H200
    the half-tile parameter got the full tile's encoding and the GEMM hung (2026-12-05,
    bench/raw_launch_hang.py)."""
    signature = {"x_desc": "tensordesc<bf16[16, 16]>", "n": "i32", "y_desc": "tensordesc<bf16[8, 16]>"}
    metas = [{"swizzle": 128}, {"swizzle": 64}]
    encoded: list[Any] = []
    got: list[tuple[Any, ...]] = []
    want: list[tuple[Any, ...]] = []
    raw = L._raw_launcher(_kernel(signature, metas, "{}".format, encoded))
    raw.c_launch = lambda *a: got.append(a)
    oracle = _kernel(signature, metas, lambda *x: want.append(x), [])
    a = torch.randn(32, 16, dtype=torch.bfloat16)
    key = (a.dtype, tuple(a.shape), a.stride(), (16, 16))
    for _ in range(2):
        if built:
            args = (_desc(a, [16, 16]), 5, _desc(a, [8, 16]))
        else:  # one key at both: the launcher may not rely on the caller's keys to tell them apart
            args = (L.LazyDescriptor(a, [16, 16], key), 5, L.LazyDescriptor(a, [16, 16], key))
        raw(1, 1, 1, 0, args, ())
        oracle.run.launch(1, 1, 1, 0, 0xF00, False, True, None, None, (4, 1, 1024), None, None, None,
                          *L._built(args))
    assert got == want
    assert [e[-1] for e in encoded] == [128, 64], "each parameter encoded once, with its own metadata"


def test_other_layouts_keep_tritons_path() -> None:
    encoded: list[Any] = []
    assert L._raw_launcher(_kernel(SIGNATURE, METAS, "{}".format, encoded, scratch=128)) is None  # scratch
    assert L._raw_launcher(_kernel(SIGNATURE, METAS, lambda *a: None, encoded)) is None  # not a C function
    no_desc = _kernel({"a": "*bf16", "n": "i32"}, [], "{}".format, encoded)  # the C launcher itself
    assert L._raw_launcher(no_desc) is not None and L._raw_launcher(no_desc).descs == []
    other = _kernel(SIGNATURE, METAS, "{}".format, encoded)
    other.run.launch.__globals__["_BASE_ARGS_FORMAT"] = "iiiKKOOOOOO"  # another base layout
    assert L._raw_launcher(other) is None
    renamed = types.SimpleNamespace(run=types.SimpleNamespace(**vars(other.run)), function=0, packed_metadata=())
    assert L._raw_launcher(renamed) is None  # not a CudaLauncher
    ns: dict[str, Any] = {}
    exec(_LAUNCHER_38, ns)  # a no-descriptor kernel of triton 3.8: its launch is a C function too
    newer = types.SimpleNamespace(run=ns["CudaLauncher"]("{}".format), function=0, packed_metadata=())
    assert L._raw_launcher(newer) is None


class JITFunction:  # the name launch_args caches for; compiles a stand-in kernel per call of fn[grid]
    def __init__(self) -> None:
        import inspect

        self.__name__ = "toy_kernel"
        self.signature = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                            for n in ("x", "n", "BLOCK")])
        self.compiled: list[Any] = []
        self.ran: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def compile_and_run(*args: Any, **kwargs: Any) -> Any:
            kernel = types.SimpleNamespace(function=len(self.compiled), packed_metadata=(),
                                           run=lambda *a: self.ran.append(a))
            self.compiled.append((L._full_key(0, args, kwargs), kernel))
            return kernel
        return compile_and_run


@pytest.mark.parametrize("check", [False, True])
def test_a_spec_key_hit_is_checked_against_the_full_key(check: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under OPREG_CHECK_SPEC (the suite's setting) a launch whose spec key hits an entry
    compiled for another constexpr, argument class or alignment raises, naming them; a hit
    with the same full key runs the cached kernel. Without the check the hit runs the stale
    binary: what the check is for."""
    monkeypatch.setattr(L, "CHECK_SPEC", check)
    monkeypatch.setattr(L, "_direct_ok", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7)
    fn = JITFunction()
    x = torch.zeros(64)
    for _ in range(3):  # the first launch of a kernel (Triton's path), a miss (cached), a hit
        L.launch_args(fn, (1,), (x, 16), ("spec", 1), {"BLOCK": 32})
    assert len(fn.compiled) == 2 and len(fn.ran) == 1
    stale = [((x, 16), {"BLOCK": 64}, r"options \['BLOCK'\]"),  # another constexpr
             ((x, 1), {"BLOCK": 32}, r"positions \[1\]"),  # an int that Triton specialises (== 1)
             ((x[1:], 16), {"BLOCK": 32}, r"positions \[0\]")]  # a pointer off 16 bytes
    for args, kwargs, names in stale:
        if check:
            with pytest.raises(RuntimeError, match=names):
                L.launch_args(fn, (1,), args, ("spec", 1), kwargs)
        else:
            L.launch_args(fn, (1,), args, ("spec", 1), kwargs)
    assert len(fn.compiled) == 2, "a spec hit never compiles"
    assert len(fn.ran) == (1 if check else 4)
    L.launch_args(fn, (1,), (x, 16), None, {"BLOCK": 64})  # without a spec key: its own entry
    assert len(fn.compiled) == 3


class GluonJITFunction(JITFunction):  # a Gluon kernel's class name: cached the same way
    pass


def test_gluon_kernels_are_cached_and_keyed_by_their_descriptors_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Gluon kernel (``moe_wgrad_gluon``'s) goes through the same cache. Its host tensor
    descriptors are keyed by what Triton specialises a descriptor parameter on (dtype,
    alignment, rank, box, shared layout, padding), not by address or value: hashable, and
    under OPREG_CHECK_SPEC a hit compares them without comparing the tensors inside."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    lay = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    lay64 = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    t = torch.randn(256, 128, dtype=torch.bfloat16)

    def key(x: torch.Tensor, box: list[int], layout: Any) -> Any:
        return L._arg_key(hopper.TensorDescriptor.from_tensor(x, box, layout))

    k = key(t, [64, 128], lay)
    assert hash(k) is not None and k == key(t.clone(), [64, 128], lay), "another address, the same type"
    assert k != key(t, [64, 64], lay) and k != key(t, [64, 128], lay64) and k != key(t.half(), [64, 128], lay)

    monkeypatch.setattr(L, "CHECK_SPEC", True)
    monkeypatch.setattr(L, "_direct_ok", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7)
    fn = GluonJITFunction()
    for _ in range(3):  # Triton's path, a miss (cached), a hit
        L.launch_args(fn, (1,), (hopper.TensorDescriptor.from_tensor(t.clone(), [64, 128], lay), 16), ("s",),
                      {"BLOCK": 32})
    assert len(fn.compiled) == 2 and len(fn.ran) == 1
    with pytest.raises(RuntimeError, match=r"positions \[0\]"):  # another layout under the same spec key
        L.launch_args(fn, (1,), (hopper.TensorDescriptor.from_tensor(t, [64, 128], lay64), 16), ("s",),
                      {"BLOCK": 32})
