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

#include "cuda/matmul_tuning.h"

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

// The product's buffers, as MatmulArgs (or RaggedDotArgs) carries them, into a kernel's parameter
// struct (the fused kernels' Params and the wgmma kernel's WgParams name them alike).
template <class Args, class KernelParams>
inline void copy_operands(const Args& a, KernelParams& p) {
  p.x = a.x;
  p.planes = a.planes;
  p.scales = a.scales;
  p.codebook = a.codebook;
  p.tensor_scale = a.tensor_scale;
  p.y = a.y;
}

// Which kernel launch_matmul would use, for logs: "fused" or "generic" plus the reason.
std::string matmul_path(const MatmulArgs& a);

std::string launch_quantize(const QuantizeArgs& a, cudaStream_t stream);
std::string launch_dequantize(const DequantizeArgs& a, cudaStream_t stream);
// (tuning: benchmark and test knobs, matmul_tuning.h; the product passes none)
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
