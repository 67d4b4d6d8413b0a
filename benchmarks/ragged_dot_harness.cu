// Standalone harness of the grouped expert product's CUDA kernels (cpp/cuda/ragged_dot.cu, the
// fused kernel's grouped mode, ragged_dot_ws.cuh, and the wgmma kernel's, ragged_dot_wgmma.cuh),
// without JAX:
//   check: every bits, dtype, layout and GLU on group sizes with zeros, empty ends, one group,
//          sum < M, one-row groups whose block of activations reaches into the next group, groups
//          of several row blocks, and row counts that take each of the fused kernel's tilings,
//          and each of the grouped wgmma kernel's row tiles (forced), against a float64 host
//          reference; exits 1 on a mismatch.
//   time:  the routed-expert shapes of three MoE models at T tokens with uniform or skewed top-k
//          routing, cold weights (L2 flushed before each launch), the kernel's device time by CUDA
//          events against the copy bandwidth measured in the same run, and the bf16 floor (the
//          active experts' bf16 bytes at that bandwidth) over the kernel's time; at T >= 256, each
//          kernel's tilings forced too, and the dense bf16 dot of the same FLOPs (jnp.dot, from
//          benchmarks/results/moe_h200.md) over the kernel's time.
//   decode: T = 1 and 4 of the same shapes (bits 4, uniform routing) timed three ways: as `time`
//          does (one launch between CUDA events, launch latency included), and as the device's
//          time per launch inside a CUDA graph of back-to-back launches: cold (each launch after a
//          kernel that reads 2x L2 of other data, whose own graph's time is subtracted), cold
//          weights (x and group_sizes read into L2 after that, as the kernels that wrote them
//          leave them) and warm (the experts' weights in L2); then every cluster size and split
//          of the fused kernel's plan on the Qwen3-Coder-Next shapes, cold (decode-plain: without
//          them).
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -Icpp
//        -DKBIT_WGMMA=1 benchmarks/ragged_dot_harness.cu cpp/cuda/ragged_dot.cu
//        cpp/cuda/ragged_dot_ws_b[2-5].cu cpp/cuda/ragged_dot_wgmma_b[2-5].cu
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/codes.cuh"
#include "cuda/ragged_dot.cuh"
#include "format.h"
#include "glu.h"

using namespace kbit::cuda;

#define CK(x)                                                                     \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(2);                                                               \
    }                                                                             \
  } while (0)

namespace kbit::cuda {
const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "?";
}
}  // namespace kbit::cuda

static uint32_t host_code(const uint32_t* w, int bits, int layout, int k) {
  if (layout == kbit::kPlanes) {
    uint32_t c = 0;
    for (int b = 0; b < bits; ++b) c |= ((w[b] >> k) & 1u) << b;
    return c;
  }
  const int bit = bits * fragment_pos(k), wi = bit >> 5, sh = bit & 31;
  uint64_t v = w[wi];
  if (wi + 1 < bits) v |= uint64_t(w[wi + 1]) << 32;
  return uint32_t(v >> sh) & ((1u << bits) - 1u);
}

static void store(std::vector<uint8_t>& buf, DType d, size_t i, float v) {
  if (d == DType::kBF16) reinterpret_cast<__nv_bfloat16*>(buf.data())[i] = __float2bfloat16_rn(v);
  else if (d == DType::kF16) reinterpret_cast<__half*>(buf.data())[i] = __float2half_rn(v);
  else reinterpret_cast<float*>(buf.data())[i] = v;
}
static float load(const std::vector<uint8_t>& buf, DType d, size_t i) {
  if (d == DType::kBF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(buf.data())[i]);
  if (d == DType::kF16) return __half2float(reinterpret_cast<const __half*>(buf.data())[i]);
  return reinterpret_cast<const float*>(buf.data())[i];
}
static size_t dsize(DType d) { return d == DType::kF32 ? 4 : 2; }

struct Case {
  int64_t m, k, n;
  std::vector<int> sizes;
  int bits, layout, glu;
  DType dtype;
  bool force_generic;
  int wgmma = 0;  // 1: the grouped wgmma kernel, -1: not it (RaggedDotTuning)
  int wgmma_tile = 0;
};

static std::mt19937 rng(1234);

