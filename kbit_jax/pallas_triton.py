"""Pallas's Triton backend, where the installed JAX has it.

The package's Pallas kernels (the decode attention and the residual add + RMSNorm of
`kbit_jax.examples`, the MoE routing of `kbit_jax.flax.routing_kernel`) are written against it:
masked loads and stores, Triton compiler parameters. JAX has deprecated that backend in favour
of Mosaic GPU. Where it is gone, ``plt`` is None and ``MISSING`` says why; each kernel's
``supported`` then returns that reason, so the layers' "auto" modes take their XLA paths and an
explicit request for a kernel raises ValueError with it, instead of the package failing to
import.
"""

from __future__ import annotations

try:
    from jax.experimental.pallas import triton as plt
    MISSING: str | None = None
except ImportError as err:   # a JAX without the backend: the XLA paths still work
    plt = None
    MISSING = f"this JAX has no Pallas Triton backend (jax.experimental.pallas.triton: {err})"
