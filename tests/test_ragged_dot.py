"""kbit_jax.ragged_dot: the grouped expert product, against a loop of reference matmuls per
group; transformations (jit, vmap, grad, shard_map), sharded jit (compiled HLO: no weight is
gathered) and every bad input."""

import os
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import kbit_jax as kj  # noqa: E402
from kbit_jax import reference  # noqa: E402
from kbit_jax import sharding as ks  # noqa: E402
from kbit_jax.moe import expert_parallel_ragged_dot  # noqa: E402
from kbit_jax.primitives import ragged_dot_p  # noqa: E402

from helpers import BITS, DTYPES, GLU_KINDS, LAYOUTS, glu_error_bound, matmul_error_bound, random_weight  # noqa: E402


def stacked_weight(rng, g, k, n, bits=4, layout="fragment"):
    return kj.quantize(random_weight(rng, (g, k, n)), bits, layout=layout)


def expected(x, w_q, group_sizes, glu=None):
    """(y64, bound): a loop of reference products, one per group's rows, in float64 with the
    error bound of a matmul in x's dtype; rows past the groups are 0."""
    dtype = jnp.dtype(x.dtype)
    x = np.asarray(jnp.asarray(x, jnp.float32))
    m = x.shape[0]
    n = w_q.out_features // (2 if glu else 1)
    y64 = np.zeros((m, n))
    bound = np.full((m, n), np.finfo(np.float32).tiny)
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    for g in range(len(group_sizes)):
        rows = slice(starts[g], starts[g + 1])
        if starts[g + 1] == starts[g]:
            continue
        w64 = np.asarray(kj.dequantize(w_q[g]), np.float64)
        if glu is None:
            y64[rows], bound[rows] = matmul_error_bound(x[rows], w64, dtype, dtype)
        else:
            y64[rows], bound[rows] = glu_error_bound(x[rows], w64, dtype, dtype, glu)
    return y64, bound


def check(y, x, w_q, group_sizes, glu=None):
    assert y.dtype == x.dtype
    y64, bound = expected(x, w_q, np.asarray(group_sizes), glu)
    assert y.shape == y64.shape
    err = np.abs(np.asarray(y, np.float64) - y64)
    assert np.all(err <= bound), f"max error {err.max()} (bound there {bound.flat[err.argmax()]})"


