"""Single-token grouped-query attention over a KV cache, as one Pallas (Triton) kernel.

At one new token per step XLA compiles the example decoder's attention core into five small
kernels (the q.k dot, the softmax's max, sum and normalize fusions, the p.v dot), each bound
by its launch: ~9 us per layer on an H200 at Llama-3-70B tensor-parallel-2 sizes, ~0.7 ms of
an 11 ms step (a profiled decode, ``bench_decode.py --profile``). This kernel does the
same work in one launch: a program per (batch row, kv head, split of the positions) streams
its keys and values once, ``block_s`` positions at a time, with an online softmax (running
max and sum) in f32; where there are several splits, a small XLA fusion combines them
(flash-decoding), so that long caches at batch 1 still spread over the SMs.

    out = decode_attention(q, cache_k, cache_v, kv_len)   # q [B, KVH, G, D], cache [B, S, KVH, D]

Keys at positions ``< kv_len`` are attended. The query group (``G`` query heads per kv head)
is padded to 16 rows in registers, the smallest tensor-core tile (masked loads and stores;
nothing padded in memory).

The decoder takes the whole step through ``decode_attention_step``: the same kernel also
rotates the new queries and key (RoPE) and writes the key and value into the cache in place
(outputs aliased to the caches), which XLA did in three more kernels (~3.7 us per layer at
Llama-3-70B TP 2 sizes). For Qwen3 it first applies the per-head q/k RMSNorm (``q_norm``,
``k_norm``), which XLA made five launch-bound kernels between the q/k/v product and the
attention (~6 us per layer on an H200 at Qwen3-Coder-Next sizes):

    out, cache_k, cache_v = decode_attention_step(qkv, cache_k, cache_v, pos, cos, sin)
    out, cache_k, cache_v = decode_attention_step(qkv, cache_k, cache_v, pos, cos, sin,
                                                  q_norm=q_scale, k_norm=k_scale, norm_eps=1e-6)

JAX 0.11 warns that Pallas's Triton backend is deprecated in favour of Mosaic GPU; this kernel
needs a port before that backend goes.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..pallas_triton import MISSING, plt

# The defaults below come from benchmarks/results/attention_h200.md (device busy time per layer on
# an H200, the head groups of Llama-3-8B and -70B, batch 1 and 8, S = 192..16384), which
# `bench_attention.py` regenerates: they take 0.81-1.00x the time of 256 positions with 4 warps
# on every row (0.82-0.86x at batch 8 and S = 1024-4096, 0.81x at batch 1 and S = 16384).
#: Cache positions per loop iteration for a cache of at most this many positions: one block, the
#: cache length rounded up to a power of two (a [16, block] score tile and two [block, D] loads).
MAX_BLOCK_S = 256
#: ... and for a longer cache, whose loop runs several iterations pipelined over two stages:
#: 128, half the shared memory of 256's stages (with 4 warps, 128 took 0.85-0.87x the time of
#: 256 at batch 8 and S = 1024-4096).
LOOP_BLOCK_S = 128
#: Warps per program (more loads in flight per program; at S = 192 one block of 256 took
#: 0.93-0.97x the time with 8 warps as with 4).
NUM_WARPS = 8
#: Programs `default_splits` aims for: two per SM of an H100/H200 (132 SMs), rounded.
TARGET_PROGRAMS = 256


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= n and >= floor (Triton tile dimensions)."""
    return max(floor, 1 << (n - 1).bit_length())


def supported(q_shape, cache_shape) -> str | None:
    """None if the kernel takes these shapes, else why not (for errors and "auto")."""
    if MISSING:
        return MISSING
    b, kvh, g, d = q_shape
    if len(cache_shape) != 4 or cache_shape[0] != b or cache_shape[2] != kvh or cache_shape[3] != d:
        return f"cache {tuple(cache_shape)} does not match q {tuple(q_shape)} ([B, S, KVH, D])"
    if not _pow2(d) or d > 256:
        return f"head_dim {d} is not a power of two <= 256 (a Triton tile dimension)"
    if g > 64:
        return f"{g} query heads per kv head (at most 64)"
    return None


