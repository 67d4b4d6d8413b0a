// kbit_ragged_dot on CUDA: the grouped k-bit expert product of a mixture-of-experts layer,
//     y[r, n] = tensor_scale[g] * sum_kb scale[g, kb, n] * sum_{k in kb} x[r, k] * codebook[g, code]
// for every row r of group g (rows sorted by group), in one launch over all groups.
//
// Work split, on the device (no host synchronisation, no allocation, so the launch can be
// captured into a CUDA graph): every CTA reads group_sizes and scans it in shared memory into the
// groups' first rows and first work items (ragged_schedule.cuh); an empty group owns no item, so
// its weights are never read. Rows at or past sum(group_sizes) are written as zeros by all CTAs
// together.
//
// Three kernels:
//  * grouped wgmma (the fused path's conditions below, compute capability 9.0, from
//    kGroupedWgmmaMinRows rows per active expert): the wgmma kbit matmul in its grouped mode
//    (ragged_dot_wgmma.cuh, matmul_wgmma.cuh), one whole output tile per CTA, each CTA finding
//    its expert and tile from group_sizes (ragged_tiles.cuh).
//  * fused (bf16/f16 activations, fragment layout, N % 16 == 0, 16-byte-aligned buffers): the
//    fused matmul's warp-specialized kernel in its grouped mode (ragged_dot_ws.cuh,
//    matmul_fused_ws.cuh): a TMA producer warp streams the active experts' weights through a
//    shared-memory ring, the consumer warps decode them from lookup tables into mma.sync, and its
//    work walk takes the items from this schedule (expert g = batch entry g of the batched matmul).
//  * generic (float32 activations, the planes layout, other N): a SIMT kernel, one thread per
//    column, 8 rows per item, float32 accumulation (as matmul_generic.cu); its CTA c takes the
//    contiguous item range [c I / P, (c + 1) I / P) of the I items.
#include "cuda/ragged_dot.cuh"

#include <algorithm>
#include <atomic>

#include "cuda/codes.cuh"
#include "cuda/common.cuh"
#include "cuda/ragged_schedule.cuh"
#include "glu.h"

