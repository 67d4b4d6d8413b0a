// The fused kbit matmul for bf16/f16 activations and fragment-layout weights:
//     y[b, m, n] = tensor_scale[b] * sum_kb scale[kb, n] * sum_{k in kb} x[b, m, k] * codebook[code]
//
// ---- Why it looks like this (numbers for the H200: 132 SMs, 1.98 GHz, ~4.3 TB/s) ----
// At small M the kernel must stream the compressed weights at memory speed, i.e. decode
// 58 (bits 2) .. 25 (bits 5) weights per SM per clock. The per-element seed recipe (bit-plane
// shifts + shuffle) costs ~10 integer ops per weight against a budget of 1-2, so:
//  * Weights use the fragment layout (format.h): thread t of an mma quad finds the 8 codes it
//    needs as one contiguous 8*bits-bit field of the cell, and two neighbouring codes form one
//    mma operand register (lower k in the low half).
//  * Operands are swapped: Y^T[N, M] = W^T[N, K] * X^T[K, M] with mma.m16n8k16. The weight
//    tile (16 columns n x 16 k) is the A operand, x is the B operand (n8 = 8 rows of M), so
//    M <= 8 wastes nothing along N and larger M re-uses the decoded A registers.
//  * Decoding is a table lookup in shared memory that returns two (bits 3..5) or four (bits 2)
//    16-bit values per instruction. The table is replicated once per lane (lane l reads bank
//    l: no conflicts) and its byte address is built with one PRMT (bits 2, 4: byte-aligned
//    indices, 256-byte rows) or one shift + one LOP3 (bits 3, 5). Per weight: bits 2: 0.375
//    integer ops + 0.125 LDS.64, bits 4: 0.5 PRMT + 0.5 LDS.32, bits 3/5: ~1.1 ops + 0.5 LDS.
//  * The E4M4 block scale multiplies the fp32 mma result of the cell's two k16 halves (mma into
//    a zero accumulator, then FFMA into the running sum), and tensor_scale is applied once in
//    the epilogue, so fp16 operands never hold scaled (possibly subnormal) values. The CTA
//    decodes each scale byte once into a float in shared memory.
//  * Weights are read exactly once, straight from global memory into registers with streaming
//    (evict-first) loads, kStages deep per warp. K is split across the warps of a CTA (and,
//    where the column tiles alone cannot fill the GPU, across the CTAs of a thread-block
//    cluster, reduced through distributed shared memory): no workspace, no atomics, no memset.
//
// ---- Work decomposition ----
//  CTA   = kWarps warps, one column group of 16*kTN columns, one k-range (its cluster rank's
//          share of K), one block of up to 8*MT rows of M, one batch entry.
//  chunk = kKCH = kWarps*kKPW consecutive blocks of 32 along K; warp w owns blocks
//          [w*kKPW, (w+1)*kKPW) of every chunk. Activations and decoded scales of a chunk are
//          staged in shared memory (x: kXBuf-deep cp.async ring; scales: 2 buffers), with one
//          __syncthreads per chunk.
//  stage = one block row kb of the warp's kTN column tiles, held in registers; kStages stages
//          are in flight per warp (the prefetch crosses chunk boundaries).
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common.cuh"

namespace kbit::cuda::fused {

// Per-bits decode path. Every member is explained where it is defined; the shared interface:
//   kLutBytes      shared-memory bytes of the replicated lookup table
//   Raw            registers one thread loads per (stage, column tile)
//   load<kFull>    issue the loads of one tile (p = planes row kb + thread offset)
//   decode         Raw -> the 2 x 4 A-operand registers of the tile's two k16 halves
//   lut_entry      value of table entry e (built once per CTA)
//   colmap(j, r)   column (relative to the CTA's first) that mma row r of tile j stands for
template <int BITS>
struct WeightPath;

// bits 4: each thread's field is exactly word t of the cell; code pair q is byte q.
// 256-entry pair table, 256-byte rows (lane l's copy at byte 4l; the upper 128 B of each row
// are unused) so that the address is PRMT(field, lane_base): byte q of the field becomes the
// row, the lane's byte offset stays in byte 0. One PRMT + one LDS.32 per two weights.
template <>
struct WeightPath<4> {
  static constexpr int kEntries = 256, kEntryBytes = 4, kRowBytes = 256;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 64 KiB
  static constexpr int kTileWords = 16 * 4;                // 16 cells of 4 words
  struct Raw { uint32_t w[2]; };                           // word t of rows g and g+8
  struct Lane { uint32_t base; };
  __device__ static Lane lane_consts(int lane) { return {uint32_t(lane) * 4u}; }
  __device__ static int offset0(int g, int t) { return 4 * g + t; }
  __device__ static int offset1(int g, int t) { return 4 * g + t; }
  __device__ static int colmap(int j, int r) { return 16 * j + r; }
  template <bool kFull>
  __device__ static void load(Raw& r, const uint32_t* p0, const uint32_t*, int j, int colbase,
                              int N) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (kFull || colbase + 16 * j + 8 * h < N) r.w[h] = ldg_stream(p0 + j * kTileWords + h * 32);
  }
  __device__ static void decode(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 4; ++q)  // selector: byte0 <- lane base, byte1 <- field byte q, 0, 0
        a[q >> 1][h + 2 * (q & 1)] = lds32(lut + __byte_perm(r.w[h], L.base, 0x5504u | (q << 4)));
  }
  template <class Act>
  __device__ static uint2 lut_entry(int e, const float* cb) {
    const uint32_t v = Act::pack2(__ldg(cb + (e & 15)), __ldg(cb + (e >> 4)));
    return make_uint2(v, v);
  }
};

