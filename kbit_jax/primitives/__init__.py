"""JAX primitives for the kbit kernels: one module per primitive.

Each primitive takes operands with one mandatory leading batch axis ``B`` (a stack of
weights; ``B = 1`` for a single weight) so that one FFI target serves plain calls, stacked
weights and every ``vmap``: batching rules only fold vmapped axes into ``B`` (or, for x,
into M). ``kbit_jax.ops`` adds and removes that axis.
"""

from .dequantize import dequantize_p
from .matmul import matmul_p
from .quantize import quantize_p
from .ragged_dot import ragged_dot_p

__all__ = ["dequantize_p", "matmul_p", "quantize_p", "ragged_dot_p"]
