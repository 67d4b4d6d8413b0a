// The fused kbit matmul for bf16/f16 activations and fragment-layout weights:
//     y[b, m, n] = tensor_scale[b] * sum_kb scale[kb, n] * sum_{k in kb} x[b, m, k] * codebook[code]
//
// ---- Why it looks like this (numbers for the H200: 132 SMs, 1.98 GHz, ~4.3 TB/s) ----
// At small M the kernel must stream the compressed weights at memory speed, i.e. decode
// 58 (bits 2) .. 25 (bits 5) weights per SM per clock. The per-element seed recipe (bit-plane
// shifts + shuffle) costs ~10 integer ops per weight against a budget of 1-2, so:
//  * Weights use the fragment layout (format.h): thread t of an mma quad finds the 8 codes it
//    needs as one contiguous 8*bits-bit field of the cell, and two neighbouring codes form one
//    mma operand register (lower k in the low half).
//  * Operands are swapped: Y^T[N, M] = W^T[N, K] * X^T[K, M] with mma.m16n8k16. The weight
//    tile (16 columns n x 16 k) is the A operand, x is the B operand (n8 = 8 rows of M), so
//    M <= 8 wastes nothing along N and larger M re-uses the decoded A registers.
//  * Decoding is a table lookup in shared memory that returns two (bits 3..5) or four (bits 2)
//    16-bit values per instruction. The table is replicated once per lane (lane l reads bank
//    l: no conflicts) and its byte address is built with one PRMT (bits 2, 4: byte-aligned
//    indices, 256-byte rows) or one shift + one LOP3 (bits 3, 5).
//  * The E4M4 block scale multiplies the fp32 mma result of the cell's two k16 halves (mma into
//    a zero accumulator, then FFMA into the running sum), and tensor_scale is applied once in
//    the epilogue, so fp16 operands never hold scaled (possibly subnormal) values. The CTA
//    decodes each scale byte once into a float in shared memory.
//  * Memory parallelism comes from a kStages-deep shared-memory ring filled with 16-byte
//    cp.async copies (weights, activations, scale bytes of one "chunk" per stage): 30-64 KiB
//    in flight per SM without spending registers, in requests of 512 B per warp instruction.
//    (A first version kept the weights in registers, 4 stages of 32-bit loads per warp: ~3 MB
//    in flight over the GPU, and it ran latency-bound at 0.8-1.3 TB/s on the H200.) In the
//    warp-specialized kernel (M <= 16) a chunk's weights, scale bytes and activations arrive by
//    three TMA tensor copies instead (tma.cuh): the cp.async copies competed with the
//    consumers for the MIO queue.
//
// ---- Where it stands (H200, measured; see benchmarks/cuda_kernel_harness.cu) ----
//  Bit-exact decode, tested against a float64 reference (bf16 rel. error <= 3.7e-3).
//  Speed, M <= 8 (warp-specialized kernel below, harness "sel", bf16, cold weights, copy
//  4.23-4.27 TB/s): llama3-8b gate_up 18-19 us at M = 1 (0.9-1.8 TB/s, 21-41 % of copy;
//  bits 4: 41 %), llama3-70b down 50-89 us (1.2-2.5 TB/s, 29-59 %; bits 4: 59 %), qwen3
//  gate_up and glm down 7.8-13.6 us (8-24 %). That is 1.13-1.40x the cp.async kernel at
//  M = 1 and 1.10-1.33x at M = 4. M = 16 keeps the cp.async kernel (below 26 % of copy).
//  The time is still nearly independent of bits (e.g. llama3-70b down 53/53/50/89 us at
//  bits 2..5): the consumers' decode + mma, not the copies, set it.
//  History of the cp.async kernel (one __syncthreads per chunk, every warp issuing copies):
//  1.2-1.8 TB/s on the large Llama shapes at M <= 4 (29-43 % of the copy bandwidth), 0.3-0.9
//  TB/s on the small Qwen3/GLM shapes. The limit is not DRAM (26 % busy)
//  but the SM: one chunk (16 k-blocks x 64 columns, 32 K weights) takes ~2.5 K cycles against
//  ~1.05 K needed at bits 4; the time is nearly independent of bits (it scales with weights
//  decoded, ~10 per SM per clock). Nsight Compute: 0.48 instructions issued per scheduler per
//  cycle, no eligible warp half of the time, 4 warps per scheduler; SM idle 25 % of the
//  elapsed time (work imbalance and prologue). Per warp and chunk: ~124 instructions of
//  decode + mma (8 LDS weights, 32 PRMT, 32 LDS table, 8 HMMA, 16 FFMA at bits 4) plus ~120
//  of copy issue / scale decode / barrier bookkeeping. The warp-specialized kernel moved the
//  copies and the barrier off the consumers (above). Tried and dropped: the producer issuing
//  one 1-D cp.async.bulk per k-block row / scale row / activation row (~33 per chunk): ~55 ns
//  per bulk copy per SM, 0.55-0.86x the speed of the cp.async kernel (per-lane operands
//  of the uniform-datapath UBLKCP are serialized; a 2-D tensor map, one copy per chunk,
//  would avoid it). Next steps, in expected order of gain: profile the warp-specialized
//  kernel (ncu: issue slots of the consumers, producer stalls); M = 16 through the
//  warp-specialized kernel with x in a separate, once-per-item buffer or a TMA tensor-map
//  copy (at M = 16 x is half of the copied bytes and the producer warps fall behind); more
//  independent work per consumer warp (two column groups); for bits 2 the non-swapped mma
//  orientation (the LDS.64 quad lookups land in operand order there, removing ~32 register
//  moves per stage); 16 consumer warps need <= 96 registers next to the producers (17-18
//  warps allocate as 20), 8 consumer warps (V1) have room.
//  Shared-memory budget (why bits 2 is no faster than bits 4): per warp and k-block at M = 1,
//  kTN = 4 (2048 weights) the consumers use ~56 shared-memory wavefronts (128 B each, one per
//  clock per SM): 32 table lookups (bits 4: LDS.32 pairs; bits 2: LDS.64 quads, 2 wavefronts
//  each, so the same count), 8 weight loads, 4 for x (ldmatrix), ~12 for the scales; the
//  cp.async writes add 4.5 (bits 2) to 8.5 (bits 4). That caps the decode at ~32-34 weights per
//  clock per SM: ~4.4 TB/s of bits-4 weights but only ~2.5 TB/s of bits-2 weights, below the
//  70 % target (2.9 TB/s) even at full use of the pipe (an estimate from instruction counts).
//  Bits 2 (and 3) therefore need part of the decode off the LSU: e.g. a register table (PRMT
//  of the 4 codebook halves by a 2-bit selector, ~2.5 ALU ops per weight with today's field
//  layout) for some of the tiles, or a field layout that makes the selector cheaper; the scale
//  path (~20 % of the wavefronts) is the next cut.
//  Nsight Compute, warp-specialized kernel (llama3-70b gate_up, M = 1, bits 4, 2-CTA clusters,
//  7 items per CTA; tools/kernel_profile.sh ncu): 1.5 instructions issued per cycle of 4, 0.5
//  eligible warps per scheduler, DRAM 40 % busy. 31 % of the warp samples waited in the
//  end-of-item barriers; item_reduce.cuh took that to 1.2 % (kernel 66.6 -> 57.6 us under ncu).
//  What remains is the consumers' k-block chain (LDS weights -> PRMT -> LDS table -> HMMA ->
//  FFMA; 70 % of the samples: fixed-latency dependency waits 28 %, the ring's full barrier and
//  other long-scoreboard waits 16 %, shared-memory results 11 %), with 8 consumer warps, i.e.
//  two per scheduler, to hide it. Bits 2 and bits 4 issue the same 22.2 M instructions there,
//  which is why their times agree. Next: more independent k-blocks in flight per warp (software
//  pipelining the weight loads of k-block u+1 under the decode of u), then the register table
//  for bits 2/3.
//  Session 4 (ncu, llama3-70b gate_up bits 4 M = 4 / bits 5 M = 1): each 16-byte cp.async of
//  the weights (LDGSTS.128) cost 13.6 shared-memory wavefronts (4 ideal) and queued behind the
//  consumers' loads in the MIO queue; the producers stalled on it, and the consumers waited on
//  the ring's full barrier for 8-14 % of their samples. Issuing all loads of a chunk's k-blocks
//  before the first decode (below) made the consumers faster but the kernel 5 % slower (full-
//  barrier waits 20-23 %); with one TMA tensor copy per chunk the pair takes 0.72-1.03x the time
//  of the session-3 kernel (median 0.93x; harness: llama3-70b down M = 1 bits 4 40.6 us = 72 %
//  of copy, gate_up 52.1 us = 56 %, bits 5 -25 %). Small shapes (qwen3, glm: 2-3 chunks per
//  CTA) stay at 8-13 us: SMs idle 27-40 % of the elapsed cycles (launch, tail), DRAM 11-19 %
//  busy; they need a shorter critical path (first copy latency, 64 KiB table build, cluster
//  reduction), e.g. a smaller table and more CTAs per SM. Then the scale bytes and the
//  activations went to TMA too (one producer thread, three tensor copies per chunk), which let
//  this kernel take M = 9..16 from the cp.async kernel: 0.55-0.95x the time there (llama3-70b
//  down bits 4 M = 16: 123.6 -> 71.7 us, 41 % of copy; gate_up 127.3 -> 80.7 us).
//  Session 5 (harness "timeline", cuda/timeline.cuh, median CTA, bits 4): the first chunk arrives
//  2.3-2.6 us after a CTA's entry (setup 0.6 us, copies issued at 1.0-1.3 us); an item's end
//  (leader's last chunk -> stored) takes 1.3-2.5 us; in k-split clusters the other ranks wait
//  4-6 us at exit for rank 0, which adds every rank's sum per item and so falls behind. The
//  launcher's k-split cost now charges that (1 + ks/2 chunks per item; see Launcher). Tried and
//  dropped: one mbarrier arrival per warp instead of per lane in item_reduce.cuh, and a
//  prefetch.tensormap at entry (together 1.006x, milestones within 0.1 us). Next, in expected
//  order of gain: a cheaper item end (rotate the reducing rank as the leader warp rotates; add
//  the warps' sums in parallel); the prologue under the previous kernel (programmatic
//  dependent launch); register tables for bits 2/3 (and bits 5's 2-tile limit); a tensor-core
//  path for M = 17..512.
//  Session 6 (benchmarks/results/kernel_rows_h200.md): at M = 9..16 a 64-column tiling (Config
//  V1) where the launcher's plan favours it (M = 16 median 0.90x the time, llama3-70b down bits
//  4 70.8 -> 53.1 us); M = 17..128 runs this kernel in blocks of 16 rows, the blocks of a column
//  group on neighbouring clusters (0.28-0.87x the cp.async kernel's time). Its time still grows
//  with M (each block decodes the weights again): at M >= 64 it is well behind the dense dot,
//  which needs one decode shared by several 16-row blocks. Tried and dropped: rotating a
//  cluster's reducing rank (no gain with 1-2 items per cluster; its epilogue code shifted the
//  main loop's schedule, M = 1 bits 4/5 up to 9 % slower).
//  Session 7 (benchmarks/results/kernel_rows_h200.md): the N-split tiling (Config V2) for
//  M = 17..128: 8 warps each own 32 columns of a 256-column group for every k-block, so a weight
//  is decoded once per 32 or 64 rows instead of once per 16; with bf16 activations the block
//  scale multiplies the decoded weights and the mma accumulates directly (ncu at M = 64: the
//  per-output FFMA were a quarter of the instructions, 1.6 issued per cycle of 4, no
//  eligible warp 53 % of the time). Harness "rows", bits 4: llama3-70b gate/up 206.7 ->
//  112.2 us at M = 64 (the dense dot: ~116), 404.7 -> 222.5 at M = 128; the launcher picks it
//  where its plan is shorter (most Llama shapes and M >= 48; the N = 2048 shapes keep 16 rows).
//  Session 8 (no kernel change; a profiled Llama-3-70B decode over two H200s, M = 1, bits 4,
//  benchmarks/results/README.md): gate/up 49.3 us for 54 chunks per SM, i.e. ~0.83 us per chunk
//  after ~4.5 us of start and end, where the copy rate allows 0.53: the steady state runs at
//  ~64 % of copy. q/k/v (N = 5120: 80 column groups for 132 SMs at k-split 1, 16 chunks each)
//  15.5 us and o (K = 4096: 8 chunks per CTA) 11.2 us are set by that imbalance and by the fixed
//  start/end. For 2x the bf16 decode at TP 2 all four need ~77 % of copy. Next, in that order:
//  balance the small products (stream-K-like k-ranges, or column groups other than 64 wide),
//  then the per-chunk consumer time (the steady state).
//  Session 9 (harness, benchmarks/results/kernel_{runs,ring}_h200.log): neither lever moved it.
//  Column runs (each cluster an equal share of 16-column tiles, the short last item copied and
//  computed tile by tile; branch experiment/column-runs): +-5 % of whole groups, because a chunk
//  of 2 of 4 tiles still took ~0.9 of a full chunk's time. A ring cap of 48 KiB (3 bits-4 chunks
//  in flight instead of 4): 0-2 % slower, so the copies' latency is not the limit either. What
//  is left per chunk and consumer warp at bits 4 is ~110 shared-memory wavefronts for ~290
//  instructions (SASS): 64 table lookups, 16 code loads, 8 for two ldmatrix.x4, ~24 for the
//  scales (2 LDS.U8 + STS.64 + 2 LDS.128 per k-block), with the TMA writes ~1000 per chunk against
//  ~1450 cycles, i.e. the MIO pipe ~70 % busy. Next: a scale-byte order that puts a lane's 8
//  scales of a k-block in one 8-byte word (one LDS.64, decoded in registers; a format change:
//  DESIGN.md section 1), then fewer lookups per weight for bits 2/3 (register tables).
//  Also learned: a 64-bit division anywhere in ItemWalk (a called subroutine) cost the hot loop
//  its uniform registers (the table base moved to a general register, +20 % instructions per
//  chunk, ~10 % time): keep the walk's arithmetic 32-bit, and check the SASS of the loop.
//  Session 10 (benchmarks/results/kernel_pdl_h200.md, launch_overlap_h200.log): launched as a
//  programmatic dependent launch (dependent_launch.cuh), back-to-back launches take 0.83x the
//  time at M <= 8 (0.9-4.3 us less each), but inside JAX's CUDA graphs a kbit kernel already
//  starts ~0.1 us after its predecessor, so JAX programs see no change. The kernel's own start
//  and end are what is left: qwen3-sized products take 7-10 us of device time in JAX
//  (matmul_h200_small_busy.md). Tried and reverted: issuing the first ring's copies before the
//  CTA's start barrier (median 1.01x the time; kernel_prologue_h200.md).
//  Session 11 (benchmarks/results/kernel_end_h200.md): k-split ranks send their item sums into
//  rank 0's shared memory by st.async (item_reduce.cuh); the cluster-scope release arrivals they
//  replace compiled to MEMBAR.GPU. K-split small shapes 0.86-0.95x the time, the rest +-2.5 %.
//  Timed and dropped: the scale bytes of a lane's k-block in one LDS.64 (a format change; 0.98x
//  on the Llama shapes, so the scale path is not what holds the steady state at ~64 % of copy),
//  and 12 consumer warps in V1 (median 1.05-1.10x the time; only bits 3 on the 70B shapes gained).
//  The tensor scale's global load moved from each item's store to the table build (it stalled
//  every item's end): M = 16 median 0.91x the time, M <= 4 0.98x (kernel_tensor_scale_h200.md).
//  Session 12 (benchmarks/results/kernel_stage_release_h200.md): a consumer warp released its ring
//  stage while the last k-block's loads of it were still in flight, and the N-split tiling with
//  5-8 CTA clusters read refilled stages (wrong sums in 2-75 % of the launches at bits 2 and 5).
//  The release now depends on the accumulators (see `release`): 1.008x the time at M <= 16,
//  1.017x at M = 17..128.
//  Session 13 (benchmarks/results/kernel_chunk_loop_h200.md): ncu found a V1 chunk taking each
//  consumer warp ~318 instructions for 192 of decode (addresses re-derived from the thread index
//  every chunk, accumulator moves, a loop tail behind the epilogue's code). With one chunk loop per
//  item and the lane's offsets computed once it takes 256: M <= 8 median 0.92x the time, M = 16
//  0.96x, M = 17..128 0.93x; a llama3-70b layer's gate/up (N = 57344) and down at bits 4, M = 1
//  at 78 % of copy.
//  The consumers now wait on the ring's full barrier in 15 % of the samples (DRAM 54 % busy).
//  Session 14 (benchmarks/results/kernel_ring_rows_h200.md): the ring's depth is a launch
//  parameter. Slots sized for the launch's rows leave room for more stages at M < 8 (bits 5: 6
//  instead of 4), taken where a CTA streams >= 16 chunks: bits 5 0.96-0.98x the time on the Llama
//  shapes, bits 2-4 within noise. Deepening every launch cost the small shapes (a deeper start
//  delays the first chunk), and a 96 KiB cap on the weights in flight bits 3. Measured and not
//  pursued: with all weights in L2, TP-2 q/k/v and o save only 1.4-2.1 us (start and end bound).
//  Session 15 (benchmarks/results/kernel_balanced_h200.md): chunk-balanced clusters (ItemWalk)
//  where the items do not divide among the clusters: llama3-70b gate/up (N = 28672) 0.89-0.94x
//  the time at bits 2-4 (K = 4 M = 1: 40.9 us, 72 % of copy), glm4.7 gate/up 0.88-0.96x; a 70B
//  layer's products at TP 2, K = 4: 92.5 -> 88.4 us. At 8-CTA clusters (120 CTAs) and where the
//  path was < 10 % shorter it was slower (1.02-1.09x), hence the launcher's limits.
//  Session 16 (benchmarks/results/kernel_start_h200.md): the harness's timings launch back to
//  back under PDL, where a kernel's start overlaps its predecessor; JAX's CUDA graphs do not
//  overlap them. There (harness timeline, KBIT_JAX_PDL=0) the first chunk arrived 4.4-4.9 us
//  after entry, ~2 us later than in session 5: the session-10 L2 prefetch of the whole first ring
//  queued ahead of the first copy. Only the first chunk is prefetched now, at entry: 2.2-2.5 us;
//  without PDL M <= 8 median 0.95x the time (0.80-1.02), a 70B layer at TP 2, K = 4 102.9 -> 92.6
//  us; under PDL median 0.98x (0.90-1.06).
//  Session 17 (benchmarks/results/kernel_start_ready_h200.md): a plain launch (the launcher no
//  longer sets the PDL attribute while the stream is captured into a CUDA graph, where it had no
//  effect) sets Params::inputs_ready, and the first chunk's copies and the table go out before the
//  setup barrier: first copy 0.5-0.6 us after entry (was 1.55-1.85), first chunk 1.6-1.8 us (was
//  2.2-2.5), but the exit only 0.1-0.5 us earlier (the ring's ramp, then the consumers' rate).
//  Without PDL M <= 8 median 0.99x the time. Learned again: the first cursor computed once at
//  kernel scope, or an if/else around the consumers' table build, grew the chunk loop from 256 to
//  320 SASS instructions (address arithmetic off the uniform datapath); tools/sass_loops.py
//  compares the loops with a reference revision on any machine with nvcc.
//  Session 18 (benchmarks/results/kernel_lsu_h200.md; no change): the chunk rate is held by the
//  SM's shared-memory path: 94 LSU instructions per consumer warp and chunk (64 of them table
//  lookups; ptxas spaces a warp's consecutive LDS 4 cycles apart), LSU pipe 59 % and wavefronts
//  61 % of peak on the 70B gate/up. Timed and slower: decoding some tiles from a register table
//  (2.6 ALU instructions per weight against 0.5 PRMT + 0.5 LDS), the next chunk's loads overlapped
//  with the current chunk's tail, 11 consumer warps. ptxas stops at 168 registers here, not 224
//  (3 of the CTA's 9 warps share scheduler 0), so a second register set per warp barely fits.
//  Session 28 (H100, benchmarks/results/nsplit_rows16_h100_s28.md): the N-split tiling (V2) in
//  blocks of 16 rows joins the launcher's comparison at M = 9..16 with bf16: on the wide gate/up
//  layers at bits 2 and 4 it takes 0.85-1.00x the time of the 16-row tilings in JAX, median 0.90
//  (Llama-3-8B gate/up, M = 16, bits 4: 22.3 -> 19.9 us); elsewhere, and in blocks of 8 rows at
//  M <= 8, it is no faster (bits 5, whose table leaves it one tile per warp, included).
//  Session 33 (H200, benchmarks/results/bits5_tables_h200_s33.md): V2 at bits 5 decodes from a
//  64 KiB table (Config::Path) and has two tiles per warp: Llama gate/up at M = 12..32 0.74-0.88x
//  the time; Llama-3-70B down at M = 17..32 1.10x (fewer, wider column groups).
//  Session 35 (H200, benchmarks/results/wgmma_pull_cost_h200_s35.md, section 7): the plan prices
//  the 64-row N-split block's item end at 2.5 chunks per cluster rank (was 0.5; 32 rows: 1.25).
//  Llama-3-70B q/k/v at TP 4, M = 56/64: 16-row blocks instead, 0.80-0.91x the time; with the
//  fused kernels at every M (KBIT_JAX_WGMMA_MIN_M=0) 67 of 280 picks change, 0.886x the time.
//  Session 42 (H100, benchmarks/results/nsplit_f16_s42.md): fp16 prices V2 per bits value,
//  refitted on the launcher's own plan costs (Config::nsplit_price_f16), and takes it at M =
//  9..16 too. (fp16 then took this launcher at every M up to 128; later that session the wgmma
//  kernel took fp16 from 33 rows, wgmma_f16_s42.md.)
//  Session 43 (H200, benchmarks/results/bits2_decode_h200_s43.md): bits 2's quads are looked
//  up from the nibbles of both mma rows (WeightPath<2>::decode), so they land in the mma's
//  operand order, and the consumers' lane constants stay in registers (pinned_to_lane): the
//  bits-2 loops 12-26 % shorter, harness "sel" at bits 2 0.966x the time at M <= 4, 0.926x at
//  M = 16 (Llama-3-70B down, M = 16: 50.7 -> 44.9 us); bits 3-5 within 1 %.
//  Session 44 (H200, benchmarks/results/item_end_h200_s44.md): a small launch's start and end.
//  The last item computes no next cursor, the owners' sum has no branch per group, and ItemWalk
//  divides by launch constants (fast_div.cuh, WalkDivs): the first copy goes out after ~170
//  instructions instead of ~345. Qwen3 gate/up at bits 4, M = 1 exits at 5.22 instead of 5.70 us
//  (timeline). Graph-timed harness: Qwen3/GLM-4.7 0.93x the time at M <= 16, Llama 0.97x.
//  Learned: grown past 128 bytes (even by padding), Params changed ptxas's chunk loops.
//  Tried and slower: 32-column groups at M <= 8 (the 16-row tilings' V0), 1.02-1.5x.
//  Session 45 (H200, benchmarks/results/item_end_h200_s45.md): at the CTA's last item each owner
//  warp sends, adds and stores its one float4 group (store_group) instead of every group's code
//  behind an owner test: a one-item CTA exits 0.09-0.36 us earlier; graph-timed harness 0.965-
//  0.98x the time on Qwen3/GLM-4.7, 0.99x on Llama (the M <= 8 V1 loops 5-9 instructions shorter).
//  Session 46 (H200, benchmarks/results/wide5_h200_s46.md): bits 5 at M = 9..16 has a 64-column
//  16-row tiling (Config V4): Qwen3 gate/up 0.80-0.85x the time, the Llama-3 layers where the
//  plan takes it 0.82-0.93x (bf16); in JAX (busy time) Llama-3-70B down at M = 16 80.6 -> 66.6 us.
//  At M <= 8 the same tiling was slower (the 64 KiB table's two-wavefront lookups).
//  Session 49 (H200, benchmarks/results/wide5_m1_h200_s49.md): V4 at M <= 8 from the 128 KiB
//  table, taken where it makes one round of whole items of V1's two rounds or cluster
//  (wide5_one_round): Qwen3 gate/up at bits 5, M = 1 and 4, 7.8 / 8.4 -> 6.9 / 7.0 us in JAX.
//  Session 50 (H200, benchmarks/results/wide5_m123_h200_s50.md, tiles_h200_s50.md): at M <= 3
//  V4 is planned against V1 (Llama-3-70B down, bits 5, M = 1: 55.1 -> 49.2 us in JAX, 75 % of
//  copy); the prices at M = 9..16 refitted on harness "tiles" (Config::chunk_cost): Qwen3 q at
//  M = 16, bits 2 and 4, 0.86x the time (V1 instead of V0).
//  * CTAs are persistent (one per SM, the lookup table is built once) and walk a list of work
//    items (column group x k-range x block of M x batch entry); their chunk stream runs across
//    item boundaries, so the ring never drains. K is split across the warps of a CTA and, when
//    the column groups alone would leave SMs idle or unbalanced, across the CTAs of a
//    thread-block cluster, reduced through distributed shared memory: no workspace, no atomics.
//
// ---- Work decomposition ----
//  chunk = kKCH consecutive k-blocks (32 k each) of one item's k-range; warp w handles k-block
//          w of every chunk for all kTN 16-column tiles of the item's column group.
//  stage = one chunk in the shared-memory ring; chunk q+kStages-1 is copied while q computes.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/dependent_launch.cuh"
#include "cuda/fast_div.cuh"
#include "cuda/item_reduce.cuh"
#include "cuda/tma.cuh"
#include "cuda/weight_path.cuh"
#include "glu.h"

