"""The MoE weight gradients: the Gluon kernels (ping-pong, cooperative) against CUTLASS (CUDA, sm90).

    python bench/moe_wgrad.py [--configs qwen3_moe olmoe mixtral] [--tokens 4096] [--sweep | --host] [--json F]

Per config (``tune.SHAPES``: E, H, I, top-k; bf16, uniform random top-k routing), both weight
gradients as ``moe_experts_backward`` computes them, out[e] = A_e^T B_e over each expert's
run of sorted rows: d gate_up_proj (A = d_pre (S, 2I), B = x's rows (S, H)) and d down_proj
(A = rw * dout's rows (S, H), B = act (S, I)). ``torch._grouped_mm(A.t(), B, offs=offs)``
(CUTLASS) against :func:`opreg.backends.triton.moe_wgrad_gluon.wgrad` at each ``--stages``
(ping-pong) and each ``--coop-stages`` (cooperative, where N is a multiple of 256), each as 10
calls in one CUDA graph, median over ``--rounds`` rounds in alternating order; µs, TF/s,
CUTLASS / Gluon. ``--sweep``: the same at fixed rows per expert (``--rows``, S = rows x
E, every expert the same count), then per implementation a least-squares fit of time = tiles
per SM x (fixed + per-step x steps) and, per shape, the rows per expert where Gluon stops
winning (what ``moe_experts_backward.GLUON_WGRAD_MAX_ROWS`` is checked against). ``--host``:
per shape at ``--tokens``, each implementation's host time to enqueue a call on an idle GPU and
its time on the stream.
"""
from __future__ import annotations

import argparse
import json

import torch

from opreg.backends.triton import moe_wgrad_gluon as G
from opreg.backends.triton import tune
from opreg.testing.timing import captured, host_once_us, median_us

CALLS = 10


def _graph(fn):
    g, _ = captured(fn, CALLS)
    g.replay()
    torch.cuda.synchronize()
    return g


def _time(g) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / CALLS


def _counts(tokens: int, e: int, k: int) -> list[int]:
    return torch.bincount(torch.rand(tokens, e).topk(k, dim=1).indices.flatten(), minlength=e).tolist()


def _grads(e: int, h: int, i: int) -> list[tuple[str, int, int]]:
    return [("gate_up", 2 * i, h), ("down", h, i)]