namespace kbit::cuda {
namespace ragged {

struct Item {
  int g, block, tile;
};

__device__ __forceinline__ Item item_at(const int* item_start, int G, int tiles, int i) {
  Item it;
  it.g = group_of_item(item_start, G, i);
  const int local = i - item_start[it.g];
  it.block = local / tiles;
  it.tile = local - it.block * tiles;
  return it;
}

// The first item of CTA c of P over I items.
__device__ __forceinline__ int range_begin(int c, int P, int I) {
  return int((long long)c * I / P);
}

// ---------------------------------------------------------------------------------------------
// Generic kernel: one thread per column, 8 rows per item, float32 sums.
// ---------------------------------------------------------------------------------------------
constexpr int kGenericThreads = 128, kGenericRows = 8;

template <int BITS, int LAYOUT, class T>
__global__ void __launch_bounds__(kGenericThreads)
    ragged_dot_generic_kernel(const T* __restrict__ x, const uint32_t* __restrict__ planes,
                              const uint8_t* __restrict__ scales, const float* __restrict__ codebook,
                              const float* __restrict__ tensor_scale,
                              const int32_t* __restrict__ group_sizes, T* __restrict__ y, int M, int KB,
                              int N, int G, int glu) {
  constexpr int C = 1 << BITS;
  extern __shared__ int sched[];  // row_start[G + 1], item_start[G + 1]
  __shared__ long long scratch[32];
  __shared__ float xs[kGenericRows][32];
  __shared__ float cb[C];
  int* row_start = sched;
  int* item_start = sched + G + 1;
  const int tid = threadIdx.x, K = KB * 32;
  const int tiles = (N + kGenericThreads - 1) / kGenericThreads;
  const int items = build_schedule(group_sizes, G, M, kGenericRows, tiles, row_start, item_start, scratch);
  const int n_out = glu != kGluNone ? N / 2 : N;
  zero_rows(y, row_start[G], M, n_out, threadIdx.x, blockDim.x);
  const int i1 = range_begin(blockIdx.x + 1, gridDim.x, items);
  const GluLogit logit(glu);
  for (int i = range_begin(blockIdx.x, gridDim.x, items); i < i1; ++i) {
    const Item it = item_at(item_start, G, tiles, i);
    const int r0 = row_start[it.g] + it.block * kGenericRows;
    const int rows = min(kGenericRows, row_start[it.g + 1] - r0);
    const int n = it.tile * kGenericThreads + tid;
    __syncthreads();  // the previous item's readers of cb are done
    if (tid < C) cb[tid] = codebook[(long long)it.g * C + tid];
    float acc[kGenericRows];
#pragma unroll
    for (int r = 0; r < kGenericRows; ++r) acc[r] = 0.f;
    for (int kb = 0; kb < KB; ++kb) {
      __syncthreads();
#pragma unroll
      for (int j = 0; j < kGenericRows * 32 / kGenericThreads; ++j) {
        const int e = tid + j * kGenericThreads, r = e / 32, k = e % 32;
        xs[r][k] = r < rows ? to_f32(x[(long long)(r0 + r) * K + kb * 32 + k]) : 0.f;
      }
      __syncthreads();
      if (n < N) {
        const long long cell = ((long long)it.g * KB + kb) * N + n;
        uint32_t w[BITS];
#pragma unroll
        for (int b = 0; b < BITS; ++b) w[b] = planes[cell * BITS + b];
        const float s = kbit::decode_e4m4(scales[cell]);
#pragma unroll
        for (int k = 0; k < 32; ++k) {
          const float wv = cb[cell_code<BITS, LAYOUT>(w, k)] * s;
#pragma unroll
          for (int r = 0; r < kGenericRows; ++r) acc[r] = fmaf(xs[r][k], wv, acc[r]);
        }
      }
    }
    const float ts = tensor_scale[it.g];
#pragma unroll
    for (int r = 0; r < kGenericRows; ++r) {
      const float v = acc[r] * ts;
      if (glu == kGluNone) {
        if (n < N && r < rows) y[(long long)(r0 + r) * N + n] = from_f32<T>(v);
      } else {  // column pairs (2j, 2j + 1) in neighbouring lanes; every lane shuffles
        const float up = __shfl_xor_sync(0xffffffffu, v, 1);
        if ((n & 1) == 0 && n < N && r < rows)
          y[(long long)(r0 + r) * n_out + n / 2] = from_f32<T>(glu_apply(logit, v, up));
      }
    }
  }
}

}  // namespace ragged

namespace {

std::string shape_string(const RaggedDotArgs& a) {
  return "M=" + std::to_string(a.m) + " K=" + std::to_string(a.k) + " N=" + std::to_string(a.n) +
         " G=" + std::to_string(a.groups) + " bits=" + std::to_string(a.bits) +
         " layout=" + std::to_string(a.layout) + " dtype=" + dtype_name(a.dtype) + " glu=" + std::to_string(a.glu);
}

int max_optin_smem(int dev) {
  static std::atomic<int> cache[kMaxDevices];
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v > 0) return v;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || v <= 0) {
    cudaGetLastError();
    v = 48 * 1024;
  }
  cache[dev].store(v, std::memory_order_relaxed);
  return v;
}

template <int BITS, int LAYOUT, class T>
std::string launch_generic(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning) {
  const int dev = current_device();
  auto kernel = ragged::ragged_dot_generic_kernel<BITS, LAYOUT, T>;
  const size_t smem = size_t(2 * (a.groups + 1) * 4);
  static std::atomic<int> configured[kMaxDevices];
  if (smem > 48 * 1024 && configured[dev].load(std::memory_order_relaxed) == 0) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin_smem(dev) - 4096) !=
        cudaSuccess)
      return check_launch("kbit_ragged_dot_generic_kernel (shared-memory attribute)", shape_string(a));
    configured[dev].store(1, std::memory_order_relaxed);
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, ragged::kGenericThreads, smem) != cudaSuccess ||
      per_sm < 1) {
    cudaGetLastError();
    per_sm = 1;
  }
  const int ctas = tuning && tuning->ctas > 0 ? tuning->ctas : per_sm * device_sm_count(dev);
  kernel<<<ctas, ragged::kGenericThreads, smem, stream>>>(
      static_cast<const T*>(a.x), a.planes, a.scales, a.codebook, a.tensor_scale, a.group_sizes,
      static_cast<T*>(a.y), int(a.m), int(a.k / 32), int(a.n), int(a.groups), a.glu);
  return check_launch("kbit_ragged_dot_generic_kernel", shape_string(a) + " (" + std::to_string(ctas) + " CTAs)");
}

