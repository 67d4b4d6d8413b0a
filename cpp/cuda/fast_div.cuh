// Division by a launch constant, as a multiply-high, an add and a shift.
//
// Why: an integer division by a runtime value compiles to ~20 instructions around a MUFU.RCP. The
// fused kernels' work walk (matmul_fused_walk.cuh, ItemWalk) divides by the cluster size, the
// number of clusters, the blocks of M and the column groups before a CTA's first copy can go
// out: with divisions the producer has its first cursor 0.27 us after entry (H200). The launcher
// computes each divisor's multiplier once per launch instead (WalkDivs).
//
// Method (round-up multiplier, as CUTLASS's FastDivmod): with s = ceil(log2 d) and
// m = floor(2^32 (2^s - d) / d) + 1, n / d = (umulhi(n, m) + n) >> s for 0 <= n < 2^31 (the sum
// stays below 2^32 there). tests/test_fast_div.py checks it on the host; the kernel harness's
// tests, on the device.
#pragma once

#include <cstdint>

namespace kbit::cuda {

struct FastDiv {
  int d;           // the divisor, >= 1
  uint32_t mul;    // the multiplier m above
  uint32_t shift;  // s

  FastDiv() = default;
  // (A divisor below 1 gets the multiplier of 1 rather than a division by zero here; the
  // launchers never pass one: matmul.cu returns before an empty product.)
  __host__ __device__ explicit FastDiv(int divisor) : d(divisor), mul(0), shift(0) {
    const uint64_t dd = divisor > 0 ? uint64_t(divisor) : 1;
    while ((uint64_t(1) << shift) < dd) ++shift;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - dd)) / dd + 1);
  }
  // n / d, for 0 <= n < 2^31
  __host__ __device__ __forceinline__ int div(int n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(uint32_t(n), mul);
#else
    const uint32_t hi = uint32_t((uint64_t(uint32_t(n)) * mul) >> 32);
#endif
    return int((hi + uint32_t(n)) >> shift);
  }
  // n % d, given q = div(n)
  __host__ __device__ __forceinline__ int mod(int n, int q) const { return n - q * d; }
};

}  // namespace kbit::cuda
