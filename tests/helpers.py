"""Shared test utilities: random weights, error bounds derived from the arithmetic."""

import jax.numpy as jnp
import numpy as np

import kbit_jax as kj
from kbit_jax import format as fmt
from kbit_jax import reference

BITS = (2, 3, 4, 5)
LAYOUTS = ("planes", "fragment")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def random_weight(rng, shape, dtype=np.float32):
    """Gaussian with a random scale per column, never exactly zero-filled."""
    w = rng.standard_normal(shape) * rng.uniform(0.01, 2.0, size=shape[-1])
    return jnp.asarray(w.astype(np.float32)).astype(dtype)


def unit_roundoff(dtype) -> float:
    return float(jnp.finfo(dtype).eps) / 2


def dense64(w_q) -> np.ndarray:
    """The exact dequantized weight in float64 (float32 dequantization is exact)."""
    return np.asarray(kj.dequantize(w_q, jnp.float32), np.float64)


def matmul_error_bound(x, w64, out_dtype, weight_dtype):
    """Worst-case |y - y_exact| per output element.

    y is accumulated in float32 (K terms: K * u32 * sum|x||w|), the weights may be rounded to
    the activation dtype twice before the product (the codebook entry, then the entry times its
    block scale in the GPU kernel's N-split tiling with bf16 activations: 2 u_w * sum|x||w|)
    and the result is rounded to the output dtype (u_out * |y|). A factor 2 covers the
    first-order terms' cross terms.
    """
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    y64 = x64 @ w64
    mag = np.abs(x64) @ np.abs(w64)
    k = x64.shape[-1]
    bound = (k * unit_roundoff(jnp.float32) + 2 * unit_roundoff(weight_dtype)) * mag
    bound += unit_roundoff(out_dtype) * np.abs(y64)
    return y64, 2 * bound + np.finfo(np.float32).tiny


def cells_codes(w_q):
    return np.asarray(fmt.unpack_codes(w_q.planes, w_q.layout))


GLU_KINDS = tuple(reference.GLU_ACTIVATIONS)


def _act64(g, kind):
    if kind == "silu":
        return g / (1 + np.exp(-g))
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def glu64(y64, kind):
    """act(y[..., 0::2]) * y[..., 1::2] in float64 (kbit_jax.reference.apply_glu's maths)."""
    return _act64(y64[..., 0::2], kind) * y64[..., 1::2]


def glu_error_bound(x, w64, out_dtype, weight_dtype, kind):
    """Worst-case |glu(y) - glu(y_exact)| per output element: the sums' errors e_g, e_u
    (matmul_error_bound, with a float32 output rounding in place of the final one) through
    act(g) * u, whose slope in g is at most 1.13 |u| (silu: 1.10, tanh-gelu: 1.13), plus the
    float32 evaluation of the gate (a few units in the last place) and the rounding to the
    output dtype."""
    y64, e = matmul_error_bound(x, w64, jnp.float32, weight_dtype)
    g, u = y64[..., 0::2], np.abs(y64[..., 1::2])
    e_g, e_u = e[..., 0::2], e[..., 1::2]
    out64 = glu64(y64, kind)
    bound = 1.13 * e_g * (u + e_u) + np.abs(_act64(g, kind)) * e_u
    bound += (8 * unit_roundoff(jnp.float32) + unit_roundoff(out_dtype)) * np.abs(out64)
    return out64, 2 * bound + np.finfo(np.float32).tiny
