// XLA FFI handlers for the CPU kernels: decode the buffers, validate every shape, dtype and
// attribute against cpp/README.md, call the kernel. A failure is an ffi::Error naming the
// target, the operand and expected vs actual; nothing here aborts.
#include "ffi/cpu_handlers.h"

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/kbit_cpu.h"
#include "format.h"

namespace {

namespace ffi = xla::ffi;
using kbit::cpu::FloatType;
using kbit::cpu::PackedWeight;
using kbit::cpu::WeightShape;
using Dims = ffi::Span<const int64_t>;

std::string dims_string(Dims dims) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << ']';
  return out.str();
}

std::string dims_string(const std::vector<int64_t>& dims) { return dims_string(Dims(dims)); }

ffi::Error invalid(const char* target, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + message);
}

// `what` names the axes, e.g. "[B, K/32, N]".
ffi::Error check_shape(const char* target, const char* operand, const char* what, Dims actual,
                       const std::vector<int64_t>& expected) {
  if (actual == Dims(expected)) return ffi::Error::Success();
  return invalid(target, std::string(operand) + " must have shape " + what + " = " +
                             dims_string(expected) + ", got " + dims_string(actual));
}

ffi::Error check_rank(const char* target, const char* operand, const char* what, Dims actual,
                      size_t rank) {
  if (actual.size() == rank) return ffi::Error::Success();
  return invalid(target, std::string(operand) + " must have rank " + std::to_string(rank) + " " +
                             what + ", got shape " + dims_string(actual));
}

std::optional<FloatType> float_type(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return FloatType::kF32;
    case ffi::DataType::BF16: return FloatType::kBF16;
    case ffi::DataType::F16: return FloatType::kF16;
    default: return std::nullopt;
  }
}

std::string dtype_string(ffi::DataType dtype) {
  std::ostringstream out;
  out << dtype;
  return out.str();
}

ffi::Error check_float_type(const char* target, const char* operand, ffi::DataType dtype) {
  if (float_type(dtype)) return ffi::Error::Success();
  return invalid(target, std::string(operand) + " must be F32, BF16 or F16, got " +
                             dtype_string(dtype));
}

ffi::Error check_layout(const char* target, int32_t layout) {
  if (layout == kbit::kPlanes || layout == kbit::kFragment) return ffi::Error::Success();
  return invalid(target, "attribute layout must be 0 (planes) or 1 (fragment), got " +
                             std::to_string(layout));
}

