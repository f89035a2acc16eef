#!/usr/bin/env bash
# Build engine.plan for a bundle ON the Jetson that will run it (an engine is tied to its
# GPU and TensorRT version). Needs JetPack 6.1 or later (TensorRT 10.3+), see README.md.
#
#   bash samples/jetson/build_engine.sh BUNDLE [MAX_BATCH] [MAX_CONTEXT] [WORKSPACE_MIB]
#
# Uses TensorRT's Python API (python -m runtime.trt_build); with USE_TRTEXEC=1 it runs the
# equivalent trtexec line instead (same profile: batch 1..MAX_BATCH, past = KV cache capacity W..MAX_CONTEXT).
set -euo pipefail
bundle=${1:?usage: build_engine.sh BUNDLE [MAX_BATCH] [MAX_CONTEXT] [WORKSPACE_MIB]}
max_batch=${2:-4}
max_context=${3:-2048}
workspace=${4:-1024}
cd "$(dirname "$0")/../.."
args=("$bundle" --max-batch "$max_batch" --max-context "$max_context" --opt-context "$((max_context / 2))"
      --workspace-mib "$workspace")
if [[ "${USE_TRTEXEC:-0}" == 1 ]]; then
    trtexec=${TRTEXEC:-/usr/src/tensorrt/bin/trtexec}  # where JetPack installs it
    line=$(python3 -m runtime.trt_build "${args[@]}" --print-trtexec | tr -d '\\\n')
    (cd "$bundle" && eval "${line/trtexec/$trtexec}")
    python3 - "$bundle" <<'PY'
import sys
from pathlib import Path
from runtime.bundle import CONFIG_FILE, ENGINE_FILE, BundleConfig, load_config
config = load_config(sys.argv[1])
Path(sys.argv[1], CONFIG_FILE).write_text(BundleConfig(**{**config.__dict__, "engine_file": ENGINE_FILE}).to_json())
print(f"recorded {ENGINE_FILE} in {CONFIG_FILE}")
PY
else
    python3 -m runtime.trt_build "${args[@]}"
fi
