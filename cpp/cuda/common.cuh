// Device-side helpers shared by the kbit CUDA kernels: activation-type traits, the tensor-core
// and shared-memory instructions the kernels use (as inline PTX, so the SASS is predictable),
// the static switches that turn runtime (bits, dtype, layout) into template parameters, and the
// launch-check helper. Only included by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "cuda/launch.cuh"
#include "format.h"

namespace kbit::cuda {

// ---------------------------------------------------------------------------------------------
// Static switches (FlashAttention style): one runtime value -> one constexpr in a lambda body.
// Every instantiated kernel comes from these lists, so adding a case here is the only place a
// new bits value or dtype has to be registered.
// ---------------------------------------------------------------------------------------------
#define KBIT_BITS_SWITCH(VALUE, NAME, ...)                    \
  [&]() -> std::string {                                      \
    switch (VALUE) {                                          \
      case 2: { constexpr int NAME = 2; return __VA_ARGS__(); } \
      case 3: { constexpr int NAME = 3; return __VA_ARGS__(); } \
      case 4: { constexpr int NAME = 4; return __VA_ARGS__(); } \
      case 5: { constexpr int NAME = 5; return __VA_ARGS__(); } \
      default: return std::string("unsupported bits value ") + std::to_string(VALUE); \
    }                                                         \
  }()

#define KBIT_LAYOUT_SWITCH(VALUE, NAME, ...)                                    \
  [&]() -> std::string {                                                        \
    if ((VALUE) == ::kbit::kPlanes) { constexpr int NAME = ::kbit::kPlanes; return __VA_ARGS__(); } \
    if ((VALUE) == ::kbit::kFragment) { constexpr int NAME = ::kbit::kFragment; return __VA_ARGS__(); } \
    return std::string("unsupported layout ") + std::to_string(VALUE);          \
  }()

// Any of the three storage dtypes (quantize input, dequantize output, generic matmul).
#define KBIT_DTYPE_SWITCH(VALUE, TYPE, ...)                                       \
  [&]() -> std::string {                                                          \
    switch (VALUE) {                                                              \
      case ::kbit::cuda::DType::kF32: { using TYPE = float; return __VA_ARGS__(); } \
      case ::kbit::cuda::DType::kBF16: { using TYPE = __nv_bfloat16; return __VA_ARGS__(); } \
      case ::kbit::cuda::DType::kF16: { using TYPE = __half; return __VA_ARGS__(); } \
    }                                                                             \
    return std::string("unsupported dtype");                                      \
  }()

// ---------------------------------------------------------------------------------------------
// Scalar conversions (round to nearest even, as the reference does).
// ---------------------------------------------------------------------------------------------
template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// Activation types of the tensor-core path. `pack2` builds the 32-bit operand register of two
// 16-bit values with `lo` in the low half (the lower k of an mma operand pair).
struct ActBF16 {
  using T = __nv_bfloat16;
  static constexpr const char* kName = "bf16";
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
struct ActF16 {
  using T = __half;
  static constexpr const char* kName = "f16";
  __device__ __forceinline__ static uint32_t pack2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// D = A * B + C for one m16n8k16 tile, fp32 accumulation. A: 4 registers (row-major 16x16),
// B: 2 registers (col-major 16x8), C/D: 4 fp32. See the PTX ISA "mma.m16n8k16" fragment maps.
template <class Act>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1, const float (&c)[4]);
template <>
__device__ __forceinline__ void mma_16816<ActBF16>(float (&d)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
template <>
__device__ __forceinline__ void mma_16816<ActF16>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1, const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// ---------------------------------------------------------------------------------------------
// Shared memory through 32-bit shared-window addresses: the lookup-table addresses are built
// with one PRMT/LOP3 and must not pay for 64-bit generic-pointer arithmetic.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ float4 lds128f(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 lds64f(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                       uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c),
               "r"(d));
}
__device__ __forceinline__ void sts32f(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v));
}
// Four 8x8 b16 matrices; lane l supplies the address of row l%8 of matrix l/8 and receives
// (row l/4, cols 2(l%4), 2(l%4)+1) of each matrix: exactly an mma B-operand pair.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Asynchronous global->shared copies of 16 bytes that bypass L1 (activations are re-read by
// other CTAs from L2; keeping them out of L1 leaves it to the streamed weights' misses).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Streaming loads for data read exactly once (weights, scales): ld.global.cs marks the lines
// evict-first in L1 and L2 so they do not push out the activations.
__device__ __forceinline__ uint32_t ldg_stream(const uint32_t* p) { return __ldcs(p); }
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) { return __ldcs(p); }

