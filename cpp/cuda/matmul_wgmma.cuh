// The fused kbit matmul on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), for
// bf16 and fp16 activations at larger M (where the mma.sync kernels of matmul_fused.cuh decode
// each weight once per 16-64 rows and run out of tensor-core rate):
//     y[b, m, n] = tensor_scale[b] * sum_kb scale[kb, n] * sum_{k in kb} x[b, m, k] * codebook[code]
//
// ---- Why it looks like this ----
//  * Swapped operands, as in matmul_fused.cuh: D^T[n, m] = W^T[n, k] X^T[k, m]. The decoded
//    weights are wgmma's A operand, taken from registers: the per-warp register fragment of a
//    64 x 16 A tile is exactly the mma.m16n8k16 A fragment of rows 16 w .. 16 w + 15, so
//    weight_path.cuh's decode (table lookups) feeds it unchanged, and the decoded weights never
//    go through shared memory. x is the B operand (wgmma's N = BM rows of x, 64 or 128), read
//    by the tensor cores from shared memory.
//  * The E4M4 block scale multiplies the decoded weights (exact in bf16; each weight rounded
//    once to bf16, as in the N-split tiling; fp16 takes the scale times a power of two that keeps
//    the products in range, f16_weight_exponent), so the wgmma accumulates straight into the f32
//    sums: no per-k-block work on the BM / 2 accumulators per thread.
//  * Work per CTA: BN weight columns (two warpgroups x J 64-column A tiles) x BM rows of x.
//    The weights (bits / 8 bytes per element) are the cheap operand, so the tile is wide in N
//    where the accumulators allow: BM = 64 and 128 take J = 2 (BN = 256; per k the CTA reads
//    256 bits/8 bytes of weights and 2 BM bytes of x from L2 for 512 BM flops), or J = 1 where
//    that gives a small layer enough tiles to fill the GPU with shorter k-splits (the launcher's
//    cost model, WgLauncher::cost). BM = 256 (M > 128, where that model prefers it to BM = 128,
//    e.g. not at M = 384 on small layers) takes J = 1 (BN = 128): the same 128 accumulators per
//    thread, and each decoded weight feeds 256 rows instead of 128, so the decode per flop halves
//    (it costs ~30 % of the BM = 128 kernel's time); x's L2 traffic per flop doubles, which costs
//    nothing measurable at BM = 128. Bits 5's 128 KiB table left
//    room for two 38 KiB stages only (1.13-2.44x the time of BM = 128), so at BM = 256 bits 5
//    decodes from a 64 KiB table of 16 lane copies (WgWeightPath) and keeps four stages:
//    0.84-0.91x the time of BM = 128 in 48 of 52 cases at M >= 512.
//  * Copies: a kStages-deep ring of chunks (KCH = 2 k-blocks), each slot with a "full" and an
//    "empty" mbarrier; warp 0 issues every copy of a chunk from one lane: x by one TMA tensor
//    copy, as wgmma's K-major operand with the 128-byte swizzle (each row of x holds the
//    chunk's 64 k in 128 bytes, its 16-byte pieces XORed with the row index mod 8, 8-row atoms
//    1024 bytes apart), and the chunk's weight cells and scale bytes by one TMA tensor copy each
//    (see the launcher's maps). The tensor cores read x through the async proxy, which TMA
//    writes: cp.async writes would need a fence.proxy.async in each writing thread, which
//    compiles to MEMBAR.ALL.CTA and empties the ring every chunk. Weights by per-thread cp.async
//    would be a fifth of the compute warps' instructions.
//  * Two A register sets, even and odd k-blocks: each k-block's decode runs while the previous
//    k-block's products are on the tensor cores (see the main loop).
//  * K is split across the CTAs of a thread-block cluster (ks ranks, each a k-range) where the
//    output tiles alone would leave SMs idle; the ranks' f32 tiles are added through distributed
//    shared memory in the epilogue: each rank owns every ks-th row, the other ranks push their
//    partial sums of it into its shared memory, and it adds and stores them (no workspace).
//    Where the tiles take more than one round of CTAs and the last round fills half the GPU or
//    less, only that round splits, over 2-CTA clusters, after whole rounds in which each rank of a
//    2-CTA cluster computes a tile of its own (WgParams::whole_ctas, WgLauncher::plan).
//  * The epilogue stages the f32 tile in shared memory ([m][n], rows padded by 4 floats: the
//    accumulator stores are conflict-free), then each thread writes 8 consecutive outputs (16
//    bytes): coalesced rows of y. A GLU gates there, on the f32 sums (glu.h, accurate form).
//
// ---- What limits it (H200, bits 4) ----
//  M = 128: the tensor cores are busy ~57 % of the time on the active SMs: a k-block's decode
//  (~100 instructions per warp, bound by dependent latencies) takes longer than the products it
//  runs under (without the decode: 0.70x the time), which the paired 64- and 128-row tiles
//  (WgConfig::kGroups) answer with more warps per scheduler. At M = 512 it runs at ~94 % of the
//  tensor cores' rate, as the dense dot. Small layers at M <= 64 are set by the cluster sum:
//  pushed or pulled, a rank receives its rows at the rate of distributed shared memory with
//  every SM moving its tile at once (~23 GB/s per SM), which the 64-column tile (WG = 1) and
//  smaller clusters shorten.
//
// ---- Limits ----
//  bf16 or fp16 activations, the fragment layout, N % 16 == 0 (16-byte rows of weights and scale
//  bytes), compiled for sm_90a only (elsewhere matmul.cu never picks it).
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/fast_div.cuh"
#include "cuda/item_reduce.cuh"  // mbar_init, mbar_wait
#include "cuda/plan_terms.h"
#include "cuda/ragged_tiles.cuh"
#include "cuda/tma.cuh"
#include "cuda/weight_path.cuh"
#include "cuda/wgmma.cuh"
#include "glu.h"

