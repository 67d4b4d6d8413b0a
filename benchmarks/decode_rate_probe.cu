// How many weights per second the fused kernels' decode + mma can take, per bits and per
// occupancy, with nothing else in the loop (no ring, no scales' decode, no reduction): the
// ceiling the decode path sets, against the rate at which HBM delivers the codes. Why: the 2-bit
// products are barely faster than the 4-bit ones (docs/performance.md), and a table-free 2-bit
// decode was the candidate cure; for 4 bits, whether moving part of the lookups from shared
// memory to the integer pipe raises the ceiling (it lowers it: docs/performance.md).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -Icpp \
//        -o /tmp/decode_rate_probe benchmarks/decode_rate_probe.cu
//   /tmp/decode_rate_probe       (one line per source, variant and CTAs per SM)
//
// Each thread streams 16-byte code words (4 loads in flight), decodes them into mma A fragments
// and runs the two mma.m16n8k16 of each 16 x 32 tile against fixed activations (M = 1), then four
// FFMA with fixed scales, as mma_k_block does. Variants:
//   stream    the loads alone
//   b4_lut    WeightPath<4>::decode: the 256-entry pair table in shared memory (one LDS.32 per
//             two weights)
//   b2_lut    WeightPath<2>::decode: the 256-entry quad table (one LDS.64 per four weights); each
//             word serves two tiles, as the fields of two threads do in the real layout
//   b2_prmt   a table-free 2-bit decode for a layout that puts four codes in the four bytes of
//             (w >> 2j) & 0x03030303: one IMAD turns them into the selectors of two PRMT that
//             pick each bf16's low and high byte from a two-register codebook
//   b2_prmth  the same with the upper selector from IMAD.HI instead of a shift
//   b4_reg    a table-free 4-bit decode (decode_word_reg): a 16-entry codebook in 8 registers,
//             21 PRMT/shift/LOP3 per 8 weights on the integer pipe
//   b4_mix4   b4_lut with 4 of every 16 words decoded as b4_reg does (the two pipes shared)
//   b4_mix8   the same with 8 of every 16
// Sources: 1 GiB of codes from HBM (the product's case), or 24 MiB re-read 42 times from L2 (the
// decode's own rate, with the memory out of the way).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/weight_path.cuh"

using namespace kbit::cuda;
using namespace kbit::cuda::fused;

constexpr int kLoadsInFlight = 4;  // 16-byte loads per thread before the first is used

// One 16 x 32 tile: two mma into a zero accumulator, then one FFMA per output (mma_k_block).
__device__ __forceinline__ void mma_tile(float (&acc)[4], const uint32_t (&a)[2][4], const uint32_t (&xb)[4],
                                         float s0, float s1) {
  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  float d[4];
  mma_16816<ActBF16>(d, a[0], xb[0], xb[1], zero);
  mma_16816<ActBF16>(d, a[1], xb[2], xb[3], d);
  acc[0] = fmaf(d[0], s0, acc[0]);
  acc[1] = fmaf(d[1], s0, acc[1]);
  acc[2] = fmaf(d[2], s1, acc[2]);
  acc[3] = fmaf(d[3], s1, acc[3]);
}

// prmt without __byte_perm's 0x7777 mask of the selector (these selectors never set bit 3).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// 16 codes of word w -> the 8 registers of one tile. Byte c of t0 is entry c's low byte, of t1
// its high byte; a selector byte c | (c + 4) << 4 = 0x11 c + 0x40 picks both halves of entry c.
template <bool kHi>
__device__ __forceinline__ void decode_prmt(uint32_t w, uint32_t t0, uint32_t t1, uint32_t (&a)[2][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t x = (w >> (2 * j)) & 0x03030303u;
    const uint32_t s = x * 0x11u + 0x40404040u;
    a[j >> 1][2 * (j & 1)] = prmt(t0, t1, s);
    a[j >> 1][2 * (j & 1) + 1] = prmt(t0, t1, kHi ? __umulhi(x, 0x110000u) + 0x4040u : s >> 16);
  }
}