def random_sizes(rng, g, total):
    """group sizes summing to `total`, with a random share of empty groups."""
    cuts = np.sort(rng.integers(0, total + 1, size=g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes[rng.random(g) < 0.3] = 0
    return sizes.astype(np.int32)


def size_patterns(rng, g, m):
    """name -> group_sizes: the cases the contract singles out."""
    one = np.zeros(g, np.int32)
    one[rng.integers(g)] = m
    ends_empty = np.zeros(g, np.int32)
    ends_empty[1:-1] = random_sizes(rng, g - 2, m)
    return {
        "random": random_sizes(rng, g, m),
        "empty_at_both_ends": ends_empty,
        "all_rows_in_one_group": one,
        "sum_below_m": random_sizes(rng, g, m // 2),
        "no_rows": np.zeros(g, np.int32),
    }


# -- values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["random", "empty_at_both_ends", "all_rows_in_one_group",
                                     "sum_below_m", "no_rows"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_group_patterns(rng, pattern, jit):
    g, k, n, m = 6, 96, 40, 37
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = size_patterns(rng, g, m)[pattern]
    f = jax.jit(kj.ragged_dot) if jit else kj.ragged_dot
    check(f(x, w_q, jnp.asarray(sizes)), x, w_q, sizes)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits", BITS)
def test_bits_and_layouts(rng, bits, layout):
    g, k, n, m = 5, 64, 24, 29
    w_q = stacked_weight(rng, g, k, n, bits, layout)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = random_sizes(rng, g, m - 3)
    check(kj.ragged_dot(x, w_q, sizes), x, w_q, sizes)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dtypes(rng, dtype):
    g, k, n, m = 4, 128, 48, 70          # > one 32-row tile in a group
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    sizes = random_sizes(rng, g, m)
    check(kj.ragged_dot(x, w_q, sizes), x, w_q, sizes)


@pytest.mark.parametrize("glu", GLU_KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_glu(rng, glu, dtype):
    g, k, n, m = 4, 64, 36, 25
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    sizes = random_sizes(rng, g, m - 2)
    y = jax.jit(kj.ragged_dot, static_argnames="glu")(x, w_q, sizes, glu=glu)
    assert y.shape == (m, n // 2)
    check(y, x, w_q, sizes, glu)


def test_m_zero(rng):
    w_q = stacked_weight(rng, 3, 32, 16)
    x = jnp.zeros((0, 32), jnp.bfloat16)
    for glu in (None, "silu"):
        y = kj.ragged_dot(x, w_q, jnp.zeros(3, jnp.int32), glu=glu)
        assert y.shape == (0, 8 if glu else 16) and y.dtype == jnp.bfloat16


def test_matches_lax_ragged_dot_and_dequantize_method(rng):
    g, k, n, m = 8, 64, 32, 50
    w_q = stacked_weight(rng, g, k, n, bits=3)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, g, m - 5))
    lax = jax.lax.ragged_dot(x, kj.dequantize(w_q), sizes, precision=jax.lax.Precision.HIGHEST)
    scale = float(jnp.abs(lax).max())
    for method in ("auto", "fused", "dequantize"):
        y = kj.ragged_dot(x, w_q, sizes, method=method)
        np.testing.assert_allclose(np.asarray(y), np.asarray(lax), atol=1e-5 * scale, rtol=0)


def test_empty_expert_never_leaks(rng):
    """An expert without rows may hold anything (here NaN): no row sees it."""
    g, k, n, m = 4, 64, 16, 12
    w_q = stacked_weight(rng, g, k, n)
    bad = w_q.tensor_scale.at[2].set(jnp.nan)
    w_nan = kj.KbitWeight(w_q.planes, w_q.scales, w_q.codebook, bad, layout=w_q.layout)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = np.array([5, 0, 0, 7], np.int32)
    y = kj.ragged_dot(x, w_nan, sizes)
    assert np.isfinite(np.asarray(y)).all()
    check(y, x, w_q, sizes)
    # The same expert with rows: they (and only they) see it.
    y = np.asarray(kj.ragged_dot(x, w_nan, np.array([0, 0, 3, 9], np.int32)))
    assert np.isnan(y[:3]).all() and np.isfinite(y[3:]).all()


def test_unchecked_sizes_under_jit(rng):
    g, k, n, m = 4, 32, 16, 10
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    f = jax.jit(kj.ragged_dot)
    for sizes, meaning in (([3, -2, 4, 20], [3, 0, 4, 3]), ([12, 5, 0, 0], [10, 0, 0, 0])):
        y = f(x, w_q, jnp.asarray(sizes, jnp.int32))
        check(y, x, w_q, np.asarray(meaning))


# -- gathered form ------------------------------------------------------------------------------
@pytest.mark.parametrize("glu", [None, "silu"])
@pytest.mark.parametrize("tokens", [1, 4, 19])
def test_gathered_dot(rng, tokens, glu):
    g, k, n, top_k = 8, 64, 32, 3
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16)
    ids = np.stack([rng.choice(g, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    for f in (kj.gathered_dot, jax.jit(kj.gathered_dot, static_argnames="glu")):
        y = f(x, w_q, jnp.asarray(ids), glu=glu)
        assert y.shape == (tokens, top_k, n // 2 if glu else n)
        for j in range(top_k):    # column j: each token with its j-th expert, one group per row
            for t in range(tokens):
                sizes = np.zeros(g, np.int32)
                sizes[ids[t, j]] = 1
                check(y[t, j][None], x[t][None], w_q, sizes, glu)
    # One expert per token (ids [T]) gives [T, N]. Not compared bitwise with the first column
    # above: a row's float32 sum order depends on its place among its expert's rows (the CPU
    # kernel takes 4 rows at a time), which differs between the two calls.
    y1 = kj.gathered_dot(x, w_q, jnp.asarray(ids[:, 0]), glu=glu)
    assert y1.shape == (tokens, n // 2 if glu else n)
    for t in range(tokens):
        sizes = np.zeros(g, np.int32)
        sizes[ids[t, 0]] = 1
        check(y1[t][None], x[t][None], w_q, sizes, glu)


def test_gathered_dot_bad_ids(rng):
    w_q = stacked_weight(rng, 4, 32, 16)
    x = jnp.ones((3, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\)"):
        kj.gathered_dot(x, w_q, jnp.asarray([[0, 4], [1, 2], [3, 0]], jnp.int32))
    with pytest.raises(TypeError, match="expert_ids must be an integer array"):
        kj.gathered_dot(x, w_q, jnp.zeros((3, 2), jnp.float32))
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        kj.gathered_dot(x, w_q, jnp.zeros((2, 2), jnp.int32))
    # Under jit an id outside [0, G) gives a zero row and leaves the others alone.
    y = jax.jit(kj.gathered_dot)(x, w_q, jnp.asarray([[0, 7], [1, 2], [-1, 0]], jnp.int32))
    assert not np.asarray(y[0, 1]).any() and not np.asarray(y[2, 0]).any()
    np.testing.assert_array_equal(np.asarray(y[2, 1]), np.asarray(y[0, 0]))


# -- transformations -----------------------------------------------------------------------------
def test_vmap_over_token_sets(rng):
    g, k, n, m, v = 5, 64, 24, 17, 4
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((v, m, k)), jnp.float32)
    sizes = np.stack([random_sizes(rng, g, int(rng.integers(0, m + 1))) for _ in range(v)])
    y = jax.jit(jax.vmap(kj.ragged_dot, in_axes=(0, None, 0)))(x, w_q, jnp.asarray(sizes))
    for i in range(v):
        check(y[i], x[i], w_q, sizes[i])
    # Only x mapped (one set of sizes), on axis 1.
    y = jax.vmap(kj.ragged_dot, in_axes=(1, None, None), out_axes=1)(
        jnp.swapaxes(x, 0, 1), w_q, jnp.asarray(sizes[0]))
    for i in range(v):
        check(y[:, i], x[i], w_q, sizes[0])


def test_vmap_over_stacked_weights(rng):
    """Token sets with their own experts (e.g. layers): one grouped call over V x G experts."""
    g, k, n, m, v = 3, 32, 16, 11, 3
    w_q = kj.quantize(random_weight(rng, (v, g, k, n)), 4)
    x = jnp.asarray(rng.standard_normal((v, m, k)), jnp.bfloat16)
    sizes = np.stack([random_sizes(rng, g, m - i) for i in range(v)])
    y = jax.vmap(kj.ragged_dot, in_axes=(0, 0, 0))(x, w_q, jnp.asarray(sizes))
    for i in range(v):
        check(y[i], x[i], w_q[i], sizes[i])
    # Weights mapped, x shared.
    y = jax.vmap(kj.ragged_dot, in_axes=(None, 0, None))(x[0], w_q, jnp.asarray(sizes[0]))
    for i in range(v):
        check(y[i], x[0], w_q[i], sizes[0])


@pytest.mark.parametrize("glu", [None, "silu"])
def test_grad_wrt_x(rng, glu):
    g, k, n, m = 4, 64, 32, 21
    w_q = stacked_weight(rng, g, k, n)
    w = kj.dequantize(w_q)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, g, m - 3))
    ct = jnp.asarray(rng.standard_normal((m, n // 2 if glu else n)), jnp.float32)

    def ref(x):
        y = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum((y if glu is None else reference.apply_glu(y, glu)) * ct)

    def mine(x):
        return jnp.sum(kj.ragged_dot(x, w_q, sizes, glu=glu) * ct)

    want = jax.grad(ref)(x)
    scale = float(jnp.abs(want).max())
    for grad in (jax.grad(mine), jax.jit(jax.grad(mine))):
        np.testing.assert_allclose(np.asarray(grad(x)), np.asarray(want), atol=2e-5 * scale, rtol=0)
    # Rows past the groups have no gradient.
    assert not np.asarray(jax.grad(mine)(x))[int(sizes.sum()):].any()
    # Forward-mode too.
    t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    _, tangent = jax.jvp(lambda x: kj.ragged_dot(x, w_q, sizes, glu=glu), (x,), (t,))
    _, want_t = jax.jvp(lambda x: (lambda y: y if glu is None else reference.apply_glu(y, glu))(
        jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)), (x,), (t,))
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(want_t),
                               atol=2e-5 * float(jnp.abs(want_t).max()), rtol=0)


def test_grad_under_vmap(rng):
    """Per-set gradients (vmap of grad, grad of vmap, experts per set): one grouped product."""
    g, k, n, m, v = 4, 64, 32, 12, 3
    w_q = kj.quantize(random_weight(rng, (v, g, k, n)), 4)
    w = kj.dequantize(w_q)
    x = jnp.asarray(rng.standard_normal((v, m, k)), jnp.float32)
    sizes = jnp.asarray(np.stack([random_sizes(rng, g, m - i) for i in range(v)]))

    def loss(x, w_q, s):
        return jnp.sum(kj.ragged_dot(x, w_q, s) ** 2)

    want = jnp.stack([jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(
        x, w[i], sizes[i], precision=jax.lax.Precision.HIGHEST) ** 2))(x[i]) for i in range(v)])
    atol = 2e-5 * float(jnp.abs(want).max())
    got = jax.vmap(jax.grad(loss))(x, w_q, sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=0)
    got = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(loss)(x, w_q, sizes))))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=atol, rtol=0)
    # Shared experts, per-set sizes.
    want0 = jnp.stack([jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(
        x, w[0], sizes[i], precision=jax.lax.Precision.HIGHEST) ** 2))(x[i]) for i in range(v)])
    got = jax.vmap(jax.grad(loss), in_axes=(0, None, 0))(x, w_q[0], sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want0), atol=atol, rtol=0)