static bool run_case(const Case& c) {
  const int64_t G = c.sizes.size(), KB = c.k / 32, C = 1 << c.bits;
  const int64_t n_out = c.glu ? c.n / 2 : c.n;
  std::uniform_int_distribution<uint32_t> u32;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  std::vector<uint32_t> planes(size_t(G * KB * c.n * c.bits));
  for (auto& w : planes) w = u32(rng);
  std::vector<uint8_t> scales(size_t(G * KB * c.n));
  for (auto& s : scales) s = uint8_t(0x80 + (u32(rng) % 0x40));  // 2^-3 .. 2^0 range
  std::vector<float> cb(size_t(G * C)), ts(G);
  for (auto& v : cb) v = ud(rng);
  for (auto& v : ts) v = 0.5f + 0.5f * (ud(rng) + 1.f);
  std::vector<uint8_t> x(size_t(c.m * c.k * dsize(c.dtype)));
  for (int64_t i = 0; i < c.m * c.k; ++i) store(x, c.dtype, i, nd(rng));
  std::vector<int32_t> gs(c.sizes.begin(), c.sizes.end());

  uint32_t* d_planes; uint8_t* d_scales; float *d_cb, *d_ts; int32_t* d_gs; void *d_x, *d_y;
  CK(cudaMalloc(&d_planes, std::max<size_t>(4, planes.size() * 4)));
  CK(cudaMalloc(&d_scales, std::max<size_t>(1, scales.size())));
  CK(cudaMalloc(&d_cb, std::max<size_t>(4, cb.size() * 4)));
  CK(cudaMalloc(&d_ts, std::max<size_t>(4, ts.size() * 4)));
  CK(cudaMalloc(&d_gs, std::max<size_t>(4, gs.size() * 4)));
  CK(cudaMalloc(&d_x, std::max<size_t>(16, x.size())));
  const size_t ybytes = size_t(c.m * n_out * dsize(c.dtype));
  CK(cudaMalloc(&d_y, std::max<size_t>(16, ybytes)));
  CK(cudaMemcpy(d_planes, planes.data(), planes.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_scales, scales.data(), scales.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_cb, cb.data(), cb.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_ts, ts.data(), ts.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_gs, gs.data(), gs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_x, x.data(), x.size(), cudaMemcpyHostToDevice));
  CK(cudaMemset(d_y, 0xff, std::max<size_t>(16, ybytes)));  // NaN everywhere: unwritten rows show

  RaggedDotArgs a;
  a.x = d_x; a.dtype = c.dtype; a.planes = d_planes; a.scales = d_scales; a.codebook = d_cb;
  a.tensor_scale = d_ts; a.group_sizes = d_gs; a.y = d_y;
  a.m = c.m; a.k = c.k; a.n = c.n; a.groups = G; a.bits = c.bits; a.layout = c.layout; a.glu = c.glu;
  RaggedDotTuning tune;
  tune.force_generic = c.force_generic;
  tune.wgmma = c.wgmma;
  tune.wgmma_tile = c.wgmma_tile;
  const std::string path = c.force_generic ? "generic (forced)"
                           : c.wgmma > 0   ? "wgmma (forced, tile " + std::to_string(c.wgmma_tile) + ")"
                                           : ragged_dot_path(a);
  const std::string err = launch_ragged_dot(a, nullptr, &tune);
  if (!err.empty()) { std::printf("launch error: %s\n", err.c_str()); return false; }
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> y(ybytes);
  CK(cudaMemcpy(y.data(), d_y, ybytes, cudaMemcpyDeviceToHost));

  // Reference: float64 sums of x * (codebook[code] * scale * tensor_scale).
  const double tol = c.dtype == DType::kF32 ? 2e-5 : 1.2e-2;
  int64_t bad = 0, row = 0;
  double worst = 0;
  std::vector<double> acc(c.n), mag(c.n);
  const kbit::GluLogit logit(c.glu);
  for (int64_t g = 0; g <= G; ++g) {
    const int64_t rows = g < G ? std::max(0, c.sizes[g]) : c.m;
    for (int64_t r = 0; r < rows && row < c.m; ++r, ++row) {
      std::fill(acc.begin(), acc.end(), 0.0);
      std::fill(mag.begin(), mag.end(), 0.0);
      if (g < G) {
        for (int64_t kb = 0; kb < KB; ++kb)
          for (int64_t n = 0; n < c.n; ++n) {
            const int64_t cell = (g * KB + kb) * c.n + n;
            const uint32_t* w = &planes[cell * c.bits];
            const double s = kbit::decode_e4m4(scales[cell]) * double(ts[g]);
            for (int k = 0; k < 32; ++k) {
              const double wv = double(cb[g * C + host_code(w, c.bits, c.layout, k)]) * s;
              const double xv = load(x, c.dtype, row * c.k + kb * 32 + k);
              acc[n] += xv * wv;
              mag[n] += std::fabs(xv * wv);
            }
          }
      }
      for (int64_t j = 0; j < n_out; ++j) {
        double ref, scale;
        if (c.glu) {
          const double gte = acc[2 * j], up = acc[2 * j + 1];
          ref = double(kbit::glu_apply(logit, float(gte), float(up)));
          scale = (mag[2 * j] + std::fabs(gte)) * (std::fabs(up) + mag[2 * j + 1]) + 1e-30;
        } else {
          ref = acc[j];
          scale = mag[j] + 1e-30;
        }
        const double got = load(y, c.dtype, row * n_out + j);
        const double e = std::fabs(got - ref) / scale;
        if (!(e <= tol) || (g == G && got != 0.0)) {
          if (bad < 3)
            std::printf("  mismatch row %lld col %lld (group %lld): got %g want %g\n", (long long)row,
                        (long long)j, (long long)g, got, ref);
          ++bad;
        }
        if (e > worst && g < G) worst = e;
      }
    }
    if (row >= c.m) break;
  }
  std::string sz;
  for (size_t i = 0; i < c.sizes.size() && i < 8; ++i) sz += std::to_string(c.sizes[i]) + ",";
  std::printf("%s M=%lld K=%lld N=%lld G=%lld sizes=%s bits=%d layout=%d glu=%d %s [%s]: worst %.2e\n",
              bad ? "FAIL" : "ok  ", (long long)c.m, (long long)c.k, (long long)c.n, (long long)G, sz.c_str(),
              c.bits, c.layout, c.glu, dtype_name(c.dtype), path.c_str(), worst);
  cudaFree(d_planes); cudaFree(d_scales); cudaFree(d_cb); cudaFree(d_ts); cudaFree(d_gs); cudaFree(d_x); cudaFree(d_y);
  return bad == 0;
}

