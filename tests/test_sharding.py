"""Sharded use of the kbit primitives on 8 simulated CPU devices.

Numerics against the unsharded result, and the compiled HLO: no all-gather anywhere (so no
weight leaf is ever gathered), no collective for data- or column-parallel layouts, exactly
one all-reduce for row-parallel. Plus shard_map (check_vma, grads), pmap and bad specs.
"""

import os
import re

# Needs 8 devices; must be set before jax initializes (tests/conftest.py does the same).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import kbit_jax as kj  # noqa: E402
from kbit_jax import reference, sharding as ks  # noqa: E402

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="needs 8 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8")

AXIS_TYPES = [pytest.param(AxisType.Auto, id="auto"), pytest.param(AxisType.Explicit, id="explicit")]
from kbit_jax.sharding import COLLECTIVES, collective_counts as collectives  # noqa: E402


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def all_reduce_reducers(hlo: str) -> list[list[str]]:
    """The body lines of every all-reduce's reduction computation in an HLO text."""
    bodies = []
    for name in re.findall(r"all-reduce\(.*?to_apply=(%[\w.\-]+)", hlo):
        start = hlo.index(f"\n{name} (") + 1
        bodies.append(hlo[start:hlo.index("\n}", start)].splitlines()[1:])
    return bodies


def mesh_1d(axis_type, name="tp"):
    return jax.make_mesh((8,), (name,), axis_types=(axis_type,))


def mesh_2d(axis_type):
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.fixture(scope="module")
def weights():
    """One 4-bit weight per (K, N) used below, quantized once (module scope keeps it fast)."""
    r = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    out = {}
    for k, n in ((512, 256), (256, 512), (256, 64)):
        w = jnp.asarray(r.standard_normal((k, n)).astype(np.float32))
        out[(k, n)] = kj.quantize(w, 4)
    return out


def run(mesh, f, *args):
    """jit(f)(*args) under the mesh, plus the collectives of its compiled program."""
    with jax.set_mesh(mesh):
        y = jax.jit(f)(*args)
        text = compiled(f, *args)
    return y, collectives(text)


def assert_close(y, ref, rtol=2e-5):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    scale = np.abs(ref).max() + 1e-30
    np.testing.assert_allclose(y, ref, atol=rtol * scale, rtol=0)


NONE = dict.fromkeys(COLLECTIVES, 0)
ONE_ALL_REDUCE = {**NONE, "all-reduce": 1}


# -- jit with NamedSharding inputs -------------------------------------------------------------
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_data_parallel(weights, axis_type, rng):
    wq = weights[(256, 512)]
    mesh = mesh_1d(axis_type, "dp")
    x = jnp.asarray(rng.standard_normal((8, 3, 256)), jnp.float32)    # [batch, seq, K]
    y, coll = run(mesh, kj.matmul, put(x, mesh, P("dp")), ks.shard_weight(wq, mesh, P()))
    assert_close(y, kj.matmul(x, wq))
    assert coll == NONE, coll


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_column_parallel(weights, axis_type, rng):
    wq = weights[(256, 512)]
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    y, coll = run(mesh, kj.matmul, put(x, mesh, P()), ks.column_parallel(wq, mesh))
    assert_close(y, kj.matmul(x, wq))
    assert y.sharding.spec == P(None, "tp")
    assert coll == NONE, coll


