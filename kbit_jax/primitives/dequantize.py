"""dequantize_p: planes[B, K/32, N, bits], scales[B, K/32, N], codebook[B, C], tensor_scale[B] -> w[B, K, N]."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad

from .. import reference
from ..format import BLOCK
from ..sharding import FactorRule
from ._common import define, layout_attr, out_aval, weight_tangent, zero_tangent

dequantize_p = Primitive("kbit_dequantize")


def _abstract_eval(planes, scales, codebook, tensor_scale, *, layout, dtype):
    b, kb, n, _ = planes.shape
    return out_aval((b, kb * BLOCK, n), dtype, (planes, scales, codebook, tensor_scale))


def _reference(planes, scales, codebook, tensor_scale, *, layout, dtype):
    return reference.dequantize(planes, scales, codebook, tensor_scale, layout=layout, dtype=dtype)


# The output dtype is the result buffer's type: the FFI target needs only the layout.
#: How dequantize_p partitions (kbit_jax.sharding): cell-local, so shards on K (at whole
#: blocks) and N stay shards.
SHARDING_RULE = FactorRule("b k n j, b k n, b c, b -> b (k i) n", replicated=("i", "j", "c"),
                           i=BLOCK)
dequantize_kernel_p = define(dequantize_p, abstract_eval=_abstract_eval, reference=_reference,
                             ffi_attrs=lambda *, layout, dtype: {"layout": layout_attr(layout)},
                             rule=SHARDING_RULE)


def _jvp(primals, tangents, *, layout, dtype):
    """w is linear in the codebook and in tensor_scale; codes and scales are integers."""
    planes, scales, codebook, tensor_scale = primals
    w = dequantize_p.bind(*primals, layout=layout, dtype=dtype)
    dw = weight_tangent(*primals, tangents[2], tangents[3], layout=layout)
    return w, zero_tangent(w) if dw is None else dw.astype(dtype)


ad.primitive_jvps[dequantize_p] = _jvp
