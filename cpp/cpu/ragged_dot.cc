// ragged_dot: the grouped expert product of a mixture-of-experts layer. x's rows are sorted by
// group; group g owns rows [start_g, start_{g+1}) and multiplies dequantize(w)[g]. Rows at or
// past the last group's end are zeros.
//
// Each thread owns a range of columns and runs matmul's fused tile loop (matmul_rows) on every
// group that has rows: a group's weight is decoded once per 64 of its rows, and a group with no
// rows is skipped before any of its weight is read.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/kbit_cpu.h"
#include "cpu/parallel.h"
#include "glu.h"

namespace kbit::cpu {

namespace {
// Threads split N at multiples of this (matmul's column tile; even, so GLU pairs stay whole).
constexpr int64_t kColumnGrain = 16;
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
  std::memset(static_cast<char*>(y) + rows * y_cols * y_item, 0,
              size_t((m - rows) * y_cols * y_item));
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
  // Per weight element of a group with rows: a decode plus one multiply-add per row (as matmul).
  const int64_t work = s.k * s.n * (rows + 4 * active);
  const int threads = thread_count(work, (s.n + kColumnGrain - 1) / kColumnGrain);
  parallel_ranges(s.n, kColumnGrain, threads, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t g = 0; g < s.batch; ++g) {
      const int64_t begin = starts[size_t(g)], end = starts[size_t(g) + 1];
      if (end == begin) continue;  // no rows: none of this group's weight is read
      matmul_rows(x_f32 + begin * s.k, end - begin, w, g, glu, x_type, y, begin, n_begin, n_end);
    }
  });
}

}  // namespace kbit::cpu