static int check() {
  int fails = 0, total = 0;
  const std::vector<std::vector<int>> sizes = {
      {3, 0, 9, 1, 0, 16},  // zeros inside, sum 29
      {0, 0, 40, 0},        // one group, empty ends, several row blocks of 32
      {0, 5, 0, 0},         // sum < M
      {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2},
      {-3, 70, 0},          // a negative size counts as 0
  };
  for (int bits = 2; bits <= 5; ++bits)
    for (DType d : {DType::kBF16, DType::kF16, DType::kF32})
      for (int glu = 0; glu <= 2; ++glu)
        for (size_t si = 0; si < sizes.size(); ++si) {
          int64_t m = 0;
          for (int s : sizes[si]) m += std::max(0, s);
          m += (si == 2) ? 7 : 0;
          if (si == 4) m = 66;  // sum (70) above M: rows clamp to M
          for (int layout : {1, 0}) {
            if (layout == 0 && (glu == 2 || si % 2)) continue;
            Case c{m, int64_t(128 + 64 * (si % 2)), glu ? 256 : 192, sizes[si], bits, layout, glu, d, false};
            ++total;
            fails += !run_case(c);
          }
        }
  // The fused kernel's tilings follow the rows per active expert, ceil(M / min(G, M)): 8 rows and
  // fewer (one-row groups, boxes over the next group), 9..32 and above (groups of several blocks
  // of 32 and 64 rows), with empty groups at both ends and sum < M; bf16 and f16, GLU.
  const std::vector<std::pair<int64_t, std::vector<int>>> tiled = {
      {12, {0, 1, 1, 1, 0, 1, 2, 0, 3, 1, 0}},  // 2 rows per expert: blocks of 8 rows
      {50, {0, 30, 1, 1, 13, 0}},                  // 9: blocks of 32
      {140, {0, 1, 1, 1, 130, 0, 1, 2, 0}},        // 18: blocks of 32
      {205, {0, 200, 1, 1, 0}},                    // 41: blocks of 64
  };
  for (int bits = 2; bits <= 5; ++bits)
    for (const auto& [m, sz] : tiled)
      for (DType d : {DType::kBF16, DType::kF16}) {
        Case c{m, 256, 192, sz, bits, 1, d == DType::kF16 ? 1 : 0, d, false, -1};  // (-1: not the wgmma kernel)
        ++total;
        fails += !run_case(c);
      }
  // Model-sized experts: K = 2048, N = 1024 (several chunks per item, clusters), decode-like
  // routing over many experts, and one group of all rows among many empty ones.
  for (int bits : {2, 3, 4, 5}) {
    std::vector<int> ten(64, 0), one(512, 0);
    for (int e = 0; e < 10; ++e) ten[3 + 6 * e] = 1;
    one[500] = 37;
    Case c{10, 2048, 1024, ten, bits, 1, 1, DType::kBF16, false};
    ++total; fails += !run_case(c);
    Case c2{40, 2048, 1024, one, bits, 1, 0, DType::kBF16, false};
    ++total; fails += !run_case(c2);
  }
  // Larger K, N = 96 (a partial column group), forced generic, G = 0.
  for (int bits : {2, 4, 5}) {
    Case c{100, 2048, 128, {30, 0, 33, 37}, bits, 1, 1, DType::kBF16, false};
    ++total; fails += !run_case(c);
    Case c2{20, 96, 96, {5, 15}, bits, 1, 0, DType::kBF16, false};
    ++total; fails += !run_case(c2);
    Case c3{29, 128, 128, {3, 0, 9, 1, 0, 16}, bits, 1, 1, DType::kBF16, true};
    ++total; fails += !run_case(c3);
  }
  // The grouped wgmma kernel, forced, each tile (96 x 256, 128 x 256): a one-row group whose box
  // reaches into the next group, groups of several row tiles with a partial last one, tiles that
  // end exactly at a group's end, empty groups at both ends and inside, sum < M and sum > M, a
  // negative size; K with an odd number of k-blocks (a half chunk), N = 160 (a partial column
  // tile), GLU; bits 2..5, bf16 and f16.
  const std::vector<std::pair<int64_t, std::vector<int>>> wg = {
      {300, {0, 1, 150, 0, 3, 130, 2, 0}},  // sum 286 < M
      {200, {0, 0, 64, 128, 1, 0}},
      {270, {-2, 260, 0, 5}},
      {250, {100, 100, 100}},  // sum above M: the last group clamps
  };
  for (int bits = 2; bits <= 5; ++bits)
    for (int tile : {1, 2})
      for (size_t i = 0; i < wg.size(); ++i) {
        const DType d = (i + tile + bits) % 2 ? DType::kF16 : DType::kBF16;
        const int glu = (i + bits) % 3 == 0 ? 0 : (i + bits) % 3;
        Case c{wg[i].first, i % 2 ? 96 : 256, glu ? 512 : 160, wg[i].second, bits, 1, glu, d, false, 1, tile};
        ++total;
        fails += !run_case(c);
      }
  // Up to 8 rows per expert with K above one chunk of the K-split tiling (K <= 512 takes the
  // N-split tiling in blocks of 32): zeros inside, empty ends, sum < M.
  for (int bits = 2; bits <= 5; ++bits) {
    Case c{29, 1024, 192, {3, 0, 9, 1, 0, 16}, bits, 1, bits % 3, bits == 3 ? DType::kF16 : DType::kBF16, false};
    ++total; fails += !run_case(c);
    Case c2{12, 1024, 128, {0, 5, 0, 0}, bits, 1, 0, DType::kBF16, false};
    ++total; fails += !run_case(c2);
  }
  // Many groups at decode sizes: G = 1024 and 1025, rows in a few groups at both ends and in the
  // middle, sum < M, in both tilings for up to 8 rows per expert (K = 256: blocks of 32; K = 640:
  // blocks of 8 with a partial last chunk).
  for (int g : {1024, 1025}) {
    std::vector<int> many(g, 0);
    many[0] = 2; many[33] = 1; many[g / 2] = 3; many[g - 2] = 1; many[g - 1] = 2;
    for (int64_t k : {256, 640}) {
      Case c{12, k, 128, many, 4, 1, 1, DType::kBF16, false};
      ++total; fails += !run_case(c);
    }
  }
  Case c0{9, 64, 64, {}, 4, 1, 0, DType::kBF16, false};
  ++total; fails += !run_case(c0);
  std::printf("check: %d of %d cases failed\n", fails, total);
  return fails ? 1 : 0;
}

