// kbit_matmul dispatch: the fused tensor-core kernels where they apply (matmul_wgmma.cuh for
// bf16 and fp16 in the rows of wgmma_rule_rows, whose terms are in plan_terms.h; matmul_fused.cuh
// otherwise), the generic SIMT kernel (matmul_generic.cu) elsewhere; plus the build information
// of the module.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "cuda/common.cuh"
#include "cuda/plan_terms.h"

namespace kbit::cuda {

std::string launch_matmul_generic(const MatmulArgs& a, cudaStream_t stream);
namespace fused {
template <int BITS>
std::string launch_fused_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning);
}  // namespace fused
namespace wgmma {
template <int BITS>
std::string launch_wgmma_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning);
}  // namespace wgmma

// The wgmma kernel's rows by plan_terms.h's rule (terms::kWgmma*).
std::pair<int, int> wgmma_rule_rows(int64_t n, int64_t k, int bits) {
  using namespace terms;
  const bool early = bits >= kWgmmaEarlyBits ||
                     (n >= kWgmmaEarlyMinN && (k * n <= kWgmmaEarlyMaxWeights ||
                                               (n >= kWgmmaEarlyBandMinN && n <= kWgmmaEarlyBandMaxN)));
  return {early ? kWgmmaEarlyMinRows : kWgmmaMinRows, bits >= kWgmmaEarlyBits ? kWgmmaWideBitsMaxRows : kWgmmaMaxRows};
}

// The environment overrides the rule's range for every N and bits (KBIT_JAX_WGMMA_MIN_M / _MAX_M,
// read once per process; MIN_M=0: never).
int env_or(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}
std::pair<int, int> wgmma_rows_here(int64_t n, int64_t k, int bits) {
  static const int forced_min = env_or("KBIT_JAX_WGMMA_MIN_M", -1), forced_max = env_or("KBIT_JAX_WGMMA_MAX_M", -1);
  const auto [rule_min, rule_max] = wgmma_rule_rows(n, k, bits);
  const int lo = forced_min >= 0 ? forced_min : rule_min;
  if (!wgmma_available() || lo <= 0) return {0, 0};
  return {lo, forced_max >= 0 ? forced_max : rule_max};
}

// bf16 or fp16 activations, the fragment layout and 16-byte rows (N % 16 == 0); tuning->variant 3
// forces it where it applies, 0..2 and -2 keep matmul_fused.cuh's kernels.
bool use_wgmma(const MatmulArgs& a, const MatmulTuning* tuning) {
  if ((a.dtype != DType::kBF16 && a.dtype != DType::kF16) || a.layout != kbit::kFragment || a.n % 16 != 0 ||
      !wgmma_available())
    return false;
  if (tuning && tuning->variant != -1) return tuning->variant == 3;
  const auto [lo, hi] = wgmma_rows_here(a.n, a.k, a.bits);
  return lo > 0 && a.m >= lo && a.m <= hi;
}

// The fused kernel needs 16-bit activations (float32 activations keep float32 accuracy on the
// generic path) and the fragment layout; any B, M, K (multiple of 32) and N.
std::string matmul_path(const MatmulArgs& a) {
  if (a.dtype == DType::kF32) return "generic (float32 activations)";
  if (a.layout != kbit::kFragment) return "generic (layout 0: planes; convert to the fragment layout for speed)";
  return "fused";
}

std::string launch_matmul(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  if (a.batch == 0 || a.m == 0 || a.n == 0) return std::string();  // nothing to write
  const bool fused = matmul_path(a) == "fused" && !(tuning && tuning->force_generic);
  if (!fused) return launch_matmul_generic(a, stream);
  if (use_wgmma(a, tuning))
    return KBIT_BITS_SWITCH(a.bits, BITS, [&] { return wgmma::launch_wgmma_bits<BITS>(a, stream, tuning); });
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] { return fused::launch_fused_bits<BITS>(a, stream, tuning); });
}

std::string compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  // nvcc defines the list as compute capabilities times ten (900 for sm_90).
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  std::string out;
  for (int a : archs) out += (out.empty() ? "" : ",") + std::to_string(a / 10);
  return out;
#else
  return "unknown";
#endif
}

std::string compiled_cuda_version() {
  return std::to_string(__CUDACC_VER_MAJOR__) + "." + std::to_string(__CUDACC_VER_MINOR__);
}

}  // namespace kbit::cuda
