// What handing one decode product's output over to the next costs, and what removes it, on the
// memory path alone (no decode). A Llama-3-8B layer's four products at M = 1 (q/k/v, o, gate/up,
// down: their compressed bytes at 4 and 2 bits) are streamed by one CTA of 512 threads per SM,
// each CTA taking an equal contiguous share of a product's bytes (stream-K). A product starts by
// reading its input row from the previous one's output (fp32, from L2) and normalizing it (a
// block sum of squares: an in-kernel RMSNorm), and ends by adding each CTA's partial sums of the
// column groups its share touches into its output (red.global.add.f32: no CTA waits for a cut
// group's owner). So every handover is the real one's dependency: each CTA's input needs every
// CTA's output. The chains, each 32 layers inside one CUDA graph on cold weights:
//   launches    one kernel launch per product: the launch boundary is the handover;
//   layer       one launch per layer, a grid barrier between its products (an arrival counter,
//               one polling thread per CTA);
//   layer+ld    the same, each CTA loading the first part of its next share (its loads in flight,
//               32 KiB) before it arrives at the barrier: weights do not depend on the input;
//   model       one launch for all 32 layers, barriers between all products;
//   stream      the model's launch without barriers (its results are wrong): this kernel's rate
//               on the same bytes with no handover, the floor of the others;
//   mlp-launch  gate/up and down as one unit on 112 CTAs, one launch per unit (q/k/v, o, the
//               pair): a CTA's down share is the K slice of the intermediate its own gate/up
//               columns computed (Llama-3-8B's 448 32-column units, 4 per CTA; 20 CTAs idle),
//               so inside the pair nothing is handed over, and down adds a partial sum of every
//               output column (red.global.add.v4.f32);
//   mlp-pair    the same as one launch per layer with barriers;
//   pairs       (q/k/v, o) as a unit too, as if each CTA attended the heads whose q/k/v columns
//               it computed: two handovers per layer.
// A check cell in every unit's output proves each handover: the next unit reads it and expects
// one arrival from every CTA. %globaltimer stamps in every CTA (about 0.25 us steps) split a
// handover into the spread of the CTAs' ends, the last end to the next unit's entry, and its
// input read.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -o /tmp/handover_probe benchmarks/handover_probe.cu
//   /tmp/handover_probe      ("CHAIN" lines: us per layer by chain and bits, against the bytes at
//                             copy speed; "HANDOVER" lines: the stamps' split)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "probe_common.cuh"

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;         // 16-byte loads in flight per thread
constexpr int kGroupCols = 64;     // output columns per column group (the kernels' item)
constexpr int kMaxK = 14336;       // the longest input row (down's K)
constexpr int kOutFloats = 28672;  // the widest output (gate/up's N); a check cell follows
constexpr int kYFloats = kOutFloats + 4;  // an output buffer: the output, its check cell, float4 padding
constexpr int kProducts = 4;       // per layer
constexpr int kLayers = 32;
constexpr int kStamps = 4;         // per CTA and product: entry, input read, share streamed, barrier passed
// Shared memory asked for: the input row, and enough that only one CTA fits on an SM.
constexpr int kSmemBytes = 120 * 1024;
static_assert(kMaxK * sizeof(float) <= kSmemBytes, "the input row fits the shared memory asked for");

struct Shape {
  size_t bytes;  // compressed weights and scales, a multiple of 16
  int groups;    // column groups of kGroupCols (N / 64)
  int k, n;      // input and output length
  size_t offset; // within a layer's weights
};

struct Chain {
  Shape shape[kProducts];
  const uint8_t* const* layer_w;  // [kLayers] each layer's weights (copies in rotation: cold)
  float* y[3];                    // unit u adds into y[u % 3] and reads y[(u + 2) % 3]
  int first, count;               // the chain's products [first, first + count) in this launch
  int barriers;                   // 0: none between the launch's products (the `stream` bound)
  int local_pairs;                // bit 0: (q/k/v, o), bit 1: (gate/up, down) without a handover inside
  int mlp_ctas;                   // > 0: the CTAs that share gate/up and down (the others idle)
  int preload;                    // 1: the next share's first loads go out before a barrier
  unsigned* arrivals;             // this launch's barrier counter (zeroed at the graph's start)
  unsigned long long* stamps;     // [kLayers * kProducts][grid][kStamps], or null
  unsigned* errors;               // barrier checks that failed, polls that timed out
};

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < kWarps; ++w) s += scratch[w];
  return s;
}

