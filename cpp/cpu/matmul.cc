// matmul: y[b, m, n] = sum_k x[b, m, k] * dequantize(w)[b, k, n], fused.
//
// Each thread owns a range of columns. For a tile of kTileN columns and up to kTileM rows of x it
// walks K in chunks: the chunk's cells are dequantized (a 2^bits-entry value table per cell,
// then one lookup per element) into a small float32 panel that stays in L1, and every x row of
// the tile is multiplied into it. W is never materialized; each weight is decoded once per
// kTileM rows of x, so decoding is amortized as M grows.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/cell_codes.h"
#include "cpu/float_convert.h"
#include "cpu/kbit_cpu.h"
#include "cpu/parallel.h"
#include "glu.h"

namespace kbit::cpu {
namespace {

constexpr int64_t kTileN = 16;        // panel row = 64 bytes: one cache line, whole vectors
constexpr int64_t kChunkBlocks = 8;   // panel of 256 x 16 floats = 16 KB
constexpr int64_t kTileM = 64;        // accumulators 64 x 16 floats = 4 KB
constexpr int64_t kChunkRows = kChunkBlocks * kBlockSize;

// A tile's cells in consecutive K blocks lie N * bits words apart, too far for the hardware
// prefetcher (it stays within a page), so they are requested a few blocks ahead.
constexpr int64_t kPrefetchBlocks = 4;

inline void prefetch_cells(const uint32_t* words, int64_t count, const uint8_t* scales) {
#if defined(__GNUC__)
  for (int64_t i = 0; i < count; i += 64 / int64_t(sizeof(uint32_t))) __builtin_prefetch(words + i);
  __builtin_prefetch(words + count - 1);
  __builtin_prefetch(scales);
#endif
}

// The build targets baseline x86-64 (SSE2) so the module runs anywhere; the multiply-add loops
// get AVX2/FMA and AVX-512 clones picked at load time (4-5x faster at M >= 16).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 12
#define KBIT_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KBIT_VECTOR_CLONES
#endif

// acc[r][:] += sum_k x[r * x_stride + k] * panel[k][:] for r < kRows, k < rows. The rows share
// each panel load and their accumulators stay in registers.
#if defined(__GNUC__)
// One panel row as a vector, so the compiler vectorizes across columns (left to itself it
// vectorizes across k with shuffles, 2x slower): 1 zmm, 2 ymm or 4 xmm registers.
typedef float PanelRow __attribute__((vector_size(kTileN * sizeof(float)), aligned(4)));

template <int kRows>
inline void accumulate_rows(const float* x, int64_t x_stride, const float* panel, int64_t rows,
                            float* acc) {
  PanelRow a[kRows];
  for (int r = 0; r < kRows; ++r) std::memcpy(&a[r], acc + r * kTileN, sizeof(PanelRow));
  for (int64_t k = 0; k < rows; ++k) {
    PanelRow p;
    std::memcpy(&p, panel + k * kTileN, sizeof(p));
    for (int r = 0; r < kRows; ++r) a[r] += x[r * x_stride + k] * p;
  }
  for (int r = 0; r < kRows; ++r) std::memcpy(acc + r * kTileN, &a[r], sizeof(PanelRow));
}
#else
template <int kRows>
inline void accumulate_rows(const float* x, int64_t x_stride, const float* panel, int64_t rows,
                            float* acc) {
  for (int64_t k = 0; k < rows; ++k)
    for (int r = 0; r < kRows; ++r)
      for (int64_t n = 0; n < kTileN; ++n)
        acc[r * kTileN + n] += x[r * x_stride + k] * panel[k * kTileN + n];
}
#endif

KBIT_VECTOR_CLONES void accumulate_4_rows(const float* x, int64_t x_stride, const float* panel,
                                          int64_t rows, float* acc) {
  accumulate_rows<4>(x, x_stride, panel, rows, acc);
}

KBIT_VECTOR_CLONES void accumulate_1_row(const float* x, const float* panel, int64_t rows,
                                         float* acc) {
#if defined(__GNUC__)
  // Two partial sums (even and odd k; rows is even) halve the chain of dependent adds that
  // otherwise bounds a single row.
  PanelRow even, odd = {};
  std::memcpy(&even, acc, sizeof(even));
  for (int64_t k = 0; k < rows; k += 2) {
    PanelRow p0, p1;
    std::memcpy(&p0, panel + k * kTileN, sizeof(p0));
    std::memcpy(&p1, panel + (k + 1) * kTileN, sizeof(p1));
    even += x[k] * p0;
    odd += x[k + 1] * p1;
  }
  even += odd;
  std::memcpy(acc, &even, sizeof(even));
#else
  accumulate_rows<1>(x, 0, panel, rows, acc);
#endif
}

// One row of a tile's sums (width columns from n0) into y, whose rows have y_cols columns: as
// they are, or (glu) act(gate) * up per column pair, at column n0 / 2 (n0 and width are even).
inline void store_row(const float* sums, int64_t width, int32_t glu, FloatType y_type, void* y,
                      int64_t row, int64_t y_cols, int64_t n0) {
  if (glu == kGluNone) {
    store_floats(sums, width, y_type, y, row * y_cols + n0);
    return;
  }
  const GluLogit logit(glu);
  float gated[kTileN / 2];
  for (int64_t j = 0; j < width / 2; ++j) gated[j] = glu_apply(logit, sums[2 * j], sums[2 * j + 1]);
  store_floats(gated, width / 2, y_type, y, row * y_cols + n0 / 2);
}

// x: float32 [m, K], the rows multiplied by weight `batch`; computes rows [y_row, y_row + m) of
// y at columns n_begin:n_end (or, with glu, their column pairs).
template <int kBits, Layout kLayout>
void matmul_columns(const float* x, int64_t m, const PackedWeight& w, int32_t glu,
                    FloatType y_type, void* y, int64_t y_row, int64_t batch, int64_t n_begin,
                    int64_t n_end) {
  const WeightShape& s = w.shape;
  const int64_t blocks = s.k / kBlockSize;
  const float* codebook = w.codebook + batch * (int64_t(1) << kBits);
  const float tensor_scale = w.tensor_scale[batch];
  const int64_t y_cols = glu == kGluNone ? s.n : s.n / 2;
  // Panel columns past a ragged tile's width are never stored; zeroing them once keeps the
  // arithmetic on them finite and defined.
  alignas(64) float panel[kChunkRows][kTileN] = {};
  alignas(64) float acc[kTileM][kTileN];
  float values[1 << kBits];

  for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
    const int64_t width = std::min(kTileN, n_end - n0);
    for (int64_t m0 = 0; m0 < m; m0 += kTileM) {
      const int64_t tile_rows = std::min(kTileM, m - m0);
      std::memset(acc, 0, sizeof(acc));
      const float* x_tile = x + m0 * s.k;
      for (int64_t kb0 = 0; kb0 < blocks; kb0 += kChunkBlocks) {
        const int64_t chunk_blocks = std::min(kChunkBlocks, blocks - kb0);
        for (int64_t kb = kb0; kb < kb0 + chunk_blocks; ++kb) {
          const int64_t first_cell = (batch * blocks + kb) * s.n + n0;
          if (kb + kPrefetchBlocks < blocks)
            prefetch_cells(w.planes + (first_cell + kPrefetchBlocks * s.n) * kBits,
                           width * kBits, w.scales + first_cell + kPrefetchBlocks * s.n);
          for (int64_t c = 0; c < width; ++c) {
            cell_values<kBits>(codebook, w.scales[first_cell + c], tensor_scale, values);
            dequantize_cell<kBits, kLayout>(w.planes + (first_cell + c) * kBits, values,
                                            &panel[(kb - kb0) * kBlockSize][c], kTileN);
          }
        }
        const int64_t rows = chunk_blocks * kBlockSize;
        const float* x_chunk = x_tile + kb0 * kBlockSize;
        int64_t r = 0;
        for (; r + 4 <= tile_rows; r += 4)
          accumulate_4_rows(x_chunk + r * s.k, s.k, &panel[0][0], rows, acc[r]);
        for (; r < tile_rows; ++r) accumulate_1_row(x_chunk + r * s.k, &panel[0][0], rows, acc[r]);
      }
      for (int64_t r = 0; r < tile_rows; ++r)
        store_row(acc[r], width, glu, y_type, y, y_row + m0 + r, y_cols, n0);
    }
  }
}

}  // namespace

