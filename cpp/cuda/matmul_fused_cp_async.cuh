// The cp.async fused kernel: the fused matmul where the warp-specialized kernel's tensor copies
// do not apply (M > 128, N % 16 != 0, or buffers not 16-byte aligned; launch_fused_bits), with
// the K-split tilings.
//
// Every thread issues 16-byte cp.async copies of one chunk (weights, activations, scale bytes)
// into a kStages-deep shared-memory ring, one commit group per chunk, and the CTA meets at one
// __syncthreads per chunk: chunk q + kStages - 1 is copied while chunk q computes. Warp w
// computes k-block(s) w of every chunk for all kTN 16-column tiles of the item's column group;
// at the item's end the warps' partial sums meet in a barrier tree in shared memory, then the
// cluster's ranks' sums in rank 0 (distributed shared memory).
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/matmul_fused_config.cuh"
#include "cuda/matmul_fused_epilogue.cuh"
#include "cuda/matmul_fused_steps.cuh"
#include "cuda/matmul_fused_walk.cuh"
#include "cuda/weight_path.cuh"

namespace kbit::cuda::fused {

template <int BITS, class Act, int MT, int V>
__global__ void __launch_bounds__(Config<BITS, MT, V>::kThreads, 1)
    kbit_matmul_fused_kernel(const Params p, const WalkDivs dv) {
  static_assert(V != Tiling::kNSplit && V != Tiling::kWideBits5, "a tiling of the warp-specialized kernel only");
  using Cfg = Config<BITS, MT, V>;
  using WP = typename Cfg::Path;
  using T = typename Act::T;
  constexpr int NW = Cfg::kWarps, NT = Cfg::kThreads, TN = Cfg::kTN, D = Cfg::kStages;
  constexpr int KCH = Cfg::kKCH, XRB = Cfg::kXRowBytes, NACC = Cfg::kAcc, COLS = Cfg::kCols;
  constexpr int SLAB = Cfg::kSlabBytes, SFB = Cfg::kSfKbBytes, KPW = Cfg::kKPW;

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const ItemWalk<KCH, COLS, 8 * MT> walk(p, dv);
  const int KS = walk.ks, rank = walk.rank, kbA = walk.kbA, kbEnd = walk.kbEnd, nch = walk.nch, Q = walk.q;
  const int64_t K = walk.k;

  // ---- shared memory: [LUT][reduction][partial][sf x 2][ring: D x (weights | x | raw scales)]
  const uint32_t s_lut = smem_u32(smem);
  const uint32_t s_red = s_lut + WP::kLutBytes;
  const uint32_t s_part = s_red + Cfg::kRedBytes;
  const uint32_t s_sf = s_part + Cfg::kPartBytes;
  const uint32_t s_ring = s_sf + 2 * Cfg::kSfChunk;
  const uint32_t x_slot = uint32_t(p.x_rows) * XRB;
  const uint32_t slot_bytes = Cfg::kWChunk + x_slot + Cfg::kRawChunk;
  float* part_ptr = reinterpret_cast<float*>(smem + WP::kLutBytes + Cfg::kRedBytes);

  // ---- issue the copies of one chunk into ring slot `slot` (one commit group per chunk).
  // Every thread's pieces are fixed by its index: their offsets are computed once here, so a
  // chunk costs a few uniform 64-bit products and one add + one cp.async per piece.
  const int64_t row_bytes = int64_t(p.N) * BITS * 4;  // one k-block row of the weight
  constexpr int kPPK = SLAB / 16;                      // 16-byte pieces per k-block slab
  constexpr int kWPieces = KCH * kPPK;
  constexpr int kWPer = (kWPieces + NT - 1) / NT;
  int64_t w_goff[kWPer];
  uint32_t w_soff[kWPer];
  int w_kbl[kWPer];
#pragma unroll
  for (int r = 0; r < kWPer; ++r) {
    const int i = tid + r * NT;
    w_kbl[r] = i < kWPieces ? i / kPPK : (1 << 29);  // no piece: fails the k-range test
    w_soff[r] = uint32_t((i / kPPK) * SLAB + (i % kPPK) * 16);
    w_goff[r] = int64_t(i / kPPK) * row_bytes + (i % kPPK) * 16;
  }
  constexpr int XRS = Cfg::kXRowStep;
  const int x_row0 = tid / (KCH * 4), x_kbl = (tid / 4) % KCH, x_piece = tid & 3;
  const int64_t x_goff = (int64_t(x_row0) * K + x_kbl * 32 + x_piece * 8) * int64_t(sizeof(T));
  const uint32_t x_soff = uint32_t(x_row0) * XRB + x_kbl * 64 + x_piece * 16;
  // Scale items live on the last kScaleItems threads (the first ones copy the activations).
  const int s_item = tid - (NT - Cfg::kScaleItems);  // < 0: none
  const int s_kbl = max(s_item, 0) / (TN * 4), s_cq = max(s_item, 0) % (TN * 4);
  const int64_t s_goff = int64_t(s_kbl) * p.N + 4 * s_cq;

  // Four scale bytes at `off` into shared memory, zeros past the end of the buffer. A partial
  // cp.async (src-size < 4) still reads all four bytes on the H200 (compute-sanitizer flags
  // it), so the last, partial word is gathered byte by byte with ordinary loads; like the
  // bookkeeping words stored next to it, it is visible after the chunk's barrier.
  auto copy_scale_word = [&](uint32_t dst, int64_t off) {
    const int64_t avail = p.scale_bytes - off;
    if (avail >= 4) {
      cp_async4_zfill(dst, p.scales + off, 4u);
      return;
    }
    uint32_t v = 0;
    for (int64_t i = 0; i < avail; ++i) v |= uint32_t(p.scales[off + i]) << (8 * i);
    sts32(dst, v);
  };

  auto issue = [&](const Cursor& cur, int slot) {
    const uint32_t base = s_ring + slot * slot_bytes;
    const int kb0 = kbA + cur.c * KCH;
    const int64_t cell0 = cur.cell0;  // first cell of the chunk
    const uint8_t* wsrc = reinterpret_cast<const uint8_t*>(p.planes) + cell0 * (BITS * 4);
    const bool full_cols = cur.col0 + COLS <= p.N;
    if (p.vec16 && full_cols) {
#pragma unroll
      for (int r = 0; r < kWPer; ++r)
        if (kb0 + w_kbl[r] < kbEnd) cp_async16(base + w_soff[r], wsrc + w_goff[r]);
    } else {  // last column group (zero-fill past N) or rows not 16-byte aligned: 4-byte copies
      const uint32_t valid = uint32_t(min(COLS, p.N - cur.col0)) * BITS * 4;
      for (int i = tid; i < KCH * SLAB / 4; i += NT) {
        const int kbl = i / (SLAB / 4), off = (i % (SLAB / 4)) * 4;
        if (kb0 + kbl < kbEnd)
          cp_async4_zfill(base + kbl * SLAB + off, wsrc + kbl * row_bytes + (uint32_t(off) < valid ? off : 0),
                          uint32_t(off) < valid ? 4u : 0u);
      }
    }
    // activations: 16-byte pieces (8 elements) of rows x_row0 + 8 i, k-block x_kbl
    if (kb0 + x_kbl < kbEnd) {
      const uint8_t* xsrc = reinterpret_cast<const uint8_t*>(p.x) + cur.x0 * int64_t(sizeof(T)) + x_goff;
      const uint32_t xdst = base + Cfg::kWChunk + x_soff;
#pragma unroll
      for (int i = 0; i < 8 * MT / XRS; ++i)
        if (x_row0 + XRS * i < cur.rows)
          cp_async16(xdst + i * XRS * XRB, xsrc + int64_t(i) * XRS * K * int64_t(sizeof(T)));
    }
    // scale bytes: thread tid < kScaleItems copies the aligned 8-byte window holding the 4 bytes
    // of columns 4cq..4cq+3 of k-block kbl, and notes the shift and validity for its decode.
    if (s_item >= 0) {
      const uint32_t raw = base + Cfg::kWChunk + x_slot + s_item * 16;
      if (kb0 + s_kbl < kbEnd) {
        const int64_t idx = cell0 + s_goff;
        const int64_t w = idx & ~int64_t(3);
        if (cell0 + int64_t(KCH) * p.N + 16 * TN + 8 <= p.scale_bytes) {  // uniform fast path
          cp_async4_zfill(raw, p.scales + w, 4u);
          cp_async4_zfill(raw + 4, p.scales + w + 4, 4u);
        } else {  // near the end of the buffer: never touch a byte past it
          copy_scale_word(raw, w);
          copy_scale_word(raw + 4, w + 4);
        }
        sts32(raw + 8, uint32_t(idx & 3) * 8);
        sts32(raw + 12, 1u);
      } else {
        sts32(raw + 12, 0u);
      }
    }
  };

  // ---- decode this thread's scale item of a landed chunk into floats ----
  auto decode_scales = [&](int slot, int sfbuf) {
    if (s_item < 0) return;
    const uint32_t raw = s_ring + slot * slot_bytes + Cfg::kWChunk + x_slot + s_item * 16;
    const uint4 r = lds128(raw);
    if (!r.w) return;
    const uint32_t v = __funnelshift_r(r.x, r.y, r.z);
    const int cq = s_cq;
    const uint32_t dst = s_sf + sfbuf * Cfg::kSfChunk + s_kbl * SFB;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = 4 * (cq & 3) + i;  // column within the tile = its mma row
      const uint32_t byte19 = i < 3 ? (v << (19 - 8 * i)) & 0x07f80000u : (v >> 5) & 0x07f80000u;
      sts32f(dst + (((rr & 7) * TN + (cq >> 2)) * 2 + (rr >> 3)) * 4, decode_e4m4_fast(byte19));
    }
  };

