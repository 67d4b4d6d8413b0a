// What the end of a k-split costs when every SM does it at once: the ranks of a thread-block
// cluster add their f32 partial tiles (BM x BN) and store the bf16 sums, as the wgmma kernel's
// epilogue does (matmul_wgmma.cuh: each rank sums every ks-th row over the ranks, in rank order).
// Modes:
//   0 dsmem: a pull: each rank reads the other ranks' staged tiles
//            through distributed shared memory, one rank after another; a cluster barrier at exit.
//   1 dsmem-batched: the same, with a thread's loads from all ranks issued before its first add.
//   2 l2: each rank writes the rows it does not own to a global workspace (L2-resident), passes
//         one cluster barrier (release / acquire: orders global memory for the cluster), and
//         sums its own rows from its shared memory and the workspace; no barrier at exit.
//   3 none: each rank stores its own rows unsummed (what remains of the end without a sum).
//   4 dsmem-mlp, 5 l2-mlp: modes 0 and 2 with the cluster size a template constant and up to
//         four items' loads from every rank in flight before the first add.
//   6 push: each rank sends the rows it does not own to their owners' receive slots by st.async
//         (completing on the owner's mbarrier), then adds its own rows from its own shared memory;
//         no barrier at exit (the wgmma kernel's sum).
// Modes 0-2 and 4-6 give bit-identical sums (same order), checked. Every launch fills the GPU
// with as many clusters as fit at once (cudaOccupancyMaxActiveClusters at the reserved shared
// memory). Column "y": the sums stored as the kernels store them ("rows": [BM][clusters x BN])
// or each cluster's tile contiguous ("tiles"); it made no difference.
//
// Build and run (H100/H200):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/cluster_sum_bench.cu \
//        -o /tmp/cluster_sum_bench && /tmp/cluster_sum_bench
// Prints one line per (BM, BN, ks, y, mode): the launch time (back-to-back, events) and the
// median and slowest CTA's span from its tile staged to its sums stored, and the median to its
// exit (%globaltimer).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace cg = cooperative_groups;

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

constexpr int kThreads = 256;
constexpr int kSmemBytes = 200 * 1024;  // as the wgmma kernel: one CTA per SM

struct Params {
  int BM, BN, mode;
  int row_major;          // y as the kernels write it: [BM][clusters x BN], cluster c's columns at c BN
                          // (else [cluster][BM][BN], each cluster's rows contiguous)
  float* ws;              // [CTA][BM][BN] f32 (mode 2)
  __nv_bfloat16* y;       // [cluster][BM][BN]
  unsigned long long* tl;  // [CTA][3]: staged, stored, exit (ns)
};

