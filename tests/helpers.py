"""Shared test utilities: random weights, error bounds derived from the arithmetic."""

import jax.numpy as jnp
import numpy as np

import kbit_jax as kj
from kbit_jax import format as fmt

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
