"""Residual add + RMSNorm as one Pallas (Triton) kernel, for the example decoder.

A pre-norm decoder adds each sublayer's output to the residual stream and normalizes the sum
for the next sublayer: ``x = x + delta; h = rms_norm(x) * scale``. XLA compiles that into two
kernels, a reduction (the add and the sum of squares) and an elementwise pass (normalize,
scale, round), ~3.4 us per norm with the gap between them at Llama-3-70B tensor-parallel-2
sizes, two norms per layer (a profiled decode, ``bench_decode.py --profile``). Here one
program per row keeps the row in registers and writes both results:

    x, h = add_rms_norm(x, delta, scale, eps)   # x, delta [..., D]; scale [D]

Rounding as the decoder's XLA path (`llama.RMSNorm`): the sum is rounded to x's dtype (it
is the residual stream), the norm computed in f32 from that, ``(x * rsqrt(mean(x^2) + eps))
* scale`` rounded once to x's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..pallas_triton import MISSING, plt


def supported(shape, dtype=None) -> str | None:
    """None if `add_rms_norm` takes rows of this shape's last dimension, else why not."""
    if MISSING:
        return MISSING
    d = shape[-1] if len(shape) else 0
    if d < 16 or d & (d - 1) or d > 65536:
        return f"feature dimension {d} is not a power of two in 16..65536 (one Triton tile per row)"
    if dtype is not None and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                                      jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype).name} (bf16, f16 or f32)"
    return None


def _kernel(*refs, eps, has_delta):
    """One row: refs (x, delta, scale, sum, h), or (x, scale, h) without a delta."""
    if has_delta:
        x_ref, delta_ref, scale_ref, sum_ref, h_ref = refs
    else:
        (x_ref, scale_ref, h_ref), delta_ref, sum_ref = refs, None, None
    x = x_ref[...].astype(jnp.float32)
    if has_delta:
        x = (x + delta_ref[...].astype(jnp.float32)).astype(sum_ref.dtype)
        sum_ref[...] = x
        x = x.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.sum(x * x) / x.shape[0] + eps)
    h_ref[...] = (normed * scale_ref[...].astype(jnp.float32)).astype(h_ref.dtype)


def add_rms_norm(x, delta, scale, eps: float, *, interpret: bool | None = None):
    """``(x + delta, rms_norm(x + delta) * scale)`` over the last axis; with ``delta`` None,
    ``(x, rms_norm(x) * scale)``.

    Args:
      x, delta: ``[..., D]``, one dtype (bf16, f16 or f32); D a power of two.
      scale: ``[D]``, any float dtype (used in f32).
      eps: added to the mean square.
      interpret: run through Pallas's interpreter (default: when not on a GPU).
    """
    why = supported(x.shape, x.dtype)
    if not why and delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        why = f"delta {delta.shape} {delta.dtype} differs from x {x.shape} {x.dtype}"
    if not why and scale.shape != x.shape[-1:]:
        why = f"scale {scale.shape} is not [{x.shape[-1]}]"
    if why:
        raise ValueError(f"add_rms_norm: {why}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    operands = [rows] + ([] if delta is None else [delta.reshape(-1, d)]) + [scale]
    kernel = functools.partial(_kernel, eps=eps, has_delta=delta is not None)
    out_shape = [jax.ShapeDtypeStruct(rows.shape, x.dtype)] * (1 if delta is None else 2)
    outs = pl.pallas_call(
        kernel,
        grid=(rows.shape[0],),
        in_specs=[row] * (len(operands) - 1) + [pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=[row] * len(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=8 if d >= 4096 else 4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*operands)
    h = outs[-1].reshape(x.shape)
    return (x if delta is None else outs[0].reshape(x.shape)), h
