"""The study's grid of device steps and batch sizes: every emulated segment's device step is named
by what it stands for (``bench.device_steps``: measured on a GPU, stated by a public source, or
assumed), with its milliseconds at each batch of the sweep (``bench.rays``); a step measured by
``dali-nerf bench loop`` on this host's GPU (``bench.device_step_file``) comes first. The headline's
step is fixed by rule, before anything runs: the first measured one (:func:`headline_step`).

>>> steps = device_steps(cfg)                       # [Step("measured", "measured", ..., {4096: 9.289, ...}), ...]
>>> headline_step(steps).name
'measured'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from dali_nerf.errors import ConfigError

__all__ = ["Step", "grid_rays", "device_steps", "headline_step", "check_steps", "steps_from_meta", "left_out"]


@dataclass(frozen=True)
class Step:
    """One named device step: its milliseconds per step at each batch it runs at."""

    name: str
    kind: str
    """measured | stated | assumed."""
    source: str
    ms: Dict[int, float] = field(default_factory=dict)
    """{rays per GPU: device ms per step}; a batch it has no value for is not run with it."""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "source": self.source,
                "ms": {str(b): v for b, v in sorted(self.ms.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> "Step":
        return cls(d["name"], d["kind"], d["source"], {int(b): float(v) for b, v in d["ms"].items()})


def grid_rays(cfg) -> List[int]:
    """The batch sizes of the emulated main grid: ``bench.rays``, else ``pipeline.rays_per_batch`` alone."""
    return [int(b) for b in cfg.bench.rays] or [int(cfg.pipeline.rays_per_batch)]


def _loop_step(path: str, rays: List[int]) -> Step:
    """The device step ``dali-nerf bench loop`` measured (its loop.json) at those of ``rays`` it has."""
    from dali_nerf.bench.loop import read_device_step

    ms, found = {}, None
    for b in rays:
        try:
            d = read_device_step(path, b)
        except ConfigError as e:
            if "has no device step at" not in str(e):
                raise
            continue
        ms[b], found = d["compute_ms"], d
    if found is None:
        raise ConfigError(f"bench.device_step_file: {path} has a device step at none of bench.rays {rays}; run "
                          f"dali-nerf bench loop --batches {','.join(map(str, rays))} first")
    timing = "CUDA events" if found.get("phase_timing") == "cuda_events" else "host timing: a CPU, not a GPU"
    src = (f"measured by dali-nerf bench loop on {found.get('device_name')} ({timing}): the ready-batch floor's "
           f"forward + backward + optimizer of the model {found.get('model_desc')}, "
           + ", ".join(f"{ms[b]:.3f} ms at {b} rays" for b in sorted(ms)) + f" ({path})")
    return Step("loop", "measured", src, ms)


def device_steps(cfg) -> List[Step]:
    """Every device step of the main grid, in order: the loop's (``bench.device_step_file``), the named
    ``bench.device_steps``, then each ``bench.emulated_step_ms`` value as an assumed step linear in
    the rays (``N ms/4096``); only those of ``bench.only_steps`` when it names any. Raises ConfigError
    when there is none."""
    b, rays = cfg.bench, grid_rays(cfg)
    out = [_loop_step(b.device_step_file, rays)] if b.device_step_file else []
    for d in b.device_steps:
        out.append(Step(d.name, d.kind, d.source, {r: float(v) for r, v in zip(rays, d.ms) if v > 0}))
    for v in b.emulated_step_ms:
        out.append(Step(f"{v:g} ms/4096", "assumed", f"assumed: {v:g} ms per 4096 rays, linear in the step's rays",
                        {r: v * r / 4096 for r in rays}))
    if b.only_steps:
        out = [s for s in out if s.name in b.only_steps]
    if not out:
        raise ConfigError("bench.device_steps: no device step for the emulated launches (give bench.device_steps, "
                          "bench.emulated_step_ms or bench.device_step_file, or set bench.emulated_ranks=[] and "
                          "bench.emulated_ranks_ss=[])")
    return out


def check_steps(cfg) -> List[tuple]:
    """The cost model's check segments (DDP at ``bench.check_ranks``, once): [(name, ms, rays)] at each
    of ``bench.check_rays``, ``bench.check_step_ms`` per 4096 rays taken as linear in the rays."""
    v = cfg.bench.check_step_ms
    return [(f"check {v:g} ms/4096", v * b / 4096, int(b)) for b in cfg.bench.check_rays]


def headline_step(steps: List[Step]) -> Optional[Step]:
    """The headline's device step, by rule: the first measured step, else the first step."""
    return next((s for s in steps if s.kind == "measured"), steps[0] if steps else None)


def steps_from_meta(meta: dict) -> List[Step]:
    """The steps a derived.json's meta recorded (``meta["device_steps"]``)."""
    return [Step.from_dict(d) for d in meta.get("device_steps") or []]


def left_out(cfg, launches: List[dict], cores: int) -> List[str]:
    """What the study's grid leaves out, in words (the report's header): what it finds itself from the
    config and its ``launches`` (:func:`~dali_nerf.bench.study.runs.emulated_launches`) on a host of
    ``cores`` usable cores, then ``bench.leaves_out``."""
    b, out = cfg.bench, []
    if not (b.ranks and b.samplers):
        out.append("the CPU-compute rows (trainer processes training the model on this CPU: bench.ranks is empty)")
    main = [la for la in launches if la["grid"] == "main"]
    if main:
        if not any(la["ranks"] > (la["cores"] or cores) for la in main):
            out.append(f"the starved host (more emulated GPUs than cores: no launch above {cores} GPUs on "
                       f"{cores} cores)")
        if cores > 1 and not any(la["cores"] for la in main):
            out.append(f"launches pinned to fewer cores than the host's {cores} (bench.emulated_cores: e.g. 1 GPU at "
                       f"1 core per GPU); every launch ran on every usable core")
        out.append(f"more than {max(la['ranks'] for la in main)} emulated GPUs")
        if not any(la["method"] == "ss" for la in main):
            out.append("spatial segmentation (SS)")
        elif b.rays_ss and set(b.rays_ss) != set(grid_rays(cfg)):
            out.append(f"SS at rays per GPU other than {', '.join(map(str, b.rays_ss))} (bench.rays_ss)")
        out.append(f"rays per GPU other than {', '.join(map(str, grid_rays(cfg)))}, and device steps other than "
                   f"the ones named above")
    if b.leaves_out:
        out.append(b.leaves_out.strip())
    return out
