"""The runtime imports and runs with torch made unimportable."""

from __future__ import annotations

import json
import subprocess

import pytest
from support import RUNTIME_PYTHON

SCRIPT = """
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import runtime, runtime.generate, runtime.decode.decoder, runtime.backends.onnx, runtime.text.tokenizer
sys.argv = ["generate", sys.argv[1], "--prompt", "hi", "--chat", "--max-new-tokens", "5", "--tau", "0.5", "--json"]
code = runtime.generate.main()
heavy = sorted(m for m in ("torch", "transformers") if sys.modules.get(m) is not None)
print(json.dumps({"code": code, "heavy": heavy}))
"""


@pytest.mark.runtime_python
def test_runtime_runs_without_torch(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    done = subprocess.run([RUNTIME_PYTHON, "-c", SCRIPT, str(bundle)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    generated, status = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert status == {"code": 0, "heavy": []}
    assert generated["num_tokens"] == 5
