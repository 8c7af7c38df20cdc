"""DALI pipeline definitions (installed as ``dali_nerf.pipelines``; import them by that name).

* :mod:`.decode`   sharded ``readers.file`` + ``decoders.image`` -> ImageCache (decode once)
* :mod:`.rays`     ``external_source(cache, no_copy=True)`` -> the ray sampler op (DDP)
* :mod:`.spatial`  the same op routed to one cell, and the routed baselines (SS)
* :mod:`.builder`  ``build_batch_source(cfg, scene, rank, world_size)``: ``pipeline.name`` -> source

Submodules import DALI; this package itself imports nothing native.
"""

__all__ = ["decode", "rays", "spatial", "builder"]
