"""The server imports, starts and answers with torch made unimportable."""

from __future__ import annotations

import json
import subprocess

import pytest
from support import RUNTIME_PYTHON

SCRIPT = """
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from fastapi.testclient import TestClient
from runtime.serve import build_app, parse_args
with TestClient(build_app(parse_args([sys.argv[1], "--threads", "1"]))) as client:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "tau": 1.0})
heavy = sorted(m for m in ("torch", "transformers") if sys.modules.get(m) is not None)
print(json.dumps({"status": r.status_code, "tokens": r.json()["usage"]["completion_tokens"], "heavy": heavy}))
"""


@pytest.mark.runtime_python
def test_server_runs_without_torch(tiny_bundle):
    _, bundle = tiny_bundle("llama", 4)
    done = subprocess.run([RUNTIME_PYTHON, "-c", SCRIPT, str(bundle)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"status": 200, "tokens": 3, "heavy": []}
