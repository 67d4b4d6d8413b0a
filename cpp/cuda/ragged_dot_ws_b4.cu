// Instantiates kbit_ragged_dot's fused kernels for bits = 4 (both activation dtypes, every tiling
// ragged_dot_ws.cuh chooses); one file per bits value so the instantiations compile in parallel.
#include "cuda/ragged_dot_ws.cuh"

namespace kbit::cuda::fused {
template std::string launch_ragged_dot_ws_bits<4>(const RaggedDotArgs&, cudaStream_t,
                                                  const RaggedDotTuning*);
}  // namespace kbit::cuda::fused