// ---- timing ------------------------------------------------------------------------------
__global__ void fill_random(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t v = uint32_t(i) * 2654435761u ^ seed;
    v ^= v >> 13; v *= 0x5bd1e995u; v ^= v >> 15;
    p[i] = v;
  }
}
__global__ void fill_scales(uint8_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(0x90 + (i * 7) % 16);
}
__global__ void fill_bf16(__nv_bfloat16* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(float(int(i % 17) - 8) * 0.05f);
}

// jnp.dot of [M, K] x [K, N] bf16 (the same FLOPs as the expert product at T tokens) on the
// H200, jax 0.11.2: benchmarks/results/moe_h200.md's `dense bf16 us`; 0 where it has none.
static double dense_bf16_us(const std::string& shape, int T) {
  struct Row { const char* shape; double t256, t4096; };
  static const Row rows[] = {
      {"qwen3-next gate_up", 24.7, 257.1}, {"qwen3-next down", 20.8, 138.8},
      {"qwen3-30b gate_up", 29.3, 310.3},  {"qwen3-30b down", 18.7, 159.6},
      {"glm4.7-flash gate_up", 31.0, 305.8}, {"glm4.7-flash down", 17.4, 166.0},
  };
  for (const Row& r : rows)
    if (shape == r.shape) return T == 256 ? r.t256 : T == 4096 ? r.t4096 : 0.0;
  return 0.0;
}

