// Host planning of a fused-matmul launch for one tiling: the shared memory it reserves, the
// cluster size (k-split) and chunk-balanced clusters, the ring depth, and the critical path's
// estimated length in the tilings' common unit, which launch_fused_bits (matmul_fused.cuh)
// compares to choose the tiling. Per-device facts and per-(kernel, device) settings are cached
// (see common.cuh's device_sm_count) in the class template, so each kernel instantiation has
// its own.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/matmul_fused_config.cuh"
#include "cuda/matmul_fused_cp_async.cuh"
#include "cuda/matmul_fused_ws.cuh"

namespace kbit::cuda::fused {

// n8 tiles along M for a problem with M rows (blocks of 64 rows above that).
inline int m_tiles(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

// Whether the launcher may choose chunk-balanced clusters (ItemWalk): yes unless the environment
// has KBIT_JAX_BALANCE=0 (read once per process; for comparisons).
inline bool balanced_clusters_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("KBIT_JAX_BALANCE");
    return v == nullptr || v[0] != '0';
  }();
  return enabled;
}

// How a launch covers the problem: shared memory, cluster size (k-split) and clusters, and the
// critical path's estimated length in chunk times of the kWarpKBlock tiling of its MT (`cost`),
// which launch_fused_bits compares between the tilings. `error` is set if the shared memory
// cannot be reserved. (Planner::plan makes it.)
struct LaunchPlan {
  size_t smem = 0;
  int x_rows = 0, KB = 0, ks = 1, kps = 1, stages = 0;
  bool balanced = false;  // chunk-balanced clusters (ItemWalk) instead of a uniform k-split
  int64_t col_groups = 0, m_blocks = 0, items = 0, ncl = 0;
  double price = 0;  // the plan's chunk in kWarpKBlock chunks (Planner::chunk_price), the unit of `cost`
  double cost = 0;
  std::string error;
};

// kGrouped: the warp-specialized kernel's grouped product (kbit_ragged_dot; plan_grouped).
template <int BITS, class Act, int MT, int V, bool WS, bool kGrouped = false>
struct Planner {
  static_assert(WS || !kGrouped, "the grouped product runs on the warp-specialized kernel");
  using Cfg = Config<BITS, MT, V>;
  static constexpr auto kernel = [] {  // instantiates only the kernel it launches
    using GroupedKernel = void (*)(Params, WalkDivs, CUtensorMap, CUtensorMap, CUtensorMap, GroupParams);
    if constexpr (kGrouped) return static_cast<GroupedKernel>(&kbit_matmul_ws_kernel<BITS, Act, MT, V, GroupParams>);
    else if constexpr (WS) return &kbit_matmul_ws_kernel<BITS, Act, MT, V>;
    else return &kbit_matmul_fused_kernel<BITS, Act, MT, V>;
  }();
  static constexpr int kThreads = std::conditional_t<WS, WsConfig<BITS, MT, V>, Cfg>::kThreads;
  static std::atomic<int>& smem_set(int dev) {
    static std::atomic<int> v[kMaxDevices];
    return v[dev];
  }
  // Resident clusters of `ks` CTAs at `smem` bytes (cached per device and ks, keyed by smem).
  static int max_clusters(int dev, int ks, size_t smem) {
    static std::atomic<int64_t> cache[kMaxDevices][9];
    std::atomic<int64_t>& slot = cache[dev][ks];
    const int64_t c = slot.load(std::memory_order_relaxed);
    if (c > 0 && (c >> 32) == int64_t(smem)) return int(c & 0xffffffff);
    const int n = query_max_active_clusters(kernel, kThreads, smem, ks, dev);
    slot.store((int64_t(smem) << 32) | int64_t(n), std::memory_order_relaxed);
    return n;
  }

  static const char* name() {
    return kGrouped ? "kbit_ragged_dot_ws_kernel" : WS ? "kbit_matmul_ws_kernel" : "kbit_matmul_fused_kernel";
  }
  static std::string shape(const MatmulArgs& a) {
    return (kGrouped ? "G=" : "B=") + std::to_string(a.batch) + " M=" + std::to_string(a.m) + " K=" + std::to_string(a.k) +
           " N=" + std::to_string(a.n) + " bits=" + std::to_string(BITS) + " dtype=" + Act::kName +
           " MT=" + std::to_string(MT) + " tiling=" + std::to_string(V) + " glu=" + std::to_string(a.glu);
  }

  // A chunk's time in kWarpKBlock chunks of this MT (Config::chunk_cost, by the activations' dtype).
  // (`one_block_of_rows`: the launch's M fits one block of 8 MT rows)
  static constexpr double chunk_price(bool one_block_of_rows) {
    return Cfg::chunk_cost(std::is_same_v<Act, ActBF16>, one_block_of_rows);
  }

