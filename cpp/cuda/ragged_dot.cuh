// Host-side entry point of the grouped k-bit expert product (kbit_ragged_dot) on CUDA: plain C++
// (no device code), so the FFI handler and standalone test programs can call it. Like the
// launchers in launch.cuh it validates no shapes (the FFI handler does), never allocates,
// synchronizes or reads device memory on the host (so it is safe inside CUDA-graph capture),
// checks every launch and returns "" or a message naming the kernel, the shape and the error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/launch.cuh"

namespace kbit::cuda {

struct RaggedDotArgs {
  const void* x = nullptr;  // [M, K] of dtype, rows sorted by group
  DType dtype = DType::kBF16;
  const uint32_t* planes = nullptr;      // [G, K/32, N, bits]
  const uint8_t* scales = nullptr;       // [G, K/32, N]
  const float* codebook = nullptr;       // [G, 2^bits]
  const float* tensor_scale = nullptr;   // [G]
  const int32_t* group_sizes = nullptr;  // [G], on the device
  void* y = nullptr;                     // [M, N] of dtype ([M, N / 2] with glu)
  int64_t m = 0, k = 0, n = 0, groups = 0;
  int bits = 0, layout = 0;
  int glu = 0;  // kbit::Glu (glu.h)
};

// Knobs for tests and benchmarks; the defaults mean "let the launcher decide".
struct RaggedDotTuning {
  bool force_generic = false;  // the SIMT kernel even where the fused kernel applies
  int ctas = 0;                // the SIMT kernel's CTAs (0: as many as fit on the device)
  int block_rows = 0;          // the fused kernel's tiling as for this many rows per expert (0: M / min(G, M))
  int wgmma = 0;               // 1: the grouped wgmma kernel where it applies, -1: never (0: the dispatch
                               // decides; block_rows > 0 alone: the fused kernel)
  int wgmma_tile = 0;          // the grouped wgmma kernel's tile (rows x columns): 1: 96 x 256, 2: 128 x 256
                               // (0: the launcher's choice)
  int k_split = 0;             // the fused kernel's cluster size (0: its plan's)
  int balance = -1;            // the fused kernel's chunk-balanced clusters: 1 wherever possible, 0 never, -1 its plan's
  MatmulLaunchReport* report = nullptr;  // where the fused kernel's launcher writes its plan (or nowhere)
};

// The kernel launch_ragged_dot uses for these arguments, for logs and tests: "fused" or
// "generic (<reason>)".
std::string ragged_dot_path(const RaggedDotArgs& a);

// Largest G the kernels take (their schedule keeps per-group prefix sums in shared memory; the
// fused kernel's launch reports a G whose schedule leaves its ring no room, by name).
constexpr int64_t kRaggedDotMaxGroups = 8192;

std::string launch_ragged_dot(const RaggedDotArgs& a, cudaStream_t stream,
                              const RaggedDotTuning* tuning = nullptr);

namespace fused {
// The fused kernel's grouped launch for bits = BITS (ragged_dot_ws.cuh; ragged_dot_ws_b<bits>.cu).
template <int BITS>
std::string launch_ragged_dot_ws_bits(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning);
}  // namespace fused

namespace wgmma {
// The grouped wgmma kernel's launch for bits = BITS (ragged_dot_wgmma.cuh;
// ragged_dot_wgmma_b<bits>.cu): bf16 or fp16, the fragment layout, N % 16 == 0, G and K > 0,
// compute capability 9.0 (ragged_dot.cu checks).
template <int BITS>
std::string launch_ragged_dot_wgmma_bits(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning);
}  // namespace wgmma

}  // namespace kbit::cuda
