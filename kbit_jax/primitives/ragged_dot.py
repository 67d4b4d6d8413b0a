"""ragged_dot_p: the grouped expert product of a mixture-of-experts layer.

Operands: x[M, K] with rows sorted by group, a weight stacked over G groups (planes[G, K/32,
N, bits], scales[G, K/32, N], codebook[G, C], tensor_scale[G]) and group_sizes int32[G];
result y[M, N] (N / 2 with a GLU) in x's dtype. Group g owns rows
``[starts[g], starts[g + 1])`` (`reference.group_bounds`: prefix sums of the sizes, a negative
size counting as 0, cut at M); rows past the last group are zeros. Semantics:
``jax.lax.ragged_dot(x, dequantize(w), group_sizes)`` accumulated in float32, then the GLU on
the float32 sums as `matmul_p` has it (`reference.ragged_dot` is the spec). The FFI target
``kbit_ragged_dot`` takes exactly these six operands and the attributes ``layout`` and
``glu`` on CPU and CUDA.

Params: ``layout``; ``method``: "fused" / "auto" run the grouped kernel, "dequantize"
materializes every expert in x's dtype and uses XLA's ``ragged_dot`` (on the GPU that reads
every expert, not only those with rows); ``glu``: None or a `reference.GLU_ACTIVATIONS` name.

Partitioning (under ``jit`` over several devices): experts' N sharded needs no collective; K
sharded sums the shards' products (one all-reduce); G sharded (experts spread over devices)
runs each device's experts on the rows they own and sums over the expert axis (one
all-reduce of y): no weight is ever gathered. Rows (M) are replicated, since every row's group
follows from the global group_sizes: a token-sharded x is gathered (activations, not weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from .. import _ext, reference
from ..format import BLOCK
from ..sharding import FactorRule, needs_partitioning, partitioned, strip_aval
from ._common import (_varying_axes, define, layout_attr, out_aval, weight_tangent, with_auto_axes,
                      x_cotangent, zero_tangent)
from .dequantize import dequantize_kernel_p, dequantize_p
from .matmul import GLU_IDS

ragged_dot_p = Primitive("kbit_ragged_dot")
METHODS = ("auto", "fused", "dequantize")
TARGET = "kbit_ragged_dot"


def _abstract_eval(x, planes, scales, codebook, tensor_scale, group_sizes, *, layout, method, glu):
    n = planes.shape[2] // (2 if glu else 1)
    return out_aval((x.shape[0], n), x.dtype, (x, planes, scales, codebook, tensor_scale, group_sizes))


def _reference(x, planes, scales, codebook, tensor_scale, group_sizes, *, layout, method, glu):
    return reference.ragged_dot(x, planes, scales, codebook, tensor_scale, group_sizes,
                                layout=layout, glu=glu)


def _ffi_attrs(*, layout, method, glu):
    return {"layout": layout_attr(layout), "glu": np.int32(GLU_IDS[glu])}


def _sanitized_sizes(group_sizes, m):
    """Sizes >= 0 that sum to at most m, giving the same groups (`reference.group_bounds`)."""
    return jnp.diff(reference.group_bounds(group_sizes, m)).astype(jnp.int32)


def _dequantize_then_ragged_dot(x, planes, scales, codebook, tensor_scale, group_sizes, *, layout,
                                method, glu):
    w = dequantize_kernel_p.bind(planes, scales, codebook, tensor_scale, layout=layout, dtype=x.dtype)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = jax.lax.ragged_dot(x, w, _sanitized_sizes(group_sizes, x.shape[0]), precision=precision,
                           preferred_element_type=jnp.float32)
    if glu is not None:
        y = reference.apply_glu(y, glu)
    return y.astype(x.dtype)


_dequantize_lowering = mlir.lower_fun(_dequantize_then_ragged_dot, multiple_results=False)
_ffi_cuda_lowering = jax.ffi.ffi_lowering(TARGET)


@functools.lru_cache(maxsize=None)
def _cuda_has_target() -> bool:
    """Whether the CUDA module registers kbit_ragged_dot (the grouped CUDA kernel)."""
    cuda = _ext._load("_kbit_cuda") if _ext.has_cuda() else None
    return cuda is not None and TARGET in cuda.registrations()


def _cuda_lowering(ctx, *args, layout, method, glu):
    if method == "dequantize" or not _cuda_has_target():
        return _dequantize_lowering(ctx, *args, layout=layout, method=method, glu=glu)
    return _ffi_cuda_lowering(ctx, *args, **_ffi_attrs(layout=layout, method=method, glu=glu))


# -- batching: every vmapped token set becomes groups of one flat grouped product ---------------
def _fold_token_sets(x, group_sizes, weights):
    """Token sets ``x[V, M, K]`` with ``group_sizes[V, G]`` as one grouped product's operands.

    Each set's rows get a key (set v, group g) -> ``v * G + g`` when ``weights`` (leaves with a
    leading ``[V, G]``) give every set its own experts, or ``g`` when ``weights`` is None (shared
    experts); rows past their set's groups get the largest key. Rows are stably sorted by key;
    the group sizes are the keys' counts. Returns (rows [V * M, K], weight leaves folded to
    ``[V * G, ...]`` or None, sizes, unfold) with ``unfold(y)`` putting the product's rows back
    as ``[V, M, ...]``."""
    v, m, k = x.shape
    groups = group_sizes.shape[1]
    if weights is not None:
        weights = [a.reshape(v * groups, *a.shape[2:]) for a in weights]
    starts = jax.vmap(lambda s: reference.group_bounds(s, m))(group_sizes)  # [V, G + 1]
    rows = jnp.arange(m)
    group = jax.vmap(lambda s: jnp.searchsorted(s[1:], rows, side="right"))(starts)   # [V, M]
    flat_groups = v * groups if weights is not None else groups
    offset = (jnp.arange(v) * groups)[:, None] if weights is not None else 0
    key = jnp.where(group < groups, group + offset, flat_groups).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((flat_groups,), jnp.int32).at[key].add(1, mode="drop")

    def unfold(y):
        return jnp.zeros_like(y).at[order].set(y).reshape(v, m, *y.shape[1:])

    return x.reshape(v * m, k)[order], weights, sizes, unfold


def _leading(a, d, size):
    return jnp.broadcast_to(a[None], (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)


def _batcher(args, dims, *, layout, method, glu):
    """vmap over token sets (x and group_sizes) and/or stacked weights, as one kernel call
    (`_fold_token_sets`)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    weight = None
    if any(d is not None for d in dims[1:5]):
        weight = [_leading(a, d, size) for a, d in zip(args[1:5], dims[1:5])]
    rows, folded, sizes, unfold = _fold_token_sets(_leading(args[0], dims[0], size),
                                                   _leading(args[5], dims[5], size), weight)
    y = ragged_dot_p.bind(rows, *(folded if folded is not None else args[1:5]), sizes,
                          layout=layout, method=method, glu=glu)
    return unfold(y), 0


