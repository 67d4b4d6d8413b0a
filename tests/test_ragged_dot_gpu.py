"""GPU-only checks of kbit_jax.ragged_dot (marked `gpu`, skipped without one): the CUDA kernels
(for bf16/f16 fragment-layout experts of N % 16 == 0 the wgmma kernel's grouped mode at prefill
sizes and the fused matmul kernel's below, the SIMT kernel for the rest) against a loop of reference products per group, over bits 2..5, the
three activation dtypes, both layouts, the GLU epilogues and the group-size cases of the contract;
the fused kernel's edges (its tilings, one-row groups whose block of activations reaches into the
next group, groups of several row blocks, model-sized experts in clusters; the same for each of
the wgmma kernel's row tiles, at model size too); the lowering's FFI
target; results the same with XLA's command buffers on and off."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kbit_jax as kj
from helpers import BITS, GLU_KINDS
from test_ragged_dot import check, random_sizes, size_patterns, stacked_weight

pytestmark = pytest.mark.gpu

PATTERNS = ["random", "empty_at_both_ends", "all_rows_in_one_group", "sum_below_m", "no_rows"]


def _gpu(a):
    return jax.device_put(a, jax.devices("gpu")[0])


def _run(x, w_q, sizes, glu=None, jit=True):
    f = jax.jit(kj.ragged_dot, static_argnames="glu") if jit else kj.ragged_dot
    return f(_gpu(x), w_q, _gpu(jnp.asarray(sizes, jnp.int32)), glu=glu)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_bits_dtypes(rng, pattern, bits, dtype):
    """N = 128: bf16 and f16 take the fused kernel, f32 the SIMT kernel. 70 rows of one group span
    several of the fused kernel's row blocks."""
    g, k, n, m = 6, 256, 128, 70
    w_q = _gpu_weight(rng, g, k, n, bits)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    sizes = size_patterns(rng, g, m)[pattern]
    check(_run(x, w_q, sizes), x, w_q, sizes)


