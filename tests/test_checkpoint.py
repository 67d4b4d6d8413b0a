"""Orbax checkpoints (kbit_jax.flax.checkpoint): layouts are stored and converted on restore,
every array is checksummed, damaged checkpoints raise CheckpointError."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kbit_jax as kj
from kbit_jax.flax import CheckpointError, KbitLinear, restore_checkpoint, save_checkpoint
from kbit_jax.flax.checkpoint import METADATA_FILE


def _weight(rng, layout, shape=(2, 64, 48)):
    return kj.quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32), 4, layout=layout)


def _assert_same_weight(a, b):
    assert a.layout == b.layout
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("saved, target", [("planes", "fragment"), ("fragment", "planes")])
def test_restore_into_another_layout_converts(tmp_path, rng, saved, target):
    w = _weight(rng, saved)
    save_checkpoint(tmp_path / "c", {"w": w})
    restored = restore_checkpoint(tmp_path / "c", {"w": kj.convert_layout(w, target)})
    _assert_same_weight(restored["w"], kj.convert_layout(w, target))
    np.testing.assert_array_equal(kj.dequantize(restored["w"]), kj.dequantize(w))


@pytest.mark.parametrize("saved, target", [("planes", "fragment"), ("fragment", "planes")])
def test_nnx_module_restore_into_another_layout_converts(tmp_path, rng, saved, target):
    w = _weight(rng, saved, (64, 32))
    save_checkpoint(tmp_path / "m", KbitLinear.from_weight(w))
    other = KbitLinear.from_weight(_weight(rng, target, (64, 32)))
    assert restore_checkpoint(tmp_path / "m", other) is other
    _assert_same_weight(other.weight, kj.convert_layout(w, target))
    # The same through an abstract state (nnx.eval_shape), then merged.
    abstract = nnx.eval_shape(lambda: KbitLinear.from_weight(_weight(np.random.default_rng(), target, (64, 32))))
    graphdef, state = nnx.split(abstract)
    merged = nnx.merge(graphdef, restore_checkpoint(tmp_path / "m", state))
    _assert_same_weight(merged.weight, kj.convert_layout(w, target))


def test_metadata_records_version_layouts_and_checksums(tmp_path, rng):
    save_checkpoint(tmp_path / "c", {"w": _weight(rng, "planes"), "b": jnp.arange(3.0)})
    meta = json.loads((tmp_path / "c" / METADATA_FILE).read_text())
    assert meta["format"] == "kbit_jax" and meta["version"] == 1
    assert meta["weights"] == {"w": {"layout": "planes"}}
    assert set(meta["arrays"]) == {"b", "w/planes", "w/scales", "w/codebook", "w/tensor_scale"}
    assert all(isinstance(e["crc32"], int) for e in meta["arrays"].values())


def _corrupt_and_restore(tmp_path, edit: str) -> subprocess.CompletedProcess:
    """Save, damage the checkpoint with ``edit`` (Python acting on `ckpt`), restore: in a fresh
    interpreter, since damaged files reach Orbax's C++ readers."""
    code = textwrap.dedent(f"""
        import glob, json, os, sys
        import jax.numpy as jnp, numpy as np
        import kbit_jax as kj
        from kbit_jax.flax import CheckpointError, restore_checkpoint, save_checkpoint
        rng = np.random.default_rng()
        w = kj.quantize(jnp.asarray(rng.standard_normal((128, 96)), jnp.float32), 4)
        tree = {{"w": w, "b": jnp.asarray(rng.standard_normal(40), jnp.float32)}}
        ckpt = save_checkpoint(sys.argv[1], tree)
        {textwrap.indent(textwrap.dedent(edit), ' ' * 8).strip()}
        try:
            r = restore_checkpoint(ckpt, tree)
        except CheckpointError as e:
            print("CheckpointError:", e)
        else:
            same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(tree)))
            print("restored", "identical" if same else "DIFFERENT")
        """).replace("import jax.numpy as jnp", "import jax, jax.numpy as jnp")
    return subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_flipped_byte_in_data_is_detected_or_harmless(tmp_path):
    """Every byte flip in the array data either raises CheckpointError or (in bytes that hold no
    array data) restores identical arrays: never different arrays."""
    result = _corrupt_and_restore(tmp_path, """
        chunks = sorted((f for f in glob.glob(os.path.join(ckpt, "**", "d", "*"), recursive=True)),
                        key=os.path.getsize)
        data = bytearray(open(chunks[-1], "rb").read())
        data[len(data) // 2] ^= 0x5A
        open(chunks[-1], "wb").write(data)
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CheckpointError:" in result.stdout or "restored identical" in result.stdout, result.stdout


def test_changed_array_values_fail_the_checksum(tmp_path):
    """Arrays whose stored bytes changed but still decode: the CRC-32 catches them."""
    result = _corrupt_and_restore(tmp_path, """
        meta_file = os.path.join(ckpt, "kbit_jax.json")
        meta = json.load(open(meta_file))
        meta["arrays"]["w/planes"]["crc32"] ^= 1
        json.dump(meta, open(meta_file, "w"))
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CheckpointError:" in result.stdout and "'w/planes' is damaged" in result.stdout, result.stdout


@pytest.mark.parametrize("edit, match", [
    ("truncate", "kbit_jax.json is damaged"),
    ("garbage", "kbit_jax.json is damaged"),
    ("version", "format version 99"),
    ("layout", "has no valid layout"),
    ("not_kbit", "is not kbit_jax checkpoint metadata"),
])
def test_damaged_metadata_gives_a_kbit_jax_error(tmp_path, rng, edit, match):
    w = _weight(rng, "planes")
    path = save_checkpoint(tmp_path / "c", {"w": w})
    file = os.path.join(path, METADATA_FILE)
    text = open(file).read()
    meta = json.loads(text)
    if edit == "truncate":
        text = text[: len(text) // 2]
    elif edit == "garbage":
        text = "\x00\xff" + text
    elif edit == "version":
        meta["version"] = 99
        text = json.dumps(meta)
    elif edit == "layout":
        meta["weights"]["w"]["layout"] = "tiles"
        text = json.dumps(meta)
    else:
        text = json.dumps([1, 2])
    with open(file, "w", encoding="latin-1") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=match):
        restore_checkpoint(path, {"w": w})
    assert issubclass(CheckpointError, ValueError)


def test_missing_checkpoint_and_mismatched_target(tmp_path, rng):
    with pytest.raises(CheckpointError, match="does not exist"):
        restore_checkpoint(tmp_path / "nowhere", {"w": jnp.zeros(3)})
    path = save_checkpoint(tmp_path / "c", {"w": _weight(rng, "planes")})
    with pytest.raises(CheckpointError):
        restore_checkpoint(path, {"w": _weight(rng, "planes", (2, 64, 32))})
