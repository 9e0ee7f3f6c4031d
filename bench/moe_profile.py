"""Where a MoE block's time goes with ``experts_implementation="opreg"`` (CUDA).

    python bench/moe_profile.py [--tokens 4096] [--configs mixtral qwen3_moe olmoe]

Per config and T, bf16, in one process:

* ``op, uniform``: the fused forward alone on uniform random routing (what ``opreg tune`` times);
* ``op, block's routing``: the same op on the block's own router output;
* ``block``: the whole block (router + experts), no grad;
* for each: the GPU time (CUDA events, median of back-to-back calls) and the host time to
  enqueue one call (wall clock of a batch of calls, no sync inside; a call whose host time
  exceeds its GPU time is launch-bound, and events then measure the host);
* the block's kernels by device time (torch.profiler, one call), and the routing's balance
  (rows of the busiest expert / the mean).
"""
from __future__ import annotations

import argparse

import torch

import opreg  # noqa: F401
import opreg.integrations.transformers  # noqa: F401
from opreg.backends.triton import moe_experts as fused
from opreg.backends.triton import tune
from opreg.testing.timing import host_once_us, host_us, median_us

import bench_moe_block as bb


def host_profile(call, reps: int) -> None:
    """Where one call's host time goes: cProfile over ``reps`` calls, top functions by own time."""
    import cProfile
    import pstats

    call()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        call()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumtime").print_stats(30)


