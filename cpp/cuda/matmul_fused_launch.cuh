// Host launch of the fused matmul in one tiling, with a plan (matmul_fused_plan.cuh): the
// kernel's parameters, the warp-specialized kernel's tensor maps, and the cluster launch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common.cuh"
#include "cuda/dependent_launch.cuh"
#include "cuda/fast_div.cuh"
#include "cuda/matmul_fused_plan.cuh"
#include "cuda/tma.cuh"

namespace kbit::cuda::fused {

// kGrouped: the grouped product (kbit_ragged_dot) of `a` with batch = G experts and x, y of M rows
// for all of them, with a plan from Planner::plan_grouped and the group sizes in `grp`.
template <int BITS, class Act, int MT, int V, bool WS, bool kGrouped = false>
struct Launcher : Planner<BITS, Act, MT, V, WS, kGrouped> {
  using P = Planner<BITS, Act, MT, V, WS, kGrouped>;
  using typename P::Cfg;
  using typename P::Plan;
  using P::kernel;
  using P::kThreads;
  using P::name;
  using P::plan;
  using P::shape;

  static std::string launch(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
    return launch(a, stream, tuning, plan(a, tuning));
  }
  // Launch with a plan already made (launch_fused_bits plans both tilings to choose one).
  static std::string launch(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning, const Plan& pl,
                            const GroupParams& grp = GroupParams{}) {
    if (!pl.error.empty()) return pl.error;
    const int KB = pl.KB, ks = pl.ks, kps = pl.kps, x_rows = pl.x_rows;
    const int64_t ncl = pl.ncl;
    const size_t smem = pl.smem;
    if (tuning && tuning->report) {
      MatmulLaunchReport& r = *tuning->report;
      r.k_split = ks;
      r.ctas = static_cast<int>(ncl * ks);
      r.balanced = pl.balanced ? 1 : 0;
      r.wg_columns = 0;
      r.whole_ctas = 0;
      r.cluster_sum = 0;
      r.variant = V;
      r.rows = 8 * MT;
      r.plan_cost = pl.cost;
      r.chunk_price = pl.price;
    }

    Params prm;
    copy_operands(a, prm);
    prm.M = a.m;
    prm.N = static_cast<int>(a.n);
    prm.KB = KB;
    prm.kb_per_split = std::max(kps, 1);
    prm.k_split = ks;
    prm.balanced = pl.balanced ? 1 : 0;
    prm.col_groups = static_cast<int>(pl.col_groups);
    prm.m_blocks = static_cast<int>(pl.m_blocks);
    prm.items = kGrouped ? 0 : static_cast<int>(pl.items);  // (grouped: the device's schedule counts them)
    prm.x_rows = x_rows;
    prm.stages = WS ? pl.stages : Cfg::kStages;
    prm.vec16 = ((a.n * BITS) % 4 == 0 && (reinterpret_cast<uintptr_t>(a.planes) & 15) == 0) ? 1 : 0;
    prm.scale_bytes = a.batch * int64_t(KB) * a.n;
    // (the cp.async kernel does not keep dependent_launch.cuh's contract: plain launches)
    const bool dependent =
        WS && (tuning && tuning->dependent >= 0 ? tuning->dependent == 1 : dependent_launch_enabled(stream));
    prm.inputs_ready = dependent ? 0 : 1;
    prm.glu = a.glu;
    const WalkDivs dv{FastDiv(ks), FastDiv(static_cast<int>(ncl)), FastDiv(static_cast<int>(pl.m_blocks)),
                      FastDiv(static_cast<int>(pl.col_groups)), FastDiv(ceil_div(KB, Cfg::kKCH))};

    const ClusterLaunch launch(static_cast<unsigned>(ncl * ks), kThreads, smem, stream, ks, dependent);
    const std::string where = shape(a) + " k_split=" + std::to_string(ks) + " ctas=" + std::to_string(ncl * ks) +
                              " smem=" + std::to_string(smem);
    cudaError_t err;
    if constexpr (WS) {  // the tensor maps of the kernel's three copies (see its header)
      CUtensorMap wmap, smap, xmap;
      const uint64_t rows = uint64_t(a.batch) * KB, n = uint64_t(a.n);
      // A column group wider than a box dimension allows (256 words; kNSplit, kWideBits5): the map
      // splits the columns into 16-column pieces, {16 BITS words, N / 16 pieces, rows}; the box of
      // COLS / 16 pieces lands in shared memory in the same order as a 2-D box would.
      constexpr bool pieces = Cfg::kPieceMap;
      constexpr int w_rank = pieces ? 3 : 2;
      const uint64_t w_dims[3] = {pieces ? 16 * BITS : n * BITS, pieces ? n / 16 : rows, rows};
      const uint64_t w_strides[2] = {pieces ? 16 * BITS * 4 : n * BITS * 4, n * BITS * 4};
      const uint32_t w_box[3] = {uint32_t(pieces ? 16 * BITS : Cfg::kCols * BITS),
                                 uint32_t(pieces ? Cfg::kCols / 16 : Cfg::kKCH), uint32_t(Cfg::kKCH)};
      const uint64_t s_dims[2] = {n, rows}, s_strides[1] = {n};
      const uint32_t s_box[2] = {uint32_t(Cfg::kCols), uint32_t(Cfg::kKCH)};
      const uint64_t x_dims[3] = {32, uint64_t(kGrouped ? a.m : a.batch * a.m), uint64_t(KB)};
      const uint64_t x_strides[2] = {uint64_t(a.k) * 2, uint64_t(kXKbBytes)};
      const uint32_t x_box[3] = {32, uint32_t(x_rows), uint32_t(Cfg::kKCH)};
      std::string bad = encode_tensor_map(&wmap, CU_TENSOR_MAP_DATA_TYPE_UINT32, w_rank, a.planes, w_dims,
                                          w_strides, w_box, CU_TENSOR_MAP_SWIZZLE_NONE);
      if (bad.empty())
        bad = encode_tensor_map(&smap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.scales, s_dims, s_strides, s_box,
                                CU_TENSOR_MAP_SWIZZLE_NONE);
      if (bad.empty())
        bad = encode_tensor_map(&xmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, a.x, x_dims, x_strides, x_box,
                                CU_TENSOR_MAP_SWIZZLE_64B);
      if (!bad.empty()) return std::string(name()) + ": " + bad + " (" + where + ")";
      if constexpr (kGrouped)
        err = cudaLaunchKernelEx(&launch.cfg, kernel, prm, dv, wmap, smap, xmap, grp);
      else
        err = cudaLaunchKernelEx(&launch.cfg, kernel, prm, dv, wmap, smap, xmap);
    } else {
      err = cudaLaunchKernelEx(&launch.cfg, kernel, prm, dv);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear
      return std::string(name()) + " failed to launch: " + cudaGetErrorName(err) + " (" +
             cudaGetErrorString(err) + ") for " + where;
    }
    return check_launch(name(), where);
  }
};

}  // namespace kbit::cuda::fused
