"""bench/_paths.py on the CPU: which path ``auto`` ran, inferred from its output's bits first
and its time second, and the PDL report's line for a slower shape (the timings stubbed)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paths():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("opreg_bench_paths", ROOT / "bench" / "_paths.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    yield mod
    sys.path.remove(str(ROOT / "bench"))


def row(us: dict[str, float], bits: dict[str, str]) -> dict:
    return {"shape": "s", "us": us, "bits": bits}


def test_same_bits_beat_a_nearer_time(paths):
    # auto's timing an outlier (3.00 against its own kernel's 2.31), nearer another path's
    r = row({"auto": 3.00, "dot": 2.31, "simt": 3.18}, {"auto": "a", "dot": "a", "simt": "b"})
    assert paths.infer_auto(r, {"dot": 2.31, "simt": 3.18}) == "dot"


def test_time_decides_among_equal_bits_and_without_bits(paths):
    forced = {"tiny": 2.0, "small": 3.0, "large": 5.0}
    same = row({"auto": 2.9, **forced}, {"auto": "a", "tiny": "a", "small": "a", "large": "b"})
    assert paths.infer_auto(same, forced) == "small"
    none = row({"auto": 4.8, **forced}, {"auto": "z", "tiny": "a", "small": "a", "large": "b"})
    assert paths.infer_auto(none, forced) == "large"
    older = {"shape": "s", "us": {"auto": 2.1, **forced}}  # a JSON from before bits were kept
    assert paths.infer_auto(older, forced) == "tiny"


def test_measure_keeps_bits_both_orders_and_pdl_shows_the_spread(paths, monkeypatch, capsys):
    # forward order, then reversed: auto, dot, simt, no_pdl, eager; eager, no_pdl, simt, dot, auto
    times = iter([3.00, 2.31, 3.18, 2.62, 4.0, 4.1, 2.70, 3.30, 2.40, 3.10])
    seen = []

    def graph_us(call, reps, calls):
        seen.append((os.environ.get("OPREG_TEST_PATH"), os.environ.get("OPREG_PDL")))
        return next(times)

    monkeypatch.setattr(paths.timing, "graph_us", graph_us)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    other = x * 1.5
    variants = {"auto": (None, lambda: x.clone()), "dot": ("dot", lambda: x.clone()),
                "simt": ("simt", lambda: other.clone()), "no_pdl": ({"OPREG_PDL": "0"}, lambda: x.clone()),
                "eager": (None, lambda: x.clone())}
    r = paths.measure("R2 B2", variants, "OPREG_TEST_PATH", x.double(), 1.0, ["dot", "simt"], 3)
    assert seen == [(None, None), ("dot", None), ("simt", None), (None, "0"), (None, None),
                    (None, None), (None, "0"), ("simt", None), ("dot", None), (None, None)]
    assert "OPREG_TEST_PATH" not in os.environ and "OPREG_PDL" not in os.environ
    assert r["us_each"]["eager"] == [4.0, 4.1] and r["us_each"]["auto"] == [3.00, 3.10]
    assert r["us"] == {"auto": 3.00, "dot": 2.31, "simt": 3.18, "no_pdl": 2.62, "eager": 4.0}
    assert r["bits"]["auto"] == r["bits"]["dot"] != r["bits"]["simt"]
    assert r["auto~"] == "dot" and r["best"] == "dot"
    paths.pdl([r], ["gemm"])
    out = capsys.readouterr().out
    assert "PDL slower: R2 B2 auto/no_pdl 1.145 (auto~ dot, auto / dot forced 1.299)" in out


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"opreg_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.parametrize("bench, data", [
    ("cat_linear_paths", "cat_linear_paths_h100_2026-12-05.json"),
    ("scatter_paths", "scatter_paths_h100_2026-12-05.json"),
    ("scatter_paths", "scatter_paths_forms_h100_2026-12-07.json")])
def test_evaluate_a_kept_run(paths, bench, data, capsys):
    """--evaluate (no GPU: the path choice compiled with the host's C++ compiler) on a run kept
    in bench/data: every shape gets a pick; a GEMM pick charged more than eager's time is marked
    as eager's own kernels."""
    assert load_bench(bench).main(["--evaluate", str(ROOT / "bench" / "data" / data)]) == 0
    out = capsys.readouterr().out
    rows = len(json.loads((ROOT / "bench" / "data" / data).read_text())["rows"])
    assert f"{rows} shapes of " in out
    if "forms" in data:  # the large path's forms timed: its picks are charged as local / fused
        assert "'local': " in out and "'fused': " in out and "'large'" not in out
    if bench == "cat_linear_paths":
        losses = [line for line in out.splitlines() if line.startswith("  R")]
        gemm = [line for line in losses if line.split()[5] == "gemm"]
        assert gemm and all("(eager's kernels: the timing's spread)" in line for line in gemm)
        assert f"({len(gemm)} of them on the GEMM path" in out


def test_bits_are_the_replays(paths, monkeypatch):
    """Auto's path is read from the output a graph's replay computes, which is what is timed:
    there cat_linear may run another path than an eager call does (graph_prefers_gemm)."""
    monkeypatch.setattr(paths.timing, "graph_us", lambda call, reps, calls: 1.0)

    def captured(call):
        os.environ["OPREG_TEST_CAPTURING"] = "1"
        try:
            return call()
        finally:
            del os.environ["OPREG_TEST_CAPTURING"]

    monkeypatch.setattr(paths, "graph_output", captured)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    gemm = x * 1.5
    variants = {"auto": (None, lambda: gemm.clone() if "OPREG_TEST_CAPTURING" in os.environ else x.clone()),
                "dot": ("dot", lambda: x.clone()), "gemm": ("gemm", lambda: gemm.clone()),
                "eager": (None, lambda: gemm.clone())}
    r = paths.measure("R32 B1", variants, "OPREG_TEST_PATH", x.double(), 1.0, ["dot", "gemm"], 3)
    assert r["bits"]["auto"] == r["bits"]["gemm"] != r["bits"]["dot"]
    assert r["auto~"] == "gemm"


def test_compare_two_scatter_runs(tmp_path, capsys):
    """--compare (no GPU): B / A per variant and local / fused in each run, by token_idx's
    bytes; a form made 10 % slower in B at the 32 KB shapes shows there and only there."""
    data = json.loads((ROOT / "bench" / "data" / "scatter_paths_forms_h100_2026-12-07.json").read_text())
    slowed = []
    for r in data["rows"]:
        t, k = (int(w[1:]) for w in r["shape"].split()[:2])
        if t * k * 4 == 32 * 1024:
            r["us"]["local"] *= 1.1
            slowed.append(r["shape"])
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text((ROOT / "bench" / "data" / "scatter_paths_forms_h100_2026-12-07.json").read_text())
    b.write_text(json.dumps(data))
    assert slowed and load_bench("scatter_paths").main(["--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line.split() for line in out if line.split()[1:2] == ["KB"]}
    # kb "KB" shapes auto large fused local (B / A), local / fused in A and in B
    assert table["32"][2] == str(len(slowed)) and table["32"][6] == "1.100"
    assert float(table["32"][8]) == pytest.approx(1.1 * float(table["32"][7]), abs=2e-3)
    assert all(row[6] == "1.000" for kb, row in table.items() if kb != "32")
    assert f"moved by > 3 % (the most first): {len(slowed)}" in out
    with pytest.raises(SystemExit, match="no shape"):
        load_bench("scatter_paths").main(["--rows", "3"])


def test_evaluate_counts_index_bytes(tmp_path, capsys):
    """--evaluate with int64 shapes ("... int64", ``--index int64``): the local form's bound is
    in token_idx's bytes, so the N = 16384 shapes it takes in int32 (64 KB) go to the fused
    kernel in int64 (128 KB), and no other shape moves there."""
    kept = ROOT / "bench" / "data" / "scatter_paths_local64_h100_2026-12-07.json"
    data = json.loads(kept.read_text())
    for r in data["rows"]:
        r["shape"] += " int64"
    wide = tmp_path / "int64.json"
    wide.write_text(json.dumps(data))
    bench = load_bench("scatter_paths")
    to_fused = {}  # the shapes whose pick moved from that run's own (local) to fused
    for path in (kept, wide):
        assert bench.main(["--evaluate", str(path)]) == 0
        out = capsys.readouterr().out
        to_fused[path] = {line.split(" local -> fused")[0].strip().removesuffix(" int64")
                          for line in out.splitlines() if " local -> fused" in line}
    n16k = {r["shape"].removesuffix(" int64") for r in data["rows"]
            if r["shape"].startswith(("T2048 k8 ", "T8192 k2 ", "T16384 k1 "))}
    assert len(n16k) == 18
    assert to_fused[wide] - to_fused[kept] == n16k and not to_fused[kept] & n16k
