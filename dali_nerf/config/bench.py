"""The ``bench`` section: the characterization study's grid (dali-nerf bench study)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


from dali_nerf.errors import ConfigError, shown
from dali_nerf.config.checks import STUDY_SAMPLERS, choice, nonneg, path_value, positive

__all__ = ["BenchConfig", "DeviceStep", "STEP_KINDS"]

STEP_KINDS = ("measured", "stated", "assumed")
"""``bench.device_steps[].kind`` values: a step measured on a GPU, one stated by a public source, or an
assumption (named as such everywhere it appears)."""


@dataclass
class DeviceStep:
    """One device step of the emulated launches, named by what it stands for."""

    name: str = ""
    """Short name in the report's tables and plots (e.g. measured, stated)."""
    kind: str = "stated"
    """measured (measured on a GPU) | stated (a public source's number) | assumed."""
    ms: List[float] = field(default_factory=list)
    """Device milliseconds per step at each of bench.rays, in that order (0: no step at that batch: not run)."""
    source: str = ""
    """What the step stands for and where its numbers come from (the report quotes it)."""


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
    rays: List[int] = field(default_factory=list)
    """Rays per GPU and step of the emulated launches, swept ([] = pipeline.rays_per_batch alone)."""
    rays_ss: List[int] = field(default_factory=list)
    """The SS launches run only those of bench.rays that are in this list ([] = every one of bench.rays)."""
    device_steps: List[DeviceStep] = field(default_factory=list)
    """Named device steps of the emulated launches, each with its ms at every bench.rays (see DeviceStep)."""
    only_steps: List[str] = field(default_factory=list)
    """Names of the device steps to run ([] = every one): a host with less time runs part of the grid."""
    emulated_step_ms: List[float] = field(default_factory=list)
    """Further device steps, assumed: ms per 4096 rays, taken as linear in the step's rays (each named "N ms/4096")."""
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
    small_scene: str = ""
    """The cache-effect row: a small scene (generated when missing: scene_kind, scene_images at
    small_resolution) run at the headline's regime and step, beside the same row of the main scene ("" = none)."""
    small_resolution: int = 200
    """Width = height in pixels of the generated small scene."""
    small_ranks: int = 2
    """Emulated DDP GPUs (on every usable core) of the cache-effect row."""
    small_rays: List[int] = field(default_factory=list)
    """Rays per GPU of the cache-effect row ([] = the first of bench.rays)."""
    leaves_out: str = ""
    """Free text for the report's list of what the grid leaves out (beside what it finds itself)."""
    device_step_file: str = ""
    """loop.json of ``dali-nerf bench loop`` (run on a GPU): its measured device steps become the first
    named device step ("loop", measured) at the bench.rays it measured (the others: not run), and its
    model's gradient bytes bench.emulated_grad_bytes when that is 0 ("" = none)."""

    def validate(self, key: str):
        positive(f"{key}.steps", self.steps)
        path_value(f"{key}.out", self.out)
        path_value(f"{key}.device_step_file", self.device_step_file)
        path_value(f"{key}.small_scene", self.small_scene)
        nonneg(f"{key}.warmup", self.warmup)
        choice(f"{key}.scene_kind", self.scene_kind, ("objects", "city"))
        positive(f"{key}.scene_images", self.scene_images)
        positive(f"{key}.scene_resolution", self.scene_resolution)
        for i, b in enumerate(self.sampling_sizes):
            positive(f"{key}.sampling_sizes[{i}]", b)
        nonneg(f"{key}.allreduce_latency_s", self.allreduce_latency_s)
        nonneg(f"{key}.sampler_seconds", self.sampler_seconds)
        if self.ranks and min(self.ranks) < 1:
            raise ConfigError(f"{key}.ranks: must be a list of integers >= 1 ([] = no CPU rows), got {shown(self.ranks)}")
        for m in self.methods:
            choice(f"{key}.methods", m, ("ddp", "ss"))
        for name in ("samplers", "emulated_samplers"):
            for s in getattr(self, name):
                choice(f"{key}.{name}", s, STUDY_SAMPLERS)
        for i, c in enumerate(self.emulated_cores):
            nonneg(f"{key}.emulated_cores[{i}]", c)
        positive(f"{key}.trials", self.trials)
        positive(f"{key}.emulated_steps", self.emulated_steps)
        nonneg(f"{key}.emulated_warmup", self.emulated_warmup)
        nonneg(f"{key}.emulated_grad_bytes", self.emulated_grad_bytes)
        for name in ("emulated_ranks", "emulated_ranks_ss", "check_rays", "check_ranks", "fit_ranks", "rays",
                     "small_rays", "rays_ss"):
            for i, v in enumerate(getattr(self, name)):
                positive(f"{key}.{name}[{i}]", v)
        for i, v in enumerate(self.emulated_step_ms):
            if not v > 0:
                raise ConfigError(f"{key}.emulated_step_ms[{i}]: must be > 0 ms, got {shown(v)}")
        if not self.check_step_ms > 0:
            raise ConfigError(f"{key}.check_step_ms: must be > 0 ms, got {shown(self.check_step_ms)}")
        positive(f"{key}.small_resolution", self.small_resolution)
        positive(f"{key}.small_ranks", self.small_ranks)
        self._validate_steps(key)

    def _validate_steps(self, key: str):
        """Named device steps: unique names, a kind of :data:`STEP_KINDS`, one ms >= 0 per bench.rays
        (at least one > 0)."""
        names = set()
        for i, d in enumerate(self.device_steps):
            k = f"{key}.device_steps[{i}]"
            if not d.name.strip() or d.name in names:
                raise ConfigError(f"{k}.name: give each device step its own non-empty name, got {shown(d.name)}")
            names.add(d.name)
            choice(f"{k}.kind", d.kind, STEP_KINDS)
            n = len(self.rays) or 1
            if len(d.ms) != n:
                raise ConfigError(f"{k}.ms: one value per bench.rays ({n}: {self.rays or 'pipeline.rays_per_batch'}), "
                                  f"got {len(d.ms)}: {shown(d.ms)}")
            for j, v in enumerate(d.ms):
                nonneg(f"{k}.ms[{j}]", v)
            if not any(v > 0 for v in d.ms):
                raise ConfigError(f"{k}.ms: every value is 0 (no batch would run); give the step's ms at one at least")
        for i, n in enumerate(self.only_steps):
            if n not in names and n != "loop":
                raise ConfigError(f"{key}.only_steps[{i}]: {shown(n)} names no device step; the named ones: "
                                  f"{', '.join(sorted(names)) or 'none'} (and loop, with bench.device_step_file)")
