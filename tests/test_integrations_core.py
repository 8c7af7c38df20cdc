"""The core package never imports nerfstudio; the nerfstudio method is declared as an entry point.
(The integration's own tests live in tests/nerfstudio_extra/ and skip, with their reason, without it.)"""

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest


def test_import_dali_nerf_does_not_import_nerfstudio():
    code = ("import sys, dali_nerf, dali_nerf.integrations, dali_nerf.cli.main, dali_nerf.train.tblog, dali_nerf.train.loop\n"
            "from dali_nerf import RayLoader, load_scene\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('nerfstudio', 'tyro', 'viser'))\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]


def test_dali_nerfacto_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="nerfstudio.method_configs")
    ours = [e for e in eps if e.name == "dali-nerfacto"]
    assert ours, "dali-nerfacto not registered; reinstall with pip install -e ."
    assert ours[0].value == "dali_nerf.integrations.nerfstudio:dali_nerfacto"


@pytest.mark.skipif(importlib.util.find_spec("nerfstudio") is not None, reason="nerfstudio is installed here")
def test_integration_without_nerfstudio_names_the_missing_package():
    with pytest.raises(ModuleNotFoundError, match="nerfstudio"):
        importlib.import_module("dali_nerf.integrations.nerfstudio")
