"""Gradients through kbit_jax: w.r.t. x, and w.r.t. a KbitWeight (codebook and tensor_scale get
their true gradient; codes and scales, integers, get float0 zeros)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kbit_jax as kj
from kbit_jax import reference


K = 64  # the products' inner dimension


def _problem(layout, batch=()):
    w = jnp.asarray(np.random.default_rng().standard_normal((*batch, K, 16)), jnp.float32)
    return kj.quantize(w, 4, layout=layout), _activations((*batch, 3, K))


def _activations(shape):
    # x / sqrt(K) keeps y = x @ w and glu(y) of order 1, so the sin(...) losses below are well
    # conditioned. With unit x, glu(y) reaches a few hundred and sin(glu(y)) amplifies y's float32
    # rounding until the tensor_scale gradient misses the tolerance (5 of 400 checks, up to 9x).
    return jnp.asarray(np.random.default_rng().standard_normal(shape) / np.sqrt(K), jnp.float32)


def _reference_weight(q, codebook, tensor_scale):
    return reference.dequantize(q.planes, q.scales, codebook, tensor_scale, layout=q.layout)


def _assert_close(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    # The kernel's y and the reference's are float32 sums over K products in different orders
    # (up to ~K ulps apart); the gradients sum ~100 terms of those: allow K * 100 ulps of the
    # largest value.
    tol = K * 100 * np.finfo(np.float32).eps * max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol)


@pytest.mark.parametrize("layout", ["planes", "fragment"])
@pytest.mark.parametrize("glu", [None, "silu"])
def test_grad_wrt_weight_matches_reference(layout, glu):
    q, x = _problem(layout)

    def loss(q):
        return jnp.sum(jnp.sin(kj.matmul(x, q, glu=glu)))

    def ref_loss(codebook, tensor_scale):
        y = jnp.matmul(x, _reference_weight(q, codebook, tensor_scale), precision="highest")
        return jnp.sum(jnp.sin(reference.apply_glu(y, glu) if glu else y))

    g = jax.grad(loss, allow_int=True)(q)
    assert g.planes.dtype == jax.dtypes.float0 and g.scales.dtype == jax.dtypes.float0
    assert g.planes.shape == q.planes.shape and g.scales.shape == q.scales.shape
    g_cb, g_ts = jax.grad(ref_loss, argnums=(0, 1))(q.codebook, q.tensor_scale)
    _assert_close(g.codebook, g_cb)
    _assert_close(g.tensor_scale, g_ts)
    g_jit = jax.jit(jax.grad(loss, allow_int=True))(q)
    _assert_close(g_jit.codebook, g_cb)


@pytest.mark.parametrize("layout", ["planes", "fragment"])
def test_grad_through_dequantize(layout):
    q, _ = _problem(layout, batch=(2,))

    def loss(codebook, tensor_scale):
        w = kj.dequantize(kj.KbitWeight(q.planes, q.scales, codebook, tensor_scale, layout=layout))
        return jnp.sum(w ** 3)

    def ref_loss(codebook, tensor_scale):
        return jnp.sum(_reference_weight(q, codebook, tensor_scale) ** 3)

    got = jax.grad(loss, argnums=(0, 1))(q.codebook, q.tensor_scale)
    expected = jax.grad(ref_loss, argnums=(0, 1))(q.codebook, q.tensor_scale)
    for a, b in zip(got, expected):
        _assert_close(a, b)


def test_grad_wrt_x_and_weight_together_and_under_vmap():
    q, x = _problem("fragment", batch=(2,))
    gx, gq = jax.grad(lambda x, q: jnp.sum(kj.matmul(x, q) ** 2), argnums=(0, 1), allow_int=True)(x, q)
    w = kj.dequantize(q)
    y = jnp.matmul(x, w, precision="highest")
    _assert_close(gx, 2 * jnp.matmul(y, jnp.swapaxes(w, -1, -2), precision="highest"))
    per = jax.vmap(jax.grad(lambda q, x: jnp.sum(kj.matmul(x, q) ** 2), allow_int=True))(q, x)
    _assert_close(per.codebook, gq.codebook)


def test_grad_through_quantize_is_zero_for_integer_outputs():
    w = jnp.asarray(np.random.default_rng().standard_normal((64, 8)), jnp.float32)
    g = jax.grad(lambda w: jnp.sum(kj.dequantize(kj.quantize(w, 4))))(w)
    assert g.shape == w.shape and not np.any(np.asarray(g))


@pytest.mark.parametrize("layout", ["planes", "fragment"])
@pytest.mark.parametrize("glu", [None, "silu"])
def test_ragged_dot_grad_wrt_experts_matches_reference(layout, glu):
    """The grouped expert product, with an empty expert and rows past the last group."""
    q, _ = _problem(layout, batch=(4,))
    x = _activations((7, K))
    sizes = jnp.asarray([2, 0, 3, 1], jnp.int32)

    def loss(q):
        return jnp.sum(jnp.sin(kj.ragged_dot(x, q, sizes, glu=glu)))

    def ref_loss(codebook, tensor_scale):
        y = reference.ragged_dot(x, q.planes, q.scales, codebook, tensor_scale, sizes,
                                 layout=layout, glu=glu)
        return jnp.sum(jnp.sin(y))

    g = jax.grad(loss, allow_int=True)(q)
    assert g.planes.dtype == jax.dtypes.float0 and g.scales.dtype == jax.dtypes.float0
    g_cb, g_ts = jax.grad(ref_loss, argnums=(0, 1))(q.codebook, q.tensor_scale)
    _assert_close(g.codebook, g_cb)
    _assert_close(g.tensor_scale, g_ts)
    _assert_close(jax.jit(jax.grad(loss, allow_int=True))(q).codebook, g_cb)
