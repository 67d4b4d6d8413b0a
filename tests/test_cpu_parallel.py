"""cpp/cpu/parallel.h on the host: a body that throws on any thread reaches the caller as an
exception after every thread is joined (a joinable std::thread destroyed on an exception path
would terminate the process), and work estimates saturate instead of overflowing int64."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = r"""
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include "cpu/parallel.h"
using namespace kbit::cpu;
int main() {
  int failures = 0;
  // A throwing body on a worker thread, on the calling thread, and on all of them.
  for (int thrower : {0, 3, 7, -1}) {
    std::atomic<int> ranges{0};
    try {
      parallel_ranges(8 * 16, 16, 8, [&](int64_t begin, int64_t) {
        ranges.fetch_add(1);
        if (thrower < 0 || begin / 16 == thrower) throw std::runtime_error("body failed");
      });
      std::printf("thrower %d: no exception reached the caller\n", thrower);
      ++failures;
    } catch (const std::runtime_error& e) {
      if (ranges.load() != 8) { std::printf("thrower %d: %d of 8 ranges ran\n", thrower, ranges.load()); ++failures; }
    }
  }
  const int64_t max = std::numeric_limits<int64_t>::max();
  if (saturating_product({int64_t(1) << 40, int64_t(1) << 40, 32}) != max) ++failures;
  if (saturating_product({3, 5, 7}) != 105) ++failures;
  if (saturating_product({max, 1}) != max || saturating_product({0, max, max}) != 0) ++failures;
  if (thread_count(saturating_product({int64_t(1) << 40, int64_t(1) << 40, 33}), 4) < 1) ++failures;
  std::printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler")
def test_parallel_ranges_joins_and_rethrows(tmp_path):
    src = tmp_path / "parallel_check.cc"
    src.write_text(DRIVER)
    exe = tmp_path / "parallel_check"
    compiler = shutil.which("g++") or shutil.which("c++")
    build = subprocess.run([compiler, "-std=c++17", "-O1", "-pthread", f"-I{os.path.join(ROOT, 'cpp')}", str(src),
                            "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "0 failures" in run.stdout
