"""bench/sweep.py end to end on the CPU (its tiny grid runs in seconds): the command line,
the summary it prints, the JSON it writes, and the summary's counting on made-up rows."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import _fresh as fresh

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "bench" / "sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("opreg_bench_sweep", SWEEP)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    yield mod
    sys.modules.pop(spec.name, None)


def groups(sweep) -> list[str]:
    return ["cat_linear/list/fwd", "cat_linear/list/fwdbwd", "cat_linear_stacked/stacked/fwd",
            "cat_linear_stacked/stacked/fwdbwd", "scatter_combine/-/fwd", "scatter_combine/-/bwd"]


def test_cli_end_to_end(tmp_path, sweep):
    out = tmp_path / "sweep.json"
    p = fresh.run([str(SWEEP), "--device", "cpu", "--json", str(out)], timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    text = p.stdout
    for g in groups(sweep):
        assert f"slower than eager by > 3 %: {g}: " in text
    for line in ("== summary:", "10 worst opreg/eager:", "scatter_combine >= 16 MB below 70 % of copy: ",
                 "cat_linear model: automatic path > 3 % slower than a forced one: ",
                 "outputs off the float64 reference: 0", "sweep took"):
        assert line in text, line

    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "summary", "rows"}
    assert doc["meta"]["device"] == "cpu" and doc["meta"]["copy_GBps"] > 0
    assert doc["meta"]["command"].startswith("python bench/sweep.py")
    grid = sweep.GRIDS["tiny"]
    n_cat = len(sweep.cat_shapes(grid))  # one row per shape in each op/form/mode group
    n_scatter = len(sweep.scatter_shapes(grid))
    rows = doc["rows"]
    count = {g: sum(f"{r['op']}/{r['form']}/{r['mode']}" == g for r in rows) for g in groups(sweep)}
    assert count == {g: n_scatter if g.startswith("scatter") else n_cat for g in groups(sweep)}
    for r in rows:
        assert {"opreg", "eager"} <= set(r["median_us"]) and min(r["median_us"].values()) > 0, r
        assert r["ratio"] > 0, r
        assert (r["err"] is None) == (r["mode"] == "fwdbwd")  # cat_linear checks its forward
        assert r["err"] is None or r["err"] < sweep.TOL[r["params"]["dtype"]]
        assert (r["frac_copy"] is not None) == (r["op"] == "scatter_combine")
        if r["op"] == "scatter_combine" and r["mode"] == "fwd":
            assert "index_put" in r["vs"]
    assert set(doc["summary"]["slower"]) == set(groups(sweep))
    assert len(doc["summary"]["worst"]) == 10


def test_ops_filter(tmp_path, sweep, capsys):
    out = tmp_path / "s.json"
    assert sweep.main(["--device", "cpu", "--ops", "scatter_combine", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and {r["op"] for r in rows} == {"scatter_combine"}
    assert "slower than eager by > 3 %: scatter_combine/-/fwd" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sweep.main(["--device", "cpu", "--ops", "nope"])


def test_dtypes_picks_the_shapes_dtypes(sweep, monkeypatch):
    """--dtypes: the shapes of every op carry only the dtypes asked for (fp16 is not in the
    default sweep); an unknown one is refused, naming the option."""
    monkeypatch.setattr(sweep, "DTYPES", dict(sweep.DTYPES))  # main() rebinds its contents
    seen: list[str] = []
    monkeypatch.setattr(sweep, "run_scatter_shape", lambda c, shape: seen.append(shape[3]) or [])
    monkeypatch.setattr(sweep, "run_cat_shape", lambda c, shape, forms: seen.append(shape[-1]) or [])
    assert sweep.main(["--device", "cpu", "--dtypes", "fp16"]) == 0
    assert seen and set(seen) == {"fp16"}, set(seen)
    seen.clear()
    assert sweep.main(["--device", "cpu", "--ops", "scatter_combine", "--dtypes", "bf16,fp32"]) == 0
    assert set(seen) == {"bf16", "fp32"}, set(seen)
    with pytest.raises(SystemExit, match="--dtypes"):
        sweep.main(["--device", "cpu", "--dtypes", "fp8"])


def test_summary_counts(sweep):
    R = sweep.Row
    rows = [
        R("cat_linear", "list", "fwd", "a", {"dtype": "fp32"}, {"opreg": 1.0, "eager": 1.0}, 1.02,
          {"simt": 1.0, "gemm": 0.7}, err=0.0),
        R("cat_linear", "list", "fwd", "b", {"dtype": "fp32"}, {"opreg": 2.0, "eager": 1.0}, 2.0,
          {"simt": 1.2, "gemm": 1.0, "eager2": 1.98}, err=0.0, spread=1.01),  # slower, and a mispick
        R("cat_linear", "list", "fwdbwd", "e", {"dtype": "fp32"}, {"opreg": 1.1, "eager": 1.0}, 1.1,
          {"eager2": 0.98}, err=0.0, spread=1.12),              # slower, but within eager's own spread
        R("cat_linear", "list", "fwdbwd", "f", {"dtype": "fp32"}, {"opreg": 1.2, "eager": 1.0}, 1.2,
          {"eager2": 1.24}, err=0.0, spread=0.965, self_spread=1.04),  # slower by more than eager's spread
        R("scatter_combine", "-", "fwd", "c", {"dtype": "bf16"}, {"opreg": 1.0, "eager": 3.0}, 0.33,
          nbytes=32e6, frac_copy=0.5, err=1e-3),                 # >= 16 MB below 70 %
        R("scatter_combine", "-", "fwd", "d", {"dtype": "bf16"}, {"opreg": 1.0, "eager": 3.0}, 0.33,
          nbytes=1e6, frac_copy=0.2, err=0.5),                   # small: not counted; wrong output
    ]
    cfg = sweep.Config("cpu", sweep.GRIDS["tiny"], "none", 1e9, 0.0, rows=rows)
    lines, summary = sweep.summarize(cfg)
    assert summary["slower"] == {"cat_linear/list/fwd": ["b"], "cat_linear/list/fwdbwd": ["e", "f"],
                                 "scatter_combine/-/fwd": []}
    assert summary["slower_beyond_noise"]["cat_linear/list/fwd"] == ["b"]
    assert summary["slower_beyond_noise"]["cat_linear/list/fwdbwd"] == ["f"]
    assert summary["noisy"]["cat_linear/list/fwdbwd"] == ["e", "f"]
    assert summary["mispicks"] == ["b"]
    assert summary["below_copy"] == ["c fwd"]
    assert summary["wrong"] == ["d"]
    assert summary["worst"][0]["label"] == "b"
    assert any(ln.startswith("slower than eager by > 3 %: cat_linear/list/fwd: 1 of 2 (1 by more than eager")
               for ln in lines)
    assert any(ln.startswith("  within the noise: cat_linear/list/fwdbwd e:") for ln in lines)
    assert any(ln.startswith("  beyond the noise: cat_linear/list/fwdbwd f:")
               and ln.endswith("(eager2/eager 0.965, opreg2/opreg 1.040)") for ln in lines)


def test_best_of_two(sweep):
    """Confirmed rows where opreg and eager each ran twice: the better run against the better
    run is printed beside each loss and counted; the verdict stays eager's."""
    R = sweep.Row
    rows = [  # bimodal op: loses in one run, not at its best; a real loss at both runs
        R("cat_linear", "list", "fwdbwd", "g", {"dtype": "fp32"},
          {"opreg": 1.2, "opreg2": 1.0, "eager": 1.0, "eager2": 1.01}, 1.2, {"eager2": 1.19},
          err=0.0, spread=1.0, self_spread=0.84, confirmed=True),
        R("cat_linear", "list", "fwdbwd", "h", {"dtype": "fp32"},
          {"opreg": 1.2, "opreg2": 1.1, "eager": 1.0, "eager2": 1.02}, 1.2, {"eager2": 1.18},
          err=0.0, spread=1.0, self_spread=0.92, confirmed=True),
    ]
    assert sweep.best_of_two(rows[0]) == pytest.approx(1.0)
    assert sweep.best_of_two(rows[1]) == pytest.approx(1.1)
    cfg = sweep.Config("cpu", sweep.GRIDS["tiny"], "none", 1e9, 0.0, confirm_rounds=21, rows=rows)
    lines, summary = sweep.summarize(cfg)
    assert summary["slower_beyond_noise"]["cat_linear/list/fwdbwd"] == ["g", "h"]
    assert any(ln.endswith("still > 3 % slower in 2 (the op's better run > 3 % slower than eager's better run "
                           "in 1 of the 2 timed twice each)") for ln in lines)
    assert any(ln.startswith("  beyond the noise: cat_linear/list/fwdbwd g:")
               and ln.endswith("opreg2/opreg 0.840, best/best 1.000)") for ln in lines)


