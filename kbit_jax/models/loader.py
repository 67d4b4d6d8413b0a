"""Loading Hugging Face checkpoints (safetensors) into the decoder, quantized as they are read, and
saving / restoring quantized models in this package's own Orbax format.

Reading uses ``safetensors`` with NumPy (no torch). Weights go one layer at a time: read from
the shard files, moved to the first device, fused into the decoder's layout there (q/k/v into
``qkv_proj``, gate/up interleaved into ``gate_up_proj``, every kernel transposed to ``[K, N]``),
quantized there when ``bits`` is given, then placed at their tensor-parallel shards when a mesh
is given. A mixture-of-experts layer's experts go straight to their expert-parallel shards
instead: each device receives the experts it owns (``G / tp`` of them, read for it alone) and
fuses and quantizes them there. Host memory holds about one layer's tensors at a time; a device
holds the model (its share of it) plus one layer's dense tensors (of a MoE layer: its experts'
share).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import flax as kflax
from ..flax.convert import _progress
from ..flax.layers import _check_quant_config
from ..format import BLOCK
from ..ops import quantize
from ..sharding import shard_weight
from . import decoder
from .config import DecoderConfig, from_hf_config, read_hf_config

__all__ = ["load", "save", "is_saved_model", "SafetensorsCheckpoint", "expected_tensors",
           "TOKENIZER_FILES"]

#: The file that marks a directory written by `save`.
MODEL_FILE = "kbit_jax_model.json"
FORMAT = "kbit_jax.models"
FORMAT_VERSION = 1
#: Files next to the weights that `copy_side_files` carries over (tokenizer and generation
#: settings, and the original config.json for reference).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "config.json")
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# -- safetensors --------------------------------------------------------------------------------
class SafetensorsCheckpoint:
    """The tensors of a Hugging Face directory's ``*.safetensors`` files, by name.

    With ``model.safetensors.index.json`` its ``weight_map`` says which file holds each
    tensor; without it every ``*.safetensors`` file is opened and its names collected. Every
    file's header is read at construction, so a truncated or corrupt shard is reported at
    once, naming the file (and the tensors the index puts in it).
    """

    def __init__(self, path):
        from safetensors import safe_open

        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = dict(json.load(f)["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' of tensor "
                                 f"name -> file): {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(self.path, "*.safetensors")))
            if not files:
                raise ValueError(f"{self.path}: no *.safetensors files (expected a Hugging Face model "
                                 f"directory; .bin / .pth checkpoints are not read)")
        self.handles = {}
        for name in files:
            file = os.path.join(self.path, name)
            held = sorted(t for t, f in (weight_map or {}).items() if f == name)
            held = f" (the index puts {len(held)} tensors in it, e.g. {held[0]})" if held else ""
            if not os.path.exists(file):
                raise ValueError(f"{file}: missing checkpoint shard{held}")
            try:
                self.handles[name] = safe_open(file, framework="numpy")
            except Exception as e:   # safetensors raises its own SafetensorError
                raise ValueError(f"{file}: cannot read the safetensors header, the file is truncated "
                                 f"or corrupt{held}: {e}") from None
        if weight_map is None:
            weight_map = {}
            for name, handle in self.handles.items():
                for key in handle.keys():
                    if key in weight_map:
                        raise ValueError(f"tensor {key!r} is in two files: {weight_map[key]} and {name}")
                    weight_map[key] = name
        self.weight_map = weight_map

    def file(self, name: str) -> str:
        return os.path.join(self.path, self.weight_map[name])

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(safetensors dtype, shape) of tensor ``name``, None when the checkpoint lacks it."""
        file = self.weight_map.get(name)
        if file is None:
            return None
        try:
            view = self.handles[file].get_slice(name)
        except Exception:
            return None
        return str(view.get_dtype()), tuple(int(d) for d in view.get_shape())

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """ValueError listing every tensor of ``expected`` (name -> shape) that is missing, has
        another shape, or is not a float tensor, each with its file."""
        problems = []
        for name, shape in expected.items():
            info = self.info(name)
            if info is None:
                where = (f"the index puts it in {self.weight_map[name]}, which lacks it"
                         if name in self.weight_map else f"in none of {', '.join(self.handles)}")
                problems.append(f"tensor {name!r} is missing ({where})")
                continue
            dtype, got = info
            if got != tuple(shape):
                problems.append(f"tensor {name!r} in {self.weight_map[name]} has shape {got}, "
                                f"expected {tuple(shape)}")
            if dtype not in FLOAT_DTYPES:
                problems.append(f"tensor {name!r} in {self.weight_map[name]} has dtype {dtype}, "
                                f"expected one of {', '.join(FLOAT_DTYPES)}")
        if problems:
            shown = "\n  ".join(problems[:20]) + ("" if len(problems) <= 20 else
                                                   f"\n  ... and {len(problems) - 20} more")
            raise ValueError(f"checkpoint {self.path} does not match its config.json:\n  {shown}")

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a NumPy array (bf16 as ``ml_dtypes.bfloat16``)."""
        try:
            return self.handles[self.weight_map[name]].get_tensor(name)
        except Exception as e:
            info = self.info(name)
            if info is not None and info[0] == "BF16":
                return self._read_raw(name)   # a safetensors whose NumPy API lacks bf16
            raise ValueError(f"cannot read tensor {name!r} from {self.file(name)}: {e}") from None

    def _read_raw(self, name: str) -> np.ndarray:
        import ml_dtypes

        file = self.file(name)
        types = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(size))[name]
            start, end = entry["data_offsets"]
            f.seek(8 + size + start)
            data = f.read(end - start)
        if len(data) != end - start:
            raise ValueError(f"cannot read tensor {name!r} from {file}: the file is truncated")
        return np.frombuffer(data, types[entry["dtype"]]).reshape(entry["shape"])


def expected_tensors(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and ``[out, in]`` shapes a checkpoint of ``cfg`` holds."""
    d, hd, f = cfg.dim, cfg.head_dim, cfg.hidden_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        out.update({
            pre + "input_layernorm.weight": (d,), pre + "post_attention_layernorm.weight": (d,),
            pre + "self_attn.q_proj.weight": (cfg.n_heads * hd, d),
            pre + "self_attn.k_proj.weight": (cfg.n_kv_heads * hd, d),
            pre + "self_attn.v_proj.weight": (cfg.n_kv_heads * hd, d),
            pre + "self_attn.o_proj.weight": (d, cfg.n_heads * hd)})
        if i in cfg.moe_layers:
            e = cfg.moe_hidden_dim
            out[pre + "mlp.gate.weight"] = (cfg.n_experts, d)
            for j in range(cfg.n_experts):
                out.update({pre + f"mlp.experts.{j}.gate_proj.weight": (e, d),
                            pre + f"mlp.experts.{j}.up_proj.weight": (e, d),
                            pre + f"mlp.experts.{j}.down_proj.weight": (d, e)})
        else:
            out.update({pre + "mlp.gate_proj.weight": (f, d), pre + "mlp.up_proj.weight": (f, d),
                        pre + "mlp.down_proj.weight": (d, f)})
        if cfg.qk_norm:
            out.update({pre + "self_attn.q_norm.weight": (hd,), pre + "self_attn.k_norm.weight": (hd,)})
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


