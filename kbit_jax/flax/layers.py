"""Flax layers for k-bit weights: NNX ``KbitLinear`` and Linen ``KbitDense``.

NNX state layout. ``KbitLinear.kernel`` is a :class:`~kbit_jax.KbitWeight` whose four
leaves are :class:`QuantizedWeight` variables (an ``nnx.Variable`` subclass, *not*
``nnx.Param``: quantized codes are not trainable), so ``nnx.state(layer)`` reads::

    kernel/planes        QuantizedWeight  uint32[*batch, K/32, N, bits]
    kernel/scales        QuantizedWeight  uint8[*batch, K/32, N]
    kernel/codebook      QuantizedWeight  float32[*batch, 2**bits]
    kernel/tensor_scale  QuantizedWeight  float32[*batch]
    bias                 Param            [*batch, N]   (when use_bias)

Every leaf is an ordinary array variable, so ``nnx.split``/``merge``/``state``/``update``,
``nnx.jit``, ``nnx.vmap``/``nnx.scan`` over stacked layers (leading axes on every leaf),
``nnx.get_partition_spec`` and Orbax all work unchanged; the layout tag stays static in the
graph definition. ``nnx.state(model, nnx.Param)`` selects the trainable (dense) part only.

Sharding. ``sharding=(k_name, n_name)`` (or ``kernel_metadata={"out_sharding": ...}``, or a
``kernel_init`` wrapped in ``nnx.with_partitioning``) names the logical axes of the dense
``W[K, N]``. Each leaf gets the matching ``out_sharding`` (flax 0.12's name for the older
``sharding_names``): planes ``(k, n, None)``, scales ``(k, n)``, codebook ``(None,)``,
tensor_scale ``()``. Sharding the planes/scales along K (whole 32-element blocks) or N gives
valid weights of the same format. As with ``nnx.Linear``, flax shards annotated variables
eagerly at creation when a mesh is active (``nnx.use_eager_sharding``); partitioning the
matmul itself is ``kbit_jax.sharding``'s job.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from .. import codebooks as _codebooks
from ..format import BLOCK, KbitWeight
from ..ops import check_glu, dequantize, matmul, quantize
from ..reference import apply_glu

__all__ = ["KbitDense", "KbitLinear", "QuantizedWeight", "leaf_sharding"]

_LEAVES = ("planes", "scales", "codebook", "tensor_scale")
#: Metadata key on a ``planes`` QuantizedWeight naming its weight's layout, so that the layout
#: travels with ``nnx.state`` (checkpoints compare it with the target's on restore).
LAYOUT_METADATA_KEY = "kbit_layout"
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class QuantizedWeight(nnx.Variable):
    """A leaf of a quantized weight (planes, scales, codebook, tensor_scale): state, not a Param."""


# -- shared helpers ---------------------------------------------------------------------------
def _check_features(in_features, out_features) -> None:
    if isinstance(in_features, bool) or not isinstance(in_features, (int, np.integer)):
        raise TypeError(f"in_features must be an int, got {in_features!r}")
    if isinstance(out_features, bool) or not isinstance(out_features, (int, np.integer)):
        raise TypeError(f"out_features must be an int, got {out_features!r}")
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(f"in_features must be a positive multiple of {BLOCK} (the quantization "
                         f"block along K), got in_features={in_features}")
    if out_features <= 0:
        raise ValueError(f"out_features must be positive, got out_features={out_features}")


def _check_quant_config(bits, codebook) -> int:
    bits = _codebooks.check_bits(bits)
    _codebooks.get_codebook(codebook, bits)  # unknown name / wrong length -> ValueError
    return bits


def leaf_sharding(names: Sequence[Any] | None) -> dict[str, tuple | None]:
    """Per-leaf ``out_sharding`` for a KbitWeight from the logical names of ``W[*batch, K, N]``.

    ``names = (*batch_names, k_name, n_name)``; ``None`` gives ``None`` for every leaf.
    """
    if names is None:
        return dict.fromkeys(_LEAVES)
    names = tuple(names)
    if len(names) < 2:
        raise ValueError(f"sharding names must cover the (K, N) axes of the weight, got {names!r}")
    *batch, k, n = names
    batch = tuple(batch)
    return {"planes": (*batch, k, n, None), "scales": (*batch, k, n),
            "codebook": (*batch, None), "tensor_scale": batch}


def _split_kernel_metadata(metadata: Mapping[str, Any]) -> tuple[tuple | None, dict]:
    """(logical names of W, the other metadata) from a kernel_metadata mapping."""
    metadata = dict(metadata)
    names = None
    for key in _SHARDING_KEYS:
        if key in metadata:
            value = metadata.pop(key)
            names = tuple(value) if value is not None else names
    for key in ("hijax", "ref", LAYOUT_METADATA_KEY):  # per-Variable settings set again per leaf
        metadata.pop(key, None)
    return names, metadata


def _promote_dtype(x, dtype, param_dtype, bias):
    """The computation dtype, as nnx.Linear's promote_dtype picks it."""
    if dtype is not None:
        return jnp.dtype(dtype)
    dtypes = [x.dtype, param_dtype] + ([bias.dtype] if bias is not None else [])
    return jnp.result_type(*dtypes)


