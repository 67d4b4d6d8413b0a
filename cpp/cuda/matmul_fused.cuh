// The fused kbit matmul on mma.sync tensor cores, for bf16/f16 activations and fragment-layout
// weights at M <= 128 rows and elsewhere the wgmma kernel (matmul_wgmma.cuh) does not take:
//     y[b, m, n] = tensor_scale[b] * sum_kb scale[kb, n] * sum_{k in kb} x[b, m, k] * codebook[code]
//
// At small M the kernel must stream the compressed weights at memory speed, i.e. decode
// 58 (bits 2) .. 25 (bits 5) weights per SM per clock on the H200 (132 SMs, 1.98 GHz, ~4.3 TB/s).
// A per-element recipe (bit-plane shifts + shuffle) costs ~10 integer ops per weight against a
// budget of 1-2, so:
//  * Weights use the fragment layout (format.h): thread t of an mma quad finds the 8 codes it
//    needs as one contiguous 8*bits-bit field of the cell, and two neighbouring codes form one
//    mma operand register (lower k in the low half).
//  * Operands are swapped: Y^T[N, M] = W^T[N, K] * X^T[K, M] with mma.m16n8k16. The weight
//    tile (16 columns n x 16 k) is the A operand, x is the B operand (n8 = 8 rows of M), so
//    M <= 8 wastes nothing along N and larger M re-uses the decoded A registers.
//  * Decoding is a table lookup in shared memory that returns two (bits 3..5) or four (bits 2)
//    16-bit values per instruction (weight_path.cuh). The table is replicated once per lane (lane
//    l reads bank l: no conflicts) and its byte address is built with one PRMT (bits 2, 4) or one
//    shift + one LOP3 (bits 3, 5).
//  * The E4M4 block scale multiplies the fp32 mma result of the cell's two k16 halves (mma into
//    a zero accumulator, then FFMA into the running sum), and tensor_scale is applied once in
//    the epilogue, so fp16 operands never hold scaled (possibly subnormal) values. (The N-split
//    tiling with bf16 scales the decoded weights instead: mma_k_block_scaled_weights.)
//  * Memory parallelism comes from a kStages-deep shared-memory ring of "chunks" (weights,
//    activations and scale bytes of kKCH k-blocks): 30-64 KiB in flight per SM without spending
//    registers. (Weights kept in registers, 4 stages of 32-bit loads per warp, put ~3 MB in flight
//    over the GPU and ran latency-bound at 0.8-1.3 TB/s.)
//  * CTAs are persistent (one per SM, the lookup table is built once) and walk a list of work
//    items (column group x k-range x block of M x batch entry; matmul_fused_walk.cuh); their chunk
//    stream runs across item boundaries, so the ring never drains. K is split across the warps of
//    a CTA (or N, in the N-split tiling) and, when the column groups alone would leave SMs idle or
//    unbalanced, across the CTAs of a thread-block cluster, reduced through distributed shared
//    memory: no workspace, no atomics.
//
// Work decomposition:
//  chunk = kKCH consecutive k-blocks (32 k each) of one item's k-range; in the K-split tilings
//          warp w handles k-block(s) w of every chunk for all kTN 16-column tiles of the item's
//          column group.
//  stage = one chunk in the shared-memory ring; chunk q + kStages - 1 is copied while q computes.
//
// What limits it: at M <= 16 the consumers' decode on the SM's shared-memory path (table lookups,
// code and scale loads; matmul_fused_ws.cuh), so the time is nearly independent of bits; the
// large Llama-3 layers at M = 1, bits 4 stream at ~75 % of the copy bandwidth. Small products
// (2-8 chunks per CTA) are set by the start (first copy, table build) and the item end
// (item_reduce.cuh); above ~32 rows each decoded weight serves too few rows, which the wgmma
// kernel fixes.
//
// The files:
//   matmul_fused_config.cuh    the tilings (Tiling) and their sizes (Config, WsConfig)
//   matmul_fused_walk.cuh      kernel parameters and the work walk (Params, ItemWalk)
//   matmul_fused_steps.cuh     the per-k-block steps both kernels share
//   matmul_fused_epilogue.cuh  an item's store (tensor scale, rounding, GLU)
//   matmul_fused_cp_async.cuh  the cp.async kernel
//   matmul_fused_ws.cuh        the warp-specialized (TMA producer + consumers) kernel
//   matmul_fused_plan.cuh      host planning per tiling (cluster size, ring depth, cost)
//   plan_terms.h               the plans' measured terms (chunk prices, item ends, limits)
//   matmul_fused_launch.cuh    host launch per tiling (parameters, tensor maps)
//   this file                  the choice of kernel and tiling (launch_fused_bits)
//   ragged_dot_ws.cuh          the grouped product (kbit_ragged_dot) on the warp-specialized
//                              kernel: its tiling and launch (the walk's and the stores' grouped
//                              mode, the kernel's GroupParams)
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/matmul_fused_config.cuh"
#include "cuda/matmul_fused_launch.cuh"
#include "cuda/matmul_fused_plan.cuh"

