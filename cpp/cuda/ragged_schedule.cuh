// The device-side schedule of the grouped expert product (kbit_ragged_dot): every CTA reads
// group_sizes and scans it in shared memory into the groups' first rows (clamped to M; negative
// sizes count as 0) and their first work items, where a group of R rows owns ceil(R / rows per
// block) x (column groups) items and an empty group none, so its weights are never read. No host
// synchronisation and no allocation: a launch that uses it can be captured into a CUDA graph.
// Both CUDA kernels of kbit_ragged_dot use it (ragged_dot.cu's SIMT kernel, and the fused
// kernel's grouped walk, matmul_fused_walk.cuh).
#pragma once

#include <cstdint>

#include "cuda/common.cuh"

namespace kbit::cuda::ragged {

// Exclusive prefix sum of v over the CTA (blockDim.x threads, a multiple of 32, at most 1024);
// total gets the sum. scratch: 32 long longs of shared memory. Ends with a barrier.
__device__ inline long long block_exclusive_scan(long long v, long long* scratch, long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  long long inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const long long o = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += o;
  }
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < warps ? scratch[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long o = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += o;
    }
    if (lane < warps) scratch[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const long long before = (warp > 0 ? scratch[warp - 1] : 0) + inc - v;
  total = scratch[warps - 1];
  __syncthreads();
  return before;
}

// row_start[g] (g = 0..G): first row of group g, clamped to M; item_start[g]: first item of group
// g, a group of R rows owning ceil(R / block_rows) * tiles items. Called by every thread of the
// CTA; returns the number of items.
__device__ inline int build_schedule(const int32_t* __restrict__ group_sizes, int G, int64_t M, int block_rows,
                                     int tiles, int* row_start, int* item_start, long long* scratch) {
  const int per = (G + blockDim.x - 1) / blockDim.x;
  const int g0 = min(G, int(threadIdx.x) * per), g1 = min(G, g0 + per);
  long long local = 0;
  for (int g = g0; g < g1; ++g) local += max(group_sizes[g], 0);
  long long total;
  long long run = block_exclusive_scan(local, scratch, total);
  for (int g = g0; g < g1; ++g) {
    row_start[g] = int(min(run, (long long)M));
    run += max(group_sizes[g], 0);
  }
  if (threadIdx.x == 0) row_start[G] = int(min(total, (long long)M));
  __syncthreads();
  local = 0;
  for (int g = g0; g < g1; ++g) {
    const int rows = row_start[g + 1] - row_start[g];
    local += (long long)((rows + block_rows - 1) / block_rows) * tiles;
  }
  run = block_exclusive_scan(local, scratch, total);
  for (int g = g0; g < g1; ++g) {
    item_start[g] = int(run);
    const int rows = row_start[g + 1] - row_start[g];
    run += (long long)((rows + block_rows - 1) / block_rows) * tiles;
  }
  if (threadIdx.x == 0) item_start[G] = int(total);
  __syncthreads();
  return int(total);
}

// The group owning item i: the last g with item_start[g] <= i (empty groups before it share its
// start, empty ones after it start past i).
__device__ __forceinline__ int group_of_item(const int* item_start, int G, int i) {
  int lo = 0, hi = G;  // invariant: item_start[lo] <= i < item_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (item_start[mid] <= i) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Rows [first, M) of y (n_out columns) are zeros: a grid-stride fill by `threads` threads of
// every CTA (this one is thread `tid`).
template <class T>
__device__ void zero_rows(T* __restrict__ y, int64_t first, int64_t M, int64_t n_out, int tid, int threads) {
  const long long begin = (long long)first * n_out, end = (long long)M * n_out;
  const T zero = from_f32<T>(0.f);
  for (long long i = begin + (long long)blockIdx.x * threads + tid; i < end; i += (long long)gridDim.x * threads)
    y[i] = zero;
}

}  // namespace kbit::cuda::ragged
