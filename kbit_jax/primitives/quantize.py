"""quantize_p: w[B, K, N], codebook[B, C], tensor_scale[B] -> planes[B, K/32, N, bits], scales[B, K/32, N]."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad

from .. import reference
from ..format import BLOCK
from ..sharding import FactorRule
from ._common import define, layout_attr, out_aval, zero_tangent

quantize_p = Primitive("kbit_quantize")
quantize_p.multiple_results = True


def _abstract_eval(w, codebook, tensor_scale, *, layout):
    b, k, n = w.shape
    bits = codebook.shape[-1].bit_length() - 1
    avals = (w, codebook, tensor_scale)
    return (out_aval((b, k // BLOCK, n, bits), jnp.uint32, avals),
            out_aval((b, k // BLOCK, n), jnp.uint8, avals))


def _reference(w, codebook, tensor_scale, *, layout):
    return reference.quantize(w, codebook, tensor_scale, layout=layout)


#: How quantize_p partitions (kbit_jax.sharding): cell-local given the tensor_scale.
SHARDING_RULE = FactorRule("b (k i) n, b c, b -> b k n j, b k n", replicated=("i", "j", "c"),
                           i=BLOCK)
quantize_kernel_p = define(quantize_p, abstract_eval=_abstract_eval, reference=_reference,
                           ffi_attrs=lambda *, layout: {"layout": layout_attr(layout)},
                           rule=SHARDING_RULE)


def _jvp(primals, tangents, *, layout):
    """Codes and scales are integers: their tangents are float0 zeros."""
    outs = quantize_p.bind(*primals, layout=layout)
    return outs, [zero_tangent(o) for o in outs]


ad.primitive_jvps[quantize_p] = _jvp
