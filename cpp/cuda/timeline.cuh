// Milestone clocks of the warp-specialized matmul kernel, for the harness's "timeline" mode:
// where the fixed cost of a launch goes (a small product takes ~8 us against ~1 us of DRAM
// time). Compiled in only with -DKBIT_TIMELINE (tools/kernel_profile.sh timeline); without it
// every mark is an empty statement and Params has no buffer, so the kernel is unchanged.
//
// Per CTA, buffer row blockIdx.x holds kTlSlots 64-bit values: the SM's clock64 at each mark
// (0 = not reached), %globaltimer (ns) at entry and at exit (clocks of different SMs are not
// comparable; the globaltimer values place the CTAs on one time axis and give the clock rate),
// and the CTA's chunk count.
#pragma once

#include <cstdint>

namespace kbit::cuda {

enum TimelineMark : int {
  kTlEntry = 0,       // first instruction (thread 0)
  kTlSetup,           // mbarriers initialised, __syncthreads passed (thread 0)
  kTlWaited,          // producer: pdl_wait passed (the previous kernel's writes visible)
  kTlFirstCopy,       // producer: first chunk's tensor copies issued
  kTlTable,           // consumers: lookup table built (thread 0, after the consumers' barrier)
  kTlFirstChunk,      // consumer warp 0: first chunk's full barrier passed (its bytes arrived)
  kTlFirstItemEnd,    // consumer warp 0: first item's last chunk computed (epilogue starts)
  kTlFirstStored,     // consumer warp 0: first item reduced and stored
  kTlLastChunk,       // consumer warp 0: last chunk's full barrier passed
  kTlLoopEnd,         // consumer warp 0: all items reduced and stored
  kTlExit,            // thread 0, after the final cluster barrier
  kTlLastWarpItemEnd, // the last consumer warp to compute its first item's last chunk (the
                      // latest of the warps' kTlFirstItemEnd; warp 0 alone may run ahead)
  kTlLastWarpStored,  // the last consumer warp to end its first item (reduced and stored)
  kTlWarpsSummed,     // V0/V1, first item: its leader (warp 0) has added the CTA's warps' sums
  kTlRanksIn,         // k-split cluster, first item, rank 0's warp 0: the other ranks' sums are in
  kTlSumEntered,      // the CTA's last item (finish_last_shared), warp 0: past the warps' barrier;
                      // wgmma kernel: thread 0 at its first sum of the cluster's rows
  kTlSumAdded,        // wgmma kernel: thread 0's first item added, before its store
  kTlProbe0,          // probes: free marks for an investigation (KBIT_TL_MARK(p, kTlProbe0 + i, ...))
  kTlProbe1,
  kTlProbe2,
  kTlProbe3,
  kTlProbe4,
  kTlProbe5,
  kTlMarks,
  kTlGlobalEntry = kTlMarks,  // %globaltimer at kTlEntry
  kTlGlobalExit,              // %globaltimer at kTlExit
  kTlChunks,                  // chunks this CTA consumed
  kTlSlots
};

}  // namespace kbit::cuda

#if defined(KBIT_TIMELINE) && defined(__CUDACC__)
namespace kbit::cuda {
// This CTA's entry for `slot` in the timeline buffer (kTlSlots entries per CTA).
__device__ __forceinline__ unsigned long long* timeline_slot(unsigned long long* buf, int slot) {
  return buf + size_t(blockIdx.x) * kTlSlots + slot;
}
__device__ __forceinline__ void timeline_store(unsigned long long* buf, int slot, unsigned long long v) {
  if (buf) *timeline_slot(buf, slot) = v;
}
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
}  // namespace kbit::cuda
// Record `mark` (a TimelineMark) when `cond` holds: KBIT_TL_MARK_TO into the buffer `buf` (the
// reducers, item_reduce.cuh, which the kernel gives KBIT_TL_BUFFER(p): the buffer, or nullptr
// outside timeline builds), KBIT_TL_MARK into that of the kernel's Params `p`.
#define KBIT_TL_MARK_TO(buf, mark, cond) \
  do { if (cond) ::kbit::cuda::timeline_store((buf), (mark), clock64()); } while (0)
#define KBIT_TL_MARK(p, mark, cond) KBIT_TL_MARK_TO((p).timeline, mark, cond)
#define KBIT_TL_BUFFER(p) ((p).timeline)
// The latest of the calling threads' clocks (one SM: comparable) at `mark`.
#define KBIT_TL_LATEST(p, mark, cond) \
  do { \
    if ((cond) && (p).timeline) \
      atomicMax(::kbit::cuda::timeline_slot((p).timeline, (mark)), clock64()); \
  } while (0)
#define KBIT_TL_GLOBAL(p, slot, cond) \
  do { if (cond) ::kbit::cuda::timeline_store((p).timeline, (slot), ::kbit::cuda::global_ns()); } while (0)
#define KBIT_TL_VALUE(p, slot, value, cond) \
  do { if (cond) ::kbit::cuda::timeline_store((p).timeline, (slot), (value)); } while (0)
#else
#define KBIT_TL_MARK(p, mark, cond) do {} while (0)
#define KBIT_TL_LATEST(p, mark, cond) do {} while (0)
#define KBIT_TL_MARK_TO(buf, mark, cond) do {} while (0)
#define KBIT_TL_BUFFER(p) nullptr
#define KBIT_TL_GLOBAL(p, slot, cond) do {} while (0)
#define KBIT_TL_VALUE(p, slot, value, cond) do {} while (0)
#endif