namespace kbit::cuda::wgmma {

constexpr int kMaxSmemBytes = 227 * 1024;  // H100/H200 per-block limit (opt-in)
constexpr int kSmSmemBytes = 228 * 1024;   // ... and per SM, for all its CTAs

// The decode path: bits 5 at BM = 256 takes the 64 KiB table of 16 lane copies (two wavefronts
// per lookup) to leave room for four stages; the decode per flop is half that of BM = 128. The
// paired 128 x 128 tile (WgConfig::kGroups) takes it too: with the 128 KiB table its 2 x 3 stages
// do not fit; so does the 64-column tile (WG = 1), for its 4 x 3 stages.
template <int BITS, int BM, int J, int WG>
using WgWeightPath = std::conditional_t<BITS == 5 && (BM == 256 || (BM == 128 && J == 1) || WG == 1),
                                        fused::WeightPathBits5<16>, fused::WeightPath<BITS>>;

// J: m64 A tiles per warpgroup (see the header); BM = 256 takes only J = 1 (its accumulators).
// WG: warpgroups side by side across the tile's columns, 2 (128 J columns) or 1 (64 columns, at
// BM = 64 only: see kGroups).
template <int BITS, int BM, int J, int WG = 2>
struct WgConfig {
  static_assert(J == 1 || (J == 2 && BM <= 128), "accumulators: BM / 2 x J floats per thread, at most 128");
  static_assert(WG == 2 || (WG == 1 && J == 1 && BM == 64), "the 64-column tile: one m64 tile per warpgroup, 64 rows");
  // Groups of WG warpgroups (P groups; two pairs at J = 1 and BM <= 128, four single warpgroups
  // at WG = 1): each group computes the whole tile's columns over every P-th chunk of the rank's
  // k-range; the epilogue adds the groups' tiles. At BM = 64, J = 1 a chunk's
  // decode (~100 instructions per warp and k-block) outlasts its products 3-4x, with two warps
  // per scheduler to hide its latencies: 0.41 us per chunk on Qwen3 down at M = 32 and 64 alike
  // (H200). With two pairs (four warps per scheduler) the main loop takes 0.68x the time there,
  // and the products 0.81-0.90x (geometric means) on Llama-3-70B's down, o and TP-4 q/k/v layers
  // at M = 17..64. The 128-row tile gains less (each decoded weight feeds twice the rows): 0.90x
  // its time at M = 128; above 128 rows the launcher picks it for about half the products.
  // 512 threads cap the registers at 128: the 32 (BM = 64) and 64
  // (BM = 128) accumulators per thread of the 128-column tile leave room (ptxas: 114, no
  // spills); the 128 of 128 x 256 and 256 x 128 do not, nor 64 x 256 (177 registers). Bits 5 at
  // BM = 128 takes the 64 KiB table (WgWeightPath) for its 3 stages per pair: 0.94-0.95x the
  // time of one pair with the 128 KiB table and 4 stages at M = 96..128 (H100).
  // The 64-column tile (WG = 1) is for small layers at M <= 64 (N = 2048: 16 tiles of 128
  // columns, which the launcher splits over 6-CTA clusters to fill the GPU, and whose cluster sum
  // takes 2.6-3.4 us of a 8-9 us launch, H100): twice
  // the tiles over 4-CTA clusters send 3/4 of a 16 KiB tile to the other ranks instead of 5/6 of
  // 32 KiB, and each rank decodes 3/4 of the weights. Its four warpgroups decode 16 columns a
  // warp each, as the pairs do, but read x once per 64 columns instead of per 128.
  static constexpr int kGroups = WG == 1 ? 4 : J == 1 && (BM == 64 || BM == 128) ? 2 : 1;
  // per group, WG warpgroups: decode and products (the group's warp 0 copies too)
  static constexpr int kGroupThreads = 128 * WG;
  static constexpr int kThreads = kGroupThreads * kGroups;
  static constexpr int kTiles = J;
  static constexpr int kBN = 64 * WG * kTiles;      // weight columns per CTA: WG warpgroups x J tiles
  static constexpr int kKCH = 2;        // k-blocks (32 k each) per ring stage
  static constexpr int kXRowBytes = kKCH * 64;            // a row of x in a stage: 64 k (128 bytes)
  static constexpr int kXBytes = BM * kXRowBytes;          // [row][64 k], swizzled
  static constexpr int kWRowBytes = kBN * BITS * 4;        // one k-block of the CTA's cells
  static constexpr int kWBytes = kKCH * kWRowBytes;
  static constexpr int kSBytes = kKCH * kBN;               // E4M4 scale bytes
  // (stages stay 1024-byte aligned: the 128-byte swizzle repeats every 8 rows of x)
  static constexpr int kStageBytes = (kXBytes + kWBytes + kSBytes + 1023) / 1024 * 1024;
  using Path = WgWeightPath<BITS, BM, J, WG>;
  static constexpr int kLutBytes = Path::kLutBytes;
  static constexpr int kTileStride = kBN + 4;              // floats per row of the epilogue tile
  static constexpr int kTileBytes = BM * kTileStride * 4;  // a group's tile
  static constexpr int kStagedBytes = kGroups * kTileBytes;  // every group's, over table and ring at the end
  // Up to S - 2 chunks in flight beyond the one being computed (a slot is refilled once the
  // products of the chunk before are done): 6 stages where they fit (bits 2-4 at BM <= 128, bits
  // 3 at 256), else 4 or 3 (bits 5's 128 KiB table at 128 x 256; bits 2, 4 and 5 at BM = 256);
  // 0: this BM does not fit. With groups, each group has S / P stages of its own, at least 3:
  // pairs 10 (5 per pair) where they fit (bits 2-4), else 6 (bits 5); four groups 16 (bits 3) or 12.
  // (+ 16 bytes of barriers per stage and the cluster sum's receive barrier)
  static constexpr int fits(int s) { return kLutBytes + s * kStageBytes + 1024 + 16 * s + 8 <= kMaxSmemBytes; }
  static constexpr int pick_stages() {
    if (kGroups == 4) return fits(16) ? 16 : fits(12) ? 12 : 0;
    if (kGroups == 2) return fits(10) ? 10 : fits(8) ? 8 : fits(6) ? 6 : 0;
    return fits(6) ? 6 : fits(4) ? 4 : fits(3) ? 3 : 0;
  }
  static constexpr int kStages = pick_stages();
  static constexpr int kGroupStages = kStages / kGroups;
  static constexpr int kBarOffset = std::max(kLutBytes + kStages * kStageBytes + 1024, kStagedBytes);
  // One CTA per SM: the launcher's plan (cluster sizes, waves) counts SMs, and two CTAs on one SM
  // share its decode and tensor-core rate while other SMs idle. Bits 3's 8 KiB table leaves BM =
  // 64 at ~99 KiB (and 104-125 registers per thread), so two fit an SM's 228 KiB; the
  // reservation is padded past half of it. (Two CTAs per SM: at M = 64 bits 3 took 1.1-1.4x the
  // time of bits 2 and 4 on the Llama layers, e.g. Llama-3-70B down 161 against 114-117 us.)
  static constexpr int kOneCtaPerSmBytes = 116 * 1024;
  // + a "full" and an "empty" mbarrier per stage, and the receive barrier of the cluster sum at the
  // very end (past everything the main loop uses, so it can be initialized at the start)
  static constexpr int kSmemBytes = std::max(kBarOffset + 16 * kStages + 8, kOneCtaPerSmBytes);
  static constexpr int kRecvBarOffset = kSmemBytes - 8;
  static_assert(kStages == 0 || kSmemBytes <= kMaxSmemBytes, "shared memory budget");
  // The k-split cluster sum by push (see the epilogue): rank q's rows of the other ks - 1 ranks'
  // tiles land in its receive slots, [ks - 1][ceil(BM / ks) rows][BN] floats after the tiles, over
  // the table and the ring, which are dead by then (not over the ring's mbarriers: their memory
  // would need an mbarrier.inval first). Where the slots do not fit, the sum pulls: BN = 256 at
  // BM = 128 (bits 2 and 3 always, 4 and 5 from 3 ranks), BM = 256 from 3 ranks (bits 3 from 4),
  // and BN = 256 at BM = 64, bits 3, from 3 ranks.
  static constexpr int recv_bytes(int ks) { return (ks - 1) * ((BM + ks - 1) / ks) * kBN * 4; }
  static constexpr int push_max_ranks() {
    int m = 1;
    for (int ks = 2; ks <= 8; ++ks)
      if (kStagedBytes + recv_bytes(ks) <= kBarOffset) m = ks;
    return m;
  }
  static constexpr int kPushMaxRanks = push_max_ranks();
  // (the kernel's choice, and the launcher's: cost, launch. Where every cluster size fits, the
  // test is ks > 1 alone, a compile-time bound: the kernel then compiles no pull, whose code would
  // take registers and instruction-cache lines)
  static constexpr bool pushes(int ks) { return ks > 1 && (kPushMaxRanks == fused::kMaxKSplit || ks <= kPushMaxRanks); }
  // The push's sends: one 16-byte piece of a row per thread, kPushRowsPerStep rows at a time
  // (the launcher divides this step by the cluster size: WgParams::push_step_q)
  static constexpr int kPushPieces = kBN / 4, kPushRowsPerStep = kThreads / kPushPieces;
  // (a pull would read every group's tile from the other ranks: groups always push)
  static_assert(kGroups == 1 || kPushMaxRanks == 8, "groups' tiles and the receive slots fit every cluster size");
  static_assert(2 * (kSmemBytes + 1024) > kSmSmemBytes, "one CTA per SM (1 KiB reserved per CTA)");
  static_assert(kStageBytes % 16 == 0 && kLutBytes % 16 == 0, "16-byte copies");
};

struct WgParams {
  const void* x;  // [B, M, K] bf16 or fp16
  const uint32_t* planes;
  const uint8_t* scales;
  const float* codebook;
  const float* tensor_scale;
  void* y;  // [B, M, N] in x's dtype, or [B, M, N / 2] with glu
  int64_t M;
  int N, K, KB;
  int ks, kps;             // cluster size along K, k-blocks per rank
  int whole_ctas;          // the first whole_ctas CTAs (whole clusters) each compute a tile of their own over
                           // all of K; the rest split the remaining tiles' K over their cluster's ks ranks
  int n_tiles, m_tiles;    // output tiles: (b, nt, mt), mt fastest (neighbours share weights in L2)
  int tail_rows;           // the rows of each batch entry's last row tile (M - (m_tiles - 1) BM)
  int glu;
  // The kernel's divisions by launch constants (fast_div.cuh): ~20 instructions around a MUFU.RCP
  // each otherwise, on the way to a CTA's first copies and, in the cluster sum, to its first send
  // (with divisions, 0.55 us passed from the tiles staged to thread 0's first send, H200).
  FastDiv ks_div, m_tiles_div, n_tiles_div;  // by ks, m_tiles, n_tiles
  int slot_rows;           // ceil(BM / ks): the rows of a receive slot (the most any rank owns)
  int push_step_q, push_step_r;  // the push's row step (kThreads / (BN / 4) rows) / ks and % ks
};

__device__ __forceinline__ uint32_t lds_u8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// The cluster sum's 16-byte pieces: s += a, and piece e4 of an item's sums, scaled, into v.
__device__ __forceinline__ void add_piece(float4& s, const float4& a) {
  s.x += a.x; s.y += a.y; s.z += a.z; s.w += a.w;
}
template <int E>
__device__ __forceinline__ void put_scaled(float (&v)[E], int e4, const float4& s, float ts) {
  v[4 * e4] = s.x * ts; v[4 * e4 + 1] = s.y * ts; v[4 * e4 + 2] = s.z * ts; v[4 * e4 + 3] = s.w * ts;
}

// The cluster sum's v[E] holds its 16-byte pieces in the order it loaded them (piece i has columns
// 4 (i ^ sw)..): swap them back into column order, by selects (an index by sw would put v in
// local memory).
template <int E>
__device__ __forceinline__ void unswizzle_pieces(float (&v)[E], int sw) {
#pragma unroll
  for (int bit = 1; bit < E / 4; bit *= 2)
#pragma unroll
    for (int i = 0; i < E; ++i)
      if ((i / 4) & bit) {
        const float lo = v[i - 4 * bit], hi = v[i];
        v[i - 4 * bit] = sw & bit ? hi : lo;
        v[i] = sw & bit ? lo : hi;
      }
}

// Keeps the compiler from moving accumulator reads or writes across a wgmma wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// fp16 activations: the E4M4 scale multiplies the decoded weights in fp16 (scale_fragments), so
// the products must stay inside fp16's range, for any codebook. The scale is taken times 2^e, e =
// 10 - (the frexp exponent of the codebook's largest |entry|), clamped to -10..11, and the
// epilogue multiplies the sums by 2^-e. Then every product is below 2^(10-e) x 31 x 2^e = 31744
// (no overflow), scale x 2^e is exact in fp16 (5 significant bits at 2^(e-14)..31 x 2^e, inside
// 2^-24..65504), and with a codebook in [-1, 1] (e = 9 or 10) a product is subnormal only where
// |entry| x scale < 2^-23: it is then rounded to a multiple of 2^-24 (absolute error <= 2^-34 in
// the weight's units, before the tensor scale), as a dense fp16 weight that small would be.
// `cb_abs`: this lane's |entry| (entry lane mod 2^BITS); every lane returns e.
__device__ __forceinline__ int f16_weight_exponent(float cb_abs) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) cb_abs = fmaxf(cb_abs, __shfl_xor_sync(0xffffffffu, cb_abs, o));
  const int frexp_exponent = int((__float_as_uint(cb_abs) >> 23) & 0xffu) - 126;  // (all zeros: e = 11)
  return min(11, max(-10, 10 - frexp_exponent));
}

