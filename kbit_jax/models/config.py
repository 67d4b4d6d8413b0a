"""Decoder configurations: the dataclass the decoder is built from, and its construction from a
Hugging Face ``config.json``.

Supported architectures (the ``architectures`` entry of ``config.json``):

- ``LlamaForCausalLM``: Llama 3.0-3.3 (GQA, RoPE with the "llama3" frequency scaling of 3.1+,
  tied or untied embeddings);
- ``Qwen3ForCausalLM``: Qwen3 dense (as Llama, plus an RMSNorm over each query and key head
  before the rotary embedding, and a head_dim that need not be hidden_size / heads);
- ``Qwen3MoeForCausalLM``: Qwen3-MoE (as Qwen3, with mixture-of-experts MLPs: softmax top-k
  routing over ``num_experts`` SwiGLU experts, ``kbit_jax.flax.MoE`` / ``KbitMoE``).

Anything else raises ValueError naming the architecture.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

__all__ = ["DecoderConfig", "LlamaConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES", "from_hf_config",
           "read_hf_config", "rope_frequencies", "LLAMA3_8B", "LLAMA3_70B", "TINY", "TINY_TP", "CONFIGS"]

#: ``config.json`` architectures this package builds, and the model_type each has.
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's "llama3" RoPE frequency scaling (``rope_scaling`` in ``config.json``):
    wavelengths above ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, those below ``original / high_freq_factor`` kept, the band between interpolated
    (see `rope_frequencies`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of a decoder (Llama-3 / Qwen3 layout).

    ``head_dim`` 0 means ``dim // n_heads`` (Llama); Qwen3 sets it explicitly. ``qk_norm``:
    RMSNorm over each query and key head before RoPE (Qwen3). ``tie_embeddings``: the output
    projection is the embedding matrix transposed (no separate lm_head weight).

    Mixture of experts (Qwen3-MoE): the layers in ``moe_layers`` have ``n_experts`` SwiGLU
    experts of width ``moe_hidden_dim`` instead of the dense MLP, ``experts_per_token`` of
    them per token (softmax top-k, renormalized when ``norm_topk_prob``).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    head_dim: int = 0
    qk_norm: bool = False
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    architecture: str = "LlamaForCausalLM"
    n_experts: int = 0
    experts_per_token: int = 0
    moe_hidden_dim: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.hidden_dim
        moe = self.n_experts * (self.dim + 3 * self.dim * self.moe_hidden_dim)
        norms = 2 * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
        n_moe = len(self.moe_layers)
        return (self.n_layers * (attn + norms) + (self.n_layers - n_moe) * mlp + n_moe * moe
                + embeddings + self.dim)

    def to_dict(self) -> dict:
        """A JSON-able dict; ``DecoderConfig(**d)`` rebuilds the config."""
        return dataclasses.asdict(self)


#: The name the decoder had as an example; the same class.
LlamaConfig = DecoderConfig

LLAMA3_8B = DecoderConfig(vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          hidden_dim=14_336)
LLAMA3_70B = DecoderConfig(vocab_size=128_256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                           hidden_dim=28_672)
TINY = DecoderConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128,
                     rope_theta=10_000.0)
#: A small config that runs quantized at tensor-parallel sizes up to 4 (TINY: up to 2, as its
#: 2 kv heads and its o_proj's K = 64 = 2 quantization blocks allow).
TINY_TP = DecoderConfig(vocab_size=256, dim=256, n_layers=2, n_heads=8, n_kv_heads=4,
                        hidden_dim=512, rope_theta=10_000.0)
CONFIGS = {"tiny": TINY, "tiny-tp": TINY_TP, "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The rotary inverse frequencies ``float32[head_dim / 2]``, computed in float32 as
    transformers does: ``1 / theta ** (2i / head_dim)``, then with ``scaling`` (Llama-3.1's
    "llama3" rule) each frequency whose wavelength ``2 pi / f`` exceeds ``original /
    low_freq_factor`` divided by ``factor``, those under ``original / high_freq_factor`` kept,
    and between them ``(1 - s) f / factor + s f`` with ``s = (original / wavelength -
    low_freq_factor) / (high_freq_factor - low_freq_factor)``."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    freqs = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return freqs
    factor = np.float32(scaling.factor)
    low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    original = np.float32(scaling.original_max_position_embeddings)
    wavelen = np.float32(2 * math.pi) / freqs
    scaled = np.where(wavelen > original / low, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either spelling: transformers 5's ``rope_parameters`` or the
    ``rope_theta`` + ``rope_scaling`` of the checkpoints' own config.json files."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta", params.get("rope_theta", 10_000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"config.json: rope scaling type {kind!r} is not supported (supported: "
                         f"none/'default', 'llama3')")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"config.json: rope scaling 'llama3' lacks {e.args[0]!r} (got {scaling})") from None


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        return archs[0]
    by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
    model_type = hf.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise ValueError(f"config.json names no architecture (architectures={archs!r}, model_type="
                     f"{model_type!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def from_hf_config(hf: Mapping[str, Any]) -> DecoderConfig:
    """A `DecoderConfig` from a Hugging Face ``config.json`` (as a dict).

    Raises ValueError for an unsupported architecture (naming it), or a feature of a
    supported one that the decoder does not implement (biases, sliding-window attention,
    activations other than silu, other RoPE scalings).
    """
    arch = _architecture(hf)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"config.json: architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (expected 'silu')")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if hf.get(key):
            problems.append(f"{key}=true")
    if problems:
        raise ValueError(f"config.json ({arch}): not supported: {', '.join(problems)}")
    kind = SUPPORTED_ARCHITECTURES[arch]
    try:
        n_heads = int(hf["num_attention_heads"])
        theta, scaling = _rope(hf)
        moe = {}
        if kind == "qwen3_moe":
            n_experts = int(hf.get("num_experts") or hf["num_local_experts"])
            step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
            moe = dict(n_experts=n_experts, experts_per_token=int(hf["num_experts_per_tok"]),
                       moe_hidden_dim=int(hf["moe_intermediate_size"]),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       moe_layers=tuple(i for i in range(int(hf["num_hidden_layers"]))
                                        if i not in dense and n_experts > 0 and (i + 1) % step == 0))
        return DecoderConfig(
            vocab_size=int(hf["vocab_size"]), dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            hidden_dim=int(hf["intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, head_dim=int(hf.get("head_dim") or 0),
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling, architecture=arch, **moe)
    except KeyError as e:
        raise ValueError(f"config.json ({arch}) lacks {e.args[0]!r}") from None


def read_hf_config(path) -> dict:
    """The dict in ``path/config.json`` (ValueError naming the file when it is missing or not
    JSON)."""
    file = os.path.join(os.fspath(path), "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{file} not found: expected a Hugging Face model directory "
                         f"(config.json and *.safetensors)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
