"""The ``bench`` section: the characterization study's grid (dali-nerf bench study)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


from dali_nerf.errors import ConfigError, shown
from dali_nerf.config.checks import STUDY_SAMPLERS, choice, nonneg, path_value, positive

__all__ = ["BenchConfig"]


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
        positive(f"{key}.steps", self.steps)
        path_value(f"{key}.out", self.out)
        path_value(f"{key}.device_step_file", self.device_step_file)
        nonneg(f"{key}.warmup", self.warmup)
        choice(f"{key}.scene_kind", self.scene_kind, ("objects", "city"))
        positive(f"{key}.scene_images", self.scene_images)
        positive(f"{key}.scene_resolution", self.scene_resolution)
        for i, b in enumerate(self.sampling_sizes):
            positive(f"{key}.sampling_sizes[{i}]", b)
        nonneg(f"{key}.allreduce_latency_s", self.allreduce_latency_s)
        nonneg(f"{key}.gpu_step_ms", self.gpu_step_ms)
        positive(f"{key}.gpu_cpu_ratio", self.gpu_cpu_ratio)
        positive(f"{key}.cores_per_gpu", self.cores_per_gpu)
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
        for name in ("emulated_ranks", "emulated_ranks_ss", "check_rays", "check_ranks", "fit_ranks"):
            for i, v in enumerate(getattr(self, name)):
                positive(f"{key}.{name}[{i}]", v)
        for i, v in enumerate(self.emulated_step_ms):
            if not v > 0:
                raise ConfigError(f"{key}.emulated_step_ms[{i}]: must be > 0 ms, got {shown(v)}")
        if not self.check_step_ms > 0:
            raise ConfigError(f"{key}.check_step_ms: must be > 0 ms, got {shown(self.check_step_ms)}")