# -- layout changes, on the device --------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("n_kv_heads",))
def _qkv_kernel(q, k, v, n_kv_heads):
    return decoder.fuse_qkv(q.T, k.T, v.T, n_kv_heads)


@jax.jit
def _gate_up_kernel(gate, up):
    return decoder.fuse_gate_up(gate.T, up.T)


@jax.jit
def _kernel(w):
    return w.T


@jax.jit
def _experts_gate_up(gate, up):
    return decoder.fuse_gate_up(jnp.swapaxes(gate, 1, 2), jnp.swapaxes(up, 1, 2))


@jax.jit
def _experts_kernel(w):
    return jnp.swapaxes(w, 1, 2)


class _Filler:
    """Puts checkpoint tensors into an abstract model (from ``nnx.eval_shape``): dense in
    ``dtype`` or quantized, on ``device`` or at their tensor-parallel (experts: expert-parallel)
    shards."""

    def __init__(self, dtype, bits, codebook, device, mesh, axis, attention_parallel="tensor"):
        self.dtype, self.bits, self.codebook = dtype, bits, codebook
        self.device, self.mesh, self.axis = device, mesh, axis
        self.attention_parallel = attention_parallel   # "tensor" or "replicated"
        self.tp = 1 if mesh is None else int(mesh.shape[axis])
        # the stacked experts [G, ...]: on ``device``, or G over the axis (expert parallelism)
        self.experts = device if mesh is None else NamedSharding(mesh, P(axis, None, None))

    def to_device(self, array: np.ndarray):
        return jax.device_put(array, self.device)

    def stacked(self, read, n: int, shape: tuple[int, ...]):
        """``[n, *shape]``: ``read(j)`` (a host array of ``shape``) stacked over j, placed as the
        experts are. Each device's experts are read for it alone and sent to it before the next
        device's are read."""
        if self.mesh is None:
            return self.to_device(np.stack([read(j) for j in range(n)]))
        shape = (n, *shape)
        shards = [jax.device_put(np.stack([read(j) for j in range(n)[index[0]]]), device)
                  for device, index in self.experts.addressable_devices_indices_map(shape).items()]
        return jax.make_array_from_single_device_arrays(shape, self.experts, shards)

    def _sharding(self, spec):
        return self.device if self.mesh is None else NamedSharding(self.mesh, spec or P())

    def set_array(self, var: nnx.Variable, array) -> None:
        """A replicated variable (embedding, norm scale)."""
        var.set_value(jax.device_put(jnp.asarray(self.to_device(array), self.dtype), self._sharding(None)))

    def set_moe(self, block, router, gate, up, down, cfg: DecoderConfig, quantized: bool) -> None:
        """``block.mlp`` (an abstract MoE) gets the router ``[experts, dim]`` and the experts'
        stacked ``[experts, out, in]`` gate, up and down (device arrays), as a KbitMoE when
        ``quantized``. Experts are stored ``[experts, in, out]``, gate and up interleaved."""
        moe = block.mlp
        moe.router.kernel.set_value(
            jax.device_put(_kernel(router).astype(self.dtype), self._sharding(None)))
        # The experts arrive placed as `stacked` puts them (one device, or G over the axis); the
        # layout changes and quantize work per expert, so each device fuses and quantizes its own.
        if quantized:
            gate_up = quantize(_experts_gate_up(gate, up), self.bits, self.codebook)
            down = quantize(_experts_kernel(down), self.bits, self.codebook)
            if self.mesh is not None:
                stacked = P(self.axis, None, None)
                gate_up, down = (shard_weight(w, self.mesh, stacked) for w in (gate_up, down))
            block.mlp = kflax.KbitMoE(moe.router, gate_up, down, top_k=cfg.experts_per_token,
                                      norm_topk_prob=cfg.norm_topk_prob, routing=moe.routing)
        else:
            for var, w in ((moe.gate, gate), (moe.up, up), (moe.down, down)):
                var.set_value(jax.device_put(_experts_kernel(w).astype(self.dtype), self.experts))

    def set_linear(self, parent, key: str, kernel, quantized: bool) -> None:
        """``parent.key`` (an nnx.Linear) gets ``kernel [K, N]`` (a device array), quantized
        into a KbitLinear when ``quantized``, placed by the decoder's `linear_spec`."""
        k, n = kernel.shape
        spec = None if self.mesh is None else decoder.linear_spec(key, k, n, self.axis, self.tp,
                                                                  self.attention_parallel)
        if quantized:
            w = quantize(kernel, self.bits, self.codebook)
            if self.mesh is not None:
                w = shard_weight(w, self.mesh, spec or P())
            setattr(parent, key, kflax.KbitLinear.from_weight(w, param_dtype=self.dtype))
        else:
            getattr(parent, key).kernel.set_value(
                jax.device_put(kernel.astype(self.dtype), self._sharding(spec)))