@pytest.mark.parametrize("x_spec", [P(None, "tp"), P()], ids=["x_on_K", "x_replicated"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_row_parallel(weights, axis_type, x_spec, rng):
    wq = weights[(512, 256)]
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
    args = put(x, mesh, x_spec), ks.row_parallel(wq, mesh)
    y, coll = run(mesh, kj.matmul, *args)
    assert_close(y, kj.matmul(x, wq))
    assert coll == ONE_ALL_REDUCE, coll
    # The reduction is a plain add of the two parameters: a sharding annotation inside it (the
    # local body traced under the caller's Explicit mesh) made XLA's GPU all-reduce abort.
    with jax.set_mesh(mesh):
        (reducer,) = all_reduce_reducers(compiled(kj.matmul, *args))
    assert len(reducer) == 3 and " add(" in reducer[-1] and "custom-call" not in "".join(reducer), reducer


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_glu_column_and_row_parallel(weights, axis_type, rng):
    """A GLU product: column-parallel gives each device whole gate/up pairs and needs no
    collective (output sharded on N / 2); with K sharded the shards' sums are all-reduced once
    and gated after."""
    wq = weights[(256, 512)]
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    gated = lambda x, w: kj.matmul(x, w, glu="silu")  # noqa: E731
    y, coll = run(mesh, gated, put(x, mesh, P()), ks.column_parallel(wq, mesh))
    assert y.shape == (16, 256) and y.sharding.spec == P(None, "tp")
    assert_close(y, gated(x, wq))
    assert coll == NONE, coll
    y, coll = run(mesh, gated, put(x, mesh, P(None, "tp")), ks.row_parallel(wq, mesh))
    assert_close(y, gated(x, wq), rtol=1e-4)
    assert coll == ONE_ALL_REDUCE, coll


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_2d_mesh_data_and_tensor_parallel(weights, axis_type, rng):
    """dp x tp: column-parallel then row-parallel (an MLP): one all-reduce in total."""
    w1, w2 = weights[(256, 512)], weights[(512, 256)]
    mesh = mesh_2d(axis_type)
    x = jnp.asarray(rng.standard_normal((8, 4, 256)), jnp.bfloat16)

    def col(x, w1):
        return kj.matmul(x, w1)

    def mlp(x, w1, w2):
        return kj.matmul(jax.nn.relu(kj.matmul(x, w1)), w2)

    xs, w1s, w2s = put(x, mesh, P("dp")), ks.column_parallel(w1, mesh), ks.row_parallel(w2, mesh)
    h, coll = run(mesh, col, xs, w1s)
    assert h.sharding.spec == P("dp", None, "tp")
    assert coll == NONE, coll
    assert_close(h, kj.matmul(x, w1), rtol=1e-2)

    y, coll = run(mesh, mlp, xs, w1s, w2s)
    assert coll == ONE_ALL_REDUCE, coll
    ref = kj.matmul(jax.nn.relu(kj.matmul(x, w1)), w2)
    assert_close(y, ref, rtol=2e-2)


def test_2d_weight_sharding(weights, rng):
    """W sharded on K over dp and on N over tp: output sharded on N, one all-reduce over dp."""
    wq = weights[(512, 256)]
    mesh = mesh_2d(AxisType.Auto)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
    y, coll = run(mesh, kj.matmul, put(x, mesh, P(None, "dp")),
                  ks.shard_weight(wq, mesh, P("dp", "tp")))
    assert_close(y, kj.matmul(x, wq))
    assert coll == ONE_ALL_REDUCE, coll


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_stacked_weights_sharded_on_batch(axis_type, rng):
    """Experts [E, K, N] sharded on E with x [E, M, K] sharded on E: no collective."""
    w = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.float32)
    wq = kj.quantize(w, 3)
    mesh = mesh_1d(axis_type, "ep")
    x = jnp.asarray(rng.standard_normal((8, 5, 64)), jnp.float32)
    y, coll = run(mesh, kj.matmul, put(x, mesh, P("ep")), ks.shard_weight(wq, mesh, P("ep", None, None)))
    assert_close(y, kj.matmul(x, wq))
    assert coll == NONE, coll


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_scan_over_stacked_tensor_parallel_layers(axis_type, rng):
    """A decoder-style scan over stacked (column, row) layer pairs: one all-reduce (in the
    loop body), no gather, carry stays replicated."""
    w1 = kj.quantize(jnp.asarray(rng.standard_normal((2, 128, 256)), jnp.float32), 4)
    w2 = kj.quantize(jnp.asarray(rng.standard_normal((2, 256, 128)) * 0.05, jnp.float32), 4)
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)

    def body(h, w):
        return h + kj.matmul(jax.nn.relu(kj.matmul(h, w[0])), w[1]), None

    def net(x, w1, w2):
        return jax.lax.scan(body, x, (w1, w2))[0]

    y, coll = run(mesh, net, put(x, mesh, P()), ks.shard_weight(w1, mesh, P(None, None, "tp")),
                  ks.shard_weight(w2, mesh, P(None, "tp", None)))
    assert_close(y, net(x, w1, w2), rtol=1e-4)
    assert coll == ONE_ALL_REDUCE, coll


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_eager_and_vmap_on_sharded_inputs(weights, axis_type, rng):
    wq = weights[(512, 256)]
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((2, 16, 512)), jnp.float32)
    xs, ws = put(x, mesh, P(None, None, "tp")), ks.row_parallel(wq, mesh)
    with jax.set_mesh(mesh):
        assert_close(kj.matmul(xs[0], ws), kj.matmul(x[0], wq))             # eager
    y, coll = run(mesh, jax.vmap(kj.matmul, (0, None)), xs, ws)
    assert_close(y, kj.matmul(x, wq))
    assert coll == ONE_ALL_REDUCE, coll