// bits 2: a thread's field is 16 bits, half t&1 of word t>>1 of the cell; each thread loads
// that word (two threads share it; a warp's load is 64 contiguous bytes). A 256-entry table of
// FOUR values (8 B: the two operand registers of one k16 half) indexed by one field byte halves
// the lookups: per 8 weights 2 PRMT + 2 LDS.64. Rows of 32 lanes x 8 B = 256 B, so the PRMT
// that moves the field byte into byte 1 also keeps the lane offset (lane*8) in byte 0.
// (A 16-byte load of both cells per thread needs a quarter of the load instructions but four
// times the registers per byte in flight, which the register file cannot afford.)
template <>
struct WeightPath<2> {
  static constexpr int kEntries = 256, kEntryBytes = 8, kRowBytes = 256;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 64 KiB
  static constexpr int kTileWords = 16 * 2;
  struct Raw { uint32_t w[2]; };  // word t>>1 of rows g and g+8
  struct Lane { uint32_t base; uint32_t sel[2]; };
  __device__ static Lane lane_consts(int lane) {
    const int t = lane & 3;
    Lane L;
    L.base = uint32_t(lane) * 8u;
    L.sel[0] = 0x5504u | (uint32_t(2 * (t & 1)) << 4);      // byte 2(t&1):   codes 0..3
    L.sel[1] = 0x5504u | (uint32_t(2 * (t & 1) + 1) << 4);  // byte 2(t&1)+1: codes 4..7
    return L;
  }
  __device__ static int offset0(int g, int t) { return 2 * g + (t >> 1); }
  __device__ static int offset1(int g, int t) { return 2 * g + (t >> 1); }
  __device__ static int colmap(int j, int r) { return 16 * j + r; }
  template <bool kFull>
  __device__ static void load(Raw& r, const uint32_t* p0, const uint32_t*, int j, int colbase,
                              int N) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (kFull || colbase + 16 * j + 8 * h < N) r.w[h] = ldg_stream(p0 + j * kTileWords + h * 16);
  }
  __device__ static void decode(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int s = 0; s < 2; ++s)    // quad s = codes 4s..4s+3 = the k16 half s of the cell
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 q = lds64(lut + __byte_perm(r.w[h], L.base, L.sel[s]));
        a[s][h] = q.x;      // k 2t, 2t+1
        a[s][h + 2] = q.y;  // k 2t+8, 2t+9
      }
  }
  template <class Act>
  __device__ static uint2 lut_entry(int e, const float* cb) {
    return make_uint2(Act::pack2(__ldg(cb + (e & 3)), __ldg(cb + ((e >> 2) & 3))),
                      Act::pack2(__ldg(cb + ((e >> 4) & 3)), __ldg(cb + (e >> 6))));
  }
};

