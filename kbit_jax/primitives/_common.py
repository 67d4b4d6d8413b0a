"""What the kbit primitives share: output avals that keep manual-axis information,
FFI lowerings with a reference fallback, and the fold-into-B batching rule."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

from .. import _ext, reference


def _varying_axes(aval) -> frozenset:
    mat = getattr(aval, "mat", None)             # jax >= 0.10: ManualAxisType
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))   # older jax


def out_aval(shape, dtype, avals_in: Sequence) -> jax.core.ShapedArray:
    """A result aval that varies over the union of the inputs' manual mesh axes.

    Inside ``shard_map`` a plain ``ShapedArray`` would drop that information: gradients
    would then come out wrong by the mesh size and some out_specs would silently return one
    device's data (docs/design/jax_integration.md). So the result is derived from the most-varying input.
    """
    vma = frozenset().union(*map(_varying_axes, avals_in))
    if not vma:
        return jax.core.ShapedArray(shape, dtype)
    src = max(avals_in, key=lambda a: len(_varying_axes(a)))
    mesh = src.sharding.mesh
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * len(shape))))
    if hasattr(src, "mat"):
        return src.update(shape=shape, dtype=dtype, sharding=sharding,
                          manual_axis_type=src.mat.update(varying=vma))
    return src.update(shape=shape, dtype=dtype, sharding=sharding, vma=vma)


def define(prim: jax.extend.core.Primitive, *, abstract_eval: Callable, reference: Callable,
           ffi_attrs: Callable[..., dict], batcher: Callable | None = None,
           cuda_lowering: Callable | None = None, rule=None,
           split_at_reduction: Callable | None = None) -> jax.extend.core.Primitive:
    """Give `prim` its rules. Eager calls compile the primitive alone with XLA; lowering:
    cpu -> the C++ FFI target named like the primitive, cuda -> the CUDA target (or
    `cuda_lowering`), any platform without a kernel -> `reference` traced to HLO. The default
    batcher folds vmapped axes into the leading batch axis.

    With a `kbit_jax.sharding.FactorRule` ``rule`` (or a function of the primitive's params
    returning one), those platform lowerings go to a twin *kernel* primitive
    (``<name>_kernel``, returned) and `prim` (which keeps the abstract eval, batching and AD
    rules) lowers through ``custom_partitioning`` so that XLA partitions it without gathering
    operands; the rule also gives results their sharding type under Explicit mesh axes. See
    `kbit_jax.sharding`. ``split_at_reduction(**params)`` may return ``(params', finish)`` for
    a result that is not a sum over a sharded reduction factor's shards: the shards then run
    the kernel with ``params'``, and ``finish`` follows the psum."""
    from jax._src import dispatch  # apply_primitive: the standard eager impl of a primitive

    target = prim.name
    prim.def_impl(lambda *args, **params: dispatch.apply_primitive(prim, *args, **params))
    rule_for = rule if callable(rule) else (lambda **params: rule)
    prim.def_abstract_eval(abstract_eval if rule is None
                           else _with_sharding_types(abstract_eval, rule_for, prim.multiple_results))
    batching.primitive_batchers[prim] = batcher or (
        lambda args, dims, **params: fold_batch_into_leading_axis(prim, args, dims, **params))
    kernel = prim
    if rule is not None:
        kernel = jax.extend.core.Primitive(prim.name + "_kernel")
        kernel.multiple_results = prim.multiple_results
        kernel.def_abstract_eval(abstract_eval)
        _partition_through_kernel(prim, kernel, rule_for, split_at_reduction)
    reference_lowering = mlir.lower_fun(reference, multiple_results=prim.multiple_results)
    ffi_rule = jax.ffi.ffi_lowering(target)

    def cpu_rule(ctx, *args, **params):
        if not _ext.has_cpu():
            return reference_lowering(ctx, *args, **params)
        return ffi_rule(ctx, *args, **ffi_attrs(**params))

    def cuda_rule(ctx, *args, **params):
        if not _ext.has_cuda():
            return reference_lowering(ctx, *args, **params)
        if cuda_lowering is not None:
            return cuda_lowering(ctx, *args, **params)
        return ffi_rule(ctx, *args, **ffi_attrs(**params))

    mlir.register_lowering(kernel, reference_lowering)
    mlir.register_lowering(kernel, cpu_rule, platform="cpu")
    mlir.register_lowering(kernel, cuda_rule, platform="cuda")
    return kernel


def _with_sharding_types(abstract_eval: Callable, rule_for: Callable, multiple_results: bool) -> Callable:
    """Wrap an abstract eval so results carry the sharding the rule derives from the inputs'
    sharding types (needed under Explicit mesh axes; a no-op for plain avals)."""
    from ..sharding import result_shardings

    def wrapped(*avals, **params):
        out = abstract_eval(*avals, **params)
        shardings = result_shardings(rule_for(**params), avals)
        if shardings is None:
            return out
        outs = [o.update(sharding=s) for o, s in zip(out if multiple_results else (out,), shardings)]
        return outs if multiple_results else outs[0]

    return wrapped


def _partition_through_kernel(prim, kernel, rule_for, split_at_reduction) -> None:
    """Lower `prim` to `kernel`: through custom_partitioning when XLA partitions the program
    over several devices, directly otherwise (one device, or inside shard_map/pmap)."""
    import functools

    from jax._src import dispatch
    from ..sharding import needs_partitioning, partitioned, strip_aval

    @functools.lru_cache(maxsize=None)
    def partitioned_fn(params):
        kw = dict(params)
        split = split_at_reduction(**kw) if split_at_reduction else None
        if split is not None:
            split_kw, finish = split
            split = (lambda *args: kernel.bind(*args, **split_kw), finish)
        return partitioned(lambda *args: kernel.bind(*args, **kw), rule_for(**kw),
                           multiple_results=prim.multiple_results, split_at_reduction=split)

    def lowering(ctx, *args, **params):
        # The kernel sees plain local shapes: no sharding types, no manual-axis types.
        ctx = ctx.replace(avals_in=[strip_aval(a) for a in ctx.avals_in],
                          avals_out=[strip_aval(a) for a in ctx.avals_out])
        if needs_partitioning(ctx):
            fn = partitioned_fn(tuple(sorted(params.items())))
        else:
            fn = lambda *a: kernel.bind(*a, **params)  # noqa: E731
        return mlir.lower_fun(fn, multiple_results=prim.multiple_results)(ctx, *args)

    mlir.register_lowering(prim, lowering)
    # custom_partitioning needs the device assignment while lowering; `prim` hides it.
    getattr(dispatch, "prim_requires_devices_during_lowering", set()).add(prim)


def fold_batch_into_leading_axis(prim, args, dims, **params):
    """vmap rule: move each vmapped axis to the front and merge it with the batch axis B.

    Operands not being mapped are broadcast. Results come back as [V, B, ...]."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args, dims):
        if d is None:
            a = jnp.broadcast_to(a[None], (size, *a.shape))
        else:
            a = jnp.moveaxis(a, d, 0)
        folded.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    outs = prim.bind(*folded, **params)

    def unfold(o):
        return o.reshape(size, o.shape[0] // size, *o.shape[1:])

    if prim.multiple_results:
        return [unfold(o) for o in outs], [0] * len(outs)
    return unfold(outs), 0


def layout_attr(layout: str) -> np.int32:
    from ..format import LAYOUT_IDS
    return np.int32(LAYOUT_IDS[layout])


# -- differentiation ---------------------------------------------------------------------------
def explicit_axes(sharding) -> tuple[str, ...]:
    """The mesh axes of ``sharding``'s mesh that are of type Explicit (none for a sharding on
    no mesh, or a mesh of Auto / Manual axes)."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return ()
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                 if t == jax.sharding.AxisType.Explicit)


