"""``python -m dali_nerf``: the ``dali-nerf`` command (what scripts/demo.sh runs)."""

from dali_nerf.cli.main import entry

entry()
