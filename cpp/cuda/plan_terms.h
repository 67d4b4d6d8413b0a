// The measured terms of the matmul launchers' choices, in one place: which kernel takes a product
// (by rows), the fused kernel's tiling, cluster size, chunk-balanced clusters and ring depth, and
// the wgmma kernel's tile. Each term says what it stands for and the measurement that set it;
// the launchers (matmul.cu's dispatch, matmul_fused.cuh, matmul_fused_plan.cuh, matmul_wgmma.cuh)
// compute their plans from these and from the problem's and the device's sizes only.
//
// The fused kernel's plan is a critical path in one unit, the chunk time of its kWarpKBlock tiling
// at the same rows (Planner::plan): a tiling's chunk price times the chunks a cluster streams, plus
// its item ends. Prices and item ends were fitted together on harness timings with every tiling and
// cluster size forced (`tools/kernel_profile.sh tiles`, `sweep`, `balance`), so they change together.
// Choices that are rules rather than terms (the tiling at M <= 8; bits 5's wide tiling at
// M = 4..8) are explained where they are made, in launch_fused_bits (matmul_fused.cuh).
#pragma once

#include <cstdint>

namespace kbit::cuda::terms {

// ---- Which kernel takes the product, by rows ----

// The largest M the warp-specialized fused kernel takes, in blocks of 8 kWsMaxMT rows or kNSplit's
// 32 or 64 (the blocks of one column group run on neighbouring clusters, so the weights come from
// DRAM about once); above it the cp.async kernel. At M = 17..64 it takes 0.28-0.83x the cp.async
// kernel's time (median 0.50-0.60x), at M = 128 0.50-0.87x (ten shapes x bits 2, 4, 5).
constexpr int kWsMaxRows = 128;

// Rows of x for which bf16 and fp16 products take the wgmma kernel (matmul_wgmma.cuh) instead of
// matmul_fused.cuh's. The rule is fitted on bf16 products, whose alternatives in matmul_fused.cuh
// are the faster (fp16 has no scaled-weights N-split path), so fp16 takes the same rows. Timed
// with both kernels on every case (H200, the ten benchmark shapes and Llama-3-70B's per-device
// layers at TP 2 and 4, bits 2-5, M = 17..64, launched as JAX runs them):
//  * From 40 rows the wgmma kernel is the faster on every case (the N = 2048 layers at bits 2-4
//    included), so every product takes it from kWgmmaMinRows.
//  * At 17..32 it wins on every N of 2560..8192 (the Llama-3-70B layers at TP 1-4: 0.62-0.98x
//    the fused kernel's time) but Llama-3-8B down (K 14336, N 4096) at bits 3-4, at bits 5 on
//    every N, and on the wide layers of at most 48 Mi weights (Qwen3 gate/up at bits 2, M = 17:
//    9.5 against 15.1 us, where the fused kernel's 16-row blocks leave 160 items for 132 SMs);
//    the fused kernel keeps the Llama gate/up layers (N >= 14336, by 1.04-1.12x) and N = 2048 at
//    bits 2-4 (by up to 1.10x). The rule below (kWgmmaEarly*) is within 0.5 % of the faster
//    kernel on (geometric) average over those cases, 8.3 % at worst (Qwen3 q, bits 2).
//  * Up to 1024 rows at bits 2-4 it takes 0.67-0.98x the time of dequantize + dense dot on the
//    ten shapes (at 2048: 0.85-1.15x, slower on half); at bits 5, 0.81-1.19x at M = 768..1024,
//    so bits 5 stops at 512.
constexpr int kWgmmaMinRows = 33, kWgmmaEarlyMinRows = 17, kWgmmaMaxRows = 1024, kWgmmaWideBitsMaxRows = 512;
// Early: bits 5 at any N; else N >= 2560 with K * N <= 48 Mi weights, or N of 5120..8192.
constexpr int kWgmmaEarlyBits = 5, kWgmmaEarlyMinN = 2560;
constexpr int64_t kWgmmaEarlyMaxWeights = int64_t(48) << 20;
constexpr int kWgmmaEarlyBandMinN = 5120, kWgmmaEarlyBandMaxN = 8192;
// (matmul.cu's wgmma_rule_rows applies the rule.)

// ---- The fused kernel's tilings: a chunk's price ----
// A chunk's time in kWarpKBlock chunks of the same MT: the unit in which the launcher compares
// the tilings' plans (launch_fused_bits, at M > 8 on the warp-specialized kernel; Config::chunk_cost
// picks the tiling's entry). The prices are fitted on harness timings with every tiling forced
// (H200 and H100; 10-17 shapes x bits 2..5 x M 9..128), so that the plan picks the faster tiling.

// kWarpKPair at MT = 2 (twice the columns at bits 2..4): 1.0 in one block of rows (M <= 16) at
// bits 2 and 4, else 1.4. (At 1.4 for M <= 16 kWarpKBlock ran Qwen3 q and o, where kWarpKPair
// takes 0.85-0.96x its time; 1.0 at M > 16 took Llama-3-70B gate/up at M = 32 from kNSplit:
// 70 -> 88 us.)
constexpr double pair_price(int bits, bool one_block_of_rows) { return bits == 3 || !one_block_of_rows ? 1.4 : 1.0; }

// kNSplit, bf16: at MT = 2 0.4 at bits 2 and 4, 0.8 at bits 3 and 5 (bits 3's decode is slower
// there; 0.6 at bits 5 would take the Llama-3-70B down layers at M = 9, 1.35-1.38x the time); at
// MT = 4 0.9 (with an item end of 1.25 chunks per cluster rank, item_end_chunks), at MT = 8 1.3:
// the faster tiling's time within 0.6 % on average, 22 % at worst (a small N = 2048 shape at
// M = 128).
// kNSplit, fp16: fp16 takes kNSplit's slower scale path (mma_k_block_scaled_weights is bf16
// only), so its prices are per bits value: within 0.49 % of the faster tiling on average over
// 572 cases, 13 % at worst (Llama-3-70B down, M = 24). At MT = 4 no price separates Qwen3 and
// GLM-4.7 gate/up (kNSplit faster by up to 1.13x) from the Llama-3-70B down layers (slower by up
// to 1.16x); 0.9 keeps the small layers, which are nearest the dense dot's time.
constexpr double nsplit_price(bool bf16, int bits, int mt) {
  if (bf16) return mt == 2 ? (bits == 3 || bits == 5 ? 0.8 : 0.4) : mt == 4 ? 0.9 : 1.3;
  return mt == 2   ? (bits == 3 ? 0.8 : bits == 5 ? 0.95 : 0.4)
         : mt == 4 ? 0.9
                   : (bits == 2 ? 2.1 : bits == 5 ? 1.6 : 1.7);
}

// kWideBits5's chunk in kWarpKBlock chunks of MT = 2: with it the plan picks a tiling within
// 0.5 % (bf16) and 1.1 % (fp16) of the fastest on (geometric) average over 17 shapes x M 9, 12,
// 16, 9 % at worst (Qwen3 q at M = 16). 1.65 would take GLM-4.7 gate/up (1.09x the time), 1.76
// would give Llama-3-70B gate/up at M = 9 back to kNSplit (1.09x).
constexpr double kWideBits5Price = 1.72;

// ---- The fused kernel's cluster size (k-split): an item's end ----
// Planner::plan takes the cluster size that minimizes the critical path: the most items a cluster
// processes times (the chunks per item + the item's end, in chunk times). Without a cluster the
// end is half a chunk. In a cluster, rank 0 waits for, reads and adds every rank's sum, so in the
// warp-specialized kernel an item's end grows with the cluster size: 1 + ks / 2 chunks, fitted to
// every cluster size timed (17 shapes x bits 2, 4, 5 x M 1, 16, cluster sizes 1..8): it picks
// sizes within 0.04 % of the best on (geometric) average, 3.2 % at worst (a flat 1 chunk: 2.0 %
// and 1.41x). The cp.async kernel keeps the flat cost.
// The N-split tiling's item end per cluster rank: at 32 rows rank 0 reads every rank's 32
// accumulators per lane through distributed shared memory, ~6 us at 5 ranks on Qwen3 gate/up; at
// 64 rows twice as many: 2.5 per rank. At 0.5 the plan takes one 64-row block over 8-CTA clusters
// for Llama-3-70B q/k/v at TP 4 (K 8192, N 2560) at M = 56 and 64, 1.11-1.24x the time of 16-row
// blocks. At 16 rows 1.0, fitted with the prices (nsplit_price): at 0.5 the same layer at
// M = 9..16 runs in 8-CTA clusters, 1.26-1.31x the time of kWarpKPair.
constexpr double item_end_chunks(int ks, bool warp_specialized, bool nsplit, int mt) {
  const double rank_end = !nsplit ? 0.5 : mt == 2 ? 1.0 : mt == 4 ? 1.25 : 2.5;
  return ks == 1 ? 0.5 : warp_specialized ? 1.0 + rank_end * ks : 1.0;
}

// ---- Chunk-balanced clusters (ItemWalk) against the uniform k-split ----
// Every rank of a cluster streams the same number of chunks of the cluster's items, so an item
// count that the clusters do not divide costs no idle ranks. Its critical path: a rank's chunks,
// its pieces' ends (kPieceEnd each, as a whole item's) and the owner's wait for the ranks that
// share its item (kSharerWait each). The launcher takes it at clusters of at most
// kBalancedMaxRanks where that path is at most kBalancedGain of the uniform split's. Both splits
// timed on the ten shapes and a Llama-3-70B layer, without those limits: 0.85-0.95x the time where
// the uniform split leaves the last round of items on under half the SMs (Llama-3-70B gate/up: 56
// chunks per CTA instead of 64), but 1.02-1.09x where its path is only 7-9 % shorter (GLM-4.7
// gate/up with 32-column groups: the uniform split's last round, on 56 of 132 SMs, runs faster per
// chunk than the path counts) and 1.03-1.09x at 8-CTA clusters (120 CTAs; Llama-3-70B q/k/v and
// gate/up at TP 4).
constexpr double kPieceEnd = 0.5, kSharerWait = 0.5;
constexpr int kBalancedMaxRanks = 4;
constexpr double kBalancedGain = 0.9;
// In one block of 8 rows (MT = 1) of the dense product the path may be 0.95 of the uniform
// split's: a CTA's last piece ends there as a whole item does (ItemReducer::finish_last_piece),
// and Llama-3-8B gate/up (K 4096, N 28672: 448 items, 28 chunks a rank against 32) takes 0.93x
// the time balanced at M = 1 and 8 (H200, bits 4: 23.4 us against 25.2). On the ten layers and
// Llama-3-70B's at TP 1, 2 and 4 it picks nothing else than 0.9 does at M = 1 and 8 (bits 2 and
// 3 plan as bits 4 there).
constexpr double kBalancedGainOneTile = 0.95;

// ---- The fused kernel's ring (warp-specialized kernel) ----
// The weight bytes the ring keeps in flight at most, per SM (stages - 1 chunks). 48 KiB changed
// the Llama-3-70B layer's times by 0-2 %; 96 KiB read 0.96-1.08x the time at M <= 8 (bits 3 up to
// 4 % slower): the copies' latency is not what limits the chunk rate.
constexpr int kRingMaxKiB = 64;
// Chunks per CTA from which a launch with fewer rows than its tiling's most takes the deeper
// ring those rows leave room for: more copies in flight at the start delay the first chunk (bits
// 5, M = 1, 6 stages instead of 4: Llama-3-70B gate/up 0.96x the time, but Qwen3 down, ~5 chunks
// per CTA, 1.04x).
constexpr int kDeepRingMinChunks = 16;

// ---- The wgmma kernel's tile (WgLauncher::cost) ----
// A plan's time in units of one k-block of a 256-column tile, fitted to harness sweeps (H100,
// 14 shapes x bits 2, 4, 5 at M = 32, 48, 64, 128; every cluster size of both tiles):
// time = c_J (35 + kps) waves, with c_2 = 1 (0.40 us per k-block at BM = 128, bits 4) and
// c_1 = 0.7 at BM = 128, 0.8 at BM = 64 (half the columns, but x is read twice per weight
// column, a larger share at fewer rows). The 35 k-blocks are the launch's fixed cost (~15 us at
// J = 2, ~9.5 at J = 1, BM = 128). Picking the tile by it loses 0-0.3 % on average against the
// faster tile at its best cluster size (worst case 7.5 %, at M = 32).
// A split last round adds its whole rounds at 35 + kb each.
// BM = 256 (J = 1, a 256 x 128 tile: the area of J = 2 at BM = 128) costs 0.9: each decoded
// weight feeds twice the rows. Fitted on 247 harness cases (H200, 13 shapes x bits 2, 4, 5 x
// M 192..2048, both row tiles timed) with an offline replica of the plan, it picks the row tile
// within 0.4 % of the faster one on (geometric) average, 13.5 % at worst (N = 2048 layers at
// M = 640, whose 128-row plan splits K over 3 ranks: the cluster sum is not in the model).
// Always taking 256 rows is 3.8 % off on average and 1.55x at worst: at M = 320 and 384,
// 256-row tiles pad a third of their rows and can leave part of the GPU idle (Llama-3-70B q/k/v
// at TP 2, M = 384: 80 tiles of 256 rows against 120 CTAs of 128).
constexpr double wg_kblock_time(int j, int bm) { return j == 2 ? 1.0 : bm == 64 ? 0.8 : bm == 256 ? 0.9 : 0.7; }
constexpr double kWgFixedKBlocks = 35.0;
// A k-split sum by pull adds 2 + ks (in the same units, ~0.34 us each on the H200): fitted on
// harness timings (13 shapes x bits 2, 4, 5 x M 64..512, every tile timed with its plan), where
// a forced pull takes 0.5-1.4 us longer than the push at 2-3 ranks and 1.5-2.5 us at 5-8.
// Without the term the plan takes 256-row tiles that pull over 6 ranks where 128-row tiles push
// over 3 (Qwen3 o at M = 256: 22.0 against 18.4 us). With it, the pick is within 0.04 % of the
// fastest tile on (geometric) average and 4.3 % at worst, against 0.8 % and 19.7 % without.
constexpr double wg_pull_kblocks(int ks) { return 2.0 + ks; }
// Warpgroup pairs (WgConfig::kGroups: J = 1 at BM = 64 and 128) take a share of a k-block's
// time, the fixed cost unchanged. At BM = 64, kPairKBlock64: fitted on harness timings (H200,
// 13 shapes x bits 2, 4, 5 x M 17, 32, 48, 64, both tiles timed with their plans) by an offline
// replica of the plan, 0.6-0.65 picks the faster tile within 0.26 % on (geometric) average,
// 7.9 % at worst (Qwen3 gate/up, bits 4, M = 17); 0.8 is 1.0 % and 10.7 % off, 0.5 takes the
// 128-column tile on Llama-3-70B q/k/v at TP 2 (1.18x the time), 0.9 the 256-column one on its
// down layer (1.33x). At BM = 128, kPairKBlock128: fitted the same way on H100 (13 shapes x
// bits 2-4 x M 96..512, every tile of 128 and 256 rows timed with its plan), 0.7-0.75 picks
// within 0.2 % of the fastest tile on average, 9.1 % at worst; 0.65 takes 128 x 128 on
// Llama-3-70B down at M = 256 (1.22x the 256-row tile's time), 0.8 128 x 256 on its q/k/v at
// TP 2, M = 384 (1.11x).
// The 64-column tile (WG = 1, four single warpgroups): kQuadKBlock64 of a k-block (half the
// pairs' columns over twice the groups) and kQuadFixed64 of the fixed cost. On H100 timings
// (13 shapes x bits 2-5 x M 17..64, every tile timed with its plan; an offline replica of the
// choice) these pick within 1.2 % of the fastest tile on (geometric) average, as the best of a
// grid of both; without the tile 2.6 % (Llama-3-8B down: 1.22x at worst).
constexpr double kPairKBlock64 = 0.65, kPairKBlock128 = 0.75;
constexpr double kQuadKBlock64 = 0.35, kQuadFixed64 = 35.0;

}  // namespace kbit::cuda::terms