static int time_mode(int reps) {
  struct Shape { const char* name; int64_t k, n; int g, topk, glu; };
  const Shape shapes[] = {
      {"qwen3-next gate_up", 2048, 1024, 512, 10, 1}, {"qwen3-next down", 512, 2048, 512, 10, 0},
      {"qwen3-30b gate_up", 2048, 1536, 128, 8, 1},   {"qwen3-30b down", 768, 2048, 128, 8, 0},
      {"glm4.7-flash gate_up", 2048, 3072, 64, 4, 1}, {"glm4.7-flash down", 1536, 2048, 64, 4, 0},
  };
  const size_t flush_bytes = size_t(512) << 20;
  void* flush;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // Copy bandwidth: device-to-device copy of 1 GiB (read + write).
  {
    void *a, *b;
    const size_t bytes = size_t(1) << 30;
    CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
    float best = 1e9;
    for (int r = 0; r < 5; ++r) {
      CK(cudaEventRecord(e0)); CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
    }
    const double bw = 2.0 * bytes / (best * 1e-3);
    std::printf("copy bandwidth %.0f GB/s\n", bw / 1e9);
    CK(cudaFree(a)); CK(cudaFree(b));
    setenv("KBIT_COPY_BW", std::to_string(bw).c_str(), 1);
  }
  const double bw = std::atof(std::getenv("KBIT_COPY_BW"));
  std::printf("%-22s %5s %4s %5s %6s %9s %9s %7s %9s %7s\n", "shape", "T", "bits", "M", "active", "us", "MB read",
              "%copy", "bf16floor", "floor/us");
  for (const Shape& s : shapes)
    for (int bits : {4, 2, 3, 5}) {
      const int64_t KB = s.k / 32;
      const size_t words = size_t(s.g) * KB * s.n * bits, cells = size_t(s.g) * KB * s.n;
      uint32_t* planes; uint8_t* scales; float *cb, *ts; int32_t* gs; __nv_bfloat16 *x, *y;
      CK(cudaMalloc(&planes, words * 4)); CK(cudaMalloc(&scales, cells));
      fill_random<<<1024, 256>>>(planes, words, 17u);
      fill_scales<<<1024, 256>>>(scales, cells);
      std::vector<float> hcb(size_t(s.g) << bits), hts(s.g, 1.f);
      for (size_t i = 0; i < hcb.size(); ++i) hcb[i] = float(int(i % (1 << bits)) - (1 << (bits - 1))) / (1 << bits);
      CK(cudaMalloc(&cb, hcb.size() * 4)); CK(cudaMalloc(&ts, s.g * 4)); CK(cudaMalloc(&gs, s.g * 4));
      CK(cudaMemcpy(cb, hcb.data(), hcb.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(ts, hts.data(), s.g * 4, cudaMemcpyHostToDevice));
      const int max_t = 4096;
      CK(cudaMalloc(&x, size_t(max_t) * s.topk * s.k * 2));
      CK(cudaMalloc(&y, size_t(max_t) * s.topk * s.n * 2));
      fill_bf16<<<1024, 256>>>(x, size_t(max_t) * s.topk * s.k);
      for (int run = 0; run < 12; ++run) {
        const int T = run < 10 ? std::array<int, 10>{1, 4, 16, 64, 256, 512, 768, 1024, 2048, 4096}[run] : (run == 10 ? 16 : 64);
        const bool skewed = run >= 10;  // expert of popularity rank r drawn with weight (r + 1)^-1.2
        if (T > max_t || (skewed && bits != 4) || (bits != 4 && T != 1 && T != 16 && T != 4096)) continue;
        const int64_t M = int64_t(T) * s.topk;
        std::vector<int32_t> hg(s.g, 0);
        std::mt19937 r2(T * 31 + bits);
        std::vector<double> pop(s.g);
        for (int e = 0; e < s.g; ++e) pop[e] = skewed ? std::pow(double(e + 1), -1.2) : 1.0;
        std::shuffle(pop.begin(), pop.end(), r2);
        std::discrete_distribution<int> draw(pop.begin(), pop.end());
        for (int t = 0; t < T; ++t) {  // top-k distinct experts per token
          std::vector<int> pick;
          while (int(pick.size()) < s.topk) {
            const int e = draw(r2);
            if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
          }
          for (int e : pick) ++hg[e];
        }
        int active = 0;
        for (int v : hg) active += v > 0;
        CK(cudaMemcpy(gs, hg.data(), s.g * 4, cudaMemcpyHostToDevice));
        RaggedDotArgs a;
        a.x = x; a.dtype = DType::kBF16; a.planes = planes; a.scales = scales; a.codebook = cb; a.tensor_scale = ts;
        a.group_sizes = gs; a.y = y; a.m = M; a.k = s.k; a.n = s.n; a.groups = s.g; a.bits = bits;
        a.layout = 1; a.glu = s.glu;
        // (at T >= 256, bits 4, uniform: also each of the fused kernel's tilings forced, by the rows
        // per expert it is chosen for, and the grouped wgmma kernel with each of its tiles (96 x 256,
        // 128 x 256); at T = 4096, other bits, all but the fused kernel's smaller tilings; "auto"
        // is the launcher's choice)
        const bool tilings = T >= 256 && bits == 4 && !skewed, wide = T == 4096 && bits != 4;
        const double dense_us = dense_bf16_us(s.name, T);
        for (int forced : {0, 8, 32, 64, -1, -2}) {
          if (forced && !tilings && !(wide && (forced == 64 || forced < 0))) continue;
          RaggedDotTuning tune;
          tune.block_rows = forced > 0 ? forced : 0;
          tune.wgmma = forced < 0 ? 1 : forced > 0 ? -1 : 0;
          tune.wgmma_tile = forced < 0 ? -forced : 0;
          std::vector<float> times;
          for (int rep = 0; rep < reps; ++rep) {
            CK(cudaMemsetAsync(flush, rep & 0xff, flush_bytes));
            CK(cudaEventRecord(e0));
            const std::string err = launch_ragged_dot(a, nullptr, &tune);
            CK(cudaEventRecord(e1));
            if (!err.empty()) { std::printf("launch error %s\n", err.c_str()); return 1; }
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); times.push_back(ms * 1e3f);
          }
          std::sort(times.begin(), times.end());
          const double us = times[times.size() / 2];
          const double wbytes = double(active) * KB * s.n * (bits * 4 + 1);
          const double bytes = wbytes + M * s.k * 2.0 + M * (s.glu ? s.n / 2 : s.n) * 2.0;
          const double floor_us = double(active) * s.k * s.n * 2.0 / bw * 1e6;
          const std::string tiling = forced > 0   ? "ws rows=" + std::to_string(forced)
                                     : forced < 0 ? std::string(forced == -1 ? "wgmma 96x256" : "wgmma 128x256")
                                                  : std::string("auto");
          char dense[64] = "";
          if (dense_us > 0) std::snprintf(dense, sizeof dense, " dense %.1f us, dense/us %.2f", dense_us, dense_us / us);
          std::printf("%-22s %5d %4d %5lld %6d %9.1f %9.2f %6.1f%% %9.1f %7.2f %s %s%s\n", s.name, T, bits, (long long)M,
                      active, us, bytes / 1e6, 100.0 * bytes / (us * 1e-6) / bw, floor_us, floor_us / us,
                      skewed ? "skewed" : "uniform", tiling.c_str(), dense);
        }
      }
      cudaFree(planes); cudaFree(scales); cudaFree(cb); cudaFree(ts); cudaFree(gs); cudaFree(x); cudaFree(y);
    }
  return 0;
}