  // Let the kernel take pl.smem bytes of dynamic shared memory on device dev (else pl.error).
  static bool reserve_smem(int dev, const MatmulArgs& a, LaunchPlan& pl) {
    if (smem_set(dev).load(std::memory_order_relaxed) < int(pl.smem)) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(pl.smem));
      if (err != cudaSuccess) {
        pl.error = std::string(name()) + ": cannot reserve " + std::to_string(pl.smem) +
                   " bytes of shared memory: " + cudaGetErrorString(err) + " (" + shape(a) + ")";
        return false;
      }
      smem_set(dev).store(int(pl.smem), std::memory_order_relaxed);
    }
    return true;
  }

  using Plan = LaunchPlan;
  static Plan plan(const MatmulArgs& a, const MatmulTuning* tuning) {
    Plan pl;
    pl.price = chunk_price(a.m <= 8 * MT);  // (also on a plan that fails: callers report it)
    pl.KB = static_cast<int>(a.k / 32);
    // (kNSplit reads all 8 MT rows of its block without a bound check: the box always has them)
    pl.x_rows = V == Tiling::kNSplit ? 8 * MT : static_cast<int>(std::min<int64_t>(a.m, 8 * MT));
    if constexpr (WS) pl.smem = WsConfig<BITS, MT, V>::smem_bytes(pl.x_rows);
    else pl.smem = Cfg::smem_bytes(pl.x_rows);
    const int dev = current_device();
    if (!reserve_smem(dev, a, pl)) return pl;
    pl.col_groups = (a.n + Cfg::kCols - 1) / Cfg::kCols;
    pl.m_blocks = (a.m + 8 * MT - 1) / (8 * MT);
    pl.items = pl.col_groups * pl.m_blocks * a.batch;
    if (pl.items > 0x7fffffffLL) {
      pl.error = std::string(name()) + ": too many work items for " + shape(a);
      return pl;
    }
    const int KB = pl.KB;
    // k-blocks per cluster rank at cluster size ks; whole chunks in the warp-specialized kernel,
    // whose copies zero-fill only the k-blocks past K (see its header)
    auto split_len = [&](int ks) {
      const int kps = (KB + ks - 1) / ks;
      return WS ? (kps + Cfg::kKCH - 1) / Cfg::kKCH * Cfg::kKCH : kps;
    };
    // Choose the cluster size (k-split) that minimizes the critical path: the most items a
    // cluster processes times (the chunks per item + the item's end, terms::item_end_chunks).
    double best_cost = 1e30;
    int ks_cap = kMaxKSplit;  // (the warp-specialized kernel: as many ranks as its reducer takes)
    if constexpr (WS) ks_cap = WsConfig<BITS, MT, V>::Reducer::kMaxRanks;
    const int ks_max = std::min(ks_cap, std::max(KB, 1));
    // clusters launched at cluster size ks, the items each processes (items > 0: launch_matmul
    // returns before planning an empty product), and the chunks of an item's k-range
    auto clusters = [&](int ks) { return std::min<int64_t>(pl.items, max_clusters(dev, ks, pl.smem)); };
    auto items_per_cluster = [&](int64_t ncl) { return (pl.items + ncl - 1) / ncl; };
    auto chunks_per_item = [&](int kps) { return (kps + Cfg::kKCH - 1) / Cfg::kKCH; };
    // (a cluster size the caller forces, tuning->k_split, excludes the others)
    auto size_allowed = [&](int ks) {
      return !(tuning && tuning->k_split > 0) || ks == std::min(tuning->k_split, ks_max);
    };
    for (int ks = 1; ks <= ks_max; ++ks) {
      if (!size_allowed(ks)) continue;
      const int kps = split_len(ks);
      if ((KB + kps - 1) / kps != ks) continue;  // would leave a rank empty
      const int64_t per_cluster = items_per_cluster(clusters(ks));
      const double chunks = double(chunks_per_item(kps));
      const double item_end = terms::item_end_chunks(ks, WS, V == Tiling::kNSplit, MT);
      const double cost = per_cluster * (chunks + item_end) * pl.price;
      if (cost < best_cost - 1e-9) { best_cost = cost; pl.ks = ks; }
    }
    pl.cost = best_cost;
    pl.kps = split_len(pl.ks);
    pl.ncl = clusters(pl.ks);
    int64_t chunks_per_cta = items_per_cluster(pl.ncl) * chunks_per_item(pl.kps);
    // Chunk-balanced clusters (ItemWalk; the warp-specialized kernel's K-split tilings, whose reducer has
    // receive slots), taken where their critical path is short enough against the uniform
    // split's (plan_terms.h says how much, and why).
    if constexpr (WS && V != Tiling::kNSplit) {
      const int want = tuning && tuning->balance >= 0 ? tuning->balance : balanced_clusters_enabled() ? -1 : 0;
      constexpr int kRecv = WsConfig<BITS, MT, V>::Reducer::kMaxRanks - 1;
      const int nchi = chunks_per_item(KB);
      const double gain = MT == 1 && BITS <= 4 && !kGrouped ? terms::kBalancedGainOneTile : terms::kBalancedGain;
      double best_bal = want == 1 ? 1e30 : gain * best_cost;
      const int ks_top = want == 1 ? ks_max : std::min(ks_max, terms::kBalancedMaxRanks);
      for (int ks = 2; want != 0 && ks <= ks_top; ++ks) {
        if (!size_allowed(ks)) continue;
        const int64_t ncl = clusters(ks), t_hi = items_per_cluster(ncl) * nchi, t_lo = pl.items / ncl * nchi;
        if (t_lo < ks || t_hi * ks >= (int64_t(1) << 31)) continue;  // a rank without chunks; 32-bit walk
        const int64_t per_rank = (t_hi + ks - 1) / ks, fewest = t_lo / ks;
        const int64_t senders = (nchi - 1 + fewest - 1) / fewest;  // most later ranks that share an item
        if (senders > kRecv) continue;
        // (grouped: the device's item count may be below the plan's estimate, so that up to every
        // later rank of the cluster shares an item)
        if (kGrouped && ks - 1 > kRecv) continue;
        const double pieces = double((per_rank + nchi - 1) / nchi + 1);
        const double cost =
            (double(per_rank) + terms::kPieceEnd * pieces + terms::kSharerWait * double(senders)) * pl.price;
        if (cost < best_bal - 1e-9) {
          best_bal = cost;
          pl.balanced = true;
          pl.ks = ks;
          pl.ncl = ncl;
          chunks_per_cta = per_rank;
        }
      }
      if (pl.balanced) {
        pl.cost = best_bal;
        pl.kps = KB;
      }
    }
    if constexpr (WS) {
      // The ring as deep as the launch's rows allow (pl.smem has room for it) where each CTA
      // streams many chunks (terms::kDeepRingMinChunks); where it streams few, the shallower
      // depth of 8 MT rows.
      using WC = WsConfig<BITS, MT, V>;
      // (kWideBits5 at MT = 1: 3 stages against 2, one more copy in flight, at any chunk count)
      const bool deep = chunks_per_cta >= terms::kDeepRingMinChunks || (Cfg::kWide5 && MT == 1);
      pl.stages = deep ? WC::stages(pl.x_rows) : WC::stages(8 * MT);
    }
    return pl;
  }

  // The grouped product (kbit_ragged_dot) of `a` (batch = G experts, m = M rows of x in all):
  // the item count is known only on the device (the schedule of group_sizes), so the plan (cluster
  // size, chunk-balanced clusters, ring depth) is made for an estimate: min(G, M) active experts
  // of ceil(M / active) rows each, what uniform top-k routing gives once tokens outnumber experts
  // and an upper bound on the active experts below that. The ring's slots then get the rows a
  // block of activations may hold (min(M, 8 MT): a box may reach into the next groups), and the
  // schedule's shared memory follows the ring: the ring loses stages where it does not fit, and
  // a G whose schedule leaves no room for two stages is an error naming G.
  static Plan plan_grouped(const MatmulArgs& a, const MatmulTuning* tuning = nullptr) {
    static_assert(kGrouped, "plan_grouped plans the grouped kernel");
    using WC = WsConfig<BITS, MT, V>;
    const int64_t active = std::max<int64_t>(1, std::min(a.batch, a.m));
    MatmulArgs est = a;
    est.batch = active;
    est.m = (a.m + active - 1) / active;
    Plan pl = plan(est, tuning);
    if (!pl.error.empty()) return pl;
    // the most items any group sizes give: every block of rows plus one partial block per group
    const int64_t items_max = pl.col_groups * ((a.m + 8 * MT - 1) / (8 * MT) + active);
    const int64_t chunks_item = (pl.KB + Cfg::kKCH - 1) / Cfg::kKCH;
    if (items_max >= (int64_t(1) << 31) || (pl.balanced && items_max * chunks_item * pl.ks >= (int64_t(1) << 31))) {
      pl.error = std::string(name()) + ": too many work items for " + shape(a);
      return pl;
    }
    pl.x_rows = V == Tiling::kNSplit ? 8 * MT : static_cast<int>(std::min<int64_t>(a.m, 8 * MT));
    const size_t sched = group_sched_bytes(a.batch);
    int d = std::min(pl.stages, WC::stages(pl.x_rows));
    while (d >= 2 && WC::fixed_bytes() + size_t(d) * WC::slot_bytes(pl.x_rows) + sched > size_t(kMaxSmem)) --d;
    if (d < 2) {
      const size_t room = size_t(kMaxSmem) - WC::fixed_bytes() - 2 * WC::slot_bytes(pl.x_rows);
      pl.error = std::string(name()) + ": G=" + std::to_string(a.batch) + " groups need " +
                 std::to_string(sched) + " bytes of shared memory for the schedule, at most G=" +
                 std::to_string(int64_t(room >= 264 ? (room - 256) / 8 - 1 : 0)) + " fit next to the ring (" +
                 shape(a) + ")";
      return pl;
    }
    pl.stages = d;
    pl.smem = WC::fixed_bytes() + size_t(d) * WC::slot_bytes(pl.x_rows) + sched;
    reserve_smem(current_device(), a, pl);
    return pl;
  }
};

}  // namespace kbit::cuda::fused
