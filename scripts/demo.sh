#!/usr/bin/env bash
# The README's main command: install, then generate the default scene, train with 2 ranks,
# render and report (dali-nerf demo). Extra arguments go to `dali-nerf demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch: the one already installed, else 2.13.0 (a local CPU build on the project's machines)
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
exec dali-nerf demo "$@"
