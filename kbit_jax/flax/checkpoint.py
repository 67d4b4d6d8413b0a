"""Orbax checkpoints of k-bit models: save and restore pytrees holding ``KbitWeight``s.

Beside Orbax's own files, a checkpoint directory holds ``kbit_jax.json``: the format version,
the layout of every quantized weight (by path) and a CRC-32 of every array's bytes. Restoring
verifies each checksum, and converts a weight whose stored layout differs from the target's
(``kbit_jax.convert_layout``, lossless), so a checkpoint never restores silently wrong.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from typing import Any

import jax
import numpy as np
from flax import nnx

from ..format import LAYOUTS, KbitWeight, pack_codes, unpack_codes
from .layers import LAYOUT_METADATA_KEY

__all__ = ["CheckpointError", "restore_checkpoint", "save_checkpoint"]

#: The file beside Orbax's that describes the quantized weights and checksums.
METADATA_FILE = "kbit_jax.json"
#: Version of METADATA_FILE's content and of the weight format it describes.
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete, or does not match the restore target."""


def _checkpoint_tree(tree):
    if isinstance(tree, nnx.Module):
        return nnx.state(tree)
    return tree


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path(keys) -> str:
    """'layers/0/kernel/planes': a path that reads the same in an nnx.State and a pytree."""
    names = [_key_name(k) for k in keys]
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names = names[:-1]                     # an nnx.Variable's payload
    return "/".join(names)


def _is_node(x) -> bool:
    return isinstance(x, (KbitWeight, nnx.Variable))


def weight_layouts(tree) -> dict[str, str]:
    """{path of each quantized weight: its layout} for a pytree of KbitWeights or an nnx.State
    (where the ``planes`` QuantizedWeight carries the layout in its metadata)."""
    layouts = {}
    for keys, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)[0]:
        if isinstance(node, KbitWeight):
            layouts[_path(keys)] = node.layout
        elif isinstance(node, nnx.Variable):
            layout = node.get_metadata().get(LAYOUT_METADATA_KEY)
            if layout is not None and keys and _key_name(keys[-1]) == "planes":
                layouts[_path(keys[:-1])] = layout
    return layouts