@pytest.mark.parametrize("spec", [P(None, "tp"), P("tp", None)], ids=["on_N", "on_K"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_dequantize_stays_sharded(weights, axis_type, spec):
    wq = weights[(256, 512)]
    mesh = mesh_1d(axis_type)
    w, coll = run(mesh, lambda w: kj.dequantize(w, jnp.bfloat16), ks.shard_weight(wq, mesh, spec))
    np.testing.assert_array_equal(np.asarray(w, np.float32),
                                  np.asarray(kj.dequantize(wq, jnp.bfloat16), np.float32))
    assert w.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert coll == NONE, coll


@pytest.mark.parametrize("placed", [True, False], ids=["x_replicated", "x_unplaced"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_grad_column_parallel_jit(weights, axis_type, placed, rng):
    """grad w.r.t. x through a column-parallel matmul under sharded jit (x replicated on the
    mesh, or an array placed on no mesh)."""
    wq = weights[(256, 512)]
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(kj.matmul(x, w)))

    g, coll = run(mesh, jax.grad(loss), put(x, mesh, P()) if placed else x, ks.column_parallel(wq, mesh))
    assert_close(g, jax.grad(loss)(x, wq), rtol=1e-4)
    assert coll["all-gather"] == 0, coll


def gathered_sizes(f, mesh, *args) -> list[int]:
    """The element counts of the all-gathers in f's compiled program under the mesh."""
    with jax.set_mesh(mesh):
        shapes = ks.all_gather_shapes(compiled(f, *args))
    return [int(np.prod([int(d) for d in re.findall(r"\d+", s.split("[")[1])])) for s in shapes]


def assert_no_weight_gathered(f, mesh, args, wq):
    """No all-gather in f's program is as large as the weight's scales (its smallest sharded
    leaf): what the gradients may gather is the activations' cotangent and group sizes."""
    gathered = gathered_sizes(f, mesh, *args)
    assert max(gathered, default=0) < wq.scales.size, (gathered, wq.scales.size)


def _gradient_bound(value_and_bound_terms, terms: int, k: int, y_sum_bound: float):
    """The bound on |sharded - reference| for a float32 gradient that sums ``terms`` products
    whose absolute values sum to ``value_and_bound_terms`` (elementwise), through a loss
    sum(sin(y)) whose y (sums of ``k`` products, absolute sums at most ``y_sum_bound``) the two
    programs add in different orders: cos(y) moves by at most k eps y_sum_bound, and the
    gradient's own sum by at most terms eps of its absolute sum."""
    eps = float(np.finfo(np.float32).eps)
    return eps * (k * y_sum_bound + terms) * np.asarray(value_and_bound_terms)


def _abs_weight(wq):
    return jnp.abs(kj.dequantize(wq))


@pytest.mark.parametrize("x_spec", [P(None, "tp"), P()], ids=["x_on_K", "x_replicated"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_grad_row_parallel_jit(axis_type, x_spec, rng):
    """x's gradient through a row-parallel matmul under sharded jit: formed on K's shards, so
    an x replicated over the mesh gathers its [M, K] cotangent, never the weight."""
    k, n, m = 512, 256, 5
    wq = kj.quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), 4)
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(kj.matmul(x, w)))

    args = put(x, mesh, x_spec), ks.row_parallel(wq, mesh)
    g, _ = run(mesh, jax.grad(loss), *args)
    assert_no_weight_gathered(jax.grad(loss), mesh, args, wq)
    w_abs = _abs_weight(wq)
    bound = _gradient_bound(jnp.max(jnp.sum(w_abs, axis=-1)), n, k,
                            float(jnp.max(jnp.abs(x) @ w_abs)))
    expected = jax.grad(lambda x: jnp.sum(jnp.sin(jnp.matmul(x, kj.dequantize(wq), precision="highest"))))(x)
    np.testing.assert_array_less(np.abs(np.asarray(g) - np.asarray(expected)), bound)


WEIGHT_GRAD_SPECS = [pytest.param(P(None, "tp"), id="on_N"), pytest.param(P("tp", None), id="on_K")]


@pytest.mark.parametrize("layout", ["planes", "fragment"])
@pytest.mark.parametrize("spec", WEIGHT_GRAD_SPECS)
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_grad_wrt_codebook_and_tensor_scale_sharded_jit(axis_type, spec, layout, rng):
    """jax.grad(..., allow_int=True) w.r.t. a sharded KbitWeight under sharded jit: the
    codebook's and tensor_scale's gradients match jax.grad of the reference on unsharded
    inputs, and no weight leaf is gathered."""
    k, n, m = 256, 64, 5
    wq = kj.quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), 4, layout=layout)
    mesh = mesh_1d(axis_type)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(kj.matmul(x, w)))

    def ref_loss(codebook, tensor_scale, x):
        w = reference.dequantize(wq.planes, wq.scales, codebook, tensor_scale, layout=layout)
        return jnp.sum(jnp.sin(jnp.matmul(x, w, precision="highest")))

    grad = jax.grad(loss, argnums=1, allow_int=True)
    args = put(x, mesh, P()), ks.shard_weight(wq, mesh, spec)
    g, _ = run(mesh, grad, *args)
    assert_no_weight_gathered(grad, mesh, args, wq)
    expected = jax.grad(ref_loss, argnums=(0, 1))(wq.codebook, wq.tensor_scale, x)
    # The absolute sums: the same gradients with |x|, |codebook| and cos(y) -> 1 (scales >= 0).
    abs_terms = jax.grad(lambda cb, ts: jnp.sum(jnp.matmul(jnp.abs(x), reference.dequantize(
        wq.planes, wq.scales, cb, ts, layout=layout), precision="highest")),
        argnums=(0, 1))(jnp.abs(wq.codebook), wq.tensor_scale)
    y_sum_bound = float(jnp.max(jnp.abs(x) @ _abs_weight(wq)))
    for got, want, terms in zip((g.codebook, g.tensor_scale), expected, abs_terms):
        bound = _gradient_bound(terms, m * k * n, k, y_sum_bound)
        np.testing.assert_array_less(np.abs(np.asarray(got) - np.asarray(want)), bound + 1e-30)


