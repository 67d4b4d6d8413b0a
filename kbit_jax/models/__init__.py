"""Supported decoder models: Llama-3, Qwen3 and Qwen3-MoE checkpoints in Hugging Face layout,
loaded dense or quantized to k bits as they are read, on one device or tensor-parallel.

    from kbit_jax import models
    model = models.load("/path/to/Llama-3.1-8B", bits=4)      # config.json + *.safetensors
    logits = model(tokens)                                    # int32[B, T] -> [B, T, vocab]
    models.save(model, "/path/to/llama-8b-k4")                # Orbax; models.load reads it back
"""

from . import config, decoder, loader
from .config import DecoderConfig, from_hf_config
from .loader import load, save

__all__ = ["DecoderConfig", "config", "decoder", "from_hf_config", "load", "loader", "save"]
