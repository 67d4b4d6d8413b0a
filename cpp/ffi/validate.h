// Operand validation shared by the CPU and CUDA FFI handlers: both platforms accept exactly the
// same shapes and dtypes (cpp/README.md's contract) and reject the rest with the same message,
// which names the target, the operand, and what was expected against what was given.
// Header-only, XLA FFI types only: no kernel headers.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "format.h"
#include "glu.h"
#include "xla/ffi/api/ffi.h"

namespace kbit::ffi_check {

namespace ffi = xla::ffi;

enum class Float { kF32, kBF16, kF16 };

// The same dtype in a kernel library's own enum (each has kF32, kBF16, kF16).
template <class KernelFloat>
KernelFloat to_kernel_float(Float dtype) {
  switch (dtype) {
    case Float::kBF16: return KernelFloat::kBF16;
    case Float::kF16: return KernelFloat::kF16;
    default: return KernelFloat::kF32;
  }
}

// What a call's operands say, once they are known to be consistent.
struct Problem {
  int64_t batch = 0, m = 0, k = 0, n = 0;  // m only for matmul and ragged_dot; n is the weight's N
  int bits = 0;
  int32_t glu = kGluNone;  // matmul and ragged_dot only (glu.h): y has N / 2 columns when set
  Layout layout = kPlanes;
  Float dtype = Float::kF32;  // w (quantize), the result (dequantize) or x and y (matmul)
};

inline std::string dims_string(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << ']';
  return out.str();
}

// NumPy's name for a dtype (what a JAX user writes), not XLA's ("S32", "F64").
inline std::string dtype_string(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S2: return "int2";
    case ffi::DataType::S4: return "int4";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U2: return "uint2";
    case ffi::DataType::U4: return "uint4";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    case ffi::DataType::TOKEN: return "token";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E4M3: return "float8_e4m3";
    case ffi::DataType::F8E3M4: return "float8_e3m4";
    case ffi::DataType::F8E4M3B11FNUZ: return "float8_e4m3b11fnuz";
    case ffi::DataType::F8E5M2FNUZ: return "float8_e5m2fnuz";
    case ffi::DataType::F8E4M3FNUZ: return "float8_e4m3fnuz";
    default: {
      std::ostringstream out;
      out << "XLA type " << dtype;
      return out.str();
    }
  }
}

inline ffi::Error invalid(const char* target, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + message);
}

#define KBIT_RETURN_IF_ERROR(expr)            \
  do {                                        \
    if (auto _error = (expr); _error.failure()) \
      return _error;                          \
  } while (0)

inline ffi::Error check_dtype(const char* target, const char* operand, const ffi::AnyBuffer& buf,
                              ffi::DataType expected) {
  if (buf.element_type() == expected) return ffi::Error::Success();
  return invalid(target, std::string(operand) + " must be " + dtype_string(expected) + ", got " +
                             dtype_string(buf.element_type()));
}

inline ffi::Error check_float(const char* target, const char* operand, const ffi::AnyBuffer& buf,
                              Float& out) {
  switch (buf.element_type()) {
    case ffi::DataType::F32: out = Float::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: out = Float::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: out = Float::kF16; return ffi::Error::Success();
    default:
      return invalid(target, std::string(operand) + " must be float32, bfloat16 or float16, got " +
                                 dtype_string(buf.element_type()));
  }
}

// `axes` names the expected axes, e.g. "[B, K/32, N]"; `expected` their sizes.
inline ffi::Error check_shape(const char* target, const char* operand, const ffi::AnyBuffer& buf,
                              const char* axes, std::initializer_list<int64_t> expected) {
  const auto dims = buf.dimensions();
  bool same = dims.size() == expected.size();
  size_t i = 0;
  for (int64_t e : expected) same = same && dims[i++] == e;
  if (same) return ffi::Error::Success();
  std::ostringstream want;
  want << '[';
  i = 0;
  for (int64_t e : expected) want << (i++ ? ", " : "") << e;
  want << ']';
  return invalid(target, std::string(operand) + " must have shape " + axes + " = " + want.str() +
                             ", got " + dims_string(dims));
}

inline ffi::Error check_rank(const char* target, const char* operand, const ffi::AnyBuffer& buf,
                             const char* axes, size_t rank) {
  if (buf.dimensions().size() == rank) return ffi::Error::Success();
  return invalid(target, std::string(operand) + " must have rank " + std::to_string(rank) + " " +
                             axes + ", got shape " + dims_string(buf.dimensions()));
}

