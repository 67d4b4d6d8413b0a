"""The Llama-3 / Qwen3 / Qwen3-MoE decoder in Flax NNX, dense or with k-bit weights: RMSNorm,
RoPE, GQA, SwiGLU or mixture-of-experts MLPs, KV cache, greedy decoding, Megatron tensor
parallelism.

Real checkpoints come in through ``kbit_jax.models.load`` (a Hugging Face directory, quantized
as it is read); `build_model` makes a randomly initialized one of any `DecoderConfig`:

    from kbit_jax.models import decoder
    model, report = decoder.build_model(decoder.TINY, bits=4)      # quantized as it is built
    logits = model(tokens)                                         # tokens int32[B, T] -> [B, T, vocab]
    new = decoder.generate(model, prompt, max_new_tokens=16)       # greedy, prompt: int32[B, T]

Without a cache ``model(tokens)`` runs the positions ``0 .. T-1`` causally and returns the
logits. With one the model is functional in its KV cache: ``model(tokens, cache, pos)``
writes the keys and values of ``tokens`` (``[B, T]``, at positions ``pos .. pos+T-1``, the same
for every row) into ``cache`` and returns ``(logits, cache)``. ``prefill``, ``decode_step`` and
``decode`` are jitted over ``(graphdef, state)`` from ``nnx.split(model)``, so a decode step
costs one dispatch and ``decode`` runs a whole greedy loop in one.

Tensor parallelism (Megatron style) over a mesh axis, bf16 or quantized alike:

    mesh = jax.make_mesh((2,), ("tp",))                               # Explicit or Auto axes
    model, _ = decoder.build_model(decoder.TINY, bits=4, mesh=mesh)   # or decoder.shard_model(model, mesh)
    new = decoder.generate(model, prompt, max_new_tokens=16)          # runs under jax.set_mesh(mesh)

The fused q/k/v and gate/up projections are column-parallel (N over "tp": whole kv-head
groups and matching gate/up features per device), o and down row-parallel (K over "tp":
one all-reduce each, so two per layer), lm_head column-parallel over the vocabulary, the
embedding and norms replicated (a tied output projection too: it is the embedding), and the
KV cache sharded over its kv-head axis. Each device holds its heads' slice of every weight;
quantized weights are placed with ``kbit_jax.shard_weight`` and multiplied shard by shard
(never gathered).

Mixture-of-experts layers are expert-parallel over the same axis: each device holds ``G / tp``
of every MoE layer's stacked experts (``P(axis, None, None)``, bf16 or quantized) and computes
them under ``shard_map`` (`kbit_jax.flax.moe`): every device routes all tokens, multiplies the
rows of its own experts and one all-reduce of the ``[tokens, dim]`` result combines them; no
expert weight moves. Routers and shared experts are replicated. In a model with MoE layers
attention is replicated by default (``attention_parallel``, `ATTENTION_PARALLEL`): every device
holds all of q/k/v/o and the whole KV cache and computes the same attention, so a MoE layer
has one all-reduce (the experts' combine) instead of two. `moe_path` names the expert product
a step runs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .. import flax as kflax
from ..flax.convert import _nbytes, _progress
from ..flax.layers import _LEAVES
from ..flax.moe import KbitMoE, MoE, dense_method
from ..examples import decode_attention as _decode
from ..examples import fused_norm as _norm
from ..format import BLOCK
from ..ops import interleave_glu, quantize
from ..sharding import weight_shardings
from .config import (CONFIGS, LLAMA3_70B, LLAMA3_8B, TINY, TINY_TP, DecoderConfig, LlamaConfig,
                     RopeScaling, rope_frequencies)

__all__ = [
    "ATTENTION_LINEARS", "ATTENTION_MODES", "ATTENTION_PARALLEL", "Attention", "Block", "CONFIGS",
    "Cache", "DecoderConfig", "KERNEL_MODES", "LLAMA3_70B", "LLAMA3_8B", "Llama", "LlamaConfig",
    "MLP", "MLP_GATE_MODES", "RMSNorm", "RopeScaling", "TINY", "TINY_TP", "TP_LAYOUT", "attend",
    "attention_placement", "build_model", "cache_sharding", "check_tp", "decode", "decode_step",
    "fuse_gate_up", "fuse_qkv", "generate", "init_cache", "linear_spec", "moe_path", "prefill",
    "quantized_tied_head", "variable_shardings", "rope", "rope_tables", "shard_model",
]

#: ``attention=`` values: "xla" (jnp q/k norm, rotary embedding, cache update, einsums and
#: softmax), "pallas" (single-token steps through ``decode_attention.decode_attention_step``, one
#: kernel for all of it; interpreted off the GPU), "auto" (that kernel on a GPU for single-token
#: steps whose shapes and dtypes it takes, XLA otherwise).
ATTENTION_MODES = ("auto", "xla", "pallas")
#: ``norm=`` values, the same three: the residual add and RMSNorm through XLA (two kernels per
#: norm), or through ``fused_norm.add_rms_norm`` (one; "auto": on a GPU).
KERNEL_MODES = ATTENTION_MODES
#: ``mlp_gate=`` values: "auto" (silu(gate) * up inside the kbit gate/up kernel,
#: ``KbitLinear(x, glu="silu")``, where that projection is quantized; XLA otherwise), "xla".
MLP_GATE_MODES = ("auto", "xla")
#: ``attention_parallel=`` values (`shard_model`, `build_model`, ``kbit_jax.models.load``): how
#: attention is placed on the mesh. "tensor": Megatron (q/k/v column-parallel over whole kv-head
#: groups, o_proj row-parallel: one all-reduce per layer; KV cache over kv heads; needs n_heads and
#: n_kv_heads divisible by the axis size). "replicated": every device holds all of q/k/v/o and
#: the whole KV cache and computes the same attention on the same tokens (no collective; any head
#: count). "auto": replicated in a model with mixture-of-experts layers, tensor otherwise
#: (`attention_placement` says why).
ATTENTION_PARALLEL = ("auto", "tensor", "replicated")


Cache = list  # [(k, v)] per layer, each [B, max_len, n_kv_heads, head_dim]


def _takes_kernel(mode: str, flag: str, why_not) -> bool:
    """Whether a layer in `KERNEL_MODES` ``mode`` runs its Pallas kernel: never with "xla";
    always with "pallas", raising ValueError (naming ``flag``) where ``why_not()`` says why the
    kernel does not take the inputs; with "auto" on a GPU where it takes them."""
    if mode == "xla":
        return False
    why = why_not()
    if mode == "pallas":
        if why:
            raise ValueError(f"{flag}='pallas': {why}")
        return True
    return why is None and jax.default_backend() == "gpu"


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. ``kernel`` (`KERNEL_MODES`): `add_and_norm` through
    ``fused_norm.add_rms_norm``'s Pallas kernel ("pallas"; "auto": on a GPU where it takes the
    shape) or through XLA ("xla")."""

    def __init__(self, dim: int, eps: float, param_dtype, *, kernel: str = "xla"):
        if kernel not in KERNEL_MODES:
            raise ValueError(f"norm={kernel!r}: expected one of {KERNEL_MODES}")
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.kernel = kernel

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)

    def add_and_norm(self, x, delta):
        """``(x + delta, self(x + delta))``, or ``(x, self(x))`` when delta is None: the residual
        stream with a sublayer's output added, and its norm (one kernel with "pallas")."""
        if not _takes_kernel(self.kernel, "norm", lambda: _norm.supported(x.shape, x.dtype)):
            if delta is not None:
                x = x + delta
            return x, self(x)
        norm = functools.partial(_norm.add_rms_norm, eps=self.eps)
        scale = self.scale[...]
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:   # replicated over the mesh (after an all-reduce): every device the same rows
            norm = jax.shard_map(norm, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                                 check_vma=False)
        return norm(x, delta, scale)


