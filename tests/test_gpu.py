"""GPU-only checks (marked `gpu`, skipped without one): the fused matmul over the M sweep,
determinism, and XLA command buffers (CUDA graphs) on and off."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kbit_jax as kj
from kbit_jax.primitives.matmul import FUSED_GLU_MAX_M
from helpers import BITS, GLU_KINDS, dense64, glu_error_bound, matmul_error_bound, random_weight

pytestmark = pytest.mark.gpu

M_SWEEP = [0, 1, 2, 5, 16, 17, 33, 64, 100, 128, 511, 1000, 4096]


@pytest.mark.parametrize("method", ["fused", "auto"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [200, 256])
def test_matmul_m_sweep(n, bits, dtype, method, rng):
    """N = 200 is not a multiple of any tile; N = 256 takes the warp-specialized kernel at M <= 128.
    K = 544 (17 blocks of 32) ends in a partial chunk of 16 k-blocks."""
    gpu = jax.devices("gpu")[0]
    k = 544
    q = kj.quantize(jax.device_put(random_weight(rng, (k, n)), gpu), bits)
    w64 = dense64(q)
    for m in M_SWEEP:
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        y = kj.matmul(jax.device_put(x, gpu), q, method=method)
        assert y.shape == (m, n) and y.dtype == dtype
        y64, bound = matmul_error_bound(x, w64, dtype, dtype)
        err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - y64)
        assert np.all(err <= bound), f"M={m}: max err/bound = {np.max(err / bound)}"


def _assert_bound_and_repeatable(f, x, q, w64, gpu):
    """f(x, q) (a jitted kj.matmul) within the derived bound of the float64 product, and the same
    result twice."""
    y = f(jax.device_put(x, gpu), q)
    y64, bound = matmul_error_bound(x, w64, x.dtype, x.dtype)
    err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - y64)
    assert np.all(err <= bound), f"M={x.shape[0]}: max err/bound = {np.max(err / bound)}"
    assert np.array_equal(np.asarray(y), np.asarray(f(jax.device_put(x, gpu), q)))


def _assert_tiling(rng, dtype, k, n, bits, ms, gated_ms):
    """kj.matmul of random K x N weights at `bits`: within the derived bound and the same twice at
    every M of `ms`; with the GLU epilogue (silu, in the kernel) within its bound at every M of
    `gated_ms` (x scaled by 4 / sqrt(K), so gate * up stays inside fp16's range)."""
    gpu = jax.devices("gpu")[0]
    q = kj.quantize(jax.device_put(random_weight(rng, (k, n)), gpu), bits)
    w64 = dense64(q)
    f = jax.jit(kj.matmul)
    gated = jax.jit(functools.partial(kj.matmul, glu="silu", method="fused"))
    for m in ms:
        _assert_bound_and_repeatable(f, jnp.asarray(rng.standard_normal((m, k)), dtype), q, w64, gpu)
    for m in gated_ms:
        xs = jnp.asarray(rng.standard_normal((m, k)) * (4 / np.sqrt(k)), dtype)
        y = gated(jax.device_put(xs, gpu), q)
        y64, bound = glu_error_bound(xs, w64, dtype, dtype, "silu")
        err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - y64)
        assert np.all(err <= bound), f"GLU, M={m}: max err/bound = {np.max(err / bound)}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n, rows", [(8192, (17, 33, 64, 100, 128)), (32768, (9, 16))], ids=["n8192", "n32768"])