RAGGED_SPECS = [pytest.param(P(None, None, "tp"), id="experts_on_N"),
                pytest.param(P("tp", None, None), id="experts_on_G"),
                pytest.param(P(None, "tp", None), id="experts_on_K")]


def _ragged_problem(rng, k=256, n=128, groups=8):
    wq = kj.quantize(jnp.asarray(rng.standard_normal((groups, k, n)), jnp.float32), 4)
    x = jnp.asarray(rng.standard_normal((13, k)), jnp.float32)
    # An empty expert and rows past the last group.
    sizes = rng.multinomial(11, np.ones(groups) / groups).astype(np.int32)
    sizes[1] = 0
    sizes[0] += 11 - sizes.sum()
    return wq, x, jnp.asarray(sizes)


@pytest.mark.parametrize("placed", [True, False], ids=["x_replicated", "x_unplaced"])
@pytest.mark.parametrize("spec", RAGGED_SPECS)
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_ragged_dot_grad_wrt_x_sharded_jit(axis_type, spec, placed, rng):
    """x's gradient through the grouped expert product with sharded experts under sharded jit
    against jax.grad of the reference on unsharded inputs; no weight leaf gathered."""
    wq, x, sizes = _ragged_problem(rng)
    mesh = mesh_1d(axis_type)

    def loss(x, w):
        return jnp.sum(jnp.sin(kj.ragged_dot(x, w, sizes)))

    def ref_loss(x):
        return jnp.sum(jnp.sin(reference.ragged_dot(x, wq.planes, wq.scales, wq.codebook,
                                                    wq.tensor_scale, sizes, layout=wq.layout)))

    args = put(x, mesh, P()) if placed else x, ks.shard_weight(wq, mesh, spec)
    g, _ = run(mesh, jax.grad(loss), *args)
    assert_no_weight_gathered(jax.grad(loss), mesh, args, wq)
    expected = jax.grad(ref_loss)(x)
    k, n = x.shape[1], wq.shape[-1]
    w_abs = _abs_weight(wq)                                           # [G, K, N]
    # Each row's gradient sums N products cos(y) W: absolute sums at most sum_n |W[g, k, n]|.
    bound = _gradient_bound(jnp.max(jnp.sum(w_abs, axis=-1)), n, k,
                            float(jnp.max(jnp.abs(x) @ jnp.max(w_abs, axis=0))))
    np.testing.assert_array_less(np.abs(np.asarray(g) - np.asarray(expected)), bound)