def rope_tables(positions, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos and sin [T, head_dim / 2] (f32) of the rotary angles at positions[T]
    (`rope_frequencies`: the base ``theta`` and the checkpoint's scaling, if any)."""
    freqs = jnp.asarray(rope_frequencies(head_dim, theta, scaling))               # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * freqs                       # [T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def rope(x, positions, theta: float, scaling: RopeScaling | None = None):
    """Rotary embedding (rotate-half convention) of x[B, T, H, D] at positions[T]."""
    cos, sin = rope_tables(positions, x.shape[-1], theta, scaling)
    cos, sin = cos[:, None, :], sin[:, None, :]                                # [T, 1, D/2]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _linear(din, dout, param_dtype, rngs):
    return nnx.Linear(din, dout, use_bias=False, param_dtype=param_dtype, rngs=rngs)


def _row_parallel_out(x):
    """``out_sharding`` for a row-parallel layer applied to ``x``: under Explicit mesh axes with
    x's features sharded, x's sharding with the features replicated (the sharded contraction
    is all-reduced; jnp's dot wants this spelled out). None otherwise (Auto axes, no mesh)."""
    try:
        sharding = jax.typeof(x).sharding
    except TypeError:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if sharding.mesh.empty or spec[-1] is None:
        return None
    return P(*spec[:-1], None)


class Attention(nnx.Module):
    """Grouped-query attention with one fused q/k/v projection.

    ``qkv_proj``'s output columns are grouped by kv head: for kv head j, the ``G = n_heads /
    n_kv_heads`` query heads that share it, then k_j, then v_j (``(G + 2) * head_dim`` columns
    per group). One projection instead of three is one kernel launch instead of three for the
    small k and v matrices, and splitting its columns over a tensor-parallel axis gives every
    device whole groups (q, k and v of the same heads). `fuse_qkv` builds this kernel from a
    checkpoint's separate q/k/v kernels.

    With ``cfg.qk_norm`` (Qwen3), ``q_norm`` and ``k_norm`` (RMSNorm over head_dim, one scale
    shared by all heads) normalize each query and key head before the rotary embedding: inside
    the attention kernel on single-token steps that take it (no kernel between the q/k/v
    product and the attention), through XLA otherwise.
    """

    def __init__(self, cfg: DecoderConfig, param_dtype, rngs: nnx.Rngs, *, attention: str = "auto"):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r}: expected one of {ATTENTION_MODES}")
        hd = cfg.head_dim
        self.qkv_proj = _linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, param_dtype, rngs)
        self.o_proj = _linear(cfg.n_heads * hd, cfg.dim, param_dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, param_dtype)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, param_dtype)
        else:
            self.q_norm = self.k_norm = None
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, hd
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.attention = attention
        # The mesh axis over kv heads once placed tensor-parallel by shard_model; None: on one
        # device, or replicated over the mesh (attention_parallel="replicated").
        self.tp_axis = None

    def _attend_one(self, qkv, cache_k, cache_v, pos, cos, sin):
        """decode_attention_step on qkv [B, KVH, G + 2, D] (with ``cfg.qk_norm``, the q/k RMSNorm
        inside the kernel too); under a mesh, per device (a Pallas kernel has no partitioning
        rule of its own) over the kv-head axis when the attention is tensor-parallel, on the
        whole (replicated) heads and cache otherwise. The norm scales are replicated."""
        norms = () if self.q_norm is None else (self.q_norm.scale[...], self.k_norm.scale[...])

        def step(qkv, cache_k, cache_v, pos, cos, sin, *norms):
            if not norms:
                return _decode.decode_attention_step(qkv, cache_k, cache_v, pos, cos, sin)
            return _decode.decode_attention_step(qkv, cache_k, cache_v, pos, cos, sin,
                                                 q_norm=norms[0], k_norm=norms[1],
                                                 norm_eps=self.q_norm.eps)

        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return step(qkv, cache_k, cache_v, pos, cos, sin, *norms)
        axis = self.tp_axis if self.tp_axis in mesh.axis_names else None
        heads, cache = P(None, axis, None, None), P(None, None, axis, None)
        return jax.shard_map(step, mesh=mesh,
                             in_specs=(heads, cache, cache, P(), P(), P()) + (P(),) * len(norms),
                             out_specs=(heads, cache, cache), check_vma=False)(
                                 qkv, cache_k, cache_v, pos, cos, sin, *norms)

    def _kernel_why_not(self, qkv_shape, qkv_dtype, cache_k) -> str | None:
        """Why `decode_attention_step` does not take this single-token step (None: it does)."""
        why = _decode.supported_step(qkv_shape, cache_k.shape, qkv_dtype, cache_k.dtype)
        if not why and self.q_norm is not None and self.q_norm.eps != self.k_norm.eps:
            why = (f"q_norm eps {self.q_norm.eps} differs from k_norm eps {self.k_norm.eps} "
                   "(the kernel takes one)")
        return why

    def _check_cache(self, cache_k):
        """ValueError when, under Explicit mesh axes, the cache's kv-head axis is not placed as
        this attention is (kv heads over ``tp_axis``, or whole when replicated): a cache made
        for the other placement."""
        try:
            sharding = jax.typeof(cache_k).sharding
        except TypeError:
            return
        mesh = sharding.mesh
        if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
            return
        spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
        explicit = dict(zip(mesh.axis_names, mesh.axis_types))
        want = self.tp_axis if explicit.get(self.tp_axis) == AxisType.Explicit else None
        if spec[2] != want:
            got = "whole" if spec[2] is None else f"sharded over {spec[2]!r}"
            placed = "replicated" if want is None else f"tensor-parallel over {want!r}"
            raise ValueError(f"cache: kv heads {got}, but this model's attention is {placed}; make "
                             f"the cache with init_cache(..., sharding=model.cache_sharding())")

    def __call__(self, x, cache_k, cache_v, pos):
        """Attention over ``x[B, T, dim]`` at positions ``pos .. pos+T-1``, writing its keys and
        values into the cache; without a cache (None, None) over ``x`` itself (causal)."""
        b, t, _ = x.shape
        if cache_k is not None:
            self._check_cache(cache_k)
        h, kvh, hd = self.n_heads, self.n_kv_heads, self.head_dim
        g = h // kvh
        positions = pos + jnp.arange(t)
        qkv = self.qkv_proj(x).reshape(b, t, kvh, g + 2, hd)
        if t == 1 and cache_k is not None and _takes_kernel(
                self.attention, "attention",
                lambda: self._kernel_why_not((b, kvh, g + 2, hd), qkv.dtype, cache_k)):
            # One kernel: the q/k RMSNorm (Qwen3), rotary embedding, the cache writes at pos and
            # the attention.
            cos, sin = rope_tables(positions, hd, self.rope_theta, self.rope_scaling)
            out, cache_k, cache_v = self._attend_one(qkv[:, 0], cache_k, cache_v,
                                                     jnp.asarray(pos, jnp.int32), cos[0], sin[0])
            out = out[:, None]
        else:
            if self.q_norm is not None:
                qkv = jnp.concatenate([self.q_norm(qkv[:, :, :, :g]), self.k_norm(qkv[:, :, :, g:g + 1]),
                                       qkv[:, :, :, g + 1:]], axis=3)
            q = rope(qkv[:, :, :, :g].reshape(b, t, h, hd), positions, self.rope_theta, self.rope_scaling)
            k = rope(qkv[:, :, :, g], positions, self.rope_theta, self.rope_scaling)
            v = qkv[:, :, :, g + 1]
            if cache_k is None:
                out = attend(q.reshape(b, t, kvh, g, hd), k, v, jnp.arange(t))
            else:
                cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, pos, 0, 0))
                cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, pos, 0, 0))
                out = attend(q.reshape(b, t, kvh, g, hd), cache_k, cache_v, positions)
        out = out.reshape(b, t, h * hd).astype(x.dtype)
        return self.o_proj(out, out_sharding=_row_parallel_out(out)), cache_k, cache_v


