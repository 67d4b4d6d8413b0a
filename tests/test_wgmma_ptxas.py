"""The wgmma kernel (cpp/cuda/matmul_wgmma.cuh) as ptxas compiles it, on any machine with nvcc:
no wgmma serialized and no register spilled, for every bits value.

Why: ptxas makes every wgmma of a kernel wait for the previous one when the pipeline around them
is not one it can prove safe (its "Potential Performance Loss: wgmma.mma_async instructions are
serialized" notes, C7510-C7520), and the kernel still gives right results, only slower. Session 23
met two of them: a copy branch on the thread index inside the k loop (C7520) and a 288-thread
block whose register cap made it spill (C7512). Both are visible at compile time, before a GPU run.
"""

import concurrent.futures
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wgmma_ptxas")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip((2, 3, 4, 5), pool.map(lambda b: ptxas_report(b, tmp), (2, 3, 4, 5))))


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
    # (the notes ptxas printed for the two versions that session 23 dropped)
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