# -- bad inputs ----------------------------------------------------------------------------------
def bad_inputs(rng):
    w_q = stacked_weight(rng, 4, 64, 16)
    x = jnp.zeros((10, 64), jnp.float32)
    sizes = jnp.asarray([2, 3, 0, 1], jnp.int32)
    one = kj.quantize(random_weight(rng, (64, 16)), 4)
    return [
        ("group_sizes must have dtype int32", TypeError, (x, w_q, sizes.astype(jnp.float32)), {}),
        ("group_sizes must have dtype int32", TypeError, (x, w_q, np.array([2, 3, 0, 1], np.int64)), {}),
        ("group_sizes must be an int32 array", TypeError, (x, w_q, 3), {}),
        ("group_sizes must have shape [G]", ValueError, (x, w_q, sizes[None]), {}),
        ("group_sizes must have one entry per expert of w_q (G=4), got 3", ValueError, (x, w_q, sizes[:3]), {}),
        ("group_sizes must be >= 0", ValueError, (x, w_q, jnp.asarray([2, -1, 0, 1], jnp.int32)), {}),
        ("group_sizes must sum to at most x.shape[0]=10", ValueError,
         (x, w_q, jnp.asarray([2, 9, 0, 1], jnp.int32)), {}),
        ("x must have shape [M, K] with the weight's K=64", ValueError, (jnp.zeros((10, 32)), w_q, sizes), {}),
        ("x must have shape [M, K]", ValueError, (jnp.zeros((2, 10, 64)), w_q, sizes), {}),
        ("x must have dtype", TypeError, (jnp.zeros((10, 64), jnp.int32), w_q, sizes), {}),
        ("x must be an array", TypeError, ([[0.0] * 64], w_q, sizes), {}),
        ("w_q must be stacked over the experts, shape [G, K, N]", ValueError, (x, one, sizes), {}),
        ("w_q must be stacked over the experts", ValueError,
         (x, kj.quantize(random_weight(rng, (2, 2, 64, 16)), 4), sizes), {}),
        ("w_q must be a KbitWeight", TypeError, (x, jnp.zeros((4, 64, 16)), sizes), {}),
        ("glu must be None or one of", ValueError, (x, w_q, sizes), {"glu": "relu"}),
        ("needs an even N", ValueError, (x, stacked_weight(rng, 4, 64, 15), sizes), {"glu": "silu"}),
        ("method must be one of", ValueError, (x, w_q, sizes), {"method": "fast"}),
    ]


