#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the 10+10 prompt default-model check. Without
# arguments (CI) the torch-free runtime tests then run again on the lowest declared
# versions (scripts/test_lowest.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
if [ $# -eq 0 ]; then
    bash scripts/test_lowest.sh
fi