def attend(q, cache_k, cache_v, positions):
    """Grouped-query attention in jnp (the XLA path): q ``[B, T, KVH, G, D]`` over the whole
    cache ``[B, S, KVH, D]``, masked to keys at positions <= the query's (``positions[T]``).
    f32 scores and softmax; probabilities rounded to the cache dtype for the p.v product.
    Returns ``[B, T, KVH, G, D]`` in f32."""
    scores = jnp.einsum("btkgd,bskd->bkgts", q, cache_k,
                        preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    mask = jnp.arange(cache_k.shape[1])[None, :] <= positions[:, None]       # [T, S]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs.astype(cache_v.dtype), cache_v,
                      preferred_element_type=jnp.float32)


class MLP(nnx.Module):
    """SwiGLU MLP with one fused gate/up projection: ``gate_up_proj``'s output column 2i is
    gate feature i and column 2i + 1 up feature i, so one kernel computes both and a
    column-parallel split gives every device matching gate and up features (`fuse_gate_up`
    builds it from separate kernels)."""

    def __init__(self, cfg: DecoderConfig, param_dtype, rngs: nnx.Rngs, *, gate: str = "auto"):
        if gate not in MLP_GATE_MODES:
            raise ValueError(f"mlp_gate={gate!r}: expected one of {MLP_GATE_MODES}")
        self.gate_up_proj = _linear(cfg.dim, 2 * cfg.hidden_dim, param_dtype, rngs)
        self.down_proj = _linear(cfg.hidden_dim, cfg.dim, param_dtype, rngs)
        self.gate = gate

    def __call__(self, x):
        if self.gate == "auto" and isinstance(self.gate_up_proj, kflax.KbitLinear):
            h = self.gate_up_proj(x, glu="silu")
        else:
            gate_up = self.gate_up_proj(x)
            gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
            h = jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]
        return self.down_proj(h, out_sharding=_row_parallel_out(h))