namespace kbit::cuda::fused {

constexpr int kMaxSmem = 227 * 1024;  // H100/H200 per-block limit (opt-in)

// Tiling per (bits, MT = number of n8 tiles along M = ceil(rows / 8), 8 rows per tile, V).
// V = 0: 16 warps, one k-block per warp per chunk. V = 1 (MT <= 2): 8 warps, two k-blocks
// per warp per chunk: the same chunk with half the per-chunk bookkeeping per unit of work, but
// fewer warps to hide latency; the harness measures both. At MT = 2, V = 1 also doubles the
// column group (bits 2..4: 64 columns, as at MT = 1): each chunk's activations (16 rows, as many
// bytes as 64 columns of bits-4 weights) then serve twice the weights.
// V = 2 (warp-specialized kernel only): the warps split N instead of K. Each of the 8 warps
// owns kTN = 2 16-column tiles of a 256-column group for every k-block of the
// chunk, so a weight is decoded once for all 8 MT rows of the block (V0/V1 split K over the
// warps, and 16 rows per decode is what their 32 accumulators allow), and the warps never add
// partial sums. The price is the activations: every warp loads all rows of every k-block, 4 MT
// shared-memory wavefronts per k-block against ~11 per decoded tile, hence two tiles per warp
// (64 accumulators at MT = 8; bits 5 decodes from a 64 KiB table to leave room for them, see
// Config::Path). Blocks of 16 (M = 9..16), 32 or 64 rows (MT 2, 4, 8).
// V = 4 (kWideBits5; warp-specialized kernel, bits 5, MT <= 2): V1 with the 64-column group
// of bits 2..4, decoded from the table of bits 5's other tilings at its MT (Config::Path: 64 KiB
// at MT = 2, 128 KiB at MT = 1). The 32-column groups of V0/V1 at bits 5 make twice the items
// of the other bits (Qwen3 gate/up, K 2048, N 5120: 160 items of 4 chunks for 132 CTAs; V4
// makes 80), and a chunk's fixed work (barriers, activations, scale decode) serves half the
// weights. Harness
// "wide5" (H200, session 46, benchmarks/results/wide5_h200_s46.md; the ten shapes and a
// Llama-3-70B layer's products at TP 2 and 4 x M 9, 12, 16, graph-timed, every tiling forced):
// where the launcher now takes it, 0.80-0.85x the time on Qwen3 gate/up (M = 16: 11.1 -> 9.0 us)
// and 0.82-0.99x on the Llama-3 layers (fp16 on Llama-3-8B gate/up: 1.03-1.05x). At M <= 8
// (MT = 1) it was slower from the 64 KiB table on 44 of 51 cases (geometric mean 1.09x, up to
// 1.25x: two-wavefront lookups against V1's 128 KiB table).
// At MT = 1 it reads the 128 KiB table (session 49). Next to it the ring holds 3 stages of 20 KiB
// at M <= 3 and 2 at M = 4..8 (its reducer keeps one receive slot: WsSizes::recv_slots).
// Harness "wide5" at M = 1, 4, 8 (H200, the same 17 shapes, graph-timed, every tiling forced;
// benchmarks/results/wide5_m1_h200_s49.md): 0.88-0.89x V1's time on Qwen3 gate/up (M = 1: 8.03
// -> 7.07 us), 0.89-0.94x on Llama-3-70B o at TP 2 and 4 (N 8192), 0.90-0.97x on Llama-3-70B
// down at TP 4 (K 7168, N 8192). With 2 stages (M = 4..8) it is up to 1.10x slower on the layers
// that stream many chunks, and at any M up to 1.38x on those that need a cluster (sums of twice
// the columns). No price in the plan's unit separates those at M = 4..8 (the winners' break-even
// prices, 1.78-2.0, are also losers'), so the launcher takes it by a rule instead
// (launch_fused_bits: wide5_one_round). With 3 stages (M <= 3) the plans decide at this price
// (session 50, benchmarks/results/wide5_m123_h200_s50.md, M = 1, 2, 3): V4 on 10 of the 17
// shapes, every Llama-3 layer among them, 0.955-0.965x V1's time on the 17 (Llama-3-70B down at
// M = 1: 54.5 -> 49.4 us), within 0.4 % of the faster tiling on average.
constexpr int kWideBits5 = 4;
// Its chunk's time in V0 chunks of MT = 2 (Config::chunk_cost): fitted on the same run
// (benchmarks/results/wide5_s46_fit.py): 1.70-1.74 picks within 0.53 % (bf16) and 1.13 % (fp16)
// of the fastest tiling on (geometric) average, 9 % at worst (Qwen3 q at M = 16, where V1 stays
// and V4 was faster); without V4 the picks were 6.9 % and 7.3 % off. (1.65 takes GLM-4.7 gate/up,
// 1.09x; 1.76 gives Llama-3-70B gate/up at M = 9 back to V2, 1.09x.)
constexpr double kWideBits5Price = 1.72;
template <int BITS, int MT, int V = 0>
struct Config {
  static_assert(V != 2 || MT >= 2, "the N-split tiling serves blocks of 16, 32 or 64 rows");
  static_assert(V != kWideBits5 || (BITS == 5 && MT <= 2),
                "the wide bits-5 tiling serves bits 5 in blocks of 8 or 16 rows");
  static constexpr bool kWide5 = V == kWideBits5;
  // Warps per CTA (one CTA per SM). At MT >= 4 the activation chunk grows with the rows, so
  // 8 warps (smaller chunks) fit.
  static constexpr int kWarps = (MT >= 4 || V >= 1) ? 8 : 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKPW = V == 1 || kWide5 ? 2 : 1;  // k-blocks per warp per chunk (V0, V1)
  // The decode path. Bits 5 in the N-split tiling and in the 16-row tilings at MT = 2 reads the
  // 64 KiB table of 16 lane copies (two wavefronts per lookup; WeightPathBits5<16>):
  //  * N-split: it leaves room for two tiles per warp, as at the other bits; one had left the x
  //    loads (every row, every k-block) to a single tile (Llama-3-70B gate/up at M = 16: 0.72x
  //    the time, session 33).
  //  * MT = 2: it leaves the ring 4 stages at 16 rows instead of 2. Harness "rows" (H200, bits 5,
  //    ten shapes, session 36, benchmarks/results/fused_bits5_table_h200_s36.md): the 16-row
  //    tilings at M = 16..32 take 0.79-0.94x the time (geometric mean 0.86; Llama-3-70B down at
  //    M = 16: 94.8 -> 76.3 us), and where the launcher takes them, so does the product.
  //  * MT = 1 keeps the 128 KiB table, whose lookups take one wavefront: the 64 KiB one took
  //    1.04-1.27x the time on the Llama layers at M = 1..8 (0.97-1.08x on the small ones).
  // V0/V1 keep 32 columns at bits 5 (two tiles per warp): with 64 (V1's four tiles, as at bits
  // 2-4, from the 64 KiB table) the launcher's pick took 0.88-0.92x the time on three Llama
  // layers at M = 16 but 1.03-1.14x on the small ones, whose items became too few (same harness
  // run). Since session 46 the 64-column tiling is V4, which the launcher plans next to them.
  using Path = std::conditional_t<BITS == 5 && (V == 2 || MT == 2), WeightPathBits5<16>, WeightPath<BITS>>;
  // 16-column tiles per warp: one ldmatrix (x) and one or two LDS.128 (scales) per k-block
  // serve all kTN tiles; accumulators kTN * MT * 4 <= 32 (V2: 64). Bits 5 in the 16-row tilings
  // uses 2 to leave shared memory for the ring next to its table.
  static constexpr int kTN = V == 2   ? 2
                             : kWide5 ? 4
                             : MT == 1 || (MT == 2 && V == 1) ? (BITS == 5 ? 2 : 4)
                                                              : (MT == 2 ? 2 : 1);
  static constexpr int kCols = 16 * kTN * (V == 2 ? kWarps : 1);  // the column group
  // A box dimension of a tensor map holds at most 256 elements: a wider k-block row of the group
  // (V2; V4: 320 words) is copied as 16-column pieces (Launcher::launch's weight map).
  static constexpr bool kPieceMap = kCols * BITS > 256;
  // k-blocks per chunk. V2: 2 (8 KiB of bits-4 weights, 4 KiB of activations per 32 rows), so
  // that the ring keeps 4-7 stages next to the table and the cluster's partial sums.
  static constexpr int kKCH = V == 2 ? 2 : kWarps * kKPW;
  static constexpr int kKBW = V == 2 ? kKCH : kKPW;  // k-blocks each warp computes per chunk
  static constexpr int kAcc = kTN * MT * 4;
  // A chunk's time relative to a chunk of the V0 tiling of the same MT, for the launcher's
  // choice between the tilings at MT = 2 (M > 8 on the warp-specialized kernel, see
  // launch_fused_bits). There V1's chunk holds twice the columns at bits 2..4. Session 6 fitted
  // it at 1.4 V0 chunks (harness "sel", M = 16, H200). Session 50 refitted it on today's kernels
  // (harness "tiles", H200, 17 shapes x bits 2..5 x M 9, 12, 16, every tiling forced, with the
  // N-split tiling's price and its cluster's item end below;
  // benchmarks/results/tiles_h200_s50.md, tiles_price_fit.py): in one block of rows (M <= 16)
  // 1.0 at bits 2 and 4 (a V1 chunk, twice the weights, takes a V0 chunk's time), 1.4 kept at
  // bits 3 (no better price). At 1.4, V0 ran Qwen3 q and o at M = 9..16, V1 0.85-0.96x its time.
  // With more blocks (M = 17..128) 1.4 stays: there the 16-row tilings are weighed against the
  // N-split tiling in blocks of 32 and 64 rows, whose prices below were fitted against it (1.0
  // there too took Llama-3-70B gate/up at M = 32 from V2 to V1: 70 -> 88 us). Bits 5 keeps 32
  // columns.
  // V2 is compared with the 16-row tilings (MT = 2) at M > 16 in the same unit, a V0 chunk at
  // MT = 2: fitted on the harness's "rows" (H200, 10 shapes x bits 2, 4, 5 x M 17..128, bf16;
  // benchmarks/rows_fit.py), 1.0 at MT = 4 and 1.3 at MT = 8 (bits 5, then one tile per warp:
  // x 0.6): the faster tiling's time within 0.6 % on (geometric) average, 22 % at worst (a
  // small N = 2048 shape at M = 128). At MT = 4 since session 31: 0.9, with an item end of
  // 1 + 1.25 chunks per cluster rank (Launcher::plan), refitted on the H100's rows at M = 32
  // (benchmarks/results/last_block_h100_s31.md): Qwen3 gate/up at bits 2-4 now takes the 16-row
  // tiling, 0.86-0.93x the time at M = 24 and 32. fp16 activations take V2's slower scale path
  // (see mma_k_block_scaled_weights) and prices of their own (nsplit_price_f16, below). At MT = 2
  // (M = 9..16) 0.6 (bits 3: 0.8), fitted on the harness's "rows" at M = 1..16 (H100, 10 shapes x
  // bits 2..5, benchmarks/results/nsplit_rows16_h100_s28.md): it takes V2 on the wide gate/up
  // layers at bits 2 and 4 (0.88-0.98x the time of the 16-row tilings) and nowhere else; bits
  // 3's decode is slower there (Llama-3-70B gate/up 1.10x). (Blocks of 8 rows were no faster anywhere:
  // 0.99-2.0x.) Bits 5, with two tiles per warp since session 33 (Config::Path), takes the
  // prices of the other bits at MT = 4 and 8 and bits 3's 0.8 at MT = 2: in an offline replica
  // of the plan scored on the H200's rows at M = 9..32 (benchmarks/results/
  // nsplit_bits5_s33_fit.py, bits5_tables_h200_s33.md) 0.9 at MT = 4 picks the faster tiling in
  // all 30 cases, 0.8 at MT = 2 is within 1.7 % on average (0.6 would take V2 on the Llama down
  // layers at M = 9: 1.35-1.38x the time).
  // fp16 (session 42, H100, harness "rows" with KBIT_HARNESS_F16=1 and the launcher's own plan
  // costs, MatmulTuning::planned_*: 13 layers x bits 2-5 x M 9..128, 572 cases; benchmarks/
  // results/nsplit_f16_s42.md) prices V2 per bits value, fitted by nsplit_price_fit.py: at MT = 2
  // (now taken at M = 9..16 too) 0.61 at bits 2 and 4, 0.95 at bits 5 (bits 3 as bf16: it never
  // won there); at MT = 8 2.1 at bits 2, 1.7 at bits 3 and 4, 1.6 at bits 5. MT = 4 keeps 0.9:
  // no price there separates Qwen3 and GLM-4.7 gate/up (V2 faster by up to 1.13x) from the
  // Llama-3-70B down layers (slower by up to 1.16x). The fit's 1.05 (harness: those down layers
  // 0.86-0.97x the time, GLM-4.7 gate/up 1.08-1.14x) would give up the small layers, which are
  // the ones nearest the dense dot's time, for the large. The fp16 products then take the tiling
  // within 0.49 % of the faster one on (geometric) average, 13 % at worst (Llama-3-70B down, M =
  // 24); the prices before (no V2 at M <= 16, 2.1 at MT = 8) were 1.43 % and 29 % off (GLM-4.7
  // gate/up, bits 5, M = 64). Harness against them (both rounds' faster time): 0.931x where the
  // pick changed at M = 9..16 (27 of 156 cases), 0.919x at M = 33..128 (43 of 260; 0.78x at
  // best, 1.064x at worst: Llama-3-70B gate/up, bits 4, M = 96); the unchanged picks read 0.99x.
  // At MT = 2, bits 2 and 4, session 50 refitted 0.4 (bf16 and fp16) together with V1's price
  // (1.4 -> 1.0) and V2's cluster item end (nsplit_rank_end): what matters is V2's price against
  // V1's, 0.4 against 0.43 (0.6 / 1.4) before, and 0.375-0.45 all beat the old prices there.
  static constexpr double nsplit_price_bf16() {
    if constexpr (MT == 2) return BITS == 3 || BITS == 5 ? 0.8 : 0.4;  // (bits 2, 4: session 50)
    if constexpr (MT == 4) return 0.9;
    return 1.3;
  }
  static constexpr double nsplit_price_f16() {
    if constexpr (MT == 2) return BITS == 3 ? 0.8 : BITS == 5 ? 0.95 : 0.4;
    if constexpr (MT == 4) return 0.9;
    return BITS == 2 ? 2.1 : BITS == 5 ? 1.6 : 1.7;
  }
  static constexpr double chunk_cost(bool bf16, bool one_block_of_rows) {
    if constexpr (V == 2) return bf16 ? nsplit_price_bf16() : nsplit_price_f16();
    if constexpr (kWide5) return kWideBits5Price;
    if constexpr (MT == 2 && V == 1 && BITS != 5) return BITS == 3 || !one_block_of_rows ? 1.4 : 1.0;
    return 1.0;
  }
  static constexpr int kSlabBytes = kCols * BITS * 4;  // one k-block of the column group
  static constexpr int kWChunk = kKCH * kSlabBytes;
  static constexpr int kXRowBytes = kKCH * 64 + 16;  // +16 B: ldmatrix rows in distinct banks
  static constexpr int kXRowStep = kThreads / (kKCH * 4);  // rows of x one pass of threads covers
  static constexpr int kScaleItems = kKCH * kTN * 4;  // 4 columns of one k-block each
  static constexpr int kRawChunk = kScaleItems * 16;  // lo word, hi word, shift, valid
  static constexpr int kSfKbBytes = kCols * 4;
  static constexpr int kSfChunk = kKCH * kSfKbBytes;
  static constexpr int kRedBytes = (kWarps / 2) * kAcc * 32 * 4;  // tree reduction, level 1
  static constexpr int kPartBytes = kAcc * 32 * 4;                 // CTA partial for the cluster
  static_assert(kScaleItems <= kThreads, "one scale item per thread");
  // (the cp.async kernel's staging of x; V2 runs only on the warp-specialized kernel, whose
  // activations come by tensor copy)
  static_assert(V == 2 || (kThreads % (kKCH * 4) == 0 && (8 * MT) % kXRowStep == 0), "x staging pattern");

