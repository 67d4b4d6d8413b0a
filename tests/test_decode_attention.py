"""The example decoder's single-token attention kernels (``examples/decode_attention.py``):
``decode_attention`` (attention alone) and ``decode_attention_step`` (rotary embedding, cache
write and attention).

On the CPU the Pallas kernel runs through Pallas's interpreter (the same kernel body); the
tests marked ``gpu`` compile it with Triton. Checked: the kernel against a float64 softmax
attention with a tolerance derived from the dtype, the decoder with the kernel against the
decoder with XLA's attention (single device and tensor-parallel over 2), and the bad inputs.
"""

import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import unit_roundoff
from jax.sharding import AxisType

from kbit_jax.examples import llama
from kbit_jax.models import decoder
from kbit_jax.examples.decode_attention import (_plan, decode_attention, decode_attention_step,
                                                 supported, supported_step)

# (batch, kv heads, query heads per kv head, head_dim, cache length S, kv_len): S not a
# multiple of the kernel's 64-position block, kv_len 1 and == S, groups below and above the
# 16-row tile.
SHAPES = [(1, 4, 8, 128, 192, 130), (2, 2, 4, 64, 70, 70), (1, 1, 16, 32, 33, 1),
          (3, 1, 1, 16, 64, 64), (1, 2, 32, 64, 130, 129)]


