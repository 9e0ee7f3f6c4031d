"""The experts' weight gradients as one persistent Triton GEMM with TMA loads and stores.

``out[e] = p[rows_e]^T @ q[rows_e]`` for every expert e, where ``rows_e = [ends[e-1], ends[e])``
are expert e's rows in the sorted, padded row order of the fused path (``ends``: the routing's
fourth table, each expert's padded end row). p is (S, A), q is (S, B), out (E, A, B).

Why a kernel of our own: at many experts with few rows each (Qwen3-MoE at T = 4096: ~256-320
padded rows per expert) the reduction is short and the gradients are large (1.2 GB of bf16
written per step), and ``torch._grouped_mm`` (CUTLASS) ran the two weight gradients at ~350
TF/s (891 µs, bench/RESULTS.md, twelfth session). Here a program per SM walks the output tiles
of every expert (all experts' tiles are the same shape; only the reduction length differs),
loads both operands through TMA and stores each tile through TMA, so that a tile's store
drains while the next tile's loads are in flight.

The reduction steps BLOCK_K rows at a time and TMA cannot mask rows inside a tensor, so every
expert's row count must be a multiple of BLOCK_K (:func:`unfit`); the padding rows must be 0 in
p or q, as for ``torch._grouped_mm``.
"""
from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - callers check unfit() first
    triton = tl = None

from .launch import LazyDescriptor, launch

__all__ = ["unfit", "wgrad"]

# the default tile (the wgrad table's "inf" entry): BLOCK_M x BLOCK_N outputs, BLOCK_K rows a step
DEFAULT = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)


def unfit(row_block: int, widths: tuple[int, ...], dtype: torch.dtype,
          config: dict[str, int] | None = None) -> str | None:
    """Why :func:`wgrad` can't take operands of ``dtype`` whose output rows (A) have these
    ``widths``, walked in padded row blocks of ``row_block``, or None. What is left to the
    tensors themselves (rows with unit stride, 16-byte aligned rows and base) the fused
    backward's buffers hold by construction; :func:`wgrad` checks them."""
    c = config or DEFAULT
    if triton is None:
        return "triton is not installed"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} is not a 16-bit float"
    if row_block % c["BLOCK_K"]:
        return f"the padded row block {row_block} is not a multiple of BLOCK_K = {c['BLOCK_K']}"
    for a in widths:
        # the store's box must not cross into the next expert's rows (the output is
        # stored as a 2-D (E * A, B) view)
        if a % c["BLOCK_M"]:
            return f"an output row count {a} is not a multiple of BLOCK_M = {c['BLOCK_M']}"
    return None


def _tma_rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


if triton is not None:
    @triton.jit
    def _wgrad_kernel(p_desc, q_desc, o_desc, ends_ptr, E, A, B,
                      BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                      NUM_PROGRAMS: tl.constexpr):
        tiles_a = tl.cdiv(A, BLOCK_A)
        tiles_b = tl.cdiv(B, BLOCK_B)
        per_expert = tiles_a * tiles_b
        total = E * per_expert
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS):
            e = tile // per_expert
            rem = tile - e * per_expert
            # neighbouring programs take neighbouring B tiles of the same A rows (p's tile
            # stays in L2 across them)
            ta = rem // tiles_b
            tb = rem - ta * tiles_b
            start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
            end = tl.load(ends_ptr + e)
            acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
            for k in range(start, end, BLOCK_K):
                a = p_desc.load([k, ta * BLOCK_A])  # (BLOCK_K, BLOCK_A)
                b = q_desc.load([k, tb * BLOCK_B])  # (BLOCK_K, BLOCK_B)
                acc = tl.dot(a.trans(1, 0), b, acc)
            o_desc.store([e * A + ta * BLOCK_A, tb * BLOCK_B], acc.to(o_desc.dtype))


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def wgrad(p: torch.Tensor, q: torch.Tensor, ends: torch.Tensor, experts: int,
          config: dict[str, int] | None = None, spec_key: Any = None) -> torch.Tensor:
    """``out[e] = p[rows_e]^T q[rows_e]``: p (S, A), q (S, B) 16-bit, rows in the fused
    path's sorted padded order; ``ends`` (E,) int32, each expert's padded end row; returns
    (E, A, B) in p's dtype, fp32 accumulation, one fixed order (deterministic). An expert
    with no rows gets exact zeros. The caller checked :func:`unfit` (with ``config``'s tile:
    BLOCK_M x BLOCK_N outputs, BLOCK_K rows a step). ``spec_key``: as
    :func:`.launch.launch`'s, for a caller whose operands' metadata it determines."""
    c = config or DEFAULT
    s, a = p.shape
    b = q.shape[1]
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    if not (_tma_rows(p) and _tma_rows(q) and q.shape[0] == s and p.dtype == q.dtype):
        raise ValueError(f"moe_wgrad: operands {list(p.shape)} {p.stride()} and {list(q.shape)} {q.stride()} "
                         "need unit column strides, 16-byte aligned rows and the same rows and dtype")
    out = torch.empty((experts, a, b), dtype=p.dtype, device=p.device)
    o2 = out.view(experts * a, b)
    tiles = experts * triton.cdiv(a, bm) * triton.cdiv(b, bn)
    progs = max(1, min(tiles, _sms(p.device)))
    args = tuple(LazyDescriptor(t, box, (t.dtype, tuple(t.shape), t.stride(), tuple(box)))
                 for t, box in ((p, [bk, bm]), (q, [bk, bn]), (o2, [bm, bn])))
    launch(_wgrad_kernel, (progs,), *args, ends, experts, a, b, spec_key=spec_key, BLOCK_A=bm, BLOCK_B=bn,
           BLOCK_K=bk, NUM_PROGRAMS=progs, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out
