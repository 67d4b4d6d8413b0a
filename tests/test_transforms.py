"""jit, vmap, pmap, shard_map, grad, and the lowered HLO calling the FFI targets."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kbit_jax as kj
from kbit_jax import _ext
from kbit_jax import reference as kbit_reference
from helpers import GLU_KINDS, dense64, glu64, matmul_error_bound, random_weight


@pytest.fixture
def layer(rng):
    w = random_weight(rng, (128, 48))
    return kj.quantize(w, 4)


def close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)


def test_jit_matches_eager(layer, rng):
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.float32)
    close(jax.jit(kj.matmul)(x, layer), kj.matmul(x, layer))
    q = jax.jit(lambda w: kj.quantize(w, 3))(kj.dequantize(layer))
    assert q.bits == 3 and q.shape == layer.shape
    close(jax.jit(kj.dequantize)(layer), kj.dequantize(layer))


def test_lowered_hlo_calls_the_ffi_targets(layer):
    if not kj.build_info()["cpu_module"]:
        pytest.fail("the C++ CPU module is not built: kbit_jax would silently use the reference")
    x = jnp.ones((2, 128), jnp.float32)
    text = jax.jit(kj.matmul).lower(x, layer).as_text()
    assert "kbit_matmul" in text
    assert "kbit_dequantize" in jax.jit(kj.dequantize).lower(layer).as_text()
    assert "kbit_quantize" in jax.jit(lambda w: kj.quantize(w, 2)).lower(jnp.ones((32, 4))).as_text()


def test_vmap_over_x_weights_and_both(rng):
    ws = random_weight(rng, (3, 64, 16))
    qs = kj.quantize(ws, 2)
    deq = dense64(qs)
    xs = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
    # over x only (weights shared)
    y = jax.vmap(kj.matmul, in_axes=(0, None))(xs, qs[0])
    close(y, np.einsum("bmk,kn->bmn", np.asarray(xs, np.float64), deq[0]), rtol=1e-4, atol=1e-4)
    # over weights only (x shared)
    y = jax.vmap(kj.matmul, in_axes=(None, 0))(xs[0], qs)
    close(y, np.einsum("mk,bkn->bmn", np.asarray(xs[0], np.float64), deq), rtol=1e-4, atol=1e-4)
    # both, with the mapped axis of x not leading
    y = jax.vmap(kj.matmul, in_axes=(1, 0))(jnp.swapaxes(xs, 0, 1), qs)
    close(y, np.einsum("bmk,bkn->bmn", np.asarray(xs, np.float64), deq), rtol=1e-4, atol=1e-4)
    # nested vmap and vmap of quantize/dequantize
    yy = jax.vmap(jax.vmap(kj.matmul, in_axes=(0, None)), in_axes=(0, 0))(xs[:, :, None], qs)
    close(yy[:, :, 0], jax.vmap(kj.matmul)(xs, qs))
    q2 = jax.vmap(lambda w: kj.quantize(w, 2))(ws)
    assert np.array_equal(q2.planes, qs.planes) and np.array_equal(q2.scales, qs.scales)
    close(jax.vmap(kj.dequantize)(qs), kj.dequantize(qs))


def test_scan_over_stacked_weights(rng):
    qs = kj.quantize(random_weight(rng, (4, 32, 32)), 3)
    x = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)

    def step(h, w):
        return jnp.tanh(kj.matmul(h, w)), None

    out, _ = jax.lax.scan(step, x, qs)
    expected = np.asarray(x, np.float64)
    for i in range(4):
        expected = np.tanh(expected @ dense64(qs)[i])
    close(out, expected, rtol=1e-4, atol=1e-4)


def test_grad_wrt_x(layer, rng):
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(kj.matmul(x, layer) ** 2))(x)
    w = dense64(layer)
    expected = 2 * (np.asarray(x, np.float64) @ w) @ w.T
    close(g, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("glu", GLU_KINDS)
def test_glu_under_jit_vmap_and_grad(layer, glu, rng):
    """matmul(glu=...) is act(y[..., 0::2]) * y[..., 1::2] of the product under jit, vmap (x
    and stacked weights), and grad w.r.t. x (through the plain product: the GLU is not linear)."""
    w = dense64(layer)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    close(jax.jit(functools.partial(kj.matmul, glu=glu))(x, layer), glu64(np.asarray(x, np.float64) @ w, glu),
          rtol=1e-4, atol=1e-4)
    qs = kj.quantize(random_weight(rng, (2, 64, 16)), 3)
    xs = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
    y = jax.vmap(functools.partial(kj.matmul, glu=glu))(xs, qs)
    assert y.shape == (2, 5, 8)
    close(y, glu64(np.einsum("bmk,bkn->bmn", np.asarray(xs, np.float64), dense64(qs)), glu), rtol=1e-4, atol=1e-4)
    close(jax.vmap(functools.partial(kj.matmul, glu=glu), in_axes=(0, None))(xs, qs[0]),
          glu64(np.asarray(xs, np.float64) @ dense64(qs)[0], glu), rtol=1e-4, atol=1e-4)

    def loss(x, f):
        return jnp.sum(f(x) ** 2)

    w32 = jnp.asarray(w, jnp.float32)
    g = jax.grad(loss)(x, lambda x: kj.matmul(x, layer, glu=glu))
    expected = jax.grad(loss)(x, lambda x: kbit_reference.apply_glu(
        jnp.matmul(x, w32, precision=jax.lax.Precision.HIGHEST), glu))
    # (float32 sums of terms up to ~|g|max with cancellation: a tolerance on that scale)
    close(g, expected, rtol=1e-4, atol=1e-5 * float(jnp.abs(expected).max()))
    _, vjp = jax.vjp(lambda x: kj.matmul(x, layer, glu=glu), x)
    assert vjp(jnp.ones((3, 24), jnp.float32))[0].shape == x.shape


def test_pmap_over_stacked_weights(rng):
    n = jax.local_device_count()
    assert n == 8, "conftest sets 8 simulated CPU devices"
    qs = kj.quantize(random_weight(rng, (n, 64, 24)), 4)
    xs = jnp.asarray(rng.standard_normal((n, 3, 64)), jnp.float32)
    y = jax.pmap(kj.matmul)(xs, qs)
    y64, bound = matmul_error_bound(xs, dense64(qs), jnp.float32, jnp.float32)
    assert np.all(np.abs(np.asarray(y, np.float64) - y64) <= bound)
    deq = jax.pmap(kj.dequantize)(qs)
    assert np.array_equal(np.asarray(deq), np.asarray(kj.dequantize(qs)))


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_shard_map_with_vma_and_grads(layer, rng, axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):  # Explicit axes need the mesh in context for jnp ops
        _check_shard_map(mesh, x, layer)


def _check_shard_map(mesh, x, layer):

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"),
                       check_vma=True)
    def local(x, w):
        return kj.matmul(x, w)

    close(local(x, layer), kj.matmul(x, layer))

    def loss_sharded(x):
        return jnp.sum(local(x, layer) ** 2)

    def loss(x):
        return jnp.sum(kj.matmul(x, layer) ** 2)

    close(jax.grad(loss_sharded)(x), jax.grad(loss)(x), rtol=1e-4, atol=1e-3)

    # a replicated output computed from a varying input must be rejected or correct, never
    # one device's data: psum makes it replicated explicitly.
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(),
                       check_vma=True)
    def summed(x, w):
        return jax.lax.psum(kj.matmul(x, w).sum(0), "data")

    close(summed(x, layer), kj.matmul(x, layer).sum(0), rtol=1e-4, atol=1e-3)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"),
                       check_vma=True)
    def gated(x, w):
        return kj.matmul(x, w, glu="silu")

    close(gated(x, layer), kj.matmul(x, layer, glu="silu"))
    g_ref = jax.grad(lambda x: jnp.sum(kj.matmul(x, layer, glu="silu") ** 2))(x)
    close(jax.grad(lambda x: jnp.sum(gated(x, layer) ** 2))(x), g_ref, rtol=1e-4,
          atol=1e-5 * float(jnp.abs(g_ref).max()))


def test_jit_under_eval_shape_and_dtypes(layer):
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        out = jax.eval_shape(kj.matmul, jax.ShapeDtypeStruct((7, 3, 128), dtype), layer)
        assert out.shape == (7, 3, 48) and out.dtype == dtype


@pytest.mark.parametrize("m, n, dtype, layout, method, fused", [
    (1, 64, jnp.bfloat16, "fragment", "auto", True),
    (16, 72, jnp.float16, "fragment", "auto", True),      # any N up to 16 rows
    (128, 64, jnp.bfloat16, "fragment", "auto", True),
    (17, 72, jnp.bfloat16, "fragment", "auto", False),    # N % 16 != 0 above 16 rows
    (129, 64, jnp.bfloat16, "fragment", "auto", False),   # above FUSED_MAX_M: dequantize + dot
    (128, 72, jnp.bfloat16, "fragment", "fused", True),
    (1, 64, jnp.bfloat16, "fragment", "dequantize", False),
    (1, 64, jnp.bfloat16, "planes", "auto", False),        # the fast kernel reads the fragment layout
    (64, 72, jnp.float32, "planes", "auto", True),         # f32 keeps the f32 kernel (no TF32 dot)
])
def test_cuda_lowering_dispatch(m, n, dtype, layout, method, fused):
    """The CUDA lowering's choice between the fused kernel and dequantize + dense dot, checked
    by lowering for CUDA on any machine (needs only the CUDA module to be built)."""
    if not kj.build_info()["cuda_module"]:
        pytest.skip("the CUDA module is not built")
    w = kj.quantize(jnp.ones((256, n)), 4, layout=layout)
    x = jnp.ones((m, 256), dtype)
    f = jax.jit(lambda x, w: kj.matmul(x, w, method=method))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert ("@kbit_matmul" in text or '"kbit_matmul"' in text) == fused
    assert ("kbit_dequantize" in text) == (not fused)


def test_cuda_lowering_glu():
    """The fused kernel gets the glu attribute; dequantize + dense dot gates in XLA."""
    if not kj.build_info()["cuda_module"]:
        pytest.skip("the CUDA module is not built")
    from kbit_jax.primitives.matmul import FUSED_GLU_MAX_M
    w = kj.quantize(jnp.ones((256, 64)), 4)
    f = jax.jit(lambda x, w: kj.matmul(x, w, glu="gelu_tanh"))
    # (rows, dtype) -> the kernel gates / the fused kernel runs without a GLU, XLA gates / dequantize + dot
    for m, dtype, where in ((1, jnp.bfloat16, "kernel"), (FUSED_GLU_MAX_M, jnp.float16, "kernel"),
                            (FUSED_GLU_MAX_M + 1, jnp.bfloat16, "xla after kernel"),
                            (64, jnp.float32, "kernel"),       # the float32 kernel gates at any M
                            (129, jnp.bfloat16, "xla after dequantize")):
        text = f.trace(jnp.ones((m, 256), dtype), w).lower(lowering_platforms=("cuda",)).as_text()
        assert ("glu = 2" in text) == (where == "kernel"), (m, where)
        assert ("glu = 0" in text) == (where == "xla after kernel"), (m, where)
        assert ("kbit_dequantize" in text) == (where == "xla after dequantize"), (m, where)
        assert ("exponential" in text) == where.startswith("xla"), (m, where)
    forced = jax.jit(lambda x, w: kj.matmul(x, w, glu="gelu_tanh", method="fused"))
    assert "glu = 2" in forced.trace(jnp.ones((64, 256), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()


def test_wgmma_rows_come_from_the_module(monkeypatch):
    """The lowering's wgmma rows are the CUDA module's answer (its launcher's own decision, with
    the device check and the environment): (0, 0) on a machine without a wgmma GPU, and without
    the module."""
    cuda = _ext._load("_kbit_cuda")
    if cuda is None:
        pytest.skip("the CUDA module is not built")
    from kbit_jax.primitives import matmul as mp
    for n, k, bits in ((4096, 4096, 4), (2048, 2048, 5), (28672, 8192, 2), (0, 0, 0)):
        assert mp.wgmma_rows(n, bits, k) == tuple(cuda.wgmma_rows(n, k, bits)), (n, k, bits)
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert mp.wgmma_rows(4096, 4, 4096) == (0, 0)
    monkeypatch.setattr(_ext, "has_cuda", lambda: False)
    assert mp.wgmma_rows(4096, 4, 4096) == (0, 0)


def test_cuda_lowering_follows_the_wgmma_rows(monkeypatch):
    """On a device with the wgmma kernel (simulated: the module's rule alone, wgmma_rule_rows), the
    lowering follows cpp/cuda/matmul.cu's rule -- from 33 rows, or from 17 at bits 5 and where N
    >= 2560 with K * N <= 48 Mi or N of 5120..8192, up to 1024 (bits 5: 512) -- where it decides
    who gates a GLU and whether M > 128 stays fused."""
    cuda = _ext._load("_kbit_cuda")
    if cuda is None:
        pytest.skip("the CUDA module is not built")
    from kbit_jax.primitives import matmul as mp
    monkeypatch.setattr(mp, "_module_wgmma_rows", cuda.wgmma_rule_rows)
    assert mp.wgmma_rows(2048, 4, 4096) == (33, 1024) and mp.wgmma_rows(2048, 2, 10240) == (33, 1024)
    assert mp.wgmma_rows(2048, 5, 2048) == (17, 512) and mp.wgmma_rows(14336, 5, 4096) == (17, 512)
    assert mp.wgmma_rows(2560, 4, 8192) == (17, 1024) and mp.wgmma_rows(8192, 3, 28672) == (17, 1024)
    assert mp.wgmma_rows(10240, 4, 2048) == (17, 1024) and mp.wgmma_rows(14336, 4, 4096) == (33, 1024)
    assert mp.wgmma_rows(4096, 4, 14336) == (33, 1024) and mp.wgmma_rows(4096, 2, 2048) == (17, 1024)
    assert mp.wgmma_rows(8208, 4, 8192) == (33, 1024)  # past the band: K * N = 64 Mi
    assert mp.wgmma_rows() == (33, 1024) and mp.wgmma_rows(5120, 4) == (17, 1024)  # (K = 0: small)
    assert mp.wgmma_rows(10240, 4) == (17, 1024) and mp.wgmma_rows(4096, 4) == (17, 1024)
    assert mp.wgmma_rows(2048, 4) == (33, 1024)
    f = jax.jit(lambda x, w: kj.matmul(x, w, glu="silu"))
    for n, bits, where in ((5120, 4, "kernel"), (2048, 5, "kernel"), (2048, 4, "xla after kernel"),
                           (2048, 2, "xla after kernel")):
        w = kj.quantize(jnp.ones((64, n)), bits)  # K = 64: a short layer
        text = f.trace(jnp.ones((24, 64), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
        assert ("glu = 1" in text) == (where == "kernel"), (n, bits)
        assert ("glu = 0" in text) == (where == "xla after kernel"), (n, bits)
    w = kj.quantize(jnp.ones((64, 4096)), 4)
    g = jax.jit(kj.matmul)
    for dtype in (jnp.bfloat16, jnp.float16):  # (fp16 takes the wgmma kernel too)
        assert "kbit_dequantize" not in g.trace(jnp.ones((200, 64), dtype), w).lower(
            lowering_platforms=("cuda",)).as_text()
    for bits, where in ((4, "kernel"), (5, "dequantize")):  # 1000 rows: within bits 2-4's range only
        w = kj.quantize(jnp.ones((64, 4096)), bits)
        text = g.trace(jnp.ones((1000, 64), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
        assert ("kbit_dequantize" in text) == (where == "dequantize"), bits
    w = kj.quantize(jnp.ones((64, 4096)), 4)
    monkeypatch.setattr(mp, "_module_wgmma_rows", lambda n, k, bits: (0, 0))  # no wgmma kernel here
    assert mp.wgmma_rows(4096, 5) == (0, 0)
    assert "kbit_dequantize" in g.trace(jnp.ones((201, 64), jnp.bfloat16), w).lower(
        lowering_platforms=("cuda",)).as_text()
