"""Mixture-of-experts blocks in Flax NNX: the dense ``MoE`` and its k-bit twin ``KbitMoE``.

Both compute, per token ``x[K]``::

    p = softmax(router(x))                       # float32, one logit per expert
    w, e = top_k(p, k)                           # optionally w /= sum(w)
    y = sum_j w[j] * down[e[j]](act(x @ gate[e[j]]) * (x @ up[e[j]]))  (+ shared expert)

``MoE`` holds the stacked expert kernels as float ``nnx.Param``\\ s (``gate``/``up``
``[G, K, H]``, ``down`` ``[G, H, K]``): the float model, and the block a checkpoint is loaded
into before quantization. It reads only the chosen experts when few rows are routed
(`MOE_METHODS`, `dense_method`): "gather" gathers the ``T * k`` chosen experts' kernels
(``gate[ids]`` -> ``[T * k, K, H]``) and multiplies each row by its own with a batched einsum
("gather-reduce": as a multiply and a sum XLA can fuse with the gather); "ragged" sorts the
rows by expert for ``jax.lax.ragged_dot`` (which on GPUs reads every expert); "all" runs every
expert on every token and zero-weights the others (the reference).
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

Expert parallelism: with ``ep_axis`` set (``kbit_jax.models.decoder.shard_model`` sets it and
places the stacked experts ``P(ep_axis, None, None)``) and a mesh active (``jax.set_mesh``), both
blocks run their experts under ``shard_map``: every device routes all tokens, multiplies the rows
of its own experts (zeros for the others), sums each token's experts with its routing weights,
and one psum of the ``[T, K]`` result combines the devices. No expert weight moves. The router
and the shared expert are replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..format import BLOCK, KbitWeight
from ..moe import _axis_index_and_size, local_ragged_dot
from ..ops import interleave_glu, quantize, ragged_dot
from ..primitives.ragged_dot import local_experts_product
from ..reference import GLU_ACTIVATIONS
from ..sharding import weight_specs
from .layers import KbitLinear, QuantizedWeight, _check_quant_config
from .routing import ROUTING_METHODS, route, route_sorted, sorted_tokens

__all__ = ["KbitMoE", "MOE_METHODS", "MoE", "dense_method", "route"]

#: How the dense `MoE` multiplies the routed experts: "auto" (`dense_method`), "gather" (the
#: chosen experts' kernels gathered per row, a batched einsum), "gather-reduce" (the same
#: product written as a float32 multiply and a sum over K, which XLA can fuse with the gather
#: into one pass over the chosen kernels instead of a gathered copy and a batched matmul),
#: "ragged" (rows sorted by expert, ``jax.lax.ragged_dot``), "all" (every expert on every
#: token; the float reference).
MOE_METHODS = ("auto", "gather", "gather-reduce", "ragged", "all")


def dense_method(rows: int, num_experts: int) -> str:
    """The dense block's path for ``rows = T * k`` (token, expert) pairs over ``num_experts``:
    "gather" when ``3 * rows <= num_experts``, else "ragged".

    The gather reads each chosen expert's kernels at most 3 times per row (read, write the
    ``[rows, K, N]`` copy, read it in the einsum; XLA on a GPU fuses the gather into the
    einsum's reduction over K, which reads them once, at ~0.2-0.5 TB/s on an H200).
    ``jax.lax.ragged_dot`` on a GPU expands to a dense product over every expert: it reads all
    ``num_experts`` once (and does ``num_experts`` times the FLOPs, which only matters for large
    ``rows``). So the gather moves fewer bytes while ``3 * rows < num_experts``: at decode
    (Qwen3-Coder-Next, 512 experts, 10 per token: up to 17 tokens per step; 64 experts, 4 per
    token: up to 5)."""
    return "gather" if 3 * rows <= num_experts else "ragged"

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


def _check_routing(routing):
    if routing not in ROUTING_METHODS:
        raise ValueError(f"routing must be one of {ROUTING_METHODS}, got {routing!r}")


def _tokens(x, hidden):
    if x.shape[-1] != hidden:
        raise ValueError(f"x must have shape [..., {hidden}] (the block's hidden size), got {x.shape}")
    return x.reshape(-1, hidden)


def _ep_mesh(ep_axis):
    """The active (abstract) mesh when ``ep_axis`` names one of its axes, else None."""
    if ep_axis is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    axes = ep_axis if isinstance(ep_axis, tuple) else (ep_axis,)
    if mesh.empty or any(a not in mesh.axis_names for a in axes):
        return None
    return mesh


def _first_expert(ep_axis, local: int):
    """Global id of this device's first expert (0 without expert parallelism)."""
    if ep_axis is None:
        return 0
    index, _ = _axis_index_and_size(ep_axis)
    return index * local