// bits 3: thread t's 24-bit field starts at bit 24t of the 96-bit cell: words a = 3t/4 and
// a+1 (the last thread needs word 2 only; it loads it twice so that no load leaves the cell),
// one funnel shift aligns it. 64-entry pair table, 128-byte rows (8 KiB); a pair's address is
// one shift + one LOP3 ((f << 7 >> 6q) & 0x1f80 | lane*4).
template <>
struct WeightPath<3> {
  static constexpr int kEntries = 64, kEntryBytes = 4, kRowBytes = 128;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 8 KiB
  static constexpr int kTileWords = 16 * 3;
  struct Raw { uint32_t lo[2], hi[2]; };
  struct Lane { uint32_t base; uint32_t shift; };
  __device__ static Lane lane_consts(int lane) {
    return {uint32_t(lane) * 4u, uint32_t((24 * (lane & 3)) & 31)};
  }
  __device__ static int offset0(int g, int t) { return 3 * g + (3 * t) / 4; }
  __device__ static int offset1(int g, int t) { return 3 * g + min((3 * t) / 4 + 1, 2); }
  __device__ static int colmap(int j, int r) { return 16 * j + r; }
  template <bool kFull>
  __device__ static void load(Raw& r, const uint32_t* p0, const uint32_t* p1, int j, int colbase,
                              int N) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (kFull || colbase + 16 * j + 8 * h < N) {
        r.lo[h] = ldg_stream(p0 + j * kTileWords + h * 24);
        r.hi[h] = ldg_stream(p1 + j * kTileWords + h * 24);
      }
  }
  __device__ static void decode(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t f = __funnelshift_r(r.lo[h], r.hi[h], L.shift);
      a[0][h] = lds32(lut + (((f << 7) & 0x1f80u) | L.base));
      a[0][h + 2] = lds32(lut + (((f << 1) & 0x1f80u) | L.base));
      a[1][h] = lds32(lut + (((f >> 5) & 0x1f80u) | L.base));
      a[1][h + 2] = lds32(lut + (((f >> 11) & 0x1f80u) | L.base));
    }
  }
  template <class Act>
  __device__ static uint2 lut_entry(int e, const float* cb) {
    const uint32_t v = Act::pack2(__ldg(cb + (e & 7)), __ldg(cb + (e >> 3)));
    return make_uint2(v, v);
  }
};

// bits 5: thread t's 40-bit field starts at bit 40t of the 160-bit cell: words a = 5t/4 and
// a+1 (both inside the cell for every t). 1024-entry pair table, 128-byte rows (128 KiB, so one
// CTA per SM with 16 warps); addresses: one shift + one LOP3 per pair, the pair that straddles
// the field's 32-bit boundary uses a funnel shift instead of the plain shift.
template <>
struct WeightPath<5> {
  static constexpr int kEntries = 1024, kEntryBytes = 4, kRowBytes = 128;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 128 KiB
  static constexpr int kTileWords = 16 * 5;
  struct Raw { uint32_t lo[2], hi[2]; };
  struct Lane { uint32_t base; uint32_t shift; };
  __device__ static Lane lane_consts(int lane) {
    return {uint32_t(lane) * 4u, uint32_t((40 * (lane & 3)) & 31)};
  }
  __device__ static int offset0(int g, int t) { return 5 * g + (5 * t) / 4; }
  __device__ static int offset1(int g, int t) { return 5 * g + (5 * t) / 4 + 1; }
  __device__ static int colmap(int j, int r) { return 16 * j + r; }
  template <bool kFull>
  __device__ static void load(Raw& r, const uint32_t* p0, const uint32_t*, int j, int colbase,
                              int N) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (kFull || colbase + 16 * j + 8 * h < N) {
        r.lo[h] = ldg_stream(p0 + j * kTileWords + h * 40);
        r.hi[h] = ldg_stream(p0 + j * kTileWords + h * 40 + 1);
      }
  }
  __device__ static void decode(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t lo = __funnelshift_r(r.lo[h], r.hi[h], L.shift);  // field bits 0..31
      const uint32_t hi = r.hi[h] >> L.shift;                           // field bits 32..39
      a[0][h] = lds32(lut + (((lo << 7) & 0x1ff80u) | L.base));
      a[0][h + 2] = lds32(lut + (((lo >> 3) & 0x1ff80u) | L.base));
      a[1][h] = lds32(lut + (((lo >> 13) & 0x1ff80u) | L.base));
      a[1][h + 2] = lds32(lut + ((__funnelshift_r(lo, hi, 23) & 0x1ff80u) | L.base));
    }
  }
  template <class Act>
  __device__ static uint2 lut_entry(int e, const float* cb) {
    const uint32_t v = Act::pack2(__ldg(cb + (e & 31)), __ldg(cb + (e >> 5)));
    return make_uint2(v, v);
  }
};