// Reads B, K/32, N and bits off planes [B, K/32, N, bits] and checks scales, codebook and
// tensor_scale against them: the part of validation all three targets share.
ffi::Error check_weight(const char* target, Dims planes, Dims scales, Dims codebook,
                        Dims tensor_scale, int32_t layout, WeightShape& shape) {
  if (auto error = check_layout(target, layout); error.failure()) return error;
  if (auto error = check_rank(target, "planes", "[B, K/32, N, bits]", planes, 4); error.failure())
    return error;
  const int64_t batch = planes[0], blocks = planes[1], n = planes[2], bits = planes[3];
  if (bits < kbit::kMinBits || bits > kbit::kMaxBits)
    return invalid(target, "planes.dim(3) is bits and must be in [2, 5], got " +
                               std::to_string(bits) + " (planes shape " + dims_string(planes) +
                               ")");
  if (auto error = check_shape(target, "scales", "[B, K/32, N]", scales, {batch, blocks, n});
      error.failure())
    return error;
  if (auto error = check_shape(target, "codebook", "[B, 2^bits]", codebook,
                               {batch, int64_t(1) << bits});
      error.failure())
    return error;
  if (auto error = check_shape(target, "tensor_scale", "[B]", tensor_scale, {batch});
      error.failure())
    return error;
  shape = WeightShape{batch, blocks * kbit::kBlockSize, n, int(bits), kbit::Layout(layout)};
  return ffi::Error::Success();
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

ffi::Error quantize_impl(ffi::AnyBuffer w, ffi::Buffer<ffi::F32> codebook,
                         ffi::Buffer<ffi::F32> tensor_scale,
                         ffi::Result<ffi::Buffer<ffi::U32>> planes,
                         ffi::Result<ffi::Buffer<ffi::U8>> scales, int32_t layout) {
  constexpr const char* kTarget = "kbit_quantize";
  if (auto error = check_float_type(kTarget, "w", w.element_type()); error.failure()) return error;
  const Dims w_dims = w.dimensions();
  if (auto error = check_rank(kTarget, "w", "[B, K, N]", w_dims, 3); error.failure()) return error;
  if (w_dims[1] % kbit::kBlockSize != 0)
    return invalid(kTarget, "w.dim(1) is K and must be a multiple of 32, got shape " +
                                dims_string(w_dims));
  WeightShape shape;
  if (auto error = check_weight(kTarget, planes->dimensions(), scales->dimensions(),
                                codebook.dimensions(), tensor_scale.dimensions(), layout, shape);
      error.failure())
    return error;
  if (auto error = check_shape(kTarget, "planes", "[B, K/32, N, bits]", planes->dimensions(),
                               {w_dims[0], w_dims[1] / kbit::kBlockSize, w_dims[2], shape.bits});
      error.failure())
    return error;
  return run_kernel(kTarget, [&] {
    kbit::cpu::quantize(w.untyped_data(), *float_type(w.element_type()), codebook.typed_data(),
                        tensor_scale.typed_data(), shape, planes->typed_data(),
                        scales->typed_data());
  });
}

ffi::Error dequantize_impl(ffi::Buffer<ffi::U32> planes, ffi::Buffer<ffi::U8> scales,
                           ffi::Buffer<ffi::F32> codebook, ffi::Buffer<ffi::F32> tensor_scale,
                           ffi::Result<ffi::AnyBuffer> w, int32_t layout) {
  constexpr const char* kTarget = "kbit_dequantize";
  WeightShape shape;
  if (auto error = check_weight(kTarget, planes.dimensions(), scales.dimensions(),
                                codebook.dimensions(), tensor_scale.dimensions(), layout, shape);
      error.failure())
    return error;
  if (auto error = check_float_type(kTarget, "w (result)", w->element_type()); error.failure())
    return error;
  if (auto error = check_shape(kTarget, "w (result)", "[B, K, N]", w->dimensions(),
                               {shape.batch, shape.k, shape.n});
      error.failure())
    return error;
  const PackedWeight weight{planes.typed_data(), scales.typed_data(), codebook.typed_data(),
                            tensor_scale.typed_data(), shape};
  return run_kernel(kTarget, [&] {
    kbit::cpu::dequantize(weight, *float_type(w->element_type()), w->untyped_data());
  });
}

ffi::Error matmul_impl(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> planes, ffi::Buffer<ffi::U8> scales,
                       ffi::Buffer<ffi::F32> codebook, ffi::Buffer<ffi::F32> tensor_scale,
                       ffi::Result<ffi::AnyBuffer> y, int32_t layout) {
  constexpr const char* kTarget = "kbit_matmul";
  WeightShape shape;
  if (auto error = check_weight(kTarget, planes.dimensions(), scales.dimensions(),
                                codebook.dimensions(), tensor_scale.dimensions(), layout, shape);
      error.failure())
    return error;
  if (auto error = check_float_type(kTarget, "x", x.element_type()); error.failure()) return error;
  const Dims x_dims = x.dimensions();
  if (auto error = check_rank(kTarget, "x", "[B, M, K]", x_dims, 3); error.failure()) return error;
  const int64_t m = x_dims[1];
  if (auto error = check_shape(kTarget, "x", "[B, M, K] with K = 32 * planes.dim(1)", x_dims,
                               {shape.batch, m, shape.k});
      error.failure())
    return error;
  if (y->element_type() != x.element_type())
    return invalid(kTarget, "y (result) must have x's dtype " + dtype_string(x.element_type()) +
                                ", got " + dtype_string(y->element_type()));
  if (auto error = check_shape(kTarget, "y (result)", "[B, M, N]", y->dimensions(),
                               {shape.batch, m, shape.n});
      error.failure())
    return error;
  const PackedWeight weight{planes.typed_data(), scales.typed_data(), codebook.typed_data(),
                            tensor_scale.typed_data(), shape};
  return run_kernel(kTarget, [&] {
    kbit::cpu::matmul(x.untyped_data(), *float_type(x.element_type()), m, weight,
                      y->untyped_data());
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitQuantizeCpu, quantize_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()              // w
                                  .Arg<ffi::Buffer<ffi::F32>>()       // codebook
                                  .Arg<ffi::Buffer<ffi::F32>>()       // tensor_scale
                                  .Ret<ffi::Buffer<ffi::U32>>()       // planes
                                  .Ret<ffi::Buffer<ffi::U8>>()        // scales
                                  .Attr<int32_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitDequantizeCpu, dequantize_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()       // planes
                                  .Arg<ffi::Buffer<ffi::U8>>()        // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()       // codebook
                                  .Arg<ffi::Buffer<ffi::F32>>()       // tensor_scale
                                  .Ret<ffi::AnyBuffer>()              // w
                                  .Attr<int32_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KbitMatmulCpu, matmul_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()              // x
                                  .Arg<ffi::Buffer<ffi::U32>>()       // planes
                                  .Arg<ffi::Buffer<ffi::U8>>()        // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()       // codebook
                                  .Arg<ffi::Buffer<ffi::F32>>()       // tensor_scale
                                  .Ret<ffi::AnyBuffer>()              // y
                                  .Attr<int32_t>("layout"));