  static constexpr size_t fixed_bytes() {
    return size_t(Path::kLutBytes) + 2 * kSfChunk + kRedBytes + kPartBytes;
  }
  static constexpr size_t slot_bytes(int x_rows) {
    return size_t(kWChunk) + size_t(x_rows) * kXRowBytes + kRawChunk;
  }
  // Ring depth: as deep as shared memory allows (sized for the largest row count of this MT)
  // up to 64 KiB of weights in flight, at least 2.
  static constexpr int pick_stages() {
    for (int d = 8; d > 2; --d)
      if (fixed_bytes() + d * slot_bytes(8 * MT) <= size_t(kMaxSmem) && (d - 1) * kWChunk <= 64 * 1024)
        return d;
    return 2;
  }
  static constexpr int kStages = pick_stages();
  static_assert(fixed_bytes() + 2 * slot_bytes(8 * MT) <= size_t(kMaxSmem), "shared memory budget");
  static constexpr size_t smem_bytes(int x_rows) { return fixed_bytes() + kStages * slot_bytes(x_rows); }
};

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
  int balanced;      // 1: chunk-balanced clusters (ItemWalk), warp-specialized kernel, V0/V1 only
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
// parameter of their own: with them, Params grew past 128 bytes, and that alone changed ptxas's
// chunk loops (16-row tilings: 2-3 instructions and an LDC more, 3-8 % slower on the wide layers
// at M = 16; harness, H200, session 44).
struct WalkDivs {
  FastDiv ks, clusters, m_blocks, col_groups, nch_item;
};

// cp.async with a source size: copies `src_bytes` (0..4) and zero-fills the rest.
__device__ __forceinline__ void cp_async4_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v));
}
__device__ __forceinline__ float lds32f(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

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
  int64_t m0;      // first row
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
// item's boundary divides, in 32 bits).
template <int KCH, int COLS, int ROWS>
struct ItemWalk {
  const Params& p;
  const WalkDivs& dv;
  int ks, rank, cluster_id, n_clusters, kbA, kbEnd, nch, q;
  int nch_item, T, g0, g1;  // chunk-balanced clusters: chunks per item, per cluster, this rank's range
  int64_t k, chunk_cells;

  __device__ ItemWalk(const Params& prm, const WalkDivs& divs) : p(prm), dv(divs) {
    ks = p.k_split;
    cluster_id = dv.ks.div(int(blockIdx.x));
    rank = dv.ks.mod(int(blockIdx.x), cluster_id);
    n_clusters = dv.clusters.d;
    const int my_items = cluster_id < p.items ? dv.clusters.div(p.items - cluster_id + n_clusters - 1) : 0;
    nch_item = dv.nch_item.d;  // (p.KB + KCH - 1) / KCH
    if (p.balanced) {
      kbA = 0;
      kbEnd = p.KB;
      nch = nch_item;
      T = my_items * nch_item;  // (the launcher keeps T * ks below 2^31)
      g0 = dv.ks.div(rank * T);
      g1 = dv.ks.div((rank + 1) * T);
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
  __device__ int rank_of(int g) const { return ((g + 1) * ks + T - 1) / T - 1; }
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

// Scale one item's sums by the tensor scale ts, round to T and store them; v[e] of lane (g, t)
// holds row m0 + 8 mt + 2t + (e & 1) of column col0 + 16 j + g + 8 ((e >> 1) & 1), with
// e = 4 (j MT + mt) + (e & 3), as the mma accumulator layout of the swapped product puts it.
// Called by all 32 lanes of a warp (at a CTA's last item each warp stores one float4 group of
// the sums instead: store_group).
//
// With p.glu, column n + 1 of an even column n sits in lane (g + 1, t), i.e. lane ^ 4 (col0 and
// 16 j are even), so one shuffle per sum pairs gate and up, and the even lane stores act(gate) *
// up at column n / 2 of the N / 2. This runs on the warp that ends the item, which holds its ring
// stages meanwhile (harness timeline, Llama-3-70B gate/up at TP 2, K = 4, M = 1: the first item's
// end 1.44 us without a GLU), so it is kept short:
//  * the sums of one row pair (mt, r) form a group, skipped as a whole where both of its rows lie
//    past M (warp-uniform: lane t = 0 holds the lowest): at M = 1 that is 3 of 4 sums;
//  * a group's 2 TN chains (shuffle, MUFU.EX2, MUFU.RCP: ~150 cycles) run side by side, all lanes
//    alike (odd lanes' results are dropped), and the stores follow. Written as one loop with the
//    predicated store inside, ptxas ran the chains one after another behind a branch per store:
//    43.2 -> 47.4 us for that gate/up.
// (KBIT_SKIP_STORE, KBIT_SKIP_EPILOGUE below: experiment builds of the kernel harness only,
// EXTRA_NVCC="-DKBIT_SKIP_..." tools/kernel_profile.sh rows|sweep. The warp-specialized kernel
// then skips each item's stores, or its whole end (the warps' and ranks' sums and the stores);
// the results are wrong, and the time saved is what that part costs:
// benchmarks/results/item_end_h100_s29.md. CMake never sets them.)
template <int MT, class T, int NACC>
__device__ __forceinline__ void store_item(const Params& p, const Cursor& cur, int g, int t, const float (&v)[NACC],
                                           float ts) {
  if (p.glu != kGluNone) {
    constexpr int TN = NACC / (4 * MT), kGroup = 2 * TN;
    const int half_n = p.N / 2;
    const GluLogit logit(p.glu);
    T* yg = static_cast<T*>(p.y) + int64_t(cur.b) * p.M * half_n;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (cur.m0 + 8 * mt + r >= p.M) continue;  // no lane holds a row of this group
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
          if ((g & 1) == 0 && m < p.M && n < p.N) yg[m * half_n + (n >> 1)] = from_f32<T>(gate[i]);
        }
      }
    return;
  }
  T* yg = static_cast<T*>(p.y) + int64_t(cur.b) * p.M * p.N;
#pragma unroll
  for (int e = 0; e < NACC; ++e) {
    const int c = e & 3, mt = (e >> 2) % MT, j = (e >> 2) / MT;
    const int64_t m = cur.m0 + 8 * mt + 2 * t + (c & 1);
    const int n = cur.col0 + 16 * j + g + 8 * (c >> 1);
    if (m < p.M && n < p.N) yg[m * p.N + n] = from_f32<T>(v[e] * ts);
  }
}

// store_item for float4 group e4 alone (v = the sums v[4 e4 .. 4 e4 + 3] of store_item's layout):
// at a CTA's last item each owner warp stores its one group (ItemReducer::finish_last_shared).
// Through store_item with a mask of groups, every lane computed all NACC sums' addresses and
// tests, behind the runtime owner index, for the 4 it stores (harness timeline, H200, session 44:
// 0.27 us of a one-item CTA's ~1 us end). With p.glu a gate/up pair (columns n, n + 1, n even)
// lies in lanes l and l ^ 4 of the same group, so each group pairs its own sums.
template <int MT, class T>
__device__ __forceinline__ void store_group(const Params& p, const Cursor& cur, int g, int t, int e4, float4 v,
                                            float ts) {
  const int mt = e4 % MT, j = e4 / MT;  // (MT a power of two: a mask and a shift)
  if (cur.m0 + 8 * mt >= p.M) return;   // no lane holds a row of this group (warp-uniform)
  const int m = cur.m0 + 8 * mt + 2 * t;
  const int n = cur.col0 + 16 * j + g;
  const float c[4] = {v.x * ts, v.y * ts, v.z * ts, v.w * ts};  // c = 2 h + r: row m + r, column n + 8 h
  if (p.glu != kGluNone) {
    const int half_n = p.N / 2;
    const GluLogit logit(p.glu);
    T* yg = static_cast<T*>(p.y) + int64_t(cur.b) * p.M * half_n;
    float gated[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) gated[i] = glu_apply_fast(logit, c[i], __shfl_xor_sync(0xffffffffu, c[i], 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int mi = m + (i & 1), ni = n + 8 * (i >> 1);
      if ((g & 1) == 0 && mi < p.M && ni < p.N) yg[int64_t(mi) * half_n + (ni >> 1)] = from_f32<T>(gated[i]);
    }
    return;
  }
  T* yg = static_cast<T*>(p.y) + int64_t(cur.b) * p.M * p.N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int mi = m + (i & 1), ni = n + 8 * (i >> 1);
    if (mi < p.M && ni < p.N) yg[int64_t(mi) * p.N + ni] = from_f32<T>(c[i]);
  }
}

// What ItemReducer / WarpClusterReducer call to store an item's sums: all of the warp's
// (operator()) or, at a CTA's last item, one float4 group of them (group()).
template <int MT, class T, int NACC>
struct ItemStore {
  const Params& p;
  const Cursor& cur;
  int g, t;
  float ts;
  __device__ void operator()(const float (&v)[NACC]) const { store_item<MT, T>(p, cur, g, t, v, ts); }
  __device__ void group(int e4, float4 v) const { store_group<MT, T>(p, cur, g, t, e4, v, ts); }
};

// ---- the per-k-block steps that both kernels share ----

// The B operand (activations) of one k-block for MT n8 tiles. `addr(row, s)` is the shared
// address of the 16 bytes of activation row `row` in the 8-wide k sub-block s of the k-block
// (each kernel stages x in its own layout); rows past `rows` repeat the last row (their results
// are never stored). Lane l supplies row l % 8 of matrix l / 8, i.e. of sub-block l / 8.
template <int MT, class RowAddr>
__device__ __forceinline__ void load_x_fragments(uint32_t (&xb)[MT][4], int rows, int lane, RowAddr addr) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(xb[mt], addr(min(8 * mt + (lane & 7), rows - 1), lane >> 3));
}

// The lane's 2 TN decoded block scales of one k-block (rows g and g + 8 of each tile).
template <int TN>
__device__ __forceinline__ void load_scales(float (&sc)[2 * TN], uint32_t addr) {
  if constexpr (TN >= 2) {
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) {
      const float4 v = lds128f(addr + 16 * i);
      sc[4 * i] = v.x; sc[4 * i + 1] = v.y; sc[4 * i + 2] = v.z; sc[4 * i + 3] = v.w;
    }
  } else {
    const float2 v = lds64f(addr);
    sc[0] = v.x; sc[1] = v.y;
  }
}

