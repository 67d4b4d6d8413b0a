// The per-bits decode of fragment-layout weights into mma A-operand registers, shared by the
// fused kernels (matmul_fused.cuh: mma.sync; matmul_wgmma.cuh: wgmma with A from registers,
// whose per-warp fragment of a 64 x 16 A tile is the mma.m16n8k16 A fragment of rows 16 w..).
#pragma once

#include <type_traits>

#include "cuda/common.cuh"

namespace kbit::cuda::fused {

// (a & MASK) | (b & ~MASK) in one LOP3: written as ANDs and an OR, ptxas spent two.
template <uint32_t MASK>
__device__ __forceinline__ uint32_t bit_select(uint32_t a, uint32_t b) {
  uint32_t d;  // LUT 0xe4 = (0xf0 & 0xaa) | (0xcc & ~0xaa) with a = 0xf0, b = 0xcc, MASK = 0xaa
  asm("lop3.b32 %0, %1, %2, %3, 0xe4;\n" : "=r"(d) : "r"(a), "r"(b), "n"(MASK));
  return d;
}

// Per-bits decode path. Shared interface:
//   kLutBytes          shared-memory bytes of the replicated lookup table
//   kCopies            copies of each entry, one per lane (or half-warp), in kRowBytes rows
//   Raw                the registers of one thread's fields for one 16-column tile
//   load(slab, off, j) read them from the staged weights of one k-block (slab = its first cell)
//   decode             Raw -> the 2 x 4 A-operand registers of the tile's two k16 halves
//   decode_rows        (bits 2 only) the same registers by per-row lookups, for callers that
//                      scale them before the mma; decode_for_scaling picks it
//   lut_entry          value of table entry e (built once per CTA)
//   offset0/offset1    byte offsets of the thread's words inside a tile (rows g and g+8 follow
//                      at compile-time distances)
// mma row r of tile j always stands for column 16 j + r of the CTA's column group.
template <int BITS>
struct WeightPath;

// bits 4: each thread's field is exactly word t of the cell; code pair q is byte q.
// 256-entry pair table, 256-byte rows (lane l's copy at byte 4l; the upper 128 B of each row
// are unused) so that the address is PRMT(field, lane_base): byte q of the field becomes the
// row, the lane's byte offset stays in byte 0. One PRMT + one LDS.32 per two weights.
template <>
struct WeightPath<4> {
  static constexpr int kEntries = 256, kEntryBytes = 4, kRowBytes = 256, kCopies = 32;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 64 KiB
  static constexpr int kTileBytes = 16 * 16;               // 16 cells of 4 words
  struct Raw { uint32_t w[2]; };                           // word t of rows g and g+8
  struct Lane { uint32_t base; };
  __device__ static Lane lane_consts(int lane) { return {uint32_t(lane) * 4u}; }
  __device__ static uint32_t offset0(int g, int t) { return 4 * (4 * g + t); }
  __device__ static uint32_t offset1(int g, int t) { return offset0(g, t); }
  __device__ static void load(Raw& r, uint32_t slab, uint32_t o0, uint32_t, int j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) r.w[h] = lds32(slab + o0 + j * kTileBytes + h * 128);
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

// bits 2: a thread's field is 16 bits, half t&1 of word t>>1 of the cell. A 256-entry table of
// FOUR values (8 B: two operand registers) indexed by one byte of codes halves the lookups: per
// 8 weights 2 PRMT + 2 LDS.64 (+ 1 SHF + 1 LOP3 in decode). Rows of 32 lanes x 8 B = 256 B, so
// the PRMT that moves the byte into byte 1 also keeps the lane offset (lane*8) in byte 0.
// A decode without the table (per four codes, one IMAD builds the selectors of two PRMT into a
// two-register codebook) issues ~1.4 instructions per weight against these ~0.75, and peaked at
// 8.0 Tweights/s against the table's 11.3 (H200, codes from L2: benchmarks/decode_rate_probe.cu).
template <>
struct WeightPath<2> {
  static constexpr int kEntries = 256, kEntryBytes = 8, kRowBytes = 256, kCopies = 32;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 64 KiB
  static constexpr int kTileBytes = 16 * 8;
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
  __device__ static uint32_t offset0(int g, int t) { return 4 * (2 * g + (t >> 1)); }
  __device__ static uint32_t offset1(int g, int t) { return offset0(g, t); }
  __device__ static void load(Raw& r, uint32_t slab, uint32_t o0, uint32_t, int j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) r.w[h] = lds32(slab + o0 + j * kTileBytes + h * 64);
  }
  __device__ static void decode(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
    // Byte s of a field holds half s's codes: low nibble k 2t, 2t+1, high nibble k 2t+8, 2t+9.
    // Rows g and g+8 merged nibble by nibble (4 ALU instructions a tile), each quad is one
    // aligned register pair of the mma's A quad: registers 0, 1 (k 2t..) and 2, 3 (k 2t+8..).
    // Looked up by row (decode_rows) the pairs are 0, 2 and 1, 3, and ptxas spent ~6 moves a
    // tile building the mma's quad (M = 9..16: the 16-row loops 15-20 % shorter without them).
    const uint32_t lo = bit_select<0x0f0f0f0fu>(r.w[0], r.w[1] << 4);
    const uint32_t hi = bit_select<0x0f0f0f0fu>(r.w[0] >> 4, r.w[1]);
#pragma unroll
    for (int s = 0; s < 2; ++s) {  // quad s = the k16 half s of the cell
      const uint2 q0 = lds64(lut + __byte_perm(lo, L.base, L.sel[s]));
      const uint2 q1 = lds64(lut + __byte_perm(hi, L.base, L.sel[s]));
      a[s][0] = q0.x;
      a[s][1] = q0.y;
      a[s][2] = q1.x;
      a[s][3] = q1.y;
    }
  }
  // decode's registers by looking up each row's quads: for callers that multiply the registers
  // by their rows' scales first (decode_for_scaling), whose multiplies write them anywhere.
  __device__ static void decode_rows(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
#pragma unroll
    for (int s = 0; s < 2; ++s)
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
// a+1 (the last thread needs word 2 only and reads it twice), one funnel shift aligns it.
// 64-entry pair table, 128-byte rows (8 KiB); a pair's address is one shift + one LOP3
// ((f << 7 >> 6q) & 0x1f80 | lane*4).
template <>
struct WeightPath<3> {
  static constexpr int kEntries = 64, kEntryBytes = 4, kRowBytes = 128, kCopies = 32;
  static constexpr int kLutBytes = kEntries * kRowBytes;  // 8 KiB
  static constexpr int kTileBytes = 16 * 12;
  struct Raw { uint32_t lo[2], hi[2]; };
  struct Lane { uint32_t base; uint32_t shift; };
  __device__ static Lane lane_consts(int lane) {
    return {uint32_t(lane) * 4u, uint32_t((24 * (lane & 3)) & 31)};
  }
  __device__ static uint32_t offset0(int g, int t) { return 4 * (3 * g + (3 * t) / 4); }
  __device__ static uint32_t offset1(int g, int t) { return 4 * (3 * g + min((3 * t) / 4 + 1, 2)); }
  __device__ static void load(Raw& r, uint32_t slab, uint32_t o0, uint32_t o1, int j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.lo[h] = lds32(slab + o0 + j * kTileBytes + h * 96);
      r.hi[h] = lds32(slab + o1 + j * kTileBytes + h * 96);
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
// a+1 (both inside the cell for every t). 1024-entry pair table; addresses: one shift + one LOP3
// per pair, the pair that straddles the field's 32-bit boundary uses a funnel shift instead of
// the plain shift. COPIES lane copies per entry:
//  * 32 (128-byte rows, 128 KiB): lane l reads bank l, one wavefront per lookup;
//  * 16 (64-byte rows, 64 KiB): lanes l and l + 16 read copy l & 15, so a lookup takes two
//    wavefronts; it leaves the wgmma kernel's 256-row tile room for four ring stages, where
//    the 128 KiB table leaves two (1.13-2.44x the time).
template <int COPIES>
struct WeightPathBits5 {
  static_assert(COPIES == 32 || COPIES == 16, "a copy per lane or per half-warp");
  static constexpr int kEntries = 1024, kEntryBytes = 4, kCopies = COPIES;
  static constexpr int kRowBytes = kCopies * kEntryBytes;
  static constexpr int kRowShift = COPIES == 32 ? 7 : 6;  // log2(kRowBytes)
  static constexpr uint32_t kRowMask = uint32_t(kEntries - 1) << kRowShift;
  static constexpr int kLutBytes = kEntries * kRowBytes;
  static constexpr int kTileBytes = 16 * 20;
  struct Raw { uint32_t lo[2], hi[2]; };
  struct Lane { uint32_t base; uint32_t shift; };
  __device__ static Lane lane_consts(int lane) {
    return {uint32_t(lane % kCopies) * 4u, uint32_t((40 * (lane & 3)) & 31)};
  }
  __device__ static uint32_t offset0(int g, int t) { return 4 * (5 * g + (5 * t) / 4); }
  __device__ static uint32_t offset1(int g, int t) { return offset0(g, t) + 4; }
  __device__ static void load(Raw& r, uint32_t slab, uint32_t o0, uint32_t, int j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.lo[h] = lds32(slab + o0 + j * kTileBytes + h * 160);
      r.hi[h] = lds32(slab + o0 + j * kTileBytes + h * 160 + 4);
    }
  }
  __device__ static void decode(const Raw& r, uint32_t lut, const Lane& L, uint32_t (&a)[2][4]) {
    constexpr int R = kRowShift;  // pair q (field bits 10q..10q+9) lands at bits R..R+9
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t lo = __funnelshift_r(r.lo[h], r.hi[h], L.shift);  // field bits 0..31
      const uint32_t hi = r.hi[h] >> L.shift;                           // field bits 32..39
      a[0][h] = lds32(lut + (((lo << R) & kRowMask) | L.base));
      a[0][h + 2] = lds32(lut + (((lo >> (10 - R)) & kRowMask) | L.base));
      a[1][h] = lds32(lut + (((lo >> (20 - R)) & kRowMask) | L.base));
      a[1][h + 2] = lds32(lut + ((__funnelshift_r(lo, hi, 30 - R) & kRowMask) | L.base));
    }
  }
  template <class Act>
  __device__ static uint2 lut_entry(int e, const float* cb) {
    const uint32_t v = Act::pack2(__ldg(cb + (e & 31)), __ldg(cb + (e >> 5)));
    return make_uint2(v, v);
  }
};

template <>
struct WeightPath<5> : WeightPathBits5<32> {};

// a * b on two bf16 lanes, rounded once.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// a * b on two fp16 lanes, rounded once.
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// a * b on two lanes of the activations' dtype, rounded once.
template <class Act>
__device__ __forceinline__ uint32_t mul_x2(uint32_t a, uint32_t b) {
  if constexpr (std::is_same_v<Act, ActBF16>) return mul_bf16x2(a, b);
  else return mul_f16x2(a, b);
}

// Multiplies a tile's decoded fragments (decode_for_scaling) by the E4M4 block scales of its two
// mma rows: s_lo for row g (registers 0, 2), s_hi for row g + 8 (registers 1, 3), in the
// activations' dtype. The scales are exact in bf16 (5 significant bits, 2^-14..31), so each
// weight is rounded once, to bf16. fp16 callers pass the scale times a power of two that keeps
// the products inside fp16's range (matmul_wgmma.cuh: f16_weight_exponent), exact there too.
template <class Act = ActBF16>
__device__ __forceinline__ void scale_fragments(uint32_t (&a)[2][4], float s_lo, float s_hi) {
  const uint32_t lo = Act::pack2(s_lo, s_lo), hi = Act::pack2(s_hi, s_hi);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    a[h][0] = mul_x2<Act>(a[h][0], lo);
    a[h][2] = mul_x2<Act>(a[h][2], lo);
    a[h][1] = mul_x2<Act>(a[h][1], hi);
    a[h][3] = mul_x2<Act>(a[h][3], hi);
  }
}

// The decode for callers that multiply the registers by their rows' scales (scale_fragments)
// before the mma: the multiplies write the mma's registers in any order, so bits 2 looks its
// quads up by row (WeightPath<2>::decode_rows), without decode's merge.
template <class WP>
__device__ __forceinline__ void decode_for_scaling(const typename WP::Raw& r, uint32_t lut,
                                                   const typename WP::Lane& L, uint32_t (&a)[2][4]) {
  if constexpr (std::is_same_v<WP, WeightPath<2>>) WP::decode_rows(r, lut, L, a);
  else WP::decode(r, lut, L, a);
}

// The replicated lookup table of one batch entry's codebook, written by `nthreads` threads, in
// one of two orders:
//  * by piece (kByEntry = false, the fused kernels): item i is 16-byte piece i % P of entry
//    i / P's row (P pieces per row), so consecutive lanes fill whole rows; each item computes its
//    entry (its codebook loads and packing) again.
//  * by entry (the wgmma kernel, and the fused kernels' build at entry): a thread computes an
//    entry once and writes its row's pieces in an order rotated by the lane, so that a warp's 32
//    stores spread over all banks (4 wavefronts, the least for 512 bytes; a 64-byte row covers
//    half the banks, so lanes 2i and 2i + 1 share a rotation). At the wgmma kernel's start, on
//    the first chunk's path, the bits-5 table (1024 entries, 128 KiB) then took 1.1 us instead
//    of 1.8 (Llama-3-8B down at M = 128); at the fused kernel's, 1.6 us instead of 2.4
//    (Llama-3-70B down, M = 1).
//    The fused kernels' rebuild inside their item loop keeps the order by piece: by entry there,
//    ptxas builds their hot loops 16-36 instructions longer or shorter (tools/sass_loops.py), and
//    the 16-row N-split tiling takes up to 1.09x the time at M = 16. The build at entry leaves
//    the loops' lengths alone, but not their order (bits 5 at M <= 8 takes 1.02-1.04x the time
//    where that build does not run, under PDL).
template <class WP, class Act, bool kByEntry = false>
__device__ __forceinline__ void build_table(uint32_t lut, const float* cb, int tid, int nthreads) {
  constexpr int kPieces = WP::kCopies * WP::kEntryBytes / 16;  // 16-byte stores per row
  if constexpr (kByEntry) {
    constexpr int kLanesPerRotation = WP::kRowBytes >= 128 ? 1 : 128 / WP::kRowBytes;
    static_assert((kPieces & (kPieces - 1)) == 0, "pieces per row: a power of two");
    const int rotation = (tid & 31) / kLanesPerRotation;
    for (int e = tid; e < WP::kEntries; e += nthreads) {
      const uint2 v = WP::template lut_entry<Act>(e, cb);
#pragma unroll
      for (int j = 0; j < kPieces; ++j)
        sts128(lut + e * WP::kRowBytes + ((j + rotation) & (kPieces - 1)) * 16, v.x, v.y, v.x, v.y);
    }
  } else {
    for (int i = tid; i < WP::kEntries * kPieces; i += nthreads) {
      const int e = i / kPieces, piece = i % kPieces;
      const uint2 v = WP::template lut_entry<Act>(e, cb);
      sts128(lut + e * WP::kRowBytes + piece * 16, v.x, v.y, v.x, v.y);
    }
  }
}

}  // namespace kbit::cuda::fused
