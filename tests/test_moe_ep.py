"""Expert-parallel MoE decode as benchmarks/bench_sharded.py --moe runs it, on simulated CPU
devices: experts spread over 2, 4 and 8 devices through shard_map give the one-device result
(within the reassociation of the final sums), with one all-reduce per layer and no all-gather
(the experts never move)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kbit_jax as kj
from kbit_jax.sharding import COLLECTIVES, collective_counts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_sharded  # noqa: E402

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8")

CFG = bench_sharded.MOE_CONFIGS["tiny"]
U32 = float(jnp.finfo(jnp.float32).eps) / 2


def ep_mesh(ep):
    return jax.sharding.Mesh(np.array(jax.devices()[:ep]), ("ep",))


def layer_terms(x, router, gate_up, down, top_k):
    """The one-device layer's weighted expert outputs ``[B, top_k, K]`` (their sum is the
    layer's output), each token's j-th expert in one ragged_dot per j."""
    probs = jax.nn.softmax(jnp.dot(x, router, preferred_element_type=jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    weights = np.asarray(weights / jnp.sum(weights, axis=-1, keepdims=True), np.float64)
    ids = np.asarray(ids)
    terms = np.zeros((x.shape[0], top_k, x.shape[1]), np.float64)
    for j in range(top_k):
        order = np.argsort(ids[:, j], kind="stable")
        sizes = jnp.asarray(np.bincount(ids[:, j], minlength=router.shape[1]).astype(np.int32))
        out = kj.ragged_dot(kj.ragged_dot(x[order], gate_up, sizes, glu="silu"), down, sizes)
        terms[order, j] = weights[order, j, None] * np.asarray(out, np.float64)
    return terms


@pytest.mark.parametrize("ep", [2, 8])
def test_expert_parallel_layer_equals_one_device(rng, ep):
    cfg = {**CFG, "layers": 1}
    key = jax.random.key(int(rng.integers(0, 2 ** 31)))
    x = jnp.asarray(rng.standard_normal((8, cfg["hidden"])).astype(np.float32))
    routers, layers = bench_sharded.random_experts(key, cfg, 4)
    one = np.asarray(bench_sharded.moe_step_fn(cfg)(x, routers, layers) - x, np.float64)
    terms = layer_terms(x, routers[0], *layers[0], cfg["top_k"])
    # The one-device layer is the sum of its terms (f32 sums of top_k terms), read back as
    # (x + layer) - x: two more f32 roundings of |x| + |layer|.
    magnitude = np.abs(terms).sum(axis=1)
    residual = 4 * U32 * (np.abs(np.asarray(x, np.float64)) + magnitude)
    bound = 2 * (cfg["top_k"] + ep) * U32 * magnitude + np.finfo(np.float32).tiny
    assert np.all(np.abs(one - terms.sum(axis=1)) <= bound + residual)

    mesh = ep_mesh(ep)
    routers_ep, layers_ep = bench_sharded.random_experts(key, cfg, 4, mesh)
    assert layers_ep[0][0].planes.sharding.spec == P("ep", None, None, None)
    step = bench_sharded.moe_step_fn(cfg, mesh)
    x_ep = jax.device_put(x, NamedSharding(mesh, P()))
    y = np.asarray(step(x_ep, routers_ep, layers_ep) - x_ep, np.float64)
    # Each device sums its own experts' terms, the psum adds the devices': the same terms
    # in another order, then the residual add (both rounded in f32).
    assert np.all(np.abs(y - one) <= 2 * (bound + residual))


def test_expert_parallel_step_collectives_and_layers(rng):
    cfg, ep = {**CFG, "layers": 3}, 4
    key = jax.random.key(int(rng.integers(0, 2 ** 31)))
    x = jnp.asarray(rng.standard_normal((4, cfg["hidden"])).astype(np.float32))
    ref = np.asarray(bench_sharded.moe_step_fn(cfg)(x, *bench_sharded.random_experts(key, cfg, 2)))
    mesh = ep_mesh(ep)
    routers, layers = bench_sharded.random_experts(key, cfg, 2, mesh)
    step = bench_sharded.moe_step_fn(cfg, mesh)
    x_ep = jax.device_put(x, NamedSharding(mesh, P()))
    hlo = step.lower(x_ep, routers, layers).compile().as_text()
    # One all-reduce per layer ([batch, hidden]), nothing else: no expert weight moves.
    assert collective_counts(hlo) == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": cfg["layers"]}
    y = np.asarray(step(x_ep, routers, layers))
    # Three layers: the per-layer reassociation (f32 ulps) carried through; routing is the
    # same unless a top-k tie is within those ulps, which random data does not produce.
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