// The lane's staged codes of the TN tiles of one k-block (`slab` = the k-block's first cell).
template <class WP, int TN>
__device__ __forceinline__ void load_codes(typename WP::Raw (&raw)[TN], uint32_t slab, uint32_t o0, uint32_t o1) {
#pragma unroll
  for (int j = 0; j < TN; ++j) WP::load(raw[j], slab, o0, o1, j);
}

// Decode the TN tiles of one k-block and accumulate scale * (W_tile^T x) into acc: two mma
// into a zero accumulator, then one FFMA per output.
template <class WP, class Act, int MT, int TN>
__device__ __forceinline__ void mma_k_block(float (&acc)[TN * MT * 4], const typename WP::Raw (&raw)[TN],
                                            uint32_t lut, const typename WP::Lane& L, const uint32_t (&xb)[MT][4],
                                            const float (&sc)[2 * TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    uint32_t a[2][4];
    WP::decode(raw[j], lut, L, a);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float zero[4] = {0.f, 0.f, 0.f, 0.f};
      float d[4];
      mma_16816<Act>(d, a[0], xb[mt][0], xb[mt][1], zero);  // k 0..15 of the block
      mma_16816<Act>(d, a[1], xb[mt][2], xb[mt][3], d);     // k 16..31
      float* c = acc + (j * MT + mt) * 4;
      c[0] = fmaf(d[0], sc[2 * j], c[0]);  // row g   = column 16 j + g
      c[1] = fmaf(d[1], sc[2 * j], c[1]);
      c[2] = fmaf(d[2], sc[2 * j + 1], c[2]);  // row g+8 = column 16 j + g + 8
      c[3] = fmaf(d[3], sc[2 * j + 1], c[3]);
    }
  }
}

// The N-split tiling (Config V2) with bf16 activations: the E4M4 block scale (exact in bf16)
// multiplies the decoded weights, rounded once to bf16, and the mma accumulates into acc
// directly. At MT = 8 that replaces 64 FFMA per warp and k-block (a quarter of the
// instructions, Nsight Compute) and the mma into zero by 16 HMUL2. fp16 keeps mma_k_block:
// scaled weights could be fp16 subnormals there. The tests' derived error bound counts that
// second rounding of each weight to the activation dtype (the codebook entry's is the first).
template <class WP, int MT, int TN>
__device__ __forceinline__ void mma_k_block_scaled_weights(float (&acc)[TN * MT * 4],
                                                           const typename WP::Raw (&raw)[TN], uint32_t lut,
                                                           const typename WP::Lane& L, const uint32_t (&xb)[MT][4],
                                                           const float (&sc)[2 * TN]) {
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    uint32_t a[2][4];
    decode_for_scaling<WP>(raw[j], lut, L, a);
    scale_fragments(a, sc[2 * j], sc[2 * j + 1]);  // columns 16 j + g and 16 j + g + 8
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float(&c)[4] = *reinterpret_cast<float(*)[4]>(acc + (j * MT + mt) * 4);
      mma_16816<ActBF16>(c, a[0], xb[mt][0], xb[mt][1], c);  // k 0..15 of the block
      mma_16816<ActBF16>(c, a[1], xb[mt][2], xb[mt][3], c);  // k 16..31
    }
  }
}