def fuse_qkv(q, k, v, n_kv_heads: int):
    """A checkpoint's separate q/k/v kernels (``[dim, n_heads * hd]``, ``[dim, n_kv_heads * hd]``
    twice, heads in column order) as one ``qkv_proj`` kernel in `Attention`'s column order:
    per kv head j, its query heads, then k_j, then v_j."""
    d = q.shape[0]
    if k.shape != v.shape or k.shape[1] % n_kv_heads or q.shape[1] % k.shape[1]:
        raise ValueError(f"fuse_qkv: q {q.shape}, k {k.shape}, v {v.shape} do not split into "
                         f"{n_kv_heads} kv heads with whole query groups")
    parts = [w.reshape(d, n_kv_heads, -1) for w in (q, k, v)]   # [dim, kv head, cols]
    return jnp.concatenate(parts, axis=2).reshape(d, -1)


#: A checkpoint's gate and up kernels (``[dim, hidden]`` each) as one ``gate_up_proj`` kernel:
#: column 2i is gate feature i, column 2i + 1 up feature i.
fuse_gate_up = interleave_glu


class Block(nnx.Module):
    """Attention and MLP, each after an RMSNorm, on the residual stream. With ``moe`` the MLP is
    a mixture of experts (``kbit_jax.flax.MoE``; `build_model` and ``kbit_jax.models.load``
    quantize it into a ``KbitMoE``)."""

    def __init__(self, cfg: DecoderConfig, param_dtype, rngs: nnx.Rngs, *, attention: str = "auto",
                 norm: str = "auto", mlp_gate: str = "auto", moe: bool = False, moe_method: str = "auto",
                 moe_routing: str = "auto"):
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype, kernel=norm)
        self.attn = Attention(cfg, param_dtype, rngs, attention=attention)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype, kernel=norm)
        if moe:
            self.mlp = MoE(cfg.dim, cfg.moe_hidden_dim, cfg.n_experts, cfg.experts_per_token,
                           norm_topk_prob=cfg.norm_topk_prob, param_dtype=param_dtype,
                           shared_intermediate=cfg.shared_expert_dim or None, method=moe_method,
                           routing=moe_routing, rngs=rngs)
        else:
            self.mlp = MLP(cfg, param_dtype, rngs, gate=mlp_gate)

    def __call__(self, x, cache_k, cache_v, pos):
        x, mlp_out, cache_k, cache_v = self.step(x, None, cache_k, cache_v, pos)
        return x + mlp_out, cache_k, cache_v

    def step(self, x, pending, cache_k, cache_v, pos):
        """The block on the residual stream ``x`` + ``pending`` (the previous block's MLP output,
        not yet added; None for none). Returns ``(x, mlp_out, cache_k, cache_v)`` with this
        block's MLP output pending in turn: each residual add is done by the norm that follows
        it (`RMSNorm.add_and_norm`, one kernel for both with norm="pallas")."""
        x, h = self.attn_norm.add_and_norm(x, pending)
        a, cache_k, cache_v = self.attn(h, cache_k, cache_v, pos)
        x, h = self.mlp_norm.add_and_norm(x, a)
        return x, self.mlp(h), cache_k, cache_v


class Llama(nnx.Module):
    """Decoder-only transformer (Llama-3 and Qwen3 layouts, `DecoderConfig`). ``block_hook(block)``
    (optional) runs on each block as soon as it is built, e.g. to quantize it before the next
    one is allocated. ``attention`` picks the single-token attention (`ATTENTION_MODES`;
    prompts always take the XLA path), ``norm`` the residual add + RMSNorm (`KERNEL_MODES`),
    ``mlp_gate`` where the MLP's silu(gate) * up runs (`MLP_GATE_MODES`), ``moe_method`` how
    a dense MoE layer multiplies its experts (``kbit_jax.flax.moe.MOE_METHODS``), ``moe_routing``
    how MoE layers route their tokens (``kbit_jax.flax.routing.ROUTING_METHODS``).

    With ``cfg.tie_embeddings`` the output projection is the embedding (``lm_head`` is None)
    unless a separate, quantized head was made from it (`build_model` and ``models.load``
    make one when they quantize, `head_dense_reason`)."""

    def __init__(self, cfg: DecoderConfig, *, param_dtype=jnp.bfloat16, rngs: nnx.Rngs,
                 block_hook=None, attention: str = "auto", norm: str = "auto", mlp_gate: str = "auto",
                 moe_method: str = "auto", moe_routing: str = "auto"):
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, param_dtype=param_dtype, rngs=rngs)
        blocks = []
        for _ in range(cfg.n_layers):
            blocks.append(Block(cfg, param_dtype, rngs, attention=attention, norm=norm, mlp_gate=mlp_gate,
                                moe=len(blocks) in cfg.moe_layers, moe_method=moe_method,
                                moe_routing=moe_routing))
            if block_hook is not None:
                block_hook(blocks[-1])
        self.layers = nnx.List(blocks)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, param_dtype, kernel=norm)
        # data even when None: a quantized head may be set later (quantized_tied_head)
        self.lm_head = nnx.data(None) if cfg.tie_embeddings else _linear(cfg.dim, cfg.vocab_size, param_dtype, rngs)
        self.tp = None   # (mesh, axis) once placed tensor-parallel by shard_model
        self.attention_parallel = None   # "tensor" or "replicated" once placed by shard_model

    def cache_sharding(self) -> NamedSharding | None:
        """The KV cache's sharding for this model as `shard_model` placed it (`cache_sharding`
        of its mesh, axis and attention placement); None when it is not placed on a mesh."""
        if self.tp is None:
            return None
        mesh, axis = self.tp
        return cache_sharding(mesh, axis, self.attention_parallel)

    def __call__(self, tokens, cache: Cache | None = None, pos=0, *, last_only: bool = False):
        """Logits of ``tokens`` int32[B, T]: ``[B, T, vocab]`` (``[B, 1, vocab]`` with
        ``last_only``) in the computation dtype (float32 for a float32 model).

        Without ``cache``: the tokens at positions 0 .. T-1, causal; returns the logits.
        With one (`init_cache`): the tokens at ``pos .. pos+T-1`` attend to the cache too and
        their keys and values are written into it; returns ``(logits, cache)``."""
        x, pending = self.embed(tokens), None
        layers_cache = [(None, None)] * len(self.layers) if cache is None else cache
        new_cache = []
        for layer, (k, v) in zip(self.layers, layers_cache):
            x, pending, k, v = layer.step(x, pending, k, v, 0 if cache is None else pos)
            new_cache.append((k, v))
        if last_only:
            x, pending = x[:, -1:], None if pending is None else pending[:, -1:]
        _, h = self.norm.add_and_norm(x, pending)
        logits = self.embed.attend(h) if self.lm_head is None else self.lm_head(h)
        return logits if cache is None else (logits, new_cache)


