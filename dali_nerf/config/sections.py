"""The config sections a run reads: scene, cache, pipeline, model, train, partition."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List


from dali_nerf.errors import ConfigError, shown
from dali_nerf.config.checks import (MAX_THREADS, STREAMS, SOURCE_NAMES, choice, in_range, nonneg, path_value,
                                     positive)
from dali_nerf.data.hostbudget import PRIORITIES
from dali_nerf.interrupt import CHECKPOINT_SIGNALS
from dali_nerf.ops.limits import INT32_MAX, INT64_MAX, MAX_CELLS

__all__ = ["SceneConfig", "CacheConfig", "PipelineConfig", "ModelConfig", "TrainConfig", "PartitionConfig"]


@dataclass
class SceneConfig:
    path: str = "data/default"
    """Scene folder (any supported format)."""
    format: str = "auto"
    """auto | blender | nerfstudio | llff | mega_nerf | colmap (auto tries them in this order: a
    mip-NeRF 360 folder, with both poses_bounds.npy and sparse/0, is read as LLFF unless colmap is named)."""
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
    masks: str = "use"
    """use | ignore. use: where the scene has masks (nerfstudio ``mask_path``), masked pixels are
    never sampled, and evaluation reports the PSNR of the unmasked pixels too. ignore: the training
    split's masks are dropped (every pixel trains, as if it had none; for comparisons); the
    evaluation split keeps them for its unmasked-pixel PSNR."""

    exposure: bool = False
    """COLMAP scenes: read each image's exposure from the EXIF of its original (``images/``) file,
    as gsplat's ``--load_exposure`` (EV relative to the capture's mean): the image batches then
    carry ``exposure``. Off by default, as in gsplat."""
    normalize_world: bool = False
    """COLMAP scenes: poses and sparse points in gsplat's normalised world (its default
    ``normalize_world_space``: a similarity from the cameras, then the points' principal axes;
    :mod:`dali_nerf.scenes.worldnorm`), for every split; off: COLMAP's own world."""

    def validate(self, key: str):
        path_value(f"{key}.path", self.path)
        choice(f"{key}.format", self.format, ("auto", "blender", "nerfstudio", "llff", "mega_nerf", "colmap"))
        choice(f"{key}.masks", self.masks, ("use", "ignore"))
        for name in ("exposure", "normalize_world"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{key}.{name}: must be true or false, got {shown(getattr(self, name))}")
        positive(f"{key}.downscale", self.downscale)
        bg = self.background
        names = ("auto", "white", "black", "random", "learned")
        if isinstance(bg, str):
            choice(f"{key}.background", bg, names)
        elif (not isinstance(bg, (list, tuple)) or len(bg) != 3
              or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b <= 1.0 for b in bg)):
            raise ConfigError(f"{key}.background: must be one of {', '.join(names)} or 3 numbers in [0, 1], got {shown(bg)}")
        for k in ("train_split", "eval_split"):
            choice(f"{key}.{k}", getattr(self, k), ("train", "val", "test"))


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
        positive(f"{key}.max_bytes", self.max_bytes)
        positive(f"{key}.decode_batch", self.decode_batch)
        nonneg(f"{key}.window_images", self.window_images)
        nonneg(f"{key}.rays_per_window", self.rays_per_window)


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
        choice(f"{key}.name", self.name, SOURCE_NAMES)
        choice(f"{key}.mode", self.mode, ("random", "epoch"))
        choice(f"{key}.stream", self.stream, STREAMS)
        # the op's argument types bound what reaches it (pipelines/rays.py OP_ARGS)
        in_range(f"{key}.rays_per_batch", self.rays_per_batch, 1, INT32_MAX)
        in_range(f"{key}.global_batch", self.global_batch, 0, INT32_MAX)
        in_range(f"{key}.rays_per_run", self.rays_per_run, 0, INT32_MAX)
        if self.rays_per_run and math.ceil(self.rays_per_run / self.rays_per_batch) * self.rays_per_batch > INT32_MAX:
            raise ConfigError(f"{key}.rays_per_run: {self.rays_per_run} rounded up to a multiple of rays_per_batch="
                              f"{self.rays_per_batch} is over the op's limit of {INT32_MAX} rays per run; lower it")
        in_range(f"{key}.num_threads", self.num_threads, 0, MAX_THREADS)
        in_range(f"{key}.prefetch", self.prefetch, 0, MAX_THREADS)
        in_range(f"{key}.workers", self.workers, 0, MAX_THREADS)
        in_range(f"{key}.seed", self.seed, 0, INT64_MAX)
        choice(f"{key}.thread_priority", self.thread_priority, ("auto",) + PRIORITIES)


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
        choice(f"{key}.kind", self.kind, ("vm",))
        choice(f"{key}.space", self.space, ("auto", "world", "ndc", "contract"))
        if not self.contract_inner > 0:
            raise ConfigError(f"{key}.contract_inner: must be > 0, got {shown(self.contract_inner)}")
        for k in ("resolution", "density_components", "color_components", "hidden", "samples_per_ray",
                  "occupancy_every"):
            positive(f"{key}.{k}", getattr(self, k))
        if self.resolution < 2:
            raise ConfigError(f"{key}.resolution: must be >= 2, got {shown(self.resolution)}")
        for k in ("occupancy_resolution", "occupancy_warmup"):
            nonneg(f"{key}.{k}", getattr(self, k))
        if not self.sigma_init > 0:
            raise ConfigError(f"{key}.sigma_init: must be > 0, got {shown(self.sigma_init)}")
        if not 0.0 < self.occupancy_threshold < 1.0:
            raise ConfigError(f"{key}.occupancy_threshold: must be in (0, 1), got {shown(self.occupancy_threshold)}")


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
    checkpoint_signal: str = "TERM"
    """The signal on which a run finishes its step, checkpoints the last step every rank completed
    and exits with 128 + the signal (143 for TERM): TERM (what torchrun sends its workers, and
    SLURM before a preemption or the time limit, ``--signal=TERM@60``) | USR2 | HUP | XCPU (for
    clusters that warn with another) | none (the signal's default: the process dies). USR1 prints
    every thread's stack; Ctrl-C (INT) stops without a new checkpoint (docs/RELIABILITY.md)."""
    tensorboard: str = "auto"
    """TensorBoard event files in runs/<name>/tensorboard/ (rank 0): auto = when the tensorboard
    package is installed | always (an error without it) | never."""

    def validate(self, key: str):
        positive(f"{key}.steps", self.steps)
        if not self.lr > 0:
            raise ConfigError(f"{key}.lr: must be > 0, got {shown(self.lr)}")
        positive(f"{key}.log_every", self.log_every)
        for k in ("eval_every", "checkpoint_every", "eval_images", "torch_threads", "stop_after"):
            nonneg(f"{key}.{k}", getattr(self, k))
        choice(f"{key}.device", self.device, ("auto", "cpu", "cuda", "emulated"))
        if not self.emulated_step_ms > 0:
            raise ConfigError(f"{key}.emulated_step_ms: must be > 0 ms, got {shown(self.emulated_step_ms)}")
        nonneg(f"{key}.emulated_floor_steps", self.emulated_floor_steps)
        for k in ("eval_every_s", "max_seconds", "target_psnr"):
            if not getattr(self, k) >= 0:  # NaN too
                raise ConfigError(f"{key}.{k}: must be >= 0 (0 = off), got {shown(getattr(self, k))}")
        if self.target_psnr > 0 and not (self.eval_every or self.eval_every_s):
            raise ConfigError(f"{key}.target_psnr: needs periodic evaluations to stop at; set {key}.eval_every "
                              f"(steps) or {key}.eval_every_s (seconds)")
        choice(f"{key}.tensorboard", self.tensorboard, ("auto", "always", "never"))
        choice(f"{key}.checkpoint_signal", self.checkpoint_signal, CHECKPOINT_SIGNALS + ("none",))
        path_value(f"{key}.runs_dir", self.runs_dir)


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
        choice(f"{key}.kind", self.kind, ("grid", "kmeans"))
        if len(self.grid) != 2 or min(self.grid) < 1:
            raise ConfigError(f"{key}.grid: must be two integers >= 1, got {shown(self.grid)}")
        positive(f"{key}.cells", self.cells)
        if self.num_cells > MAX_CELLS:
            what = f"grid {shown(self.grid[0])}x{shown(self.grid[1])} = " if self.kind == "grid" else ""
            raise ConfigError(f"{key}.{'grid' if self.kind == 'grid' else 'cells'}: {what}{shown(self.num_cells)} cells; "
                              f"the op routes among at most {MAX_CELLS}")
        if not 1.0 <= self.margin < math.inf:
            raise ConfigError(f"{key}.margin: must be a finite number >= 1.0, got {shown(self.margin)}")
        choice(f"{key}.dims", self.dims, (2, 3))

    @property
    def num_cells(self) -> int:
        return self.grid[0] * self.grid[1] if self.kind == "grid" else self.cells
