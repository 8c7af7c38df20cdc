"""The ray graph: ``external_source(cache, no_copy=True)`` -> ``fn.dali_nerf.ray_sampler``, with
optional routing to one spatial-segmentation cell.

The cache arrays are fed once, without a copy, to external sources that repeat their last
input every run (``repeat_last``: no Python callback per run, which cost ~0.1 ms each); the
stream position of the first run's first ray is the op's constant ``start`` with
``continue_runs=True`` (every later run continues where the previous one ended, tracked by the
op), so the pipeline can run ``prefetch_queue_depth`` runs ahead of the consumer in its own
threads (``exec_async`` / ``exec_pipelined``) even when ``consumed`` depends on the data (routed
runs), and a run costs the caller no per-run input at all.

Unrouted (DDP, streaming windows): run ``j`` of a pipeline built with ``first_start=s0`` samples
stream positions ``[s0 + j * rays_per_run, s0 + (j + 1) * rays_per_run)``. Routed
(``partition``, ``cell``; SS): the partition's centroids are a 4th input and each run emits
exactly ``rays_per_run`` rays that cross the cell (exact closed-form test inside the op), having
consumed ``consumed`` stream positions; the stream key is the caller's (seed, stream, num_streams):
the DDP sources pass their rank and world size, the SS sources the cell and the number of cells.

The split's global stream (``global_pixels=P`` > 0; DDP, unrouted): the stream is the seed's alone
(``stream``/``num_streams`` must stay 0 / 1) and the cache holds the split's pixels
``[shard_begin, shard_begin + len(cache.pixels))``; run ``j`` walks the global positions
``[s0 + j * rays_per_run, s0 + (j + 1) * rays_per_run)`` (``rays_per_run`` = K steps of
``step_positions`` = G, the global batch; ``s0`` a multiple of G) and emits the rays of the
positions that fall in the cache, in position order, plus two outputs (:data:`GLOBAL_OUTPUTS`):
``step_counts`` (K,) (rays of each step) and ``positions`` (M,) (each ray's global position).
Outputs (one sample each):

=========== ========= ======= ==============================================
origins     (R, 3)    float32 world ray origins
directions  (R, 3)    float32 unit directions
rgb         (R, 3)    float32 target colour in [0, 1]
indices     (R, 3)    int64   (camera index in split, row, col)
near, far   (R, 1)    float32 per-ray bounds (0, 1e10 when the scene has none)
consumed    (1,)      int64   stream positions used (R when not routed)
step_counts (K,)      int64   global stream only: rays of each of the K steps
positions   (M,)      int64   global stream only: each ray's global position
=========== ========= ======= ==============================================

>>> pipe = ray_pipeline(cache, rays_per_run=262144, mode="random", seed=0, stream=0, num_streams=1)
>>> origins, directions, rgb, indices, near, far, consumed = pipe.run()
>>> routed = ray_pipeline(cache, 4096, "random", 0, 2, 4, partition=part, cell=2)
>>> ddp = ray_pipeline(cache, 16 * 8192, "epoch", 0, 0, 1, global_pixels=P, shard_begin=lo,
...                    step_positions=8192, first_start=step * 8192)
>>> *rays, consumed, step_counts, positions = ddp.run()
"""

from __future__ import annotations

import numpy as np

from dali_nerf._dali import ray_graph_api

__all__ = ["ray_pipeline", "release_pipeline", "RAY_OUTPUTS", "GLOBAL_OUTPUTS", "pixel_feed"]

RAY_OUTPUTS = ("origins", "directions", "rgb", "indices", "near", "far", "consumed")
"""Output names of :func:`ray_pipeline`, in order."""

GLOBAL_OUTPUTS = RAY_OUTPUTS + ("step_counts", "positions")
"""Output names of :func:`ray_pipeline` with ``global_pixels`` > 0, in order."""


def pixel_feed(pixels, gpu: bool):
    """What the ``pixels`` external source is fed (once; a batch of one sample, no copy).

    GPU: one contiguous (1, P, 3) tensor (a view of ``pixels``): DALI's ``external_source``
    documents that with ``no_copy`` a GPU batch given as a list of separate tensors is copied
    internally every run, while one contiguous buffer is used as is. CPU: ``[pixels]`` (a list of
    contiguous arrays is passed without a copy on the CPU).
    """
    return pixels.unsqueeze(0) if gpu else [pixels]


def _routing_args(partition, cell: int) -> dict:
    """The op's routing arguments for ``cell`` of ``partition``."""
    return dict(cell=int(cell), margin=float(partition.margin), up=[float(u) for u in partition.up],
                dims=int(partition.dims),
                bounds=[] if partition.bounds is None else [float(v) for v in np.asarray(partition.bounds).ravel()])


