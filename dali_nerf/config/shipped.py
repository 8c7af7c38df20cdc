"""The configs shipped with the package, and the one resolution of ``--config X``.

The repository's ``configs/*.yaml`` are installed inside the package as ``dali_nerf/configs/``
(setup.cfg ``package_dir`` + ``package_data``), so an installed copy has them without a checkout
(tests/test_wheel.py).
``X`` is a path when that file exists, else the name of a shipped config (``ddp_objects`` or
``ddp_objects.yaml``); anything else is a one-line :class:`ConfigError` listing the names. Every
command that takes ``--config`` goes through :func:`resolve_config` (via :func:`load_config`).
A config's description is the first line of its leading comment.

>>> resolve_config("ddp_objects").name
'ddp_objects.yaml'
>>> sorted(shipped_configs())[:2]
['ddp_blender_gpu', 'ddp_llff']
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from dali_nerf.errors import ConfigError

__all__ = ["shipped_dir", "shipped_configs", "describe_config", "resolve_config"]


def shipped_dir() -> Path:
    """The folder of the shipped configs: the copy installed inside the package (``dali_nerf/configs/``,
    setup.cfg ``package_dir``), else this checkout's ``configs/`` (an editable install, or a checkout
    on ``sys.path``)."""
    pkg = Path(__file__).resolve().parents[1]  # dali_nerf/
    installed, checkout = pkg / "configs", pkg.parent / "configs"
    return installed if any(installed.glob("*.yaml")) or not checkout.is_dir() else checkout


def shipped_configs() -> Dict[str, Path]:
    """``{name: path}`` of every shipped config, sorted by name (``name`` = the file's stem)."""
    return {p.stem: p for p in sorted(shipped_dir().glob("*.yaml"))}


def describe_config(path) -> str:
    """The config's one-line description: the first line of its leading ``#`` comment ('' without one)."""
    for line in Path(path).read_text().splitlines():
        s = line.strip()
        if s.startswith("#"):
            return s.lstrip("#").strip()
        if s:
            return ""
    return ""


def resolve_config(config) -> Optional[Path]:
    """``config`` as a file: the path when it exists, else the shipped config of that name.

    None stays None (the built-in defaults). A name is looked up only when ``config`` has no
    folder part (``ddp_objects``, ``ddp_objects.yaml``); a path that does not exist stays a path.

    Raises:
        ConfigError: neither a file nor a shipped name; the line lists the shipped names.
    """
    if config is None:
        return None
    p = Path(config)
    if p.is_file():
        return p
    if p.parent == Path(".") and str(config):
        shipped = shipped_configs()
        name = p.stem if p.suffix in (".yaml", ".yml") else p.name
        if name in shipped:
            return shipped[name]
        raise ConfigError(f"{config}: config file not found and not a shipped config; pass a YAML path or one of: "
                          f"{', '.join(shipped) or '(none installed)'} (dali-nerf train --list)")
    raise ConfigError(f"{config}: config file not found; pass a YAML path or a shipped config's name "
                      f"(dali-nerf train --list)")
