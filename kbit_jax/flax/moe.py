"""Mixture-of-experts blocks in Flax NNX: the dense ``MoE`` and its k-bit twin ``KbitMoE``.

Both compute, per token ``x[K]``::

    p = softmax(router(x))                       # float32, one logit per expert
    w, e = top_k(p, k)                           # optionally w /= sum(w)
    y = sum_j w[j] * down[e[j]](act(x @ gate[e[j]]) * (x @ up[e[j]]))  (+ shared expert)

``MoE`` holds the stacked expert kernels as float ``nnx.Param``\\ s (``gate``/``up``
``[G, K, H]``, ``down`` ``[G, H, K]``) and evaluates every expert on every token: the float
reference, and the block a checkpoint is loaded into before quantization.
``KbitMoE.from_dense`` (or ``kbit_jax.flax.quantize_model``) turns it into ``KbitMoE``: gate
and up interleaved into one ``KbitWeight`` ``[G, K, 2H]`` (``kbit_jax.interleave_glu``),
``down`` a ``KbitWeight`` ``[G, H, K]``, the router kept dense. ``KbitMoE`` sorts the
``T * k`` (token, expert) pairs by expert once and runs two grouped products
(`kbit_jax.ragged_dot`: gate/up with the GLU in the kernel, then down), reading only the
experts some token chose, then puts rows back in token order and combines.

State layout of ``KbitMoE`` (``nnx.state``): ``router/kernel`` (Param), ``gate_up/{planes,
scales,codebook,tensor_scale}`` and ``down/...`` (`QuantizedWeight`), and with a shared expert
``shared_gate_up`` / ``shared_down`` (`KbitLinear`). Orbax round trips go through
`kbit_jax.flax.save_checkpoint` / `restore_checkpoint` like any NNX module.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..format import BLOCK, KbitWeight
from ..ops import interleave_glu, quantize, ragged_dot
from ..reference import GLU_ACTIVATIONS
from .layers import KbitLinear, QuantizedWeight, _check_quant_config

__all__ = ["KbitMoE", "MoE", "route"]

_LEAVES = ("planes", "scales", "codebook", "tensor_scale")


def _check_config(hidden, intermediate, num_experts, top_k, activation, shared_intermediate):
    for name, value in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts),
                        ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k must be at most num_experts={num_experts}, got {top_k}")
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(GLU_ACTIVATIONS)}, got {activation!r}")
    if shared_intermediate is not None and (not isinstance(shared_intermediate, int) or shared_intermediate <= 0):
        raise ValueError(f"shared_intermediate must be None or a positive int, got {shared_intermediate!r}")


def route(logits, top_k: int, normalize: bool):
    """(weights float32[T, k], expert ids int32[T, k]): the softmax over the experts' logits, its
    ``top_k`` largest entries, renormalized to sum to 1 when ``normalize``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def _tokens(x, hidden):
    if x.shape[-1] != hidden:
        raise ValueError(f"x must have shape [..., {hidden}] (the block's hidden size), got {x.shape}")
    return x.reshape(-1, hidden)


