"""Pipelined step against the emulation floor with the sampler threads at normal vs background priority.

    python benchmarks/thread_priority.py [--config study] [--scene DIR] [--ranks 4,8,16]
                                         [--step-ms 1,2] [--repeats 2] [--trials 3] [--steps 40]

For each rank count, launches of the study's emulated DDP ranks (:func:`dali_nerf.bench.emulated.launch`,
the scene of ``--config`` or ``--scene``, 4096 rays per rank) alternate between ``pipeline.thread_priority``
normal and background, ``--repeats`` times each. Every launch runs the floor (a ready batch) and
RayLoader at each ``--step-ms``, ``--trials`` times in rotation, so each RayLoader segment has a
floor beside it in the same launch. Prints, per (ranks, device ms, priority), the mean and range
of step / floor over every trial of every launch (1.0 = the loader adds nothing to the step), and
per rank count in how many background launches the starvation guard returned a sampler to normal
priority (on a quiet host a loader that keeps up should stay in background: the real-time side of
tests/test_thread_priority.py::test_a_loader_that_keeps_up_stays_in_background, which drives the
guard with a controlled consumer so that the suite does not depend on the host's load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path


def _ratios(out: Path, segs, steps: int) -> dict:
    """{(device ms per 4096 rays, trial): step / floor} of one launch."""
    step = {}
    for s in segs:
        rows = [json.loads(x) for x in (out / s.name / "metrics.jsonl").read_text().splitlines()][-steps:]
        step[(round(s.step_ms * 4096 / s.rays, 9), s.trial, s.sampler)] = statistics.mean(r["step_s"] for r in rows)
    return {(ms, t): v / step[(ms, t, "ready")] for (ms, t, smp), v in step.items() if smp == "rays"}


def main(argv=None) -> None:
    from dali_nerf.bench import emulated as em
    from dali_nerf.config import load_config
    from dali_nerf.train.emulation import DeviceLinks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="study")
    ap.add_argument("--scene", default=None, help="scene folder (default: the config's scene.path)")
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--step-ms", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args(argv)
    cfg = load_config(a.config, [f"scene.path={a.scene}"] if a.scene else [])
    B = cfg.pipeline.rays_per_batch
    step_ms = [float(x) for x in a.step_ms.split(",")]
    res, fired = {}, {}
    with tempfile.TemporaryDirectory() as td:
        for W in (int(x) for x in a.ranks.split(",")):
            # device steps of ms per 4096 rays, at the config's batch (linear in the rays)
            segs = em.schedule([em.PIPELINED], [(f"{ms:g} ms/4096", ms * B / 4096, B) for ms in step_ms], a.trials)
            for rep in range(a.repeats):
                for prio in (("normal", "background") if rep % 2 == 0 else ("background", "normal")):
                    # the launch's budget for W ranks at this priority (the plan resolves it)
                    budget = em.launch_budget(dataclasses.replace(
                        cfg, pipeline=dataclasses.replace(cfg.pipeline, thread_priority=prio)), W)
                    out = Path(td) / f"{W}_{prio}_{rep}"
                    info = em.launch(cfg, "ddp", W, segs, out, budget, DeviceLinks(), 20000, a.steps, 5)
                    if prio == "background":
                        fired.setdefault(W, []).append(bool(info["demoted"]))
                    for (ms, _), r in _ratios(out, segs, a.steps).items():
                        res.setdefault((W, ms, prio), []).append(r)
    scene = f" --scene {a.scene}" if a.scene else ""
    print(f"`python benchmarks/thread_priority.py --config {a.config}{scene} --ranks {a.ranks} --step-ms {a.step_ms} "
          f"--repeats {a.repeats} --trials {a.trials} --steps {a.steps}`\n")
    print("| ranks | device ms | priority | pipelined step / floor, mean | min | max | n |")
    print("|---|---|---|---|---|---|---|")
    for (W, ms, prio), v in sorted(res.items()):
        print(f"| {W} | {ms:g} | {prio} | {statistics.mean(v):.3f} | {min(v):.3f} | {max(v):.3f} | {len(v)} |")
    print()
    for W, f in sorted(fired.items()):
        print(f"{W} ranks: the starvation guard returned a background sampler to normal in {sum(f)} of {len(f)} launches")


if __name__ == "__main__":
    main()
