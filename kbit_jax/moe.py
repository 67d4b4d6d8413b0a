"""Expert parallelism for `kbit_jax.ragged_dot` inside ``shard_map``.

Experts are spread over a mesh axis: each device holds ``G / E`` consecutive experts (a
`KbitWeight` sharded on its expert axis, ``P(axis, None, None)``). `expert_parallel_ragged_dot`
is the per-device body of the all-gather + psum pattern: every device sees all rows (sorted by
expert) and the global group sizes, multiplies the rows of its own experts, and the devices'
products are summed over the axis. `local_ragged_dot` is the same product without the sum,
for several products on one set of rows with one sum at the end (the decoder's expert-parallel
MoE layers: `kbit_jax.flax.moe.KbitMoE` under ``shard_map``). Under plain ``jit`` the same
happens without shard_map when the weight is sharded on its expert axis (see
`kbit_jax.primitives.ragged_dot`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .format import KbitWeight
from .ops import ragged_dot
from .primitives.ragged_dot import local_experts_product

__all__ = ["expert_parallel_ragged_dot", "local_ragged_dot"]


def _axis_index_and_size(axis_name):
    """The device's index and the device count over one mesh axis or a tuple of axes (the
    first axis major, as in a PartitionSpec entry)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    index, size = 0, 1
    for name in names:
        n = jax.lax.axis_size(name)
        index, size = index * n + jax.lax.axis_index(name), size * n
    return index, size


def local_ragged_dot(x, w_q: KbitWeight, group_sizes, *, axis_name, glu: str | None = None,
                     method: str = "auto") -> jax.Array:
    """This device's share of ``ragged_dot(x, W, group_sizes)`` for experts sharded over
    ``axis_name`` (call inside ``shard_map``): the rows of its own experts, zeros elsewhere, so
    the devices' results sum to the whole product. Arguments as `expert_parallel_ragged_dot`.
    Several products on the same rows (a MoE layer's gate/up then down, then the weighted sum
    over each token's experts) can run locally and be summed once at the end."""
    if not isinstance(w_q, KbitWeight) or len(w_q.batch_shape) != 1:
        raise TypeError(f"w_q must be this device's stack of experts, a KbitWeight [G/E, K, N], got "
                        f"{getattr(w_q, 'shape', type(w_q).__name__)}")
    group_sizes = jnp.asarray(group_sizes)
    index, size = _axis_index_and_size(axis_name)
    local = w_q.batch_shape[0]
    if group_sizes.ndim != 1 or group_sizes.shape[0] != local * size:
        raise ValueError(f"group_sizes must have one entry per expert over the {size} devices of "
                         f"{axis_name!r} ({size} x {local} = {size * local}), got shape {group_sizes.shape}")

    def kernel(x_, planes, scales, codebook, tensor_scale, sizes):
        return ragged_dot(x_, KbitWeight(planes, scales, codebook, tensor_scale, layout=w_q.layout),
                          sizes, glu=glu, method=method)

    return local_experts_product(kernel, x, w_q.planes, w_q.scales, w_q.codebook, w_q.tensor_scale,
                                 group_sizes, index * local)


def expert_parallel_ragged_dot(x, w_q: KbitWeight, group_sizes, *, axis_name, glu: str | None = None,
                               method: str = "auto") -> jax.Array:
    """``ragged_dot(x, W, group_sizes)`` for experts sharded over ``axis_name``; call inside
    ``shard_map``.

    Args (the per-device values):
      x: ``[M, K]``, every row, sorted by expert (the same on every device of the axis: e.g.
        ``jax.lax.all_gather(tokens, axis_name, tiled=True)`` of a token-sharded batch, sorted).
      w_q: this device's experts, ``[G / E, K, N]``: the shard of a weight placed with
        ``shard_weight(w, mesh, P(axis_name, None, None))`` (``in_specs`` entry
        ``weight_specs(w, P(axis_name, None, None))``).
      group_sizes: int32[G], every expert's rows (global).
      axis_name: the mesh axis (or tuple of axes) the experts are sharded over.

    Returns the full ``[M, N]`` (``N / 2`` with ``glu``) on every device: each device's rows of
    other experts are 0 (`local_ragged_dot`) and the products are summed with one psum over
    ``axis_name``. A row belongs to one expert, so a GLU is applied before the sum (half the
    bytes summed).
    """
    y = local_ragged_dot(x, w_q, group_sizes, axis_name=axis_name, glu=glu, method=method)
    return jax.lax.psum(y, axis_name)
