// kbit_dequantize on the GPU: w[b, 32 kb + k, n] = (codebook[code] * decode_e4m4(scale)) * ts,
// rounded to the output dtype (round to nearest even), bit-exact with the references.
//
// The kernel is bound by writing the output (2-4 bytes per element against 0.3-0.7 bytes read),
// so its layout is chosen for the stores: one thread per cell, consecutive threads take
// consecutive columns n, and each of the 32 unrolled stores of a warp writes 32 adjacent
// elements of one output row (64 B for 16-bit outputs, 128 B for f32). Each thread loads its
// cell's words with one vector load where the cell size allows (bits 2: 8 B, bits 4: 16 B).
// The codebook sits in shared memory when the CTA's cells share one batch entry (the usual
// case; entry i in bank i, so the 32 lanes' lookups never conflict), else it is read through L1.
#include "cuda/codes.cuh"
#include "cuda/common.cuh"

namespace kbit::cuda {
namespace {

constexpr int kDequantThreads = 256;

template <int BITS>
__device__ __forceinline__ void load_cell(const uint32_t* __restrict__ p, uint32_t (&w)[BITS]) {
  if constexpr (BITS == 4) {
    const uint4 v = ldg_stream(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (BITS == 2) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < BITS; ++i) w[i] = ldg_stream(p + i);
  }
}

template <int BITS, int LAYOUT, class T>
__global__ void __launch_bounds__(kDequantThreads)
    dequantize_kernel(const uint32_t* __restrict__ planes, const uint8_t* __restrict__ scales,
                      const float* __restrict__ codebook, const float* __restrict__ tensor_scale,
                      T* __restrict__ out, int64_t KB, int64_t N, int64_t cells) {
  constexpr int C = 1 << BITS;
  __shared__ float cb_s[C];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kDequantThreads;
  const int64_t last = min(first + kDequantThreads, cells) - 1;
  const int64_t per_batch = KB * N;
  const int64_t b_first = first / per_batch;
  const bool one_batch = (last / per_batch) == b_first;  // CTA-uniform
  if (one_batch && threadIdx.x < C) cb_s[threadIdx.x] = codebook[b_first * C + threadIdx.x];
  __syncthreads();

  const int64_t cell = first + threadIdx.x;
  if (cell >= cells) return;
  const int64_t n = cell % N, rest = cell / N, kb = rest % KB, b = rest / KB;
  uint32_t w[BITS];
  load_cell<BITS>(planes + cell * BITS, w);
  const float s = kbit::decode_e4m4(__ldcs(scales + cell));
  const float ts = tensor_scale[b];
  const float* cb = one_batch ? cb_s : codebook + b * C;
  T* dst = out + (b * KB * 32 + kb * 32) * N + n;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const uint32_t code = cell_code<BITS, LAYOUT>(w, k);
    // Two float32 products in the reference's order; no FMA can contract a product of products.
    const float v = (cb[code] * s) * ts;
    __stcs(dst + k * N, from_f32<T>(v));
  }
}

}  // namespace

std::string launch_dequantize(const DequantizeArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.k == 0 || a.n == 0) return std::string();
  const int64_t KB = a.k / 32;
  const int64_t cells = a.batch * KB * a.n;
  const std::string shape = "B=" + std::to_string(a.batch) + " K=" + std::to_string(a.k) +
                            " N=" + std::to_string(a.n) + " bits=" + std::to_string(a.bits) +
                            " layout=" + std::to_string(a.layout) + " dtype=" + dtype_name(a.out_dtype);
  const int64_t blocks = (cells + kDequantThreads - 1) / kDequantThreads;
  if (blocks > 0x7fffffffLL) return "kbit_dequantize_kernel: too many cells for " + shape;
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] {
    return KBIT_LAYOUT_SWITCH(a.layout, LAYOUT, [&] {
      return KBIT_DTYPE_SWITCH(a.out_dtype, T, [&] {
        dequantize_kernel<BITS, LAYOUT, T><<<static_cast<unsigned>(blocks), kDequantThreads, 0, stream>>>(
            a.planes, a.scales, a.codebook, a.tensor_scale, static_cast<T*>(a.out), KB, a.n, cells);
        return check_launch("kbit_dequantize_kernel", shape);
      });
    });
  });
}

}  // namespace kbit::cuda