// Tiling per (bits, MT = number of n8 tiles along M = ceil(rows / 8)).
template <int BITS, int MT>
struct Config {
  // Warps per CTA. bits 5: its 128 KiB table allows one CTA per SM, so that CTA has 16 warps
  // (at MT <= 2; above that the activation ring needs the room and 8 warps must do).
  static constexpr int kWarps = (BITS == 5 && MT <= 2) ? 16 : 8;
  static constexpr int kThreads = kWarps * 32;
  // CTAs per SM the register budget is sized for (registers <= 65536 / (kThreads * this)).
  static constexpr int kMinBlocks = (BITS == 5) ? 1 : 2;
  // 16-column tiles per warp: amortizes the activation and scale loads (one ldmatrix and one or
  // two LDS.128 per k-block serve kTN tiles) while the accumulators (kTN * MT * 4) stay <= 32
  // and the weight registers (kStages * kTN * Raw) fit: bits 3 and 5 hold two words per cell.
  static constexpr int kTN = MT == 8 ? 1 : (MT == 1 && (BITS == 2 || BITS == 4)) ? 4 : 2;
  static constexpr int kCols = 16 * kTN;
  // Register stages of weights per warp (prefetch depth). At MT <= 2, 4 stages x kTN tiles
  // keep 1.5-4 KiB per warp in flight, 3-8 MiB over the GPU: at or above latency x bandwidth
  // (~0.8 us x 4.3 TB/s = 3.4 MB). At MT >= 4 the accumulators need the registers.
  static constexpr int kStages = MT >= 4 ? 2 : 4;
  // k-blocks per warp per chunk: 2 at MT = 1; 1 above, where the activation chunk is larger.
  static constexpr int kKPW = MT == 1 ? 2 : 1;
  static constexpr int kCPI = kStages / kKPW;  // chunks spanned by the register pipeline
  static constexpr int kKCH = kWarps * kKPW;   // k-blocks per chunk
  // Activation ring depth: chunk c+kXBuf-1 is fetched while chunk c is computed.
  static constexpr int kXBuf = MT >= 4 ? 2 : 3;
  static constexpr int kXRowBytes = kKCH * 64 + 16;  // +16 B: ldmatrix rows in distinct banks
  static constexpr int kSfKbBytes = kCols * 4;         // decoded scales of one k-block
  static constexpr int kAcc = kTN * MT * 4;            // fp32 accumulators per thread
  static_assert(kStages % kKPW == 0, "the register pipeline must span whole chunks");
  static_assert(kKCH * kCols / 4 <= kThreads, "one scale word per thread per chunk");

  static constexpr size_t smem_bytes(int x_rows) {
    const size_t main = size_t(WeightPath<BITS>::kLutBytes) + size_t(kXBuf) * x_rows * kXRowBytes +
                        2 * size_t(kKCH) * kSfKbBytes;
    const size_t reduce = size_t(kWarps + 1) * kAcc * 32 * 4;
    return main > reduce ? main : reduce;
  }
};

struct Params {
  const void* x;
  const uint32_t* planes;
  const uint8_t* scales;
  const float* codebook;
  const float* tensor_scale;
  void* y;
  int64_t M;
  int N, KB;
  int kb_per_split;  // k-blocks per cluster rank
  int k_split;       // cluster size along grid x (1 = no cluster)
  int x_rows;        // rows of x the shared-memory layout is sized for (min(M, 8 * MT))
  int64_t scale_bytes;  // B * KB * N, the end of the scales buffer
};

// Scale bytes are 4-byte loads of an aligned window; a load that would cross the end of the
// buffer is assembled byte by byte.
__device__ __forceinline__ uint32_t load_u32_clamped(const uint8_t* base, int64_t idx, int64_t end) {
  if (idx + 4 <= end) return ldg_stream(reinterpret_cast<const uint32_t*>(base + idx));
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    if (idx + i < end) v |= uint32_t(base[idx + i]) << (8 * i);
  return v;
}

