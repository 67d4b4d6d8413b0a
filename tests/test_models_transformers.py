"""kbit_jax.models against transformers: tiny random Llama-3 and Qwen3 models made and saved by
transformers (torch on the CPU), loaded by kbit_jax.models.load (Qwen3-MoE also expert-parallel
over 2 devices).

- float32: logits within 1e-4 relative (max |difference| / max |logit|), greedy continuations
  identical;
- K=5: the quantized model computes exactly transformers' model with the dequantized weights
  (logits within 1e-4 relative), and its logits stay within the first-order bound of the
  weights' quantization errors (below).

Skipped when torch or transformers is missing (``pip install -e ".[test]"`` brings them).
"""

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import kbit_jax  # noqa: E402
import kbit_jax.flax as kflax  # noqa: E402
from kbit_jax import models  # noqa: E402
from kbit_jax.models import config as mconfig  # noqa: E402
from kbit_jax.models import decoder  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
#: RoPE scaling with a short original context, so that the tiny head_dim has frequencies in
#: all three of the llama3 rule's bands.
LLAMA_ROPE = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
KINDS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, rope_parameters=LLAMA_ROPE, tie_word_embeddings=False)),
    "llama-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # 8 experts, 2 per token; the middle layer keeps a dense MLP (mlp_only_layers)
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=32, rms_norm_eps=1e-6, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1])),
}


def hf_model(kind, rng, path, *, shard=False, dtype=torch.float32):
    """A transformers model with every parameter random (weights N(0, 0.1), norm scales
    1 + N(0, 0.1)), saved in ``dtype`` to ``path``; returned as transformers loads it back in
    float32 (a model cast to bf16 and back would keep bf16-rounded rotary frequencies)."""
    torch.manual_seed(int(rng.integers(2 ** 31)))
    model = KINDS[kind]().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, max_shard_size="100KB" if shard else "50GB")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def test_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = mconfig.from_hf_config(hf.to_dict())
    got = mconfig.rope_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("kind, shard, dtype", [
    pytest.param("llama", True, torch.float32, id="llama-sharded-f32"),
    pytest.param("llama-tied", False, torch.bfloat16, id="llama-tied-bf16"),
    pytest.param("qwen3", False, torch.float32, id="qwen3-f32"),
    pytest.param("qwen3-moe", True, torch.float32, id="qwen3-moe-sharded-f32"),
])
def test_matches_transformers(kind, shard, dtype, tmp_path, rng):
    """float32 logits within 1e-4 relative; the same greedy continuation as generate()."""
    hf = hf_model(kind, rng, tmp_path, shard=shard, dtype=dtype)
    model = models.load(tmp_path, dtype=jnp.float32, progress=False)
    tokens = rng.integers(0, 256, (2, 12)).astype(np.int32)
    assert rel_err(model(tokens), hf_logits(hf, tokens)) < 1e-4
    hf.generation_config.pad_token_id, hf.generation_config.eos_token_id = 0, None
    with torch.no_grad():
        want = hf.generate(torch.tensor(tokens, dtype=torch.long), do_sample=False, max_new_tokens=8,
                           attention_mask=torch.ones(tokens.shape, dtype=torch.long)).numpy()[:, 12:]
    np.testing.assert_array_equal(decoder.generate(model, tokens, 8), want)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (simulated) devices")
def test_moe_expert_parallel_matches_transformers(tmp_path, rng):
    """Qwen3-MoE loaded expert-parallel over 2 devices (4 experts each), float32: logits within
    1e-4 relative of transformers' and the same greedy continuation, as on one device."""
    hf = hf_model("qwen3-moe", rng, tmp_path, shard=True)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    model = models.load(tmp_path, dtype=jnp.float32, mesh=mesh, progress=False)
    assert model.layers[0].mlp.ep_axis == "tp"
    tokens = rng.integers(0, 256, (2, 12)).astype(np.int32)
    with jax.set_mesh(mesh):
        got = model(jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
    assert rel_err(got, hf_logits(hf, tokens)) < 1e-4
    hf.generation_config.pad_token_id, hf.generation_config.eos_token_id = 0, None
    with torch.no_grad():
        want = hf.generate(torch.tensor(tokens, dtype=torch.long), do_sample=False, max_new_tokens=8,
                           attention_mask=torch.ones(tokens.shape, dtype=torch.long)).numpy()[:, 12:]
    np.testing.assert_array_equal(decoder.generate(model, tokens, 8), want)


def write_dequantized(model: decoder.Llama, src, dst) -> None:
    """A copy of the Hugging Face directory ``src`` in ``dst`` with every quantized weight of
    ``model`` replaced by its dequantized values, split back into q/k/v, gate/up and the
    experts and transposed to transformers' ``[out, in]``; a quantized head as
    ``lm_head.weight`` (a tied model's config then unties it: its embedding stays dense)."""
    from safetensors.numpy import load_file, save_file

    cfg = model.config
    tensors = {}
    for file in sorted(os.listdir(src)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, file)))
    g = cfg.n_heads // cfg.n_kv_heads

    def put(name, w):
        tensors[name] = np.ascontiguousarray(np.swapaxes(np.asarray(w, np.float32), -1, -2))

    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        qkv = np.asarray(layer.attn.qkv_proj.dequantized_kernel(jnp.float32))
        qkv = qkv.reshape(cfg.dim, cfg.n_kv_heads, g + 2, cfg.head_dim)
        put(pre + "self_attn.q_proj.weight", qkv[:, :, :g].reshape(cfg.dim, -1))
        put(pre + "self_attn.k_proj.weight", qkv[:, :, g].reshape(cfg.dim, -1))
        put(pre + "self_attn.v_proj.weight", qkv[:, :, g + 1].reshape(cfg.dim, -1))
        put(pre + "self_attn.o_proj.weight", layer.attn.o_proj.dequantized_kernel(jnp.float32))
        if isinstance(layer.mlp, kflax.KbitMoE):
            gate_up, down = (kbit_jax.dequantize(w) for w in layer.mlp.weights)
            for j in range(cfg.n_experts):
                put(pre + f"mlp.experts.{j}.gate_proj.weight", gate_up[j, :, 0::2])
                put(pre + f"mlp.experts.{j}.up_proj.weight", gate_up[j, :, 1::2])
                put(pre + f"mlp.experts.{j}.down_proj.weight", down[j])
            continue
        gate_up = np.asarray(layer.mlp.gate_up_proj.dequantized_kernel(jnp.float32))
        put(pre + "mlp.gate_proj.weight", gate_up[:, 0::2])
        put(pre + "mlp.up_proj.weight", gate_up[:, 1::2])
        put(pre + "mlp.down_proj.weight", layer.mlp.down_proj.dequantized_kernel(jnp.float32))
    os.makedirs(dst)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    if isinstance(model.lm_head, kflax.KbitLinear):
        put("lm_head.weight", model.lm_head.dequantized_kernel(jnp.float32))
        with open(os.path.join(dst, "config.json")) as f:
            hf_config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**hf_config, "tie_word_embeddings": False}, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3-moe"])