template <int BITS, class Act, int MT, int V>
__global__ void __launch_bounds__(Config<BITS, MT, V>::kThreads, 1)
    kbit_matmul_fused_kernel(const Params p, const WalkDivs dv) {
  static_assert(V != 2 && V != kWideBits5, "a tiling of the warp-specialized kernel only");
  using Cfg = Config<BITS, MT, V>;
  using WP = typename Cfg::Path;
  using T = typename Act::T;
  constexpr int NW = Cfg::kWarps, NT = Cfg::kThreads, TN = Cfg::kTN, D = Cfg::kStages;
  constexpr int KCH = Cfg::kKCH, XRB = Cfg::kXRowBytes, NACC = Cfg::kAcc, COLS = Cfg::kCols;
  constexpr int SLAB = Cfg::kSlabBytes, SFB = Cfg::kSfKbBytes, KPW = Cfg::kKPW;

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const ItemWalk<KCH, COLS, 8 * MT> walk(p, dv);
  const int KS = walk.ks, rank = walk.rank, kbA = walk.kbA, kbEnd = walk.kbEnd, nch = walk.nch, Q = walk.q;
  const int64_t K = walk.k;

  // ---- shared memory: [LUT][reduction][partial][sf x 2][ring: D x (weights | x | raw scales)]
  const uint32_t s_lut = smem_u32(smem);
  const uint32_t s_red = s_lut + WP::kLutBytes;
  const uint32_t s_part = s_red + Cfg::kRedBytes;
  const uint32_t s_sf = s_part + Cfg::kPartBytes;
  const uint32_t s_ring = s_sf + 2 * Cfg::kSfChunk;
  const uint32_t x_slot = uint32_t(p.x_rows) * XRB;
  const uint32_t slot_bytes = Cfg::kWChunk + x_slot + Cfg::kRawChunk;
  float* part_ptr = reinterpret_cast<float*>(smem + WP::kLutBytes + Cfg::kRedBytes);

  // ---- issue the copies of one chunk into ring slot `slot` (one commit group per chunk).
  // Every thread's pieces are fixed by its index: their offsets are computed once here, so a
  // chunk costs a few uniform 64-bit products and one add + one cp.async per piece.
  const int64_t row_bytes = int64_t(p.N) * BITS * 4;  // one k-block row of the weight
  constexpr int kPPK = SLAB / 16;                      // 16-byte pieces per k-block slab
  constexpr int kWPieces = KCH * kPPK;
  constexpr int kWPer = (kWPieces + NT - 1) / NT;
  int64_t w_goff[kWPer];
  uint32_t w_soff[kWPer];
  int w_kbl[kWPer];
#pragma unroll
  for (int r = 0; r < kWPer; ++r) {
    const int i = tid + r * NT;
    w_kbl[r] = i < kWPieces ? i / kPPK : (1 << 29);  // no piece: fails the k-range test
    w_soff[r] = uint32_t((i / kPPK) * SLAB + (i % kPPK) * 16);
    w_goff[r] = int64_t(i / kPPK) * row_bytes + (i % kPPK) * 16;
  }
  constexpr int XRS = Cfg::kXRowStep;
  const int x_row0 = tid / (KCH * 4), x_kbl = (tid / 4) % KCH, x_piece = tid & 3;
  const int64_t x_goff = (int64_t(x_row0) * K + x_kbl * 32 + x_piece * 8) * int64_t(sizeof(T));
  const uint32_t x_soff = uint32_t(x_row0) * XRB + x_kbl * 64 + x_piece * 16;
  // Scale items live on the last kScaleItems threads (the first ones copy the activations).
  const int s_item = tid - (NT - Cfg::kScaleItems);  // < 0: none
  const int s_kbl = max(s_item, 0) / (TN * 4), s_cq = max(s_item, 0) % (TN * 4);
  const int64_t s_goff = int64_t(s_kbl) * p.N + 4 * s_cq;

  // Four scale bytes at `off` into shared memory, zeros past the end of the buffer. A partial
  // cp.async (src-size < 4) still reads all four bytes on the H200 (compute-sanitizer flags
  // it), so the last, partial word is gathered byte by byte with ordinary loads; like the
  // bookkeeping words stored next to it, it is visible after the chunk's barrier.
  auto copy_scale_word = [&](uint32_t dst, int64_t off) {
    const int64_t avail = p.scale_bytes - off;
    if (avail >= 4) {
      cp_async4_zfill(dst, p.scales + off, 4u);
      return;
    }
    uint32_t v = 0;
    for (int64_t i = 0; i < avail; ++i) v |= uint32_t(p.scales[off + i]) << (8 * i);
    sts32(dst, v);
  };

  auto issue = [&](const Cursor& cur, int slot) {
    const uint32_t base = s_ring + slot * slot_bytes;
    const int kb0 = kbA + cur.c * KCH;
    const int64_t cell0 = cur.cell0;  // first cell of the chunk
    const uint8_t* wsrc = reinterpret_cast<const uint8_t*>(p.planes) + cell0 * (BITS * 4);
    const bool full_cols = cur.col0 + COLS <= p.N;
    if (p.vec16 && full_cols) {
#pragma unroll
      for (int r = 0; r < kWPer; ++r)
        if (kb0 + w_kbl[r] < kbEnd) cp_async16(base + w_soff[r], wsrc + w_goff[r]);
    } else {  // last column group (zero-fill past N) or rows not 16-byte aligned: 4-byte copies
      const uint32_t valid = uint32_t(min(COLS, p.N - cur.col0)) * BITS * 4;
      for (int i = tid; i < KCH * SLAB / 4; i += NT) {
        const int kbl = i / (SLAB / 4), off = (i % (SLAB / 4)) * 4;
        if (kb0 + kbl < kbEnd)
          cp_async4_zfill(base + kbl * SLAB + off, wsrc + kbl * row_bytes + (uint32_t(off) < valid ? off : 0),
                          uint32_t(off) < valid ? 4u : 0u);
      }
    }
    // activations: 16-byte pieces (8 elements) of rows x_row0 + 8 i, k-block x_kbl
    if (kb0 + x_kbl < kbEnd) {
      const uint8_t* xsrc = reinterpret_cast<const uint8_t*>(p.x) + cur.x0 * int64_t(sizeof(T)) + x_goff;
      const uint32_t xdst = base + Cfg::kWChunk + x_soff;
#pragma unroll
      for (int i = 0; i < 8 * MT / XRS; ++i)
        if (x_row0 + XRS * i < cur.rows)
          cp_async16(xdst + i * XRS * XRB, xsrc + int64_t(i) * XRS * K * int64_t(sizeof(T)));
    }
    // scale bytes: thread tid < kScaleItems copies the aligned 8-byte window holding the 4 bytes
    // of columns 4cq..4cq+3 of k-block kbl, and notes the shift and validity for its decode.
    if (s_item >= 0) {
      const uint32_t raw = base + Cfg::kWChunk + x_slot + s_item * 16;
      if (kb0 + s_kbl < kbEnd) {
        const int64_t idx = cell0 + s_goff;
        const int64_t w = idx & ~int64_t(3);
        if (cell0 + int64_t(KCH) * p.N + 16 * TN + 8 <= p.scale_bytes) {  // uniform fast path
          cp_async4_zfill(raw, p.scales + w, 4u);
          cp_async4_zfill(raw + 4, p.scales + w + 4, 4u);
        } else {  // near the end of the buffer: never touch a byte past it
          copy_scale_word(raw, w);
          copy_scale_word(raw + 4, w + 4);
        }
        sts32(raw + 8, uint32_t(idx & 3) * 8);
        sts32(raw + 12, 1u);
      } else {
        sts32(raw + 12, 0u);
      }
    }
  };

  // ---- decode this thread's scale item of a landed chunk into floats ----
  auto decode_scales = [&](int slot, int sfbuf) {
    if (s_item < 0) return;
    const uint32_t raw = s_ring + slot * slot_bytes + Cfg::kWChunk + x_slot + s_item * 16;
    const uint4 r = lds128(raw);
    if (!r.w) return;
    const uint32_t v = __funnelshift_r(r.x, r.y, r.z);
    const int cq = s_cq;
    const uint32_t dst = s_sf + sfbuf * Cfg::kSfChunk + s_kbl * SFB;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = 4 * (cq & 3) + i;  // column within the tile = its mma row
      const uint32_t byte19 = i < 3 ? (v << (19 - 8 * i)) & 0x07f80000u : (v >> 5) & 0x07f80000u;
      sts32f(dst + (((rr & 7) * TN + (cq >> 2)) * 2 + (rr >> 3)) * 4, decode_e4m4_fast(byte19));
    }
  };

  // ---- per-thread constants of the compute path ----
  const typename WP::Lane L = WP::lane_consts(lane);
  const uint32_t o0 = WP::offset0(g, t), o1 = WP::offset1(g, t);
  const uint32_t sf_lane_off = uint32_t(g) * (2 * TN * 4);

  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;

  auto compute = [&](const Cursor& cur, int slot, int sfbuf) {
    const uint32_t base = s_ring + slot * slot_bytes;
#pragma unroll
    for (int u = 0; u < KPW; ++u) {
      const int kbl = warp * KPW + u;
      if (kbA + cur.c * KCH + kbl >= kbEnd) return;  // warp-uniform
      const uint32_t slab = base + kbl * SLAB;
      uint32_t xb[MT][4];
      const uint32_t x_kb = base + Cfg::kWChunk + kbl * 64;  // rows XRB apart
      load_x_fragments<MT>(xb, cur.rows, lane, [&](int row, int s) { return x_kb + row * XRB + s * 16; });
      float sc[2 * TN];
      load_scales<TN>(sc, s_sf + sfbuf * Cfg::kSfChunk + kbl * SFB + sf_lane_off);
      typename WP::Raw raw[TN];
      load_codes<WP, TN>(raw, slab, o0, o1);
      mma_k_block<WP, Act, MT, TN>(acc, raw, s_lut, L, xb, sc);
    }
  };

  // ---- end of an item: reduce the warps' partial sums (tree, fixed order), then the
  // cluster's (rank 0 adds the ranks' partials in rank order), scale, round, store. The CTA
  // meets at a barrier every chunk anyway, so the tree's barriers cost little here; the
  // warp-specialized kernel, whose warps drift, uses item_reduce.cuh instead ----
  auto epilogue = [&](const Cursor& cur) {
#pragma unroll
    for (int half = NW / 2; half >= 1; half >>= 1) {
      if (warp >= half && warp < 2 * half)
#pragma unroll
        for (int e = 0; e < NACC; ++e) sts32f(s_red + (((warp - half) * NACC + e) * 32 + lane) * 4, acc[e]);
      __syncthreads();
      if (warp < half)
#pragma unroll
        for (int e = 0; e < NACC; ++e) acc[e] += lds32f(s_red + ((warp * NACC + e) * 32 + lane) * 4);
      __syncthreads();
    }
    auto store = [&](const float (&v)[NACC]) { store_item<MT, T>(p, cur, g, t, v, p.tensor_scale[cur.b]); };
    if (KS == 1) {
      if (warp == 0) store(acc);
    } else {
      namespace cg = cooperative_groups;
      cg::cluster_group cluster = cg::this_cluster();
      if (warp == 0)
#pragma unroll
        for (int e = 0; e < NACC; ++e) sts32f(s_part + (e * 32 + lane) * 4, acc[e]);
      cluster.sync();  // every rank's partial is in its shared memory
      if (rank == 0 && warp == 0) {
        float v[NACC];
#pragma unroll
        for (int e = 0; e < NACC; ++e) v[e] = 0.f;
        for (int r = 0; r < KS; ++r) {
          const float* rp = cluster.map_shared_rank(part_ptr, r);
#pragma unroll
          for (int e = 0; e < NACC; ++e) v[e] += rp[e * 32 + lane];
        }
        store(v);
      }
      cluster.sync();  // partials may be overwritten only after rank 0 has read them
    }
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[e] = 0.f;
  };

  // ---- prologue: copies of the first D-1 chunks, the table while they fly ----
  Cursor ic = walk.first();  // next chunk to issue
