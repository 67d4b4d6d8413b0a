"""matmul_p: x[B, M, K] and a weight (planes, scales, codebook, tensor_scale) with batch B -> y[B, M, N].

Params: ``layout`` (the weight's layout) and ``method``: "fused" runs the fused
dequantize+matmul kernel; "dequantize" materializes W in x.dtype with the dequantize kernel
and lets XLA's dense dot do the rest (faster at large M on the GPU); "auto" picks by M on
the GPU (see `FUSED_MAX_M`) and the fused kernel elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import reference
from ._common import define, fold_batch_into_leading_axis, layout_attr, out_aval
from .dequantize import dequantize_p

matmul_p = Primitive("kbit_matmul")
METHODS = ("auto", "fused", "dequantize")

#: On CUDA, "auto" uses the fused kernel up to this many rows (M) and dequantize + dense dot
#: above it. Chosen from benchmarks/results (the crossover on an H200).
FUSED_MAX_M = 256


def _abstract_eval(x, planes, scales, codebook, tensor_scale, *, layout, method):
    b, m, _ = x.shape
    return out_aval((b, m, planes.shape[2]), x.dtype, (x, planes, scales, codebook, tensor_scale))


def _reference(x, planes, scales, codebook, tensor_scale, *, layout, method):
    return reference.matmul(x, planes, scales, codebook, tensor_scale, layout=layout)


def _dequantize_then_dot(x, planes, scales, codebook, tensor_scale, *, layout, method):
    w = dequantize_p.bind(planes, scales, codebook, tensor_scale, layout=layout, dtype=x.dtype)
    y = jnp.einsum("bmk,bkn->bmn", x, w, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


_dequantize_then_dot_lowering = mlir.lower_fun(_dequantize_then_dot, multiple_results=False)
_fused_cuda_lowering = jax.ffi.ffi_lowering("kbit_matmul")


def _cuda_lowering(ctx, x, planes, scales, codebook, tensor_scale, *, layout, method):
    m = ctx.avals_in[0].shape[1]
    fused = method == "fused" or (method == "auto" and m <= FUSED_MAX_M)
    if not fused:
        return _dequantize_then_dot_lowering(ctx, x, planes, scales, codebook, tensor_scale,
                                             layout=layout, method=method)
    return _fused_cuda_lowering(ctx, x, planes, scales, codebook, tensor_scale,
                                layout=layout_attr(layout))


def _batcher(args, dims, *, layout, method):
    x, *weight = args
    x_dim, *weight_dims = dims
    if all(d is None for d in weight_dims):
        # Only x is mapped: fold the mapped axis into M instead of copying the weight.
        x = jnp.moveaxis(x, x_dim, 1)                       # [B, V, M, K]
        b, v, m, k = x.shape
        y = matmul_p.bind(x.reshape(b, v * m, k), *weight, layout=layout, method=method)
        return jnp.moveaxis(y.reshape(b, v, m, -1), 1, 0), 0
    return fold_batch_into_leading_axis(matmul_p, args, dims, layout=layout, method=method)


define(matmul_p, abstract_eval=_abstract_eval, reference=_reference,
       ffi_attrs=lambda *, layout, method: {"layout": layout_attr(layout)},
       batcher=_batcher, cuda_lowering=_cuda_lowering)


# -- differentiation: y is linear in x; the quantized weight is a constant -------------------
def _jvp(primals, tangents, *, layout, method):
    x, *weight = primals
    y = matmul_p.bind(x, *weight, layout=layout, method=method)
    tx = tangents[0]
    if type(tx) is ad.Zero:
        return y, ad.Zero.from_primal_value(y)
    return y, matmul_p.bind(tx, *weight, layout=layout, method=method)


def _transpose(ct, x, planes, scales, codebook, tensor_scale, *, layout, method):
    assert ad.is_undefined_primal(x) and not ad.is_undefined_primal(planes)
    x_aval = x.aval
    if type(ct) is ad.Zero:
        return [ad.Zero(x_aval), None, None, None, None]
    w = dequantize_p.bind(planes, scales, codebook, tensor_scale, layout=layout, dtype=jnp.float32)
    ct_x = jnp.einsum("bmn,bkn->bmk", ct.astype(jnp.float32), w,
                      precision=jax.lax.Precision.HIGHEST)
    return [ct_x.astype(x_aval.dtype), None, None, None, None]


ad.primitive_jvps[matmul_p] = _jvp
ad.primitive_transposes[matmul_p] = _transpose
