"""Registers and spills of each CUDA kernel in one source, as opreg's build compiles it
(``ptxas -v``): a kernel candidate's check before it spends device time.

    python bench/ptxas_report.py backends/cuda/scatter_combine_large.cu \\
        [--patch bench/candidates/<file>.diff] [--arch 9.0] [--match local_kernel] [--all]

The nvcc flags are the CUDA library's own (its ``build.ninja``; the library is built first
where there is none, ~80 s on 2 cores). With ``--patch`` the file is compiled as the tree has it
and as patched, side by side, and the kernels whose registers moved by more than ``--regs``, or
that spill in either, are listed tree -> patched; ``--all`` lists every kernel. Exit status 1
where a kernel spills (with ``--patch``: where the patched file spills more than the tree), else 0.

Why: the seventy-eighth session's candidate (``local_scan_vec.diff``) was called spill-free from
a reading of some kernels' lines; ptxas had 16 bytes of spills in its bf16 wide-row local kernel,
which ran 14-27 % slower on an H100 (bench/RESULTS.md, seventy-ninth session).
"""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


@dataclass
class Kernel:
    regs: int = -1
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def __str__(self) -> str:
        s = f"{self.regs} regs"
        return s + (f", spills {self.spill_stores}/{self.spill_loads} B" if self.spills else "")


def parse_ptxas(text: str) -> dict[str, Kernel]:
    """``ptxas -v``'s lines -> {mangled entry (and arch where several): Kernel}."""
    out: dict[str, Kernel] = {}
    cur: Kernel | None = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            name = m.group(1) if m.group(1) not in out else f"{m.group(1)} [{m.group(2)}]"
            cur = out[name] = Kernel()
            continue
        if cur is None:
            continue
        m = _SPILL.search(line)
        if m:
            cur.spill_stores, cur.spill_loads = int(m.group(1)), int(m.group(2))
        m = _REGS.search(line)
        if m:
            cur.regs = int(m.group(1))
            cur = None  # the entry's last line
    return out


def short_names(mangled: list[str]) -> dict[str, str]:
    """Demangled (c++filt where it is installed), namespaces and argument lists dropped."""
    names = dict(zip(mangled, mangled))
    if mangled and shutil.which("c++filt"):
        plain = [n.split(" [")[0] for n in mangled]
        res = subprocess.run(["c++filt"], input="\n".join(plain), capture_output=True, text=True)
        if res.returncode == 0 and len(res.stdout.splitlines()) == len(mangled):
            names = dict(zip(mangled, res.stdout.splitlines()))
    strip = re.compile(r"(\w+::)*\(anonymous namespace\)::|opreg::\w+::|c10::")
    out = {}
    for k, v in names.items():
        v = strip.sub("", v)
        depth, cut = 0, len(v)
        for i, c in enumerate(v):  # drop the argument list: the first '(' outside template brackets
            depth += c == "<"
            depth -= c == ">"
            if c == "(" and depth == 0 and i > 0:
                cut = i
                break
        out[k] = re.sub(r"^void ", "", v[:cut])
    return out


def nvcc_command() -> tuple[str, list[str]]:
    """(nvcc, its flags) as opreg's CUDA build runs them, from the library's build.ninja."""
    from opreg import _build

    ninja = _build.build_dir(_build.CUDA) / "build.ninja"
    if not ninja.exists():
        raise SystemExit(f"{ninja} does not exist: build the CUDA library first "
                         "(python -m opreg build --only cuda --cuda-arch 9.0)")
    found = {}
    for line in ninja.read_text().splitlines():
        key, eq, val = line.partition(" = ")
        if eq and key in ("nvcc", "cuda_cflags", "cuda_post_cflags"):
            found[key] = val
    if "nvcc" not in found or "cuda_cflags" not in found:
        raise SystemExit(f"{ninja} has no nvcc or cuda_cflags line")
    return found["nvcc"], shlex.split(found["cuda_cflags"]) + shlex.split(found.get("cuda_post_cflags", ""))


def compile_report(nvcc: str, flags: list[str], src: Path, include: Path, obj: Path) -> subprocess.Popen:
    cmd = [nvcc, *flags, f"-I{include}", "-Xptxas", "-v", "-c", str(src), "-o", str(obj)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path, help="a .cu file under backends/cuda")
    ap.add_argument("--patch", type=Path, help="a diff against the source (bench/candidates/)")
    ap.add_argument("--match", default="", help="only kernels whose name has this regex")
    ap.add_argument("--regs", type=int, default=4, help="list kernels whose registers moved by more")
    ap.add_argument("--all", action="store_true", help="list every kernel")
    args = ap.parse_args(argv)
    src = args.source.resolve()
    if not src.is_file():
        raise SystemExit(f"source: {src} is not a file")
    if args.patch and not shutil.which("c++filt"):
        # the anonymous namespace's mangled name differs by file: only demangled names match
        raise SystemExit("--patch needs c++filt (binutils) to match a kernel across the two files")
    nvcc, flags = nvcc_command()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"tree": src}
        if args.patch:
            patched = Path(tmp) / src.name
            res = subprocess.run(["patch", "-s", "-o", str(patched), str(src), str(args.patch)],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"patch: {args.patch} does not apply to {src}:\n{res.stdout}{res.stderr}")
            runs["patched"] = patched
        procs = {k: compile_report(nvcc, flags, p, src.parent, Path(tmp) / f"{k}.o") for k, p in runs.items()}
        logs = {k: p.communicate()[0] for k, p in procs.items()}
        for k, p in procs.items():
            if p.returncode != 0:
                sys.stdout.write(logs[k])
                raise SystemExit(f"nvcc failed on the {k} file ({runs[k]})")
    kernels = {k: by_short_name(parse_ptxas(v)) for k, v in logs.items()}
    checked = kernels["patched" if args.patch else "tree"]
    rx = re.compile(args.match)
    shown = 0
    for name in sorted(set().union(*kernels.values())):
        if not rx.search(name):
            continue
        row = [kernels[k].get(name) for k in runs]
        regs = [r.regs for r in row if r is not None]
        moved = len(regs) == 2 and abs(regs[0] - regs[1]) > args.regs
        if args.all or moved or any(r is not None and r.spills for r in row) or None in row:
            print(" -> ".join(str(r) if r else "absent" for r in row).ljust(36), name)
            shown += 1
    bad = [n for n in (spills_added(kernels["tree"], checked) if args.patch else
                       [n for n, k in checked.items() if k.spills]) if rx.search(n)]
    print(f"{len(checked)} kernels ({', '.join(runs)}); {shown} listed; {len(bad)} "
          + ("spill more than in the tree" if args.patch else "spill"))
    for n in bad:
        print(f"  spills: {n}")
    return 1 if bad else 0


def spills_added(tree: dict[str, Kernel], patched: dict[str, Kernel]) -> list[str]:
    """Kernels that spill in ``patched`` where the tree's same kernel spilled less or is absent
    (the tree's own spills are listed, not failed on)."""
    def total(k: Kernel) -> int:
        return k.spill_stores + k.spill_loads
    return [n for n, k in patched.items() if k.spills and (n not in tree or total(k) > total(tree[n]))]


def by_short_name(kernels: dict[str, Kernel]) -> dict[str, Kernel]:
    short = short_names(list(kernels))
    out: dict[str, Kernel] = {}
    for mangled, k in kernels.items():
        name, i = short[mangled], 2
        while name in out:  # overloads that differ only in their arguments
            name, i = f"{short[mangled]} #{i}", i + 1
        out[name] = k
    return out


if __name__ == "__main__":
    sys.exit(main())
