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

Masked caches (``cache.valid``, the valid-pixel index of a scene with masks) feed it as one more
input: every stream then draws among the cache's valid pixels only (random: uniform over them;
epoch: each once per ``num_valid`` positions; global: ``global_pixels`` / ``shard_begin`` count
the split's valid pixels), and no ray ever lands on a masked pixel.

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

>>> pipe = ray_pipeline(cache, RayGraph(rays=262144, mode="random", seed=0, stream=0, num_streams=1))
>>> origins, directions, rgb, indices, near, far, consumed = pipe.run()
>>> routed = ray_pipeline(cache, RayGraph(4096, "random", 0, stream=2, num_streams=4, partition=part, cell=2))
>>> ddp = ray_pipeline(cache, RayGraph(16 * 8192, "epoch", 0, global_pixels=P, shard_begin=lo,
...                                    step_positions=8192, first_start=step * 8192))
>>> *rays, consumed, step_counts, positions = ddp.run()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dali_nerf.data._dali import ray_graph_api
from dali_nerf.errors import ConfigError
from dali_nerf.ops.limits import INT32_MAX, INT64_MAX, MAX_CELLS, RAY_BYTES  # the op's limits (re-exported)

__all__ = ["RayGraph", "ray_pipeline", "release_pipeline", "abort_pipeline", "RAY_OUTPUTS", "GLOBAL_OUTPUTS", "GLOBAL_STREAM", "SHARD_STREAM", "pixel_feed", "OP_ARGS", "check_op_args",
           "INT32_MAX", "INT64_MAX", "MAX_CELLS", "RAY_BYTES"]

_FLOAT_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class _Arg:
    """One argument of the op's schema: its kind and the values it accepts."""

    kind: str  # "int" | "float" | "bool" | "choice" | "floats"
    lo: float = 0
    hi: float = 0
    choices: tuple = ()
    text: str = ""

    def accepts(self, v) -> bool:
        if self.kind == "bool":
            return isinstance(v, (bool, np.bool_))
        if self.kind == "choice":
            return isinstance(v, (int, str)) and not isinstance(v, bool) and v in self.choices
        if self.kind == "int":
            return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and self.lo <= v <= self.hi
        if self.kind == "float":
            return (isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
                    and math.isfinite(v) and self.lo < v <= self.hi)
        if self.kind == "floats":  # a list of finite float32 values; lo / hi: the lengths allowed
            if not isinstance(v, (list, tuple)) or len(v) not in self.choices:
                return False
            return all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
                       and math.isfinite(x) and abs(x) <= _FLOAT_MAX for x in v)
        raise AssertionError(self.kind)


OP_ARGS = {
    "rays": _Arg("int", 1, INT32_MAX, text=f"an integer in [1, {INT32_MAX}] (the op's int32)"),
    "mode": _Arg("choice", choices=("random", "epoch"), text="random or epoch"),
    "seed": _Arg("int", 0, INT64_MAX, text=f"an integer in [0, {INT64_MAX}] (the op's int64)"),
    "stream": _Arg("int", 0, INT32_MAX - 1, text="an integer in [0, num_streams)"),
    "num_streams": _Arg("int", 1, INT32_MAX, text=f"an integer in [1, {INT32_MAX}] (the op's int32)"),
    "global_pixels": _Arg("int", 0, 2**62, text="0 (the cache's own stream) or the split's pixel count, at most 2**62"),
    "shard_begin": _Arg("int", 0, 2**62 - 1, text="the split's pixel id of the cache's first pixel, in [0, global_pixels)"),
    "step_positions": _Arg("int", 0, INT64_MAX, text=f"0 or the global positions per step in [1, {INT64_MAX}]"),
    "start": _Arg("int", -1, INT64_MAX - 1, text=f"-1 (continue) or a stream position in [0, {INT64_MAX - 1}] (int64)"),
    "continue_runs": _Arg("bool", text="true or false"),
    "cell": _Arg("int", -1, MAX_CELLS - 1, text=f"-1 (no routing) or a cell index in [0, {MAX_CELLS})"),
    "margin": _Arg("float", 0.0, _FLOAT_MAX, text="a finite number > 0"),
    "up": _Arg("floats", choices=(3,), text="3 finite numbers, not all zero"),
    "dims": _Arg("choice", choices=(2, 3), text="2 or 3"),
    "simd": _Arg("bool", text="true or false"),
    "route_tile": _Arg("choice", choices=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), text="0 or a power of two <= 256"),
    "bounds": _Arg("floats", choices=(0, 6), text="empty or 6 finite numbers (min x, y, z, max x, y, z)"),
}
"""The arguments of ``dali_nerf__RaySampler``'s schema (``dali_nerf/ops/csrc/ray_sampler.cc``) and
the values each accepts: :func:`check_op_args` refuses anything else in Python, before DALI sees
it (DALI would overflow a too-large integer or fail with a multi-line C++ assert)."""