def with_auto_axes(fn, *args, out_sharding):
    """``fn(*args)`` with ``out_sharding``'s Explicit mesh axes treated as Auto inside, the
    result resharded to ``out_sharding``; plain ``fn(*args)`` where there are none.

    The derivative rules use reference.py's dequantize (reshapes that regroup a cell's bits, a
    gather from the codebook) and XLA's ragged_dot, whose result types JAX cannot infer from
    sharded operands under Explicit axes (ShardingTypeError / NotImplementedError); under Auto
    axes XLA propagates the shardings itself, and the operands' shardings are kept, so no
    weight is gathered."""
    axes = explicit_axes(out_sharding)
    if not axes:
        return fn(*args)
    return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding)(*args)


def _padded_spec(sharding, ndim) -> tuple:
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (ndim - len(spec))


def _entry_axes(entry) -> set:
    return set() if entry is None else {entry} if isinstance(entry, str) else set(entry)


def x_cotangent(product, ct, w, x_aval, *, k_dim: int):
    """x's cotangent ``product(ct, w)`` (a contraction of the cotangent with the dense
    float32 weight ``w`` whose K is axis ``k_dim``) with x's sharding type.

    Under Explicit mesh axes the product is formed where it needs no weight moved - x's
    sharding on its other axes, K sharded as the weight's K - and then resharded to x's type
    (an x replicated over a row-parallel weight's mesh gathers the [.., M, K] cotangent, not
    the weight); an x placed on no mesh gets a cotangent replicated over the weight's mesh."""
    target = x_aval.sharding
    if target.mesh.empty:
        target = jax.sharding.NamedSharding(jax.typeof(w).sharding.mesh, jax.sharding.PartitionSpec())
    if not explicit_axes(target):
        return product(ct, w)
    x_spec = _padded_spec(target, len(x_aval.shape))
    k_entry = _padded_spec(jax.typeof(w).sharding, w.ndim)[k_dim]
    if _entry_axes(k_entry) & set().union(*map(_entry_axes, x_spec[:-1])):
        k_entry = None
    natural = jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec(*x_spec[:-1], k_entry))
    return jax.sharding.reshard(with_auto_axes(product, ct, w, out_sharding=natural), target)