#pragma unroll
  for (int s = 0; s < D - 1; ++s) {
    if (s < Q) { issue(ic, s); walk.advance(ic); }
    cp_async_commit();
  }
  // The table holds one batch entry's codebook; a CTA whose items span batch entries rebuilds
  // it where b changes (at an item boundary, see the main loop).
  auto build_lut = [&](int b) { build_table<WP, Act>(s_lut, p.codebook + int64_t(b) * (1 << BITS), tid, NT); };
  Cursor cc = walk.first();  // chunk being computed
  int lut_b = -1;
  if (Q > 0) {
    build_lut(cc.b);
    lut_b = cc.b;
  }
  cp_async_wait<D - 2>();
  if (Q > 0) decode_scales(0, 0);
  __syncthreads();

  // ---- main loop over this CTA's chunks ----
  for (int q = 0; q < Q; ++q) {
    if (q + D - 1 < Q) { issue(ic, (q + D - 1) % D); walk.advance(ic); }
    cp_async_commit();
    compute(cc, q % D, q & 1);
    const bool last = cc.c == nch - 1;
    if (last) epilogue(cc);
    walk.advance(cc);
    cp_async_wait<D - 2>();
    if (q + 1 < Q) {
      decode_scales((q + 1) % D, (q + 1) & 1);
      if (last && cc.b != lut_b) {  // next item belongs to another batch entry: new codebook
        __syncthreads();            // (every warp finished reading the old table)
        build_lut(cc.b);
        lut_b = cc.b;
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
}

// =============================================================================================
// Warp-specialized version (the default at M <= 128, in blocks of up to 16 rows or, with the
// N-split tiling V2, 32 or 64 rows, where the buffers suit the tensor copies, see
// launch_fused_bits): one thread of a producer warp streams each chunk into the ring with
// three TMA tensor copies (tma.cuh: weights, scale bytes,
// activations) that complete on the stage's "full" mbarrier by byte count; the kWarps consumer
// warps wait on it, compute, and release the stage through its "empty" mbarrier (one arrival
// per warp). No CTA-wide barrier in the steady state; consumer warps drift freely by up to
// kStages - 1 chunks. Each consumer warp decodes the scale bytes of its own k-block (two per
// lane at kTN = 4) into a warp-private float buffer (__syncwarp only). The end of an item stops
// only its leader warp (item_reduce.cuh; in V2 each warp stores its own columns); the producer
// takes part in no per-item synchronization, only in the cluster barriers at the start and the
// end of the kernel.
// A slot holds [weights: KCH x SLAB][scale bytes: KCH x COLS][activations: KCH x x_rows x 64 B,
// 64-byte swizzle]. The activation box has the rows inside the k-block (TMA writes boxes densely,
// so rows of a whole chunk would sit 1 KiB apart, all in the same banks for ldmatrix); 64-byte
// rows with the 64-byte swizzle put the 8 rows an ldmatrix reads in 8 distinct bank groups.
// Partial chunks: k-split ranges are whole chunks (the launcher rounds them), so only the last
// chunk of the K range can be partial, and the copies fill its k-blocks past K with zeros.
// =============================================================================================
// The largest M tiling (n8 tiles of 8 rows) this kernel serves with V0/V1: 2 = blocks of 16
// rows (the N-split tiling V2 has its own, 4 and 8, see launch_fused_bits). Harness
// A/B on the H200 against the version with only the weights by TMA (whose 16 rows of 16-byte
// activation copies per chunk kept M = 9..16 on the cp.async kernel): at M = 16 0.55-0.95x the
// time, median 0.82x (llama3-70b down bits 4: 123.6 -> 71.7 us); M <= 8 unchanged (median
// 1.01x).
constexpr int kWsMaxMT = 2;
// The largest M the warp-specialized kernel takes, in blocks of 8 kWsMaxMT rows or V2's 32 or 64
// (the blocks of one column group run on neighbouring clusters, so the weights come from DRAM
// about once); above it the cp.async kernel. Harness "rows" (H200, ten shapes x bits 2, 4, 5):
// at M = 17..64 0.28-0.83x the cp.async kernel's time (median 0.50-0.60x), at M = 128
// 0.50-0.87x, in blocks of 16 rows (session 6; V2 is faster still where the launcher takes it).
constexpr int kWsMaxRows = 128;
constexpr int kXKbBytes = 64;  // one k-block of one activation row (32 x 16 bit)

// The weight bytes the ring keeps in flight at most, per SM (stages - 1 chunks). Session 9,
// harness "layers" (H200, bits 2 and 4, M = 1): 48 KiB (bits 4: 3 chunks in flight instead of 4)
// changed the Llama-3-70B layer's times by 0-2 %. Session 14 (kernel_ring_rows_h200.md): 96 KiB
// with the rows-sized ring below (bits 3: 8 stages, bits 4 at M = 1: 6) read 0.96-1.08x the time
// of session 13's ring at M <= 8, median 1.007, bits 3 up to 4 % slower; so the cap stays.
// -DKBIT_WS_RING_KIB=n to experiment.
constexpr int kRingMaxKiB = 64;
// Chunks per CTA from which a launch with fewer rows than its tiling's most takes the deeper
// ring those rows leave room for (Launcher::plan).
constexpr int kDeepRingMinChunks = 16;
// The sizes of the warp-specialized kernel's shared memory that do not depend on its reducer.
template <int BITS, int MT, int V>
struct WsSizes {
  using C = Config<BITS, MT, V>;
  static constexpr int kWarps = C::kWarps;             // consumer warps
  static constexpr int kThreads = C::kThreads + 32;    // + one producer warp
  static constexpr int kSfWarpBytes = 2 * C::kTN * 8 * 4;  // one k-block: 8 g x kTN x 2 floats
  static constexpr int kSfBytes = kWarps * C::kKBW * 2 * kSfWarpBytes;  // double-buffered
  static constexpr int kSChunk = C::kKCH * C::kCols;                  // raw scale bytes
  static constexpr int kSSlot = (kSChunk + 511) & ~511;              // ... their room in a slot
  static constexpr size_t align1024(size_t b) { return (b + 1023) & ~size_t(1023); }
  static constexpr size_t slot_bytes(int x_rows) {
    return align1024(size_t(C::kWChunk) + kSSlot + size_t(x_rows) * C::kKCH * kXKbBytes);
  }
  static_assert(C::kWChunk % 512 == 0, "activations of a slot start on 512 bytes");
  // [LUT][reducer][sf][full x 8, empty x 8][ring]; the ring and its slots start on 1024 bytes
  // (tensor-copy destinations; the swizzled activations need 512). +1 KiB: the dynamic shared
  // memory itself may start anywhere on 16 bytes.
  static constexpr size_t ring_offset(size_t reducer_bytes) {
    return size_t(C::Path::kLutBytes) + reducer_bytes + kSfBytes + 2 * 8 * 8;
  }
  // Ring depth next to a reducer of `reducer_bytes` with slots for `x_rows` activation rows: as
  // deep as shared memory allows, up to KBIT_WS_RING_KIB of weights in flight and 8 stages (the
  // barriers), at least 2; 0 if two stages do not fit.
  static constexpr int stages_with(size_t reducer_bytes, int x_rows = 8 * MT) {
    for (int d = 8; d >= 2; --d)
      if (ring_offset(reducer_bytes) + 1024 + d * slot_bytes(x_rows) <= size_t(kMaxSmem) &&
          (d == 2 || (d - 1) * C::kWChunk <= kRingMaxKiB * 1024))
        return d;
    return 0;
  }
  // Receive slots of ItemReducer (V0/V1): one per other rank of a kMaxKSplit cluster, fewer
  // where they would cut the ring below 4 stages (or below its depth with one slot, if less);
  // the launcher then caps the cluster size at slots + 1. (13 of the 16 tilings get all 7; four
  // lose one stage, e.g. bits 2 at MT = 1 8 -> 7, which the session-9 ring A/B put within 0-2 %;
  // bits 5 at MT = 1, V0 gets 2 slots, bits 2 and 4 at MT = 2, V1 6. Bits 5 at MT = 2, V0 had 4
  // next to the 128 KiB table, until session 36.)
  static constexpr int recv_slots() {
    // V4 at MT = 1 (the 128 KiB table) runs without a cluster where the launcher takes it
    // (launch_fused_bits: wide5_one_round): one slot (clusters of 2 when forced) leaves its
    // ring a third stage at M <= 3.
    if constexpr (C::kWide5 && MT == 1) return 1;
    using R = ItemReducer<kWarps, C::kAcc, 1>;
    const int want = std::min(stages_with(R::bytes_with(1)), 4);
    for (int n = kMaxKSplit - 1; n > 1; --n)
      if (stages_with(R::bytes_with(n)) >= want) return n;
    return 1;
  }
};

template <int BITS, int MT, int V>
struct WsConfig : WsSizes<BITS, MT, V> {
  using S = WsSizes<BITS, MT, V>;
  using typename S::C;
  // End-of-item sums: V0/V1 add the warps' partial sums (and the cluster's); in V2 each warp
  // owns its columns and only the cluster's ranks add up.
  using Reducer = std::conditional_t<V == 2, WarpClusterReducer<S::kWarps, C::kAcc>,
                                     ItemReducer<S::kWarps, C::kAcc, S::recv_slots()>>;
  static constexpr size_t kRingOffset = S::ring_offset(Reducer::kBytes);
  static constexpr size_t fixed_bytes() { return kRingOffset + 1024; }
  // The ring's depth for a launch whose blocks of M have at most `x_rows` rows: the slots hold
  // that many activation rows, so fewer rows leave room for more stages (at M = 1: bits 5 6
  // stages instead of the 4 that 8 rows allow, bits 2 8 instead of 7; the in-flight cap holds
  // bits 3 and 4). Launcher::plan picks this depth or that of 8 MT rows.
  static constexpr int stages(int x_rows) { return S::stages_with(Reducer::kBytes, x_rows); }
  static_assert(stages(8 * MT) >= 2, "shared memory budget");
  static constexpr size_t smem_bytes(int x_rows) { return fixed_bytes() + stages(x_rows) * S::slot_bytes(x_rows); }
};

__device__ __forceinline__ uint32_t lds_u8(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u8 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts64f(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1,%2};\n" ::"r"(addr), "f"(a), "f"(b));
}
template <int N>
__device__ __forceinline__ void named_bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(N) : "memory");
}

// The tensor maps (tma.cuh), encoded per launch and passed by value:
//   wmap  the weights as 32-bit words: B * KB k-block rows of N * BITS words; box KCH rows x
//         COLS * BITS words.
//   smap  the scale bytes: B * KB rows of N bytes; box KCH rows x COLS bytes.
//   xmap  the activations as 16-bit elements, 3-D {32 (a k-block), B * M rows, KB k-blocks};
//         box {32, x_rows, KCH}, 64-byte swizzle.
template <int BITS, class Act, int MT, int V>
__global__ void __launch_bounds__(WsConfig<BITS, MT, V>::kThreads, 1)
    kbit_matmul_ws_kernel(const Params p, const WalkDivs dv, const __grid_constant__ CUtensorMap wmap,
                          const __grid_constant__ CUtensorMap smap, const __grid_constant__ CUtensorMap xmap) {
  using Cfg = Config<BITS, MT, V>;
  using WC = WsConfig<BITS, MT, V>;
  using WP = typename Cfg::Path;
  using T = typename Act::T;
  constexpr int NW = Cfg::kWarps, NT = Cfg::kThreads, TN = Cfg::kTN;
  const int D = p.stages;  // WC::stages of p.x_rows or of 8 MT rows (Launcher::plan), 2..8
  constexpr int KCH = Cfg::kKCH, NACC = Cfg::kAcc, COLS = Cfg::kCols;
  constexpr int SLAB = Cfg::kSlabBytes, KPW = Cfg::kKPW, SFW = WC::kSfWarpBytes;

  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const ItemWalk<KCH, COLS, 8 * MT> walk(p, dv);
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
  // A last block of M with one row after others (V0/V1: M = 17, 33, ...) copies its box from one
  // row higher, so that two of the box's rows lie inside x; its row sits `x_shift` = 1 row down in
  // the slot (set_x_offsets). With the one row alone inside the box the 16-row tiling took
  // 1.03-1.48x its time at M = 18..32 (H100, median 1.20; the cause is not known: 2..15 rows
  // inside are fine); shifted it takes M = 18's time (H200: M = 17 0.95x, M = 33 0.99x, other M
  // 1.000-1.003x; benchmarks/results/last_block_h200_s32.md). (Shifting every partial last block
  // to end at row M cost M = 18..24 1.5 %: the box's extra rows are real copies.)
  auto x_shift = [&](const Cursor& c) { return V != 2 && c.m0 > 0 && c.rows == 1 ? 1 : 0; };
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
    tma_load_3d(base + kXOffset, &xmap, 0, int(int64_t(c.b) * p.M + c.m0 - x_shift(c)), c.kb, full);
  };
  // The producer's lane 0 sends its first request before anything else, so DRAM works while the
  // CTA sets up:
  //  * inputs ready (a plain launch, as inside JAX's CUDA graphs): the first chunk's copies
  //    themselves, and with one batch entry the consumers build the table before the setup
  //    barrier too. The first copy goes out 0.5-0.6 us after entry instead of 1.55-1.85 (setup,
  //    pdl_wait and the copy one after the other), the first chunk arrives at 1.6-1.8 us instead
  //    of 2.2-2.5 (benchmarks/results/kernel_start_ready_h200.md).
  //  * a programmatic dependent launch: only an L2 prefetch of the first chunk's weights and
  //    scale bytes, which may precede pdl_wait (dependent_launch.cuh). Only the first chunk:
  //    prefetching the whole ring put D chunks of every CTA into DRAM's queue ahead of the first
  //    copy (the first chunk arrived 4.4-4.9 us after entry instead of 2.2-2.5).
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
  // barrier with ready inputs (session 37, benchmarks/results/fused_early_table_h200_s37.md).)
  if (tid < D) {
    if (tid > 0 || !ready) mbar_init(s_full + 8 * tid, 1);  // the producer's arrival (with the byte count)
    mbar_init(s_empty + 8 * tid, NW);
  }
  if (tid == 0) reducer.init();
  // Inputs ready and one batch entry (so one table): the consumers build the table now, under the
  // first copies' latency; otherwise after pdl_wait in their branch, for the first item's entry.
  // This build computes each entry once (build_table's order by entry; session 37, harness "rows"
  // without PDL, H200: 0.976x the time over 240 cases, the small layers' bits 5 0.87-0.96x);
  // the rebuild in the consumers' item loop keeps the order by piece (see build_table).
  const bool early_table = ready && p.items == p.col_groups * p.m_blocks;
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
    // copies. (Earlier versions had 64 producer threads issuing 16-byte cp.async copies: they
    // shared the MIO queue with the consumers and fell behind, see tma.cuh; a version with one
    // 1-D cp.async.bulk per k-block row issued ~33 copies per chunk and was slower still.)
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
    // L through an identity shuffle (pinned_to_lane): ptxas recomputed bits 2's selectors from
    // the thread index in every k-block (an S2R and 4 more instructions). Pinning o0 and o1 too
    // spilled at MT = 8 and reordered bits 3's loops.
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
    // thread index for every chunk (~45 of the ~300 instructions a V1 chunk issued per warp).
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
    // a branch per k-block they ran one after the other; ncu: 28 % of the samples waited on
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

    // V2: the warp's own TN tiles of every k-block of the chunk, one k-block after the other
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
      if constexpr (V == 2) wc.col0 += 16 * TN * warp;  // the warp's own columns
      const ItemStore<MT, T, NACC> store{p, wc, g, t, ts};
      if constexpr (V != 2) {
        if (p.balanced) {
          int peer = 0;
          const int role = walk.piece_role(cur, peer);
          reducer.finish_piece(acc, item_seq++, role, peer, warp, lane, store);
          return;
        }
      }
      reducer.finish(acc, item_seq++, last_item, warp, lane, store);
    };

    Cursor cc = walk.first();
    if constexpr (V != 2) set_x_offsets(cc);
    int lut_b = -1;
    pdl_wait();  // (the codebook, the activations' and the outputs' buffers may be the previous kernel's)
    if (Q > 0) {
      if (early_table)
        ts = p.tensor_scale[0];
      else
        build_lut(cc.b);
      lut_b = cc.b;
    }
    named_bar_sync<NT>(1);

    int slot = 0;
    uint32_t fparity = 0;
    // Release a stage only once this warp's reads of it have returned their data: the producer's
    // next tensor copy into it (an async-proxy write) may start as soon as it sees the arrival, and
    // ptxas leaves the last k-block's loads in flight past an arrival that depends on nothing
    // (their registers are used after it). Here the arrival's address depends on every accumulator,
    // i.e. on the last mma of each tile, which consumed all of the stage's loads: a LOP3 per three
    // accumulator groups and the mma latency. (Without it the N-split tiling read refilled stages:
    // wrong sums in 2-75 % of the launches at bits 2 and 5 with 5-8 CTA clusters, in the warps that
    // share a scheduler with the producer and run behind. A proxy fence before the arrival, which
    // waits for the loads, fixed it too at 1.02x the time.
    // benchmarks/results/kernel_stage_release_h200.md)
    auto release = [&](int s) {
      uint32_t zero = uint32_t(p.M) >> 31;  // 0, but not a constant to the compiler
#pragma unroll
      for (int i = 0; i < NACC / 4; ++i)
        asm volatile("and.b32 %0, %0, %1;\n" : "+r"(zero) : "r"(__float_as_uint(acc[4 * i])));
      __syncwarp();
      if (lane == 0) mbar_arrive(s_empty + 8 * s + zero);
    };
    // One item per pass; its chunks are the steady state, a loop of its own with one taken branch
    // per chunk (with the item's end tested inside it, the epilogue's code sat between the chunk's
    // body and the loop's tail: ncu counted 10 % of the samples there, instruction fetch and
    // branch resolution).
    int q = 0;  // chunks consumed
    while (q < Q) {
      for (int c = 0; c < cc.nch; ++c, ++q) {
        mbar_wait(s_full + 8 * slot, fparity);
        if constexpr (V == 2)
          compute_nsplit(slot, q & 1);
        else
          compute(slot, q & 1);
        release(slot);
        if (++slot == D) { slot = 0; fparity ^= 1u; }
      }
      epilogue(cc, q == Q);
      if (q == Q) break;  // (before next_item: its divisions sat on the CTA's exit, 0.29 us)
      walk.next_item(cc);
      if constexpr (V != 2) set_x_offsets(cc);  // the next item's block of M may have fewer rows
      if (cc.b != lut_b) {       // the next item belongs to another batch entry
        named_bar_sync<NT>(1);   // (every warp finished reading the old table)
        build_lut(cc.b);
        lut_b = cc.b;
        named_bar_sync<NT>(1);
      }
    }
    if (KS > 1 && item_seq == 0) cluster_wait();  // (no item: still pair the start's arrive)
  }  // consumer warps
  // no rank's shared memory may still be addressed by another (relaxed: the reducers leave nothing
  // in flight between the CTAs after their last item, item_reduce.cuh)
  if (KS > 1) cluster_barrier_relaxed();
}