class MoE(nnx.Module):
    """A dense (float) mixture-of-experts block: router, ``num_experts`` gated-MLP experts
    stacked in ``gate``/``up`` ``[G, K, H]`` and ``down`` ``[G, H, K]``, top-k routing, and an
    optional shared expert (a gated MLP every token goes through: ``shared_gate``,
    ``shared_up``, ``shared_down`` ``nnx.Linear``\\ s).

    Args:
      hidden: K, the model width. intermediate: H, each expert's hidden width.
      num_experts: G. top_k: experts per token.
      norm_topk_prob: renormalize the top-k weights to sum to 1 (Qwen3-MoE does).
      activation: the GLU's gate, "silu" (SwiGLU) or "gelu_tanh".
      shared_intermediate: the shared expert's hidden width, None for none.
      dtype: computation dtype (None: x's). param_dtype: the kernels' dtype.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, activation: str = "silu",
                 shared_intermediate: int | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        _check_config(hidden, intermediate, num_experts, top_k, activation, shared_intermediate)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(hidden, num_experts, use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.gate = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), param_dtype))
        self.up = nnx.Param(init(rngs.params(), (num_experts, hidden, intermediate), param_dtype))
        self.down = nnx.Param(init(rngs.params(), (num_experts, intermediate, hidden), param_dtype))
        if shared_intermediate:
            linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype,  # noqa: E731
                                             param_dtype=param_dtype, rngs=rngs)
            self.shared_gate = linear(hidden, shared_intermediate)
            self.shared_up = linear(hidden, shared_intermediate)
            self.shared_down = linear(shared_intermediate, hidden)
        else:
            self.shared_gate = self.shared_up = self.shared_down = nnx.data(None)
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob, self.activation = norm_topk_prob, activation
        self.shared_intermediate = shared_intermediate
        self.dtype, self.param_dtype = dtype, param_dtype

    def __call__(self, x):
        """``x[..., K]`` -> ``[..., K]``: every expert on every token, weighted by the router
        (zero weight for experts outside a token's top k)."""
        dtype = jnp.dtype(self.dtype or x.dtype)
        tokens = _tokens(x, self.hidden).astype(dtype)
        weights, ids = route(self.router(tokens), self.top_k, self.norm_topk_prob)
        combine = jnp.zeros((tokens.shape[0], self.num_experts), jnp.float32)
        combine = combine.at[jnp.arange(tokens.shape[0])[:, None], ids].add(weights)
        act = GLU_ACTIVATIONS[self.activation]
        t32 = tokens.astype(jnp.float32)
        precision = jax.lax.Precision.HIGHEST
        g = jnp.einsum("tk,ekh->teh", t32, self.gate[...].astype(jnp.float32), precision=precision)
        u = jnp.einsum("tk,ekh->teh", t32, self.up[...].astype(jnp.float32), precision=precision)
        h = (act(g) * u).astype(dtype).astype(jnp.float32)
        out = jnp.einsum("teh,ehk->tek", h, self.down[...].astype(jnp.float32), precision=precision)
        y = jnp.einsum("te,tek->tk", combine, out.astype(dtype).astype(jnp.float32), precision=precision)
        if self.shared_gate is not None:
            s = act(self.shared_gate(tokens).astype(jnp.float32)) * self.shared_up(tokens).astype(jnp.float32)
            y = y + self.shared_down(s.astype(dtype)).astype(jnp.float32)
        return y.astype(dtype).reshape(x.shape)


def _variables(weight: KbitWeight, names) -> KbitWeight:
    """A KbitWeight of QuantizedWeight variables (with logical axis names when given)."""
    leaves = {}
    for leaf in _LEAVES:
        meta = {}
        if names is not None:
            g, k, n = names
            meta["out_sharding"] = {"planes": (g, k, n, None), "scales": (g, k, n),
                                    "codebook": (g, None), "tensor_scale": (g,)}[leaf]
        leaves[leaf] = QuantizedWeight(getattr(weight, leaf), **meta)
    return nnx.data(KbitWeight(**leaves, layout=weight.layout))


def _value(weight: KbitWeight) -> KbitWeight:
    return jax.tree.map(lambda v: v.get_value(), weight, is_leaf=lambda v: isinstance(v, nnx.Variable))


class KbitMoE(nnx.Module):
    """A mixture-of-experts block with k-bit experts (`kbit_jax.ragged_dot`); see the module
    docstring. Build it with `KbitMoE.from_dense` (or `kbit_jax.flax.quantize_model` on a model
    holding `MoE` blocks), or from quantized stacks with the constructor.

    ``expert_sharding`` (constructor and ``from_dense``): logical axis names of the stacked
    ``(G, K, N)`` expert weights, put on the quantized leaves as ``out_sharding`` (e.g.
    ``("expert", None, None)`` for expert parallelism under ``jit``: each device multiplies its
    own experts' rows and one all-reduce combines, no weight moves)."""

    def __init__(self, router: nnx.Linear, gate_up: KbitWeight, down: KbitWeight, *, top_k: int,
                 norm_topk_prob: bool = True, activation: str = "silu",
                 shared_gate_up: KbitLinear | None = None, shared_down: KbitLinear | None = None,
                 dtype: Any = None, expert_sharding=None):
        if not isinstance(router, nnx.Linear):
            raise TypeError(f"router must be an nnx.Linear, got {type(router).__name__}")
        for name, w in (("gate_up", gate_up), ("down", down)):
            if not isinstance(w, KbitWeight) or len(w.batch_shape) != 1:
                raise ValueError(f"{name} must be a KbitWeight stacked over the experts [G, K, N], got "
                                 f"{getattr(w, 'shape', type(w).__name__)}")
        g, hidden, two_h = gate_up.shape
        if down.shape != (g, two_h // 2, hidden) or two_h % 2:
            raise ValueError(f"down must have shape [G, H, K] = {[g, two_h // 2, hidden]} for gate_up "
                             f"[G, K, 2H] = {list(gate_up.shape)}, got {list(down.shape)}")
        if router.kernel.shape != (hidden, g):
            raise ValueError(f"router.kernel must have shape [K, G] = {[hidden, g]}, got {router.kernel.shape}")
        _check_config(hidden, two_h // 2, g, top_k, activation, None)
        if (shared_gate_up is None) != (shared_down is None):
            raise ValueError("shared_gate_up and shared_down come together (a shared expert) or not at all")
        self.router = router
        self.gate_up = _variables(gate_up, expert_sharding)
        self.down = _variables(down, expert_sharding)
        self.shared_gate_up = shared_gate_up if shared_gate_up is not None else nnx.data(None)
        self.shared_down = shared_down if shared_down is not None else nnx.data(None)
        self.hidden, self.intermediate, self.num_experts = hidden, two_h // 2, g
        self.top_k, self.norm_topk_prob, self.activation = top_k, norm_topk_prob, activation
        self.dtype = dtype

    @classmethod
    def from_dense(cls, moe: MoE, bits: int = 4, codebook: Any = "nf", *,
                   expert_sharding=None) -> "KbitMoE":
        """Quantize a dense `MoE`: gate and up interleaved (`kbit_jax.interleave_glu`) into one
        ``[G, K, 2H]`` stack, down ``[G, H, K]``, the shared expert's gate/up and down as
        `KbitLinear`\\ s; the router is copied dense (its logits pick the experts). K and H
        must be multiples of 32."""
        if not isinstance(moe, MoE):
            raise TypeError(f"moe must be a kbit_jax.flax.moe.MoE, got {type(moe).__name__}")
        bits = _check_quant_config(bits, codebook)
        for name, size in (("hidden", moe.hidden), ("intermediate", moe.intermediate)):
            if size % BLOCK:
                raise ValueError(f"cannot quantize the experts: {name}={size} is not a multiple of {BLOCK}")
        gate_up = quantize(interleave_glu(moe.gate[...], moe.up[...]), bits, codebook)
        down = quantize(moe.down[...], bits, codebook)
        router = nnx.clone(moe.router)
        shared = {}
        if moe.shared_gate is not None:
            glu_kernel = interleave_glu(moe.shared_gate.kernel[...], moe.shared_up.kernel[...])
            shared = dict(
                shared_gate_up=KbitLinear.from_weight(quantize(glu_kernel, bits, codebook),
                                                      dtype=moe.dtype, param_dtype=moe.param_dtype),
                shared_down=KbitLinear.from_linear(moe.shared_down, bits, codebook))
        return cls(router, gate_up, down, top_k=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
                   activation=moe.activation, dtype=moe.dtype, expert_sharding=expert_sharding, **shared)

    @property
    def weights(self) -> tuple[KbitWeight, KbitWeight]:
        """(gate_up, down) as KbitWeights of plain arrays."""
        return _value(self.gate_up), _value(self.down)

    def __call__(self, x):
        """``x[..., K]`` -> ``[..., K]``, in the block's dtype (x's when None)."""
        dtype = jnp.dtype(self.dtype or x.dtype)
        tokens = _tokens(x, self.hidden).astype(dtype)
        t = tokens.shape[0]
        weights, ids = route(self.router(tokens), self.top_k, self.norm_topk_prob)
        # Sort the (token, expert) pairs by expert once; both products use that order.
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros((self.num_experts,), jnp.int32).at[flat].add(1)
        gate_up, down = self.weights
        h = ragged_dot(tokens[order // self.top_k], gate_up, sizes, glu=self.activation)
        out = ragged_dot(h, down, sizes)                                     # [T * k, K], sorted
        out = jnp.zeros_like(out).at[order].set(out).reshape(t, self.top_k, self.hidden)
        y = jnp.einsum("tj,tjk->tk", weights, out.astype(jnp.float32))
        if self.shared_gate_up is not None:
            s = self.shared_down(self.shared_gate_up(tokens, glu=self.activation))
            y = y + s.astype(jnp.float32)
        return y.astype(dtype).reshape(x.shape)
