"""The tile-level device functions the MoE Triton kernels share: the activation and the gate
on fp32 tiles, a program's tile in GEMM order, and a routed GEMM tile's main loop. The
forward (:mod:`.moe_experts`), the backward (:mod:`.moe_experts_backward`) and the Gluon
GEMM1 (:mod:`.moe_gemm1_gluon`) call them, so each is written once: Triton inlines them.

Also where ``triton`` is imported for those modules (:data:`NO_TRITON` says why not), and
whether the kernels run under Triton's CPU interpreter (:func:`interpreting`).
"""
from typing import Optional

from opreg.ops import moe_experts as M

try:
    import triton
    import triton.language as tl
    NO_TRITON: Optional[str] = None
except ImportError as _e:  # the op still imports; the implementation lists itself as unavailable
    triton = None
    NO_TRITON = f"triton is not installed ({_e})"

    class tl:  # type: ignore[no-redef]  # just enough for the kernel signatures below
        constexpr = object

jit = triton.jit if triton is not None else (lambda fn: fn)

# Activation ids shared by the kernels and the launcher (tl.constexpr ACT).
ACT_IDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4, "sigmoid": 5, M.GPT_OSS: 6}
IDENTITY = -1  # GEMM2: no activation

__all__ = ["ACT_IDS", "IDENTITY", "NO_TRITON", "activate", "activate_grad", "gate_tile", "gate_tile_grad",
           "gate_up_cols", "interpreting", "jit", "program_tile", "routed_mma", "tile_of", "tl", "triton", "w_tile"]


@jit
def activate(x, ACT: tl.constexpr):
    """The ungated activation (fp32 in, fp32 out); ids as in ACT_IDS."""
    if ACT == 0:  # silu
        y = x * tl.sigmoid(x)
    elif ACT == 1:  # gelu, erf form (F.gelu's default)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh form: 0.5x(1 + tanh(u)) == x * sigmoid(2u), no tanh needed
        y = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif ACT == 3:  # relu
        y = tl.maximum(x, 0.0)
    elif ACT == 4:  # relu2
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 5:  # sigmoid
        y = tl.sigmoid(x)
    else:  # IDENTITY
        y = x
    return y


@jit
def gate_tile(acc0, acc1, alpha, limit, GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """apply_gate on fp32 tiles: ``act(acc0)``, or gated with acc0 = gate, acc1 = up."""
    if GATED:
        gate = acc0
        up = acc1
        if HAS_LIMIT:  # apply_gate's clamps: gate <= limit, |up| <= limit
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        if ACT == 6:  # gpt_oss
            y = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:
            y = activate(gate, ACT) * up
    else:
        y = activate(acc0, ACT)
    return y


@jit
def activate_grad(x, ACT: tl.constexpr):
    """d act(x) / dx (fp32), ids as in ACT_IDS; relu's at 0 is 0, as torch's."""
    if ACT == 0:  # silu: s + x s (1 - s)
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    elif ACT == 1:  # gelu (erf): Phi(x) + x phi(x)
        d = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 2:  # gelu (tanh) = x sigmoid(2u), u = c (x + 0.044715 x^3)
        s = tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
        d = s + x * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * x * x)
    elif ACT == 3:  # relu
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 4:  # relu2
        d = 2.0 * tl.maximum(x, 0.0)
    else:  # sigmoid
        s = tl.sigmoid(x)
        d = s * (1.0 - s)
    return d


@jit
def gate_tile_grad(p0, p1, dy, alpha, limit, GATED: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   GATE_TIE: tl.constexpr, UP_LO_TIE: tl.constexpr, UP_HI_TIE: tl.constexpr):
    """The gate's backward on fp32 tiles: (d p0, d p1, y) for the pre-activation (p0 = gate
    half, p1 = up half when GATED; else p0 alone) and dy = dL/dy. Where a clamp clips, the
    derivative is 0 (a ``where``, so a NaN or inf there does not leak); at a tie (a value
    exactly at the limit) it is what torch's clamp backward gives (``*_TIE``: 1 or 0,
    :func:`.moe_experts_backward.clamp_ties`)."""
    if GATED:
        gate = p0
        up = p1
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        if ACT == 6:  # gpt_oss: (up + 1) * gate * sigmoid(alpha * gate)
            s = tl.sigmoid(gate * alpha)
            glu = gate * s
            y = (up + 1.0) * glu
            d_up = dy * glu
            d_gate = dy * (up + 1.0) * (s + alpha * glu * (1.0 - s))
        else:
            a = activate(gate, ACT)
            y = a * up
            d_up = dy * a
            d_gate = dy * up * activate_grad(gate, ACT)
        if HAS_LIMIT:
            if GATE_TIE:
                pass_gate = p0 <= limit
            else:
                pass_gate = p0 < limit
            if UP_LO_TIE:
                pass_lo = p1 >= -limit
            else:
                pass_lo = p1 > -limit
            if UP_HI_TIE:
                pass_hi = p1 <= limit
            else:
                pass_hi = p1 < limit
            d_gate = tl.where(pass_gate, d_gate, 0.0)
            d_up = tl.where(pass_lo & pass_hi, d_up, 0.0)
    else:
        y = activate(p0, ACT)
        d_gate = dy * activate_grad(p0, ACT)
        d_up = d_gate  # unused
    return d_gate, d_up, y


