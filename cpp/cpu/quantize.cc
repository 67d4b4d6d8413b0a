// quantize: w[B, K, N] -> planes[B, K/32, N, bits], scales[B, K/32, N]. Must be bit-exact with
// kbit_jax/reference.py, so every step is the scalar definition from format.h, in float32.
#include <algorithm>
#include <cmath>

#include "cpu/cell_codes.h"
#include "cpu/float_convert.h"
#include "cpu/kbit_cpu.h"
#include "cpu/parallel.h"

namespace kbit::cpu {
namespace {

constexpr int64_t kTileN = 16;  // columns loaded together: a block's rows are then contiguous

// max |w|, propagating NaN like jnp.max: a block holding a NaN gets absmax NaN, hence scale
// byte 0 and every element normalized to 0, as in the reference.
inline float absmax_nan_propagating(float current, float w) {
  const float a = std::fabs(w);
  return (a > current || a != a) && current == current ? a : current;
}

// codes[c] = nearest_code(normalized(w[c], absmax[c]), codebook) for the kTileN columns of one
// row; the same float operations as format.h, arranged so the compiler vectorizes across
// columns; keep it in step with kbit::nearest_code. (|r - e| is computed as fabs(r - e), which
// equals format.h's branch because a - b == -(b - a) exactly in IEEE arithmetic.)
template <int kBits>
inline void nearest_codes(const float* w, const float* absmax, const float* codebook,
                          uint8_t* codes) {
  float r[kTileN], best_distance[kTileN];
  int32_t best[kTileN];
  for (int64_t c = 0; c < kTileN; ++c) {
    r[c] = normalized(w[c], absmax[c]);
    best_distance[c] = std::fabs(r[c] - codebook[0]);
    best[c] = 0;
  }
  for (int32_t e = 1; e < (1 << kBits); ++e) {
    for (int64_t c = 0; c < kTileN; ++c) {
      const float distance = std::fabs(r[c] - codebook[e]);
      const bool closer = distance < best_distance[c];  // strict: ties keep the lower index
      best_distance[c] = closer ? distance : best_distance[c];
      best[c] = closer ? e : best[c];
    }
  }
  for (int64_t c = 0; c < kTileN; ++c) codes[c] = uint8_t(best[c]);
}

template <int kBits>
void quantize_columns(const void* w, FloatType w_type, const float* codebook, float tensor_scale,
                      const WeightShape& s, int64_t batch, int64_t n_begin, int64_t n_end,
                      uint32_t* planes, uint8_t* scales) {
  const int64_t blocks = s.k / kBlockSize;
  float tile[kBlockSize][kTileN] = {};  // columns past a ragged tile's width stay zero
  float absmax[kTileN];
  uint8_t codes_by_row[kBlockSize][kTileN];
  uint8_t codes[kBlockSize];
  for (int64_t kb = 0; kb < blocks; ++kb) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
      const int64_t width = std::min(kTileN, n_end - n0);
      for (int j = 0; j < kBlockSize; ++j)
        load_floats(w, w_type, (batch * s.k + kb * kBlockSize + j) * s.n + n0, width, tile[j]);
      std::fill(absmax, absmax + kTileN, 0.f);
      for (int j = 0; j < kBlockSize; ++j)
        for (int64_t c = 0; c < kTileN; ++c)
          absmax[c] = absmax_nan_propagating(absmax[c], tile[j][c]);
      for (int j = 0; j < kBlockSize; ++j)
        nearest_codes<kBits>(tile[j], absmax, codebook, codes_by_row[j]);
      for (int64_t c = 0; c < width; ++c) {
        for (int j = 0; j < kBlockSize; ++j) codes[j] = codes_by_row[j][c];
        const int64_t cell = (batch * blocks + kb) * s.n + n0 + c;
        scales[cell] = uint8_t(block_scale_byte(absmax[c], tensor_scale));
        pack_cell<kBits>(codes, s.layout, planes + cell * kBits);
      }
    }
  }
}

}  // namespace

void quantize(const void* w, FloatType w_type, const float* codebook, const float* tensor_scale,
              const WeightShape& shape, uint32_t* planes, uint8_t* scales) {
  const int entries = 1 << shape.bits;
  // nearest_code scans the codebook: about `entries` operations per element.
  const int64_t work = saturating_product({shape.batch, shape.k, shape.n, entries});
  const int threads = thread_count(work, (shape.n + kTileN - 1) / kTileN);
  parallel_ranges(shape.n, kTileN, threads, [&](int64_t n_begin, int64_t n_end) {
    dispatch_bits(shape.bits, [&](auto bits) {
      for (int64_t b = 0; b < shape.batch; ++b)
        quantize_columns<decltype(bits)::value>(w, w_type, codebook + b * entries,
                                                tensor_scale[b], shape, b, n_begin, n_end,
                                                planes, scales);
    });
  });
}

}  // namespace kbit::cpu