def test_confirm_retimes_the_losers_only(sweep, monkeypatch):
    """--confirm-rounds: each cat_linear shape with a row > 3 % slower is timed again (both
    modes) with that many rounds, and its rows are replaced by the new, ``confirmed`` ones;
    the other shapes' rows stay; the summary counts what the longer run still finds."""
    R = sweep.Row
    shapes = [(2, 1, 16, 24, "fp32"), (2, 16, 16, 24, "fp32")]
    lose, win = (sweep.cat_label(s) for s in shapes)
    cfg = sweep.Config("cpu", sweep.GRIDS["tiny"], "none", 1e9, 0.0, confirm_rounds=9, rows=[
        R("cat_linear", "list", "fwd", lose, {"dtype": "fp32"}, {"opreg": 1.1, "eager": 1.0}, 1.10),
        R("cat_linear", "list", "fwdbwd", lose, {"dtype": "fp32"}, {"opreg": 1.0, "eager": 1.0}, 1.0),
        R("cat_linear", "list", "fwd", win, {"dtype": "fp32"}, {"opreg": 1.0, "eager": 1.0}, 0.9)])
    timed: list[tuple[tuple, int]] = []

    def fake_run(c, shape, forms):
        assert c.opreg_twice and not cfg.opreg_twice, "the confirmation alone runs opreg twice"
        timed.append((shape, c.grid["rounds"]))
        return [R("cat_linear", "list", m, sweep.cat_label(shape), {"dtype": "fp32"}, {"opreg": 1.0, "eager": 1.0},
                  1.01 if m == "fwd" else 1.05) for m in ("fwd", "fwdbwd")]

    monkeypatch.setattr(sweep, "run_cat_shape", fake_run)
    sweep.confirm(cfg, "cat_linear", "list", shapes, deadline=float("inf"))
    assert timed == [(shapes[0], 9)], "only the loser, with the confirmation's rounds"
    by = {(r.label, r.mode): r for r in cfg.rows}
    assert len(cfg.rows) == 3 and by[(win, "fwd")].ratio == 0.9 and not by[(win, "fwd")].confirmed
    assert by[(lose, "fwd")].ratio == 1.01 and by[(lose, "fwdbwd")].ratio == 1.05
    assert by[(lose, "fwd")].confirmed and by[(lose, "fwdbwd")].confirmed
    lines, summary = sweep.summarize(cfg)
    assert ("timed again with --confirm-rounds 9: 2 rows, still > 3 % slower in 1 (the op's better run > 3 % "
            "slower than eager's better run in 0 of the 0 timed twice each)") in lines
    assert summary["slower"]["cat_linear/list/fwd"] == [] and summary["slower"]["cat_linear/list/fwdbwd"] == [lose]
    timed.clear()
    cfg.rows.append(R("cat_linear", "list", "fwdbwd", win, {"dtype": "fp32"}, {"opreg": 1.2, "eager": 1.0}, 1.2))
    sweep.confirm(cfg, "cat_linear", "list", shapes, deadline=0.0)  # a new loser, no time left: not timed
    assert timed == [] and not cfg.rows[-1].confirmed


