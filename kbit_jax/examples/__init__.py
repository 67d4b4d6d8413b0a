"""Example models built on kbit_jax (random weights, no downloads)."""
