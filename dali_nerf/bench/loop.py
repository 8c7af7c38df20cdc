"""``dali-nerf bench loop``: the training loop's step, wait and stall per batch source, on this
machine's training device, against the same step with a ready batch (the floor).

    dali-nerf bench loop --config configs/ddp_blender_gpu.yaml --scene data/lego \\
        --batches 16384,65536 --trials 3 --out out/loop [key=value ...]

One process, world size 1. The config's model is built by the DDP trainer's own method
(``trainers/ddp.py``) and trained by the trainer's own step (:func:`dali_nerf.train.loop.train_task_step`,
phases by :class:`~dali_nerf.train.phases.PhaseTimer`: CUDA events on torch's stream on a GPU, host
time on the CPU; ``wait`` is host time in ``next()``). It is first trained ``--pretrain`` steps
(so the occupancy grid has culled empty space, as in a real run), then its state (field,
optimiser, occupancy grid, schedule) is kept and restored before every segment: every source
times the same steps of the same model.

A *segment* is one source at one batch size: a fresh source, ``--warmup`` untimed steps, then
``--steps`` timed steps (for the synchronous ``rays`` control a whole number of its DALI runs,
whose cost falls on every K-th step). Per batch size and trial the sources run in an order rotated
by the trial (:func:`dali_nerf.bench.emulated.pair_order`: every baseline next to a pipelined
run, the floor between two groups), for each placement:

* ``host``: images decoded once into host memory, sampled on the CPU; the loop copies each
  batch to the device (the ``h2d`` phase): ``rays`` (RayLoader, pipelined), ``rays_sync``
  (the same sampler run synchronously: the registry's same-sampler control, ``prefetch=0``), ``sync_local``, ``sync_global`` (one rank:
  rank 0's global batch is its own), ``torch_workers`` (as the trainer builds it: on a GPU its
  batches are pinned and copied in ``next()``), ``ready`` (the floor: one host batch again);
* ``device`` (a GPU only): images decoded into device memory (nvJPEG): ``rays`` and
  ``rays_sync`` are the CUDA operator, ``sync_local`` / ``sync_global`` the torch sampler on
  the device-resident images, ``ready`` one batch already in device memory (no copy).

Outputs (``--out``), rewritten after every segment so that a run cut short keeps what it measured:

* ``loop.json``: ``meta`` (device, host, model, config, commit), ``segments`` (one per segment:
  placement, rays, sampler, trial, order, steps, mean step/wait seconds, stall = wait / step,
  phases, torch's peak GPU memory and the device's used memory), ``rows`` (per placement, batch
  size and sampler: mean and 95% interval over trials of step and stall, step / the same trial's
  floor, the pipelined speedup over it (its step / the trial's ``rays`` step), peak memory) and
  ``device_steps`` (per batch size: the host floor's forward + backward + optimizer, the device
  step the emulated study takes with ``bench.device_step_file``; :func:`read_device_step`);
* ``loop.md``: the rows as a table.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np
import torch

from dali_nerf.atomic import atomic_write_text
from dali_nerf.config import Config, config_to_dict, load_config
from dali_nerf.errors import ConfigError
from dali_nerf.data.plan import plan_from_config, sampling_device

__all__ = ["main", "run_loop", "read_device_step", "SAMPLERS", "LABELS", "aggregate"]

SAMPLERS = ("rays", "rays_sync", "sync_local", "sync_global", "torch_workers", "ready")
"""Sources of the benchmark (``ready`` is the floor)."""
LABELS = {
    "rays": "rays (pipelined)",
    "rays_sync": "rays_sync (same sampler, synchronous)",
    "sync_local": "sync_local",
    "sync_global": "sync_global (1 rank)",
    "torch_workers": "torch_workers",
    "ready": "ready (floor)",
}
DEVICE_SAMPLERS = ("rays", "rays_sync", "sync_local", "sync_global", "ready")
"""Sources with a device placement (images resident in GPU memory)."""
FLOOR = "ready"
PIPELINED = "rays"
COMPUTE = ("forward", "backward", "optimizer")


# ---------------------------------------------------------------------------------------------
# model state: kept on the host, restored before every segment


def _to_host(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _snapshot(task) -> dict:
    return {"field": _to_host(task.raw_field.state_dict()), "optimizer": _to_host(task.optimizer.state_dict()),
            "occupancy": _to_host(task.occupancy.state_dict()) if task.occupancy is not None else None,
            "scheduler": copy.deepcopy(task.scheduler.state_dict()) if task.scheduler is not None else None}


def _restore(task, snap: dict) -> None:
    task.raw_field.load_state_dict(snap["field"])
    task.optimizer.load_state_dict(snap["optimizer"])
    if snap["occupancy"] is not None:
        task.occupancy.load_state_dict(snap["occupancy"])
    if snap["scheduler"] is not None:
        task.scheduler.load_state_dict(snap["scheduler"])


# ---------------------------------------------------------------------------------------------
# sources


def _make_source(cfg: Config, name: str, placement: str, B: int, scene, cache, device: str, threads: int):
    """The source ``name`` at ``B`` rays over ``cache`` (decoded on the placement's device), from the
    registry: the trainer's plan for ``device`` with ``threads`` sampler threads, sampling where the
    placement keeps the images (torch_workers as the trainer builds it for ``device``: workers
    sample on the host, batches pinned on a GPU)."""
    from dali_nerf.sources import make_source

    if name not in SAMPLERS:
        raise ConfigError(f"--samplers: unknown source {name!r}; use {', '.join(SAMPLERS)}")
    p = cfg.pipeline
    c = dataclasses.replace(cfg, pipeline=dataclasses.replace(
        p, rays_per_batch=int(B), num_threads=int(threads)),
        train=dataclasses.replace(cfg.train, device=device))
    where = device if name == "torch_workers" else ("cuda" if placement == "device" else "cpu")
    plan = plan_from_config(c, 0, 1, device=where)
    if name == "torch_workers":
        plan = dataclasses.replace(plan, prefetch=max(1, p.prefetch))
    return make_source(name, scene, plan, cache=cache)


def _warmup(name: str, src, base: int) -> int:
    """Untimed steps: ``base`` (past the pipeline build and first run); the synchronous ``rays``
    control: one whole DALI run, so that its timed steps start at a run boundary."""
    if name == "rays_sync":
        return max(base, int(src.steps_per_run))
    return base


def _timed_steps(name: str, src, steps: int) -> int:
    """``steps``; the synchronous ``rays`` control: rounded up to whole DALI runs (its sampling
    cost falls on every K-th step)."""
    if name == "rays_sync":
        k = int(src.steps_per_run)
        return k * max(1, -(-steps // k))
    return steps


# ---------------------------------------------------------------------------------------------
# one segment


def _segment(cfg, env, task, scene, src, warm: int, steps: int, first_step: int) -> dict:
    """Train ``warm + steps`` steps of ``task`` on ``src``; means over the timed ones."""
    from dali_nerf.train.phases import PHASES, PhaseTimer
    from dali_nerf.train.loop import train_task_step

    task.source, task.iterator = src, None
    bg = torch.as_tensor(np.array(scene.background), device=env.device)
    timer = PhaseTimer(env.device)
    cuda = env.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
    rows = []
    for k in range(warm + steps):
        ph = {p: 0.0 for p in PHASES}
        t0 = time.perf_counter()
        loss, _ = train_task_step(cfg, env, task, first_step + k, scene, bg, {}, timer)
        timer.resolve(ph)
        loss = float(loss)
        ph["step"] = time.perf_counter() - t0
        if k >= warm:
            rows.append(ph)
    out = {"steps": steps, "warmup": warm, "loss_last": loss}
    out["step_s"] = float(np.mean([r["step"] for r in rows]))
    out["wait_s"] = float(np.mean([r["wait"] for r in rows]))
    out["stall"] = out["wait_s"] / max(out["step_s"], 1e-12)
    out["phases_s"] = {p: float(np.mean([r[p] for r in rows])) for p in PHASES}
    out["compute_s"] = sum(out["phases_s"][p] for p in COMPUTE)
    if cuda:
        free, total = torch.cuda.mem_get_info(env.device)
        out["torch_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(env.device))
        out["device_used_bytes"] = int(total - free)
    return out


# ---------------------------------------------------------------------------------------------
# aggregation


def aggregate(segments: List[dict]) -> dict:
    """``rows`` and ``device_steps`` from the segments (see the module docstring)."""
    from dali_nerf.bench.study.derive import mean_ci

    floors = {(s["placement"], s["rays"], s["trial"]): s for s in segments if s["sampler"] == FLOOR}
    pipes: Dict[tuple, list] = {}
    for s in segments:
        if s["sampler"] == PIPELINED:
            pipes.setdefault((s["placement"], s["rays"], s["trial"]), []).append(s["step_s"])
    groups: Dict[tuple, list] = {}
    for s in segments:
        groups.setdefault((s["placement"], s["rays"], s["sampler"]), []).append(s)
    rows = []
    order = {n: i for i, n in enumerate(SAMPLERS)}
    for (pl, B, name), segs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99))):
        by_trial: Dict[int, list] = {}
        for s in segs:
            by_trial.setdefault(s["trial"], []).append(s)
        steps = [float(np.mean([s["step_s"] for s in v])) for v in by_trial.values()]
        stalls = [float(np.mean([s["stall"] for s in v])) for v in by_trial.values()]
        waits = [float(np.mean([s["wait_s"] for s in v])) for v in by_trial.values()]
        over, speed = [], []
        for t, v in by_trial.items():
            f = floors.get((pl, B, t))
            st = float(np.mean([s["step_s"] for s in v]))
            if f is not None:
                over.append(st / f["step_s"])
            if (pl, B, t) in pipes:
                speed.append(st / float(np.mean(pipes[(pl, B, t)])))
        m, ci = mean_ci(steps)
        sm, sci = mean_ci(stalls)
        row = {"placement": pl, "rays": B, "sampler": name, "label": LABELS.get(name, name), "trials": len(by_trial),
               "step_ms": 1e3 * m, "step_ms_ci": [1e3 * ci[0], 1e3 * ci[1]], "wait_ms": 1e3 * float(np.mean(waits)),
               "stall": sm, "stall_ci": sci,
               "phases_ms": {p: 1e3 * float(np.mean([s["phases_s"][p] for s in segs])) for p in segs[0]["phases_s"]}}
        if over:
            om, oci = mean_ci(over)
            row.update(step_over_floor=om, step_over_floor_ci=oci)
        if speed and name not in (PIPELINED, FLOOR):
            pm, pci = mean_ci(speed)
            row.update(pipelined_speedup=pm, pipelined_speedup_ci=pci)
        peaks = [s["torch_peak_allocated_bytes"] for s in segs if "torch_peak_allocated_bytes" in s]
        if peaks:
            row["torch_peak_allocated_bytes"] = max(peaks)
            row["device_used_bytes"] = max(s["device_used_bytes"] for s in segs)
        rows.append(row)
    device_steps = []
    for B in sorted({s["rays"] for s in segments}):
        fl = [s for s in segments if s["sampler"] == FLOOR and s["rays"] == B and s["placement"] == "host"]
        if not fl:
            continue
        comp = float(np.mean([s["compute_s"] for s in fl]))
        device_steps.append({"rays": B, "compute_ms": 1e3 * comp, "ms_per_4096": 1e3 * comp * 4096 / B,
                             "h2d_ms": 1e3 * float(np.mean([s["phases_s"]["h2d"] for s in fl])),
                             "floor_step_ms": 1e3 * float(np.mean([s["step_s"] for s in fl])), "trials": len(fl)})
    return {"rows": rows, "device_steps": device_steps}


def _table(res: dict) -> str:
    m = res["meta"]
    L = [f"# dali-nerf bench loop: {m['device_name']} ({m['phase_timing']})", "",
         f"`{m['command']}` at {m['commit']}, {m['date']}; host: {m['host']}; model: {m['model_desc']}; "
         f"{m['trials']} trials x {m['steps']} timed steps per source (pretrained {m['pretrain']} steps first, "
         f"the same state restored before every source).", "",
         "| placement | rays | source | step ms (95% CI) | wait ms | stall | step / floor | pipelined speedup | torch peak GiB |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ci = r["step_ms_ci"]
        sof = f"{r['step_over_floor']:.2f}" if "step_over_floor" in r else "-"
        spd = f"{r['pipelined_speedup']:.2f}x" if "pipelined_speedup" in r else "-"
        mem = f"{r['torch_peak_allocated_bytes'] / 2 ** 30:.2f}" if "torch_peak_allocated_bytes" in r else "-"
        L.append(f"| {r['placement']} | {r['rays']} | {r['label']} | {r['step_ms']:.2f} ({ci[0]:.2f}-{ci[1]:.2f}) | "
                 f"{r['wait_ms']:.2f} | {100 * r['stall']:.1f}% | {sof} | {spd} | {mem} |")
    if res["device_steps"]:
        L += ["", "Device step (the host floor's forward + backward + optimizer; `bench.device_step_file` of the "
              "emulated study): " + "; ".join(f"{d['rays']} rays {d['compute_ms']:.2f} ms ({d['ms_per_4096']:.3f} ms "
                                               f"per 4096 rays), h2d {d['h2d_ms']:.2f} ms" for d in res["device_steps"]) + "."]
    if res["meta"].get("skipped"):
        L += ["", "Not measured: " + "; ".join(res["meta"]["skipped"]) + "."]
    return "\n".join(L) + "\n"


def _write(out: Path, res: dict) -> None:
    res.update(aggregate(res["segments"]))
    atomic_write_text(out / "loop.json", json.dumps(res, indent=1))
    atomic_write_text(out / "loop.md", _table(res))


# ---------------------------------------------------------------------------------------------
# the run


def run_loop(cfg: Config, out: Path, batches: Sequence[int], samplers: Sequence[str], placements: Sequence[str],
             trials: int, steps: int, warmup: int, pretrain: int, device: str = "auto", command: str = "",
             log=print) -> dict:
    """Measure every (placement, batch size, sampler) ``trials`` times; write ``out/loop.json``
    and ``out/loop.md`` after every segment; returns the result dict (see the module docstring)."""
    from dali_nerf.train.emulation import model_grad_bytes
    from dali_nerf.data.imagecache import CacheStore
    from dali_nerf.scenes import scene_from_config
    from dali_nerf.sources.registry import rank_feed
    from dali_nerf.trainers.ddp import DDPMethod
    from dali_nerf.train.runtime import DistEnv
    from dali_nerf.bench.study.provenance import git_commit, machine_desc as _machine_desc

    dev_name = sampling_device(device, "--device")  # the trainer's rule: auto, a missing GPU refused
    env = DistEnv(0, 1, 0, torch.device("cuda", torch.cuda.current_device()) if dev_name == "cuda" else torch.device("cpu"))
    for s in samplers:
        if s not in SAMPLERS:
            raise ConfigError(f"--samplers: unknown source {s!r}; use {', '.join(SAMPLERS)}")
    if FLOOR not in samplers:
        samplers = list(samplers) + [FLOOR]
    skipped = []
    if "device" in placements and dev_name != "cuda":
        skipped.append("the device placement (images in GPU memory): no GPU")
        placements = [p for p in placements if p != "device"]
    if not placements:
        raise ConfigError("--placements: nothing to run (device needs a GPU); use host")
    sc = cfg.scene
    scene = scene_from_config(cfg)
    cfg_floor = copy.deepcopy(cfg)
    cfg_floor.pipeline.name = FLOOR
    cfg_floor.train.device = dev_name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    method = DDPMethod()
    feed = rank_feed(cfg_floor, scene, 0, 1)  # the trainer's plan: its budget on this host
    feed.build()
    task = method.build_tasks(cfg_floor, scene, env, feed)[0]  # the trainer's model, optimiser, occupancy, schedule
    task.source.close()
    plan0 = feed.plan
    threads = plan0.threads
    store = CacheStore(scene, plan0)
    caches = {"host": store.full("cpu")}
    if "device" in placements:
        caches["device"] = store.full("cuda")
    res = {"meta": {
        "kind": "dali-nerf bench loop", "command": command, "commit": git_commit(exclude="docs"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(env.device),
        "device_name": torch.cuda.get_device_name(env.device) if dev_name == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "host": _machine_desc(), "host_cores": os.cpu_count(), "machine": platform.machine(),
        "torch": torch.__version__,
        "phase_timing": "cuda_events" if dev_name == "cuda" else "host",
        "config": config_to_dict(cfg), "scene": str(sc.path), "scene_images": scene.num_images,
        "scene_pixels": int(caches["host"].num_pixels),
        "model_desc": " ".join(f"{k}={v}" for k, v in config_to_dict(cfg.model).items()),
        "grad_bytes": model_grad_bytes(cfg.model), "batches": list(batches), "samplers": list(samplers),
        "placements": list(placements), "trials": trials, "steps": steps, "warmup": warmup, "pretrain": pretrain,
        "sampler_threads": threads, "sampler_priority": plan0.priority, "workers": cfg.pipeline.workers,
        "skipped": skipped,
        "notes": ["stall = wait / step (wait: host time blocked in next()); step / floor: the same trial's ready-batch "
                  "step; pipelined speedup: this source's step / the same trial's rays step",
                  "torch_peak_allocated_bytes: torch's peak during the segment (model, optimiser, activations, "
                  "device-resident caches and batches torch holds); device_used_bytes: the device's used memory after "
                  "it (also DALI's pools)",
                  "sync_global with one rank: rank 0 samples its own batch from all images (no scatter)"],
    }, "segments": []}
    # pretrain: the occupancy grid culls empty space as in a real run; then the state every source starts from
    if pretrain:
        place = "device" if "device" in placements else "host"
        src = _make_source(cfg, PIPELINED, place, max(batches), scene, caches[place], dev_name, threads)
        try:
            r = _segment(cfg, env, task, scene, src, 0, pretrain, 1)
        finally:
            src.close()
        res["meta"].update(pretrain_loss=r["loss_last"], pretrain_source=f"{place} rays at {max(batches)} rays")
        log(f"pretrained {pretrain} steps ({place} rays, {max(batches)} rays): loss {r['loss_last']:.5f}")
    _grid(cfg, env, task, scene, caches, res, out, batches, samplers, placements, trials, steps, warmup,
          pretrain + 1, dev_name, threads, t0, log)
    res["meta"]["wall_s"] = time.perf_counter() - t0
    _write(out, res)
    return res


def _grid(cfg, env, task, scene, caches, res, out, batches, samplers, placements, trials, steps, warmup, first,
          dev_name, threads, t0, log) -> None:
    """Every (batch size, trial, placement, source) segment of :func:`run_loop`, rotated, each from
    the same pretrained state; ``res`` rewritten to ``out`` after every segment."""
    from dali_nerf.bench.emulated import pair_order, with_floor

    snap = _snapshot(task)
    baselines = [s for s in samplers if s not in (PIPELINED, FLOOR)]
    for B in batches:
        for t in range(trials):
            pls = list(placements)
            pls = pls[t % len(pls):] + pls[:t % len(pls)]
            for pl in pls:
                names = [s for s in samplers if pl == "host" or s in DEVICE_SAMPLERS]
                base = [s for s in baselines if s in names]
                order = with_floor(pair_order(base, t, PIPELINED) if PIPELINED in names else [(s, -1) for s in base], t)
                for k, (name, _) in enumerate(order):
                    _restore(task, snap)
                    src = _make_source(cfg, name, pl, B, scene, caches[pl], dev_name, threads)
                    try:
                        warm, n = _warmup(name, src, warmup), _timed_steps(name, src, steps)
                        seg = _segment(cfg, env, task, scene, src, warm, n, first)
                    finally:
                        src.close()
                    seg.update(placement=pl, rays=B, sampler=name, label=LABELS[name], trial=t, order=k)
                    res["segments"].append(seg)
                    res["meta"]["wall_s"] = time.perf_counter() - t0
                    _write(out, res)
                    log(f"{pl:6s} B={B:6d} t{t} {LABELS[name]:44s} step {1e3 * seg['step_s']:8.2f} ms  "
                        f"wait {1e3 * seg['wait_s']:7.2f} ms  stall {100 * seg['stall']:5.1f}%")


def read_device_step(path, rays: int) -> dict:
    """The device step that ``dali-nerf bench loop`` measured at ``rays`` rays (``loop.json``'s
    ``device_steps``), for the emulated study: {"rays", "compute_ms", "ms_per_4096", "h2d_ms",
    "floor_step_ms", "trials", "grad_bytes", "device_name", "phase_timing", "model_desc", "file",
    "source" (one sentence: what was measured, where, by which command)}.

    Raises ConfigError naming the file when it is missing, not a loop benchmark's output, or has
    no device step at ``rays``."""
    p = Path(path)
    try:
        res = json.loads(p.read_text())
        meta, steps = res["meta"], res["device_steps"]
    except FileNotFoundError:
        raise ConfigError(f"bench.device_step_file: {p} not found; run dali-nerf bench loop first") from None
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"bench.device_step_file: {p} is not the loop.json of dali-nerf bench loop") from None
    hit = [d for d in steps if int(d["rays"]) == int(rays)]
    if not hit:
        have = ", ".join(str(d["rays"]) for d in steps) or "none"
        raise ConfigError(f"bench.device_step_file: {p} has no device step at {rays} rays (it has: {have}); set "
                          f"pipeline.rays_per_batch to one of them")
    d = dict(hit[0])
    d.update(grad_bytes=int(meta.get("grad_bytes") or 0), device_name=meta.get("device_name"),
             phase_timing=meta.get("phase_timing"), model_desc=meta.get("model_desc"), file=str(p))
    d["source"] = (f"measured, not assumed: the ready-batch floor's forward + backward + optimizer at {d['rays']} rays "
                   f"({d['compute_ms']:.3f} ms, mean of {d['trials']} trials; {d['ms_per_4096']:.3f} ms per 4096 rays) "
                   f"of the model {meta.get('model_desc')} on {meta.get('device_name')} "
                   f"({'CUDA events' if d['phase_timing'] == 'cuda_events' else 'host timing: a CPU, not a GPU'}), "
                   f"by `{meta.get('command')}` at {meta.get('commit')} ({p})")
    return d


def main(args) -> int:
    """``dali-nerf bench loop``."""
    import shlex

    def ints(s, what):
        try:
            v = [int(x) for x in str(s).split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"{what} {s!r}: use comma-separated integers, e.g. 16384,65536") from None
        if not v or min(v) <= 0:
            raise ConfigError(f"{what} {s!r}: values must be > 0")
        return v

    batches = ints(args.batches, "--batches")
    for name, v, lo in (("--trials", args.trials, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                        ("--pretrain", args.pretrain, 0)):
        if v < lo:
            raise ConfigError(f"{name} {v}: must be >= {lo}")
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    placements = [s.strip() for s in args.placements.split(",") if s.strip()]
    for pl in placements:
        if pl not in ("host", "device"):
            raise ConfigError(f"--placements: {pl!r}; use host, device or host,device")
    overrides = list(args.overrides or [])
    if args.scene:
        overrides.append(f"scene.path={args.scene}")
    cfg = load_config(args.config, overrides)
    cmd = " ".join(shlex.quote(str(a)) for a in [
        "dali-nerf", "bench", "loop", "--config", args.config, "--batches", args.batches, "--samplers", args.samplers,
        "--placements", args.placements, "--trials", args.trials, "--steps", args.steps, "--warmup", args.warmup,
        "--pretrain", args.pretrain, "--device", args.device, "--out", args.out, *overrides])
    res = run_loop(cfg, Path(args.out), batches, samplers, placements, args.trials, args.steps, args.warmup,
                   args.pretrain, args.device, cmd)
    print(_table(res))
    print(f"wrote {Path(args.out) / 'loop.json'} in {res['meta']['wall_s']:.1f} s", flush=True)
    return 0