// ---- host side: launch configuration ----
// Per-device facts and per-(kernel, device) settings are cached (see common.cuh's
// device_sm_count); they live in the class template below, so each kernel instantiation has its
// own.

// n8 tiles along M for a problem with M rows (blocks of 64 rows above that).
inline int m_tiles(int64_t m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

// The launcher's limits on chunk-balanced clusters (Launcher::plan): the largest cluster, and the
// critical path it must have against the uniform k-split's.
constexpr int kBalancedMaxRanks = 4;
constexpr double kBalancedGain = 0.9;
// Whether the launcher may choose chunk-balanced clusters (ItemWalk): yes unless the environment
// has KBIT_JAX_BALANCE=0 (read once per process; for comparisons).
inline bool balanced_clusters_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("KBIT_JAX_BALANCE");
    return v == nullptr || v[0] != '0';
  }();
  return enabled;
}

// How a launch covers the problem: shared memory, cluster size (k-split) and clusters, and the
// critical path's estimated length in chunk times of the V0 tiling of its MT (`cost`), which
// launch_fused_bits compares between the tilings. `error` is set if the shared memory cannot be
// reserved. (Launcher::plan makes it.)
struct LaunchPlan {
  size_t smem = 0;
  int x_rows = 0, KB = 0, ks = 1, kps = 1, stages = 0;
  bool balanced = false;  // chunk-balanced clusters (ItemWalk) instead of a uniform k-split
  int64_t col_groups = 0, m_blocks = 0, items = 0, ncl = 0;
  double price = 0;  // the plan's chunk in V0 chunks (Launcher::chunk_price), the unit of `cost`
  double cost = 0;
  std::string error;
};

template <int BITS, class Act, int MT, int V, bool WS>
struct Launcher {
  using Cfg = Config<BITS, MT, V>;
  static constexpr auto kernel = [] {  // instantiates only the kernel it launches
    if constexpr (WS) return &kbit_matmul_ws_kernel<BITS, Act, MT, V>;
    else return &kbit_matmul_fused_kernel<BITS, Act, MT, V>;
  }();
  static constexpr int kThreads = std::conditional_t<WS, WsConfig<BITS, MT, V>, Cfg>::kThreads;
  static std::atomic<int>& smem_set(int dev) {
    static std::atomic<int> v[kMaxDevices];
    return v[dev];
  }
  // Resident clusters of `ks` CTAs at `smem` bytes (cached per device and ks, keyed by smem).
  static int max_clusters(int dev, int ks, size_t smem) {
    static std::atomic<int64_t> cache[kMaxDevices][9];
    std::atomic<int64_t>& slot = cache[dev][ks];
    const int64_t c = slot.load(std::memory_order_relaxed);
    if (c > 0 && (c >> 32) == int64_t(smem)) return int(c & 0xffffffff);
    const int n = query_max_active_clusters(kernel, kThreads, smem, ks, dev);
    slot.store((int64_t(smem) << 32) | int64_t(n), std::memory_order_relaxed);
    return n;
  }

  static const char* name() { return WS ? "kbit_matmul_ws_kernel" : "kbit_matmul_fused_kernel"; }
  static std::string shape(const MatmulArgs& a) {
    return "B=" + std::to_string(a.batch) + " M=" + std::to_string(a.m) + " K=" + std::to_string(a.k) +
           " N=" + std::to_string(a.n) + " bits=" + std::to_string(BITS) + " dtype=" + Act::kName +
           " MT=" + std::to_string(MT) + " V=" + std::to_string(V) + " glu=" + std::to_string(a.glu);
  }

  // A chunk's time in V0 chunks of this MT (Config::chunk_cost, by the activations' dtype).
  // (`one_block_of_rows`: the launch's M fits one block of 8 MT rows)
  static constexpr double chunk_price(bool one_block_of_rows) {
    return Cfg::chunk_cost(std::is_same_v<Act, ActBF16>, one_block_of_rows);
  }

  using Plan = LaunchPlan;
  static Plan plan(const MatmulArgs& a, const MatmulTuning* tuning) {
    Plan pl;
    pl.price = chunk_price(a.m <= 8 * MT);  // (also on a plan that fails: callers report it)
    pl.KB = static_cast<int>(a.k / 32);
    // (V2 reads all 8 MT rows of its block without a bound check: the box always has them)
    pl.x_rows = V == 2 ? 8 * MT : static_cast<int>(std::min<int64_t>(a.m, 8 * MT));
    if constexpr (WS) pl.smem = WsConfig<BITS, MT, V>::smem_bytes(pl.x_rows);
    else pl.smem = Cfg::smem_bytes(pl.x_rows);
    const int dev = current_device();
    if (smem_set(dev).load(std::memory_order_relaxed) < int(pl.smem)) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(pl.smem));
      if (err != cudaSuccess) {
        pl.error = std::string(name()) + ": cannot reserve " + std::to_string(pl.smem) +
                   " bytes of shared memory: " + cudaGetErrorString(err) + " (" + shape(a) + ")";
        return pl;
      }
      smem_set(dev).store(int(pl.smem), std::memory_order_relaxed);
    }
    pl.col_groups = (a.n + Cfg::kCols - 1) / Cfg::kCols;
    pl.m_blocks = (a.m + 8 * MT - 1) / (8 * MT);
    pl.items = pl.col_groups * pl.m_blocks * a.batch;
    if (pl.items > 0x7fffffffLL) {
      pl.error = std::string(name()) + ": too many work items for " + shape(a);
      return pl;
    }
    const int KB = pl.KB;
    // k-blocks per cluster rank at cluster size ks; whole chunks in the warp-specialized kernel,
    // whose copies zero-fill only the k-blocks past K (see its header)
    auto split_len = [&](int ks) {
      const int kps = (KB + ks - 1) / ks;
      return WS ? (kps + Cfg::kKCH - 1) / Cfg::kKCH * Cfg::kKCH : kps;
    };
    // Choose the cluster size (k-split) that minimizes the critical path: the most items a
    // cluster processes times (the chunks per item + the item's end, in chunk times). In a
    // cluster, rank 0 waits for, reads and adds every rank's sum, so in the warp-specialized
    // kernel an item's end grows with the cluster size: 1 + ks / 2 chunks, fitted to the
    // harness's "sweep" (H200: 17 shapes x bits 2, 4, 5 x M 1, 16, each at cluster sizes 1..8).
    // There it picked sizes within 0.04 % of the best on (geometric) average, 3.2 % at worst,
    // against 2.0 % and 1.41x for a flat 1 chunk (which it replaced: 12 of the 102 cases changed,
    // all faster, e.g. llama3-70b gate/up at TP 2 (K 8192, N 28672) 52.5 -> 50.6 us and q/k/v
    // (K 8192, N 5120) 20.4 -> 16.3 us at M = 1). The cp.async kernel keeps the flat cost.
    double best_cost = 1e30;
    int ks_cap = kMaxKSplit;  // (the warp-specialized kernel: as many ranks as its reducer takes)
    if constexpr (WS) ks_cap = WsConfig<BITS, MT, V>::Reducer::kMaxRanks;
    const int ks_max = std::min(ks_cap, std::max(KB, 1));
    // clusters launched at cluster size ks, the items each processes (items > 0: launch_matmul
    // returns before planning an empty product), and the chunks of an item's k-range
    auto clusters = [&](int ks) { return std::min<int64_t>(pl.items, max_clusters(dev, ks, pl.smem)); };
    auto items_per_cluster = [&](int64_t ncl) { return (pl.items + ncl - 1) / ncl; };
    auto chunks_per_item = [&](int kps) { return (kps + Cfg::kKCH - 1) / Cfg::kKCH; };
    // (a cluster size the caller forces, tuning->k_split, excludes the others)
    auto size_allowed = [&](int ks) {
      return !(tuning && tuning->k_split > 0) || ks == std::min(tuning->k_split, ks_max);
    };
    for (int ks = 1; ks <= ks_max; ++ks) {
      if (!size_allowed(ks)) continue;
      const int kps = split_len(ks);
      if ((KB + kps - 1) / kps != ks) continue;  // would leave a rank empty
      const int64_t per_cluster = items_per_cluster(clusters(ks));
      const double chunks = double(chunks_per_item(kps));
      // (the N-split tiling at 32 rows: rank 0 reads every rank's 32 accumulators per lane through
      // distributed shared memory, ~6 us at 5 ranks on Qwen3 gate/up (item_end_h100_s29.md); at 64
      // rows, twice as many: 2.5 per rank. At 0.5 the plan took one 64-row block over 8-CTA
      // clusters for Llama-3-70B q/k/v at TP 4 (K 8192, N 2560) at M = 56 and 64, 1.11-1.24x the
      // time of 16-row blocks (fused_rows_tp_h200_s35_m40-64.log). At 16 rows 1.0, fitted with
      // the prices (session 50, Config::chunk_cost): at 0.5 the same layer at M = 9..16 ran in
      // 8-CTA clusters, 1.26-1.31x the time of V1.)
      const double nsplit_rank_end = V != 2 ? 0.5 : MT == 2 ? 1.0 : MT == 4 ? 1.25 : 2.5;
      const double item_end = ks == 1 ? 0.5 : WS ? 1.0 + nsplit_rank_end * ks : 1.0;
      const double cost = per_cluster * (chunks + item_end) * pl.price;
      if (cost < best_cost - 1e-9) { best_cost = cost; pl.ks = ks; }
    }
    pl.cost = best_cost;
    pl.kps = split_len(pl.ks);
    pl.ncl = clusters(pl.ks);
    int64_t chunks_per_cta = items_per_cluster(pl.ncl) * chunks_per_item(pl.kps);
    // Chunk-balanced clusters (ItemWalk; the warp-specialized kernel's V0/V1, whose reducer has
    // receive slots): every rank of a cluster streams the same number of chunks of the cluster's
    // items, so an item count that the clusters do not divide costs no idle ranks. Its critical
    // path: a rank's chunks, its pieces' ends (0.5 each, as a whole item's) and the owner's wait
    // for the ranks that share its item (0.5 each). The launcher takes it at clusters of at most
    // kBalancedMaxRanks where that path is at most kBalancedGain of the uniform split's: harness
    // "sel" and "layers" (H200, both splits timed on one build, kernel_balanced_h200.md), with
    // no limits: 0.85-0.95x the time where the uniform split left the last round of items on
    // under half the SMs (llama3-70b gate/up: 64 -> 56 chunks per CTA), but 1.02-1.09x where
    // its path was only 7-9 % shorter (glm4.7 gate/up with 32-column groups: the uniform split's
    // last round, on 56 of 132 SMs, runs faster per chunk than the path counts) and 1.03-1.09x
    // at 8-CTA clusters (120 CTAs; Llama-3-70B q/k/v and gate/up at TP 4).
    if constexpr (WS && V != 2) {
      const int want = tuning && tuning->balance >= 0 ? tuning->balance : balanced_clusters_enabled() ? -1 : 0;
      constexpr int kRecv = WsConfig<BITS, MT, V>::Reducer::kMaxRanks - 1;
      const int nchi = chunks_per_item(KB);
      double best_bal = want == 1 ? 1e30 : kBalancedGain * best_cost;
      const int ks_top = want == 1 ? ks_max : std::min(ks_max, kBalancedMaxRanks);
      for (int ks = 2; want != 0 && ks <= ks_top; ++ks) {
        if (!size_allowed(ks)) continue;
        const int64_t ncl = clusters(ks), t_hi = items_per_cluster(ncl) * nchi, t_lo = pl.items / ncl * nchi;
        if (t_lo < ks || t_hi * ks >= (int64_t(1) << 31)) continue;  // a rank without chunks; 32-bit walk
        const int64_t per_rank = (t_hi + ks - 1) / ks, fewest = t_lo / ks;
        const int64_t senders = (nchi - 1 + fewest - 1) / fewest;  // most later ranks that share an item
        if (senders > kRecv) continue;
        const double pieces = double((per_rank + nchi - 1) / nchi + 1);
        const double cost = (double(per_rank) + 0.5 * pieces + 0.5 * double(senders)) * pl.price;
        if (cost < best_bal - 1e-9) {
          best_bal = cost;
          pl.balanced = true;
          pl.ks = ks;
          pl.ncl = ncl;
          chunks_per_cta = per_rank;
        }
      }
      if (pl.balanced) {
        pl.cost = best_bal;
        pl.kps = KB;
      }
    }
    if constexpr (WS) {
      // The ring as deep as the launch's rows allow (pl.smem has room for it) where each CTA
      // streams many chunks; where it streams few, the shallower depth of 8 MT rows, since more
      // copies in flight at the start delay the first chunk (harness "sel", H200, bits 5: 6
      // stages instead of 4 at M = 1 took llama3-70b gate/up 59.9 -> 57.7 us but qwen3 down, ~5
      // chunks per CTA, 7.3 -> 7.6; kernel_ring_rows_h200.md).
      using WC = WsConfig<BITS, MT, V>;
      // (V4 at MT = 1: 3 stages against 2, one more copy in flight, at any chunk count)
      const bool deep = chunks_per_cta >= kDeepRingMinChunks || (Cfg::kWide5 && MT == 1);
      pl.stages = deep ? WC::stages(pl.x_rows) : WC::stages(8 * MT);
    }
    return pl;
  }

  static std::string launch(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
    return launch(a, stream, tuning, plan(a, tuning));
  }
  // Launch with a plan already made (launch_fused_bits plans both tilings to choose one).
  static std::string launch(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning, const Plan& pl) {
    if (!pl.error.empty()) return pl.error;
    const int KB = pl.KB, ks = pl.ks, kps = pl.kps, x_rows = pl.x_rows;
    const int64_t ncl = pl.ncl;
    const size_t smem = pl.smem;
    if (tuning && tuning->report) {
      MatmulLaunchReport& r = *tuning->report;
      r.k_split = ks;
      r.ctas = static_cast<int>(ncl * ks);
      r.balanced = pl.balanced ? 1 : 0;
      r.wg_columns = 0;
      r.whole_ctas = 0;
      r.cluster_sum = 0;
      r.variant = V;
      r.rows = 8 * MT;
      r.plan_cost = pl.cost;
      r.chunk_price = pl.price;
    }

    Params prm;
    copy_operands(a, prm);
    prm.M = a.m;
    prm.N = static_cast<int>(a.n);
    prm.KB = KB;
    prm.kb_per_split = std::max(kps, 1);
    prm.k_split = ks;
    prm.balanced = pl.balanced ? 1 : 0;
    prm.col_groups = static_cast<int>(pl.col_groups);
    prm.m_blocks = static_cast<int>(pl.m_blocks);
    prm.items = static_cast<int>(pl.items);
    prm.x_rows = x_rows;
    prm.stages = WS ? pl.stages : Cfg::kStages;
    prm.vec16 = ((a.n * BITS) % 4 == 0 && (reinterpret_cast<uintptr_t>(a.planes) & 15) == 0) ? 1 : 0;
    prm.scale_bytes = a.batch * int64_t(KB) * a.n;
    // (the cp.async kernel does not keep dependent_launch.cuh's contract: plain launches)
    const bool dependent = WS && dependent_launch_enabled(stream);
    prm.inputs_ready = dependent ? 0 : 1;
    prm.glu = a.glu;
    const WalkDivs dv{FastDiv(ks), FastDiv(static_cast<int>(ncl)), FastDiv(static_cast<int>(pl.m_blocks)),
                      FastDiv(static_cast<int>(pl.col_groups)), FastDiv(ceil_div(KB, Cfg::kKCH))};

    const ClusterLaunch launch(static_cast<unsigned>(ncl * ks), kThreads, smem, stream, ks, dependent);
    const std::string where = shape(a) + " k_split=" + std::to_string(ks) + " ctas=" + std::to_string(ncl * ks) +
                              " smem=" + std::to_string(smem);
    cudaError_t err;
    if constexpr (WS) {  // the tensor maps of the kernel's three copies (see its header)
      CUtensorMap wmap, smap, xmap;
      const uint64_t rows = uint64_t(a.batch) * KB, n = uint64_t(a.n);
      // A column group wider than a box dimension allows (256 words; V2, V4): the map splits the
      // columns into 16-column pieces, {16 BITS words, N / 16 pieces, rows}; the box of
      // COLS / 16 pieces lands in shared memory in the same order as a 2-D box would.
      constexpr bool pieces = Cfg::kPieceMap;
      constexpr int w_rank = pieces ? 3 : 2;
      const uint64_t w_dims[3] = {pieces ? 16 * BITS : n * BITS, pieces ? n / 16 : rows, rows};
      const uint64_t w_strides[2] = {pieces ? 16 * BITS * 4 : n * BITS * 4, n * BITS * 4};
      const uint32_t w_box[3] = {uint32_t(pieces ? 16 * BITS : Cfg::kCols * BITS),
                                 uint32_t(pieces ? Cfg::kCols / 16 : Cfg::kKCH), uint32_t(Cfg::kKCH)};
      const uint64_t s_dims[2] = {n, rows}, s_strides[1] = {n};
      const uint32_t s_box[2] = {uint32_t(Cfg::kCols), uint32_t(Cfg::kKCH)};
      const uint64_t x_dims[3] = {32, uint64_t(a.batch * a.m), uint64_t(KB)};
      const uint64_t x_strides[2] = {uint64_t(a.k) * 2, uint64_t(kXKbBytes)};
      const uint32_t x_box[3] = {32, uint32_t(x_rows), uint32_t(Cfg::kKCH)};
      std::string bad = encode_tensor_map(&wmap, CU_TENSOR_MAP_DATA_TYPE_UINT32, w_rank, a.planes, w_dims,
                                          w_strides, w_box, CU_TENSOR_MAP_SWIZZLE_NONE);
      if (bad.empty())
        bad = encode_tensor_map(&smap, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, a.scales, s_dims, s_strides, s_box,
                                CU_TENSOR_MAP_SWIZZLE_NONE);
      if (bad.empty())
        bad = encode_tensor_map(&xmap, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, a.x, x_dims, x_strides, x_box,
                                CU_TENSOR_MAP_SWIZZLE_64B);
      if (!bad.empty()) return std::string(name()) + ": " + bad + " (" + where + ")";
      err = cudaLaunchKernelEx(&launch.cfg, kernel, prm, dv, wmap, smap, xmap);
    } else {
      err = cudaLaunchKernelEx(&launch.cfg, kernel, prm, dv);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear
      return std::string(name()) + " failed to launch: " + cudaGetErrorName(err) + " (" +
             cudaGetErrorString(err) + ") for " + where;
    }
    return check_launch(name(), where);
  }
};

