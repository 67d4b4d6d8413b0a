// The end of a work item of the warp-specialized fused matmul: adding the partial sums of the
// consumer warps of a CTA (each covered some k-blocks of the item) and of the CTAs of a k-split
// cluster, in a fixed order, without stopping the warps that the sum does not need
// (ItemReducer; WarpClusterReducer at the end is the N-split tiling's, whose warps own columns).
// (The cp.async kernel keeps a barrier tree: its CTA meets at a barrier every chunk anyway, and
// the slots below would cost it a ring stage at M = 9..16, measured 10-16 % slower.)
//
// Why not barriers: Nsight Compute on the H200 (llama3-70b gate_up, M = 1, bits 4: 2-CTA
// clusters, 7 items per CTA) put 31 % of all warp samples in the previous epilogue -- a tree
// over three CTA barriers plus two full cluster barriers per item -- stalled on those barriers:
// at every item every warp waited for the slowest warp of both CTAs, and the ring drained.
// Here only the item's leader waits, on mbarriers:
//  * every other consumer warp writes its accumulators to its slot, arrives on `full` and goes
//    on with the next item at once. It waits on `empty` only before it rewrites its slot, i.e.
//    when the leader is still a whole item behind.
//  * The leader (warp seq % NW for the CTA's seq-th item, so the extra work rotates) waits on
//    `full`, adds all warps in warp order 0..NW-1 (a fixed order whoever leads: results are
//    deterministic) and arrives on `empty`.
//  * k-split cluster: rank r > 0's leader sends its sum straight from its registers into its
//    receive slot in rank 0's shared memory (st.async; each store completes its bytes on rank
//    0's `cl_full`, so no fence is needed). Rank 0's leader announces the bytes it expects,
//    waits, adds the slots in rank order, stores, and arrives on every rank's `cl_empty`, which
//    rank r's next leader waits on before it sends again. (Rank 0 reading each rank's sum
//    through distributed shared memory would need a release-at-cluster-scope arrival: ptxas turns
//    that arrival, and the release of the cluster barrier at exit, into MEMBAR.GPU, which waits
//    for every outstanding memory operation of the warp; the small k-split products take
//    0.3-0.8 us longer per launch that way, H200.)
//    Nothing is left in flight between the CTAs after the last item (it has no `cl_empty`
//    arrivals: no one would wait for them), so the kernel's exit barrier needs no release.
//  * The CTA's last item (finish_last_shared): no warp has a next item to go on with, so all of
//    them share the sum. Each warp owns a round-robin share of the accumulator groups, adds it
//    over the warps (and, on rank 0, the ranks) in the same order, and stores it; a named
//    barrier replaces `full`. Most small launches run one item per CTA, so this is their item
//    end (below).
//  * chunk-balanced clusters (ItemWalk): an item cut at a rank boundary is summed by its owner
//    (the rank with its first chunk) from the later ranks' pieces, each sent once per launch
//    into its own receive slot (finish_piece; a CTA's last piece, unless it sends, is summed by
//    all warps as above: finish_last_piece).
// What it costs (H100, timed against builds without it): an item's end takes 1.3-3.6 us of a
// 6-16 us Qwen3/GLM product at M = 1..32, even without a cluster; 0.9-1.7 us of it would be the
// leader adding the CTA's warps' sums (one slot after another) while the other warps have nothing
// left to do. With the last item's sum shared a one-item CTA's end takes 0.8-1.2 us instead of
// 1.4-2.2, 0.96x the time over 120 cases (10 shapes x M = 1, 16, 32 x bits 2-5; 0.87-0.92x for
// the 16-row kWarpKBlock tiling of Qwen3 q/o/down and GLM down at M = 16, which runs in k-split
// clusters).
// Phases: a parity wait is only sound if the barrier is within one phase of the waiter. So
// `full` and `cl_full` exist once per leader warp (phase k of full[L] is the k-th item that L
// leads; with one shared barrier, a leader could test item seq's parity while item seq - 1's
// phase is still open, and pass). `empty` and `cl_empty` are single: their arrivals are in item
// order (item seq + 1's slots are written only after item seq's were read), and whoever waits
// for item seq - 1 has already seen item seq - 2 complete (harness test: many items per cluster).
#pragma once

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/tma.cuh"  // mbar_arrive_expect_tx

