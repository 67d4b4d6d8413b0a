"""Mixture-of-experts in the decoder (``kbit_jax.models.decoder``): the MoE-class configs, the
dense block's paths that read only the chosen experts (gather-einsum, lax.ragged_dot) against
its every-expert reference, quantizing every expert while building, and expert parallelism
over 2, 4 and 8 simulated CPU devices with tensor-parallel or replicated attention (numerics
and greedy tokens of one device; the compiled step all-reduces twice per layer with
tensor-parallel attention, once with replicated attention, and gathers no weight)."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from kbit_jax.flax import KbitLinear
from kbit_jax.flax.moe import KbitMoE, MoE, dense_method
from kbit_jax.models import config, decoder
from kbit_jax.sharding import COLLECTIVES, all_gather_shapes, collective_counts

U32 = float(jnp.finfo(jnp.float32).eps) / 2
BF16_ULP = 2.0 ** -8          # bfloat16's unit roundoff (8 bits of significand)
CFG = decoder.CONFIGS["tiny-moe"]


def test_moe_class_configs():
    """The routed and shared expert sizes of the real models, and what fits one 141 GB GPU."""
    qcn = decoder.CONFIGS["qwen3-coder-next"]
    assert (qcn.dim, qcn.n_experts, qcn.experts_per_token, qcn.moe_hidden_dim, qcn.n_layers) == (
        2048, 512, 10, 512, 48)
    assert (qcn.shared_expert_dim, qcn.n_heads, qcn.n_kv_heads, qcn.head_dim, qcn.vocab_size) == (
        512, 16, 2, 256, 151_936)
    assert qcn.moe_layers == tuple(range(48))
    assert 78e9 < qcn.num_params() < 81e9                      # "80B"
    assert 2 * qcn.num_params() > 141e9                         # bf16 does not fit one H200
    small = decoder.CONFIGS["qwen3-coder-next-12l"]
    assert small == config.with_layers(qcn, 12) and small.moe_layers == tuple(range(12))
    assert 2 * small.num_params() < 0.4 * 141e9                 # bf16 fits with room
    glm = decoder.CONFIGS["glm-4.7-flash"]
    assert (glm.n_experts, glm.experts_per_token, glm.moe_hidden_dim, glm.shared_expert_dim) == (64, 4, 1536, 1536)
    assert glm.moe_layers == tuple(range(1, 47)) and glm.hidden_dim == 10_240   # layer 0 dense
    q30 = decoder.CONFIGS["qwen3-30b-a3b"]
    assert (q30.n_experts, q30.experts_per_token, q30.moe_hidden_dim, q30.n_kv_heads) == (128, 8, 768, 4)
    assert 29e9 < q30.num_params() < 32e9 and 2 * q30.num_params() < 141e9
    # Expert, shared-expert and dense-MLP parameters add up as the decoder builds them.
    model = nnx.eval_shape(lambda: decoder.Llama(CFG, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))
    assert n == CFG.num_params()
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        config.with_layers(qcn, 0)


def test_dense_method_rule():
    assert dense_method(10, 512) == "gather" and dense_method(170, 512) == "gather"
    assert dense_method(171, 512) == "ragged"
    assert dense_method(4, 64) == "gather" and dense_method(32, 64) == "ragged"
    moe = MoE(64, 32, 8, 2, rngs=nnx.Rngs(0))
    assert moe.method_for(1) == "gather" and moe.method_for(2) == "ragged"
    assert MoE(64, 32, 8, 2, method="all", rngs=nnx.Rngs(0)).method_for(1) == "all"
    with pytest.raises(ValueError, match="method must be one of"):
        MoE(64, 32, 8, 2, method="dense", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_paths_match_every_expert_reference(rng, dtype):
    """gather-einsum, gather-reduce and lax.ragged_dot read only the chosen experts; they round where the
    every-expert reference does (the GLU's output and each expert's output to the computation
    dtype, sums in float32), so they differ only in float32 summation order."""
    moe = MoE(64, 32, 8, 3, shared_intermediate=64, param_dtype=dtype, method="all",
              rngs=nnx.Rngs(int(rng.integers(2 ** 31))))
    x = jnp.asarray(rng.standard_normal((5, 64)), dtype)
    jitted = nnx.jit(lambda m, x: m(x))
    # Eager against eager, jit against jit: under jit XLA may keep excess precision where the
    # code rounds to bf16 (the router's logits too, which can change a near-tie's routing).
    refs = {"eager": np.asarray(moe(x), np.float64), "jit": np.asarray(jitted(moe, x), np.float64)}
    for method in ("gather", "gather-reduce", "ragged"):
        moe.method = method
        for mode, ref in refs.items():
            y = np.asarray(moe(x) if mode == "eager" else jitted(moe, x), np.float64)
            scale = np.abs(ref).max()
            if dtype == jnp.float32:
                # K = 64 (and H = 32) products summed in another order: within 64 u32 of the
                # magnitudes, the result under twice that after the GLU and down product.
                np.testing.assert_allclose(y, ref, rtol=0, atol=4 * 64 * U32 * scale)
            else:
                # A float32 sum that differs in its last bits can round h or an expert's output
                # to the neighbouring bf16 value (1 ulp); the final bf16 rounding adds another.
                np.testing.assert_allclose(y, ref, rtol=0, atol=4 * BF16_ULP * scale)


def test_build_quantizes_every_expert(rng):
    cfg = CFG
    model, report = decoder.build_model(cfg, bits=4, param_dtype=jnp.float32)
    for i, layer in enumerate(model.layers):
        if i in cfg.moe_layers:
            assert isinstance(layer.mlp, KbitMoE), i
            gate_up, down = layer.mlp.weights
            assert gate_up.shape == (cfg.n_experts, cfg.dim, 2 * cfg.moe_hidden_dim)
            assert down.shape == (cfg.n_experts, cfg.moe_hidden_dim, cfg.dim)
            assert isinstance(layer.mlp.shared_gate_up, KbitLinear)
            assert isinstance(layer.mlp.shared_down, KbitLinear)
            assert f"layers/{i}/mlp" in report.replaced
        else:
            assert isinstance(layer.mlp.gate_up_proj, KbitLinear)
    # The same random weights as the dense build: quantized block == from_dense of the dense one.
    dense, _ = decoder.build_model(cfg, param_dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, cfg.dim)), jnp.float32)
    layer = cfg.moe_layers[0]
    np.testing.assert_array_equal(np.asarray(model.layers[layer].mlp(x)),
                                  np.asarray(KbitMoE.from_dense(dense.layers[layer].mlp)(x)))


PROMPT = np.random.default_rng(2).integers(0, 256, (2, 6)).astype(np.int32)


def _logits(model, mesh, tokens, pos_tokens=None):
    """Prefill logits of ``tokens`` [B, T], then one decode step's logits of ``pos_tokens``."""
    graphdef, state = nnx.split(model)
    b, t = tokens.shape
    sharding = model.cache_sharding()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        cache = decoder.init_cache(CFG, b, t + 2, jnp.float32, sharding=sharding)
        logits, cache = decoder.prefill(graphdef, state, jnp.asarray(tokens), cache)
        step, _ = decoder.decode_step(graphdef, state, jnp.asarray(tokens[:, 0]), cache, t)
    return np.asarray(logits, np.float64), np.asarray(step, np.float64)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("bits, attention_parallel", [
    pytest.param(None, "tensor", id="dense-tensor"), pytest.param(4, "tensor", id="k4-tensor"),
    pytest.param(4, "replicated", id="k4-replicated")])