@jax.custom_batching.custom_vmap
def _float_ragged_dot(lhs, rhs, group_sizes):
    """XLA's ragged_dot in float32 at full precision (the x-gradient's product), with sizes
    made valid (`_sanitized_sizes`); vmapped like ragged_dot_p (XLA's batches only some axes)."""
    return jax.lax.ragged_dot(lhs, rhs, _sanitized_sizes(group_sizes, lhs.shape[0]),
                              precision=jax.lax.Precision.HIGHEST)


@_float_ragged_dot.def_vmap
def _float_ragged_dot_vmap(axis_size, in_batched, lhs, rhs, group_sizes):
    lhs_b, rhs_b, sizes_b = in_batched
    lead = lambda a, b: a if b else jnp.broadcast_to(a[None], (axis_size, *a.shape))  # noqa: E731
    rows, folded, sizes, unfold = _fold_token_sets(lead(lhs, lhs_b), lead(group_sizes, sizes_b),
                                                   [rhs] if rhs_b else None)
    return unfold(_float_ragged_dot(rows, folded[0] if rhs_b else rhs, sizes)), True


# -- partitioning ----------------------------------------------------------------------------
#: Factors of the six operands (for the result's sharding type under Explicit mesh axes): the
#: K blocks `k` and experts `g` are contracted; rows `m` and the group sizes `h` stay whole.
SHARDING_RULE = FactorRule("m (k i), g k n j, g k n, g c, g, h -> m n", reduction=("k", "g"),
                           replicated=("m", "i", "j", "c", "h"), order=(1, 2, 0, 3, 4, 5), i=BLOCK)
