// bfloat16 / IEEE half <-> float32 in plain C++ (no compiler half types, which are not
// portable). Narrowing rounds to nearest, ties to even, and keeps NaN a (quiet) NaN of the same
// sign, which is what numpy/ml_dtypes and XLA do, so CPU results match the JAX reference.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/kbit_cpu.h"

namespace kbit::cpu {

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bfloat16 is the top half of a float32.
inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  // Adding 0x7fff plus the lowest kept bit rounds ties to even; a carry into the exponent is
  // the correct rounding up to the next binade (or to infinity).
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in float32
    const float magnitude = float(mantissa) * (1.0f / 16777216.0f);
    return bits_float(float_bits(magnitude) | sign);
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (a <= 0x33000000u) return sign;                      // <= 2^-25 rounds (ties even) to 0
  const uint32_t exponent = a >> 23;
  if (exponent < 113) {  // result is subnormal: round (1.m * 2^(e-127)) / 2^-24
    const uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    const uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    // Rounding up from 0x3ff yields 0x400: the smallest normal, correctly encoded.
    return uint16_t(sign | (kept + (rest > half || (rest == half && (kept & 1u)))));
  }
  const uint32_t kept = ((exponent - 112u) << 10) | ((a >> 13) & 0x3ffu);
  const uint32_t rest = a & 0x1fffu;
  return uint16_t(sign | (kept + (rest > 0x1000u || (rest == 0x1000u && (kept & 1u)))));
}

// Converts `count` contiguous values, rounding to `type`.
inline void store_floats(const float* values, int64_t count, FloatType type, void* data,
                         int64_t offset) {
  switch (type) {
    case FloatType::kBF16: {
      uint16_t* out = static_cast<uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(values[i]);
      break;
    }
    case FloatType::kF16: {
      uint16_t* out = static_cast<uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = float_to_f16(values[i]);
      break;
    }
    default: std::memcpy(static_cast<float*>(data) + offset, values, size_t(count) * 4);
  }
}

// Converts `count` contiguous values to float32.
inline void load_floats(const void* data, FloatType type, int64_t offset, int64_t count,
                        float* values) {
  switch (type) {
    case FloatType::kBF16: {
      const uint16_t* in = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) values[i] = bf16_to_float(in[i]);
      break;
    }
    case FloatType::kF16: {
      const uint16_t* in = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) values[i] = f16_to_float(in[i]);
      break;
    }
    default: std::memcpy(values, static_cast<const float*>(data) + offset, size_t(count) * 4);
  }
}

}  // namespace kbit::cpu
