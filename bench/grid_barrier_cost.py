"""What a cooperative launch and each grid barrier in it cost on this GPU, by grid shape.

    python3 bench/grid_barrier_cost.py [--rounds 7] [--json out.json]

Why (issue 19, acceptance 3): the fused ``scatter_combine`` kernel is one cooperative launch
with two ``grid.sync()`` (zero -> count -> reduce), and on an H100 (seventy-third session,
ncu) the launch alone took 2.9 us and each barrier ~2 us at its grid of 792 blocks x 128
threads; software barriers (one counter, or 32 group counters and a top one) were no faster.
Whether a grid of fewer, wider blocks (the same threads an SM) makes a barrier cheaper
decided whether the fused kernel's blocks should be reshaped: it does (H100, seventy-fourth
session: 2.03 us a barrier at 792 x 128 threads, 1.12 at 132 x 768; bench/RESULTS.md), and
the kernel now runs one block an SM for most reducers. Each grid shape's kernel runs
0, 1, 2, 4 and 8 barriers; a least-squares line through those times gives the launch (the
intercept) and one barrier (the slope). Times are device time per launch from CUDA graphs of
20 launches (the host taken out), median of the rounds. Kernels: ``bench/cuda/grid_barrier_cost.cu``
(built here with torch's cpp_extension; nothing of opreg's build).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import Variant, graph_us  # noqa: E402
from opreg._toolchain import cuda_home, using_cpp_extension  # noqa: E402

BARRIERS = (0, 1, 2, 4, 8)
LAUNCHES_A_GRAPH = 20


def build():
    home = cuda_home()
    if home is None:
        raise SystemExit("grid_barrier_cost.py: no CUDA toolkit (nvcc) found")
    src = Path(__file__).resolve().parent / "cuda" / "grid_barrier_cost.cu"
    out = Path(tempfile.gettempdir()) / "opreg-grid-barrier-cost"
    out.mkdir(exist_ok=True)
    major, minor = torch.cuda.get_device_capability()
    with using_cpp_extension({"CUDA_HOME": home, "TORCH_CUDA_ARCH_LIST": f"{major}.{minor}"}, cuda=True) as ext:
        return ext.load(name="opreg_grid_barrier_cost", sources=[str(src)], build_directory=str(out),
                        extra_cuda_cflags=["-O3"], verbose=False)


def time_launch(mod, blocks: int, threads: int, barriers: int, sink: torch.Tensor, rounds: int) -> float:
    """Device us per launch: a CUDA graph of LAUNCHES_A_GRAPH launches, median of ``rounds`` replays."""
    return graph_us(Variant(lambda _i: mod.launch(blocks, threads, barriers, sink)), nsets=1,
                    calls=LAUNCHES_A_GRAPH, reps=rounds)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grid_barrier_cost.py needs a CUDA device")
    mod = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.empty(1024, dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}; us per launch in CUDA graphs, "
          f"median of {args.rounds}")
    print(f"{'threads':>7} {'blocks/SM':>9} {'blocks':>6} | " + " ".join(f"{b:>2} bar" for b in BARRIERS)
          + " | launch  barrier")
    rows = []
    for threads in (128, 256, 512, 768, 1024):
        cap = min(mod.max_blocks_per_sm(threads), 2048 // threads)
        for per_sm in sorted({1, 2, 4, 6, 8, 16} & set(range(1, cap + 1)) | {cap}):
            blocks = sms * per_sm
            ts = [time_launch(mod, blocks, threads, b, sink, args.rounds) for b in BARRIERS]
            launch, barrier = fit([float(b) for b in BARRIERS], ts)
            rows.append(dict(threads=threads, per_sm=per_sm, blocks=blocks, us=ts, launch_us=launch,
                             barrier_us=barrier))
            print(f"{threads:>7} {per_sm:>9} {blocks:>6} | " + " ".join(f"{t:6.2f}" for t in ts)
                  + f" | {launch:6.2f}  {barrier:6.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                             rows=rows), indent=1))


if __name__ == "__main__":
    main()