// ---- decode sizes: the device's time per launch ------------------------------------------
// Reads n 16-byte words (its sum goes nowhere unless it hits `never`): evicts L2 and leaves it clean.
__global__ void read_flush(const uint4* __restrict__ p, size_t n, uint32_t* sink, uint32_t never) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == never) *sink = acc;
}

// Microseconds per launch of `launch` inside a CUDA graph of `R` back-to-back launches (median of
// `reps` replays); with `flush`, each launch follows a read_flush of `flush_words` (then a read of
// the `touch` buffers, if any, as a previous kernel that wrote them would leave them in L2), and
// the time of a graph of those alone is subtracted.
struct Touch {
  const void* p = nullptr;
  size_t words = 0;  // 16-byte words
};
template <class F>
static double graph_us(F&& launch, bool flush, const uint4* fbuf, size_t flush_words, uint32_t* sink, int reps,
                       Touch t1 = {}, Touch t2 = {}) {
  constexpr int R = 20;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_graph = [&](bool with_kernel) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < R; ++i) {
      if (flush) {
        read_flush<<<264, 512, 0, s>>>(fbuf, flush_words, sink, 0x9e3779b9u + i);
        for (const Touch& t : {t1, t2})
          if (t.words) read_flush<<<8, 256, 0, s>>>(static_cast<const uint4*>(t.p), t.words, sink, 0x7f4a7c15u + i);
      }
      if (with_kernel) {
        const std::string err = launch(s);
        if (!err.empty()) { std::printf("launch error %s\n", err.c_str()); std::exit(1); }
      }
    }
    CK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      CK(cudaEventRecord(e0, s));
      CK(cudaGraphLaunch(ge, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1e3f / R);
    }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    std::sort(t.begin(), t.end());
    return double(t[t.size() / 2]);
  };
  const double us = time_graph(true) - (flush ? time_graph(false) : 0.0);
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(s));
  return us;
}