// The 8 weights of one bits-4 word (byte q = code pair q, low nibble first) from a register
// codebook, without the table: L[k] byte j is the low byte of entry 4k + j, H[k] its high byte.
// Per half word (4 codes as the selector's 4 nibbles): 4 PRMT pick each code's bytes among
// entries 0..7 and among 8..15, 2 PRMT take each byte from one or the other by the code's msb,
// 2 PRMT interleave low and high bytes into two bf16x2 pairs. 21 instructions per 8 weights, all
// on the integer pipe, against the table's 4 PRMT + 4 LDS.
__device__ __forceinline__ void decode_word_reg(uint32_t w, const uint32_t (&L)[4], const uint32_t (&H)[4],
                                                uint32_t (&p)[4]) {
  const uint32_t s = w & 0x77777777u;                                // 3-bit indices
  const uint32_t t = ((w >> 1) & 0x44444444u) | 0x32103210u;         // byte i of a (msb 0) or b
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t sk = k ? s >> 16 : s, tk = k ? t >> 16 : t;
    const uint32_t lx = prmt(prmt(L[0], L[1], sk), prmt(L[2], L[3], sk), tk);
    const uint32_t hx = prmt(prmt(H[0], H[1], sk), prmt(H[2], H[3], sk), tk);
    p[2 * k] = prmt(lx, hx, 0x5140u);
    p[2 * k + 1] = prmt(lx, hx, 0x7362u);
  }
}

// WeightPath<4>::decode's registers, word 0 / 1 of the tile from the register codebook where
// kReg0 / kReg1, else from the table.
template <bool kReg0, bool kReg1>
__device__ __forceinline__ void decode_b4_mix(const WeightPath<4>::Raw& r, uint32_t lut, const WeightPath<4>::Lane& l4,
                                              const uint32_t (&L)[4], const uint32_t (&H)[4], uint32_t (&a)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h == 0 ? kReg0 : kReg1) {
      uint32_t p[4];
      decode_word_reg(r.w[h], L, H, p);
#pragma unroll
      for (int q = 0; q < 4; ++q) a[q >> 1][h + 2 * (q & 1)] = p[q];
    } else {
#pragma unroll
      for (int q = 0; q < 4; ++q)
        a[q >> 1][h + 2 * (q & 1)] = lds32(lut + __byte_perm(r.w[h], l4.base, 0x5504u | (q << 4)));
    }
  }
}

// The register codebook of decode_word_reg: byte c & 3 of L[c >> 2] / H[c >> 2] is entry c's low /
// high byte.
__device__ __forceinline__ void register_codebook4(const float* cb, uint32_t (&L)[4], uint32_t (&H)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) L[k] = H[k] = 0;
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const uint32_t v = ActBF16::pack2(cb[c], cb[c]) & 0xffffu;
    L[c >> 2] |= (v & 0xffu) << (8 * (c & 3));
    H[c >> 2] |= (v >> 8) << (8 * (c & 3));
  }
}

// Where the dynamic shared memory (the table) starts in the CTA's shared window: after the 1 KiB
// that sm_90 reserves. The fused kernels' lookups add this base for free ([R+UR] addressing);
// from smem_u32(smem) ptxas adds it to every lookup here (64 IADDs per 4 loads at 4 bits), so
// the probes name it as a constant (an immediate offset) and flag where it is wrong (the table
// variants' rates are then void).
constexpr uint32_t kTableAt = 0x400;
__device__ int g_table_elsewhere;
__device__ __forceinline__ void check_table_at(const uint8_t* smem) {
  if (smem_u32(smem) != kTableAt) g_table_elsewhere = 1;
}

enum Variant { kStream, kB4Lut, kB2Lut, kB2Prmt, kB2PrmtHi, kB4Reg, kB4Mix4, kB4Mix8 };


