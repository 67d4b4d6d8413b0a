"""matmul_p: x[B, M, K] and a weight (planes, scales, codebook, tensor_scale) with batch B -> y[B, M, N].

Params: ``layout`` (the weight's layout), ``method``: "fused" runs the fused
dequantize+matmul kernel; "dequantize" materializes W in x.dtype with the dequantize kernel
and lets XLA's dense dot do the rest (faster at large M on the GPU); "auto" picks by M on
the GPU (see `FUSED_MAX_M`, `wgmma_rows`) and the fused kernel elsewhere; and ``glu``: None, or a
`reference.GLU_ACTIVATIONS` name, for which y is ``act(y[..., 0::2]) * y[..., 1::2]``
(``[B, M, N / 2]``), applied by the kernels to their float32 sums (the FFI attribute ``glu``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _ext, reference
from ..format import BLOCK
from ..sharding import FactorRule
from ._common import (_varying_axes, define, fold_batch_into_leading_axis, layout_attr, out_aval,
                      weight_tangent, with_auto_axes, x_cotangent, zero_tangent)
from .dequantize import dequantize_kernel_p, dequantize_p

matmul_p = Primitive("kbit_matmul")
METHODS = ("auto", "fused", "dequantize")

#: On CUDA, "auto" uses the fused kernel up to this many rows (M) and dequantize + dense dot
#: above it. Measured on an H200 (bits 4, ten shapes):
#: above 16 rows the warp-specialized kernel runs (it needs N % 16 == 0), in blocks of 16 rows
#: or, where its launcher expects that to be faster, in N-split blocks of 32 or 64 rows that
#: decode each weight once per block. At M = 128 those take 0.65-0.75x the time of dequantize +
#: dot on the Llama shapes (Llama-3-70B gate/up 222 against 296 us) and about the same on the
#: small Qwen3/GLM ones; above 128 rows the dense dot's tensor-core GEMM wins. Other N keep
#: dequantize + dot above 16 rows (the other kernel takes about as long as dequantize + dot
#: at M = 32: Llama-3-8B gate/up 97 against 88 us).
FUSED_MAX_M = 128
#: Rows up to which every N takes the fused kernel under "auto".
FUSED_ANY_N_MAX_M = 16


def _module_wgmma_rows(n: int, k: int, bits: int) -> tuple[int, int]:
    """The CUDA module's wgmma_rows (cpp/cuda/matmul.cu's wgmma_rows_here, what its launcher
    uses); (0, 0) without the module. (Tests replace it with the module's wgmma_rule_rows to
    lower for a device with the wgmma kernel on any machine.)"""
    cuda = _ext._load("_kbit_cuda") if _ext.has_cuda() else None
    return tuple(cuda.wgmma_rows(n, k, bits)) if cuda is not None else (0, 0)


def wgmma_rows(n: int = 0, bits: int = 0, k: int = 0) -> tuple[int, int]:
    """(min, max): the rows (M) for which bf16 and fp16 products of ``n`` columns (N % 16 == 0),
    ``k`` rows of W and ``bits`` take the CUDA module's wgmma kernel (cpp/cuda/matmul_wgmma.cuh;
    cpp/cuda/matmul.cu says where it wins: from 33 rows, or from 17 at bits 5 and where N >= 2560
    with K * N <= 48 Mi or N of 5120..8192; up to 1024 at bits 2-4 and 512 at bits 5), whose
    epilogue applies a GLU to the staged float32 tile, after its main loop; (0, 0) where there is
    none (no CUDA module, a build without the sm_90a target, a GPU other than compute capability
    9.0, or KBIT_JAX_WGMMA_MIN_M=0, which like _MAX_M sets the range for every product). The
    module answers, as its launcher decides, for the current device; ``k`` = 0 counts as a layer
    within the K * N bound. Above FUSED_MAX_M, "auto" takes the fused kernel too where this range
    covers M."""
    lo, hi = _module_wgmma_rows(n, k, bits)
    return int(lo), int(hi)


#: On CUDA under method "auto", rows up to which the fused bf16/f16 kernel applies a GLU itself;
#: above, its plain product is gated by XLA (one elementwise fusion; "fused" keeps the gate in the
#: kernel at any M), except in the wgmma kernel (`wgmma_rows`), whose epilogue gates. In the other
#: kernels the gate runs on the warp that ends each work item while it holds its ring stages, and
#: its work grows with the item's rows. Measured on an H200 (bits 4, `bench_matmul.py --glu silu`),
#: fused gate against kernel + XLA gate: at M = 1
#: 0.6-5.3 us less on the Qwen3, GLM-4.7 and Llama-3 gate/up shapes; at M = 4 and 8 less on the
#: small shapes but 3.5-4.2 us more on Llama-3-70B's (8192 x 28672: 49.5 against 46.0 us at M = 4);
#: at M = 16 mixed.
FUSED_GLU_MAX_M = 1


#: The FFI attribute ``glu`` (cpp/glu.h's kbit::Glu) for each value of the ``glu`` param.
GLU_IDS = {None: 0, "silu": 1, "gelu_tanh": 2}
assert set(GLU_IDS) - {None} == set(reference.GLU_ACTIVATIONS)


def _abstract_eval(x, planes, scales, codebook, tensor_scale, *, layout, method, glu):
    b, m, _ = x.shape
    n = planes.shape[2] // (2 if glu else 1)
    return out_aval((b, m, n), x.dtype, (x, planes, scales, codebook, tensor_scale))


def _reference(x, planes, scales, codebook, tensor_scale, *, layout, method, glu):
    return reference.matmul(x, planes, scales, codebook, tensor_scale, layout=layout, glu=glu)


def _dequantize_then_dot(x, planes, scales, codebook, tensor_scale, *, layout, method, glu):
    w = dequantize_kernel_p.bind(planes, scales, codebook, tensor_scale, layout=layout, dtype=x.dtype)
    # The result is asked for in x's dtype: cuBLAS accumulates 16-bit products in float32 and
    # rounds once, as an f32 result + convert would, without writing and re-reading a float32
    # [B, M, N] (H200, M = 4096: 4 % less time, median over the benchmark shapes). float32
    # inputs ask for full float32 precision: the default may use TF32 on the GPU. A GLU gates
    # the float32 sums, as the kernels do.
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    if glu is None:
        return jnp.einsum("bmk,bkn->bmn", x, w, precision=precision)
    y = jnp.einsum("bmk,bkn->bmn", x, w, precision=precision, preferred_element_type=jnp.float32)
    return reference.apply_glu(y, glu).astype(x.dtype)


_dequantize_then_dot_lowering = mlir.lower_fun(_dequantize_then_dot, multiple_results=False)
_fused_cuda_lowering = jax.ffi.ffi_lowering("kbit_matmul")


def _ffi_attrs(*, layout, method, glu):
    return {"layout": layout_attr(layout), "glu": np.int32(GLU_IDS[glu])}


def _cuda_lowering(ctx, x, planes, scales, codebook, tensor_scale, *, layout, method, glu):
    x_aval = ctx.avals_in[0]
    # The fast fused kernel reads the fragment layout with bf16/f16 activations; float32
    # activations take the (slower) float32 kernel to keep float32 accuracy, since XLA's
    # dense f32 dot may use TF32. The planes layout is served by dequantize + dense dot.
    fast = layout == "fragment" and x_aval.dtype != jnp.float32
    m = x_aval.shape[1]
    n, bits = ctx.avals_in[1].shape[2:]  # planes: [B, K/32, N, bits]
    small = m <= FUSED_ANY_N_MAX_M or (m <= FUSED_MAX_M and n % 16 == 0)
    lo, hi = wgmma_rows(n, bits, x_aval.shape[2])
    tensor_core = (x_aval.dtype in (jnp.bfloat16, jnp.float16) and layout == "fragment" and n % 16 == 0
                   and 0 < lo <= m <= hi)
    fused = method == "fused" or (method == "auto" and (x_aval.dtype == jnp.float32 or
                                                         (fast and (small or tensor_core))))
    if not fused:
        return _dequantize_then_dot_lowering(ctx, x, planes, scales, codebook, tensor_scale,
                                             layout=layout, method=method, glu=glu)
    if glu is not None and fast and method == "auto" and m > FUSED_GLU_MAX_M and not tensor_core:
        return _gated_by_xla_lowering(ctx, x, planes, scales, codebook, tensor_scale,
                                      layout=layout, method=method, glu=glu)
    return _fused_cuda_lowering(ctx, x, planes, scales, codebook, tensor_scale,
                                **_ffi_attrs(layout=layout, method=method, glu=glu))


def _gated_by_xla(x, planes, scales, codebook, tensor_scale, *, layout, method, glu):
    y = matmul_kernel_p.bind(x, planes, scales, codebook, tensor_scale, layout=layout, method=method,
                             glu=None)
    return reference.apply_glu(y, glu)


_gated_by_xla_lowering = mlir.lower_fun(_gated_by_xla, multiple_results=False)


def _batcher(args, dims, *, layout, method, glu):
    x, *weight = args
    x_dim, *weight_dims = dims
    if all(d is None for d in weight_dims):
        # Only x is mapped: fold the mapped axis into M instead of copying the weight.
        x = jnp.moveaxis(x, x_dim, 1)                       # [B, V, M, K]
        b, v, m, k = x.shape
        y = matmul_p.bind(x.reshape(b, v * m, k), *weight, layout=layout, method=method, glu=glu)
        return jnp.moveaxis(y.reshape(b, v, m, -1), 1, 0), 0
    return fold_batch_into_leading_axis(matmul_p, args, dims, layout=layout, method=method, glu=glu)


#: How matmul_p partitions (kbit_jax.sharding): x's K is the K/32 blocks `k` times 32; `k` is
#: contracted (psum over its mesh axes); weights' shardings win (order: planes, scales, x).
SHARDING_RULE = FactorRule("b m (k i), b k n j, b k n, b c, b -> b m n", reduction=("k",),
                           replicated=("i", "j", "c"), order=(1, 2, 0, 3, 4), i=BLOCK)
#: With a GLU the weight's N is `n` gate/up pairs `p`: a shard along N holds whole pairs.
GLU_SHARDING_RULE = FactorRule("b m (k i), b k (n p) j, b k (n p), b c, b -> b m n", reduction=("k",),
                               replicated=("i", "j", "c"), order=(1, 2, 0, 3, 4), i=BLOCK, p=2)


def _sharding_rule(*, layout, method, glu):
    return SHARDING_RULE if glu is None else GLU_SHARDING_RULE


def _split_at_reduction(*, layout, method, glu):
    """A GLU does not commute with the sum over K's shards: where K is sharded, the shards'
    products are summed first and gated after."""
    if glu is None:
        return None
    return dict(layout=layout, method=method, glu=None), lambda y: reference.apply_glu(y, glu)


#: The kernel primitive matmul_p lowers to (directly, or per shard via custom_partitioning).
matmul_kernel_p = define(matmul_p, abstract_eval=_abstract_eval, reference=_reference,
                         ffi_attrs=_ffi_attrs, batcher=_batcher, cuda_lowering=_cuda_lowering,
                         rule=_sharding_rule, split_at_reduction=_split_at_reduction)


# -- differentiation ---------------------------------------------------------------------------
# y is linear in x and, for fixed codes and scales, in the codebook and tensor_scale
# (`_common.weight_tangent`); codes and scales are integers, with float0 zero tangents.
def _jvp(primals, tangents, *, layout, method, glu):
    x, planes, scales, codebook, tensor_scale = primals
    tx, _, _, t_codebook, t_tensor_scale = tangents
    weight = (planes, scales, codebook, tensor_scale)
    dw = weight_tangent(*weight, t_codebook, t_tensor_scale, layout=layout)
    if type(tx) is ad.Zero and dw is None:
        y = matmul_p.bind(x, *weight, layout=layout, method=method, glu=glu)
        return y, zero_tangent(y)
    plain = lambda a: matmul_p.bind(a, *weight, layout=layout, method=method, glu=None)  # noqa: E731
    y_plain = plain(x)
    t_plain = None
    if type(tx) is not ad.Zero:
        t_plain = plain(tx)
    if dw is not None:
        t_w = with_auto_axes(lambda x, dw: jnp.einsum("bmk,bkn->bmn", x.astype(jnp.float32), dw,
                                                      precision=jax.lax.Precision.HIGHEST),
                             x, dw, out_sharding=jax.typeof(y_plain).sharding).astype(x.dtype)
        t_plain = t_w if t_plain is None else t_plain + t_w
    if glu is None:
        return y_plain, t_plain
    # A GLU gates the two halves of the linear product: JAX differentiates the gate; the
    # product and its tangent run without it.
    return jax.jvp(lambda y: reference.apply_glu(y, glu), (y_plain,), (t_plain,))


def _transpose(ct, x, planes, scales, codebook, tensor_scale, *, layout, method, glu):
    assert glu is None, "a GLU product is not linear; its JVP transposes the plain product"
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(planes)
    x_aval = x.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(x_aval), None, None, None, None]
    w = dequantize_p.bind(planes, scales, codebook, tensor_scale, layout=layout, dtype=jnp.float32)
    ct_x = x_cotangent(lambda ct, w: jnp.einsum("bmn,bkn->bmk", ct.astype(jnp.float32), w,
                                                precision=jax.lax.Precision.HIGHEST),
                       ct, w, x_aval, k_dim=1)
    # Inside shard_map an x that is invariant over a mesh axis the weight varies over was
    # implicitly broadcast (pvary) into the op; its cotangent is the sum over that axis.
    extra = _varying_axes(jax.typeof(ct_x)) - _varying_axes(x_aval)
    if extra:
        ct_x = jax.lax.psum(ct_x, tuple(sorted(extra)))
    return [ct_x.astype(x_aval.dtype), None, None, None, None]


ad.primitive_jvps[matmul_p] = _jvp
ad.primitive_transposes[matmul_p] = _transpose
