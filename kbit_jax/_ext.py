"""Load the compiled modules and register their FFI targets with XLA, once per process."""

from __future__ import annotations

import importlib
import threading

import jax

TARGETS = ("kbit_quantize", "kbit_dequantize", "kbit_matmul", "kbit_ragged_dot")

_lock = threading.Lock()
_registered: dict[str, bool] = {}


def _load(module_name: str):
    try:
        return importlib.import_module(f"kbit_jax.{module_name}")
    except ImportError:
        return None


def _register(platform: str, module_name: str) -> bool:
    with _lock:
        if platform not in _registered:
            module = _load(module_name)
            if module is not None:
                for name, capsule in module.registrations().items():
                    jax.ffi.register_ffi_target(name, capsule, platform=platform)
            _registered[platform] = module is not None
        return _registered[platform]


def has_cpu() -> bool:
    """True when the C++ CPU kernels are built and registered."""
    return _register("cpu", "_kbit_cpu")


def has_cuda() -> bool:
    """True when the CUDA kernels are built and registered (a GPU need not be present)."""
    return _register("CUDA", "_kbit_cuda")


def build_info() -> dict:
    info = {"cpu_module": has_cpu(), "cuda_module": has_cuda()}
    cuda = _load("_kbit_cuda")
    if cuda is not None and hasattr(cuda, "build_info"):
        info.update(cuda.build_info())
    return info