__device__ __forceinline__ int ks_of(const cg::cluster_group& c) { return int(c.num_blocks()); }

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads, 1) cluster_sum_kernel(Params p) {
  extern __shared__ __align__(128) float tile[];
  cg::cluster_group cluster = cg::this_cluster();
  const int ks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int tid = threadIdx.x, stride = p.BN + 4;  // (the kernel's padded rows)
  const int cl = int(blockIdx.x) / ks;
  // the partial tile: any values; the sums are compared between modes
  for (int i = tid; i < p.BM * p.BN; i += kThreads) {
    const int m = i / p.BN, n = i % p.BN;
    tile[m * stride + n] = float((int(blockIdx.x) * 131 + m * 7 + n * 3) % 1009) * (1.f / 1024);
  }
  __syncthreads();
  const unsigned long long t_staged = now_ns();
  float* ws_me = p.ws + size_t(blockIdx.x) * p.BM * p.BN;
  const int first_cta = cl * ks;
  if (p.mode == 2) {  // the rows other ranks own, to the workspace (16-byte pieces, coalesced)
    const int n4 = p.BN / 4;
    for (int i = tid; i < p.BM * n4; i += kThreads) {
      const int m = i / n4, c4 = i % n4;
      if (m % ks == rank) continue;
      __stcg(reinterpret_cast<float4*>(ws_me + m * p.BN + 4 * c4),
             *reinterpret_cast<const float4*>(tile + m * stride + 4 * c4));
    }
  }
  if (ks > 1 && p.mode != 3) cluster.sync();
  const int E = 8, groups = p.BN / E;
  const int my_rows = (p.BM - rank + ks - 1) / ks;
  const int ncl = int(gridDim.x) / ks_of(cluster);
  __nv_bfloat16* y = p.row_major ? p.y + size_t(cl) * p.BN : p.y + size_t(cl) * p.BM * p.BN;
  const size_t y_stride = p.row_major ? size_t(ncl) * p.BN : size_t(p.BN);
  for (int it = tid; it < my_rows * groups; it += kThreads) {
    const int r = rank + ks * (it / groups), c0 = (it % groups) * E;
    float v[8];
    for (int e = 0; e < E; e += 4) {
      const int off = r * stride + c0 + e;
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
      if (p.mode == 0) {
        for (int q = 0; q < ks; ++q) {
          const float4 u = *cluster.map_shared_rank(reinterpret_cast<const float4*>(tile + off), q);
          s.x += u.x; s.y += u.y; s.z += u.z; s.w += u.w;
        }
      } else if (p.mode == 1) {
        float4 u[8];
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (q < ks) u[q] = *cluster.map_shared_rank(reinterpret_cast<const float4*>(tile + off), q);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (q < ks) { s.x += u[q].x; s.y += u[q].y; s.z += u[q].z; s.w += u[q].w; }
      } else if (p.mode == 2) {
        float4 u[8];
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (q < ks)
            u[q] = q == rank ? *reinterpret_cast<const float4*>(tile + off)
                             : __ldcg(reinterpret_cast<const float4*>(p.ws + size_t(first_cta + q) * p.BM * p.BN +
                                                                       r * p.BN + c0 + e));
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (q < ks) { s.x += u[q].x; s.y += u[q].y; s.z += u[q].z; s.w += u[q].w; }
      } else {
        s = *reinterpret_cast<const float4*>(tile + off);
      }
      v[e] = s.x; v[e + 1] = s.y; v[e + 2] = s.z; v[e + 3] = s.w;
    }
    uint32_t packed[4];
    for (int o = 0; o < 4; ++o) {
      __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * o], v[2 * o + 1]);
      std::memcpy(&packed[o], &h, 4);
    }
    *reinterpret_cast<uint4*>(y + size_t(r) * y_stride + c0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  __syncthreads();
  const unsigned long long t_stored = now_ns();
  if (ks > 1 && p.mode <= 1) cluster.sync();  // no rank leaves while another reads its tile
  if (tid == 0) {
    p.tl[3 * blockIdx.x] = t_staged;
    p.tl[3 * blockIdx.x + 1] = t_stored;
    p.tl[3 * blockIdx.x + 2] = now_ns();
  }
}


__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 ld_cluster(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}

