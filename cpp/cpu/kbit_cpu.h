// CPU kernels for the kbit v1 format (cpp/README.md has the contract). Plain C++17: no XLA or
// nanobind headers, so the kernels can be tested and benchmarked on their own.
//
// Every operand carries one leading batch axis B, all arrays are dense row-major:
//   w, out:       [B, K, N]            float of `FloatType`
//   x, y:         [B, M, K], [B, M, N] float of `FloatType`
//   planes:       [B, K/32, N, bits]   uint32, one cell's `bits` words contiguous
//   scales:       [B, K/32, N]         uint8 (E4M4)
//   codebook:     [B, 2^bits]          float32
//   tensor_scale: [B]                  float32
// Shapes are validated by the caller (the FFI handlers); the kernels trust them.
//
// The kernels are reentrant (no mutable globals) and may split work over std::threads; a thread
// that cannot be started has its share run on the calling thread. Only matmul and ragged_dot
// allocate (x converted to float32) and so may throw std::bad_alloc; callers catch it.
#pragma once

#include <cstdint>

#include "format.h"

namespace kbit::cpu {

enum class FloatType { kF32, kBF16, kF16 };

struct WeightShape {
  int64_t batch = 0;
  int64_t k = 0;  // multiple of kBlockSize
  int64_t n = 0;
  int bits = 0;   // kMinBits..kMaxBits
  Layout layout = kPlanes;
};

// A quantized weight, read-only.
struct PackedWeight {
  const uint32_t* planes = nullptr;
  const uint8_t* scales = nullptr;
  const float* codebook = nullptr;
  const float* tensor_scale = nullptr;
  WeightShape shape;
};

// planes/scales <- quantize(w). Bit-exact with kbit_jax/reference.py.
void quantize(const void* w, FloatType w_type, const float* codebook, const float* tensor_scale,
              const WeightShape& shape, uint32_t* planes, uint8_t* scales);

// out[b, k, n] = (codebook[code] * decode_e4m4(scale)) * tensor_scale, rounded (RNE) to out_type.
void dequantize(const PackedWeight& w, FloatType out_type, void* out);

// y[b, m, n] = sum_k x[b, m, k] * dequantize(w)[b, k, n], float32 accumulation, rounded (RNE)
// to x_type. Fused: W is dequantized a tile at a time, never materialized. With `glu` (glu.h)
// other than kGluNone, y[b, m, j] = act(sum for n = 2j) * (sum for n = 2j + 1), N / 2 columns.
void matmul(const void* x, FloatType x_type, int64_t m, const PackedWeight& w, int32_t glu,
            void* y);

// The fused product of `m` float32 rows x[m, K] with weight `batch` of w, at columns
// [n_begin, n_end) (even, with glu), stored (rounded to y_type) into rows [y_row, y_row + m)
// of y [*, N] (N / 2 with glu): matmul's work for one range of columns, which matmul and
// ragged_dot split over threads.
void matmul_rows(const float* x, int64_t m, const PackedWeight& w, int64_t batch, int32_t glu,
                 FloatType y_type, void* y, int64_t y_row, int64_t n_begin, int64_t n_end);

// The grouped (mixture-of-experts) product. x: [M, K], y: [M, N] (N / 2 with `glu`), no batch
// axis; w's batch axis B is the G groups (experts) and group_sizes int32[G] the rows of each:
// group g owns rows [start_g, start_{g+1}) of x, start_0 = 0 and start_{g+1} = min(M, start_g +
// max(0, group_sizes[g])) (so a negative size counts as 0 and groups end at M at the latest).
// y[m, n] = sum_k x[m, k] * dequantize(w)[g(m), k, n] with matmul's accumulation, rounding and
// GLU; rows at or past start_G are zeros. A group with no rows reads none of its weight.
void ragged_dot(const void* x, FloatType x_type, int64_t m, const PackedWeight& w,
                const int32_t* group_sizes, int32_t glu, void* y);

// starts[0..groups] as ragged_dot defines them (starts has groups + 1 entries).
void group_bounds(const int32_t* group_sizes, int64_t groups, int64_t m, int64_t* starts);

}  // namespace kbit::cpu