def test_quantized_k5(kind, tmp_path, rng):
    """K=5 (float32 activations).

    Exact: the quantized model is transformers' model with the dequantized weights, logits
    within 1e-4 relative (the same bound as dense: only the weights changed).

    Close to the unquantized model: each quantized matrix ``W_j + E_j`` changes its sublayer's
    output by about ``e_j = ||E_j||_F / ||W_j||_F`` relative (for inputs not aligned with
    ``E_j``); the residual stream adds the sublayers' perturbations, and the norms, softmax and
    SiLU have gain <= 1 at these scales, so to first order the logits move by at most the sum
    of the ``e_j`` along one path (Frobenius norm, relative): per layer at most 7 matrices
    (q, k, v, o and the MLP's or each chosen expert's gate, up, down), and the output
    projection (quantized by default; a tied one against the embedding), so at most the sum of
    the 7 x layers + 1 largest ``e_j``. Measured on these models: K=5 gives ``e_j ~ 0.05``
    each, a bound of 0.45 (dense, 2 layers of fused q/k/v, o, gate/up, down, and the head) to
    ~1 (MoE, 3 layers), logit errors 0.14-0.17."""
    hf = hf_model(kind, rng, tmp_path)
    tokens = rng.integers(0, 256, (2, 12)).astype(np.int32)
    want = hf_logits(hf, tokens)
    dense = models.load(tmp_path, dtype=jnp.float32, progress=False)
    model = models.load(tmp_path, bits=5, dtype=jnp.float32, progress=False)
    got = np.asarray(model(tokens))

    write_dequantized(model, tmp_path, tmp_path / "dequantized")
    hf_dequantized = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "dequantized", dtype=torch.float32).eval()
    assert rel_err(got, hf_logits(hf_dequantized, tokens)) < 1e-4

    dense_layers = dict(nnx.iter_modules(dense))
    errors = []
    for path, layer in nnx.iter_modules(model):
        if path == ("lm_head",) and dense.lm_head is None:     # tied: the embedding is the head
            pairs = [(layer.dequantized_kernel(jnp.float32), dense.embed.embedding.get_value().T)]
        elif isinstance(layer, kflax.KbitLinear):
            pairs = [(layer.dequantized_kernel(jnp.float32), dense_layers[path].kernel.get_value())]
        elif isinstance(layer, kflax.KbitMoE):     # the experts, each matrix on its own
            moe = dense_layers[path]
            gate_up, down = (kbit_jax.dequantize(w) for w in layer.weights)
            pairs = [(gate_up[:, :, 0::2], moe.gate[...]), (gate_up[:, :, 1::2], moe.up[...]),
                     (down, moe.down[...])]
            pairs = [(q[j], w[j]) for q, w in pairs for j in range(q.shape[0])]
        else:
            continue
        errors += [np.linalg.norm(np.asarray(q) - np.asarray(w)) / np.linalg.norm(np.asarray(w))
                   for q, w in pairs]
    assert max(errors) < 0.08                                # K=5: ~0.05 per matrix
    # one path through the network: per layer q/k/v, o, and gate/up/down of the MLP or of
    # the top-k experts, then the head; the sum over all matrices bounds that from above
    assert isinstance(model.lm_head, kflax.KbitLinear)
    path_errors = sum(sorted(errors, reverse=True)[:7 * model.config.n_layers + 1])
    assert 0 < np.linalg.norm(got - want) / np.linalg.norm(want) <= path_errors
