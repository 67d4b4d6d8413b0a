// What any kernel that streams a weight from DRAM costs per launch on this GPU, beside its bytes:
// back-to-back launches inside one CUDA graph (as in JAX's command buffers) of a plain streaming
// kernel, one CTA of 512 threads per SM (plain, and in clusters of 2 as the k-split products
// launch), 16-byte evict-first loads, cold data (each launch reads another buffer; together they
// exceed L2 several times). The time per launch against the size
// read gives the floor a decode product's start and end are measured against: the intercept is
// what a launch costs with nothing to read, the slope the streaming rate. Why: a fused decode
// product spends ~4 us a launch beyond its bytes even with its decode switched off
// (tools/kernel_profile.sh stream; docs/performance.md).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -o /tmp/launch_floor_probe benchmarks/launch_floor_probe.cu
//   /tmp/launch_floor_probe      (one line per cluster size and size read: us per launch, GB/s,
//                                 us beyond copy speed)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_common.cuh"

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

__global__ void __launch_bounds__(kThreads, 1) stream_kernel(const uint4* __restrict__ src, size_t n, uint32_t* sink) {
  uint32_t folded = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = i + u * stride < n ? __ldcs(src + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (folded == 0x9e3779b9u) sink[0] = folded;  // (keeps the loads; never true for zeroed data)
}

int main() {
  Probe probe;
  const int sms = probe.sms;
  const size_t pool_bytes = size_t(1) << 30;  // 1 GiB: the buffers a size rotates through
  uint8_t* pool;
  uint32_t* sink;
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(pool, 0, pool_bytes));
  cudaStream_t s = probe.s;
  cudaEvent_t a = probe.a, b = probe.b;
  const double copy_speed = probe.copy_speed(pool, pool_bytes);
  constexpr int kPer = 50, kReps = 7;
  for (const int cluster : {1, 2}) {
    for (const double mib : {0.0, 0.25, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0}) {
      const size_t bytes = size_t(mib * (1 << 20)), slot = std::max<size_t>((bytes + 4095) / 4096 * 4096, 4096);
      const int copies = int(std::min<size_t>(pool_bytes / slot, 1024));
      std::vector<double> t;
      int call = 0;
      for (int r = 0; r < kReps; ++r) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < kPer; ++i, ++call) {
          cudaLaunchConfig_t cfg = {};
          cfg.gridDim = dim3(sms / cluster * cluster);
          cfg.blockDim = dim3(kThreads);
          cfg.stream = s;
          cudaLaunchAttribute attr;
          attr.id = cudaLaunchAttributeClusterDimension;
          attr.val.clusterDim.x = cluster;
          attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
          cfg.attrs = &attr;
          cfg.numAttrs = cluster > 1 ? 1 : 0;
          CK(cudaLaunchKernelEx(&cfg, stream_kernel, reinterpret_cast<const uint4*>(pool + (call % copies) * slot),
                                bytes / 16, sink));
        }
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphUpload(exec, s));
        CK(cudaStreamSynchronize(s));
        t.push_back(graph_launch_ms(exec, s, a, b) * 1e3 / kPer);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
      }
      std::sort(t.begin(), t.end());
      const double us = t[t.size() / 2], at_copy = bytes / (copy_speed * 1e3);
      printf("FLOOR cluster %d %7.2f MiB  %7.2f us a launch  %6.0f GB/s  %5.2f us beyond copy speed\n", cluster, mib,
             us, bytes / (us * 1e3), us - at_copy);
    }
  }
  return 0;
}