@jit
def program_tile(block_expert_ptr, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """This program's (M block, N block) in GROUP_M-swizzled order (consecutive programs
    walk down GROUP_M row blocks of one column tile, so the expert's weight tile is reused
    from L2), and the M block's expert (-1: past the last padded row)."""
    return tile_of(tl.program_id(0), block_expert_ptr, num_m_blocks, num_n_blocks, GROUP_M)


@jit
def tile_of(pid, block_expert_ptr, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """:func:`program_tile` of tile ``pid`` (a persistent program walks several)."""
    group = GROUP_M * num_n_blocks
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    expert = tl.load(block_expert_ptr + pid_m)
    return pid_m, pid_n, expert


@jit
def w_tile(w_ptrs, k_ok, col_ok, w_desc, expert, wn, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           W_TMA: tl.constexpr, W_KMAJOR: tl.constexpr):
    """One (BLOCK_K, BLOCK_N) tile of W for :func:`routed_mma`: through the descriptor (rows wn..
    of ``expert``, K-major or not) or the pointers."""
    if W_TMA:
        if W_KMAJOR:
            return w_desc.load([expert, wn, k0]).reshape(BLOCK_N, BLOCK_K).trans(1, 0)
        return w_desc.load([expert, k0, wn]).reshape(BLOCK_K, BLOCK_N)
    return tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)


@jit
def routed_mma(a_ptr, a_row, row_ok, stride_am, stride_ak, w_base, wcol0, wcol1, col_ok, stride_wn, stride_wk, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
               DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr = False,
               w_desc=None, expert=0, wn0=0, wn1=0, W_TMA: tl.constexpr = False, W_KMAJOR: tl.constexpr = True,
               a_desc=None, a_row0=0, A_TMA: tl.constexpr = False):
    """The main loop of a routed GEMM tile: acc0[m, n] = sum over k of A[a_row[m], k] *
    W[wcol0[n], k] (and acc1 with wcol1 when GATED), fp32; rows not ``row_ok`` and columns
    not ``col_ok`` load zeros. W is seen through (stride_wn, stride_wk) from ``w_base``, the
    expert's slice. Shared by the forward GEMMs and the backward's (inlined: one loop).

    W_TMA: W's tiles come through the tensor descriptor ``w_desc`` instead (rows wn0.. and
    wn1.. of ``expert``: (E, N, K) when W_KMAJOR, else (E, K, N)); the descriptor zero-fills
    past its edges, and a column past N reads a row that only feeds a column never stored.
    A_TMA: A's rows are the contiguous a_row0 .. a_row0 + BLOCK_M of ``a_desc`` (the sorted
    rows; a padding row reads the next expert's row, or the descriptor's zeros past the
    end, which only feeds its own output row, never stored). EVEN_K: K is
    a multiple of BLOCK_K, so A's loads need no K mask."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :] * stride_ak
    w0_ptrs = w_base + ks[:, None] * stride_wk + wcol0[None, :] * stride_wn
    w1_ptrs = w_base + ks[:, None] * stride_wk + wcol1[None, :] * stride_wn
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the up half; unused unless GATED
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kb * BLOCK_K
        k_ok = ks < K - k0
        if A_TMA:
            a = a_desc.load([a_row0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w0 = w_tile(w0_ptrs, k_ok, col_ok, w_desc, expert, wn0, k0, BLOCK_N, BLOCK_K, W_TMA, W_KMAJOR)
        acc0 = tl.dot(a, w0, acc0, input_precision=DOT_PRECISION)
        if GATED:
            w1 = w_tile(w1_ptrs, k_ok, col_ok, w_desc, expert, wn1, k0, BLOCK_N, BLOCK_K, W_TMA, W_KMAJOR)
            acc1 = tl.dot(a, w1, acc1, input_precision=DOT_PRECISION)
            w1_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w0_ptrs += BLOCK_K * stride_wk
    return acc0, acc1


@jit
def gate_up_cols(cols, N, INTERLEAVED: tl.constexpr):
    """gate_up's columns of the gate and up halves for output columns ``cols``: (cols,
    cols + N), or (2 cols, 2 cols + 1) where the halves are interleaved."""
    if INTERLEAVED:
        c0 = 2 * cols
        c1 = 2 * cols + 1
    else:
        c0 = cols
        c1 = cols + N
    return c0, c1


# Fixed at import (Dynamo on torch 2.11 cannot take ``type()`` of a Triton kernel).
_INTERPRETING = triton is not None and type(activate).__name__ == "InterpretedFunction"


def interpreting() -> bool:
    """Do the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)?
    A bool fixed at import: Dynamo on torch 2.11 cannot take ``type()`` of a Triton kernel
    ("TritonKernelVariable() has no type"), and ``why_not_fused`` asks this inside compiled
    training."""
    return _INTERPRETING
