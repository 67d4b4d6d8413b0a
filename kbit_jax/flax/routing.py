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

`route_sorted` does both steps of a block (``route``, then ``sorted_rows`` of its ids). With
``method="kernel"`` (and with "auto" on an NVIDIA GPU where `routing_kernel.supported` says it
fits: decode batches) they run as one Pallas kernel (`kbit_jax.flax.routing_kernel`) instead of
XLA's several launch-bound ones; its results are the comparison path's but for the rounding
ties that module's docstring describes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import routing_kernel

__all__ = ["COMPARE_LIMIT", "ROUTING_METHODS", "SELECT_METHODS", "route", "route_sorted", "sorted_rows",
           "sorted_tokens", "top_k"]

#: How `top_k` and `sorted_rows` select: "auto" (comparisons on a GPU while the grid is within
#: `COMPARE_LIMIT`, else the sort), "compare", "sort".
SELECT_METHODS = ("auto", "compare", "sort")
#: How `route` and `route_sorted` (a MoE block's ``routing=``) run: `SELECT_METHODS`, or "kernel"
#: (`routing_kernel.route_sorted`, one Pallas kernel; ValueError where it does not fit). "auto":
#: that kernel on an NVIDIA GPU where it fits, else `SELECT_METHODS`' "auto".
ROUTING_METHODS = SELECT_METHODS + ("kernel",)

#: Most elements of one compare-and-reduce grid before the sort path is taken: 2^21 is 8
#: compares per thread over one wave of an H200 (132 SMs x 2048 resident threads = 2^18), well
#: under a microsecond of integer work, while one sort or scatter kernel is a launch-bound 1-5
#: microseconds. Decode of a 512-expert block at batch 8 (top-k: 8 x 512 x 512 = 2^21) stays
#: on the comparison path.
COMPARE_LIMIT = 2**21


def _dispatch(method: str, fits: bool, compare, sort, *args):
    """``compare(*args)`` or ``sort(*args)`` as ``method`` says (see `ROUTING_METHODS`)."""
    if method not in SELECT_METHODS:
        raise ValueError(f"method must be one of {SELECT_METHODS}, got {method!r}")
    if method == "compare":
        return compare(*args)
    if method == "sort" or not fits:
        return sort(*args)
    return jax.lax.platform_dependent(*args, cuda=compare, rocm=compare, default=sort)


def _total_order_key(x):
    """int32 keys that order float32 ``x`` as ``lax.top_k`` orders numbers, -0.0 below +0.0, and
    (positive) NaN above +inf: a total order, so the ranks of `_ranks` are a
    permutation and the ids valid whatever the router gives."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _ranks(x):
    """The rank of each of ``x[T, G]``'s entries in its row: the number of entries that precede
    it (a larger value, or an equal value at a lower index), one ``[T, G, G]``
    compare-and-reduce; a permutation of 0..G-1 per row."""
    key = _total_order_key(x)
    e = jnp.arange(x.shape[1], dtype=jnp.int32)
    mine, other = key[:, :, None], key[:, None, :]                   # [T, e, f]
    precedes = (other > mine) | ((other == mine) & (e[None, :] < e[:, None]))
    return jnp.sum(precedes, axis=-1, dtype=jnp.int32)


def _top_k_by_rank(x, k: int):
    """The comparison path of `top_k`: the id of slot j is the expert of rank j, its value the
    only term of a masked max (a max over the others at -inf is that value bit for bit)."""
    rank = _ranks(x)
    hit = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]   # [T, k, G]
    ids = jnp.max(jnp.where(hit, jnp.arange(x.shape[1], dtype=jnp.int32), -1), axis=-1)
    values = jnp.max(jnp.where(hit, x[:, None, :], -jnp.inf), axis=-1)
    return values, ids


def _probs_top_k_by_rank(probs, k: int):
    """`_top_k_by_rank` of softmax probabilities (no -0.0) with the sum of the k values: slot k
    of the same reduction sums every value of rank < k (the values, in another order)."""
    rank = _ranks(probs)
    slot = jnp.arange(k + 1, dtype=jnp.int32)[None, :, None]
    hit = jnp.where(slot < k, rank[:, None, :] == slot, rank[:, None, :] < k)   # [T, k + 1, G]
    ids = jnp.sum(jnp.where(hit, jnp.arange(probs.shape[1], dtype=jnp.int32), 0), axis=-1, dtype=jnp.int32)
    sums = jnp.sum(jnp.where(hit, probs[:, None, :], 0.0), axis=-1)   # slot j < k: its one value
    return sums[:, :k], ids[:, :k], sums[:, k]


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
    renormalized to sum to 1 when ``normalize``. On the comparison path the renormalizing sum
    comes out of the reduction that picks the values (no kernel of its own); it adds the same
    k values in another order, so the weights are within ``(k + 2) * 2^-23`` relative of the
    sort path's. ``method`` "kernel" (or "auto" where `route_sorted` takes the kernel): the
    weights and ids of `route_sorted`."""
    if method not in ROUTING_METHODS:
        raise ValueError(f"method must be one of {ROUTING_METHODS}, got {method!r}")
    if method == "kernel" or (method == "auto" and _kernel_fits(logits, k)):
        return route_sorted(logits, k, normalize, method=method)[:2]
    return _route(logits, k, normalize, method)