// `v` as this lane's shuffle of itself: the same value, which ptxas cannot recompute from the
// thread index (it sees a shuffle), so it keeps it in a register (each 32-bit word of v).
template <class T>
__device__ __forceinline__ T pinned_to_lane(T v, int lane) {
  static_assert(sizeof(T) % 4 == 0, "whole 32-bit words");
  uint32_t w[sizeof(T) / 4];
  memcpy(w, &v, sizeof(T));
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 4); ++i) w[i] = __shfl_sync(0xffffffffu, w[i], lane);
  memcpy(&v, w, sizeof(T));
  return v;
}

// decode_e4m4 in three instructions: the byte shifted to bit 19 is a float with exponent e and
// mantissa m (a denormal when e = 0), and 2^116 = 2^(127-11) rebiases it. Exact for every byte
// (denormal times a power of two, no flush-to-zero in these kernels), equal to format.h's
// decode_e4m4, which the tests check exhaustively in the harness.
__device__ __forceinline__ float decode_e4m4_fast(uint32_t byte_at_19) {
  return __uint_as_float(byte_at_19) * 0x1p116f;
}

// Launch check: returns "" or "<kernel>: <cuda error> (<shape>)".
inline std::string check_launch(const char* kernel, const std::string& shape) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return std::string();
  return std::string(kernel) + " failed to launch: " + cudaGetErrorName(err) + " (" +
         cudaGetErrorString(err) + ") for " + shape;
}

// A cudaLaunchKernelEx configuration, in thread-block clusters of `cluster` CTAs along x when
// cluster > 1, and as a programmatic dependent launch (dependent_launch.cuh) when `dependent`
// (only for kernels that keep that header's contract). cfg.attrs points into the object, so it
// is neither copied nor moved.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2] = {};
  ClusterLaunch(unsigned grid, unsigned threads, size_t smem, cudaStream_t stream, int cluster,
                bool dependent = false) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    if (cluster > 1) {
      cudaLaunchAttribute& a = attr[cfg.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = static_cast<unsigned>(cluster);
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = 1;
    }
    if (dependent) {
      cudaLaunchAttribute& a = attr[cfg.numAttrs++];
      a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      a.val.programmaticStreamSerializationAllowed = 1;
    }
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// ---------------------------------------------------------------------------------------------
// Per-device facts for the launchers. They are cached: a launcher runs on every eager call, and
// a driver query per launch would make small kernels host-bound. The caches are benign-race
// atomics (every writer stores the same value).
// ---------------------------------------------------------------------------------------------
constexpr int kMaxDevices = 64;

inline int current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) dev = 0;
  return dev;
}

inline int device_sm_count(int dev) {
  static std::atomic<int> cache[kMaxDevices];
  int sms = cache[dev].load(std::memory_order_relaxed);
  if (sms > 0) return sms;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 132;
  cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

// The module has the wgmma kernels (CMake compiled the sm_90a target: KBIT_WGMMA) and the current
// device runs them (compute capability 9.0; sm_90a code runs nowhere else).
inline bool wgmma_available() {
#if defined(KBIT_WGMMA)
  static std::atomic<int> cache[kMaxDevices];  // 0: unknown, 1: yes, 2: no
  const int dev = current_device();
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
    v = ok && major == 9 && minor == 0 ? 1 : 2;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v == 1;
#else
  return false;
#endif
}

// Clusters of `ks` CTAs of `kernel` (at `threads` and `smem` bytes of dynamic shared memory) that
// fit on device `dev` at once; half the SMs' worth where the driver cannot say. Callers cache it.
// At ks = 1, the CTAs per SM times the SMs: the cluster query does not describe a launch without
// clusters (the wgmma launcher got half the SMs from it and planned twice the rounds).
template <class Kernel>
int query_max_active_clusters(Kernel kernel, int threads, size_t smem, int ks, int dev) {
  int n = 0;
  if (ks == 1) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) {
      cudaGetLastError();
      n = 1;
    }
    return n * device_sm_count(dev);
  }
  const ClusterLaunch probe(unsigned(ks) * 64, unsigned(threads), smem, nullptr, ks);
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &probe.cfg) != cudaSuccess || n < 1) {
    cudaGetLastError();
    n = std::max(1, device_sm_count(dev) / ks / 2);
  }
  return n;
}

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace kbit::cuda
