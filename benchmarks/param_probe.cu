// What a kernel's first read of each line of its parameters costs: the latency of one read of a
// kernel parameter (a constant-bank load, LDC) the first time its line is touched in a launch,
// against a second read of the same line, and after one warp has touched every line at once.
// Why: the small kbit products spend 0.2-0.4 us on stretches of their item end that issue a few
// dozen instructions; those stretches read parameters that nothing had read before in that
// launch.
// Measured (H200): a first read
// of a parameter line takes ~137 cycles, a second 63, an L2 hit from global memory 460-540: not
// what the stretches cost.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -o /tmp/param_probe benchmarks/param_probe.cu
//   /tmp/param_probe            (one line per read: median and slowest SM, cycles)
//
// One warp per SM; lane 0 reads a chain of parameters, each read's index depending on the value
// before (all parameters are 0), so each read waits for the previous one, and a branch on the
// value sits between the read and the clock (in-order issue: the clock read waits for it). For
// comparison, the same chain on global memory that the previous kernel wrote (L2 hits).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

struct alignas(128) Block {  // (its own lines: after the other parameters)
  int w[256];  // 1 KiB of parameters, zeros
};

constexpr int kReads = 9;
// Word offsets read in order: a line, the same line, lines 64, 128, 256, 512, 768 bytes on, the
// 64-byte line again, and a word 4 bytes past the first.
__device__ constexpr int kOffsets[kReads] = {0, 1, 16, 32, 64, 128, 192, 16, 2};

// The clock after `v` has arrived: a branch on it (in-order issue: nothing after the branch
// issues before it resolves; an add of v alone was scheduled after the clock read).
__device__ __forceinline__ long long clock_after(int v, int* sink) {
  if (v == 12345) {
    *sink = v;
    asm volatile("trap;");
  }
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}

// warm_first: every lane reads word 8 * lane first (lines 32 bytes apart across the 1 KiB), and
// the chain starts after those values arrived.
template <bool kGlobal>
__global__ void chain(const int* g, int warm_first, long long* out, int* sink, const __grid_constant__ Block p) {
  int idx = 0;
  if (warm_first) {
    idx = kGlobal ? g[8 * threadIdx.x] : p.w[8 * threadIdx.x];
    idx = __shfl_sync(0xffffffffu, idx, 0) | __reduce_or_sync(0xffffffffu, idx);  // every lane's read is back
  }
  if (threadIdx.x != 0) return;
  long long t0 = clock_after(idx, sink), t[kReads];
#pragma unroll
  for (int i = 0; i < kReads; ++i) {
    const int v = kGlobal ? g[kOffsets[i] + idx] : p.w[kOffsets[i] + idx];
    t[i] = clock_after(v, sink);
    idx = v;
  }
#pragma unroll
  for (int i = 0; i < kReads; ++i) {
    out[blockIdx.x * kReads + i] = t[i] - t0;
    t0 = t[i];
  }
}

__global__ void touch(int* g, int n) {  // writes g (so the chain's global reads hit L2)
  for (int i = threadIdx.x; i < n; i += blockDim.x) g[i] = 0;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs\n", prop.name, sms);
  Block p{};
  int *g, *sink;
  long long* d_out;
  cudaMalloc(&g, 4096);
  cudaMalloc(&sink, 4);
  cudaMalloc(&d_out, sizeof(long long) * sms * kReads);
  std::vector<long long> h(size_t(sms) * kReads);
  const char* what[kReads] = {"line 0 (first read)", "line 0 again", "+64 B", "+128 B", "+256 B",
                              "+512 B", "+768 B", "+64 B again", "line 0, +8 B"};
  for (int src = 0; src < 2; ++src)
    for (int warm = 0; warm < 2; ++warm)
      for (int launch = 0; launch < 3; ++launch) {
        touch<<<1, 256>>>(g, 1024);
        if (src == 0)
          chain<false><<<sms, 32>>>(g, warm, d_out, sink, p);
        else
          chain<true><<<sms, 32>>>(g, warm, d_out, sink, p);
        if (cudaMemcpy(h.data(), d_out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost) != cudaSuccess) {
          printf("ERROR %s\n", cudaGetErrorString(cudaGetLastError()));
          return 1;
        }
        printf("%s, %s, launch %d:", src == 0 ? "parameters" : "global (L2)",
               warm ? "after one warp read every line" : "cold", launch);
        for (int i = 0; i < kReads; ++i) {
          std::vector<long long> v;
          for (int s = 0; s < sms; ++s) v.push_back(h[size_t(s) * kReads + i]);
          std::sort(v.begin(), v.end());
          printf("  %s %lld/%lld", what[i], v[v.size() / 2], v.back());
        }
        printf("\n");
      }
  return 0;
}
