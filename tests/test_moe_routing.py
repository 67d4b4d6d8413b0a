"""kbit_jax.flax.routing: the comparison paths of top-k and of the expert sort against the sort
formulation (lax.top_k, a stable argsort and scatters, written here as the oracle), on random
values with many ties, from one pair to past COMPARE_LIMIT, over 8 to 512 experts; which path
"auto" lowers to on a GPU (lowered for CUDA, no GPU needed) and on the CPU."""

from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from jax.sharding import AxisType

from kbit_jax.flax.moe import KbitMoE, MoE
from kbit_jax.flax.routing import COMPARE_LIMIT, route, sorted_rows, sorted_tokens, top_k

METHODS = ["compare", "auto"]


def lowered(f, *args, platform):
    return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def sorts(text):
    """Whether lowered StableHLO holds a sort, a top-k (a sort on GPUs) or a scatter."""
    return any(op in text for op in ("stablehlo.sort", "chlo.top_k", "stablehlo.scatter"))


def oracle_sorted_rows(ids, num_experts):
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, inverse, sizes


def oracle_route(logits, k, normalize):
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def tied(rng, shape, levels):
    """float32 values with only ``levels`` distinct values: many exact ties."""
    return jnp.asarray(rng.integers(0, levels, shape).astype(np.float32) / levels - 0.5)


@pytest.mark.parametrize("t,g,k", [(1, 8, 1), (3, 8, 2), (5, 64, 4), (1, 512, 10), (8, 512, 10),
                                   (9, 512, 10), (2, 128, 8)])
@pytest.mark.parametrize("levels", [2, 7, 1 << 20])
@pytest.mark.parametrize("method", METHODS)
def test_top_k_equals_lax_top_k(rng, t, g, k, levels, method):
    x = tied(rng, (t, g), levels)
    values, ids = jax.jit(lambda x: top_k(x, k, method=method))(x)
    want_values, want_ids = jax.lax.top_k(x, k)
    assert ids.dtype == jnp.int32 and values.shape == (t, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32))


def test_top_k_signed_zero_and_nan(rng):
    """-0.0 ranks below +0.0 and NaN above +inf (lax.top_k's order); NaN rows still give k
    distinct ids in range."""
    x = jnp.asarray([[0.0, -0.0, 1.0, -1.0, -0.0, 0.0, -2.0, 3.0]], jnp.float32)
    values, ids = top_k(x, 8, method="compare")
    want_values, want_ids = jax.lax.top_k(x, 8)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32))
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32).at[0, 3].set(jnp.nan).at[1].set(jnp.nan)
    _, ids = top_k(x, 5, method="compare")
    ids = np.asarray(ids)
    assert ids[0, 0] == 3
    assert all(len(set(row)) == 5 and row.min() >= 0 and row.max() < 16 for row in ids)


@pytest.mark.parametrize("n_tokens,k,g", [(1, 1, 8), (1, 10, 512), (8, 10, 512), (7, 3, 8), (40, 8, 64),
                                          (181, 8, 8), (410, 10, 8), (100, 4, 512)])