def _check_args(bits, codebook, dtype, mesh, axis):
    if bits is not None:
        _check_quant_config(bits, codebook)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}") from None
    if dtype not in [jnp.dtype(d) for d in DTYPES]:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16; got {dtype.name}")
    if mesh is not None and axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r} (axes {tuple(mesh.axis_names)})")
    return dtype


def _check_mesh(cfg: DecoderConfig, mesh, axis: str, bits: int | None = None,
                attention_parallel: str = "auto") -> None:
    """ValueError, before anything is read, unless ``cfg`` splits over ``mesh``'s axis: whole
    heads and kv heads per device (with tensor-parallel attention), the dense MLP width (where
    there are dense MLP layers) and the experts (where there are MoE layers) divisible by the
    device count (``decoder.check_tp``); quantized, whole 32-element blocks of the row-parallel
    layers' input features per device."""
    if mesh is None:
        return
    tp = int(mesh.shape[axis])
    decoder.check_tp(cfg, tp, attention_parallel)
    if bits is None:
        return
    rows = []
    if decoder.attention_placement(cfg, attention_parallel) == "tensor":
        rows.append(("o_proj", "n_heads * head_dim", cfg.n_heads * cfg.head_dim))
    if len(cfg.moe_layers) < cfg.n_layers:
        rows.append(("down_proj", "hidden_dim", cfg.hidden_dim))
    for name, what, k in rows:
        if k % (BLOCK * tp):
            raise ValueError(f"quantized tensor parallelism over {tp} devices needs {name}'s in_features "
                             f"({what} = {k}) divisible by {BLOCK} * {tp} = {BLOCK * tp} (whole "
                             f"{BLOCK}-element blocks per device)")