__global__ void __launch_bounds__(kThreads, 1) chain_kernel(const Chain c) {
  extern __shared__ float x_s[];  // the product's input row
  __shared__ float scratch[kWarps];
  const int tid = threadIdx.x, cta = blockIdx.x, grid = gridDim.x;
  // This CTA's equal share of product j's bytes, as 16-byte words [lo, hi) of src.
  // (With mlp_ctas, gate/up and down are shared by that many CTAs only, as whole 32-column
  // units of the intermediate would be: Llama-3-8B's 448 units on 112 CTAs; the rest idle.)
  auto share = [&](int j, const uint4*& src, size_t& lo, size_t& hi) {
    const Shape& sh = c.shape[j % kProducts];
    const int parts = c.mlp_ctas && j % kProducts >= 2 ? c.mlp_ctas : grid;
    src = reinterpret_cast<const uint4*>(c.layer_w[j / kProducts] + sh.offset);
    lo = cta < parts ? sh.bytes / 16 * cta / parts : 0;
    hi = cta < parts ? sh.bytes / 16 * (cta + 1) / parts : 0;
  };
  uint4 v[kUnroll];  // the loads in flight
  auto load = [&](const uint4* src, size_t i, size_t hi) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = i + u * kThreads < hi ? __ldcs(src + i + u * kThreads) : make_uint4(0, 0, 0, 0);
  };
  bool loaded = false;  // the first loads of this product went out before the barrier
  int barriers_passed = 0;
  for (int local = 0; local < c.count; ++local) {
    const int j = c.first + local;
    const Shape& sh = c.shape[j % kProducts];
    // With local pairs, (q/k/v, o) and (gate/up, down) each form one unit: the second product's
    // input is the CTA's own share of the first's output (the heads it attended, the gate/up
    // columns it computed), so the pair needs no handover, and only the second adds into the
    // output; otherwise every product is a unit.
    const int pos = j % kProducts, paired = c.local_pairs >> (pos / 2) & 1;  // pos: within the layer
    const bool pair_first = paired && pos % 2 == 0, pair_second = paired && pos % 2 == 1;
    const int units = kProducts - (c.local_pairs & 1) - (c.local_pairs >> 1 & 1);  // per layer
    const int unit = j / kProducts * units + pos - (c.local_pairs & 1 && pos >= 1) - (c.local_pairs >> 1 & 1 && pos >= 3);
    float* out = c.y[unit % 3];
    const float* in = c.y[(unit + 2) % 3];
    unsigned long long* st = c.stamps ? c.stamps + (size_t(j) * grid + cta) * kStamps : nullptr;
    if (st && tid == 0) st[0] = global_ns();
    // The share is streamed with evict-first loads; the first ones go out before anything waits
    // on the input (weights do not depend on it), or went out before the barrier.
    const uint4* src;
    size_t lo, hi;
    share(j, src, lo, hi);
    size_t i = lo + tid;
    if (!loaded) load(src, i, hi);
    loaded = false;
    float inv_rms = 1.f;
    if (!pair_second) {
      // The buffer the next unit adds into was read by the previous unit, which has ended.
      float4* next = reinterpret_cast<float4*>(c.y[(unit + 1) % 3]);
      for (int q = cta * kThreads + tid; q < kYFloats / 4; q += grid * kThreads) next[q] = make_float4(0.f, 0.f, 0.f, 0.f);
      // The input row from L2 (other CTAs wrote it), normalized by its RMS.
      const float check = tid == 0 ? __ldcg(in + kOutFloats) : 0.f;
      float ss = 0.f;
      const float4* in4 = reinterpret_cast<const float4*>(in);
#pragma unroll 8
      for (int q = tid; q < sh.k / 4; q += kThreads) {
        const float4 x = __ldcg(in4 + q);
        reinterpret_cast<float4*>(x_s)[q] = x;
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
      }
      inv_rms = rsqrtf(block_sum(ss, scratch) / sh.k + 1e-6f);
      if (tid == 0 && unit > 0 && c.barriers && check != float(grid)) atomicAdd(c.errors, 1u);
    }
    if (st && tid == 0) st[1] = global_ns();
    uint32_t folded = 0;
    for (;;) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) folded ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
      i += kUnroll * kThreads;
      if (i >= hi) break;
      load(src, i, hi);
    }
    // Partial sums of every column group the share touches, added into the output.
    const float part = float(folded & 0xffu) * x_s[tid % sh.k] * inv_rms;
    const size_t group_bytes = sh.bytes / sh.groups;
    const int g0 = int(lo * 16 / group_bytes), g1 = int(min_size(hi * 16 / group_bytes, size_t(sh.groups - 1)));
    const int out_cols = sh.n;
    if (pair_second) {  // a partial sum of every output column (its share covers a slice of K)
      for (int q = tid; q < out_cols / 4 && hi > lo; q += kThreads)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};" ::"l"(out + 4 * q), "f"(part) : "memory");
    } else if (!pair_first) {
      for (int g = g0; g <= g1; ++g) {
        const float s = block_sum(part, scratch);
        if (tid < kGroupCols && g * kGroupCols + tid < out_cols) atomicAdd(out + g * kGroupCols + tid, s * 1e-9f);
      }
    } else {
      x_s[tid] = part;  // the pair's second product reads the CTA's own outputs
    }
    if (tid == 0 && !pair_first) atomicAdd(out + kOutFloats, 1.f);  // the check cell: one arrival per CTA
    const bool last = local + 1 == c.count;
    if (!last && c.preload) {
      const uint4* nsrc;
      size_t nlo, nhi;
      share(j + 1, nsrc, nlo, nhi);
      load(nsrc, nlo + tid, nhi);
      loaded = true;
    }
    __syncthreads();
    if (tid == 0) {
      if (st) st[2] = global_ns();
      if (!last && c.barriers && !pair_first) {
        __threadfence();
        atomicAdd(c.arrivals, 1u);
        const unsigned target = unsigned(grid) * unsigned(++barriers_passed);
        for (long polls = 0; load_acquire(c.arrivals) < target; ++polls)
          if (polls > (1l << 22)) {  // a hang (a CTA not resident) becomes an error
            atomicAdd(c.errors, 1u);
            break;
          }
      }
      if (st) st[3] = global_ns();
    }
    __syncthreads();
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int main() {
  Probe probe;
  const int sms = probe.sms;
  const size_t pool_bytes = size_t(2) << 30;  // 2 GiB: the weight copies the layers rotate over
  uint8_t* pool;
  float* ybuf;
  unsigned *arrivals, *errors;
  unsigned long long* stamps;
  const int max_launches = kLayers * kProducts;
  const size_t n_stamps = size_t(kLayers) * kProducts * sms * kStamps;
  CK(cudaMalloc(&pool, pool_bytes));
  CK(cudaMalloc(&ybuf, 3 * kYFloats * sizeof(float)));
  CK(cudaMalloc(&arrivals, max_launches * sizeof(unsigned)));
  CK(cudaMalloc(&errors, sizeof(unsigned)));
  CK(cudaMalloc(&stamps, n_stamps * sizeof(unsigned long long)));
  CK(cudaMemset(pool, 0x5a, pool_bytes));
  CK(cudaMemset(errors, 0, sizeof(unsigned)));
  CK(cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  cudaStream_t s = probe.s;
  cudaEvent_t a = probe.a, b = probe.b;
  const double copy_speed = probe.copy_speed(pool, pool_bytes);  // (copies 0x5a over 0x5a)

  // Llama-3-8B: (K, N) of q/k/v, o, gate/up (both halves), down.
  const int kn[kProducts][2] = {{4096, 6144}, {4096, 4096}, {4096, 28672}, {14336, 4096}};
  struct Variant {
    const char* name;
    int launch;   // kernel launches: 0 one per product, 1 per layer, 2 per model, 3 per unit
    int barriers, preload, local_pairs, mlp_ctas;
    bool stamps;  // print the HANDOVER lines
  };
  const Variant variants[] = {{"launches", 0, 1, 0, 0, 0, true},  {"layer", 1, 1, 0, 0, 0, true},
                              {"layer+ld", 1, 1, 1, 0, 0, true},  {"model", 2, 1, 0, 0, 0, false},
                              {"stream", 2, 0, 0, 0, 0, false},   {"mlp-launch", 3, 1, 0, 2, 112, true},
                              {"mlp-pair", 1, 1, 0, 2, 112, false}, {"pairs", 1, 1, 0, 3, 0, true}};
  for (const int bits : {4, 2}) {
    Chain c = {};
    size_t layer_bytes = 0;
    for (int q = 0; q < kProducts; ++q) {
      const size_t weights = size_t(kn[q][0]) * kn[q][1];
      const size_t bytes = (weights * bits / 8 + weights / 32 + 15) / 16 * 16;  // codes + a scale byte per 32
      c.shape[q] = Shape{bytes, kn[q][1] / kGroupCols, kn[q][0], kn[q][1], layer_bytes};
      layer_bytes += (bytes + 4095) / 4096 * 4096;
    }
    // Each layer reads a copy last read copies - 1 layers earlier (>= 1.7 GB; L2 holds 60 MB).
    const int copies = int(std::min<size_t>(kLayers, pool_bytes / layer_bytes));
    std::vector<const uint8_t*> bases(kLayers);
    for (int l = 0; l < kLayers; ++l) bases[l] = pool + (l % copies) * layer_bytes;
    const uint8_t** layer_w;
    CK(cudaMalloc(&layer_w, kLayers * sizeof(void*)));
    CK(cudaMemcpy(layer_w, bases.data(), kLayers * sizeof(void*), cudaMemcpyHostToDevice));
    c.layer_w = layer_w;
    for (int i = 0; i < 3; ++i) c.y[i] = ybuf + i * kYFloats;
    c.errors = errors;
    const double at_copy = layer_bytes / (copy_speed * 1e3);  // us per layer
    for (const Variant& var : variants) {
      // The launches (first product, count).
      std::vector<std::pair<int, int>> launches;
      for (int l = 0; l < kLayers; ++l) {
        const int f = l * kProducts;
        if (var.launch == 0) {
          for (int q = 0; q < kProducts; ++q) launches.push_back({f + q, 1});
        } else if (var.launch == 3) {
          launches.insert(launches.end(), {{f, 1}, {f + 1, 1}, {f + 2, 2}});
        } else if (var.launch == 2) {
          if (l == 0) launches.push_back({0, kProducts * kLayers});
        } else {
          launches.push_back({f, kProducts});
        }
      }
      for (int with_stamps = 0; with_stamps < (var.stamps ? 2 : 1); ++with_stamps) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        CK(cudaMemsetAsync(arrivals, 0, max_launches * sizeof(unsigned), s));
        CK(cudaMemsetAsync(ybuf, 0, 3 * kYFloats * sizeof(float), s));
        for (int L = 0; L < int(launches.size()); ++L) {
          Chain lc = c;
          lc.first = launches[L].first;
          lc.count = launches[L].second;
          lc.barriers = var.barriers;
          lc.local_pairs = var.local_pairs;
          lc.mlp_ctas = var.mlp_ctas;
          lc.preload = var.preload;
          lc.arrivals = arrivals + L;
          lc.stamps = with_stamps ? stamps : nullptr;
          chain_kernel<<<sms, kThreads, kSmemBytes, s>>>(lc);
        }
        CK(cudaStreamEndCapture(s, &graph));
        CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphUpload(exec, s));
        std::vector<double> t;
        for (int r = 0; r < (with_stamps ? 2 : 9); ++r) t.push_back(graph_launch_ms(exec, s, a, b) * 1e3 / kLayers);
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        unsigned err;
        CK(cudaMemcpy(&err, errors, sizeof(err), cudaMemcpyDeviceToHost));
        if (var.barriers && err) {
          printf("ERROR bits %d %s: %u handover checks failed or polls timed out\n", bits, var.name, err);
          return 2;
        }
        CK(cudaMemset(errors, 0, sizeof(err)));
        if (!with_stamps) {
          const double us = median(t);
          printf("CHAIN bits %d %-10s %7.2f us a layer  (bytes %6.1f MB: %6.2f us at copy speed; beyond it %6.2f us, "
                 "%5.2f us a product)\n",
                 bits, var.name, us, layer_bytes / 1e6, at_copy, us - at_copy, (us - at_copy) / kProducts);
          continue;
        }
        // The handover from product q to q + 1 inside layers 1..30: the spread of the CTAs'
        // ends (p10 -> last end), the last end -> the median CTA's entry into the next product
        // (a barrier's release, or the next launch's start), and that product's input read
        // (median entry -> median input read), over the CTAs with a share of the product.
        // (q = 3 -> 0 crosses into the next layer; inside a pair a CTA goes on at once.)
        std::vector<unsigned long long> h(n_stamps);
        CK(cudaMemcpy(h.data(), stamps, n_stamps * sizeof(h[0]), cudaMemcpyDeviceToHost));
        auto at = [&](int j, int cta, int k) { return double(h[(size_t(j) * sms + cta) * kStamps + k]); };
        auto active = [&](int j, int cta) { return !(var.mlp_ctas && j % kProducts >= 2 && cta >= var.mlp_ctas); };
        for (int q = 0; q < kProducts; ++q) {
          std::vector<double> spread, entry, input, stream;
          for (int l = 1; l + 1 < kLayers; ++l) {
            const int j = l * kProducts + q;
            std::vector<double> ends, entries, inputs, streams;
            for (int x = 0; x < sms; ++x) {
              if (active(j, x)) {
                ends.push_back(at(j, x, 2));
                streams.push_back(at(j, x, 2) - at(j, x, 1));
              }
              if (active(j + 1, x)) {
                entries.push_back(at(j + 1, x, 0));
                inputs.push_back(at(j + 1, x, 1) - at(j + 1, x, 0));
              }
            }
            std::sort(ends.begin(), ends.end());
            spread.push_back((ends.back() - ends[ends.size() / 10]) * 1e-3);
            entry.push_back((median(entries) - ends.back()) * 1e-3);
            input.push_back(median(inputs) * 1e-3);
            stream.push_back(median(streams) * 1e-3);
          }
          printf("HANDOVER bits %d %-10s product %d -> %d: CTA ends spread %5.2f us (p10 -> last); last end -> next "
                 "entry %5.2f us; input read %5.2f us; median CTA streams %6.2f us\n",
                 bits, var.name, q, (q + 1) % kProducts, median(spread), median(entry), median(input),
                 median(stream));
        }
      }
    }
    CK(cudaFree(layer_w));
  }
  return 0;
}
