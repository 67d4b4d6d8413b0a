// XLA FFI handlers of the CUDA kernels (platform "CUDA"): kbit_quantize, kbit_dequantize,
// kbit_matmul, kbit_ragged_dot. Each decodes its buffers and the `layout` attribute, validates
// shapes and dtypes (errors name the target, the operand and the expected vs actual value), and
// calls the launcher in cpp/cuda. All are declared command-buffer compatible: they allocate
// nothing, never synchronize, and read no device memory on the host.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* KbitQuantizeCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KbitDequantizeCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KbitMatmulCuda(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* KbitRaggedDotCuda(XLA_FFI_CallFrame* call_frame);
}
