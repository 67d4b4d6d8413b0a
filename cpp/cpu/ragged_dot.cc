// ragged_dot: the grouped expert product of a mixture-of-experts layer. x's rows are sorted by
// group; group g owns rows [start_g, end_g) (prefix sums of group_sizes) and multiplies
// dequantize(w)[g]: y[m, n] = sum_k x[m, k] * dequantize(w)[g(m), k, n]. Rows at or past the
// last group's end are zeros.
//
// Each thread owns a range of columns. For every group with rows it walks that group's weight
// once per kTileM rows, as matmul does: a chunk of cells is decoded into a small float32 panel
// that stays in L1 and the group's rows are multiplied into it. A group with no rows is skipped
// before any of its weight is read.
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

constexpr int64_t kTileN = 16;        // panel row = 64 bytes: one cache line
constexpr int64_t kChunkBlocks = 8;   // panel of 256 x 16 floats = 16 KB
constexpr int64_t kTileM = 32;        // accumulators 32 x 16 floats = 2 KB
constexpr int64_t kChunkRows = kChunkBlocks * kBlockSize;

// acc[r][:] += sum_k x[r][k] * panel[k][:] for r < rows_m, k < rows_k, written over whole
// panel rows so the compiler vectorizes across the kTileN columns.
inline void accumulate(const float* x, int64_t x_stride, int64_t rows_m, const float* panel,
                       int64_t rows_k, float (*acc)[kTileN]) {
  for (int64_t r = 0; r < rows_m; ++r) {
    float a[kTileN];
    std::memcpy(a, acc[r], sizeof(a));
    const float* xr = x + r * x_stride;
    for (int64_t k = 0; k < rows_k; ++k) {
      const float xv = xr[k];
      const float* p = panel + k * kTileN;
      for (int64_t n = 0; n < kTileN; ++n) a[n] += xv * p[n];
    }
    std::memcpy(acc[r], a, sizeof(a));
  }
}

// Row `row` of y (y_cols columns) at columns [n0, n0 + width) from float32 sums, or with a GLU
// act(gate) * up per column pair at column n0 / 2 (n0 and width are even).
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

// Rows [row_begin, row_end) of x (float32 [M, K]) times group g's weight, columns
// [n_begin, n_end) of the product into y.
template <int kBits, Layout kLayout>
void group_columns(const float* x, int64_t row_begin, int64_t row_end, const PackedWeight& w,
                   int64_t g, int32_t glu, FloatType y_type, void* y, int64_t n_begin,
                   int64_t n_end) {
  const WeightShape& s = w.shape;
  const int64_t blocks = s.k / kBlockSize;
  const float* codebook = w.codebook + g * (int64_t(1) << kBits);
  const float tensor_scale = w.tensor_scale[g];
  const int64_t y_cols = glu == kGluNone ? s.n : s.n / 2;
  // Panel columns past a ragged tile's width are never stored; zeroing them once keeps the
  // arithmetic on them finite.
  alignas(64) float panel[kChunkRows][kTileN] = {};
  alignas(64) float acc[kTileM][kTileN];
  float values[1 << kBits];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
    const int64_t width = std::min(kTileN, n_end - n0);
    for (int64_t m0 = row_begin; m0 < row_end; m0 += kTileM) {
      const int64_t tile_rows = std::min(kTileM, row_end - m0);
      std::memset(acc, 0, sizeof(acc));
      for (int64_t kb0 = 0; kb0 < blocks; kb0 += kChunkBlocks) {
        const int64_t chunk_blocks = std::min(kChunkBlocks, blocks - kb0);
        for (int64_t kb = kb0; kb < kb0 + chunk_blocks; ++kb) {
          const int64_t first_cell = (g * blocks + kb) * s.n + n0;
          for (int64_t c = 0; c < width; ++c) {
            cell_values<kBits>(codebook, w.scales[first_cell + c], tensor_scale, values);
            dequantize_cell<kBits, kLayout>(w.planes + (first_cell + c) * kBits, values,
                                            &panel[(kb - kb0) * kBlockSize][c], kTileN);
          }
        }
        accumulate(x + m0 * s.k + kb0 * kBlockSize, s.k, tile_rows, &panel[0][0],
                   chunk_blocks * kBlockSize, acc);
      }
      for (int64_t r = 0; r < tile_rows; ++r) store_row(acc[r], width, glu, y_type, y, m0 + r, y_cols, n0);
    }
  }
}

}  // namespace

void group_bounds(const int32_t* group_sizes, int64_t groups, int64_t m, int64_t* starts) {
  int64_t end = 0;
  starts[0] = 0;
  for (int64_t g = 0; g < groups; ++g) {
    end = std::min(m, end + std::max<int64_t>(0, group_sizes[g]));
    starts[g + 1] = end;
  }
}

void ragged_dot(const void* x, FloatType x_type, int64_t m, const PackedWeight& w,
                const int32_t* group_sizes, int32_t glu, void* y) {
  const WeightShape& s = w.shape;
  if (m == 0 || s.n == 0) return;
  std::vector<int64_t> starts(size_t(s.batch) + 1);
  group_bounds(group_sizes, s.batch, m, starts.data());
  const int64_t rows = starts[size_t(s.batch)];
  const int64_t y_cols = glu == kGluNone ? s.n : s.n / 2;
  const int64_t y_item = x_type == FloatType::kF32 ? 4 : 2;
  // Rows past the groups: zeros (all-zero bits are +0 in every float type).
  std::memset(static_cast<char*>(y) + rows * y_cols * y_item, 0, size_t((m - rows) * y_cols * y_item));
  if (rows == 0) return;
  // The grouped rows converted to float32 once, so every thread reads float32.
  std::vector<float> x_converted;
  const float* x_f32 = static_cast<const float*>(x);
  if (x_type != FloatType::kF32) {
    x_converted.resize(size_t(rows * s.k));
    load_floats(x, x_type, 0, rows * s.k, x_converted.data());
    x_f32 = x_converted.data();
  }
  int64_t active = 0;
  for (int64_t g = 0; g < s.batch; ++g) active += starts[size_t(g) + 1] > starts[size_t(g)];
  // Per weight element of an active group: one decode per kTileM rows plus one multiply-add
  // per row.
  const int64_t work = s.k * s.n * (rows + 4 * active);
  const int threads = thread_count(work, (s.n + kTileN - 1) / kTileN);
  parallel_ranges(s.n, kTileN, threads, [&](int64_t n_begin, int64_t n_end) {
    dispatch_format(s.bits, s.layout, [&](auto bits, auto layout) {
      for (int64_t g = 0; g < s.batch; ++g) {
        if (starts[size_t(g) + 1] == starts[size_t(g)]) continue;  // no rows: no weight read
        group_columns<decltype(bits)::value, decltype(layout)::value>(
            x_f32, starts[size_t(g)], starts[size_t(g) + 1], w, g, glu, x_type, y, n_begin, n_end);
      }
    });
  });
}

}  // namespace kbit::cpu
