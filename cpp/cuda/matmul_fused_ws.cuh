// The warp-specialized fused kernel: the default at M <= 128 (blocks of 16 rows, or kNSplit's
// 16, 32 or 64), where the buffers suit the tensor copies (launch_fused_bits).
//
// One thread of a producer warp streams each chunk into the ring with three TMA tensor copies
// (tma.cuh: weights, scale bytes, activations) that complete on the stage's "full" mbarrier by
// byte count; the kWarps consumer warps wait on it, compute, and release the stage through its
// "empty" mbarrier (one arrival per warp). There is no CTA-wide barrier in the steady state:
// consumer warps drift freely by up to kStages - 1 chunks. Each consumer warp decodes the scale
// bytes of its own k-blocks into a warp-private float buffer (__syncwarp only). The end of an
// item stops only its leader warp (item_reduce.cuh; in kNSplit each warp stores its own
// columns); the producer takes part in no per-item synchronization, only in the cluster barriers
// at the start and the end of the kernel. With the copies and the barrier off the consumers it
// takes 0.71-0.91x the cp.async kernel's time at M = 1 and 4 even with cp.async copies of its
// own; the TMA copies take a further 0.93x (median): per-thread cp.async copies compete with the
// consumers for the MIO queue.
//
// A slot holds [weights: KCH x SLAB][scale bytes: KCH x COLS][activations: KCH x x_rows x 64 B,
// 64-byte swizzle]. The activation box has the rows inside the k-block (TMA writes boxes densely,
// so rows of a whole chunk would sit 1 KiB apart, all in the same banks for ldmatrix); 64-byte
// rows with the 64-byte swizzle put the 8 rows an ldmatrix reads in 8 distinct bank groups.
// Partial chunks: k-split ranges are whole chunks (the launcher rounds them), so only the last
// chunk of the K range can be partial, and the copies fill its k-blocks past K with zeros.
//
// What holds the steady state (ncu, Llama-3-70B gate/up, M = 1, bits 4): the consumers' k-block
// chain (LDS codes -> PRMT -> LDS table -> HMMA -> FFMA) on the SM's shared-memory path: ~94 LSU
// instructions per consumer warp and chunk (64 of them table lookups), LSU pipe ~59 % and
// wavefronts ~61 % of peak, with two consumer warps per scheduler to hide the latencies. Bits 2
// and 4 issue about the same instructions per chunk, which is why their times agree.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/dependent_launch.cuh"
#include "cuda/item_reduce.cuh"
#include "cuda/matmul_fused_config.cuh"
#include "cuda/matmul_fused_epilogue.cuh"
#include "cuda/matmul_fused_steps.cuh"
#include "cuda/matmul_fused_walk.cuh"
#include "cuda/tma.cuh"
#include "cuda/weight_path.cuh"

