// Hopper's tensor-memory accelerator (TMA) for the warp-specialized fused matmul: per chunk,
// one tensor copy each moves the weights (KCH k-block rows x the column group's bytes), their
// scale bytes and the activations from global to shared memory, all completing on one mbarrier
// by byte count.
//
// Why: with 16-byte cp.async copies the producer warps issue ~32 LDGSTS per 16 KiB chunk through
// the same MIO queue as the consumers' ~700 shared-memory loads. Nsight Compute (llama3-70b
// gate_up, H200): each LDGSTS.128 cost 13.6 shared-memory wavefronts (ideal 4), the producers
// stalled on the queue (long-scoreboard waits on their address registers) and the consumers
// then waited on the ring's full barrier for 8-23 % of their samples, with DRAM 35-45 % busy.
// A tensor copy is one instruction, issued by one thread, and the copy engine writes shared
// memory without the LSU. (With only the weights by TMA, 16 rows of 16-byte activation copies
// per chunk limited M = 9..16 the same way.)
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

// Copy the box at element coordinates (c0, c1[, c2]) of the tensor `map` to shared memory at
// `dst` (aligned as the map's swizzle needs); completes the box's bytes on mbarrier `bar`.
// Elements outside the tensor arrive as zeros (and count towards the bytes).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Predicated forms (the instruction runs where `on`): a warp runs them without a branch, e.g.
// where a branch around them would sit inside a wgmma pipeline (matmul_wgmma.cuh).
__device__ __forceinline__ void mbar_arrive_expect_tx_if(bool on, uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
      "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2;\n}\n" ::"r"(int(on)),
      "r"(bar), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void tma_load_2d_if(bool on, uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                               uint32_t bar) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
      "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%1], [%2, {%3, %4}], "
      "[%5];\n}\n" ::"r"(int(on)),
      "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d_if(bool on, uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                               uint32_t bar) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n"
      "@p cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%1], [%2, {%3, %4, %5}], "
      "[%6];\n}\n" ::"r"(int(on)),
      "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Bring the box at (c0, c1[, c2]) of `map` into L2 only (no shared memory, no barrier): the
// kernel's first chunks, requested before it may read them (dependent_launch.cuh).
__device__ __forceinline__ void tma_prefetch_l2_2d(const CUtensorMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void tma_prefetch_l2_3d(const CUtensorMap* map, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

// The shared-memory address at which CU_TENSOR_MAP_SWIZZLE_64B puts the byte that would be at
// `addr` unswizzled: the 16-byte chunk index (bits 4-5) is XORed with bits 7-8 of the address
// (the destination is 512-byte aligned, so absolute and box-relative bits agree).
__device__ __forceinline__ uint32_t swizzle64(uint32_t addr) { return addr ^ (((addr >> 7) & 3u) << 4); }

// ---- host side ----

// A tensor of `rank` (2 or 3) dimensions, dims[0] innermost and contiguous, strides[i] the
// byte distance between consecutive indices of dimension i + 1 (multiples of 16, in any
// order), read in boxes of box[] elements (box[0] * element size a multiple of 16 and at most
// the swizzle span). Returns "" or what failed.
inline std::string encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base,
                                     const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                                     CUtensorMapSwizzle swizzle) {
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
  cuuint64_t d[3] = {}, st[2] = {};
  cuuint32_t b[3] = {}, es[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    if (i + 1 < rank) st[i] = strides[i];
  }
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), d, st, b, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r == CUDA_SUCCESS) return std::string();
  std::string shape;  // (built only on failure: this runs on every launch)
  for (int i = 0; i < rank; ++i) shape += (i ? " x " : "") + std::to_string(dims[i]);
  return "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) + ") for a " + shape +
         " tensor (innermost first)";
}

}  // namespace kbit::cuda