def test_only_filters_shapes_by_label(sweep, monkeypatch):
    """--only: only the shapes whose label holds one of the fragments run, for either op."""
    timed: list[str] = []
    monkeypatch.setattr(sweep, "run_cat_shape", lambda c, shape, forms: timed.append(sweep.cat_label(shape)) or [])
    monkeypatch.setattr(sweep, "run_scatter_shape",
                        lambda c, shape: timed.append(sweep.shape_label("scatter_combine", shape)) or [])
    grid = sweep.GRIDS["tiny"]
    cats = [sweep.cat_label(s) for s in sweep.cat_shapes(grid)]
    pick = cats[len(cats) // 2]
    cfg = sweep.Config("cpu", grid, "none", 1e9, float("inf"), only=(pick,))
    sweep.run_op(cfg, "cat_linear", float("inf"))
    assert timed and set(timed) == {c for c in cats if pick in c}, timed
    timed.clear()
    scatters = [sweep.shape_label("scatter_combine", s) for s in sweep.scatter_shapes(grid)]
    cfg = sweep.Config("cpu", grid, "none", 1e9, float("inf"), only=(scatters[0], "no such shape"))
    sweep.run_op(cfg, "scatter_combine", float("inf"))
    assert timed and set(timed) == {s for s in scatters if scatters[0] in s}, timed


def test_profile_prints_both_tables(sweep, capsys):
    """--profile (with --only): after the timing, a torch.profiler table of opreg's calls and
    one of eager's, per mode, naming the ops each ran."""
    grid = sweep.GRIDS["tiny"]
    pick = sweep.cat_label(sweep.cat_shapes(grid)[0])
    assert sweep.main(["--device", "cpu", "--ops", "cat_linear", "--only", pick, "--profile"]) == 0
    out = capsys.readouterr().out
    for name, mode in (("opreg", "no_grad"), ("eager", "no_grad"), ("opreg", "grad"), ("eager", "grad")):
        assert f"--- profile {name}, 10 calls (torch {mode})" in out, (name, mode)
    assert "opreg::cat_linear" in out and "aten::cat" in out