def attention64(q, k, v, kv_len):
    """float64 softmax attention: q [B, KVH, G, D] over k, v [B, S, KVH, D] positions < kv_len."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bkgd,bskd->bkgs", q, k) / np.sqrt(q.shape[-1])
    s[..., kv_len:] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bkgs,bskd->bkgd", p / p.sum(axis=-1, keepdims=True), v)


def tolerance(dtype, v):
    """The output is a convex combination of value rows. bf16: the probabilities are rounded to
    bf16 for the p.v product (relative 2^-9 each, so at most 2^-9 * max|v| in total) and the
    output once more (2^-9 * max|v|); twice that as margin. f32: f32 arithmetic throughout."""
    vmax = float(np.abs(np.asarray(v, np.float64)).max())
    return (2.0 ** -7 if dtype == jnp.bfloat16 else 1e-5) * vmax


def random_inputs(rng, shape, dtype):
    b, kvh, g, d, s, _ = shape
    def draw(*dims):
        return jnp.asarray(rng.standard_normal(dims), dtype)
    return draw(b, kvh, g, d), draw(b, s, kvh, d), draw(b, s, kvh, d)


def check_against_float64(rng, shape, dtype, **options):
    q, k, v = random_inputs(rng, shape, dtype)
    kv_len = shape[-1]
    out = jax.jit(functools.partial(decode_attention, **options))(q, k, v, jnp.int32(kv_len))
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), attention64(q, k, v, kv_len),
                               rtol=0, atol=tolerance(dtype, v))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_float64(shape, dtype, rng):
    check_against_float64(rng, shape, dtype)


@pytest.mark.parametrize("splits,block_s", [(3, 16), (4, 32), (1, 16)])
def test_kernel_split_over_positions(splits, block_s, rng):
    """Programs over parts of the positions, combined afterwards: S = 130 in 3 or 4 splits
    (the last ones partly or wholly past kv_len = 40) and one split of many 16-blocks."""
    check_against_float64(rng, (2, 2, 8, 32, 130, 40), jnp.float32, splits=splits, block_s=block_s)
    check_against_float64(rng, (1, 2, 4, 64, 130, 130), jnp.bfloat16, splits=splits, block_s=block_s)


def test_positions_past_kv_len_are_ignored(rng):
    """Keys and values at positions >= kv_len (here inf and nan) change nothing."""
    q, k, v = random_inputs(rng, (1, 2, 8, 32, 100, 40), jnp.float32)
    want = decode_attention(q, k, v, 40)
    k = k.at[:, 40:].set(jnp.inf)
    v = v.at[:, 40:].set(jnp.nan)
    np.testing.assert_array_equal(np.asarray(decode_attention(q, k, v, 40)), np.asarray(want))


@pytest.mark.parametrize("s,d,itemsize,batch,kv_heads,want", [
    (192, 128, 2, 1, 8, (256, 1)),      # one block: the cache rounded up to a power of two
    (256, 128, 2, 8, 8, (256, 1)),
    (1024, 128, 2, 1, 8, (128, 8)),     # several iterations: LOOP_BLOCK_S, split to ~256 programs
    (4096, 128, 2, 8, 8, (128, 4)),
    (4096, 128, 4, 8, 8, (128, 4)),     # f32: ~64 KiB of keys per tile allow 128 positions
    (192, 256, 2, 1, 2, (128, 2)),      # head_dim 256: 128 positions are 64 KiB
    (40, 64, 2, 1, 2, (64, 1)),
])
def test_default_plan(s, d, itemsize, batch, kv_heads, want):
    """The default block and splits (benchmarks/results/attention_h200.md says why)."""
    block_s, splits, split_len = _plan(s, d, itemsize, batch, kv_heads, None, None, "test")
    assert (block_s, splits) == want
    assert split_len % block_s == 0 and splits * split_len >= s > (splits - 1) * split_len


def test_bad_inputs():
    q = jnp.zeros((1, 2, 4, 32), jnp.float32)
    cache = jnp.zeros((1, 16, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match="must share a shape and q's dtype"):
        decode_attention(q, cache, cache.astype(jnp.bfloat16), 1)
    with pytest.raises(ValueError, match=r"does not match q"):
        decode_attention(q, jnp.zeros((1, 16, 3, 32)), jnp.zeros((1, 16, 3, 32)), 1)
    with pytest.raises(ValueError, match=r"head_dim 24 is not a power of two"):
        decode_attention(jnp.zeros((1, 2, 4, 24)), jnp.zeros((1, 16, 2, 24)),
                         jnp.zeros((1, 16, 2, 24)), 1)
    with pytest.raises(ValueError, match=r"q must be \[B, KVH, G, D\]"):
        decode_attention(jnp.zeros((2, 4, 32)), cache, cache, 1)
    with pytest.raises(ValueError, match=r"block_s=24 is not a power of two"):
        decode_attention(q, cache, cache, 1, block_s=24)
    with pytest.raises(ValueError, match=r"splits=0"):
        decode_attention(q, cache, cache, 1, splits=0)
    assert supported((1, 2, 4, 32), (1, 16, 2, 32)) is None
    with pytest.raises(ValueError, match=r"attention='flash'"):
        llama.build_model(llama.TINY, attention="flash")
    cfg = llama.LlamaConfig(vocab_size=64, dim=48, n_layers=1, n_heads=2, n_kv_heads=1,
                            hidden_dim=64)                # head_dim 24
    model, _ = llama.build_model(cfg, param_dtype=jnp.float32, attention="pallas")
    with pytest.raises(ValueError, match=r"attention='pallas': head_dim 24"):
        llama.generate(model, np.zeros((1, 4), np.int32), 2)
    # "auto" falls back to XLA for that shape instead.
    auto, _ = llama.build_model(cfg, param_dtype=jnp.float32, attention="auto")
    assert llama.generate(auto, np.zeros((1, 4), np.int32), 2).shape == (1, 2)


# -- decode_attention_step: rotary embedding + cache write + attention ---------------------------
# (batch, kv heads, G, head_dim, S, pos): pos 0 (the new token alone), pos S - 1, groups of 1.
STEP_SHAPES = [(1, 4, 8, 128, 192, 130), (2, 2, 4, 64, 70, 69), (1, 1, 1, 32, 64, 0),
               (3, 2, 16, 32, 40, 39)]


def step_inputs(rng, shape, dtype, theta=10_000.0):
    b, kvh, g, d, s, pos = shape
    def draw(*dims):
        return jnp.asarray(rng.standard_normal(dims), dtype)
    angles = pos * theta ** (-np.arange(0, d, 2) / d)
    return (draw(b, kvh, g + 2, d), draw(b, s, kvh, d), draw(b, s, kvh, d), pos,
            jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))


def step_reference(qkv, cache_k, cache_v, pos, cos, sin):
    """float64 rotation of the new queries and key (rounded to the dtype, as the kernel and the
    XLA path round them), the caches with the key and value at pos, and attention64 over them."""
    dtype = qkv.dtype
    x = np.asarray(qkv, np.float64)
    c, s_ = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    x1, x2 = np.split(x, 2, axis=-1)
    rot = np.asarray(jnp.asarray(np.concatenate([x1 * c - x2 * s_, x2 * c + x1 * s_], -1), dtype))
    g = qkv.shape[2] - 2
    k = np.asarray(cache_k).copy()
    v = np.asarray(cache_v).copy()
    k[:, pos] = rot[:, :, g]
    v[:, pos] = np.asarray(qkv)[:, :, g + 1]
    return attention64(rot[:, :, :g], k, v, pos + 1), k, v


def decoder_qk_norm(qkv, q_norm, k_norm, eps):
    """qkv with its query heads and key normalized by the decoder's own (XLA) ``RMSNorm``s with
    scales q_norm, k_norm: the values the kernel must rotate."""
    def norm(x, scale):
        module = decoder.RMSNorm(x.shape[-1], eps, scale.dtype)
        module.scale.set_value(scale)
        return module(x)
    g = qkv.shape[2] - 2
    return jnp.concatenate([norm(qkv[:, :, :g], q_norm), norm(qkv[:, :, g:g + 1], k_norm),
                            qkv[:, :, g + 1:]], axis=2)


def check_step(rng, shape, dtype, qk_norm=False, **options):
    """The kernel against `step_reference`; with ``qk_norm`` each head of qkv at its own random
    magnitude and random RMSNorm scales, the reference rotating the XLA path's normalized heads."""
    qkv, cache_k, cache_v, pos, cos, sin = step_inputs(rng, shape, dtype)
    if qk_norm:
        d, eps = shape[3], 1e-6
        qkv = (qkv * jnp.asarray(rng.uniform(0.1, 10.0, qkv.shape[:3] + (1,)), dtype)).astype(dtype)
        norms = {"q_norm": jnp.asarray(rng.uniform(0.5, 2.0, d), dtype),
                 "k_norm": jnp.asarray(rng.uniform(0.5, 2.0, d), dtype), "norm_eps": eps}
        rotated_in = decoder_qk_norm(qkv, norms["q_norm"], norms["k_norm"], eps)
        options = {**options, **norms}
    else:
        rotated_in = qkv
    want, want_k, want_v = step_reference(rotated_in, cache_k, cache_v, pos, cos, sin)
    out, new_k, new_v = jax.jit(functools.partial(decode_attention_step, **options))(
        qkv, cache_k, cache_v, jnp.int32(pos), cos, sin)
    assert out.shape == qkv[:, :, 2:].shape and out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0,
                               atol=tolerance(dtype, want_v))
    # The cache changes at pos only: there the rotated key and the value itself. The key is
    # rotated in f32 (x1 cos - x2 sin: two products and a sum, each within half an f32 ulp of
    # |x| <= max|x|) and rounded to the dtype (the f32 and the float64 rotation may round to
    # neighbours: one ulp of the dtype). With the norm, the kernel's f32 sum of squares is
    # associated differently from XLA's, so a normalized element may round to the neighbour of
    # the reference's (one ulp, 2u|x|), which the rotation carries into both halves: 4u max|x|.
    keep = np.arange(shape[4]) != pos
    np.testing.assert_array_equal(np.asarray(new_k)[:, keep], np.asarray(cache_k)[:, keep])
    np.testing.assert_array_equal(np.asarray(new_v), want_v)
    xmax = float(jnp.abs(rotated_in.astype(jnp.float32)).max())
    atol = (8 * unit_roundoff(jnp.float32) + (4 * unit_roundoff(dtype) if qk_norm else 0)) * xmax
    np.testing.assert_allclose(np.asarray(new_k, np.float64)[:, pos], np.asarray(want_k, np.float64)[:, pos],
                               rtol=2 * unit_roundoff(dtype), atol=atol)
    if qk_norm and dtype != jnp.float32:
        # The rotation starts from the normalized key rounded to the dtype, as the XLA path's:
        # the key equals that path's (the f32 rotation of the rounded norm) but where the
        # reassociated sum of squares moved a normalized element to the other side of a
        # rounding boundary (probability ~ f32 error / dtype ulp ~ 2^-13 per element). A
        # rotation of the unrounded norm differs in ~30 % of the elements.
        g = shape[2]
        x1, x2 = jnp.split(rotated_in[:, :, g].astype(jnp.float32), 2, axis=-1)
        xla_k = np.asarray(jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(dtype))
        differ = int((np.asarray(new_k)[:, pos] != xla_k).sum())
        assert differ <= 2 + 0.01 * xla_k.size, f"{differ} of {xla_k.size} key elements"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", STEP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_step_kernel_matches_float64(shape, dtype, rng):
    check_step(rng, shape, dtype)