def test_bad_inputs(rng):
    for message, error, args, kwargs in bad_inputs(rng):
        with pytest.raises(error) as info:
            kj.ragged_dot(*args, **kwargs)
        assert message in str(info.value), (message, str(info.value))


def test_bad_sizes_checked_under_jit_by_shape(rng):
    """Under jit sizes are traced: their dtype, shape and length are still checked."""
    w_q = stacked_weight(rng, 4, 64, 16)
    x = jnp.zeros((10, 64), jnp.float32)
    with pytest.raises(ValueError, match="one entry per expert"):
        jax.jit(kj.ragged_dot)(x, w_q, jnp.zeros(5, jnp.int32))
    with pytest.raises(TypeError, match="int32"):
        jax.jit(kj.ragged_dot)(x, w_q, jnp.zeros(4, jnp.uint8))


def test_kernel_rejects_bad_operands_without_crashing():
    """The FFI handler validates what reaches it (here a float32 group_sizes bound directly to
    the primitive): an exception naming the target and operand, not a crash."""
    code = """
import jax, jax.numpy as jnp, numpy as np
import kbit_jax as kj
from kbit_jax.primitives import ragged_dot_p
w = kj.quantize(jnp.ones((2, 32, 8)), 4)
try:
    jax.jit(lambda x, *a: ragged_dot_p.bind(x, *a, layout=w.layout, method="auto", glu=None))(
        jnp.ones((3, 32)), w.planes, w.scales, w.codebook, w.tensor_scale, jnp.ones(2, jnp.float32))
except Exception as e:
    print("ERROR", str(e).splitlines()[0])
"""
    if not kj.build_info()["cpu_module"]:
        pytest.skip("the C++ CPU module is not built")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "kbit_ragged_dot" in out.stdout and "group_sizes must be int32" in out.stdout, out.stdout