template <int BITS, class Act, int MT>
__global__ void __launch_bounds__(Config<BITS, MT>::kThreads, Config<BITS, MT>::kMinBlocks)
    kbit_matmul_fused_kernel(const Params p) {
  using Cfg = Config<BITS, MT>;
  using WP = WeightPath<BITS>;
  using T = typename Act::T;
  constexpr int NW = Cfg::kWarps, NT = Cfg::kThreads, TN = Cfg::kTN, P = Cfg::kStages;
  constexpr int KPW = Cfg::kKPW, CPI = Cfg::kCPI, KCH = Cfg::kKCH, XBUF = Cfg::kXBuf;
  constexpr int XRB = Cfg::kXRowBytes, SFB = Cfg::kSfKbBytes, NACC = Cfg::kAcc;

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int rank = blockIdx.x % p.k_split, cgrp = blockIdx.x / p.k_split;
  const int b = blockIdx.y;
  const int col0 = cgrp * Cfg::kCols;
  const int kbA = rank * p.kb_per_split, kbEnd = min(p.KB, kbA + p.kb_per_split);
  const int nchunks = kbEnd > kbA ? (kbEnd - kbA + KCH - 1) / KCH : 0;
  const int64_t m0 = int64_t(blockIdx.z) * 8 * MT;
  const int rows = int(min(int64_t(8 * MT), p.M - m0));
  const int64_t K = int64_t(p.KB) * 32;

  const uint32_t s_lut = smem_u32(smem);
  const uint32_t s_x = s_lut + WP::kLutBytes;
  const uint32_t x_buf_bytes = uint32_t(p.x_rows) * XRB;
  const uint32_t s_sf = s_x + XBUF * x_buf_bytes;
  constexpr uint32_t kSfBufBytes = KCH * SFB;

  // ---- per-thread constants ----
  const typename WP::Lane L = WP::lane_consts(lane);
  const int64_t kb_stride = int64_t(p.N) * BITS;  // words per block row of the weight
  const uint32_t* wbase = p.planes + (int64_t(b) * p.KB * p.N + col0) * BITS;
  const int off0 = WP::offset0(g, t), off1 = WP::offset1(g, t);
  const int colbase = col0 + g;  // column of mma row g in tile 0 (row g+8: +8)
  // ldmatrix: lane l supplies row l%8 of matrix l/8 (= k sub-block of 8 within the 32-block).
  uint32_t x_lane_off[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    x_lane_off[mt] = uint32_t(min(8 * mt + (lane & 7), rows - 1)) * XRB + (lane >> 3) * 16;
  const uint32_t sf_lane_off = uint32_t(g) * (2 * TN * 4);

  const T* xg = static_cast<const T*>(p.x) + (int64_t(b) * p.M + m0) * K;
  const uint8_t* sg = p.scales;

  // Scale staging item of this thread: k-block kbl of the chunk, columns 4cq..4cq+3.
  constexpr int kScaleItems = KCH * TN * 4;
  const bool scale_item = tid < kScaleItems;
  const int s_kbl = tid / (TN * 4), s_cq = tid % (TN * 4);

  auto scale_byte_index = [&](int c) -> int64_t {
    const int kb = kbA + c * KCH + s_kbl;
    return (int64_t(b) * p.KB + kb) * p.N + col0 + 4 * s_cq;
  };
  auto load_scales = [&](uint32_t& lo, uint32_t& hi, int c) {
    const int kb = kbA + c * KCH + s_kbl;
    if (!scale_item || kb >= kbEnd) return;
    const int64_t idx = scale_byte_index(c), w = idx & ~int64_t(3);
    lo = load_u32_clamped(sg, w, p.scale_bytes);
    hi = (idx & 3) ? load_u32_clamped(sg, w + 4, p.scale_bytes) : 0u;
  };
  auto decode_scales = [&](uint32_t lo, uint32_t hi, int c) {
    const int kb = kbA + c * KCH + s_kbl;
    if (!scale_item || kb >= kbEnd) return;
    const uint32_t v = __funnelshift_r(lo, hi, uint32_t(scale_byte_index(c) & 3) * 8);
    const uint32_t dst = s_sf + (c & 1) * kSfBufBytes + s_kbl * SFB;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * (s_cq & 3) + i;  // column within the tile = its mma row (colmap)
      const uint32_t byte19 = i < 3 ? (v << (19 - 8 * i)) & 0x07f80000u : (v >> 5) & 0x07f80000u;
      sts32f(dst + (((r & 7) * TN + (s_cq >> 2)) * 2 + (r >> 3)) * 4, decode_e4m4_fast(byte19));
    }
  };
  // Activation staging: thread tid copies piece tid%4 of k-block (tid/4)%KCH of rows
  // tid/(4*KCH) + i*kXRowStep (16 bytes each, cp.async, no L1 allocation).
  constexpr int kXRowStep = NT / (KCH * 4);
  static_assert(NT % (KCH * 4) == 0, "x staging pattern");
  const int x_kbl = (tid / 4) % KCH, x_row0 = tid / (4 * KCH);
  const T* x_src0 = xg + int64_t(x_row0) * K + (kbA + x_kbl) * 32 + (tid & 3) * 8;
  const uint32_t x_dst0 = uint32_t(x_row0) * XRB + x_kbl * 64 + (tid & 3) * 16;
  auto stage_x = [&](int c) {
    if (kbA + c * KCH + x_kbl >= kbEnd) return;
    const uint32_t dst = s_x + (c % XBUF) * x_buf_bytes + x_dst0;
    const T* src = x_src0 + int64_t(c) * KCH * 32;
    for (int row = x_row0, i = 0; row < rows; row += kXRowStep, ++i)
      cp_async16(dst + i * kXRowStep * XRB, src + int64_t(i) * kXRowStep * K);
  };

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

  auto run = [&](auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    typename WP::Raw wbuf[P][TN];
#pragma unroll
    for (int s = 0; s < P; ++s)
#pragma unroll
      for (int j = 0; j < TN; ++j) wbuf[s][j] = {};
    auto load_stage = [&](typename WP::Raw (&st)[TN], int kb) {
      const uint32_t* row = wbase + int64_t(kb) * kb_stride;
#pragma unroll
      for (int j = 0; j < TN; ++j) WP::template load<kFull>(st[j], row + off0, row + off1, j, colbase, p.N);
    };
    auto compute = [&](const typename WP::Raw (&st)[TN], uint32_t xbuf, uint32_t sfbuf, int kbl) {
      uint32_t xb[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(xb[mt], xbuf + x_lane_off[mt] + kbl * 64);
      float sc[2 * TN];
      const uint32_t sfa = sfbuf + kbl * SFB + sf_lane_off;
      if constexpr (TN >= 2) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) {
          const float4 v = lds128f(sfa + 16 * i);
          sc[4 * i] = v.x; sc[4 * i + 1] = v.y; sc[4 * i + 2] = v.z; sc[4 * i + 3] = v.w;
        }
      } else {
        const float2 v = lds64f(sfa);
        sc[0] = v.x; sc[1] = v.y;
      }
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        uint32_t a[2][4];
        WP::decode(st[j], s_lut, L, a);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float zero[4] = {0.f, 0.f, 0.f, 0.f};
          float d[4];
          mma_16816<Act>(d, a[0], xb[mt][0], xb[mt][1], zero);  // k 0..15 of the block
          mma_16816<Act>(d, a[1], xb[mt][2], xb[mt][3], d);     // k 16..31
          float* c = acc + (j * MT + mt) * 4;
          c[0] = fmaf(d[0], sc[2 * j], c[0]);      // row g   (column colmap(j, g))
          c[1] = fmaf(d[1], sc[2 * j], c[1]);
          c[2] = fmaf(d[2], sc[2 * j + 1], c[2]);  // row g+8
          c[3] = fmaf(d[3], sc[2 * j + 1], c[3]);
        }
      }
    };

    // ---- prologue: weights of the first kStages stages, scales of the first kCPI chunks,
    // activations of the first kXBuf-1 chunks; the table is built while they are in flight.