def init_cache(cfg: DecoderConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *,
               sharding=None) -> Cache:
    """Zeros ``[(k, v)]`` per layer, each ``[batch, max_len, n_kv_heads, head_dim]``, placed
    with ``sharding`` if given (see `cache_sharding`)."""
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    return [(jnp.zeros(shape, dtype, device=sharding), jnp.zeros(shape, dtype, device=sharding))
            for _ in range(cfg.n_layers)]


# -- tensor parallelism -----------------------------------------------------------------------
#: Logical (K, N) placement of each linear layer, by attribute name: "col" = N over the
#: tensor-parallel axis (no collective), "row" = K over it (one all-reduce).
TP_LAYOUT = {"qkv_proj": "col", "gate_up_proj": "col", "o_proj": "row", "down_proj": "row",
             "lm_head": "col"}


def _tp_size(mesh, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r} (axes {tuple(mesh.axis_names)})")
    return int(mesh.shape[axis])


def _check_attention_parallel(attention_parallel, allowed=ATTENTION_PARALLEL) -> str:
    if attention_parallel not in allowed:
        raise ValueError(f"attention_parallel={attention_parallel!r}: expected one of {allowed}")
    return attention_parallel


def attention_placement(cfg: DecoderConfig, attention_parallel: str = "auto") -> str:
    """``attention_parallel`` (`ATTENTION_PARALLEL`) resolved for ``cfg``: "tensor" or
    "replicated"; "auto" is "replicated" when ``cfg`` has mixture-of-experts layers, else
    "tensor".

    Why: at decode a layer's all-reduce moves a few KB (``[batch, dim]``) and costs its latency
    (~20-30 us per all-reduce with NCCL on H200s, skew between the GPUs included), whatever its
    size. Under expert parallelism the MoE layer already all-reduces once (the experts' combine);
    tensor-parallel attention adds a second one (after o_proj). Replicated attention drops it,
    and costs each device a read of the attention weights and KV cache that tensor parallelism
    would have split: Qwen3-Coder-Next-class, q/k/v/o ~19 M weights per layer, ~10 MB at K=4
    (~2 us of HBM time on an H200), and 2 KB of cache per token per layer (2 kv heads). So a MoE
    step does half the all-reduces for a few us of extra reads per layer; and attention with
    fewer kv heads than devices (2 kv heads over 4 GPUs) can only be replicated. In a dense
    model the MLP all-reduces anyway and attention is a large share of the weights (Llama-3-70B:
    ~150 M per layer, ~80 MB at K=4, ~20 us): there tensor parallelism stays the default."""
    attention_parallel = _check_attention_parallel(attention_parallel)
    if attention_parallel != "auto":
        return attention_parallel
    return "replicated" if cfg.moe_layers else "tensor"


