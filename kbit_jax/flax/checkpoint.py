"""Orbax checkpoints of k-bit models: save and restore pytrees holding ``KbitWeight``s."""

from __future__ import annotations

import os

import jax
from flax import nnx

__all__ = ["restore_checkpoint", "save_checkpoint"]


def _checkpoint_tree(tree):
    if isinstance(tree, nnx.Module):
        return nnx.state(tree)
    return tree


def save_checkpoint(path, tree, *, overwrite: bool = False) -> str:
    """Save a pytree (KbitWeights, params dicts, ``nnx.state(...)``, or an NNX Module's state).

    Thin wrapper over ``orbax.checkpoint.StandardCheckpointer``; integer planes/scales are
    stored as they are. Returns the absolute path written.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _checkpoint_tree(tree), force=overwrite)
        ckptr.wait_until_finished()
    return path


def restore_checkpoint(path, target):
    """Restore what ``save_checkpoint`` wrote, exactly (no re-quantization).

    ``target`` gives structure, shapes, dtypes and shardings: a tree of arrays or
    ``jax.ShapeDtypeStruct`` (e.g. ``nnx.state(nnx.eval_shape(make_model))``), or an NNX
    Module, which is updated in place and returned.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    module = target if isinstance(target, nnx.Module) else None
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None) or default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    abstract_tree = jax.tree.map(abstract, _checkpoint_tree(target))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract_tree)
    if module is not None:
        nnx.update(module, restored)
        return module
    return restored