def is_saved_model(path) -> bool:
    """Whether ``path`` is a directory written by `save`."""
    return os.path.exists(os.path.join(os.fspath(path), MODEL_FILE))


def load(path, *, bits: int | None = None, codebook: Any = "nf", dtype=jnp.bfloat16, mesh=None,
         quantize_head: bool = True, progress: bool = True, axis: str = "tp",
         attention: str = "auto", norm: str = "auto", mlp_gate: str = "auto",
         attention_parallel: str = "auto") -> decoder.Llama:
    """A `decoder.Llama` from a Hugging Face directory (``config.json`` + ``*.safetensors``, with
    or without ``model.safetensors.index.json``), or from a directory written by `save`.

    Args:
      path: the directory.
      bits: None keeps the linear layers dense in ``dtype``; 2..5 quantizes each as it is read
        (the checkpoint's own values, before any cast). A saved quantized model is restored as
        it was saved (``bits`` must be None or its bits).
      codebook: as ``kbit_jax.quantize``.
      dtype: float32, bfloat16 or float16: the dense weights (embedding, norms, dense layers)
        and so the computation (a saved model's dense weights are cast to it as restored).
      mesh, axis: place the model tensor-parallel over ``mesh``'s axis ``axis`` as it is loaded
        (``decoder.shard_model``'s layout: a mixture-of-experts layer's stacked experts
        expert-parallel, ``G / tp`` per device, each device's read and quantized on it); None:
        the default device.
      attention_parallel: with a mesh, how attention is placed (``decoder.ATTENTION_PARALLEL``):
        "tensor" (q/k/v and o split over the axis by heads), "replicated" (whole on every
        device, no all-reduce after o_proj), "auto" (replicated in a model with MoE layers,
        ``decoder.attention_placement`` says why).
      quantize_head: with ``bits``, quantize the output projection too (the default: it is
        read whole at every decode step; a tied one gets a quantized copy of the embedding,
        which itself stays dense for the token lookup). False keeps it dense in ``dtype``; a
        head that cannot be quantized stays dense (``decoder.head_dense_reason`` says when and
        why). A saved model keeps the head it was saved with.
      progress: a progress bar on stderr (tqdm).
      attention, norm, mlp_gate: the decoder's kernel choices (``decoder.build_model``).

    Raises ValueError naming the file and tensor for a missing tensor, a wrong shape or dtype
    or a truncated shard, naming the architecture for one this package does not build, and,
    with a mesh, naming the sizes the axis does not divide (heads and kv heads with
    tensor-parallel attention, the MLP width, the experts; quantized, o_proj's and down_proj's
    input features in whole 32-element blocks per device), and naming ``attention_parallel``
    when it is not one of ``decoder.ATTENTION_PARALLEL``.
    """
    path = os.fspath(path)
    dtype = _check_args(bits, codebook, dtype, mesh, axis)
    if attention_parallel not in decoder.ATTENTION_PARALLEL:
        raise ValueError(f"attention_parallel={attention_parallel!r}: expected one of "
                         f"{decoder.ATTENTION_PARALLEL}")
    modes = dict(attention=attention, norm=norm, mlp_gate=mlp_gate)
    if is_saved_model(path):
        return _restore(path, bits=bits, dtype=dtype, mesh=mesh, axis=axis, modes=modes,
                        attention_parallel=attention_parallel)
    cfg = from_hf_config(read_hf_config(path))
    _check_mesh(cfg, mesh, axis, bits, attention_parallel)
    placement = decoder.attention_placement(cfg, attention_parallel)
    ckpt = SafetensorsCheckpoint(path)
    ckpt.check(expected_tensors(cfg))

    model = nnx.eval_shape(lambda: decoder.Llama(cfg, param_dtype=dtype, rngs=nnx.Rngs(0), **modes))
    device = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0])
    fill = _Filler(dtype, bits, codebook, device, mesh, axis, placement)
    quantized = bits is not None
    steps = _progress(range(cfg.n_layers + 2), cfg.n_layers + 2, progress,
                          "load" + ("" if bits is None else f" + quantize to {bits} bits"))
    steps = iter(steps)

    def read(name):
        return fill.to_device(ckpt.read(name))

    def read_stacked(pattern, n):       # the experts' tensors as one [n, ...] array, placed
        _, shape = ckpt.info(pattern.format(0))
        return fill.stacked(lambda j: ckpt.read(pattern.format(j)), n, shape)

    next(steps)
    embedding = ckpt.read("model.embed_tokens.weight")
    fill.set_array(model.embed.embedding, embedding)
    quantized_head = quantized and decoder.head_dense_reason(cfg, quantize_head) is None
    tied_head = cfg.tie_embeddings and quantized_head
    if not tied_head:
        del embedding                     # kept on the host only to make a quantized tied head
    for i, layer in enumerate(model.layers):
        next(steps)
        pre = f"model.layers.{i}."
        fill.set_array(layer.attn_norm.scale, ckpt.read(pre + "input_layernorm.weight"))
        fill.set_array(layer.mlp_norm.scale, ckpt.read(pre + "post_attention_layernorm.weight"))
        attn = layer.attn
        qkv = _qkv_kernel(*(read(pre + f"self_attn.{p}_proj.weight") for p in "qkv"),
                          n_kv_heads=cfg.n_kv_heads)
        fill.set_linear(attn, "qkv_proj", qkv, quantized)
        del qkv
        fill.set_linear(attn, "o_proj", _kernel(read(pre + "self_attn.o_proj.weight")), quantized)
        if cfg.qk_norm:
            fill.set_array(attn.q_norm.scale, ckpt.read(pre + "self_attn.q_norm.weight"))
            fill.set_array(attn.k_norm.scale, ckpt.read(pre + "self_attn.k_norm.weight"))
        if i in cfg.moe_layers:
            experts = [read_stacked(pre + f"mlp.experts.{{}}.{p}_proj.weight", cfg.n_experts)
                       for p in ("gate", "up", "down")]
            fill.set_moe(layer, read(pre + "mlp.gate.weight"), *experts, cfg, quantized)
            del experts
            continue
        gate_up = _gate_up_kernel(read(pre + "mlp.gate_proj.weight"), read(pre + "mlp.up_proj.weight"))
        fill.set_linear(layer.mlp, "gate_up_proj", gate_up, quantized)
        del gate_up
        fill.set_linear(layer.mlp, "down_proj", _kernel(read(pre + "mlp.down_proj.weight")), quantized)
    next(steps)
    fill.set_array(model.norm.scale, ckpt.read("model.norm.weight"))
    if not cfg.tie_embeddings:
        fill.set_linear(model, "lm_head", _kernel(read("lm_head.weight")), quantized_head)
    elif tied_head:                       # a quantized copy of the tied embedding
        fill.set_linear(model, "lm_head", _kernel(fill.to_device(embedding)), True)
        del embedding
    for _ in steps:
        pass
    _check_filled(model)
    if mesh is not None:   # records the placement; the arrays are already there
        decoder.shard_model(model, mesh, axis, attention_parallel=placement)
    return model


