"""Worker side of tests/test_distributed.py: a small MoE + cat_linear model, its eager
single-process reference, and the per-rank training run under DDP / FSDP2 with
``torch.compile(..., backend="opreg")``; on the CPU with gloo, or one GPU per rank with
NCCL.

A module of its own (not the test file): each rank runs it as a script (``python
_dist_worker.py RANK PORT OUT_DIR SCENARIOS DEVICE``), forked from tests/_fresh.py's server
(torch imported), and imports little else.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

WORLD = 2
H, R, M = 64, 4, 4             # hidden, cat parts, tokens per part
T = R * M                      # tokens
N = 2 * T                      # expert rows (top-2 routing)
STEPS = 3
LR = 0.1
OPTIONS = {"inner": "eager"}   # no codegen: compile time stays low on a 2-core box
# Output widths: the small model's parameters (~25 KiB) fit one DDP bucket; the big one's
# projection weight is 1 MiB (+ bias), a bucket of its own.
K_SMALL, K_BIG = 5, 1024
INIT_SEED, DATA_SEED = 1234, 4321

#: name -> (output width K, wrapper, DDP bucket_cap_mb, torch._dynamo.config.optimize_ddp)
SCENARIOS: dict[str, tuple[int, str, float, bool]] = {
    # DDP, default 25 MiB buckets, small model: one bucket, so one graph.
    "ddp": (K_SMALL, "ddp", 25, True),
    # DDP, bucket_cap_mb=1 (the least torch.compile allows: DDPOptimizer asserts that DDP's
    # 1 MiB first bucket is no bigger than the others), big model: the projection fills a
    # bucket, so DDPOptimizer splits the graph between the cat and the linear before the
    # backend sees it. (With the default 25 MiB it splits there too: the first bucket,
    # the last layers', is 1 MiB.)
    "ddp_split": (K_BIG, "ddp", 1, True),
    # The same, with optimize_ddp=False: one graph (DDP then all-reduces after the whole
    # backward, without overlapping communication with it).
    "ddp_nosplit": (K_BIG, "ddp", 1, False),
    # FSDP2: fully_shard per block and at the root, then torch.compile of the root.
    "fsdp2": (K_SMALL, "fsdp2", 0, True),
}


class MoEBlock(nn.Module):
    """Route rows to an expert, gate them, combine into tokens (the scatter_combine idiom)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(H, H)
        self.router = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.expert(x))
        g = torch.sigmoid(self.router(x)).squeeze(-1)
        return torch.zeros(T, H, device=x.device).index_add_(0, idx, hidden * g[:, None])