def ray_pipeline(cache, rays_per_run: int, mode: str, seed: int, stream: int, num_streams: int, *,
                 first_start: int = 0, device: str = "cpu", num_threads: int = 2, prefetch: int = 2,
                 device_id=None, partition=None, cell: int = -1, global_pixels: int = 0,
                 shard_begin: int = 0, step_positions: int = 0):
    """Build the ray graph over an :class:`~dali_nerf.pipelines.decode.ImageCache`.

    Args:
        cache: pixels (P, 3) u8, cameras (N, 18) f32, layout (N, 4) i64 (kept alive by the caller;
            fed with ``no_copy=True`` — they must not change while the pipeline exists).
        rays_per_run: R, rays per run (one output sample; accepted rays when routed); with
            ``global_pixels``: global positions walked per run (K * ``step_positions``).
        mode: "random" | "epoch"; seed, stream, num_streams: the stream's key (a DDP rank and
            the world size, or an SS cell and the number of cells; 0 and 1 with
            ``global_pixels``).
        first_start: stream position of run 0's first ray (a global position, a multiple of
            ``step_positions``, with ``global_pixels``).
        device: "cpu" or "cuda" (GPU backend of the op; ``cache.pixels`` must then be a CUDA
            tensor, fed as one (1, P, 3) batch, :func:`pixel_feed`; cameras/layout/centroids
            stay CPU inputs).
        prefetch: runs DALI computes ahead (0 = synchronous executor, whose output buffers are
            reused by the next run).
        partition, cell: route to ``cell`` of this :class:`~dali_nerf.partition.Partition`
            (None: no routing).
        global_pixels: P of the split's global stream (0: the cache's own stream, as before).
        shard_begin: the split's pixel id of the cache's first pixel (global stream).
        step_positions: G, global positions per step (global stream; 0: ``rays_per_run``).
    Returns:
        A built pipeline whose ``run()`` gives the 7 outputs of :data:`RAY_OUTPUTS` (the 9 of
        :data:`GLOBAL_OUTPUTS` with ``global_pixels``).
    """
    fn, pipeline_def, types = ray_graph_api()
    gpu = device == "cuda"
    names = ["pixels", "cameras", "layout"]
    srcs = [pixel_feed(cache.pixels, gpu), [cache.cameras], [cache.layout]]
    if partition is not None:
        names.append("centroids")
        srcs.append([np.ascontiguousarray(partition.centroids, np.float32)])
    routing = _routing_args(partition, cell) if partition is not None else {}
    stream_args = dict(stream=int(stream), num_streams=int(num_streams))
    if global_pixels:  # the op's defaults otherwise: nothing changes for the cache's own streams
        stream_args.update(global_pixels=int(global_pixels), shard_begin=int(shard_begin),
                           step_positions=int(step_positions))

    @pipeline_def
    def _rays():
        dev = "gpu" if gpu else "cpu"
        # fed once after build (below) and repeated every run without a copy
        fed = dict(batch=True, no_copy=True, repeat_last=True)
        pixels = fn.external_source(device=dev, dtype=types.UINT8, ndim=2, name="pixels", **fed)
        inputs = [fn.external_source(device="cpu", dtype=types.FLOAT, ndim=2, name="cameras", **fed),
                  fn.external_source(device="cpu", dtype=types.INT64, ndim=2, name="layout", **fed)]
        if routing:
            inputs.append(fn.external_source(device="cpu", dtype=types.FLOAT, ndim=2, name="centroids", **fed))
        # the GPU op takes cameras, layout and centroids as CPU inputs (its host-side checks and
        # tables read them there); only the pixels live on the device
        return tuple(fn.dali_nerf.ray_sampler(
            pixels, *inputs, rays=int(rays_per_run), mode=mode, seed=int(seed), start=int(first_start),
            continue_runs=True, device=dev, **stream_args, **routing,
        ))

    sync = prefetch <= 0
    pipe = _rays(batch_size=1, num_threads=num_threads, device_id=device_id,
                 prefetch_queue_depth=max(1, int(prefetch)), exec_async=not sync, exec_pipelined=not sync)
    pipe.build()
    for name, data in zip(names, srcs):
        pipe.feed_input(name, data)
    pipe._dali_nerf_sources = srcs  # kept alive while the pipeline exists; see release_pipeline
    return pipe


def release_pipeline(pipe) -> None:
    """Destroy a pipeline from :func:`ray_pipeline` and drop its references to the cache arrays now.

    DALI's graph objects (operators <-> data nodes) form reference cycles that hold the external
    sources' closures until the garbage collector runs; clearing the source lists after the
    pipeline is gone frees the cache's buffers immediately (streaming windows rely on this to keep
    decoded memory bounded). The caller must not use ``pipe`` afterwards.
    """
    sources = getattr(pipe, "_dali_nerf_sources", None)
    del pipe  # the Pipeline object itself is not in a cycle: its executor stops here
    if sources is not None:
        sources.clear()
