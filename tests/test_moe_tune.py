"""``python -m opreg tune moe_experts`` (backends/triton/tune.py): what it keeps, what
pick_config then reads, and a whole run under Triton's interpreter (tiny shape, float32: its
times mean nothing there, the plumbing does)."""
from __future__ import annotations

import json
import re
import os

import pytest
import torch

import _fresh as fresh
from opreg.backends.triton import moe_experts as TM
from opreg.backends.triton import moe_tiles as TT
from opreg.backends.triton import tune

needs_triton = pytest.mark.skipif(TT.triton is None, reason="triton is not installed")


def _version(mod: object) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", str(getattr(mod, "__version__", "0")))[:2])


# Without a GPU the whole runs below go through Triton's interpreter, whose tensors' __index__
# was int(array) before triton 3.8 (3.8: int(array.squeeze())); numpy 2.4 refuses int() of a
# 1-element 1-D array, so triton 3.6 (torch 2.11's) with numpy >= 2.4 can't interpret a
# range() over a scalar tensor: a kernel's int argument (the one-program routing's
# `range(0, num_chunks)`) or a loaded count (the decode kernels' `range(0, count, BLOCK_M)`).
# TypeError "only 0-dimensional arrays can be converted to Python scalars", inside triton;
# the GPU runs both (the CPU suite's other interpreted cases pass with these versions).
def _interpreter_takes_scalar_bounds() -> bool:
    if TT.triton is None or torch.cuda.is_available():
        return True
    import numpy
    return _version(TT.triton) >= (3, 8) or _version(numpy) < (2, 4)


needs_interpretable = pytest.mark.skipif(
    not _interpreter_takes_scalar_bounds(),
    reason="triton < 3.8's interpreter can't take a scalar tensor as a range() bound with numpy >= 2.4 "
           "(int() of a 1-element array)")


def _table() -> dict:
    with open(TM.CONFIG_FILE) as f:
        return json.load(f)


def _found(default_us: float, best_us: float, error: float) -> dict:
    return {"default_us": default_us, "best_us": best_us, "rows_per_expert": 256.0, "error": error,
            "gemm1": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
            "gemm2": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)}


@pytest.mark.parametrize("best_us, error, kept", [
    (90.0, 1e-3, True),            # faster and right: written
    (99.0, 1e-3, False),           # within the noise: the default stays
    (90.0, 5e-2, False),           # faster but off the grouped path: never kept
    (90.0, float("nan"), False)])
def test_record_keeps_only_a_faster_right_config(best_us, error, kept):
    e, h, i, k, t = 128, 2048, 768, 8, 4096
    table = _table()
    found = _found(100.0, best_us, error)
    assert tune.record(table, e, h, i, k, t, torch.bfloat16, found) is kept
    got1 = TM.pick_config("gemm1", t * k / e, 2 * i, h, torch.bfloat16, table=table)
    got2 = TM.pick_config("gemm2", t * k / e, h, i, torch.bfloat16, block_m=got1["BLOCK_M"], table=table)
    default1 = TM.pick_config("gemm1", t * k / e, 2 * i, h, torch.bfloat16, table=_table())
    assert (got1 == found["gemm1"]) is kept and (got1 == default1) is not kept
    assert ({key: v for key, v in got2.items() if key != "BLOCK_M"} == found["gemm2"]) is kept
    # another shape, or another bucket of this one, keeps its default
    assert TM.pick_config("gemm1", 4.0, 2 * i, h, torch.bfloat16, table=table) == \
        TM.pick_config("gemm1", 4.0, 2 * i, h, torch.bfloat16, table=_table())


@pytest.mark.parametrize("best_us, error, kept", [(90.0, 1e-3, True), (99.0, 1e-3, False), (90.0, 5e-2, False)])
def test_record_backward_keeps_only_a_faster_right_config(best_us, error, kept):
    """The backward's winners go where the backward's pick_config looks (N, K as it asks),
    for their bucket only; a GEMM left at its default (None) writes nothing."""
    e, h, i, k, t = 128, 2048, 768, 8, 4096
    rpe = t * k / e
    table = _table()
    dgrad2 = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=2, SPLIT=1)  # not the table's
    assert TM.pick_config("dgrad2", rpe, i, h, torch.bfloat16, table=table) != {**dgrad2, "BLOCK_M": 64}
    found = {"default_us": 100.0, "best_us": best_us, "rows_per_expert": rpe, "error": error,
             "dgrad2": dgrad2, "dgrad1": None}
    assert tune.record_backward(table, e, h, i, k, t, torch.bfloat16, found) is kept
    picked = {key: v for key, v in TM.pick_config("dgrad2", rpe, i, h, torch.bfloat16, block_m=128,
                                                  table=table).items() if key != "BLOCK_M"}
    assert (picked == dgrad2) is kept
    assert TM.pick_config("dgrad1", rpe, h, 2 * i, torch.bfloat16, block_m=128, table=table) == \
        TM.pick_config("dgrad1", rpe, h, 2 * i, torch.bfloat16, block_m=128, table=_table())
    assert TM.pick_config("dgrad2", 4.0, i, h, torch.bfloat16, block_m=64, table=table) == \
        TM.pick_config("dgrad2", 4.0, i, h, torch.bfloat16, block_m=64, table=_table())


