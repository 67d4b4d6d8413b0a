"""Flax layers for k-bit weights: NNX ``KbitLinear``, Linen ``KbitDense``, model conversion, Orbax.

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

import dataclasses
import os
import sys
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from . import codebooks as _codebooks
from .format import BLOCK, KbitWeight
from .ops import check_glu, dequantize, matmul, quantize
from .reference import apply_glu

__all__ = [
    "KbitDense", "KbitLinear", "QuantizeReport", "QuantizedWeight", "default_filter",
    "leaf_sharding", "quantize_model", "quantize_params", "restore_checkpoint",
    "save_checkpoint",
]

_LEAVES = ("planes", "scales", "codebook", "tensor_scale")
#: Substrings of a layer's path that the default filter leaves dense.
DEFAULT_EXCLUDE = ("embed", "lm_head", "head")
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
    for key in ("hijax", "ref"):  # per-Variable settings flax fills in; let it choose again
        metadata.pop(key, None)
    return names, metadata


def _promote_dtype(x, dtype, param_dtype, bias):
    """The computation dtype, as nnx.Linear's promote_dtype picks it."""
    if dtype is not None:
        return jnp.dtype(dtype)
    dtypes = [x.dtype, param_dtype] + ([bias.dtype] if bias is not None else [])
    return jnp.result_type(*dtypes)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(p) for p in path)


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


# -- model conversion -------------------------------------------------------------------------
def default_filter(path: Sequence[Any], module: Any) -> bool:
    """Every ``nnx.Linear`` except those with "embed", "lm_head" or "head" in a path component.

    Layers whose in_features is not a multiple of 32 are left dense too (and reported).
    """
    return not any(word in str(part).lower() for part in path for word in DEFAULT_EXCLUDE)


@dataclasses.dataclass
class QuantizeReport:
    """What ``quantize_model`` / ``quantize_params`` did.

    ``replaced``: paths ("layers/0/attn/qkv_proj") converted; ``skipped``: (path, reason) for
    linear layers left dense; ``bytes_before``/``bytes_after``: the whole model's state;
    ``replaced_bytes_before``/``replaced_bytes_after``: the converted kernels only.
    """

    bits: int
    codebook: Any
    replaced: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    replaced_bytes_before: int = 0
    replaced_bytes_after: int = 0

    @property
    def compression(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)

    def __str__(self) -> str:
        codebook = self.codebook if isinstance(self.codebook, str) else "custom"
        return (f"kbit {self.bits}-bit ({codebook}): replaced {len(self.replaced)} layers, "
                f"left {len(self.skipped)} dense; model {_fmt_bytes(self.bytes_before)} -> "
                f"{_fmt_bytes(self.bytes_after)} ({self.compression:.2f}x); converted kernels "
                f"{_fmt_bytes(self.replaced_bytes_before)} -> {_fmt_bytes(self.replaced_bytes_after)}")


def _progress(iterable, total: int, enabled: bool, desc: str):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="layer", leave=False, file=sys.stderr)


def _linear_edges(root) -> list[tuple[tuple, Any, Any, Any]]:
    """Every (path, parent, key, linear) edge to an nnx.Linear in graph order, shared layers at each path."""
    from flax.nnx import graphlib

    edges, visited = [], set()

    def visit(path, node):
        if id(node) in visited:
            return
        visited.add(id(node))
        impl = graphlib.get_node_impl(node)
        if impl is None:
            return
        for key, child in impl.node_dict(node).items():
            if isinstance(child, nnx.Linear):
                edges.append(((*path, key), node, key, child))
            elif not isinstance(child, (nnx.Variable, KbitLinear)) and graphlib.is_node(child):
                visit((*path, key), child)

    visit((), root)
    return edges


def _get_child(parent, key):
    from flax.nnx import graphlib

    return graphlib.get_node_impl(parent).node_dict(parent)[key]


def _set_child(parent, key, value, path) -> None:
    from flax.nnx import graphlib

    impl = graphlib.get_node_impl(parent)
    if isinstance(parent, (list, dict)) and not isinstance(parent, nnx.Pytree):
        parent[key] = value
    elif getattr(impl, "set_key", None) is not None:
        impl.set_key(parent, key, value)
    else:
        raise TypeError(f"cannot replace the layer at {_path_str(path)!r}: its parent is an immutable "
                        f"{type(parent).__name__}; hold layers in an nnx.List / nnx.Dict or attributes")


