// XLA FFI handlers for the CUDA kernels: decode, validate, launch (see cuda_handlers.h).
#include "ffi/cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "cuda/launch.cuh"
#include "cuda/ragged_dot.cuh"
#include "ffi/validate.h"

namespace ffi = xla::ffi;

namespace {

using kbit::cuda::DType;
using kbit::ffi_check::Problem;

DType cuda_dtype(kbit::ffi_check::Float dtype) {
  return kbit::ffi_check::to_kernel_float<DType>(dtype);
}

ffi::Error launch_result(const std::string& msg) {
  if (msg.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(msg);
}

// The operands and sizes that kbit_matmul's and kbit_ragged_dot's launch arguments share.
template <class Args>
void set_product_args(Args& a, const Problem& p, ffi::AnyBuffer x, ffi::AnyBuffer planes,
                      ffi::AnyBuffer scales, ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                      ffi::AnyBuffer y) {
  a.dtype = cuda_dtype(p.dtype);
  a.x = x.untyped_data();
  a.planes = static_cast<const uint32_t*>(planes.untyped_data());
  a.scales = static_cast<const uint8_t*>(scales.untyped_data());
  a.codebook = static_cast<const float*>(codebook.untyped_data());
  a.tensor_scale = static_cast<const float*>(tensor_scale.untyped_data());
  a.y = y.untyped_data();
  a.m = p.m;
  a.k = p.k;
  a.n = p.n;
  a.bits = p.bits;
  a.layout = p.layout;
  a.glu = p.glu;
}

// ---- kbit_quantize ----
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer codebook,
                        ffi::AnyBuffer tensor_scale, ffi::Result<ffi::AnyBuffer> planes,
                        ffi::Result<ffi::AnyBuffer> scales, int32_t layout) {
  Problem p;
  KBIT_RETURN_IF_ERROR(
      kbit::ffi_check::check_quantize(w, codebook, tensor_scale, *planes, *scales, layout, p));
  kbit::cuda::QuantizeArgs a;
  a.w_dtype = cuda_dtype(p.dtype);
  a.w = w.untyped_data();
  a.codebook = static_cast<const float*>(codebook.untyped_data());
  a.tensor_scale = static_cast<const float*>(tensor_scale.untyped_data());
  a.planes = static_cast<uint32_t*>(planes->untyped_data());
  a.scales = static_cast<uint8_t*>(scales->untyped_data());
  a.batch = p.batch;
  a.k = p.k;
  a.n = p.n;
  a.bits = p.bits;
  a.layout = p.layout;
  return launch_result(kbit::cuda::launch_quantize(a, stream));
}

// ---- kbit_dequantize ----
ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer planes, ffi::AnyBuffer scales,
                          ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                          ffi::Result<ffi::AnyBuffer> out, int32_t layout) {
  Problem p;
  KBIT_RETURN_IF_ERROR(
      kbit::ffi_check::check_dequantize(planes, scales, codebook, tensor_scale, *out, layout, p));
  kbit::cuda::DequantizeArgs a;
  a.out_dtype = cuda_dtype(p.dtype);
  a.planes = static_cast<const uint32_t*>(planes.untyped_data());
  a.scales = static_cast<const uint8_t*>(scales.untyped_data());
  a.codebook = static_cast<const float*>(codebook.untyped_data());
  a.tensor_scale = static_cast<const float*>(tensor_scale.untyped_data());
  a.out = out->untyped_data();
  a.batch = p.batch;
  a.k = p.k;
  a.n = p.n;
  a.bits = p.bits;
  a.layout = p.layout;
  return launch_result(kbit::cuda::launch_dequantize(a, stream));
}

// ---- kbit_matmul ----
ffi::Error MatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer planes,
                      ffi::AnyBuffer scales, ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                      ffi::Result<ffi::AnyBuffer> y, int32_t layout, int32_t glu) {
  constexpr const char* kT = "kbit_matmul";
  Problem p;
  KBIT_RETURN_IF_ERROR(kbit::ffi_check::check_matmul(x, planes, scales, codebook, tensor_scale,
                                                     *y, layout, glu, p));
  if (p.n > 0x7fffffff / 8 || p.k > 0x7fffffff)  // the kernels index columns and k in 32 bits
    return kbit::ffi_check::invalid(kT, "the CUDA path needs N < 2^28 and K < 2^31, got K=" +
                                            std::to_string(p.k) + " N=" + std::to_string(p.n));
  kbit::cuda::MatmulArgs a;
  set_product_args(a, p, x, planes, scales, codebook, tensor_scale, *y);
  a.batch = p.batch;
  return launch_result(kbit::cuda::launch_matmul(a, stream));
}

// ---- kbit_ragged_dot ----
ffi::Error RaggedDotImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer planes,
                         ffi::AnyBuffer scales, ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                         ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> y, int32_t layout,
                         int32_t glu) {
  constexpr const char* kT = "kbit_ragged_dot";
  Problem p;
  KBIT_RETURN_IF_ERROR(kbit::ffi_check::check_ragged_dot(x, planes, scales, codebook, tensor_scale,
                                                         group_sizes, *y, layout, glu, p));
  if (p.batch > kbit::cuda::kRaggedDotMaxGroups)
    return kbit::ffi_check::invalid(kT, "the CUDA kernels take at most " +
                                            std::to_string(kbit::cuda::kRaggedDotMaxGroups) +
                                            " groups, got G=" + std::to_string(p.batch));
  if (p.m > 0x3fffffff || p.k / 32 * p.n > 0x7fffffff / 8)  // rows, k-blocks and columns in 32 bits
    return kbit::ffi_check::invalid(kT, "the CUDA path needs M < 2^30 and K/32 * N < 2^28, got M=" +
                                            std::to_string(p.m) + " K=" + std::to_string(p.k) +
                                            " N=" + std::to_string(p.n));
  kbit::cuda::RaggedDotArgs a;
  set_product_args(a, p, x, planes, scales, codebook, tensor_scale, *y);
  a.group_sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  a.groups = p.batch;
  return launch_result(kbit::cuda::launch_ragged_dot(a, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitQuantizeCuda, QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Ret<ffi::AnyBuffer>()  // planes
                                  .Ret<ffi::AnyBuffer>()  // scales
                                  .Attr<int32_t>("layout"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitDequantizeCuda, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // planes
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Ret<ffi::AnyBuffer>()  // w
                                  .Attr<int32_t>("layout"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitMatmulCuda, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // planes
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("glu"),
                              {ffi::Traits::kCmdBufferCompatible});

// Command-buffer compatible: the launcher reads group_sizes on the device only, allocates
// nothing and never synchronizes.
XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitRaggedDotCuda, RaggedDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // planes
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("glu"),
                              {ffi::Traits::kCmdBufferCompatible});
