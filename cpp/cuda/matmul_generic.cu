// The generic kbit matmul: a plain SIMT kernel, float32 arithmetic, any layout, any of the
// three activation dtypes. It is the path for float32 activations (whose contract is float32
// accuracy, which the bf16/f16 tensor-core kernel cannot give) and the fallback where the fused
// kernel does not apply (layout kPlanes, bits 2 with odd N). Correctness over speed.
//
// A CTA of 128 threads owns 128 columns and 8 rows of M; thread n keeps 8 accumulators. Per
// block row kb: the CTA stages x[8 rows][32] in shared memory (as float), each thread loads its
// cell, dequantizes the 32 elements exactly as kbit_dequantize does before rounding
// (codebook[code] * scale, in float32) and accumulates x * w into float32; tensor_scale is
// applied once at the end, and the sum is rounded to the activation dtype (with glu, after the
// gate of each column pair: the even thread of a pair gets its neighbour's sum by a shuffle).
#include "cuda/codes.cuh"
#include "cuda/common.cuh"
#include "glu.h"

namespace kbit::cuda {

namespace {
constexpr int kGenericThreads = 128;  // columns per CTA
constexpr int kGenericRows = 8;       // rows of M per CTA (accumulators per thread)
}  // namespace

template <int BITS, int LAYOUT, class T>
__global__ void __launch_bounds__(kGenericThreads)
    matmul_generic_kernel(const T* __restrict__ x, const uint32_t* __restrict__ planes,
                          const uint8_t* __restrict__ scales, const float* __restrict__ codebook,
                          const float* __restrict__ tensor_scale, T* __restrict__ y, int64_t M,
                          int64_t KB, int64_t N, int glu) {
  constexpr int C = 1 << BITS;
  __shared__ float xs[kGenericRows][32];
  __shared__ float cb[C];
  const int tid = threadIdx.x;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kGenericThreads + tid;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kGenericRows;
  const int64_t b = blockIdx.z, K = KB * 32;
  if (tid < C) cb[tid] = codebook[b * C + tid];
  float acc[kGenericRows];
#pragma unroll
  for (int r = 0; r < kGenericRows; ++r) acc[r] = 0.f;

  for (int64_t kb = 0; kb < KB; ++kb) {
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kGenericRows * 32 / kGenericThreads; ++i) {
      const int e = tid + i * kGenericThreads, r = e / 32, k = e % 32;
      xs[r][k] = (m0 + r < M) ? to_f32(x[(b * M + m0 + r) * K + kb * 32 + k]) : 0.f;
    }
    __syncthreads();
    if (n < N) {
      const int64_t cell = (b * KB + kb) * N + n;
      uint32_t w[BITS];
#pragma unroll
      for (int i = 0; i < BITS; ++i) w[i] = planes[cell * BITS + i];
      const float s = kbit::decode_e4m4(scales[cell]);
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const float wv = cb[cell_code<BITS, LAYOUT>(w, k)] * s;
#pragma unroll
        for (int r = 0; r < kGenericRows; ++r) acc[r] = fmaf(xs[r][k], wv, acc[r]);
      }
    }
  }
  const float ts = tensor_scale[b];
  if (glu == kGluNone) {
    if (n >= N) return;
#pragma unroll
    for (int r = 0; r < kGenericRows; ++r)
      if (m0 + r < M) y[(b * M + m0 + r) * N + n] = from_f32<T>(acc[r] * ts);
    return;
  }
  // Column pairs (2j, 2j + 1) lie in neighbouring lanes of one warp (N even, warps start at
  // multiples of 32 columns), both in range or both out; every lane takes part in the shuffle.
  const GluLogit logit(glu);
#pragma unroll
  for (int r = 0; r < kGenericRows; ++r) {
    const float v = acc[r] * ts, up = __shfl_xor_sync(0xffffffffu, v, 1);
    if ((n & 1) == 0 && n < N && m0 + r < M)
      y[(b * M + m0 + r) * (N / 2) + n / 2] = from_f32<T>(glu_apply(logit, v, up));
  }
}

std::string launch_matmul_generic(const MatmulArgs& a, cudaStream_t stream) {
  const int64_t KB = a.k / 32;
  const std::string shape = "B=" + std::to_string(a.batch) + " M=" + std::to_string(a.m) +
                            " K=" + std::to_string(a.k) + " N=" + std::to_string(a.n) +
                            " bits=" + std::to_string(a.bits) + " layout=" +
                            std::to_string(a.layout) + " dtype=" + dtype_name(a.dtype) +
                            " glu=" + std::to_string(a.glu);
  const int64_t mblocks = (a.m + kGenericRows - 1) / kGenericRows;
  if (mblocks > 65535 || a.batch > 65535)
    return "kbit_matmul_generic_kernel: grid too large (ceil(M/8) and B must be <= 65535) for " + shape;
  const dim3 grid(ceil_div(a.n, kGenericThreads), static_cast<unsigned>(mblocks),
                  static_cast<unsigned>(a.batch));
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] {
    return KBIT_LAYOUT_SWITCH(a.layout, LAYOUT, [&] {
      return KBIT_DTYPE_SWITCH(a.dtype, T, [&] {
        matmul_generic_kernel<BITS, LAYOUT, T><<<grid, kGenericThreads, 0, stream>>>(
            static_cast<const T*>(a.x), a.planes, a.scales, a.codebook, a.tensor_scale,
            static_cast<T*>(a.y), a.m, KB, a.n, a.glu);
        return check_launch("kbit_matmul_generic_kernel", shape);
      });
    });
  });
}

}  // namespace kbit::cuda
