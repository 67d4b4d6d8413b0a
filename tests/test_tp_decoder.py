"""The decoder (``kbit_jax.models.decoder``) under tensor parallelism (simulated CPU devices,
see conftest.py).

Megatron layout from ``decoder.shard_model``: q/k/v, gate/up column-parallel, o/down row-parallel,
lm_head over the vocabulary, embedding and norms replicated, KV cache over kv heads. Checked:
greedy generation equals the single-device model's (same tokens, logits within rounding) for
the quantized and the bf16 model on Explicit and Auto meshes; every weight leaf stays sharded;
the compiled decode step has exactly two all-reduces per layer (one after o_proj, one after
down_proj) and no other collective, so no weight is ever all-gathered; the greedy loop adds
only the two [batch, tp] all-gathers of the argmax over the sharded vocabulary.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kbit_jax.nn as knn
from kbit_jax.models import decoder
from kbit_jax.sharding import COLLECTIVES, all_gather_shapes, collective_counts as collectives

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4,
    reason="needs 4 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8")

AXIS_TYPES = [pytest.param(AxisType.Explicit, id="explicit"), pytest.param(AxisType.Auto, id="auto")]
PROMPT = np.random.default_rng(1).integers(0, 256, (2, 8)).astype(np.int32)
NEW = 6


def tp_mesh(tp, axis_type):
    return jax.make_mesh((tp,), ("tp",), axis_types=(axis_type,), devices=jax.devices()[:tp])


def prefill_logits(model, cfg, dtype, mesh=None):
    graphdef, state = nnx.split(model)
    sharding = None if mesh is None else decoder.cache_sharding(mesh)
    cache = decoder.init_cache(cfg, PROMPT.shape[0], PROMPT.shape[1] + NEW, dtype, sharding=sharding)
    if mesh is None:
        logits, _ = decoder.prefill(graphdef, state, jnp.asarray(PROMPT), cache)
    else:
        with jax.set_mesh(mesh):
            logits, _ = decoder.prefill(graphdef, state, jnp.asarray(PROMPT), cache)
    return np.asarray(logits, np.float32)


_REFERENCE = {}


def reference(cfg, bits, dtype):
    """Single-device (tokens, prefill logits), computed once per (cfg, bits, dtype)."""
    key = (cfg, bits, jnp.dtype(dtype).name)
    if key not in _REFERENCE:
        model, _ = decoder.build_model(cfg, bits=bits, param_dtype=dtype)
        _REFERENCE[key] = (np.asarray(decoder.generate(model, PROMPT, NEW)),
                           prefill_logits(model, cfg, dtype))
    return _REFERENCE[key]


def assert_weights_sharded(model, tp):
    """Every projection's leaves hold 1/tp of the weight on each device (never replicated)."""
    for path, module in nnx.iter_modules(model):
        if not path or path[-1] not in decoder.TP_LAYOUT:
            continue
        if isinstance(module, knn.KbitLinear):
            w = module.weight
            kdim = 0 if decoder.TP_LAYOUT[path[-1]] == "row" else 1     # in planes [K/32, N, bits]
            for leaf in (w.planes, w.scales):
                shard = leaf.addressable_shards[0].data.shape
                assert shard[kdim] * tp == leaf.shape[kdim], (path, leaf.shape, shard)
                assert len(leaf.sharding.device_set) == tp
        else:
            kernel = module.kernel.get_value()
            kdim = 0 if decoder.TP_LAYOUT[path[-1]] == "row" else 1
            assert kernel.addressable_shards[0].data.shape[kdim] * tp == kernel.shape[kdim], path


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_quantized_tp2_generation_equals_single_device(axis_type):
    cfg, dtype = decoder.TINY, jnp.float32   # f32 activations: TP changes only summation order
    ref_tokens, ref_logits = reference(cfg, 4, dtype)
    mesh = tp_mesh(2, axis_type)
    model, report = decoder.build_model(cfg, bits=4, param_dtype=dtype, mesh=mesh)
    assert len(report.replaced) == 4 * cfg.n_layers + 1      # the blocks' layers and lm_head
    assert model.tp == (mesh, "tp")
    assert_weights_sharded(model, 2)

    np.testing.assert_array_equal(np.asarray(decoder.generate(model, PROMPT, NEW)), ref_tokens)
    logits = prefill_logits(model, cfg, dtype, mesh)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-5 * np.abs(ref_logits).max())


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_bf16_tp2_generation_equals_single_device(axis_type):
    cfg = decoder.TINY
    mesh = tp_mesh(2, axis_type)
    # float32 weights: the same tokens.
    ref_tokens, ref_logits = reference(cfg, None, jnp.float32)
    model, report = decoder.build_model(cfg, param_dtype=jnp.float32, mesh=mesh)
    assert report is None
    assert_weights_sharded(model, 2)
    np.testing.assert_array_equal(np.asarray(decoder.generate(model, PROMPT, NEW)), ref_tokens)
    np.testing.assert_allclose(prefill_logits(model, cfg, jnp.float32, mesh), ref_logits, rtol=0,
                               atol=1e-5 * np.abs(ref_logits).max())
    # bfloat16 weights and activations: the row-parallel partial sums are rounded to bf16
    # before the all-reduce, so logits agree to a few bf16 ulps (near-ties may flip a token).
    ref16 = prefill_logits(decoder.build_model(cfg)[0], cfg, jnp.bfloat16)
    tp16 = prefill_logits(decoder.build_model(cfg, mesh=mesh)[0], cfg, jnp.bfloat16, mesh)
    np.testing.assert_allclose(tp16, ref16, rtol=0, atol=0.03 * np.abs(ref16).max())


