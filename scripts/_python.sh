# Sourced by scripts/demo.sh and scripts/test.sh (the README's two commands), from the checkout's
# root: which Python to install dali_nerf into, and the install.
#
#   dn_python            sets PY: the running python3 (an active virtual environment's, or any
#                        Python whose pip accepts installs); only when pip refuses (PEP 668:
#                        Debian's and Ubuntu's own python3 are "externally managed") or python3 has
#                        no pip, the virtual environment .venv/ in the checkout, created once and
#                        reused (one line says so; .venv/bin is then first in PATH for this script)
#   dn_install TARGET    torch 2.13.0 where there is no torch (a CPU build where the package index
#                        has one), then `pip install -e TARGET`
#   dn_exec CMD ...      exec CMD
#
# DALI_NERF_INSTALL_DRY=1: print the decision and the commands instead of running them (nothing is
# installed or created; tests/test_install_scripts.py). Missing tools are one line naming the
# Debian/Ubuntu packages, exit code 2.

dn_fail() {
    echo "error: $*" >&2
    exit 2
}

dn_run() {  # run "$@", or print it in the dry mode
    if [ -n "${DALI_NERF_INSTALL_DRY:-}" ]; then
        printf 'would run:'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

dn_exec() {
    if [ -n "${DALI_NERF_INSTALL_DRY:-}" ]; then
        dn_run "$@"
        exit 0
    fi
    exec "$@"
}

dn_python() {
    command -v python3 >/dev/null 2>&1 ||
        dn_fail "python3 not found; install Python >= 3.10 (Debian/Ubuntu: sudo apt-get install python3 python3-venv)"
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
        dn_fail "$(python3 -V 2>&1) is too old; dali_nerf needs Python >= 3.10"
    command -v g++ >/dev/null 2>&1 ||
        dn_fail "g++ not found (it builds the ray sampler operator); install it (Debian/Ubuntu: sudo apt-get install g++)"
    # pip's own answer to "may I install into this Python?": an install with no requirement stops at
    # the PEP 668 check when the environment is externally managed, else at "give a requirement"
    local probe why
    probe=$(python3 -m pip install --dry-run 2>&1 || true)
    case "$probe" in
        *externally-managed-environment*) why="is externally managed (PEP 668)" ;;
        *"No module named pip"*) why="has no pip" ;;
        *) why="" ;;
    esac
    if [ -z "$why" ]; then
        PY=$(python3 -c 'import sys; print(sys.executable)')
        [ -z "${DALI_NERF_INSTALL_DRY:-}" ] || echo "python: installing into $PY (its pip accepts installs)"
        return 0
    fi
    local where
    where="$(command -v python3) ($(python3 -V 2>&1))"
    if [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; then
        echo "python: $where $why: using the virtual environment .venv/ in this checkout"
    else
        python3 -c 'import venv, ensurepip' 2>/dev/null ||
            dn_fail "python3 $why and cannot create a virtual environment (no ensurepip); install it (Debian/Ubuntu: sudo apt-get install python3-venv), then rerun"
        echo "python: $where $why: creating the virtual environment .venv/ in this checkout (later commands: .venv/bin/dali-nerf, or source .venv/bin/activate)"
        # --clear: a .venv/ left broken (no pip) by an interrupted run is made anew
        dn_run python3 -m venv --clear .venv
    fi
    PY="$PWD/.venv/bin/python"
    export VIRTUAL_ENV="$PWD/.venv"
    export PATH="$PWD/.venv/bin:$PATH"
}

dn_install() {
    # torch: the one already installed (found, not imported: that takes seconds), else 2.13.0 (a
    # local CPU build on the project's machines)
    if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
        dn_run "$PY" -m pip install -q torch==2.13.0
    fi
    dn_run "$PY" -m pip install -q -e "$1"
}