def _check_filled(model) -> None:
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct):
            raise AssertionError(f"load left {'/'.join(map(str, path))} unset")


# -- the package's own format --------------------------------------------------------------------
def _quantized_layers(model) -> list[dict]:
    """Where ``model`` holds quantized layers (KbitLinear) and expert blocks (KbitMoE)."""
    out = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, kflax.KbitMoE):
            gate_up, _ = module.weights
            out.append({"path": list(path), "kind": "moe", "bits": gate_up.bits, "layout": gate_up.layout})
        elif isinstance(module, kflax.KbitLinear) and not any(isinstance(m, kflax.KbitMoE) for m in
                                                              _parents(model, path)):
            out.append({"path": list(path), "kind": "linear", "bits": module.bits,
                        "layout": module.kernel.layout})
    return out


def _parents(model, path):
    node = model
    for key in path[:-1]:
        node = _get(node, key)
        yield node


def save(model: decoder.Llama, path, *, overwrite: bool = False) -> str:
    """Write ``model`` (dense or quantized, on one device or sharded) to the directory ``path``:
    ``kbit_jax_model.json`` (its config, dtype and which layers are quantized) and ``state/``
    (``kbit_jax.flax.save_checkpoint``, Orbax). `load` restores it exactly, without quantizing
    again. Returns the absolute path. Tokenizer files are not model state: see
    `copy_side_files`."""
    if not isinstance(model, decoder.Llama):
        raise TypeError(f"model must be a kbit_jax.models.decoder.Llama, got {type(model).__name__}")
    path = os.path.abspath(os.fspath(path))
    meta_file = os.path.join(path, MODEL_FILE)
    if os.path.exists(meta_file) and not overwrite:
        raise ValueError(f"{path} already holds a saved model; pass overwrite=True to replace it")
    os.makedirs(path, exist_ok=True)
    kflax.save_checkpoint(os.path.join(path, "state"), model, overwrite=overwrite)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "config": model.config.to_dict(),
            "dtype": jnp.dtype(model.embed.embedding.get_value().dtype).name,
            "quantized": _quantized_layers(model)}
    with open(meta_file, "w") as f:
        json.dump(meta, f, indent=1)
    return path


