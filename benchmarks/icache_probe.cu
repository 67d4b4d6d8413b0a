// What a kernel's first pass over straight-line code costs on the GPU's instruction caches: the
// time of N independent FMAs run once (cold: fetched at this launch) against the same code run
// again right after (warm), per SM. Why: Nsight Compute put 11-21 % of the warp samples of the
// small kbit matmul launches in stall_no_inst, at every 128-byte line of their epilogues, which
// run once per launch.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -o /tmp/icache_probe benchmarks/icache_probe.cu
//   /tmp/icache_probe            (one line per code size and launch)
//
// Each CTA (one warp, one per SM) times both passes with clock64. The kernel is launched 3 times
// in a row, then once more after another kernel has run: whether the SMs keep a kernel's code
// from one launch to the next. Each FMA is independent of the 7 before it (8 accumulators), so a
// warm pass issues one per cycle: a 128-byte line (8 instructions) every 8 cycles.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

template <int N>
__global__ void straight_line(float* out, long long* clocks) {
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = threadIdx.x + i;
  const float b = 1.0001f;
  long long t[3];
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    t[pass] = clock64();
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(a[i % 8]) : "f"(b));
  }
  t[2] = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += a[i];
  if (s == 0.123f) out[threadIdx.x] = s;  // (keeps the FMAs)
  if (threadIdx.x == 0) {
    clocks[2 * blockIdx.x] = t[1] - t[0];
    clocks[2 * blockIdx.x + 1] = t[2] - t[1];
  }
}

__global__ void other_kernel(float* out) {  // something else on the SMs between launches
  out[blockIdx.x * blockDim.x + threadIdx.x] += 1.f;
}

template <int N>
void probe(int sms, float* out, long long* d_clocks) {
  std::vector<long long> h(2 * sms);
  for (int launch = 0; launch < 4; ++launch) {
    if (launch == 3) other_kernel<<<sms, 256>>>(out);
    straight_line<N><<<sms, 32>>>(out, d_clocks);
    cudaMemcpy(h.data(), d_clocks, h.size() * sizeof(long long), cudaMemcpyDeviceToHost);
    std::vector<long long> cold, warm;
    for (int i = 0; i < sms; ++i) { cold.push_back(h[2 * i]); warm.push_back(h[2 * i + 1]); }
    std::sort(cold.begin(), cold.end());
    std::sort(warm.begin(), warm.end());
    const double lines = N * 16.0 / 128.0;
    printf("N %5d instructions (%4.0f lines) launch %d%s: cold pass median %7lld cycles (max %7lld), warm %6lld;"
           " cold - warm per line %5.1f cycles\n",
           N, lines, launch, launch == 3 ? " (after another kernel)" : "", cold[sms / 2], cold.back(), warm[sms / 2],
           (cold[sms / 2] - warm[sms / 2]) / lines);
  }
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const int sms = prop.multiProcessorCount;
  printf("device: %s, %d SMs\n", prop.name, sms);
  float* out;
  long long* d_clocks;
  cudaMalloc(&out, sms * 256 * sizeof(float));
  cudaMemset(out, 0, sms * 256 * sizeof(float));
  cudaMalloc(&d_clocks, 2 * sms * sizeof(long long));
  probe<256>(sms, out, d_clocks);
  probe<1024>(sms, out, d_clocks);
  probe<4096>(sms, out, d_clocks);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(err)); return 1; }
  return 0;
}