@pytest.mark.parametrize("glu", GLU_KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
def test_glu(rng, bits, dtype, glu):
    g, k, n, m = 5, 128, 192, 41
    w_q = _gpu_weight(rng, g, k, n, bits)
    # x scaled by 4 / sqrt(K): gate * up stays inside fp16's range
    x = jnp.asarray(rng.standard_normal((m, k)) * 4 / np.sqrt(k), dtype)
    sizes = random_sizes(rng, g, m - 3)
    y = _run(x, w_q, sizes, glu)
    assert y.shape == (m, n // 2)
    check(y, x, w_q, sizes, glu)


# (M, group sizes): the fused kernel picks its tiling by the rows per active expert, ceil(M /
# min(G, M)); each case has empty groups at both ends, one-row groups next to larger ones (their
# block of activations holds the next group's rows, which must not be stored), and rows past
# sum(group_sizes).
TILING_CASES = {
    "rows2_blocks8": (14, [0, 1, 1, 1, 0, 1, 2, 0, 3, 1, 0]),
    "rows9_blocks32": (50, [0, 30, 1, 1, 13, 0]),
    "rows18_blocks32": (140, [0, 1, 1, 1, 130, 0, 1, 2, 0]),
    "rows41_blocks64": (205, [0, 200, 1, 1, 0]),  # (on compute capability 9.0: the wgmma kernel)
}


@pytest.mark.parametrize("glu", [None, "silu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("case", list(TILING_CASES))
def test_fused_kernel_tilings_and_edges(rng, case, bits, dtype, glu):
    m, sizes = TILING_CASES[case]
    sizes = np.asarray(sizes, np.int32)
    g, k, n = len(sizes), 256, 160  # (N = 160: a partial column group in every tiling)
    w_q = _gpu_weight(rng, g, k, n, bits)
    x = jnp.asarray(rng.standard_normal((m, k)) * 4 / np.sqrt(k), dtype)
    y = _run(x, w_q, sizes, glu)
    assert y.shape == (m, n // 2 if glu else n)
    check(y, x, w_q, sizes, glu)
    assert np.all(np.asarray(y[int(sizes.sum()):], np.float32) == 0)


# (M, group sizes) for the grouped wgmma kernel (bf16/f16 at prefill sizes: an estimate of 50,
# 100 and 200 rows per active expert, ceil(M / min(G, M))): 96-row tiles, then 128. Each starts with a
# one-row group whose box of x reaches into the next group, has groups of several row tiles with a
# partial last one, empty groups at both ends and inside, and rows past sum(group_sizes).
WGMMA_CASES = {
    "rows50": (400, [0, 1, 150, 0, 3, 200, 30, 0]),
    "rows100": (600, [0, 1, 300, 3, 250, 0]),
    "rows200": (1200, [0, 1, 600, 0, 530, 0]),
}


@pytest.mark.parametrize("glu", [None, "silu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("case", list(WGMMA_CASES))
def test_grouped_wgmma_edges(rng, case, bits, dtype, glu):
    m, sizes = WGMMA_CASES[case]
    sizes = np.asarray(sizes, np.int32)
    g, k, n = len(sizes), 224, 160  # (K = 224: an odd number of k-blocks; N = 160: a partial column tile)
    w_q = _gpu_weight(rng, g, k, n, bits)
    x = jnp.asarray(rng.standard_normal((m, k)) * 4 / np.sqrt(k), dtype)
    y = _run(x, w_q, sizes, glu)
    assert y.shape == (m, n // 2 if glu else n)
    check(y, x, w_q, sizes, glu)
    assert np.all(np.asarray(y[int(sizes.sum()):], np.float32) == 0)


@pytest.mark.parametrize("bits", [2, 4, 5])
def test_grouped_wgmma_model_sized_prefill(rng, bits):
    """Qwen3-30B-A3B-like gate/up experts at prefill (K = 2048, N = 1536), 8 experts of 150-260
    rows and one empty, rows past the sum; with SwiGLU and without."""
    g, k, n = 8, 2048, 1536
    w_q = _gpu_weight(rng, g, k, n, bits)
    sizes = rng.integers(150, 260, g).astype(np.int32)
    sizes[5] = 0
    m = int(sizes.sum()) + 9
    x = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), jnp.bfloat16)
    check(_run(x, w_q, sizes, "silu"), x, w_q, sizes, "silu")
    check(_run(x, w_q, sizes), x, w_q, sizes)


@pytest.mark.parametrize("bits", BITS)
def test_fused_kernel_model_sized_decode(rng, bits):
    """Qwen3-Coder-Next-like gate/up experts (K = 2048, N = 1024, SwiGLU) at decode: 10 of 64
    experts with one row each (the plan's k-split clusters see far fewer items than it estimated),
    and then all rows in one expert."""
    g, k, n = 64, 2048, 1024
    w_q = _gpu_weight(rng, g, k, n, bits)
    x = jnp.asarray(rng.standard_normal((12, k)) / np.sqrt(k), jnp.bfloat16)
    sizes = np.zeros(g, np.int32)
    sizes[3::6][:10] = 1
    check(_run(x, w_q, sizes, "silu"), x, w_q, sizes, "silu")
    one = np.zeros(g, np.int32)
    one[60] = 11
    check(_run(x, w_q, one), x, w_q, one)


@pytest.mark.parametrize("k", [256, 640])
@pytest.mark.parametrize("g", [1024, 1025])
def test_fused_kernel_many_groups_at_decode_sizes(rng, g, k):
    """Over a thousand groups with rows in a few at both ends and in the middle, sum < M, at
    decode sizes in both of the fused kernel's tilings for them (K <= 512: blocks of 32; above:
    blocks of 8, here with a partial last chunk)."""
    n = 64
    w_q = _gpu_weight(rng, g, k, n, 4)
    sizes = np.zeros(g, np.int32)
    sizes[[0, 33, g // 2, g - 2, g - 1]] = [2, 1, 3, 1, 2]
    x = jnp.asarray(rng.standard_normal((12, k)) / np.sqrt(k), jnp.bfloat16)
    y = _run(x, w_q, sizes, "silu")
    check(y, x, w_q, sizes, "silu")
    assert np.all(np.asarray(y[int(sizes.sum()):], np.float32) == 0)


def test_fused_kernel_m_zero_and_small_f16(rng):
    """M = 0 on the fused path (nothing launched), then 7 rows in two groups with empty groups at
    both ends and rows past the sum, f16 with a GLU."""
    w_q = _gpu_weight(rng, 4, 64, 64, 4)
    y = _run(jnp.zeros((0, 64), jnp.float16), w_q, np.zeros(4, np.int32))
    assert y.shape == (0, 64)
    x = jnp.asarray(rng.standard_normal((7, 64)), jnp.float16)
    y = _run(x, w_q, np.asarray([0, 3, 0, 2], np.int32), "silu")
    check(y, x, w_q, [0, 3, 0, 2], "silu")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [96, 200])
def test_generic_shapes_and_planes_layout(rng, n, bits):
    """N = 96 (fused kernel, a partial column group), N = 200 (not a multiple of 16: the SIMT
    kernel) and the planes layout (the SIMT kernel)."""
    g, k, m = 4, 160, 33
    for layout in ("fragment", "planes"):
        w_q = kj.quantize(_gpu(jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)), bits, layout=layout)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        sizes = random_sizes(rng, g, m)
        check(_run(x, w_q, sizes), x, w_q, sizes)


@pytest.mark.parametrize("bits", [2, 4, 5])
def test_model_sized_experts(rng, bits):
    """K = 2048, N = 256, a skewed routing with one group of 150 rows and empty groups, eager and
    under jit."""
    g, k, n = 16, 2048, 256
    w_q = _gpu_weight(rng, g, k, n, bits)
    sizes = np.zeros(g, np.int32)
    sizes[[0, 3, 4, 9, 15]] = [1, 150, 7, 33, 2]
    m = int(sizes.sum()) + 5
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    for jit in (False, True):
        check(_run(x, w_q, sizes, jit=jit), x, w_q, sizes)


def test_m_zero_and_no_groups_on_gpu(rng):
    w_q = _gpu_weight(rng, 3, 64, 64, 4)
    y = _run(jnp.zeros((0, 64), jnp.bfloat16), w_q, np.zeros(3, np.int32))
    assert y.shape == (0, 64)
    x = jnp.asarray(rng.standard_normal((9, 64)), jnp.bfloat16)
    y = _run(x, w_q, np.zeros(3, np.int32))
    assert np.array_equal(np.asarray(y, np.float32), np.zeros((9, 64), np.float32))


def test_many_groups(rng):
    """G = 3000 small experts, most of them empty: the schedule's prefix sums over many groups."""
    g, k, n = 3000, 64, 64
    w_q = _gpu_weight(rng, g, k, n, 4)
    sizes = np.zeros(g, np.int32)
    sizes[rng.choice(g, 40, replace=False)] = rng.integers(1, 6, 40)
    m = int(sizes.sum()) + 3
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    check(_run(x, w_q, sizes), x, w_q, sizes)


def test_too_many_groups_is_an_error(rng):
    """Above the kernels' G limit the CUDA target reports the limit (no crash, no wrong result)."""
    g = 8193
    w_q = _gpu_weight(rng, g, 32, 16, 2)
    x = _gpu(jnp.ones((4, 32), jnp.bfloat16))
    with pytest.raises(Exception, match="at most 8192 groups"):
        jax.block_until_ready(_run(x, w_q, np.zeros(g, np.int32)))


def test_lowers_to_the_cuda_target(rng):
    w_q = _gpu_weight(rng, 4, 64, 64, 4)
    x = _gpu(jnp.ones((8, 64), jnp.bfloat16))
    text = jax.jit(kj.ragged_dot).lower(x, w_q, _gpu(jnp.asarray([2, 0, 6, 0], jnp.int32))).as_text()
    assert "kbit_ragged_dot" in text


def test_repeatable_and_command_buffers(rng):
    """The same bits twice, and with XLA's command buffers (CUDA graphs) off in a subprocess."""
    g, k, n, m = 8, 512, 256, 60
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    sizes = random_sizes(rng, g, m - 4)
    f = jax.jit(kj.ragged_dot, static_argnames="glu")
    w_q = kj.quantize(_gpu(w), 4)
    xb = _gpu(jnp.asarray(x, jnp.bfloat16))
    y1 = np.asarray(f(xb, w_q, _gpu(sizes), glu="silu"), np.float32)
    y2 = np.asarray(f(xb, w_q, _gpu(sizes), glu="silu"), np.float32)
    assert np.array_equal(y1, y2)
    script = textwrap.dedent(f"""
        import sys, numpy as np, jax, jax.numpy as jnp, kbit_jax as kj
        d = np.load(sys.argv[1])
        w_q = kj.quantize(jnp.asarray(d["w"]), 4)
        y = jax.jit(kj.ragged_dot, static_argnames="glu")(
            jnp.asarray(d["x"], jnp.bfloat16), w_q, jnp.asarray(d["sizes"]), glu="silu")
        np.save(sys.argv[2], np.asarray(y, np.float32))
    """)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        inputs, out = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npy")
        np.savez(inputs, w=w, x=x, sizes=sizes)
        env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=")
        proc = subprocess.run([sys.executable, "-c", script, inputs, out], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert np.array_equal(np.load(out), y1)


def _gpu_weight(rng, g, k, n, bits):
    return kj.quantize(_gpu(jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)), bits)
