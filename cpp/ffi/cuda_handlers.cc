// XLA FFI handlers for the CUDA kernels: decode, validate, launch (see cuda_handlers.h).
#include "ffi/cuda_handlers.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "cuda/launch.cuh"
#include "format.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using kbit::cuda::DType;

std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

const char* ffi_dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::F64: return "float64";
    default: return "another dtype";
  }
}

ffi::Error bad(const char* target, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + what);
}

// Float dtype of an activation/weight buffer, or false.
bool float_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

ffi::Error check_rank(const char* target, const char* operand, const ffi::AnyBuffer& buf,
                      size_t rank, const char* layout) {
  if (buf.dimensions().size() != rank)
    return bad(target, std::string("operand '") + operand + "' must have rank " +
                           std::to_string(rank) + " " + layout + ", got shape " +
                           dims_str(buf.dimensions()));
  return ffi::Error::Success();
}

ffi::Error check_dtype(const char* target, const char* operand, const ffi::AnyBuffer& buf,
                       ffi::DataType want) {
  if (buf.element_type() != want)
    return bad(target, std::string("operand '") + operand + "' must be " + ffi_dtype_name(want) +
                           ", got " + ffi_dtype_name(buf.element_type()));
  return ffi::Error::Success();
}

ffi::Error check_dim(const char* target, const char* operand, const ffi::AnyBuffer& buf, int axis,
                     int64_t want, const char* meaning) {
  const int64_t got = buf.dimensions()[axis];
  if (got != want)
    return bad(target, std::string("operand '") + operand + "' axis " + std::to_string(axis) +
                           " (" + meaning + ") must be " + std::to_string(want) + ", got " +
                           std::to_string(got) + " (shape " + dims_str(buf.dimensions()) + ")");
  return ffi::Error::Success();
}

#define KBIT_RETURN_IF_ERROR(expr)      \
  do {                                  \
    ffi::Error _e = (expr);             \
    if (_e.failure()) return _e;        \
  } while (0)

ffi::Error check_layout(const char* target, int32_t layout) {
  if (layout != kbit::kPlanes && layout != kbit::kFragment)
    return bad(target, "attribute 'layout' must be 0 (planes) or 1 (fragment), got " +
                           std::to_string(layout));
  return ffi::Error::Success();
}

// The quantized operands shared by dequantize and matmul: planes [B, KB, N, bits],
// scales [B, KB, N], codebook [B, 2^bits], tensor_scale [B]. Sets batch, kb, n, bits.
ffi::Error check_weight(const char* target, const ffi::AnyBuffer& planes,
                        const ffi::AnyBuffer& scales, const ffi::AnyBuffer& codebook,
                        const ffi::AnyBuffer& tensor_scale, int64_t* batch, int64_t* kb,
                        int64_t* n, int* bits) {
  KBIT_RETURN_IF_ERROR(check_dtype(target, "planes", planes, ffi::DataType::U32));
  KBIT_RETURN_IF_ERROR(check_rank(target, "planes", planes, 4, "[B, K/32, N, bits]"));
  const auto pd = planes.dimensions();
  *batch = pd[0];
  *kb = pd[1];
  *n = pd[2];
  const int64_t b = pd[3];
  if (b < kbit::kMinBits || b > kbit::kMaxBits)
    return bad(target, "operand 'planes' last axis (bits) must be in [2, 5], got " +
                           std::to_string(b) + " (shape " + dims_str(pd) + ")");
  *bits = static_cast<int>(b);
  KBIT_RETURN_IF_ERROR(check_dtype(target, "scales", scales, ffi::DataType::U8));
  KBIT_RETURN_IF_ERROR(check_rank(target, "scales", scales, 3, "[B, K/32, N]"));
  KBIT_RETURN_IF_ERROR(check_dim(target, "scales", scales, 0, *batch, "B"));
  KBIT_RETURN_IF_ERROR(check_dim(target, "scales", scales, 1, *kb, "K/32"));
  KBIT_RETURN_IF_ERROR(check_dim(target, "scales", scales, 2, *n, "N"));
  KBIT_RETURN_IF_ERROR(check_dtype(target, "codebook", codebook, ffi::DataType::F32));
  KBIT_RETURN_IF_ERROR(check_rank(target, "codebook", codebook, 2, "[B, 2^bits]"));
  KBIT_RETURN_IF_ERROR(check_dim(target, "codebook", codebook, 0, *batch, "B"));
  KBIT_RETURN_IF_ERROR(check_dim(target, "codebook", codebook, 1, int64_t(1) << *bits, "2^bits"));
  KBIT_RETURN_IF_ERROR(check_dtype(target, "tensor_scale", tensor_scale, ffi::DataType::F32));
  KBIT_RETURN_IF_ERROR(check_rank(target, "tensor_scale", tensor_scale, 1, "[B]"));
  KBIT_RETURN_IF_ERROR(check_dim(target, "tensor_scale", tensor_scale, 0, *batch, "B"));
  return ffi::Error::Success();
}