@pytest.mark.parametrize("splits,block_s", [(3, 16), (4, 32)])
@pytest.mark.parametrize("pos", [0, 40, 129])
def test_step_kernel_split_over_positions(splits, block_s, pos, rng):
    """Only split 0 writes the cache and starts from the new token; the others see positions
    below pos only (some none at all)."""
    check_step(rng, (2, 2, 8, 32, 130, pos), jnp.float32, splits=splits, block_s=block_s)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", STEP_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_step_kernel_with_qk_norm(shape, dtype, rng):
    """Qwen3's q/k RMSNorm inside the kernel: the result, the key written and the attention
    as the decoder's XLA norms followed by the rotation and attention."""
    check_step(rng, shape, dtype, qk_norm=True)


def test_step_kernel_with_qk_norm_split_over_positions(rng):
    """Every split normalizes its queries; only split 0 writes the normalized, rotated key."""
    check_step(rng, (2, 2, 8, 32, 130, 40), jnp.float32, qk_norm=True, splits=3, block_s=16)


def test_step_kernel_reads_nothing_at_or_past_pos(rng):
    """Cache entries at pos (overwritten) and past it (inf, nan) change nothing."""
    qkv, k, v, pos, cos, sin = step_inputs(rng, (1, 2, 8, 32, 100, 40), jnp.float32)
    want = decode_attention_step(qkv, k, v, pos, cos, sin)
    k = k.at[:, pos:].set(jnp.inf)
    v = v.at[:, pos:].set(jnp.nan)
    got = decode_attention_step(qkv, k, v, pos, cos, sin)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1][:, :pos + 1]), np.asarray(want[1][:, :pos + 1]))
    np.testing.assert_array_equal(np.asarray(got[2][:, :pos + 1]), np.asarray(want[2][:, :pos + 1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_step_kernel_lowers_to_one_triton_call(qk_norm, dtype):
    """For CUDA (lowered on any machine) the step is one Triton call whose cache outputs alias
    the cache operands, which follow the norm scales when they are given."""
    shapes = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in [
        ((1, 4, 10, 128), dtype), ((1, 192, 4, 128), dtype), ((1, 192, 4, 128), dtype),
        ((), jnp.int32), ((64,), jnp.float32), ((64,), jnp.float32), ((128,), jnp.bfloat16),
        ((128,), jnp.bfloat16)]]

    def step(qkv, cache_k, cache_v, pos, cos, sin, q_norm, k_norm):
        norms = {"q_norm": q_norm, "k_norm": k_norm} if qk_norm else {}
        return decode_attention_step(qkv, cache_k, cache_v, pos, cos, sin, splits=1,
                                     interpret=False, **norms)

    text = jax.jit(step).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@__gpu$xla.gpu.triton" in calls[0]
    first_cache = 6 if qk_norm else 4
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert aliases == [("1", str(first_cache)), ("2", str(first_cache + 1))]


def test_step_bad_inputs():
    cache = jnp.zeros((1, 16, 2, 32), jnp.float32)
    qkv = jnp.zeros((1, 2, 6, 32), jnp.float32)
    half = jnp.zeros((16,), jnp.float32)
    with pytest.raises(ValueError, match=r"qkv must be \[B, KVH, G \+ 2, D\] with G >= 1"):
        decode_attention_step(jnp.zeros((1, 2, 2, 32)), cache, cache, 0, half, half)
    with pytest.raises(ValueError, match=r"head_dim 16 is below 32"):
        decode_attention_step(jnp.zeros((1, 2, 6, 16)), jnp.zeros((1, 16, 2, 16)),
                              jnp.zeros((1, 16, 2, 16)), 0, half[:8], half[:8])
    with pytest.raises(ValueError, match=r"qkv dtype bfloat16 differs from the cache's float32"):
        decode_attention_step(qkv.astype(jnp.bfloat16), cache, cache, 0, half, half)
    with pytest.raises(ValueError, match=r"cache_v .* differs from cache_k"):
        decode_attention_step(qkv, cache, cache[:, :8], 0, half, half)
    with pytest.raises(ValueError, match=r"cos \(32,\) and sin \(16,\) must be \[16\]"):
        decode_attention_step(qkv, cache, cache, 0, jnp.zeros((32,)), half)
    with pytest.raises(ValueError, match=r"does not match q"):
        decode_attention_step(qkv, jnp.zeros((1, 16, 3, 32)), jnp.zeros((1, 16, 3, 32)), 0, half, half)
    norm = jnp.ones((32,), jnp.float32)
    with pytest.raises(ValueError, match=r"q_norm given without k_norm"):
        decode_attention_step(qkv, cache, cache, 0, half, half, q_norm=norm)
    with pytest.raises(ValueError, match=r"k_norm given without q_norm"):
        decode_attention_step(qkv, cache, cache, 0, half, half, k_norm=norm)
    with pytest.raises(ValueError, match=r"k_norm must be a floating \[32\] array .* shape \(16,\)"):
        decode_attention_step(qkv, cache, cache, 0, half, half, q_norm=norm, k_norm=half)
    with pytest.raises(ValueError, match=r"q_norm must be a floating \[32\] array .* dtype int32"):
        decode_attention_step(qkv, cache, cache, 0, half, half, q_norm=norm.astype(jnp.int32),
                              k_norm=norm)
    with pytest.raises(ValueError, match=r"norm_eps must be a float >= 0, got -1e-06"):
        decode_attention_step(qkv, cache, cache, 0, half, half, q_norm=norm, k_norm=norm,
                              norm_eps=-1e-6)
    assert supported_step((1, 2, 6, 32), (1, 16, 2, 32), jnp.float32, jnp.float32) is None


def decode_logits(model, prompt, steps, mesh=None, tokens=None):
    """decode_step logits [steps, B, V] (f32) after prefill, and the tokens fed [steps, B]:
    ``tokens`` if given (so two models see the same inputs even where a near-tie would flip
    one's greedy choice), else each step's argmax."""
    graphdef, state = nnx.split(model)
    cfg = model.config
    sharding = None if mesh is None else llama.cache_sharding(mesh)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        cache = llama.init_cache(cfg, prompt.shape[0], prompt.shape[1] + steps,
                                 model.embed.embedding.dtype, sharding=sharding)
        logits, cache = llama.prefill(graphdef, state, jnp.asarray(prompt), cache)
        out, fed = [], []
        for i in range(steps):
            token = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if tokens is None
                     else jnp.asarray(tokens[i]))
            logits, cache = llama.decode_step(graphdef, state, token, cache, prompt.shape[1] + i)
            out.append(np.asarray(logits, np.float32))
            fed.append(np.asarray(token))
    return np.stack(out), np.stack(fed)


#: TINY_TP as Qwen3: q/k RMSNorm per head before the rotary embedding.
QWEN3_TINY_TP = dataclasses.replace(llama.TINY_TP, qk_norm=True, norm_eps=1e-6,
                                    architecture="Qwen3ForCausalLM")


@pytest.mark.parametrize("bits,cfg", [pytest.param(4, llama.TINY_TP, id="k4"),
                                      pytest.param(None, llama.TINY_TP, id="dense"),
                                      pytest.param(4, QWEN3_TINY_TP, id="qwen3-k4")])
def test_decoder_kernel_equals_xla_attention(bits, cfg, rng):
    """f32 model: the decoder's logits with the kernels (attention and norm="pallas") equal
    those with XLA's attention and norms to f32 rounding, on one device and tensor-parallel over
    2 (Explicit and Auto mesh axes). With Qwen3's q/k norm (random scales) the kernel normalizes
    the heads itself. Full f32 dots: on a GPU XLA's default f32 dot precision is TF32."""
    with jax.default_matmul_precision("highest"):
        check_decoder_kernel_equals_xla(cfg, bits, rng)


def build_f32(cfg, bits, mode, seed, mesh=None):
    """The f32 model of ``cfg`` (weights from ``seed``) with attention and norm ``mode``; q/k
    norm scales drawn away from their initial ones, so that a scale not applied shows."""
    model, _ = llama.build_model(cfg, bits=bits, param_dtype=jnp.float32, attention=mode, norm=mode,
                                 mesh=mesh)
    if cfg.qk_norm:
        draw = np.random.default_rng(seed)
        for layer in model.layers:
            for norm in (layer.attn.q_norm, layer.attn.k_norm):
                scale = jnp.asarray(draw.uniform(0.5, 2.0, cfg.head_dim), jnp.float32)
                norm.scale.set_value(jax.device_put(scale, norm.scale.get_value().sharding))
    return model


def check_decoder_kernel_equals_xla(cfg, bits, rng):
    prompt = rng.integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
    seed = int(rng.integers(1 << 31))
    want, tokens = decode_logits(build_f32(cfg, bits, "xla", seed), prompt, 3)
    atol = 1e-5 * np.abs(want).max()
    got, _ = decode_logits(build_f32(cfg, bits, "pallas", seed), prompt, 3, tokens=tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    if len(jax.devices()) < 2:
        return
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2,), ("tp",), axis_types=(axis_type,), devices=jax.devices()[:2])
        got, _ = decode_logits(build_f32(cfg, bits, "pallas", seed, mesh), prompt, 3, mesh,
                               tokens=tokens)
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def test_qwen3_step_has_nothing_between_projection_and_kernel():
    """With the kernel a Qwen3 single-token step normalizes q and k inside it: the step's jaxpr
    has no concatenate (the XLA path rejoins the normalized heads with one per layer, and the
    rotary embedding with two), only the attention kernel per layer."""
    cfg = QWEN3_TINY_TP
    counts = {}
    for mode in ("xla", "pallas"):
        model, _ = llama.build_model(cfg, bits=4, attention=mode)
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(llama.decode_step, static_argnums=0)(
            graphdef, state, jnp.zeros((1,), jnp.int32), llama.init_cache(cfg, 1, 16), 3)
        text = str(jaxpr)
        counts[mode] = (len(re.findall(r"\bconcatenate\[", text)), text.count("pallas_call["))
    assert counts == {"xla": (3 * cfg.n_layers, 0), "pallas": (0, cfg.n_layers)}


