// The per-k-block steps that both fused kernels share (activation fragments, block scales,
// codes, decode + mma), and the shared-memory and barrier instructions they use.
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/weight_path.cuh"

namespace kbit::cuda::fused {

// cp.async with a source size: copies `src_bytes` (0..4) and zero-fills the rest.
__device__ __forceinline__ void cp_async4_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}
__device__ __forceinline__ float lds32f(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds_u8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts64f(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(addr), "f"(a), "f"(b));
}
template <int N>
__device__ __forceinline__ void named_bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(N) : "memory");
}

// The B operand (activations) of one k-block for MT n8 tiles. `addr(row, s)` is the shared
// address of the 16 bytes of activation row `row` in the 8-wide k sub-block s of the k-block
// (each kernel stages x in its own layout); rows past `rows` repeat the last row (their results
// are never stored). Lane l supplies row l % 8 of matrix l / 8, i.e. of sub-block l / 8.
template <int MT, class RowAddr>
__device__ __forceinline__ void load_x_fragments(uint32_t (&xb)[MT][4], int rows, int lane, RowAddr addr) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(xb[mt], addr(min(8 * mt + (lane & 7), rows - 1), lane >> 3));
}

// The lane's 2 TN decoded block scales of one k-block (rows g and g + 8 of each tile).
template <int TN>
__device__ __forceinline__ void load_scales(float (&sc)[2 * TN], uint32_t addr) {
  if constexpr (TN >= 2) {
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) {
      const float4 v = lds128f(addr + 16 * i);
      sc[4 * i] = v.x; sc[4 * i + 1] = v.y; sc[4 * i + 2] = v.z; sc[4 * i + 3] = v.w;
    }
  } else {
    const float2 v = lds64f(addr);
    sc[0] = v.x; sc[1] = v.y;
  }
}

// The lane's staged codes of the TN tiles of one k-block (`slab` = the k-block's first cell).
template <class WP, int TN>
__device__ __forceinline__ void load_codes(typename WP::Raw (&raw)[TN], uint32_t slab, uint32_t o0, uint32_t o1) {
#pragma unroll
  for (int j = 0; j < TN; ++j) WP::load(raw[j], slab, o0, o1, j);
}

// Decode the TN tiles of one k-block and accumulate scale * (W_tile^T x) into acc: two mma
// into a zero accumulator, then one FFMA per output.
template <class WP, class Act, int MT, int TN>
__device__ __forceinline__ void mma_k_block(float (&acc)[TN * MT * 4], const typename WP::Raw (&raw)[TN],
                                            uint32_t lut, const typename WP::Lane& L, const uint32_t (&xb)[MT][4],
                                            const float (&sc)[2 * TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    uint32_t a[2][4];
    WP::decode(raw[j], lut, L, a);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float zero[4] = {0.f, 0.f, 0.f, 0.f};
      float d[4];
      mma_16816<Act>(d, a[0], xb[mt][0], xb[mt][1], zero);  // k 0..15 of the block
      mma_16816<Act>(d, a[1], xb[mt][2], xb[mt][3], d);     // k 16..31
      float* c = acc + (j * MT + mt) * 4;
      c[0] = fmaf(d[0], sc[2 * j], c[0]);  // row g   = column 16 j + g
      c[1] = fmaf(d[1], sc[2 * j], c[1]);
      c[2] = fmaf(d[2], sc[2 * j + 1], c[2]);  // row g+8 = column 16 j + g + 8
      c[3] = fmaf(d[3], sc[2 * j + 1], c[3]);
    }
  }
}

// The N-split tiling (Tiling::kNSplit) with bf16 activations: the E4M4 block scale (exact in bf16)
// multiplies the decoded weights, rounded once to bf16, and the mma accumulates into acc
// directly. At MT = 8 that replaces 64 FFMA per warp and k-block (a quarter of the
// instructions, Nsight Compute) and the mma into zero by 16 HMUL2. fp16 keeps mma_k_block:
// scaled weights could be fp16 subnormals there. The tests' derived error bound counts that
// second rounding of each weight to the activation dtype (the codebook entry's is the first).
template <class WP, int MT, int TN>
__device__ __forceinline__ void mma_k_block_scaled_weights(float (&acc)[TN * MT * 4],
                                                           const typename WP::Raw (&raw)[TN], uint32_t lut,
                                                           const typename WP::Lane& L, const uint32_t (&xb)[MT][4],
                                                           const float (&sc)[2 * TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    uint32_t a[2][4];
    decode_for_scaling<WP>(raw[j], lut, L, a);
    scale_fragments(a, sc[2 * j], sc[2 * j + 1]);  // columns 16 j + g and 16 j + g + 8
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float(&c)[4] = *reinterpret_cast<float(*)[4]>(acc + (j * MT + mt) * 4);
      mma_16816<ActBF16>(c, a[0], xb[mt][0], xb[mt][1], c);  // k 0..15 of the block
      mma_16816<ActBF16>(c, a[1], xb[mt][2], xb[mt][3], c);  // k 16..31
    }
  }
}

}  // namespace kbit::cuda::fused