@pytest.mark.parametrize("spec", RAGGED_SPECS)
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_ragged_dot_grad_wrt_codebook_sharded_jit(axis_type, spec, rng):
    """The experts' codebook and tensor_scale gradients through the grouped product with
    sharded experts under sharded jit, against jax.grad of the reference on unsharded inputs."""
    wq, x, sizes = _ragged_problem(rng)
    mesh = mesh_1d(axis_type)

    def loss(x, w):
        return jnp.sum(jnp.sin(kj.ragged_dot(x, w, sizes)))

    def ref_loss(codebook, tensor_scale, x):
        return jnp.sum(jnp.sin(reference.ragged_dot(x, wq.planes, wq.scales, codebook,
                                                    tensor_scale, sizes, layout=wq.layout)))

    grad = jax.grad(loss, argnums=1, allow_int=True)
    args = put(x, mesh, P()), ks.shard_weight(wq, mesh, spec)
    g, _ = run(mesh, grad, *args)
    assert_no_weight_gathered(grad, mesh, args, wq)
    expected = jax.grad(ref_loss, argnums=(0, 1))(wq.codebook, wq.tensor_scale, x)
    abs_terms = jax.grad(lambda cb, ts: jnp.sum(reference.ragged_dot(
        jnp.abs(x), wq.planes, wq.scales, cb, ts, sizes, layout=wq.layout)),
        argnums=(0, 1))(jnp.abs(wq.codebook), wq.tensor_scale)
    k, n = x.shape[1], wq.shape[-1]
    y_sum_bound = float(jnp.max(jnp.abs(x) @ jnp.max(_abs_weight(wq), axis=0)))
    for got, want, terms in zip((g.codebook, g.tensor_scale), expected, abs_terms):
        bound = _gradient_bound(terms, x.shape[0] * k * n, k, y_sum_bound)
        np.testing.assert_array_less(np.abs(np.asarray(got) - np.asarray(want)), bound + 1e-30)


# -- shard_map and pmap ------------------------------------------------------------------------
def test_shard_map_column_parallel_grad(weights, rng):
    wq = weights[(256, 512)]
    mesh = mesh_1d(AxisType.Explicit)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    wspec = ks.weight_specs(wq, P(None, "tp"))

    @jax.shard_map(mesh=mesh, in_specs=(P(), wspec), out_specs=P(None, "tp"), check_vma=True)
    def layer(x, w):
        return kj.matmul(x, w)

    def loss_sharded(x, w):
        return jnp.sum(jnp.sin(layer(x, w)))

    def loss(x, w):
        return jnp.sum(jnp.sin(kj.matmul(x, w)))

    ws = ks.column_parallel(wq, mesh)
    with jax.set_mesh(mesh):
        y = jax.jit(layer)(x, ws)
        g = jax.jit(jax.grad(loss_sharded))(x, ws)
    assert_close(y, kj.matmul(x, wq))
    assert_close(g, jax.grad(loss)(x, wq), rtol=1e-4)


def test_shard_map_row_parallel_grad(weights, rng):
    wq = weights[(512, 256)]
    mesh = mesh_1d(AxisType.Auto)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.float32)
    wspec = ks.weight_specs(wq, P("tp", None))

    @jax.shard_map(mesh=mesh, in_specs=(P(None, "tp"), wspec), out_specs=P(), check_vma=True)
    def layer(x, w):
        return jax.lax.psum(kj.matmul(x, w), "tp")

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    ws = ks.row_parallel(wq, mesh)
    with jax.set_mesh(mesh):
        y = jax.jit(layer)(x, ws)
        g = jax.jit(jax.grad(loss(layer)))(x, ws)
        text = compiled(layer, x, ws)
    assert_close(y, kj.matmul(x, wq))
    assert_close(g, jax.grad(loss(kj.matmul))(x, wq), rtol=1e-4)
    assert collectives(text) == ONE_ALL_REDUCE


