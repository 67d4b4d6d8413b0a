"""User-facing functions: validate arguments, shape them for the primitives, dispatch.

Every bad input raises a ValueError or TypeError at trace time naming the argument, what was
expected and what was given. Weights are `KbitWeight` pytrees (see `kbit_jax.format`).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import codebooks as _codebooks
from . import reference
from .format import BLOCK, KbitWeight, check_layout, pack_codes, unpack_codes
from .primitives import dequantize_p, matmul_p, quantize_p, ragged_dot_p
from .primitives.matmul import METHODS
from .primitives.ragged_dot import METHODS as RAGGED_DOT_METHODS
from .sharding import reshape as _reshape  # jnp.reshape that keeps Explicit shardings

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


class ScaleUnderflowWarning(UserWarning):
    """``quantize`` stored some nonzero blocks as zeros: their absmax is more than E4M4's range
    (about 2^20) below the matrix's largest (docs/errors.md, "Range"). ``count`` says how many."""

    def __init__(self, message: str, count: int):
        super().__init__(message)
        self.count = count


def _check_float(name: str, x, *, allow_float64: bool = False):
    dtype = jnp.dtype(x.dtype)
    if dtype in FLOAT_DTYPES or (allow_float64 and dtype == jnp.float64):
        return
    allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
    raise TypeError(f"{name} must have dtype {allowed}; got {dtype}")


#: The most elements any array of a call may have: XLA indexes buffers by int64 bytes and aborts
#: the process on a larger static shape, and the reference lowering's widest intermediate holds
#: 2^5 float32 per weight element, so 2^56 leaves that room.
MAX_ELEMENTS = 1 << 56


def _check_size(name: str, shape) -> None:
    """Raise ValueError if an array of ``shape`` is larger than kbit_jax (and XLA) can index."""
    count = math.prod(int(d) for d in shape)
    if count > MAX_ELEMENTS:
        raise ValueError(f"{name} of shape {tuple(shape)} has {count} elements, more than the "
                         f"2^56 = {MAX_ELEMENTS} an array may have")


def _check_leaf(name: str, leaf) -> None:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)):
        return
    raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray), got "
                    f"{type(leaf).__name__} {leaf!r:.60}")


def _check_weight(w_q) -> KbitWeight:
    if not isinstance(w_q, KbitWeight):
        raise TypeError(f"w_q must be a KbitWeight (from kbit_jax.quantize), got {type(w_q).__name__}")
    for name in ("planes", "scales", "codebook", "tensor_scale"):
        _check_leaf(f"w_q.{name}", getattr(w_q, name))
    planes, scales, codebook, tensor_scale = w_q.planes, w_q.scales, w_q.codebook, w_q.tensor_scale
    if planes.ndim < 3:
        raise ValueError(f"w_q.planes must have shape [..., K/32, N, bits], got {planes.shape}")
    _codebooks.check_bits(planes.shape[-1], "w_q.bits (planes.shape[-1])")
    batch = planes.shape[:-3]
    expected = {
        "planes": (planes, jnp.uint32, planes.shape),
        "scales": (scales, jnp.uint8, planes.shape[:-1]),
        "codebook": (codebook, jnp.float32, (*batch, 1 << planes.shape[-1])),
        "tensor_scale": (tensor_scale, jnp.float32, batch),
    }
    for name, (leaf, dtype, shape) in expected.items():
        if tuple(leaf.shape) != tuple(shape) or jnp.dtype(leaf.dtype) != jnp.dtype(dtype):
            raise ValueError(f"w_q.{name} must be {jnp.dtype(dtype).name}{list(shape)}, "
                             f"got {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}")
    check_layout(w_q.layout)
    _check_size("the dense weight w_q", w_q.shape)
    return w_q


