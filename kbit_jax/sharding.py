"""Sharded (SPMD) use of kbit weights: placement helpers and the partitioning rules.

Two halves:

**Placement.** A ``KbitWeight`` for ``W[*batch, K, N]`` is laid out in 32-element cells
along K, so a slice at whole blocks along K, or any slice along N, is itself a valid weight
(docs/format.md). `shard_weight` places the four leaves from a *logical* PartitionSpec over
``(*batch, K, N)``: the K entry goes to the ``K/32`` axis of ``planes``/``scales``, the N
entry to their N axis, batch entries to every leaf's batch axes; ``codebook`` and
``tensor_scale`` are replicated except along batch axes. `column_parallel` (``P(None, tp)``,
output sharded on N, no collective) and `row_parallel` (``P(tp, None)``, x sharded on K,
local matmul + one all-reduce) are the two tensor-parallel layouts; `weight_specs` and
`weight_shardings` give the per-leaf specs/shardings for ``shard_map`` ``in_specs`` and
``jit`` ``in_shardings``.

**Partitioning.** Without a rule XLA treats a custom call as opaque and all-gathers its
sharded operands. Each kbit primitive therefore describes its operands with a `FactorRule`,
an einsum-like string such as ``"b m (k i), b k n j, b k n, b c, b -> b m n"`` (matmul:
``(k i)`` says x's K axis is the K/32 blocks ``k`` times the ``i = 32`` elements of a block,
so a K shard always cuts at whole blocks; ``k`` is a reduction factor). The rule is used
three ways:

1. as the Shardy ``sharding_rule`` of a `jax.experimental.custom_partitioning` wrapper, so
   the partitioner propagates shardings through the op without gathering (written for the
   operands' shapes by `FactorRule.shardy_rule`: with K = 32 the block factor ``k`` has size 1,
   which Shardy does not accept inside a compound, so ``(k i)`` becomes ``i``);
2. by the partition callback, which fixes one consistent sharding per factor (taken from the
   weight operands first, so weights never move; an activation is resharded instead),
   lowers the *kernel* on the local shards and ``psum``\\ s the result over the mesh axes of
   the reduction factors (row-parallel: exactly one all-reduce);
3. by the abstract eval, to give results a sharding type under ``Explicit`` mesh axes.

Layering (see `kbit_jax.primitives._common.define`): custom_partitioning has no batching or
AD rule of its own, so it sits *under* the user-visible primitive (``matmul_p`` etc., which
keep their abstract eval, vmap and AD rules). Each such primitive gets a twin
*kernel primitive* (``kbit_matmul_kernel``) that carries the real lowerings (C++ FFI on CPU,
the CUDA lowering with its method dispatch, the pure-JAX reference elsewhere). The outer
primitive lowers to ``custom_partitioning(kernel_p.bind)`` when the program is partitioned
over several devices by XLA (``jit`` with shardings), and straight to the kernel otherwise
(eager single device, ``jit`` on one device, inside ``shard_map``/``pmap`` where every value
is already local).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .format import BLOCK, KbitWeight

__all__ = [
    "FactorRule", "column_parallel", "row_parallel", "shard_weight", "weight_shardings",
    "weight_specs", "collective_counts", "all_gather_shapes",
]

# ------------------------------------------------------------------------------------------
# Placement helpers
# ------------------------------------------------------------------------------------------


def _entry_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry -> tuple of mesh axis names (() for None/unconstrained)."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _entry(axes: Sequence[str]):
    """Tuple of axis names -> a PartitionSpec entry."""
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _mesh_axis_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def weight_specs(w_q: KbitWeight, spec) -> KbitWeight:
    """Per-leaf PartitionSpecs (a `KbitWeight` of specs) for the logical spec ``spec``.

    ``spec`` covers the logical shape ``(*batch, K, N)``: exactly ``w_q.ndim`` entries, or
    ``P()`` for fully replicated. Useful as a ``shard_map`` ``in_specs`` entry. Divisibility
    is not checked here (it needs a mesh); `shard_weight` and `weight_shardings` check it.
    """
    if not isinstance(w_q, KbitWeight):
        raise TypeError(f"w_q must be a KbitWeight, got {type(w_q).__name__}")
    spec = P(*spec) if not isinstance(spec, P) else spec
    if len(spec) == 0:
        spec = P(*([None] * w_q.ndim))
    if len(spec) != w_q.ndim:
        names = ", ".join([f"batch{i}" for i in range(len(w_q.batch_shape))] + ["K", "N"])
        raise ValueError(
            f"spec {spec} must have one entry per logical weight axis ({names}) of the "
            f"weight's shape {w_q.shape}: expected {w_q.ndim} entries, got {len(spec)}")
    *batch, k, n = spec
    return KbitWeight(P(*batch, k, n, None), P(*batch, k, n), P(*batch, None), P(*batch),
                      layout=w_q.layout)


def _check_spec(w_q: KbitWeight, mesh, spec) -> P:
    spec = P(*spec) if not isinstance(spec, P) else spec
    weight_specs(w_q, spec)                        # length check with a clear message
    if len(spec) == 0:
        spec = P(*([None] * w_q.ndim))
    sizes = _mesh_axis_sizes(mesh)
    seen: set[str] = set()
    labels = [f"batch axis {i}" for i in range(len(w_q.batch_shape))] + ["K", "N"]
    for label, entry, dim in zip(labels, spec, w_q.shape):
        axes = _entry_axes(entry)
        for a in axes:
            if a not in sizes:
                raise ValueError(f"spec {spec}: {label} names mesh axis {a!r}, which is not "
                                 f"in the mesh (axes {tuple(sizes)})")
            if a in seen:
                raise ValueError(f"spec {spec}: mesh axis {a!r} is used more than once")
            seen.add(a)
        parts = math.prod(sizes[a] for a in axes)
        if label == "K":
            blocks = dim // BLOCK
            if blocks % parts:
                raise ValueError(
                    f"spec {spec}: K={dim} is sharded over mesh axes {axes} ({parts} shards), "
                    f"but a shard must hold whole {BLOCK}-element blocks and K/{BLOCK}={blocks} "
                    f"is not divisible by {parts}")
        elif dim % parts:
            raise ValueError(f"spec {spec}: {label} (size {dim}) is sharded over mesh axes "
                             f"{axes} ({parts} shards) and {dim} is not divisible by {parts}")
    return spec


def weight_shardings(w_q: KbitWeight, mesh, spec) -> KbitWeight:
    """Per-leaf `NamedSharding`\\ s (a `KbitWeight` of shardings), e.g. for ``jit``'s
    ``in_shardings``. Raises ValueError for a spec that cuts inside a block (see
    `shard_weight`)."""
    spec = _check_spec(w_q, mesh, spec)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), weight_specs(w_q, spec),
                        is_leaf=lambda s: isinstance(s, P))


def shard_weight(w_q: KbitWeight, mesh, spec) -> KbitWeight:
    """Place the leaves of ``w_q`` on ``mesh`` following a logical spec over ``(*batch, K, N)``.

    ``spec`` is a `PartitionSpec` with one entry per logical axis (``P()`` replicates).
    Sharding K splits the ``K/32`` block axis of ``planes``/``scales``; sharding N splits their
    N axis; batch entries split every leaf's batch axes; ``codebook`` and ``tensor_scale`` are
    otherwise replicated. Every shard is itself a valid `KbitWeight` (no repacking).

    Raises ValueError (naming the spec and axis) when K/32 or N (or a batch size) is not
    divisible by the number of shards, when an axis is not in the mesh or is used twice, or
    when the spec has the wrong length. Works with Auto and Explicit mesh axes.
    """
    shardings = weight_shardings(w_q, mesh, spec)
    return jax.tree.map(jax.device_put, w_q, shardings)


def _tp_spec(w_q: KbitWeight, k, n) -> P:
    return P(*([None] * len(w_q.batch_shape)), k, n)


def column_parallel(w_q: KbitWeight, mesh, axis="tp") -> KbitWeight:
    """Shard N over ``axis`` (``P(None, axis)``): ``x @ W`` needs no collective and its output
    is sharded on N over ``axis``. Batch axes (stacked weights) stay replicated."""
    return shard_weight(w_q, mesh, _tp_spec(w_q, None, axis))


def row_parallel(w_q: KbitWeight, mesh, axis="tp") -> KbitWeight:
    """Shard K over ``axis`` at whole blocks (``P(axis, None)``): with x sharded on K over the
    same axis (e.g. the output of a column-parallel layer), ``x @ W`` is a local matmul plus
    one all-reduce. Batch axes stay replicated."""
    return shard_weight(w_q, mesh, _tp_spec(w_q, axis, None))


# ------------------------------------------------------------------------------------------
# Partitioning rules
# ------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\(([^()]*)\)|([A-Za-z]\w*)")


def _parse_value(text: str) -> tuple[tuple[str, ...], ...]:
    dims = []
    for compound, single in _TOKEN.findall(text):
        dims.append(tuple(compound.split()) if compound else (single,))
    return tuple(dims)


class FactorRule:
    """An einsum-like sharding rule for a primitive, e.g. (matmul)
    ``FactorRule("b m (k i), b k n j, b k n, b c, b -> b m n", reduction=("k",),
    replicated=("i", "j", "c"), order=(1, 2, 0), i=32)``.

    Each operand/result dimension is one factor or a compound ``(major minor...)``; only the
    major factor of a dimension may be sharded (so ``(k i)`` with ``i = 32`` shards at whole
    blocks). ``reduction`` factors appear in operands only: the local results are summed over
    their mesh axes. ``replicated`` factors are never sharded. ``order`` is the operand
    priority when choosing each factor's mesh axes (weights first: weights never move).
    ``sizes`` give the sizes of factors that only appear as minor parts of compounds.
    """

    def __init__(self, rule: str, *, reduction: Sequence[str] = (), replicated: Sequence[str] = (),
                 order: Sequence[int] | None = None, **sizes: int):
        self.rule = rule
        operands, results = rule.split("->")
        self.operands = tuple(_parse_value(v) for v in operands.split(","))
        self.results = tuple(_parse_value(v) for v in results.split(","))
        self.reduction = tuple(reduction)
        self.replicated = tuple(replicated)
        self.order = tuple(order) if order is not None else tuple(range(len(self.operands)))
        self.sizes = dict(sizes)

    def __repr__(self):
        return f"FactorRule({self.rule!r}, reduction={self.reduction}, replicated={self.replicated})"

    # -- the Shardy rule ------------------------------------------------------------------
    def shardy_rule(self, shapes, result_shapes=()) -> tuple[str, dict]:
        """``(rule, keyword arguments)`` of ``str_to_sdy_sharding_rule`` for operands (and
        results) of these shapes. Shardy rejects a compound dimension holding a factor of size
        1, e.g. ``(k i)`` for K = 32 (one block): such a factor is left out of its compound
        (the dimension is then the other factors; a size-1 factor is never sharded anyway)."""
        sizes = self.sizes | self._factor_sizes(shapes, result_shapes)

        def dim(group):
            kept = [f for f in group if sizes.get(f) != 1] or list(group[:1])
            return kept[0] if len(kept) == 1 else "(" + " ".join(kept) + ")"

        def values(vals):
            return ", ".join(" ".join(dim(group) for group in value) for value in vals)

        rule = f"{values(self.operands)} -> {values(self.results)}"
        groups = [group for side in rule.split("->") for v in side.split(",") for group in _parse_value(v)]
        appearance = [f for group in groups for f in group]
        compound = {f for group in groups if len(group) > 1 for f in group[1:]}

        def special(factors):   # sorted by factor index (first appearance), as Shardy wants
            return tuple(sorted((f for f in factors if f in appearance), key=appearance.index))

        return rule, dict(reduction_factors=special(self.reduction),
                          need_replication_factors=special(self.replicated),
                          **{f: int(n) for f, n in self.sizes.items() if f in compound})

    # -- choosing one sharding per factor --------------------------------------------------
    def _factor_sizes(self, shapes, result_shapes=()) -> dict[str, int]:
        """Sizes of the factors that lead a dimension, from the operands' (then the results')
        shapes and the given sizes of minor factors."""
        sizes = {}
        pairs = list(zip(shapes, self.operands)) + list(zip(result_shapes, self.results))
        for shape, dims in pairs:
            for size, group in zip(shape, dims):
                minor = math.prod(self.sizes.get(f, 1) for f in group[1:])
                sizes.setdefault(group[0], size // minor)
        return sizes

    def assign(self, shapes, axes, mesh_sizes: dict[str, int]) -> dict[str, tuple[str, ...]]:
        """Mesh axes per factor from the operands' per-dimension axes.

        A factor takes the axes of the first operand (in ``order``) that shards it, minus
        axes already taken by another factor; a sharding that does not divide the factor
        evenly is ignored (that operand will be resharded), never padded.
        """
        factor_sizes = self._factor_sizes(shapes)
        chosen: dict[str, tuple[str, ...]] = {}
        used: set[str] = set()
        for i in self.order:
            for group, dim_axes in zip(self.operands[i], axes[i]):
                f = group[0]
                if f in chosen or f in self.replicated or not dim_axes:
                    continue
                cand = tuple(a for a in dim_axes if a not in used and a in mesh_sizes)
                parts = math.prod(mesh_sizes[a] for a in cand)
                if not cand or factor_sizes.get(f, 0) % parts:
                    continue
                chosen[f] = cand
                used.update(cand)
        return chosen

    def specs(self, chosen) -> tuple[tuple[P, ...], tuple[P, ...]]:
        """(operand specs, result specs) for a factor assignment."""
        def spec(dims):
            return P(*(_entry(chosen.get(group[0], ())) for group in dims))
        return tuple(map(spec, self.operands)), tuple(map(spec, self.results))

    def reduction_axes(self, chosen) -> tuple[str, ...]:
        return tuple(a for f in self.reduction for a in chosen.get(f, ()))


def _spec_axes(sharding, ndim) -> tuple[tuple[str, ...], ...]:
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(_entry_axes(e) for e in spec)


def result_shardings(rule: FactorRule, avals_in) -> list[NamedSharding] | None:
    """Result shardings for the abstract eval: derived from the inputs' sharding types.

    Returns None when no input carries a mesh (plain arrays: nothing to do). Under Explicit
    mesh axes the inputs' specs name those axes and the results get the matching spec (a
    reduction over an explicitly sharded K gives a result replicated over those axes: the
    partition function all-reduces). Auto and Manual axes never appear in specs.
    """
    meshes = [a.sharding.mesh for a in avals_in
              if getattr(a, "sharding", None) is not None and not a.sharding.mesh.empty]
    if not meshes:
        return None
    mesh = meshes[0]
    shapes = [a.shape for a in avals_in]
    axes = [_spec_axes(a.sharding, len(a.shape)) if getattr(a, "sharding", None) is not None
            else ((),) * len(a.shape) for a in avals_in]
    chosen = rule.assign(shapes, axes, _mesh_axis_sizes(mesh))
    _, result_specs = rule.specs(chosen)
    return [NamedSharding(mesh, s) for s in result_specs]


def _reshape_spec(in_shape, out_shape, spec, mesh_sizes) -> P | None:
    """The spec of ``reshape(x, out_shape)`` that moves no data, or None if there is none.

    A sharded input dimension ``d`` maps to the output dimension ``e`` with the same number of
    elements before it (``prod(in[:d]) == prod(out[:e])``) whose size the shard count divides:
    then each device's contiguous chunk is the same before and after (merges and splits of
    leading dimensions, inserted or removed unit dimensions).
    """
    spec = tuple(spec) + (None,) * (len(in_shape) - len(spec))
    out = [None] * len(out_shape)
    for d, entry in enumerate(spec):
        axes = _entry_axes(entry)
        if not axes:
            continue
        parts = math.prod(mesh_sizes[a] for a in axes)
        prefix = math.prod(in_shape[:d])
        for e, size in enumerate(out_shape):
            if (out[e] is None and size > 1 and size % parts == 0
                    and math.prod(out_shape[:e]) == prefix):
                out[e] = entry
                break
        else:
            return None
    return P(*out)


def reshape(x, shape):
    """``jnp.reshape`` that keeps an Explicit sharding when the reshape moves no data.

    Under Explicit mesh axes ``jnp.reshape`` refuses some reshapes that are free (say
    ``[8@dp, 3, K] -> [1, 24@dp, K]``); this gives it the ``out_sharding``. Elsewhere (Auto or
    Manual axes, no mesh) it is plain ``jnp.reshape``.
    """
    shape = tuple(shape)
    try:
        sharding = jax.typeof(x).sharding
    except TypeError:
        sharding = None
    if (sharding is None or sharding.mesh.empty or tuple(x.shape) == shape
            or not any(_entry_axes(e) for e in sharding.spec)):
        return jax.numpy.reshape(x, shape)
    spec = _reshape_spec(tuple(x.shape), shape, sharding.spec, _mesh_axis_sizes(sharding.mesh))
    if spec is None:
        return jax.numpy.reshape(x, shape)
    return jax.numpy.reshape(x, shape, out_sharding=NamedSharding(sharding.mesh, spec))


def _replicated_like(sharding):
    from jax._src import sharding_impls  # only for the GSPMDSharding fallback
    return sharding_impls.GSPMDSharding.get_replicated(sharding._device_assignment)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def partitioned(kernel: Callable, rule: FactorRule, *, multiple_results: bool,
                split_at_reduction: tuple[Callable, Callable] | None = None):
    """``custom_partitioning`` wrapper around ``kernel(*operands)`` following ``rule``.

    The partition callback reshards operands to one consistent sharding per factor, runs
    ``kernel`` on the local shards and psums the results over the reduction factors' axes
    (in the result dtype, as XLA does for a dense dot with a sharded contraction). With
    ``split_at_reduction = (local, finish)``, a sharded reduction runs ``local`` on the shards
    and ``finish`` on the sum instead (a result that is a function of the sum, e.g. a GLU).
    """
    from jax.experimental.custom_partitioning import custom_partitioning

    def fn(*args):
        out = kernel(*args)
        return tuple(out) if multiple_results else out

    def decide(mesh, arg_shapes):
        if not all(isinstance(s.sharding, NamedSharding) for s in arg_shapes):
            return None
        shapes = [s.shape for s in arg_shapes]
        axes = [_spec_axes(s.sharding, len(s.shape)) for s in arg_shapes]
        chosen = rule.assign(shapes, axes, _mesh_axis_sizes(mesh))
        arg_specs, res_specs = rule.specs(chosen)
        arg_sh = tuple(NamedSharding(mesh, s) for s in arg_specs)
        res_sh = tuple(NamedSharding(mesh, s) for s in res_specs)
        return arg_sh, res_sh, rule.reduction_axes(chosen)

    def pack(res_sh):
        return res_sh if multiple_results else res_sh[0]

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):   # GSPMD only
        decided = decide(mesh, arg_shapes)
        if decided is None:
            rep = _replicated_like(arg_shapes[0].sharding)
            return pack((rep,) * len(rule.results))
        return pack(decided[1])

    def partition(mesh, arg_shapes, result_shape):
        decided = decide(mesh, arg_shapes)
        if decided is None:                    # no mesh to reason with: replicate (correct)
            rep = _replicated_like(arg_shapes[0].sharding)
            return mesh, fn, pack((rep,) * len(rule.results)), (rep,) * len(arg_shapes)
        arg_sh, res_sh, red_axes = decided

        def lower_fn(*args):
            # Trace the local body with no ambient mesh. custom_partitioning traces it under
            # the caller's mesh (from jax 0.11 on), so under Explicit axes the kernel result and
            # with it psum's scalar reducer carried that mesh: the reducer was emitted with a
            # Sharding custom call inside, which XLA's GPU all-reduce cannot match to a
            # reduction kind (compile abort "reduction_kind.has_value()" on the H200).
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                if red_axes and split_at_reduction is not None:
                    local, finish = split_at_reduction
                    return finish(jax.lax.psum(local(*args), red_axes))
                out = fn(*args)
                if red_axes:
                    out = jax.tree.map(lambda y: jax.lax.psum(y, red_axes), out)
            return out

        return mesh, lower_fn, pack(res_sh), arg_sh

    def sharding_rule(mesh, operand_types, result_types):
        # Called per lowering with the MLIR types: the rule follows the shapes (size-1 factors).
        return rule.shardy_rule([tuple(t.shape) for t in operand_types],
                                [tuple(t.shape) for t in result_types])

    cp = custom_partitioning(fn)
    cp.def_partition(partition=partition, infer_sharding_from_operands=infer_sharding_from_operands,
                     sharding_rule=sharding_rule)
    return cp


def needs_partitioning(ctx) -> bool:
    """Whether a lowering must go through custom_partitioning: XLA partitions the program over
    several devices and no mesh axis is manual (inside shard_map/pmap every operand is
    already the local shard, so the kernel is lowered directly)."""
    axis_context = ctx.module_context.axis_context
    # ShardingContext: jit/GSPMD-Shardy partitioning; SPMDAxisContext: inside shard_map.
    if type(axis_context).__name__ == "ShardingContext":
        return getattr(axis_context, "num_devices", 1) > 1
    return False


def strip_aval(aval):
    """The same shape/dtype with no sharding or manual-axis type (what the kernel sees)."""
    return jax.core.ShapedArray(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))



# -- checking what XLA did ---------------------------------------------------------------------
#: Collective instructions that can appear in compiled HLO.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast")


def collective_counts(compiled_hlo: str) -> dict[str, int]:
    """How many of each collective a compiled program runs (async ``-start`` forms included),
    e.g. ``collective_counts(jax.jit(f).lower(*args).compile().as_text())``: no all-gather
    means no weight was gathered."""
    return {c: len(re.findall(rf"\s{c}(?:-start)?\(", compiled_hlo)) for c in COLLECTIVES}


def all_gather_shapes(compiled_hlo: str) -> list[str]:
    """The result shapes of the all-gathers (e.g. ``"f32[2,4]"``), to show what is gathered."""
    return re.findall(r"=\s*(\w+\[[\d,]*\])\S*\s+all-gather(?:-start)?\(", compiled_hlo)
