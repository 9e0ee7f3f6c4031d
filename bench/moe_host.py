"""Host cost of the fused MoE path on the CPU, with every kernel launch stubbed out.

    python bench/moe_host.py [--configs mixtral qwen3_moe olmoe] [--tokens 512] [--blocks]

Why: on the H200 box an eager MoE training step and the block at decode wait on their host
(bench/RESULTS.md, twentieth session), and a device call is scarce. The host work of our
launcher (configs, buffers, views, launch arguments) does not need a GPU to be measured:
here the Triton launches (``launch``, ``launch_args``) and ``torch._grouped_mm`` return at
once, on CPU tensors of the configs' shapes (hidden and expert sizes cut to 256 / 128, so
that allocations cost what the caching allocator's do, not megabytes of page mapping).
What this box's figures are: our Python's share; the H200 host ran the same code ~2-3x
slower (bench/RESULTS.md), and each real launch adds 8-15 µs there.

Rows, µs per call, min over rounds of back-to-back calls:

* the fused forward (T tokens), as the op runs it (no save), and with ``save=True`` (the
  training forward);
* the fused backward (``fused_experts_backward``) on that forward's saved tensors;
* at T = 1, 4 and 64: the decode path (``decode_forward``: per pair, grouped by expert) against the
  GEMM path it replaces;
* ``--blocks``: a whole transformers block's training step at T = 64 (router, integration,
  the fused training path, autograd), eager and under ``torch.compile``, beside HF's
  ``grouped_mm`` block compiled (its grouped_mm stubbed alike; Inductor's own CPU kernels for
  the rest of HF's experts do run, so that row is not host time alone). In fp32, the
  variants timed in 9 interleaved rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any, Callable, Iterator

import torch

from opreg.backends.triton import moe_experts as F
from opreg.backends.triton import moe_experts_backward as B

SHAPES = {"mixtral": (8, 2), "qwen3_moe": (128, 8), "olmoe": (64, 8)}  # experts, top-k
HIDDEN, FFN = 256, 128


def min_us(fn: Callable[[], Any], calls: int = 300, rounds: int = 9) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def _no_launch(*args: Any, **kwargs: Any) -> None:
    return None


def _no_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Any = None, **kwargs: Any) -> torch.Tensor:
    if a.dim() == 2 and b.dim() == 2:  # (K, M) x (K, N) grouped along K: (G, M, N)
        return torch.empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=a.dtype)
    return torch.empty((a.shape[0], b.shape[-1]), dtype=a.dtype)


@contextlib.contextmanager
def stubbed() -> Iterator[None]:
    """Every launch of the fused path returns at once (and nothing is checked on the device).
    The replay is off: with no launch to record, a call would become a plan of none, whose
    replay asks for a CUDA device; the Python path's host is what these rows measure (the
    replay's own is ``bench/moe_replay.py``'s, on a GPU)."""
    saved = (F.launch, F.launch_args, B.launch_args, torch._grouped_mm, F.REPLAY, F.REPLAY_TRAINING)
    F.launch = F.launch_args = B.launch_args = _no_launch
    torch._grouped_mm = _no_grouped_mm
    F.REPLAY = F.REPLAY_TRAINING = False
    try:
        yield
    finally:
        F.launch, F.launch_args, B.launch_args, torch._grouped_mm, F.REPLAY, F.REPLAY_TRAINING = saved


def op_args(e: int, k: int, t: int, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, ...]:
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    w1, w2 = torch.randn(e, 2 * FFN, HIDDEN, dtype=dtype), torch.randn(e, HIDDEN, FFN, dtype=dtype)
    return (torch.randn(t, HIDDEN, dtype=dtype), ids, torch.rand(t, k, dtype=dtype), w1, None, w2, None, "silu",
            True, False, False, 1.0, float("inf"))


def op_rows(name: str, t: int) -> None:
    e, k = SHAPES[name]
    args = op_args(e, k, t)
    spec = F.spec_of(*args)
    fwd = min_us(lambda: F.fused_experts_forward(*args, spec=spec))
    fwd_save = min_us(lambda: F.fused_experts_forward(*args, save=True, spec=spec))
    _, saved = F.fused_experts_forward(*args, save=True, spec=spec)
    g = torch.randn(t, HIDDEN, dtype=args[0].dtype)
    bwd = min_us(lambda: B.fused_experts_backward(g, *args, saved, fwd_spec=spec))
    print(f"{name:9s} T={t:<5d} forward {fwd:6.1f}   forward, save {fwd_save:6.1f}   backward {bwd:6.1f} us")
    for t_dec, launches in ((1, 2), (4, 3), (64, 3)):  # the per-pair decode kernels; the grouped ones
        few = op_args(e, k, t_dec)
        spec1 = F.spec_of(*few)
        dec = min_us(lambda: F.fused_experts_forward(*few, spec=spec1))
        real = F.decodes
        F.decodes = lambda *a: False
        try:
            gemm = min_us(lambda: F.fused_experts_forward(*few, spec=spec1))
        finally:
            F.decodes = real
        print(f"{name:9s} T={t_dec:<5d} decode path {dec:6.1f} ({launches} launches)   GEMM path {gemm:6.1f} us "
              f"(4-5 launches)")


def block_rows(name: str, t: int = 64) -> None:
    """A transformers block's training step, the fused path's launches stubbed."""
    import transformers

    import opreg.integrations.transformers  # noqa: F401  (registers "opreg")
    from opreg.backends.triton import moe_experts_train as TR
    from opreg.integrations import transformers as integ

    import bench_moe_block as bm

    cfg_cls, path, _, _, e, k = bm.CONFIGS[name]
    config = getattr(transformers, cfg_cls)(hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN,
                                            num_local_experts=e, num_experts=e, num_experts_per_tok=k,
                                            router_jitter_noise=0.0, norm_topk_prob=True)
    mod, cls = path.rsplit(".", 1)
    # fp32: the router's matmuls and their gradients run for real here, and bf16 ones on this
    # box's CPU took ~1.4 ms a step, hiding the host work this measures
    block = getattr(__import__(f"transformers.models.{mod}", fromlist=[cls]), cls)(config).to(torch.float32)
    hf = copy.deepcopy(block)
    block.experts.config._experts_implementation = "opreg"
    hf.experts.config = copy.copy(hf.experts.config)
    hf.experts.config._experts_implementation = "grouped_mm"
    x = torch.randn(1, t, HIDDEN, dtype=torch.float32).requires_grad_()
    trains, checked = integ._fused_train.fused_trains, F.checked
    integ._fused_train.fused_trains = TR.fused_trains = lambda args: True  # the CUDA path, on CPU tensors
    F.checked = lambda args: (F.spec_of(*args), None)
    try:
        torch._dynamo.reset()
        steps = {}
        for label, m in (("opreg eager", block), ("opreg compiled", torch.compile(block)),
                         ("HF grouped_mm compiled", torch.compile(hf))):
            leaves = [x] + list(m.parameters())

            def step(m: Any = m, leaves: list[torch.Tensor] = leaves) -> None:
                for p in leaves:
                    p.grad = None
                m(x).sum().backward()
            steps[label] = step
        for s in steps.values():
            s()
        # interleaved rounds (this box swings +-50 % between runs): min per variant
        rounds = [{label: min_us(s, calls=30, rounds=1) for label, s in steps.items()} for _ in range(9)]
        got = {label: min(r[label] for r in rounds) for label in steps}
    finally:
        integ._fused_train.fused_trains = TR.fused_trains = trains
        F.checked = checked
    print(f"{name:9s} block training step, T={t}: " + ", ".join(f"{k} {v:.0f} us" for k, v in got.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(SHAPES))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--blocks", action="store_true", help="also whole blocks' training steps (compiles; ~1 min)")
    a = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU, launches stubbed; hidden {HIDDEN}, expert ffn {FFN}, bf16; "
          "µs per call (min of rounds)")
    with stubbed():
        for name in a.configs:
            op_rows(name, a.tokens)
        if a.blocks:
            for name in a.configs:
                block_rows(name)


if __name__ == "__main__":
    main()