GLU_SHARDING_RULE = FactorRule("m (k i), g k (n p) j, g k (n p), g c, g, h -> m n",
                               reduction=("k", "g"), replicated=("m", "i", "j", "c", "h"),
                               order=(1, 2, 0, 3, 4, 5), i=BLOCK, p=2)


@functools.lru_cache(maxsize=None)
def _partition_rule(glu: bool) -> FactorRule:
    """What the partitioner sees: the six operands and the experts' global ids (int32[G],
    sharded like the weights), so that each device finds the rows of its own experts."""
    n = "(n p)" if glu else "n"
    sizes = {"i": BLOCK} | ({"p": 2} if glu else {})
    return FactorRule(f"m (k i), g k {n} j, g k {n}, g c, g, h, g -> m n", reduction=("k", "g"),
                      replicated=("m", "i", "j", "c", "h"), order=(1, 2, 6, 0, 3, 4, 5), **sizes)


def _sharding_rule(*, layout, method, glu):
    return SHARDING_RULE if glu is None else GLU_SHARDING_RULE


def local_experts_product(kernel, x, planes, scales, codebook, tensor_scale, group_sizes, first_expert):
    """One device's share of a grouped product whose experts are spread over devices: this
    device holds the ``planes.shape[0]`` experts from global id ``first_expert``; ``x`` holds
    every row and ``group_sizes`` every expert's size. Rows of other experts come out 0, so the
    devices' results sum to the full product. ``kernel(x, planes, ..., sizes)`` is the grouped
    product on the local experts."""
    local, m = planes.shape[0], x.shape[0]
    if local == group_sizes.shape[0]:
        return kernel(x, planes, scales, codebook, tensor_scale, group_sizes)
    starts = reference.group_bounds(group_sizes, m)
    mine = jax.lax.dynamic_slice(starts, (first_expert,), (local + 1,))
    # The local experts' rows [mine[0], mine[-1]) moved to the front, and back after.
    y = kernel(jnp.roll(x, -mine[0], axis=0), planes, scales, codebook, tensor_scale,
               jnp.diff(mine).astype(jnp.int32))
    return jnp.roll(y, mine[0], axis=0)


@functools.lru_cache(maxsize=None)
def _partitioned_fn(params):
    kw = dict(params)

    def local(glu):
        def fn(x, planes, scales, codebook, tensor_scale, group_sizes, expert_ids):
            kernel = lambda *a: ragged_dot_kernel_p.bind(*a, **{**kw, "glu": glu})  # noqa: E731
            return local_experts_product(kernel, x, planes, scales, codebook, tensor_scale,
                                         group_sizes, expert_ids[0])
        return fn

    glu = kw["glu"]
    split = None
    if glu is not None:
        # A GLU does not commute with the sum over K's shards: the shards' products are summed
        # first and gated after.
        split = (local(None), lambda y: reference.apply_glu(y, glu))
    return partitioned(local(glu), _partition_rule(glu is not None), multiple_results=False,
                       split_at_reduction=split)


def _lowering(ctx, x, planes, scales, codebook, tensor_scale, group_sizes, **params):
    ctx = ctx.replace(avals_in=[strip_aval(a) for a in ctx.avals_in],
                      avals_out=[strip_aval(a) for a in ctx.avals_out])
    if needs_partitioning(ctx):
        cp = _partitioned_fn(tuple(sorted(params.items())))
        groups = ctx.avals_in[5].shape[0]
        fn = lambda *a: cp(*a, jnp.arange(groups, dtype=jnp.int32))  # noqa: E731
    else:
        fn = lambda *a: ragged_dot_kernel_p.bind(*a, **params)  # noqa: E731
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x, planes, scales, codebook,
                                                      tensor_scale, group_sizes)


