// Instantiates the fused kbit matmul for bits = 3 (all activation dtypes and M tilings); one
// file per bits value so the instantiations compile in parallel.
#include "cuda/matmul_fused.cuh"

namespace kbit::cuda::fused {
template std::string launch_fused_bits<3>(const MatmulArgs&, cudaStream_t, const MatmulTuning*);
}  // namespace kbit::cuda::fused