class CatBlock(nn.Module):
    """``nn.Linear(torch.cat([y[i] for i in range(R)], -1))`` (the cat_linear idiom)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.proj = nn.Linear(R * H, k)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([y[i] for i in range(R)], -1))


class Net(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.moe = MoEBlock()
        self.cat = CatBlock(k)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.cat(self.moe(x, idx).view(R, M, H))


def make_model(k: int, device: str = "cpu") -> Net:
    """The same initial parameters on every device (drawn on the CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return Net(k).to(device)


def make_data(k: int, rank: int, step: int,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the global batch of step ``step``: (x, idx, target),
    drawn on the CPU so that every device sees the same values."""
    g = torch.Generator().manual_seed(DATA_SEED + 1000 * step + rank)
    x = torch.randn(N, H, generator=g)
    idx = torch.randint(0, T, (N,), generator=g)
    target = torch.randn(M, k, generator=g)
    return x.to(device), idx.to(device), target.to(device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def reference(k: int, device: str = "cpu") -> dict[str, Any]:
    """Single process (one GPU for "cuda"), eager: the loss of the global batch is the
    mean of the shards' losses (what DDP's / FSDP2's gradient averaging computes). Per
    step: each shard's loss and every parameter's gradient; then the parameters after the
    last step (tensors on the CPU)."""
    model = make_model(k, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        shard_losses = [loss_fn(model(x, idx), t)
                        for x, idx, t in (make_data(k, r, step, device) for r in range(WORLD))]
        (sum(shard_losses) / WORLD).backward()
        losses.append([v.item() for v in shard_losses])
        grads.append({n: p.grad.detach().cpu() for n, p in model.named_parameters()})
        opt.step()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()}}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameters and gradients) gathered to a plain CPU tensor."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().cpu().clone()


def _clean_name(name: str) -> str:
    # DDP adds "module.", torch.compile "_orig_mod.": compare by the plain model's names.
    for prefix in ("_orig_mod.", "module."):
        name = name.replace(prefix, "")
    return name


def _counters() -> dict[str, Any]:
    from opreg.backend import registered_patterns, stats

    pats = {p.name: p for p in registered_patterns()}
    return {"graphs": stats["graphs"], "rewrites": stats["rewrites"],
            "matches": {n: dict(p.matches) for n, p in pats.items()},
            "near_misses": {n: dict(p.near_misses) for n, p in pats.items()}}


def _reset_counters() -> None:
    from opreg.backend import registered_patterns, stats

    torch._dynamo.reset()
    stats.clear()
    for p in registered_patterns():
        p.reset_counters()


def _wrap(model: Net, wrapper: str, bucket_cap_mb: float, device: str) -> nn.Module:
    dev = torch.device(device)
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, bucket_cap_mb=bucket_cap_mb,
                   device_ids=[dev.index] if dev.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev.type, (WORLD,))
    fully_shard(model.moe, mesh=mesh)
    fully_shard(model.cat, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _explain(model: nn.Module, x: torch.Tensor, idx: torch.Tensor) -> dict[str, Any]:
    """opreg.explain on the wrapped model: what the backend sees under DDPOptimizer."""
    from opreg.explain import explain

    with torch.no_grad():   # a forward only: DDP must not wait for a backward
        rep = explain(model, (x, idx), print_report=False)
    return {"graphs": rep.graphs, "text": str(rep),
            "matches": sorted((f.pattern, f.spelling) for f in rep.matches),
            "near_misses": sorted((f.pattern, f.reason) for f in rep.near_misses)}


def _train(scenario: str, rank: int, device: str) -> dict[str, Any]:
    """Train STEPS steps of SGD on this rank's shards; per step the local loss and the
    (averaged, gathered) gradients, then the parameters, which opreg ops ran in each step
    (profiler), the backend's counters and, under DDP, opreg.explain's report."""
    k, wrapper, bucket_cap_mb, optimize_ddp = SCENARIOS[scenario]
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
        model = _wrap(make_model(k, device), wrapper, bucket_cap_mb, device)
        explained = (_explain(model, *make_data(k, rank, 0, device)[:2])
                     if wrapper == "ddp" else None)
        _reset_counters()
        compiled = torch.compile(model, backend="opreg", options=OPTIONS)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, grads, ran = [], [], []
        for step in range(STEPS):
            opt.zero_grad()
            x, idx, target = make_data(k, rank, step, device)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss = loss_fn(compiled(x, idx), target)
                loss.backward()
            ran.append(sorted({e.name for e in prof.events() if e.name.startswith("opreg::")}))
            losses.append(loss.item())
            grads.append({_clean_name(n): _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
    params = {_clean_name(n): _full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "ran": ran,
            "explain": explained, **_counters()}


def worker(rank: int, port: int, out_dir: str, scenarios: list[str], device: str = "cpu") -> None:
    """One rank: run every scenario, save results (or each one's traceback) to
    ``out_dir/rank{rank}.pt``. ``device``: "cpu" (gloo) or "cuda" (NCCL, GPU ``rank``).
    The process group is always destroyed."""
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # gloo's own sockets: loopback too
    results: dict[str, Any] = {}
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        for scenario in scenarios:
            try:
                results[scenario] = _train(scenario, rank, device)
            except Exception:  # noqa: BLE001 - reported by the test of that scenario
                results[scenario] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank, _port, _out_dir, _scenarios, _device = sys.argv[1:]
    worker(int(_rank), int(_port), _out_dir, _scenarios.split(","), _device)
