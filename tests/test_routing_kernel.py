"""kbit_jax.flax.routing_kernel: MoE routing (softmax, top-k, renormalization, the sort by expert)
as one Pallas kernel, interpreted on the CPU, against the comparison and sort paths of
kbit_jax.flax.routing on logits with many exact ties, NaN and signed zeros; where it fits and
what "auto" lowers to; bad inputs; a tiny MoE decoder gives the same tokens with it. The `gpu`
test runs the compiled kernel on a GPU against the comparison path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from kbit_jax.flax import routing_kernel
from kbit_jax.flax.moe import KbitMoE, MoE
from kbit_jax.flax.routing import ROUTING_METHODS, route, route_sorted, sorted_rows
from kbit_jax.models import decoder

NAMES = ("weights", "ids", "order", "inverse", "sizes")


def xla_route_sorted(logits, k, normalize, method):
    """route + sorted_rows on one of the XLA paths ("compare" or "sort")."""
    weights, ids = route(logits, k, normalize, method=method)
    return (weights, ids, *sorted_rows(ids, logits.shape[1], method=method))


def weight_rtol(g, k, normalize):
    """The kernel's bound on its weights (module docstring): the two exps (2 ulp each) and
    roundings, the k-term sum's order; unnormalized, the G-term sum's order."""
    return ((k if normalize else g) + 8) * 2.0**-23


def tied_logits(rng, t, g, dtype):
    """Logits on a grid of 1/16 (exact in bf16) with every third expert a copy of another:
    exact ties, and distinct values far apart (no probability ties by rounding)."""
    x = np.round(rng.standard_normal((t, g)) * 48) / 16
    x[:, 1::3] = x[:, 0::3][:, : x[:, 1::3].shape[1]]
    return jnp.asarray(x, dtype)


def assert_same(got, want, g, k, normalize):
    for a, b, name in zip(got, want, NAMES):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        if name == "weights":
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=weight_rtol(g, k, normalize), atol=0)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("t,g,k,dtype", [
    (1, 8, 1, jnp.float32), (1, 512, 10, jnp.bfloat16), (3, 8, 2, jnp.float32), (5, 64, 4, jnp.float16),
    (8, 512, 10, jnp.bfloat16), (16, 512, 8, jnp.float32), (2, 100, 7, jnp.float32), (4, 1024, 8, jnp.bfloat16)])
@pytest.mark.parametrize("normalize", [True, False])
def test_kernel_equals_compare_and_sort_paths(rng, t, g, k, dtype, normalize):
    logits = tied_logits(rng, t, g, dtype)
    got = jax.jit(lambda x: route_sorted(x, k, normalize, method="kernel"))(logits)
    for method in ("compare", "sort"):
        want = jax.jit(lambda x: xla_route_sorted(x, k, normalize, method))(logits)
        assert_same(got, want, g, k, normalize)
    weights, ids = route(logits, k, normalize, method="kernel")
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(got[1]))


def test_kernel_signed_zeros_nan_and_infinities(rng):
    """Rows whose softmax ties at exact zeros, has +-0.0 logits, +inf (NaN probabilities where
    the infinities are), a NaN logit, and -inf logits: the comparison path's ids and sorted rows."""
    x = rng.standard_normal((6, 16)).astype(np.float32)
    x[0] = -np.inf
    x[0, [3, 9]] = 0.0                    # two experts, the rest exactly 0 probability
    x[1, ::2], x[1, 1::2] = 0.0, -0.0     # +0 and -0 logits: equal probabilities
    x[2, 5] = np.inf
    x[3, 7] = np.nan
    x[4, [2, 11]] = np.inf
    x[5] = -200.0
    x[5, 0] = 200.0                       # exp underflows to 0 for all others
    logits = jnp.asarray(x)
    for normalize in (True, False):
        got = route_sorted(logits, 5, normalize, method="kernel")
        want = xla_route_sorted(logits, 5, normalize, "compare")
        for a, b, name in zip(got[1:], want[1:], NAMES[1:]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        np.testing.assert_array_equal(np.isnan(np.asarray(got[0])), np.isnan(np.asarray(want[0])))
        finite = ~np.isnan(np.asarray(want[0]))
        np.testing.assert_allclose(np.asarray(got[0])[finite], np.asarray(want[0])[finite],
                                   rtol=weight_rtol(16, 5, normalize), atol=0)


def test_where_it_fits():
    """Batch 16 at 512 experts (8 per token), batch 8 at 1024 or with 10 per token; not past."""
    assert routing_kernel.supported(16, 512, 8) is None
    assert routing_kernel.supported(8, 1024, 10) is None
    assert routing_kernel.supported(1, 8192, 10) is None
    assert "logits' tile [32, 512]" in routing_kernel.supported(17, 512, 8)
    assert "logits' tile [1, 16384]" in routing_kernel.supported(1, 16384, 10)
    assert "sort's tile [256, 16, 16]" in routing_kernel.supported(16, 512, 10)
    assert "k <= G" in routing_kernel.supported(1, 8, 9)


def lowered(f, *args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_auto_takes_the_kernel_on_gpus_where_it_fits():
    """"auto" lowers for CUDA to the kernel (no sort, no scatter, no XLA softmax) where it fits,
    to the XLA paths past it and on the CPU; "compare" never takes it."""
    f = lambda x: route_sorted(x, 10, True)  # noqa: E731
    cuda = lowered(f, jnp.zeros((1, 512), jnp.bfloat16), platform="cuda")
    assert "moe_route_sorted" in cuda and "stablehlo.exponential" not in cuda
    assert "moe_route_sorted" not in lowered(f, jnp.zeros((32, 512), jnp.bfloat16), platform="cuda")
    assert "moe_route_sorted" not in lowered(f, jnp.zeros((1, 512), jnp.bfloat16), platform="cpu")
    compare = lambda x: route_sorted(x, 10, True, method="compare")  # noqa: E731
    assert "moe_route_sorted" not in lowered(compare, jnp.zeros((1, 512)), platform="cuda")
    assert "moe_route_sorted" in lowered(lambda x: route(x, 10, True), jnp.zeros((1, 512)), platform="cuda")
    # Triton's lowering (in Python, no GPU needed) takes every tile shape and dtype
    for t, g, k, dtype in ((16, 512, 8, jnp.float32), (8, 1024, 10, jnp.bfloat16), (3, 100, 7, jnp.float16),
                           (1, 8, 1, jnp.float32)):
        for normalize in (True, False):
            kernel = lambda x: route_sorted(x, k, normalize)  # noqa: E731
            assert "moe_route_sorted" in lowered(kernel, jnp.zeros((t, g), dtype), platform="cuda")


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"logits must be a float \[T, G\] array, got \(512,\)"):
        routing_kernel.route_sorted(jnp.zeros((512,)), 10, True)
    with pytest.raises(ValueError, match=r"logits must be a float \[T, G\] array, got \(1, 8\) int32"):
        routing_kernel.route_sorted(jnp.zeros((1, 8), jnp.int32), 2, True)
    with pytest.raises(ValueError, match=r"k must be an int, got True"):
        routing_kernel.route_sorted(jnp.zeros((1, 8)), True, True)
    with pytest.raises(ValueError, match=r"logits \(1, 8\) with k=9: .*1 <= k <= G"):
        route_sorted(jnp.zeros((1, 8)), 9, True, method="kernel")
    with pytest.raises(ValueError, match=r"logits \(64, 512\) with k=10: the logits' tile"):
        route_sorted(jnp.zeros((64, 512)), 10, True, method="kernel")
    with pytest.raises(ValueError, match=r"method must be one of \('auto', 'compare', 'sort', 'kernel'\), got 'fast'"):
        route_sorted(jnp.zeros((1, 8)), 2, True, method="fast")
    with pytest.raises(ValueError, match=r"routing must be one of .*'kernel'\), got 'fast'"):
        MoE(64, 32, 8, 2, routing="fast", rngs=nnx.Rngs(0))
    assert ROUTING_METHODS == ("auto", "compare", "sort", "kernel")


@pytest.mark.parametrize("bits", [None, 4], ids=["dense", "k4"])
def test_tiny_moe_decoder_same_tokens(bits):
    """The tiny MoE decoder (2 of 8 experts per token) greedy-decodes the same tokens with the
    kernel's routing as with the comparison path; the quantized blocks keep the routing."""
    cfg = decoder.CONFIGS["tiny-moe"]
    prompt = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    tokens = {}
    for routing in ("kernel", "compare"):
        model, _ = decoder.build_model(cfg, bits=bits, param_dtype=jnp.float32, moe_routing=routing)
        block = model.layers[cfg.moe_layers[0]].mlp
        assert isinstance(block, KbitMoE if bits else MoE) and block.routing == routing
        tokens[routing] = np.asarray(decoder.generate(model, prompt, 4))
    np.testing.assert_array_equal(tokens["kernel"], tokens["compare"])


@pytest.mark.gpu
@pytest.mark.parametrize("t,g,k", [(1, 512, 10), (4, 512, 10), (8, 512, 10), (16, 512, 8), (1, 64, 4),
                                   (8, 128, 8), (3, 100, 7), (8, 1024, 8)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_kernel_on_gpu_equals_compare_path(rng, t, g, k, normalize, dtype):
    """The compiled kernel on the GPU against the comparison path compiled by XLA on the GPU:
    exact ties (grid logits) and continuous random logits (bf16 or f32)."""
    gpu = jax.devices("gpu")[0]
    for logits in (tied_logits(rng, t, g, dtype), jnp.asarray(rng.standard_normal((t, g)) * 3, dtype)):
        logits = jax.device_put(logits, gpu)
        got = jax.jit(lambda x: route_sorted(x, k, normalize, method="kernel"))(logits)
        want = jax.jit(lambda x: xla_route_sorted(x, k, normalize, "compare"))(logits)
        assert_same(got, want, g, k, normalize)
        auto = jax.jit(lambda x: route_sorted(x, k, normalize))(logits)
        assert_same(auto, got, g, k, normalize)


def test_kernel_under_a_mesh_and_inside_shard_map(rng):
    """Under a mesh the kernel runs on every device alike (replicated in and out), also when
    called inside a shard_map over the mesh's axes: the one-device results."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    logits = tied_logits(rng, 2, 64, jnp.float32)
    want = route_sorted(logits, 4, True, method="kernel")
    with jax.set_mesh(mesh):
        got = jax.jit(lambda x: route_sorted(x, 4, True, method="kernel"))(logits)
        inner = jax.jit(jax.shard_map(lambda x: route_sorted(x, 4, True, method="kernel"), mesh=mesh,
                                      in_specs=P(), out_specs=P(), check_vma=False))(logits)
    for result in (got, inner):
        for a, b, name in zip(result, want, NAMES):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
