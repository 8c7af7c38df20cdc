#!/usr/bin/env bash
# The README's test command: install (editable, with test extras) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch: the one already installed, else 2.13.0 (a local CPU build on the project's machines)
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
python3 -m pytest -q "$@"
