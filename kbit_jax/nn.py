"""Deprecated location of the Flax support: use ``kbit_jax.flax``.

``kbit_jax.nn`` re-exports the names of ``kbit_jax.flax`` (``KbitLinear``, ``KbitDense``,
``quantize_model``, ``quantize_params``, ``QuantizeReport``, ``save_checkpoint``,
``restore_checkpoint``, ...) so existing imports keep working for one more release, after
which this module is removed.
"""

from .flax import (  # noqa: F401
    DEFAULT_EXCLUDE, KbitDense, KbitLinear, QuantizedWeight, QuantizeReport, default_filter,
    leaf_sharding, quantize_model, quantize_params, restore_checkpoint, save_checkpoint,
)
from .flax.convert import _nbytes, _progress  # noqa: F401  (used by kbit_jax.examples.llama)
from .flax.layers import _LEAVES  # noqa: F401  (used by kbit_jax.examples.llama)

__all__ = [
    "KbitDense", "KbitLinear", "QuantizeReport", "QuantizedWeight", "default_filter",
    "leaf_sharding", "quantize_model", "quantize_params", "restore_checkpoint",
    "save_checkpoint",
]