def check_tp(cfg: DecoderConfig, tp: int, attention_parallel: str = "auto") -> None:
    """ValueError unless ``cfg`` splits into ``tp`` tensor-parallel shards: whole heads and kv
    heads when attention is tensor-parallel (`attention_placement`), hidden_dim with dense MLP
    layers, whole experts with MoE layers."""
    sizes = []
    if attention_placement(cfg, attention_parallel) == "tensor":
        sizes += [("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads)]
    if len(cfg.moe_layers) < cfg.n_layers:
        sizes.append(("hidden_dim", cfg.hidden_dim))
    if cfg.moe_layers:
        sizes.append(("n_experts", cfg.n_experts))
    problems = [f"{name}={value}" for name, value in sizes if value % tp]
    if problems:
        names = [name for name, _ in sizes]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        raise ValueError(f"tensor parallelism over {tp} devices needs {listed} divisible by {tp}; "
                         f"got {', '.join(problems)}")


def moe_path(cfg: DecoderConfig, bits: int | None, tokens: int, tp: int = 1,
             method: str = "auto") -> str | None:
    """The routed-expert product a step over ``tokens`` tokens runs (None without MoE layers):
    "kbit ragged_dot" (quantized), else by the dense block's ``method`` ("auto":
    ``kbit_jax.flax.moe.dense_method``) "gather-einsum", "gather-reduce", "lax.ragged_dot" or
    "all experts"; prefixed "ep " when expert-parallel (``tp > 1``)."""
    if not cfg.moe_layers:
        return None
    if bits is not None:
        path = "kbit ragged_dot"
    else:
        if method == "auto":
            method = dense_method(tokens * cfg.experts_per_token, cfg.n_experts)
        path = {"gather": "gather-einsum", "gather-reduce": "gather-reduce", "ragged": "lax.ragged_dot",
                "all": "all experts"}[method]
    return f"ep {path}" if tp > 1 else path


def cache_sharding(mesh, axis: str = "tp", attention_parallel: str = "tensor") -> NamedSharding:
    """The KV cache's sharding on ``mesh``: kv heads over ``axis`` with tensor-parallel
    attention, replicated with ``attention_parallel="replicated"``. A placed model's own:
    ``Llama.cache_sharding()``."""
    if _check_attention_parallel(attention_parallel, ("tensor", "replicated")) == "replicated":
        return NamedSharding(mesh, P())
    return NamedSharding(mesh, P(None, None, axis, None))


#: The attention's linear layers (kept whole on every device with replicated attention).
ATTENTION_LINEARS = ("qkv_proj", "o_proj")


def linear_spec(name: str, k: int, n: int, axis: str, tp: int, attention_parallel: str = "tensor"):
    """The logical (K, N) PartitionSpec of a ``[k, n]`` linear layer named ``name`` under
    tensor parallelism over ``tp`` devices of mesh axis ``axis`` (`TP_LAYOUT`; None:
    replicate; the attention's q/k/v and o with ``attention_parallel="replicated"`` too).
    ValueError when the layer does not split evenly."""
    kind = TP_LAYOUT.get(name)
    placement = _check_attention_parallel(attention_parallel, ("tensor", "replicated"))
    if kind is None or (placement == "replicated" and name in ATTENTION_LINEARS):
        return None
    if kind == "col" and n % tp:
        if name == "lm_head":
            return None              # a vocabulary tp does not divide: keep the head replicated
        raise ValueError(f"{name}: out_features={n} is not divisible by the {tp} shards of {axis!r}")
    if kind == "row" and k % tp:
        raise ValueError(f"{name}: in_features={k} is not divisible by the {tp} shards of {axis!r}")
    return P(None, axis) if kind == "col" else P(axis, None)


def _placement(model, attention_parallel: str) -> str:
    """`attention_placement` for a `Llama` (by its config) or a sub-module ("auto": replicated
    when it holds MoE blocks)."""
    if isinstance(model, Llama):
        return attention_placement(model.config, attention_parallel)
    if _check_attention_parallel(attention_parallel) != "auto":
        return attention_parallel
    moe = any(isinstance(m, (MoE, KbitMoE)) for _, m in nnx.iter_modules(model))
    return "replicated" if moe else "tensor"


def variable_shardings(model, mesh, axis: str = "tp", attention_parallel: str = "auto") -> dict:
    """Where `shard_model` puts each array variable of ``model``: ``{id(variable): (variable,
    NamedSharding, out_sharding names or None)}``. Works on an abstract model too
    (``nnx.eval_shape``), e.g. to restore a checkpoint straight into its shards."""
    tp = _tp_size(mesh, axis)
    placement = _placement(model, attention_parallel)
    out = {}
    stacked = P(axis, None, None)
    for path, module in nnx.iter_modules(model):
        if isinstance(module, MoE):          # experts over the axis: expert parallelism
            for var in (module.gate, module.up, module.down):
                out[id(var)] = (var, NamedSharding(mesh, stacked), tuple(stacked))
            continue
        if isinstance(module, KbitMoE):
            names = kflax.leaf_sharding(tuple(stacked))
            for weight in (module.gate_up, module.down):
                shardings = weight_shardings(_weight_value(weight), mesh, stacked)
                for leaf in _LEAVES:
                    var = getattr(weight, leaf)
                    out[id(var)] = (var, getattr(shardings, leaf), names[leaf])
            continue
        if not isinstance(module, (nnx.Linear, kflax.KbitLinear)) or not path:
            continue
        spec = linear_spec(path[-1], module.in_features, module.out_features, axis, tp, placement)
        if spec is None:
            continue
        if module.bias is not None:
            raise NotImplementedError("shard_model: layers with a bias")
        if isinstance(module, kflax.KbitLinear):
            shardings = weight_shardings(module.weight, mesh, spec)   # refuses cut blocks
            names = kflax.leaf_sharding(tuple(spec))
            for leaf in _LEAVES:
                var = getattr(module.kernel, leaf)
                out[id(var)] = (var, getattr(shardings, leaf), names[leaf])
        else:
            out[id(module.kernel)] = (module.kernel, NamedSharding(mesh, spec), tuple(spec))
    replicated = NamedSharding(mesh, P())
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and id(node) not in out and hasattr(node.get_value(), "shape"):
            out[id(node)] = (node, replicated, None)
    return out


def _weight_value(weight):
    """A KbitWeight of QuantizedWeight variables as one of their values (arrays or, on an
    abstract model, shape structs)."""
    return jax.tree.map(lambda v: v.get_value(), weight, is_leaf=lambda v: isinstance(v, nnx.Variable))


def shard_model(model, mesh, axis: str = "tp", *, attention_parallel: str = "auto"):
    """Place ``model`` (a `Llama`, or any sub-module such as one `Block`) tensor-parallel over
    ``mesh``'s axis ``axis``, in place; returns it.

    Linear layers follow `TP_LAYOUT` (Megatron: fused q/k/v and gate/up column-parallel, o/down
    row-parallel; lm_head column-parallel over the vocabulary when ``tp`` divides it). A
    quantized layer's leaves are placed by ``kbit_jax.shard_weight`` (it refuses a shard
    that would cut a 32-element block, e.g. o_proj's K/tp not a multiple of 32); a dense
    kernel by ``jax.device_put``. Each placed variable records its spec as ``out_sharding``
    metadata, so ``nnx.get_partition_spec(nnx.state(model))`` describes the placement.
    Everything else (embedding, norms) is replicated over the mesh. Mixture-of-experts blocks
    (`MoE`, `KbitMoE`) are expert-parallel: their stacked experts ``P(axis, None, None)``, their
    ``ep_axis`` set to ``axis`` (they then compute under ``shard_map``), router and shared
    expert replicated.

    ``attention_parallel`` (`ATTENTION_PARALLEL`) places the attention: "tensor" (the layout
    above: q/k/v column-, o row-parallel, each `Attention`'s ``tp_axis`` set to ``axis``),
    "replicated" (q/k/v/o whole on every device, ``tp_axis`` None: no collective in attention;
    the KV cache then replicated too, ``Llama.cache_sharding()``), "auto" (`attention_placement`:
    replicated in a model with MoE layers, halving a MoE layer's all-reduces; for a sub-module,
    replicated when it holds MoE blocks). Dense MLP layers are tensor-parallel either way. A
    `Llama` records the choice in ``attention_parallel``.

    Raises ValueError when ``axis`` is not in the mesh, ``attention_parallel`` is not one of
    `ATTENTION_PARALLEL`, or ``n_heads``, ``n_kv_heads`` (with tensor-parallel attention),
    ``hidden_dim`` (with dense MLPs) or ``n_experts`` (with MoE layers) is not divisible by the
    axis size.
    """
    tp = _tp_size(mesh, axis)
    placement = _placement(model, attention_parallel)
    if isinstance(model, Llama):
        check_tp(model.config, tp, placement)
    modules = list(nnx.iter_modules(model))
    for _, module in modules:
        if isinstance(module, Attention) and placement == "replicated":
            module.tp_axis = None
        elif isinstance(module, Attention):
            problems = [f"{name}={getattr(module, name)}" for name in ("n_heads", "n_kv_heads")
                        if getattr(module, name) % tp]
            if problems:
                raise ValueError(f"tensor parallelism over {tp} devices needs n_heads and "
                                 f"n_kv_heads divisible by {tp}; got {', '.join(problems)}")
            module.tp_axis = axis
        if isinstance(module, (MoE, KbitMoE)):
            if module.num_experts % tp:
                raise ValueError(f"expert parallelism over {tp} devices needs num_experts divisible "
                                 f"by {tp}; got {module.num_experts}")
            module.ep_axis = axis
    for var, sharding, names in variable_shardings(model, mesh, axis, placement).values():
        var.set_value(jax.device_put(var.get_value(), sharding))
        if names is not None:
            var.set_metadata("out_sharding", names)
    if isinstance(model, Llama):
        model.tp = (mesh, axis)
        model.attention_parallel = placement
    return model


def head_dense_reason(cfg: DecoderConfig, quantize_head: bool = True) -> str | None:
    """Why a quantized model of ``cfg`` keeps its output projection dense, or None when it
    quantizes it. The head ([dim, vocab]) is read whole at every decode step: kept bf16 in a
    Llama-3-8B at K=4 it is about a fifth of the weight bytes a step reads (a third at K=2),
    so a quantized model quantizes it unless asked not to (``quantize_head=False``) or it
    cannot be: its in_features (``cfg.dim``) must be whole 32-element blocks."""
    if not quantize_head:
        return "kept dense (quantize_head=False)"
    if cfg.dim % BLOCK:
        return f"in_features={cfg.dim} is not a multiple of {BLOCK}"
    return None


def quantized_tied_head(embed: nnx.Embed, bits: int, codebook: Any = "nf") -> kflax.KbitLinear:
    """A quantized output projection made from a tied embedding ``[vocab, dim]`` (its
    transpose, ``[dim, vocab]``); the embedding itself stays dense for the token lookup."""
    table = embed.embedding.get_value()
    return kflax.KbitLinear.from_weight(quantize(table.T, bits, codebook), param_dtype=table.dtype)


def build_model(cfg: DecoderConfig, *, bits: int | None = None, codebook: Any = "nf", seed: int = 0,
                param_dtype=jnp.bfloat16, quantize_head: bool = True, progress: bool = False,
                mesh=None, axis: str = "tp", attention: str = "auto", norm: str = "auto",
                mlp_gate: str = "auto", moe_method: str = "auto", moe_routing: str = "auto",
                attention_parallel: str = "auto"):
    """A randomly initialized model, and the ``QuantizeReport`` (None when ``bits`` is None).

    With ``bits``, each block goes through ``kbit_jax.flax.quantize_model`` as soon as it is
    built, so peak memory is the quantized model plus one dense block (a 70B model at K=4
    builds on one GPU although its bf16 weights would not fit). The output projection is
    quantized too (a tied embedding gets a quantized copy as the head, `quantized_tied_head`;
    the embedding itself stays dense for the token lookup): it is read whole at every decode
    step (`head_dense_reason` says how much that weighs). ``quantize_head=False`` keeps it
    dense; one that cannot be quantized stays dense as well, with the reason in the report's
    ``skipped``.

    With ``mesh``, the model is tensor-parallel over ``mesh``'s axis ``axis`` (`shard_model`):
    each block is placed as soon as it is built (and quantized), so no device ever holds more
    than its share plus one block, embedding and lm_head (70B in bf16 builds over 2 GPUs).
    The weights are the same as without a mesh (same seed, same values).
    ``attention_parallel`` places the attention on the mesh (`ATTENTION_PARALLEL`; "auto":
    replicated when ``cfg`` has MoE layers, tensor-parallel otherwise, `attention_placement`).

    ``attention`` picks the single-token attention: `ATTENTION_MODES` ("auto": the Pallas
    kernel of ``decode_attention.decode_attention_step`` on a GPU, q/k norm, rotary embedding
    and cache write included). ``norm`` picks the residual add + RMSNorm: `KERNEL_MODES` ("auto": the
    Pallas kernel of ``fused_norm.add_rms_norm`` on a GPU). ``mlp_gate``: `MLP_GATE_MODES`
    ("auto": silu(gate) * up inside the quantized gate/up projection's kernel). ``moe_method``:
    the dense MoE layers' path, ``kbit_jax.flax.moe.MOE_METHODS`` ("auto": gather the chosen
    experts at decode sizes, `moe_path`; quantized layers always run ``kbit_jax.ragged_dot``).
    ``moe_routing``: how every MoE layer routes its tokens, ``kbit_jax.flax.routing.ROUTING_METHODS``
    ("auto": softmax, top-k and the sort by expert as one Pallas kernel on a GPU at decode
    sizes, ``kbit_jax.flax.routing_kernel``).
    """
    modes = dict(attention=attention, norm=norm, mlp_gate=mlp_gate, moe_method=moe_method,
                 moe_routing=moe_routing)
    placement = attention_placement(cfg, attention_parallel)   # every block placed alike
    place = functools.partial(shard_model, mesh=mesh, axis=axis, attention_parallel=placement)
    if mesh is not None:
        check_tp(cfg, _tp_size(mesh, axis), placement)
    if bits is None:
        if mesh is None:
            return Llama(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(seed), **modes), None
        model = Llama(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(seed), **modes, block_hook=place)
        return place(model), None
    report = kflax.QuantizeReport(bits=bits, codebook=codebook)
    ticks = iter(_progress(range(cfg.n_layers), cfg.n_layers, progress, "build + quantize"))

    def hook(block):
        i = next(ticks)
        r = kflax.quantize_model(block, bits, codebook, progress=False)
        if mesh is not None:
            place(block)
        report.replaced += [f"layers/{i}/{p}" for p in r.replaced]
        report.skipped += [(f"layers/{i}/{p}", why) for p, why in r.skipped]
        report.bytes_before += r.bytes_before
        report.replaced_bytes_before += r.replaced_bytes_before
        report.replaced_bytes_after += r.replaced_bytes_after

    model = Llama(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(seed), block_hook=hook, **modes)
    report.bytes_before += _nbytes(nnx.state(model)) - _nbytes(nnx.state(model.layers))
    dense_reason = head_dense_reason(cfg, quantize_head)
    if dense_reason is not None:
        report.skipped.append(("lm_head", dense_reason))
    elif model.lm_head is None:
        model.lm_head = quantized_tied_head(model.embed, bits, codebook)
        report.replaced.append("lm_head")
        report.replaced_bytes_after += _nbytes(model.lm_head.weight)
    else:
        r = kflax.quantize_model(model, bits, codebook, filter=lambda path, _: path == ("lm_head",),
                                 progress=False)
        report.replaced += r.replaced
        report.replaced_bytes_before += r.replaced_bytes_before
        report.replaced_bytes_after += r.replaced_bytes_after
    if mesh is not None:
        place(model)
    report.bytes_after = _nbytes(nnx.state(model))
    return model, report


# -- jitted entry points over (graphdef, state) ---------------------------------------------
@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill(graphdef, state, tokens, cache):
    """Run the prompt ``tokens[B, T]`` from position 0: (last-position logits [B, V], cache)."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache, 0, last_only=True)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def decode_step(graphdef, state, token, cache, pos):
    """One token per row ``token[B]`` at position ``pos``: (logits [B, V], cache)."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(token[:, None], cache, pos)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnames=("cache",))
def decode(graphdef, state, token, cache, pos, steps: int):
    """Greedy: feed ``token[B]`` at ``pos`` and ``steps`` - 1 of its successors; returns
    (the ``steps`` next tokens [B, steps], cache). One dispatch for the whole loop."""
    model = nnx.merge(graphdef, state)

    def body(i, carry):
        token, cache, out = carry
        logits, cache = model(token[:, None], cache, pos + i)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return token, cache, out.at[:, i].set(token)

    out = jnp.zeros((token.shape[0], steps), jnp.int32)
    _, cache, out = jax.lax.fori_loop(0, steps, body, (token, cache, out))
    return out, cache


def generate(model: Llama, prompt, max_new_tokens: int, *, cache_dtype=None):
    """Greedy generation: ``prompt`` int32[B, T] -> the ``max_new_tokens`` next tokens [B, n].

    A model placed by `shard_model` runs under ``jax.set_mesh`` of its mesh with the KV cache
    placed as its attention is (``Llama.cache_sharding()``)."""
    if model.tp is None:
        return _generate(model, prompt, max_new_tokens, cache_dtype, None)
    mesh, _ = model.tp
    with jax.set_mesh(mesh):
        prompt = jax.device_put(jnp.asarray(prompt, jnp.int32), NamedSharding(mesh, P()))
        return _generate(model, prompt, max_new_tokens, cache_dtype, model.cache_sharding())


def _generate(model, prompt, max_new_tokens, cache_dtype, sharding):
    prompt = jnp.asarray(prompt, jnp.int32)
    b, t = prompt.shape
    graphdef, state = nnx.split(model)
    dtype = cache_dtype or model.embed.embedding.dtype
    cache = init_cache(model.config, b, t + max_new_tokens, dtype, sharding=sharding)
    logits, cache = prefill(graphdef, state, prompt, cache)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if max_new_tokens == 1:
        return first[:, None]
    rest, _ = decode(graphdef, state, first, cache, t, max_new_tokens - 1)
    return jnp.concatenate([first[:, None], rest], axis=1)
