// What the standalone probes (launch_floor_probe.cu, handover_probe.cu) share: error checks, the
// copy speed their streaming rates are measured against, and the time of one CUDA graph launch.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// A failed CUDA call ends the probe with its message and place.
inline void probe_check(cudaError_t e, const char* file, int line) {
  if (e == cudaSuccess) return;
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), file, line);
  exit(1);
}
#define CK(x) probe_check((x), __FILE__, __LINE__)

// Device-to-device copy speed in GB/s (bytes read + written): the best of 5 copies of one half of
// `buf` into the other.
inline double copy_gbs(uint8_t* buf, size_t bytes, cudaStream_t s, cudaEvent_t a, cudaEvent_t b) {
  float best = 1e9f;
  for (int r = 0; r < 5; ++r) {
    CK(cudaEventRecord(a, s));
    CK(cudaMemcpyAsync(buf + bytes / 2, buf, bytes / 2, cudaMemcpyDeviceToDevice, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  return 2.0 * (bytes / 2) / (best * 1e-3) / 1e9;
}

// The device, and a stream with two events to time it by.
struct Probe {
  int sms = 0;
  cudaDeviceProp prop;
  cudaStream_t s;
  cudaEvent_t a, b;
  Probe() {
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaGetDeviceProperties(&prop, 0));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  // The copy speed through `buf` (copy_gbs), printed with the device's name.
  double copy_speed(uint8_t* buf, size_t bytes) {
    const double gbs = copy_gbs(buf, bytes, s, a, b);
    printf("device: %s, %d SMs; device-to-device copy: %.0f GB/s (read + write)\n", prop.name, sms, gbs);
    return gbs;
  }
};

// Milliseconds of one launch of `exec` on `s`, between events a and b.
inline float graph_launch_ms(cudaGraphExec_t exec, cudaStream_t s, cudaEvent_t a, cudaEvent_t b) {
  CK(cudaEventRecord(a, s));
  CK(cudaGraphLaunch(exec, s));
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float ms;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}
