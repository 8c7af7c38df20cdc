#!/usr/bin/env bash
# The [nerfstudio] extra's tests (tests/nerfstudio_extra), in their own virtual environment,
# outside the core suite: nerfstudio 1.1.5 and its dependencies (~9 GB with torch 2.14.1), pinned by
# constraints/nerfstudio.txt. The environment is reused when it exists (DALI_NERF_NS_VENV, default
# ~/.cache/dali_nerf/nsvenv: outside the checkout, so clean clones and CI reuse it instead of
# building ~9 GB again; the editable install of dali_nerf is re-pointed to this checkout each run).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DALI_NERF_NS_VENV:-$HOME/.cache/dali_nerf/nsvenv}
C=constraints/nerfstudio.txt
[ -x "$VENV/bin/python" ] || { mkdir -p "$(dirname "$VENV")" && python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
# the core's install_requires except torch (the extra runs on torch 2.14.1; see $C)
mapfile -t CORE < <(python3 - <<'PY'
import configparser
c = configparser.ConfigParser()
c.read("setup.cfg")
for line in c["options"]["install_requires"].splitlines():
    line = line.split("#")[0].strip()
    if line and not line.replace(" ", "").startswith(("torch==", "torch>=")):
        print(line)
PY
)
"$PY" -m pip install -q -c "$C" torch torchvision "nerfstudio==1.1.5" tensorboard "pytest>=8" "${CORE[@]}"
"$PY" -m pip install -q --no-deps -e .
"$PY" - <<'PY'
import importlib.metadata as m
eps = [e.name for e in m.entry_points(group="nerfstudio.method_configs")]
assert {"dali-nerfacto", "dali-splatfacto"} <= set(eps), f"dali-nerfacto or dali-splatfacto entry point missing: {eps}"
print("nerfstudio", m.version("nerfstudio"), "torch", m.version("torch"), "methods:", ", ".join(eps))
PY
"$PY" -m pytest -q -p no:cacheprovider tests/nerfstudio_extra "$@"