namespace kbit::cuda::fused {

// The largest k-split cluster (the portable cluster size); ItemReducer keeps a receive slot per
// other rank.
constexpr int kMaxKSplit = 8;
// What the end of a piece of a chunk-balanced cluster does with its sum (ItemWalk::piece_role).
constexpr int kPieceStore = 0, kPieceSend = 1, kPieceOwn = 2;

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spin until the phase of parity `parity` has completed: acquire at CTA scope, or at cluster
// scope (kCluster) when the arrivals came from other CTAs of the cluster.
#define KBIT_MBAR_TRY_WAIT(SEM) \
  "{\n.reg .pred p;\nmbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
template <bool kCluster = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    if constexpr (kCluster)
      asm volatile(KBIT_MBAR_TRY_WAIT(".acquire.cluster") : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    else
      asm volatile(KBIT_MBAR_TRY_WAIT("") : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
#undef KBIT_MBAR_TRY_WAIT
// The address of `addr` (this CTA's shared window) in the shared memory of cluster rank `rank`.
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// Arrive (release, cluster scope: this thread's earlier writes are visible to the waiter) on the
// barrier at `addr` in rank `rank`'s shared memory.
__device__ __forceinline__ void mbar_arrive_rank(uint32_t addr, int rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(map_rank(addr, rank))
               : "memory");
}
// Arrive on the barrier at `addr` in rank `rank`'s shared memory, ordering only this thread's
// earlier shared-memory accesses (release at CTA scope: no MEMBAR.GPU). For "your buffer here
// is free again" signals, whose reads have completed (their values are in registers).
__device__ __forceinline__ void mbar_arrive_rank_cta(uint32_t addr, int rank) {
  asm volatile("mbarrier.arrive.release.cta.shared::cluster.b64 _, [%0];\n" ::"r"(map_rank(addr, rank)) : "memory");
}
// Store 16 bytes into another rank's shared memory (both addresses from map_rank) and complete
// them on that rank's barrier `bar` as transaction bytes: the barrier's phase cannot complete
// before the bytes have landed.
__device__ __forceinline__ void st_async_f32x4(uint32_t cluster_addr, float a, float b, float c, float d,
                                               uint32_t cluster_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1,%2,%3,%4}, [%5];\n" ::"r"(
                   cluster_addr),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(cluster_bar)
               : "memory");
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t cluster_addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void sts128f(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
// Cluster barrier, all threads of every rank; each thread alternates arrive and wait. Split at
// the start (arrive after the barrier init, wait before the first remote arrival) and whole
// before exit (no rank's shared memory may still be addressed by another). The exit's is
// relaxed: neither reducer below leaves anything in flight between the CTAs after its last item
// (a release there compiled to MEMBAR.GPU).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_barrier_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

// NW consumer warps with NACC fp32 accumulators per lane, in clusters of up to RECV + 1 CTAs
// (rank 0 has RECV receive slots).
template <int NW, int NACC, int RECV>
struct ItemReducer {
  static_assert(NACC % 4 == 0, "accumulators move as float4");
  static_assert(RECV >= 1 && RECV < kMaxKSplit, "receive slots");
  static constexpr int kMaxRanks = RECV + 1;
  static constexpr int kSlotBytes = NACC * 32 * 4;
  static constexpr int kRedBytes = (NW - 1) * kSlotBytes;  // one slot per non-leader warp
  static constexpr int kRecvBytes = RECV * kSlotBytes;     // (rank 0) one per other rank
  static constexpr int kBarBytes = (2 * NW + 2) * 8;
  static constexpr int bytes_with(int recv) { return kRedBytes + recv * kSlotBytes + kBarBytes; }
  static constexpr int kBytes = bytes_with(RECV);

  uint32_t red, recv;
  uint32_t full, empty, cl_full, cl_empty;  // full[NW], empty, cl_full[NW], cl_empty
  int ks, rank;

  __device__ ItemReducer(uint32_t base, int k_split, int cluster_rank)
      : red(base), recv(base + kRedBytes), full(base + kRedBytes + kRecvBytes), empty(full + 8 * NW),
        cl_full(empty + 8), cl_empty(cl_full + 8 * NW), ks(k_split), rank(cluster_rank) {}

  // One thread, before the CTA-wide (or cluster-wide) barrier that publishes the init.
  __device__ void init() const {
    for (int w = 0; w < NW; ++w) {
      mbar_init(full + 8 * w, 32 * (NW - 1));  // every lane of every non-leader warp
      if (ks > 1) mbar_init(cl_full + 8 * w, 1);  // (rank 0) its leader's arrival; the sums as bytes
    }
    mbar_init(empty, 32);                   // the leader's lanes
    if (ks > 1) mbar_init(cl_empty, 32);    // (rank > 0) rank 0's leader's lanes
  }

  // Slot of warp w when `leader` leads: the NW - 1 non-leaders fill slots 0..NW-2.
  __device__ static int slot_of(int w, int leader) {
    const int d = w - leader - 1 + NW;  // 0 .. 2 NW - 2
    if constexpr ((NW & (NW - 1)) == 0) return d & (NW - 1);  // (a signed % costs ~6 instructions)
    return d % NW;
  }
  __device__ uint32_t slot_addr(int slot, int e4, int lane) const {
    return red + uint32_t(((slot * (NACC / 4) + e4) * 32 + lane) * 16);
  }
  __device__ uint32_t recv_slot_addr(int s, int e4, int lane) const {
    return recv + uint32_t((s * (NACC / 4) + e4) * 32 + lane) * 16;
  }
  // The sending warp's lanes (the leader's) send the CTA's sum v into receive slot s of rank
  // `to` by st.async, each store completing its bytes on that rank's barrier `bar` (an address
  // of this CTA's window).
  __device__ void send_sum(const float (&v)[NACC], int to, int s, uint32_t bar, int lane) const {
    const uint32_t rbar = map_rank(bar, to), dst = map_rank(recv_slot_addr(s, 0, lane), to);
#pragma unroll
    for (int e4 = 0; e4 < NACC / 4; ++e4)
      st_async_f32x4(dst + uint32_t(e4 * 32 * 16), v[4 * e4], v[4 * e4 + 1], v[4 * e4 + 2], v[4 * e4 + 3], rbar);
  }
  // The adding warp's lanes add receive slots 0..n-1 to v, in slot (= rank) order.
  __device__ void add_received(float (&v)[NACC], int n, int lane) const {
    for (int s = 0; s < n; ++s) {
#pragma unroll
      for (int e4 = 0; e4 < NACC / 4; ++e4) {
        const float4 q = lds128f(recv_slot_addr(s, e4, lane));
        v[4 * e4] += q.x; v[4 * e4 + 1] += q.y; v[4 * e4 + 2] += q.z; v[4 * e4 + 3] += q.w;
      }
    }
  }

  // add_received for float4 group e4 alone (the shared last-item ends: warp e4 owns group e4).
  __device__ void add_received_group(float4& v, int n, int e4, int lane) const {
    for (int s = 0; s < n; ++s) {
      const float4 q = lds128f(recv_slot_addr(s, e4, lane));
      v.x += q.x; v.y += q.y; v.z += q.z; v.w += q.w;
    }
  }

  // The CTA's sum of its seq-th item (seq = 0, 1, ... per CTA), called by every consumer warp:
  // the non-leaders leave their sums in their slots and return false; the leader adds every
  // warp's into v (warp order) and returns true.
  __device__ bool sum_warps(const float (&acc)[NACC], int seq, int warp, int lane, float (&v)[NACC]) const {
    const int leader = seq % NW;
    if (warp != leader) {
      if (seq > 0) mbar_wait(empty, uint32_t(seq - 1) & 1u);  // the leader has read item seq - 1's slots
      const int s = slot_of(warp, leader);
#pragma unroll
      for (int e4 = 0; e4 < NACC / 4; ++e4)
        sts128f(slot_addr(s, e4, lane), acc[4 * e4], acc[4 * e4 + 1], acc[4 * e4 + 2], acc[4 * e4 + 3]);
      mbar_arrive(full + 8 * leader);
      return false;
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) v[e] = 0.f;
    if (NW > 1) mbar_wait(full + 8 * leader, uint32_t(seq / NW) & 1u);  // the leader's phase of full
    for (int w = 0; w < NW; ++w) {  // warp order, whoever leads
      if (w == leader) {
#pragma unroll
        for (int e = 0; e < NACC; ++e) v[e] += acc[e];
      } else {
        const int s = slot_of(w, leader);
#pragma unroll
        for (int e4 = 0; e4 < NACC / 4; ++e4) {
          const float4 q = lds128f(slot_addr(s, e4, lane));
          v[4 * e4] += q.x; v[4 * e4 + 1] += q.y; v[4 * e4 + 2] += q.z; v[4 * e4 + 3] += q.w;
        }
      }
    }
    if (NW > 1) mbar_arrive(empty);
    return true;
  }

  // The CTA's last item: no warp has a next item to go on with, so instead of one leader adding
  // every warp's sums while the others idle (0.9-1.7 us at 8-16 warps, the largest part of a small
  // launch's item end), warp w owns float4 group w
  // (every tiling has at most NW groups). Every warp leaves the groups it does not own in the
  // slots, each group of warp u in slot slot_of(u, owner) (so NW - 1 slots hold all of them);
  // each owner adds its group over all warps in warp order. In a cluster, rank r > 0's owners
  // then send theirs to rank 0's receive slot r - 1 by st.async, and rank 0's add the other
  // ranks' in rank order. The owners of rank 0 (without a cluster: of every CTA) store their
  // groups (store.group). That is the leader's order, so the same sums, bit for bit. Barriers
  // and phases as in the leader's path; no other item follows, so nothing waits on this item's
  // arrivals.
  // The shared sum of the CTA's last item (finish_last_shared, finish_last_piece): true for the
  // warps that own a float4 group (warp < NACC / 4), with that group's sum over the warps in v.
  __device__ bool sum_groups_shared(const float (&acc)[NACC], int seq, int& warp, int& lane, float4& v) const {
    static_assert(NACC / 4 <= NW, "at most one float4 group per warp (NACC <= 4 NW in every tiling)");
    // The warp and lane indices pass through a volatile no-op, so that ptxas cannot hoist this
    // path's addresses (one slot per group, from the warp index) out of the chunk loop around it.
    // Without it the K-split tilings' chunk loops grow by up to 15 instructions (tools/sass_loops.py;
    // lane addresses recomputed inside).
    asm volatile("mov.b32 %0, %0;\n" : "+r"(warp));
    asm volatile("mov.b32 %0, %0;\n" : "+r"(lane));
    if (seq > 0) mbar_wait(empty, uint32_t(seq - 1) & 1u);  // item seq - 1's leader has read the slots
#pragma unroll
    for (int e4 = 0; e4 < NACC / 4; ++e4)
      if (e4 != warp)
        sts128f(slot_addr(slot_of(warp, e4), e4, lane), acc[4 * e4], acc[4 * e4 + 1], acc[4 * e4 + 2],
                acc[4 * e4 + 3]);
    asm volatile("bar.sync 2, %0;\n" ::"n"(NW * 32) : "memory");  // every consumer warp's groups are in
    if (warp >= NACC / 4) return false;  // (owns no group)
    // From here the warp handles its group e4 = warp alone, as one float4: straight-line selects
    // instead of a branch around each group's block (the owners' sum takes 0.19 us instead of
    // 0.28, H200), and one group's sends, loads and stores, not every group's
    // behind a test of the owner.
    const int e4 = warp;
    float4 own_v = make_float4(acc[0], acc[1], acc[2], acc[3]);
#pragma unroll
    for (int e = 1; e < NACC / 4; ++e)
      if (e == e4) own_v = make_float4(acc[4 * e], acc[4 * e + 1], acc[4 * e + 2], acc[4 * e + 3]);
    v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      // (w == warp: slot 0, written before the barrier like the others; read and dropped)
      const float4 ld = lds128f(slot_addr(w == warp ? 0 : slot_of(w, warp), e4, lane));
      const float4 q = w == warp ? own_v : ld;
      v.x += q.x; v.y += q.y; v.z += q.z; v.w += q.w;
    }
    return true;
  }

  template <class Store>
  __device__ void finish_last_shared(float (&acc)[NACC], int seq, int warp, int lane, Store&& store) const {
    float4 v;
    if (!sum_groups_shared(acc, seq, warp, lane, v)) return;
    const int e4 = warp;
    if (ks > 1) {
      const int leader = seq % NW;  // the barrier (and phase) the leader's path would use
      if (rank > 0) {
        if (seq > 0) mbar_wait<true>(cl_empty, uint32_t(seq - 1) & 1u);  // rank 0 has read item seq - 1's sum
        st_async_f32x4(map_rank(recv_slot_addr(rank - 1, e4, lane), 0), v.x, v.y, v.z, v.w,
                       map_rank(cl_full + 8 * leader, 0));
        return;
      }
      if (warp == 0 && lane == 0) mbar_arrive_expect_tx(cl_full + 8 * leader, uint32_t((ks - 1) * kSlotBytes));
      mbar_wait<true>(cl_full + 8 * leader, uint32_t(seq / NW) & 1u);
      add_received_group(v, ks - 1, e4, lane);  // ranks 1..ks-1
    }
    store.group(e4, v);
  }

  // Called by every consumer warp at the end of its seq-th item (seq = 0, 1, ... per CTA);
  // `last`: the CTA's last item (the same for every warp, and every rank of a cluster). The warp
  // that must store the item's result calls store(sum) (at the last item each owner warp calls
  // store.group(e4, its float4 group of the sum)). acc is zeroed.
  template <class Store>
  __device__ void finish(float (&acc)[NACC], int seq, bool last, int warp, int lane, Store&& store) const {
    if (NW > 1 && last) {
      finish_last_shared(acc, seq, warp, lane, store);
#pragma unroll
      for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
      return;
    }
    const int leader = seq % NW;
    const uint32_t prev = uint32_t(seq - 1) & 1u;      // item seq - 1's phase of cl_empty
    const uint32_t led = uint32_t(seq / NW) & 1u;      // the leader's phase of cl_full
    float v[NACC];
    if (sum_warps(acc, seq, warp, lane, v)) {
      if (ks == 1) {
        store(v);
      } else if (rank > 0) {
        if (seq > 0) mbar_wait<true>(cl_empty, prev);  // rank 0 has read item seq - 1's sum
        send_sum(v, 0, rank - 1, cl_full + 8 * leader, lane);
      } else {
        if (lane == 0) mbar_arrive_expect_tx(cl_full + 8 * leader, uint32_t((ks - 1) * kSlotBytes));
        mbar_wait<true>(cl_full + 8 * leader, led);
        add_received(v, ks - 1, lane);  // ranks 1..ks-1
        for (int r = 1; r < ks; ++r) mbar_arrive_rank_cta(cl_empty, r);  // (an item follows)
        store(v);
      }
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
  }

  // Chunk-balanced clusters (ItemWalk): the end of the CTA's seq-th piece, called by every
  // consumer warp. `role` kPieceStore: a whole item, stored here. kPieceSend: the leader sends
  // the CTA's sum into receive slot rank - peer - 1 of rank `peer` (the item's owner) by
  // st.async. kPieceOwn: the leader waits for the `peer` later ranks' sums, adds them in rank
  // order (deterministic), stores. Each rank sends and owns at most once per launch, so every
  // slot is written once and cl_full[0] completes one phase: no "slot free" signals.
  template <class Store>
  __device__ void finish_piece(float (&acc)[NACC], int seq, int role, int peer, int warp, int lane,
                               Store&& store) const {
    float v[NACC];
    if (sum_warps(acc, seq, warp, lane, v)) {
      if (role == kPieceStore) {
        store(v);
      } else if (role == kPieceSend) {
        send_sum(v, peer, rank - peer - 1, cl_full, lane);
      } else {
        if (lane == 0) mbar_arrive_expect_tx(cl_full, uint32_t(peer * kSlotBytes));
        mbar_wait<true>(cl_full, 0);
        add_received(v, peer, lane);  // ranks rank+1 .. rank+peer
        store(v);
      }
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
  }

  // Chunk-balanced clusters: the CTA's last piece where it stores or owns its item (not where it
  // sends): the sum shared by the warps as in finish_last_shared, then each owner warp adds its
  // group of the later ranks' sums in rank order and stores it (finish_piece's order, so the same
  // sums, bit for bit). In finish_piece's leader path one warp adds every warp's sums while the
  // others wait at the kernel's end: with it, balanced clusters of 2 took 1.00-1.09x the time on
  // the ten layers and Llama-3-70B's at M = 1 (H200, bits 4; GLM-4.7 gate/up 9.50 us against 8.68).
  template <class Store>
  __device__ void finish_last_piece(float (&acc)[NACC], int seq, int role, int peer, int warp, int lane,
                                    Store&& store) const {
    float4 v;
    if (sum_groups_shared(acc, seq, warp, lane, v)) {
      const int e4 = warp;
      if (role == kPieceOwn) {
        if (warp == 0 && lane == 0) mbar_arrive_expect_tx(cl_full, uint32_t(peer * kSlotBytes));
        mbar_wait<true>(cl_full, 0);
        add_received_group(v, peer, e4, lane);  // ranks rank+1 .. rank+peer
      }
      store.group(e4, v);
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
  }
};

// The item end of the N-split tiling (Tiling::kNSplit), whose consumer warps each own their columns:
// only the CTAs of a k-split cluster add up, warp by warp. Rank r > 0's warp w leaves its sums in
// its slot and arrives on rank 0's cl_full[w] (release, cluster scope); rank 0's warp w waits
// there, adds its own sums and the ranks' in rank order (deterministic), stores, and arrives on
// every rank's cl_empty[w] (release at CTA scope, see finish), which rank r's warp w waits on
// before it rewrites its slot. The barriers are per warp, so no warp waits for another warp of
// its CTA. Phases: rank r's warp w arrives for item seq only after rank 0's warp w has finished
// item seq - 1, so each barrier is within one phase of its waiter. Without a cluster each warp
// stores its sums at once.
template <int NW, int NACC>
struct WarpClusterReducer {
  static_assert(NACC % 4 == 0, "accumulators move as float4");
  static constexpr int kMaxRanks = kMaxKSplit;
  static constexpr int kSlotBytes = NACC * 32 * 4;
  static constexpr int kPartBytes = NW * kSlotBytes;  // this rank's sums, one slot per warp
  static constexpr int kBarBytes = 2 * NW * 8;
  static constexpr int kBytes = kPartBytes + kBarBytes;

  uint32_t part, cl_full, cl_empty;  // part[NW], cl_full[NW], cl_empty[NW]
  int ks, rank;

  __device__ WarpClusterReducer(uint32_t base, int k_split, int cluster_rank)
      : part(base), cl_full(base + kPartBytes), cl_empty(cl_full + 8 * NW), ks(k_split), rank(cluster_rank) {}

  // One thread, before the cluster-wide barrier that publishes the init.
  __device__ void init() const {
    if (ks == 1) return;
    for (int w = 0; w < NW; ++w) {
      mbar_init(cl_full + 8 * w, 32 * (ks - 1));  // (rank 0) warp w's lanes of the other ranks
      mbar_init(cl_empty + 8 * w, 32);            // (rank > 0) rank 0's warp w's lanes
    }
  }

  __device__ uint32_t slot_addr(int warp, int e4, int lane) const {
    return part + uint32_t(warp * kSlotBytes + (e4 * 32 + lane) * 16);
  }

  // Called by every consumer warp at the end of its seq-th item; `last`: the CTA's last item (the
  // same on every rank). On rank 0 (or without a cluster) calls store(sum) with the warp's
  // columns' sums. acc is zeroed.
  template <class Store>
  __device__ void finish(float (&acc)[NACC], int seq, bool last, int warp, int lane, Store&& store) const {
    if (ks == 1) {
      store(acc);
    } else if (rank > 0) {
      if (seq > 0) mbar_wait<true>(cl_empty + 8 * warp, uint32_t(seq - 1) & 1u);  // rank 0 read seq - 1
#pragma unroll
      for (int e4 = 0; e4 < NACC / 4; ++e4)
        sts128f(slot_addr(warp, e4, lane), acc[4 * e4], acc[4 * e4 + 1], acc[4 * e4 + 2], acc[4 * e4 + 3]);
      mbar_arrive_rank(cl_full + 8 * warp, 0);
    } else {
      mbar_wait<true>(cl_full + 8 * warp, uint32_t(seq) & 1u);
      for (int r = 1; r < ks; ++r) {  // rank order
        const uint32_t rp = map_rank(slot_addr(warp, 0, lane), r);
#pragma unroll
        for (int e4 = 0; e4 < NACC / 4; ++e4) {
          const float4 q = ld_cluster_f32x4(rp + uint32_t(e4 * 32 * 16));
          acc[4 * e4] += q.x; acc[4 * e4 + 1] += q.y; acc[4 * e4 + 2] += q.z; acc[4 * e4 + 3] += q.w;
        }
      }
      // "Your slot is free again": the loads from it are complete once the adds have consumed
      // them, which the empty asm pins before the arrivals (asm volatile keeps its order). So
      // the arrivals release at CTA scope: at cluster scope each compiled to a MEMBAR.GPU, and
      // this tiling forced takes 1.07-1.28x the time on the Qwen3/GLM layers at M = 16-32
      // (H100). The last item sends none (nothing waits for them):
      // with rank 0's remote loads complete, nothing is in flight towards another rank at exit,
      // and the kernel's exit barrier is relaxed (a release there was a MEMBAR.GPU that also
      // waited for rank 0's stores of the sums).
#pragma unroll
      for (int e = 0; e < NACC; ++e) asm volatile("" ::"f"(acc[e]));
      if (!last)
        for (int r = 1; r < ks; ++r) mbar_arrive_rank_cta(cl_empty + 8 * warp, r);
      store(acc);
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
  }
};

}  // namespace kbit::cuda::fused
