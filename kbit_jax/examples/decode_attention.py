"""Single-token grouped-query attention over a KV cache, as one Pallas (Triton) kernel.

At one new token per step XLA compiles the example decoder's attention core into five small
kernels (the q.k dot, the softmax's max, sum and normalize fusions, the p.v dot), each bound
by its launch: ~9 us per layer on an H200 at Llama-3-70B tensor-parallel-2 sizes, ~0.7 ms of
an 11 ms step (``benchmarks/results/README.md``, session-16 profile). This kernel does the
same work in one launch: a program per (batch row, kv head, split of the positions) streams
its keys and values once, ``block_s`` positions at a time, with an online softmax (running
max and sum) in f32; where there are several splits, a small XLA fusion combines them
(flash-decoding), so that long caches at batch 1 still spread over the SMs.

    out = decode_attention(q, cache_k, cache_v, kv_len)   # q [B, KVH, G, D], cache [B, S, KVH, D]

Keys at positions ``< kv_len`` are attended (the decoder passes ``pos + 1``). The query
group (``G`` query heads per kv head) is padded to 16 rows in registers, the smallest
tensor-core tile (masked loads and stores; nothing padded in memory).

JAX 0.11 warns that Pallas's Triton backend is deprecated in favour of Mosaic GPU; this kernel
needs a port before that backend goes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

#: Cache positions per loop iteration (default: the cache length rounded up to a power of
#: two, at most this): a [16, block] score tile and two [block, D] loads per step.
MAX_BLOCK_S = 256
#: Programs `default_splits` aims for: two per SM of an H100/H200 (132 SMs), rounded.
TARGET_PROGRAMS = 256


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= n and >= floor (Triton tile dimensions)."""
    return max(floor, 1 << (n - 1).bit_length())


def supported(q_shape, cache_shape) -> str | None:
    """None if the kernel takes these shapes, else why not (for errors and "auto")."""
    b, kvh, g, d = q_shape
    if len(cache_shape) != 4 or cache_shape[0] != b or cache_shape[2] != kvh or cache_shape[3] != d:
        return f"cache {tuple(cache_shape)} does not match q {tuple(q_shape)} ([B, S, KVH, D])"
    if not _pow2(d) or d > 256:
        return f"head_dim {d} is not a power of two <= 256 (a Triton tile dimension)"
    if g > 64:
        return f"{g} query heads per kv head (at most 64)"
    return None


