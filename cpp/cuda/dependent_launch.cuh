// Programmatic dependent launch (PDL, sm_90+) for the warp-specialized fused matmul.
//
// Why: a small product's kernel spends a third of its time on fixed start and end (Qwen3 q
// 2048 x 4096 at M = 1: 9.0 us per launch back to back, of which ~2 us pass
// between one kernel's last CTA exit and the next one's first entry, ~1.1 us in the prologue
// before the first weight copy is issued and ~1.4 us until it arrives). Launched with the
// programmatic-stream-serialization attribute, a kernel's CTAs may start while the previous
// kernel on the stream still runs: they set up shared memory and barriers and prefetch their
// first weights into L2, and only then wait (griddepcontrol.wait) for the previous kernel to
// finish and its writes to become visible.
//
// Measured on the H200: back to back on a stream, 0.83x the time at M <= 8, 0.88x at M = 16.
// Inside JAX programs XLA's command buffers (on by default) record a custom call as a nested
// graph, which starts its kernel ~0.1 us after the previous one anyway; there the attribute has
// no effect, so it is not set while a stream is being captured (dependent_launch_enabled).
//
// The contract, for every kernel launched with the attribute:
//  * no thread reads global memory that a previous kernel may write, nor writes global memory
//    that a previous kernel may read, before it has executed pdl_wait() (the wait is per thread).
//    Kernel parameters (tensor maps included) are not such memory.
//  * L2 prefetches may precede the wait: L2 is the point of coherence for global memory, so a
//    prefetched line that the previous kernel then writes is updated there, never stale.
// A kernel launched without the attribute passes pdl_wait() at once, so the same code serves
// both. pdl_allow_dependents() lets the next PDL-launched kernel's CTAs take SMs as this
// kernel's CTAs leave them; it makes nothing visible early (the next kernel's wait is for this
// whole grid's completion and its writes).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>

namespace kbit::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether a launch on `stream` sets the attribute: not while the stream is being captured into a
// CUDA graph, and not where the environment has KBIT_JAX_PDL=0 (read once per process; an escape
// hatch for comparisons and for drivers that mishandle PDL). XLA's command buffers capture each
// custom call into a graph of its own, where the kernel has no kernel predecessor for the
// attribute to act on; launched plainly instead, the kernel knows its inputs are visible at
// entry and starts its first copies there (Params::inputs_ready).
inline bool dependent_launch_enabled(cudaStream_t stream) {
  static const bool enabled = [] {
    const char* v = std::getenv("KBIT_JAX_PDL");
    return v == nullptr || v[0] != '0';
  }();
  if (!enabled) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();  // (clear it) unknown: a plain launch is correct either way
    return false;
  }
  return status == cudaStreamCaptureStatusNone;
}

}  // namespace kbit::cuda
