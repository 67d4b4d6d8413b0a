"""FastDiv (cpp/cuda/fast_div.cuh), the fused kernels' division by launch constants, on the host
against C++'s division: the multiplier and shift the launcher computes, and the quotient formula
the kernels evaluate (there with __umulhi, here with a 64-bit product), for every divisor up to
4096, edge divisors, and numerators from 0 to 2^31 - 1. The harness's tests check the device side."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = r"""
#include <cstdio>
#include <random>
#include <vector>
#include "cuda/fast_div.cuh"
int main() {
  std::mt19937 rng(20261126);
  long checks = 0, bad = 0;
  auto check = [&](int d, int n) {
    const kbit::cuda::FastDiv f(d);
    const int q = f.div(n);
    ++checks;
    if (q != n / d || f.mod(n, q) != n % d) {
      if (bad++ < 5) std::printf("d=%d n=%d: %d, expected %d\n", d, n, q, n / d);
    }
  };
  std::vector<int> divisors;
  for (int d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int e = 12; e < 31; ++e)
    for (int o : {-1, 0, 1}) divisors.push_back((1 << e) + o);
  divisors.push_back(0x7fffffff);
  for (int i = 0; i < 2000; ++i) divisors.push_back(int(rng() & 0x7fffffff) | 1);
  for (int d : divisors) {
    for (long long n : {0LL, 1LL, d - 1LL, 1LL * d, d + 1LL, 2LL * d - 1, 0x7ffffffeLL, 0x7fffffffLL})
      if (n >= 0 && n <= 0x7fffffff) check(d, int(n));
    for (int i = 0; i < 64; ++i) check(d, int(rng() & 0x7fffffff));
  }
  std::printf("%ld checks, %ld wrong\n", checks, bad);
  return bad ? 1 : 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fast_div_matches_division(tmp_path):
    src = tmp_path / "fast_div_check.cu"
    src.write_text(DRIVER)
    exe = tmp_path / "fast_div_check"
    build = subprocess.run(["nvcc", "-std=c++17", "-O2", f"-I{os.path.join(ROOT, 'cpp')}", str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    assert " 0 wrong" in run.stdout