  // ---- per-thread constants of the compute path ----
  const typename WP::Lane L = WP::lane_consts(lane);
  const uint32_t o0 = WP::offset0(g, t), o1 = WP::offset1(g, t);
  const uint32_t sf_lane_off = uint32_t(g) * (2 * TN * 4);

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

  auto compute = [&](const Cursor& cur, int slot, int sfbuf) {
    const uint32_t base = s_ring + slot * slot_bytes;
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      const int kbl = warp * KPW + u;
      if (kbA + cur.c * KCH + kbl >= kbEnd) return;  // warp-uniform
      const uint32_t slab = base + kbl * SLAB;
      uint32_t xb[MT][4];
      const uint32_t x_kb = base + Cfg::kWChunk + kbl * 64;  // rows XRB apart
      load_x_fragments<MT>(xb, cur.rows, lane, [&](int row, int s) { return x_kb + row * XRB + s * 16; });
      float sc[2 * TN];
      load_scales<TN>(sc, s_sf + sfbuf * Cfg::kSfChunk + kbl * SFB + sf_lane_off);
      typename WP::Raw raw[TN];
      load_codes<WP, TN>(raw, slab, o0, o1);
      mma_k_block<WP, Act, MT, TN>(acc, raw, s_lut, L, xb, sc);
    }
  };

  // ---- end of an item: reduce the warps' partial sums (tree, fixed order), then the
  // cluster's (rank 0 adds the ranks' partials in rank order), scale, round, store. The CTA
  // meets at a barrier every chunk anyway, so the tree's barriers cost little here; the
  // warp-specialized kernel, whose warps drift, uses item_reduce.cuh instead ----
  auto epilogue = [&](const Cursor& cur) {
#pragma unroll
    for (int half = NW / 2; half >= 1; half >>= 1) {
      if (warp >= half && warp < 2 * half)
#pragma unroll
        for (int e = 0; e < NACC; ++e) sts32f(s_red + (((warp - half) * NACC + e) * 32 + lane) * 4, acc[e]);
      __syncthreads();
      if (warp < half)
#pragma unroll
        for (int e = 0; e < NACC; ++e) acc[e] += lds32f(s_red + ((warp * NACC + e) * 32 + lane) * 4);
      __syncthreads();
    }
    auto store = [&](const float (&v)[NACC]) { store_item<MT, T>(p, cur, g, t, v, p.tensor_scale[cur.b]); };
    if (KS == 1) {
      if (warp == 0) store(acc);
    } else {
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      if (warp == 0)
#pragma unroll
        for (int e = 0; e < NACC; ++e) sts32f(s_part + (e * 32 + lane) * 4, acc[e]);
      cluster.sync();  // every rank's partial is in its shared memory
      if (rank == 0 && warp == 0) {
        float v[NACC];
#pragma unroll
        for (int e = 0; e < NACC; ++e) v[e] = 0.f;
        for (int r = 0; r < KS; ++r) {
          const float* rp = cluster.map_shared_rank(part_ptr, r);
#pragma unroll
          for (int e = 0; e < NACC; ++e) v[e] += rp[e * 32 + lane];
        }
        store(v);
      }
      cluster.sync();  // partials may be overwritten only after rank 0 has read them
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
  };

  // ---- prologue: copies of the first D-1 chunks, the table while they fly ----
  Cursor ic = walk.first();  // next chunk to issue
#pragma unroll
  for (int s = 0; s < D - 1; ++s) {
    if (s < Q) { issue(ic, s); walk.advance(ic); }
    cp_async_commit();
  }
  // The table holds one batch entry's codebook; a CTA whose items span batch entries rebuilds
  // it where b changes (at an item boundary, see the main loop).
  auto build_lut = [&](int b) { build_table<WP, Act>(s_lut, p.codebook + int64_t(b) * (1 << BITS), tid, NT); };
  Cursor cc = walk.first();  // chunk being computed
  int lut_b = -1;
  if (Q > 0) {
    build_lut(cc.b);
    lut_b = cc.b;
  }
  cp_async_wait<D - 2>();
  if (Q > 0) decode_scales(0, 0);
  __syncthreads();

  // ---- main loop over this CTA's chunks ----
  for (int q = 0; q < Q; ++q) {
    if (q + D - 1 < Q) { issue(ic, (q + D - 1) % D); walk.advance(ic); }
    cp_async_commit();
    compute(cc, q % D, q & 1);
    const bool last = cc.c == nch - 1;
    if (last) epilogue(cc);
    walk.advance(cc);
    cp_async_wait<D - 2>();
    if (q + 1 < Q) {
      decode_scales((q + 1) % D, (q + 1) & 1);
      if (last && cc.b != lut_b) {  // next item belongs to another batch entry: new codebook
        __syncthreads();            // (every warp finished reading the old table)
        build_lut(cc.b);
        lut_b = cc.b;
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
}

}  // namespace kbit::cuda::fused
