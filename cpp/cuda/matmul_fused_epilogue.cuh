// The end of a fused-kernel work item: the item's sums scaled by the tensor scale, rounded to
// the activation dtype and stored (with a GLU: act(gate) * up of column pairs, glu.h).
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/matmul_fused_walk.cuh"
#include "glu.h"

namespace kbit::cuda::fused {

// Scale one item's sums by the tensor scale ts, round to T and store them; v[e] of lane (g, t)
// holds row m0 + 8 mt + 2t + (e & 1) of column col0 + 16 j + g + 8 ((e >> 1) & 1), with
// e = 4 (j MT + mt) + (e & 3), as the mma accumulator layout of the swapped product puts it.
// Called by all 32 lanes of a warp (at a CTA's last item each warp stores one float4 group of
// the sums instead: store_group). Grouped (kbit_ragged_dot): y is [M, N(/2)] for all batch entries
// (groups) and the item stores only its `rows` rows, m0 .. m0 + rows - 1 (its block of activations
// may hold the next group's rows: their sums are dropped).
//
// With p.glu, column n + 1 of an even column n sits in lane (g + 1, t), i.e. lane ^ 4 (col0 and
// 16 j are even), so one shuffle per sum pairs gate and up, and the even lane stores act(gate) *
// up at column n / 2 of the N / 2. This runs on the warp that ends the item, which holds its ring
// stages meanwhile (Llama-3-70B gate/up at TP 2, K = 4, M = 1: the first item's end takes 1.44 us
// without a GLU), so it is kept short:
//  * the sums of one row pair (mt, r) form a group, skipped as a whole where both of its rows lie
//    past M (warp-uniform: lane t = 0 holds the lowest): at M = 1 that is 3 of 4 sums;
//  * a group's 2 TN chains (shuffle, MUFU.EX2, MUFU.RCP: ~150 cycles) run side by side, all lanes
//    alike (odd lanes' results are dropped), and the stores follow. Written as one loop with the
//    predicated store inside, ptxas runs the chains one after another behind a branch per store:
//    1.10x the time of that gate/up.
template <int MT, class T, int NACC, bool kGrouped = false>
__device__ __forceinline__ void store_item(const Params& p, const Cursor& cur, int g, int t, const float (&v)[NACC],
                                           float ts) {
  const int64_t m_end = kGrouped ? cur.m0 + cur.rows : p.M;  // the rows to store end here
  if (p.glu != kGluNone) {
    constexpr int TN = NACC / (4 * MT), kGroup = 2 * TN;
    const int half_n = p.N / 2;
    const GluLogit logit(p.glu);
    T* yg = static_cast<T*>(p.y) + (kGrouped ? 0 : int64_t(cur.b) * p.M * half_n);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (cur.m0 + 8 * mt + r >= m_end) continue;  // no lane holds a row of this group
        float gate[kGroup], up[kGroup];            // i = 2 j + h: column 16 j + g + 8 h
#pragma unroll
        for (int i = 0; i < kGroup; ++i) gate[i] = v[4 * ((i >> 1) * MT + mt) + 2 * (i & 1) + r] * ts;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) up[i] = __shfl_xor_sync(0xffffffffu, gate[i], 4);
#pragma unroll
        for (int i = 0; i < kGroup; ++i) gate[i] = glu_apply_fast(logit, gate[i], up[i]);
        const int64_t m = cur.m0 + 8 * mt + 2 * t + r;
#pragma unroll
        for (int i = 0; i < kGroup; ++i) {
          const int n = cur.col0 + 16 * (i >> 1) + g + 8 * (i & 1);
          if ((g & 1) == 0 && m < m_end && n < p.N) yg[m * half_n + (n >> 1)] = from_f32<T>(gate[i]);
        }
      }
    return;
  }
  T* yg = static_cast<T*>(p.y) + (kGrouped ? 0 : int64_t(cur.b) * p.M * p.N);
#pragma unroll
  for (int e = 0; e < NACC; ++e) {
    const int c = e & 3, mt = (e >> 2) % MT, j = (e >> 2) / MT;
    const int64_t m = cur.m0 + 8 * mt + 2 * t + (c & 1);
    const int n = cur.col0 + 16 * j + g + 8 * (c >> 1);
    if (m < m_end && n < p.N) yg[m * p.N + n] = from_f32<T>(v[e] * ts);
  }
}

// store_item for float4 group e4 alone (v = the sums v[4 e4 .. 4 e4 + 3] of store_item's layout):
// at a CTA's last item each owner warp stores its one group (ItemReducer::finish_last_shared).
// (Through store_item with a mask of groups, every lane would compute all NACC sums' addresses
// and tests, behind the runtime owner index, for the 4 it stores: 0.27 us of a one-item CTA's
// ~1 us end.) With p.glu a gate/up pair (columns n, n + 1, n even)
// lies in lanes l and l ^ 4 of the same group, so each group pairs its own sums.
template <int MT, class T, bool kGrouped = false>
__device__ __forceinline__ void store_group(const Params& p, const Cursor& cur, int g, int t, int e4, float4 v,
                                            float ts) {
  const int64_t m_end = kGrouped ? cur.m0 + cur.rows : p.M;  // (as in store_item)
  const int mt = e4 % MT, j = e4 / MT;  // (MT a power of two: a mask and a shift)
  if (cur.m0 + 8 * mt >= m_end) return;  // no lane holds a row of this group (warp-uniform)
  const int m = cur.m0 + 8 * mt + 2 * t;
  const int n = cur.col0 + 16 * j + g;
  const float c[4] = {v.x * ts, v.y * ts, v.z * ts, v.w * ts};  // c = 2 h + r: row m + r, column n + 8 h
  if (p.glu != kGluNone) {
    const int half_n = p.N / 2;
    const GluLogit logit(p.glu);
    T* yg = static_cast<T*>(p.y) + (kGrouped ? 0 : int64_t(cur.b) * p.M * half_n);
    float gated[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) gated[i] = glu_apply_fast(logit, c[i], __shfl_xor_sync(0xffffffffu, c[i], 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int mi = m + (i & 1), ni = n + 8 * (i >> 1);
      if ((g & 1) == 0 && mi < m_end && ni < p.N) yg[int64_t(mi) * half_n + (ni >> 1)] = from_f32<T>(gated[i]);
    }
    return;
  }
  T* yg = static_cast<T*>(p.y) + (kGrouped ? 0 : int64_t(cur.b) * p.M * p.N);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int mi = m + (i & 1), ni = n + 8 * (i >> 1);
    if (mi < m_end && ni < p.N) yg[int64_t(mi) * p.N + ni] = from_f32<T>(c[i]);
  }
}

// What ItemReducer / WarpClusterReducer call to store an item's sums: all of the warp's
// (operator()) or, at a CTA's last item, one float4 group of them (group()).
template <int MT, class T, int NACC, bool kGrouped = false>
struct ItemStore {
  const Params& p;
  const Cursor& cur;
  int g, t;
  float ts;
  __device__ void operator()(const float (&v)[NACC]) const { store_item<MT, T, NACC, kGrouped>(p, cur, g, t, v, ts); }
  __device__ void group(int e4, float4 v) const { store_group<MT, T, kGrouped>(p, cur, g, t, e4, v, ts); }
};

}  // namespace kbit::cuda::fused
