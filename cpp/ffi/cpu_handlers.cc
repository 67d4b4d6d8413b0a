// XLA FFI handlers for the CPU kernels: validate the operands (ffi/validate.h, shared with the
// CUDA handlers), call the kernel. A failure is an ffi::Error naming the target, the operand
// and expected vs actual; nothing here aborts.
#include "ffi/cpu_handlers.h"

#include <exception>
#include <new>
#include <string>

#include "cpu/kbit_cpu.h"
#include "ffi/validate.h"

namespace {

namespace ffi = xla::ffi;
using kbit::cpu::FloatType;
using kbit::ffi_check::Problem;

FloatType float_type(kbit::ffi_check::Float dtype) {
  return kbit::ffi_check::to_kernel_float<FloatType>(dtype);
}

kbit::cpu::WeightShape weight_shape(const Problem& p) {
  return {p.batch, p.k, p.n, p.bits, p.layout};
}

kbit::cpu::PackedWeight packed_weight(const ffi::AnyBuffer& planes, const ffi::AnyBuffer& scales,
                                      const ffi::AnyBuffer& codebook,
                                      const ffi::AnyBuffer& tensor_scale, const Problem& p) {
  return {static_cast<const uint32_t*>(planes.untyped_data()),
          static_cast<const uint8_t*>(scales.untyped_data()),
          static_cast<const float*>(codebook.untyped_data()),
          static_cast<const float*>(tensor_scale.untyped_data()), weight_shape(p)};
}

// Kernels only throw for host memory or thread start-up failures; report, never propagate.
template <class Kernel>
ffi::Error run_kernel(const char* target, Kernel&& kernel) {
  try {
    kernel();
    return ffi::Error::Success();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(target) + ": out of host memory for scratch buffers");
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(target) + ": " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(target) + ": unknown C++ exception");
  }
}

ffi::Error quantize_impl(ffi::AnyBuffer w, ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                         ffi::Result<ffi::AnyBuffer> planes, ffi::Result<ffi::AnyBuffer> scales,
                         int32_t layout) {
  Problem p;
  KBIT_RETURN_IF_ERROR(
      kbit::ffi_check::check_quantize(w, codebook, tensor_scale, *planes, *scales, layout, p));
  return run_kernel("kbit_quantize", [&] {
    kbit::cpu::quantize(w.untyped_data(), float_type(p.dtype),
                        static_cast<const float*>(codebook.untyped_data()),
                        static_cast<const float*>(tensor_scale.untyped_data()), weight_shape(p),
                        static_cast<uint32_t*>(planes->untyped_data()),
                        static_cast<uint8_t*>(scales->untyped_data()));
  });
}

ffi::Error dequantize_impl(ffi::AnyBuffer planes, ffi::AnyBuffer scales, ffi::AnyBuffer codebook,
                           ffi::AnyBuffer tensor_scale, ffi::Result<ffi::AnyBuffer> w,
                           int32_t layout) {
  Problem p;
  KBIT_RETURN_IF_ERROR(
      kbit::ffi_check::check_dequantize(planes, scales, codebook, tensor_scale, *w, layout, p));
  return run_kernel("kbit_dequantize", [&] {
    kbit::cpu::dequantize(packed_weight(planes, scales, codebook, tensor_scale, p),
                          float_type(p.dtype), w->untyped_data());
  });
}

ffi::Error matmul_impl(ffi::AnyBuffer x, ffi::AnyBuffer planes, ffi::AnyBuffer scales,
                       ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                       ffi::Result<ffi::AnyBuffer> y, int32_t layout, int32_t glu) {
  Problem p;
  KBIT_RETURN_IF_ERROR(kbit::ffi_check::check_matmul(x, planes, scales, codebook, tensor_scale,
                                                     *y, layout, glu, p));
  return run_kernel("kbit_matmul", [&] {
    kbit::cpu::matmul(x.untyped_data(), float_type(p.dtype), p.m,
                      packed_weight(planes, scales, codebook, tensor_scale, p), p.glu,
                      y->untyped_data());
  });
}

ffi::Error ragged_dot_impl(ffi::AnyBuffer x, ffi::AnyBuffer planes, ffi::AnyBuffer scales,
                           ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                           ffi::AnyBuffer group_sizes, ffi::Result<ffi::AnyBuffer> y,
                           int32_t layout, int32_t glu) {
  Problem p;
  KBIT_RETURN_IF_ERROR(kbit::ffi_check::check_ragged_dot(x, planes, scales, codebook, tensor_scale,
                                                         group_sizes, *y, layout, glu, p));
  return run_kernel("kbit_ragged_dot", [&] {
    kbit::cpu::ragged_dot(x.untyped_data(), float_type(p.dtype), p.m,
                          packed_weight(planes, scales, codebook, tensor_scale, p),
                          static_cast<const int32_t*>(group_sizes.untyped_data()), p.glu,
                          y->untyped_data());
  });
}

}  // namespace

// Every operand is an AnyBuffer so that a wrong dtype is reported by our validation, naming
// the target, rather than by XLA's generic decoder.
XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitQuantizeCpu, quantize_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Ret<ffi::AnyBuffer>()  // planes
                                  .Ret<ffi::AnyBuffer>()  // scales
                                  .Attr<int32_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitDequantizeCpu, dequantize_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // planes
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Ret<ffi::AnyBuffer>()  // w
                                  .Attr<int32_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitMatmulCpu, matmul_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // planes
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("glu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitRaggedDotCpu, ragged_dot_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // planes
                                  .Arg<ffi::AnyBuffer>()  // scales
                                  .Arg<ffi::AnyBuffer>()  // codebook
                                  .Arg<ffi::AnyBuffer>()  // tensor_scale
                                  .Arg<ffi::AnyBuffer>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("glu"));