def test_matmul_nsplit_tiling(n, rows, bits, dtype, rng):
    """K = 256, N = 8192 at M = 17..128: the launcher's plan takes the N-split tiling (blocks of
    32 or 64 rows, partial at 17, 33 and 100; 2-CTA k-split clusters; at M = 100 and 128 the
    wgmma kernel takes them), which with bf16 rounds each scaled weight to bf16 (the bound counts
    it); N = 32768 at M = 9 and 16 takes it in blocks of 16 rows with bf16 (fp16 where its price
    says so); the same result twice (deterministic)."""
    _assert_tiling(rng, dtype, 256, n, bits, rows, ())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_matmul_wide_bits5_tiling(dtype, rng):
    """K = 2048, N = 5120 (Qwen3 gate/up) at bits 5: the 64-column tiling (variant 4, 80 items),
    in 16-row blocks at M = 9..16 (the launcher's plan) and in 8-row blocks from the 128 KiB table
    at M = 1..8 (planned at M <= 3, its rule wide5_one_round above: one round of whole items), with
    and without the GLU epilogue; the same result twice."""
    _assert_tiling(rng, dtype, 2048, 5120, 5, (1, 3, 8, 9, 12, 16), (1, 8, 9, 12, 16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
def test_matmul_wgmma_64_column_tile(bits, dtype, rng):
    """K = 2048, N = 4096 (Qwen3 q) at M = 17..64: the wgmma kernel's plan takes the 64-column
    tile (64 tiles over 2-CTA k-split clusters, four warpgroups each over its own chunks), partial
    at 17 and 40 rows, with and without the GLU epilogue; the same result twice."""
    _assert_tiling(rng, dtype, 2048, 4096, bits, (17, 40, 64), (40,))


@pytest.mark.parametrize("glu", GLU_KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", [4, 5])
def test_matmul_glu_every_path(bits, dtype, glu, rng):
    """The GLU epilogue of every kernel path: K 544 x N 200 (ragged tiles: the cp.async kernel
    above 16 rows), N 256 (the warp-specialized kernel up to 128 rows), K 4096 x N 512 (k-split
    clusters at small M), K 256 x N 8192 (the N-split tiling's per-warp cluster reduction at
    M = 17..128), float32 (the generic kernel), and XLA's gate after the kernel or after
    dequantize + dot. x is scaled by 4 / sqrt(K) so that gate * up stays far inside float16's
    range at every K."""
    gpu = jax.devices("gpu")[0]
    f = jax.jit(functools.partial(kj.matmul, glu=glu))
    fused = jax.jit(functools.partial(kj.matmul, glu=glu, method="fused"))  # the gate in the kernel at any M
    for k, n, ms in [(544, 200, (0, 1, 2, 5, 16, 17, 100, 511)), (544, 256, (1, 5, 16, 33, 128, 4096)),
                     (4096, 512, (1, 5, 16, 64)), (256, 8192, (17, 64, 100))]:
        q = kj.quantize(jax.device_put(random_weight(rng, (k, n)), gpu), bits)
        w64 = dense64(q)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k)) * (4 / np.sqrt(k)), dtype)
            y = f(jax.device_put(x, gpu), q)
            assert y.shape == (m, n // 2) and y.dtype == dtype
            y64, bound = glu_error_bound(x, w64, dtype, dtype, glu)
            err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - y64)
            assert np.all(err <= bound), f"K={k} N={n} M={m}: max err/bound = {np.max(err / bound)}"
            if FUSED_GLU_MAX_M < m <= 128 and dtype != jnp.float32:   # auto let XLA gate
                y = fused(jax.device_put(x, gpu), q)
                err = np.abs(np.asarray(y.astype(jnp.float32), np.float64) - y64)
                assert np.all(err <= bound), (f"in kernel, K={k} N={n} M={m}: "
                                              f"max err/bound = {np.max(err / bound)}")