def _attend(q_parts, k_ref, v_ref, first, end, init, *, block_s, scale, precision):
    """The online softmax over cache positions [first, end), block_s at a time, from the state
    ``init`` = (running max [rows], running sum [rows], unnormalized sum [rows, D]). The scores
    are the sum over ``q_parts`` ((queries [rows, d'], the d' key columns they meet)) of q k^T."""
    def step(i, carry):
        m, l, acc = carry
        start = first + i * block_s
        live = start + jnp.arange(block_s) < end
        s = None
        for q, cols in q_parts:
            k = plt.load(k_ref.at[pl.ds(start, block_s), cols], mask=live[:, None], other=0.0)
            part = plt.dot(q, k, trans_b=True, precision=precision)          # [rows, block_s]
            s = part if s is None else s + part
        v = plt.load(v_ref.at[pl.ds(start, block_s), :], mask=live[:, None], other=0.0)
        s = jnp.where(live[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + plt.dot(p.astype(v.dtype), v, precision=precision)
        return m_new, l * alpha + p.sum(axis=1), acc

    steps = jnp.maximum(pl.cdiv(end - first, block_s), 0)
    return jax.lax.fori_loop(0, steps, step, init)


def _store_result(out_refs, m, l, acc, group):
    """One output ref: the normalized result (a single split). Three: this split's unnormalized
    f32 sum, running max and running sum, for `_combine`."""
    rows = m.shape[0]
    row = jnp.arange(rows)
    if len(out_refs) == 1:
        plt.store(out_refs[0].at[pl.ds(0, rows), :], (acc / l[:, None]).astype(out_refs[0].dtype),
                  mask=(row < group)[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        plt.store(acc_ref.at[pl.ds(0, rows), :], acc, mask=(row < group)[:, None])
        plt.store(m_ref.at[pl.ds(0, rows)], m, mask=row < group)
        plt.store(l_ref.at[pl.ds(0, rows)], l, mask=row < group)


def _empty_state(rows: int, d: int):
    return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))


def _kernel(kv_len_ref, q_ref, k_ref, v_ref, *out_refs, seq_len, group, rows, block_s, split_len,
            scale, exact):
    """One program: query group (b, j) over positions [split * split_len, +split_len) of the
    first kv_len."""
    q = plt.load(q_ref.at[pl.ds(0, rows), :], mask=(jnp.arange(rows) < group)[:, None], other=0.0)
    first = pl.program_id(2) * split_len
    end = jnp.minimum(jnp.minimum(kv_len_ref[0], seq_len), first + split_len)
    precision = jax.lax.Precision.HIGHEST if exact else None
    m, l, acc = _attend([(q, slice(None))], k_ref, v_ref, first, end, _empty_state(rows, q.shape[1]),
                        block_s=block_s, scale=scale, precision=precision)
    _store_result(out_refs, m, l, acc, group)


def _step_kernel(pos_ref, qkv_ref, cos_ref, sin_ref, *refs, seq_len, group, rows, block_s,
                 split_len, scale, exact, norm_eps):
    """One program of `decode_attention_step`: query group (b, j) at position pos, over cache
    positions [split * split_len, +split_len) below pos and the new token itself. The program of
    split 0 writes the rotated key and the value at pos (``k_out_ref``/``v_out_ref`` alias the
    caches) and starts its softmax from the new token; no program reads position pos from memory,
    so the write races with nothing. The rotary halves of a head are separate tiles (the scores
    are q1 k1^T + q2 k2^T), so nothing is concatenated in registers. With ``norm_eps`` (not
    None) the refs start with the query and key RMSNorm scales [D]."""
    if norm_eps is None:
        q_norm_ref = k_norm_ref = None
        k_ref, v_ref, *out_refs = refs
    else:
        q_norm_ref, k_norm_ref, k_ref, v_ref, *out_refs = refs
    *result_refs, k_out_ref, v_out_ref = out_refs
    dtype = k_out_ref.dtype
    d = qkv_ref.shape[-1]
    half = d // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    cos, sin = cos_ref[...][None, :], sin_ref[...][None, :]                   # [1, half] f32
    f32 = jnp.float32

    def rotate(rows_slice, mask=None, norm_ref=None):   # rotate-half RoPE in f32, rounded to the dtype
        fill = {} if mask is None else {"mask": mask, "other": 0.0}   # (Triton: no other without mask)
        x1 = plt.load(qkv_ref.at[rows_slice, lo], **fill).astype(f32)
        x2 = plt.load(qkv_ref.at[rows_slice, hi], **fill).astype(f32)
        if norm_ref is not None:
            # RMSNorm of each head first, as the decoder's RMSNorm computes it: in f32 over the
            # whole head (both halves), times the scale, rounded to the dtype; the rotation
            # starts from those rounded values. (Masked rows are 0 and stay 0.)
            inv = jax.lax.rsqrt(((x1 * x1).sum(axis=1) + (x2 * x2).sum(axis=1)) / d + norm_eps)
            w1 = norm_ref[lo].astype(f32)[None, :]
            w2 = norm_ref[hi].astype(f32)[None, :]
            x1 = (x1 * inv[:, None] * w1).astype(dtype).astype(f32)
            x2 = (x2 * inv[:, None] * w2).astype(dtype).astype(f32)
        return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)

    q1, q2 = rotate(pl.ds(0, rows), (jnp.arange(rows) < group)[:, None], q_norm_ref)  # [rows, half]
    k1, k2 = rotate(pl.ds(group, 1), norm_ref=k_norm_ref)                              # [1, half]
    v = plt.load(qkv_ref.at[pl.ds(group + 1, 1), :]).astype(dtype)           # [1, D]
    pos = pos_ref[0]
    is_writer = pl.program_id(2) == 0
    writes = jnp.logical_and(is_writer, pos < seq_len)
    plt.store(k_out_ref.at[pl.ds(pos, 1), lo], k1, mask=jnp.full(k1.shape, writes))
    plt.store(k_out_ref.at[pl.ds(pos, 1), hi], k2, mask=jnp.full(k2.shape, writes))
    plt.store(v_out_ref.at[pl.ds(pos, 1), :], v, mask=jnp.full(v.shape, writes))

    # The new token's score, in f32 from the rounded operands as a dot would take them.
    s_new = ((q1.astype(f32) * k1.astype(f32)).sum(axis=1)
             + (q2.astype(f32) * k2.astype(f32)).sum(axis=1)) * scale          # [rows]
    m0, l0, acc0 = _empty_state(rows, v.shape[1])
    init = (jnp.where(is_writer, s_new, m0), jnp.where(is_writer, 1.0, l0),
            jnp.where(is_writer, jnp.broadcast_to(v.astype(f32), acc0.shape), acc0))
    first = pl.program_id(2) * split_len
    end = jnp.minimum(jnp.minimum(pos, seq_len), first + split_len)
    precision = jax.lax.Precision.HIGHEST if exact else None
    m, l, acc = _attend([(q1, lo), (q2, hi)], k_ref, v_ref, first, end, init,
                        block_s=block_s, scale=scale, precision=precision)
    _store_result(result_refs, m, l, acc, group)


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


def _plan(s: int, d: int, itemsize: int, batch: int, kv_heads: int, block_s, splits, who: str):
    """(block_s, splits, split_len) for a cache of S positions: the defaults, checked."""
    if block_s is None:
        # A [block_s, D] tile of k and one of v: ~64 KiB each at most.
        block_s = min(MAX_BLOCK_S if s <= MAX_BLOCK_S else LOOP_BLOCK_S, 65536 // (d * itemsize),
                      _pow2_at_least(s))
    if not _pow2(block_s) or block_s < 16:
        raise ValueError(f"{who}: block_s={block_s} is not a power of two >= 16")
    if splits is None:
        splits = default_splits(batch, kv_heads, s, block_s)
    if splits < 1:
        raise ValueError(f"{who}: splits={splits} (must be >= 1)")
    split_len = pl.cdiv(pl.cdiv(s, splits), block_s) * block_s
    return block_s, pl.cdiv(s, split_len), split_len


def _result_specs(b: int, kvh: int, g: int, d: int, splits: int, dtype):
    """Block specs and shapes of the kernels' results over grid (b, kvh, split): the output
    [B, KVH, G, D] itself for one split, else each split's (f32 sum, max, sum) for `_combine`."""
    if splits == 1:
        return ([pl.BlockSpec((None, None, g, d), lambda i, j, h: (i, j, 0, 0))],
                [jax.ShapeDtypeStruct((b, kvh, g, d), dtype)])
    return ([pl.BlockSpec((None, None, None, g, d), lambda i, j, h: (i, j, h, 0, 0)),
             pl.BlockSpec((None, None, None, g), lambda i, j, h: (i, j, h, 0)),
             pl.BlockSpec((None, None, None, g), lambda i, j, h: (i, j, h, 0))],
            [jax.ShapeDtypeStruct((b, kvh, splits, g, d), jnp.float32),
             jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32),
             jax.ShapeDtypeStruct((b, kvh, splits, g), jnp.float32)])