def _route(logits, k: int, normalize: bool, method: str):
    """`route` on the comparison or sort path (``method`` one of `SELECT_METHODS`)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    t, g = probs.shape

    def sort(p):
        values, ids = jax.lax.top_k(p, k)
        return values, ids.astype(jnp.int32), jnp.sum(values, axis=-1)

    weights, ids, total = _dispatch(method, t * g * g <= COMPARE_LIMIT,
                                    lambda p: _probs_top_k_by_rank(p, k), sort, probs)
    if normalize:
        weights = weights / total[:, None]
    return weights, ids


def _kernel_fits(logits, k: int) -> bool:
    return logits.ndim == 2 and routing_kernel.supported(*logits.shape, k) is None


def route_sorted(logits, k: int, normalize: bool, *, method: str = "auto"):
    """`route` and `sorted_rows` of its ids, as a block routes its tokens: (weights float32[T, k],
    ids int32[T, k], order, inverse int32[T * k], sizes int32[G]) for ``logits[T, G]``.

    ``method`` (`ROUTING_METHODS`): "kernel" runs `routing_kernel.route_sorted`, one Pallas
    kernel (interpreted off the GPU; ValueError where `routing_kernel.supported` says it does
    not fit); "auto" runs it on an NVIDIA GPU where it fits, elsewhere `route` and
    `sorted_rows` with "auto"; "compare" and "sort" run those two with that method."""
    if method not in ROUTING_METHODS:
        raise ValueError(f"method must be one of {ROUTING_METHODS}, got {method!r}")
    g = logits.shape[-1]

    def xla(logits, method):
        weights, ids = _route(logits, k, normalize, method)
        return (weights, ids, *sorted_rows(ids, g, method=method))

    if method == "kernel":
        return _replicated(lambda x: routing_kernel.route_sorted(x, k, normalize))(logits)
    if method == "auto" and _kernel_fits(logits, k):
        kernel = _replicated(lambda x: routing_kernel.route_sorted(x, k, normalize, interpret=False))
        return jax.lax.platform_dependent(logits, cuda=kernel, default=lambda x: xla(x, "auto"))
    return xla(logits, method)


def _replicated(kernel):
    """``kernel`` on every device of the active mesh alike (under ``shard_map``, replicated in and
    out: every device routes all tokens), or as it is without a mesh or inside a ``shard_map``
    over all of its axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual:
        return kernel
    return jax.shard_map(kernel, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def sorted_rows(ids, num_experts: int, *, method: str = "auto"):
    """The ``T * k`` (token, expert) pairs of ``ids[T, k]`` sorted by expert, stably:
    (order, inverse, group sizes), int32. ``order[r]`` is the pair at sorted row r (token
    ``order[r] // k``); ``inverse`` undoes it (``inverse[order[r]] == r``); ``sizes[g]`` counts
    expert g's pairs.

    The comparison path (``method`` "compare", or "auto" on a GPU while ``n * max(n, G) <=
    COMPARE_LIMIT``, n = T * k): compare-and-reduce over ``[max(n, G), n]`` for each pair's
    sorted position (``inverse[i]``: the pairs of a lower expert, or of the same expert at a
    lower index, as ``argsort(stable=True)`` orders them) and each expert's pair count;
    ``order`` picks the pair of each position, an ``[n, n]`` reduction. Else an argsort and
    two scatters."""
    flat = ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    if n == 0:
        method = "sort"
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
    # Two sibling reductions over one [max(n, G), n] grid (one multi-output kernel when XLA
    # fuses them; the counts then need no slice copy while n <= G): in row r, the pairs j
    # sorted before pair r, and the pairs j of expert r.
    r = jnp.arange(max(n, g), dtype=jnp.int32)[:, None]
    mine, other = flat[jnp.minimum(r, n - 1)], flat[None, :]
    before = (other < mine) | ((other == mine) & (i[None, :] < r))
    inverse = jnp.sum(before, axis=-1, dtype=jnp.int32)[:n]
    sizes = jnp.sum(other == r, axis=-1, dtype=jnp.int32)[:g]
    order = jnp.sum(jnp.where(inverse[None, :] == i[:, None], i[None, :], 0), axis=-1, dtype=jnp.int32)
    return order, inverse, sizes


def sorted_tokens(tokens, order, k: int):
    """``tokens[order // k]``: the token row of each sorted pair (``tokens[T, K]``, ``order``
    of `sorted_rows`). With one token every pair's row is that token: a broadcast, without
    the gather or ``order``."""
    if tokens.shape[0] == 1:
        return jnp.broadcast_to(tokens, (order.shape[0], tokens.shape[1]))
    return tokens[order // k]
