// Per-cell code extraction shared by the SIMT kernels (dequantize, generic matmul) and the
// quantize packer: with the 32 element offsets unrolled, every shift below is a compile-time
// constant, so extracting a code costs one or two shift/and instructions.
#pragma once

#include <cstdint>

#include "format.h"

namespace kbit::cuda {

// Fragment position p holding element k of the block: the inverse of kbit::fragment_k.
// k = 16*(i>>2) + 8*((i>>1)&1) + 2t + (i&1) with p = 8t + i.
__host__ __device__ constexpr int fragment_pos(int k) {
  return 8 * ((k >> 1) & 3) + ((k & 1) | (((k >> 3) & 1) << 1) | ((k >> 4) << 2));
}

// Code of element k (0..31) of a cell whose `BITS` words are in w[].
template <int BITS, int LAYOUT>
__device__ __forceinline__ uint32_t cell_code(const uint32_t (&w)[BITS], int k) {
  if constexpr (LAYOUT == kbit::kPlanes) {
    uint32_t c = 0;
#pragma unroll
    for (int b = 0; b < BITS; ++b) c |= ((w[b] >> k) & 1u) << b;
    return c;
  } else {
    const int bit = BITS * fragment_pos(k);  // compile-time when k is
    const int wi = bit >> 5, sh = bit & 31;
    uint32_t c = w[wi] >> sh;
    if (sh + BITS > 32) c |= w[wi + 1] << (32 - sh);  // code straddles two words
    return c & ((1u << BITS) - 1u);
  }
}

}  // namespace kbit::cuda
