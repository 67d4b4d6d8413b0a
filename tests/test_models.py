"""kbit_jax.models: configs from config.json, loading safetensors directories (dense, quantized,
tensor-parallel, Qwen3-MoE expert-parallel), the package's own saved format, and the errors for
bad checkpoints.

The checkpoints here are written with ``safetensors.numpy`` from random tensors (no torch);
tests/test_models_transformers.py compares against transformers itself.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

import kbit_jax
import kbit_jax.flax as kflax  # noqa: E402
from kbit_jax import models  # noqa: E402
from kbit_jax.models import config as mconfig  # noqa: E402
from kbit_jax.models import decoder, loader  # noqa: E402
from kbit_jax.sharding import COLLECTIVES, all_gather_shapes, collective_counts  # noqa: E402

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5, rope_theta=10_000.0, hidden_act="silu", tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
             bos_token_id=1, eos_token_id=2)
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
             intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, rms_norm_eps=1e-6, rope_theta=1_000_000.0, hidden_act="silu",
             tie_word_embeddings=True, use_sliding_window=False)
#: Qwen3-MoE: 8 experts of width 64, 2 per token; layer 1 of 3 keeps a dense MLP.
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [1], "tie_word_embeddings": False}
#: Shapes that split into 8 tensor-parallel shards, quantized: whole kv heads per device,
#: o_proj's and down_proj's K / 8 a multiple of 32, the vocabulary divisible by 8.
LLAMA_TP8 = {**LLAMA, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8,
             "intermediate_size": 256}
QWEN3_TP8 = {**QWEN3, "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 256}
#: Qwen3-MoE over up to 8 devices: whole kv heads and one expert (of 8) per device, whole
#: 32-element blocks of o_proj's and the dense layer's down_proj's K per device.
QWEN3_MOE_TP8 = {**QWEN3_MOE, "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 256}
U32 = float(jnp.finfo(jnp.float32).eps) / 2     # float32's unit roundoff


def random_tensors(hf: dict, rng, dtype=np.float32) -> dict:
    """Every tensor a checkpoint of ``hf`` holds: weights N(0, 0.1), norm scales 1 + N(0, 0.1)
    (so that a norm mapped to the wrong place changes the result)."""
    out = {}
    for name, shape in loader.expected_tensors(mconfig.from_hf_config(hf)).items():
        base = 1.0 if "norm" in name else 0.0
        out[name] = (base + 0.1 * rng.standard_normal(shape)).astype(dtype)
    return out


def write_checkpoint(path, hf: dict, tensors: dict, shards: int = 1) -> str:
    """A Hugging Face directory: config.json and ``shards`` safetensors files (an index when
    more than one)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[j]: tensors[names[j]] for j in part}, os.path.join(path, file),
                  metadata={"format": "pt"})
        weight_map.update({names[j]: file for j in part})
    with open(os.path.join(path, loader.INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def tokens_for(hf, rng, shape=(2, 10)):
    return rng.integers(0, hf["vocab_size"], shape).astype(np.int32)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# -- config.json ------------------------------------------------------------------------------
#: The published config.json files' relevant entries.
LLAMA3_8B_JSON = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                      hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=None, tie_word_embeddings=False,
                      hidden_act="silu", attention_bias=False, mlp_bias=False)
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
QWEN3_06B_JSON = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                      hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                      rope_theta=1000000, rope_scaling=None, tie_word_embeddings=True,
                      hidden_act="silu", attention_bias=False, use_sliding_window=False)


