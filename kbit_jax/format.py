"""The v1 kbit weight format: E4M4 scales, layouts, and the `KbitWeight` pytree.

Format (docs/format.md). A weight ``W[..., K, N]`` (``y = x @ W``) is cut into cells of 32
consecutive elements along K, one per (block ``kb``, column ``n``). Each cell stores

- ``bits`` uint32 words holding the 32 codes (indices into the codebook), in a *layout*:
  ``"planes"`` (canonical: bit ``j`` of word ``b`` is bit ``b`` of the code of element ``j``,
  what ``__ballot_sync`` produces) or ``"fragment"`` (the codes packed densely in the
  tensor-core fragment order the CUDA GEMM reads; see ``cpp/format.h``);
- one E4M4 byte: the block absmax divided by the per-tensor ``tensor_scale``.

Dequantized value: ``codebook[code] * decode_e4m4(scale) * tensor_scale``.

``tensor_scale`` is the smallest power of two for which the largest block absmax encodes
without saturating (so it lands in E4M4's top binade): a power of two only shifts
exponents, so the E4M4 mantissa rounding is exactly that of unscaled E4M4 and folding it in
is exact. Both layouts keep each cell self-contained: any slice along K at whole blocks, or
along N, is itself a valid weight, and converting between layouts never changes a code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
E4M4_BIAS = 11
E4M4_MAX = 31.0
LAYOUTS = ("planes", "fragment")
LAYOUT_IDS = {"planes": 0, "fragment": 1}  # kbit::Layout in cpp/format.h


def _e4m4_table() -> np.ndarray:
    byte = np.arange(256)
    e, m = byte >> 4, byte & 15
    normal = np.ldexp(1.0 + m / 16.0, e - E4M4_BIAS)
    subnormal = np.ldexp(m / 16.0, 1 - E4M4_BIAS)
    return np.where(e > 0, normal, subnormal).astype(np.float32)


#: decode_e4m4 as a table: E4M4_VALUES[byte] is the float32 value of that byte.
E4M4_VALUES = _e4m4_table()
# Midpoints between neighbouring E4M4 values; exact in float32 (values have 5 significant
# bits), so "round to nearest, ties to the lower code" is a count of midpoints below v.
E4M4_MIDPOINTS = ((E4M4_VALUES[:-1].astype(np.float64) + E4M4_VALUES[1:]) / 2).astype(np.float32)
assert np.all(E4M4_MIDPOINTS.astype(np.float64) * 2 == E4M4_VALUES[:-1].astype(np.float64) + E4M4_VALUES[1:])


def encode_e4m4(v) -> jax.Array:
    """float32 -> E4M4 byte: nearest, ties to the lower code, saturating at 31, NaN/<=0 -> 0."""
    v = jnp.asarray(v, jnp.float32)
    return jnp.sum(v[..., None] > jnp.asarray(E4M4_MIDPOINTS), axis=-1).astype(jnp.uint8)


def decode_e4m4(byte) -> jax.Array:
    """E4M4 byte -> float32 (exact)."""
    return jnp.asarray(E4M4_VALUES)[jnp.asarray(byte).astype(jnp.int32)]


def fragment_order() -> np.ndarray:
    """FRAGMENT_K[p]: the element (offset in its block) whose code sits at fragment position p.

    Position p = 8t + i belongs to thread t of an mma.m16n8k16 quad; its eight elements are
    k = 2t, 2t+1, 2t+8, 2t+9 of each k16 half of the block, so they are contiguous in the cell.
    """
    p = np.arange(BLOCK)
    t, i = p >> 3, p & 7
    return (16 * (i >> 2) + 8 * ((i >> 1) & 1) + 2 * t + (i & 1)).astype(np.int32)


FRAGMENT_K = fragment_order()


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def pack_codes(codes: jax.Array, bits: int, layout: str) -> jax.Array:
    """codes uint[..., 32] (element order) -> uint32[..., bits] words of one cell per row."""
    codes = codes.astype(jnp.uint32)
    if check_layout(layout) == "fragment":
        codes = codes[..., FRAGMENT_K]          # position p holds element FRAGMENT_K[p]
        # bit c of the code at position p is bit bits*p + c of the cell's bit string.
        bitstring = (codes[..., :, None] >> jnp.arange(bits, dtype=jnp.uint32)) & 1
    else:
        # bit j of word b is bit b of element j: bit string index 32*b + j.
        bitstring = jnp.swapaxes((codes[..., :, None] >> jnp.arange(bits, dtype=jnp.uint32)) & 1, -1, -2)
    bitstring = bitstring.reshape(*codes.shape[:-1], bits, BLOCK)
    return jnp.sum(bitstring << jnp.arange(BLOCK, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def unpack_codes(words: jax.Array, layout: str) -> jax.Array:
    """uint32[..., bits] words of one cell -> codes int32[..., 32] in element order."""
    bits = words.shape[-1]
    bitstring = (words[..., :, None] >> jnp.arange(BLOCK, dtype=jnp.uint32)) & 1  # [..., bits, 32]
    weights = jnp.arange(bits, dtype=jnp.uint32)
    if check_layout(layout) == "fragment":
        by_position = bitstring.reshape(*words.shape[:-1], BLOCK, bits)           # [..., p, c]
        codes_at_p = jnp.sum(by_position << weights, axis=-1, dtype=jnp.uint32)
        return codes_at_p[..., np.argsort(FRAGMENT_K)].astype(jnp.int32)
    codes = jnp.sum(jnp.swapaxes(bitstring, -1, -2) << weights, axis=-1, dtype=jnp.uint32)
    return codes.astype(jnp.int32)


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True, eq=False)
class KbitWeight:
    """A k-bit quantized weight ``W[*batch, K, N]`` (``y = x @ W``), a pytree of four arrays.

    Leaves (bits, K, N and the batch shape are all derived from their shapes, so stacking,
    slicing, ``vmap``, ``pmap`` and ``scan`` over stacked weights need no bookkeeping):

    - ``planes``: ``uint32[*batch, K/32, N, bits]``, the codes of each 32-element cell;
    - ``scales``: ``uint8[*batch, K/32, N]``, each cell's absmax / tensor_scale in E4M4;
    - ``codebook``: ``float32[*batch, 2**bits]``;
    - ``tensor_scale``: ``float32[*batch]``, a power of two.

    Static (aux) data: ``layout``, how codes sit inside a cell ("planes" or "fragment").
    The constructor does not validate (pytree machinery builds instances with placeholder
    leaves); ``kbit_jax.ops`` validates at the API boundary.
    """

    planes: Any
    scales: Any
    codebook: Any
    tensor_scale: Any
    layout: str = "fragment"

    # -- pytree ---------------------------------------------------------------------------
    def tree_flatten_with_keys(self):
        keys = ("planes", "scales", "codebook", "tensor_scale")
        return [(jax.tree_util.GetAttrKey(k), getattr(self, k)) for k in keys], self.layout

    @classmethod
    def tree_unflatten(cls, layout, leaves):
        return cls(*leaves, layout=layout)

    # -- derived metadata -----------------------------------------------------------------
    @property
    def bits(self) -> int:
        return self.planes.shape[-1]

    @property
    def in_features(self) -> int:
        """K: the contraction size (rows of W)."""
        return self.planes.shape[-3] * BLOCK

    @property
    def out_features(self) -> int:
        """N: the output size (columns of W)."""
        return self.planes.shape[-2]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.planes.shape[:-3])

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of the dense weight: (*batch, K, N)."""
        return (*self.batch_shape, self.in_features, self.out_features)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in (self.planes, self.scales, self.codebook, self.tensor_scale))

    @property
    def bits_per_element(self) -> float:
        """Storage per weight element: bits + 8/32 for the scale (codebooks not counted)."""
        return self.bits + 8 / BLOCK

    def __getitem__(self, index) -> "KbitWeight":
        """Index the batch axes only (``w[3]`` is the 4th stacked weight)."""
        if not self.batch_shape:
            raise IndexError("KbitWeight has no batch axes to index")
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.batch_shape) or any(i is Ellipsis for i in index):
            raise IndexError(f"index {index} must address only the batch axes {self.batch_shape}")
        return jax.tree.map(lambda x: x[index], self)

    def __repr__(self) -> str:
        return (f"KbitWeight(shape={self.shape}, bits={self.bits}, layout={self.layout!r}, "
                f"bits_per_element={self.bits_per_element})")