# -- NNX layer --------------------------------------------------------------------------------
class KbitLinear(nnx.Module):
    """``y = x @ W + b`` with ``W`` stored as a k-bit ``KbitWeight``; mirrors ``nnx.Linear``.

    Args:
      in_features: K, a positive multiple of 32.
      out_features: N.
      use_bias: add a bias (an ``nnx.Param``, trainable, dense).
      dtype: the computation dtype (None: promote input, ``param_dtype`` and bias, as
        ``nnx.Linear`` does). Must end up float32, bfloat16 or float16.
      param_dtype: dtype of the dense kernel drawn by ``kernel_init`` before quantization,
        and of the bias; also the nominal kernel dtype for promotion.
      bits: 2..5. codebook: a name ("nf", "nf4", "lloyd_max", "uniform") or 2**bits floats.
      kernel_init, bias_init: initializers; the kernel is drawn dense and quantized at once.
      rngs: ``nnx.Rngs`` (needs a ``params`` stream).
      kernel_metadata: as ``nnx.Linear``; ``out_sharding`` (or ``sharding_names``/``sharding``)
        names the logical (K, N) axes; other entries go on every quantized leaf.
      bias_metadata: metadata for the bias ``Param``.
      sharding: shorthand for ``kernel_metadata={"out_sharding": sharding}``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        bits: int = 4,
        codebook: Any = "nf",
        kernel_init: Callable = default_kernel_init,
        bias_init: Callable = default_bias_init,
        rngs: nnx.Rngs | None = None,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        sharding: Sequence[Any] | None = None,
        _weight: KbitWeight | None = None,
        _bias: Any = None,
    ):
        names, meta = _split_kernel_metadata(kernel_metadata)
        if sharding is not None:
            names = tuple(sharding)
        if _weight is None:
            _check_features(in_features, out_features)
            bits = _check_quant_config(bits, codebook)
            if rngs is None:
                raise TypeError("KbitLinear needs rngs (an nnx.Rngs) to initialize its kernel")
            kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
            if isinstance(kernel, nnx.VariableMetadata):   # nnx.with_partitioning / with_metadata
                kernel_names, extra = _split_kernel_metadata(kernel.metadata)
                names = names if names is not None else kernel_names
                meta = {**extra, **meta}
                kernel = kernel.raw_value
            _weight = quantize(kernel, bits, codebook)
        if use_bias and _bias is None:
            if rngs is None:
                raise TypeError("KbitLinear needs rngs (an nnx.Rngs) to initialize its bias")
            _bias = bias_init(rngs.params(), (out_features,), param_dtype)

        shardings = leaf_sharding(names)
        leaves = {}
        for name in _LEAVES:
            leaf_meta = dict(meta)
            if shardings[name] is not None:
                leaf_meta["out_sharding"] = shardings[name]
            if name == "planes":
                leaf_meta[LAYOUT_METADATA_KEY] = _weight.layout
            leaves[name] = QuantizedWeight(getattr(_weight, name), **leaf_meta)
        self.kernel = nnx.data(KbitWeight(**leaves, layout=_weight.layout))
        if use_bias:
            if isinstance(_bias, nnx.VariableMetadata):     # a bias_init with_partitioning
                _bias = nnx.Param(_bias.raw_value, **{**_bias.metadata, **bias_metadata})
            self.bias = _bias if isinstance(_bias, nnx.Param) else nnx.Param(_bias, **bias_metadata)
        else:
            self.bias = nnx.data(None)

        self.in_features = int(_weight.in_features)
        self.out_features = int(_weight.out_features)
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.bits = int(_weight.bits)

    # -- construction from other things ----------------------------------------------------
    @classmethod
    def from_weight(cls, weight: KbitWeight, bias=None, *, dtype=None, param_dtype=jnp.float32,
                    sharding: Sequence[Any] | None = None,
                    kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                    bias_metadata: Mapping[str, Any] = MappingProxyType({})) -> "KbitLinear":
        """A layer around an existing ``KbitWeight`` (any batch shape) and optional bias."""
        if not isinstance(weight, KbitWeight):
            raise TypeError(f"weight must be a KbitWeight, got {type(weight).__name__}")
        return cls(weight.in_features, weight.out_features, use_bias=bias is not None, dtype=dtype,
                   param_dtype=param_dtype, bits=weight.bits, kernel_metadata=kernel_metadata,
                   bias_metadata=bias_metadata, sharding=sharding, _weight=weight, _bias=bias)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, bits: int = 4, codebook: Any = "nf") -> "KbitLinear":
        """Quantize an ``nnx.Linear`` (its kernel may carry leading stacked-layer axes).

        Keeps its bias (a copy of the same ``Param``, metadata included), ``dtype``,
        ``param_dtype`` and the kernel's sharding annotation.
        """
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"linear must be an nnx.Linear, got {type(linear).__name__}")
        kernel_var = linear.kernel
        kernel = kernel_var.get_value()
        if kernel.ndim < 2:
            raise ValueError(f"linear.kernel must have shape [..., in_features, out_features], got {kernel.shape}")
        _check_features(int(kernel.shape[-2]), int(kernel.shape[-1]))
        bits = _check_quant_config(bits, codebook)
        names, meta = _split_kernel_metadata(kernel_var.get_metadata())
        bias = None
        if linear.bias is not None:
            bias = linear.bias.replace(linear.bias.get_value())
        return cls.from_weight(quantize(kernel, bits, codebook), bias, dtype=linear.dtype,
                               param_dtype=linear.param_dtype, sharding=names,
                               kernel_metadata=meta)

    # -- use -------------------------------------------------------------------------------
    @property
    def weight(self) -> KbitWeight:
        """The quantized kernel as a ``KbitWeight`` of plain arrays."""
        return jax.tree.map(lambda v: v.get_value(), self.kernel,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))

    def dequantized_kernel(self, dtype=None) -> jax.Array:
        """The dense kernel ``[*batch, K, N]`` (float32 is exact), e.g. to build an ``nnx.Linear``."""
        return dequantize(self.weight, dtype or self.param_dtype)

    def __call__(self, inputs: jax.Array, out_sharding=None, *, glu: str | None = None) -> jax.Array:
        """``inputs @ W + b``. ``out_sharding`` (as ``nnx.Linear``'s, for Explicit mesh axes)
        reshards the result; the matmul itself already gives it the sharding its operands
        imply (column-parallel: N sharded; row-parallel: all-reduced, K's axes replicated).

        ``glu`` ("silu" or "gelu_tanh"): the layer is a gated MLP's interleaved gate/up
        projection (`kbit_jax.interleave_glu`) and returns ``act(y[..., 0::2]) * y[..., 1::2]``
        with ``out_features / 2`` features, gated inside the kernel (`kbit_jax.matmul`); with a
        bias, the bias is added first and the gate follows in JAX."""
        check_glu(glu, self.out_features)
        bias = self.bias.get_value() if self.bias is not None else None
        dtype = _promote_dtype(inputs, self.dtype, self.param_dtype, bias)
        y = matmul(jnp.asarray(inputs, dtype), self.weight, glu=glu if bias is None else None)
        if out_sharding is not None:
            y = jax.sharding.reshard(y, out_sharding)
        if bias is not None:
            y = y + jnp.asarray(bias, dtype)
            if glu is not None:
                y = apply_glu(y, glu)
        return y


# -- Linen ------------------------------------------------------------------------------------
class KbitDense(linen.Module):
    """Linen ``Dense`` with a k-bit kernel: ``params["kernel"]`` is a ``KbitWeight``.

    Same param names as ``nn.Dense``, so a params tree converted by ``quantize_params``
    applies to the same model with Dense swapped for KbitDense. ``bits`` must match the
    converted weights (Linen checks the param shapes); the codebook is read from the weight.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    bits: int = 4
    codebook: Any = "nf"
    kernel_init: Callable = linen.initializers.lecun_normal()
    bias_init: Callable = linen.initializers.zeros_init()

    @linen.compact
    def __call__(self, inputs):
        k = inputs.shape[-1]
        _check_features(int(k), int(self.features))
        bits = _check_quant_config(self.bits, self.codebook)

        def init(rng):
            return quantize(self.kernel_init(rng, (k, self.features), self.param_dtype),
                            bits, self.codebook)

        kernel = self.param("kernel", init)
        if not isinstance(kernel, KbitWeight):
            raise TypeError(f"KbitDense {self.name!r}: params 'kernel' must be a KbitWeight "
                            f"(convert dense params with kbit_jax.flax.quantize_params), got "
                            f"{type(kernel).__name__}")
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        dtype = _promote_dtype(inputs, self.dtype, self.param_dtype, bias)
        y = matmul(jnp.asarray(inputs, dtype), kernel)
        if bias is not None:
            y = y + jnp.asarray(bias, dtype)
        return y