def _finish(results, dtype):
    return results[0] if len(results) == 1 else _combine(*results, dtype)


def _cache_block(s: int, d: int):
    """A program's view of a cache [B, S, KVH, D]: all positions of its (b, kv head)."""
    return pl.BlockSpec((None, s, None, d), lambda i, j, h: (i, 0, j, 0))


def decode_attention(q, cache_k, cache_v, kv_len, *, block_s: int | None = None,
                     splits: int | None = None, num_warps: int = NUM_WARPS, interpret: bool | None = None):
    """Softmax attention of one query per row over the first ``kv_len`` cache positions.

    Args:
      q: ``[B, KVH, G, D]``, the (rotated, unscaled) queries grouped by kv head.
      cache_k, cache_v: ``[B, S, KVH, D]``, the same dtype as q.
      kv_len: int32 scalar or ``[1]``, 1 <= kv_len <= S: positions ``0 .. kv_len-1`` count.
      block_s: cache positions per loop iteration, a power of two >= 16 (default: S rounded up
        to a power of two up to ``MAX_BLOCK_S`` positions, ``LOOP_BLOCK_S`` beyond; at most ~64 KiB
        of keys).
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
    block_s, splits, split_len = _plan(s, d, q.dtype.itemsize, b, kvh, block_s, splits,
                                       "decode_attention")
    kernel = functools.partial(_kernel, seq_len=s, group=g, rows=_pow2_at_least(g), block_s=block_s,
                               split_len=split_len, scale=d ** -0.5, exact=q.dtype == jnp.float32)
    out_specs, out_shape = _result_specs(b, kvh, g, d, splits, q.dtype)
    results = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[pl.BlockSpec((1,), lambda i, j, h: (0,)),
                  pl.BlockSpec((None, None, g, d), lambda i, j, h: (i, j, 0, 0)),
                  _cache_block(s, d), _cache_block(s, d)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(jnp.reshape(kv_len, (1,)).astype(jnp.int32), q, cache_k, cache_v)
    return _finish(results, q.dtype)


def supported_step(qkv_shape, cache_shape, qkv_dtype=None, cache_dtype=None) -> str | None:
    """None if `decode_attention_step` takes these shapes (and dtypes, if given), else why not."""
    if len(qkv_shape) != 4 or qkv_shape[2] < 3:
        return f"qkv must be [B, KVH, G + 2, D] with G >= 1, got {tuple(qkv_shape)}"
    b, kvh, g2, d = qkv_shape
    why = supported((b, kvh, g2 - 2, d), cache_shape)
    if why:
        return why
    if d < 32:
        return f"head_dim {d} is below 32 (each rotary half is a tile dimension >= 16)"
    if qkv_dtype is not None and cache_dtype is not None and jnp.dtype(qkv_dtype) != jnp.dtype(cache_dtype):
        return f"qkv dtype {jnp.dtype(qkv_dtype).name} differs from the cache's {jnp.dtype(cache_dtype).name}"
    return None


def _check_norms(q_norm, k_norm, norm_eps, d: int) -> str | None:
    """None if the optional q/k RMSNorm arguments of `decode_attention_step` are valid."""
    if (q_norm is None) != (k_norm is None):
        given, missing = ("q_norm", "k_norm") if k_norm is None else ("k_norm", "q_norm")
        return f"{given} given without {missing}: pass both RMSNorm scales or neither"
    if q_norm is None:
        return None
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        shape, dtype = getattr(w, "shape", None), getattr(w, "dtype", None)
        if shape != (d,) or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return (f"{name} must be a floating [{d}] array (one RMSNorm scale over head_dim), "
                    f"got shape {shape} dtype {dtype}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, numbers.Real) or not norm_eps >= 0:
        return f"norm_eps must be a float >= 0, got {norm_eps!r}"
    return None


def decode_attention_step(qkv, cache_k, cache_v, pos, cos, sin, *, q_norm=None, k_norm=None,
                          norm_eps: float = 1e-6, block_s: int | None = None,
                          splits: int | None = None, num_warps: int = NUM_WARPS,
                          interpret: bool | None = None):
    """A decoder's whole single-token attention step in one kernel: RMSNorm of each query and key
    head (optional, Qwen3's q/k norm), rotary embedding of the new queries and key, the key and
    value written into the cache, attention over positions ``0 .. pos``.

    Args:
      qkv: ``[B, KVH, G + 2, D]``, the fused projection of the token at position ``pos`` grouped
        by kv head: its ``G`` query heads, then its key, then its value (unnormalized, unrotated).
      cache_k, cache_v: ``[B, S, KVH, D]`` in qkv's dtype; positions ``< pos`` are attended.
        Donate them: the kernel writes position ``pos`` in place (outputs aliased to them).
      pos: int32 scalar or ``[1]``, ``0 <= pos < S``.
      cos, sin: ``[D / 2]`` f32, the rotary angles' cosines and sines at ``pos`` (rotate-half
        convention: ``x1 * cos - x2 * sin, x2 * cos + x1 * sin`` on the halves of a head).
      q_norm, k_norm: ``[D]`` floating RMSNorm scales, both or neither. Given, every query head
        is normalized with ``q_norm`` and the key with ``k_norm`` before the rotation:
        ``x * rsqrt(mean(x^2) + norm_eps) * scale`` in f32 over the head, rounded to qkv's
        dtype (the decoder's ``RMSNorm``). The value is not normalized.
      norm_eps: the RMSNorm epsilon (used only with the scales).
      block_s, splits, num_warps, interpret: as in `decode_attention`.

    Returns ``(out [B, KVH, G, D], cache_k, cache_v)``: the attention output in qkv's dtype and
    the caches with the rotated key and the value at ``pos``. The normalized and the rotated
    operands are each rounded to qkv's dtype, as the decoder's XLA path rounds them.
    """
    why = supported_step(qkv.shape, cache_k.shape, qkv.dtype, cache_k.dtype)
    if not why and (cache_v.shape != cache_k.shape or cache_v.dtype != cache_k.dtype):
        why = f"cache_v {cache_v.shape} {cache_v.dtype} differs from cache_k {cache_k.shape} {cache_k.dtype}"
    d = qkv.shape[-1]
    if not why and (cos.shape != (d // 2,) or sin.shape != (d // 2,)):
        why = f"cos {cos.shape} and sin {sin.shape} must be [{d // 2}] (half the head_dim)"
    if not why:
        why = _check_norms(q_norm, k_norm, norm_eps, d)
    if why:
        raise ValueError(f"decode_attention_step: {why}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, kvh, g2, _ = qkv.shape
    g, s = g2 - 2, cache_k.shape[1]
    block_s, splits, split_len = _plan(s, d, qkv.dtype.itemsize, b, kvh, block_s, splits,
                                       "decode_attention_step")
    normed = q_norm is not None
    kernel = functools.partial(_step_kernel, seq_len=s, group=g, rows=_pow2_at_least(g),
                               block_s=block_s, split_len=split_len, scale=d ** -0.5,
                               exact=qkv.dtype == jnp.float32,
                               norm_eps=float(norm_eps) if normed else None)
    out_specs, out_shape = _result_specs(b, kvh, g, d, splits, qkv.dtype)
    n = len(out_shape)
    half = pl.BlockSpec((d // 2,), lambda i, j, h: (0,))
    whole = pl.BlockSpec((d,), lambda i, j, h: (0,))
    norms = (q_norm, k_norm) if normed else ()
    first_cache = 4 + len(norms)         # operand index of cache_k (aliased to its output)
    *results, cache_k, cache_v = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[pl.BlockSpec((1,), lambda i, j, h: (0,)),
                  pl.BlockSpec((None, None, g2, d), lambda i, j, h: (i, j, 0, 0)),
                  half, half, *[whole] * len(norms), _cache_block(s, d), _cache_block(s, d)],
        out_specs=out_specs + [_cache_block(s, d), _cache_block(s, d)],
        out_shape=out_shape + [jax.ShapeDtypeStruct(cache_k.shape, cache_k.dtype)] * 2,
        input_output_aliases={first_cache: n, first_cache + 1: n + 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention_step",
    )(jnp.reshape(pos, (1,)).astype(jnp.int32), qkv, cos.astype(jnp.float32),
      sin.astype(jnp.float32), *norms, cache_k, cache_v)
    return _finish(results, qkv.dtype), cache_k, cache_v