// Grouped (kbit_ragged_dot: one WgGroups after the tensor maps; without it the kernel is the
// batched matmul's, the same code): expert b is batch entry b for its weights (k-block rows
// b KB + kb), codebook and tensor scale, but x and y are [M, K] and [M, N(/2)] for all experts.
// Each CTA computes one whole tile (no k-split cluster): CTA i finds its expert, row tile and
// column tile from group_sizes (ragged_tiles.cuh: expert g's ceil(R_g / BM) row tiles x n_tiles,
// numbered expert by expert, row tile fastest, so neighbouring CTAs share the expert's weights in
// L2); its box of x starts at the tile's absolute first row (rows of the next expert in it are
// computed and never stored, rows past M arrive as zeros), and it stores only its expert's rows.
// CTAs past the tile count, and then every other, write the rows at or past sum(group_sizes) as
// zeros. The launch is a plain one (stream-ordered), so group_sizes may be the previous kernel's.
struct WgGroups {
  const int32_t* group_sizes;  // [G], on the device
  int G;
};

template <int BITS, int BM, int J, int WG, class Act, class... Grouped>
__global__ void __launch_bounds__(WgConfig<BITS, BM, J, WG>::kThreads, 1)
    kbit_matmul_wgmma_kernel(const WgParams p, const __grid_constant__ CUtensorMap xmap,
                             const __grid_constant__ CUtensorMap xmap_tail, const __grid_constant__ CUtensorMap wmap,
                             const __grid_constant__ CUtensorMap smap, Grouped... grouped) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(sizeof...(Grouped) <= 1, "one WgGroups at most");
  constexpr bool kGrouped = sizeof...(Grouped) == 1;
  using Cfg = WgConfig<BITS, BM, J, WG>;
  using WP = typename Cfg::Path;
  constexpr bool kF16 = std::is_same_v<Act, ActF16>;
  using Mma = std::conditional_t<kF16, WgmmaF16<BM>, WgmmaBF16<BM>>;
  constexpr int S = Cfg::kStages, KCH = Cfg::kKCH, BN = Cfg::kBN, NACC = BM / 2;
  constexpr int P = Cfg::kGroups, SP = Cfg::kGroupStages, GW = 4 * WG;  // (GW: warps per group)
  static_assert(S >= 3 && SP >= 3, "a tile that fits shared memory");
  extern __shared__ __align__(128) uint8_t smem[];
  // (the warp index through a shuffle: ptxas then knows it is warp-uniform, and the branch on it
  // below is no divergent path around the wgmma pipeline)
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  // group: the warpgroup group (its chunks, see WgConfig::kGroups); wg: the warpgroup's 64 J columns
  const int group = P == 1 ? 0 : warp / GW, wg = WG == 1 ? 0 : P == 1 ? warp >> 2 : (warp >> 2) & 1;
  const int wq = warp & 3, g = lane >> 2, t = lane & 3;

  // (cluster-uniform: whole_ctas is a multiple of the cluster size)
  const bool whole = kGrouped || int(blockIdx.x) < p.whole_ctas;
  const int split = whole ? 0 : int(blockIdx.x) - p.whole_ctas;
  const int ks = whole ? 1 : p.ks;
  const FastDiv ks_div = whole ? FastDiv(1) : p.ks_div;
  const int split_cluster = ks_div.div(split), rank = ks_div.mod(split, split_cluster);
  const int tile = whole ? int(blockIdx.x) : p.whole_ctas + split_cluster;
  // (grouped) the CTA's expert, its rows and the tile (its shared memory is free until the table)
  [[maybe_unused]] ragged::GroupTile gt{};
  if constexpr (kGrouped) {
    const WgGroups gp{grouped...};
    gt = ragged::group_tile<BM>(gp.group_sizes, gp.G, p.M, p.n_tiles, int(blockIdx.x), smem);
    if (!gt.valid) {
      ragged::zero_rows(static_cast<typename Act::T*>(p.y), gt.total_rows, p.M, p.glu != kGluNone ? p.N / 2 : p.N,
                        tid, Cfg::kThreads);
      return;
    }
  }
  const int mn = kGrouped ? 0 : p.m_tiles_div.div(tile), b = kGrouped ? gt.g : p.n_tiles_div.div(mn);  // (tile = (b n_tiles + nt) m_tiles + mt)
  const int mt = kGrouped ? gt.mt : p.m_tiles_div.mod(tile, mn), nt = kGrouped ? gt.nt : p.n_tiles_div.mod(mn, b);
  const int n0 = nt * BN;
  const int64_t m0 = kGrouped ? int64_t(gt.row_start) + int64_t(mt) * BM : int64_t(mt) * BM;
  const int rows = kGrouped ? min(BM, gt.row_end - int(m0)) : int(min(int64_t(BM), p.M - m0));
  const int kbA = rank * p.kps, kbE = whole ? p.KB : min(p.KB, kbA + p.kps);
  const int nch = kbE > kbA ? (kbE - kbA + KCH - 1) / KCH : 0;
  const bool copier = P == 1 ? warp == 0 : warp % GW == 0;  // the group's warp 0: it copies the group's chunks

  const uint32_t s_lut = smem_u32(smem), s_full = s_lut + Cfg::kBarOffset, s_empty = s_full + 8 * S;
  const uint32_t s_ring = (s_lut + Cfg::kLutBytes + 1023u) & ~1023u;  // 1024-byte aligned stages
  // (each group's copying lane initializes its group's barriers: it copies onto them before the
  // CTA's first barrier)
  if (P == 1 ? tid == 0 : tid % Cfg::kGroupThreads == 0) {
    for (int s = group * SP; s < (group + 1) * SP; ++s) {
      fused::mbar_init(s_full + 8 * s, 1);                    // the copying lane's arrival + the bytes
      fused::mbar_init(s_empty + 8 * s, Cfg::kGroupThreads);  // every thread of the group, done with the slot
    }
    // the cluster sum's receive barrier (used where it pushes): this CTA's arrival + the bytes
    if (tid == 0) fused::mbar_init(s_lut + Cfg::kRecvBarOffset, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
  }
  // Group pr's chunk c (the rank's chunk P c + pr): its ring slot (one of the group's SP), its
  // barriers, the parity of its use of them (the slot's (c / SP)-th), its first k-block; and the
  // group's number of chunks. The code that runs them takes pr from an unrolled loop over the
  // groups, i.e. as a constant: `group` (from the warp index) took the addresses off the uniform
  // datapath, the bits-4 main loop 201 -> 237 instructions per chunk (tools/sass_loops.py); a
  // generic lambda per pair changed the main loop of P = 1 too (+2..9).
  auto slot = [&](auto pr, int c) { return s_ring + uint32_t(pr * SP + c % SP) * Cfg::kStageBytes; };
  auto full_bar = [&](auto pr, int c) { return s_full + 8u * uint32_t(pr * SP + c % SP); };
  auto empty_bar = [&](auto pr, int c) { return s_empty + 8u * uint32_t(pr * SP + c % SP); };
  auto parity = [&](int c) { return uint32_t(c / SP) & 1u; };
  auto kblock0 = [&](auto pr, int c) { return kbA + (P * c + pr) * KCH; };
  auto chunks_of = [&](auto pr) { return P == 1 ? nch : nch > pr ? (nch - pr + P - 1) / P : 0; };

  // ---- copies of the group's chunk c (k-blocks kblock0(c) ..) into its ring slot, issued by lane 0
  // of the group's warp 0 (the whole warp runs this, see the main loop), completing on the slot's
  // "full" barrier: one TMA tensor copy each for x (k past K arrives as zeros; a partial row tile
  // brings only its rows, through xmap_tail, over zeros written once below), the chunk's two
  // k-block rows of the CTA's weight cells and of its scale bytes (columns past N and rows past
  // B * KB arrive as zeros; a rank's last chunk may bring a k-block it skips). Their operands are
  // uniform (tensor maps, chunk coordinates): bulk copies of computed addresses cost warp 0 ~240
  // instructions per chunk.
  const int w_row0 = b * p.KB;  // the weight's first k-block row of batch entry b
  const bool tail = !kGrouped && mt == p.m_tiles - 1 && p.tail_rows < BM;
  const CUtensorMap* x_map = tail ? &xmap_tail : &xmap;
  const uint32_t x_bytes = tail ? uint32_t(p.tail_rows * Cfg::kXRowBytes) : uint32_t(Cfg::kXBytes);
  const int lane_pinned = pinned_to_lane(lane, lane);  // (see the decode's constants below)
  auto issue = [&](auto pr, int c) {
    const uint32_t st = slot(pr, c), full = full_bar(pr, c);
    const int kb0 = kblock0(pr, c);
    const bool me = lane_pinned == 0;
    mbar_arrive_expect_tx_if(me, full, x_bytes + Cfg::kWBytes + Cfg::kSBytes);
    tma_load_2d_if(me, st, x_map, 32 * kb0, int(kGrouped ? m0 : int64_t(b) * p.M + m0), full);
    tma_load_3d_if(me, st + Cfg::kXBytes, &wmap, 0, n0 / 16, w_row0 + kb0, full);
    tma_load_2d_if(me, st + Cfg::kXBytes + Cfg::kWBytes, &smap, n0, w_row0 + kb0, full);
  };
  // Warp 0 issues the first S - 1 chunks' copies while warps 1-7 build the table, so that
  // DRAM's latency runs under the build (thread 0 initialized the barriers the copies complete
  // on; the other threads wait on them only after the __syncthreads below; the table and the ring
  // do not overlap). Issued after the whole CTA had built the table, they went out 1.5 us (bits 4)
  // to 2.3 us (bits 5, a 128 KiB table) after entry, and the first chunk arrived at 1.9-3.0 us
  // (Llama-3-8B down at M = 128).
  // With groups, each group's warp 0 (which builds no part of the table) issues its first kEarly
  // chunks here and the rest of its first SP - 1 after the barrier: with all eight here, the
  // first chunk arrived 0.3 us later than the five of one warpgroup pair (Qwen3 down at M = 32),
  // and with one warp issuing all eight the barrier waited 0.4 us more. (The
  // group is a constant here too, by branch rather than by the unrolled loop below: that form of
  // this loop took 9 instructions more in the 256-column tile's main loop.)
  constexpr int kEarly = P == 1 ? SP - 1 : 2;
  // f(constant group): by branch (above)
  auto as_group = [&](auto f) {
    if (P == 1 || group == 0) f(0);
    else if (P == 2 || group == 1) f(1);
    else if (group == 2) f(2);
    else f(3);
  };
  // fp16: this lane's codebook entry for f16_weight_exponent, loaded now, reduced after the barrier
  float cb_abs = 0.f;
  if constexpr (kF16) cb_abs = fabsf(__ldg(p.codebook + int64_t(b) * (1 << BITS) + (lane & ((1 << BITS) - 1))));
  if (copier) {
    as_group([&](int pr) {
      for (int c = 0; c < min(kEarly, chunks_of(pr)); ++c) issue(pr, c);
    });
  } else {
    const int worker = tid - 32 * (group + 1), workers = Cfg::kThreads - 32 * P;  // (every warp but the copiers)
    fused::build_table<WP, Act, true>(s_lut, p.codebook + int64_t(b) * (1 << BITS), worker, workers);
    if (tail) {
      // A partial tile's rows of x past its own, which xmap_tail's copies never write: zeros in
      // every stage, as TMA's fill brought them before. Their products are never stored, but
      // stale data there costs the tensor cores power: Llama-3-70B gate/up (128 x 256 tiles) took
      // 1.07-1.10x the time at M = 72..96 and 300, bits 4-5, against the zero fill (H100). A fence makes the zeros visible to the async proxy that wgmma reads through.
      const int pieces = (BM - p.tail_rows) * (Cfg::kXRowBytes / 16);  // 16-byte pieces per stage
      const uint32_t first = s_ring + uint32_t(p.tail_rows * Cfg::kXRowBytes);
      for (int i = worker; i < S * pieces; i += workers) {
        const int stage = i / pieces;
        sts128(first + uint32_t(stage) * Cfg::kStageBytes + 16u * uint32_t(i - stage * pieces), 0u, 0u, 0u, 0u);
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
  }
  __syncthreads();  // every thread sees the initialized barriers, and the whole table
  // The E4M4 decode's factor: decode_e4m4_fast's 2^116, times 2^e with fp16 (f16_weight_exponent;
  // e = 0 with bf16), whose inverse the epilogue applies
  int f16_exp = 0;
  if constexpr (kF16) f16_exp = f16_weight_exponent(cb_abs);
  const float scale_decode = __uint_as_float(uint32_t(127 + 116 + f16_exp) << 23);  // 2^(116 + e)

  float acc[J][NACC];  // [m64 tile j][wgmma accumulator]
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[j][i] = 0.f;
  // The lane's constants of the decode, each through an identity shuffle (pinned_to_lane): ptxas
  // cannot recompute them from the thread index, as it did inside the main loop, an S2R and 39-65
  // more instructions per chunk at every bits value and tile (13-24 % of the loop; nvcc 13.0,
  // tools/sass_loops.py): 0.95x the time at M = 33..128, 0.94x at 192..1024 (H200).
  const typename WP::Lane L = pinned_to_lane(WP::lane_consts(lane), lane);
  const uint32_t o0 = pinned_to_lane(WP::offset0(g, t), lane), o1 = pinned_to_lane(WP::offset1(g, t), lane);
  const uint32_t g_pinned = pinned_to_lane(uint32_t(g), lane);
  // The decode of k-block kbl of the chunk in slot `st` into one A register set: per warp, its
  // 16 columns of each of its J m64 tiles, scaled by their E4M4 block scales.
  auto decode = [&](uint32_t (&a)[J][2][4], uint32_t st, int kbl) {
    const uint32_t slab = st + Cfg::kXBytes + kbl * Cfg::kWRowBytes;
    const uint32_t sc = st + Cfg::kXBytes + Cfg::kWBytes + kbl * BN;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int tile16 = 4 * J * wg + 4 * j + wq;  // the warp's 16 columns: rows 16 wq.. of tile j
      typename WP::Raw raw;
      WP::load(raw, slab, o0, o1, tile16);
      fused::decode_for_scaling<WP>(raw, s_lut, L, a[j]);
      const float s_lo = __uint_as_float(lds_u8(sc + 16 * tile16 + g_pinned) << 19) * scale_decode;
      const float s_hi = __uint_as_float(lds_u8(sc + 16 * tile16 + g_pinned + 8) << 19) * scale_decode;
      fused::scale_fragments<Act>(a[j], s_lo, s_hi);
    }
  };
  // That k-block's products: 2 k16 slices x J m64 tiles, committed as one group.
  auto multiply = [&](const uint32_t (&a)[J][2][4], uint32_t st, int kbl) {
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // the k16 slice at byte 64 kbl + 32 h of every 128-byte row (SWIZZLE_128B, see header)
      const uint64_t desc = make_smem_desc_sw128(st + 64 * kbl + 32 * h);
#pragma unroll
      for (int j = 0; j < J; ++j) Mma::mma(acc[j], a[j][h], desc);
    }
  };

  // Software pipeline over k-blocks, two A register sets (even and odd k-blocks of a chunk):
  // each k-block's decode runs while the previous k-block's group is on the tensor cores.
  // wgmma_wait<1> before a decode finishes only the group that last read that register set
  // (rewriting registers of a group in flight would make ptxas serialize every wgmma, C7513).
  // (Three sets with wgmma_wait<2>, two groups queued during a decode, are no faster, and ptxas
  // gives two of the sets the same physical registers: the forced-wgmma test fails.)
  // Ring: every thread of the group arrives on its chunk c - 1's "empty" barrier once that chunk's
  // wgmma groups are done (early in chunk c); the group's warp 0 waits there, then copies the
  // group's chunk c + SP - 1 into that slot. No CTA-wide barrier in the loop: the groups run on
  // their own.
  // (Warp 0 runs the copies whole, lane 0's instructions predicated: under a branch on the
  // thread, ptxas serialized every wgmma, C7520; in a warp of their own, 288 threads, it capped
  // the registers at 168 and spilled.)
  static_assert(KCH == 2, "the pipeline alternates two register sets per chunk");
#pragma unroll
  for (int pr = 0; pr < P; ++pr) {  // (the thread's group as a constant, see slot)
    if (pr != group) continue;
    const int nch_group = chunks_of(pr);
    if (copier)
      for (int c = kEarly; c < min(SP - 1, nch_group); ++c) issue(pr, c);  // (P = 1: none)
    uint32_t a_even[J][2][4], a_odd[J][2][4];
    if (nch_group > 0) {
      fused::mbar_wait(full_bar(pr, 0), parity(0));
      decode(a_even, slot(pr, 0), 0);
    }
    for (int c = 0; c < nch_group; ++c) {
      const uint32_t st = slot(pr, c);
      multiply(a_even, st, 0);
      wgmma_commit();   // group 2c
      wgmma_wait<1>();  // group 2c - 1 (a_odd, chunk c - 1) is done
      if (c > 0) fused::mbar_arrive(empty_bar(pr, c - 1));
      if (kblock0(pr, c) + 1 < kbE) {  // group-uniform
        decode(a_odd, st, 1);
        multiply(a_odd, st, 1);
      }
      wgmma_commit();  // group 2c + 1 (empty past K)
      if (copier && c + SP - 1 < nch_group) {  // refill chunk c - 1's slot (at c = 0: the unused one)
        if (c > 0) fused::mbar_wait(empty_bar(pr, c - 1), parity(c - 1));
        issue(pr, c + SP - 1);
      }
      if (c + 1 < nch_group) {
        fused::mbar_wait(full_bar(pr, c + 1), parity(c + 1));
        wgmma_wait<1>();  // group 2c (a_even) is done
        decode(a_even, slot(pr, c + 1), 0);
      }
    }
    // (inside each group's copy of the loop: the copies' accumulators may sit in different
    // registers, and moves at their join before this wait serialized every wgmma, C7515)
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < J; ++j) fence_operands(acc[j]);
  }
  __syncthreads();  // every warp is done with the table and the ring (and every copy has landed): the
                    // tile overlays them

  // ---- epilogue: this rank's f32 sums into shared memory ([m][n], padded rows), one tile per
  // group; whatever reads a row of this rank's sums adds the groups' tiles (own_piece), so the
  // groups store at once, without a pass that adds one tile into another. At J = 1 only the
  // tile's rows of x (nothing reads the others; at BM = 128 the three passes over the whole tile
  // are ~1,500 shared-memory wavefronts, ~0.8 us); at J = 2 that test made ptxas reorder the main
  // loop, and Llama-3-70B gate/up took 1.03-1.05x the time (H100). ----
  float* tile_f = reinterpret_cast<float*>(smem);
  constexpr int kTileFloats = Cfg::kTileBytes / 4;
  {
    float* mine = tile_f + group * kTileFloats;
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int i = 0; i < NACC; ++i) {
        if (J == 1 && 8 * (i >> 2) >= rows) continue;  // (the accumulator's 8-row group: a constant)
        const int m = 8 * (i >> 2) + 2 * t + (i & 1);
        const int n = 64 * J * wg + 64 * j + 16 * wq + g + 8 * ((i >> 1) & 1);
        mine[m * Cfg::kTileStride + n] = acc[j][i];
      }
  }
  // The 4 sums at float offset `at` of the tile: every group's, added in group order
  auto own_piece = [&](int at) {
    float4 v = *reinterpret_cast<const float4*>(tile_f + at);
#pragma unroll
    for (int q = 1; q < P; ++q) {
      // (through u: the load passed straight to add_piece changed ptxas's schedule of the
      // 64-column tile, 80 instructions fewer, untimed)
      const float4 u = *reinterpret_cast<const float4*>(tile_f + q * kTileFloats + at);
      add_piece(v, u);
    }
    return v;
  };
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const bool push = Cfg::pushes(ks);  // (cluster-uniform)
  // A pull reads the other ranks' tiles: their stores must be released to it (cluster.sync's
  // arrive compiles to MEMBAR.GPU). A push only needs every rank past its main loop before
  // another writes into its receive slots, which overlay the table and the ring: their reads
  // are complete (consumed by the finished wgmma groups), so the arrive is relaxed, after a
  // CTA barrier for this CTA's own reads of the staged tile.
  if (ks > 1 && !push) {
    cluster.sync();
  } else {
    __syncthreads();
    if (ks > 1) fused::cluster_barrier_relaxed();
  }

  // ---- rank q owns every ks-th row from q: it sums it over the ranks (in rank order: the same
  // sums on every run), scales, rounds and stores it. Push (ks <= kPushMaxRanks): every rank sends
  // the rows it does not own to their owners' receive slots (st.async, 16 bytes each, completing
  // on the owner's receive barrier as transaction bytes), then waits for its own rows and adds
  // them from its own shared memory. No load crosses the cluster, so no rank waits on a remote
  // round trip, and no barrier is needed at exit: a rank leaves once its own rows have landed.
  // Pull (otherwise): each rank reads its rows from every rank's tile, then a cluster barrier
  // keeps every tile alive until all have read it. On the H200 (benchmarks/cluster_sum_bench.cu,
  // 128 x 128 f32 tiles, every SM at once) the pull took 3.2-5.4 us from staged to stored at 2-8
  // ranks and 0.7-1.5 us more to the exit; the push 2.6-2.9 us, exit included. In this kernel,
  // against the pull with the same main loop: 0.95x the time at M = 33..128, 0.97x at
  // 192..1024. ----
  // (times 2^-e, see f16_weight_exponent)
  const float ts = p.tensor_scale[b] * __uint_as_float(uint32_t(127 - f16_exp) << 23);
  const uint32_t s_recv_bar = s_lut + Cfg::kRecvBarOffset;
  const int my_rows = rows > rank ? ks_div.div(rows - rank + ks - 1) : 0;
  const int slot_floats = p.slot_rows * BN;  // a receive slot: the most rows any rank owns
  if (push) {
    if (tid == 0) mbar_arrive_expect_tx(s_recv_bar, uint32_t((ks - 1) * my_rows * BN * 4));
    // A thread sends one 16-byte piece of every kRowsPerStep-th row; the row's owner and its index
    // among the owner's rows advance by a constant step, so the loop divides by nothing. (Looping
    // owner by owner instead moved the main loop's chunk arithmetic off the uniform datapath, +26
    // instructions per chunk at BM = 64 and 128, J = 1: tools/sass_loops.py.)
    constexpr int kPieces = Cfg::kPushPieces, kRowsPerStep = Cfg::kPushRowsPerStep;
    const int step_q = p.push_step_q, step_r = p.push_step_r, c4 = tid % kPieces;
    const uint32_t slots = s_lut + uint32_t(Cfg::kStagedBytes);
    int r = tid / kPieces, rq = ks_div.div(r), owner = ks_div.mod(r, rq);  // tile row r is row rq of rank `owner`
    for (; r < rows; r += kRowsPerStep) {
      if (owner != rank) {
        const float4 v = own_piece(r * Cfg::kTileStride + 4 * c4);
        const int slot = rank < owner ? rank : rank - 1;  // (the owner's slots skip its own rank)
        const uint32_t dst = slots + uint32_t((slot * slot_floats + rq * BN + 4 * c4) * 4);
        fused::st_async_f32x4(fused::map_rank(dst, owner), v.x, v.y, v.z, v.w, fused::map_rank(s_recv_bar, owner));
      }
      rq += step_q;
      owner += step_r;
      if (owner >= ks) { owner -= ks; ++rq; }
    }
    fused::mbar_wait<true>(s_recv_bar, 0);
  }

  // A thread takes E consecutive tile columns of one row (8, or 16 with a GLU: 8 outputs, one
  // 16-byte store); E is a constant, so the item's row and columns are shifts and masks.
  const int n_out = p.glu != kGluNone ? p.N / 2 : p.N;
  typename Act::T* y = static_cast<typename Act::T*>(p.y) + (kGrouped ? m0 : int64_t(b) * p.M + m0) * n_out;
  // The pull's sums of an item (only tiles whose receive slots do not fit every cluster size
  // compile it): E columns at tile offset `own` from every rank's tile, pieces in the order sw,
  // sw ^ 1, ... (see sum_and_store), scaled into v. The loads from every rank go out before the
  // first add, except from more than kPullBatchMaxRanks ranks: there it adds rank by rank, which
  // took 0.93-0.94x the time of the whole launch at 5-8 ranks (the many remote loads in flight
  // queue up) and 1.01-1.02x at 2-3 (H200).
  auto pull_sum = [&](auto e_const, auto& v, int own, int sw) {
    constexpr int E = decltype(e_const)::value;
    // EP columns at a time: all E at 256 threads; 8 at 512, whose 128 registers E = 16's 4 pieces
    // of loads per rank would exceed (ptxas spilled).
    constexpr int EP = Cfg::kThreads > 256 ? 8 : E;
    if (ks > kPullBatchMaxRanks) {
#pragma unroll
      for (int e4 = 0; e4 < E / 4; ++e4) {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
        for (int q = 0; q < ks; ++q)
          add_piece(s, *cluster.map_shared_rank(reinterpret_cast<const float4*>(tile_f + own + 4 * (e4 ^ sw)), q));
        put_scaled(v, e4, s, ts);
      }
      return;
    }
#pragma unroll
    for (int h = 0; h < E / EP; ++h) {
      float4 u[EP / 4][kPullBatchMaxRanks];  // [16-byte piece][rank]
#pragma unroll
      for (int q = 0; q < kPullBatchMaxRanks; ++q) {
        if (q >= ks) break;
#pragma unroll
        for (int e4 = EP / 4 * h; e4 < EP / 4 * (h + 1); ++e4)
          u[e4 - EP / 4 * h][q] = *cluster.map_shared_rank(reinterpret_cast<const float4*>(tile_f + own + 4 * (e4 ^ sw)), q);
      }
#pragma unroll
      for (int e4 = EP / 4 * h; e4 < EP / 4 * (h + 1); ++e4) {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int q = 0; q < kPullBatchMaxRanks; ++q) {
          if (q >= ks) break;
          add_piece(s, u[e4 - EP / 4 * h][q]);
        }
        put_scaled(v, e4, s, ts);
      }
    }
  };
  auto sum_and_store = [&](auto e_const) {
    constexpr int E = decltype(e_const)::value, kGroups = BN / E;
    // A shared-memory load of 16 bytes per thread is served 8 threads (128 bytes) at a time;
    // eight threads' items start E floats apart, so their first pieces fell on 2 (E = 8) or 4
    // (E = 16) bank quads at once, and each load took 2-4 wavefronts. A thread instead reads its
    // pieces in the order sw, sw ^ 1, ...: the eight threads' first loads cover all 32 banks, and
    // so does each later one. (The item's rows are BN floats apart in a receive slot, a multiple of
    // 32.) Its sums are put back in column order before the store (unswizzle_pieces).
    const int sw = tid / (32 / E) % (E / 4);
    const GluLogit logit(p.glu);
    for (int it = tid; it < my_rows * kGroups; it += Cfg::kThreads) {
      const int rr = it / kGroups, r = rank + ks * rr, c0 = (it % kGroups) * E;
      if (n0 + c0 >= p.N) continue;
      const int own = r * Cfg::kTileStride + c0, recv = Cfg::kStagedBytes / 4 + rr * BN + c0;
      float v[E];  // the sums, added in rank order (the same on every run), scaled
      if (push || ks == 1) {
        // This rank's tiles and its receive slots, rank by rank: a short loop. Unrolled over the 8
        // possible ranks, each with its own, pushed and pulled loads (~1,100 instructions from the
        // wait to the first add, 64-128 registers of loads in flight), thread 0's first item took
        // 0.73-1.13 us, as long in a build that sent nothing; rolled, 0.48-0.55 us (H200). Why is
        // not pinned down: not bank conflicts (the piece order alone changed nothing at E = 8),
        // nor a cold instruction cache (it stays warm from launch to launch:
        // benchmarks/icache_probe.cu).
        float4 s[E / 4];
#pragma unroll
        for (int e4 = 0; e4 < E / 4; ++e4) s[e4] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
        for (int q = 0; q < ks; ++q) {
          // (the owner's slots skip its own rank; at q == rank this points at a valid, unread row)
          const float* slot = tile_f + recv + (q >= rank ? q - 1 : q) * slot_floats;
#pragma unroll
          for (int e4 = 0; e4 < E / 4; ++e4) {
            const int at = 4 * (e4 ^ sw);
            add_piece(s[e4], q == rank ? own_piece(own + at) : *reinterpret_cast<const float4*>(slot + at));
          }
        }
#pragma unroll
        for (int e4 = 0; e4 < E / 4; ++e4) put_scaled(v, e4, s[e4], ts);
      } else if constexpr (Cfg::kPushMaxRanks < fused::kMaxKSplit) {
        pull_sum(e_const, v, own, sw);
      }
      unswizzle_pieces<E>(v, sw);
      // (the test on v[0], always true, keeps the mark's clock read behind the adds)
      uint32_t packed[4];
#pragma unroll
      for (int o = 0; o < 4; ++o)
        packed[o] = E == 16 ? Act::pack2(glu_apply(logit, v[4 * o], v[4 * o + 1]),
                                         glu_apply(logit, v[4 * o + 2], v[4 * o + 3]))
                            : Act::pack2(v[2 * o], v[2 * o + 1]);
      const int col = E == 16 ? (n0 + c0) / 2 : n0 + c0;
      *reinterpret_cast<uint4*>(y + int64_t(r) * n_out + col) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  };
  if (p.glu != kGluNone)
    sum_and_store(std::integral_constant<int, 16>());
  else
    sum_and_store(std::integral_constant<int, 8>());
  if (ks > 1 && !push) cluster.sync();  // (pull) no rank leaves while another reads its tile
  if constexpr (kGrouped)
    ragged::zero_rows(static_cast<typename Act::T*>(p.y), gt.total_rows, p.M, n_out, tid, Cfg::kThreads);
#endif
}

