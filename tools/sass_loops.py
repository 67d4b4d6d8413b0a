#!/usr/bin/env python3
"""The size of each fused-matmul kernel's hot loop, a reference tree against the working tree.

A change outside the chunk loop can still change the loop's machine code: e.g. a cursor computed
at kernel scope instead of per item moved the loop's address arithmetic off the uniform datapath
(256 -> 320 instructions per chunk, 1.02x the time). That is visible here, on any machine with
nvcc, before a GPU run.

For every kernel in the compiled `cpp/cuda/matmul_fused_b*.cu` and `matmul_wgmma_b*.cu` of both
trees, the hot loop is taken as the shortest loop that contains an HMMA (mma.sync) or HGMMA
(wgmma) instruction: the instructions from a backward branch's target to the branch. Each kernel
gets one line, with the loop's instruction count in REF and in the working tree. (The wgmma
kernel's loop is one chunk, two k-blocks, and includes warp 0's copy code.) A loop of the same
length whose instructions sit in another order (beyond register names) is marked "reordered":
ptxas's schedule changed, which can cost a few percent of time at the same length.

    python3 tools/sass_loops.py [REF] [--only b4] [--max-growth N] [--ops]   (b4: both kernels' bits 4)

REF defaults to HEAD. `--max-growth N` exits with status 1 when a loop grew by more than N
instructions. `--ops` adds, under each loop that changed, its opcodes' counts that changed
(e.g. `IMAD -35  MOV -19  LOP3 +13  SHF +12`).

    python3 tools/sass_loops.py [REF] --identical [--new REV] [--cache DIR]

compares the whole disassembly of every `cpp/cuda/*.cu` instead: identical SASS means the GPU
tests of REF cover the working tree too, a way to verify a behaviour-preserving kernel refactor
on a machine without a GPU (exit status 1 where a unit's SASS differs). `--new REV` compiles git
revision REV instead of the working tree; `--cache DIR` keeps the cubins of git revisions there
(by commit), so a second comparison against the same REF compiles only the new tree.

Needs nvcc and cuobjdump: the CUDA toolkit's, or the one Triton's wheel carries, given by
--cuobjdump or $CUOBJDUMP, e.g.
  $(python3 -c "import triton, os; print(os.path.dirname(triton.__file__))")/backends/nvidia/bin/cuobjdump
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import difflib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC_FLAGS = ["-arch=sm_90a", "-O3", "-std=c++17", "--expt-relaxed-constexpr"]
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
# kbit_matmul_{ws,fused}_kernel<BITS, Act, MT, V> (warp-specialized / cp.async kernel; V the tiling,
# matmul_fused_config.cuh's Tiling)
_MATMUL_KERNEL = re.compile(r"kbit_matmul_(ws|fused)_kernelILi(\d)ENS0_\d+(\w+?)ELi(\d)ELi(\d)E")
# kbit_matmul_wgmma_kernel<BITS, BM, J, WG, Act>: bits, BM, J, WG (warpgroups across the tile's
# columns; labelled only where it is 1), Act (optional: trees without it pair with bf16)
TILINGS = {"0": "kWarpKBlock", "1": "kWarpKPair", "2": "kNSplit", "4": "kWideBits5"}
_WGMMA_KERNEL = re.compile(r"kbit_matmul_wgmma_kernelILi(\d)ELi(\d+)E(?:Li(\d)E)?(?:Li(\d)E)?(?:NS0_\d+(\w+?)E)?")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """cuobjdump -sass text -> {mangled name: [(address, instruction), ...]}."""
    out, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = _INSTRUCTION.match(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def hot_loop(code: list[tuple[int, str]]) -> list[tuple[int, str]] | None:
    """The shortest backward-branch loop that contains an HMMA or HGMMA: its instructions, from
    the branch's target to the branch (None: no such loop)."""
    mma = [a for a, i in code if "HMMA" in i or "HGMMA" in i]
    best = None
    for addr, ins in code:
        m = _BRANCH_TARGET.search(ins)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and any(target <= a <= addr for a in mma):
            loop = [(a, i) for a, i in code if target <= a <= addr]
            if best is None or len(loop) < len(best):
                best = loop
    return best


def _size(loop: list[tuple[int, str]] | None) -> int | None:
    return None if loop is None else len(loop)


def hot_loop_size(code: list[tuple[int, str]]) -> int | None:
    """Instructions in hot_loop(code) (None: no loop)."""
    return _size(hot_loop(code))


