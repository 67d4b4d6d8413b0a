// Instantiates kbit_ragged_dot's grouped wgmma kernels for bits = 5 (both activation dtypes, every
// row tile ragged_dot_wgmma.cuh chooses); one file per bits value so the instantiations compile in
// parallel.
#include "cuda/ragged_dot_wgmma.cuh"

namespace kbit::cuda::wgmma {
template std::string launch_ragged_dot_wgmma_bits<5>(const RaggedDotArgs&, cudaStream_t,
                                                     const RaggedDotTuning*);
}  // namespace kbit::cuda::wgmma