template <int V>
__global__ void __launch_bounds__(256)
    probe(const uint4* __restrict__ codes, size_t n, const float* cb, float* sink, int reps) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr uint32_t lut = kTableAt;
  const int lane = threadIdx.x & 31;
  if constexpr (V == kB4Lut || V == kB4Mix4 || V == kB4Mix8 || V == kB2Lut) check_table_at(smem);
  if constexpr (V == kB4Lut || V == kB4Mix4 || V == kB4Mix8)
    build_table<WeightPath<4>, ActBF16>(lut, cb, threadIdx.x, blockDim.x);
  if constexpr (V == kB2Lut) build_table<WeightPath<2>, ActBF16>(lut, cb, threadIdx.x, blockDim.x);
  uint32_t L4[4], H4[4];
  register_codebook4(cb, L4, H4);
  __syncthreads();
  uint32_t t0 = 0, t1 = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const uint32_t v = ActBF16::pack2(cb[c], cb[c]) & 0xffffu;
    t0 |= (v & 0xffu) << (8 * c);
    t1 |= (v >> 8) << (8 * c);
  }
  const auto l4 = WeightPath<4>::lane_consts(lane);
  const auto l2 = WeightPath<2>::lane_consts(lane);
  auto l2_other = l2;  // the other 16-bit half of each word
  l2_other.sel[0] ^= 0x20u;
  l2_other.sel[1] ^= 0x20u;
  uint32_t xb[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) xb[i] = ActBF16::pack2(0.001f * (lane + i), 0.002f * i);
  const float s0 = 0.5f + lane * 1e-3f, s1 = 0.25f;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  uint32_t folded = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (int rep = 0; rep < reps; ++rep)
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += kLoadsInFlight * stride) {
      uint4 v[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u)
        v[u] = i + u * stride < n ? __ldcs(codes + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        uint32_t a[2][4];
        if constexpr (V == kStream) {
          folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        } else if constexpr (V == kB4Lut) {  // two tiles of bits 4
          using Raw = WeightPath<4>::Raw;
          for (const Raw r : {Raw{{v[u].x, v[u].y}}, Raw{{v[u].z, v[u].w}}}) {
            WeightPath<4>::decode(r, lut, l4, a);
            mma_tile(acc, a, xb, s0, s1);
          }
        } else if constexpr (V == kB4Reg || V == kB4Mix4 || V == kB4Mix8) {  // two tiles of bits 4
          // (registers: b4_reg every word, b4_mix4 word 0 of the load's four, b4_mix8 words 0 and 2)
          using Raw = WeightPath<4>::Raw;
          const Raw r0{{v[u].x, v[u].y}}, r1{{v[u].z, v[u].w}};
          if constexpr (V == kB4Reg) decode_b4_mix<true, true>(r0, lut, l4, L4, H4, a);
          else decode_b4_mix<true, false>(r0, lut, l4, L4, H4, a);
          mma_tile(acc, a, xb, s0, s1);
          if constexpr (V == kB4Mix4) decode_b4_mix<false, false>(r1, lut, l4, L4, H4, a);
          else decode_b4_mix<true, V == kB4Reg>(r1, lut, l4, L4, H4, a);
          mma_tile(acc, a, xb, s0, s1);
        } else if constexpr (V == kB2Lut) {  // four tiles of bits 2
          using Raw = WeightPath<2>::Raw;
          for (const Raw r : {Raw{{v[u].x, v[u].y}}, Raw{{v[u].z, v[u].w}}})
            for (const auto& half : {l2, l2_other}) {
              WeightPath<2>::decode(r, lut, half, a);
              mma_tile(acc, a, xb, s0, s1);
            }
        } else {  // four tiles of bits 2, without a table
          for (const uint32_t w : {v[u].x, v[u].y, v[u].z, v[u].w}) {
            decode_prmt<V == kB2PrmtHi>(w, t0, t1, a);
            mma_tile(acc, a, xb, s0, s1);
          }
        }
      }
    }
  if (folded == 0x12345678u || acc[0] + acc[1] + acc[2] + acc[3] == 1234.5f) sink[0] = 1.f;
}