def test_shard_map_varying_output(weights, rng):
    """A result that varies over the mesh axis must come back from every device (not one)."""
    wq = weights[(256, 64)]
    mesh = mesh_1d(AxisType.Auto, "dp")
    x = jnp.asarray(rng.standard_normal((8, 3, 256)), jnp.float32)

    @jax.shard_map(mesh=mesh, in_specs=(P("dp"), ks.weight_specs(wq, P())), out_specs=P("dp"),
                   check_vma=True)
    def f(x, w):
        return kj.matmul(x, w)

    assert_close(jax.jit(f)(x, wq), kj.matmul(x, wq))


def test_pmap_stacked_weights(rng):
    w = jnp.asarray(rng.standard_normal((8, 64, 48)), jnp.float32)
    wq = kj.quantize(w, 4)
    x = jnp.asarray(rng.standard_normal((8, 3, 64)), jnp.float32)
    y = jax.pmap(kj.matmul)(x, wq)
    assert_close(y, kj.matmul(x, wq))
    g = jax.pmap(jax.grad(lambda x, w: jnp.sum(kj.matmul(x, w) ** 2)))(x, wq)
    assert_close(g, jax.grad(lambda x, w: jnp.sum(kj.matmul(x, w) ** 2))(x, wq), rtol=1e-4)


# -- unsharded behaviour is unchanged ----------------------------------------------------------
def test_unsharded_paths(weights, rng):
    wq = weights[(256, 64)]
    x = jnp.asarray(rng.standard_normal((2, 5, 256)), jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(kj.dequantize(wq), np.float64)
    assert_close(kj.matmul(x, wq), ref, rtol=1e-5)                       # eager
    assert_close(jax.jit(kj.matmul)(x, wq), ref, rtol=1e-5)              # jit, one device
    assert_close(jax.vmap(kj.matmul, (0, None))(x, wq), ref, rtol=1e-5)  # vmap over x
    g = jax.grad(lambda x: jnp.sum(kj.matmul(x, wq)))(x)
    assert_close(g, jnp.broadcast_to(jnp.sum(kj.dequantize(wq), 1), x.shape), rtol=1e-5)


def test_quantize_sharded_weight(rng):
    """quantize of an N-sharded dense weight: planes/scales come out sharded, no gather."""
    mesh = mesh_1d(AxisType.Auto)
    w = jnp.asarray(rng.standard_normal((128, 256)), jnp.float32)
    wq, _ = run(mesh, lambda w: kj.quantize(w, 4), put(w, mesh, P(None, "tp")))
    ref = kj.quantize(w, 4)
    np.testing.assert_array_equal(np.asarray(wq.planes), np.asarray(ref.planes))
    np.testing.assert_array_equal(np.asarray(wq.scales), np.asarray(ref.scales))
    assert wq.planes.sharding.spec[1] == "tp"
    text = compiled(lambda w: kj.quantize(w, 4), put(w, mesh, P(None, "tp")))
    assert collectives(text)["all-gather"] == 0


# -- one block along K (K = 32) -----------------------------------------------------------------
# With K = 32 the block factor of "(k i)" has size 1, which Shardy does not accept inside a
# compound dimension; K = 64 (two blocks) is the contrast. "on_K" needs K/32 divisible by the
# mesh axis, so it shards over the 2-device "dp" axis of the 2 x 4 mesh.
ONE_BLOCK_SPECS = [pytest.param(P(None, "tp"), id="on_N"), pytest.param(P("dp", None), id="on_K"),
                   pytest.param(P(None, None), id="replicated")]


@pytest.mark.parametrize("k", [32, 64])
@pytest.mark.parametrize("spec", ONE_BLOCK_SPECS)
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_one_block_of_k_sharded_jit(k, spec, axis_type, rng):
    """quantize, dequantize and matmul (plain and GLU) of a [K, 32] weight under sharded jit,
    the same as unsharded, no all-gather."""
    if spec == P("dp", None) and k // 32 % 2:
        pytest.skip("K/32 = 1 block cannot be sharded")
    mesh = mesh_2d(axis_type)
    w = jnp.asarray(rng.standard_normal((k, 32)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, k)), jnp.float32)
    ref = kj.quantize(w, 4)
    wq, coll = run(mesh, lambda w: kj.quantize(w, 4), put(w, mesh, spec))
    np.testing.assert_array_equal(np.asarray(wq.planes), np.asarray(ref.planes))
    np.testing.assert_array_equal(np.asarray(wq.scales), np.asarray(ref.scales))
    assert coll["all-gather"] == 0, coll
    ws = ks.shard_weight(ref, mesh, spec)
    dense, coll = run(mesh, kj.dequantize, ws)
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(kj.dequantize(ref)))
    assert coll["all-gather"] == 0, coll
    x_spec = P(None, spec[0])             # x's K sharded like the weight's (row-parallel)
    for glu in (None, "silu"):
        f = lambda x, w: kj.matmul(x, w, glu=glu)  # noqa: E731
        y, coll = run(mesh, f, put(x, mesh, x_spec), ws)
        assert_close(y, f(x, ref), rtol=1e-4)
        assert coll["all-gather"] == 0, coll


