// Host-side entry points of the CUDA kernels: plain C++ (no device code, no XLA or nanobind
// headers), so the FFI handlers (compiled by the host compiler) and the standalone benchmark
// harness can both call them. Every launcher validates nothing about shapes (the FFI handler
// does that), launches on the given stream, checks the launch with cudaGetLastError, and
// returns "" on success or a message naming the kernel, the problem shape and the CUDA error.
// Launchers never allocate, synchronize or read device memory on the host, so they are safe
// inside CUDA-graph capture (XLA command buffers).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

namespace kbit::cuda {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
const char* dtype_name(DType d);

struct QuantizeArgs {
  const void* w = nullptr;  // [B, K, N] of w_dtype
  DType w_dtype = DType::kF32;
  const float* codebook = nullptr;      // [B, 2^bits]
  const float* tensor_scale = nullptr;  // [B]
  uint32_t* planes = nullptr;           // [B, K/32, N, bits]
  uint8_t* scales = nullptr;            // [B, K/32, N]
  int64_t batch = 0, k = 0, n = 0;
  int bits = 0, layout = 0;
};

struct DequantizeArgs {
  const uint32_t* planes = nullptr;
  const uint8_t* scales = nullptr;
  const float* codebook = nullptr;
  const float* tensor_scale = nullptr;
  void* out = nullptr;  // [B, K, N] of out_dtype
  DType out_dtype = DType::kBF16;
  int64_t batch = 0, k = 0, n = 0;
  int bits = 0, layout = 0;
};

struct MatmulArgs {
  const void* x = nullptr;  // [B, M, K] of dtype
  DType dtype = DType::kBF16;
  const uint32_t* planes = nullptr;
  const uint8_t* scales = nullptr;
  const float* codebook = nullptr;
  const float* tensor_scale = nullptr;
  void* y = nullptr;  // [B, M, N] of dtype ([B, M, N / 2] with glu)
  int64_t batch = 0, m = 0, k = 0, n = 0;
  int bits = 0, layout = 0;
  int glu = 0;  // kbit::Glu (glu.h): 0, or act(column 2j) * column 2j + 1 into column j
};

// The product's buffers, as MatmulArgs carries them, into a kernel's parameter struct (the fused
// kernels' Params and the wgmma kernel's WgParams name them alike).
template <class KernelParams>
inline void copy_operands(const MatmulArgs& a, KernelParams& p) {
  p.x = a.x;
  p.planes = a.planes;
  p.scales = a.scales;
  p.codebook = a.codebook;
  p.tensor_scale = a.tensor_scale;
  p.y = a.y;
}

// Knobs for benchmarks and tests; the defaults (0) mean "let the launcher decide".
// The wgmma kernel's k-split cluster sum (MatmulTuning::launched_cluster_sum, matmul_wgmma.cuh):
// each rank's rows pushed to their owners, or pulled by them: with every rank's loads of an item
// issued before its first add up to kPullBatchMaxRanks ranks, rank by rank above.
constexpr int kClusterSumPush = 1, kClusterSumPull = 2;
constexpr int kPullBatchMaxRanks = 3;

struct MatmulTuning {
  int k_split = 0;        // CTAs per thread-block cluster that split K (1..8); 0 = heuristic
  bool force_generic = false;  // use the slow SIMT kernel even where the fused one applies
  int variant = -1;            // fused tiling: 0 or 1 (the 8- and 16-row tilings), 2 (the N-split tiling
                               // of 16, 32 or 64 rows, warp-specialized kernel only), 3 (the wgmma kernel,
                               // bf16 and N % 16 == 0 on sm_90a only), 4 (bits 5, M = 9..16: V1 in
                               // 64-column groups, warp-specialized kernel only); -1 = the launcher picks;
                               // -2 = matmul_fused.cuh's launcher picks (never the wgmma kernel)
  int ws_max_rows = -1;        // M up to which the warp-specialized kernel runs; -1 = default
  int min_m_tiles = 0;         // warp-specialized kernel: blocks of at least this many n8 row tiles (2:
                               // the 16-row tilings, whose V0 has 32-column groups, even at M <= 8);
                               // 0 = ceil(M / 8)
  int wg_columns = 0;          // wgmma kernel, M <= 128: the weight tile's columns, 256, 128 or (M <= 64)
                               // 64; 0 = the launcher picks (WgLauncher::cost)
  int balance = -1;            // chunk-balanced clusters: 1 = wherever possible (at k_split if set), 0 =
                               // never (uniform k-split), -1 = the launcher picks (KBIT_JAX_BALANCE=0: never)
  int wg_rows = 0;             // wgmma kernel above 128 rows: the row tile, 128 or 256; 0 = the launcher
                               // picks (WgLauncher::cost)
  int wg_split_last = -1;      // wgmma kernel: a last round of tiles that fills half the GPU or less split over
                               // 2-CTA clusters (WgLauncher::plan): 1 = wherever so, 0 = never, -1 = the
                               // launcher picks (ignored where k_split is set)
#ifdef KBIT_TIMELINE
  unsigned long long* timeline = nullptr;  // cuda/timeline.cuh: [CTAs, kTlSlots] milestone clocks
#endif
  // Written by the fused kernel's launcher (for benchmarks and tests): the cluster size and CTA
  // count it launched with, whether its clusters were chunk-balanced, the wgmma kernel's weight
  // tile's columns (0: another kernel), and the tiling variant (as `variant`) with the rows
  // of its blocks of M; the wgmma kernel's CTAs that computed a whole tile each before the split
  // last round (0: none), and how its k-split clusters added their tiles (kClusterSumPush or
  // kClusterSumPull; 0: no k-split).
  mutable int launched_k_split = 0, launched_ctas = 0, launched_balanced = 0, launched_wg_columns = 0;
  mutable int launched_whole_ctas = 0, launched_cluster_sum = 0;
  mutable int launched_variant = -1, launched_rows = 0;
  // matmul_fused.cuh's launcher: the launched plan's cost (Launcher::plan, in chunk times of the V0
  // tiling of its MT) and the price of its chunk in that unit (Config::chunk_cost); the wgmma
  // kernel's launcher sets both to 0
  mutable double launched_plan_cost = 0, launched_chunk_price = 0;
  // matmul_fused.cuh's launcher at M > 8 on the warp-specialized kernel (for fitting its prices,
  // benchmarks/nsplit_price_fit.py): the cost of its 16-row plan (V0, V1 or at bits 5 V4,
  // whichever it takes), and of the N-split plan (V2) with the price of V2's chunk that cost includes
  // (Config::chunk_cost); -1 where a plan cannot be made. The N-split tiling is taken where its
  // cost is lower (and the dtype may take it at that M). 0: that launcher did not compare them.
  mutable double planned_rows16_cost = 0, planned_nsplit_cost = 0, planned_nsplit_price = 0;
};

// Which kernel launch_matmul would use, for logs: "fused" or "generic" plus the reason.
std::string matmul_path(const MatmulArgs& a);

std::string launch_quantize(const QuantizeArgs& a, cudaStream_t stream);
std::string launch_dequantize(const DequantizeArgs& a, cudaStream_t stream);
std::string launch_matmul(const MatmulArgs& a, cudaStream_t stream,
                          const MatmulTuning* tuning = nullptr);

// The rows (min, max) for which bf16 products of n columns (N % 16 == 0, the fragment layout), k
// rows of W and bits take the wgmma kernel on the current device: what launch_matmul uses, and
// what the module exports for the JAX lowering's dispatch at trace time. (0, 0) where there is
// none (not compiled, not compute capability 9.0, or KBIT_JAX_WGMMA_MIN_M=0); the environment's
// KBIT_JAX_WGMMA_MIN_M / _MAX_M replace the rule's rows for every product. cpp/cuda/matmul.cu
// says why the rule is what it is.
std::pair<int, int> wgmma_rows_here(int64_t n, int64_t k, int bits);
// The rule alone, as on a device with the wgmma kernel and without the environment's override
// (the module exports it so that tests can lower for such a device on any machine).
std::pair<int, int> wgmma_rule_rows(int64_t n, int64_t k, int bits);

// The architectures the device code was compiled for (from nvcc's __CUDA_ARCH_LIST__),
// e.g. "90", and the CUDA toolkit version the module was built with, e.g. "13.0".
std::string compiled_archs();
std::string compiled_cuda_version();

}  // namespace kbit::cuda