def _check_codebook_dtype(codebook) -> None:
    """Complex and boolean codebooks would be silently cast (imaginary part dropped, bool to
    0/1): reject them, and anything else that is not real numbers."""
    if isinstance(codebook, str):
        return
    dtype = getattr(codebook, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(codebook).dtype
        except Exception:  # ragged or otherwise not an array: get_codebook says so
            return
    if np.dtype(dtype).kind not in "fiu":
        raise TypeError(f"codebook must be a name or an array of real numbers (float or int), got "
                        f"dtype {np.dtype(dtype).name}")


def _flat_weight(w_q: KbitWeight):
    """The four leaves with the batch axes folded into one leading axis B."""
    b = math.prod(w_q.batch_shape)
    kb, n, bits = w_q.planes.shape[-3:]
    return (_reshape(w_q.planes, (b, kb, n, bits)), _reshape(w_q.scales, (b, kb, n)),
            _reshape(w_q.codebook, (b, 1 << bits)), _reshape(w_q.tensor_scale, (b,)))


def quantize(w, bits: int = 4, codebook="nf", *, layout: str = "fragment") -> KbitWeight:
    """Quantize a weight ``w[..., K, N]`` (``y = x @ w``) to ``bits`` bits per element.

    Args:
      w: float32, bfloat16 or float16 array (float64 is cast to float32); K must be a
        positive multiple of 32. Leading axes are a stack of independent matrices, each with
        its own tensor_scale.
      bits: 2, 3, 4 or 5.
      codebook: "nf" (normal-float, default), "nf4" (bits=4), "lloyd_max", "uniform", or
        an array of 2**bits finite floats (any order; duplicates allowed).
      layout: "fragment" (default; what the CUDA GEMM reads) or "planes" (canonical).

    When ``w`` is concrete, a ``ScaleUnderflowWarning`` says how many nonzero blocks were
    stored as zeros because they lie more than E4M4's range below the matrix's largest block
    (docs/errors.md, "Range"). Non-finite values raise ValueError when ``w`` is concrete. Under ``jit`` they cannot be
    checked: the matrix's tensor_scale becomes NaN, so everything dequantized or multiplied
    from it is NaN (never silently finite); its codes and scales are unspecified.
    """
    bits = _codebooks.check_bits(bits)
    check_layout(layout)
    _check_codebook_dtype(codebook)
    if isinstance(codebook, jax.core.Tracer):
        if codebook.shape != (1 << bits,):
            raise ValueError(f"codebook for bits={bits} must have shape ({1 << bits},), got {codebook.shape}")
        cb = codebook.astype(jnp.float32)
    else:
        cb = jnp.asarray(_codebooks.get_codebook(codebook, bits))
    if not hasattr(w, "dtype"):
        try:
            w = np.asarray(w)
        except Exception as e:
            raise TypeError(f"w must be an array of floats, got {type(w).__name__}") from e
    _check_float("w", w, allow_float64=True)
    if jnp.dtype(w.dtype) == jnp.float64:
        w = jnp.asarray(w, jnp.float32)
    w = jnp.asarray(w)
    if w.ndim < 2:
        raise ValueError(f"w must have shape [..., K, N] (at least 2 axes), got {w.shape}")
    *batch, k, n = w.shape
    if k == 0 or k % BLOCK:
        raise ValueError(f"w.shape[-2] (K) must be a positive multiple of {BLOCK}, got {k} (w.shape={w.shape})")
    if n == 0:
        raise ValueError(f"w.shape[-1] (N) must be positive, got w.shape={w.shape}")
    _check_size("w", w.shape)
    if _is_concrete(w) and not bool(jnp.all(jnp.isfinite(w))):
        raise ValueError("w contains NaN or infinite values; they cannot be quantized")
    ts = reference.tensor_scale(w)
    b = math.prod(batch)
    planes, scales = quantize_p.bind(
        _reshape(w, (b, k, n)), jnp.broadcast_to(cb, (b, cb.shape[-1])), _reshape(ts, (b,)), layout=layout)
    w_q = KbitWeight(_reshape(planes, (*batch, k // BLOCK, n, bits)), _reshape(scales, (*batch, k // BLOCK, n)),
                     jnp.broadcast_to(cb, (*batch, cb.shape[-1])), ts, layout=layout)
    if _is_concrete(w):
        count = int(reference.underflowed_blocks(w, w_q.scales))
        if count:
            warnings.warn(ScaleUnderflowWarning(
                f"quantize: {count} of {w_q.scales.size} blocks of w (shape {w.shape}) are nonzero but "
                f"more than E4M4's range (about 2^20) below the largest block of their matrix, and "
                f"are stored as zeros", count), stacklevel=2)
    return w_q


def dequantize(w_q: KbitWeight, dtype=jnp.float32) -> jax.Array:
    """The dense weight ``[..., K, N]`` in ``dtype`` (float32 is exact)."""
    _check_weight(w_q)
    try:
        resolved = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in FLOAT_DTYPES:
        got = resolved.name if resolved is not None else repr(dtype)
        raise TypeError(f"dtype must be one of {[d.name for d in FLOAT_DTYPES]}, got {got}")
    dtype = resolved
    w = dequantize_p.bind(*_flat_weight(w_q), layout=w_q.layout, dtype=dtype)
    return _reshape(w, w_q.shape)


def check_glu(glu, n: int) -> None:
    """Raise ValueError unless ``glu`` is None or a GLU name that applies to N = ``n``."""
    if glu is not None and glu not in reference.GLU_ACTIVATIONS:
        raise ValueError(f"glu must be None or one of {tuple(reference.GLU_ACTIVATIONS)}, got {glu!r}")
    if glu is not None and n % 2:
        raise ValueError(f"glu={glu!r} pairs gate and up columns (2j, 2j + 1) and needs an even N, "
                         f"got the weight's N={n}")


def matmul(x, w_q: KbitWeight, *, method: str = "auto", glu: str | None = None) -> jax.Array:
    """``x @ W`` with W dequantized on the fly: ``x[..., K]`` -> ``[..., N]`` in x's dtype.

    ``x`` is float32, bfloat16 or float16 and may have any leading shape. For a stacked
    weight ``W[*batch, K, N]``, x must be ``[*batch, ..., K]`` (like ``jnp.matmul``).
    ``method``: "auto" (default) uses the fused kernel, except on the GPU for more than
    ``primitives.matmul.FUSED_MAX_M`` (128) rows, or more than 16 when N is not a multiple of
    16, where dequantize + XLA's dense dot is faster; bf16 and fp16 products on Hopper keep the
    fused (wgmma) kernel up to ``primitives.matmul.wgmma_rows(N, bits)[1]`` rows (by default 1024 at
    bits 2-4 and 512 at bits 5; ``KBIT_JAX_WGMMA_MAX_M``). "fused" and "dequantize" force one
    path.

    ``glu``: "silu" (SwiGLU) or "gelu_tanh" (GeGLU) makes this a gated MLP's first product:
    W's column 2j is gate feature j, column 2j + 1 up feature j (`interleave_glu` builds such a
    W), and the result is ``act(y[..., 0::2]) * y[..., 1::2]``, ``[..., N / 2]``, computed by
    the kernel on its float32 sums before the one rounding to x's dtype (no N-wide
    intermediate, no separate elementwise kernel). On the GPU, "auto" does this up to
    ``primitives.matmul.FUSED_GLU_MAX_M`` (1) row and lets XLA gate the kernel's product above
    (the in-kernel gate sits on each work item's end; measured slower there on large shapes);
    "fused" keeps it in the kernel at any M. Under sharded ``jit``, shard W's N across devices
    (column-parallel); a sharded K is summed before the gate.
    """
    _check_weight(w_q)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_glu(glu, w_q.out_features)
    if not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    _check_float("x", x)
    batch, k, n = w_q.batch_shape, w_q.in_features, w_q.out_features
    if x.ndim < 1 + len(batch):
        raise ValueError(f"x must have shape [{', '.join(map(str, batch)) + ', ' if batch else ''}..., {k}], "
                         f"got {x.shape}")
    if x.shape[-1] != k:
        raise ValueError(f"x.shape[-1] must equal the weight's K={k}, got x.shape={x.shape}")
    if tuple(x.shape[:len(batch)]) != batch:
        raise ValueError(f"x's leading axes {x.shape[:len(batch)]} must match the weight's batch "
                         f"shape {batch} (x.shape={x.shape})")
    rows = x.shape[len(batch):-1]
    _check_size("x", x.shape)
    _check_size("the result x @ w_q", (*batch, *rows, n))
    b, m = math.prod(batch), math.prod(rows)
    y = matmul_p.bind(_reshape(x, (b, m, k)), *_flat_weight(w_q), layout=w_q.layout, method=method, glu=glu)
    return _reshape(y, (*batch, *rows, n // 2 if glu else n))


def ragged_dot(x, w_q: KbitWeight, group_sizes, *, glu: str | None = None,
               method: str = "auto") -> jax.Array:
    """The grouped expert product of a mixture-of-experts layer, ``jax.lax.ragged_dot`` with a
    quantized stack of experts: ``x[M, K]`` with rows sorted by expert, ``w_q`` a `KbitWeight`
    stacked over G experts (``[G, K, N]``), ``group_sizes`` int32[G] rows per expert. Expert g
    owns rows ``[sum(group_sizes[:g]), sum(group_sizes[:g + 1]))``; rows at or past
    ``sum(group_sizes)`` give zeros. Result ``[M, N]`` in x's dtype, accumulated in float32.

    One kernel call covers every expert, and an expert without rows reads none of its weight.
    ``glu``: "silu" or "gelu_tanh" for interleaved gate/up experts (`interleave_glu`), as in
    `matmul`: the result is ``act(y[:, 0::2]) * y[:, 1::2]``, ``[M, N / 2]``. ``method``: "auto"
    and "fused" run the grouped kernel; "dequantize" dequantizes every expert to x's dtype and
    uses ``jax.lax.ragged_dot``.

    Concrete ``group_sizes`` are checked (no negative size, a sum of at most M); under ``jit``
    they cannot be: a negative size then counts as 0 and groups are cut at row M. Gradients
    flow to x and to the experts' codebook and tensor_scale (codes and scales, integers, get
    float0 zeros). Under sharded ``jit``: experts' N sharded needs no
    collective, K sharded one all-reduce, experts (G) sharded one all-reduce of the result;
    expert weights are never gathered (docs/moe.md).
    """
    _check_weight(w_q)
    if len(w_q.batch_shape) != 1:
        raise ValueError(f"w_q must be stacked over the experts, shape [G, K, N], got a weight of "
                         f"shape {w_q.shape} (quantize a [G, K, N] array)")
    if method not in RAGGED_DOT_METHODS:
        raise ValueError(f"method must be one of {RAGGED_DOT_METHODS}, got {method!r}")
    (g,), k, n = w_q.batch_shape, w_q.in_features, w_q.out_features
    check_glu(glu, n)
    if not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    _check_float("x", x)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must have shape [M, K] with the weight's K={k}, got {x.shape}")
    if isinstance(group_sizes, (list, tuple)):
        group_sizes = np.asarray(group_sizes, np.int32) if group_sizes else np.zeros((0,), np.int32)
    if not hasattr(group_sizes, "dtype"):
        raise TypeError(f"group_sizes must be an int32 array [G], got {type(group_sizes).__name__}")
    if jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise TypeError(f"group_sizes must have dtype int32, got {jnp.dtype(group_sizes.dtype)}")
    if group_sizes.ndim != 1:
        raise ValueError(f"group_sizes must have shape [G] (one size per expert), got {group_sizes.shape}")
    if group_sizes.shape[0] != g:
        raise ValueError(f"group_sizes must have one entry per expert of w_q (G={g}), got "
                         f"{group_sizes.shape[0]} entries")
    m = x.shape[0]
    if _is_concrete(group_sizes):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            raise ValueError(f"group_sizes must be >= 0, got {sizes.tolist()}")
        if int(sizes.sum()) > m:
            raise ValueError(f"group_sizes must sum to at most x.shape[0]={m} (the rows), got a sum "
                             f"of {int(sizes.sum())}")
    out = n // 2 if glu else n
    if m == 0:
        return jnp.zeros((0, out), x.dtype)
    return ragged_dot_p.bind(x, *_flat_weight(w_q), jnp.asarray(group_sizes), layout=w_q.layout,
                             method=method, glu=glu)


def gathered_dot(x, w_q: KbitWeight, expert_ids, *, glu: str | None = None,
                 method: str = "auto") -> jax.Array:
    """Each token times each of its experts: ``y[t, j] = x[t] @ W[expert_ids[t, j]]``.

    ``x[T, K]``, ``w_q`` stacked ``[G, K, N]``, ``expert_ids`` integer ``[T, k]`` (a router's
    top-k choices; ``[T]`` for one expert per token) -> ``[T, k, N]`` (``N / 2`` with ``glu``)
    in x's dtype. The ``T * k`` (token, expert) rows are sorted by expert, multiplied with one
    `ragged_dot` call and put back in token order, so only the experts some token chose are
    read. Use it when tokens come straight from a router; use `ragged_dot` when rows are
    already grouped by expert (after an expert-parallel dispatch), or to run several products
    on one sorted order (a MoE block sorts once for gate/up and down: `kbit_jax.flax.moe`).
    Concrete ids must lie in ``[0, G)``; under ``jit`` an id outside gives a zero row.
    """
    _check_weight(w_q)
    if len(w_q.batch_shape) != 1:
        raise ValueError(f"w_q must be stacked over the experts, shape [G, K, N], got a weight of "
                         f"shape {w_q.shape}")
    if not hasattr(expert_ids, "dtype") or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"expert_ids must be an integer array [T, k], got "
                        f"{getattr(expert_ids, 'dtype', type(expert_ids).__name__)}")
    if not hasattr(x, "dtype") or x.ndim != 2:
        raise ValueError(f"x must be an array [T, K], got {getattr(x, 'shape', type(x).__name__)}")
    one = expert_ids.ndim == 1
    ids = expert_ids[:, None] if one else expert_ids
    if ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids must have shape [T, k] with T = x.shape[0] = {x.shape[0]}, "
                         f"got {expert_ids.shape}")
    g = w_q.batch_shape[0]
    if _is_concrete(ids) and ids.size and (int(np.min(ids)) < 0 or int(np.max(ids)) >= g):
        raise ValueError(f"expert_ids must lie in [0, {g}) (the experts of w_q), got values in "
                         f"[{int(np.min(ids))}, {int(np.max(ids))}]")
    t, k = ids.shape
    flat = ids.reshape(-1).astype(jnp.int32)
    key = jnp.where((flat >= 0) & (flat < g), flat, g)       # invalid ids sort last: zero rows
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((g,), jnp.int32).at[key].add(1, mode="drop")
    y = ragged_dot(x[order // k], w_q, sizes, glu=glu, method=method)
    y = jnp.zeros_like(y).at[order].set(y)
    return y.reshape(t, y.shape[-1]) if one else y.reshape(t, k, y.shape[-1])


def interleave_glu(gate, up):
    """One kernel ``[..., K, 2 H]`` from a gated MLP's gate and up kernels (``[..., K, H]``
    each), in the column order ``matmul(..., glu=...)`` reads: column 2j is gate feature j,
    column 2j + 1 up feature j. Quantize the result; a column-parallel shard of it holds
    matching gate and up features."""
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    if gate.shape != up.shape or gate.ndim < 2:
        raise ValueError(f"gate and up must be kernels [..., K, H] of one shape, got {gate.shape} and {up.shape}")
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def convert_layout(w_q: KbitWeight, layout: str) -> KbitWeight:
    """The same weight with its codes rearranged to ``layout`` (lossless, cell by cell)."""
    _check_weight(w_q)
    check_layout(layout)
    if layout == w_q.layout:
        return w_q
    planes = pack_codes(unpack_codes(w_q.planes, w_q.layout), w_q.bits, layout)
    return KbitWeight(planes, w_q.scales, w_q.codebook, w_q.tensor_scale, layout=layout)