def test_quantized_tp4_and_shard_model_after_build():
    """tp=4 (TINY_TP: 4 kv heads, o_proj K/4 = 64 = 2 blocks); shard_model on a built model."""
    cfg, dtype = decoder.TINY_TP, jnp.float32
    ref_tokens, ref_logits = reference(cfg, 4, dtype)
    mesh = tp_mesh(4, AxisType.Explicit)
    model, _ = decoder.build_model(cfg, bits=4, param_dtype=dtype)
    assert decoder.shard_model(model, mesh) is model
    assert_weights_sharded(model, 4)
    # The placement is recorded as out_sharding metadata (nnx.get_partition_spec).
    specs = nnx.get_partition_spec(nnx.state(model))
    attn = specs["layers"][0]["attn"]
    assert attn["qkv_proj"]["kernel"]["planes"].get_value() == P(None, "tp", None)
    assert attn["o_proj"]["kernel"]["scales"].get_value() == P("tp", None)
    assert attn["o_proj"]["kernel"]["codebook"].get_value() == P(None)
    assert specs["lm_head"]["kernel"]["planes"].get_value() == P(None, "tp", None)
    assert model.embed.embedding.get_value().sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(decoder.generate(model, PROMPT, NEW)), ref_tokens)
    np.testing.assert_allclose(prefill_logits(model, cfg, dtype, mesh), ref_logits, rtol=0,
                               atol=1e-5 * np.abs(ref_logits).max())


@pytest.mark.parametrize("attention", ["xla", "pallas"])
@pytest.mark.parametrize("bits", [pytest.param(4, id="k4"), pytest.param(None, id="bf16")])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_decode_hlo_collectives(bits, axis_type, attention):
    """decode_step: 2 all-reduces per layer and nothing else (column-parallel q/k/v, gate/up
    and lm_head need none; row-parallel o_proj and down_proj one each; the attention runs on
    each device's own heads and KV-cache shard, also the Pallas kernels under their shard_maps:
    attention="pallas" runs the norms' kernel too).
    No all-gather: weights never move. (TINY_TP: the kernel takes head_dim >= 32.)"""
    cfg, tp = decoder.TINY_TP, 2
    mesh = tp_mesh(tp, axis_type)
    model, _ = decoder.build_model(cfg, bits=bits, mesh=mesh, attention=attention, norm=attention)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        cache = decoder.init_cache(cfg, 2, 16, sharding=decoder.cache_sharding(mesh))
        token = jax.device_put(jnp.zeros((2,), jnp.int32), NamedSharding(mesh, P()))
        step = decoder.decode_step.lower(graphdef, state, token, cache, 8).compile().as_text()
        loop = decoder.decode.lower(graphdef, state, token, cache, 8, 4).compile().as_text()
    expected = dict.fromkeys(COLLECTIVES, 0)
    assert collectives(step) == {**expected, "all-reduce": 2 * cfg.n_layers}
    # The greedy loop adds the argmax over the vocabulary-sharded logits: each device's best
    # (value, index), gathered as two [batch, tp] arrays. Nothing of a weight's size.
    assert collectives(loop) == {**expected, "all-reduce": 2 * cfg.n_layers, "all-gather": 2}
    assert sorted(all_gather_shapes(loop)) == [f"f32[2,{tp}]", f"s32[2,{tp}]"]


def test_bad_tp_sizes():
    mesh4 = tp_mesh(4, AxisType.Explicit)
    with pytest.raises(ValueError, match=r"divisible by 4; got n_kv_heads=2"):
        decoder.build_model(decoder.TINY, mesh=mesh4)
    model, _ = decoder.build_model(decoder.TINY)
    with pytest.raises(ValueError, match=r"n_kv_heads=2"):
        decoder.shard_model(model, mesh4)
    with pytest.raises(ValueError, match=r"mesh has no axis 'model'"):
        decoder.shard_model(model, mesh4, axis="model")
    three = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3])
    with pytest.raises(ValueError, match=r"n_heads=4, n_kv_heads=2"):
        decoder.shard_model(model, three)
    # Heads divide, but a quantized o_proj shard would cut a 32-element block (K/4 = 16).
    cfg = decoder.LlamaConfig(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=4,
                            hidden_dim=128)
    with pytest.raises(ValueError, match=r"whole 32-element blocks"):
        decoder.build_model(cfg, bits=4, mesh=mesh4)
    decoder.build_model(cfg, mesh=mesh4)   # the bf16 model has no blocks: fine


@pytest.mark.parametrize("bits", [pytest.param(2, id="k2"), pytest.param(None, id="bf16")])
def test_decode_loop_hlo_tp4_batch8(bits):
    """The configuration bench_decode measures at tp 4 (K = 2 and bf16, batch 8, Explicit
    axis): the greedy loop's program has 2 all-reduces per layer and only the argmax's two
    [batch, tp] all-gathers; every weight stays in its shard."""
    cfg, tp, batch = decoder.TINY_TP, 4, 8
    mesh = tp_mesh(tp, AxisType.Explicit)
    model, _ = decoder.build_model(cfg, bits=bits, mesh=mesh)
    assert_weights_sharded(model, tp)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        cache = decoder.init_cache(cfg, batch, 16, sharding=decoder.cache_sharding(mesh))
        token = jax.device_put(jnp.zeros((batch,), jnp.int32), NamedSharding(mesh, P()))
        loop = decoder.decode.lower(graphdef, state, token, cache, 8, 4).compile().as_text()
    assert collectives(loop) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 2 * cfg.n_layers,
                                 "all-gather": 2}
    assert sorted(all_gather_shapes(loop)) == [f"f32[{batch},{tp}]", f"s32[{batch},{tp}]"]
