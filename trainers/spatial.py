"""Spatial-segmentation NeRF trainer (the study's second method, Mega-NeRF style).

The scene is cut into cells (``partition``); rank r trains the sub-models of its cells (cells r,
r + W, ... round-robin), each on the rays that cross its cell — routed exactly inside our DALI
operator, no mask precompute — with no gradient sync. Every rank decodes all images (a ray of any
image may cross its cell). At the end rank 0 gathers the sub-models and renders the held-out
views with the fused field (inverse-distance blend per sample point), and reports the fusion
overhead against rendering one sub-model alone.

    torchrun --nproc_per_node=2 trainers/spatial.py --config configs/ss_city.yaml [key=value ...]
"""

from __future__ import annotations

from dali_nerf.interrupt import exit_process, quiet_startup

if __name__ == "__main__":
    quiet_startup()  # Ctrl-C while torch and DALI load: one line, exit 130

import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist

from dali_nerf.models import build_field, build_occupancy, make_optimizer
from dali_nerf.models.fused import FusedField
from dali_nerf.errors import ConfigError
from dali_nerf.train.evaluation import EvalViews, evaluate_field
from dali_nerf.train.fieldsetup import learned_background_init, scene_space
from dali_nerf.train.runtime import DistEnv
from dali_nerf.data.seeds import init_seed
from dali_nerf.train.tasks import Method, Task
from dali_nerf.cli.trainer import trainer_main

__all__ = ["SpatialMethod", "build_fused", "main"]


def build_fused(cfg, partition, aabb, cell_states: dict, device):
    """(FusedField, fused occupancy grid) from ``{cell: {"field": sd, "occupancy": sd}}``.

    Sub-fields whose state holds a learned background (``background_logit``) get one; the fused
    field's background is their mean (:meth:`FusedField.background`).

    The fused occupancy is the union of the sub-models' grids (conservative: a cell is skipped
    only if every sub-model finds it empty)."""
    fields, occ = [], build_occupancy(cfg.model, aabb)
    for c in range(partition.num_cells):
        f = _cell_field(cfg, aabb, cell_states[c]["field"])
        fields.append(f.to(device).eval())
    if occ is not None:
        grids = []
        for c in range(partition.num_cells):
            o = build_occupancy(cfg.model, aabb)
            o.load_state_dict(cell_states[c]["occupancy"])
            grids.append(o)
        # union: occupied where any sub-model's grid is occupied (running max of densities)
        with torch.no_grad():
            occ.density.copy_(torch.stack([g.density for g in grids]).amax(0))
            occ.bits.copy_(torch.stack([g.bits for g in grids]).any(0))
            occ.updates.fill_(max(int(g.updates) for g in grids))
        occ = occ.to(device)
    return FusedField(fields, partition).to(device).eval(), occ


def _cell_field(cfg, aabb, state: dict):
    """A sub-model built for ``state`` (with a learned background when the state has one) and loaded."""
    init = state["background_logit"].sigmoid() if "background_logit" in state else None
    f = build_field(cfg.model, aabb, init)
    f.load_state_dict(state)
    return f


class SpatialMethod(Method):
    name = "ss"

    def check(self, cfg, scene):
        space = scene_space(cfg, scene)
        if space.kind != "world":  # cells, routing and the fused blend are in world coordinates
            raise ConfigError(f"model.space: the spatial-segmentation trainer needs world space, got {space.kind!r} "
                              f"for {cfg.scene.path}; set model.space=world (or give the scene an aabb)")

    def build_tasks(self, cfg, scene, env: DistEnv, feed):
        self.partition = feed.partition  # built from the config by the registry, the cells assigned there
        if env.rank == 0:
            self.partition.save(cfg.run_dir / "partition.json")
        self.cells = feed.cells[env.rank]
        self.space = scene_space(cfg, scene)
        self.aabb = self.space.aabb
        tasks = []
        for c, source in zip(self.cells, feed.sources):
            torch.manual_seed(init_seed(cfg.pipeline.seed, c))
            field = build_field(cfg.model, self.aabb, learned_background_init(scene)).to(env.device)
            occ = build_occupancy(cfg.model, self.aabb)
            occ = occ.to(env.device) if occ is not None else None
            opt, sched = make_optimizer(field, cfg)
            tasks.append(Task(f"cell{c}", source, field, field, occ, opt, sched, cell=c, space=self.space))
        return tasks

    def _gather_states(self, tasks, env):
        mine = {t.cell: {"field": {k: v.cpu() for k, v in t.raw_field.state_dict().items()},
                         "occupancy": {k: v.cpu() for k, v in t.occupancy.state_dict().items()} if t.occupancy is not None else {}}
                for t in tasks}
        if not env.distributed:
            return mine
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, mine)
        out = {}
        for g in gathered:
            out.update(g)
        return out

    def eval_field(self, cfg, tasks, env):
        states = self._gather_states(tasks, env)
        if env.rank != 0:
            return None, None
        self.cell_states = states
        return build_fused(cfg, self.partition, self.aabb, states, env.device)

    def extra_summary(self, cfg, tasks, env, eval_scene, field, occupancy, views=None):
        """Fusion overhead (fused render time / one sub-model's) and each sub-model's PSNR alone,
        on the run's evaluated views (decoded once for the run)."""
        n = min(cfg.train.eval_images or eval_scene.num_images, eval_scene.num_images)
        views = (views or EvalViews(cfg, eval_scene)).cache()
        alone = []
        for c in range(self.partition.num_cells):
            f = _cell_field(cfg, self.aabb, self.cell_states[c]["field"]).to(env.device).eval()
            occ = build_occupancy(cfg.model, self.aabb)
            if occ is not None:
                occ.load_state_dict(self.cell_states[c]["occupancy"])
                occ = occ.to(env.device)
            _, p, _, secs = evaluate_field(f, occ, eval_scene, cfg, env.device, n, decode=views, space=self.space)
            alone.append({"cell": c, "psnr": p, "render_s": secs})
        field.reset_stats() if hasattr(field, "reset_stats") else None
        t0 = time.perf_counter()
        _, fused_psnr, _, fused_s = evaluate_field(field, occupancy, eval_scene, cfg, env.device, n, decode=views,
                                                   space=self.space)
        stats = field.fusion_stats() if hasattr(field, "fusion_stats") else {}
        single_s = float(np.mean([a["render_s"] for a in alone]))
        return {
            "cells": self.partition.num_cells,
            "partition": {"kind": self.partition.kind, "margin": float(self.partition.margin), "dims": int(self.partition.dims)},
            "submodels_alone": alone,
            "fused_psnr": fused_psnr,
            "fused_render_s": fused_s,
            "single_render_s": single_s,
            "fusion_overhead": fused_s / max(single_s, 1e-9),
            "fusion_stats": stats,
            "acceptance": [t.source.stats().get("acceptance") for t in tasks] if env.rank == 0 else None,
        }


def main(argv=None) -> int:
    return trainer_main(SpatialMethod, "ss_city", argv)


if __name__ == "__main__":
    exit_process(main())  # after Ctrl-C: os._exit(130), no unbounded interpreter shutdown
