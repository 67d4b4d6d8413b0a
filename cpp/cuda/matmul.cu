// kbit_matmul dispatch: the fused tensor-core kernel (matmul_fused.cuh) where it applies, the
// generic SIMT kernel (matmul_generic.cu) elsewhere; plus the build information of the module.
#include "cuda/common.cuh"

namespace kbit::cuda {

std::string launch_matmul_generic(const MatmulArgs& a, cudaStream_t stream);
namespace fused {
template <int BITS>
std::string launch_fused_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning);
}  // namespace fused

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