def _combine(out_rows, weights):
    """``sum_j weights[t, j] * out[t, j]`` in float32 for the pairs' outputs ``[T * k, K]`` in token
    order (a multiply-reduce XLA fuses with the gather that produced them)."""
    t, k = weights.shape
    out = out_rows.reshape(t, k, -1).astype(jnp.float32)
    return jnp.sum(weights[:, :, None] * out, axis=1)


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
      method: how the routed experts are multiplied, one of `MOE_METHODS` ("auto":
        `dense_method` of ``T * top_k`` and ``num_experts``). Every path rounds the GLU's output
        and each expert's output to the computation dtype and sums in float32.
      routing: how the tokens are routed, one of ``kbit_jax.flax.routing.ROUTING_METHODS``
        ("auto": one Pallas kernel on an NVIDIA GPU at decode sizes, `routing.route_sorted`).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 norm_topk_prob: bool = True, activation: str = "silu",
                 shared_intermediate: int | None = None, dtype: Any = None,
                 param_dtype: Any = jnp.float32, method: str = "auto", routing: str = "auto",
                 rngs: nnx.Rngs):
        _check_config(hidden, intermediate, num_experts, top_k, activation, shared_intermediate)
        if method not in MOE_METHODS:
            raise ValueError(f"method must be one of {MOE_METHODS}, got {method!r}")
        _check_routing(routing)
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
        self.method, self.routing = method, routing
        self.ep_axis = None   # the mesh axis the experts are sharded over (shard_model sets it)

    def method_for(self, tokens: int) -> str:
        """The path `__call__` takes for ``tokens`` tokens (one of `MOE_METHODS` but "auto")."""
        return dense_method(tokens * self.top_k, self.num_experts) if self.method == "auto" else self.method

    def __call__(self, x):
        """``x[..., K]`` -> ``[..., K]``: each token through its top-k experts, weighted by the
        router (`method_for` says how), plus the shared expert."""
        dtype = jnp.dtype(self.dtype or x.dtype)
        tokens = _tokens(x, self.hidden).astype(dtype)
        weights, ids, *rows = route_sorted(self.router(tokens), self.top_k, self.norm_topk_prob,
                                           method=self.routing)
        method = self.method_for(tokens.shape[0])
        if method == "all":
            y = self._all_experts(tokens, weights, ids, dtype)
        else:
            mesh = _ep_mesh(self.ep_axis)
            ep = self.ep_axis if mesh is not None else None
            body = lambda tokens, weights, ids, rows, gate, up, down: self._routed(  # noqa: E731
                tokens, weights, ids, rows, gate, up, down, method, dtype, ep)
            experts = (self.gate[...], self.up[...], self.down[...])
            if ep is None:
                y = body(tokens, weights, ids, rows, *experts)
            else:
                stacked = P(ep, None, None)
                y = jax.shard_map(
                    lambda *a: jax.lax.psum(body(*a), ep), mesh=mesh,
                    in_specs=(P(), P(), P(), P(), stacked, stacked, stacked), out_specs=P(),
                    check_vma=False)(tokens, weights, ids, rows, *experts)
        if self.shared_gate is not None:
            act = GLU_ACTIVATIONS[self.activation]
            s = act(self.shared_gate(tokens).astype(jnp.float32)) * self.shared_up(tokens).astype(jnp.float32)
            y = y + self.shared_down(s.astype(dtype)).astype(jnp.float32)
        return y.astype(dtype).reshape(x.shape)

    def _routed(self, tokens, weights, ids, rows, gate, up, down, method, dtype, ep_axis):
        """The routed experts' weighted sum ``[T, K]`` (float32) over the experts in ``gate``,
        ``up``, ``down`` (this device's, from global id `_first_expert`, under expert
        parallelism: pairs routed elsewhere contribute zeros). ``rows``: (order, inverse,
        sizes) of the pairs sorted by expert (`route_sorted`; unused by the gathers)."""
        act = GLU_ACTIVATIONS[self.activation]
        local, k = gate.shape[0], self.top_k
        first = _first_expert(ep_axis, local)
        precision = jax.lax.Precision.HIGHEST
        if method in ("gather", "gather-reduce"):
            flat = ids.reshape(-1) - first
            mine = (flat >= 0) & (flat < local)
            flat = jnp.where(mine, flat, 0)
            rows = jnp.repeat(tokens, k, axis=0)                                  # [T * k, K]
            if method == "gather":
                dot = lambda x, w: jnp.einsum("rk,rkn->rn", x, w[flat], precision=precision,  # noqa: E731
                                              preferred_element_type=jnp.float32)
            else:
                dot = lambda x, w: jnp.sum(x.astype(jnp.float32)[:, :, None]  # noqa: E731
                                           * w[flat].astype(jnp.float32), axis=1)
            h = (act(dot(rows, gate)) * dot(rows, up)).astype(dtype)
            out = dot(h, down).astype(dtype)
            return _combine(out, jnp.where(mine.reshape(weights.shape), weights, 0.0))
        order, inverse, sizes = rows

        def ragged(x, w):
            kernel = lambda x_, w_, _a, _b, _c, sizes_: jax.lax.ragged_dot(  # noqa: E731
                x_, w_, sizes_, precision=precision, preferred_element_type=jnp.float32)
            return local_experts_product(kernel, x, w, None, None, None, sizes, first)

        rows = sorted_tokens(tokens, order, k)
        h = (act(ragged(rows, gate)) * ragged(rows, up)).astype(dtype)
        out = ragged(h, down).astype(dtype)                      # rows of other devices' experts: 0
        return _combine(out[inverse], weights)

    def _all_experts(self, tokens, weights, ids, dtype):
        """Every expert on every token (float32, HIGHEST), zero weight outside the top k."""
        combine = jnp.zeros((tokens.shape[0], self.num_experts), jnp.float32)
        combine = combine.at[jnp.arange(tokens.shape[0])[:, None], ids].add(weights)
        act = GLU_ACTIVATIONS[self.activation]
        t32 = tokens.astype(jnp.float32)
        precision = jax.lax.Precision.HIGHEST
        g = jnp.einsum("tk,ekh->teh", t32, self.gate[...].astype(jnp.float32), precision=precision)
        u = jnp.einsum("tk,ekh->teh", t32, self.up[...].astype(jnp.float32), precision=precision)
        h = (act(g) * u).astype(dtype).astype(jnp.float32)
        out = jnp.einsum("teh,ehk->tek", h, self.down[...].astype(jnp.float32), precision=precision)
        return jnp.einsum("te,tek->tk", combine, out.astype(dtype).astype(jnp.float32), precision=precision)


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
    own experts' rows and one all-reduce combines, no weight moves). ``routing``: how tokens are
    routed, as `MoE`'s (``from_dense`` keeps the dense block's)."""

    def __init__(self, router: nnx.Linear, gate_up: KbitWeight, down: KbitWeight, *, top_k: int,
                 norm_topk_prob: bool = True, activation: str = "silu",
                 shared_gate_up: KbitLinear | None = None, shared_down: KbitLinear | None = None,
                 dtype: Any = None, expert_sharding=None, routing: str = "auto"):
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
        _check_routing(routing)
        self.dtype, self.routing = dtype, routing
        self.ep_axis = None   # the mesh axis the experts are sharded over (shard_model sets it)

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
                   activation=moe.activation, dtype=moe.dtype, expert_sharding=expert_sharding,
                   routing=moe.routing, **shared)

    @property
    def weights(self) -> tuple[KbitWeight, KbitWeight]:
        """(gate_up, down) as KbitWeights of plain arrays."""
        return _value(self.gate_up), _value(self.down)

    def __call__(self, x):
        """``x[..., K]`` -> ``[..., K]``, in the block's dtype (x's when None)."""
        dtype = jnp.dtype(self.dtype or x.dtype)
        tokens = _tokens(x, self.hidden).astype(dtype)
        weights, _, *rows = route_sorted(self.router(tokens), self.top_k, self.norm_topk_prob,
                                         method=self.routing)
        gate_up, down = self.weights
        mesh = _ep_mesh(self.ep_axis)
        if mesh is None:
            y = self._routed(tokens, weights, rows, gate_up, down, None)
        else:
            ep, stacked = self.ep_axis, P(self.ep_axis, None, None)
            y = jax.shard_map(
                lambda *a: jax.lax.psum(self._routed(*a, ep), ep), mesh=mesh,
                in_specs=(P(), P(), P(), weight_specs(gate_up, stacked), weight_specs(down, stacked)),
                out_specs=P(), check_vma=False)(tokens, weights, rows, gate_up, down)
        if self.shared_gate_up is not None:
            s = self.shared_down(self.shared_gate_up(tokens, glu=self.activation))
            y = y + s.astype(jnp.float32)
        return y.astype(dtype).reshape(x.shape)

    def _routed(self, tokens, weights, rows, gate_up, down, ep_axis):
        """The routed experts' weighted sum ``[T, K]`` (float32). The ``T * k`` (token, expert)
        pairs are sorted by expert once; both grouped products (gate/up with the GLU in the
        kernel, then down) run on that order, reading only the experts some pair chose; the
        outputs are gathered back to token order inside the weighted sum over each token's k
        experts (one fused multiply-reduce). Under expert parallelism (``ep_axis``) the products
        cover this device's experts, zeros elsewhere (`kbit_jax.moe.local_ragged_dot`). ``rows``:
        (order, inverse, sizes) of the pairs sorted by expert (`route_sorted`)."""
        order, inverse, sizes = rows
        if ep_axis is None:
            product = ragged_dot
        else:
            product = lambda x, w, sizes, glu=None: local_ragged_dot(  # noqa: E731
                x, w, sizes, axis_name=ep_axis, glu=glu)
        h = product(sorted_tokens(tokens, order, self.top_k), gate_up, sizes, glu=self.activation)
        out = product(h, down, sizes)                                       # [T * k, K], sorted
        return _combine(out[inverse], weights)
