"""The example decoder's residual add + RMSNorm kernel (``examples/fused_norm.py``).

On the CPU the Pallas kernel runs through Pallas's interpreter; the ``gpu`` tests compile it
with Triton. Checked against XLA's add (bit-exact: the residual stream is rounded the same
way) and a float64 norm with a tolerance derived from the dtype; the decoder with the kernel
is checked in test_decode_attention.py and test_tp_decoder.py (norm="pallas").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DTYPES, unit_roundoff

from kbit_jax.examples import llama
from kbit_jax.examples.fused_norm import add_rms_norm, supported

SHAPES = [(1, 1, 256), (3, 5, 64), (2, 4096), (16,)]


def norm64(s, scale, eps):
    s = np.asarray(s, np.float64)
    return s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def check(rng, shape, dtype, with_delta, eps=1e-5, interpret=None):
    def draw(*dims):
        return jnp.asarray(rng.standard_normal(dims) * 3, dtype)
    x, delta, scale = draw(*shape), draw(*shape) if with_delta else None, draw(shape[-1])
    s, h = jax.jit(lambda x, d, c: add_rms_norm(x, d, c, eps, interpret=interpret))(x, delta, scale)
    want_s = x if delta is None else x + delta          # XLA's rounding of the residual stream
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    assert h.shape == x.shape and h.dtype == dtype
    # f32 arithmetic (relative ~1e-6), then one rounding to the dtype (its unit roundoff).
    want = norm64(want_s, scale, eps)
    np.testing.assert_allclose(np.asarray(h, np.float64), want,
                               rtol=unit_roundoff(dtype) + 1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "norm-only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_xla_add_and_float64_norm(shape, dtype, with_delta, rng):
    check(rng, shape, dtype, with_delta)


def test_same_as_the_decoders_rmsnorm(rng):
    """add_and_norm with the kernel equals RMSNorm's XLA path (bf16: to one rounding)."""
    norm = llama.RMSNorm(256, 1e-5, jnp.bfloat16, kernel="pallas")
    norm.scale.set_value(jnp.asarray(rng.standard_normal(256), jnp.bfloat16))
    x, delta = (jnp.asarray(rng.standard_normal((2, 1, 256)), jnp.bfloat16) for _ in range(2))
    s, h = norm.add_and_norm(x, delta)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x + delta))
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(norm(x + delta), np.float32),
                               rtol=2 ** -8, atol=0)


def test_bad_inputs():
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="feature dimension 48 is not a power of two"):
        add_rms_norm(jnp.zeros((2, 48)), None, jnp.zeros((48,)), 1e-5)
    with pytest.raises(ValueError, match=r"delta \(2, 32\) float32 differs from x"):
        add_rms_norm(x, jnp.zeros((2, 32)), jnp.zeros((64,)), 1e-5)
    with pytest.raises(ValueError, match=r"delta .* bfloat16 differs"):
        add_rms_norm(x, x.astype(jnp.bfloat16), jnp.zeros((64,)), 1e-5)
    with pytest.raises(ValueError, match=r"scale \(32,\) is not \[64\]"):
        add_rms_norm(x, x, jnp.zeros((32,)), 1e-5)
    with pytest.raises(ValueError, match="dtype int32"):
        add_rms_norm(x.astype(jnp.int32), None, jnp.zeros((64,)), 1e-5)
    assert supported((1, 4096), jnp.bfloat16) is None
    with pytest.raises(ValueError, match="norm='fused'"):
        llama.RMSNorm(64, 1e-5, jnp.float32, kernel="fused")
    # "pallas" refuses a dimension the kernel does not take; "auto" falls back to XLA.
    with pytest.raises(ValueError, match="norm='pallas': feature dimension 48"):
        llama.RMSNorm(48, 1e-5, jnp.float32, kernel="pallas").add_and_norm(jnp.ones((1, 48)), None)
    s, h = llama.RMSNorm(48, 1e-5, jnp.float32, kernel="auto").add_and_norm(jnp.ones((1, 48)), None)
    np.testing.assert_allclose(np.asarray(h), 1.0, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES + [(1, 1, 8192), (4, 16384), (128, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_kernel(shape, dtype, rng):
    assert jax.default_backend() == "gpu"
    check(rng, shape, dtype, True)
    check(rng, shape, dtype, False)


@pytest.mark.gpu
def test_gpu_auto_takes_the_kernel():
    from flax import nnx
    cfg = llama.TINY_TP
    model, _ = llama.build_model(cfg, bits=4)
    graphdef, state = nnx.split(model)
    hlo = llama.decode_step.lower(graphdef, state, jnp.zeros((1,), jnp.int32),
                                  llama.init_cache(cfg, 1, 16), 3).as_text()
    # one per norm: two per block and the final one
    assert hlo.count("add_rms_norm") >= 2 * cfg.n_layers + 1
