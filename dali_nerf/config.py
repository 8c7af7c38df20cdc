"""Typed configuration: dataclasses loaded from YAML with ``yaml.safe_load``.

Each field has a docstring (the string literal under it). Runtime values (rank, world size,
device) are not stored here; they are passed to ``from_config(cfg, rank, world_size)`` at setup.

An unknown key, a wrong type, an out-of-range value or a missing path raises :class:`ConfigError`
with a one-line message naming the key and the file::

    configs/ddp_objects.yaml: pipeline.rays_per_batch: must be in [1, 2147483647], got -4

>>> cfg = load_config("configs/ddp_objects.yaml", ["train.steps=200", "pipeline.mode=epoch"])
>>> cfg.pipeline.rays_per_batch
4096
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

import yaml

from dali_nerf.errors import ConfigError
from dali_nerf.data.hostbudget import PRIORITIES
from dali_nerf.pipelines.rays import INT32_MAX, INT64_MAX, MAX_CELLS

__all__ = [
    "Config", "SceneConfig", "CacheConfig", "PipelineConfig", "ModelConfig", "TrainConfig",
    "PartitionConfig", "BenchConfig", "load_config", "config_to_dict", "apply_overrides", "SOURCE_NAMES",
    "STUDY_SAMPLERS", "STREAMS",
]


@dataclass
class SceneConfig:
    path: str = "data/default"
    """Scene folder (any supported format)."""
    format: str = "auto"
    """auto | blender | nerfstudio | llff | mega_nerf."""
    downscale: int = 1
    """Integer factor to decode images at (1 = full resolution)."""
    background: Any = "auto"
    """auto | white | black | random | learned | [r, g, b] in [0, 1]. A colour (white, black, the
    list): images with alpha are composited over it at decode and the renderer uses it. random /
    learned: images must have no alpha (decode refuses one), targets are the pixels as stored and
    the trainer draws / learns the colour per ray. auto: Blender white; other formats white when
    the first image has alpha, else learned (RGB captures: nothing to composite)."""
    train_split: str = "train"
    """Split the trainer samples rays from."""
    eval_split: str = "test"
    """Split evaluated (PSNR) and rendered at the end of training."""

    def validate(self, key: str):
        _choice(f"{key}.format", self.format, ("auto", "blender", "nerfstudio", "llff", "mega_nerf"))
        _positive(f"{key}.downscale", self.downscale)
        bg = self.background
        names = ("auto", "white", "black", "random", "learned")
        if isinstance(bg, str):
            _choice(f"{key}.background", bg, names)
        elif (not isinstance(bg, (list, tuple)) or len(bg) != 3
              or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b <= 1.0 for b in bg)):
            raise ConfigError(f"{key}.background: must be one of {', '.join(names)} or 3 numbers in [0, 1], got {bg!r}")
        for k in ("train_split", "eval_split"):
            _choice(f"{key}.{k}", getattr(self, k), ("train", "val", "test"))


@dataclass
class CacheConfig:
    max_bytes: int = 8 << 30
    """Decoded-image budget per rank. A split larger than this is streamed through a rolling,
    double-buffered window of decoded images instead of being cached whole."""
    decode_batch: int = 8
    """Images per decode-pipeline run."""
    window_images: int = 0
    """Streaming only: images per decoded window (0 = the most for which two windows fit in max_bytes)."""
    rays_per_window: int = 0
    """Streaming, random mode only: rays sampled from a window before switching to the next
    (0 = the window's pixel count; epoch mode always uses the pixel count)."""

    def validate(self, key: str):
        _positive(f"{key}.max_bytes", self.max_bytes)
        _positive(f"{key}.decode_batch", self.decode_batch)
        _nonneg(f"{key}.window_images", self.window_images)
        _nonneg(f"{key}.rays_per_window", self.rays_per_window)


SOURCE_NAMES = ("rays", "rays_sync", "sync_global", "sync_local", "torch_workers", "ready")
"""``pipeline.name`` values (:data:`dali_nerf.sources.registry.SOURCES`, which a test holds equal)."""
STUDY_SAMPLERS = ("sync_global", "sync_local", "torch_workers", "rays_sync", "rays")
"""``bench.samplers`` / ``bench.emulated_samplers`` values (the floor, ``ready``, is always added)."""


@dataclass
class PipelineConfig:
    name: str = "rays"
    """Batch source: rays (our DALI pipeline + operator, sampling ahead) | rays_sync (the same, run in
    the training thread at prefetch 0: the study's same-sampler control) | sync_global | sync_local |
    torch_workers | ready (one batch again and again: the benchmarks' floor, for timing only)."""
    rays_per_batch: int = 4096
    """Rays per rank per training step: B. With ``stream: global`` the mean: the global batch is
    G = B x world size (or global_batch), and each step's batch of a rank holds the rays of G whose
    image is in its shard (counts vary around B). A run resumed on W' ranks keeps its G (B = G / W')."""
    global_batch: int = 0
    """G whatever the number of ranks W (DDP's global stream, sync_global): B = G / W, W must divide
    G; for torchrun --nnodes=MIN:MAX (docs/MULTINODE.md). 0: G = rays_per_batch x W at the start."""
    mode: str = "random"
    """random (iid per step) | epoch (each pixel once per epoch across ranks)."""
    stream: str = "global"
    """rays source, DDP: global (one stream of global batches defined by the seed alone: the same
    for every world size, every pixel of the split once per epoch across all ranks, resumes on
    another number of ranks) | shard (each rank's own stream over its image shard; resumes on the
    same world size only). Ignored by the SS cells (their streams do not depend on the world size)
    and the baselines (sync_global: a global batch on rank 0; sync_local, torch_workers: per rank).
    A shard streamed through windows (over cache.max_bytes) needs shard."""
    seed: int = 0
    """Base seed; the stream is a function of (seed, step) (global) or (seed, rank, world size, step) (shard)."""
    prefetch: int = 2
    """Batches of rays sampled ahead of the consumer (0 = synchronous)."""
    rays_per_run: int = 0
    """Rays sampled per DALI pipeline run (amortises the fixed per-run cost); rounded up to a
    multiple of rays_per_batch. 0 = this host's budget: 65536 per sampler thread, at most 262144
    (dali_nerf/data/hostbudget.py)."""
    num_threads: int = 0
    """Sampler threads per rank (DALI CPU threads; decode threads). 0 = this host's budget: the
    usable cores per local rank (LOCAL_WORLD_SIZE) minus one, 1 to 4 (dali_nerf/data/hostbudget.py)."""
    workers: int = 2
    """Worker processes for the torch_workers baseline."""
    thread_priority: str = "auto"
    """Priority of the threads (and torch_workers processes) that sample ahead: normal | background
    (Linux SCHED_IDLE: only cores nothing else wants, so a waking training thread never waits for
    them) | auto = background when train.device is cuda or emulated, normal on the CPU (hostbudget.py)."""

    def validate(self, key: str):
        _choice(f"{key}.name", self.name, SOURCE_NAMES)
        _choice(f"{key}.mode", self.mode, ("random", "epoch"))
        _choice(f"{key}.stream", self.stream, STREAMS)
        # the op's argument types bound what reaches it (pipelines/rays.py OP_ARGS)
        _in_range(f"{key}.rays_per_batch", self.rays_per_batch, 1, INT32_MAX)
        _in_range(f"{key}.global_batch", self.global_batch, 0, INT32_MAX)
        _in_range(f"{key}.rays_per_run", self.rays_per_run, 0, INT32_MAX)
        if self.rays_per_run and math.ceil(self.rays_per_run / self.rays_per_batch) * self.rays_per_batch > INT32_MAX:
            raise ConfigError(f"{key}.rays_per_run: {self.rays_per_run} rounded up to a multiple of rays_per_batch="
                              f"{self.rays_per_batch} is over the op's limit of {INT32_MAX} rays per run; lower it")
        _in_range(f"{key}.num_threads", self.num_threads, 0, MAX_THREADS)
        _in_range(f"{key}.prefetch", self.prefetch, 0, MAX_THREADS)
        _in_range(f"{key}.workers", self.workers, 0, MAX_THREADS)
        _in_range(f"{key}.seed", self.seed, 0, INT64_MAX)
        _choice(f"{key}.thread_priority", self.thread_priority, ("auto",) + PRIORITIES)


@dataclass
class ModelConfig:
    kind: str = "vm"
    """Radiance field: vm (TensoRF vector-matrix factorised grid + tiny colour MLP, see docs/MODEL.md)."""
    resolution: int = 128
    """Plane and line resolution per axis of the factorised grid."""
    density_components: int = 4
    """Vector-matrix components of the density."""
    color_components: int = 8
    """Vector-matrix components of the appearance features."""
    hidden: int = 32
    """Width of the colour MLP."""
    view_dependent: bool = False
    """Feed the view direction to the colour MLP (off: Lambertian scenes)."""
    sigma_init: float = 0.01
    """Density of the untrained field (per world unit): a faint fog."""
    samples_per_ray: int = 96
    """Ray-marching samples per ray inside the aabb (before occupancy culling)."""
    occupancy_resolution: int = 64
    """Occupancy grid resolution for empty-space skipping (0 disables)."""
    occupancy_every: int = 16
    """Steps between occupancy-grid updates."""
    occupancy_warmup: int = 48
    """First step at which the occupancy grid is updated (all cells occupied before)."""
    occupancy_threshold: float = 0.01
    """A cell is occupied while its decayed max density gives alpha above this over one sample step."""
    space: str = "auto"
    """Where the field lives (dali_nerf/models/ray_space.py): world (the scene box from
    scenes/bounds.py::scene_bounds), ndc (forward-facing: rays in a reference camera's normalised
    device coordinates, sampled linearly in NDC depth), contract (unbounded: the scene box is kept,
    everything beyond squeezed into [-2, 2]^3, samples linear in disparity beyond it), or auto: a
    scene with its own aabb (Blender, generated objects/city) -> world, an LLFF scene -> ndc, any
    other scene without a box (nerfstudio/COLMAP captures) -> contract."""
    contract_inner: float = 1.0
    """space contract: the kept (uncontracted) region is the scene box scaled by this about its
    centre (for outward-looking captures the scene box holds only the cameras)."""

    def validate(self, key: str):
        _choice(f"{key}.kind", self.kind, ("vm",))
        _choice(f"{key}.space", self.space, ("auto", "world", "ndc", "contract"))
        if not self.contract_inner > 0:
            raise ConfigError(f"{key}.contract_inner: must be > 0, got {self.contract_inner}")
        for k in ("resolution", "density_components", "color_components", "hidden", "samples_per_ray",
                  "occupancy_every"):
            _positive(f"{key}.{k}", getattr(self, k))
        if self.resolution < 2:
            raise ConfigError(f"{key}.resolution: must be >= 2, got {self.resolution}")
        for k in ("occupancy_resolution", "occupancy_warmup"):
            _nonneg(f"{key}.{k}", getattr(self, k))
        if not self.sigma_init > 0:
            raise ConfigError(f"{key}.sigma_init: must be > 0, got {self.sigma_init}")
        if not 0.0 < self.occupancy_threshold < 1.0:
            raise ConfigError(f"{key}.occupancy_threshold: must be in (0, 1), got {self.occupancy_threshold}")


@dataclass
class TrainConfig:
    steps: int = 2000
    """Optimisation steps per rank."""
    lr: float = 2e-2
    """Adam learning rate of the grids (the MLP gets a tenth; see docs/MODEL.md)."""
    weight_decay: float = 0.0
    """Adam weight decay on the MLP."""
    log_every: int = 50
    """Steps between progress-bar / metrics summaries."""
    eval_every: int = 0
    """Steps between held-out PSNR evaluations, each a row {"step", "eval_psnr", "eval_ssim",
    "eval_render_s"} of metrics.jsonl (0 = only at the end, in summary.json)."""
    eval_every_s: float = 0.0
    """Seconds of training time between held-out evaluations (0 = none): the same metrics rows as
    ``eval_every``'s, plus ``train_s``, at the first step after each multiple of this; the PSNR vs
    seconds curve (summary.json ``eval_curve``). Training time is the loop's wall time minus the
    evaluations' own."""
    max_seconds: float = 0.0
    """Stop this run after the step at which its training time reaches this many seconds (0 = no
    limit), checkpointing and evaluating there as at its last step (summary.json ``stopped_by``:
    ``max_seconds``); continue later with --resume. The schedule still spans train.steps."""
    target_psnr: float = 0.0
    """Stop after the periodic evaluation (``eval_every`` or ``eval_every_s``) whose held-out PSNR
    reaches this many dB (0 = never; summary.json ``stopped_by``: ``target_psnr`` and
    ``target_reached_s``, the training seconds it took)."""
    checkpoint_every: int = 500
    """Steps between checkpoints (0 = only at the end)."""
    eval_images: int = 4
    """Held-out images evaluated and rendered (0 = all)."""
    runs_dir: str = "runs"
    """Folder that holds runs/<name>/."""
    device: str = "auto"
    """auto (cuda when available) | cpu | cuda | emulated (no model: each rank's device work is a
    timed wait, host work real; measures whether this host feeds the GPUs, see
    dali_nerf/train/emulated.py)."""
    emulated_step_ms: float = 2.0
    """train.device=emulated: device milliseconds of forward + backward + optimizer per 4096 rays
    (linear in the step's rays)."""
    emulated_floor_steps: int = 100
    """train.device=emulated: steps timed with a ready batch after the source's (the emulation floor; 0 = none)."""
    torch_threads: int = 0
    """Intra-op threads per rank for torch (0 = cores / ranks)."""
    stop_after: int = 0
    """Stop this run after this step (0 = run to train.steps), checkpointing there; continue later
    with --resume (e.g. to fit a cluster job's time limit). The schedule still spans train.steps."""
    tensorboard: str = "auto"
    """TensorBoard event files in runs/<name>/tensorboard/ (rank 0): auto = when the tensorboard
    package is installed | always (an error without it) | never."""

    def validate(self, key: str):
        _positive(f"{key}.steps", self.steps)
        if not self.lr > 0:
            raise ConfigError(f"{key}.lr: must be > 0, got {self.lr}")
        _positive(f"{key}.log_every", self.log_every)
        for k in ("eval_every", "checkpoint_every", "eval_images", "torch_threads", "stop_after"):
            _nonneg(f"{key}.{k}", getattr(self, k))
        _choice(f"{key}.device", self.device, ("auto", "cpu", "cuda", "emulated"))
        if not self.emulated_step_ms > 0:
            raise ConfigError(f"{key}.emulated_step_ms: must be > 0 ms, got {self.emulated_step_ms}")
        _nonneg(f"{key}.emulated_floor_steps", self.emulated_floor_steps)
        for k in ("eval_every_s", "max_seconds", "target_psnr"):
            if not getattr(self, k) >= 0:  # NaN too
                raise ConfigError(f"{key}.{k}: must be >= 0 (0 = off), got {getattr(self, k)}")
        if self.target_psnr > 0 and not (self.eval_every or self.eval_every_s):
            raise ConfigError(f"{key}.target_psnr: needs periodic evaluations to stop at; set {key}.eval_every "
                              f"(steps) or {key}.eval_every_s (seconds)")
        _choice(f"{key}.tensorboard", self.tensorboard, ("auto", "always", "never"))


@dataclass
class PartitionConfig:
    kind: str = "grid"
    """grid (2-D grid over camera positions, Mega-NeRF's default) | kmeans."""
    grid: List[int] = field(default_factory=lambda: [2, 2])
    """Cells along the two horizontal axes (grid kind)."""
    cells: int = 4
    """Number of cells (kmeans kind)."""
    margin: float = 1.15
    """Boundary margin m: a point is in cell j if dist(p, c_j) <= m * min_k dist(p, c_k)."""
    dims: int = 2
    """2 (ignore altitude along the scene's up axis) or 3 (full 3-D distances)."""

    def validate(self, key: str):
        _choice(f"{key}.kind", self.kind, ("grid", "kmeans"))
        if len(self.grid) != 2 or min(self.grid) < 1:
            raise ConfigError(f"{key}.grid: must be two integers >= 1, got {self.grid}")
        _positive(f"{key}.cells", self.cells)
        if self.num_cells > MAX_CELLS:
            what = f"grid {self.grid[0]}x{self.grid[1]} = " if self.kind == "grid" else ""
            raise ConfigError(f"{key}.{'grid' if self.kind == 'grid' else 'cells'}: {what}{self.num_cells} cells; "
                              f"the op routes among at most {MAX_CELLS}")
        if not 1.0 <= self.margin < math.inf:
            raise ConfigError(f"{key}.margin: must be a finite number >= 1.0, got {self.margin}")
        _choice(f"{key}.dims", self.dims, (2, 3))

    @property
    def num_cells(self) -> int:
        return self.grid[0] * self.grid[1] if self.kind == "grid" else self.cells


@dataclass
class BenchConfig:
    steps: int = 60
    """Timed steps per configuration of the study."""
    warmup: int = 10
    """Untimed steps before timing."""
    ranks: List[int] = field(default_factory=lambda: [1, 2])
    """World sizes of the study's CPU rows (trainer processes with CPU compute; [] = none)."""
    methods: List[str] = field(default_factory=lambda: ["ddp", "ss"])
    """Training methods of the study grid."""
    samplers: List[str] = field(default_factory=lambda: ["sync_global", "sync_local", "rays_sync", "rays"])
    """Batch sources of the study grid (rays_sync: the same-sampler control; the floor is always added)."""
    out: str = "docs/study"
    """Report folder (a per-machine subfolder is created)."""
    scene_kind: str = "objects"
    """Scene generated at scene.path when it is missing (dali-nerf make-scene kind)."""
    scene_images: int = 100
    """Training images of the generated scene."""
    scene_resolution: int = 200
    """Width = height in pixels of the generated scene."""
    sampling_sizes: List[int] = field(default_factory=lambda: [1024, 4096, 16384])
    """Batch sizes at which sampling is timed on its own for the cost model ([] skips it)."""
    allreduce_latency_s: float = 1e-4
    """All-reduce latency assumed by the cost model when only one multi-rank world size is measured."""
    gpu_step_ms: float = 0.0
    """Projection: GPU compute ms per step at pipeline.rays_per_batch (0 = measured CPU / gpu_cpu_ratio)."""
    gpu_cpu_ratio: float = 50.0
    """Projection: GPU compute speed over one CPU core (used when gpu_step_ms is 0)."""
    cores_per_gpu: float = 8.0
    """Projection: host CPU cores per GPU available for sampling."""
    regime: str = ""
    """Free text for the report: why these knobs (image count, resolution, rays, model size)."""
    sampler_seconds: float = 1.0
    """Seconds per measurement of the `bench sampler` table in the report (0 skips the table)."""
    trials: int = 3
    """Trials per configuration, in an order rotated between trials (speedups per trial from adjacent pairs)."""
    emulated_ranks: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    """DDP world sizes of the emulated-device launches ([] skips them)."""
    emulated_ranks_ss: List[int] = field(default_factory=lambda: [1, 2])
    """SS world sizes of the emulated-device launches (one cell per rank; [] skips them)."""
    emulated_samplers: List[str] = field(default_factory=lambda: list(STUDY_SAMPLERS))
    """Batch sources of the emulated launches (the floor, a ready batch, is always added)."""
    emulated_cores: List[int] = field(default_factory=lambda: [0])
    """Cores each emulated launch runs on: its ranks pinned (CPU affinity, which the host budget reads)
    to the first N usable cores; 0 = all. A pinned launch runs only world sizes <= N (>= 1 core per
    GPU): the full host's launches already cover the starved host below that."""
    emulated_step_ms: List[float] = field(default_factory=lambda: [1.0, 2.0, 5.0, 10.0])
    """Emulated device compute ms (forward + backward + optimizer) per 4096-ray step."""
    emulated_steps: int = 30
    """Timed steps per emulated segment."""
    emulated_warmup: int = 5
    """Untimed steps per emulated segment, after draining what the source prefetched meanwhile."""
    emulated_grad_bytes: int = 0
    """Bytes all-reduced per emulated DDP step (0 = the study model's gradients)."""
    check_rays: List[int] = field(default_factory=lambda: [2048, 16384])
    """Other batch sizes run once in the emulated DDP launches of check_ranks, at check_step_ms (cost-model check)."""
    check_step_ms: float = 2.0
    """Emulated device step ms of the check_rays segments."""
    check_ranks: List[int] = field(default_factory=lambda: [4])
    """DDP world sizes whose emulated launch also runs the check_rays segments."""
    fit_ranks: List[int] = field(default_factory=lambda: [1, 2])
    """The cost model is fit on emulated DDP runs at these world sizes and pipeline.rays_per_batch only."""
    device_step_file: str = ""
    """loop.json of ``dali-nerf bench loop`` (run on a GPU): its measured device step at
    pipeline.rays_per_batch replaces bench.emulated_step_ms and bench.check_step_ms (and its
    model's gradient bytes bench.emulated_grad_bytes when that is 0); the report states where the
    step was measured ("" = the emulated_step_ms as given, a stated assumption)."""

    def validate(self, key: str):
        _positive(f"{key}.steps", self.steps)
        _nonneg(f"{key}.warmup", self.warmup)
        _choice(f"{key}.scene_kind", self.scene_kind, ("objects", "city"))
        _positive(f"{key}.scene_images", self.scene_images)
        _positive(f"{key}.scene_resolution", self.scene_resolution)
        for i, b in enumerate(self.sampling_sizes):
            _positive(f"{key}.sampling_sizes[{i}]", b)
        _nonneg(f"{key}.allreduce_latency_s", self.allreduce_latency_s)
        _nonneg(f"{key}.gpu_step_ms", self.gpu_step_ms)
        _positive(f"{key}.gpu_cpu_ratio", self.gpu_cpu_ratio)
        _positive(f"{key}.cores_per_gpu", self.cores_per_gpu)
        _nonneg(f"{key}.sampler_seconds", self.sampler_seconds)
        if self.ranks and min(self.ranks) < 1:
            raise ConfigError(f"{key}.ranks: must be a list of integers >= 1 ([] = no CPU rows), got {self.ranks}")
        for m in self.methods:
            _choice(f"{key}.methods", m, ("ddp", "ss"))
        for name in ("samplers", "emulated_samplers"):
            for s in getattr(self, name):
                _choice(f"{key}.{name}", s, STUDY_SAMPLERS)
        for i, c in enumerate(self.emulated_cores):
            _nonneg(f"{key}.emulated_cores[{i}]", c)
        _positive(f"{key}.trials", self.trials)
        _positive(f"{key}.emulated_steps", self.emulated_steps)
        _nonneg(f"{key}.emulated_warmup", self.emulated_warmup)
        _nonneg(f"{key}.emulated_grad_bytes", self.emulated_grad_bytes)
        for name in ("emulated_ranks", "emulated_ranks_ss", "check_rays", "check_ranks", "fit_ranks"):
            for i, v in enumerate(getattr(self, name)):
                _positive(f"{key}.{name}[{i}]", v)
        for i, v in enumerate(self.emulated_step_ms):
            if not v > 0:
                raise ConfigError(f"{key}.emulated_step_ms[{i}]: must be > 0 ms, got {v}")
        if not self.check_step_ms > 0:
            raise ConfigError(f"{key}.check_step_ms: must be > 0 ms, got {self.check_step_ms}")


@dataclass
class Config:
    name: str = "default"
    """Run name: outputs go to <train.runs_dir>/<name>/."""
    method: str = "ddp"
    """ddp (data parallel) | ss (spatial segmentation)."""
    scene: SceneConfig = field(default_factory=SceneConfig)
    """Where the scene is and how to read it."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """Decoded image cache."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Ray batch source."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Radiance field."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, logging, checkpoints."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """Spatial segmentation cells (method: ss)."""
    bench: BenchConfig = field(default_factory=BenchConfig)
    """The characterization study (dali-nerf bench study)."""

    def validate(self, key: str = ""):
        _choice("method", self.method, ("ddp", "ss"))
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"name: must be a plain folder name, got {self.name!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v.validate(f.name)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.runs_dir) / self.name


# ---------------------------------------------------------------------------------------------
# generic typed loading


STREAMS = ("global", "shard")
"""Valid ``pipeline.stream`` values."""

MAX_THREADS = 1024
"""Largest pipeline.num_threads / prefetch / workers accepted (threads, queued runs, processes)."""


def _in_range(key, v, lo, hi):
    if not lo <= v <= hi:
        raise ConfigError(f"{key}: must be in [{lo}, {hi}], got {v}")


def _positive(key, v):
    if not v > 0:  # NaN too
        raise ConfigError(f"{key}: must be > 0, got {v}")


def _nonneg(key, v):
    if v < 0:
        raise ConfigError(f"{key}: must be >= 0, got {v}")


def _choice(key, v, choices):
    if v not in choices:
        raise ConfigError(f"{key}: must be one of {', '.join(map(str, choices))}, got {v!r}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    if origin in (list, List, Sequence):
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {_type_name(tp)} fields, got {type(value).__name__}")
        return _build(tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        try:
            return float(value)
        except OverflowError:  # an int beyond the float range
            raise ConfigError(f"{key}: {len(str(abs(value)))}-digit integer is beyond the range of a number "
                              f"(about 1.8e308); give a smaller value") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else str(k)
            raise ConfigError(f"{where}: unknown key; valid keys here: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(f"{prefix}.{f.name}" if prefix else f.name, data[f.name], hints[f.name])
    return cls(**kwargs)


def config_to_dict(cfg) -> dict:
    """Plain dict of a config (for YAML dumps and run folders)."""
    return dataclasses.asdict(cfg)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b=value`` strings (value parsed as YAML) to a nested dict, in place."""
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key=value, e.g. train.steps=100")
        key, raw = ov.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except (yaml.YAMLError, ValueError):  # ValueError: an integer of more than 4300 digits
            value = raw
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ConfigError(f"override {key}: {p} is not a section")
            node = node[p]
        node[parts[-1]] = value
    return data


def load_config(path=None, overrides: Sequence[str] = (), check_paths: bool = True) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate.

    Args:
        path: YAML file, or None for the built-in defaults.
        overrides: ``key=value`` strings, e.g. ``["train.steps=100"]``.
        check_paths: also require ``scene.path`` to exist.
    Raises:
        ConfigError: one line naming the file and key.
    """
    where = str(path) if path is not None else "<defaults>"
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{where}: config file not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{where}: not valid YAML{at}; fix the syntax") from None
        except ValueError as e:  # the YAML is well formed but a value cannot be built (Python's int digit limit)
            raise ConfigError(f"{where}: a value cannot be read ({str(e).split(';')[0]}); fix it") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: top level must be a mapping of sections, got {type(data).__name__}")
    try:
        apply_overrides(data, overrides)
        cfg = _build(Config, data)
        cfg.validate()
        if check_paths and not Path(cfg.scene.path).exists():
            raise ConfigError(f"scene.path: {cfg.scene.path} does not exist; create it with `dali-nerf make-scene` or fix the path")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return cfg
