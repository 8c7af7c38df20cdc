"""nerfstudio 1.1.x datamanagers vs ours: rays/s of ``next_train`` and nerfacto iterations/s.

    python benchmarks/nerfstudio_dm.py [--scene DIR] [--res 200] [--images 40] [--rays 4096 65536]
        [--steps 30] [--rounds 3] [--train-steps 3] [--train-rounds 2] [--small-model] [--out FILE]

(Not ``benchmarks/nerfstudio.py``: run as a script, that name would shadow the nerfstudio package.)
Needs the [nerfstudio] extra's environment (bash scripts/test_nerfstudio.sh builds it). Without
``--scene`` it writes a generated Blender scene (``objects``, ``--images`` PNGs of ``--res`` pixels)
to a temp folder; ``--scene`` takes any Blender-format scene (e.g. a real NeRF-synthetic one).

1. **rays/s of next_train** for nerfstudio's ``VanillaDataManager`` (cached images, pixel sampler
   and ``RayGenerator`` in the training thread), ``ParallelDataManager`` (one worker process,
   nerfstudio's default, queue of 2) and our ``DaliDataManager`` (RayLoader, prefetch 2), at each
   ``--rays`` per step on the CPU: ``--steps`` timed calls after 3 warm-up calls, each
   datamanager built fresh per measurement, in ``--rounds`` interleaved rounds (round r measures
   every (manager, rays) pair before round r+1 starts); printed as median [min-max] Mrays/s.
2. **nerfacto training iterations/s** at 4096 rays/step on the CPU with each datamanager (the
   dali-nerfacto model, i.e. nerfacto without LPIPS; ``--small-model``: the reduced nerfacto of
   tests/nerfstudio_extra/test_ns_train.py): ``--train-steps`` timed iterations (data, forward,
   losses, backward, optimizer step: what nerfstudio's Trainer does per step, without its
   callbacks) after one warm-up iteration, ``--train-rounds`` interleaved rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from nerfstudio.data.datamanagers.base_datamanager import VanillaDataManagerConfig
from nerfstudio.data.datamanagers.parallel_datamanager import ParallelDataManagerConfig
from nerfstudio.data.dataparsers.blender_dataparser import BlenderDataParserConfig
from nerfstudio.engine.optimizers import Optimizers

from dali_nerf.integrations.nerfstudio import DaliDataManagerConfig, dali_nerfacto
from dali_nerf.scenegen import make_scene

KINDS = ("vanilla", "parallel", "dali")
SMALL_MODEL = dict(num_proposal_samples_per_ray=(32, 16), num_nerf_samples_per_ray=16, num_levels=8, max_res=256,
                   hidden_dim=32, hidden_dim_color=32)


def dm_config(kind: str, scene: Path, rays: int):
    parser = BlenderDataParserConfig(data=scene)
    cls = {"vanilla": VanillaDataManagerConfig, "parallel": ParallelDataManagerConfig, "dali": DaliDataManagerConfig}[kind]
    return cls(dataparser=parser, train_num_rays_per_batch=rays, eval_num_rays_per_batch=rays)


def close(dm) -> None:
    if hasattr(dm, "close"):
        dm.close()
    for p in getattr(dm, "data_procs", []):  # ParallelDataManager's worker processes
        p.terminate()
        p.join(timeout=10)


def rays_per_s(kind: str, scene: Path, rays: int, steps: int) -> float:
    dm = dm_config(kind, scene, rays).setup(device="cpu", test_mode="val", world_size=1, local_rank=0)
    try:
        for s in range(3):
            dm.next_train(s)
        t = time.perf_counter()
        for s in range(steps):
            bundle, batch = dm.next_train(3 + s)
            assert bundle.origins.shape[0] == rays and batch["image"].shape[0] == rays
        return steps * rays / (time.perf_counter() - t)
    finally:
        close(dm)


def train_its(kind: str, scene: Path, steps: int, small: bool) -> float:
    cfg = copy.deepcopy(dali_nerfacto.config)
    cfg.pipeline.datamanager = dm_config(kind, scene, 4096)
    if small:
        for k, v in SMALL_MODEL.items():
            setattr(cfg.pipeline.model, k, v)
    pipe = cfg.pipeline.setup(device="cpu", test_mode="val", world_size=1, local_rank=0)
    pipe.train()
    opt = Optimizers(cfg.optimizers, pipe.get_param_groups())
    try:
        def it(step):
            _, loss_dict, _ = pipe.get_train_loss_dict(step)
            loss = sum(loss_dict.values())
            opt.zero_grad_all()
            loss.backward()
            opt.optimizer_step_all()

        it(0)
        t = time.perf_counter()
        for s in range(steps):
            it(1 + s)
        return steps / (time.perf_counter() - t)
    finally:
        close(pipe.datamanager)


def _fmt(vals, scale=1.0):
    v = [x / scale for x in vals]
    return f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scene", type=Path, default=None, help="Blender-format scene (default: generate one)")
    ap.add_argument("--res", type=int, default=200)
    ap.add_argument("--images", type=int, default=40)
    ap.add_argument("--rays", type=int, nargs="+", default=[4096, 65536])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=3, help="timed nerfacto iterations (0: skip part 2)")
    ap.add_argument("--train-rounds", type=int, default=2)
    ap.add_argument("--small-model", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        scene = a.scene or make_scene("objects", Path(tmp) / "objects", width=a.res, n_train=a.images, n_val=2, n_test=2)
        res = {"rays_per_s": {f"{k}@{r}": [] for k in KINDS for r in a.rays}, "train_its": {k: [] for k in KINDS}}
        for rnd in range(a.rounds):
            for r in a.rays:
                for k in KINDS:
                    res["rays_per_s"][f"{k}@{r}"].append(rays_per_s(k, scene, r, a.steps))
            print(f"round {rnd + 1}/{a.rounds}: " + ", ".join(f"{key} {v[-1] / 1e6:.2f}" for key, v in res["rays_per_s"].items())
                  + " Mrays/s", flush=True)
        for rnd in range(a.train_rounds if a.train_steps > 0 else 0):
            for k in KINDS:
                res["train_its"][k].append(train_its(k, scene, a.train_steps, a.small_model))
            print(f"train round {rnd + 1}/{a.train_rounds}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in res["train_its"].items())
                  + " it/s", flush=True)
    print(f"\nnext_train, Mrays/s, median [min-max] of {a.rounds} interleaved rounds ({a.steps} steps each)")
    print(f"{'rays/step':>10} " + " ".join(f"{k:>24}" for k in KINDS))
    for r in a.rays:
        print(f"{r:>10} " + " ".join(f"{_fmt(res['rays_per_s'][f'{k}@{r}'], 1e6):>24}" for k in KINDS))
    if a.train_steps > 0:
        print(f"\nnerfacto{' (small model)' if a.small_model else ''} iterations/s at 4096 rays/step on the CPU, "
              f"median [min-max] of {a.train_rounds} rounds ({a.train_steps} iterations each)")
        print(" ".join(f"{k}: {_fmt(res['train_its'][k])}" for k in KINDS))
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **res}, indent=2))


if __name__ == "__main__":
    main()
