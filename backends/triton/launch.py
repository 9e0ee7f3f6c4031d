"""Launch a ``@triton.jit`` kernel with less host time than ``kernel[grid](...)``.

Why: Triton's launch path specialises every argument, builds a string cache key and checks
the kernel's globals on every call: with the MoE kernels' ~45 arguments that is 40-50 us of
host time per launch on the H200 box (``bench/moe_profile.py --host-profile``), and the
fused forward launches five kernels, so a decode-sized call was all host time.

:func:`launch` keeps, per kernel, the compiled kernel Triton chose for a key that is at
least as fine as Triton's own specialisation (each tensor's dtype and 16-byte alignment;
each int's range class, divisibility by 16 and equality to 1; every constexpr and launch
option by value; the device), so a hit runs exactly the binary Triton's path would run. A
miss, the interpreter, a launch hook (a profiler's), or a Triton whose compiled-kernel
call differs (checked once) all take Triton's own path. Launches go to the current
stream of the current device, as Triton's do (so CUDA-graph capture sees them).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from opreg._log import log_once

try:
    import triton
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - callers only launch where triton imports
    triton = None
    _knobs = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:
    _TensorDescriptor = None

__all__ = ["launch"]

_I32 = 2 ** 31
_CACHE_LIMIT = 4096  # entries per kernel
_direct_ok: bool | None = None  # None: not tried yet; False: this Triton's kernel call differs


def _arg_key(a: Any) -> Any:
    """What Triton's specialisation can depend on, for one argument (finer is fine)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a & 15 == 0, -_I32 <= a < _I32, 0 <= a < 2 ** 64)
    if isinstance(a, float):
        return "f"
    if _TensorDescriptor is not None and isinstance(a, _TensorDescriptor):  # specialised on its type and box
        return ("desc", a.base.dtype, a.base.data_ptr() & 15 == 0, len(a.shape), tuple(a.block_shape),
                getattr(a, "padding", None), getattr(a, "round_f32_to_tf32", None))
    return a  # None, strings, constexprs: by value


def _hooked(hook: Any) -> bool:
    # triton >= 3.8 keeps a (usually empty) HookChain there; older ones None or a callable
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _hooks() -> bool:
    rt = _knobs.runtime
    return _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook)


def _tail(fn: Any, n_args: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The parameters after the positional ones, in signature order (kwargs or defaults)."""
    params = list(fn.signature.parameters.values())[n_args:]
    return tuple(kwargs.get(p.name, p.default) for p in params)


def launch(fn: Any, grid: tuple[int, ...], *args: Any, spec_key: Any = None, **kwargs: Any) -> None:
    """``fn[grid](*args, **kwargs)`` (``kwargs``: the constexprs and launch options), with a
    cached compiled kernel on a hit (see the module docstring).

    ``spec_key``: the caller's promise that this hashable value determines everything the
    key would read (each argument's dtype, alignment and int class; the constexprs and
    options), e.g. the shapes, strides, dtypes and alignments of the op's inputs that every
    argument here is derived from. It replaces that key: building it cost ~35 us per launch
    of the MoE GEMM's ~45 arguments on the 2-core box, more than the launch itself."""
    global _direct_ok
    cache = getattr(fn, "_opreg_launch_cache", None)
    if cache is None or _direct_ok is False or _hooks():
        if cache is None and type(fn).__name__ == "JITFunction":
            fn._opreg_launch_cache = {}
        fn[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    if spec_key is not None:
        key = (device, "spec", spec_key)
    else:
        key = (device, tuple(map(_arg_key, args)), tuple(kwargs.items()))
    hit = cache.get(key)
    if hit is None:
        kernel = fn[grid](*args, **kwargs)
        if len(cache) >= _CACHE_LIMIT:  # spec keys are per input shape: serving sees many
            cache.clear()
        # the compiled kernel takes every parameter in signature order, constexprs included
        cache[key] = (kernel, _tail(fn, len(args), kwargs))
        return
    kernel, tail = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    if _direct_ok:
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *tail)
        return
    try:  # the first direct call: does this Triton's compiled-kernel call take these?
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *tail)
        _direct_ok = True
    except (TypeError, AttributeError) as e:
        _direct_ok = False
        log_once(("triton-launch", str(e)), logging.INFO,
                 "opreg: triton %s: compiled kernels called through Triton's launcher (%s)",
                 getattr(triton, "__version__", "?"), e)
        fn[grid](*args, **kwargs)