// Modes 4-6, the cluster size a compile-time constant so that a thread's loads of IT items x 2
// halves x KS ranks are all in flight before its first add:
//   4 dsmem-mlp: the pull by ld.shared::cluster;
//   5 l2-mlp: the workspace round trip;
//   6 push: each rank sends the rows it does not own from its tile to their owner's receive
//     area with st.async (16 bytes each, completing on the owner's mbarrier: no round trip);
//     the owner then sums from its own shared memory only; no barrier at exit.
template <int KS, int MODE>
__global__ void __launch_bounds__(kThreads, 1) cluster_sum_mlp_kernel(Params p) {
  extern __shared__ __align__(128) float tile[];
  constexpr int IT = KS <= 2 ? 4 : KS <= 4 ? 2 : 1;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int tid = threadIdx.x, stride = p.BN + 4;
  const int cl = int(blockIdx.x) / KS, first_cta = cl * KS;
  const int my_rows = (p.BM - rank + KS - 1) / KS, max_rows = (p.BM + KS - 1) / KS;
  // push: receive area after the tile, one slot per sending rank q != rank (indexed by q), rows of
  // this rank in order, BN floats each; its mbarrier after it
  float* recv = tile + p.BM * stride;
  const uint32_t bar = smem_addr(recv + KS * max_rows * p.BN);
  if (MODE == 6) {
    if (tid == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster.sync();  // (the kernel's start has one anyway)
  }
  for (int i = tid; i < p.BM * p.BN; i += kThreads) {
    const int m = i / p.BN, n = i % p.BN;
    tile[m * stride + n] = float((int(blockIdx.x) * 131 + m * 7 + n * 3) % 1009) * (1.f / 1024);
  }
  __syncthreads();
  const unsigned long long t_staged = now_ns();
  const int n4 = p.BN / 4;
  float* ws_me = p.ws + size_t(blockIdx.x) * p.BM * p.BN;
  if (MODE == 5) {
    for (int i = tid; i < p.BM * n4; i += kThreads) {
      const int m = i / n4, c4 = i % n4;
      if (m % KS == rank) continue;
      __stcg(reinterpret_cast<float4*>(ws_me + m * p.BN + 4 * c4),
             *reinterpret_cast<const float4*>(tile + m * stride + 4 * c4));
    }
    cluster.sync();
  } else if (MODE == 6) {
    if (tid == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                   "r"(uint32_t((KS - 1) * my_rows * p.BN * 4)) : "memory");
    for (int i = tid; i < p.BM * n4; i += kThreads) {
      const int m = i / n4, c4 = i % n4, owner = m % KS;
      if (owner == rank) continue;
      const float4 v = *reinterpret_cast<const float4*>(tile + m * stride + 4 * c4);
      const uint32_t dst = map_rank(smem_addr(recv + (rank * max_rows + m / KS) * p.BN + 4 * c4), owner);
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
          ::"r"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(map_rank(bar, owner)) : "memory");
    }
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 q, [%1], 0;"
                   " selp.u32 %0, 1, 0, q; }" : "=r"(done) : "r"(bar) : "memory");
  } else {
    cluster.sync();
  }
  const int groups = p.BN / 8;
  const int ncl = int(gridDim.x) / ks_of(cluster);
  __nv_bfloat16* y = p.row_major ? p.y + size_t(cl) * p.BN : p.y + size_t(cl) * p.BM * p.BN;
  const size_t y_stride = p.row_major ? size_t(ncl) * p.BN : size_t(p.BN);
  const uint32_t tile_s = smem_addr(tile);
  for (int it0 = tid; it0 < my_rows * groups; it0 += IT * kThreads) {
    float4 u[IT][2][KS];
#pragma unroll
    for (int j = 0; j < IT; ++j) {
      const int it = it0 + j * kThreads;
      if (it >= my_rows * groups) break;
      const int rr = it / groups, r = rank + KS * rr, c0 = (it % groups) * 8;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < KS; ++q) {
          const int off = r * stride + c0 + 4 * h;
          if (q == rank) u[j][h][q] = *reinterpret_cast<const float4*>(tile + off);
          else if (MODE == 4) u[j][h][q] = ld_cluster(map_rank(tile_s + 4 * off, q));
          else if (MODE == 5)
            u[j][h][q] = __ldcg(reinterpret_cast<const float4*>(p.ws + size_t(first_cta + q) * p.BM * p.BN +
                                                                 r * p.BN + c0 + 4 * h));
          else u[j][h][q] = *reinterpret_cast<const float4*>(recv + (q * max_rows + rr) * p.BN + c0 + 4 * h);
        }
    }
#pragma unroll
    for (int j = 0; j < IT; ++j) {
      const int it = it0 + j * kThreads;
      if (it >= my_rows * groups) break;
      const int r = rank + KS * (it / groups), c0 = (it % groups) * 8;
      float v[8];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int q = 0; q < KS; ++q) { s.x += u[j][h][q].x; s.y += u[j][h][q].y; s.z += u[j][h][q].z; s.w += u[j][h][q].w; }
        v[4 * h] = s.x; v[4 * h + 1] = s.y; v[4 * h + 2] = s.z; v[4 * h + 3] = s.w;
      }
      uint32_t packed[4];
#pragma unroll
      for (int o = 0; o < 4; ++o) {
        __nv_bfloat162 hh = __floats2bfloat162_rn(v[2 * o], v[2 * o + 1]);
        std::memcpy(&packed[o], &hh, 4);
      }
      *reinterpret_cast<uint4*>(y + size_t(r) * y_stride + c0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
  __syncthreads();
  const unsigned long long t_stored = now_ns();
  if (MODE == 4) cluster.sync();
  if (tid == 0) {
    p.tl[3 * blockIdx.x] = t_staged;
    p.tl[3 * blockIdx.x + 1] = t_stored;
    p.tl[3 * blockIdx.x + 2] = now_ns();
  }
}

using KernelFn = void (*)(Params);
template <int MODE>
KernelFn mlp_kernel(int ks) {
  switch (ks) {
    case 2: return cluster_sum_mlp_kernel<2, MODE>;
    case 3: return cluster_sum_mlp_kernel<3, MODE>;
    case 4: return cluster_sum_mlp_kernel<4, MODE>;
    case 5: return cluster_sum_mlp_kernel<5, MODE>;
    case 6: return cluster_sum_mlp_kernel<6, MODE>;
    case 7: return cluster_sum_mlp_kernel<7, MODE>;
    default: return cluster_sum_mlp_kernel<8, MODE>;
  }
}
KernelFn kernel_for(int mode, int ks) {
  if (mode < 4) return cluster_sum_kernel;
  if (mode == 4) return mlp_kernel<4>(ks);
  if (mode == 5) return mlp_kernel<5>(ks);
  return mlp_kernel<6>(ks);
}

