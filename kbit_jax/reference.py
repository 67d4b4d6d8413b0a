"""Pure-JAX quantize / dequantize / matmul: the executable specification of the format.

Every kernel (C++ CPU, CUDA) is tested against these functions: codes, planes and scales
bit-exactly, dequantized values exactly, matmul within a derived bound. They favour
clarity over speed, and serve as the lowering on platforms without a kernel.
Shapes: ``w[..., K, N]``, ``codebook[..., 2**bits]``, ``tensor_scale[...]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .format import BLOCK, E4M4_MAX, decode_e4m4, encode_e4m4, pack_codes, unpack_codes


#: The smallest tensor_scale: float32's smallest normal number. A smaller power of two would be
#: subnormal, which flush-to-zero float modes (XLA on CPU and GPU) turn into 0.
MIN_TENSOR_SCALE = 2.0 ** -126
#: Blocks whose absmax is at least this have a subnormal reciprocal; they are scaled by
#: LARGE_ABSMAX_PRESCALE (exact) before it is formed (cpp/format.h `normalized`).
LARGE_ABSMAX = 2.0 ** 126
LARGE_ABSMAX_PRESCALE = 2.0 ** -64


def tensor_scale(w: jax.Array) -> jax.Array:
    """Per-matrix scale over the last two axes: the smallest power of two ``s`` with
    ``max|w| / s <= 31`` (E4M4's largest value), at least ``MIN_TENSOR_SCALE``; 1 for an
    all-zero matrix, NaN if any element is not finite."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(-2, -1))
    mantissa, exponent = jnp.frexp(amax)       # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    del mantissa
    # amax / 2^(e-5) = 32 * mantissa lies in [16, 32): fits unless it exceeds 31.
    fits = jnp.ldexp(amax, 5 - exponent) <= E4M4_MAX
    scale_exponent = jnp.maximum(jnp.where(fits, exponent - 5, exponent - 4), -126)
    scale = jnp.ldexp(jnp.ones_like(amax), scale_exponent)
    scale = jnp.where(amax > 0, scale, 1.0)
    return jnp.where(jnp.isfinite(amax), scale, jnp.nan).astype(jnp.float32)


def block_scale_byte(absmax, tensor_scale):
    """encode_e4m4(absmax / tensor_scale), one code lower where rounding up would overflow the
    block's scale decode * tensor_scale in float32 (cpp/format.h `block_scale_byte`)."""
    scales = encode_e4m4(absmax / tensor_scale)
    overflows = (scales > 0) & jnp.isinf(decode_e4m4(scales) * tensor_scale)
    return jnp.where(overflows, scales - 1, scales).astype(jnp.uint8)


def _cells(w: jax.Array) -> jax.Array:
    """[..., K, N] -> [..., K/32, N, 32]: the 32 elements of each cell on the last axis."""
    *batch, k, n = w.shape
    return jnp.swapaxes(w.reshape(*batch, k // BLOCK, BLOCK, n), -1, -2)


def _uncells(cells: jax.Array) -> jax.Array:
    *batch, kb, n, _ = cells.shape
    return jnp.swapaxes(cells, -1, -2).reshape(*batch, kb * BLOCK, n)


def quantize_codes(w, codebook, tensor_scale):
    """-> (codes int32[..., K/32, N, 32], scales uint8[..., K/32, N])."""
    cells = _cells(w.astype(jnp.float32))
    absmax = jnp.max(jnp.abs(cells), axis=-1)
    scales = block_scale_byte(absmax, tensor_scale[..., None, None])
    # w * (1 / absmax), written out: XLA would turn a division by the broadcast absmax into
    # this anyway, and cpp/format.h `normalized` does the same, so the codes agree exactly.
    # Blocks with absmax >= 2^126 are scaled by 2^-64 first so that 1 / absmax stays normal.
    prescale = jnp.where(absmax >= LARGE_ABSMAX, jnp.float32(LARGE_ABSMAX_PRESCALE), jnp.float32(1.0))
    scaled_absmax = absmax * prescale
    inv_absmax = 1.0 / jnp.where(absmax > 0, scaled_absmax, 1.0)
    normalized = jnp.where(absmax[..., None] > 0, (cells * prescale[..., None]) * inv_absmax[..., None], 0.0)
    cb = codebook[..., None, None, None, :]
    # argmin returns the first minimum: ties go to the lower codebook index.
    codes = jnp.argmin(jnp.abs(normalized[..., None] - cb), axis=-1).astype(jnp.int32)
    return codes, scales


def underflowed_blocks(w, scales) -> jax.Array:
    """How many blocks of ``w[..., K, N]`` are nonzero but got scale byte 0 (they dequantize to
    zeros): their absmax / tensor_scale is below half E4M4's smallest positive value."""
    absmax = jnp.max(jnp.abs(_cells(w.astype(jnp.float32))), axis=-1)
    return jnp.sum((absmax > 0) & (scales == 0))


def quantize(w, codebook, tensor_scale, *, layout="fragment"):
    """-> (planes uint32[..., K/32, N, bits], scales uint8[..., K/32, N])."""
    bits = codebook.shape[-1].bit_length() - 1
    codes, scales = quantize_codes(w, codebook, tensor_scale)
    return pack_codes(codes, bits, layout), scales


def dequantize(planes, scales, codebook, tensor_scale, *, layout="fragment", dtype=jnp.float32):
    """-> w[..., K, N] of ``dtype``: (codebook[code] * decode(scale)) * tensor_scale in f32."""
    codes = unpack_codes(planes, layout)                         # [..., KB, N, 32]
    batch = codes.shape[:-3]
    # Each cell's codes index its own matrix's codebook, broadcast over (KB, N): no axis of the
    # codes is merged with another, so a sharded weight's shards dequantize in place.
    values = jnp.take_along_axis(codebook[..., None, None, :], codes, axis=-1)
    values = values * decode_e4m4(scales)[..., None]
    values = values * tensor_scale.reshape(*batch, 1, 1, 1)
    return _uncells(values).astype(dtype)


#: Gated linear units `matmul` can apply to its product (cpp/glu.h evaluates the same
#: functions in float32): "silu" (SwiGLU) and "gelu_tanh" (GeGLU with jax.nn.gelu's default
#: tanh approximation, 0.5 g (1 + tanh(z)), written as g * sigmoid(2 z), which is the same
#: function without 1 + tanh(z)'s cancellation at negative z).
GLU_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda g: g * jax.nn.sigmoid(1.5957691216057308 * (g + 0.044715 * (g * g * g))),
}


def apply_glu(y, kind: str):
    """``act(y[..., 0::2]) * y[..., 1::2]``: gate column 2j, up column 2j + 1 -> column j.
    Evaluated in float32, returned in y's dtype."""
    y32 = y.astype(jnp.float32)
    return (GLU_ACTIVATIONS[kind](y32[..., 0::2]) * y32[..., 1::2]).astype(y.dtype)


def matmul(x, planes, scales, codebook, tensor_scale, *, layout="fragment", glu=None):
    """y[..., M, N] = x[..., M, K] @ W, float32 accumulation, rounded to x.dtype. With
    ``glu`` (a `GLU_ACTIVATIONS` name), `apply_glu` of the float32 product (N / 2 columns),
    rounded once."""
    w = dequantize(planes, scales, codebook, tensor_scale, layout=layout)
    y = jnp.matmul(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    if glu is not None:
        y = apply_glu(y, glu)
    return y.astype(x.dtype)


def group_bounds(group_sizes, m: int):
    """starts[G + 1] of the groups of ``group_sizes`` over ``m`` rows: group g owns rows
    ``[starts[g], starts[g + 1])``. A negative size counts as 0 and groups end at row ``m`` at
    the latest (what every kernel does with sizes it cannot check under ``jit``)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends.astype(jnp.int32)])


def ragged_dot(x, planes, scales, codebook, tensor_scale, group_sizes, *, layout="fragment", glu=None):
    """y[M, N] for x[M, K] with rows sorted by group and a weight stacked over G groups
    (``planes[G, K/32, N, bits]``...): row m of group g is ``x[m] @ W[g]``, rows past the last
    group are 0 (`group_bounds`); float32 accumulation, an optional GLU on the float32 sums,
    rounded once to x.dtype. One masked product per group: simple, not fast."""
    w = dequantize(planes, scales, codebook, tensor_scale, layout=layout)   # [G, K, N]
    m = x.shape[0]
    starts = group_bounds(group_sizes, m)
    rows = jnp.arange(m)
    y = jnp.zeros((m, w.shape[-1]), jnp.float32)
    for g in range(w.shape[0]):
        mine = (rows >= starts[g]) & (rows < starts[g + 1])
        product = jnp.matmul(x.astype(jnp.float32), w[g], precision=jax.lax.Precision.HIGHEST)
        y = y + jnp.where(mine[:, None], product, 0.0)
    if glu is not None:
        y = apply_glu(y, glu)
    return y.astype(x.dtype)