def quantize_model(model, bits: int = 4, codebook: Any = "nf", filter: Callable | None = None,
                   progress: bool = True) -> QuantizeReport:
    """Replace selected ``nnx.Linear`` layers of an NNX model by ``KbitLinear`` (in place).

    Args:
      model: any NNX graph (a Module, or nnx.List/nnx.Dict of them).
      bits, codebook: as ``kbit_jax.quantize``.
      filter: ``filter(path, linear) -> bool`` with ``path`` a tuple of attribute names and
        indices (nnx's path convention). Default: ``default_filter`` (everything but paths
        containing "embed", "lm_head" or "head"; layers with in_features not a multiple of
        32 are skipped). A custom filter that selects an incompatible layer raises ValueError.
      progress: show a tqdm bar (when tqdm is installed).

    A layer shared at several paths is quantized once and stays shared. Each dense kernel is
    released as soon as it is replaced, so peak memory is about one dense layer above the
    final model. Returns a ``QuantizeReport``.
    """
    bits = _check_quant_config(bits, codebook)
    report = QuantizeReport(bits=bits, codebook=codebook)
    report.bytes_before = _nbytes(nnx.state(model))

    groups: dict[int, list] = {}
    for path, parent, key, linear in _linear_edges(model):
        groups.setdefault(id(linear), []).append((path, parent, key, linear))
    selected = []
    for edges in groups.values():
        path, _, _, linear = edges[0]
        k = linear.kernel.shape[-2] if linear.kernel.ndim >= 2 else None
        if filter is None:
            if not default_filter(path, linear):
                report.skipped.append((_path_str(path), "excluded by the default filter"))
                continue
            if k is None or k % BLOCK:
                report.skipped.append((_path_str(path), f"in_features={k} is not a multiple of {BLOCK}"))
                continue
        elif not filter(path, linear):
            report.skipped.append((_path_str(path), "excluded by filter"))
            continue
        selected.append([(p, parent, key) for p, parent, key, _ in edges])
    del groups, edges, linear

    for edges in _progress(selected, len(selected), progress, "kbit quantize"):
        path, parent, key = edges[0]
        linear = _get_child(parent, key)
        report.replaced_bytes_before += _nbytes(linear.kernel.get_value())
        new = KbitLinear.from_linear(linear, bits=bits, codebook=codebook)
        report.replaced_bytes_after += _nbytes(new.weight)
        for p, par, k in edges:
            _set_child(par, k, new, p)
        report.replaced.append(_path_str(path))
        del linear, new
    report.bytes_after = _nbytes(nnx.state(model))
    return report


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
                            f"(convert dense params with kbit_jax.nn.quantize_params), got "
                            f"{type(kernel).__name__}")
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        dtype = _promote_dtype(inputs, self.dtype, self.param_dtype, bias)
        y = matmul(jnp.asarray(inputs, dtype), kernel)
        if bias is not None:
            y = y + jnp.asarray(bias, dtype)
        return y


def _default_params_filter(path: tuple[str, ...], kernel) -> bool:
    return (path[-1] == "kernel" and getattr(kernel, "ndim", 0) == 2
            and kernel.shape[0] % BLOCK == 0 and default_filter(path[:-1], kernel))


def quantize_params(params, bits: int = 4, codebook: Any = "nf", filter: Callable | None = None,
                    *, with_report: bool = False):
    """Convert Dense kernels in a Linen params tree to ``KbitWeight`` (returns a new tree).

    Args:
      params: a nested dict / FrozenDict (e.g. ``variables["params"]`` or the whole
        variables dict). Boxed params (``nn.Partitioned``) are unboxed.
      filter: ``filter(path, array) -> bool``, ``path`` a tuple of str keys ending in the
        param's name. Default: 2-D leaves named "kernel" with K a multiple of 32 whose path
        has no "embed"/"lm_head"/"head" component. A filter may also select stacked kernels
        ``[L, K, N]`` (from ``nn.scan``); they become stacked KbitWeights.
      with_report: also return a ``QuantizeReport``.
    """
    from flax import traverse_util
    from flax.core import FrozenDict, meta

    bits = _check_quant_config(bits, codebook)
    frozen = isinstance(params, FrozenDict)
    tree = meta.unbox(params)
    tree = tree.unfreeze() if isinstance(tree, FrozenDict) else tree
    flat = traverse_util.flatten_dict(tree)
    report = QuantizeReport(bits=bits, codebook=codebook, bytes_before=_nbytes(flat))
    select = filter or _default_params_filter
    for path, leaf in flat.items():
        path_s = tuple(str(p) for p in path)
        if not isinstance(leaf, KbitWeight) and hasattr(leaf, "ndim") and select(path_s, leaf):
            if leaf.ndim < 2 or leaf.shape[-2] % BLOCK:
                raise ValueError(f"cannot quantize params {'/'.join(path_s)} of shape {leaf.shape}: "
                                 f"need [..., K, N] with K a multiple of {BLOCK}")
            flat[path] = quantize(leaf, bits, codebook)
            report.replaced.append("/".join(path_s))
            report.replaced_bytes_before += _nbytes(leaf)
            report.replaced_bytes_after += _nbytes(flat[path])
    report.bytes_after = _nbytes(flat)
    out = traverse_util.unflatten_dict(flat)
    out = FrozenDict(out) if frozen else out
    return (out, report) if with_report else out


# -- Orbax ------------------------------------------------------------------------------------
def _checkpoint_tree(tree):
    if isinstance(tree, nnx.Module):
        return nnx.state(tree)
    return tree


def save_checkpoint(path, tree, *, overwrite: bool = False) -> str:
    """Save a pytree (KbitWeights, params dicts, ``nnx.state(...)``, or an NNX Module's state).

    Thin wrapper over ``orbax.checkpoint.StandardCheckpointer``; integer planes/scales are
    stored as they are. Returns the absolute path written.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _checkpoint_tree(tree), force=overwrite)
        ckptr.wait_until_finished()
    return path


def restore_checkpoint(path, target):
    """Restore what ``save_checkpoint`` wrote, exactly (no re-quantization).

    ``target`` gives structure, shapes, dtypes and shardings: a tree of arrays or
    ``jax.ShapeDtypeStruct`` (e.g. ``nnx.state(nnx.eval_shape(make_model))``), or an NNX
    Module, which is updated in place and returned.
    """
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    module = target if isinstance(target, nnx.Module) else None
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None) or default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    abstract_tree = jax.tree.map(abstract, _checkpoint_tree(target))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract_tree)
    if module is not None:
        nnx.update(module, restored)
        return module
    return restored
