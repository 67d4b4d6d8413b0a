"""Every documented bad input raises the documented exception, naming what is wrong."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kbit_jax as kj


@pytest.fixture
def q():
    return kj.quantize(jnp.asarray(np.random.default_rng().standard_normal((64, 8)), jnp.float32), 4)


@pytest.mark.parametrize("shape, match", [((48, 8), "multiple of 32"), ((0, 8), "multiple of 32"),
                                          ((64,), "at least 2 axes"), ((64, 0), "N")])
def test_quantize_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        kj.quantize(jnp.ones(shape), 4)


@pytest.mark.parametrize("bits", [1, 6, 0, -2])
def test_quantize_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        kj.quantize(jnp.ones((32, 4)), bits)


@pytest.mark.parametrize("bits", [4.0, "4", None, True])
def test_quantize_bits_wrong_type(bits):
    with pytest.raises(TypeError, match="bits"):
        kj.quantize(jnp.ones((32, 4)), bits)


def test_quantize_bad_codebook_and_layout():
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        kj.quantize(jnp.ones((32, 4)), 4, codebook=np.zeros(8))
    with pytest.raises(ValueError, match="unknown codebook"):
        kj.quantize(jnp.ones((32, 4)), 4, codebook="normal")
    with pytest.raises(ValueError, match="layout"):
        kj.quantize(jnp.ones((32, 4)), 4, layout="tiles")


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64])
def test_quantize_bad_dtype(dtype):
    with pytest.raises(TypeError, match="w must have dtype"):
        kj.quantize(jnp.ones((32, 4), dtype), 4)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_non_finite_eager_raises(bad):
    w = np.ones((32, 4), np.float32)
    w[3, 1] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        kj.quantize(w, 4)


def test_quantize_non_finite_under_jit_is_nan_not_finite():
    """Documented: under jit the tensor_scale becomes NaN and everything downstream is NaN."""
    w = np.ones((2, 64, 4), np.float32)
    w[0, 3, 1] = np.nan
    q = jax.jit(lambda w: kj.quantize(w, 4))(w)
    assert np.isnan(q.tensor_scale[0]) and np.isfinite(q.tensor_scale[1])
    assert np.all(np.isnan(kj.dequantize(q[0]))) and np.all(np.isfinite(kj.dequantize(q[1])))
    y = kj.matmul(jnp.ones((1, 64)), q[0])
    assert np.all(np.isnan(y))


def test_matmul_bad_inputs(q):
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal the weight's K=64"):
        kj.matmul(jnp.ones((2, 32)), q)
    with pytest.raises(TypeError, match="x must have dtype"):
        kj.matmul(jnp.ones((2, 64), jnp.int32), q)
    with pytest.raises(TypeError, match="x must be an array"):
        kj.matmul([[1.0] * 64], q)
    with pytest.raises(TypeError, match="w_q must be a KbitWeight"):
        kj.matmul(jnp.ones((2, 64)), jnp.ones((64, 8)))
    with pytest.raises(ValueError, match="method"):
        kj.matmul(jnp.ones((2, 64)), q, method="fast")
    stacked = kj.quantize(jnp.ones((3, 64, 8)), 2)
    with pytest.raises(ValueError, match="batch shape"):
        kj.matmul(jnp.ones((2, 5, 64)), stacked)
    with pytest.raises(ValueError, match="x must have shape"):
        kj.matmul(jnp.ones((64,)), stacked)


def test_matmul_bad_glu(q):
    with pytest.raises(ValueError, match=r"glu must be None or one of \('silu', 'gelu_tanh'\), got 'relu'"):
        kj.matmul(jnp.ones((2, 64)), q, glu="relu")
    odd = kj.quantize(jnp.ones((64, 7)), 4)
    with pytest.raises(ValueError, match="needs an even N, got the weight's N=7"):
        kj.matmul(jnp.ones((2, 64)), odd, glu="silu")
    with pytest.raises(ValueError, match="of one shape"):
        kj.interleave_glu(jnp.ones((64, 8)), jnp.ones((64, 4)))


def test_malformed_weights(q):
    bad = kj.KbitWeight(q.planes, q.scales[:1], q.codebook, q.tensor_scale, layout=q.layout)
    with pytest.raises(ValueError, match="w_q.scales must be uint8"):
        kj.matmul(jnp.ones((1, 64)), bad)
    bad = kj.KbitWeight(q.planes, q.scales, q.codebook[:8], q.tensor_scale, layout=q.layout)
    with pytest.raises(ValueError, match="w_q.codebook"):
        kj.dequantize(bad)
    bad = kj.KbitWeight(q.planes.astype(jnp.int32), q.scales, q.codebook, q.tensor_scale, layout=q.layout)
    with pytest.raises(ValueError, match="w_q.planes"):
        kj.dequantize(bad)
    with pytest.raises(TypeError, match="dtype"):
        kj.dequantize(q, jnp.int8)


def test_ffi_handler_errors_reach_python_without_crashing():
    """Call the CPU target directly with inconsistent shapes: an exception, not an abort."""
    if not kj.build_info()["cpu_module"]:
        pytest.fail("the C++ CPU module is not built")
    out = (jax.ShapeDtypeStruct((1, 2, 4, 4), jnp.uint32), jax.ShapeDtypeStruct((1, 2, 4), jnp.uint8))
    call = jax.ffi.ffi_call("kbit_quantize", out)
    with pytest.raises(Exception, match="kbit_quantize"):
        jax.block_until_ready(call(jnp.ones((1, 48, 4)), jnp.zeros((1, 16)), jnp.ones((1,)),
                                   layout=np.int32(1)))
    with pytest.raises(Exception, match="kbit_quantize: codebook must be float32, got float16"):
        jax.block_until_ready(call(jnp.ones((1, 64, 4)), jnp.zeros((1, 16), jnp.float16), jnp.ones((1,)),
                                   layout=np.int32(1)))
    with pytest.raises(Exception, match="layout"):
        jax.block_until_ready(call(jnp.ones((1, 64, 4)), jnp.zeros((1, 16)), jnp.ones((1,)),
                                   layout=np.int32(7)))
    # kbit_matmul's glu attribute: an unknown kind, an odd N, a result of the ungated width
    q = kj.quantize(jnp.ones((64, 6)), 4)
    weight = (q.planes[None], q.scales[None], q.codebook[None], q.tensor_scale[None])
    x = jnp.ones((1, 2, 64))
    for glu, n_out, match in [(3, 3, "attribute glu must be 0"), (1, 6, r"y \(result\) must have shape \[B, M, N/2\]")]:
        matmul = jax.ffi.ffi_call("kbit_matmul", jax.ShapeDtypeStruct((1, 2, n_out), jnp.float32))
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(matmul(x, *weight, layout=np.int32(1), glu=np.int32(glu)))
    odd = kj.quantize(jnp.ones((64, 5)), 4)
    matmul = jax.ffi.ffi_call("kbit_matmul", jax.ShapeDtypeStruct((1, 2, 2), jnp.float32))
    with pytest.raises(Exception, match="needs an even N, got N=5"):
        jax.block_until_ready(matmul(x, odd.planes[None], odd.scales[None], odd.codebook[None],
                                     odd.tensor_scale[None], layout=np.int32(1), glu=np.int32(1)))


def test_interop_errors(q):
    p, a, cb, shape = kj.to_bitsandbytes(q)
    with pytest.raises(ValueError, match="packed"):
        kj.from_bitsandbytes(p[:-1], a, cb, shape)
    with pytest.raises(ValueError, match="absmax"):
        kj.from_bitsandbytes(p, a[:-1], cb, shape)
    with pytest.raises(ValueError, match="multiple of 32"):
        kj.from_bitsandbytes(p, a, cb, (8, 60))
    with pytest.raises(ValueError, match="batch"):
        kj.to_bitsandbytes(kj.quantize(jnp.ones((2, 32, 4)), 2))


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: a crash there fails the test, not the session."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("bad", [None, [1.0, 2.0], 1.0, "planes"])
@pytest.mark.parametrize("leaf", ["planes", "scales", "codebook", "tensor_scale"])
def test_weight_leaf_not_an_array_names_the_leaf(q, leaf, bad):
    leaves = {name: getattr(q, name) for name in ("planes", "scales", "codebook", "tensor_scale")}
    weight = kj.KbitWeight(**{**leaves, leaf: bad}, layout=q.layout)
    for call in (lambda: kj.dequantize(weight), lambda: kj.matmul(jnp.ones((1, 64)), weight),
                 lambda: kj.convert_layout(weight, "planes")):
        with pytest.raises(TypeError, match=rf"w_q.{leaf} must be an array .*got {type(bad).__name__}"):
            call()


@pytest.mark.parametrize("codebook", [np.linspace(-1, 1, 16) + 0.5j, np.arange(16) % 2 == 0,
                                      jnp.ones(16, jnp.complex64)])
def test_complex_and_bool_codebooks_rejected(codebook):
    with pytest.raises(TypeError, match=rf"codebook must be .* real numbers .*got dtype {np.asarray(codebook).dtype.name}"):
        kj.quantize(jnp.ones((32, 4)), 4, codebook=codebook)


def test_complex_codebook_rejected_under_jit():
    with pytest.raises(TypeError, match="codebook must be"):
        jax.jit(lambda cb: kj.quantize(jnp.ones((32, 4)), 4, codebook=cb))(jnp.ones(16, jnp.complex64))


@pytest.mark.parametrize("dtype, got", [(None, "None"), (jnp.int8, "int8"), ("float64", "float64"),
                                        ("nonsense", "'nonsense'")])
def test_dequantize_bad_dtype_says_what_it_got(q, dtype, got):
    with pytest.raises(TypeError, match=rf"dtype must be one of \['float32', 'bfloat16', 'float16'\], got {got}$"):
        kj.dequantize(q, dtype)


def test_ffi_errors_name_dtypes_as_numpy_does():
    """The C++ checks print int32/float64, not XLA's S32/F64."""
    out = (jax.ShapeDtypeStruct((1, 2, 4, 4), jnp.uint32), jax.ShapeDtypeStruct((1, 2, 4), jnp.uint8))
    call = jax.ffi.ffi_call("kbit_quantize", out)
    with pytest.raises(Exception, match="kbit_quantize: codebook must be float32, got int32"):
        jax.block_until_ready(call(jnp.ones((1, 64, 4)), jnp.zeros((1, 16), jnp.int32), jnp.ones((1,)),
                                   layout=np.int32(1)))
    with pytest.raises(Exception, match="w must be float32, bfloat16 or float16, got bool"):
        jax.block_until_ready(call(jnp.ones((1, 64, 4), jnp.bool_), jnp.zeros((1, 16)), jnp.ones((1,)),
                                   layout=np.int32(1)))