static int decode_mode(int reps, bool sweep) {
  struct Shape { const char* name; int64_t k, n; int g, topk, glu; };
  const Shape shapes[] = {
      {"qwen3-next gate_up", 2048, 1024, 512, 10, 1}, {"qwen3-next down", 512, 2048, 512, 10, 0},
      {"qwen3-30b gate_up", 2048, 1536, 128, 8, 1},   {"qwen3-30b down", 768, 2048, 128, 8, 0},
      {"glm4.7-flash gate_up", 2048, 3072, 64, 4, 1}, {"glm4.7-flash down", 1536, 2048, 64, 4, 0},
  };
  constexpr int bits = 4, kMaxT = 4;
  const size_t flush_words = (size_t(128) << 20) / 16;  // 128 MB: twice the H200's L2
  uint4* fbuf;
  uint32_t* sink;
  CK(cudaMalloc(&fbuf, flush_words * 16));
  CK(cudaMalloc(&sink, 4));
  fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(fbuf), flush_words * 4, 5u);
  const size_t memset_bytes = size_t(512) << 20;
  void* mflush;
  CK(cudaMalloc(&mflush, memset_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  double bw = 0;
  {
    void *a, *b;
    const size_t bytes = size_t(1) << 30;
    CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
    float best = 1e9;
    for (int r = 0; r < 5; ++r) {
      CK(cudaEventRecord(e0)); CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
    }
    bw = 2.0 * bytes / (best * 1e-3);
    std::printf("copy bandwidth %.0f GB/s\n", bw / 1e9);
    CK(cudaFree(a)); CK(cudaFree(b));
  }
  // cold: every buffer flushed from L2; cold w: the weights flushed, x and group_sizes in L2 (as
  // the kernels that wrote them leave them in a MoE layer); warm: back to back, weights in L2
  std::printf("%-22s %3s %4s %6s %-14s %9s %9s %9s %9s %9s %9s\n", "DECODE shape", "T", "M", "active", "plan",
              "event us", "cold us", "cold w us", "warm us", "floor us", "floor/cold");
  for (const Shape& s : shapes) {
    const int64_t KB = s.k / 32;
    const size_t words = size_t(s.g) * KB * s.n * bits, cells = size_t(s.g) * KB * s.n;
    uint32_t* planes; uint8_t* scales; float *cb, *ts; int32_t* gs; __nv_bfloat16 *x, *y;
    CK(cudaMalloc(&planes, words * 4)); CK(cudaMalloc(&scales, cells));
    fill_random<<<1024, 256>>>(planes, words, 17u);
    fill_scales<<<1024, 256>>>(scales, cells);
    std::vector<float> hcb(size_t(s.g) << bits), hts(s.g, 1.f);
    for (size_t i = 0; i < hcb.size(); ++i) hcb[i] = float(int(i % (1 << bits)) - (1 << (bits - 1))) / (1 << bits);
    CK(cudaMalloc(&cb, hcb.size() * 4)); CK(cudaMalloc(&ts, s.g * 4)); CK(cudaMalloc(&gs, s.g * 4));
    CK(cudaMemcpy(cb, hcb.data(), hcb.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ts, hts.data(), s.g * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&x, size_t(kMaxT) * s.topk * s.k * 2));
    CK(cudaMalloc(&y, size_t(kMaxT) * s.topk * s.n * 2));
    fill_bf16<<<1024, 256>>>(x, size_t(kMaxT) * s.topk * s.k);
    for (int T : {1, 4}) {
      const int64_t M = int64_t(T) * s.topk;
      std::vector<int32_t> hg(s.g, 0);
      std::mt19937 r2(T * 31 + bits);  // the routing of `time` (uniform)
      std::vector<double> pop(s.g, 1.0);
      std::shuffle(pop.begin(), pop.end(), r2);
      std::discrete_distribution<int> draw(pop.begin(), pop.end());
      for (int t = 0; t < T; ++t) {
        std::vector<int> pick;
        while (int(pick.size()) < s.topk) {
          const int e = draw(r2);
          if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
        }
        for (int e : pick) ++hg[e];
      }
      int active = 0;
      for (int v : hg) active += v > 0;
      CK(cudaMemcpy(gs, hg.data(), s.g * 4, cudaMemcpyHostToDevice));
      RaggedDotArgs a;
      a.x = x; a.dtype = DType::kBF16; a.planes = planes; a.scales = scales; a.codebook = cb; a.tensor_scale = ts;
      a.group_sizes = gs; a.y = y; a.m = M; a.k = s.k; a.n = s.n; a.groups = s.g; a.bits = bits;
      a.layout = 1; a.glu = s.glu;
      const double floor_us = double(active) * s.k * s.n * 2.0 / bw * 1e6;
      const Touch tx{x, size_t(M * s.k * 2 / 16)}, tg{gs, size_t((s.g * 4 + 15) / 16)};
      auto measure = [&](RaggedDotTuning tune, double& event_us, double& cold, double& cold_w, double& warm) {
        std::vector<float> times;
        for (int rep = 0; rep < reps; ++rep) {  // as `time` does
          CK(cudaMemsetAsync(mflush, rep & 0xff, memset_bytes));
          CK(cudaEventRecord(e0));
          const std::string err = launch_ragged_dot(a, nullptr, &tune);
          CK(cudaEventRecord(e1));
          if (!err.empty()) { std::printf("launch error %s\n", err.c_str()); std::exit(1); }
          CK(cudaEventSynchronize(e1));
          float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); times.push_back(ms * 1e3f);
        }
        std::sort(times.begin(), times.end());
        event_us = times[times.size() / 2];
        auto launch = [&](cudaStream_t st) { return launch_ragged_dot(a, st, &tune); };
        cold = graph_us(launch, true, fbuf, flush_words, sink, reps);
        cold_w = graph_us(launch, true, fbuf, flush_words, sink, reps, tx, tg);
        warm = graph_us(launch, false, fbuf, flush_words, sink, reps);
      };
      MatmulLaunchReport rep;
      RaggedDotTuning tune;
      tune.report = &rep;
      double ev, cold, cold_w, warm;
      measure(tune, ev, cold, cold_w, warm);
      char plan[64];
      std::snprintf(plan, sizeof plan, "ks%d%s/%d", rep.k_split, rep.balanced ? "b" : "u", rep.ctas);
      std::printf("%-22s %3d %4lld %6d %-14s %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", s.name, T, (long long)M, active,
                  plan, ev, cold, cold_w, warm, floor_us, floor_us / cold);
      if (s.g != 512 || !sweep) continue;
      for (int rows : {8, 32})
        for (int bal : {0, 1})
          for (int ks = 1; ks <= 8; ++ks) {
            RaggedDotTuning t2;
            MatmulLaunchReport r2p;
            t2.block_rows = rows;
            t2.k_split = ks;
            t2.balance = bal;
            t2.report = &r2p;
            launch_ragged_dot(a, nullptr, &t2);  // (the plan it takes)
            CK(cudaDeviceSynchronize());
            if (r2p.k_split != ks || r2p.balanced != bal) continue;
            auto launch = [&](cudaStream_t st) { return launch_ragged_dot(a, st, &t2); };
            const double c2 = graph_us(launch, true, fbuf, flush_words, sink, reps);
            std::printf("SWEEP %-22s T=%d rows=%d ks=%d %s ctas=%d cold %.2f us\n", s.name, T, rows, ks,
                        bal ? "balanced" : "uniform", r2p.ctas, c2);
          }
    }
    cudaFree(planes); cudaFree(scales); cudaFree(cb); cudaFree(ts); cudaFree(gs); cudaFree(x); cudaFree(y);
  }
  cudaFree(fbuf); cudaFree(sink); cudaFree(mflush);
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "check") return check();
  if (mode == "time") return time_mode(argc > 2 ? std::atoi(argv[2]) : 20);
  if (mode == "decode") return decode_mode(argc > 2 ? std::atoi(argv[2]) : 9, true);
  if (mode == "decode-plain") return decode_mode(argc > 2 ? std::atoi(argv[2]) : 9, false);
  std::printf("usage: %s check|time|decode|decode-plain [reps]\n", argv[0]);
  return 2;
}