def test_expert_parallel_equals_one_device(bits, attention_parallel):
    """Experts over 8 devices (1 each), attention over 8 kv-head shards or replicated: prefill
    (6 tokens: the dense block's ragged path) and a decode step (1 token: its gather path) give
    the one-device logits. Float32
    activations: expert parallelism changes only the order of float32 sums (a device's partial
    sum of its experts, then the psum), and routing is the same away from exact ties."""
    one, _ = decoder.build_model(CFG, bits=bits, param_dtype=jnp.float32)
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
    ep, _ = decoder.build_model(CFG, bits=bits, param_dtype=jnp.float32, mesh=mesh,
                                attention_parallel=attention_parallel)
    assert ep.attention_parallel == attention_parallel
    mlp = ep.layers[CFG.moe_layers[0]].mlp
    assert mlp.ep_axis == "tp"
    leaf = mlp.gate if bits is None else mlp.gate_up.planes
    assert tuple(leaf.get_value().sharding.spec)[:3] == ("tp", None, None)
    assert leaf.get_value().addressable_shards[0].data.shape[0] == 1          # one expert each
    prompt = PROMPT[:1]
    for a, b in zip(_logits(one, None, prompt), _logits(ep, mesh, prompt)):
        # Each layer's float32 sums of at most 256 terms reassociated; three layers, a final
        # norm and the head carry it to the logits as a few hundred ulps of their magnitude.
        np.testing.assert_allclose(b, a, rtol=0, atol=1e3 * U32 * np.abs(a).max())


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("bits", [pytest.param(None, id="bf16"), pytest.param(4, id="k4")])
def test_expert_parallel_step_moves_no_weight(bits):
    """The compiled decode step over 8 devices with tensor-parallel attention: two all-reduces
    per layer (o_proj's, and the MLP's: down_proj in the dense layer, the experts' psum in a MoE
    layer), no all-gather."""
    mesh = jax.make_mesh((8,), ("tp",))
    model, _ = decoder.build_model(CFG, bits=bits, mesh=mesh, attention_parallel="tensor")
    graphdef, state = nnx.split(model)
    for batch in (1, 4):       # bf16: the gather path, then lax.ragged_dot
        with jax.set_mesh(mesh):
            cache = decoder.init_cache(CFG, batch, 16, sharding=decoder.cache_sharding(mesh))
            token = jax.device_put(jnp.zeros((batch,), jnp.int32), NamedSharding(mesh, P()))
            text = decoder.decode_step.lower(graphdef, state, token, cache, 8).compile().as_text()
        assert collective_counts(text) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 2 * CFG.n_layers}
        assert all_gather_shapes(text) == []
    assert decoder.moe_path(CFG, bits, 1, 8) == ("ep gather-einsum" if bits is None else "ep kbit ragged_dot")
    assert decoder.moe_path(CFG, None, 4, 1) == "lax.ragged_dot"
    assert decoder.moe_path(decoder.TINY, None, 1) is None


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_expert_parallel_needs_whole_experts():
    mesh = jax.make_mesh((8,), ("tp",))
    cfg = config.DecoderConfig(**{**CFG.to_dict(), "n_experts": 4, "experts_per_token": 2})
    with pytest.raises(ValueError, match=r"n_experts=4"):
        decoder.build_model(cfg, mesh=mesh)
    block = MoE(64, 32, 4, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_experts divisible by 8; got 4"):
        decoder.shard_model(block, mesh)


def _all_reduce_sizes(text):
    """The element count of each all-reduce's result in compiled HLO."""
    shapes = re.findall(r"=\s*\w+\[([\d,]*)\]\S*\s+all-reduce(?:-start)?\(", text)
    return [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]


_ONE_DEVICE_TOKENS = {}


def _one_device_tokens(bits):
    """The one-device model's greedy continuation of PROMPT (5 tokens), computed once per bits."""
    if bits not in _ONE_DEVICE_TOKENS:
        one, _ = decoder.build_model(CFG, bits=bits, param_dtype=jnp.float32)
        _ONE_DEVICE_TOKENS[bits] = np.asarray(decoder.generate(one, PROMPT, 5))
    return _ONE_DEVICE_TOKENS[bits]


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("ep, bits, attention_parallel", [
    pytest.param(2, None, "auto", id="ep2-dense-auto"), pytest.param(2, 4, "replicated", id="ep2-k4-replicated"),
    pytest.param(4, None, "replicated", id="ep4-dense-replicated"), pytest.param(4, 4, "auto", id="ep4-k4-auto"),
    pytest.param(2, 4, "tensor", id="ep2-k4-tensor"), pytest.param(4, 4, "tensor", id="ep4-k4-tensor")])
def test_expert_parallel_decode_collectives_and_tokens(ep, bits, attention_parallel):
    """Experts over 2 and 4 devices. Replicated attention ("auto" in a model with MoE layers):
    q/k/v/o and the KV cache whole on every device, no collective in attention, so the compiled
    decode step has one all-reduce per layer (the experts' combine in a MoE layer, down_proj's
    in the dense layer), each of a [batch, dim] activation; tensor-parallel attention adds
    o_proj's (two per layer). No all-gather in the step; the greedy loop adds only the argmax's
    two [batch, ep] all-gathers over the vocabulary-sharded logits (lm_head stays
    column-parallel). The greedy tokens are the one-device model's (float32 weights)."""
    mesh = jax.make_mesh((ep,), ("tp",), devices=jax.devices()[:ep])
    model, _ = decoder.build_model(CFG, bits=bits, param_dtype=jnp.float32, mesh=mesh,
                                   attention_parallel=attention_parallel)
    placement = "tensor" if attention_parallel == "tensor" else "replicated"
    assert model.attention_parallel == placement
    for layer in model.layers:
        assert layer.attn.tp_axis == (None if placement == "replicated" else "tp")
        attn_leaves = jax.tree.leaves(nnx.state(layer.attn))
        assert all(x.sharding.is_fully_replicated for x in attn_leaves) == (placement == "replicated")
    assert model.cache_sharding().is_fully_replicated == (placement == "replicated")
    for i in CFG.moe_layers:      # routers and shared experts replicated under either placement
        mlp = model.layers[i].mlp
        names = ["router", "shared_gate", "shared_up", "shared_down", "shared_gate_up"]
        parts = [getattr(mlp, n) for n in names if getattr(mlp, n, None) is not None]
        assert len(parts) == (3 if bits is not None else 4)
        for part in parts:
            assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(part)))
    graphdef, state = nnx.split(model)
    batch = 4
    with jax.set_mesh(mesh):
        cache = decoder.init_cache(CFG, batch, 16, jnp.float32, sharding=model.cache_sharding())
        token = jax.device_put(jnp.zeros((batch,), jnp.int32), NamedSharding(mesh, P()))
        step = decoder.decode_step.lower(graphdef, state, token, cache, 8).compile().as_text()
        loop = decoder.decode.lower(graphdef, state, token, cache, 8, 4).compile().as_text()
    per_layer = 1 if placement == "replicated" else 2
    none = dict.fromkeys(COLLECTIVES, 0)
    assert collective_counts(step) == {**none, "all-reduce": per_layer * CFG.n_layers}
    assert _all_reduce_sizes(step) == [batch * CFG.dim] * (per_layer * CFG.n_layers)
    assert collective_counts(loop) == {**none, "all-reduce": per_layer * CFG.n_layers, "all-gather": 2}
    assert sorted(all_gather_shapes(loop)) == [f"f32[{batch},{ep}]", f"s32[{batch},{ep}]"]
    np.testing.assert_array_equal(np.asarray(decoder.generate(model, PROMPT, 5)), _one_device_tokens(bits))


