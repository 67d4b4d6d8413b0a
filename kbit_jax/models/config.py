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

Besides the configs of loadable checkpoints, `CONFIGS` holds "-class" configs of
mixture-of-experts models for benchmarks with random weights: the real model's sizes of the
routed and shared experts, the embeddings and the layer count, with attention simplified to the
decoder's grouped-query attention where the real model differs (see each config's comment).
`with_layers` reduces the layer count (e.g. so that bf16 weights fit one GPU).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

__all__ = ["DecoderConfig", "LlamaConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES", "from_hf_config",
           "read_hf_config", "rope_frequencies", "with_layers", "LLAMA3_8B", "LLAMA3_70B", "TINY", "TINY_TP",
           "TINY_MOE", "QWEN3_CODER_NEXT", "QWEN3_CODER_NEXT_12L", "GLM_4_7_FLASH",
           "QWEN3_30B_A3B", "CONFIGS"]

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
    them per token (softmax top-k, renormalized when ``norm_topk_prob``); the other layers
    have the dense SwiGLU MLP of width ``hidden_dim``. ``shared_expert_dim`` (0: none): the
    width of a shared SwiGLU expert every token of a MoE layer goes through as well.
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
    shared_expert_dim: int = 0

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.hidden_dim
        moe = (self.n_experts * (self.dim + 3 * self.dim * self.moe_hidden_dim)
               + 3 * self.dim * self.shared_expert_dim)
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


def with_layers(cfg: DecoderConfig, n_layers: int) -> DecoderConfig:
    """``cfg`` with its first ``n_layers`` layers (the MoE layers among them stay MoE)."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    return dataclasses.replace(cfg, n_layers=n_layers,
                               moe_layers=tuple(i for i in cfg.moe_layers if i < n_layers))


#: A tiny MoE decoder for tests: a dense first layer, then two layers of 8 experts (2 per token)
#: and a shared expert; runs quantized over up to 8 devices (kv heads, whole blocks and experts).
TINY_MOE = DecoderConfig(vocab_size=256, dim=64, n_layers=3, n_heads=8, n_kv_heads=8, head_dim=32,
                         hidden_dim=256,
                         rope_theta=10_000.0, qk_norm=True, n_experts=8, experts_per_token=2,
                         moe_hidden_dim=32, norm_topk_prob=True, moe_layers=(1, 2),
                         shared_expert_dim=64, architecture="Qwen3MoeForCausalLM")
#: Qwen3-Coder-Next-class (the Qwen3-Next-80B-A3B architecture, ~80B parameters): 48 layers,
#: every one with 512 routed experts (10 per token, each gate/up 2048 x 512 and down 512 x 2048)
#: and one shared expert of width 512, vocabulary 151936, untied embeddings: the sizes of its
#: config.json. Simplified: all 48 layers use grouped-query attention with the sizes of its
#: full-attention layers (16 query heads, 2 kv heads, head_dim 256, q/k RMSNorm), where the real
#: model has Gated DeltaNet linear attention in 3 of every 4 layers, an output gate on the
#: attention, partial rotary embedding, and a sigmoid gate on the shared expert's output.
#: bf16: ~158 GB (does not fit one H200); K=4: ~43 GB.
QWEN3_CODER_NEXT = DecoderConfig(
    vocab_size=151_936, dim=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256,
    hidden_dim=5120, norm_eps=1e-6, rope_theta=10_000_000.0, qk_norm=True, n_experts=512,
    experts_per_token=10, moe_hidden_dim=512, norm_topk_prob=True, moe_layers=tuple(range(48)),
    shared_expert_dim=512, architecture="Qwen3NextForCausalLM")
#: The same with 12 layers (~20B parameters, bf16 ~40 GB): bf16 and k-bit on one H200.
QWEN3_CODER_NEXT_12L = with_layers(QWEN3_CODER_NEXT, 12)
#: GLM-4.7-Flash-class (~30B parameters): 47 layers, the first with a dense SwiGLU MLP of width
#: 10240, the other 46 with 64 routed experts (4 per token, gate/up 2048 x 1536, down 1536 x 2048)
#: and one shared expert of width 1536 (n_shared_experts 1 x moe_intermediate_size), vocabulary
#: 154880: the sizes of its config.json. Simplified: multi-head latent attention (20 heads) is
#: replaced by grouped-query attention with 20 query and 20 kv heads of 128 (about the bytes of
#: its attention weights per layer), and the sigmoid routing with a score-correction bias and
#: a routed scaling factor by softmax top-k, renormalized. bf16 ~60 GB: fits one H200.
GLM_4_7_FLASH = DecoderConfig(
    vocab_size=154_880, dim=2048, n_layers=47, n_heads=20, n_kv_heads=20, head_dim=128,
    hidden_dim=10_240, norm_eps=1e-5, rope_theta=1_000_000.0, n_experts=64, experts_per_token=4,
    moe_hidden_dim=1536, norm_topk_prob=True, moe_layers=tuple(range(1, 47)),
    shared_expert_dim=1536, architecture="Glm4MoeLiteForCausalLM")
#: Qwen3-30B-A3B (Qwen3MoeForCausalLM, as its config.json): 48 layers of 128 experts, 8 per
#: token, 2048 x 768 / 768 x 2048, 32 query and 4 kv heads of 128, no shared expert. bf16 ~61 GB.
QWEN3_30B_A3B = DecoderConfig(
    vocab_size=151_936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    hidden_dim=6144, norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True, n_experts=128,
    experts_per_token=8, moe_hidden_dim=768, norm_topk_prob=True, moe_layers=tuple(range(48)),
    architecture="Qwen3MoeForCausalLM")
CONFIGS = {"tiny": TINY, "tiny-tp": TINY_TP, "tiny-moe": TINY_MOE, "llama3-8b": LLAMA3_8B,
           "llama3-70b": LLAMA3_70B, "qwen3-coder-next": QWEN3_CODER_NEXT,
           "qwen3-coder-next-12l": QWEN3_CODER_NEXT_12L, "glm-4.7-flash": GLM_4_7_FLASH,
           "qwen3-30b-a3b": QWEN3_30B_A3B}


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