def _shape(ins: str) -> str:
    """An instruction without its register numbers and immediates (what a renaming changes)."""
    return re.sub(r"\bU?R\d+", "R", re.sub(r"0x[0-9a-f]+", "X", ins))


def moved(ref_loop: list[tuple[int, str]], new_loop: list[tuple[int, str]]) -> int:
    """Of two loops of equal length, the positions whose instruction differs beyond register
    names and immediates: ptxas's schedule changed (0: the same loop, possibly renamed)."""
    return sum(1 for (_, a), (_, b) in zip(ref_loop, new_loop) if _shape(a) != _shape(b))


def label(mangled: str) -> str:
    m = _MATMUL_KERNEL.search(mangled)
    if m:
        kind, bits, act, mt, v = m.groups()
        return f"{'ws' if kind == 'ws' else 'cp.async'} bits {bits} {act:7s} MT {mt} {TILINGS.get(v, 'V' + v)}"
    m = _WGMMA_KERNEL.search(mangled)
    if m:
        act = m.group(5) if m.group(5) and m.group(5) != "ActBF16" else ""  # (bf16 pairs with older trees)
        return (f"wgmma bits {m.group(1)} BM {m.group(2)}" + (f" J {m.group(3)}" if m.group(3) else "") +
                (" WG 1" if m.group(4) == "1" else "") + (f" {act}" if act else ""))
    return mangled[:60]


def compile_cubin(src: str, include: str, out: str) -> None:
    partial = out + ".partial"  # (a cached cubin appears only once complete)
    done = subprocess.run(["nvcc", *NVCC_FLAGS, f"-I{include}", "-cubin", "-o", partial, src],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed on {src}:\n{done.stderr}")
    os.replace(partial, out)


def _export(rev: str, dest: str) -> None:
    """git revision ``rev``'s cpp/ into ``dest``."""
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "cpp"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def _commit(rev: str) -> str:
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                          capture_output=True, text=True).stdout.strip()


