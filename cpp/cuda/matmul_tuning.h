// Knobs of launch_matmul for benchmarks and tests (the C++ harness, tools/sanitize_case.py's
// cases go through the FFI and use none): forcing a kernel, a tiling or a cluster size, and a
// report of what the launcher chose. The product passes no tuning (nullptr): the launchers decide.
#pragma once

namespace kbit::cuda {

// The wgmma kernel's k-split cluster sum (MatmulLaunchReport::cluster_sum, matmul_wgmma.cuh):
// each rank's rows pushed to their owners, or pulled by them; a pull loads every rank's rows of
// an item before its first add up to kPullBatchMaxRanks ranks, rank by rank above.
constexpr int kClusterSumPush = 1, kClusterSumPull = 2;
constexpr int kPullBatchMaxRanks = 3;

// What a matmul launcher chose, written where MatmulTuning::report points.
struct MatmulLaunchReport {
  int k_split = 0;      // CTAs per cluster that split K
  int ctas = 0;         // CTAs launched
  int balanced = 0;     // 1: chunk-balanced clusters (matmul_fused_walk.cuh's ItemWalk)
  int wg_columns = 0;   // the wgmma kernel's weight tile columns (0: another kernel)
  int whole_ctas = 0;   // the wgmma kernel's CTAs that computed a whole tile each before a split
                        // last round (0: none)
  int cluster_sum = 0;  // the wgmma kernel's cluster sum: kClusterSumPush or kClusterSumPull (0: no k-split)
  int variant = -1;     // the tiling, as MatmulTuning::variant
  int rows = 0;         // rows of its blocks of M
  // matmul_fused.cuh's launcher: the launched plan's cost (in chunk times of the
  // Tiling::kWarpKBlock tiling of its MT) and its chunk's price in that unit (Config::chunk_cost);
  // the wgmma kernel's launcher sets both to 0.
  double plan_cost = 0, chunk_price = 0;
  // matmul_fused.cuh's launcher at M > 8 on the warp-specialized kernel: the cost of its 16-row
  // plan (whichever 16-row tiling it takes), of the N-split plan, and the N-split chunk's price in
  // that cost; -1 where a plan cannot be made, 0 where that launcher did not compare them. The
  // N-split tiling is taken where its cost is lower.
  double planned_rows16_cost = 0, planned_nsplit_cost = 0, planned_nsplit_price = 0;
};

struct MatmulTuning {
  int k_split = 0;             // CTAs per thread-block cluster that split K (1..8); 0 = heuristic
  bool force_generic = false;  // use the slow SIMT kernel even where the fused one applies
  int variant = -1;            // the tiling (Tiling in matmul_fused_config.cuh): 0 kWarpKBlock, 1 kWarpKPair
                               // (the 8- and 16-row tilings), 2 kNSplit (16, 32 or 64 rows, warp-specialized
                               // kernel only), 3 the wgmma kernel (bf16 and N % 16 == 0 on sm_90a only), 4
                               // kWideBits5 (bits 5, M <= 16, warp-specialized kernel only); -1 = the launcher
                               // picks; -2 = matmul_fused.cuh's launcher picks (never the wgmma kernel)
  int ws_max_rows = -1;        // M up to which the warp-specialized kernel runs; -1 = default
  int min_m_tiles = 0;         // warp-specialized kernel: blocks of at least this many n8 row tiles (2:
                               // the 16-row tilings, whose kWarpKBlock has 32-column groups, even at
                               // M <= 8); 0 = ceil(M / 8)
  int wg_columns = 0;          // wgmma kernel, M <= 128: the weight tile's columns, 256, 128 or (M <= 64)
                               // 64; 0 = the launcher picks (WgLauncher::cost)
  int balance = -1;            // chunk-balanced clusters: 1 = wherever possible (at k_split if set), 0 =
                               // never (uniform k-split), -1 = the launcher picks (KBIT_JAX_BALANCE=0: never)
  int wg_rows = 0;             // wgmma kernel above 128 rows: the row tile, 128 or 256; 0 = the launcher
                               // picks (WgLauncher::cost)
  int wg_split_last = -1;      // wgmma kernel: a last round of tiles that fills half the GPU or less split over
                               // 2-CTA clusters (WgLauncher::plan): 1 = wherever so, 0 = never, -1 = the
                               // launcher picks (ignored where k_split is set)
  int dependent = -1;          // warp-specialized kernel: 1 = a programmatic dependent launch even while the
                               // stream is captured (a chain of kernels in one graph), 0 = a plain launch,
                               // -1 = dependent_launch_enabled decides
  MatmulLaunchReport* report = nullptr;  // where the launcher writes what it chose (or nowhere)
};

}  // namespace kbit::cuda