def _arrays(tree) -> dict[str, Any]:
    return {_path(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}


def _crc32(array) -> int | None:
    """CRC-32 of the array's bytes (C order), or None where this process cannot see all of it."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return None
    return zlib.crc32(np.ascontiguousarray(np.asarray(array)).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def save_checkpoint(path, tree, *, overwrite: bool = False) -> str:
    """Save a pytree (KbitWeights, params dicts, ``nnx.state(...)``, or an NNX Module's state).

    Orbax's ``StandardCheckpointer`` writes the arrays as they are (integer planes/scales too);
    ``kbit_jax.json`` beside them records the format version, each quantized weight's layout
    and a CRC-32 per array. Returns the absolute path written.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    tree = _checkpoint_tree(tree)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree, force=overwrite)
        ckptr.wait_until_finished()
    if jax.process_index() == 0:
        metadata = {
            "format": "kbit_jax",
            "version": FORMAT_VERSION,
            "weights": {p: {"layout": layout} for p, layout in weight_layouts(tree).items()},
            "arrays": {p: {"shape": list(a.shape), "dtype": np.dtype(a.dtype).name, "crc32": _crc32(a)}
                       for p, a in _arrays(tree).items()},
        }
        tmp = os.path.join(path, METADATA_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(metadata, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(path, METADATA_FILE))
    return path


def _read_metadata(path: str) -> dict | None:
    file = os.path.join(path, METADATA_FILE)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            metadata = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path!r}: {METADATA_FILE} is damaged ({e})") from e
    if not isinstance(metadata, dict) or metadata.get("format") != "kbit_jax":
        raise CheckpointError(f"checkpoint {path!r}: {METADATA_FILE} is not kbit_jax checkpoint metadata")
    version = metadata.get("version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r}: format version {version!r} is not one this kbit_jax "
                              f"reads (1..{FORMAT_VERSION}); upgrade kbit_jax")
    weights, arrays = metadata.get("weights"), metadata.get("arrays")
    if not isinstance(weights, dict) or not isinstance(arrays, dict):
        raise CheckpointError(f"checkpoint {path!r}: {METADATA_FILE} lacks its 'weights' or 'arrays' table")
    for p, entry in weights.items():
        if not isinstance(entry, dict) or entry.get("layout") not in LAYOUTS:
            raise CheckpointError(f"checkpoint {path!r}: weight {p!r} has no valid layout in {METADATA_FILE} "
                                  f"(expected one of {LAYOUTS}, got {entry!r})")
    return metadata


def _verify(path: str, restored, metadata: dict) -> None:
    saved = metadata["arrays"]
    for p, array in _arrays(restored).items():
        entry = saved.get(p)
        if entry is None:
            raise CheckpointError(f"checkpoint {path!r} has no array {p!r} that the target has")
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint {path!r}: the entry of array {p!r} is damaged: {entry!r}")
        if list(array.shape) != entry.get("shape") or np.dtype(array.dtype).name != entry.get("dtype"):
            raise CheckpointError(f"checkpoint {path!r}: array {p!r} was saved as {entry.get('dtype')}"
                                  f"{entry.get('shape')}, the target has {np.dtype(array.dtype).name}"
                                  f"{list(array.shape)}")
        expected, actual = entry.get("crc32"), _crc32(array)
        if expected is not None and actual is not None and expected != actual:
            raise CheckpointError(f"checkpoint {path!r}: array {p!r} is damaged (CRC-32 {actual:#010x}, "
                                  f"saved {expected:#010x})")


def _convert_layouts(restored, saved_layouts: dict[str, str], target_layouts: dict[str, str]):
    """Rewrite the planes of every weight whose saved layout differs from the target's."""
    convert = {p: (saved_layouts[p], layout) for p, layout in target_layouts.items()
               if p in saved_layouts and saved_layouts[p] != layout}
    if not convert:
        return restored

    def fix(keys, node):
        p = _path(keys)
        if isinstance(node, KbitWeight) and p in convert:
            src, dst = convert[p]
            planes = pack_codes(unpack_codes(node.planes, src), node.bits, dst)
            return KbitWeight(planes, node.scales, node.codebook, node.tensor_scale, layout=dst)
        if isinstance(node, nnx.Variable) and keys and _key_name(keys[-1]) == "planes":
            parent = _path(keys[:-1])
            if parent in convert:
                src, dst = convert[parent]
                planes = node.get_value()
                return node.replace(pack_codes(unpack_codes(planes, src), planes.shape[-1], dst))
        return node

    return jax.tree_util.tree_map_with_path(fix, restored, is_leaf=_is_node)


def restore_checkpoint(path, target):
    """Restore what ``save_checkpoint`` wrote, exactly (no re-quantization).

    ``target`` gives structure, shapes, dtypes and shardings: a tree of arrays or
    ``jax.ShapeDtypeStruct`` (e.g. ``nnx.state(nnx.eval_shape(make_model))``), or an NNX
    Module, which is updated in place and returned. Every array's CRC-32 is checked, and a
    weight saved in another layout than the target's is converted to the target's layout.
    Raises ``CheckpointError`` (a ValueError) for a damaged checkpoint or one that does not
    match the target.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist (expected a directory written by "
                              f"save_checkpoint)")
    metadata = _read_metadata(path)
    module = target if isinstance(target, nnx.Module) else None
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None) or default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    target_tree = _checkpoint_tree(target)
    abstract_tree = jax.tree.map(abstract, target_tree)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path, abstract_tree)
    except (ValueError, TypeError, KeyError, OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path!r} could not be read into the target: {e}") from e
    target_layouts = weight_layouts(target_tree)
    if metadata is None:
        if target_layouts:
            warnings.warn(f"checkpoint {path!r} has no {METADATA_FILE} (written by an older kbit_jax): "
                          f"its weights' layouts and checksums cannot be verified", stacklevel=2)
    else:
        _verify(path, restored, metadata)
        saved_layouts = {p: e["layout"] for p, e in metadata["weights"].items()}
        restored = _convert_layouts(restored, saved_layouts, target_layouts)
    if module is not None:
        nnx.update(module, restored)
        return module
    return restored
