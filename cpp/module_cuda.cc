// nanobind module _kbit_cuda: the CUDA FFI targets and the build information.
//   registrations() -> {"kbit_quantize": capsule, "kbit_dequantize": capsule, "kbit_matmul": capsule}
//   build_info()    -> {"cuda_version": "13.0", "cuda_archs": "90", "cudart_version": 13000, ...}
//   wgmma_rule_rows(n, k, bits) -> (min, max): kbit::cuda::wgmma_rule_rows, for tests
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda/launch.cuh"
#include "ffi/cuda_handlers.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_kbit_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["kbit_quantize"] = encapsulate(KbitQuantizeCuda);
    d["kbit_dequantize"] = encapsulate(KbitDequantizeCuda);
    d["kbit_matmul"] = encapsulate(KbitMatmulCuda);
    return d;
  });
  m.def("build_info", []() {
    nb::dict d;
    d["cuda_version"] = kbit::cuda::compiled_cuda_version();  // nvcc that compiled the kernels
    d["cuda_archs"] = kbit::cuda::compiled_archs();           // e.g. "90"
    d["cudart_version"] = CUDART_VERSION;                     // headers of the linked runtime
    int runtime = 0, driver = 0;
    d["cuda_runtime_version"] = cudaRuntimeGetVersion(&runtime) == cudaSuccess ? runtime : -1;
    // 0 when no driver is installed (a machine without a GPU); never raises.
    d["cuda_driver_version"] = cudaDriverGetVersion(&driver) == cudaSuccess ? driver : -1;
    d["fused_matmul"] = "bf16/f16 activations, fragment layout (layout=1); others: generic SIMT kernel";
    // bf16 products of wgmma_min_m..wgmma_max_m rows take the wgmma kernel (0: not on this
    // device); the early ones (bits >= wgmma_early_bits; else N >= wgmma_early_min_n with K * N <=
    // wgmma_early_max_weights, or N of wgmma_early_band_min_n..wgmma_early_band_max_n) from
    // wgmma_early_min_m rows; those of bits >= wgmma_early_bits up to wgmma_wide_bits_max_m
    // (kbit::cuda::WgmmaRule).
    const kbit::cuda::WgmmaRule rule = kbit::cuda::wgmma_rule_here();
    d["wgmma_min_m"] = rule.min_rows;
    d["wgmma_early_min_m"] = rule.early_min_rows;
    d["wgmma_max_m"] = rule.max_rows;
    d["wgmma_wide_bits_max_m"] = rule.wide_bits_max_rows;
    d["wgmma_early_bits"] = rule.early_bits;
    d["wgmma_early_min_n"] = rule.early_min_n;
    d["wgmma_early_max_weights"] = rule.early_max_weights;
    d["wgmma_early_band_min_n"] = rule.early_band_min_n;
    d["wgmma_early_band_max_n"] = rule.early_band_max_n;
    return d;
  });
  m.def("wgmma_rule_rows", [](int64_t n, int64_t k, int bits) {
    const auto [lo, hi] = kbit::cuda::wgmma_rule_rows(n, k, bits);
    return nb::make_tuple(lo, hi);
  });
}