def check_op_args(args: dict) -> None:
    """Refuse, as one ConfigError naming the argument and its valid range, an op argument outside
    :data:`OP_ARGS` (and ``stream < num_streams``; ``shard_begin < global_pixels``; ``start + rays``
    within int64; ``up`` non-zero).

    >>> check_op_args({"rays": 2**31})
    Traceback (most recent call last):
    ConfigError: ray_sampler argument rays=2147483648: must be an integer in [1, 2147483647] (the op's int32)
    """
    for k, v in args.items():
        spec = OP_ARGS.get(k)
        if spec is None:
            raise ConfigError(f"ray_sampler argument {k}: unknown; the op takes {', '.join(OP_ARGS)}")
        if not spec.accepts(v):
            raise ConfigError(f"ray_sampler argument {k}={v!r}: must be {spec.text}")
    if "stream" in args and not args["stream"] < args.get("num_streams", 1):
        raise ConfigError(f"ray_sampler argument stream={args['stream']!r}: must be in [0, num_streams={args.get('num_streams', 1)})")
    if args.get("global_pixels", 0) and not args.get("shard_begin", 0) < args["global_pixels"]:
        raise ConfigError(f"ray_sampler argument shard_begin={args['shard_begin']!r}: must be in [0, global_pixels="
                          f"{args['global_pixels']})")
    if "up" in args and not any(args["up"]):
        raise ConfigError(f"ray_sampler argument up={args['up']!r}: must be {OP_ARGS['up'].text}")
    if args.get("start", 0) > INT64_MAX - args.get("rays", 1):
        raise ConfigError(f"ray_sampler argument start={args['start']!r}: the run's last position start + rays must "
                          f"fit in int64 (<= {INT64_MAX})")

RAY_OUTPUTS = ("origins", "directions", "rgb", "indices", "near", "far", "consumed")
"""Output names of :func:`ray_pipeline`, in order."""

GLOBAL_OUTPUTS = RAY_OUTPUTS + ("step_counts", "positions")
"""Output names of :func:`ray_pipeline` with ``global_pixels`` > 0, in order."""

GLOBAL_STREAM = "global-v2"
"""The version of the global stream's formula (the op with ``global_pixels``;
dali_nerf/ops/reference.py): loader states and checkpoints carry it, and a state of another
version is refused. Change it with the formula."""

SHARD_STREAM = "shard-v1"
"""The version of the per-cache streams (a DDP rank's own stream over its shard)."""


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


@dataclass(frozen=True)
class RayGraph:
    """What a ray graph is built with, but the cache: the op's arguments and DALI's settings. A
    :class:`~dali_nerf.data.plan.SamplingPlan` fills it (``plan.ray_graph(scene, ...)``); a
    variant is ``dataclasses.replace(graph, ...)`` (a streaming window's key and run size).

    >>> graph = RayGraph(rays=262144, mode="random", seed=0, stream=0, num_streams=1)
    >>> routed = RayGraph(4096, "random", 0, stream=2, num_streams=4, partition=part, cell=2)
    >>> ddp = RayGraph(16 * 8192, "epoch", 0, first_start=step * 8192, global_pixels=P, shard_begin=lo,
    ...                step_positions=8192)
    """

    rays: int
    """R, rays per run (one output sample; accepted rays when routed); with ``global_pixels``:
    global positions walked per run (K * ``step_positions``)."""
    mode: str = "random"
    """random | epoch."""
    seed: int = 0
    stream: int = 0
    """The stream's id (a DDP rank, or an SS cell; 0 with ``global_pixels``)."""
    num_streams: int = 1
    """The number of streams (the world size, or the number of cells; 1 with ``global_pixels``)."""
    first_start: int = 0
    """Stream position of run 0's first ray (a global position, a multiple of ``step_positions``,
    with ``global_pixels``)."""
    device: str = "cpu"
    """cpu | cuda (the op's GPU backend; ``cache.pixels`` must then be a CUDA tensor, fed as one
    (1, P, 3) batch, :func:`pixel_feed`; cameras/layout/centroids stay CPU inputs)."""
    num_threads: int = 2
    """DALI CPU threads."""
    prefetch: int = 2
    """Runs DALI computes ahead (0 = synchronous executor, whose output buffers are reused by the
    next run)."""
    device_id: Optional[int] = None
    """The CUDA device of a GPU graph (None on the CPU)."""
    partition: object = None
    """Route to ``cell`` of this :class:`~dali_nerf.partition.Partition` (None: no routing)."""
    cell: int = -1
    global_pixels: int = 0
    """P of the split's global stream (0: the cache's own stream); a masked cache's: the split's
    valid pixels."""
    shard_begin: int = 0
    """The split's pixel id of the cache's first pixel (global stream); a masked cache's: the
    split's valid pixels before it."""
    step_positions: int = 0
    """G, global positions per step (global stream; 0: ``rays``)."""

    def op_args(self) -> dict:
        """The op's arguments of this graph (checked by :func:`check_op_args`)."""
        args = dict(rays=self.rays, mode=self.mode, seed=self.seed, stream=self.stream, num_streams=self.num_streams,
                    start=self.first_start, continue_runs=True)
        if self.global_pixels:  # the op's defaults otherwise: nothing changes for the cache's own streams
            args.update(global_pixels=self.global_pixels, shard_begin=self.shard_begin,
                        step_positions=self.step_positions)
        if self.partition is not None:
            args.update(_routing_args(self.partition, self.cell))
        return args


