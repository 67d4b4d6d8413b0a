// nanobind module _kbit_cuda: the CUDA FFI targets and the build information.
//   registrations() -> {"kbit_quantize": capsule, "kbit_dequantize": capsule, "kbit_matmul": capsule,
//                      "kbit_ragged_dot": capsule}
//   build_info()    -> {"cuda_version": "13.0", "cuda_archs": "90", "cudart_version": 13000, ...}
//   wgmma_rows(n, k, bits)      -> (min, max): the rows that take the wgmma kernel here (the lowering)
//   wgmma_rule_rows(n, k, bits) -> (min, max): the rule alone, as on a wgmma device (tests)
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
    d["kbit_ragged_dot"] = encapsulate(KbitRaggedDotCuda);
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
    return d;
  });
  // (min, max) rows for which bf16 products take the wgmma kernel on the current device ((0, 0):
  // none), as launch_matmul decides; the lowering asks at trace time.
  m.def("wgmma_rows", [](int64_t n, int64_t k, int bits) {
    const auto [lo, hi] = kbit::cuda::wgmma_rows_here(n, k, bits);
    return nb::make_tuple(lo, hi);
  });
  // The rule alone, as on a device with the wgmma kernel (tests lower for one on any machine).
  m.def("wgmma_rule_rows", [](int64_t n, int64_t k, int bits) {
    const auto [lo, hi] = kbit::cuda::wgmma_rule_rows(n, k, bits);
    return nb::make_tuple(lo, hi);
  });
}
