// dequantize: planes, scales, codebook, tensor_scale -> w[B, K, N] in float32/bf16/f16.
#include <algorithm>

#include "cpu/cell_codes.h"
#include "cpu/float_convert.h"
#include "cpu/kbit_cpu.h"
#include "cpu/parallel.h"

namespace kbit::cpu {
namespace {

constexpr int64_t kTileN = 16;  // cells decoded into a [32, 16] tile, then stored row by row

template <int kBits, Layout kLayout>
void dequantize_columns(const PackedWeight& w, FloatType out_type, int64_t batch, int64_t n_begin,
                        int64_t n_end, void* out) {
  const WeightShape& s = w.shape;
  const int64_t blocks = s.k / kBlockSize;
  const float* codebook = w.codebook + batch * (int64_t(1) << kBits);
  float values[1 << kBits];
  float tile[kBlockSize][kTileN];
  for (int64_t kb = 0; kb < blocks; ++kb) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
      const int64_t width = std::min(kTileN, n_end - n0);
      for (int64_t c = 0; c < width; ++c) {
        const int64_t cell = (batch * blocks + kb) * s.n + n0 + c;
        cell_values<kBits>(codebook, w.scales[cell], w.tensor_scale[batch], values);
        dequantize_cell<kBits, kLayout>(w.planes + cell * kBits, values, &tile[0][c], kTileN);
      }
      for (int j = 0; j < kBlockSize; ++j)
        store_floats(tile[j], width, out_type, out, (batch * s.k + kb * kBlockSize + j) * s.n + n0);
    }
  }
}

}  // namespace

void dequantize(const PackedWeight& w, FloatType out_type, void* out) {
  const WeightShape& s = w.shape;
  const int threads =
      thread_count(saturating_product({s.batch, s.k, s.n}), (s.n + kTileN - 1) / kTileN);
  parallel_ranges(s.n, kTileN, threads, [&](int64_t n_begin, int64_t n_end) {
    dispatch_format(s.bits, s.layout, [&](auto bits, auto layout) {
      for (int64_t b = 0; b < s.batch; ++b)
        dequantize_columns<decltype(bits)::value, decltype(layout)::value>(w, out_type, b, n_begin,
                                                                          n_end, out);
    });
  });
}

}  // namespace kbit::cpu