// How one launch divides its work: output tiles (b, n tile, m tile), the cluster size along K
// (ks ranks of kps k-blocks each) and the rounds of CTAs the GPU runs them in. A split last
// round: the first whole_tiles tiles take one CTA each over all kb k-blocks (whole_waves
// rounds), and only the rest are split over clusters (waves rounds).
struct WgPlan {
  int64_t tiles = 0;
  int ks = 1, kps = 0, kb = 0;
  int64_t waves = 1;
  int64_t whole_tiles = 0, whole_waves = 0;
  int64_t ctas() const { return whole_tiles + (tiles - whole_tiles) * ks; }
};

// What both launchers of this kernel (WgLauncher below, ragged_dot_wgmma.cuh's grouped one) set
// up on the host: its shared memory above the 48 KB default, reserved once per device and kernel,
// and its tensor maps.
template <auto kKernel, size_t kBytes>
std::string reserve_wgmma_smem(int dev, const std::string& where) {
  static std::atomic<bool> reserved[kMaxDevices];
  if (reserved[dev].load(std::memory_order_relaxed)) return std::string();
  const cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBytes));
  if (err != cudaSuccess)
    return std::string("cannot reserve ") + std::to_string(kBytes) + " bytes of shared memory: " +
           cudaGetErrorString(err) + " (" + where + ")";
  reserved[dev].store(true, std::memory_order_relaxed);
  return std::string();
}