def test_config_llama3():
    assert mconfig.from_hf_config(LLAMA3_8B_JSON) == decoder.LLAMA3_8B
    cfg = mconfig.from_hf_config({**LLAMA3_8B_JSON, "rope_scaling": LLAMA31_ROPE})
    assert cfg.rope_scaling == mconfig.RopeScaling(8.0, 1.0, 4.0, 8192)
    # transformers 5 writes rope_parameters instead of rope_theta + rope_scaling
    new = {k: v for k, v in LLAMA3_8B_JSON.items() if k not in ("rope_theta", "rope_scaling")}
    assert mconfig.from_hf_config({**new, "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 500000.0}}) == cfg
    small = mconfig.from_hf_config({**LLAMA3_8B_JSON, "hidden_size": 2048, "head_dim": 64,
                                    "num_attention_heads": 32, "tie_word_embeddings": True})
    assert small.head_dim == 64 and small.tie_embeddings and not small.qk_norm


def test_config_qwen3():
    cfg = mconfig.from_hf_config(QWEN3_06B_JSON)
    assert (cfg.head_dim, cfg.qk_norm, cfg.tie_embeddings, cfg.rope_theta) == (128, True, True, 1e6)
    assert cfg.head_dim * cfg.n_heads != cfg.dim
    # Qwen3-0.6B: 0.6B parameters, 0.44B without the (tied) embedding
    assert round(cfg.num_params() / 1e6) == 596
    assert mconfig.DecoderConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg
    llama31 = mconfig.from_hf_config({**LLAMA3_8B_JSON, "rope_scaling": LLAMA31_ROPE})
    assert mconfig.DecoderConfig(**json.loads(json.dumps(llama31.to_dict()))) == llama31


def test_rope_frequencies_llama3_bands():
    """The llama3 rule by hand: wavelengths under original/high kept, over original/low divided
    by factor, the band between interpolated (and monotone)."""
    scaling = mconfig.RopeScaling(8.0, 1.0, 4.0, 8192)
    base = mconfig.rope_frequencies(128, 500000.0)
    scaled = mconfig.rope_frequencies(128, 500000.0, scaling)
    wavelen = 2 * np.pi / base
    short, long_ = wavelen < 8192 / 4, wavelen > 8192
    assert short.any() and long_.any() and (~short & ~long_).any()
    np.testing.assert_array_equal(scaled[short], base[short])
    np.testing.assert_allclose(scaled[long_], base[long_] / 8, rtol=1e-6)
    assert np.all(np.diff(scaled) < 0)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "GPT2LMHeadModel"])
def test_unknown_architecture(arch, tmp_path):
    with pytest.raises(ValueError, match=arch):
        mconfig.from_hf_config({**LLAMA, "architectures": [arch]})
    write_checkpoint(tmp_path, {**LLAMA, "architectures": [arch]}, {"x": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=f"architecture '{arch}' is not supported"):
        models.load(tmp_path, progress=False)


def test_config_qwen3_moe():
    cfg = mconfig.from_hf_config(QWEN3_MOE)
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_hidden_dim, cfg.moe_layers) == (8, 2, 64, (0, 2))
    every_other = mconfig.from_hf_config({**QWEN3_MOE, "num_hidden_layers": 6, "mlp_only_layers": [],
                                          "decoder_sparse_step": 2, "num_experts": None,
                                          "num_local_experts": 8})
    assert every_other.moe_layers == (1, 3, 5) and every_other.n_experts == 8
    assert mconfig.DecoderConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg
    # Qwen3-30B-A3B: 30.5B parameters
    a3b = {**QWEN3_MOE, "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
           "num_experts_per_tok": 8, "mlp_only_layers": []}
    assert round(mconfig.from_hf_config(a3b).num_params() / 1e9, 1) == 30.5


def test_qwen3_moe_load_save(tmp_path, rng):
    """Qwen3-MoE: expert layers load as MoE (dense) or KbitMoE (quantized, the stacked experts
    equal to kbit_jax.quantize of the dense stacks), the dense-MLP layer as the MLP; a saved
    quantized model restores exactly."""
    path = write_checkpoint(tmp_path / "hf", QWEN3_MOE, random_tensors(QWEN3_MOE, rng), shards=2)
    dense = models.load(path, dtype=jnp.float32, progress=False)
    model = models.load(path, bits=4, dtype=jnp.float32, progress=False)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["KbitMoE", "MLP", "KbitMoE"]
    gate_up, down = model.layers[2].mlp.weights
    moe = dense.layers[2].mlp
    for got, want in ((gate_up, kbit_jax.quantize(kbit_jax.interleave_glu(moe.gate[...], moe.up[...]), 4)),
                      (down, kbit_jax.quantize(moe.down[...], 4))):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
    tokens = tokens_for(QWEN3_MOE, rng)
    # K=4 weights are ~0.1 off each (relative); the logits measured 0.23-0.30 off (Frobenius)
    got, want = np.asarray(model(tokens)), np.asarray(dense(tokens))
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) < 0.6
    back = models.load(models.save(model, tmp_path / "k4"), dtype=jnp.float32, progress=False)
    for a, b in zip(leaves(model), leaves(back)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(decoder.generate(back, tokens, 4), decoder.generate(model, tokens, 4))


def test_missing_expert(tmp_path, rng):
    tensors = random_tensors(QWEN3_MOE, rng)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    write_checkpoint(tmp_path, QWEN3_MOE, tensors)
    with pytest.raises(ValueError, match="'model.layers.2.mlp.experts.5.up_proj.weight' is missing"):
        models.load(tmp_path, progress=False)


@pytest.mark.parametrize("change, match", [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"architectures": None, "model_type": "bert"}, "names no architecture"),
])
def test_unsupported_config(change, match):
    with pytest.raises(ValueError, match=match):
        mconfig.from_hf_config({**LLAMA, **change})
    with pytest.raises(ValueError, match="lacks 'intermediate_size'"):
        mconfig.from_hf_config({k: v for k, v in LLAMA.items() if k != "intermediate_size"})


