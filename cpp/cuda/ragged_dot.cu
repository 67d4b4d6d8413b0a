// kbit_ragged_dot on CUDA: the grouped k-bit expert product of a mixture-of-experts layer,
//     y[r, n] = tensor_scale[g] * sum_kb scale[g, kb, n] * sum_{k in kb} x[r, k] * codebook[g, code]
// for every row r of group g (rows sorted by group), in one launch over all groups.
//
// Work split, on the device (no host synchronisation, no allocation, so the launch can be
// captured into a CUDA graph): every CTA of a persistent grid reads group_sizes, scans it in
// shared memory into the groups' first rows (clamped to M; negative sizes count as 0) and
// their first work items, where a group of R rows owns ceil(R / rows per block) x (N / columns
// per item) items and an empty group none, so its weights are never read. CTA c takes the
// contiguous item range [c I / P, (c + 1) I / P) of the I items in (group, row block, column
// tile) order: balanced to one item, and consecutive items mostly share a group, so the CTA keeps
// that group's lookup table and its staged rows of x. Rows at or past sum(group_sizes) are
// written as zeros by all CTAs together.
//
// Two kernels share that schedule:
//  * mma (bf16/f16 activations, fragment layout, N % 64 == 0): an item is one group's 64 weight
//    columns over the whole K for up to kMmaMaxRows rows. 8 warps: 4 tiles of 16 columns x 2
//    slices of K, summed through shared memory at the item's end (no workspace, no atomics).
//    As in matmul_fused.cuh the operands are swapped (the decoded weight tile is mma.m16n8k16's A
//    operand, 8 rows of x its B operand), the fragment layout is decoded by the replicated
//    shared-memory lookup tables of weight_path.cuh, and the E4M4 scale multiplies the fp32
//    result of each k-block (FFMA), tensor_scale and the GLU the item's sums. Weights go straight
//    from global memory into registers (12-16 k-blocks in flight per warp, see mma_slice), read
//    once with evict-first loads; at each item's start the CTA asks L2 for the next item's weight
//    and scale rows (cp.async.bulk.prefetch), so DRAM runs an item ahead of the loads. x's rows of
//    the item are staged in shared memory once per (group, row block) and read by ldmatrix.
//    The lookup table is rebuilt only when the group's codebook differs from the one it holds
//    (experts quantized with one codebook share it).
//  * generic (float32 activations, the planes layout, other N): a SIMT kernel, one thread per
//    column, 8 rows per item, float32 accumulation (as matmul_generic.cu).
#include "cuda/ragged_dot.cuh"

#include <algorithm>
#include <atomic>

#include "cuda/codes.cuh"
#include "cuda/common.cuh"
#include "cuda/weight_path.cuh"
#include "glu.h"

