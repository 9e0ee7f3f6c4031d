"""pytest-benchmark: transformers' sparse-MoE blocks, HF's experts implementations vs opreg.

    pytest -n 0 bench/bench_moe_block.py --benchmark-group-by=param:config,param:mode
    python bench/bench_moe_block.py [--tokens 1,64,512,4096,16384] [--rounds 7]   # the table (H200: bf16)

Variants, each on the same block weights and input: ``hf_eager`` (the per-expert loop),
``hf_grouped_mm`` (transformers' default), ``hf_grouped_mm_inductor`` (that under
``torch.compile``), ``opreg`` (``experts_implementation="opreg"``), ``opreg_inductor`` (that
under ``torch.compile``) and
``grouped_mm_backend_opreg`` (the grouped_mm block under ``torch.compile(backend="opreg")``) and
``hf_eager_optimize`` (the eager-loop block under ``opreg.optimize``: its loop rewritten);
and, asked for by name only, ``opreg_decode`` (``opreg`` with the decode kernels taken up to
``--decode-max-tokens`` tokens: the default's choice and an alternative timed side by side);
modes ``fwd`` and ``fwd+bwd``. Every variant's output is first checked against HF eager in
float64. On CUDA: the issue's three block configs at T = 4096, bf16; on the CPU a tiny
one in float32 (so CI runs this file).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers") if "pytest" in sys.modules else __import__("transformers")

import opreg  # noqa: E402
import opreg.integrations.transformers  # noqa: E402,F401  (registers "opreg")
from opreg.testing import TOL, assert_matches  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing as tm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# name: (config class, block class path, hidden, expert ffn, experts, top-k)
CONFIGS = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock", 2048, 4096, 8, 2),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", 2048, 768, 128, 8),
    "olmoe": ("OlmoeConfig", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock", 2048, 1024, 64, 8),
}
CPU_SIZES = (64, 32, 8, 2)  # hidden, ffn, experts (at most the config's), top-k; T = 64
VARIANTS = ["hf_eager", "hf_grouped_mm", "hf_grouped_mm_inductor", "opreg", "opreg_inductor",
            "grouped_mm_backend_opreg", "hf_eager_optimize"]
# The H200's bf16 matrix rate measured on random data (8192^3 products through PyTorch: 769-798
# TFLOP/s, the device notes' KINDS.md): the floor a block's expert GEMMs can't beat.
PEAK_TFLOPS = 790.0
MODES = ["fwd", "fwd+bwd"]
EXTRA_VARIANTS = ["opreg_decode"]  # only where --variants names them
DECODE_TRY = 4  # opreg_decode's decode bound (--decode-max-tokens)


class Decoding(torch.nn.Module):
    """``block`` (experts_implementation="opreg") with the fused forward's decode kernels taken
    up to ``tokens`` tokens (``moe_experts.DECODE_MAX_TOKENS`` set around each call; a
    training step saves the GEMM path's routing tables, so it runs as ``opreg``)."""

    def __init__(self, block: torch.nn.Module, tokens: int) -> None:
        super().__init__()
        from opreg.backends.triton import moe_experts as fused
        self.block, self.tokens, self.fused = block, tokens, fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        old = self.fused.DECODE_MAX_TOKENS
        self.fused.DECODE_MAX_TOKENS = max(old, self.tokens)
        try:
            return self.block(x)
        finally:
            self.fused.DECODE_MAX_TOKENS = old


def make_block(name: str, dtype: torch.dtype, device: str, cpu: bool) -> torch.nn.Module:
    """The family's MoE block with random weights (std 1/sqrt(fan-in))."""
    cfg_cls, path, h, ffn, e, k = CONFIGS[name]
    if cpu:
        h, ffn, e, k = CPU_SIZES
    sizes = dict(hidden_size=h, intermediate_size=ffn, moe_intermediate_size=ffn, num_local_experts=e,
                 num_experts=e, num_experts_per_tok=k, router_jitter_noise=0.0, norm_topk_prob=True)
    config = getattr(transformers, cfg_cls)(**sizes)
    module, cls = path.rsplit(".", 1)
    block_cls = getattr(__import__(f"transformers.models.{module}", fromlist=[cls]), cls)
    block = block_cls(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return block


def variant(block: torch.nn.Module, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A copy of ``block`` running as ``name`` says."""
    impl = {"hf_eager": "eager", "hf_eager_optimize": "eager", "opreg": "opreg",
            "opreg_inductor": "opreg", "opreg_decode": "opreg"}.get(name, "grouped_mm")
    b = copy.deepcopy(block)
    b.experts.config._experts_implementation = impl
    if name in ("hf_grouped_mm_inductor", "opreg_inductor"):
        return torch.compile(b)
    if name == "opreg_decode":
        return Decoding(b, DECODE_TRY)
    if name == "grouped_mm_backend_opreg":
        return torch.compile(b, backend="opreg")
    if name == "hf_eager_optimize":
        fast = opreg.optimize(b)
        assert all(f.matched for f in b.experts._opreg_loops) and b.experts._opreg_loops, \
            "opreg.optimize did not rewrite the expert loop"
        return fast
    return b


def step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mode: str,
         accumulate: bool = False) -> Callable[[], None]:
    """One call of ``fn`` on ``x``: under no_grad (``fwd``), or a training step (``fwd+bwd``):
    the gradients set to None, as ``optimizer.zero_grad()`` does by default, then forward and
    backward. ``accumulate``: keep the gradients instead, so each backward adds into every
    ``.grad`` (the tables before 2026-12-02's fourteenth session: a read-modify-write of every
    weight's gradient each step, 1.2 GB of them at Qwen3-MoE's sizes, which neither side's
    kernels choose and a training step with ``zero_grad()`` does not pay)."""
    if mode == "fwd":
        def fwd() -> None:
            with torch.no_grad():
                fn(x)
        return fwd
    xg = x.detach().requires_grad_()
    leaves = [xg] + (list(fn.parameters()) if isinstance(fn, torch.nn.Module) else [])

    def fwd_bwd() -> None:
        if not accumulate:
            for t in leaves:
                t.grad = None
        fn(xg).sum().backward()
    return fwd_bwd


def check(block: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
          mode: str = "fwd") -> float:
    """Normwise error of ``fn`` against HF eager in float64. In float32 it must be within
    tolerance; in bf16 it is reported, not asserted: bf16 router logits flip near-tied top-k
    choices, so even HF's own bf16 block is ~2 % off float64 (H200, 2026-12-01), and the
    experts' accuracy is tested with a fixed routing (tests/test_transformers.py). ``mode``:
    the grad mode of the call checked, the one then timed (a compiled ``fn`` compiles once
    per grad mode: checking the other one compiled a graph never timed, 14 s on the CPU)."""
    ref = copy.deepcopy(block).double()
    ref.experts.config._experts_implementation = "eager"
    with torch.set_grad_enabled(mode != "fwd"):
        got = fn(x if mode == "fwd" else x.detach().requires_grad_()).detach()
    with torch.no_grad():
        want = ref(x.double())
        if x.dtype != torch.bfloat16:
            assert_matches(got, want, x.dtype)
        return float((got.double() - want).norm() / want.norm())


def inputs(name: str, tokens: int, cpu: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    dtype = torch.float32 if cpu else torch.bfloat16
    block = make_block(name, dtype, DEVICE, cpu)
    x = torch.randn(1, tokens, block.experts.hidden_dim, device=DEVICE, dtype=dtype)
    return block, x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("var", VARIANTS)
@pytest.mark.parametrize("config", list(CONFIGS) if DEVICE == "cuda" else ["qwen3_moe"])
def test_moe_block(benchmark, config, var, mode):
    cpu = DEVICE == "cpu"
    block, x = inputs(config, 64 if cpu else 4096, cpu)
    torch._dynamo.reset()
    fn = variant(block, var)
    check(block, fn, x, mode)
    call = step(fn, x, mode)
    call()  # compile / plan outside the timing
    benchmark.extra_info.update(config=config, device=DEVICE, torch=torch.__version__,
                                transformers=transformers.__version__, tol=TOL[x.dtype])

    def timed() -> None:
        call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark(timed)


def expert_flops(config: str, tokens: int, mode: str, cpu: bool) -> float:
    """The experts' GEMM FLOPs (gated: up 2I wide, down I): forward 2 T k H 3I; backward
    twice that (the input and weight gradients)."""
    _, _, h, ffn, _, k = CONFIGS[config]
    if cpu:
        h, ffn, _, k = CPU_SIZES
    fwd = 2.0 * tokens * k * h * 3 * ffn
    return fwd if mode == "fwd" else 3 * fwd


def interleaved_us(steps: dict[str, Callable[[], None]], rounds: int, min_batch: int = 1) -> dict[str, float]:
    """Median µs per call of each step, by the project's timer (bench/_timing.py:
    ``rounds`` rounds, each timing every step, the order rotated). Why not one step after
    the other: the H200's clock sags under sustained load (the fused forward at T = 16384:
    2435-2458 µs in its first ~65 ms after an idle gap, 2700-2750 after, 2026-12-03), so
    the step timed first (HF's) ran up to ~11 % faster for it. ``min_batch``: calls a batch
    at least (a batch lasts ~2 ms: one call at T = 16384, or a training step at T = 4096,
    where a batch then also costs the host's start-up, see ``tm.interleaved``)."""
    variants = {v: tm.Variant(lambda i, f=f: f()) for v, f in steps.items()}
    times = tm.interleaved(variants, DEVICE, rounds=rounds, target_us=2000.0, min_batch=min_batch)
    return {v: tm.median(t) for v, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    global DECODE_TRY, CPU_SIZES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096", help="token counts, comma-separated (issue 18: 1,64,512,4096,16384)")
    p.add_argument("--configs", nargs="*", default=list(CONFIGS))
    p.add_argument("--cpu-sizes", default=",".join(map(str, CPU_SIZES)),
                   help="on the CPU: hidden, expert ffn, experts (at most the config's), top-k")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds, each timing every variant (a batch of ~2 ms of calls), the order rotated")
    p.add_argument("--min-batch", default="1",
                   help="calls a timed batch at least, comma-separated to time each in turn (1: a batch of "
                        "~2 ms, one call where a call is longer: it then costs the host's start-up as well; "
                        "a larger value gives back-to-back calls, as a model's layers run)")
    p.add_argument("--accumulate-grads", action="store_true",
                   help="fwd+bwd adds into the kept .grad of every weight each step (the tables before "
                        "2026-12-02's fourteenth session); default: set to None first, as zero_grad() does")
    p.add_argument("--modes", nargs="*", default=MODES, choices=MODES,
                   help="forward (no grad) and/or a training step (each compiled variant compiles once per mode)")
    p.add_argument("--traced-min-flops", type=float, default=None,
                   help="moe_experts_train.TRACED_MIN_FLOPS for this process (0: a compiled training step "
                        "always takes the fused ops; the default: the grouped path below 5e11 GEMM FLOPs)")
    p.add_argument("--inline-kernels", type=int, choices=(0, 1), default=None,
                   help="moe_experts_train.INLINE_KERNELS for this process (1: under torch.compile the fused "
                        "kernels are nodes of the graph, launched by Inductor's wrapper; 0: the custom ops)")
    p.add_argument("--gluon-training-ops", type=int, choices=(0, 1), default=None,
                   help="moe_experts_train.GLUON_TRAINING_OPS for this process (1: a compiled training step at "
                        "the sizes where eager runs Gluon kernels goes through the custom ops, not inline)")
    p.add_argument("--pre-bf16", type=int, choices=(0, 1), default=None,
                   help="moe_experts.PRE_BF16 for this process (1: a bf16 training step whose gate has no clamp "
                        "saves its pre-activation in bf16, rounded before the forward's gate)")
    p.add_argument("--traced-combine", type=int, choices=(0, 1), default=None,
                   help="moe_experts_grouped.TRACED_TORCH_COMBINE for this process (1: the grouped path traced "
                        "by torch.compile gathers and combines with torch's ops; 0: through scatter_combine)")
    p.add_argument("--decode-max-tokens", type=int, default=DECODE_TRY,
                   help="opreg_decode's bound: its forward takes the decode kernels up to this many tokens")
    p.add_argument("--variants", nargs="*", default=[v for v in VARIANTS if v != "hf_eager"],
                   help="default: all but hf_eager (the per-expert loop: 0.02-0.3x, 0.2 s a call at T 4096)")
    a = p.parse_args(argv)
    cpu = DEVICE == "cpu"
    CPU_SIZES = tuple(int(v) for v in a.cpu_sizes.split(","))
    if len(CPU_SIZES) != 4 or min(CPU_SIZES) < 1:
        p.error(f"--cpu-sizes {a.cpu_sizes}: four positive ints (hidden, expert ffn, experts, top-k)")
    if a.traced_min_flops is not None:
        from opreg.backends.triton import moe_experts_train
        moe_experts_train.TRACED_MIN_FLOPS = a.traced_min_flops
        print(f"moe_experts_train.TRACED_MIN_FLOPS = {a.traced_min_flops:g}")
    if a.inline_kernels is not None:
        from opreg.backends.triton import moe_experts_train
        moe_experts_train.INLINE_KERNELS = bool(a.inline_kernels)
        print(f"moe_experts_train.INLINE_KERNELS = {bool(a.inline_kernels)}")
    if a.gluon_training_ops is not None:
        from opreg.backends.triton import moe_experts_train
        moe_experts_train.GLUON_TRAINING_OPS = bool(a.gluon_training_ops)
        print(f"moe_experts_train.GLUON_TRAINING_OPS = {bool(a.gluon_training_ops)}")
    if a.pre_bf16 is not None:
        from opreg.backends.triton import moe_experts
        moe_experts.PRE_BF16 = bool(a.pre_bf16)
        print(f"moe_experts.PRE_BF16 = {moe_experts.PRE_BF16}")
    if a.traced_combine is not None:
        from opreg.ops import moe_experts_grouped
        moe_experts_grouped.TRACED_TORCH_COMBINE = bool(a.traced_combine)
        print(f"moe_experts_grouped.TRACED_TORCH_COMBINE = {bool(a.traced_combine)}")
    DECODE_TRY = a.decode_max_tokens
    min_batches = [int(b) for b in a.min_batch.split(",")]
    if any(b < 1 for b in min_batches):
        p.error(f"--min-batch {a.min_batch}: each value a positive int")
    variants = [v for v in VARIANTS + EXTRA_VARIANTS if v in a.variants]
    if "hf_grouped_mm_inductor" not in variants:
        p.error("the ratios are against hf_grouped_mm_inductor: keep it among --variants")
    what = f"float32, hidden / ffn / experts / top-k {CPU_SIZES}" if cpu else "bf16"
    print(f"device {torch.cuda.get_device_name() if not cpu else 'cpu'}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {what}, median of {a.rounds} "
          f"interleaved rounds (bench/_timing.py), us per call "
          f"(ratio = hf_grouped_mm_inductor / variant; TF/s of the experts' GEMMs; "
          f"floor = those FLOPs at {PEAK_TFLOPS:.0f} TF/s; fwd+bwd: "
          f"{'gradients accumulated' if a.accumulate_grads else 'gradients set to None each step'})")
    print("| config | T | mode | " + " | ".join(variants) + " | floor |")
    print("|---|---|---|" + "---|" * (len(variants) + 1))
    for config in a.configs:
        for tokens in (int(t) for t in a.tokens.split(",")):
            block, x = inputs(config, tokens, cpu)
            # Dynamo's cache is per code object (the block's forward), shared by every T and
            # config: without a reset the compiled variants hit the recompile limit (8) and
            # silently run eager (the H200 run of 2026-12-01 at T = 16384 did).
            torch._dynamo.reset()
            fns = {v: variant(block, v) for v in variants}
            errs = {v: check(block, fn, x, a.modes[0]) for v, fn in fns.items()}
            print(f"| {config} | {tokens} | error vs float64 | " + " | ".join(f"{errs[v]:.2e}" for v in variants)
                  + " | |")
            for mode in a.modes:
                steps = {v: step(fn, x, mode, a.accumulate_grads) for v, fn in fns.items()}
                for f in steps.values():  # compile (once per grad mode), allocator
                    for _ in range(3):
                        f()
                for mb in min_batches:
                    us = interleaved_us(steps, a.rounds, mb)
                    base, flops = us["hf_grouped_mm_inductor"], expert_flops(config, tokens, mode, cpu)
                    cells = [f"{us[v]:.0f} ({base / us[v]:.2f}x, {flops / us[v] / 1e6:.0f} TF/s)" for v in variants]
                    floor = flops / (PEAK_TFLOPS * 1e6)
                    label = mode if min_batches == [1] else f"{mode}, batch >= {mb}"
                    print(f"| {config} | {tokens} | {label} | " + " | ".join(cells) + f" | {floor:.1f} |",
                          flush=True)


if __name__ == "__main__":
    main()