#pragma unroll
    for (int s = 0; s < P; ++s) {
      const int kb = kbA + (s / KPW) * KCH + warp * KPW + (s % KPW);
      if (kb < kbEnd) load_stage(wbuf[s], kb);
    }
    uint32_t rs_lo[CPI], rs_hi[CPI];
#pragma unroll
    for (int i = 0; i < CPI; ++i) { rs_lo[i] = 0; rs_hi[i] = 0; load_scales(rs_lo[i], rs_hi[i], i); }
#pragma unroll
    for (int c = 0; c < XBUF - 1; ++c) { if (c < nchunks) stage_x(c); cp_async_commit(); }
    {
      constexpr int kChunks = 2 * WP::kEntryBytes;  // 16-byte pieces per table row
      const float* cb = p.codebook + int64_t(b) * (1 << BITS);
      for (int i = tid; i < WP::kEntries * kChunks; i += NT) {
        const int e = i / kChunks, piece = i % kChunks;
        const uint2 v = WP::template lut_entry<Act>(e, cb);
        sts128(s_lut + e * WP::kRowBytes + piece * 16, v.x, v.y, v.x, v.y);
      }
    }
    decode_scales(rs_lo[0], rs_hi[0], 0);
    cp_async_wait<XBUF - 2>();
    __syncthreads();

    // ---- main loop: kCPI chunks (= kStages register stages) per iteration ----
    for (int cbase = 0; cbase < nchunks; cbase += CPI) {
#pragma unroll
      for (int ci = 0; ci < CPI; ++ci) {
        const int c = cbase + ci;
        if (c >= nchunks) break;  // CTA-uniform
        if (c + XBUF - 1 < nchunks) stage_x(c + XBUF - 1);
        cp_async_commit();
        if (c + CPI < nchunks) load_scales(rs_lo[ci], rs_hi[ci], c + CPI);
        const uint32_t xbuf = s_x + (c % XBUF) * x_buf_bytes;
        const uint32_t sfbuf = s_sf + (c & 1) * kSfBufBytes;
#pragma unroll
        for (int u = 0; u < KPW; ++u) {
          const int s = ci * KPW + u;  // register stage slot (compile-time)
          const int kbl = warp * KPW + u;
          const int kb = kbA + c * KCH + kbl;
          if (kb < kbEnd) compute(wbuf[s], xbuf, sfbuf, kbl);
          const int kb_next = kb + CPI * KCH;  // the same slot, kStages stages later
          if (kb_next < kbEnd) load_stage(wbuf[s], kb_next);
        }
        if (c + 1 < nchunks) decode_scales(rs_lo[(ci + 1) % CPI], rs_hi[(ci + 1) % CPI], c + 1);
        cp_async_wait<XBUF - 2>();
        __syncthreads();
      }
    }
  };
  if (col0 + Cfg::kCols <= p.N) run(std::true_type{});
  else run(std::false_type{});

  // ---- epilogue: reduce the warps' partial sums (they split K), then the cluster's ----
  cp_async_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [NW][NACC][32]
