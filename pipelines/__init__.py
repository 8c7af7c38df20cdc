"""DALI graph definitions only (installed as ``dali_nerf.pipelines``; import them by that name).

* :mod:`.decode`   sharded ``readers.file`` + ``decoders.image`` -> ImageCache (decode once)
* :mod:`.rays`     ``external_source(cache, no_copy=True)`` -> the ray sampler op, optionally
  routed to one spatial-segmentation cell

The batch sources that run these graphs live in :mod:`dali_nerf.sources`; nothing here imports
them, the baselines or the trainers (tests/test_layout.py). DALI itself is imported only when a
graph is built (:mod:`dali_nerf.data._dali`); this package imports nothing native.
"""

__all__ = ["decode", "rays"]
