#!/usr/bin/env bash
# The README's main command: install, then generate the default scene, train with 2 ranks,
# render and report (dali-nerf demo). Extra arguments go to `dali-nerf demo`.
# Installs into the running python3, or into .venv/ here where that Python refuses installs
# (PEP 668): scripts/_python.sh. DALI_NERF_INSTALL_DRY=1 prints what it would run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
dn_python
dn_install .
dn_exec "$PY" -m dali_nerf demo "$@"
