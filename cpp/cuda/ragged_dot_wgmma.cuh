// kbit_ragged_dot on the wgmma kbit matmul (matmul_wgmma.cuh) in its grouped mode, for prefill
// sizes: the row tile for the rows an expert is expected to get, then the launch. One
// instantiation per bits value (ragged_dot_wgmma_b<bits>.cu), so they compile in parallel;
// ragged_dot.cu chooses between this, the warp-specialized kernel's grouped mode and the SIMT
// kernel.
//
// Every CTA computes one whole tile over all of K (no k-split cluster: at these sizes there are
// many tiles); the grid is the upper bound of tiles, (ceil(M / BM) + min(G, M)) x n_tiles, and the
// CTAs past the device-side count only help write the zero rows (ragged_tiles.cuh). No host
// synchronisation and no allocation: the launch can be captured into a CUDA graph.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/matmul_wgmma.cuh"
#include "cuda/ragged_dot.cuh"

namespace kbit::cuda::wgmma {

template <int BITS, int BM, int J, class Act>
struct GroupedWgLauncher {
  using Cfg = WgConfig<BITS, BM, J, 2>;
  static constexpr auto kernel = &kbit_matmul_wgmma_kernel<BITS, BM, J, 2, Act, WgGroups>;

  static std::string shape(const RaggedDotArgs& a) {  // (built only for messages)
    return "M=" + std::to_string(a.m) + " K=" + std::to_string(a.k) + " N=" + std::to_string(a.n) +
           " G=" + std::to_string(a.groups) + " bits=" + std::to_string(BITS) + " dtype=" + Act::kName +
           " BM=" + std::to_string(BM) + " BN=" + std::to_string(Cfg::kBN) + " glu=" + std::to_string(a.glu);
  }

  static std::string launch(const RaggedDotArgs& a, cudaStream_t stream) {
    const std::string reserved = reserve_wgmma_smem<kernel, Cfg::kSmemBytes>(current_device(), shape(a));
    if (!reserved.empty()) return "kbit_ragged_dot_wgmma_kernel: " + reserved;
    WgParams p{};
    copy_operands(a, p);
    p.M = a.m;
    p.N = static_cast<int>(a.n);
    p.K = static_cast<int>(a.k);
    p.KB = static_cast<int>(a.k / 32);
    p.glu = a.glu;
    p.ks = 1;
    p.kps = p.KB;
    p.n_tiles = ceil_div(a.n, Cfg::kBN);
    const int64_t row_tiles = (a.m + BM - 1) / BM + std::min(a.groups, a.m);  // (an upper bound)
    const int64_t ctas = row_tiles * p.n_tiles;
    if (ctas > 0x7fffffffLL) return "kbit_ragged_dot_wgmma_kernel: too many tiles for " + shape(a);
    p.m_tiles = static_cast<int>(row_tiles);
    p.tail_rows = BM;
    p.whole_ctas = static_cast<int>(ctas);  // (every CTA a whole tile)
    p.ks_div = FastDiv(1);
    p.m_tiles_div = FastDiv(p.m_tiles);
    p.n_tiles_div = FastDiv(p.n_tiles);
    p.slot_rows = BM;
    p.push_step_q = Cfg::kPushRowsPerStep;
    p.push_step_r = 0;
    // x as {K, M rows} and the experts' weights as G * KB k-block rows (expert g's k-block kb is
    // row g KB + kb), mapped as the dense launcher maps them.
    CUtensorMap xmap, wmap, smap;
    std::string bad = encode_wgmma_x_map<Cfg>(&xmap, a.x, a.k, a.m, BM);
    if (bad.empty()) bad = encode_wgmma_weight_maps<BITS, Cfg>(&wmap, &smap, a.planes, a.scales, a.n, a.groups * (a.k / 32));
    if (!bad.empty()) return "kbit_ragged_dot_wgmma_kernel: " + bad + " (" + shape(a) + ")";
    const ClusterLaunch launch(static_cast<unsigned>(ctas), Cfg::kThreads, Cfg::kSmemBytes, stream, 1);
    const WgGroups grp{a.group_sizes, static_cast<int>(a.groups)};
    cudaLaunchKernelEx(&launch.cfg, kernel, p, xmap, xmap, wmap, smap, grp);
    return check_launch("kbit_ragged_dot_wgmma_kernel", shape(a) + " (" + std::to_string(ctas) + " CTAs)");
  }
};

// The tile by the rows per active expert of the estimate M / min(G, M): 96 x 256 up to 96 rows,
// else 128 x 256 (both two warpgroups side by side, J = 2); tuning->wgmma_tile forces one.
// Timed on the harness (H200, uniform routing, the three models' routed experts, every tile
// forced): 96-row tiles take 0.89-0.97x the time of 128-row ones at 5-80 rows per expert (a
// 128-row tile holds an ~80-row Qwen3-Coder-Next expert and 48 rows that are computed and
// dropped), 1.05-1.15x at 128 and 256 rows (bits 2-5). Other tiles timed the same way: 64 x 256
// took 1.12-1.45x the time of 128 x 256 at 64-256 rows, 256 x 128 0.94-1.06x at 256 rows, and
// 128 x 128 over two warpgroup pairs 1.01-1.51x the time of the tile chosen here at 5-256 rows.
template <int BITS>
std::string launch_ragged_dot_wgmma_bits(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning) {
  int tile = tuning ? tuning->wgmma_tile : 0;
  if (tile == 0) {
    const int64_t active = std::max<int64_t>(1, std::min(a.groups, a.m));
    tile = (a.m + active - 1) / active <= 96 ? 1 : 2;
  }
  auto with = [&](auto act) -> std::string {
    using A = decltype(act);
    if (tile == 1) return GroupedWgLauncher<BITS, 96, 2, A>::launch(a, stream);
    return GroupedWgLauncher<BITS, 128, 2, A>::launch(a, stream);
  };
  if (a.dtype == DType::kF16) return with(ActF16{});
  return with(ActBF16{});
}

}  // namespace kbit::cuda::wgmma