# -- sharding ------------------------------------------------------------------------------------
needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def compiled_collectives(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return ks.collective_counts(text), ks.all_gather_shapes(text)


@needs8
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("glu", [None, "silu"])
@pytest.mark.parametrize("layout,reduces", [
    ("experts", 1),    # G sharded: each device its experts' rows, one all-reduce of y
    ("columns", 0),    # N sharded inside every expert: no collective
    ("rows", 1),       # K sharded inside every expert: one all-reduce
])
def test_sharded_jit_never_gathers_weights(rng, layout, reduces, glu, axis_type):
    g, k, n, m = 16, 512, 64, 60
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, g, m - 4))
    mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
    spec = {"experts": P("d", None, None), "columns": P(None, None, "d"), "rows": P(None, "d", None)}[layout]
    with jax.set_mesh(mesh):
        w_s = ks.shard_weight(w_q, mesh, spec)
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "d") if layout == "rows" else P()))
        f = lambda x, w, s: kj.ragged_dot(x, w, s, glu=glu)  # noqa: E731
        y = jax.jit(f)(xs, w_s, sizes)
        counts, gathered = compiled_collectives(f, xs, w_s, sizes)
    check(y, x, w_q, np.asarray(sizes), glu)
    if layout == "columns":
        assert y.sharding.spec == P(None, "d")
    assert gathered == [], gathered
    assert counts == {**dict.fromkeys(ks.COLLECTIVES, 0), "all-reduce": reduces}, counts


@needs8
@pytest.mark.parametrize("glu", [None, "silu"])
def test_sharded_jit_one_block_of_k(rng, glu):
    """K = 32: x's K is one block (a size-1 block factor, which Shardy's rules cannot hold in a
    compound dimension)."""
    g, k, n, m = 8, 32, 64, 30
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, g, m))
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    for spec in (P("d", None, None), P(None, None, "d")):
        with jax.set_mesh(mesh):
            w_s = ks.shard_weight(w_q, mesh, spec)
            f = lambda x, w, s: kj.ragged_dot(x, w, s, glu=glu)  # noqa: E731
            y = jax.jit(f)(x, w_s, sizes)
            _, gathered = compiled_collectives(f, x, w_s, sizes)
        check(y, x, w_q, np.asarray(sizes), glu)
        assert gathered == [], gathered