@pytest.mark.parametrize("method", METHODS)
def test_sorted_rows_equals_stable_argsort(rng, n_tokens, k, g, method):
    """Ids from a few experts (many ties) and from all; n * max(n, G) on both sides of
    COMPARE_LIMIT (n = 1448 is the largest square under it, 4100 is past it)."""
    for used in (min(3, g), g):
        ids = jnp.asarray(rng.integers(0, used, (n_tokens, k)) * (g // used), jnp.int32)
        got = jax.jit(lambda ids: sorted_rows(ids, g, method=method))(ids)
        want = oracle_sorted_rows(ids, g)
        for a, b, name in zip(got, want, ("order", "inverse", "sizes")):
            assert a.dtype == jnp.int32 and a.shape == b.shape, name
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_auto_compares_on_gpus_within_the_limit():
    """"auto" lowers to comparisons for CUDA while the grid is within COMPARE_LIMIT (largest
    n * n: 1448^2; top-k at 512 experts: 8 tokens), to the sort past it and on the CPU."""
    assert 1448 * 1448 <= COMPARE_LIMIT < 1449 * 1449 and 8 * 512 * 512 <= COMPARE_LIMIT < 9 * 512 * 512
    rows = lambda ids: sorted_rows(ids, 8)  # noqa: E731
    assert not sorts(lowered(rows, jnp.zeros((1448,), jnp.int32), platform="cuda"))
    assert sorts(lowered(rows, jnp.zeros((1449,), jnp.int32), platform="cuda"))
    assert sorts(lowered(rows, jnp.zeros((10,), jnp.int32), platform="cpu"))
    pick = lambda x: top_k(x, 10)  # noqa: E731
    assert not sorts(lowered(pick, jnp.zeros((8, 512)), platform="cuda"))
    assert sorts(lowered(pick, jnp.zeros((9, 512)), platform="cuda"))
    assert sorts(lowered(pick, jnp.zeros((1, 512)), platform="cpu"))
    for method in ("compare", "sort"):
        for platform in ("cpu", "cuda"):
            text = lowered(lambda x: top_k(x, 10, method=method), jnp.zeros((9, 512)), platform=platform)
            assert sorts(text) == (method == "sort"), (method, platform)


@pytest.mark.parametrize("ep", [False, True], ids=["one_device", "expert_parallel"])
@pytest.mark.parametrize("block", ["MoE", "KbitMoE"])
def test_moe_blocks_route_without_sorts_on_gpus(rng, block, ep):
    """A decode-sized step of either block lowered for CUDA has no sort and no scatter, also
    with its experts under shard_map over 8 devices."""
    if ep and len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    moe = MoE(64, 32, 16, 2, method="ragged", rngs=nnx.Rngs(int(rng.integers(2**31))))
    m = KbitMoE.from_dense(moe) if block == "KbitMoE" else moe
    m.ep_axis = "ep" if ep else None
    graphdef, state = nnx.split(m)
    f = lambda s, x: nnx.merge(graphdef, s)(x)  # noqa: E731
    x = jnp.zeros((3, 64))
    with jax.set_mesh(jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))) if ep else nullcontext():
        cuda, cpu = (lowered(f, state, x, platform=p) for p in ("cuda", "cpu"))
    assert ("manual" in cuda) == ep                 # shard_map's manual computation
    assert not sorts(cuda)
    assert sorts(cpu)


@pytest.mark.parametrize("method", ["compare", "sort"])
def test_no_tokens(method):
    order, inverse, sizes = sorted_rows(jnp.zeros((0, 2), jnp.int32), 8, method=method)
    assert order.shape == inverse.shape == (0,) and np.asarray(sizes).tolist() == [0] * 8
    weights, ids = route(jnp.zeros((0, 8)), 2, True, method=method)
    assert weights.shape == ids.shape == (0, 2)


def test_bad_method():
    with pytest.raises(ValueError, match=r"method must be one of \('auto', 'compare', 'sort'\), got 'fast'"):
        top_k(jnp.zeros((2, 8)), 2, method="fast")
    with pytest.raises(ValueError, match="method must be one of"):
        sorted_rows(jnp.zeros((2, 2), jnp.int32), 8, method=None)


@pytest.mark.parametrize("t", [1, 5])
def test_sorted_tokens(rng, t):
    k = 3
    tokens = jnp.asarray(rng.standard_normal((t, 16)), jnp.bfloat16)
    order, _, _ = sorted_rows(jnp.asarray(rng.integers(0, 4, (t, k)), jnp.int32), 4, method="compare")
    np.testing.assert_array_equal(np.asarray(sorted_tokens(tokens, order, k)),
                                  np.asarray(tokens[order // k]))


@pytest.mark.parametrize("t,g,k", [(1, 512, 10), (8, 512, 10), (9, 512, 10), (6, 8, 2), (4, 64, 4)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("method", METHODS)
def test_route_equals_softmax_top_k(rng, t, g, k, normalize, dtype, method):
    """Ids identical. The weights: the softmax is compiled in another program than the oracle's
    (which may add its G exponentials in another order: each order within (G - 1) 2^-24 of the
    exact sum, so within G * 2^-23 of each other). Renormalized, that common factor cancels and
    what is left is the order of the k-term sum ((k - 1) 2^-24 each way) and three roundings:
    within (k + 2) * 2^-23."""
    logits = jnp.asarray(rng.standard_normal((t, g)) * 3, dtype)
    logits = logits.at[:, 1::3].set(logits[:, 0::3][:, : logits[:, 1::3].shape[1]])   # exact ties
    weights, ids = jax.jit(lambda x: route(x, k, normalize, method=method))(logits)
    want_weights, want_ids = oracle_route(logits, k, normalize)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    rtol = (k + 2) * 2.0**-23 if normalize else g * 2.0**-23
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=rtol, atol=0)