def bench_one(name: str, counts: list[int], m: int, n: int, stages: list[int], rounds: int,
              coop_stages: list[int] = ()) -> dict:
    e, s = len(counts), sum(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(s, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(e, m, n, device="cuda", dtype=torch.bfloat16)
    impls = {"cutlass": lambda: torch._grouped_mm(a.t(), b, offs=offs)}
    for st in stages:
        impls[f"gluon{st}"] = lambda st=st: G.wgrad(a, b, offs, out=out, stages=st)
    if G.unfit(a, b, cooperative=True) is None:
        for st in coop_stages:
            impls[f"coop{st}"] = lambda st=st: G.wgrad(a, b, offs, out=out, stages=st, cooperative=True)
    graphs = {k: _graph(f) for k, f in impls.items()}
    ref = torch._grouped_mm(a.t(), b, offs=offs)
    same = torch.equal(ref, G.wgrad(a, b, offs, stages=stages[0])) and all(
        torch.equal(ref, G.wgrad(a, b, offs, stages=st, cooperative=True))
        for st in coop_stages if f"coop{st}" in impls)
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for r in range(rounds):
        for k in (list(graphs) if r % 2 == 0 else list(graphs)[::-1]):
            times[k].append(_time(graphs[k]))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    flops = 2.0 * s * m * n
    row = dict(name=name, E=e, M=m, N=n, S=s, rows=s / e, us=med, same_bits=same)
    print(f"{name:28s} E={e:3d} M={m:5d} N={n:5d} rows/expert={s / e:6.0f}  cutlass {med['cutlass']:8.1f} us "
          f"({flops / med['cutlass'] / 1e6:4.0f} TF/s)  " +
          "  ".join(f"{k} {med[k]:8.1f} ({med['cutlass'] / med[k]:.3f}x)" for k in med if k != "cutlass") +
          ("" if same else "  RESULTS DIFFER FROM CUTLASS'S BITS"), flush=True)
    return row


def host_one(name: str, counts: list[int], m: int, n: int) -> None:
    """Host time to enqueue one call on an idle GPU (``host_once_us``) and the call's time on
    the stream (``median_us``), per implementation."""
    e, s = len(counts), sum(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = torch.randn(s, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s, n, device="cuda", dtype=torch.bfloat16)
    line = f"{name:28s} S={s:6d} M={m:5d} N={n:5d}:"
    gluon = lambda: G.wgrad(a, b, offs, stages=G.stages_for(s / e))  # noqa: E731

    def tritons_launch() -> None:  # the same call with the kernel launched by Triton's kernel[grid]
        saved, G.launch = G.launch, lambda fn, grid, *args, spec_key=None, **kw: fn[grid](*args, **kw)
        try:
            gluon()
        finally:
            G.launch = saved

    for impl, fn in (("cutlass", lambda: torch._grouped_mm(a.t(), b, offs=offs)), ("gluon", gluon),
                     ("gluon kernel[grid]", tritons_launch)):
        line += f"  {impl} host {host_once_us(fn, reps=20):6.1f} us, stream {median_us(fn, 20, True):7.1f} us"
    entries = list(getattr(G.wgrad_kernel, "_opreg_launch_cache", {}).values())
    path = ("launch.py's C launcher" if entries and all(x[2] is not None for x in entries)
            else f"launch.py, kernel.run ({len(entries)} entries)")
    print(line + f"  [gluon: {path}]", flush=True)


def fit(rows: list[dict], sms: int) -> None:
    """time = tiles per SM x (fixed + per step x steps), per implementation (CUTLASS's tile
    counted as 128 x 256, Gluon's 128 x 128; steps = mean rows per expert / 64)."""
    for impl in rows[0]["us"]:
        tm, tn = (128, 256) if impl == "cutlass" or impl.startswith("coop") else (128, 128)
        xs, ys = [], []
        for r in rows:
            tiles = r["E"] * r["M"] / tm * r["N"] / tn / sms
            steps = -(-r["S"] // r["E"] // 64)
            xs.append([tiles, tiles * steps])
            ys.append(r["us"][impl])
        c0, c1 = torch.linalg.lstsq(torch.tensor(xs, dtype=torch.float64),
                                    torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
        err = max(abs(x[0] * c0 + x[1] * c1 - y) / y for x, y in zip(xs, ys))
        print(f"fit {impl}: {c0:.2f} us a tile + {c1:.3f} us a step (worst error {err:.0%})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=["qwen3_moe", "olmoe", "mixtral"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--stages", type=int, nargs="*", default=[4, 5])
    p.add_argument("--coop-stages", type=int, nargs="*", default=[3],
                   help="the cooperative kernel's ring depths (128 x 256 tiles; none: not timed)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--rows", type=int, nargs="*", default=[64, 128, 256, 384, 512, 768, 1024, 1536])
    p.add_argument("--host", action="store_true", help="host time a call of each, at --tokens, instead")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    import triton
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    results = []
    for cfg in a.configs:
        e, h, i, k = tune.SHAPES[cfg]
        for g, m, n in _grads(e, h, i):
            if a.host:
                host_one(f"{cfg} {g} T={a.tokens}", _counts(a.tokens, e, k), m, n)
            elif a.sweep:
                for r in a.rows:
                    results.append(bench_one(f"{cfg} {g} sweep", [r] * e, m, n, a.stages, a.rounds, a.coop_stages))
                    torch.cuda.empty_cache()
            else:
                results.append(bench_one(f"{cfg} {g} T={a.tokens}", _counts(a.tokens, e, k), m, n, a.stages,
                                         a.rounds, a.coop_stages))
                torch.cuda.empty_cache()
    if a.sweep:
        fit(results, props.multi_processor_count)
        for cfg in a.configs:
            for g in ("gate_up", "down"):
                rs = [r for r in results if r["name"] == f"{cfg} {g} sweep"]
                best = {r["rows"]: max(r["us"]["cutlass"] / v for kk, v in r["us"].items() if kk != "cutlass")
                        for r in rs}
                print(f"{cfg} {g}: CUTLASS / best Gluon by rows per expert: "
                      + ", ".join(f"{int(rw)} {x:.2f}" for rw, x in best.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, triton=triton.__version__, results=results),
                      f, indent=1)


if __name__ == "__main__":
    main()