@needs8
def test_sharded_jit_token_sharded_x_gathers_only_activations(rng):
    """Rows sharded over devices (data parallel) with experts sharded: only activations (x, or
    the rows of y) are gathered, never a weight leaf (uint32 planes, uint8 scales)."""
    g, k, n, m = 8, 256, 32, 64
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, g, m))
    mesh = jax.make_mesh((8,), ("d",))
    with jax.set_mesh(mesh):
        w_s = ks.shard_weight(w_q, mesh, P("d", None, None))
        xs = jax.device_put(x, NamedSharding(mesh, P("d")))
        y = jax.jit(kj.ragged_dot)(xs, w_s, sizes)
        _, gathered = compiled_collectives(kj.ragged_dot, xs, w_s, sizes)
    check(y, x, w_q, np.asarray(sizes))
    assert set(gathered) <= {f"f32[{m},{k}]", f"f32[{m},{n}]"}, gathered


@needs8
@pytest.mark.parametrize("glu", [None, "gelu_tanh"])
def test_expert_parallel_shard_map(rng, glu):
    """The all-gather + psum pattern: tokens sharded over devices are gathered, sorted by
    expert, each device multiplies its own experts' rows, psum combines."""
    g, k, n, tokens, top_k = 16, 128, 32, 24, 2
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(g, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    mesh = jax.make_mesh((8,), ("ep",), axis_types=(AxisType.Auto,))
    w_s = ks.shard_weight(w_q, mesh, P("ep", None, None))

    def body(x_local, experts_local, w_local):
        x_all = jax.lax.all_gather(x_local, "ep", tiled=True)              # [T, K]
        e_all = jax.lax.all_gather(experts_local, "ep", tiled=True)        # [T, top_k]
        flat = e_all.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        rows = x_all[order // top_k]
        sizes = jnp.bincount(flat, length=g).astype(jnp.int32)
        y = expert_parallel_ragged_dot(rows, w_local, sizes, axis_name="ep", glu=glu)
        y = jnp.zeros_like(y).at[order].set(y).reshape(-1, top_k, y.shape[-1]).sum(1)
        per = x_local.shape[0]
        return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("ep") * per, per)

    f = jax.jit(jax.shard_map(body, mesh=mesh,
                              in_specs=(P("ep"), P("ep"), ks.weight_specs(w_q, P("ep", None, None))),
                              out_specs=P("ep")))
    y = f(x, experts, w_s)
    # Per token: the sum of its experts' products.
    w64 = np.asarray(kj.dequantize(w_q), np.float64)
    x64 = np.asarray(x, np.float64)
    want = np.zeros((tokens, n // 2 if glu else n))
    for t in range(tokens):
        for e in np.asarray(experts[t]):
            p = x64[t] @ w64[e]
            want[t] += p if glu is None else np.asarray(reference.apply_glu(jnp.asarray(p), glu))
    np.testing.assert_allclose(np.asarray(y), want, atol=1e-4 * np.abs(want).max(), rtol=0)
    counts, gathered = compiled_collectives(f, x, experts, w_s)
    assert all(s.startswith(("f32[24,", "s32[24,")) for s in gathered), gathered   # tokens only
    assert counts["all-reduce"] == 1, counts


@needs8
def test_shard_map_tensor_parallel_and_grad(rng):
    """Inside shard_map with N sharded: local ragged_dot per device; gradients w.r.t. a
    replicated x are summed over the devices."""
    g, k, n, m = 4, 64, 64, 20
    w_q = stacked_weight(rng, g, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, g, m))
    mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,))
    spec = P(None, None, "tp")
    f = jax.shard_map(lambda x, w, s: kj.ragged_dot(x, w, s), mesh=mesh,
                      in_specs=(P(), ks.weight_specs(w_q, spec), P()), out_specs=P(None, "tp"))
    w_s = ks.shard_weight(w_q, mesh, spec)
    check(jax.jit(f)(x, w_s, sizes), x, w_q, np.asarray(sizes))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x, w_s, sizes) ** 2)))(x)
    want = jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(x, kj.dequantize(w_q), sizes,
                                                         precision=jax.lax.Precision.HIGHEST) ** 2))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), atol=1e-4 * float(jnp.abs(want).max()))


def test_primitive_is_exported():
    assert kj.ragged_dot is not None and ragged_dot_p.name == "kbit_ragged_dot"
