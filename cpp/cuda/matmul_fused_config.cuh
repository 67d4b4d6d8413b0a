// The fused matmul's tilings and their compile-time sizes: what a CTA computes per chunk, how
// its shared memory is laid out and how deep its ring is (Config for both kernels, WsConfig for
// the warp-specialized kernel), and each tiling's chunk price for the launcher's plan
// (matmul_fused_plan.cuh). Times quoted are H200 measurements of the C++ harness
// (benchmarks/cuda_kernel_harness.cu) unless said otherwise.
#pragma once

#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/item_reduce.cuh"
#include "cuda/plan_terms.h"
#include "cuda/weight_path.cuh"

namespace kbit::cuda::fused {

constexpr int kMaxSmem = 227 * 1024;  // H100/H200 per-block limit (opt-in)

// A diagnostic build, never the module's (tools/kernel_profile.sh stream): with
// -DKBIT_STREAM_ONLY=1 the warp-specialized kernel's consumers wait for each chunk and release it
// without decoding it, so a launch takes what its memory path alone takes (start, ring, the
// partial sums' reduction and stores, exit), and the difference to the real build is the decode.
#ifndef KBIT_STREAM_ONLY
#define KBIT_STREAM_ONLY 0
#endif
constexpr bool kStreamOnly = KBIT_STREAM_ONLY != 0;

// The tilings (the template argument V of Config and the kernels; MatmulTuning::variant).
// MT is the number of n8 tiles along M (8 rows each) in a block of rows.
struct Tiling {
  // K split over the warps: 16 warps (8 at MT >= 4), one k-block each per chunk, for all kTN
  // 16-column tiles of the column group. The warps' partial sums are added at the item's end.
  static constexpr int kWarpKBlock = 0;
  // K split over 8 warps, two k-blocks each per chunk: the same chunk with half the per-chunk
  // bookkeeping per unit of work, but fewer warps to hide latency. At MT = 2 (16 rows) it also
  // doubles the column group at bits 2..4 (64 columns, as at MT = 1), so each chunk's
  // activations serve twice the weights. On the warp-specialized kernel at M <= 8 it takes
  // 0.81-0.90x the time of kWarpKBlock at every bits value.
  static constexpr int kWarpKPair = 1;
  // N split over 8 warps (warp-specialized kernel only): each warp owns kTN = 2 16-column tiles
  // of a 256-column group for every k-block of the chunk, so a weight is decoded once for the
  // whole block of 16, 32 or 64 rows (the K-split tilings decode it once per 16 rows, which is
  // what their 32 accumulators allow) and the warps never add partial sums. The price is the
  // activations: every warp loads all rows of every k-block, 4 MT shared-memory wavefronts per
  // k-block against ~11 per decoded tile, hence two tiles per warp (64 accumulators at MT = 8).
  static constexpr int kNSplit = 2;
  // Bits 5 (warp-specialized kernel, MT <= 2): kWarpKPair with the 64-column group of bits
  // 2..4. The 32-column groups of the K-split tilings at bits 5 make twice the items of the
  // other bits (Qwen3 gate/up, K 2048, N 5120: 160 items for 132 CTAs, against 80), and a
  // chunk's fixed work (barriers, activations, scale decode) serves half the weights. Where the
  // launcher takes it: 0.80-0.85x the time on Qwen3 gate/up at M = 9..16, 0.82-0.99x on the
  // Llama-3 layers; at M = 1..3 0.955-0.965x kWarpKPair's time on 17 shapes (Llama-3-70B down,
  // M = 1: 54.5 -> 49.4 us). It decodes from bits 5's table at its MT (Config::Path). At M <= 8
  // its ring holds 3 stages of 20 KiB at M <= 3 and 2 at M = 4..8 (its reducer keeps one receive
  // slot: WsSizes::recv_slots); with 2 stages it is up to 1.10x slower on the layers that stream
  // many chunks and up to 1.38x on those that need a cluster, and no chunk price separates those
  // from the winners, so launch_fused_bits takes it there by a rule (wide5_one_round).
  static constexpr int kWideBits5 = 4;
};
template <int BITS, int MT, int V = Tiling::kWarpKBlock>
struct Config {
  static_assert(V != Tiling::kNSplit || MT >= 2, "the N-split tiling serves blocks of 16, 32 or 64 rows");
  static_assert(V != Tiling::kWideBits5 || (BITS == 5 && MT <= 2),
                "the wide bits-5 tiling serves bits 5 in blocks of 8 or 16 rows");
  static constexpr bool kWide5 = V == Tiling::kWideBits5;
  // Warps per CTA (one CTA per SM). At MT >= 4 the activation chunk grows with the rows, so
  // 8 warps (smaller chunks) fit. kWarpKPair with 16 warps at MT = 1 (96 registers, a ring of
  // two 32 KiB stages) took 1.03-1.24x the time of 8 (H200, M = 1, bits 4, 23 shapes).
  static constexpr int kWarps = (MT >= 4 || V >= Tiling::kWarpKPair) ? 8 : 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKPW = V == Tiling::kWarpKPair || kWide5 ? 2 : 1;  // k-blocks per warp per chunk (K split)
  // The decode path. Bits 5 in the N-split tiling and in the 16-row tilings (MT = 2) reads the
  // 64 KiB table of 16 lane copies (two wavefronts per lookup; WeightPathBits5<16>):
  //  * N-split: it leaves room for two tiles per warp, as at the other bits (two tiles take 0.72x
  //    the time of one on Llama-3-70B gate/up at M = 16).
  //  * MT = 2: it leaves the ring 4 stages at 16 rows instead of 2: 0.79-0.94x the time at
  //    M = 16..32 (ten shapes; Llama-3-70B down at M = 16: 94.8 -> 76.3 us).
  //  * MT = 1 keeps the 128 KiB table, whose lookups take one wavefront: the 64 KiB one took
  //    1.04-1.27x the time on the Llama layers at M = 1..8.
  // The K-split tilings keep 32 columns at bits 5 (two tiles per warp); the 64-column group is
  // kWideBits5, which the launcher plans next to them.
  using Path = std::conditional_t<BITS == 5 && (V == Tiling::kNSplit || MT == 2), WeightPathBits5<16>,
                                  WeightPath<BITS>>;
  // 16-column tiles per warp: one ldmatrix (x) and one or two LDS.128 (scales) per k-block
  // serve all kTN tiles; accumulators kTN * MT * 4 <= 32 (kNSplit: 64). Bits 5 in the 16-row
  // tilings uses 2 to leave shared memory for the ring next to its table. At MT = 1, 8 tiles
  // (128-column groups: half the items, 32 KiB chunks, a ring of 3) took 1.10-1.11x (bits 4) and
  // 1.06x (bits 2) the time of 4 on a Llama-3-8B layer's products (M = 1 and 8, H200).
  static constexpr int kTN = V == Tiling::kNSplit ? 2
                             : kWide5             ? 4
                             : MT == 1 || (MT == 2 && V == Tiling::kWarpKPair) ? (BITS == 5 ? 2 : 4)
                                                                               : (MT == 2 ? 2 : 1);
  static constexpr int kCols = 16 * kTN * (V == Tiling::kNSplit ? kWarps : 1);  // the column group
  // A box dimension of a tensor map holds at most 256 elements: a wider k-block row of the group
  // (kNSplit; kWideBits5: 320 words) is copied as 16-column pieces (the launcher's weight map).
  static constexpr bool kPieceMap = kCols * BITS > 256;
  // k-blocks per chunk. kNSplit: 2 (8 KiB of bits-4 weights, 4 KiB of activations per 32 rows),
  // so that the ring keeps 4-7 stages next to the table and the cluster's partial sums.
  static constexpr int kKCH = V == Tiling::kNSplit ? 2 : kWarps * kKPW;
  static constexpr int kKBW = V == Tiling::kNSplit ? kKCH : kKPW;  // k-blocks each warp computes per chunk
  static constexpr int kAcc = kTN * MT * 4;
  // A chunk's time in kWarpKBlock chunks of the same MT, the unit in which the launcher compares
  // the tilings' plans: this tiling's price (plan_terms.h).
  static constexpr double chunk_cost(bool bf16, bool one_block_of_rows) {
    if constexpr (V == Tiling::kNSplit) return terms::nsplit_price(bf16, BITS, MT);
    if constexpr (kWide5) return terms::kWideBits5Price;
    if constexpr (MT == 2 && V == Tiling::kWarpKPair && BITS != 5) return terms::pair_price(BITS, one_block_of_rows);
    return 1.0;
  }
  static constexpr int kSlabBytes = kCols * BITS * 4;  // one k-block of the column group
  static constexpr int kWChunk = kKCH * kSlabBytes;
  static constexpr int kXRowBytes = kKCH * 64 + 16;  // +16 B: ldmatrix rows in distinct banks
  static constexpr int kXRowStep = kThreads / (kKCH * 4);  // rows of x one pass of threads covers
  static constexpr int kScaleItems = kKCH * kTN * 4;  // 4 columns of one k-block each
  static constexpr int kRawChunk = kScaleItems * 16;  // lo word, hi word, shift, valid
  static constexpr int kSfKbBytes = kCols * 4;
  static constexpr int kSfChunk = kKCH * kSfKbBytes;
  static constexpr int kRedBytes = (kWarps / 2) * kAcc * 32 * 4;  // tree reduction, level 1
  static constexpr int kPartBytes = kAcc * 32 * 4;                 // CTA partial for the cluster
  static_assert(kScaleItems <= kThreads, "one scale item per thread");
  // (the cp.async kernel's staging of x; kNSplit runs only on the warp-specialized kernel, whose
  // activations come by tensor copy)
  static_assert(V == Tiling::kNSplit || (kThreads % (kKCH * 4) == 0 && (8 * MT) % kXRowStep == 0),
                "x staging pattern");