template <class A>
struct ActTag { using type = A; };

template <int BITS>
std::string launch_fused_bits(const MatmulArgs& a, cudaStream_t stream, const MatmulTuning* tuning) {
  if (a.k == 0) {  // empty contraction: y = 0 (+0.0 is all-zero bits in every dtype)
    const cudaError_t err = cudaMemsetAsync(a.y, 0, size_t(a.batch * a.m * a.n) * 2, stream);
    return err == cudaSuccess ? std::string() : std::string("kbit_matmul: memset failed: ") + cudaGetErrorString(err);
  }
  // The warp-specialized kernel (M <= kWsMaxRows, in blocks of up to 16 rows) needs what its
  // tensor copies need: N % 16 == 0 (16-byte rows of scale bytes) and 16-byte-aligned buffers
  // (K is a multiple of 32). Otherwise, and for larger M, the cp.async kernel with one
  // __syncthreads per chunk. Measured on the H200 (harness, ten shapes x bits 2..5): at M = 1
  // and 4 the warp-specialized kernel took 0.71-0.91x the cp.async kernel's time with cp.async
  // copies of its own, and the TMA copies took that to a median 0.93x; at M = 16 the TMA
  // version takes 0.55-0.95x.
  auto al16 = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15) == 0; };
  // (tensor-copy coordinates are 32-bit: rows B * M and B * K / 32 must fit)
  const int64_t ws_rows = tuning && tuning->ws_max_rows >= 0 ? tuning->ws_max_rows : kWsMaxRows;
  const bool ws = a.m <= ws_rows && a.n % 16 == 0 && al16(a.planes) && al16(a.scales) && al16(a.x) &&
                  a.batch * a.m < (int64_t(1) << 31) && a.batch * (a.k / 32) < (int64_t(1) << 31);
  const int min_mt = ws && tuning ? tuning->min_m_tiles : 0;
  const int mt = ws ? std::min(std::max(m_tiles(a.m), min_mt), kWsMaxMT) : m_tiles(a.m);
  // The tiling variant (see Config); tuning->variant overrides. At M <= 8, cp.async kernel,
  // measured on the H200 over the ten benchmark shapes at M = 1 and 4: V1 takes 0.95x the time
  // of V0 at bits 3 (faster in 18/20 cases) and 0.98x at bits 5 (16/20); 1.02x at bits 2 and
  // 1.01x at bits 4, where V0 stays. Warp-specialized kernel: V1 (8 consumer warps, two
  // k-blocks each per chunk) takes 0.81-0.90x the time of V0 at every bits value. At M > 8
  // the cp.async kernel keeps V0, and the warp-specialized kernel takes the variant whose plan
  // (cluster size and critical path, Launcher::plan) is shorter: V1 wins where the columns are
  // plentiful (llama3 gate/up and down at M = 16: 0.72-0.88x the time of V0 at bits 2..4), V0
  // where 64-column groups would leave too few items (N = 2048: V1 up to 1.11x). At M > 8 the
  // N-split tiling (V2) joins the comparison (Config::chunk_cost puts the plans in one unit; fp16
  // from session 42, before only from M = 17). Variant 2, the N-split tiling in blocks of 16 (M
  // <= 16, and forced at M <= 8), 32 (M <= 32) or 64 rows, runs only on the warp-specialized
  // kernel; a request for it elsewhere gets the default.
  // Bits 5 on the warp-specialized kernel also has V4 (kWideBits5: 64-column groups in blocks of
  // 8 or 16 rows), planned at M = 9..16 and taken at M <= 8 by wide5_one_round (below).
  const bool forced_variant = tuning && tuning->variant >= 0 && (tuning->variant != 2 || ws) &&
                              (tuning->variant != kWideBits5 || (ws && BITS == 5 && mt <= 2 && a.m <= 16));
  constexpr int kDefaultV = (BITS == 3 || BITS == 5) ? 1 : 0;
  const int variant = forced_variant ? tuning->variant : mt > 1 ? 0 : ws ? 1 : kDefaultV;
  auto with_nsplit = [&](auto act_tag, auto&& use) -> std::string {
    using A = typename decltype(act_tag)::type;
    if (a.m <= 16) return use(Launcher<BITS, A, 2, 2, true>{});
    if (a.m <= 32) return use(Launcher<BITS, A, 4, 2, true>{});
    return use(Launcher<BITS, A, 8, 2, true>{});
  };
  auto by_ws = [&](auto act_tag, auto mt_tag, auto v_tag) -> std::string {
    using A = typename decltype(act_tag)::type;
    constexpr int MT = decltype(mt_tag)::value, V = decltype(v_tag)::value;
    if constexpr (MT <= kWsMaxMT)
      if (ws) return Launcher<BITS, A, MT, V, true>::launch(a, stream, tuning);
    return Launcher<BITS, A, MT, V, false>::launch(a, stream, tuning);
  };
  auto by_act = [&](auto mt_tag) -> std::string {
    constexpr int MT = decltype(mt_tag)::value;
    using V0 = std::integral_constant<int, 0>;
    using V1 = std::integral_constant<int, 1>;
    auto with = [&](auto act_tag) -> std::string {
      using A = typename decltype(act_tag)::type;
      if (variant == 2)
        return with_nsplit(act_tag, [&](auto ln) { return decltype(ln)::launch(a, stream, tuning); });
      // Bits 5's wide tiling (V4): forced (forced_variant has checked ws), or at M = 9..16 planned
      // next to V0 and V1 and taken where its plan is the shortest.
      using LW = Launcher<BITS, A, MT, kWideBits5, true>;
      constexpr bool has_wide = BITS == 5 && MT <= 2 && MT <= kWsMaxMT;
      if constexpr (has_wide)
        if (variant == kWideBits5) return LW::launch(a, stream, tuning);
      // At M <= 8, V4 against V1 (see kWideBits5):
      //  * Where its ring has 3 stages (M <= 3) the plans decide, V4's chunk at kWideBits5Price V1
      //    chunks (harness, M = 1..3: within 0.4 % of the faster tiling on average).
      //  * With 2 stages (M = 4..8) it pays only where it turns V1's two rounds of items, or V1's
      //    cluster, into one round of whole items on single CTAs that each stream fewer chunks
      //    than the deep ring is for (kDeepRingMinChunks): wide5_one_round.
      if constexpr (has_wide && MT == 1)
        if (ws && !forced_variant) {
          using L1 = Launcher<BITS, A, 1, 1, true>;
          const auto p1 = L1::plan(a, tuning);
          const auto pw = LW::plan(a, tuning);
          bool wide = pw.error.empty() && !p1.error.empty();  // (V1 cannot run: V4 can)
          if (p1.error.empty() && pw.error.empty()) {
            if (pw.stages >= 3) {
              wide = pw.cost < p1.cost;
            } else {
              const bool v1_one_round = p1.ks == 1 && p1.items <= p1.ncl;
              const int chunks = ceil_div(pw.KB, LW::Cfg::kKCH);  // (an item's: ks is 1)
              const bool wide5_one_round = pw.ks == 1 && !pw.balanced && pw.items <= pw.ncl &&
                                           chunks < kDeepRingMinChunks;
              wide = !v1_one_round && wide5_one_round;
            }
          }
          if (wide) return LW::launch(a, stream, tuning, pw);
          return L1::launch(a, stream, tuning, p1);
        }
      if constexpr (MT == 2 && MT <= kWsMaxMT)
        if (ws && !forced_variant) {
          using L0 = Launcher<BITS, A, 2, 0, true>;
          using L1 = Launcher<BITS, A, 2, 1, true>;
          const auto p0 = L0::plan(a, tuning);
          const auto p1 = L1::plan(a, tuning);
          const bool v1 = p1.error.empty() && (!p0.error.empty() || p1.cost <= p0.cost);
          double best = v1 ? p1.cost : p0.error.empty() ? p0.cost : 1e300;
          LaunchPlan pw;
          pw.error = "not planned";
          if constexpr (has_wide)
            if (a.m <= 16) pw = LW::plan(a, tuning);
          const bool wide = pw.error.empty() && pw.cost < best;
          if (wide) best = pw.cost;
          // The N-split tiling where its plan is shorter (costs in the same unit; a caller's
          // tuning gets both: the 16-row tilings' best, V4 included, and the N-split tiling's).
          bool taken = false;
          std::string out = with_nsplit(act_tag, [&](auto ln) {
            using LN = decltype(ln);
            const auto pn = LN::plan(a, tuning);
            if (tuning && tuning->report) {
              tuning->report->planned_rows16_cost = best < 1e300 ? best : -1.0;
              tuning->report->planned_nsplit_cost = pn.error.empty() ? pn.cost : -1.0;
              tuning->report->planned_nsplit_price = pn.price;
            }
            if (!pn.error.empty() || pn.cost >= best) return std::string();
            taken = true;
            return LN::launch(a, stream, tuning, pn);
          });
          if (taken) return out;
          if constexpr (has_wide)
            if (wide) return LW::launch(a, stream, tuning, pw);
          if (v1) return L1::launch(a, stream, tuning, p1);
          return L0::launch(a, stream, tuning, p0);
        }
      if constexpr (MT <= 2)
        if (variant == 1) return by_ws(act_tag, mt_tag, V1{});
      return by_ws(act_tag, mt_tag, V0{});
    };
    if (a.dtype == DType::kBF16) return with(ActTag<ActBF16>{});
    return with(ActTag<ActF16>{});
  };
  switch (mt) {
    case 1: return by_act(std::integral_constant<int, 1>{});
    case 2: return by_act(std::integral_constant<int, 2>{});
    case 4: return by_act(std::integral_constant<int, 4>{});
    default: return by_act(std::integral_constant<int, 8>{});
  }
}

}  // namespace kbit::cuda::fused
