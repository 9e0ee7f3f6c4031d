"""Host time of one Triton launch, by layer of Triton's launch path (CUDA).

    python bench/launch_overhead.py [--tokens 64] [--reps 3000]

The fused MoE forward's GEMM1 and combine launches (Qwen3-MoE sizes, bf16), each enqueued
``reps`` times with no sync inside (grid of one program, so the GPU never holds the host
back), µs per launch:

* ``triton``: ``fn[grid](...)``, Triton's own path;
* ``launch()``: :func:`opreg.backends.triton.launch.launch_args` with a spec key, as the
  forward calls it (a cached compiled kernel; on triton 3.6 through its C launcher, tensor
  descriptors passed unbuilt);
* ``kernel.run``: the same call without ``launch()``'s Python;
* ``kernel.run, int pointers``: tensors passed as their data pointers (the launcher skips
  ``data_ptr()`` and, on triton 3.6, ``cuPointerGetAttribute``);
* ``raw launcher``: triton 3.6's generated C ``launch`` with the tensor descriptors
  expanded once (what a per-spec plan could call); "n/a" where the layout differs.

Also the host time of the whole op at ``--tokens`` (the fused forward, its spec given).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from opreg.backends.triton import launch as L
from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import tune
from opreg.testing.timing import host_us


class Recorder:
    """Records the (fn, grid, args, kwargs, spec_key) of every launch through the forward's
    ``launch`` and ``launch_args``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def launch(self, fn: Any, grid: tuple[int, ...], *args: Any, spec_key: Any = None, **kwargs: Any) -> None:
        self.launch_args(fn, grid, args, spec_key, kwargs)

    def launch_args(self, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], spec_key: Any,
                    kwargs: dict[str, Any]) -> None:
        self.calls.append((fn, grid, args, kwargs, spec_key))
        L.launch_args(fn, grid, args, spec_key, kwargs)


def raw_launcher(kernel: Any) -> Any:
    """triton 3.6's generated C launch behind ``kernel.run`` (and the descriptor indices), or None."""
    run = kernel.run
    inner = getattr(run, "launch", None)
    if inner is None:
        return None
    if type(inner).__name__ == "builtin_function_or_method":
        return inner, set(), []
    cells = {c.cell_contents.__class__.__name__: c.cell_contents for c in (inner.__closure__ or ())}
    launcher = next((v for k, v in cells.items() if k == "builtin_function_or_method"), None)
    idx = next((v for v in cells.values() if isinstance(v, set)), None)
    meta = next((v for v in cells.values() if isinstance(v, list)), None)
    if launcher is None or idx is None:
        return None
    return launcher, idx, meta


def rows_for(name: str, fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any],
             spec: Any, reps: int) -> None:
    grid1 = (1,) * len(grid)
    dev = torch.cuda.current_device()
    stream = torch._C._cuda_getCurrentRawStream(dev)
    lazy, args = args, L._built(args)  # the descriptors as the forward passes them, and built
    kernel = fn[grid1](*args, **kwargs)
    tail = L._tail(fn, len(args), kwargs)
    ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    res = {
        "triton": lambda: fn[grid1](*args, **kwargs),
        "launch()": lambda: L.launch_args(fn, grid1, lazy, ("bench", spec), kwargs),
        "kernel.run": lambda: kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                                         *args, *tail),
        "kernel.run, int pointers": lambda: kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata,
                                                       None, None, None, *ints, *tail),
    }
    raw = raw_launcher(kernel)
    if raw is not None and getattr(kernel.run, "global_scratch_size", 1) == 0 \
            and getattr(kernel.run, "profile_scratch_size", 0) == 0:
        launcher, idx, meta = raw
        from triton.backends.nvidia import driver as D
        flat: list[Any] = []
        d = 0
        for i, a in enumerate((*ints, *tail)):
            if i in idx:
                m = meta[d] if meta else None
                d += 1
                flat.extend(D.make_tensordesc_arg(a, m) if a is not None else [a])
            else:
                flat.append(a)
        run = kernel.run
        base = (run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata, None, None, None)
        try:
            launcher(1, 1, 1, stream, kernel.function, *base, *flat)
            torch.cuda.synchronize()
            res["raw launcher"] = lambda: launcher(1, 1, 1, stream, kernel.function, *base, *flat)
        except Exception as e:  # noqa: BLE001 - a measurement: say why and go on
            print(f"  raw launcher failed: {type(e).__name__}: {e}")
    print(f"{name}: {len(args)} positional args")
    for k, call in res.items():
        print(f"  {k:28s} {host_us(call, reps, warmup=20):7.2f} us per launch")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3000)
    a = p.parse_args()
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    e, h, ffn, k = 128, 2048, 768, 8
    args = tune.inputs(e, h, ffn, k, a.tokens, torch.bfloat16, "cuda")
    spec = F.spec_of(*args)
    with torch.no_grad():
        for t in (1, a.tokens, 4096):
            at = tune.inputs(e, h, ffn, k, t, torch.bfloat16, "cuda")
            st = F.spec_of(*at)
            us = host_us(lambda: F.fused_experts_forward(*at, spec=st), 300, warmup=20)
            print(f"whole op, T={t}: {us:.1f} us of host per call (GPU-bound where the GPU time is larger)")
        rec = Recorder()
        old = F.launch, F.launch_args
        F.launch, F.launch_args = rec.launch, rec.launch_args
        try:
            F.fused_experts_forward(*args, spec=spec)
        finally:
            F.launch, F.launch_args = old
        torch.cuda.synchronize()
        for fn, grid, fargs, kwargs, sk in rec.calls:
            rows_for(getattr(fn, "__name__", repr(fn)), fn, grid, fargs, kwargs, sk, a.reps)


if __name__ == "__main__":
    main()
