"""The Python examples in README.md and docs/**/*.md run as written (each file in a fresh
process, its blocks in order, with 8 simulated CPU devices).

Every block fenced as ```python is run; examples that cannot run on a CPU (GPU-only flags,
shell commands, rules and pseudo-code) are fenced as ```bash or ```text instead."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(doc, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    if not blocks:
        pytest.skip(f"{doc.name} has no python examples")
    script = tmp_path / "examples.py"
    script.write_text("\n\n".join(blocks))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{doc.name} examples failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
