"""How much of the fused MoE GEMMs' work is padding: the rows their tiles walk past each
expert's real ones, on the block bench's own routing (CPU is enough: no kernel runs).

    python bench/moe_padding.py [--configs mixtral qwen3_moe olmoe] [--tokens 4096,16384] [--block-m 128,64]

The fused GEMMs' tiles walk each expert's rows padded to BLOCK_M (moe_experts.py's routing),
so an expert of c rows costs ceil(c / BLOCK_M) whole tiles. Per config, T and BLOCK_M: the
real rows (T * k), the padded rows and their excess, the tiles (full and partial), and the
partial tiles whose second half is padding (where ``HALF_TAIL`` computes half a tile). The
routing is ``bench_moe_block.py``'s (its block's router on random weights and inputs, the
bench's model of a trained router: near-uniform, so each expert holds ~T k / E rows).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe_block as bb  # noqa: E402
from moe_profile import router  # noqa: E402


def padding(counts: list[int], bm: int) -> dict[str, int]:
    """Tiles of ``bm`` rows over experts of ``counts`` rows each."""
    tiles = sum(-(-c // bm) for c in counts)
    full = sum(c // bm for c in counts)
    half = sum(1 for c in counts if c % bm and c % bm <= bm // 2)
    return {"rows": sum(counts), "padded": tiles * bm, "tiles": tiles, "partial": tiles - full, "half": half}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="*", default=list(bb.CONFIGS))
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--block-m", default="128,64")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    print("| config | T | BLOCK_M | rows | padded rows | excess | tiles | partial | second half padding |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config in a.configs:
        _, _, h, _, e, _ = bb.CONFIGS[config]
        block = bb.make_block(config, torch.float32, "cpu", False)
        for t in (int(v) for v in a.tokens.split(",")):
            with torch.no_grad():
                ids, _ = router(block, torch.randn(t, h))
            counts = torch.bincount(ids.reshape(-1), minlength=e).tolist()
            for bm in (int(v) for v in a.block_m.split(",")):
                r = padding(counts, bm)
                print(f"| {config} | {t} | {bm} | {r['rows']} | {r['padded']} | "
                      f"{100 * (r['padded'] - r['rows']) / r['rows']:.1f} % | {r['tiles']} | {r['partial']} | "
                      f"{r['half']} |")


if __name__ == "__main__":
    main()