@pytest.mark.parametrize("k", [32, 64])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_one_block_of_k_stacked_and_vmapped(k, axis_type, rng):
    """Stacked weights [8, K, 16] sharded on the batch axis, and vmap over x, under sharded jit."""
    mesh = mesh_1d(axis_type, "ep")
    w = jnp.asarray(rng.standard_normal((8, k, 16)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 5, k)), jnp.float32)
    ref = kj.quantize(w, 3)
    wq, coll = run(mesh, lambda w: kj.quantize(w, 3), put(w, mesh, P("ep")))
    np.testing.assert_array_equal(np.asarray(wq.planes), np.asarray(ref.planes))
    assert coll["all-gather"] == 0, coll
    ws = ks.shard_weight(ref, mesh, P("ep", None, None))
    y, coll = run(mesh, kj.matmul, put(x, mesh, P("ep")), ws)
    assert_close(y, kj.matmul(x, ref))
    assert coll == NONE, coll
    dense, coll = run(mesh, kj.dequantize, ws)
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(kj.dequantize(ref)))
    assert coll == NONE, coll
    # vmap over x with one N-sharded weight (the vmapped axis is folded into M).
    w1 = ks.shard_weight(ref[0], mesh_1d(axis_type), P(None, "tp"))
    y, coll = run(mesh_1d(axis_type), jax.vmap(kj.matmul, (0, None)), x, w1)
    assert_close(y, jax.vmap(kj.matmul, (0, None))(x, ref[0]))
    assert coll["all-gather"] == 0, coll


def test_one_block_of_k_shard_map(rng):
    """K = 32 inside shard_map (every value local: no partitioning rule involved)."""
    mesh = mesh_1d(AxisType.Explicit)
    wq = kj.quantize(jnp.asarray(rng.standard_normal((32, 64)), jnp.float32), 4)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)

    @jax.shard_map(mesh=mesh, in_specs=(P(), ks.weight_specs(wq, P(None, "tp"))),
                   out_specs=(P(None, "tp"), P(None, "tp")), check_vma=True)
    def layer(x, w):
        return kj.matmul(x, w), kj.dequantize(w)

    with jax.set_mesh(mesh):
        y, dense = jax.jit(layer)(x, ks.column_parallel(wq, mesh))
    assert_close(y, kj.matmul(x, wq))
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(kj.dequantize(wq)))


@pytest.mark.parametrize("in_features", [32, 64])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_one_block_of_k_flax_layer(in_features, axis_type, rng):
    """A column-parallel KbitLinear with in_features = 32 under sharded jit."""
    from flax import nnx
    from kbit_jax.flax import KbitLinear

    mesh = mesh_1d(axis_type)
    init = lambda key, shape, dtype=jnp.float32: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    with jax.set_mesh(mesh):
        layer = KbitLinear(in_features, 64, sharding=(None, "tp"), kernel_init=init, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((4, in_features)), jnp.float32)
    with jax.set_mesh(mesh):
        y = nnx.jit(lambda m, x: m(x))(layer, put(x, mesh, P()))
    assert layer.weight.planes.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 4)
    ref = np.asarray(x, np.float64) @ np.asarray(layer.dequantized_kernel(jnp.float32), np.float64)
    assert_close(y, ref + np.asarray(layer.bias.get_value()), rtol=1e-5)