namespace kbit::cuda::fused {

template <class A>
struct ActTag { using type = A; };

// The fused matmul for bits = BITS: the kernel and the tiling, then the launch.
//  * Kernel. The warp-specialized kernel (matmul_fused_ws.cuh) takes M <= terms::kWsMaxRows where its
//    tensor copies apply: N % 16 == 0 (16-byte rows of scale bytes), 16-byte-aligned buffers (K
//    is a multiple of 32) and 32-bit copy coordinates (B * M and B * K / 32 rows). Otherwise the
//    cp.async kernel (matmul_fused_cp_async.cuh).
//  * Rows. Blocks of 8 MT rows: MT = ceil(M / 8) up to 2 on the warp-specialized kernel's K-split
//    tilings (blocks of 16 rows; kNSplit 16, 32 or 64), up to 8 on the cp.async kernel.
//  * Tiling (Tiling in matmul_fused_config.cuh; tuning->variant forces one where it can run).
//    At M <= 8 the warp-specialized kernel takes kWarpKPair (0.81-0.90x the time of kWarpKBlock
//    at every bits value), and at bits 5 kWideBits5 where it shortens the launch (below). The
//    cp.async kernel at M <= 8 takes kWarpKPair at bits 3 and 5 (0.95x and 0.98x the time of
//    kWarpKBlock on the ten benchmark shapes at M = 1 and 4) and kWarpKBlock at bits 2 and 4
//    (1.02x and 1.01x with kWarpKPair). At M > 8 the cp.async kernel keeps kWarpKBlock, and the
//    warp-specialized kernel plans kWarpKBlock, kWarpKPair, kNSplit and at bits 5 kWideBits5
//    (Planner::plan: cluster size and critical path, in one unit through the chunk prices of
//    plan_terms.h)
//    and takes the shortest plan: kWarpKPair where the columns are plentiful (Llama-3 gate/up
//    and down at M = 16: 0.72-0.88x the time of kWarpKBlock at bits 2..4), kWarpKBlock where
//    64-column groups would leave too few items (N = 2048: kWarpKPair up to 1.11x), kNSplit where
//    decoding each weight once per 32 or 64 rows wins (most Llama shapes at M >= 48).
template <int BITS>
std::string launch_fused_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  if (a.k == 0) {  // empty contraction: y = 0 (+0.0 is all-zero bits in every dtype)
    const cudaError_t err = cudaMemsetAsync(a.y, 0, size_t(a.batch * a.m * a.n) * 2, stream);
    return err == cudaSuccess ? std::string() : std::string("kbit_matmul: memset failed: ") + cudaGetErrorString(err);
  }
  auto al16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  // (tensor-copy coordinates are 32-bit: rows B * M and B * K / 32 must fit)
  const int64_t ws_rows = tuning && tuning->ws_max_rows >= 0 ? tuning->ws_max_rows : terms::kWsMaxRows;
  const bool ws = a.m <= ws_rows && a.n % 16 == 0 && al16(a.planes) && al16(a.scales) && al16(a.x) &&
                  a.batch * a.m < (int64_t(1) << 31) && a.batch * (a.k / 32) < (int64_t(1) << 31);
  const int min_mt = ws && tuning ? tuning->min_m_tiles : 0;
  const int mt = ws ? std::min(std::max(m_tiles(a.m), min_mt), kWsMaxMT) : m_tiles(a.m);
  // (a forced kNSplit, blocks of 16 rows at M <= 16, or kWideBits5 runs only on the
  // warp-specialized kernel; a request for it elsewhere gets the default)
  const bool forced_variant = tuning && tuning->variant >= 0 && (tuning->variant != Tiling::kNSplit || ws) &&
                              (tuning->variant != Tiling::kWideBits5 || (ws && BITS == 5 && mt <= 2 && a.m <= 16));
  constexpr int kCpAsyncTiling = (BITS == 3 || BITS == 5) ? Tiling::kWarpKPair : Tiling::kWarpKBlock;  // (M <= 8)
  const int variant = forced_variant ? tuning->variant
                      : mt > 1       ? Tiling::kWarpKBlock
                      : ws           ? Tiling::kWarpKPair
                                     : kCpAsyncTiling;
  auto with_nsplit = [&](auto act_tag, auto&& use) -> std::string {
    using A = typename decltype(act_tag)::type;
    if (a.m <= 16) return use(Launcher<BITS, A, 2, Tiling::kNSplit, true>{});
    if (a.m <= 32) return use(Launcher<BITS, A, 4, Tiling::kNSplit, true>{});
    return use(Launcher<BITS, A, 8, Tiling::kNSplit, true>{});
  };
  auto by_ws = [&](auto act_tag, auto mt_tag, auto v_tag) -> std::string {
    using A = typename decltype(act_tag)::type;
    constexpr int MT = decltype(mt_tag)::value, V = decltype(v_tag)::value;
    if constexpr (MT <= kWsMaxMT)
      if (ws) return Launcher<BITS, A, MT, V, true>::launch(a, stream, tuning);
    return Launcher<BITS, A, MT, V, false>::launch(a, stream, tuning);
  };
  auto by_act = [&](auto mt_tag) -> std::string {
    constexpr int MT = decltype(mt_tag)::value;
    using KBlock = std::integral_constant<int, Tiling::kWarpKBlock>;
    using KPair = std::integral_constant<int, Tiling::kWarpKPair>;
    auto with = [&](auto act_tag) -> std::string {
      using A = typename decltype(act_tag)::type;
      if (variant == Tiling::kNSplit)
        return with_nsplit(act_tag, [&](auto ln) { return decltype(ln)::launch(a, stream, tuning); });
      // Bits 5's wide tiling: forced (forced_variant has checked ws), or at M = 9..16 planned
      // next to the K-split tilings and taken where its plan is the shortest.
      using LW = Launcher<BITS, A, MT, Tiling::kWideBits5, true>;
      constexpr bool has_wide = BITS == 5 && MT <= 2 && MT <= kWsMaxMT;
      if constexpr (has_wide)
        if (variant == Tiling::kWideBits5) return LW::launch(a, stream, tuning);
      // At M <= 8, kWideBits5 against kWarpKPair (see Tiling::kWideBits5):
      //  * Where its ring has 3 stages (M <= 3) the plans decide, its chunk at terms::kWideBits5Price
      //    kWarpKPair chunks (M = 1..3: within 0.4 % of the faster tiling on average).
      //  * With 2 stages (M = 4..8) it pays only where it turns kWarpKPair's two rounds of items,
      //    or its cluster, into one round of whole items on single CTAs that each stream fewer
      //    chunks than the deep ring is for (terms::kDeepRingMinChunks): wide5_one_round.
      if constexpr (has_wide && MT == 1)
        if (ws && !forced_variant) {
          using L1 = Launcher<BITS, A, 1, Tiling::kWarpKPair, true>;
          const auto p1 = L1::plan(a, tuning);
          const auto pw = LW::plan(a, tuning);
          bool wide = pw.error.empty() && !p1.error.empty();  // (only the wide tiling can run)
          if (p1.error.empty() && pw.error.empty()) {
            if (pw.stages >= 3) {
              wide = pw.cost < p1.cost;
            } else {
              const bool pair_one_round = p1.ks == 1 && p1.items <= p1.ncl;
              const int chunks = ceil_div(pw.KB, LW::Cfg::kKCH);  // (an item's: ks is 1)
              const bool wide5_one_round = pw.ks == 1 && !pw.balanced && pw.items <= pw.ncl &&
                                           chunks < terms::kDeepRingMinChunks;
              wide = !pair_one_round && wide5_one_round;
            }
          }
          if (wide) return LW::launch(a, stream, tuning, pw);
          return L1::launch(a, stream, tuning, p1);
        }
      if constexpr (MT == 2 && MT <= kWsMaxMT)
        if (ws && !forced_variant) {
          using L0 = Launcher<BITS, A, 2, Tiling::kWarpKBlock, true>;
          using L1 = Launcher<BITS, A, 2, Tiling::kWarpKPair, true>;
          const auto p0 = L0::plan(a, tuning);
          const auto p1 = L1::plan(a, tuning);
          const bool pair = p1.error.empty() && (!p0.error.empty() || p1.cost <= p0.cost);
          double best = pair ? p1.cost : p0.error.empty() ? p0.cost : 1e300;
          LaunchPlan pw;
          pw.error = "not planned";
          if constexpr (has_wide)
            if (a.m <= 16) pw = LW::plan(a, tuning);
          const bool wide = pw.error.empty() && pw.cost < best;
          if (wide) best = pw.cost;
          // The N-split tiling where its plan is shorter (costs in the same unit; a caller's
          // report gets both: the 16-row tilings' best, kWideBits5 included, and the N-split tiling's).
          bool taken = false;
          std::string out = with_nsplit(act_tag, [&](auto ln) {
            using LN = decltype(ln);
            const auto pn = LN::plan(a, tuning);
            if (tuning && tuning->report) {
              tuning->report->planned_rows16_cost = best < 1e300 ? best : -1.0;
              tuning->report->planned_nsplit_cost = pn.error.empty() ? pn.cost : -1.0;
              tuning->report->planned_nsplit_price = pn.price;
            }
            if (!pn.error.empty() || pn.cost >= best) return std::string();
            taken = true;
            return LN::launch(a, stream, tuning, pn);
          });
          if (taken) return out;
          if constexpr (has_wide)
            if (wide) return LW::launch(a, stream, tuning, pw);
          if (pair) return L1::launch(a, stream, tuning, p1);
          return L0::launch(a, stream, tuning, p0);
        }
      if constexpr (MT <= 2)
        if (variant == Tiling::kWarpKPair) return by_ws(act_tag, mt_tag, KPair{});
      return by_ws(act_tag, mt_tag, KBlock{});
    };
    if (a.dtype == DType::kBF16) return with(ActTag<ActBF16>{});
    return with(ActTag<ActF16>{});
  };
  switch (mt) {
    case 1: return by_act(std::integral_constant<int, 1>{});
    case 2: return by_act(std::integral_constant<int, 2>{});
    case 4: return by_act(std::integral_constant<int, 4>{});
    default: return by_act(std::integral_constant<int, 8>{});
  }
}

}  // namespace kbit::cuda::fused
