"""The wgmma kernel (cpp/cuda/matmul_wgmma.cuh) as ptxas compiles it, on any machine with nvcc:
no wgmma serialized and no register spilled, for every bits value.

Why: ptxas makes every wgmma of a kernel wait for the previous one when the pipeline around them
is not one it can prove safe (its "Potential Performance Loss: wgmma.mma_async instructions are
serialized" notes, C7510-C7520), and the kernel still gives right results, only slower: e.g. a
copy branch on the thread index inside the k loop (C7520), or a 288-thread block whose register
cap makes it spill (C7512). Both are visible at compile time, before a GPU run.
Where cuobjdump is found, also: no thread-index read inside the main loop.
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import sass_loops  # noqa: E402  (its SASS parsing: each kernel's hot loop)

# as CMake compiles the module's CUDA sources for the 90a target (CMakeLists.txt)
FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
         "-DKBIT_WGMMA=1", "-Xptxas=-v,-warn-spills"]
SERIALIZED = re.compile(r"\(C75\d\d\).*wgmma\.mma_async instructions are serialized")
SPILLED = re.compile(r"Registers are spilled|[1-9]\d* bytes spill (stores|loads)")

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def ptxas_report(bits: int, tmp_path) -> str:
    src = os.path.join(ROOT, "cpp", "cuda", f"matmul_wgmma_b{bits}.cu")
    out = subprocess.run(["nvcc", *FLAGS, f"-I{os.path.join(ROOT, 'cpp')}", "-c", src,
                          "-o", str(tmp_path / f"b{bits}.o")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """{bits: (ptxas -v's report, the compiled object's path)}."""
    tmp = tmp_path_factory.mktemp("wgmma_ptxas")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        texts = pool.map(lambda b: ptxas_report(b, tmp), (2, 3, 4, 5))
        return {b: (text, tmp / f"b{b}.o") for b, text in zip((2, 3, 4, 5), texts)}


@pytest.fixture(scope="module")
def reports(objects):
    return {b: text for b, (text, _) in objects.items()}


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_no_wgmma_serialized(reports, bits):
    text = reports[bits]
    assert "kbit_matmul_wgmma_kernel" in text, "ptxas -v printed nothing for the kernel"
    assert not SERIALIZED.findall(text), [ln for ln in text.splitlines() if SERIALIZED.search(ln)]


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_no_registers_spilled(reports, bits):
    bad = [ln for ln in reports[bits].splitlines() if SPILLED.search(ln)]
    assert not bad, bad


def test_the_patterns_match_ptxas_wording():
    # (notes ptxas prints for a copy branch in the k loop and for a register cap that spills)
    assert SERIALIZED.search("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async "
                             "instructions are serialized due to program dependence on compiler-inserted "
                             "WG.AR in divergent path in the function 'k'")
    assert SERIALIZED.search("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async "
                             "instructions are serialized due to insufficient register resources for the "
                             "function 'k'")
    assert SPILLED.search("    80 bytes stack frame, 112 bytes spill stores, 96 bytes spill loads")
    assert not SPILLED.search("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    assert not SERIALIZED.search("ptxas info    : (C7519) warpgroup.arrive is injected in around line 5 "
                                 "by compiler to allow use of registers in GMMA in function 'k'")


CUOBJDUMP = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")


@pytest.mark.skipif(CUOBJDUMP is None, reason="needs cuobjdump (the CUDA toolkit's, or $CUOBJDUMP)")
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_main_loop_reads_no_thread_index(objects, bits):
    # Without pinned_to_lane (matmul_wgmma.cuh) ptxas rebuilds the decode's lane constants from the
    # thread index inside the main loop (an S2R of SR_TID and 39-65 instructions per chunk) unless
    # the code after the loop happens to need more registers.
    sass = subprocess.run([CUOBJDUMP, "-sass", str(objects[bits][1])], check=True, capture_output=True,
                          text=True).stdout
    kernels = {name: code for name, code in sass_loops.functions(sass).items() if "wgmma_kernel" in name}
    # BM 64 with J 1 and 2 and the 64-column tile (WG 1), BM 128 with J 1 and 2, BM 256; bf16 and fp16
    assert len(kernels) == 12, sorted(kernels)
    for name, code in kernels.items():
        loop = sass_loops.hot_loop(code)
        assert loop, f"no main loop found in {sass_loops.label(name)}"
        reads = [ins for _, ins in loop if ins.startswith("S2R") or " S2R " in ins]
        assert not reads, (sass_loops.label(name), reads)
