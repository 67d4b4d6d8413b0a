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
// M / min(G, M)), or tuning->block_rows:
//  * up to 8 rows (decode): kWarpKPair in blocks of 8 rows, an item one expert's 64 columns
//    (bits 5: 32) over all of K; but where all of K is one chunk of that tiling (K <= 512), the
//    N-split tiling in blocks of 32. With kWarpKPair every item would be one chunk, so every
//    chunk would end an item (the CTA's warps add their sums) and nearly every item would change
//    the expert; the N-split item is 256 columns over all of K in chunks of 2 k-blocks, and its
//    warps own their columns. Qwen3-Coder-Next down (K 512, N 2048), H200: 0.94x and 0.87x the
//    time at 1 and 4 tokens (harness `decode`, CUDA-graph times), 0.65x at 256 (harness `time`,
//    tilings forced), at most 0.80x and 0.71x at 16 and 64 (harness `time`).
//  * 9..32 rows: the N-split tiling in blocks of 32. Its warps own their columns, so an item ends
//    without adding the warps' partial sums, and its 256-column groups make a quarter of the
//    items: at 16 rows per expert (Qwen3-30B-A3B and GLM-4.7-Flash experts at 256 tokens, H200,
//    harness) it takes 0.42-0.62x the time of the 16-row K-split tilings.
//  * above 32 rows its largest blocks, 64 rows (prefill: each decoded weight serves the most
//    rows; 0.79-0.98x the time of blocks of 32 at 4096 tokens on those models' experts).
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
  MatmulTuning knobs;  // (the plan's cluster size and split, and its report, for benchmarks)
  if (tuning) {
    knobs.k_split = tuning->k_split;
    knobs.balance = tuning->balance;
    knobs.report = tuning->report;
  }
  auto with = [&](auto act_tag) -> std::string {
    using A = typename decltype(act_tag)::type;
    auto run = [&](auto launcher) {
      using L = decltype(launcher);
      return L::launch(a, stream, &knobs, L::plan_grouped(a, tuning ? &knobs : nullptr), grp);
    };
    using Pair = Launcher<BITS, A, 1, Tiling::kWarpKPair, true, true>;
    const bool one_chunk = r.k <= 32 * Pair::Cfg::kKCH && !(tuning && tuning->block_rows > 0);
    if (rows <= 8 && !one_chunk) return run(Pair{});
    if (rows <= 32) return run(Launcher<BITS, A, 4, Tiling::kNSplit, true, true>{});
    return run(Launcher<BITS, A, 8, Tiling::kNSplit, true, true>{});
  };
  if (a.dtype == DType::kBF16) return with(ActTag<ActBF16>{});
  return with(ActTag<ActF16>{});
}

}  // namespace kbit::cuda::fused
