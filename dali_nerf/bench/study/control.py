"""The control's own cost, measured apart.

``rays_sync`` (the study's same-sampler control) is ``rays`` at prefetch 0: DALI's synchronous
executor, whose output buffers are reused by the next run, so each run's outputs are copied out of
them (:func:`dali_nerf.sources.base.dali_to_torch`). The pipelined loader runs the same graph on the
asynchronous executor, whose runs come in fresh buffers handed out without a copy. That difference
is work the control does and the pipelined loader does not: counted inside the overlap gain, it
would be credited to overlap. It is measured here on its own, in the calling thread, with the ray
graph of each batch size and each launch's sampler threads and run size (world size 1, the global
stream the study pins), in interleaved rounds:

* ``control``: the synchronous executor, each run copied (what ``rays_sync`` does);
* ``no_copy``: the same executor and runs, not copied (the copy's share: control - no_copy);
* ``async``: the asynchronous executor at one run in flight, driven from the calling thread, not
  copied (each ``run()`` schedules one run and waits for it: the pipelined loader's own production,
  with no overlap; the executor's share: no_copy - async).

The control's own cost per step = control - async, per round (paired), its mean and 95% interval
over the rounds; :func:`~dali_nerf.bench.study.summary.control_factor` turns it into a factor of
the overlap gain.

>>> measure_control(cfg, scene, sizes=[4096, 65536], budgets=[(1, 65536)])["rows"][0]["own_s"]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, List, Sequence, Tuple

import numpy as np

from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.plan import plan_from_config
from dali_nerf.pipelines.rays import ray_pipeline, release_pipeline
from dali_nerf.sources.dalirun import run_graph
from dali_nerf.sources.rays import DEFAULT_OUTPUTS
from dali_nerf.bench.study.stats import mean_ci

__all__ = ["measure_control", "VARIANTS"]

VARIANTS = ("control", "no_copy", "async")


def _pipes(cfg, scene, cache, B: int, threads: int, rays_per_run: int):
    """({variant: (pipe, copy)}, steps per run, output keys) of the ray graph at ``B`` rays per step."""
    c = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, rays_per_batch=int(B), num_threads=threads,
                                                              rays_per_run=rays_per_run, mode="random"),
                            train=dataclasses.replace(cfg.train, device="cpu"))
    plan = plan_from_config(c, 0, 1, local_ranks=1)
    glob = plan.ray_stream == "global"
    keys = DEFAULT_OUTPUTS + (("positions", "step_counts") if glob else ())
    keys = tuple(k for k in keys if k not in ("near", "far") or scene.has_bounds)
    graph = plan.ray_graph(scene)  # the graph RayLoader samples with at this plan (world size 1)
    sync = ray_pipeline(cache, dataclasses.replace(graph, prefetch=0))
    return ({"control": (sync, True), "no_copy": (sync, False),
             "async": (ray_pipeline(cache, dataclasses.replace(graph, prefetch=1)), False)}, plan.steps_per_run, keys)


def _time_runs(pipe, keys, copy: bool, runs: int) -> float:
    """Seconds per run of ``pipe`` over ``runs`` runs (outputs converted to torch, copied or not)."""
    t0 = time.perf_counter()
    for _ in range(runs):
        run_graph(pipe, "cpu", keys, copy)
    return (time.perf_counter() - t0) / runs


def measure_control(cfg, scene, sizes: Sequence[int], budgets: Iterable[Tuple[int, int]], rounds: int = 7,
                    runs: int = 10) -> dict:
    """The control's own cost at each of ``sizes`` (rays per step) and each (sampler threads, rays per
    run) of ``budgets`` (the launches' host budgets), in ``rounds`` interleaved rounds of ``runs``
    runs per variant (:data:`VARIANTS`, after 2 untimed runs each).

    Returns {"rounds", "runs", "rows": [{"rays", "threads", "rays_per_run", "steps_per_run",
    "<variant>_s" [per round: seconds per step], "own_s" (control - async per step, the mean over
    rounds), "own_ci", "copy_s" (control - no_copy), "executor_s" (no_copy - async)}]}."""
    cache = CacheStore(scene, plan_from_config(cfg, 0, 1, local_ranks=1)).shard()
    rows: List[dict] = []
    for threads, rpr in sorted(set((int(t), int(r)) for t, r in budgets)):
        for B in sizes:
            pipes, K, keys = _pipes(cfg, scene, cache, int(B), threads, rpr)
            try:
                for pipe, copy in pipes.values():
                    _time_runs(pipe, keys, copy, 2)
                per = {v: [] for v in VARIANTS}
                for _ in range(rounds):
                    for v in VARIANTS:
                        pipe, copy = pipes[v]
                        per[v].append(_time_runs(pipe, keys, copy, runs) / K)
            finally:
                for pipe in {id(p): p for p, _ in pipes.values()}.values():
                    release_pipeline(pipe)
            own, own_ci = mean_ci(np.subtract(per["control"], per["async"]))
            rows.append({"rays": int(B), "threads": threads, "rays_per_run": rpr, "steps_per_run": K,
                         **{f"{v}_s": per[v] for v in VARIANTS}, "own_s": own, "own_ci": own_ci,
                         "copy_s": float(np.mean(np.subtract(per["control"], per["no_copy"]))),
                         "executor_s": float(np.mean(np.subtract(per["no_copy"], per["async"])))})
    return {"rounds": rounds, "runs": runs, "rows": rows}
