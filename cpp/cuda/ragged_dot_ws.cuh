// kbit_ragged_dot on the fused matmul's warp-specialized kernel (matmul_fused_ws.cuh) in its
// grouped mode: the tiling for the rows an expert is expected to get, then the launch. One
// instantiation per bits value (ragged_dot_ws_b<bits>.cu), so they compile in parallel;
// ragged_dot.cu chooses between this and its SIMT kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda/matmul_fused.cuh"
#include "cuda/ragged_dot.cuh"

namespace kbit::cuda::fused {

// The tiling follows the rows per active expert of the plan's estimate (Planner::plan_grouped:
// M / min(G, M)), as launch_fused_bits follows M: up to 8 rows kWarpKPair in blocks of 8 (decode,
// T <= ~G / top-k tokens), 9..16 rows the cheaper plan of the two 16-row K-split tilings, above
// that the N-split tiling in blocks of 32 rows, and above 32 rows its largest, 64 (prefill: each
// decoded weight serves the most rows the kernel has).
template <int BITS>
std::string launch_ragged_dot_ws_bits(const RaggedDotArgs& r, cudaStream_t stream, const RaggedDotTuning* tuning) {
  MatmulArgs a;
  a.x = r.x;
  a.dtype = r.dtype;
  a.planes = r.planes;
  a.scales = r.scales;
  a.codebook = r.codebook;
  a.tensor_scale = r.tensor_scale;
  a.y = r.y;
  a.batch = r.groups;
  a.m = r.m;
  a.k = r.k;
  a.n = r.n;
  a.bits = r.bits;
  a.layout = r.layout;
  a.glu = r.glu;
  if (r.groups == 0 || r.k == 0) {  // every row sums nothing: y = 0 (+0.0 is all-zero bits in every dtype)
    const int64_t n_out = r.glu != 0 ? r.n / 2 : r.n;
    const cudaError_t err = cudaMemsetAsync(r.y, 0, size_t(r.m * n_out) * 2, stream);
    return err == cudaSuccess ? std::string() : std::string("kbit_ragged_dot: memset failed: ") + cudaGetErrorString(err);
  }
  const GroupParams grp{r.group_sizes, static_cast<int>(r.groups)};
  const int64_t active = std::max<int64_t>(1, std::min(r.groups, r.m));
  const int64_t rows = tuning && tuning->block_rows > 0 ? tuning->block_rows : (r.m + active - 1) / active;
  auto with = [&](auto act_tag) -> std::string {
    using A = typename decltype(act_tag)::type;
    auto run = [&](auto launcher) {
      using L = decltype(launcher);
      return L::launch(a, stream, nullptr, L::plan_grouped(a), grp);
    };
    if (rows <= 8) return run(Launcher<BITS, A, 1, Tiling::kWarpKPair, true, true>{});
    if (rows <= 16) {
      using L0 = Launcher<BITS, A, 2, Tiling::kWarpKBlock, true, true>;
      using L1 = Launcher<BITS, A, 2, Tiling::kWarpKPair, true, true>;
      const LaunchPlan p0 = L0::plan_grouped(a), p1 = L1::plan_grouped(a);
      if (p1.error.empty() && (!p0.error.empty() || p1.cost <= p0.cost)) return L1::launch(a, stream, nullptr, p1, grp);
      return L0::launch(a, stream, nullptr, p0, grp);
    }
    if (rows <= 32) return run(Launcher<BITS, A, 4, Tiling::kNSplit, true, true>{});
    return run(Launcher<BITS, A, 8, Tiling::kNSplit, true, true>{});
  };
  if (a.dtype == DType::kBF16) return with(ActTag<ActBF16>{});
  return with(ActTag<ActF16>{});
}

}  // namespace kbit::cuda::fused
