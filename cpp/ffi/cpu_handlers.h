// XLA FFI handlers for the CPU kernels (targets kbit_quantize, kbit_dequantize, kbit_matmul,
// kbit_ragged_dot on platform "cpu"; operands, results and the `layout` attribute as in cpp/README.md).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(KbitQuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KbitDequantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KbitMatmulCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(KbitRaggedDotCpu);