namespace kbit::cuda {
namespace ragged {

// ---------------------------------------------------------------------------------------------
// The schedule: per-group prefix sums of rows and items in shared memory.
// ---------------------------------------------------------------------------------------------

// Exclusive prefix sum of v over the CTA (blockDim.x threads, a multiple of 32); total gets the
// sum. scratch: 32 long longs of shared memory. Ends with a barrier.
__device__ long long block_exclusive_scan(long long v, long long* scratch, long long& total) {
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

// row_start[g] (g = 0..G): first row of group g, clamped to M; item_start[g]: first item of group g,
// a group of R rows owning ceil(R / block_rows) * tiles items. Returns the number of items.
__device__ int build_schedule(const int32_t* __restrict__ group_sizes, int G, int M, int block_rows,
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

// Rows [first, M) are zeros: a grid-stride fill by all CTAs.
template <class T>
__device__ void zero_rows(T* __restrict__ y, int first, int M, int n_out) {
  const long long begin = (long long)first * n_out, end = (long long)M * n_out;
  const T zero = from_f32<T>(0.f);
  for (long long i = begin + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = zero;
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
  zero_rows(y, row_start[G], M, n_out);
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

// ---------------------------------------------------------------------------------------------
// mma kernel.
// ---------------------------------------------------------------------------------------------
constexpr int kMmaThreads = 256;
constexpr int kColTiles = 4;                    // 16-column mma tiles per item
constexpr int kItemCols = 16 * kColTiles;       // 64
constexpr int kKSlices = kMmaThreads / 32 / kColTiles;  // warps that share an item's K
constexpr int kMmaMaxRows = 32;                 // rows of x per item (4 mma n8 tiles)
constexpr int kRowPadBytes = 16;                // staged x rows: 2K + 16 bytes apart (ldmatrix
                                                // rows land on distinct banks)

// Streaming (evict-first) loads as volatile asm: ptxas keeps them where they are written, right
// after the decode that frees their slot, instead of moving them towards their uses.
__device__ __forceinline__ uint32_t ld_stream_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.global.cs.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}
// (A byte straight into a 32-bit register: a 16-bit result's widening would wait for the load.)
__device__ __forceinline__ uint32_t ld_stream_u8(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.global.cs.u8 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// Weight words of a warp's 16-column tile at one k-block, straight from global memory: the same
// fields WeightPath<BITS>::load reads from a staged k-block (rows g and g + 8 of the tile are 8
// cells apart). `p` points at the lane's first word in the tile (its first cell + offset0), `d1`
// is offset1 - offset0 (bits 3 and 5), in words.
template <int BITS, class Raw>
__device__ __forceinline__ void load_raw(Raw& r, const uint32_t* __restrict__ p, int d1) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (BITS == 2 || BITS == 4) {
      r.w[h] = ld_stream_u32(p + h * 8 * BITS);
    } else {
      r.lo[h] = ld_stream_u32(p + h * 8 * BITS);
      r.hi[h] = ld_stream_u32(p + d1 + h * 8 * BITS);
    }
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The lookup-table path of each bits (bits 5 with a copy per half-warp: 64 KiB, not 128).
template <int BITS>
struct Path { using type = fused::WeightPath<BITS>; };
template <>
struct Path<5> { using type = fused::WeightPathBits5<16>; };

struct MmaParams {
  const void* x;
  const uint32_t* planes;
  const uint8_t* scales;
  const float* codebook;
  const float* tensor_scale;
  const int32_t* group_sizes;
  void* y;
  int M, KB, N, G, glu;
  int block_rows;  // rows of x per item (multiple of 8, <= kMmaMaxRows)
  int lut_bytes, xs_bytes, red_bytes;  // shared-memory regions after the schedule
};

// Register slots of a warp's weight stream: slot j holds k-block kb0 + j + U u (u = 0, 1, ...).
// 2.5-4 KB of weights in flight per warp (16 columns x bits x 16 bytes a k-block), within 255
// registers without spills.
template <int BITS>
constexpr int kSlots = BITS == 5 ? 12 : BITS == 3 ? 12 : 16;

// The slots: each k-block's weight fields and its two scale bytes (rows g and g + 8), each byte
// in a register of its own until the k-block is decoded: merged right after their loads (one
// IMAD), the bytes made every refill wait for its loads, a full memory latency per k-block.
template <int BITS>
struct Fields {
  using WP = typename Path<BITS>::type;
  typename WP::Raw w[kSlots<BITS>];
  uint32_t s_lo[kSlots<BITS>], s_hi[kSlots<BITS>];
  // Slot j <- k-block kb of the tile at (wtile, stile), the lane's first word and scale byte.
  // (32-bit offsets: the launcher bounds K/32 * N * bits below 2^31.)
  __device__ __forceinline__ void load(int j, const uint32_t* __restrict__ wtile, const uint8_t* __restrict__ stile,
                                       int kb_words, int N, int kb, int d1) {
    load_raw<BITS>(w[j], wtile + kb * kb_words, d1);
    const uint8_t* sp = stile + kb * N;
    s_lo[j] = ld_stream_u8(sp);
    s_hi[j] = ld_stream_u8(sp + 8);
  }
};

// One warp's slice [kb0, kb1) of its 16-column tile for mt (1..4) n8 tiles of staged rows. The
// slots hold the slice's first k-blocks on entry. Each slot is refilled as soon as its k-block is
// decoded: with the k-block U further on, or, past the slice, with the next item's k-block of
// that slot (tile next_w, next_s; none where next_w is null), so the stream never drains between
// k-block groups nor between items, and no register is copied (a copy of a loaded register
// waits for the load: a double buffer rotated by copies stalls every group on a memory latency).
// Row tiles 2..4 sit behind a branch: predicated off, their mma and loads took ~30 issue slots a
// k-block of every one-row item. (Two paths instead, one per row-tile count, made ptxas copy the
// slots where the paths join.)
template <int BITS, class Act>
__device__ __forceinline__ void mma_slice(float (&acc)[kMmaMaxRows / 8][4], Fields<BITS>& f, int mt,
                                          const uint32_t* __restrict__ wtile, const uint8_t* __restrict__ stile,
                                          const uint32_t* __restrict__ next_w, const uint8_t* __restrict__ next_s,
                                          int kb_words, int N, int kb0, int kb1, uint32_t lut, uint32_t xs_lane,
                                          uint32_t xs_row8, int lane, int d1) {
  using WP = typename Path<BITS>::type;
  constexpr int U = kSlots<BITS>;
  const typename WP::Lane L = WP::lane_consts(lane);
  for (int kb = kb0; kb < kb1; kb += U) {
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (kb + j < kb1) {
        uint32_t a[2][4];
        WP::decode(f.w[j], lut, L, a);
        const float s_lo = decode_e4m4_fast(f.s_lo[j] << 19);
        const float s_hi = decode_e4m4_fast(f.s_hi[j] << 19);
        if (kb + j + U < kb1) f.load(j, wtile, stile, kb_words, N, kb + j + U, d1);
        else if (next_w != nullptr) f.load(j, next_w, next_s, kb_words, N, kb0 + j, d1);
        const uint32_t xa = xs_lane + uint32_t(kb + j) * 64u;
        auto tile = [&](int i) {
          uint32_t b[4];
          ldmatrix_x4(b, xa + uint32_t(i) * xs_row8);
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma_16816<Act>(d, a[0], b[0], b[1], d);
          mma_16816<Act>(d, a[1], b[2], b[3], d);
          acc[i][0] = fmaf(s_lo, d[0], acc[i][0]);
          acc[i][1] = fmaf(s_lo, d[1], acc[i][1]);
          acc[i][2] = fmaf(s_hi, d[2], acc[i][2]);
          acc[i][3] = fmaf(s_hi, d[3], acc[i][3]);
        };
        tile(0);
        if (mt > 1) {
#pragma unroll
          for (int i = 1; i < kMmaMaxRows / 8; ++i)
            if (i < mt) tile(i);
        }
      }
    }
  }
}

template <int BITS, class Act>
__global__ void __launch_bounds__(kMmaThreads, 1) ragged_dot_mma_kernel(const MmaParams p) {
  using T = typename Act::T;
  using WP = typename Path<BITS>::type;
  constexpr int C = 1 << BITS;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ long long scratch[32];
  __shared__ float cb_held[C];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wc = warp % kColTiles, ks = warp / kColTiles;
  const int G = p.G, N = p.N, KB = p.KB, K = KB * 32;
  // Shared memory: lookup table, staged x rows, partial sums (two buffers), schedule.
  unsigned char* lut_p = smem;
  unsigned char* xs_p = lut_p + p.lut_bytes;
  float* red = reinterpret_cast<float*>(xs_p + p.xs_bytes);
  int* row_start = reinterpret_cast<int*>(reinterpret_cast<unsigned char*>(red) + p.red_bytes);
  int* item_start = row_start + G + 1;
  const uint32_t lut = smem_u32(lut_p), xs = smem_u32(xs_p);
  const uint32_t xs_stride = uint32_t(2 * K + kRowPadBytes);

  const int tiles = N / kItemCols;
  const int items = build_schedule(p.group_sizes, G, p.M, p.block_rows, tiles, row_start, item_start, scratch);
  const int n_out = p.glu != kGluNone ? N / 2 : N;
  T* __restrict__ y = static_cast<T*>(p.y);
  const T* __restrict__ x = static_cast<const T*>(p.x);
  zero_rows(y, row_start[G], p.M, n_out);
  if (tid < C) cb_held[tid] = __int_as_float(0x7fffffff);  // NaN: differs from every codebook
  const int i0 = range_begin(blockIdx.x, gridDim.x, items), i1 = range_begin(blockIdx.x + 1, gridDim.x, items);
  const int kb_words = N * BITS;
  const uint32_t tile_bytes = uint32_t(kItemCols * BITS * 4);

  // L2 prefetch of item i's weight and scale rows (one bulk request per k-block row each).
  auto prefetch_item = [&](int i) {
    if (i >= i1) return;
    const Item it = item_at(item_start, G, tiles, i);
    const int64_t col0 = int64_t(it.tile) * kItemCols;
    for (int kb = tid; kb < KB; kb += kMmaThreads) {
      const int64_t cell = (int64_t(it.g) * KB + kb) * N + col0;
      prefetch_l2(p.planes + cell * BITS, tile_bytes);
      prefetch_l2(p.scales + cell, kItemCols);
    }
  };
  prefetch_item(i0);

  // The k-slice of this warp.
  const int kb0 = ks * KB / kKSlices, kb1 = (ks + 1) * KB / kKSlices;
  // Lane address of ldmatrix: row (lane & 7) of matrix lane >> 3 (k offset 8 (lane >> 3)).
  const uint32_t xs_lane = xs + uint32_t(lane & 7) * xs_stride + uint32_t(lane >> 3) * 16u;
  const uint32_t xs_row8 = 8u * xs_stride;
  const GluLogit logit(p.glu);
  // This warp's 16 columns of an item's weight and scale rows; the lane's word offsets.
  const int o0 = int(WP::offset0(lane >> 2, lane & 3) / 4), d1 = int(WP::offset1(lane >> 2, lane & 3) / 4) - o0;
  auto tile_w = [&](const Item& it) {
    return p.planes + (int64_t(it.g) * KB * N + it.tile * kItemCols + wc * 16) * BITS + o0;
  };
  auto tile_s = [&](const Item& it) {
    return p.scales + int64_t(it.g) * KB * N + it.tile * kItemCols + wc * 16 + (lane >> 2);
  };
  Fields<BITS> cur;
  int held_g = -1, held_block = -1, buf = 0;
  float ts = 0.f;
  for (int i = i0; i < i1; ++i) {
    const Item it = item_at(item_start, G, tiles, i);
    prefetch_item(i + 1);
    const uint32_t* wtile = tile_w(it);
    const uint8_t* stile = tile_s(it);
    if (i == i0) {  // later items' first k-blocks were loaded by the item before
#pragma unroll
      for (int j = 0; j < kSlots<BITS>; ++j)
        if (kb0 + j < kb1) cur.load(j, wtile, stile, kb_words, N, kb0 + j, d1);
    }
    const int r0 = row_start[it.g] + it.block * p.block_rows;
    const int rows = min(p.block_rows, row_start[it.g + 1] - r0);
    if (it.g != held_g || it.block != held_block) {
      __syncthreads();  // every warp is done with the table and the staged rows
      if (it.g != held_g) {
        const float* cb = p.codebook + int64_t(it.g) * C;
        const bool differs = __syncthreads_or(tid < C && !(cb_held[tid] == __ldg(cb + tid)));
        if (differs) {
          if (tid < C) cb_held[tid] = __ldg(cb + tid);
          fused::build_table<WP, Act, true>(lut, cb, tid, kMmaThreads);
        }
        ts = __ldg(p.tensor_scale + it.g);
      }
      // Stage rows [r0, r0 + rows) of x: 16-byte copies, 2K bytes a row.
      const int per_row = K / 8;
      for (int c = tid; c < rows * per_row; c += kMmaThreads) {
        const int r = c / per_row, q = c - r * per_row;
        cp_async16(xs + uint32_t(r) * xs_stride + uint32_t(q) * 16u, x + int64_t(r0 + r) * K + q * 8);
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      held_g = it.g;
      held_block = it.block;
    }
    const int col0 = it.tile * kItemCols + wc * 16;
    const uint32_t* next_w = nullptr;
    const uint8_t* next_s = nullptr;
    if (i + 1 < i1) {
      const Item nx = item_at(item_start, G, tiles, i + 1);
      next_w = tile_w(nx);
      next_s = tile_s(nx);
    }
    float acc[kMmaMaxRows / 8][4];
#pragma unroll
    for (int m = 0; m < kMmaMaxRows / 8; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[m][j] = 0.f;
    const int mt = (rows + 7) / 8;
    mma_slice<BITS, Act>(acc, cur, mt, wtile, stile, next_w, next_s, kb_words, N, kb0, kb1, lut, xs_lane, xs_row8,
                         lane, d1);
    // Partial sums of the other k-slices -> shared memory; slice 0 adds them and stores.
    float* rb = red + buf * (p.red_bytes / 8);  // two buffers of red_bytes / 2
    constexpr int kSliceFloats = kColTiles * (kMmaMaxRows / 8) * 4 * 32;
    if (ks > 0) {
#pragma unroll
      for (int m = 0; m < kMmaMaxRows / 8; ++m)
        if (m < mt)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            rb[(ks - 1) * kSliceFloats + ((wc * (kMmaMaxRows / 8) + m) * 4 + j) * 32 + lane] = acc[m][j];
    }
    __syncthreads();
    if (ks == 0) {
      const int g8 = lane >> 2, t = lane & 3;
#pragma unroll
      for (int m = 0; m < kMmaMaxRows / 8; ++m) {
        if (m < mt) {
          float v[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            v[j] = acc[m][j];
#pragma unroll
            for (int s = 0; s < kKSlices - 1; ++s)
              v[j] += rb[s * kSliceFloats + ((wc * (kMmaMaxRows / 8) + m) * 4 + j) * 32 + lane];
            v[j] *= ts;
          }
          // v[0], v[1]: column col0 + g8, rows 2t, 2t + 1 of the n8 tile; v[2], v[3]: column + 8.
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int row = m * 8 + 2 * t + (j & 1);
            const int col = col0 + g8 + 8 * (j >> 1);
            if (p.glu == kGluNone) {
              if (row < rows) y[int64_t(r0 + row) * N + col] = from_f32<T>(v[j]);
            } else {  // gate column 2c in lane g8 even, up column 2c + 1 in the lane 4 above
              const float up = __shfl_xor_sync(0xffffffffu, v[j], 4);
              if ((g8 & 1) == 0 && row < rows)
                y[int64_t(r0 + row) * n_out + col / 2] = from_f32<T>(glu_apply_fast(logit, v[j], up));
            }
          }
        }
      }
    }
    buf ^= 1;
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

// Shared memory of the mma kernel's regions for a block of `rows` rows of x.
struct MmaSmem {
  int lut = 0, xs = 0, red = 0, sched = 0;
  int total() const { return lut + xs + red + sched; }
};

template <int BITS>
MmaSmem mma_smem(int64_t k, int64_t groups, int rows) {
  using WP = typename ragged::Path<BITS>::type;
  MmaSmem s;
  s.lut = WP::kLutBytes;
  s.xs = int(rows * (2 * k + ragged::kRowPadBytes));
  s.red = 2 * (ragged::kKSlices - 1) * ragged::kColTiles * (ragged::kMmaMaxRows / 8) * 4 * 32 * 4;
  s.sched = int(2 * (groups + 1) * 4);
  return s;
}

// Rows of x per item: as many as fit (to kMmaMaxRows, a multiple of 8), 0 where not even 8 do.
template <int BITS>
int mma_block_rows(int64_t k, int64_t groups, int dev) {
  const int limit = max_optin_smem(dev) - 1024;  // the static shared memory
  for (int rows = ragged::kMmaMaxRows; rows >= 8; rows -= 8)
    if (mma_smem<BITS>(k, groups, rows).total() <= limit) return rows;
  return 0;
}

int mma_block_rows_any(const RaggedDotArgs& a, int dev) {
  switch (a.bits) {
    case 2: return mma_block_rows<2>(a.k, a.groups, dev);
    case 3: return mma_block_rows<3>(a.k, a.groups, dev);
    case 4: return mma_block_rows<4>(a.k, a.groups, dev);
    case 5: return mma_block_rows<5>(a.k, a.groups, dev);
  }
  return 0;
}

template <int BITS, class Act>
std::string launch_mma(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning) {
  const int dev = current_device();
  const int rows = mma_block_rows<BITS>(a.k, a.groups, dev);
  const MmaSmem s = mma_smem<BITS>(a.k, a.groups, rows);
  ragged::MmaParams p;
  p.x = a.x;
  p.planes = a.planes;
  p.scales = a.scales;
  p.codebook = a.codebook;
  p.tensor_scale = a.tensor_scale;
  p.group_sizes = a.group_sizes;
  p.y = a.y;
  p.M = int(a.m);
  p.KB = int(a.k / 32);
  p.N = int(a.n);
  p.G = int(a.groups);
  p.glu = a.glu;
  p.block_rows = rows;
  p.lut_bytes = s.lut;
  p.xs_bytes = s.xs;
  p.red_bytes = s.red;
  auto kernel = ragged::ragged_dot_mma_kernel<BITS, Act>;
  static std::atomic<int> configured[kMaxDevices];
  if (configured[dev].load(std::memory_order_relaxed) == 0) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_optin_smem(dev) - 1024) !=
        cudaSuccess)
      return check_launch("kbit_ragged_dot_mma_kernel (shared-memory attribute)", shape_string(a));
    configured[dev].store(1, std::memory_order_relaxed);
  }
  const int ctas = tuning && tuning->ctas > 0 ? tuning->ctas : device_sm_count(dev);
  kernel<<<ctas, ragged::kMmaThreads, size_t(s.total()), stream>>>(p);
  return check_launch("kbit_ragged_dot_mma_kernel",
                      shape_string(a) + " (rows per item " + std::to_string(rows) + ", " +
                          std::to_string(s.total()) + " B shared memory, " + std::to_string(ctas) + " CTAs)");
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

}  // namespace

std::string ragged_dot_path(const RaggedDotArgs& a) {
  if (a.dtype == DType::kF32) return "generic (float32 activations)";
  if (a.layout != kbit::kFragment) return "generic (layout 0: planes; convert to the fragment layout for speed)";
  if (a.n % ragged::kItemCols != 0) return "generic (N is not a multiple of 64)";
  if (mma_block_rows_any(a, current_device()) == 0) return "generic (K and G leave no room for 8 rows of x)";
  return "mma";
}

std::string launch_ragged_dot(const RaggedDotArgs& a, cudaStream_t stream, const RaggedDotTuning* tuning) {
  if (a.m == 0 || a.n == 0) return std::string();  // nothing to write
  if (a.groups > kRaggedDotMaxGroups)
    return "kbit_ragged_dot: G=" + std::to_string(a.groups) + " groups, at most " +
           std::to_string(kRaggedDotMaxGroups) + " supported, for " + shape_string(a);
  if (a.m > 0x7fffffff / 2 || a.k / 32 * a.n > 0x7fffffff / 8)
    return "kbit_ragged_dot: the kernels index rows, k-blocks and columns in 32 bits, for " + shape_string(a);
  const bool mma = !(tuning && tuning->force_generic) && ragged_dot_path(a) == "mma";
  if (mma) {
    return KBIT_BITS_SWITCH(a.bits, BITS, [&] {
      if (a.dtype == DType::kBF16) return launch_mma<BITS, ActBF16>(a, stream, tuning);
      return launch_mma<BITS, ActF16>(a, stream, tuning);
    });
  }
  return KBIT_BITS_SWITCH(a.bits, BITS, [&] {
    return KBIT_LAYOUT_SWITCH(a.layout, LAYOUT, [&] {
      return KBIT_DTYPE_SWITCH(a.dtype, T, [&] { return launch_generic<BITS, LAYOUT, T>(a, stream, tuning); });
    });
  });
}

}  // namespace kbit::cuda