// x as {K, rows} (16-bit elements): a box of {64 k, box_rows rows} lands as a stage's [row][64 k],
// each 128-byte row's 16-byte pieces swizzled by the row's index mod 8 (see the kernel's header).
template <class Cfg>
std::string encode_wgmma_x_map(CUtensorMap* map, const void* x, int64_t k, int64_t rows, int box_rows) {
  const uint64_t dims[2] = {uint64_t(k), uint64_t(rows)};
  const uint64_t strides[1] = {uint64_t(k) * 2};
  const uint32_t box[2] = {uint32_t(32 * Cfg::kKCH), uint32_t(box_rows)};
  return encode_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, x, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

// The weight cells as {16 BITS words of a 16-column piece, N / 16 pieces, `rows` k-block rows}
// (uint32): a box of {16 BITS, BN / 16, KCH} lands as the stage's KCH rows of BN cells, each row
// contiguous, as the decode reads them. The scale bytes as {N, rows}. (A stack of weights or
// experts is rows b KB + kb.)
template <int BITS, class Cfg>
std::string encode_wgmma_weight_maps(CUtensorMap* wmap, CUtensorMap* smap, const void* planes, const void* scales,
                                     int64_t n, int64_t rows) {
  const uint64_t w_dims[3] = {uint64_t(16 * BITS), uint64_t(n) / 16, uint64_t(rows)};
  const uint64_t w_strides[2] = {uint64_t(16 * BITS * 4), uint64_t(n) * BITS * 4};
  const uint32_t w_box[3] = {uint32_t(16 * BITS), uint32_t(Cfg::kBN / 16), uint32_t(Cfg::kKCH)};
  const uint64_t s_dims[2] = {uint64_t(n), uint64_t(rows)}, s_strides[1] = {uint64_t(n)};
  const uint32_t s_box[2] = {uint32_t(Cfg::kBN), uint32_t(Cfg::kKCH)};
  std::string bad = encode_tensor_map(wmap, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, planes, w_dims, w_strides, w_box,
                                      CU_TENSOR_MAP_SWIZZLE_NONE);
  if (bad.empty())
    bad = encode_tensor_map(smap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, scales, s_dims, s_strides, s_box,
                            CU_TENSOR_MAP_SWIZZLE_NONE);
  return bad;
}

// One instantiation's launcher: its shared-memory reservation and resident-cluster counts are
// cached per device (function statics, one set per template instance).
template <int BITS, int BM, int J, int WG, class Act>
struct WgLauncher {
  using Cfg = WgConfig<BITS, BM, J, WG>;
  static constexpr auto kernel = &kbit_matmul_wgmma_kernel<BITS, BM, J, WG, Act>;

  static std::string shape(const MatmulArgs& a) {  // (built only for messages)
    return "B=" + std::to_string(a.batch) + " M=" + std::to_string(a.m) + " K=" + std::to_string(a.k) +
           " N=" + std::to_string(a.n) + " bits=" + std::to_string(BITS) + " dtype=" + Act::kName +
           " BM=" + std::to_string(BM) + " BN=" + std::to_string(Cfg::kBN) + " glu=" + std::to_string(a.glu);
  }

  // The dynamic shared memory above the 48 KB default, once per device.
  static std::string reserve(const MatmulArgs& a, int dev) {
    const std::string bad = reserve_wgmma_smem<kernel, Cfg::kSmemBytes>(dev, shape(a));
    return bad.empty() ? bad : "kbit_matmul_wgmma_kernel: " + bad;
  }

  // Clusters of c CTAs resident at once (cudaOccupancyMaxActiveClusters, cached).
  static int max_clusters(int c, int dev) {
    static std::atomic<int> fits[kMaxDevices][9];
    int n = fits[dev][c].load(std::memory_order_relaxed);
    if (n == 0) {
      n = query_max_active_clusters(kernel, Cfg::kThreads, Cfg::kSmemBytes, c, dev);
      fits[dev][c].store(n, std::memory_order_relaxed);
    }
    return n;
  }

  // Split K over a cluster where the tiles leave SMs idle: the largest cluster size whose
  // clusters all fit on the GPU at once (at ~170 KB of shared memory per CTA, 4-CTA clusters fit
  // 120 CTAs, not 132, and a second wave doubled the time of 128-CTA launches), with at least
  // two chunks per rank. (reserve() first: the occupancy query needs the shared-memory size.)
  static WgPlan plan(const MatmulArgs& a, const MatmulTuning* tuning, int dev) {
    WgPlan w;
    const int kb = static_cast<int>(a.k / 32);
    w.tiles = int64_t(ceil_div(a.n, Cfg::kBN)) * ceil_div(a.m, BM) * a.batch;
    int ks = 1;
    if (tuning && tuning->k_split > 0) {
      ks = std::min(tuning->k_split, 8);
    } else {
      for (int c = std::min(8, kb / (2 * Cfg::kKCH)); c > 1; --c)
        if (w.tiles * c <= device_sm_count(dev) && w.tiles <= max_clusters(c, dev)) {
          ks = c;
          break;
        }
    }
    w.kb = kb;
    w.kps = ceil_div(kb, ks);
    w.ks = std::max(1, ceil_div(kb, w.kps));  // no rank without k-blocks
    const int64_t resident = int64_t(std::max(1, max_clusters(w.ks, dev))) * w.ks;
    w.waves = ceil_div(w.tiles * w.ks, resident);
    // A last round of tiles that fills half the GPU or less (Llama-3-70B gate/up at M = 512: 448
    // tiles of 256 x 128, 3.4 rounds of 132) runs as 2-CTA clusters that split K, in half the
    // time, after the whole rounds (which then run as 2-CTA clusters too, each rank a tile).
    // (not where the caller forces a cluster size)
    const int split_last = tuning ? (tuning->k_split > 0 ? 0 : tuning->wg_split_last) : -1;
    if (w.ks == 1 && split_last != 0 && kb >= 4 * Cfg::kKCH) {
      const int64_t r2 = int64_t(max_clusters(2, dev)) * 2;
      const int64_t whole_waves = w.tiles / r2, rest = w.tiles - whole_waves * r2;
      if (whole_waves >= 1 && rest > 0 && 2 * rest <= r2) {
        WgPlan m = w;
        m.ks = 2;
        m.kps = ceil_div(kb, 2);
        m.whole_tiles = whole_waves * r2;  // (even: whole clusters)
        m.whole_waves = whole_waves;
        m.waves = 1;
        if (split_last == 1 || cost(m) < cost(w)) w = m;
      }
    }
    return w;
  }

  // The plan's time in units of one k-block of a 256-column tile (plan_terms.h: what each term
  // stands for and how it was fitted): a fixed cost plus each rank's share of its k-blocks, per
  // round of tiles, a split last round's whole rounds added, and a k-split sum by pull.
  static double cost(const WgPlan& w) {
    const double per_kblock = terms::wg_kblock_time(J, BM);
    const double k_share = Cfg::kGroups == 1 ? 1.0
                           : WG == 1         ? terms::kQuadKBlock64
                           : BM == 64        ? terms::kPairKBlock64
                                             : terms::kPairKBlock128;
    const double fixed = WG == 1 ? terms::kQuadFixed64 : terms::kWgFixedKBlocks;
    const double pull = w.ks > 1 && !Cfg::pushes(w.ks) ? terms::wg_pull_kblocks(w.ks) : 0.0;
    const double split = (fixed + k_share * w.kps) * double(w.waves);
    const double whole = (fixed + k_share * w.kb) * double(w.whole_waves);
    return per_kblock * (split + whole) + pull;
  }

  static std::string launch(const MatmulArgs& a, const WgPlan& w, cudaStream_t stream, const MatmulTuning* tuning) {
    WgParams p;
    copy_operands(a, p);
    p.M = a.m;
    p.N = static_cast<int>(a.n);
    p.K = static_cast<int>(a.k);
    p.KB = static_cast<int>(a.k / 32);
    p.glu = a.glu;
    p.n_tiles = ceil_div(a.n, Cfg::kBN);
    p.m_tiles = ceil_div(a.m, BM);
    p.tail_rows = static_cast<int>(a.m - int64_t(p.m_tiles - 1) * BM);
    p.ks = w.ks;
    p.kps = w.kps;
    p.ks_div = FastDiv(w.ks);
    p.m_tiles_div = FastDiv(p.m_tiles);
    p.n_tiles_div = FastDiv(p.n_tiles);
    p.slot_rows = ceil_div(BM, w.ks);
    p.push_step_q = Cfg::kPushRowsPerStep / w.ks;
    p.push_step_r = Cfg::kPushRowsPerStep % w.ks;
    p.whole_ctas = static_cast<int>(w.whole_tiles);
    if (w.ctas() > 0x7fffffffLL) return "kbit_matmul_wgmma_kernel: too many tiles for " + shape(a);
    if (tuning && tuning->report) {
      MatmulLaunchReport& r = *tuning->report;
      r.k_split = w.ks;
      r.ctas = static_cast<int>(w.ctas());
      r.whole_ctas = static_cast<int>(w.whole_tiles);
      r.balanced = 0;
      r.wg_columns = Cfg::kBN;
      r.variant = 3;
      r.rows = BM;
      r.cluster_sum = w.ks < 2 ? 0 : Cfg::pushes(w.ks) ? kClusterSumPush : kClusterSumPull;
      r.plan_cost = 0;  // (matmul_fused.cuh's plans only)
      r.chunk_price = 0;
    }
    // x as {K, B * M rows}. Each batch entry's last row tile, where it is partial, loads through a
    // second map whose box has only its rows: TMA's zero fill of the box's rows past B * M is slow.
    // With 63 of 128 rows filled (M = 65, H100) the paired 128-row tile took 1.2-1.3x its time at
    // M = 96 on Llama-3-8B gate/up, Llama-3-70B down and o (e.g. 26.6 against 21.2 us), from ~40
    // filled rows up; with the rows read from memory instead, 65 took no longer than 96.
    CUtensorMap xmap, xmap_tail, wmap, smap;
    std::string bad = encode_wgmma_x_map<Cfg>(&xmap, a.x, a.k, a.batch * a.m, BM);
    xmap_tail = xmap;
    if (bad.empty() && p.tail_rows < BM) bad = encode_wgmma_x_map<Cfg>(&xmap_tail, a.x, a.k, a.batch * a.m, p.tail_rows);
    if (bad.empty()) bad = encode_wgmma_weight_maps<BITS, Cfg>(&wmap, &smap, a.planes, a.scales, a.n, a.batch * (a.k / 32));
    if (!bad.empty()) return "kbit_matmul_wgmma_kernel: " + bad + " (" + shape(a) + ")";
    const ClusterLaunch launch(static_cast<unsigned>(w.ctas()), Cfg::kThreads, Cfg::kSmemBytes, stream, w.ks);
    cudaLaunchKernelEx(&launch.cfg, kernel, p, xmap, xmap_tail, wmap, smap);
    if (cudaPeekAtLastError() == cudaSuccess) return std::string();
    return check_launch("kbit_matmul_wgmma_kernel", shape(a));
  }
};

// The weight tile at BM <= 128: 256 columns (J = 2), 128 (J = 1) or, at BM = 64, 64 (WG = 1),
// whichever WgLauncher::cost predicts fastest (tuning->wg_columns forces one): narrower tiles
// give small layers more tiles, so shorter k-splits (Qwen3 q at M = 128: 15.1 us at 128 columns
// against 18.4 at 256), and lose on large ones (Llama-3-70B gate/up: 161 against 115 us).
template <int BITS, int BM, class Act>
struct WgColumnChoice {
  using Wide = WgLauncher<BITS, BM, 2, 2, Act>;
  using Narrow = WgLauncher<BITS, BM, 1, 2, Act>;
  using Slim = WgLauncher<BITS, BM, 1, 1, Act>;  // (instantiated at BM = 64 only)
  static constexpr bool kSlim = BM == 64;
  std::string error;  // (a reservation failed: nothing to launch)
  WgPlan plan;
  int columns = 0;  // the chosen tile's: 64, 128 or 256
  double cost = 0;
  WgColumnChoice(const MatmulArgs& a, const MatmulTuning* tuning, int dev) {
    const int forced = tuning ? tuning->wg_columns : 0;
    auto consider = [&](auto launcher, int cols) {
      using L = decltype(launcher);
      if (!error.empty() || (forced != 0 && forced != cols)) return;
      error = L::reserve(a, dev);
      if (!error.empty()) return;
      const WgPlan w = L::plan(a, tuning, dev);
      if (columns == 0 || L::cost(w) < cost) {
        plan = w;
        columns = cols;
        cost = L::cost(w);
      }
    };
    consider(Wide(), 256);
    consider(Narrow(), 128);
    if constexpr (kSlim) consider(Slim(), 64);
    if (error.empty() && columns == 0)
      error = "kbit_matmul_wgmma_kernel: no weight tile of " + std::to_string(forced) + " columns at " +
              std::to_string(BM) + " rows (" + Wide::shape(a) + ")";
  }
  std::string launch(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) const {
    if (!error.empty()) return error;
    if constexpr (kSlim)
      if (columns == 64) return Slim::launch(a, plan, stream, tuning);
    return columns == 128 ? Narrow::launch(a, plan, stream, tuning) : Wide::launch(a, plan, stream, tuning);
  }
};

// The row tile (BM) by M: 64 rows up to 64, 128 up to 128; above, 256 (J = 1; every bits value
// fits: see WgConfig::pick_stages and WgWeightPath) or 128, whichever WgLauncher::cost predicts
// faster (tuning->wg_rows forces one).
template <int BITS, class Act>
std::string launch_wgmma_rows(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  static_assert(WgConfig<BITS, 256, 1>::kStages > 0, "the 256-row tile fits shared memory");
  const int dev = current_device();
  if (a.m <= 64) return WgColumnChoice<BITS, 64, Act>(a, tuning, dev).launch(a, stream, tuning);
  const int forced_rows = tuning ? tuning->wg_rows : 0;
  if (a.m <= 128 || forced_rows == 128)
    return WgColumnChoice<BITS, 128, Act>(a, tuning, dev).launch(a, stream, tuning);
  using Tall = WgLauncher<BITS, 256, 1, 2, Act>;
  const std::string bad = Tall::reserve(a, dev);
  if (!bad.empty()) return bad;
  const WgPlan tall = Tall::plan(a, tuning, dev);
  if (forced_rows != 256) {
    const WgColumnChoice<BITS, 128, Act> rows128(a, tuning, dev);
    if (rows128.error.empty() && rows128.cost < Tall::cost(tall)) return rows128.launch(a, stream, tuning);
  }
  return Tall::launch(a, tall, stream, tuning);
}

// By the activations' dtype (bf16 or fp16; matmul.cu's use_wgmma admits no other).
template <int BITS>
std::string launch_wgmma_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  if (a.dtype == DType::kF16) return launch_wgmma_rows<BITS, ActF16>(a, stream, tuning);
  return launch_wgmma_rows<BITS, ActBF16>(a, stream, tuning);
}

}  // namespace kbit::cuda::wgmma