// decode_word_reg against the table's decode, on n pseudo-random words: mismatches in *bad.
__global__ void check_b4_reg(const float* cb, int n, unsigned* bad) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr uint32_t lut = kTableAt;
  check_table_at(smem);
  build_table<WeightPath<4>, ActBF16>(lut, cb, threadIdx.x, blockDim.x);
  __syncthreads();
  uint32_t L4[4], H4[4];
  register_codebook4(cb, L4, H4);
  const auto l4 = WeightPath<4>::lane_consts(threadIdx.x & 31);
  uint32_t x = 0x9e3779b9u * (blockIdx.x * blockDim.x + threadIdx.x + 1);
  for (int i = 0; i < n; ++i) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    const WeightPath<4>::Raw r{{x, x * 0x85ebca6bu}};
    uint32_t a[2][4], b[2][4];
    decode_b4_mix<false, false>(r, lut, l4, L4, H4, a);
    decode_b4_mix<true, true>(r, lut, l4, L4, H4, b);
    for (int j = 0; j < 8; ++j) if (a[j >> 2][j & 3] != b[j >> 2][j & 3]) atomicAdd(bad, 1u);
  }
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const size_t bytes = size_t(1) << 30;
  uint4* codes;
  float *sink, *cb;
  cudaMalloc(&codes, bytes);
  cudaMalloc(&sink, 4);
  cudaMalloc(&cb, 16 * sizeof(float));
  cudaMemset(codes, 0x5a, bytes);
  float host_cb[16];
  for (int i = 0; i < 16; ++i) host_cb[i] = -1.f + i * 0.13f;
  cudaMemcpy(cb, host_cb, sizeof(host_cb), cudaMemcpyHostToDevice);
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  constexpr int kLut4 = WeightPath<4>::kLutBytes, kLut2 = WeightPath<2>::kLutBytes;
  cudaFuncSetAttribute(probe<kB4Lut>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLut4);
  cudaFuncSetAttribute(probe<kB2Lut>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLut2);
  cudaFuncSetAttribute(probe<kB4Mix4>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLut4);
  cudaFuncSetAttribute(probe<kB4Mix8>, cudaFuncAttributeMaxDynamicSharedMemorySize, kLut4);
  cudaFuncSetAttribute(check_b4_reg, cudaFuncAttributeMaxDynamicSharedMemorySize, kLut4);
  {
    unsigned* bad;
    cudaMalloc(&bad, 4);
    cudaMemset(bad, 0, 4);
    check_b4_reg<<<sms, 256, kLut4>>>(cb, 4096, bad);
    unsigned h = 1;
    cudaMemcpy(&h, bad, 4, cudaMemcpyDeviceToHost);
    printf("check b4_reg against b4_lut: %u mismatches in %d words (%s)\n", h, sms * 256 * 4096 * 2,
           cudaGetErrorString(cudaGetLastError()));
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  size_t n = bytes / 16;
  int reps = 1;
  const char* source = "hbm";
  auto run = [&](const char* name, int bits, int per_sm, auto launch) {
    launch();
    cudaDeviceSynchronize();
    float best = 1e9f;
    for (int r = 0; r < 10; ++r) {
      cudaEventRecord(start);
      launch();
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float ms;
      cudaEventElapsedTime(&ms, start, stop);
      best = ms < best ? ms : best;
    }
    const double total = double(n) * 16 * reps, weights = total * 8.0 / bits;
    printf("%s %-8s CTAs/SM %d  %7.3f ms  %5.2f TB/s of codes  %6.2f Tweights/s  %s\n", source, name, per_sm, best,
           total / (best * 1e-3) / 1e12, weights / (best * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
  };
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      n = (size_t(24) << 20) / 16;
      reps = 42;
      source = "l2";
    }
    for (int per_sm : {1, 2, 3, 4, 8}) {  // the tables (64 KiB each) allow 3 CTAs per SM
      const dim3 grid(sms * per_sm), block(256);
      run("stream", 4, per_sm, [&] { probe<kStream><<<grid, block>>>(codes, n, cb, sink, reps); });
      if (per_sm <= 3) {
        run("b4_lut", 4, per_sm, [&] { probe<kB4Lut><<<grid, block, kLut4>>>(codes, n, cb, sink, reps); });
        run("b2_lut", 2, per_sm, [&] { probe<kB2Lut><<<grid, block, kLut2>>>(codes, n, cb, sink, reps); });
        run("b4_mix4", 4, per_sm, [&] { probe<kB4Mix4><<<grid, block, kLut4>>>(codes, n, cb, sink, reps); });
        run("b4_mix8", 4, per_sm, [&] { probe<kB4Mix8><<<grid, block, kLut4>>>(codes, n, cb, sink, reps); });
      }
      run("b4_reg", 4, per_sm, [&] { probe<kB4Reg><<<grid, block>>>(codes, n, cb, sink, reps); });
      run("b2_prmt", 2, per_sm, [&] { probe<kB2Prmt><<<grid, block>>>(codes, n, cb, sink, reps); });
      run("b2_prmth", 2, per_sm, [&] { probe<kB2PrmtHi><<<grid, block>>>(codes, n, cb, sink, reps); });
    }
  }
  int elsewhere = 0;
  cudaMemcpyFromSymbol(&elsewhere, g_table_elsewhere, sizeof(int));
  printf("table at shared address 0x%x: %s (%s)\n", kTableAt,
         elsewhere ? "NO: the table variants' rates are void" : "yes", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
