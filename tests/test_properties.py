"""Property-based tests: random shapes, bits, dtypes, layouts, codebooks and magnitudes from
1e-38 to 3e38, checked against an independent NumPy reading of the format written here (not
kbit_jax.reference): planes/fragment decoding, E4M4, codebook and tensor_scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kbit_jax as kj

# Kept to well under a minute on CI: most of an example's time is compiling its shapes, so the
# shapes come from a small set and the example count is modest (raise max_examples to fuzz).
SETTINGS = settings(max_examples=15, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
F32_MIN_NORMAL = 2.0 ** -126


# -- the format, read in NumPy --------------------------------------------------------------------
def np_e4m4(byte):
    """E4M4: 4-bit exponent (bias 11), 4-bit mantissa, subnormals at exponent 0."""
    byte = np.asarray(byte, np.int64)
    e, m = byte >> 4, byte & 15
    return np.where(e > 0, 2.0 ** (e - 11) * (1 + m / 16), 2.0 ** -10 * (m / 16))


def np_fragment_element(p):
    """The element of a block whose code sits at fragment position p (p = 8t + i)."""
    t, i = p >> 3, p & 7
    return 16 * (i >> 2) + 8 * ((i >> 1) & 1) + 2 * t + (i & 1)


def np_codes(planes, layout):
    """uint32[..., bits] words of a cell -> int codes[..., 32] in element order."""
    planes = np.asarray(planes).astype(np.uint64)
    bits = planes.shape[-1]
    codes = np.zeros((*planes.shape[:-1], 32), np.int64)
    if layout == "planes":        # bit j of word b is bit b of element j's code
        for b in range(bits):
            for j in range(32):
                codes[..., j] |= ((planes[..., b] >> np.uint64(j)) & np.uint64(1)).astype(np.int64) << b
        return codes
    # fragment: the code at position p fills bits [bits*p, bits*(p+1)) of the words' little-endian
    # concatenation, and position p holds element np_fragment_element(p).
    for p in range(32):
        for c in range(bits):
            bit = bits * p + c
            value = (planes[..., bit // 32] >> np.uint64(bit % 32)) & np.uint64(1)
            codes[..., np_fragment_element(p)] |= value.astype(np.int64) << c
    return codes


def np_dequantize(q):
    """float32 W[..., K, N] = (codebook[code] * e4m4(scale)) * tensor_scale, rounded in float32."""
    codes = np_codes(q.planes, q.layout)                         # [..., KB, N, 32]
    cb = np.asarray(q.codebook, np.float32)
    batch = codes.shape[:-3]
    flat_cb = cb.reshape(-1, cb.shape[-1])
    values = np.take_along_axis(flat_cb, codes.reshape(flat_cb.shape[0], -1), axis=-1).reshape(codes.shape)
    scale = np_e4m4(q.scales).astype(np.float32)
    ts = np.asarray(q.tensor_scale, np.float32).reshape(*batch, 1, 1, 1)
    with np.errstate(under="ignore"):
        w = (values * scale[..., None]).astype(np.float32) * ts
    *_, kb, n, _ = codes.shape
    return np.swapaxes(w, -1, -2).reshape(*batch, kb * 32, n)


def worst_rounding(codebook):
    """The largest distance from a point of [-1, 1] to its nearest codebook entry."""
    c = np.sort(np.asarray(codebook, np.float64))
    gaps = np.diff(c) / 2
    return max(abs(-1 - c[0]) if c[0] > -1 else 0.0, abs(1 - c[-1]) if c[-1] < 1 else 0.0,
               gaps.max(initial=0.0))


def assert_within_documented_error(w, q):
    """Per element |w - W| <= absmax * (worst codebook rounding) + max|c| * (scale rounding)
    + float32's smallest normal (values below it are flushed to zero), per 32-element block."""
    w = np.asarray(w, np.float64)
    d = np_dequantize(q).astype(np.float64)
    *batch, k, n = w.shape
    blocks = np.swapaxes(w.reshape(*batch, k // 32, 32, n), -1, -2)       # [..., KB, N, 32]
    absmax = np.max(np.abs(blocks), axis=-1)
    ts = np.asarray(q.tensor_scale, np.float64).reshape(*batch, 1, 1)
    cb = np.asarray(q.codebook, np.float64)
    g = np.array([worst_rounding(c) for c in cb.reshape(-1, cb.shape[-1])]).reshape(*batch, 1, 1)
    cmax = np.max(np.abs(cb), axis=-1).reshape(*batch, 1, 1)
    # E4M4 rounds absmax / ts to 4 mantissa bits (relative 2^-5) in its normal range, and to a
    # step of 2^-14 below 2^-10; 0 for blocks below half that step.
    scale_err = np.maximum(absmax * 2.0 ** -5, ts * 2.0 ** -15)
    bound = absmax * (g + 1e-6) + cmax * scale_err * (1 + 1e-6) + 2 * F32_MIN_NORMAL
    err = np.swapaxes(np.abs(w - d).reshape(*batch, k // 32, 32, n), -1, -2)
    assert np.all(err <= bound[..., None]), float(np.max(err / bound[..., None]))


# -- strategies -----------------------------------------------------------------------------------
DTYPE_RANGE = {"float32": (-38, 38.5), "bfloat16": (-38, 38.5), "float16": (-4, 4.8)}


@st.composite
def problems(draw):
    bits = draw(st.integers(2, 5))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    layout = draw(st.sampled_from(["planes", "fragment"]))
    batch = draw(st.sampled_from([(), (2,)]))
    k = draw(st.sampled_from([32, 64]))
    n = draw(st.sampled_from([1, 5, 16]))
    lo, hi = DTYPE_RANGE[dtype]
    exponent = draw(st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi])))   # the ends too
    spread = draw(st.sampled_from([0.0, 3.0, 10.0]))       # decades between columns
    seed = draw(st.integers(0, 2 ** 32 - 1))
    names = ["nf", "lloyd_max", "uniform"] + (["nf4"] if bits == 4 else [])
    codebook = draw(st.one_of(st.sampled_from(names), st.just("random")))
    return bits, dtype, layout, batch, k, n, exponent, spread, seed, codebook


def make(problem):
    bits, dtype, layout, batch, k, n, exponent, spread, seed, codebook = problem
    rng = np.random.default_rng(seed)
    column_scale = 10.0 ** (-spread * rng.uniform(0, 1, n))
    w = rng.uniform(-1, 1, (*batch, k, n)) * column_scale * 10.0 ** exponent
    limit = float(jnp.finfo(dtype).max)
    w = np.clip(w, -limit, limit)
    if codebook == "random":
        codebook = np.round(rng.uniform(-1, 1, 1 << bits), int(rng.integers(1, 6))).astype(np.float32)
    w = jnp.asarray(w.astype(np.float32), dtype)
    return w, bits, codebook, layout


def assert_equal_up_to_flushed_subnormals(actual, expected):
    """Equal in float32, but where the exact result is a float32 subnormal: XLA flushes those to
    zero on CPU and GPU (docs/errors.md), and a kernel may keep them."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    subnormal = np.abs(expected) < F32_MIN_NORMAL
    flushed = np.where(subnormal & (actual == 0), np.float32(0), expected)
    np.testing.assert_array_equal(actual, flushed)


@SETTINGS
@given(problems())
# Columns 1e-35 * 10^-3..1e-35: their smallest products of codebook, scale and tensor_scale are
# float32 subnormals.
@example(problem=(2, "float32", "planes", (), 32, 5, -35.0, 3.0, 0, "nf"))
def test_quantize_matches_the_numpy_reading_of_the_format(problem):
    w, bits, codebook, layout = make(problem)
    with _ignore_underflow_warnings():
        q = kj.quantize(w, bits, codebook, layout=layout)
    assert q.planes.shape == (*w.shape[:-2], w.shape[-2] // 32, w.shape[-1], bits)
    ts = np.asarray(q.tensor_scale, np.float64)
    assert np.all(ts > 0) and np.all(np.log2(ts) == np.round(np.log2(ts)))   # a normal power of two
    expected = np_dequantize(q)
    assert_equal_up_to_flushed_subnormals(kj.dequantize(q), expected)
    assert_within_documented_error(np.asarray(w, np.float32), q)
    other = kj.convert_layout(q, "planes" if layout == "fragment" else "fragment")
    np.testing.assert_array_equal(np_dequantize(other), expected)


@SETTINGS
@given(problems(), st.sampled_from([1, 3]), st.sampled_from(["float32", "bfloat16"]))
def test_matmul_matches_the_numpy_reading(problem, m, x_dtype):
    w, bits, codebook, layout = make(problem)
    with _ignore_underflow_warnings():
        q = kj.quantize(w, bits, codebook, layout=layout)
    rng = np.random.default_rng(problem[-2] + 1)
    x = jnp.asarray(rng.standard_normal((*q.batch_shape, m, q.in_features)), x_dtype)
    wd = np_dequantize(q).astype(np.float64)
    x64 = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        expected = x64 @ wd
        magnitude = np.abs(x64) @ np.abs(wd)
    y = np.asarray(kj.matmul(x, q), np.float64)
    eps = float(jnp.finfo(x_dtype).eps)
    # float32 accumulation over K terms, then one rounding to x's dtype; flushed subnormals.
    tol = (q.in_features * 2.0 ** -23 + eps) * magnitude + 1e-37
    finite = magnitude < 1e38
    assert np.all(np.abs(y - expected)[finite] <= tol[finite])


class _ignore_underflow_warnings:
    """Wide column spreads underflow on purpose here (the warning is tested in test_format)."""

    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", kj.ops.ScaleUnderflowWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)
