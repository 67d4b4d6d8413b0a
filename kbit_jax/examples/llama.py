"""Moved to `kbit_jax.models.decoder`; this name stays importable for existing code."""

from ..models.decoder import *  # noqa: F401,F403
from ..models.decoder import __all__  # noqa: F401