// planes [B, K/32, N, bits] u32, scales [B, K/32, N] u8, codebook [B, 2^bits] f32,
// tensor_scale [B] f32 and the layout attribute: what all three targets share.
inline ffi::Error check_weight(const char* target, const ffi::AnyBuffer& planes,
                               const ffi::AnyBuffer& scales, const ffi::AnyBuffer& codebook,
                               const ffi::AnyBuffer& tensor_scale, int32_t layout, Problem& p) {
  if (layout != kPlanes && layout != kFragment)
    return invalid(target, "attribute layout must be 0 (planes) or 1 (fragment), got " +
                               std::to_string(layout));
  KBIT_RETURN_IF_ERROR(check_dtype(target, "planes", planes, ffi::DataType::U32));
  KBIT_RETURN_IF_ERROR(check_rank(target, "planes", planes, "[B, K/32, N, bits]", 4));
  const auto dims = planes.dimensions();
  const int64_t batch = dims[0], blocks = dims[1], n = dims[2], bits = dims[3];
  if (bits < kMinBits || bits > kMaxBits)
    return invalid(target, "planes.shape[3] is bits and must be in [2, 5], got " +
                               std::to_string(bits) + " (planes shape " + dims_string(dims) + ")");
  KBIT_RETURN_IF_ERROR(check_dtype(target, "scales", scales, ffi::DataType::U8));
  KBIT_RETURN_IF_ERROR(check_shape(target, "scales", scales, "[B, K/32, N]", {batch, blocks, n}));
  KBIT_RETURN_IF_ERROR(check_dtype(target, "codebook", codebook, ffi::DataType::F32));
  KBIT_RETURN_IF_ERROR(
      check_shape(target, "codebook", codebook, "[B, 2^bits]", {batch, int64_t(1) << bits}));
  KBIT_RETURN_IF_ERROR(check_dtype(target, "tensor_scale", tensor_scale, ffi::DataType::F32));
  KBIT_RETURN_IF_ERROR(check_shape(target, "tensor_scale", tensor_scale, "[B]", {batch}));
  p.batch = batch;
  p.k = blocks * kBlockSize;
  p.n = n;
  p.bits = int(bits);
  p.layout = Layout(layout);
  return ffi::Error::Success();
}

// kbit_quantize(w [B, K, N]) -> planes, scales.
inline ffi::Error check_quantize(const ffi::AnyBuffer& w, const ffi::AnyBuffer& codebook,
                                 const ffi::AnyBuffer& tensor_scale, const ffi::AnyBuffer& planes,
                                 const ffi::AnyBuffer& scales, int32_t layout, Problem& p) {
  constexpr const char* kTarget = "kbit_quantize";
  KBIT_RETURN_IF_ERROR(check_float(kTarget, "w", w, p.dtype));
  KBIT_RETURN_IF_ERROR(check_rank(kTarget, "w", w, "[B, K, N]", 3));
  const auto dims = w.dimensions();
  if (dims[1] % kBlockSize != 0)
    return invalid(kTarget, "w.shape[1] is K and must be a multiple of 32, got shape " +
                                dims_string(dims));
  KBIT_RETURN_IF_ERROR(check_weight(kTarget, planes, scales, codebook, tensor_scale, layout, p));
  return check_shape(kTarget, "planes (result)", planes, "[B, K/32, N, bits]",
                     {dims[0], dims[1] / kBlockSize, dims[2], p.bits});
}

// kbit_dequantize(planes, scales, codebook, tensor_scale) -> w [B, K, N].
inline ffi::Error check_dequantize(const ffi::AnyBuffer& planes, const ffi::AnyBuffer& scales,
                                   const ffi::AnyBuffer& codebook,
                                   const ffi::AnyBuffer& tensor_scale, const ffi::AnyBuffer& w,
                                   int32_t layout, Problem& p) {
  constexpr const char* kTarget = "kbit_dequantize";
  KBIT_RETURN_IF_ERROR(check_weight(kTarget, planes, scales, codebook, tensor_scale, layout, p));
  KBIT_RETURN_IF_ERROR(check_float(kTarget, "w (result)", w, p.dtype));
  return check_shape(kTarget, "w (result)", w, "[B, K, N]", {p.batch, p.k, p.n});
}