def test_needs_a_gpu_or_the_interpreter(capsys):
    if torch.cuda.is_available() or TT.interpreting():
        pytest.skip("there is a GPU (or the interpreter) here")
    with pytest.raises(SystemExit) as exc:
        tune.main(["--shapes", "4:32:16:2"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@needs_triton
@needs_interpretable
def test_a_whole_run(tmp_path):
    """On the GPU where there is one (real kernels), else under the interpreter."""
    out = tmp_path / "configs.json"
    env = {**os.environ, **({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"})}
    run = fresh.run(["-m", "opreg", "tune", "moe_experts", "--shapes", "4:32:16:2", "--tokens", "8",
                     "--reps", "1", "--max-candidates", "2", "--dtype", "float32", "--out", str(out),
                     "--backward"], env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "E=4 H=32 I=16 k=2 T=8: default" in run.stdout and f"wrote {out}" in run.stdout
    # the budget (600 s) is not spent on a build: every candidate runs, the forward's 2 GEMM1,
    # the best and 2 with PREGATHER, the best persistent, 2 GEMM2 and the best persistent, and
    # each winner with HALF_TAIL where it applies (a winner of BLOCK_M >= 32, not persistent:
    # which wins, in the interpreter, is the timing's); the backward's 2 + 2 and the
    # persistent form of each winner that runs on the forward's GEMM (dgrad1 runs on Triton in
    # float32, dgrad2's fused kernel here has no such form), and its HALF_TAIL form likewise
    forward = re.search(r"(\d+) of (\d+) candidates tried", run.stdout)
    assert forward and forward[1] == forward[2] and 9 <= int(forward[1]) <= 11, run.stdout
    backward = re.search(r"  backward: default.*?(\d+) of (\d+) candidates tried", run.stdout, re.S)
    assert backward and backward[1] == backward[2] and 5 <= int(backward[1]) <= 6, run.stdout
    table = json.loads(out.read_text())
    assert table["tuned_on"]["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available()
                                           else "cpu (interpreter)")
    assert table["default"] == _table()["default"]  # only "tuned" changes
    # this run's command first, then the shipped table's history (where each entry came from)
    command = table["tuned_on"]["command"]
    assert command.startswith("python -m opreg tune moe_experts --shapes 4:32:16:2 --tokens 8 "), command
    assert command.endswith(_table()["tuned_on"]["command"]), command
    written = [(shape, gemm, bucket, cfg) for shape, gemms in table["tuned"].get("float32", {}).items()
               for gemm, buckets in gemms.items() for bucket, cfg in buckets.items()]
    assert written or "default kept" in run.stdout, run.stdout
    for shape, gemm, bucket, cfg in written:  # what pick_config now returns for that shape
        n, k = (int(v.split("=")[1]) for v in shape.split(","))
        rpe = float(bucket) if bucket != "inf" else 1e9
        got = TM.pick_config(gemm, rpe, n, k, torch.float32, block_m=cfg.get("BLOCK_M"), table=table)
        assert all(got[key] == v for key, v in cfg.items() if key != "num_stages"), (cfg, got)
        assert got["num_stages"] <= cfg["num_stages"]  # shrunk only to fit shared memory


@needs_triton
def test_shared_buckets_are_named() -> None:
    """Qwen3-MoE's T = 4096 and 16384 (256 and 1024 rows per expert) fall in one gemm2 bucket
    of the shipped table (gemm1 splits them at 512): the tuner says so before it overwrites
    one with the other."""
    table = _table()
    lines = tune.shared_buckets(table, tune.SHAPES["qwen3_moe"], [4096, 16384], ("gemm1", "gemm2"))
    assert len(lines) == 1 and "T=4096, 16384 share gemm2's bucket '1024'" in lines[0], lines
    assert tune.shared_buckets(table, tune.SHAPES["mixtral"], [4096, 16384], ("gemm1", "gemm2")) == []


@needs_triton
@needs_interpretable
def test_a_decode_run(tmp_path):
    """``--decode``: the decode kernels' candidates at T = 1, then the grouped ones at
    tune.GROUPED_TOKENS; a winner lands under the shape's "decode" / "decode_grouped" entry,
    where pick_config reads it. A forward of one token without
    ``--decode`` is refused: its GEMM configs would never run."""
    out = tmp_path / "configs.json"
    env = {**os.environ, **({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"})}
    run = fresh.run(["-m", "opreg", "tune", "moe_experts", "--shapes", "4:32:16:2", "--decode", "--reps", "1",
                     "--max-candidates", "2", "--dtype", "float32", "--out", str(out)], env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "E=4 H=32 I=16 k=2 T=1 (decode): default" in run.stdout and "4 of 4 candidates tried" in run.stdout, \
        run.stdout
    assert f"E=4 H=32 I=16 k=2 T={','.join(map(str, tune.GROUPED_TOKENS))} (grouped decode): default" in run.stdout, \
        run.stdout
    assert "2 of 2 candidates tried; decode_grouped=" in run.stdout, run.stdout
    table = json.loads(out.read_text())
    assert table["default"] == _table()["default"]
    for entry in ("decode", "decode_grouped"):
        written = table["tuned"].get("float32", {}).get("N=32,K=32", {}).get(entry)
        if written:
            assert TM.pick_config(entry, 0.0, 32, 32, torch.float32, table=table) == written["-"]
    assert "written" in run.stdout or "default kept" in run.stdout, run.stdout
    refused = fresh.run(["-m", "opreg", "tune", "moe_experts", "--shapes", "4:32:16:2", "--tokens", "1"], env=env,
                        timeout=120)
    assert refused.returncode == 2 and "--decode tunes those" in refused.stderr, refused.stderr[-2000:]
