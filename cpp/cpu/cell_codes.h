// Packing and unpacking the 32 codes of one cell in either layout (format.h defines both).
// Templated on the bit width so shifts and masks are constants in the hot loops.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "format.h"

namespace kbit::cpu {

// f(std::integral_constant<int, 0>{}) ... f(..., kCount - 1>{}): a loop unrolled by construction,
// so expressions of the index (fragment_k of it, shift amounts) fold to constants.
template <class F, int... kIndex>
inline void static_for_impl(F&& f, std::integer_sequence<int, kIndex...>) {
  (f(std::integral_constant<int, kIndex>{}), ...);
}
template <int kCount, class F>
inline void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, kCount>{});
}

// Byte i of kSpreadBits[v] is bit i of v: turns one byte of a bit-plane into 8 one-bit codes.
constexpr std::array<uint64_t, 256> make_spread_bits() {
  std::array<uint64_t, 256> table{};
  for (int v = 0; v < 256; ++v)
    for (int i = 0; i < 8; ++i) table[v] |= uint64_t((v >> i) & 1) << (8 * i);
  return table;
}
inline constexpr std::array<uint64_t, 256> kSpreadBits = make_spread_bits();

// codes[j] = code of element j of the cell; the cell's `bits` words are written in full.
template <int kBits>
inline void pack_cell(const uint8_t* codes, Layout layout, uint32_t* words) {
  uint32_t packed[kBits] = {};
  if (layout == kPlanes) {
    for (int j = 0; j < kBlockSize; ++j)
      for (int b = 0; b < kBits; ++b) packed[b] |= uint32_t((codes[j] >> b) & 1u) << j;
  } else {
    for (int p = 0; p < kBlockSize; ++p) {
      const uint32_t code = codes[fragment_k(p)];
      const int bit = kBits * p, word = bit >> 5, offset = bit & 31;
      packed[word] |= code << offset;
      if (offset + kBits > 32) packed[word + 1] |= code >> (32 - offset);  // straddles a word
    }
  }
  std::memcpy(words, packed, sizeof(packed));
}

// Calls emit(element, code) for the 32 elements of a cell (in an order that suits the layout).
template <int kBits, Layout kLayout, class Emit>
inline void unpack_cell(const uint32_t* words, Emit&& emit) {
  if constexpr (kLayout == kPlanes) {
    // Eight elements at a time: spread one byte of every plane into per-element bytes.
    static_for<4>([&](auto q) {
      uint64_t codes8 = 0;
      for (int b = 0; b < kBits; ++b) codes8 |= kSpreadBits[(words[b] >> (8 * q)) & 255u] << b;
      static_for<8>([&](auto i) { emit(8 * q + i, uint32_t(codes8 >> (8 * i)) & 255u); });
    });
  } else {
    // Positions 8t..8t+7 fill bits [8*kBits*t, 8*kBits*(t+1)), i.e. start at byte kBits*t:
    // one unaligned 64-bit load (from a zero-padded copy) holds all eight codes.
    uint8_t bytes[4 * kBits + 8] = {};
    std::memcpy(bytes, words, 4 * kBits);
    constexpr uint64_t kMask = (1u << kBits) - 1u;
    static_for<4>([&](auto t) {
      uint64_t window;
      std::memcpy(&window, bytes + kBits * t, 8);  // little-endian host, as the format is
      static_for<8>([&](auto i) {
        emit(fragment_k(8 * t + i), uint32_t((window >> (kBits * i)) & kMask));
      });
    });
  }
}

// The cell's 2^bits dequantized values: (codebook[c] * decode_e4m4(scale)) * tensor_scale, the
// contract's float32 expression, so looking values up is bit-exact with computing them.
template <int kBits>
inline void cell_values(const float* codebook, uint8_t scale, float tensor_scale, float* values) {
  const float block_scale = decode_e4m4(scale);
  for (int c = 0; c < (1 << kBits); ++c) values[c] = (codebook[c] * block_scale) * tensor_scale;
}

// out[j * stride] = dequantized element j of the cell.
template <int kBits, Layout kLayout>
inline void dequantize_cell(const uint32_t* words, const float* values, float* out,
                            int64_t stride) {
  unpack_cell<kBits, kLayout>(words, [&](int j, uint32_t code) { out[j * stride] = values[code]; });
}

// Calls f(BitsTag<bits>{}) / f(BitsTag<bits>{}, LayoutTag<layout>{}): the runtime bit width
// and layout become compile-time constants, so each kernel is instantiated once per format.
template <int kBits> struct BitsTag { static constexpr int value = kBits; };
template <Layout kLayout> struct LayoutTag { static constexpr Layout value = kLayout; };

template <class F>
inline void dispatch_bits(int bits, F&& f) {
  switch (bits) {
    case 2: f(BitsTag<2>{}); break;
    case 3: f(BitsTag<3>{}); break;
    case 4: f(BitsTag<4>{}); break;
    default: f(BitsTag<5>{}); break;
  }
}

template <class F>
inline void dispatch_format(int bits, Layout layout, F&& f) {
  dispatch_bits(bits, [&](auto bits_tag) {
    if (layout == kPlanes) f(bits_tag, LayoutTag<kPlanes>{});
    else f(bits_tag, LayoutTag<kFragment>{});
  });
}

}  // namespace kbit::cpu