// The glu attribute of a product whose weight check filled p: a known activation, and an even
// N (gate and up columns come in pairs). Sets p.glu.
inline ffi::Error check_glu(const char* target, int32_t glu, Problem& p) {
  if (glu < kGluNone || glu > kGluLast)
    return invalid(target, "attribute glu must be 0 (none), 1 (silu) or 2 (gelu_tanh), got " +
                               std::to_string(glu));
  if (glu != kGluNone && p.n % 2 != 0)
    return invalid(target, "attribute glu pairs gate and up columns and needs an even N, got N=" +
                               std::to_string(p.n));
  p.glu = glu;
  return ffi::Error::Success();
}

// kbit_matmul(x [B, M, K], planes, scales, codebook, tensor_scale) -> y [B, M, N], x's dtype;
// with the glu attribute set, y [B, M, N / 2] (N even).
inline ffi::Error check_matmul(const ffi::AnyBuffer& x, const ffi::AnyBuffer& planes,
                               const ffi::AnyBuffer& scales, const ffi::AnyBuffer& codebook,
                               const ffi::AnyBuffer& tensor_scale, const ffi::AnyBuffer& y,
                               int32_t layout, int32_t glu, Problem& p) {
  constexpr const char* kTarget = "kbit_matmul";
  KBIT_RETURN_IF_ERROR(check_weight(kTarget, planes, scales, codebook, tensor_scale, layout, p));
  KBIT_RETURN_IF_ERROR(check_glu(kTarget, glu, p));
  KBIT_RETURN_IF_ERROR(check_float(kTarget, "x", x, p.dtype));
  KBIT_RETURN_IF_ERROR(check_rank(kTarget, "x", x, "[B, M, K]", 3));
  p.m = x.dimensions()[1];
  KBIT_RETURN_IF_ERROR(
      check_shape(kTarget, "x", x, "[B, M, K] with K = 32 * planes.shape[1]", {p.batch, p.m, p.k}));
  if (y.element_type() != x.element_type())
    return invalid(kTarget, "y (result) must have x's dtype " + dtype_string(x.element_type()) +
                                ", got " + dtype_string(y.element_type()));
  if (glu != kGluNone)
    return check_shape(kTarget, "y (result)", y, "[B, M, N/2]", {p.batch, p.m, p.n / 2});
  return check_shape(kTarget, "y (result)", y, "[B, M, N]", {p.batch, p.m, p.n});
}

// kbit_ragged_dot(x [M, K], planes [G, K/32, N, bits], scales, codebook, tensor_scale,
// group_sizes int32 [G]) -> y [M, N], x's dtype; with the glu attribute set, y [M, N / 2]
// (N even). The weight's batch axis is the G groups (p.batch = G); x and y have no batch axis.
inline ffi::Error check_ragged_dot(const ffi::AnyBuffer& x, const ffi::AnyBuffer& planes,
                                   const ffi::AnyBuffer& scales, const ffi::AnyBuffer& codebook,
                                   const ffi::AnyBuffer& tensor_scale,
                                   const ffi::AnyBuffer& group_sizes, const ffi::AnyBuffer& y,
                                   int32_t layout, int32_t glu, Problem& p) {
  constexpr const char* kTarget = "kbit_ragged_dot";
  KBIT_RETURN_IF_ERROR(check_weight(kTarget, planes, scales, codebook, tensor_scale, layout, p));
  KBIT_RETURN_IF_ERROR(check_glu(kTarget, glu, p));
  KBIT_RETURN_IF_ERROR(check_dtype(kTarget, "group_sizes", group_sizes, ffi::DataType::S32));
  KBIT_RETURN_IF_ERROR(check_shape(kTarget, "group_sizes", group_sizes, "[G] with G = planes.shape[0]",
                                   {p.batch}));
  KBIT_RETURN_IF_ERROR(check_float(kTarget, "x", x, p.dtype));
  KBIT_RETURN_IF_ERROR(check_rank(kTarget, "x", x, "[M, K]", 2));
  p.m = x.dimensions()[0];
  KBIT_RETURN_IF_ERROR(
      check_shape(kTarget, "x", x, "[M, K] with K = 32 * planes.shape[1]", {p.m, p.k}));
  if (y.element_type() != x.element_type())
    return invalid(kTarget, "y (result) must have x's dtype " + dtype_string(x.element_type()) +
                                ", got " + dtype_string(y.element_type()));
  if (glu != kGluNone) return check_shape(kTarget, "y (result)", y, "[M, N/2]", {p.m, p.n / 2});
  return check_shape(kTarget, "y (result)", y, "[M, N]", {p.m, p.n});
}

}  // namespace kbit::ffi_check
