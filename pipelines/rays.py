"""The DDP ray pipeline: ``external_source(cache, no_copy=True)`` -> ``fn.dali_nerf.ray_sampler``.

The cache arrays are fed as the same (immutable) buffers every run, without a copy; the stream
position of the first run's first ray (``start``) is fed by a second external source, which
feeds -1 ("continue after your previous run") for every later run (:class:`StartFeed`), so the
pipeline can run ``prefetch_queue_depth`` runs ahead of the consumer in its own threads
(``exec_async`` / ``exec_pipelined``). The SS pipeline uses the same feed.

Run ``j`` of a pipeline built with ``first_start=s0`` samples stream positions
``[s0 + j * rays_per_run, s0 + (j + 1) * rays_per_run)``; its outputs (one sample each) are

=========== ========= ======= ==============================================
origins     (R, 3)    float32 world ray origins
directions  (R, 3)    float32 unit directions
rgb         (R, 3)    float32 target colour in [0, 1]
indices     (R, 3)    int64   (camera index in split, row, col)
near, far   (R, 1)    float32 per-ray bounds (0, 1e10 when the scene has none)
consumed    (1,)      int64   stream positions used (R: no routing here)
=========== ========= ======= ==============================================

>>> pipe = ray_pipeline(cache, rays_per_run=262144, mode="random", seed=0, rank=0, world_size=1)
>>> origins, directions, rgb, indices, near, far, consumed = pipe.run()
"""

from __future__ import annotations

import numpy as np

__all__ = ["ray_pipeline", "release_pipeline", "StartFeed", "RAY_OUTPUTS"]

RAY_OUTPUTS = ("origins", "directions", "rgb", "indices", "near", "far", "consumed")
"""Output names of :func:`ray_pipeline`, in order."""


class StartFeed:
    """``start`` per run: ``first`` for run 0, then -1: the op continues right where its previous
    run ended (start + consumed), so DALI can run a pipeline ahead even when ``consumed`` depends
    on the data (routed runs)."""

    def __init__(self, first: int):
        self.first = int(first)
        self.calls = 0

    def __call__(self):
        v = self.first if self.calls == 0 else -1
        self.calls += 1
        return [np.array(v, dtype=np.int64)]


def ray_pipeline(cache, rays_per_run: int, mode: str, seed: int, rank: int, world_size: int, *,
                 first_start: int = 0, device: str = "cpu", num_threads: int = 2, prefetch: int = 2,
                 device_id=None):
    """Build the ray pipeline over an :class:`~dali_nerf.pipelines.decode.ImageCache`.

    Args:
        cache: pixels (P, 3) u8, cameras (N, 18) f32, layout (N, 4) i64 (kept alive by the caller;
            fed with ``no_copy=True`` — they must not change while the pipeline exists).
        rays_per_run: R, rays per run (one output sample).
        mode: "random" | "epoch"; seed, rank, world_size: the stream's key.
        first_start: stream position of run 0's first ray.
        device: "cpu" or "cuda" (GPU backend of the op; ``cache.pixels`` on the GPU).
        prefetch: runs DALI computes ahead (0 = synchronous, no async executor).
    Returns:
        A built pipeline whose ``run()`` gives the 7 outputs of :data:`RAY_OUTPUTS`.
    """
    from nvidia.dali import fn, pipeline_def, types

    from dali_nerf.hostmem import dali_host_pool
    from dali_nerf.ops import load_plugin

    dali_host_pool()  # per-run output buffers from DALI's pool (dali_nerf.hostmem)
    load_plugin()
    gpu = device == "cuda"
    feed = StartFeed(first_start)
    pixels_src, cameras_src, layout_src = [cache.pixels], [cache.cameras], [cache.layout]

    @pipeline_def
    def _rays():
        dev = "gpu" if gpu else "cpu"
        pixels = fn.external_source(source=lambda: pixels_src, batch=True, no_copy=True, device=dev,
                                    dtype=types.UINT8, ndim=2, name="pixels")
        cameras = fn.external_source(source=lambda: cameras_src, batch=True, no_copy=True, device="cpu",
                                     dtype=types.FLOAT, ndim=2, name="cameras")
        layout = fn.external_source(source=lambda: layout_src, batch=True, no_copy=True, device="cpu",
                                    dtype=types.INT64, ndim=2, name="layout")
        start = fn.external_source(source=feed, batch=True, device="cpu", dtype=types.INT64, ndim=0,
                                   name="start")
        if gpu:
            cameras, layout = cameras.gpu(), layout.gpu()
        return tuple(fn.dali_nerf.ray_sampler(
            pixels, cameras, layout, rays=int(rays_per_run), mode=mode, seed=int(seed), rank=int(rank),
            world_size=int(world_size), start=start, device=dev,
        ))

    sync = prefetch <= 0
    pipe = _rays(batch_size=1, num_threads=num_threads, device_id=device_id,
                 prefetch_queue_depth=max(1, int(prefetch)), exec_async=not sync, exec_pipelined=not sync)
    pipe.build()
    pipe._dali_nerf_sources = (pixels_src, cameras_src, layout_src)
    return pipe


def release_pipeline(pipe) -> None:
    """Destroy a pipeline from :func:`ray_pipeline` and drop its references to the cache arrays now.

    DALI's graph objects (operators <-> data nodes) form reference cycles that hold the external
    sources' closures until the garbage collector runs; clearing the source lists after the
    pipeline is gone frees the cache's buffers immediately (streaming windows rely on this to keep
    decoded memory bounded). The caller must not use ``pipe`` afterwards.
    """
    sources = getattr(pipe, "_dali_nerf_sources", ())
    del pipe  # the Pipeline object itself is not in a cycle: its executor stops here
    for lst in sources:
        lst.clear()