# -- loading --------------------------------------------------------------------------------------
def test_forward_contract(tmp_path, rng):
    """model(tokens): [B, T, vocab] logits in the model's dtype; the cached path gives the same."""
    path = write_checkpoint(tmp_path, QWEN3, random_tensors(QWEN3, rng))
    tokens = tokens_for(QWEN3, rng, (3, 7))
    for dtype in (jnp.float32, jnp.bfloat16):
        model = models.load(path, dtype=dtype, progress=False)
        logits = model(tokens)
        assert logits.shape == (3, 7, QWEN3["vocab_size"]) and logits.dtype == dtype
    model = models.load(path, dtype=jnp.float32, progress=False)
    cache = decoder.init_cache(model.config, 3, 7, jnp.float32)
    cached, _ = model(jnp.asarray(tokens), cache, 0)
    np.testing.assert_allclose(cached, model(tokens), rtol=1e-5, atol=1e-6)


def test_shards_and_bf16(tmp_path, rng):
    """An index over several shard files and bf16 tensors load as one file of float32 does."""
    tensors = random_tensors(LLAMA, rng)
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in tensors.items()}
    one = models.load(write_checkpoint(tmp_path / "one", LLAMA, {k: v.astype(np.float32) for k, v in bf16.items()}),
                      dtype=jnp.float32, progress=False)
    three = models.load(write_checkpoint(tmp_path / "three", LLAMA, bf16, shards=3), dtype=jnp.float32,
                        progress=False)
    for a, b in zip(leaves(one), leaves(three)):
        np.testing.assert_array_equal(a, b)


def test_raw_reader_matches_safetensors(tmp_path, rng):
    """The header-and-offset reader (used where safetensors' NumPy API lacks bf16) reads what
    safetensors reads, for every float dtype."""
    tensors = {f"w.{np.dtype(d).name}": rng.standard_normal((3, 5)).astype(d)
               for d in (np.float32, np.float16, jnp.bfloat16)}
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    ckpt = loader.SafetensorsCheckpoint(tmp_path)
    for name, want in tensors.items():
        got = ckpt._read_raw(name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ckpt.read(name), want)


def test_quantized_load_is_quantize_of_the_weights(tmp_path, rng):
    """bits=K: each fused kernel is kbit_jax.quantize of the dense one (same leaves), every
    linear layer of the blocks quantized and the head too, unless quantize_head=False."""
    path = write_checkpoint(tmp_path, LLAMA, random_tensors(LLAMA, rng))
    dense = models.load(path, dtype=jnp.float32, progress=False)
    q = models.load(path, bits=3, dtype=jnp.float32, progress=False)
    dense_layers = dict(nnx.iter_modules(dense))
    quantized = [(p, m) for p, m in nnx.iter_modules(q) if isinstance(m, kflax.KbitLinear)]
    assert len(quantized) == 4 * LLAMA["num_hidden_layers"] + 1
    assert ("lm_head",) in dict(quantized) and q.lm_head.bits == 3
    for p, m in quantized:
        want = kbit_jax.quantize(dense_layers[p].kernel.get_value(), 3)
        for a, b in zip(jax.tree.leaves(m.weight), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)
    kept = models.load(path, bits=3, quantize_head=False, progress=False)
    assert type(kept.lm_head) is nnx.Linear and kept.lm_head.kernel.get_value().dtype == jnp.bfloat16
    assert isinstance(kept.layers[0].attn.o_proj, kflax.KbitLinear)


