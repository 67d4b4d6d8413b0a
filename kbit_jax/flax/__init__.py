"""Flax support for k-bit weights.

- ``layers``: ``KbitLinear`` (NNX) and ``KbitDense`` (Linen), layers holding a ``KbitWeight``.
- ``convert``: ``quantize_model`` (NNX, in place) and ``quantize_params`` (Linen params tree),
  reporting what changed in a ``QuantizeReport``.
- ``checkpoint``: Orbax ``save_checkpoint`` / ``restore_checkpoint``.
"""

from .checkpoint import restore_checkpoint, save_checkpoint
from .convert import DEFAULT_EXCLUDE, QuantizeReport, default_filter, quantize_model, quantize_params
from .layers import KbitDense, KbitLinear, QuantizedWeight, leaf_sharding

__all__ = [
    "DEFAULT_EXCLUDE", "KbitDense", "KbitLinear", "QuantizeReport", "QuantizedWeight",
    "default_filter", "leaf_sharding", "quantize_model", "quantize_params", "restore_checkpoint",
    "save_checkpoint",
]