namespace kbit::cuda::fused {

// The tensor maps (tma.cuh), encoded per launch and passed by value:
//   wmap  the weights as 32-bit words: B * KB k-block rows of N * BITS words; box KCH rows x
//         COLS * BITS words.
//   smap  the scale bytes: B * KB rows of N bytes; box KCH rows x COLS bytes.
//   xmap  the activations as 16-bit elements, 3-D {32 (a k-block), B * M rows, KB k-blocks};
//         box {32, x_rows, KCH}, 64-byte swizzle.
//
// Grouped (kbit_ragged_dot: one GroupParams after the tensor maps; without it the kernel is the
// batched matmul's, the same code): batch entry b is expert b, whose items are those of the
// device-built schedule (ragged_schedule.cuh, ItemWalk), built by the whole CTA at entry into the
// shared memory after the ring; x and y are [M, K] and [M, N(/2)] for all experts, the xmap has
// M rows, and an item's box starts at its absolute first row (it may hold the next group's rows,
// computed and dropped by the store, and rows past M arrive as zeros). A change of expert loads
// the expert's codebook and rebuilds the table only where it differs from the one the table holds
// (experts quantized with one codebook share it); the tensor scale is loaded per expert. Rows at
// or past sum(group_sizes) are zeroed by the consumer threads of every CTA after their items.
template <int BITS, class Act, int MT, int V, class... Grouped>
__global__ void __launch_bounds__(WsConfig<BITS, MT, V>::kThreads, 1)
    kbit_matmul_ws_kernel(const Params p, const WalkDivs dv, const __grid_constant__ CUtensorMap wmap,
                          const __grid_constant__ CUtensorMap smap, const __grid_constant__ CUtensorMap xmap,
                          Grouped... grouped) {
  static_assert(sizeof...(Grouped) <= 1, "one GroupParams at most");
  constexpr bool kGrouped = sizeof...(Grouped) == 1;
  using Cfg = Config<BITS, MT, V>;
  using WC = WsConfig<BITS, MT, V>;
  using WP = typename Cfg::Path;
  using T = typename Act::T;
  constexpr int NW = Cfg::kWarps, NT = Cfg::kThreads, TN = Cfg::kTN;
  const int D = p.stages;  // WC::stages of p.x_rows or of 8 MT rows (Planner::plan), 2..8
  constexpr int KCH = Cfg::kKCH, NACC = Cfg::kAcc, COLS = Cfg::kCols;
  constexpr int SLAB = Cfg::kSlabBytes, KPW = Cfg::kKPW, SFW = WC::kSfWarpBytes;

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // (grouped) the schedule, after the ring; group_sizes may be the previous kernel's output
  const GroupSched sched = [&] {
    GroupSched gs;
    if constexpr (kGrouped) {
      const GroupParams gp{grouped...};
      const uint32_t ring = (smem_u32(smem) + uint32_t(WC::kRingOffset) + 1023u) & ~1023u;
      uint8_t* base = smem + (ring - smem_u32(smem)) + size_t(p.stages) * WC::slot_bytes(p.x_rows);
      int* row_start = reinterpret_cast<int*>(base + 256);
      int* item_start = row_start + gp.G + 1;
      pdl_wait();
      gs.items = ragged::build_schedule(gp.group_sizes, gp.G, p.M, 8 * MT, p.col_groups, row_start, item_start,
                                        reinterpret_cast<long long*>(base));
      gs.row_start = row_start;
      gs.item_start = item_start;
      gs.G = gp.G;
    }
    return gs;
  }();
  const ItemWalk<KCH, COLS, 8 * MT, kGrouped> walk(p, dv, sched);
  const int KS = walk.ks, rank = walk.rank, Q = walk.q;

  // ---- shared memory: [LUT][reducer][sf][full x 8, empty x 8][ring: D x (weights | scales | x)]
  const uint32_t s_lut = smem_u32(smem);
  const typename WC::Reducer reducer(s_lut + WP::kLutBytes, KS, rank);
  const uint32_t s_sf = s_lut + WP::kLutBytes + WC::Reducer::kBytes;
  const uint32_t s_full = s_sf + WC::kSfBytes, s_empty = s_full + 64;
  const uint32_t s_ring = (s_lut + uint32_t(WC::kRingOffset) + 1023u) & ~1023u;
  const uint32_t slot_bytes = uint32_t(WC::slot_bytes(p.x_rows));
  constexpr uint32_t kXOffset = Cfg::kWChunk + WC::kSSlot;  // activations within a slot
  const uint32_t x_kb_bytes = uint32_t(p.x_rows) * kXKbBytes;  // one k-block of the activations

  // the chunk's first k-block (within the batch entry) and its row of weights and scales
  auto row_of = [&](const Cursor& c) { return c.b * p.KB + c.kb; };
  // A last block of M with one row after others (K-split tilings: M = 17, 33, ...) copies its box
  // from one row higher, so that two of the box's rows lie inside x; its row sits `x_shift` = 1
  // row down in the slot (set_x_offsets). With the one row alone inside the box the 16-row tiling
  // takes 1.03-1.48x the time of M = 18 (H100, median 1.20; the cause is not known: 2..15 rows
  // inside are fine). (Shifting every partial last block to end at row M costs M = 18..24 1.5 %:
  // the box's extra rows are real copies.)
  auto x_shift = [&](const Cursor& c) { return V != Tiling::kNSplit && c.m0 > 0 && c.rows == 1 ? 1 : 0; };
  const bool ready = p.inputs_ready != 0;
  const uint32_t chunk_bytes = uint32_t(Cfg::kWChunk + WC::kSChunk) + uint32_t(KCH) * x_kb_bytes;
  // The producer's lane 0: announce chunk `c`'s bytes on ring slot `slot`'s full barrier and
  // issue its three tensor copies (weights, scale bytes, activations).
  auto issue = [&](int slot, const Cursor& c) {
    const uint32_t base = s_ring + slot * slot_bytes, full = s_full + 8 * slot;
    const int wrow = row_of(c);
    mbar_arrive_expect_tx(full, chunk_bytes);
    if constexpr (Cfg::kPieceMap)  // 16-column pieces (a box dimension holds at most 256 words)
      tma_load_3d(base, &wmap, 0, c.col0 / 16, wrow, full);
    else
      tma_load_2d(base, &wmap, c.col0 * BITS, wrow, full);
    tma_load_2d(base + Cfg::kWChunk, &smap, c.col0, wrow, full);
    const int64_t x_row = kGrouped ? c.m0 : int64_t(c.b) * p.M + c.m0;  // (grouped: x is shared)
    tma_load_3d(base + kXOffset, &xmap, 0, int(x_row - x_shift(c)), c.kb, full);
  };
  // The producer's lane 0 sends its first request before anything else, so DRAM works while the
  // CTA sets up:
  //  * inputs ready (a plain launch, as inside JAX's CUDA graphs): the first chunk's copies
  //    themselves, and with one batch entry the consumers build the table before the setup
  //    barrier too. The first copy goes out 0.5-0.6 us after entry (1.55-1.85 with setup,
  //    pdl_wait and the copy one after the other), the first chunk arrives at 1.6-1.8 us.
  //  * a programmatic dependent launch: only an L2 prefetch of the first chunk's weights and
  //    scale bytes, which may precede pdl_wait (dependent_launch.cuh). Only the first chunk:
  //    prefetching the whole ring puts D chunks of every CTA into DRAM's queue ahead of the first
  //    copy (the first chunk then arrives 4.4-4.9 us after entry instead of 2.2-2.5).
  if (tid == NT) {
    const Cursor c0 = walk.first();
    if (ready) {
      mbar_init(s_full, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
      if (Q > 0) {
        issue(0, c0);
      }
    } else if (Q > 0) {
      if constexpr (Cfg::kPieceMap)
        tma_prefetch_l2_3d(&wmap, 0, c0.col0 / 16, row_of(c0));
      else
        tma_prefetch_l2_2d(&wmap, c0.col0 * BITS, row_of(c0));
      tma_prefetch_l2_2d(&smap, c0.col0, row_of(c0));
    }
  }
  // (With inputs ready, compute-sanitizer's racecheck reports the producer's first arrival above
  // as a RAW hazard with "thread 3 or 4" writing stage 0's full barrier here. No thread but the
  // producer writes it: ptxas makes the loop below over the lanes' barriers a uniform-predicated
  // SYNCS.EXCH, and the report points at the NOP before it and stays when warp 0 skips every full
  // barrier with ready inputs: a false report.)
  if (tid < D) {
    if (tid > 0 || !ready) mbar_init(s_full + 8 * tid, 1);  // the producer's arrival (with the byte count)
    mbar_init(s_empty + 8 * tid, NW);
  }
  if (tid == 0) reducer.init();
  // Inputs ready and one batch entry (so one table): the consumers build the table now, under the
  // first copies' latency; otherwise after pdl_wait in their branch, for the first item's entry.
  // This build computes each entry once (build_table's order by entry: 0.976x the time of the
  // order by piece over 240 cases without PDL, the small layers' bits 5 0.87-0.96x); the rebuild
  // in the consumers' item loop keeps the order by piece (see build_table).
  const bool early_table = !kGrouped && ready && p.items == p.col_groups * p.m_blocks;
  if (early_table && warp < NW) build_table<WP, Act, true>(s_lut, p.codebook, tid, NT);
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  // Launched as a programmatic dependent launch (dependent_launch.cuh), this kernel may run
  // while the previous one on the stream still does: global memory other than the L2 prefetch
  // above is touched only after pdl_wait() (p.inputs_ready is 0 then). The next such launch may
  // take this CTA's SM as soon as it exits.
  pdl_allow_dependents();
  // Every rank's reducer barriers must exist before another rank arrives on them: arrive on the
  // cluster barrier now, wait just before the first cross-CTA step (the first item's end), so a
  // rank that starts late does not hold the others up at the start.
  if (KS > 1) cluster_arrive_relaxed();

  if (warp >= NW) {
    // ================= producer warp =================
    // Lane 0 announces the chunk's bytes on the stage's full barrier and issues its three tensor
    // copies. (64 producer threads issuing 16-byte cp.async copies share the MIO queue with the
    // consumers and fall behind, see tma.cuh; one 1-D cp.async.bulk per k-block row issues ~33
    // copies per chunk and is slower still.)
    if (lane == 0) {
      pdl_wait();
      Cursor ic = walk.first();
      int q = 0, slot = 0;
      uint32_t round = 0;  // passes over the ring; pass r >= 1 waits for completion r - 1 of empty
      if (ready && Q > 0) {  // the first chunk went out at entry (D >= 2)
        walk.advance(ic);
        q = slot = 1;
      }
      for (; q < Q; ++q) {
        if (round > 0) mbar_wait(s_empty + 8 * slot, (round - 1) & 1u);
        issue(slot, ic);
        walk.advance(ic);
        if (++slot == D) { slot = 0; ++round; }
      }
    }
    __syncwarp();
    if (KS > 1) cluster_wait();  // pairs with the arrive at the start
  } else {
    // ================= consumer warps =================
    // L through an identity shuffle (pinned_to_lane): otherwise ptxas recomputes bits 2's
    // selectors from the thread index in every k-block (an S2R and 4 more instructions). Pinning
    // o0 and o1 too spills at MT = 8 and reorders bits 3's loops.
    const typename WP::Lane L = pinned_to_lane(WP::lane_consts(lane), lane);
    const uint32_t o0 = WP::offset0(g, t), o1 = WP::offset1(g, t);
    const uint32_t sf_lane_off = uint32_t(g) * (2 * TN * 4);

    float acc[NACC];
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

    // The lane's shared-memory addresses for its KPW k-blocks, as offsets within a ring slot (the
    // scale bytes, codes and activations; slots start on 1024 bytes, so the activations' 64-byte
    // swizzle is a function of the offset alone) or as addresses of the warp's scale buffer (+ the
    // parity's SFW). Computed once: derived inside the chunk loop, ptxas re-derived them from the
    // thread index for every chunk (~45 of the ~300 instructions a kWarpKPair chunk issued per warp).
    uint32_t o_sraw[KPW], o_code0[KPW], o_code1[KPW], o_sf_st[KPW], o_sf_ld[KPW], o_x[KPW][MT];
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      const int kbl = warp * KPW + u;
      // scale bytes: lane (g, t) decodes columns 16 j + 8 h + g for the entries i = 2 j + h it
      // owns, into the warp's buffer at float g * 2TN + i (see load_scales)
      const int first_col = TN == 4 ? 16 * t + g : TN == 2 ? 16 * (t >> 1) + 8 * (t & 1) + g : 8 * t + g;
      const int entry = TN == 4 ? 2 * t : t;
      o_sraw[u] = uint32_t(Cfg::kWChunk + kbl * COLS + first_col);
      o_sf_st[u] = s_sf + uint32_t(kbl * 2 * SFW + (g * 2 * TN + entry) * 4);
      o_sf_ld[u] = s_sf + uint32_t(kbl * 2 * SFW) + sf_lane_off;
      o_code0[u] = uint32_t(kbl * SLAB) + o0;
      o_code1[u] = uint32_t(kbl * SLAB) + o1;
    }
    // ldmatrix lane l reads row l % 8 of n8 tile mt (rows past the block's `rows` repeat its last
    // row; their results are never stored) in the 8-wide k sub-block l / 8; the block's row r is
    // the slot's row r + x_shift.
    auto set_x_offsets = [&](const Cursor& c) {
      const int shift = x_shift(c);
#pragma unroll
      for (int u = 0; u < KPW; ++u)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          o_x[u][mt] = swizzle64(uint32_t(kXOffset + (warp * KPW + u) * x_kb_bytes +
                                          (min(8 * mt + (lane & 7), c.rows - 1) + shift) * kXKbBytes +
                                          (lane >> 3) * 16));
    };

    // One chunk: the warp's KPW k-blocks, software-pipelined. Every shared-memory load of all
    // KPW k-blocks (scale bytes, activations, codes) is issued before the first decode, so the
    // latencies overlap and the scheduler interleaves the k-blocks' lookup -> mma chains. (With
    // a branch per k-block they run one after the other; ncu: 28 % of the samples wait on
    // fixed-latency dependencies.) There is no branch: a k-block past K (in the last chunk) is
    // computed too, and adds exactly zero because its activations arrive as zeros (its codes and
    // scale bytes -- other weights or zeros -- decode to finite values: every table entry is a
    // codebook value, every E4M4 byte finite).
    auto compute = [&](int slot, int par) {
      const uint32_t base = s_ring + slot * slot_bytes, sf_par = uint32_t(par) * SFW;
      uint32_t xb[KPW][MT][4];
      typename WP::Raw raw[KPW][TN];
#pragma unroll
      for (int u = 0; u < KPW; ++u) {
        const uint32_t sraw = base + o_sraw[u], sfa = o_sf_st[u] + sf_par;
        if constexpr (TN == 4) {
          const uint32_t b0 = lds_u8(sraw), b1 = lds_u8(sraw + 8);
          sts64f(sfa, decode_e4m4_fast(b0 << 19), decode_e4m4_fast(b1 << 19));
        } else if constexpr (TN == 2) {
          sts32f(sfa, decode_e4m4_fast(lds_u8(sraw) << 19));
        } else {
          if (t < 2) sts32f(sfa, decode_e4m4_fast(lds_u8(sraw) << 19));
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(xb[u][mt], base + o_x[u][mt]);
        load_codes<WP, TN>(raw[u], base, o_code0[u], o_code1[u]);
      }
      __syncwarp();
      float sc[KPW][2 * TN];
#pragma unroll
      for (int u = 0; u < KPW; ++u) load_scales<TN>(sc[u], o_sf_ld[u] + sf_par);
#pragma unroll
      for (int u = 0; u < KPW; ++u) mma_k_block<WP, Act, MT, TN>(acc, raw[u], s_lut, L, xb[u], sc[u]);
    };

    // kNSplit: the warp's own TN tiles of every k-block of the chunk, one k-block after the other
    // (the activation fragments of all 8 MT rows take 4 MT registers per k-block). The scale
    // bytes of the whole chunk are decoded first, so one __syncwarp covers them: lane (g, t <
    // 2 TN) decodes column 16 (t / 2) + 8 (t % 2) + g, entry t of its row g (see load_scales).
    // ldmatrix lane l reads row l % 8 of sub-block l / 8; the 64-byte swizzle moves the 16-byte
    // piece s of row r to piece s ^ ((r / 2) % 4) (tma.cuh: swizzle64, 512-byte aligned rows).
    const uint32_t x_lane_off = uint32_t((lane & 7) * kXKbBytes + (((lane >> 3) ^ ((lane >> 1) & 3)) * 16));
    auto compute_nsplit = [&](int slot, int par) {
      const uint32_t base = s_ring + slot * slot_bytes;
      const uint32_t wcol = uint32_t(warp) * 16 * TN;  // the warp's first column in the group
#pragma unroll
      for (int u = 0; u < KCH; ++u)
        if (t < 2 * TN)
          sts32f(s_sf + ((warp * KCH + u) * 2 + par) * SFW + (g * 2 * TN + t) * 4,
                 decode_e4m4_fast(lds_u8(base + Cfg::kWChunk + u * COLS + wcol + 16 * (t >> 1) + 8 * (t & 1) + g)
                                  << 19));
      __syncwarp();
#pragma unroll
      for (int u = 0; u < KCH; ++u) {
        // The activations of a k-block: all 8 MT rows (the launcher sizes the box at 8 MT rows;
        // rows past M hold other rows or zeros, and their sums are never stored), 512 bytes per
        // n8 tile, so the swizzled lane offset is the same for every tile.
        uint32_t xb[MT][4];
        const uint32_t x_kb = base + kXOffset + u * x_kb_bytes + x_lane_off;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(xb[mt], x_kb + 512 * mt);
        typename WP::Raw raw[TN];
        load_codes<WP, TN>(raw, base + u * SLAB + warp * TN * WP::kTileBytes, o0, o1);
        float sc[2 * TN];
        load_scales<TN>(sc, s_sf + ((warp * KCH + u) * 2 + par) * SFW + sf_lane_off);
        if constexpr (std::is_same_v<Act, ActBF16>)
          mma_k_block_scaled_weights<WP, MT, TN>(acc, raw, s_lut, L, xb, sc);
        else
          mma_k_block<WP, Act, MT, TN>(acc, raw, s_lut, L, xb, sc);
      }
    };

    // The batch entry's table, and its tensor scale for the epilogues: loaded here, next to the
    // codebook, instead of at each item's store, where its latency would sit on the item's end.
    float ts = 0.f;
    auto build_lut = [&](int b) {
      build_table<WP, Act>(s_lut, p.codebook + int64_t(b) * (1 << BITS), tid, NT);
      ts = p.tensor_scale[b];
    };

    int item_seq = 0;
    auto epilogue = [&](const Cursor& cur, bool last_item) {
      if (KS > 1 && item_seq == 0) cluster_wait();  // the other ranks' reducer barriers exist
      Cursor wc = cur;
      if constexpr (V == Tiling::kNSplit) wc.col0 += 16 * TN * warp;  // the warp's own columns
      const ItemStore<MT, T, NACC, kGrouped> store{p, wc, g, t, ts};
      if constexpr (V != Tiling::kNSplit) {
        if (p.balanced) {
          int peer = 0;
          const int role = walk.piece_role(cur, peer);
          if (last_item && role != kPieceSend && NW > 1)
            reducer.finish_last_piece(acc, item_seq++, role, peer, warp, lane, store);
          else
            reducer.finish_piece(acc, item_seq++, role, peer, warp, lane, store);
          return;
        }
      }
      reducer.finish(acc, item_seq++, last_item, warp, lane, store);
    };

    // (grouped) lane l < 2^BITS: entry l of the codebook the table holds, as bits
    auto codebook_entry = [&](int b) {
      return lane < (1 << BITS) ? __float_as_uint(p.codebook[int64_t(b) * (1 << BITS) + lane]) : 0u;
    };
    uint32_t held_entry = 0;

    Cursor cc = walk.first();
    if constexpr (V != Tiling::kNSplit) set_x_offsets(cc);
    int lut_b = -1;
    pdl_wait();  // (the codebook, the activations' and the outputs' buffers may be the previous kernel's)
    if (Q > 0) {
      if (early_table)
        ts = p.tensor_scale[0];
      else
        build_lut(cc.b);
      lut_b = cc.b;
      if constexpr (kGrouped) held_entry = codebook_entry(cc.b);
    }
    named_bar_sync<NT>(1);

    int slot = 0;
    uint32_t fparity = 0;
    // Release a stage only once this warp's reads of it have returned their data: the producer's
    // next tensor copy into it (an async-proxy write) may start as soon as it sees the arrival, and
    // ptxas leaves the last k-block's loads in flight past an arrival that depends on nothing
    // (their registers are used after it). Here the arrival's address depends on every accumulator,
    // i.e. on the last mma of each tile, which consumed all of the stage's loads: a LOP3 per three
    // accumulator groups and the mma latency. (Without it the N-split tiling reads refilled stages:
    // wrong sums in 2-75 % of the launches at bits 2 and 5 with 5-8 CTA clusters, in the warps that
    // share a scheduler with the producer and run behind. A proxy fence before the arrival, which
    // waits for the loads, also works, at 1.02x the time.)
    auto release = [&](int s) {
      uint32_t zero = uint32_t(p.M) >> 31;  // 0, but not a constant to the compiler
#pragma unroll
      for (int i = 0; i < NACC / 4; ++i)
        asm volatile("and.b32 %0, %0, %1;\n" : "+r"(zero) : "r"(__float_as_uint(acc[4 * i])));
      __syncwarp();
      if (lane == 0) mbar_arrive(s_empty + 8 * s + zero);
    };
    // One item per pass; its chunks are the steady state, a loop of its own with one taken branch
    // per chunk (with the item's end tested inside it, the epilogue's code sits between the chunk's
    // body and the loop's tail: ncu counts 10 % of the samples there, instruction fetch and
    // branch resolution).
    int q = 0;  // chunks consumed
    while (q < Q) {
      for (int c = 0; c < cc.nch; ++c, ++q) {
        mbar_wait(s_full + 8 * slot, fparity);
        if constexpr (kStreamOnly) {
          // (the diagnostic build: the chunk is released undecoded)
        } else if constexpr (V == Tiling::kNSplit) {
          compute_nsplit(slot, q & 1);
        } else {
          compute(slot, q & 1);
        }
        release(slot);
        if (++slot == D) { slot = 0; fparity ^= 1u; }
      }
      epilogue(cc, q == Q);
      if (q == Q) break;  // (before next_item: its divisions would sit on the CTA's exit, 0.29 us)
      walk.next_item(cc);
      if constexpr (V != Tiling::kNSplit) set_x_offsets(cc);  // the next item's block of M may have fewer rows
      if constexpr (kGrouped) {
        if (cc.b != lut_b) {  // another expert: its tensor scale, and its table if its codebook differs
          const uint32_t entry = codebook_entry(cc.b);
          ts = p.tensor_scale[cc.b];
          lut_b = cc.b;
          if (__any_sync(0xffffffffu, entry != held_entry)) {  // (the same answer in every warp)
            named_bar_sync<NT>(1);
            build_table<WP, Act>(s_lut, p.codebook + int64_t(cc.b) * (1 << BITS), tid, NT);
            held_entry = entry;
            named_bar_sync<NT>(1);
          }
        }
      } else if (cc.b != lut_b) {  // the next item belongs to another batch entry
        named_bar_sync<NT>(1);     // (every warp finished reading the old table)
        build_lut(cc.b);
        lut_b = cc.b;
        named_bar_sync<NT>(1);
      }
    }
    if (KS > 1 && item_seq == 0) cluster_wait();  // (no item: still pair the start's arrive)
    if constexpr (kGrouped) {
      const int64_t n_out = p.glu != kGluNone ? p.N / 2 : p.N;
      ragged::zero_rows(static_cast<T*>(p.y), sched.row_start[sched.G], p.M, n_out, tid, NT);
    }
  }  // consumer warps
  // no rank's shared memory may still be addressed by another (relaxed: the reducers leave nothing
  // in flight between the CTAs after their last item, item_reduce.cuh)
  if (KS > 1) cluster_barrier_relaxed();
}

}  // namespace kbit::cuda::fused
