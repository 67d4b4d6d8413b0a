// Instantiates the wgmma kbit matmul (matmul_wgmma.cuh) for bits = 5; one file per bits value so
// the instantiations compile in parallel.
#include "cuda/matmul_wgmma.cuh"

namespace kbit::cuda::wgmma {
template std::string launch_wgmma_bits<5>(const MatmulArgs&, cudaStream_t, const MatmulTuning*);
}  // namespace kbit::cuda::wgmma
