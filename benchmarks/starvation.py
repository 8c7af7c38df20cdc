"""A background-priority loader on a host whose cores are all busy: normal vs background, with and
without the starvation guard.

    python benchmarks/starvation.py [--config study] [--scene DIR] [--seconds 8] [--repeats 3]
                                    [--step-ms 1]

One RayLoader (the scene of ``--config`` or ``--scene`` and the config's batch, this host's budget for one rank) feeds a consumer
that sleeps ``--step-ms`` per step (an emulated device step), while usable cores + 1 processes
busy-loop at normal priority (other jobs, other ranks' threads). The variants run in an order
rotated per repeat, each for ``--seconds`` on a fresh loader: ``normal``; ``background`` with the
guard (the default: a loader whose consumer waits over 20% of a second returns to normal priority,
dali_nerf.sources.runahead.StarvationGuard); ``background, no guard`` (``starvation_guard = False``).
Prints per variant the mean over repeats (and range) of the steps per second, the stall
(time in next() / wall time), the mean and worst wait in next(), and when the guard switched.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import warnings


def _burn(stop):
    while not stop.is_set():
        pass


def _run(scene, cache, B, budget, prio: str, guard: bool, seconds: float, step_s: float) -> dict:
    from dali_nerf.sources import RayLoader

    L = RayLoader(scene, B, 0, 1, 0, prefetch=2, mode="random", num_threads=budget.threads,
                  rays_per_run=budget.rays_per_run, cache=cache, thread_priority=prio)
    L.starvation_guard = guard
    waits, switched = [], None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):  # the build and first run, before timing
                next(L)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                t = time.perf_counter()
                next(L)
                waits.append(time.perf_counter() - t)
                if switched is None and L.thread_priority != prio:
                    switched = time.perf_counter() - t0
                time.sleep(step_s)
            wall = time.perf_counter() - t0
    finally:
        L.close()
    return {"steps_per_s": len(waits) / wall, "stall": sum(waits) / wall, "mean_wait_ms": 1e3 * statistics.mean(waits),
            "max_wait_ms": 1e3 * max(waits), "switched_s": switched}


def main(argv=None) -> None:
    from dali_nerf.config import load_config
    from dali_nerf.data.hostbudget import usable_cores
    from dali_nerf.data.imagecache import CacheStore
    from dali_nerf.data.plan import SamplingPlan
    from dali_nerf.scenes import scene_from_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="study")
    ap.add_argument("--scene", default=None, help="scene folder (default: the config's scene.path)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=1.0)
    a = ap.parse_args(argv)
    cfg = load_config(a.config, [f"scene.path={a.scene}"] if a.scene else [])
    scene = scene_from_config(cfg)
    B = cfg.pipeline.rays_per_batch
    budget = SamplingPlan.for_loader(B)  # this host's budget for one rank: its threads and run size
    cache = CacheStore(scene, budget).full()
    variants = [("normal", "normal", True), ("background", "background", True),
                ("background, no guard", "background", False)]
    n = usable_cores() + 1
    print(f"{n} busy-looping processes at normal priority on {usable_cores()} cores; 1 loader, {B} rays a step, "
          f"{a.step_ms:g} ms device step, {a.seconds:g} s per variant, {a.repeats} repeats in rotated order")
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(n)]
    res = {v[0]: [] for v in variants}
    try:
        for p in procs:
            p.start()
        for rep in range(a.repeats):
            k = rep % len(variants)
            for name, prio, guard in variants[k:] + variants[:k]:
                res[name].append(_run(scene, cache, B, budget, prio, guard, a.seconds, a.step_ms / 1e3))
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
    print("| variant | steps/s | stall | mean wait ms | worst wait ms | switched to normal after |")
    print("|---|---|---|---|---|---|")
    for name, rows in res.items():
        def col(key, fmt):
            v = [r[key] for r in rows]
            return f"{format(statistics.mean(v), fmt)} [{format(min(v), fmt)}, {format(max(v), fmt)}]"
        sw = [r["switched_s"] for r in rows]
        sws = "-" if all(s is None for s in sw) else ", ".join("never" if s is None else f"{s:.1f} s" for s in sw)
        stall = [100 * r["stall"] for r in rows]
        print(f"| {name} | {col('steps_per_s', '.0f')} | {statistics.mean(stall):.1f}% [{min(stall):.1f}, {max(stall):.1f}] | "
              f"{col('mean_wait_ms', '.2f')} | {col('max_wait_ms', '.0f')} | {sws} |")


if __name__ == "__main__":
    main()