#: The kernel primitive ragged_dot_p lowers to (directly, or per shard via custom_partitioning).
ragged_dot_kernel_p = define(ragged_dot_p, abstract_eval=_abstract_eval, reference=_reference,
                             ffi_attrs=_ffi_attrs, batcher=_batcher, cuda_lowering=_cuda_lowering,
                             rule=_sharding_rule)
# define() lowers ragged_dot_p through custom_partitioning of the six operands; the expert
# split needs the experts' ids as a seventh: this lowering replaces it.
mlir.register_lowering(ragged_dot_p, _lowering)


# -- differentiation ---------------------------------------------------------------------------
# y is linear in x and, for fixed codes and scales, in the codebook and tensor_scale
# (`_common.weight_tangent`); codes, scales and group sizes are integers, with float0 zeros.
def _jvp(primals, tangents, *, layout, method, glu):
    x, planes, scales, codebook, tensor_scale, group_sizes = primals
    tx, _, _, t_codebook, t_tensor_scale, _ = tangents
    weight = (planes, scales, codebook, tensor_scale)
    dw = weight_tangent(*weight, t_codebook, t_tensor_scale, layout=layout)
    if type(tx) is ad.Zero and dw is None:
        y = ragged_dot_p.bind(x, *weight, group_sizes, layout=layout, method=method, glu=glu)
        return y, zero_tangent(y)
    plain = lambda a: ragged_dot_p.bind(a, *weight, group_sizes, layout=layout,  # noqa: E731
                                        method=method, glu=None)
    y_plain = plain(x)
    t_plain = None if type(tx) is ad.Zero else plain(tx)
    if dw is not None:
        # XLA's ragged_dot (not `_float_ragged_dot`, whose custom vmap has no transpose): linear
        # in dw, which JAX transposes to the codebook's and tensor_scale's cotangents.
        def product(x, dw, group_sizes):
            return jax.lax.ragged_dot(x.astype(jnp.float32), dw,
                                      _sanitized_sizes(group_sizes, x.shape[0]),
                                      precision=jax.lax.Precision.HIGHEST)

        t_w = with_auto_axes(product, x, dw, group_sizes,
                             out_sharding=jax.typeof(y_plain).sharding).astype(x.dtype)
        t_plain = t_w if t_plain is None else t_plain + t_w
    if glu is None:
        return y_plain, t_plain
    return jax.jvp(lambda y: reference.apply_glu(y, glu), (y_plain,), (t_plain,))


def _transpose(ct, x, planes, scales, codebook, tensor_scale, group_sizes, *, layout, method, glu):
    """x's cotangent: each row's cotangent times its expert's transposed weight, a ragged_dot
    with the dequantized float32 experts (XLA's; the quantized format stores W along K only)."""
    assert glu is None, "a GLU product is not linear; its JVP transposes the plain product"
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(planes)
    x_aval = x.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(x_aval)] + [None] * 5
    w = dequantize_p.bind(planes, scales, codebook, tensor_scale, layout=layout, dtype=jnp.float32)
    # Under Explicit mesh axes JAX infers no result type for XLA's ragged_dot: x_cotangent
    # forms it under Auto axes.
    ct_x = x_cotangent(lambda ct, w: _float_ragged_dot(ct.astype(jnp.float32), jnp.swapaxes(w, 1, 2),
                                                       group_sizes),
                       ct, w, x_aval, k_dim=1)
    # Inside shard_map an x that is invariant over a mesh axis the weight varies over was
    # implicitly broadcast (pvary) into the op; its cotangent is the sum over that axis.
    extra = _varying_axes(jax.typeof(ct_x)) - _varying_axes(x_aval)
    if extra:
        ct_x = jax.lax.psum(ct_x, tuple(sorted(extra)))
    return [ct_x.astype(x_aval.dtype)] + [None] * 5


ad.primitive_jvps[ragged_dot_p] = _jvp
ad.primitive_transposes[ragged_dot_p] = _transpose