def _draw_qk_norm_scales(model, seed):
    """Every layer's q/k RMSNorm scales drawn from ``seed`` (placed as the ones they replace),
    so that a scale not applied shows."""
    draw = np.random.default_rng(seed)
    for layer in model.layers:
        for norm in (layer.attn.q_norm, layer.attn.k_norm):
            scale = jnp.asarray(draw.uniform(0.5, 2.0, CFG.head_dim), jnp.float32)
            norm.scale.set_value(jax.device_put(scale, norm.scale.get_value().sharding))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (simulated) devices")
def test_replicated_attention_pallas_kernels(rng):
    """The Pallas attention, norm and routing kernels (interpreted on the CPU) under replicated
    attention and expert parallelism run whole on every device (shard_maps over replicated
    operands, the q/k norm scales included): still one all-reduce per layer and no all-gather,
    and (float32, random q/k norm scales) the prefill and decode-step logits of one device with
    XLA's attention and the comparison routing, as in `test_expert_parallel_equals_one_device`."""
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    ep, _ = decoder.build_model(CFG, bits=4, param_dtype=jnp.float32, mesh=mesh, attention="pallas",
                                norm="pallas", moe_routing="kernel")
    assert all(ep.layers[i].mlp.routing == "kernel" for i in CFG.moe_layers)
    one, _ = decoder.build_model(CFG, bits=4, param_dtype=jnp.float32, attention="xla", norm="xla")
    seed = int(rng.integers(1 << 31))
    for model in (one, ep):
        _draw_qk_norm_scales(model, seed)
    graphdef, state = nnx.split(ep)
    with jax.set_mesh(mesh):
        cache = decoder.init_cache(CFG, 2, 16, jnp.float32, sharding=ep.cache_sharding())
        token = jax.device_put(jnp.zeros((2,), jnp.int32), NamedSharding(mesh, P()))
        step = decoder.decode_step.lower(graphdef, state, token, cache, 8).compile().as_text()
    assert collective_counts(step) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": CFG.n_layers}
    for a, b in zip(_logits(one, None, PROMPT[:1]), _logits(ep, mesh, PROMPT[:1])):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e3 * U32 * np.abs(a).max())


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
def test_attention_parallel_choices_and_errors():
    """"auto": replicated with MoE layers, tensor-parallel in a dense model. Attention with fewer
    kv heads than devices (Qwen3-Coder-Next: 2 over 4) splits only when replicated. Bad values
    and a cache placed for the other attention name the argument."""
    assert decoder.attention_placement(CFG) == "replicated"
    assert decoder.attention_placement(decoder.TINY) == "tensor"
    assert decoder.attention_placement(CFG, "tensor") == "tensor"
    qcn = decoder.CONFIGS["qwen3-coder-next"]
    decoder.check_tp(qcn, 4)
    with pytest.raises(ValueError, match=r"n_heads, n_kv_heads and n_experts divisible by 4; got n_kv_heads=2"):
        decoder.check_tp(qcn, 4, "tensor")
    mesh4 = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    few_heads = config.DecoderConfig(**{**CFG.to_dict(), "n_heads": 2, "n_kv_heads": 2})
    model, _ = decoder.build_model(few_heads, bits=4, mesh=mesh4)
    assert model.attention_parallel == "replicated"
    with pytest.raises(ValueError, match=r"got n_heads=2, n_kv_heads=2"):
        decoder.build_model(few_heads, mesh=mesh4, attention_parallel="tensor")
    for bad in ("data", None, "Replicated"):
        with pytest.raises(ValueError, match=r"attention_parallel=.*expected one of \('auto', 'tensor', 'replicated'\)"):
            decoder.build_model(CFG, mesh=mesh4, attention_parallel=bad)
        with pytest.raises(ValueError, match=r"attention_parallel="):
            decoder.shard_model(MoE(64, 32, 8, 2, rngs=nnx.Rngs(0)), mesh4, attention_parallel=bad)
    with pytest.raises(ValueError, match=r"attention_parallel='auto'"):
        decoder.cache_sharding(mesh4, attention_parallel="auto")   # no config to resolve it by
    # A cache sharded over kv heads (tensor-parallel attention's) given to replicated attention.
    explicit = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    model, _ = decoder.build_model(CFG, bits=4, mesh=explicit)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(explicit):
        cache = decoder.init_cache(CFG, 1, 16, sharding=decoder.cache_sharding(explicit))
        token = jax.device_put(jnp.zeros((1,), jnp.int32), NamedSharding(explicit, P()))
        with pytest.raises(ValueError, match=r"cache: kv heads sharded over 'tp', but this model's "
                                             r"attention is replicated; make the cache with "
                                             r"init_cache\(\.\.\., sharding=model.cache_sharding\(\)\)"):
            decoder.decode_step(graphdef, state, token, cache, 0)
    # and a replicated cache given to tensor-parallel attention
    model, _ = decoder.build_model(CFG, bits=4, mesh=explicit, attention_parallel="tensor")
    graphdef, state = nnx.split(model)
    with jax.set_mesh(explicit):
        cache = decoder.init_cache(CFG, 1, 16, sharding=NamedSharding(explicit, P()))
        with pytest.raises(ValueError, match=r"cache: kv heads whole, but this model's attention is "
                                             r"tensor-parallel over 'tp'"):
            decoder.decode_step(graphdef, state, token, cache, 0)