void matmul_rows(const float* x, int64_t m, const PackedWeight& w, int64_t batch, int32_t glu,
                 FloatType y_type, void* y, int64_t y_row, int64_t n_begin, int64_t n_end) {
  dispatch_format(w.shape.bits, w.shape.layout, [&](auto bits, auto layout) {
    matmul_columns<decltype(bits)::value, decltype(layout)::value>(x, m, w, glu, y_type, y, y_row,
                                                                  batch, n_begin, n_end);
  });
}

void matmul(const void* x, FloatType x_type, int64_t m, const PackedWeight& w, int32_t glu,
            void* y) {
  const WeightShape& s = w.shape;
  if (m == 0 || s.n == 0 || s.batch == 0) return;
  // Converting x once up front lets every thread read float32 rows.
  std::vector<float> x_converted;
  const float* x_f32 = static_cast<const float*>(x);
  if (x_type != FloatType::kF32) {
    x_converted.resize(size_t(s.batch * m * s.k));
    load_floats(x, x_type, 0, int64_t(x_converted.size()), x_converted.data());
    x_f32 = x_converted.data();
  }
  // Per weight element: one decode plus one multiply-add per x row.
  const int64_t work = saturating_product({s.batch, s.k, s.n, m + 4});
  const int threads = thread_count(work, (s.n + kTileN - 1) / kTileN);
  parallel_ranges(s.n, kTileN, threads, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t b = 0; b < s.batch; ++b)
      matmul_rows(x_f32 + b * m * s.k, m, w, b, glu, x_type, y, b * m, n_begin, n_end);
  });
}

}  // namespace kbit::cpu
