// kbit_quantize on the GPU: one warp per cell (32 consecutive elements along K of one column),
// lane j holding element j, exactly the format's definition:
//   absmax = max |w| (float32)            -> one redux.sync.max on the float bit patterns
//   scale  = block_scale_byte(absmax, ts) -> format.h, IEEE division (no fast math)
//   code   = nearest_code(w / absmax)     -> format.h, codebook in shared memory
//   planes:   word b = ballot(bit b of code)                     (layout kPlanes)
//   fragment: word i = OR over lanes of the code shifted to bits*fragment_pos(lane) - 32 i
//                                                                 (layout kFragment)
// Bit-exact with the CPU and Python references because every arithmetic step is the shared
// format.h helper evaluated in float32 with round-to-nearest IEEE operations.
//
// A CTA quantizes a 32 x 32 tile (one block row kb, 32 columns): it reads the tile row by row
// (coalesced along N), transposes it through shared memory, then each of its 8 warps takes 4
// columns. Quantization runs once per weight, so it is written for clarity, not speed.
#include "cuda/codes.cuh"
#include "cuda/common.cuh"

namespace kbit::cuda {
namespace {

constexpr int kQuantThreads = 256;  // 8 warps; 32x32 tile = 4 elements per thread
constexpr int kTile = 32;           // columns per CTA (and rows: one block of 32 along K)

template <int BITS, int LAYOUT, class T>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_kernel(const T* __restrict__ w, const float* __restrict__ codebook,
                    const float* __restrict__ tensor_scale, uint32_t* __restrict__ planes,
                    uint8_t* __restrict__ scales, int64_t KB, int64_t N) {
  constexpr int C = 1 << BITS;
  __shared__ float tile[kTile][kTile + 1];  // +1: column reads by a warp hit 32 different banks
  __shared__ float cb[C];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t kb = blockIdx.y, b = blockIdx.z;
  const int64_t K = KB * 32;

  if (tid < C) cb[tid] = codebook[b * C + tid];
#pragma unroll
  for (int r = 0; r < kTile * kTile / kQuantThreads; ++r) {
    const int e = tid + r * kQuantThreads, row = e / kTile, col = e % kTile;
    const int64_t n = n0 + col;
    tile[row][col] = n < N ? to_f32(w[(b * K + kb * 32 + row) * N + n]) : 0.f;
  }
  __syncthreads();
  const float ts = tensor_scale[b];

  for (int col = warp; col < kTile; col += kQuantThreads / 32) {
    const int64_t n = n0 + col;
    if (n >= N) break;  // warp-uniform
    const float v = tile[lane][col];
    // max |w|: |w| >= 0, and non-negative floats order like their bit patterns (NaN above inf,
    // so a NaN in the block propagates, as numpy's max does).
    const float absmax = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
    const uint32_t code = kbit::nearest_code(kbit::normalized(v, absmax), cb, C);
    const int64_t cell = (b * KB + kb) * N + n;
    uint32_t word_for_me = 0;
    if constexpr (LAYOUT == kbit::kPlanes) {
#pragma unroll
      for (int bit = 0; bit < BITS; ++bit) {
        const uint32_t word = __ballot_sync(0xffffffffu, (code >> bit) & 1u);
        if (lane == bit) word_for_me = word;
      }
    } else {
      const int pos = BITS * fragment_pos(lane);  // first bit of this element's code
#pragma unroll
      for (int wi = 0; wi < BITS; ++wi) {
        const int s = pos - 32 * wi;  // where the code lands relative to word wi
        uint32_t part = 0;
        if (s >= 0 && s < 32) part = code << s;             // starts in this word
        else if (s < 0 && s > -BITS) part = code >> (-s);   // spills over from the word below
        const uint32_t word = __reduce_or_sync(0xffffffffu, part);
        if (lane == wi) word_for_me = word;
      }
    }
    if (lane < BITS) planes[cell * BITS + lane] = word_for_me;
    if (lane == 0) scales[cell] = static_cast<uint8_t>(kbit::block_scale_byte(absmax, ts));
  }
}

}  // namespace

std::string launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.k == 0 || a.n == 0) return std::string();
  const int64_t KB = a.k / 32;
  const dim3 grid(ceil_div(a.n, kTile), static_cast<unsigned>(KB), static_cast<unsigned>(a.batch));
  const std::string shape = "B=" + std::to_string(a.batch) + " K=" + std::to_string(a.k) +
                            " N=" + std::to_string(a.n) + " bits=" + std::to_string(a.bits) +
                            " layout=" + std::to_string(a.layout) + " dtype=" + dtype_name(a.w_dtype);
  if (KB > 65535 || a.batch > 65535)
    return "kbit_quantize_kernel: grid too large (K/32 and B must be <= 65535) for " + shape;
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] {
    return KBIT_LAYOUT_SWITCH(a.layout, LAYOUT, [&] {
      return KBIT_DTYPE_SWITCH(a.w_dtype, T, [&] {
        quantize_kernel<BITS, LAYOUT, T><<<grid, kQuantThreads, 0, stream>>>(
            static_cast<const T*>(a.w), a.codebook, a.tensor_scale, a.planes, a.scales, KB, a.n);
        return check_launch("kbit_quantize_kernel", shape);
      });
    });
  });
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

}  // namespace kbit::cuda
