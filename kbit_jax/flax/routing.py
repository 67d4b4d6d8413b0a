"""Routing of a mixture-of-experts block: the top-k experts of each token, and the ``T * k``
(token, expert) pairs sorted by expert for the grouped products.

Both are selections over tiny arrays at decode sizes (``T * k`` = 10 pairs at batch 1 for
512 experts and 10 per token). There a sort is a kernel of its own (``lax.top_k`` over 512
experts lowers to one on a GPU), and inverting the sort and counting the experts' rows are
scatters with their own launches: launch-bound kernels, several microseconds in all. Here
the same results come from comparisons: the sorted position of an element is the number of
elements ordered before it, one compare-and-reduce over all pairs (a single fused reduction),
and picking the element at position r is one more. The work grows with the square of the
sizes, so each function takes the comparison path only while the compared grid has at most
`COMPARE_LIMIT` elements and falls back to the sort above it, and only on GPUs: XLA's CPU
compiler does not fuse the compared grid into its reduction but writes it out, slower than
its sorts. Both paths return identical results (same ids, same order of ties, same values bit
for bit); ``method="compare"`` or ``"sort"`` picks one on every platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["COMPARE_LIMIT", "ROUTING_METHODS", "route", "sorted_rows", "sorted_tokens", "top_k"]

#: How `top_k` and `sorted_rows` select: "auto" (comparisons on a GPU while the grid is within
#: `COMPARE_LIMIT`, else the sort), "compare", "sort".
ROUTING_METHODS = ("auto", "compare", "sort")

#: Most elements of one compare-and-reduce grid before the sort path is taken: 2^21 is 8
#: compares per thread over one wave of an H200 (132 SMs x 2048 resident threads = 2^18), well
#: under a microsecond of integer work, while one sort or scatter kernel is a launch-bound 1-5
#: microseconds. Decode of a 512-expert block at batch 8 (top-k: 8 x 512 x 512 = 2^21) stays
#: on the comparison path.
COMPARE_LIMIT = 2**21


def _dispatch(method: str, fits: bool, compare, sort, *args):
    """``compare(*args)`` or ``sort(*args)`` as ``method`` says (see `ROUTING_METHODS`)."""
    if method not in ROUTING_METHODS:
        raise ValueError(f"method must be one of {ROUTING_METHODS}, got {method!r}")
    if method == "compare":
        return compare(*args)
    if method == "sort" or not fits:
        return sort(*args)
    return jax.lax.platform_dependent(*args, cuda=compare, rocm=compare, default=sort)


def _total_order_key(x):
    """int32 keys that order float32 ``x`` as ``lax.top_k`` orders numbers, -0.0 below +0.0, and
    (positive) NaN above +inf: a total order, so the ranks of `_top_k_by_rank` are a
    permutation and the ids valid whatever the router gives."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _top_k_by_rank(x, k: int):
    """The comparison path of `top_k`."""
    g = x.shape[1]
    key = _total_order_key(x)
    e = jnp.arange(g, dtype=jnp.int32)
    mine, other = key[:, :, None], key[:, None, :]                   # [T, e, f]
    precedes = (other > mine) | ((other == mine) & (e[None, :] < e[:, None]))
    rank = jnp.sum(precedes, axis=-1, dtype=jnp.int32)                 # [T, G], a permutation
    hit = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]   # [T, k, G]
    # One hit per slot: a max over the others at -inf is that value bit for bit (-0.0 too).
    ids = jnp.max(jnp.where(hit, e, -1), axis=-1)
    values = jnp.max(jnp.where(hit, x[:, None, :], -jnp.inf), axis=-1)
    return values, ids


def top_k(x, k: int, *, method: str = "auto"):
    """``lax.top_k(x, k)`` for ``x`` float32 ``[T, G]``: (values ``[T, k]``, int32 ids), the
    largest first, the lower index first among equal values; identical results on both paths.

    The comparison path (``method`` "compare", or "auto" on a GPU while ``T * G * G <=
    COMPARE_LIMIT``): the rank of expert e is the number of experts that precede it (a larger
    value, or an equal value at a lower index), one ``[T, G, G]`` compare-and-reduce; the id at
    position j is the e of rank j and its value the only term of a masked max, both in a
    second reduction. Else ``lax.top_k``."""
    t, g = x.shape

    def sort(x):
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)

    return _dispatch(method, t * g * g <= COMPARE_LIMIT, lambda x: _top_k_by_rank(x, k), sort, x)


def route(logits, k: int, normalize: bool, *, method: str = "auto"):
    """(weights float32[T, k], expert ids int32[T, k]): the softmax over the experts' logits, its
    ``k`` largest entries (`top_k` with ``method``: ``lax.top_k``'s ids and values),
    renormalized to sum to 1 when ``normalize``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = top_k(probs, k, method=method)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def sorted_rows(ids, num_experts: int, *, method: str = "auto"):
    """The ``T * k`` (token, expert) pairs of ``ids[T, k]`` sorted by expert, stably:
    (order, inverse, group sizes), int32. ``order[r]`` is the pair at sorted row r (token
    ``order[r] // k``); ``inverse`` undoes it (``inverse[order[r]] == r``); ``sizes[g]`` counts
    expert g's pairs.

    The comparison path (``method`` "compare", or "auto" on a GPU while ``n * max(n, G) <=
    COMPARE_LIMIT``, n = T * k): one reduction over an ``[n + G, n]`` grid gives each pair's
    sorted position in its first n rows (``inverse[i]``: the pairs of a lower expert, or of
    the same expert at a lower index, as ``argsort(stable=True)`` orders them) and each
    expert's pair count in its last G; ``order`` picks the pair of each position, a second
    ``[n, n]`` reduction. Else an argsort and two scatters."""
    flat = ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    return _dispatch(method, n * max(n, num_experts) <= COMPARE_LIMIT,
                     lambda f: _sorted_by_rank(f, num_experts), lambda f: _sorted_by_argsort(f, num_experts),
                     flat)


def _sorted_by_argsort(flat, g: int):
    n = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n, dtype=jnp.int32))
    sizes = jnp.zeros((g,), jnp.int32).at[flat].add(1)
    return order, inverse, sizes


def _sorted_by_rank(flat, g: int):
    n = flat.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    row = jnp.arange(n + g, dtype=jnp.int32)[:, None]                # a pair i, then an expert
    mine = flat[jnp.minimum(row, n - 1)]                             # [n + G, 1]: pair row's expert
    other = flat[None, :]                                            # [1, n]: pair j's expert
    before = (other < mine) | ((other == mine) & (i[None, :] < row))
    counted = jnp.where(row < n, before, other == row - n)
    counts = jnp.sum(counted, axis=-1, dtype=jnp.int32)              # [n + G]
    inverse, sizes = counts[:n], counts[n:]
    order = jnp.sum(jnp.where(inverse[None, :] == i[:, None], i[None, :], 0), axis=-1, dtype=jnp.int32)
    return order, inverse, sizes


def sorted_tokens(tokens, order, k: int):
    """``tokens[order // k]``: the token row of each sorted pair (``tokens[T, K]``, ``order``
    of `sorted_rows`). With one token every pair's row is that token: a broadcast, without
    the gather or ``order``."""
    if tokens.shape[0] == 1:
        return jnp.broadcast_to(tokens, (order.shape[0], tokens.shape[1]))
    return tokens[order // k]