def final_hidden(model, tokens) -> np.ndarray:
    """The output projection's input (the final norm's output) [B, T, dim], float64: ``model``
    with an identity head (exact: one nonzero product per output)."""
    probe = nnx.clone(model)
    dim = model.config.dim
    probe.lm_head = nnx.Linear(dim, dim, use_bias=False, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    probe.lm_head.kernel.set_value(jnp.eye(dim, dtype=jnp.float32))
    return np.asarray(probe(tokens), np.float64)


def assert_head_logits(q, kept, w, tokens):
    """``q`` (quantized head) and ``kept`` (dense head ``w [dim, vocab]``) share every block, so
    their logits differ by h @ (W_q - W) only, h the head's input: per logit at most
    |h| |W_q - W|'s column (Cauchy-Schwarz) plus each dim-term float32 dot's rounding
    ((dim + 1) u |h| @ |W|); and the quantized head computes h @ dequantize(W_q) to that
    rounding. The difference is not zero (the head is quantized)."""
    w = np.asarray(w, np.float64)
    w_q = np.asarray(kbit_jax.dequantize(q.lm_head.weight), np.float64)
    h = final_hidden(q, tokens)
    np.testing.assert_array_equal(h, final_hidden(kept, tokens))
    dim = w.shape[0]
    rounding_q = (dim + 1) * U32 * (np.abs(h) @ np.abs(w_q))
    rounding = (dim + 1) * U32 * (np.abs(h) @ np.abs(w))
    got, dense_head = np.asarray(q(tokens), np.float64), np.asarray(kept(tokens), np.float64)
    assert np.all(np.abs(got - h @ w_q) <= rounding_q)
    bound = np.linalg.norm(h, axis=-1, keepdims=True) * np.linalg.norm(w_q - w, axis=0) + rounding_q + rounding
    assert np.all(np.abs(got - dense_head) <= bound)
    assert np.abs(got - dense_head).max() > 0


@pytest.mark.parametrize("hf", [LLAMA, QWEN3], ids=["lm_head", "tied-embedding"])
def test_head_quantized_by_default(hf, tmp_path, rng):
    """A quantized load quantizes the output projection (a tied one: a quantized copy of the
    embedding's transpose, the embedding kept for the lookup); quantize_head=False keeps it
    dense; the logits differ by the head's quantization only (`assert_head_logits`)."""
    path = write_checkpoint(tmp_path, hf, random_tensors(hf, rng))
    tokens = tokens_for(hf, rng)
    q = models.load(path, bits=4, dtype=jnp.float32, progress=False)
    kept = models.load(path, bits=4, dtype=jnp.float32, quantize_head=False, progress=False)
    assert isinstance(q.lm_head, kflax.KbitLinear) and q.lm_head.bits == 4
    if hf["tie_word_embeddings"]:
        assert kept.lm_head is None                      # the embedding is the head
        w = np.asarray(kept.embed.embedding.get_value(), np.float64).T
        np.testing.assert_array_equal(q.embed.embedding.get_value(), kept.embed.embedding.get_value())
    else:
        assert type(kept.lm_head) is nnx.Linear
        w = np.asarray(kept.lm_head.kernel.get_value(), np.float64)
    for a, b in zip(jax.tree.leaves(q.lm_head.weight), jax.tree.leaves(kbit_jax.quantize(w.astype(np.float32), 4))):
        np.testing.assert_array_equal(a, b)
    assert_head_logits(q, kept, w, tokens)


TIED = mconfig.DecoderConfig(**{**decoder.TINY.to_dict(), "tie_embeddings": True})
#: in_features of the head and of q/k/v and gate/up not whole 32-element blocks (o and down are)
ODD_DIM = mconfig.DecoderConfig(vocab_size=256, dim=48, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
                                hidden_dim=64, rope_theta=10_000.0)


@pytest.mark.parametrize("cfg", [decoder.TINY, TIED], ids=["lm_head", "tied-embedding"])
def test_build_model_quantizes_the_head(cfg, rng):
    """build_model(bits=K) quantizes the head (the report says so, its bytes counted), the
    same weight as quantizing the dense model's head; quantize_head=False keeps it dense; the
    logits differ by the head's quantization only (`assert_head_logits`)."""
    q, report = decoder.build_model(cfg, bits=4, param_dtype=jnp.float32)
    kept, kept_report = decoder.build_model(cfg, bits=4, param_dtype=jnp.float32, quantize_head=False)
    dense, _ = decoder.build_model(cfg, param_dtype=jnp.float32)
    assert isinstance(q.lm_head, kflax.KbitLinear) and "lm_head" in report.replaced
    assert ("lm_head", "kept dense (quantize_head=False)") in kept_report.skipped
    assert "lm_head" not in kept_report.replaced
    w = dense.embed.embedding.get_value().T if cfg.tie_embeddings else dense.lm_head.kernel.get_value()
    for a, b in zip(jax.tree.leaves(q.lm_head.weight), jax.tree.leaves(kbit_jax.quantize(w, 4))):
        np.testing.assert_array_equal(a, b)
    assert report.bytes_after == sum(x.nbytes for x in jax.tree.leaves(nnx.state(q)))
    head_bytes = sum(x.nbytes for x in jax.tree.leaves(q.lm_head.weight))
    if cfg.tie_embeddings:
        assert kept.lm_head is None and report.bytes_after == kept_report.bytes_after + head_bytes
    else:
        assert type(kept.lm_head) is nnx.Linear
        assert report.bytes_after == kept_report.bytes_after - w.nbytes + head_bytes
    assert_head_logits(q, kept, w, tokens_for({"vocab_size": cfg.vocab_size}, rng))


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied-embedding"])
def test_head_that_cannot_be_quantized_stays_dense(tied):
    """A head whose in_features (dim) is not whole 32-element blocks stays dense, the reason in
    the report, as do the blocks' layers of that K; the model builds and runs."""
    cfg = mconfig.DecoderConfig(**{**ODD_DIM.to_dict(), "tie_embeddings": tied})
    model, report = decoder.build_model(cfg, bits=4, param_dtype=jnp.float32)
    assert ("lm_head", "in_features=48 is not a multiple of 32") in report.skipped
    assert model.lm_head is None if tied else type(model.lm_head) is nnx.Linear
    assert type(model.layers[0].attn.qkv_proj) is nnx.Linear                 # K = dim = 48
    assert isinstance(model.layers[0].attn.o_proj, kflax.KbitLinear)         # K = 2 * 32
    assert decoder.head_dense_reason(cfg) == "in_features=48 is not a multiple of 32"
    assert decoder.head_dense_reason(decoder.TINY) is None
    assert model(jnp.zeros((1, 3), jnp.int32)).shape == (1, 3, cfg.vocab_size)


SHARDED = [pytest.param(LLAMA_TP8, None, False, id="llama-dense"),
           pytest.param(QWEN3_TP8, 4, True, id="qwen3-k4-head")]


@pytest.mark.parametrize("hf, bits, quantize_head", SHARDED)
def test_sharded_load_equals_single_device(hf, bits, quantize_head, tmp_path, rng):
    """Loaded over 8 devices: the same weights as on one device, each linear layer's weight
    split 8 ways as shard_model places it, the same logits and greedy tokens."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    path = write_checkpoint(tmp_path, hf, random_tensors(hf, rng, jnp.bfloat16), shards=2)
    kw = dict(bits=bits, quantize_head=quantize_head, dtype=jnp.float32, progress=False)
    single = models.load(path, **kw)
    mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
    sharded = models.load(path, mesh=mesh, **kw)
    for a, b in zip(leaves(single), leaves(sharded)):
        np.testing.assert_array_equal(a, b)
    placed = 0
    for path_, module in nnx.iter_modules(sharded):
        if isinstance(module, (nnx.Linear, kflax.KbitLinear)) and path_[-1] in decoder.TP_LAYOUT:
            big = module.kernel.planes if isinstance(module, kflax.KbitLinear) else module.kernel
            x = big.get_value()
            assert len(x.sharding.device_set) == 8
            assert all(s.data.size * 8 == x.size for s in x.addressable_shards), path_
            placed += 1
    assert placed == 4 * hf["num_hidden_layers"] + (1 if quantize_head or not hf["tie_word_embeddings"] else 0)
    prompt = tokens_for(hf, rng, (2, 6))
    want = single(prompt)
    with jax.set_mesh(mesh):
        got = sharded(jax.device_put(prompt, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(decoder.generate(sharded, prompt, 5), decoder.generate(single, prompt, 5))


def _expert_leaves(model):
    """Every MoE block's stacked expert arrays (dense kernels or quantized leaves)."""
    out = []
    for _, module in nnx.iter_modules(model):
        if isinstance(module, kflax.MoE):
            out += [v.get_value() for v in (module.gate, module.up, module.down)]
        elif isinstance(module, kflax.KbitMoE):
            out += [x for w in module.weights for x in jax.tree.leaves(w)]
    return out


def _check_expert_parallel(model, n: int) -> None:
    """Every MoE block computes expert-parallel over "tp": its expert leaves split into n shards
    of G / n experts each, one per device; its router replicated."""
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, (kflax.MoE, kflax.KbitMoE))]
    assert len(blocks) == len(model.config.moe_layers)
    for block in blocks:
        assert block.ep_axis == "tp"
        router = block.router.kernel.get_value()
        assert len(router.sharding.device_set) == n and router.sharding.is_fully_replicated
    g = model.config.n_experts
    for x in _expert_leaves(model):
        assert x.shape[0] == g and len(x.sharding.device_set) == n
        assert sorted(s.index[0].start for s in x.addressable_shards) == list(range(0, g, g // n))
        assert all(s.data.shape[0] * n == g for s in x.addressable_shards)


def _step_logits(model, prompt):
    """The prefill logits of ``prompt`` [B, T] and one decode step's after it (float64), under
    the model's mesh when it has one."""
    graphdef, state = nnx.split(model)
    b, t = prompt.shape
    tokens, first = jnp.asarray(prompt), jnp.asarray(prompt[:, 0])
    if model.tp is None:
        cache = decoder.init_cache(model.config, b, t + 1, jnp.float32)
        logits, cache = decoder.prefill(graphdef, state, tokens, cache)
        step, _ = decoder.decode_step(graphdef, state, first, cache, t)
    else:
        mesh, _ = model.tp
        with jax.set_mesh(mesh):
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            cache = decoder.init_cache(model.config, b, t + 1, jnp.float32,
                                       sharding=model.cache_sharding())
            logits, cache = decoder.prefill(graphdef, state, jax.device_put(tokens, replicated), cache)
            step, _ = decoder.decode_step(graphdef, state, jax.device_put(first, replicated), cache, t)
    return np.asarray(logits, np.float64), np.asarray(step, np.float64)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("bits, counts", [pytest.param(None, (2, 8), id="dense"),
                                          pytest.param(4, (4, 8), id="k4")])
def test_moe_sharded_load_equals_single_device(bits, counts, tmp_path, rng, monkeypatch):
    """A Qwen3-MoE checkpoint (bf16 tensors) loaded over 2, 4 or 8 devices: the same weights as
    on one device, every expert stack at its expert-parallel shards (G / n experts per device;
    none of them passed through the first device), the same prefill and decode logits up to
    float32 reassociation, and the same greedy tokens. The first mesh with attention replicated
    (the default for a MoE model), the second with it tensor-parallel."""
    hf = QWEN3_MOE_TP8
    path = write_checkpoint(tmp_path, hf, random_tensors(hf, rng, jnp.bfloat16), shards=2)
    kw = dict(bits=bits, dtype=jnp.float32, progress=False)
    single = models.load(path, **kw)
    prompt = tokens_for(hf, rng, (2, 6))
    one, tokens = _step_logits(single, prompt), decoder.generate(single, prompt, 5)
    for n, attention_parallel in zip(counts, ("auto", "tensor")):
        mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
        to_device = loader._Filler.to_device
        first_device = []
        monkeypatch.setattr(loader._Filler, "to_device",
                            lambda self, a: first_device.append(a.shape) or to_device(self, a))
        sharded = models.load(path, mesh=mesh, attention_parallel=attention_parallel, **kw)
        assert sharded.attention_parallel == ("replicated" if attention_parallel == "auto" else "tensor")
        qkv = sharded.layers[0].attn.qkv_proj
        qkv = qkv.kernel.get_value() if bits is None else qkv.weight.planes
        assert qkv.sharding.is_fully_replicated == (attention_parallel == "auto")
        monkeypatch.setattr(loader._Filler, "to_device", to_device)
        assert first_device and not [s for s in first_device if len(s) == 3], first_device
        for a, b in zip(leaves(single), leaves(sharded)):
            np.testing.assert_array_equal(a, b)
        _check_expert_parallel(sharded, n)
        for got, want in zip(_step_logits(sharded, prompt), one):
            # The devices' partial sums (o_proj's K = 512 over n shards, the experts' psum, the
            # dense down_proj's K = 256) reassociate float32 sums: each of the 3 layers is off by
            # at most K * u32 of its sums' magnitudes, which the norms carry to the logits.
            k = hf["num_attention_heads"] * hf["head_dim"]
            np.testing.assert_allclose(got, want, rtol=0, atol=hf["num_hidden_layers"] * k * U32 * np.abs(want).max())
        np.testing.assert_array_equal(decoder.generate(sharded, prompt, 5), tokens)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("bits, attention_parallel", [pytest.param(None, "tensor", id="bf16-tensor"),
                                                        pytest.param(4, "tensor", id="k4-tensor"),
                                                        pytest.param(4, "auto", id="k4-replicated")])
def test_moe_sharded_load_step_moves_no_weight(bits, attention_parallel, tmp_path, rng):
    """The compiled decode step of a Qwen3-MoE checkpoint loaded over 8 devices (bf16): with
    tensor-parallel attention two all-reduces per layer (o_proj's; the MLP's: down_proj's in the
    dense layer, the experts' psum in a MoE layer), with replicated attention (a MoE model's
    default) only the MLP's; no all-gather, so no weight moves."""
    hf = QWEN3_MOE_TP8
    path = write_checkpoint(tmp_path, hf, random_tensors(hf, rng, jnp.bfloat16))
    mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
    model = models.load(path, bits=bits, mesh=mesh, progress=False, attention_parallel=attention_parallel)
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        cache = decoder.init_cache(model.config, 2, 16, sharding=model.cache_sharding())
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        token = jax.device_put(jnp.zeros((2,), jnp.int32), replicated)
        text = decoder.decode_step.lower(graphdef, state, token, cache, 8).compile().as_text()
    per_layer = 2 if attention_parallel == "tensor" else 1
    want = {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": per_layer * hf["num_hidden_layers"]}
    assert collective_counts(text) == want
    assert all_gather_shapes(text) == []


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("change, bits, attention_parallel, match", [
    ({}, None, "tensor", r"over 8 devices needs n_heads, n_kv_heads, hidden_dim and n_experts divisible "
                         r"by 8; got n_heads=4, n_kv_heads=2"),
    ({"num_experts": 4}, None, "auto", r"over 8 devices needs hidden_dim and n_experts divisible by 8; "
                                       r"got n_experts=4$"),
    ({"num_attention_heads": 16, "num_key_value_heads": 8, "num_experts": 4}, None, "tensor",
     r"n_experts divisible by 8; got n_experts=4$"),
    ({"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8}, 4, "tensor",
     r"needs o_proj's in_features \(n_heads \* head_dim = 128\) divisible by 32 \* 8 = 256"),
    ({}, None, "heads", r"attention_parallel='heads': expected one of \('auto', 'tensor', 'replicated'\)"),
])
def test_moe_mesh_must_divide(change, bits, attention_parallel, match, tmp_path, rng, monkeypatch):
    """A Qwen3-MoE checkpoint that does not split over the mesh is refused before any tensor is
    read, naming what does not divide (heads only with tensor-parallel attention: the MoE
    model's default replicates it), or the bad ``attention_parallel``."""
    hf = {**QWEN3_MOE, **change}
    path = write_checkpoint(tmp_path, hf, random_tensors(hf, rng))
    mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
    reads, read = [], loader.SafetensorsCheckpoint.read
    monkeypatch.setattr(loader.SafetensorsCheckpoint, "read",
                        lambda self, name: reads.append(name) or read(self, name))
    with pytest.raises(ValueError, match=match):
        models.load(path, bits=bits, mesh=mesh, progress=False, attention_parallel=attention_parallel)
    assert reads == []


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_moe_save_restore_on_mesh(tmp_path, rng):
    """A quantized Qwen3-MoE saved (from its expert-parallel placement over 8 devices) restores
    onto 4 devices straight into its expert shards and onto one device: the same leaves and
    greedy tokens; a mesh that does not divide it is refused naming the sizes."""
    hf = QWEN3_MOE_TP8
    path = write_checkpoint(tmp_path / "hf", hf, random_tensors(hf, rng))
    mesh8 = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
    model = models.load(path, bits=4, dtype=jnp.float32, mesh=mesh8, progress=False)
    saved = models.save(model, tmp_path / "k4")
    mesh4 = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
    back = models.load(saved, mesh=mesh4, dtype=jnp.float32, progress=False)
    single = models.load(saved, dtype=jnp.float32, progress=False)
    _check_expert_parallel(back, 4)
    for a, b, c in zip(leaves(model), leaves(back), leaves(single)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    prompt = tokens_for(hf, rng, (2, 6))
    want = decoder.generate(single, prompt, 5)
    np.testing.assert_array_equal(decoder.generate(back, prompt, 5), want)
    np.testing.assert_array_equal(decoder.generate(model, prompt, 5), want)
    mesh3 = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3])
    with pytest.raises(ValueError, match="over 3 devices needs .* divisible by 3; got n_heads=16, "
                                         "n_kv_heads=8, hidden_dim=256, n_experts=8"):
        models.load(saved, mesh=mesh3, progress=False, attention_parallel="tensor")
    with pytest.raises(ValueError, match="over 3 devices needs hidden_dim and n_experts divisible by 3; "
                                         "got hidden_dim=256, n_experts=8"):
        models.load(saved, mesh=mesh3, progress=False)     # attention replicated: heads need not divide


def test_save_load_round_trip(tmp_path, rng):
    """save + load: the same leaves (no re-quantization), the same logits; restoring onto a
    mesh places the shards directly; bits= must match what was saved."""
    path = write_checkpoint(tmp_path / "hf", QWEN3_TP8, random_tensors(QWEN3_TP8, rng))
    model = models.load(path, bits=4, quantize_head=True, progress=False)
    saved = models.save(model, tmp_path / "k4")
    assert loader.is_saved_model(saved)
    back = models.load(saved, progress=False)
    assert isinstance(back.lm_head, kflax.KbitLinear)
    assert jax.tree.structure(nnx.state(back)) == jax.tree.structure(nnx.state(model))
    for a, b in zip(leaves(model), leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    tokens = tokens_for(QWEN3_TP8, rng)
    np.testing.assert_array_equal(back(tokens), model(tokens))
    with pytest.raises(ValueError, match="saved with bits=\\[4\\]"):
        models.load(saved, bits=3, progress=False)
    with pytest.raises(ValueError, match="already holds a saved model"):
        models.save(model, saved)
    if len(jax.devices()) >= 4:
        mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
        sharded = models.load(saved, mesh=mesh, progress=False)
        planes = sharded.layers[0].mlp.down_proj.kernel.planes.get_value()
        assert all(s.data.shape[0] * 4 == planes.shape[0] for s in planes.addressable_shards)
        for a, b in zip(leaves(model), leaves(sharded)):
            np.testing.assert_array_equal(a, b)


def test_save_load_dense(tmp_path, rng):
    path = write_checkpoint(tmp_path / "hf", LLAMA, random_tensors(LLAMA, rng))
    model = models.load(path, dtype=jnp.float32, progress=False)
    saved = models.save(model, tmp_path / "dense")
    back = models.load(saved, dtype=jnp.float32, progress=False)
    for a, b in zip(leaves(model), leaves(back)):
        np.testing.assert_array_equal(a, b)
    assert back.config == model.config
    half = models.load(saved, progress=False)            # dtype bf16: dense leaves cast on restore
    for a, b in zip(leaves(model), leaves(half)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a.astype(jnp.bfloat16), b)


# -- bad checkpoints and arguments -------------------------------------------------------------
def test_missing_tensor(tmp_path, rng):
    tensors = random_tensors(LLAMA, rng)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    write_checkpoint(tmp_path, LLAMA, tensors)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' is missing \(in none of model.safetensors\)"):
        models.load(tmp_path, progress=False)


def test_missing_tensor_in_indexed_shard(tmp_path, rng):
    write_checkpoint(tmp_path, LLAMA, random_tensors(LLAMA, rng), shards=2)
    with open(tmp_path / loader.INDEX_FILE) as f:
        index = json.load(f)
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight"] = "model-00002-of-00002.safetensors"
    with open(tmp_path / loader.INDEX_FILE, "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.weight' is missing .the index "
                                         "puts it in model-00002-of-00002.safetensors, which lacks it"):
        models.load(tmp_path, progress=False)


def test_wrong_shape_and_dtype(tmp_path, rng):
    tensors = random_tensors(QWEN3, rng)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    tensors["model.norm.weight"] = np.ones(64, np.int32)
    write_checkpoint(tmp_path, QWEN3, tensors)
    with pytest.raises(ValueError) as info:
        models.load(tmp_path, progress=False)
    message = str(info.value)
    assert ("'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape (32, 64), "
            "expected (64, 64)") in message
    assert "'model.norm.weight' in model.safetensors has dtype I32, expected one of F32, F16, BF16" in message


def test_truncated_shard(tmp_path, rng):
    write_checkpoint(tmp_path, LLAMA, random_tensors(LLAMA, rng), shards=2)
    file = tmp_path / "model-00002-of-00002.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors: cannot read the safetensors "
                                         "header, the file is truncated or corrupt .the index puts"):
        models.load(tmp_path, progress=False)
    file.write_bytes(data[:4])
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors: cannot read"):
        models.load(tmp_path, progress=False)
    file.unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors: missing checkpoint shard"):
        models.load(tmp_path, progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="config.json not found"):
        models.load(tmp_path, progress=False)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(LLAMA, f)
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        models.load(tmp_path, progress=False)
    with open(tmp_path / "config.json", "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        models.load(tmp_path, progress=False)


def test_bad_arguments(tmp_path, rng):
    path = write_checkpoint(tmp_path, LLAMA, random_tensors(LLAMA, rng))
    with pytest.raises(ValueError, match="bits"):
        models.load(path, bits=7, progress=False)
    with pytest.raises(ValueError, match="codebook"):
        models.load(path, bits=4, codebook="nope", progress=False)
    with pytest.raises(TypeError, match="dtype must be one of float32, bfloat16, float16; got int32"):
        models.load(path, dtype=jnp.int32, progress=False)
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="mesh has no axis 'tp'"):
        models.load(path, mesh=mesh, progress=False)
    if len(jax.devices()) >= 8:
        mesh = jax.make_mesh((8,), ("tp",), devices=jax.devices()[:8])
        with pytest.raises(ValueError, match="n_heads, n_kv_heads and hidden_dim divisible by 8"):
            models.load(path, mesh=mesh, progress=False)
    with pytest.raises(TypeError, match="decoder.Llama"):
        models.save(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path / "x")