@pytest.mark.parametrize("call", [
    "jax.jit(lambda w: kj.quantize(w, 4)).lower(jax.ShapeDtypeStruct((2**32, 2**31), jnp.float32))",
    "jax.jit(lambda w: kj.quantize(w, 4)).lower(jax.ShapeDtypeStruct((2**36, 2**36, 32, 8), jnp.float32))",
    "jax.jit(lambda x: kj.matmul(x, q)).lower(jax.ShapeDtypeStruct((2**31, 2**31, 64), jnp.float32))",
    "jax.jit(kj.dequantize).lower(kj.KbitWeight(jax.ShapeDtypeStruct((2**20, 2**34, 2**20, 4), jnp.uint32), "
    "jax.ShapeDtypeStruct((2**20, 2**34, 2**20), jnp.uint8), jax.ShapeDtypeStruct((2**20, 16), jnp.float32), "
    "jax.ShapeDtypeStruct((2**20,), jnp.float32)))",
])
def test_oversized_shapes_raise_instead_of_aborting(call):
    """XLA aborts the process on a shape whose byte size overflows int64; kbit_jax raises first."""
    result = _run_isolated(f"""
        import jax, jax.numpy as jnp, kbit_jax as kj
        q = kj.quantize(jnp.ones((64, 8)), 4)
        try:
            {call}
        except ValueError as e:
            print("ValueError:", e)
        """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ValueError:" in result.stdout and "elements, more than the 2^56" in result.stdout, result.stdout
