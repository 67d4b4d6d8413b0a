"""Flax support for k-bit weights.

- ``layers``: ``KbitLinear`` (NNX) and ``KbitDense`` (Linen), layers holding a ``KbitWeight``.
- ``convert``: ``quantize_model`` (NNX, in place) and ``quantize_params`` (Linen params tree),
  reporting what changed in a ``QuantizeReport``.
- ``checkpoint``: Orbax ``save_checkpoint`` / ``restore_checkpoint``.
- ``moe``: ``MoE`` (dense NNX mixture-of-experts block) and ``KbitMoE`` (k-bit experts).
"""

from .checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from .convert import DEFAULT_EXCLUDE, QuantizeReport, default_filter, quantize_model, quantize_params
from .layers import KbitDense, KbitLinear, QuantizedWeight, leaf_sharding
from .moe import KbitMoE, MoE

__all__ = [
    "CheckpointError", "DEFAULT_EXCLUDE", "KbitDense", "KbitLinear", "KbitMoE", "MoE", "QuantizeReport",
    "QuantizedWeight",
    "default_filter", "leaf_sharding", "quantize_model", "quantize_params", "restore_checkpoint",
    "save_checkpoint",
]
