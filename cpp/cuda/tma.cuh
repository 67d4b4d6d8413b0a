// Hopper's tensor-memory accelerator (TMA) for the weight stream of the warp-specialized fused
// matmul: one 2-D tensor copy moves a whole chunk of weights (KCH k-block rows x the column
// group's bytes) from global to shared memory and completes on an mbarrier by byte count.
//
// Why: with 16-byte cp.async copies the producer warps issue ~32 LDGSTS per 16 KiB chunk through
// the same MIO queue as the consumers' ~700 shared-memory loads. Nsight Compute (llama3-70b
// gate_up, H200): each LDGSTS.128 cost 13.6 shared-memory wavefronts (ideal 4), the producers
// stalled on the queue (long-scoreboard waits on their address registers) and the consumers
// then waited on the ring's full barrier for 11-25 % of their samples, with DRAM 35-45 % busy.
// A tensor copy is one instruction per chunk, issued by one thread, and the copy engine writes
// shared memory without the LSU.
//
// Host side: the tensor map (a 128-byte descriptor passed to the kernel by value as a
// __grid_constant__ parameter, so CUDA-graph capture records it with the launch) is encoded by
// the driver's cuTensorMapEncodeTiled, looked up once through the runtime (no link against
// libcuda).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace kbit::cuda {

// ---- device side ----

// Arrive on the mbarrier and raise the bytes its current phase waits for by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Copy the box at element coordinates (c0, c1) of the 2-D tensor `map` to shared memory at
// `dst` (128-byte aligned); completes `bytes` = the box size on mbarrier `bar`. Elements outside
// the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// ---- host side ----

// A row-major 2-D tensor of 32-bit words: `rows` rows of `row_words` words, `row_stride_bytes`
// apart (a multiple of 16), read in boxes of box_rows x box_words (box_words <= 256, box_words
// * 4 a multiple of 16). Returns "" or what failed.
inline std::string encode_tensor_map_2d_u32(CUtensorMap* map, const void* base, uint64_t row_words, uint64_t rows,
                                            uint64_t row_stride_bytes, uint32_t box_words, uint32_t box_rows) {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the CUDA driver";
  const cuuint64_t dims[2] = {row_words, rows};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {box_words, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<void*>(base), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) + ") for a " +
           std::to_string(rows) + " x " + std::to_string(row_words) + " word tensor, box " +
           std::to_string(box_rows) + " x " + std::to_string(box_words);
  return std::string();
}

}  // namespace kbit::cuda