def _dense_weight_sharding(planes):
    """The sharding type of the dense W[B, K, N] of ``planes[B, K/32, N, bits]``: K as the
    K/32 blocks, N as planes' N (a cell never straddles a shard)."""
    sharding = jax.typeof(planes).sharding
    spec = _padded_spec(sharding, planes.ndim)[:-1]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def weight_tangent(planes, scales, codebook, tensor_scale, t_codebook, t_tensor_scale, *, layout):
    """dW[B, K, N] (float32) for tangents of the codebook and tensor_scale (``ad.Zero`` or
    arrays), or None when both are zero. W = codebook[code] * decode(scale) * tensor_scale is
    linear in each of the two for fixed codes and scales, so dW is the reference's dense W with
    the tangent in their place, which JAX transposes itself (the gather over the codebook
    becomes a scatter-add). Under Explicit mesh axes dW has the weight's sharding
    (`with_auto_axes`)."""
    has_codebook, has_scale = (type(t) is not ad.Zero for t in (t_codebook, t_tensor_scale))
    if not (has_codebook or has_scale):
        return None

    def dense(planes, scales, codebook, tensor_scale, t_codebook, t_tensor_scale):
        dw = None
        if has_codebook:
            dw = reference.dequantize(planes, scales, t_codebook, tensor_scale, layout=layout)
        if has_scale:
            dw_scale = reference.dequantize(planes, scales, codebook, t_tensor_scale, layout=layout)
            dw = dw_scale if dw is None else dw + dw_scale
        return dw

    # Operands go in as arguments (not closed over) so that with_auto_axes retypes them.
    tangents = [None if type(t) is ad.Zero else t for t in (t_codebook, t_tensor_scale)]
    return with_auto_axes(dense, planes, scales, codebook, tensor_scale, *tangents,
                          out_sharding=_dense_weight_sharding(planes))


def zero_tangent(y):
    """The symbolic zero tangent of ``y`` (float0 for integer ``y``)."""
    return ad.Zero(jax.typeof(y).to_tangent_aval())
