#!/usr/bin/env bash
# The README's main command: install, then generate the default scene, train with 2 ranks,
# render and report (dali-nerf demo). Extra arguments go to `dali-nerf demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e .
exec dali-nerf demo "$@"