def _kernel(kv_len_ref, q_ref, k_ref, v_ref, *out_refs, seq_len, group, rows, block_s, split_len,
            scale, exact):
    """One program: query group (b, j) over positions [split * split_len, +split_len) of the
    first kv_len. One output ref: the normalized result (a single split). Three: this split's
    unnormalized f32 sum, running max and running sum, for `_combine`."""
    row = jnp.arange(rows)
    group_rows = (row < group)[:, None]
    q = plt.load(q_ref.at[pl.ds(0, rows), :], mask=group_rows, other=0.0)
    first = pl.program_id(2) * split_len
    end = jnp.minimum(jnp.minimum(kv_len_ref[0], seq_len), first + split_len)
    precision = jax.lax.Precision.HIGHEST if exact else None

    def step(i, carry):
        m, l, acc = carry
        start = first + i * block_s
        live = start + jnp.arange(block_s) < end
        k = plt.load(k_ref.at[pl.ds(start, block_s), :], mask=live[:, None], other=0.0)
        v = plt.load(v_ref.at[pl.ds(start, block_s), :], mask=live[:, None], other=0.0)
        s = plt.dot(q, k, trans_b=True, precision=precision) * scale          # [rows, block_s]
        s = jnp.where(live[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v, precision=precision)
        return m_new, l * alpha + p.sum(axis=1), acc

    d = q.shape[1]
    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    steps = jnp.maximum(pl.cdiv(end - first, block_s), 0)
    m, l, acc = jax.lax.fori_loop(0, steps, step, init)
    if len(out_refs) == 1:
        plt.store(out_refs[0].at[pl.ds(0, rows), :], (acc / l[:, None]).astype(out_refs[0].dtype),
                  mask=group_rows)
    else:
        acc_ref, m_ref, l_ref = out_refs
        plt.store(acc_ref.at[pl.ds(0, rows), :], acc, mask=group_rows)
        plt.store(m_ref.at[pl.ds(0, rows)], m, mask=row < group)
        plt.store(l_ref.at[pl.ds(0, rows)], l, mask=row < group)


def _combine(acc, m, l, dtype):
    """The splits' partial results [B, KVH, NS, G, (D)] as one softmax: each split's sums are
    rescaled from its own running max to the global one. A split past kv_len has m = -inf and
    l = acc = 0, so it weighs 0."""
    weight = jnp.exp(m - m.max(axis=2, keepdims=True))                        # [B, KVH, NS, G]
    total = (acc * weight[..., None]).sum(axis=2)
    return (total / (l * weight).sum(axis=2)[..., None]).astype(dtype)


def default_splits(batch: int, kv_heads: int, seq_len: int, block_s: int) -> int:
    """Position splits per query group: one program per (b, kv head) reads its whole cache
    serially, which is only fast while the cache is short; past one block, split it until
    there are ~TARGET_PROGRAMS programs (no split shorter than one block)."""
    return max(1, min(pl.cdiv(seq_len, block_s), pl.cdiv(TARGET_PROGRAMS, batch * kv_heads)))


def decode_attention(q, cache_k, cache_v, kv_len, *, block_s: int | None = None,
                     splits: int | None = None, num_warps: int = 4, interpret: bool | None = None):
    """Softmax attention of one query per row over the first ``kv_len`` cache positions.

    Args:
      q: ``[B, KVH, G, D]``, the (rotated, unscaled) queries grouped by kv head.
      cache_k, cache_v: ``[B, S, KVH, D]``, the same dtype as q.
      kv_len: int32 scalar or ``[1]``, 1 <= kv_len <= S: positions ``0 .. kv_len-1`` count.
      block_s: cache positions per loop iteration, a power of two >= 16 (default: S rounded up
        to a power of two, at most ``MAX_BLOCK_S`` and ~64 KiB of keys).
      splits: programs per query group, each over an equal share of the positions, combined
        afterwards by a small XLA fusion (default: `default_splits`; 1: no combine).
      num_warps: warps per program (Triton).
      interpret: run the kernel through Pallas's interpreter (default: when not on a GPU).

    Returns ``[B, KVH, G, D]`` in q's dtype: ``softmax(q k^T / sqrt(D)) v`` with f32 scores,
    probabilities rounded to the cache dtype for the p.v product (as the XLA path does).
    """
    if cache_k.shape != cache_v.shape or q.dtype != cache_k.dtype or q.dtype != cache_v.dtype:
        raise ValueError(f"decode_attention: q {q.shape} {q.dtype}, cache_k {cache_k.shape} "
                         f"{cache_k.dtype}, cache_v {cache_v.shape} {cache_v.dtype}: caches "
                         "must share a shape and q's dtype")
    why = f"q must be [B, KVH, G, D], got {q.shape}" if q.ndim != 4 else supported(q.shape, cache_k.shape)
    if why:
        raise ValueError(f"decode_attention: {why}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, kvh, g, d = q.shape
    s = cache_k.shape[1]
    if block_s is None:
        # A [block_s, D] tile of k and one of v: ~64 KiB each at most.
        tile = 65536 // (d * q.dtype.itemsize)
        block_s = min(MAX_BLOCK_S, tile, _pow2_at_least(s))
    if not _pow2(block_s) or block_s < 16:
        raise ValueError(f"decode_attention: block_s={block_s} is not a power of two >= 16")
    if splits is None:
        splits = default_splits(b, kvh, s, block_s)
    if splits < 1:
        raise ValueError(f"decode_attention: splits={splits} (must be >= 1)")
    split_len = pl.cdiv(pl.cdiv(s, splits), block_s) * block_s
    splits = pl.cdiv(s, split_len)
    rows = _pow2_at_least(g)
    kernel = functools.partial(_kernel, seq_len=s, group=g, rows=rows, block_s=block_s,
                               split_len=split_len, scale=d ** -0.5, exact=q.dtype == jnp.float32)
    cache_block = pl.BlockSpec((None, s, None, d), lambda i, j, h: (i, 0, j, 0))
    q_block = pl.BlockSpec((None, None, g, d), lambda i, j, h: (i, j, 0, 0))
    if splits == 1:
        out_specs = q_block
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_specs = [pl.BlockSpec((None, None, None, g, d), lambda i, j, h: (i, j, h, 0, 0)),
                     pl.BlockSpec((None, None, None, g), lambda i, j, h: (i, j, h, 0)),
                     pl.BlockSpec((None, None, None, g), lambda i, j, h: (i, j, h, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, kvh, splits, g, d), jnp.float32),
                     jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32),
                     jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[pl.BlockSpec((1,), lambda i, j, h: (0,)), q_block, cache_block, cache_block],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(kv_len, (1,)).astype(jnp.int32), q, cache_k, cache_v)
    return out if splits == 1 else _combine(*out, q.dtype)
