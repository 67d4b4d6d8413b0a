// The fused kernels' parameters and their work walk: which chunks of which work items each CTA
// streams (ItemWalk), and the cursor that advances through them without integer division in the
// hot loop.
#pragma once

#include <cstdint>

#include "cuda/fast_div.cuh"
#include "cuda/item_reduce.cuh"
#include "cuda/ragged_schedule.cuh"

namespace kbit::cuda::fused {

// The kernels' parameters (the launcher fills them; matmul_fused_launch.cuh).
struct Params {
  const void* x;
  const uint32_t* planes;
  const uint8_t* scales;
  const float* codebook;
  const float* tensor_scale;
  void* y;
  int64_t M;
  int N, KB;
  int kb_per_split;  // k-blocks per cluster rank (uniform k-split)
  int k_split;       // cluster size along grid x (1 = no cluster)
  int balanced;      // 1: chunk-balanced clusters (ItemWalk), warp-specialized kernel, K-split tilings only
  int col_groups, m_blocks, items;  // items = col_groups * m_blocks * batch
  int x_rows;                       // rows the shared-memory layout is sized for
  int stages;                       // ring depth (warp-specialized kernel; WsConfig::stages)
  int vec16;                        // weight rows are 16-byte aligned: 16-byte copies
  int64_t scale_bytes;              // B * KB * N, the end of the scales buffer
  int inputs_ready;                 // 1: a plain launch (not a programmatic dependent one), so
                                    // every input is visible at entry (warp-specialized kernel)
  int glu;                          // kbit::Glu: y gets act(column 2j) * column 2j + 1 (store_item)
};

// ItemWalk's divisors as multipliers (fast_div.cuh): the cluster size, the number of clusters,
// the blocks of M, the column groups and the chunks of an item's whole k-range. A kernel
// parameter of their own: with them in Params, Params grows past 128 bytes, and that alone
// changes ptxas's chunk loops (16-row tilings: 2-3 instructions and an LDC more, 3-8 % slower on
// the wide layers at M = 16).
struct WalkDivs {
  FastDiv ks, clusters, m_blocks, col_groups, nch_item;
};

// The grouped product (kbit_ragged_dot): the warp-specialized kernel's extra parameter, after its
// tensor maps (so the dense product's parameters keep their layout). Batch entry b is expert b:
// its weight rows are b * KB + kb as in the batched product, but x and y are [M, K] and
// [M, N(/2)] for all experts, group b owning rows [row_start[b], row_start[b + 1]).
struct GroupParams {
  const int32_t* group_sizes;  // [G], on the device
  int G;
};
// The schedule of a grouped launch in the CTA's shared memory (ragged_schedule.cuh): the groups'
// first rows and first items, and the item count.
struct GroupSched {
  const int* row_start = nullptr;   // [G + 1]
  const int* item_start = nullptr;  // [G + 1]
  int G = 0, items = 0;
};
// Its shared memory: 32 long longs of scan scratch, then row_start and item_start.
__host__ __device__ constexpr size_t group_sched_bytes(int64_t G) { return 256 + size_t(G + 1) * 8; }


// Where a CTA's chunk stream is: chunk within the item and the item's coordinates, advanced
// incrementally (the item index grows by the number of clusters) so that the hot loop has no
// integer division (only an item boundary divides).
struct Cursor {
  int c;           // chunk within the piece
  int nch;         // chunks in the piece (the item's k-range on this rank, or part of it)
  int g;           // (balanced clusters) the piece's first chunk in the cluster's chunk sequence
  int kb;          // first k-block of the chunk, within the batch entry
  int item;        // item index: block of M fastest, then column group, then batch entry
  int cg, mb, b;   // column group, block of M, batch entry
  int col0, rows;  // first column, rows of M in the block
  int64_t m0;      // first row (of the batch entry; grouped: of x)
  int64_t cell0;   // first cell (b, kb0, col0) of the chunk
  int64_t x0;      // first activation element (b, m0, 32 kb0) of the chunk
};

// A CTA's share of the work, the same for both kernels: items (column group of COLS columns x
// block of ROWS rows of M x batch entry) are dealt round-robin to the clusters, the blocks of M
// of one column group to neighbouring clusters, which run them at the same time: the second
// and later reads of those weights hit L2 (with the column group fastest, a weight larger than
// L2 was read from DRAM once per block of M). Within a cluster, one of two splits:
//  * uniform k-split: rank `rank` covers k-blocks [kbA, kbEnd) of each of the cluster's items in
//    nch chunks of KCH k-blocks, q chunks in all.
//  * chunk-balanced (p.balanced, warp-specialized kernel only): the cluster's items, each of
//    nch_item chunks, form one sequence of T chunks, and rank r takes chunks [r T / ks, (r + 1)
//    T / ks). So every rank streams the same number of chunks (+-1) whatever the item count,
//    where the uniform split can only give a cluster whole items (gate/up of Llama-3-70B at TP 2:
//    448 items on 132 SMs, 4 on some and 3 on others). A rank's run of chunks of one item is a
//    "piece": only its first piece can start inside an item (it is then sent to the rank that
//    holds the item's first chunk, the item's owner) and only its last can end inside one (the
//    rank then owns that item and adds the later ranks' pieces), so each rank sends at most one
//    sum and receives at most one set (ItemReducer::finish_piece).
// Cursors advance incrementally, so the hot loop has no integer division (only a piece's or an
// item's boundary divides, in 32 bits: a 64-bit division anywhere in the walk, a called
// subroutine, cost the chunk loop its uniform registers, +20 % instructions per chunk, ~10 % time).
//
// Grouped (kGrouped, kbit_ragged_dot): the items are those of the device-built schedule (sched),
// numbered group by group, within a group block of M fastest then column group (as above: a
// group's blocks of M share its weights); the item count is sched.items, and an item boundary
// finds its group by a binary search over the groups' first items.
template <int KCH, int COLS, int ROWS, bool kGrouped = false>
struct ItemWalk {
  const Params& p;
  const WalkDivs& dv;
  GroupSched sched;
  int ks, rank, cluster_id, n_clusters, kbA, kbEnd, nch, q;
  int nch_item, T, g0, g1;  // chunk-balanced clusters: chunks per item, per cluster, this rank's range
  int64_t k, chunk_cells;