_WGMMA_SCRIPT = textwrap.dedent("""
    import functools, sys
    import jax, jax.numpy as jnp, numpy as np, kbit_jax as kj
    from kbit_jax.primitives.matmul import wgmma_rows
    from helpers import dense64, glu_error_bound, matmul_error_bound, random_weight
    assert wgmma_rows() == (1, 1 << 30), wgmma_rows()
    rng = np.random.default_rng(int(sys.argv[1]))
    worst = 0.0
    # (K, N, M values): K = 544 ends in a partial ring stage; N = 400 in a partial 256- (128-)
    # column tile; K = 4096 with N = 256 is one or two tiles, so K splits over 8-CTA clusters; M
    # crosses the 64-, 128- and 256-row tiles (M > 128: 128 rows, or 256 rows and 128-column
    # tiles, whichever WgLauncher::cost prefers). The launcher takes 128-column tiles on these
    # small layers at M <= 128, and 256-column ones on N = 20480 (80 tiles in one wave, where
    # 128-column tiles would take two). N = 8960 at M = 512 is 140 tiles of 256 x 128: the last 8
    # split K over 2-CTA clusters after a round of 132 whole tiles; at M = 300 it takes 105 tiles
    # of 128 x 256. fp16 too (the scales times 2^e, f16_weight_exponent).
    for dt in (jnp.bfloat16, jnp.float16):
        for bits in (2, 3, 4, 5):
            for k, n, ms in [(544, 400, (1, 17, 64, 65, 129)), (4096, 256, (1, 33, 128, 200)),
                             (256, 4096, (100, 300)), (512, 20480, (48, 100)), (256, 8960, (300, 512))]:
                q = kj.quantize(random_weight(rng, (k, n)), bits)
                w64 = dense64(q)
                for m in ms:
                    x = jnp.asarray(rng.standard_normal((m, k)), dt)
                    y64, bound = matmul_error_bound(x, w64, dt, dt)
                    y = np.asarray(kj.matmul(x, q).astype(jnp.float32), np.float64)
                    r = np.max(np.abs(y - y64) / bound)
                    assert r <= 1, f"{dt.__name__} bits={bits} K={k} N={n} M={m}: max err/bound {r}"
                    assert np.array_equal(np.asarray(kj.matmul(x, q)), np.asarray(kj.matmul(x, q)))
                    worst = max(worst, r)
                    for glu in ("silu", "gelu_tanh"):
                        xs = x * (4 / np.sqrt(k))
                        y64, bound = glu_error_bound(xs, w64, dt, dt, glu)
                        y = np.asarray(kj.matmul(xs, q, glu=glu).astype(jnp.float32), np.float64)
                        r = np.max(np.abs(y - y64) / bound)
                        assert r <= 1, f"{dt.__name__} glu={glu} bits={bits} K={k} N={n} M={m}: max err/bound {r}"
    # fp16 with codebooks far from [-1, 1]: entries of up to 1000 (scaled products past fp16's
    # range without the power of two) and of at most 0.001; x divided by the factor keeps the
    # outputs inside fp16's range (the quantizer's blocks take the entries nearest [-1, 1])
    for factor in (1000.0, 1e-3):
        for bits in (2, 5):
            q = kj.quantize(random_weight(rng, (512, 384)), bits, codebook=kj.codebooks.normal_float(bits) * factor)
            w64 = dense64(q)
            x = jnp.asarray(rng.standard_normal((96, 512)) / max(factor, 1.0), jnp.float16)
            y64, bound = matmul_error_bound(x, w64, jnp.float16, jnp.float16)
            assert np.max(np.abs(y64)) < 3e4, np.max(np.abs(y64))
            y = np.asarray(kj.matmul(x, q).astype(jnp.float32), np.float64)
            r = np.max(np.abs(y - y64) / bound)
            assert np.all(np.isfinite(y)) and r <= 1, f"codebook x {factor} bits={bits}: max err/bound {r}"
    # stacked weights (batch entries with their own codebooks and tensor scales)
    qs = [kj.quantize(random_weight(rng, (256, 512)), 4) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *qs)
    xb = jnp.asarray(rng.standard_normal((3, 80, 256)), jnp.bfloat16)
    yb = jax.vmap(kj.matmul)(xb, stacked)
    for i, q in enumerate(qs):
        y64, bound = matmul_error_bound(xb[i], dense64(q), jnp.bfloat16, jnp.bfloat16)
        r = np.max(np.abs(np.asarray(yb[i].astype(jnp.float32), np.float64) - y64) / bound)
        assert r <= 1, f"stacked entry {i}: max err/bound {r}"
    print(f"worst err/bound {worst:.3f}")
""")


def test_matmul_wgmma_every_m(rng):
    """The wgmma kernel (bf16 and fp16, N % 16 == 0) forced at every M (KBIT_JAX_WGMMA_MIN_M=1 and
    _MAX_M, read once per process, hence the subprocess): partial ring stages, column and row
    tiles, 8-CTA k-split clusters, both GLUs, stacked weights, fp16 with codebooks of entries up
    to 1000 and down to 0.001; deterministic."""
    env = dict(os.environ, KBIT_JAX_WGMMA_MIN_M="1", KBIT_JAX_WGMMA_MAX_M=str(1 << 30),
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _WGMMA_SCRIPT, str(rng.integers(1 << 30))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_matmul_deterministic(rng):
    gpu = jax.devices("gpu")[0]
    q = kj.quantize(jax.device_put(random_weight(rng, (4096, 1024)), gpu), 4)
    f = jax.jit(kj.matmul)
    for m in (1, 16, 64):
        x = jax.device_put(jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16), gpu)
        assert np.array_equal(np.asarray(f(x, q)), np.asarray(f(x, q)))


_COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, kbit_jax as kj
    w = jax.random.normal(jax.random.key(0), (1024, 384))
    x = jax.random.normal(jax.random.key(1), (8, 1024), jnp.bfloat16)
    f = jax.jit(lambda x, w: [kj.matmul(x, w), kj.matmul(x * 2, w), kj.dequantize(w, jnp.bfloat16)])
    outs = [np.asarray(f(x, kj.quantize(w, b))[0].astype(jnp.float32)) for b in (2, 3, 4, 5)]
    np.save(__import__("sys").argv[1], np.stack(outs))
""")


def test_command_buffers_on_and_off(tmp_path):
    results = []
    for flag in ("", "--xla_gpu_enable_command_buffer="):   # default (on) and off
        out = tmp_path / f"out{len(results)}.npy"
        env = dict(os.environ, XLA_FLAGS=flag)
        subprocess.run([sys.executable, "-c", _COMMAND_BUFFER_SCRIPT, str(out)], env=env, check=True,
                       timeout=300)
        results.append(np.load(out))
    assert np.all(np.isfinite(results[0]))
    assert np.array_equal(results[0], results[1])