def host_table(call, steps: int = 5) -> str:
    """The host side under torch.profiler over ``steps`` calls, by self CPU time (a launch or
    an allocation that blocks on the GPU shows up as a large self time on a cuda* runtime
    call). A first profile runs untimed: the profiler's one-off set-up ("Activity Buffer
    Request", 2.1-2.6 ms on the H200 box) landed in the twentieth session's tables."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                call()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60)


def router(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's top-k ids and weights for ``x`` (T, H), as its forward computes them."""
    gate = block.gate
    out = gate(x)
    # transformers' routers return (logits, weights, ids) or logits (older blocks)
    if isinstance(out, tuple):
        return out[2], out[1]
    probs = out.float().softmax(-1)
    w, ids = probs.topk(block.top_k if hasattr(block, "top_k") else 2, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096")
    p.add_argument("--configs", nargs="*", default=list(bb.CONFIGS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--host-profile", action="store_true",
                   help="cProfile the op's host path (top functions by own time), and the block's (and each "
                        "compiled step's) host side under torch.profiler, by self CPU time")
    p.add_argument("--inductor", action="store_true",
                   help="also the block under torch.compile (experts_implementation='opreg'): GPU time, "
                        "host time and its kernels, beside the eager block's")
    p.add_argument("--modes", nargs="*", default=["fwd"], choices=bb.MODES,
                   help="with --inductor: the steps profiled (fwd+bwd: the block's training step, "
                        "beside HF's grouped_mm + Inductor)")
    p.add_argument("--skip-op", action="store_true", help="only the compiled blocks (--inductor)")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="with --inductor: also each step's N longest kernels (torch.profiler, one step)")
    p.add_argument("--variants", nargs="*", default=list(COMPILED_VARIANTS), choices=COMPILED_VARIANTS,
                   help="with --inductor: the blocks compared")
    p.add_argument("--dgrad2-min-rows", type=float, default=None,
                   help="moe_experts_backward.DGRAD2_GROUPED_MIN_ROWS for this process (GEMM2's split dgrad "
                        "on torch._grouped_mm from this many rows per expert; inf: never)")
    p.add_argument("--pre-bf16", type=int, choices=(0, 1), default=None,
                   help="moe_experts.PRE_BF16 for this process (see bench_moe_block.py --pre-bf16)")
    a = p.parse_args()
    if a.pre_bf16 is not None:
        fused.PRE_BF16 = bool(a.pre_bf16)
    if a.dgrad2_min_rows is not None:
        from opreg.backends.triton import moe_experts_backward as B

        B.DGRAD2_GROUPED_MIN_ROWS = a.dgrad2_min_rows
        print(f"moe_experts.PRE_BF16 = {fused.PRE_BF16}")
    for config in a.configs:
        _, _, h, ffn, e, k = bb.CONFIGS[config]
        for t in (int(v) for v in a.tokens.split(",")):
            block, x = bb.inputs(config, t, False)
            if a.skip_op:
                compiled_block(block, x, a.reps, a.modes, a.host_profile, a.variants, a.kernels)
                continue
            args = tune.inputs(e, h, ffn, k, t, torch.bfloat16, "cuda")
            block.experts.config._experts_implementation = "opreg"
            x2 = x.reshape(-1, h)
            with torch.no_grad():
                ids, rw = router(block, x2)
            ex = block.experts
            w1, w2 = ex.gate_up_proj, ex.down_proj
            real = (args[0],) + (ids, rw.to(torch.bfloat16), w1.detach(), None, w2.detach(), None) + args[7:]
            counts = torch.bincount(ids.reshape(-1), minlength=e).float()
            rows = {"op, uniform": lambda: fused.fused_experts_forward(*args),
                    "op, block's routing": lambda: fused.fused_experts_forward(*real),
                    "op through torch.ops": lambda: torch.ops.opreg.moe_experts(*real),
                    "block": lambda: block(x)}
            print(f"\n{config} T={t}: busiest expert {counts.max().item():.0f} rows, mean {counts.mean().item():.0f}; "
                  f"w1 {tuple(w1.shape)} stride {w1.stride()}, transposed? see config")
            with torch.no_grad():
                for name, call in rows.items():
                    print(f"  {name:24s} GPU {median_us(call, a.reps, True):8.0f} us   host {host_us(call):8.0f} us")
                if a.host_profile:
                    host_profile(rows["op through torch.ops"], a.reps)
                    print(host_table(rows["block"]))
                from torch.profiler import ProfilerActivity, profile
                block(x)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    block(x)
                    torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            if a.inductor:
                compiled_block(block, x, a.reps, a.modes, a.host_profile, a.variants, a.kernels)


def syncs(call) -> str:
    """The host syncs in one call (``torch.cuda.set_sync_debug_mode``): how many, and where
    the first was. A sync inside a step lets the GPU drain, and it idles through the host
    work that follows."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (the mode's own "prototype feature" notice is not a sync)
    hits = [w for w in seen if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    if not hits:
        return "0"
    first = hits[0]
    return f"{len(hits)} (first: {str(first.message)[:80]!r} at {first.filename}:{first.lineno})"


COMPILED_VARIANTS = ("hf_grouped_mm_inductor", "opreg", "opreg_inductor")


def compiled_block(block: torch.nn.Module, x: torch.Tensor, reps: int, modes: list[str],
                   host: bool = False, names: tuple[str, ...] | list[str] = COMPILED_VARIANTS,
                   top: int = 0) -> None:
    """The block eager and under torch.compile: same kernels (their GPU sums match), so a
    gap between the two GPU times (events, back to back) is the GPU waiting on the host.
    fwd+bwd: the training step (``bench_moe_block.step``: the gradients set to None, then
    the sum's backward). HF's grouped_mm + Inductor beside both (``names``: which). The
    host time twice: a batch of steps (:func:`host_us`, which waits on a GPU-bound step's
    queue and then reads the GPU's time) and one step on an idle GPU (:func:`host_once_us`).
    ``host``: also cProfile each step's host path. ``top``: also the step's ``top`` longest
    kernels (one profiled step)."""
    from torch.profiler import ProfilerActivity, profile

    for mode in modes:
        for name in names:
            torch._dynamo.reset()
            fn = bb.variant(block, name)
            call = bb.step(fn, x, mode)
            gpu, host_time, once = median_us(call, reps, True), host_us(call), host_once_us(call)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            kernels = sum(e.self_device_time_total for e in prof.key_averages())
            print(f"  block {mode}, {name:22s} GPU {gpu:8.0f} us   host {host_time:8.0f} us (one step on an idle GPU "
                  f"{once:6.0f})   kernels {kernels:8.0f} us"
                  f"   host syncs {syncs(call)}")
            if top:
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top,
                                                max_name_column_width=70))
            if host:
                host_profile(call, reps)
                # the host side under torch.profiler, 5 steps: a launch or allocation that
                # blocks on the GPU shows up as a large self CPU time on a cuda* runtime call
                print(host_table(call))
            rows = 8 if mode == "fwd" else 22
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    torch._dynamo.reset()


if __name__ == "__main__":
    main()
