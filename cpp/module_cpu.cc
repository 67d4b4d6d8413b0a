// Python module _kbit_cpu: hands the CPU FFI handlers to kbit_jax/_ext.py, which registers them
// with jax.ffi.register_ffi_target(name, capsule, platform="cpu").
#include <nanobind/nanobind.h>

#include <type_traits>

#include "ffi/cpu_handlers.h"

namespace nb = nanobind;

namespace {

template <typename Handler>
nb::capsule as_capsule(Handler* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Handler, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_kbit_cpu, m) {
  m.doc() = "kbit_jax CPU kernels as XLA FFI handlers";
  m.def(
      "registrations",
      [] {
        nb::dict targets;
        targets["kbit_quantize"] = as_capsule(KbitQuantizeCpu);
        targets["kbit_dequantize"] = as_capsule(KbitDequantizeCpu);
        targets["kbit_matmul"] = as_capsule(KbitMatmulCpu);
        targets["kbit_ragged_dot"] = as_capsule(KbitRaggedDotCpu);
        return targets;
      },
      "FFI target name -> handler capsule, for jax.ffi.register_ffi_target(platform='cpu').");
}