def test_one_gate_up_pair_sharded_jit(rng):
    """A GLU weight with N = 2 (one gate/up pair: the factor n of "(n p)" has size 1),
    row-parallel under sharded jit."""
    mesh = mesh_1d(AxisType.Auto)
    wq = kj.quantize(jnp.asarray(rng.standard_normal((256, 2)), jnp.float32), 4)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    gated = lambda x, w: kj.matmul(x, w, glu="silu")  # noqa: E731
    y, coll = run(mesh, gated, put(x, mesh, P(None, "tp")), ks.row_parallel(wq, mesh))
    assert y.shape == (3, 1)
    assert_close(y, gated(x, wq), rtol=1e-4)
    assert coll == ONE_ALL_REDUCE, coll


def test_shardy_rule_leaves_size_one_factors_out_of_compounds():
    rule = ks.FactorRule("b m (k i), b k (n p) j, b k (n p), b c, b -> b m n", reduction=("k",),
                         replicated=("i", "j", "c"), i=32, p=2)
    kw = dict(reduction_factors=("k",), need_replication_factors=("i", "j", "c"))
    shapes = lambda k, n: [(1, 5, k), (1, k // 32, n, 4), (1, k // 32, n), (1, 16), (1,)]  # noqa: E731
    assert rule.shardy_rule(shapes(64, 8)) == (
        "b m (k i), b k (n p) j, b k (n p), b c, b -> b m n", {**kw, "i": 32, "p": 2})
    # K = 32: one block (k = 1); N = 2: one gate/up pair (n = 1).
    assert rule.shardy_rule(shapes(32, 2)) == (
        "b m i, b k p j, b k p, b c, b -> b m n",
        dict(reduction_factors=("k",), need_replication_factors=("i", "j", "c")))
    dequantize = ks.FactorRule("b k n j, b k n, b c, b -> b (k i) n", replicated=("i", "j", "c"), i=32)
    assert dequantize.shardy_rule([(2, 1, 8, 4), (2, 1, 8), (2, 16), (2,)])[0] == \
        "b k n j, b k n, b c, b -> b i n"


# -- placement helpers -------------------------------------------------------------------------
def test_shard_weight_leaf_specs(weights):
    wq = weights[(256, 512)]
    mesh = mesh_2d(AxisType.Auto)
    ws = ks.shard_weight(wq, mesh, P("dp", "tp"))
    assert ws.planes.sharding.spec == P("dp", "tp", None)
    assert ws.scales.sharding.spec == P("dp", "tp")
    assert ws.codebook.sharding.is_fully_replicated
    assert ws.tensor_scale.sharding.is_fully_replicated
    # Each shard is a valid weight: K/32 blocks split 2 ways, N split 4 ways.
    assert ws.planes.addressable_shards[0].data.shape == (4, 128, 4)


@pytest.mark.parametrize("shape, spec, match", [
    ((64, 16), P("tp", None), r"\('tp', None\): K=64 .* whole 32-element blocks "
                              r"and K/32=2 is not divisible by 8"),
    ((256, 12), P(None, "tp"), r"N \(size 12\) is sharded over mesh axes \('tp',\).* not divisible"),
    ((3, 256, 16), P("tp", None, None), r"batch axis 0 \(size 3\)"),
    ((256, 16), P("nope", None), r"mesh axis 'nope'.*not in the mesh"),
    ((256, 16), P("tp", "tp"), r"'tp' is used more than once"),
    ((256, 16), P("tp"), r"expected 2 entries, got 1"),
])
@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_bad_specs_raise(shape, spec, match, axis_type, rng):
    mesh = mesh_1d(axis_type)
    wq = kj.quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32), 2)
    with pytest.raises(ValueError, match=match):
        ks.shard_weight(wq, mesh, spec)


def test_tp_helpers_raise(rng):
    mesh = mesh_1d(AxisType.Explicit)
    wq = kj.quantize(jnp.asarray(rng.standard_normal((64, 12)), jnp.float32), 4)
    with pytest.raises(ValueError, match=r"K/32=2 is not divisible by 8"):
        ks.row_parallel(wq, mesh)
    with pytest.raises(ValueError, match=r"N \(size 12\)"):
        ks.column_parallel(wq, mesh)