int main() {
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs\n", prop.name, sms);
  for (int mode = 0; mode < 7; ++mode)
    for (int ks = 2; ks <= 8; ++ks)
      CHECK(cudaFuncSetAttribute(kernel_for(mode, ks), cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const size_t max_ctas = 2 * size_t(sms);
  float* ws;
  __nv_bfloat16* y;
  unsigned long long* tl;
  CHECK(cudaMalloc(&ws, max_ctas * 256 * 256 * 4));
  CHECK(cudaMalloc(&y, max_ctas * 256 * 256 * 2));
  CHECK(cudaMalloc(&tl, max_ctas * 3 * 8));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int tiles[][2] = {{64, 128}, {128, 128}, {128, 256}, {256, 128}};
  const char* names[] = {"dsmem", "dsmem-batched", "l2", "none", "dsmem-mlp", "l2-mlp", "push"};
  std::printf("%4s %4s %3s %5s %-6s %-14s %9s %9s %9s %9s\n", "BM", "BN", "ks", "ctas", "y", "mode", "launch_us",
              "sum_med", "sum_max", "exit_med");
  int failures = 0;
  for (const auto& t : tiles) {
    if (t[0] * (t[1] + 4) * 4 > kSmemBytes) continue;
    for (int ks = 2; ks <= 8; ++ks) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = ks;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = kSmemBytes;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      cfg.gridDim = dim3(ks);
      int ncl = 0;
      CHECK(cudaOccupancyMaxActiveClusters(&ncl, cluster_sum_kernel, &cfg));  // (same for every mode)
      ncl = std::min(ncl, sms / ks);
      cfg.gridDim = dim3(ncl * ks);
      for (int layout = 0; layout < 2; ++layout) {
      std::vector<uint16_t> ref;
      for (int mode = 0; mode < 7; ++mode) {
        const KernelFn kern = kernel_for(mode, ks);
        // push: the tile, the receive area ((ks - 1) ranks' rows, one slot per rank) and an mbarrier
        if (mode == 6 && t[0] * (t[1] + 4) * 4 + ks * ((t[0] + ks - 1) / ks) * t[1] * 4 + 8 > kSmemBytes) continue;
        Params p{t[0], t[1], mode, layout, ws, y, tl};
        CHECK(cudaMemset(y, 0, size_t(ncl) * t[0] * t[1] * 2));
        for (int i = 0; i < 20; ++i) CHECK(cudaLaunchKernelEx(&cfg, kern, p));
        CHECK(cudaDeviceSynchronize());
        const int reps = 200;
        CHECK(cudaEventRecord(e0));
        for (int i = 0; i < reps; ++i) CHECK(cudaLaunchKernelEx(&cfg, kern, p));
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        std::vector<unsigned long long> h(size_t(ncl) * ks * 3);
        CHECK(cudaMemcpy(h.data(), tl, h.size() * 8, cudaMemcpyDeviceToHost));
        std::vector<double> sum_span, exit_span;
        for (size_t c = 0; c < h.size() / 3; ++c) {
          sum_span.push_back((h[3 * c + 1] - h[3 * c]) * 1e-3);
          exit_span.push_back((h[3 * c + 2] - h[3 * c]) * 1e-3);
        }
        std::sort(sum_span.begin(), sum_span.end());
        std::sort(exit_span.begin(), exit_span.end());
        std::vector<uint16_t> out(size_t(ncl) * t[0] * t[1]);
        CHECK(cudaMemcpy(out.data(), y, out.size() * 2, cudaMemcpyDeviceToHost));
        const char* verdict = "";
        if (mode == 0) ref = out;
        else if (mode != 3 && out != ref) { verdict = "  MISMATCH"; ++failures; }
        std::printf("%4d %4d %3d %5d %-6s %-14s %9.2f %9.2f %9.2f %9.2f%s\n", t[0], t[1], ks, ncl * ks,
                    layout ? "rows" : "tiles", names[mode], ms * 1e3 / reps, sum_span[sum_span.size() / 2],
                    sum_span.back(), exit_span[exit_span.size() / 2], verdict);
      }
      }
    }
  }
  std::printf("%s: %d mismatches\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
