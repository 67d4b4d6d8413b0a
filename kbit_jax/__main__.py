"""``python -m kbit_jax <command>``: see `kbit_jax.cli` (demo, generate, perplexity, quantize)."""

import sys

from kbit_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
