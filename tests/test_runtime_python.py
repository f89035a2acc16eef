"""The torch-free runtime under ``support.RUNTIME_PYTHON`` gives this venv's token ids.

Run by scripts/test_lowest.sh with the lowest numpy, onnxruntime, tokenizers and jinja2
that pyproject.toml declares, on bundles this venv exported: the same chat-template ids,
and the same decoded ids from solo decoding and from the engine in both batch schemes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_ids import runtime_ids
from support import RUNTIME_PYTHON

SCRIPT = Path(__file__).with_name("runtime_ids.py")


@pytest.mark.runtime_python
@pytest.mark.parametrize("arch, window", [("llama", 4), ("qwen3", 8)])
def test_runtime_python_gives_the_ids_of_this_venv(tiny_bundle, arch, window):
    _, bundle = tiny_bundle(arch, window)
    done = subprocess.run([RUNTIME_PYTHON, str(SCRIPT), str(bundle)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    got, want = json.loads(done.stdout), runtime_ids(str(bundle))
    assert got["1.0"]["continuous"] == got["1.0"]["solo"] == got["1.0"]["block"]  # tau = 1: greedy AR
    assert got == want, f"{RUNTIME_PYTHON} decodes other ids than {sys.executable}"