def ray_pipeline(cache, graph: RayGraph):
    """Build the ray graph ``graph`` over an :class:`~dali_nerf.data.imagecache.ImageCache`.

    Args:
        cache: pixels (P, 3) u8, cameras (N, 18) f32, layout (N, 4) i64 (kept alive by the caller;
            fed with ``no_copy=True`` — they must not change while the pipeline exists).
        graph: the op's arguments and DALI's settings (:class:`RayGraph`).
    Returns:
        A built pipeline whose ``run()`` gives the 7 outputs of :data:`RAY_OUTPUTS` (the 9 of
        :data:`GLOBAL_OUTPUTS` with ``global_pixels``).
    """
    g = graph
    args = g.op_args()
    check_op_args(args)  # before DALI: one line naming the argument, not a C++ assert
    if g.partition is not None and not 0 < len(g.partition.centroids) <= MAX_CELLS:
        raise ConfigError(f"partition: {len(g.partition.centroids)} cells; the op routes among at most {MAX_CELLS}")
    stream_args = {k: int(args[k]) for k in ("stream", "num_streams", "global_pixels", "shard_begin", "step_positions")
                   if k in args}
    routing = {k: args[k] for k in ("cell", "margin", "up", "dims", "bounds") if k in args}
    fn, pipeline_def, types = ray_graph_api()
    gpu = g.device == "cuda"
    names = ["pixels", "cameras", "layout"]
    srcs = [pixel_feed(cache.pixels, gpu), [cache.cameras], [cache.layout]]
    if routing:
        names.append("centroids")
        srcs.append([np.ascontiguousarray(g.partition.centroids, np.float32)])
    masked = getattr(cache, "valid", None) is not None
    if masked:  # the streams draw the valid pixels only (always a CPU input of the op)
        names.append("valid")
        srcs.append([cache.valid])

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
        if masked:
            inputs.append(fn.external_source(device="cpu", dtype=types.UINT64, ndim=1, name="valid", **fed))
        # the GPU op takes cameras, layout and centroids as CPU inputs (its host-side checks and
        # tables read them there); only the pixels live on the device
        return tuple(fn.dali_nerf.ray_sampler(
            pixels, *inputs, rays=int(g.rays), mode=g.mode, seed=int(g.seed), start=int(g.first_start),
            continue_runs=True, device=dev, **stream_args, **routing,
        ))

    sync = g.prefetch <= 0
    pipe = _rays(batch_size=1, num_threads=g.num_threads, device_id=g.device_id,
                 prefetch_queue_depth=max(1, int(g.prefetch)), exec_async=not sync, exec_pipelined=not sync)
    pipe.build()
    for name, data in zip(names, srcs):
        pipe.feed_input(name, data)
    pipe._dali_nerf_sources = srcs  # kept alive while the pipeline exists; see release_pipeline
    return pipe


def abort_pipeline(pipe) -> None:
    """Shut a pipeline from :func:`ray_pipeline` down while another thread may be inside its
    ``run()``: that run raises there at once (the executor stops), where it could otherwise last
    minutes on starved cores. DALI's own exit handler shuts every live pipeline down the same way
    (``Pipeline._shutdown``, its only shutdown call); the pipeline cannot run again, and
    :func:`release_pipeline` still frees it."""
    pipe._shutdown()


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