# -- on the GPU: the Triton-compiled kernel ----------------------------------------------------
# Long caches, split over positions by default (the last entry: kv_len, or pos for the step).
GPU_LONG = [(4, 8, 8, 128, 1000, 777), (1, 4, 8, 128, 5000, 4321)]


def check_step_qk_norm(rng, shape, dtype):
    check_step(rng, shape, dtype, qk_norm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("check,shape",
                         [(check_against_float64, s) for s in SHAPES + GPU_LONG]
                         + [(check_step, s) for s in STEP_SHAPES + GPU_LONG]
                         + [(check_step_qk_norm, s) for s in STEP_SHAPES + GPU_LONG],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else
                         {check_against_float64: "attention", check_step: "step",
                          check_step_qk_norm: "step-qk-norm"}[v])
def test_gpu_kernels_match_float64(check, shape, dtype, rng):
    assert jax.default_backend() == "gpu"
    check(rng, shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [pytest.param(llama.TINY_TP, id="llama"),
                                 pytest.param(QWEN3_TINY_TP, id="qwen3")])
def test_gpu_auto_takes_the_kernel(cfg, rng):
    """On a GPU "auto" compiles single-token steps with the Triton kernels, and the bf16 decoder's
    logits agree with XLA's attention and norms to bf16 rounding (both fed the same tokens);
    Qwen3's q/k norm inside the attention kernel."""
    model, _ = llama.build_model(cfg, bits=4, attention="auto")
    graphdef, state = nnx.split(model)
    cache = llama.init_cache(cfg, 1, 16)
    hlo = llama.decode_step.lower(graphdef, state, jnp.zeros((1,), jnp.int32), cache, 3).as_text()
    assert "triton" in hlo.lower()
    prompt = rng.integers(0, cfg.vocab_size, (1, 6)).astype(np.int32)
    want, tokens = decode_logits(llama.build_model(cfg, bits=4, attention="xla", norm="xla")[0],
                                 prompt, 3)
    got, _ = decode_logits(model, prompt, 3, tokens=tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_gpu_cache_updated_in_place(attention):
    """The compiled greedy loop writes the KV cache in place, through the kernel's aliased
    outputs as through XLA's dynamic-update-slice: no copy of a cache-shaped buffer."""
    cfg = llama.TINY_TP
    model, _ = llama.build_model(cfg, bits=4, attention=attention)
    graphdef, state = nnx.split(model)
    cache = llama.init_cache(cfg, 1, 24)
    lowered = llama.decode.lower(graphdef, state, jnp.zeros((1,), jnp.int32), cache, 8, 4)
    assert ("decode_attention_step" in lowered.as_text()) == (attention == "auto")
    text = lowered.compile().as_text()
    shape = f"bf16[1,24,{cfg.n_kv_heads},{cfg.head_dim}]"
    copies = [line for line in text.splitlines()
              if shape in line.split("=", 1)[-1].split("(", 1)[0] and " copy" in line]
    assert not copies, copies[:4]


_NO_COMMAND_BUFFER_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[2])
import test_decode_attention as t
from kbit_jax.examples import llama
from kbit_jax.models import decoder
cfg = llama.LlamaConfig(vocab_size=1024, dim=4096, n_layers=2, n_heads=32, n_kv_heads=8,
                        hidden_dim=8192)
prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 6)).astype(np.int32)
want, tokens = t.decode_logits(llama.build_model(cfg, bits=4, attention="xla", norm="xla")[0],
                               prompt, 4)
got, _ = t.decode_logits(llama.build_model(cfg, bits=4)[0], prompt, 4, tokens=tokens)
np.save(sys.argv[1], np.stack([want, got]))
"""


@pytest.mark.gpu
def test_gpu_kernels_without_command_buffers(tmp_path):
    """With XLA's command buffers off, kernels are launched one by one on the stream, where
    the kbit kernels (programmatic dependent launches there) let the next kernel start while
    they run: the Pallas kernels that read their outputs must still see them. A 4096-wide
    model (q/k/v and o products of ~10 us) decodes as XLA's attention and norms do."""
    out = tmp_path / "logits.npy"
    env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=")
    subprocess.run([sys.executable, "-c", _NO_COMMAND_BUFFER_SCRIPT, str(out),
                    os.path.dirname(os.path.abspath(__file__))], env=env, check=True, timeout=600)
    want, got = np.load(out)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * np.abs(want).max())