def disassemble(units: list[str], ref: str, work: str, cuobjdump: str, new: str | None = None,
                cache: str | None = None) -> dict[str, dict[str, str]]:
    """{unit name: {"ref": SASS, "new": SASS}}: each unit compiled from git revision ``ref``'s
    cpp/ and from the working tree's (or git revision ``new``'s), in parallel, then disassembled.
    With ``cache``, a revision's cubins are kept in cache/<commit>/ and reused."""
    roots, cubin_dirs, cached = {}, {}, set()
    for tree, rev in (("ref", ref), ("new", new)):
        if rev is None:
            roots[tree], cubin_dirs[tree] = ROOT, os.path.join(work, tree)
            continue
        roots[tree] = os.path.join(work, f"{tree}_src")
        _export(rev, roots[tree])
        if cache:
            cubin_dirs[tree] = os.path.join(os.path.abspath(cache), _commit(rev))
            cached.add(tree)
        else:
            cubin_dirs[tree] = os.path.join(work, tree)
    for d in cubin_dirs.values():
        os.makedirs(d, exist_ok=True)
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for unit in units:
            name, rel = os.path.basename(unit)[:-3], os.path.relpath(unit, ROOT)
            for tree in ("ref", "new"):
                out = os.path.join(cubin_dirs[tree], f"{name}.cubin")
                if tree not in cached or not os.path.exists(out):
                    future = pool.submit(compile_cubin, os.path.join(roots[tree], rel),
                                         os.path.join(roots[tree], "cpp"), out)
                else:
                    future = None  # (cached)
                jobs[(name, tree)] = (future, out)
    sass = {}
    for (name, tree), (future, cubin) in jobs.items():
        if future is not None:
            future.result()  # (raises RuntimeError with nvcc's message on failure)
        sass.setdefault(name, {})[tree] = subprocess.run(
            [cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    return sass


def normalized(sass: str) -> str:
    """SASS without what differs between two compiles of the same code: anonymous-namespace
    symbols carry a hash of the source path."""
    return re.sub(r"_GLOBAL__N__[0-9a-f]*_", "_GLOBAL__N__", sass)


def report_identity(sass: dict[str, dict[str, str]]) -> int:
    status = 0
    for name, trees in sass.items():
        ref, new = (normalized(trees[t]).splitlines() for t in ("ref", "new"))
        if ref == new:
            print(f"{name}: identical SASS")
            continue
        changed = sum(1 for line in difflib.unified_diff(ref, new, lineterm="", n=0)
                      if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        print(f"{name}: SASS differs ({changed} lines)")
        status = 1
    return status


def opcode(ins: str) -> str:
    """An instruction's opcode without its predicate and modifiers ("@!P0 IMAD.MOV.U32 ..." -> "IMAD")."""
    words = ins.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def opcode_changes(ref_loop: list[tuple[int, str]], new_loop: list[tuple[int, str]]) -> str:
    """The opcodes whose count differs between two loops, largest change first: "MOV -19  LOP3 +16"."""
    before = collections.Counter(opcode(i) for _, i in ref_loop)
    after = collections.Counter(opcode(i) for _, i in new_loop)
    delta = {op: after[op] - before[op] for op in before | after if after[op] != before[op]}
    return "  ".join(f"{op} {d:+d}" for op, d in sorted(delta.items(), key=lambda kv: (-abs(kv[1]), kv[0])))


def _natural(text: str) -> list:
    """Sort key: numbers by value ("BM 64" before "BM 128")."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _count(size: int | None) -> str:
    return "-" if size is None else str(size)


def report_loops(sass: dict[str, dict[str, str]], ref: str, max_growth: int | None, ops: bool = False) -> int:
    """One line per kernel, paired across the trees by its label (the template arguments), so a
    kernel whose parameter list changed still meets its reference; kernels only in the working
    tree are marked "(new)", those only in REF "(gone)"."""
    status = 0
    print(f"hot loop (instructions), {ref} -> working tree")
    for name, trees in sass.items():
        loops = {tree: {label(fn): hot_loop(code) for fn, code in functions(text).items()}
                 for tree, text in trees.items()}
        for kernel in sorted(set(loops["ref"]) | set(loops["new"]), key=_natural):
            ref_loop, new_loop = loops["ref"].get(kernel), loops["new"].get(kernel)
            before, after = _size(ref_loop), _size(new_loop)
            if before is None and after is None:
                continue  # no loop around an MMA in either tree
            mark = ""
            if before is None:
                mark = "  (new)"
            elif after is None:
                mark = "  (gone)"
            elif after != before:
                mark = f"  ({after - before:+d})"
                if max_growth is not None and after - before > max_growth:
                    status = 1
            elif (n_moved := moved(ref_loop, new_loop)):
                mark = f"  (reordered: {n_moved} moved)"
            print(f"  {name}: {kernel:34s} {_count(before):>5} -> {_count(after):>5}{mark}")
            if ops and ref_loop and new_loop and (changes := opcode_changes(ref_loop, new_loop)):
                print(f"      {changes}")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", nargs="?", default="HEAD", help="git revision to compare with (HEAD)")
    ap.add_argument("--only", default="",
                    help="comma list of translation units, e.g. b4 or b2,b4 (with --identical: "
                         "file names without .cu, e.g. quantize,matmul_fused_b4)")
    ap.add_argument("--max-growth", type=int, default=None,
                    help="exit 1 when a hot loop grew by more than this many instructions")
    ap.add_argument("--ops", action="store_true",
                    help="under each changed loop, the opcodes whose count changed")
    ap.add_argument("--identical", action="store_true",
                    help="compare the whole SASS of every cpp/cuda/*.cu instead of the hot loops")
    ap.add_argument("--new", default=None,
                    help="git revision to compile instead of the working tree (with --identical)")
    ap.add_argument("--cache", default=None,
                    help="directory that keeps the cubins of git revisions, by commit")
    ap.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP", "cuobjdump"))
    args = ap.parse_args(argv)
    if shutil.which(args.cuobjdump) is None and not os.path.exists(args.cuobjdump):
        print(f"sass_loops: no cuobjdump at '{args.cuobjdump}' (see --cuobjdump)", file=sys.stderr)
        return 2
    kinds = ("fused", "wgmma")  # the mma.sync and the wgmma kernels' translation units
    patterns = ["*.cu"] if args.identical else [f"matmul_{kind}_b*.cu" for kind in kinds]
    units = sorted(u for p in patterns for u in glob.glob(os.path.join(ROOT, "cpp", "cuda", p)))
    if args.only:
        names = [u.strip() for u in args.only.split(",")]
        wanted = ({f"{n}.cu" for n in names} if args.identical else
                  {f"matmul_{kind}_{n}.cu" for n in names for kind in kinds})
        units = [u for u in units if os.path.basename(u) in wanted]
    with tempfile.TemporaryDirectory() as work:
        sass = disassemble(units, args.ref, work, args.cuobjdump, args.new, args.cache)
    if args.identical:
        return report_identity(sass)
    return report_loops(sass, args.ref, args.max_growth, args.ops)


if __name__ == "__main__":
    sys.exit(main())
