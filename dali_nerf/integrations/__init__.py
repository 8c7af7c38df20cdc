"""Adapters to training frameworks users already run; each needs its own extra and is imported
only by name (``import dali_nerf`` imports none of them).

* :mod:`dali_nerf.integrations.nerfstudio` — a nerfstudio 1.1.x DataManager backed by
  :class:`~dali_nerf.RayLoader` and the ``dali-nerfacto`` method (``pip install -e '.[nerfstudio]'``).
"""

__all__: list = []  # submodules are imported by name: each needs its extra
