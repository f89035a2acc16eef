#!/usr/bin/env bash
# Create .venv (once) and install the toolkit at the locked versions (requirements/lock.txt)
# with the CPU onnxruntime and every extra CI needs. Idempotent: a second run only checks
# that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c requirements/lock.txt \
    -e ".[cpu,export,fused,dev,bench,eval,serve-ray]"
