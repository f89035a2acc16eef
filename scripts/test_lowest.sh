#!/usr/bin/env bash
# The torch-free runtime tests (pytest -m runtime_python: generate and the server without
# torch, the engine's ids, the C sample's comparison) with the lowest numpy, onnxruntime,
# tokenizers, jinja2 and server packages that pyproject.toml declares. They run in a second
# venv, .venv-lowest, on bundles that .venv (scripts/setup.sh) exports. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-lowest/bin/python ]; then
    "$PYTHON" -m venv .venv-lowest
fi
pip=(.venv-lowest/bin/python -m pip install --quiet --disable-pip-version-check)
# httpx at the lock's version: fastapi's TestClient in the server test needs it.
"${pip[@]}" $(.venv/bin/python scripts/lowest_requirements.py) "$(grep '^httpx==' requirements/lock.txt)"
.venv-lowest/bin/python -m pip show --quiet mars-edge >/dev/null 2>&1 || "${pip[@]}" --no-deps -e .
MARS_RUNTIME_PYTHON=.venv-lowest/bin/python exec .venv/bin/python -m pytest -m runtime_python tests
