"""The routing of a mixture-of-experts block at decode sizes as one Pallas (Triton) kernel.

From the router's logits ``[T, G]`` one program computes what `routing.route` and
`routing.sorted_rows` compute (same contract, same dtypes)::

    weights, ids, order, inverse, sizes = route_sorted(logits, k, normalize)

- the softmax over the G experts in float32 (``exp(x - max) / sum``, as ``jax.nn.softmax``);
- its k largest entries, largest first and the lower expert first among equal values
  (``lax.top_k``'s order; NaN and signed zeros ordered as `routing._total_order_key` orders
  them): k rounds of a masked arg-max over the ``[T, G]`` tile, each one reduction for the
  expert and one for its value (as an order key, turned back into the float bit for bit);
- the weights renormalized to sum to 1 with ``normalize``;
- the ``T * k`` (token, expert) pairs sorted by expert, stably: the chosen pairs are a 0/1
  tile ``[T, G]``; its column sums are the group sizes, an exclusive scan of those plus a
  scan down each column give each pair's sorted row (``inverse``), and ``order`` (the pair of
  each sorted row) is one compare-and-reduce over ``[n, T, k]`` (n = T * k).

Why: on an H200 XLA compiles `route` and `sorted_rows` at decode sizes (512 experts, 10 per
token, batch 1) into ~7 small kernels (softmax, four compare-and-reduce fusions, a reduce-window,
a subtract, a dynamic-slice), ~12 us per MoE layer, each bound by its launch: ~0.5 ms of a
~5 ms step over 48 layers (a profiled decode, ``bench_decode.py --profile``). Here it is one
launch over tiles that fit one program's registers (`supported`).

Results: ids, order, inverse and sizes are the comparison path's whenever the kernel's
probabilities order the experts as XLA's do. Both compute the same formula, but each compiler
has its own ``exp`` and its own order of the G-term sum, so two probabilities within one
rounding of each other (logits within ~2^-23 of each other) may tie in one and not the other; exact
ties of the logits are ties in both. The weights: the probabilities may differ by the two
``exp`` errors (libdevice's ``expf``: 2 ulp each) and the two sums' orders ((G - 1) 2^-24 each
way); renormalized, the sum over G cancels and the weights are within ``(k + 8) * 2^-23``
relative of `routing.route`'s, else within ``(G + 8) * 2^-23``. One corner of the order keys: the
lowest key is the kernel's mark for "taken", so the float whose bits are all ones (a negative
NaN) ranks as if its bits were ``0xFFFFFFFE`` (tied with that NaN: the lower expert first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..pallas_triton import MISSING, plt

__all__ = ["MAX_LOGITS_TILE", "MAX_SORT_TILE", "route_sorted", "supported"]

#: Most elements of the logits' tile ``[T_pad, G_pad]`` (each dimension padded to a power of
#: two, Triton's tile rule): 2^13, 32 per thread at 8 warps for each of the few live tiles (the
#: order keys, the chosen pairs) within the registers of one SM's 256 threads: batch 16 at 512
#: experts, batch 8 at 1024.
MAX_LOGITS_TILE = 2**13
#: Most elements of the order's compare ``[n_pad, T_pad, k_pad]`` (n = T * k): 2^14, a transient
#: of one reduction: batch 8 with 10 experts per token, batch 16 with 8.
MAX_SORT_TILE = 2**14

_KEY_MIN = -(2**31)   # the "taken / padding" key: below every element's (see the module docstring)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tiles(t: int, g: int, k: int) -> tuple[int, int, int, int]:
    tp, gp, kp = _pow2(t), _pow2(g), _pow2(k)
    return tp, gp, kp, _pow2(t * k)


def supported(t: int, g: int, k: int) -> str | None:
    """None if the kernel takes ``T`` tokens over ``G`` experts, ``k`` per token, else why not."""
    if MISSING:
        return MISSING
    if t < 1 or k < 1 or k > g:
        return f"T={t}, k={k}, G={g}: needs T >= 1 and 1 <= k <= G"
    tp, gp, kp, np_ = _tiles(t, g, k)
    if tp * gp > MAX_LOGITS_TILE:
        return f"the logits' tile [{tp}, {gp}] has more than MAX_LOGITS_TILE={MAX_LOGITS_TILE} elements"
    if np_ * tp * kp > MAX_SORT_TILE:
        return f"the sort's tile [{np_}, {tp}, {kp}] has more than MAX_SORT_TILE={MAX_SORT_TILE} elements"
    return None


def _order_key(x):
    """`routing._total_order_key` of float32 ``x``: int32 keys in lax.top_k's order."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _key_value(key):
    """The float32 whose `_order_key` is ``key`` (the map is its own inverse)."""
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def _kernel(logits_ref, weights_ref, ids_ref, order_ref, inverse_ref, sizes_ref, *, t, g, k, normalize):
    tp, gp, kp, np_ = _tiles(t, g, k)
    row = jnp.arange(tp, dtype=jnp.int32)[:, None]                      # [tp, 1]
    col = jnp.arange(gp, dtype=jnp.int32)[None, :]                      # [1, gp]
    slot = jnp.arange(kp, dtype=jnp.int32)[None, :]                     # [1, kp]
    live = (row < t) & (col < g)
    x = plt.load(logits_ref.at[pl.ds(0, tp), pl.ds(0, gp)], mask=live, other=0.0).astype(jnp.float32)
    x = jnp.where(col < g, x, -jnp.inf)
    e = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))                 # padding: exp(-inf) = 0
    probs = e / jnp.sum(e, axis=1, keepdims=True)
    key = jnp.where(live, jnp.maximum(_order_key(probs), _KEY_MIN + 1), _KEY_MIN)

    ids = jnp.zeros((tp, kp), jnp.int32)
    values = jnp.zeros((tp, kp), jnp.float32)
    total = jnp.zeros((tp, 1), jnp.float32)
    chosen = jnp.zeros((tp, gp), jnp.int32)                             # 1 where (t, e) is a pair
    picks = []
    for j in range(k):
        # argmax takes the lower index among equal keys (lax.top_k's order); the max its key
        pick = jnp.argmax(key, axis=1).astype(jnp.int32)[:, None]      # [tp, 1]
        value = _key_value(jnp.max(key, axis=1, keepdims=True))
        hit = col == pick
        key = jnp.where(hit, _KEY_MIN, key)
        chosen = chosen + hit.astype(jnp.int32)
        picks.append(pick)
        ids = jnp.where(slot == j, pick, ids)
        values = jnp.where(slot == j, value, values)
        total = total + value
    if normalize:
        values = values / total
    chosen = jnp.where(row < t, chosen, 0)

    # Sorted row of pair (t, e): the pairs of lower experts, then those of expert e at lower t.
    sizes = jnp.sum(chosen, axis=0)                                     # [gp]
    before = (jnp.cumsum(sizes) - sizes)[None, :] + (jnp.cumsum(chosen, axis=0) - chosen)
    inverse = jnp.zeros((tp, kp), jnp.int32)
    for j, pick in enumerate(picks):
        here = jnp.sum(jnp.where(col == pick, before, 0), axis=1, keepdims=True)
        inverse = jnp.where(slot == j, here, inverse)
    # order[r]: the pair (t * k + j) whose sorted row is r.
    r = jnp.arange(np_, dtype=jnp.int32)[:, None, None]
    pair = (row * k + slot)[None]                                       # [1, tp, kp]
    valid = ((row < t) & (slot < k))[None]
    order = jnp.sum(jnp.sum(jnp.where(valid & (inverse[None] == r), pair, 0), axis=2), axis=1)

    out = (row < t) & (slot < k)
    plt.store(weights_ref.at[pl.ds(0, tp), pl.ds(0, kp)], values, mask=out)
    plt.store(ids_ref.at[pl.ds(0, tp), pl.ds(0, kp)], ids, mask=out)
    plt.store(inverse_ref.at[pl.ds(0, tp), pl.ds(0, kp)], inverse, mask=out)
    plt.store(order_ref.at[pl.ds(0, np_)], order, mask=jnp.arange(np_) < t * k)
    plt.store(sizes_ref.at[pl.ds(0, gp)], sizes, mask=jnp.arange(gp) < g)


