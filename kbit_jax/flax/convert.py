"""Model conversion: swap ``nnx.Linear`` for ``KbitLinear`` (NNX) or Dense kernels for
``KbitWeight`` (Linen params), with a ``QuantizeReport`` of what changed."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from ..format import BLOCK, KbitWeight
from ..ops import ScaleUnderflowWarning, quantize
from .layers import KbitLinear, _check_quant_config
from .moe import KbitMoE, MoE

__all__ = ["DEFAULT_EXCLUDE", "QuantizeReport", "default_filter", "quantize_model", "quantize_params"]

#: Substrings of a layer's path that the default filter leaves dense.
DEFAULT_EXCLUDE = ("embed", "lm_head", "head")


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


# -- NNX models -------------------------------------------------------------------------------
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
    ``replaced_bytes_before``/``replaced_bytes_after``: the converted kernels only;
    ``underflowed_blocks``: nonzero 32-element blocks stored as zeros because they lie more
    than E4M4's range below their matrix's largest block (docs/errors.md, "Range"), with
    ``underflowed``: (path, count) per layer that has any.
    """

    bits: int
    codebook: Any
    replaced: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    replaced_bytes_before: int = 0
    replaced_bytes_after: int = 0
    underflowed_blocks: int = 0
    underflowed: list[tuple[str, int]] = dataclasses.field(default_factory=list)

    @property
    def compression(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)

    def __str__(self) -> str:
        codebook = self.codebook if isinstance(self.codebook, str) else "custom"
        return (f"kbit {self.bits}-bit ({codebook}): replaced {len(self.replaced)} layers, "
                f"left {len(self.skipped)} dense; model {_fmt_bytes(self.bytes_before)} -> "
                f"{_fmt_bytes(self.bytes_after)} ({self.compression:.2f}x); converted kernels "
                f"{_fmt_bytes(self.replaced_bytes_before)} -> {_fmt_bytes(self.replaced_bytes_after)}"
                + (f"; {self.underflowed_blocks} nonzero blocks in {len(self.underflowed)} layers "
                   f"underflowed to zero" if self.underflowed_blocks else ""))

    def _count_underflow(self, path: str, counts: list[int]) -> None:
        if sum(counts):
            self.underflowed.append((path, sum(counts)))
            self.underflowed_blocks += sum(counts)

    def _warn_underflow(self) -> None:
        if self.underflowed_blocks:
            worst = ", ".join(f"{p} ({c})" for p, c in sorted(self.underflowed, key=lambda pc: -pc[1])[:3])
            warnings.warn(ScaleUnderflowWarning(
                f"{self.underflowed_blocks} nonzero blocks in {len(self.underflowed)} layers are stored "
                f"as zeros (more than E4M4's range below their matrix's largest block); most in "
                f"{worst}. See QuantizeReport.underflowed", self.underflowed_blocks), stacklevel=3)


@contextlib.contextmanager
def _underflow_counts():
    """Collects the counts of the ScaleUnderflowWarnings raised inside (instead of showing them)."""
    counts: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ScaleUnderflowWarning)
        yield counts
    for w in caught:
        if issubclass(w.category, ScaleUnderflowWarning):
            counts.append(w.message.count)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _progress(iterable, total: int, enabled: bool, desc: str):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="layer", leave=False, file=sys.stderr)


def _linear_edges(root) -> list[tuple[tuple, Any, Any, Any]]:
    """Every (path, parent, key, layer) edge to an nnx.Linear or a dense MoE block in graph order,
    shared layers at each path."""
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
            if isinstance(child, (nnx.Linear, MoE)):
                edges.append(((*path, key), node, key, child))
            elif not isinstance(child, (nnx.Variable, KbitLinear, KbitMoE)) and graphlib.is_node(child):
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
    """Replace selected ``nnx.Linear`` layers of an NNX model by ``KbitLinear`` and dense
    mixture-of-experts blocks (`kbit_jax.flax.moe.MoE`) by ``KbitMoE`` (in place; a MoE's router
    stays dense).

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
        if isinstance(linear, MoE):   # its experts' K: the hidden size, and H for down
            k = linear.hidden if linear.intermediate % BLOCK == 0 else linear.intermediate
        else:
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
        with _underflow_counts() as counts:
            if isinstance(linear, MoE):
                report.replaced_bytes_before += _nbytes(nnx.state(linear))
                new = KbitMoE.from_dense(linear, bits=bits, codebook=codebook)
                report.replaced_bytes_after += _nbytes(nnx.state(new))
            else:
                report.replaced_bytes_before += _nbytes(linear.kernel.get_value())
                new = KbitLinear.from_linear(linear, bits=bits, codebook=codebook)
                report.replaced_bytes_after += _nbytes(new.weight)
        report._count_underflow(_path_str(path), counts)
        for p, par, k in edges:
            _set_child(par, k, new, p)
        report.replaced.append(_path_str(path))
        del linear, new
    report.bytes_after = _nbytes(nnx.state(model))
    report._warn_underflow()
    return report


# -- Linen params -----------------------------------------------------------------------------
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
            with _underflow_counts() as counts:
                flat[path] = quantize(leaf, bits, codebook)
            report._count_underflow("/".join(path_s), counts)
            report.replaced.append("/".join(path_s))
            report.replaced_bytes_before += _nbytes(leaf)
            report.replaced_bytes_after += _nbytes(flat[path])
    report.bytes_after = _nbytes(flat)
    report._warn_underflow()
    out = traverse_util.unflatten_dict(flat)
    out = FrozenDict(out) if frozen else out
    return (out, report) if with_report else out