// The grouped wgmma kernel (ragged_dot_wgmma.cuh) from this many rows per active expert (the
// estimate M / min(G, M)); the warp-specialized kernel below. Harness, H200, bits 4, uniform
// routing, each kernel's tilings forced: at 32 rows (Qwen3-30B-A3B and GLM-4.7-Flash experts,
// 512 tokens) the wgmma kernel takes 0.92-0.95x the time of the other's best tiling, at 40 rows
// (Qwen3-Coder-Next, 2048 tokens) 0.95x (gate/up) and 1.03x (down); at 16-20 rows (256 and 1024
// tokens) the warp-specialized kernel's 32-row blocks take 0.74-0.78x the wgmma kernel's time.
constexpr int64_t kGroupedWgmmaMinRows = 32;

// (on the fused path: bf16/f16, the fragment layout, N % 16 == 0, aligned buffers)
bool use_grouped_wgmma(const RaggedDotArgs& a, const RaggedDotTuning* tuning) {
  if (a.groups == 0 || a.k == 0 || !wgmma_available()) return false;
  if (tuning && tuning->wgmma != 0) return tuning->wgmma > 0;
  if (tuning && tuning->block_rows > 0) return false;
  const int64_t active = std::max<int64_t>(1, std::min(a.groups, a.m));
  return (a.m + active - 1) / active >= kGroupedWgmmaMinRows;
}

}  // namespace

std::string ragged_dot_path(const RaggedDotArgs& a) {
  if (a.dtype == DType::kF32) return "generic (float32 activations)";
  if (a.layout != kbit::kFragment) return "generic (layout 0: planes; convert to the fragment layout for speed)";
  if (a.n % 16 != 0) return "generic (N is not a multiple of 16)";
  auto al16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  if (!al16(a.x) || !al16(a.planes) || !al16(a.scales)) return "generic (x, planes or scales not 16-byte aligned)";
  if (a.groups * (a.k / 32) >= (int64_t(1) << 31)) return "generic (G * K / 32 k-block rows past 2^31)";
  return "fused";
}

std::string launch_ragged_dot(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning) {
  if (a.m == 0 || a.n == 0) return std::string();  // nothing to write
  if (a.groups > kRaggedDotMaxGroups)
    return "kbit_ragged_dot: G=" + std::to_string(a.groups) + " groups, at most " +
           std::to_string(kRaggedDotMaxGroups) + " supported, for " + shape_string(a);
  if (a.m > 0x7fffffff / 2 || a.k / 32 * a.n > 0x7fffffff / 8)
    return "kbit_ragged_dot: the kernels index rows, k-blocks and columns in 32 bits, for " + shape_string(a);
  if (!(tuning && tuning->force_generic) && ragged_dot_path(a) == "fused") {
    if (use_grouped_wgmma(a, tuning))
      return KBIT_BITS_SWITCH(a.bits, BITS, [&] { return wgmma::launch_ragged_dot_wgmma_bits<BITS>(a, stream, tuning); });
    return KBIT_BITS_SWITCH(a.bits, BITS, [&] { return fused::launch_ragged_dot_ws_bits<BITS>(a, stream, tuning); });
  }
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] {
    return KBIT_LAYOUT_SWITCH(a.layout, LAYOUT, [&] {
      return KBIT_DTYPE_SWITCH(a.dtype, T, [&] { return launch_generic<BITS, LAYOUT, T>(a, stream, tuning); });
    });
  });
}

}  // namespace kbit::cuda
