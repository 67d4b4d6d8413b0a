"""Generated sources are what their generators write today (regenerate, never hand-edit)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wgmma_wrappers_match_generator():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py")], capture_output=True, text=True,
                         check=True).stdout
    assert out == (ROOT / "cpp" / "cuda" / "wgmma.cuh").read_text(), \
        "cpp/cuda/wgmma.cuh is stale: python tools/gen_wgmma.py > cpp/cuda/wgmma.cuh"
