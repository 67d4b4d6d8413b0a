"""Import and export the bitsandbytes k-bit layout (numpy arrays, no torch needed).

bitsandbytes stores a torch weight ``W_t[N, K]`` (``y = x @ W_t.T``) as flat blocks of 32
consecutive elements of the row-major tensor: block ``i = n * K/32 + kb`` holds
``W_t[n, 32kb : 32kb+32]``, its ``bits`` bit-plane words at ``packed[i*bits : (i+1)*bits]``,
and its absmax as float32 or as an E4M4 byte (same encoding as ours, bias 11). That is our
canonical cell ``(kb, n)`` of ``W = W_t.T``: importing is a transpose of the first two axes
of ``packed.reshape(N, K/32, bits)``, with no change to any code.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import codebooks as _codebooks
from .format import BLOCK, E4M4_VALUES, KbitWeight
from .ops import _check_weight, convert_layout
from .reference import block_scale_byte as _block_scale_byte
from .reference import tensor_scale as _tensor_scale


def from_bitsandbytes(packed, absmax, codebook, shape, *, layout: str = "fragment") -> KbitWeight:
    """Build a KbitWeight from bitsandbytes k-bit buffers.

    Args:
      packed: uint32 (or int32) array of ``N * K/32 * bits`` words.
      absmax: ``N * K/32`` scales: uint8 E4M4 bytes (imported exactly, tensor_scale = 1) or
        float32 absmax values (encoded to E4M4 with a power-of-two tensor_scale: lossy in
        the scale's mantissa, as quantizing with E4M4 is).
      codebook: the ``2**bits`` float codebook used by bitsandbytes.
      shape: the torch weight's shape ``(N, K)``.
      layout: layout of the result ("fragment" or "planes").
    """
    n, k = (int(d) for d in shape)
    if k <= 0 or k % BLOCK or n <= 0:
        raise ValueError(f"shape must be (N, K) with K a positive multiple of {BLOCK}, got {shape}")
    codebook = np.asarray(codebook, np.float32)
    bits = int(codebook.size).bit_length() - 1
    _codebooks.check_bits(bits, f"log2(len(codebook)) (codebook has {codebook.size} entries)")
    codebook = _codebooks.check_codebook(codebook, bits)
    packed = np.asarray(packed)
    if packed.size != n * (k // BLOCK) * bits:
        raise ValueError(f"packed must have N*K/32*bits = {n * (k // BLOCK) * bits} words for shape "
                         f"{shape} and bits={bits}, got {packed.size}")
    planes = packed.astype(np.uint32).reshape(n, k // BLOCK, bits).transpose(1, 0, 2)
    absmax = np.asarray(absmax)
    if absmax.size != n * (k // BLOCK):
        raise ValueError(f"absmax must have N*K/32 = {n * (k // BLOCK)} entries, got {absmax.size}")
    absmax = absmax.reshape(n, k // BLOCK).T
    if absmax.dtype == np.uint8:
        scales, ts = absmax, np.float32(1.0)
    elif np.issubdtype(absmax.dtype, np.floating):
        # tensor_scale over the absmax values equals tensor_scale over the weight itself.
        ts = np.asarray(_tensor_scale(jnp.asarray(absmax, jnp.float32)))
        scales = np.asarray(_block_scale_byte(jnp.asarray(absmax, jnp.float32), ts))
    else:
        raise TypeError(f"absmax must be uint8 (E4M4) or float32, got {absmax.dtype}")
    w_q = KbitWeight(jnp.asarray(np.ascontiguousarray(planes)), jnp.asarray(np.ascontiguousarray(scales)),
                     jnp.asarray(codebook), jnp.asarray(ts, jnp.float32), layout="planes")
    return convert_layout(w_q, layout)


def to_bitsandbytes(w_q: KbitWeight, *, absmax_format: str = "fp32"):
    """Export a 2-D KbitWeight to bitsandbytes buffers.

    Returns ``(packed uint32[N*K/32*bits], absmax, codebook float32[2**bits], (N, K))`` with
    absmax float32 (``decode(scale) * tensor_scale``, exact) for ``absmax_format="fp32"``, or
    the E4M4 bytes for ``"e4m4"`` (only when tensor_scale is 1, otherwise the bytes alone
    would not carry the scale).
    """
    _check_weight(w_q)
    if w_q.batch_shape:
        raise ValueError(f"to_bitsandbytes exports one matrix; index the batch axes {w_q.batch_shape} first")
    if absmax_format not in ("fp32", "e4m4"):
        raise ValueError(f"absmax_format must be 'fp32' or 'e4m4', got {absmax_format!r}")
    w_q = convert_layout(w_q, "planes")
    planes, scales = np.asarray(w_q.planes), np.asarray(w_q.scales)
    ts = float(np.asarray(w_q.tensor_scale))
    packed = planes.transpose(1, 0, 2).reshape(-1)
    if absmax_format == "e4m4":
        if ts != 1.0:
            raise ValueError(f"tensor_scale is {ts}, not 1: E4M4 bytes alone cannot carry it; "
                             "use absmax_format='fp32'")
        absmax = scales.T.reshape(-1)
    else:
        absmax = (E4M4_VALUES[scales.T] * np.float32(ts)).reshape(-1).astype(np.float32)
    return packed, absmax, np.asarray(w_q.codebook, np.float32), (w_q.out_features, w_q.in_features)
