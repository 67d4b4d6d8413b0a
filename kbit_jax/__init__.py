"""kbit_jax: k-bit (2-5 bit) lookup-table quantized weights and fused matmul for JAX."""

from . import codebooks
from ._ext import build_info
from .format import KbitWeight, decode_e4m4, encode_e4m4
from .interop import from_bitsandbytes, to_bitsandbytes
from .ops import convert_layout, dequantize, gathered_dot, interleave_glu, matmul, quantize, ragged_dot
from . import sharding
from .sharding import column_parallel, row_parallel, shard_weight

__version__ = "0.1.0"

__all__ = [
    "KbitWeight", "build_info", "codebooks", "column_parallel", "convert_layout", "decode_e4m4",
    "dequantize", "encode_e4m4", "from_bitsandbytes", "gathered_dot", "interleave_glu", "matmul", "quantize",
    "ragged_dot", "row_parallel", "shard_weight", "sharding", "to_bitsandbytes",
]
