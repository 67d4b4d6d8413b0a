"""The format itself: E4M4, codebooks, layouts and the KbitWeight pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kbit_jax as kj
from kbit_jax import codebooks
from kbit_jax import format as fmt
from helpers import BITS, LAYOUTS


# -- E4M4 -------------------------------------------------------------------------------------
def test_e4m4_values_follow_the_definition():
    for byte in range(256):
        e, m = byte >> 4, byte & 15
        expected = 2.0 ** (e - 11) * (1 + m / 16) if e else 2.0 ** -10 * m / 16
        assert float(kj.decode_e4m4(byte)) == expected
    assert float(kj.decode_e4m4(0)) == 0.0 and float(kj.decode_e4m4(255)) == 31.0


def test_e4m4_round_trip_and_monotonic():
    values = fmt.E4M4_VALUES
    assert np.all(np.diff(values) > 0), "byte order must equal value order"
    assert np.array_equal(np.asarray(kj.encode_e4m4(values)), np.arange(256))


def test_e4m4_rounds_to_nearest_ties_down_and_saturates(rng):
    v = rng.uniform(0, 40, 100_000).astype(np.float32)
    codes = np.asarray(kj.encode_e4m4(v))
    err = np.abs(fmt.E4M4_VALUES[codes].astype(np.float64) - v)
    # nearest: no other code is strictly closer
    all_err = np.abs(fmt.E4M4_VALUES[None, :].astype(np.float64) - v[:, None])
    assert np.all(err <= all_err.min(axis=1))
    # saturating, never wrapping: everything at or above 31 encodes to 31
    assert np.all(codes[v >= 31] == 255)
    assert np.all(np.diff(codes[np.argsort(v)].astype(int)) >= 0), "encode must be monotonic"
    mid = fmt.E4M4_MIDPOINTS
    assert np.array_equal(np.asarray(kj.encode_e4m4(mid)), np.arange(255)), "ties go to the lower code"
    huge = np.array([1e6, 3.4e38, np.inf], np.float32)
    assert np.all(np.asarray(kj.encode_e4m4(huge)) == 255)
    assert np.all(np.asarray(kj.encode_e4m4(np.array([0.0, -1.0, np.nan], np.float32))) == 0)


# -- codebooks --------------------------------------------------------------------------------
def test_normal_float_codebook():
    np.testing.assert_allclose(codebooks.normal_float(2), [-1, -0.277, 0.277, 1], atol=5e-4)
    for bits in BITS:
        cb = codebooks.normal_float(bits)
        assert cb.shape == (2 ** bits,) and cb.dtype == np.float32
        assert np.all(np.diff(cb) > 0) and np.abs(cb).max() == 1.0
        np.testing.assert_allclose(cb, -cb[::-1])
        assert not np.any(cb == 0)


def test_named_codebooks():
    assert codebooks.nf4().shape == (16,) and 0.0 in codebooks.nf4()
    for bits in BITS:
        for name in ("lloyd_max", "uniform", "nf"):
            cb = codebooks.get_codebook(name, bits)
            assert cb.shape == (2 ** bits,) and np.all(np.abs(cb) <= 1)
    assert np.array_equal(codebooks.uniform(2), [-1, -0.5, 0, 0.5])


@pytest.mark.parametrize("bad, err", [("nope", ValueError), ([0.1, 0.2, 0.3], ValueError),
                                      ([0, 1, 2, np.nan], ValueError), ("nf4", ValueError)])
def test_bad_codebooks(bad, err):
    with pytest.raises(err, match="codebook"):
        codebooks.get_codebook(bad, 2)


# -- layouts ----------------------------------------------------------------------------------
def test_fragment_order_is_a_permutation_matching_the_mma_quad():
    assert sorted(fmt.FRAGMENT_K.tolist()) == list(range(32))
    for t in range(4):  # thread t of a quad: k = 2t, 2t+1, 2t+8, 2t+9 of both k16 halves
        expected = [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9, 16 + 2 * t, 17 + 2 * t, 24 + 2 * t, 25 + 2 * t]
        assert fmt.FRAGMENT_K[8 * t: 8 * t + 8].tolist() == expected


@pytest.mark.parametrize("bits", BITS)
def test_planes_layout_is_ballot_order(bits, rng):
    codes = rng.integers(0, 2 ** bits, size=(5, 32))
    words = np.asarray(fmt.pack_codes(jnp.asarray(codes), bits, "planes"))
    for b in range(bits):  # bit j of word b is bit b of element j
        expected = sum(((codes[:, j] >> b) & 1).astype(np.uint64) << j for j in range(32))
        assert np.array_equal(words[:, b], expected.astype(np.uint32))


@pytest.mark.parametrize("bits", BITS)
def test_fragment_layout_is_dense_packing_in_fragment_order(bits, rng):
    codes = rng.integers(0, 2 ** bits, size=(5, 32))
    words = np.asarray(fmt.pack_codes(jnp.asarray(codes), bits, "fragment")).astype(np.uint64)
    as_int = [sum(int(words[r, i]) << (32 * i) for i in range(bits)) for r in range(5)]
    for r in range(5):
        for p in range(32):
            assert (as_int[r] >> (bits * p)) & (2 ** bits - 1) == codes[r, fmt.FRAGMENT_K[p]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(bits, layout, rng):
    codes = rng.integers(0, 2 ** bits, size=(3, 4, 32))
    words = fmt.pack_codes(jnp.asarray(codes), bits, layout)
    assert words.shape == (3, 4, bits) and words.dtype == jnp.uint32
    assert np.array_equal(np.asarray(fmt.unpack_codes(words, layout)), codes)


def test_convert_layout_is_lossless(rng):
    w = jnp.asarray(rng.standard_normal((64, 40)), jnp.float32)
    for bits in BITS:
        a = kj.quantize(w, bits, layout="planes")
        b = kj.convert_layout(a, "fragment")
        assert b.layout == "fragment"
        assert np.array_equal(kj.dequantize(a), kj.dequantize(b))
        back = kj.convert_layout(b, "planes")
        assert np.array_equal(back.planes, a.planes)


# -- the pytree -------------------------------------------------------------------------------
def test_kbit_weight_pytree_and_derived_metadata(rng):
    w = jnp.asarray(rng.standard_normal((3, 96, 17)), jnp.float32)
    q = kj.quantize(w, 3)
    assert (q.bits, q.in_features, q.out_features, q.batch_shape, q.shape) == (3, 96, 17, (3,), (3, 96, 17))
    assert q.planes.shape == (3, 3, 17, 3) and q.scales.shape == (3, 3, 17)
    assert q.codebook.shape == (3, 8) and q.tensor_scale.shape == (3,)
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 4
    again = jax.tree.unflatten(treedef, leaves)
    assert again.layout == q.layout and again.shape == q.shape
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(q)[0]]
    assert paths == [".planes", ".scales", ".codebook", ".tensor_scale"]
    one = q[1]
    assert one.shape == (96, 17)
    assert np.array_equal(kj.dequantize(one), kj.dequantize(q)[1])
    assert q.bits_per_element == 3.25
    with pytest.raises(IndexError):
        one[0]


def test_tensor_scale_is_a_power_of_two_that_fits():
    from kbit_jax.reference import tensor_scale
    for amax in [1e-3, 0.3, 1.0, 15.5, 16.0, 31.0, 31.5, 32.0, 1000.0, 3e30]:
        w = jnp.full((32, 1), amax, jnp.float32)
        s = float(tensor_scale(w))
        assert np.log2(s) == round(np.log2(s))
        assert amax / s <= 31 and amax / s > 15, (amax, s)
    assert float(tensor_scale(jnp.zeros((32, 2)))) == 1.0
    assert np.isnan(tensor_scale(jnp.array([[np.inf]] * 32, jnp.float32)))


# -- extreme magnitudes and range ---------------------------------------------------------------
def _relative_error(w, q):
    d = np.asarray(kj.dequantize(q), np.float64)
    return np.max(np.abs(d - w)) / np.max(np.abs(w))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("absmax", [2.0 ** 126, 1e38, 3e38, float(np.finfo(np.float32).max)])
def test_huge_blocks_quantize_with_the_documented_error(layout, absmax, rng):
    """1 / absmax is subnormal from 2^126 on; the quantizer must not flush it to zero."""
    w = np.linspace(-1, 1, 32 * 6, dtype=np.float64).reshape(32, 6) * rng.permutation(6)
    w = (w / np.max(np.abs(w)) * absmax).astype(np.float32)
    q = kj.quantize(w, 4, layout=layout)
    # nf4 codes are at most half their largest gap (~0.28) apart, E4M4 rounds the scale by <= 1/32.
    assert _relative_error(w, q) < 0.2
    # Bit-exact with the reference (the CPU kernel and the spec agree at the edge too).
    from kbit_jax import reference
    planes, scales = reference.quantize(jnp.asarray(w), q.codebook, q.tensor_scale, layout=layout)
    np.testing.assert_array_equal(planes, q.planes)
    np.testing.assert_array_equal(scales, q.scales)


@pytest.mark.parametrize("amax", [2.0 ** -122, 2.0 ** -124, 2.0 ** -126])
def test_tiny_matrices_keep_a_nonzero_tensor_scale(amax, rng):
    w = rng.standard_normal((64, 8))
    w = (w / np.max(np.abs(w)) * amax).astype(np.float32)
    q = kj.quantize(w, 4)
    assert float(q.tensor_scale) == 2.0 ** -126
    d = np.asarray(kj.dequantize(q), np.float64)
    # Relative error as for any matrix, plus float32's smallest normal absolutely: values below
    # it are flushed to zero (docs/errors.md).
    assert np.max(np.abs(d - w)) <= 0.2 * amax + 2.0 ** -126
    assert np.count_nonzero(d) > 0


def test_underflowed_blocks_are_counted_and_warned(rng):
    w = np.ones((64, 41), np.float32) * np.logspace(-20, 20, 41, dtype=np.float32)
    with pytest.warns(kj.ops.ScaleUnderflowWarning, match="70 of 82 blocks") as caught:
        q = kj.quantize(w, 4)
    assert caught[0].message.count == 70
    zero_columns = np.all(np.asarray(kj.dequantize(q)) == 0, axis=0)
    assert zero_columns.sum() == 35
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kj.quantize(rng.standard_normal((64, 8)).astype(np.float32), 4)   # nothing underflows
        jax.jit(lambda w: kj.quantize(w, 4))(w)                           # traced: no count
