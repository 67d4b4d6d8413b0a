// The gated-linear-unit epilogue of kbit_matmul, shared by the CPU and CUDA kernels (and, by
// value, kbit_jax/reference.py `GLU_ACTIVATIONS`): with a `glu` attribute other than kGluNone
// the product y[.., N] is reduced to out[.., N/2] with out[j] = act(y[2j]) * y[2j+1] (gate
// column 2j, up column 2j+1: the interleaved gate/up weight of a SwiGLU/GeGLU MLP), evaluated
// in float32 on the float32 sums, before the one rounding to the output dtype.
//
// Both gates are g * sigmoid(logit(g)): silu is g * sigmoid(g), and the tanh-approximate gelu
// 0.5 g (1 + tanh(z)) equals g * sigmoid(2 z) with z = sqrt(2/pi) (g + 0.044715 g^3) (the
// sigmoid form also avoids 1 + tanh(z)'s cancellation for negative z).
#pragma once

#include <math.h>

#include <cstdint>

#include "format.h"  // KBIT_HD

namespace kbit {

enum Glu : int32_t {
  kGluNone = 0,
  kGluSilu = 1,      // SwiGLU: silu(g) = g * sigmoid(g)
  kGluGeluTanh = 2,  // GeGLU: gelu with the tanh approximation (jax.nn.gelu's default)
};
constexpr int32_t kGluLast = kGluGeluTanh;

// logit(g) = g (a + b g^2): silu a = 1, b = 0; gelu a = 2 sqrt(2/pi), b = 0.044715 a. One
// formula with per-kind coefficients, so a compiler has no branch to unswitch a loop over.
struct GluLogit {
  float a, b;
  KBIT_HD explicit GluLogit(int32_t kind)
      : a(kind == kGluSilu ? 1.0f : 1.5957691216057308f),
        b(kind == kGluSilu ? 0.0f : 0.044715f * 1.5957691216057308f) {}
  KBIT_HD float operator()(float gate) const { return gate * (a + b * gate * gate); }
};

// act(gate) * up for a kind other than kGluNone; float32-accurate (the CPU kernel and the
// CUDA kernel for float32 activations). expf(-logit) = inf gives -0 or 0, as the limit.
KBIT_HD float glu_apply(const GluLogit& logit, float gate, float up) {
  return gate / (1.0f + expf(-logit(gate))) * up;
}

#if defined(__CUDACC__)
// The same for results rounded to bf16/f16 (the fused tensor-core kernel): the fast exponent
// (MUFU.EX2; 2 + 1.2 |x| ulp) and division (MUFU.RCP; 2 ulp) err by less than 1e-5 relative
// for logits down to -80, where the gate is below 1e-33 g, against half an ulp of f16 (2.4e-4),
// and keep the epilogue short: the accurate expf and IEEE division, unrolled over an item's
// sums at every store site, added ~3000 instructions to each cp.async kernel's item loop. A
// denominator past 2^126 gives 0, as the limit.
__device__ __forceinline__ float glu_apply_fast(const GluLogit& logit, float gate, float up) {
  return __fdividef(gate, 1.0f + __expf(-logit(gate))) * up;
}
#endif

}  // namespace kbit
