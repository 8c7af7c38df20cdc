#!/usr/bin/env bash
# The README's test command (and CI's, .ci/run): install (editable, with the test extra) and run
# the whole suite. Extra arguments go to pytest.
# Installs into the running python3, or into .venv/ here where that Python refuses installs
# (PEP 668): scripts/_python.sh. DALI_NERF_INSTALL_DRY=1 prints what it would run.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_python.sh
dn_python
dn_install '.[test]'
dn_exec "$PY" -m pytest -q "$@"