def _num_warps(t: int, g: int, k: int) -> int:
    """One warp while the largest tile is at most 1024 elements (32 per thread: no reduction
    crosses warps, so none waits on shared memory), else 4 or 8."""
    tp, gp, kp, np_ = _tiles(t, g, k)
    largest = max(tp * gp, np_ * tp * kp)
    return 1 if largest <= 1024 else 4 if largest <= 4096 else 8


def route_sorted(logits, k: int, normalize: bool, *, interpret: bool | None = None,
                 num_warps: int | None = None):
    """(weights float32[T, k], ids int32[T, k], order int32[T * k], inverse int32[T * k],
    sizes int32[G]): `routing.route` and `routing.sorted_rows` of ``logits[T, G]`` (any float
    dtype) in one kernel; see the module docstring.

    Args:
      logits: the router's ``[T, G]``.
      k: experts per token (``1 <= k <= G``). normalize: renormalize the k weights to sum to 1.
      interpret: run through Pallas's interpreter (default: when not on a GPU).
      num_warps: Triton warps of the one program (default: by the tile size).

    Raises ValueError (naming the argument) where `supported` says the kernel does not fit.
    """
    if getattr(logits, "ndim", None) != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be a float [T, G] array, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)} {getattr(logits, 'dtype', '')}")
    if isinstance(k, bool) or not isinstance(k, int):
        raise ValueError(f"k must be an int, got {k!r}")
    t, g = logits.shape
    why = supported(t, g, k)
    if why:
        raise ValueError(f"logits {tuple(logits.shape)} with k={k}: {why}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    n = t * k
    out_shape = [jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32),
                 jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.int32),
                 jax.ShapeDtypeStruct((g,), jnp.int32)]
    weights, ids, order, inverse, sizes = pl.pallas_call(
        functools.partial(_kernel, t=t, g=g, k=k, normalize=bool(normalize)),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps or _num_warps(t, g, k), num_stages=1),
        interpret=interpret,
        name="moe_route_sorted",
    )(logits)
    return weights, ids, order, inverse.reshape(n), sizes