  __device__ ItemWalk(const Params& prm, const WalkDivs& divs, const GroupSched& gs = GroupSched{})
      : p(prm), dv(divs), sched(gs) {
    ks = p.k_split;
    cluster_id = dv.ks.div(int(blockIdx.x));
    rank = dv.ks.mod(int(blockIdx.x), cluster_id);
    n_clusters = dv.clusters.d;
    const int items = kGrouped ? sched.items : p.items;
    const int my_items = cluster_id < items ? dv.clusters.div(items - cluster_id + n_clusters - 1) : 0;
    nch_item = dv.nch_item.d;  // (p.KB + KCH - 1) / KCH
    if (p.balanced) {
      kbA = 0;
      kbEnd = p.KB;
      nch = nch_item;
      T = my_items * nch_item;  // (the launcher keeps T * ks below 2^31)
      if (kGrouped && T < ks) {  // (grouped: fewer chunks than the plan's estimate) one per rank
        g0 = min(rank, T);
        g1 = min(rank + 1, T);
      } else {
        g0 = dv.ks.div(rank * T);
        g1 = dv.ks.div((rank + 1) * T);
      }
      q = g1 - g0;
    } else {
      kbA = rank * p.kb_per_split;
      kbEnd = min(p.KB, kbA + p.kb_per_split);
      nch = kbEnd > kbA ? (kbEnd - kbA + KCH - 1) / KCH : 0;
      q = my_items * nch;
      T = g0 = g1 = 0;
    }
    k = int64_t(p.KB) * 32;
    chunk_cells = int64_t(KCH) * p.N;
  }
  __device__ void set_derived(Cursor& cur) const {
    if constexpr (kGrouped) {
      const int g = ragged::group_of_item(sched.item_start, sched.G, cur.item);
      const int local = cur.item - sched.item_start[g], first = sched.row_start[g];
      const int group_rows = sched.row_start[g + 1] - first;
      const int m_blocks = (group_rows + ROWS - 1) / ROWS;  // >= 1: an empty group has no items
      cur.cg = local / m_blocks;
      cur.mb = local - cur.cg * m_blocks;
      cur.b = g;
      cur.col0 = cur.cg * COLS;
      cur.m0 = first + cur.mb * ROWS;
      cur.rows = min(ROWS, group_rows - cur.mb * ROWS);
      cur.cell0 = (int64_t(cur.b) * p.KB + cur.kb) * p.N + cur.col0;
      cur.x0 = cur.m0 * k + int64_t(cur.kb) * 32;
      return;
    }
    const int rest = dv.m_blocks.div(cur.item);
    cur.mb = dv.m_blocks.mod(cur.item, rest);
    cur.b = dv.col_groups.div(rest);
    cur.cg = dv.col_groups.mod(rest, cur.b);
    cur.col0 = cur.cg * COLS;
    cur.m0 = int64_t(cur.mb) * ROWS;
    cur.rows = int(min(int64_t(ROWS), p.M - cur.m0));
    cur.cell0 = (int64_t(cur.b) * p.KB + cur.kb) * p.N + cur.col0;
    cur.x0 = (int64_t(cur.b) * p.M + cur.m0) * k + int64_t(cur.kb) * 32;
  }
  // (balanced) the piece that starts at chunk g of the cluster's sequence
  __device__ void set_piece(Cursor& cur, int g) const {
    const int j = dv.nch_item.div(g), c0 = g - j * nch_item;
    cur.c = 0;
    cur.g = g;
    cur.nch = min(g1, (j + 1) * nch_item) - g;
    cur.kb = c0 * KCH;
    cur.item = cluster_id + j * n_clusters;
    set_derived(cur);
  }
  __device__ Cursor first() const {
    Cursor cur;
    if (p.balanced) {
      set_piece(cur, g0);
      return cur;
    }
    cur.c = 0;
    cur.nch = nch;
    cur.g = 0;
    cur.kb = kbA;
    cur.item = cluster_id;
    set_derived(cur);
    return cur;
  }
  __device__ void next_item(Cursor& cur) const {  // the first chunk of the CTA's next piece
    if (p.balanced) {
      set_piece(cur, cur.g + cur.nch);
      return;
    }
    cur.c = 0;
    cur.kb = kbA;
    cur.item += n_clusters;
    set_derived(cur);
  }
  __device__ void advance(Cursor& cur) const {
    if (++cur.c < cur.nch) {
      cur.cell0 += chunk_cells;
      cur.x0 += KCH * 32;
      cur.kb += KCH;
      return;
    }
    next_item(cur);
  }
  // (balanced) the cluster rank whose range holds chunk g of the sequence
  __device__ int rank_of(int g) const {
    if (kGrouped && T < ks) return g;  // (see the constructor: ranks without chunks come last)
    return ((g + 1) * ks + T - 1) / T - 1;
  }
  // (balanced) what the end of the piece at `cur` does with its sum: kPieceStore (a whole item),
  // kPieceSend to rank `peer` (a piece after the item's first chunk), or kPieceOwn (the item's
  // first piece; `peer` = the later ranks that hold the rest of it).
  __device__ int piece_role(const Cursor& cur, int& peer) const {
    const int j = cur.g / nch_item;
    if (cur.kb != 0) {
      peer = rank_of(j * nch_item);
      return kPieceSend;
    }
    if (cur.nch == nch_item) return kPieceStore;
    peer = rank_of((j + 1) * nch_item - 1) - rank;
    return kPieceOwn;
  }
};


}  // namespace kbit::cuda::fused