#pragma unroll
  for (int i = 0; i < NACC; ++i) red[(warp * NACC + i) * 32 + lane] = acc[i];
  __syncthreads();
  float* part = red + NW * NACC * 32;  // [NACC][32]
  const float ts = p.tensor_scale[b];
  T* yg = static_cast<T*>(p.y) + (int64_t(b) * p.M) * p.N;
  auto write_out = [&](int idx, float v) {
    const int e = idx >> 5, ln = idx & 31, c = e & 3, mt = (e >> 2) % MT, j = (e >> 2) / MT;
    const int r = (ln >> 2) + 8 * (c >> 1);
    const int64_t m = m0 + 8 * mt + 2 * (ln & 3) + (c & 1);
    const int n = col0 + WP::colmap(j, r);
    if (m < p.M && n < p.N) yg[m * p.N + n] = from_f32<T>(v * ts);
  };
  for (int idx = tid; idx < NACC * 32; idx += NT) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) s += red[w * NACC * 32 + idx];
    if (p.k_split == 1) write_out(idx, s);
    else part[idx] = s;
  }
  if (p.k_split > 1) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every rank's partial sums are in its shared memory
    for (int idx = rank * NT + tid; idx < NACC * 32; idx += NT * p.k_split) {
      float s = 0.f;
      for (int r = 0; r < p.k_split; ++r) s += cluster.map_shared_rank(part, r)[idx];
      write_out(idx, s);
    }
    cluster.sync();  // no CTA leaves while another still reads its shared memory
  }
}

}  // namespace kbit::cuda::fused

// ---- host side: launch configuration ----
namespace kbit::cuda::fused {

// Per-device facts and per-(kernel, device) settings are cached: the launcher runs on every
// eager call, and a driver query per launch would make small kernels host-bound. The caches
// are benign-race atomics (every writer stores the same value).
constexpr int kMaxDevices = 64;

inline int current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) dev = 0;
  return dev;
}

inline int device_sm_count(int dev) {
  static std::atomic<int> cache[kMaxDevices];
  int sms = cache[dev].load(std::memory_order_relaxed);
  if (sms > 0) return sms;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
  cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

// Raises the kernel's dynamic shared-memory limit to at least `bytes` on device `dev` (once
// per size increase) and returns the resident CTAs per SM at `bytes` (cached per row count).
template <class Kernel>
cudaError_t prepare_kernel(Kernel* kernel, int dev, size_t bytes, int threads, int x_rows, int* per_sm) {
  static std::atomic<int> smem_set[kMaxDevices];
  static std::atomic<int> occupancy[kMaxDevices][65];
  if (smem_set[dev].load(std::memory_order_relaxed) < int(bytes)) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err != cudaSuccess) return err;
    smem_set[dev].store(int(bytes), std::memory_order_relaxed);
  }
  const int slot = x_rows < 0 ? 0 : (x_rows > 64 ? 64 : x_rows);
  int occ = occupancy[dev][slot].load(std::memory_order_relaxed);
  if (occ <= 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, bytes) != cudaSuccess || occ < 1)
      occ = 1;
    occupancy[dev][slot].store(occ, std::memory_order_relaxed);
  }
  *per_sm = occ;
  return cudaSuccess;
}