ffi::Error launch_result(const std::string& msg) {
  if (msg.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(msg);
}

// ---- kbit_quantize ----
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer w, ffi::AnyBuffer codebook,
                        ffi::AnyBuffer tensor_scale, ffi::Result<ffi::AnyBuffer> planes,
                        ffi::Result<ffi::AnyBuffer> scales, int32_t layout) {
  constexpr const char* kT = "kbit_quantize";
  KBIT_RETURN_IF_ERROR(check_layout(kT, layout));
  kbit::cuda::QuantizeArgs a;
  if (!float_dtype(w.element_type(), &a.w_dtype))
    return bad(kT, std::string("operand 'w' must be float32, bfloat16 or float16, got ") +
                       ffi_dtype_name(w.element_type()));
  KBIT_RETURN_IF_ERROR(check_rank(kT, "w", w, 3, "[B, K, N]"));
  const auto wd = w.dimensions();
  const int64_t B = wd[0], K = wd[1], N = wd[2];
  if (K % kbit::kBlockSize != 0)
    return bad(kT, "operand 'w' axis 1 (K) must be a multiple of 32, got " + std::to_string(K));
  int64_t pb = 0, kb = 0, pn = 0;
  int bits = 0;
  KBIT_RETURN_IF_ERROR(check_weight(kT, *planes, *scales, codebook, tensor_scale, &pb, &kb, &pn, &bits));
  if (pb != B || kb != K / 32 || pn != N)
    return bad(kT, "result 'planes' must have shape [B, K/32, N, bits] = [" + std::to_string(B) +
                       ", " + std::to_string(K / 32) + ", " + std::to_string(N) + ", bits], got " +
                       dims_str(planes->dimensions()));
  a.w = w.untyped_data();
  a.codebook = static_cast<const float*>(codebook.untyped_data());
  a.tensor_scale = static_cast<const float*>(tensor_scale.untyped_data());
  a.planes = static_cast<uint32_t*>(planes->untyped_data());
  a.scales = static_cast<uint8_t*>(scales->untyped_data());
  a.batch = B;
  a.k = K;
  a.n = N;
  a.bits = bits;
  a.layout = layout;
  return launch_result(kbit::cuda::launch_quantize(a, stream));
}

// ---- kbit_dequantize ----
ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer planes, ffi::AnyBuffer scales,
                          ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                          ffi::Result<ffi::AnyBuffer> out, int32_t layout) {
  constexpr const char* kT = "kbit_dequantize";
  KBIT_RETURN_IF_ERROR(check_layout(kT, layout));
  int64_t B = 0, KB = 0, N = 0;
  int bits = 0;
  KBIT_RETURN_IF_ERROR(check_weight(kT, planes, scales, codebook, tensor_scale, &B, &KB, &N, &bits));
  kbit::cuda::DequantizeArgs a;
  if (!float_dtype(out->element_type(), &a.out_dtype))
    return bad(kT, std::string("result 'w' must be float32, bfloat16 or float16, got ") +
                       ffi_dtype_name(out->element_type()));
  KBIT_RETURN_IF_ERROR(check_rank(kT, "w (result)", *out, 3, "[B, K, N]"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "w (result)", *out, 0, B, "B"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "w (result)", *out, 1, KB * 32, "K = 32 * planes.shape[1]"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "w (result)", *out, 2, N, "N"));
  a.planes = static_cast<const uint32_t*>(planes.untyped_data());
  a.scales = static_cast<const uint8_t*>(scales.untyped_data());
  a.codebook = static_cast<const float*>(codebook.untyped_data());
  a.tensor_scale = static_cast<const float*>(tensor_scale.untyped_data());
  a.out = out->untyped_data();
  a.batch = B;
  a.k = KB * 32;
  a.n = N;
  a.bits = bits;
  a.layout = layout;
  return launch_result(kbit::cuda::launch_dequantize(a, stream));
}

// ---- kbit_matmul ----
ffi::Error MatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer planes,
                      ffi::AnyBuffer scales, ffi::AnyBuffer codebook, ffi::AnyBuffer tensor_scale,
                      ffi::Result<ffi::AnyBuffer> y, int32_t layout) {
  constexpr const char* kT = "kbit_matmul";
  KBIT_RETURN_IF_ERROR(check_layout(kT, layout));
  kbit::cuda::MatmulArgs a;
  if (!float_dtype(x.element_type(), &a.dtype))
    return bad(kT, std::string("operand 'x' must be float32, bfloat16 or float16, got ") +
                       ffi_dtype_name(x.element_type()));
  KBIT_RETURN_IF_ERROR(check_rank(kT, "x", x, 3, "[B, M, K]"));
  int64_t B = 0, KB = 0, N = 0;
  int bits = 0;
  KBIT_RETURN_IF_ERROR(check_weight(kT, planes, scales, codebook, tensor_scale, &B, &KB, &N, &bits));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "x", x, 0, B, "B, the batch axis of planes"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "x", x, 2, KB * 32, "K = 32 * planes.shape[1]"));
  const int64_t M = x.dimensions()[1];
  if (y->element_type() != x.element_type())
    return bad(kT, std::string("result 'y' must have the dtype of x (") +
                       ffi_dtype_name(x.element_type()) + "), got " + ffi_dtype_name(y->element_type()));
  KBIT_RETURN_IF_ERROR(check_rank(kT, "y (result)", *y, 3, "[B, M, N]"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "y (result)", *y, 0, B, "B"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "y (result)", *y, 1, M, "M"));
  KBIT_RETURN_IF_ERROR(check_dim(kT, "y (result)", *y, 2, N, "N"));
  if (N > 0x7fffffff / 8 || KB > 0x7fffffff / 32)
    return bad(kT, "K and N must each be below 2^28 on the CUDA path, got K=" +
                       std::to_string(KB * 32) + " N=" + std::to_string(N));
  a.x = x.untyped_data();
  a.planes = static_cast<const uint32_t*>(planes.untyped_data());
  a.scales = static_cast<const uint8_t*>(scales.untyped_data());
  a.codebook = static_cast<const float*>(codebook.untyped_data());
  a.tensor_scale = static_cast<const float*>(tensor_scale.untyped_data());
  a.y = y->untyped_data();
  a.batch = B;
  a.m = M;
  a.k = KB * 32;
  a.n = N;
  a.bits = bits;
  a.layout = layout;
  return launch_result(kbit::cuda::launch_matmul(a, stream));
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
                                  .Attr<int32_t>("layout"),
                              {ffi::Traits::kCmdBufferCompatible});
