// The kbit v1 weight format as constants and exact scalar helpers, shared by the CPU
// kernels, the CUDA kernels and (by value) the Python reference. Everything here must stay
// bit-for-bit identical to kbit_jax/reference.py: tests compare codes, planes and scales exactly.
//
// A weight W[K, N] is cut into cells (kb, n) of 32 consecutive elements along K. A cell holds
// one E4M4 scale byte and `bits` uint32 words of codes, in one of two layouts:
//   kPlanes   (canonical): bit j of word b is bit b of the code of element 32*kb + j, i.e. what
//             __ballot_sync produces when lane j holds element j.
//   kFragment (GPU GEMM): the 32 codes are packed densely, `bits` bits each, in "fragment order":
//             the code of element kFragmentK[p] sits at bits [bits*p, bits*p + bits) of the cell's
//             little-endian concatenation of its words. Fragment order puts the eight elements
//             one thread of an mma.m16n8k16 quad needs (k = 2t, 2t+1, 2t+8, 2t+9 of both k16
//             halves of the block) at positions 8t..8t+7, so that thread reads one contiguous
//             8*bits-bit field and two neighbouring codes form one operand register.
// Both layouts keep each cell self-contained, so any slice along K (whole blocks) or N is itself
// a valid weight, and converting between them is a permutation inside the cell.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KBIT_HD __host__ __device__ __forceinline__
#else
#define KBIT_HD inline
#endif

namespace kbit {

constexpr int kBlockSize = 32;  // elements per cell along K: one warp, one ballot word
constexpr int kMinBits = 2;
constexpr int kMaxBits = 5;     // 2^5 = 32 codebook entries: one per lane
constexpr int kE4M4Bias = 11;   // largest finite scale: 2^(15-11) * (1 + 15/16) = 31
constexpr float kE4M4Max = 31.0f;

enum Layout : int32_t { kPlanes = 0, kFragment = 1 };

// Element (offset inside the block) stored at fragment position p. Position p = 8t + i belongs
// to quad thread t; i walks (k16 half, upper 8 rows, pair member) as in the mma operand fragment.
KBIT_HD int fragment_k(int p) {
  const int t = p >> 3, i = p & 7;
  return 16 * (i >> 2) + 8 * ((i >> 1) & 1) + 2 * t + (i & 1);
}

// E4M4: 4-bit exponent (bias 11), 4-bit mantissa, IEEE-style subnormals, no inf/NaN.
//   e > 0: 2^(e-11) * (1 + m/16);  e = 0: 2^-10 * m/16;  byte 0 is 0.0.
// Byte order equals value order, which makes encoding a search over midpoints.
KBIT_HD float decode_e4m4(uint32_t byte) {
  const uint32_t e = (byte >> 4) & 15u, m = byte & 15u;
  // Build the float directly: for e > 0 the value is a normal float with exponent e-11 and
  // the 4 mantissa bits at the top of the 23-bit field; for e = 0 it is m * 2^-14 (exact).
  union { uint32_t u; float f; } bits_to_float;
  bits_to_float.u = ((e + 127u - kE4M4Bias) << 23) | (m << 19);
  return e ? bits_to_float.f : float(m) * (1.0f / 16384.0f);
}

// Round to nearest, ties to the lower code, saturating at 31 (never wrapping), NaN and values
// <= 0 to byte 0. A value rounds up past code c exactly when it exceeds the midpoint of codes
// c and c+1; midpoints of neighbouring E4M4 values are exact in float32, so this comparison is
// the same on every platform. Binary search: 8 steps.
KBIT_HD uint32_t encode_e4m4(float v) {
  uint32_t code = 0;
  for (uint32_t step = 128; step >= 1; step >>= 1) {
    const uint32_t probe = code + step;  // is v above the midpoint between probe-1 and probe?
    if (probe <= 255u && v > 0.5f * (decode_e4m4(probe - 1) + decode_e4m4(probe))) code = probe;
  }
  return code;
}

// A block's scale byte: encode_e4m4(absmax / tensor_scale), one code lower where rounding up
// would make the block's scale, decode_e4m4(byte) * tensor_scale, overflow float32 (absmax within
// 2^-5 of float32's largest value; the lower code is then within 2^-5 of absmax too).
constexpr float kFloatMax = 3.40282346638528859812e+38f;
KBIT_HD uint32_t block_scale_byte(float absmax, float tensor_scale) {
  uint32_t byte = encode_e4m4(absmax / tensor_scale);
  if (byte > 0u && decode_e4m4(byte) * tensor_scale > kFloatMax) --byte;
  return byte;
}

// Index of the codebook entry nearest to r; ties go to the lower index.
KBIT_HD uint32_t nearest_code(float r, const float* codebook, int entries) {
  uint32_t best = 0;
  float best_dist = r - codebook[0] < 0 ? codebook[0] - r : r - codebook[0];
  for (int i = 1; i < entries; ++i) {
    const float d = r - codebook[i] < 0 ? codebook[i] - r : r - codebook[i];
    if (d < best_dist) { best_dist = d; best = uint32_t(i); }
  }
  return best;
}

// The value a block's codes are matched against: w * (1 / absmax), and 0 for an all-zero block.
// Reciprocal-then-multiply rather than w / absmax because XLA rewrites a division by a
// broadcast divisor into exactly this form, and the reference must agree bit for bit (true
// division differs by an ulp in ~25% of elements and flips about one code in a million).
// From absmax = 2^126 on, 1 / absmax is subnormal, which flush-to-zero float modes (XLA's CPU
// threads) turn into 0: such blocks are first scaled by 2^-64 (exact), keeping the reciprocal
// normal. Every other block takes the unscaled path, so its codes do not depend on this.
constexpr float kLargeAbsmax = 0x1p126f;
constexpr float kLargeAbsmaxPrescale = 0x1p-64f;
KBIT_HD float normalized(float w, float absmax) {
  if (!(absmax > 0.f)) return 0.f;
  if (absmax >= kLargeAbsmax) {
    w *= kLargeAbsmaxPrescale;
    absmax *= kLargeAbsmaxPrescale;
  }
  return w * (1.0f / absmax);
}

}  // namespace kbit
