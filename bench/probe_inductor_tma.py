"""Can ``torch.compile`` launch a user Triton kernel that takes a host-side TensorDescriptor
(TMA) from Inductor's own wrapper? (CUDA, sm90+.)

    python bench/probe_inductor_tma.py

Why: under ``torch.compile`` the fused MoE ops cost their Python and launches on the host
(bench/RESULTS.md, twenty-eighth and twenty-ninth sessions); Inductor could launch their
kernels itself if it traced them, but the GEMMs load through host-side tensor descriptors.
Two ways in, each checked here on a toy kernel (output and gradient against 2x):
(a) ``wrap_triton`` launches traced by Dynamo inside an ``autograd.Function`` (forward and
backward), descriptors from ``TensorDescriptor.from_tensor``; (b) the same launch inside a
``torch.library.triton_op`` (traced without Dynamo). H200, torch 2.11 / triton 3.6
(twenty-ninth session): (a) compiles and is correct; (b) fails in Inductor ("tolist()
shouldn't be called on a tensor with unallocated storage"): that tracing path keeps a
descriptor as a constant. Prints each case's result and host µs per no-grad call."""
import time
import traceback

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
from torch.library import wrap_triton, triton_op


@triton.jit
def twice(a_desc, out_ptr, BLOCK: tl.constexpr, W: tl.constexpr):
    pid = tl.program_id(0)
    x = a_desc.load([pid * BLOCK, 0])
    offs = (pid * BLOCK + tl.arange(0, BLOCK))[:, None] * W + tl.arange(0, W)[None, :]
    tl.store(out_ptr + offs, x * 2)


def launch(a):
    out = torch.empty_like(a)
    d = TensorDescriptor.from_tensor(a, [64, 64])
    wrap_triton(twice)[(a.shape[0] // 64,)](d, out, BLOCK=64, W=64)
    return out


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return launch(a)

    @staticmethod
    def backward(ctx, g):
        return launch(g.contiguous())


@triton_op("probe::twice", mutates_args=())
def twice_op(a: torch.Tensor) -> torch.Tensor:
    return launch(a)


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return h


def main() -> None:
    a = torch.randn(256, 64, device="cuda", requires_grad=True)
    print("torch", torch.__version__, "triton", triton.__version__)
    for name, body in [("dynamo autograd.Function", lambda x: Fn.apply(x).sum()),
                       ("triton_op fwd", lambda x: twice_op(x.detach()).sum())]:
        try:
            torch._dynamo.reset()
            f = torch.compile(body, fullgraph=True)
            y = f(a)
            ok = torch.allclose(y, (a.detach() * 2).sum())
            if name.startswith("dynamo"):
                a.grad = None
                y.backward()
                ok = ok and torch.equal(a.grad, torch.full_like(a, 2.0))
            print(f"{name}: ok={ok}", flush=True)
            with torch.no_grad():
                compiled, eager = host_us(lambda: f(a)), host_us(lambda: body(a))
            print(f"  host us/call, no grad: compiled {compiled:.1f}, eager {eager:.1f}")
        except Exception:  # noqa: BLE001
            print(f"{name}: FAILED")
            traceback.print_exc(limit=3)


if __name__ == "__main__":
    main()
