"""bench/ptxas_report.py on the CPU, from ptxas' own lines (nvcc 13.0, sm_90; no compile): the
registers and spills read per kernel, the same kernel of two files matched across the
anonymous namespace's per-file names, and only new or grown spills failing a patch."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ("scatter_large_local_kernelIN3c108BFloat16ENS1_10WideReduceIS4_Li8ELi2EEEEEvPKT_PKvbSB_bPS7_ili"
         "NS1_10ReduceWorkE")
FUSED = ("scatter_large_fused_kernelIN3c108BFloat16ENS1_10WideReduceIS4_Li8ELi2EEEEEvPKT_PKvbSB_bPiSC_SC_SC_SC_SC_"
         "SC_PS7_iliNS1_10ReduceWorkE")


def log(ns: str, local: tuple[int, int, int], fused: tuple[int, int, int]) -> str:
    """ptxas -v's lines for the two kernels in the namespace ``ns``: (registers, spill stores,
    spill loads) each, with an unrelated line between them as nvcc prints."""
    lines = []
    for name, (regs, st, ld) in ((LOCAL, local), (FUSED, fused)):
        mangled = f"_ZN5opreg9sc_detail{len(ns)}{ns}{len(name.split('I')[0])}{name}"
        lines += [f"ptxas info    : Compiling entry function '{mangled}' for 'sm_90'",
                  f"ptxas info    : Function properties for {mangled}",
                  f"    8 bytes stack frame, {st} bytes spill stores, {ld} bytes spill loads",
                  f"ptxas info    : Used {regs} registers, used 1 barriers, 8 bytes cumulative stack size",
                  "ptxas info    : Compile time = 131.412 ms"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def px():
    spec = importlib.util.spec_from_file_location("opreg_bench_ptxas", ROOT / "bench" / "ptxas_report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    yield mod
    del sys.modules[spec.name]


def test_reads_registers_and_spills(px):
    k = px.parse_ptxas(log("_GLOBAL__N__7e56d0c0_24_scatter_combine_large_cu_82f5bbbb_13760", (80, 16, 12),
                           (72, 0, 0)))
    assert sorted((v.regs, v.spill_stores, v.spill_loads, v.spills) for v in k.values()) == \
        [(72, 0, 0, False), (80, 16, 12, True)]


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) not installed")
def test_matches_kernels_across_files_and_fails_only_new_spills(px):
    tree = px.by_short_name(px.parse_ptxas(
        log("_GLOBAL__N__7e56d0c0_24_scatter_combine_large_cu_82f5bbbb_13760", (80, 0, 0), (128, 8, 16))))
    patched = px.by_short_name(px.parse_ptxas(
        log("_GLOBAL__N__65bad91f_12__cand_tmp_cu_6b498777_13758", (80, 16, 12), (128, 8, 16))))
    assert set(tree) == set(patched) == {
        "scatter_large_local_kernel<BFloat16, WideReduce<BFloat16, 8, 2> >",
        "scatter_large_fused_kernel<BFloat16, WideReduce<BFloat16, 8, 2> >"}
    # the fused kernel's spills are the tree's own: listed, not failed on
    assert px.spills_added(tree, patched) == ["scatter_large_local_kernel<BFloat16, WideReduce<BFloat16, 8, 2> >"]
    assert px.spills_added(tree, tree) == []