def copy_side_files(src, dst) -> list[str]:
    """Copy the tokenizer and generation files (`TOKENIZER_FILES`) that exist in ``src`` to
    ``dst``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        file = os.path.join(os.fspath(src), name)
        if os.path.exists(file):
            shutil.copyfile(file, os.path.join(os.fspath(dst), name))
            copied.append(name)
    return copied


def _get(node, key):
    return node[key] if isinstance(key, int) else getattr(node, key)


def _skeleton(cfg: DecoderConfig, dtype, quantized: list[dict], modes: dict) -> decoder.Llama:
    """The model's structure with the saved layers quantized (values: to be restored)."""
    model = decoder.Llama(cfg, param_dtype=dtype, rngs=nnx.Rngs(0), **modes)
    for entry in quantized:
        *parents, key = entry["path"]
        parent = functools.reduce(_get, parents, model)
        layer = _get(parent, key)
        if entry.get("kind") == "moe":
            setattr(parent, key, kflax.KbitMoE.from_dense(layer, entry["bits"]))
            continue
        kernel = (model.embed.embedding.get_value().T if layer is None and key == "lm_head"
                  else layer.kernel.get_value())
        w = quantize(kernel, entry["bits"], layout=entry["layout"])
        setattr(parent, key, kflax.KbitLinear.from_weight(w, param_dtype=dtype))
    return model


def _restore(path, *, bits, dtype, mesh, axis, modes, attention_parallel) -> decoder.Llama:
    with open(os.path.join(path, MODEL_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{os.path.join(path, MODEL_FILE)}: format {meta.get('format')!r} version "
                         f"{meta.get('version')!r}, expected {FORMAT!r} version {FORMAT_VERSION}")
    saved_bits = sorted({q["bits"] for q in meta["quantized"]})
    if bits is not None and saved_bits != [bits]:
        raise ValueError(f"{path} holds a model saved with bits={saved_bits or None}; load it "
                         f"with bits=None, or quantize the original checkpoint with bits={bits}")
    cfg = DecoderConfig(**meta["config"])
    _check_mesh(cfg, mesh, axis, saved_bits[0] if saved_bits else None, attention_parallel)
    model = nnx.eval_shape(lambda: _skeleton(cfg, dtype, meta["quantized"], modes))
    if mesh is not None:
        placement = {i: s for i, (_, s, _) in
                     decoder.variable_shardings(model, mesh, axis, attention_parallel).items()}
    else:
        placement = {}
    # Dense leaves are restored in the dtype they were saved in (the checkpoint verifies each
    # array's checksum), then cast to ``dtype``.
    saved_dtype = jnp.dtype(meta["dtype"])
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    recast = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct):
            x = node.get_value()
            stored = x.dtype
            if x.dtype == dtype and not isinstance(node, kflax.QuantizedWeight):
                stored = saved_dtype
                recast.append(node)
            node.set_value(jax.ShapeDtypeStruct(x.shape, stored, sharding=placement.get(id(node), default)))
    restored = kflax.restore_checkpoint(os.path.join(path, "state"), nnx.state(model))
    nnx.update(model, restored)
    if saved_dtype != dtype:
        for node in recast:
            node.set_value(node.get_value().astype(dtype))
    _check_filled(model)
    if mesh is not None:
        decoder.shard_model(model, mesh, axis, attention_parallel=attention_parallel)
    return model