// n8 tiles along M for a problem with M rows (blocks of 64 rows above that).
inline int m_tiles(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

template <int BITS, class Act, int MT>
std::string launch_fused_config(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  using Cfg = Config<BITS, MT>;
  auto* kernel = &kbit_matmul_fused_kernel<BITS, Act, MT>;
  const std::string shape = "B=" + std::to_string(a.batch) + " M=" + std::to_string(a.m) +
                            " K=" + std::to_string(a.k) + " N=" + std::to_string(a.n) +
                            " bits=" + std::to_string(BITS) + " dtype=" + Act::kName +
                            " MT=" + std::to_string(MT);
  const int KB = static_cast<int>(a.k / 32);
  const int x_rows = static_cast<int>(std::min<int64_t>(a.m, 8 * MT));
  const size_t smem = Cfg::smem_bytes(x_rows);
  const char* name = "kbit_matmul_fused_kernel";
  const int dev = current_device();
  int per_sm = 1;
  cudaError_t err = prepare_kernel(kernel, dev, smem, Cfg::kThreads, x_rows, &per_sm);
  if (err != cudaSuccess)
    return std::string(name) + ": cannot reserve " + std::to_string(smem) +
           " bytes of shared memory: " + cudaGetErrorString(err) + " (" + shape + ")";

  const int64_t col_groups = (a.n + Cfg::kCols - 1) / Cfg::kCols;
  const int64_t m_blocks = (a.m + 8 * MT - 1) / (8 * MT);
  if (a.batch > 65535 || m_blocks > 65535 || col_groups * 8 > 0x7fffffffLL)
    return std::string(name) + ": grid too large for " + shape;

  // Split K over a thread-block cluster when the column groups alone leave SMs idle: as many
  // ranks as fit the resident-CTA capacity in one wave, at most 8 (the portable cluster size),
  // and at least 8 k-blocks per rank.
  int k_split = 1;
  if (tuning && tuning->k_split > 0) {
    k_split = tuning->k_split;
  } else {
    const int64_t capacity = int64_t(device_sm_count(dev)) * per_sm;
    const int64_t base = col_groups * a.batch * m_blocks;
    if (base < capacity) k_split = static_cast<int>(std::min<int64_t>(8, capacity / base));
    k_split = std::max(1, std::min(k_split, KB / 8));
  }
  k_split = std::max(1, std::min({k_split, 8, std::max(KB, 1)}));
  const int kb_per_split = (KB + k_split - 1) / k_split;
  k_split = std::max(1, (KB + kb_per_split - 1) / std::max(kb_per_split, 1));  // no empty ranks

  Params prm;
  prm.x = a.x;
  prm.planes = a.planes;
  prm.scales = a.scales;
  prm.codebook = a.codebook;
  prm.tensor_scale = a.tensor_scale;
  prm.y = a.y;
  prm.M = a.m;
  prm.N = static_cast<int>(a.n);
  prm.KB = KB;
  prm.kb_per_split = std::max(kb_per_split, 1);
  prm.k_split = k_split;
  prm.x_rows = x_rows;
  prm.scale_bytes = a.batch * int64_t(KB) * a.n;

  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(col_groups * k_split), static_cast<unsigned>(a.batch),
                     static_cast<unsigned>(m_blocks));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (k_split > 1) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(k_split);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  err = cudaLaunchKernelEx(&cfg, kernel, prm);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear
    return std::string(name) + " failed to launch: " + cudaGetErrorName(err) + " (" +
           cudaGetErrorString(err) + ") for " + shape + " k_split=" + std::to_string(k_split);
  }
  return check_launch(name, shape + " k_split=" + std::to_string(k_split));
}

template <int BITS>
std::string launch_fused_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  auto by_act = [&](auto mt_tag) -> std::string {
    constexpr int MT = decltype(mt_tag)::value;
    if (a.dtype == DType::kBF16) return launch_fused_config<BITS, ActBF16, MT>(a, stream, tuning);
    return launch_fused_config<BITS, ActF16, MT>(a, stream, tuning);
  };
  switch (m_tiles(a.m)) {
    case 1: return by_act(std::integral_constant<int, 1>{});
    case 2: return by_act(std::integral_constant<int, 2>{});
    case 4: return by_act(std::integral_constant<int, 4>{});
    default: return by_act(std::integral_constant<int, 8>{});
  }
}

}  // namespace kbit::cuda::fused