  static constexpr size_t fixed_bytes() {
    return size_t(Path::kLutBytes) + 2 * kSfChunk + kRedBytes + kPartBytes;
  }
  static constexpr size_t slot_bytes(int x_rows) {
    return size_t(kWChunk) + size_t(x_rows) * kXRowBytes + kRawChunk;
  }
  // Ring depth: as deep as shared memory allows (sized for the largest row count of this MT)
  // up to 64 KiB of weights in flight, at least 2.
  static constexpr int pick_stages() {
    for (int d = 8; d > 2; --d)
      if (fixed_bytes() + d * slot_bytes(8 * MT) <= size_t(kMaxSmem) && (d - 1) * kWChunk <= 64 * 1024)
        return d;
    return 2;
  }
  static constexpr int kStages = pick_stages();
  static_assert(fixed_bytes() + 2 * slot_bytes(8 * MT) <= size_t(kMaxSmem), "shared memory budget");
  static constexpr size_t smem_bytes(int x_rows) { return fixed_bytes() + kStages * slot_bytes(x_rows); }
};

// ---- the warp-specialized kernel (matmul_fused_ws.cuh) ----

// The largest MT the warp-specialized kernel serves with the K-split tilings: blocks of 16 rows
// (kNSplit has its own, 4 and 8). With the activations by tensor copy it takes 0.55-0.95x the
// cp.async kernel's time at M = 16 (median 0.82x; Llama-3-70B down, bits 4: 123.6 -> 71.7 us).
constexpr int kWsMaxMT = 2;
constexpr int kXKbBytes = 64;  // one k-block of one activation row (32 x 16 bit)

// The sizes of the warp-specialized kernel's shared memory that do not depend on its reducer.
template <int BITS, int MT, int V>
struct WsSizes {
  using C = Config<BITS, MT, V>;
  static constexpr int kWarps = C::kWarps;             // consumer warps
  static constexpr int kThreads = C::kThreads + 32;    // + one producer warp
  static constexpr int kSfWarpBytes = 2 * C::kTN * 8 * 4;  // one k-block: 8 g x kTN x 2 floats
  static constexpr int kSfBytes = kWarps * C::kKBW * 2 * kSfWarpBytes;  // double-buffered
  static constexpr int kSChunk = C::kKCH * C::kCols;                  // raw scale bytes
  static constexpr int kSSlot = (kSChunk + 511) & ~511;              // ... their room in a slot
  static constexpr size_t align1024(size_t b) { return (b + 1023) & ~size_t(1023); }
  static constexpr size_t slot_bytes(int x_rows) {
    return align1024(size_t(C::kWChunk) + kSSlot + size_t(x_rows) * C::kKCH * kXKbBytes);
  }
  static_assert(C::kWChunk % 512 == 0, "activations of a slot start on 512 bytes");
  // [LUT][reducer][sf][full x 8, empty x 8][ring]; the ring and its slots start on 1024 bytes
  // (tensor-copy destinations; the swizzled activations need 512). +1 KiB: the dynamic shared
  // memory itself may start anywhere on 16 bytes.
  static constexpr size_t ring_offset(size_t reducer_bytes) {
    return size_t(C::Path::kLutBytes) + reducer_bytes + kSfBytes + 2 * 8 * 8;
  }
  // Ring depth next to a reducer of `reducer_bytes` with slots for `x_rows` activation rows: as
  // deep as shared memory allows, up to terms::kRingMaxKiB of weights in flight and 8 stages (the
  // barriers), at least 2; 0 if two stages do not fit.
  static constexpr int stages_with(size_t reducer_bytes, int x_rows = 8 * MT) {
    for (int d = 8; d >= 2; --d)
      if (ring_offset(reducer_bytes) + 1024 + d * slot_bytes(x_rows) <= size_t(kMaxSmem) &&
          (d == 2 || (d - 1) * C::kWChunk <= terms::kRingMaxKiB * 1024))
        return d;
    return 0;
  }
  // Receive slots of ItemReducer (K-split tilings): one per other rank of a kMaxKSplit cluster,
  // fewer where they would cut the ring below 4 stages (or below its depth with one slot, if
  // less); the launcher then caps the cluster size at slots + 1. (13 of the 16 tilings get all
  // 7; e.g. bits 2 at MT = 1 keeps 7 stages instead of 8, within 0-2 % of the time.)
  static constexpr int recv_slots() {
    // kWideBits5 at MT = 1 (the 128 KiB table) runs without a cluster where the launcher takes
    // it (launch_fused_bits: wide5_one_round): one slot (clusters of 2 when forced) leaves its
    // ring a third stage at M <= 3.
    if constexpr (C::kWide5 && MT == 1) return 1;
    using R = ItemReducer<kWarps, C::kAcc, 1>;
    const int want = std::min(stages_with(R::bytes_with(1)), 4);
    for (int n = kMaxKSplit - 1; n > 1; --n)
      if (stages_with(R::bytes_with(n)) >= want) return n;
    return 1;
  }
};

template <int BITS, int MT, int V>
struct WsConfig : WsSizes<BITS, MT, V> {
  using S = WsSizes<BITS, MT, V>;
  using typename S::C;
  // End-of-item sums: the K-split tilings add the warps' partial sums (and the cluster's); in
  // kNSplit each warp owns its columns and only the cluster's ranks add up.
  using Reducer = std::conditional_t<V == Tiling::kNSplit, WarpClusterReducer<S::kWarps, C::kAcc>,
                                     ItemReducer<S::kWarps, C::kAcc, S::recv_slots()>>;
  static constexpr size_t kRingOffset = S::ring_offset(Reducer::kBytes);
  static constexpr size_t fixed_bytes() { return kRingOffset + 1024; }
  // The ring's depth for a launch whose blocks of M have at most `x_rows` rows: the slots hold
  // that many activation rows, so fewer rows leave room for more stages (at M = 1: bits 5 6
  // stages instead of the 4 that 8 rows allow, bits 2 8 instead of 7; the in-flight cap holds
  // bits 3 and 4). Planner::plan picks this depth or that of 8 MT rows.
  static constexpr int stages(int x_rows) { return S::stages_with(Reducer::kBytes, x_rows); }
  static_assert(stages(8 * MT) >= 2, "shared memory budget");
  static constexpr size_t smem_bytes(int x_rows) { return fixed_bytes() + stages(x_rows) * S::slot_bytes(x_rows); }
};

}  // namespace kbit::cuda::fused
