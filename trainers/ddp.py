"""Distributed data parallel NeRF trainer.

Every rank holds the whole model, samples rays from its shard of the images (RayLoader, or the
baseline named by ``pipeline.name``) and all-reduces gradients (DistributedDataParallel). With
``pipeline.stream: global`` (the default) a rank's batch is its shard's part of the step's global
batch, so a run resumes on another number of ranks (docs/MULTINODE.md, "Elastic runs").

    torchrun --nproc_per_node=2 trainers/ddp.py --config configs/ddp_objects.yaml [key=value ...]
    python trainers/ddp.py --config configs/ddp_objects.yaml          # world size 1, no torchrun
    torchrun ... trainers/ddp.py --config ... --resume                # continue the exact stream
"""

from __future__ import annotations

from dali_nerf.interrupt import exit_process, quiet_startup

if __name__ == "__main__":
    quiet_startup()  # Ctrl-C while torch and DALI load: one line, exit 130

import torch  # noqa: E402

from dali_nerf.errors import stderr_line
from dali_nerf.data.masks import stream_sizes
from dali_nerf.data.plan import RAY_GRAPH_SOURCES, uneven_rays_note
from dali_nerf.models import build_field, build_occupancy, make_optimizer
from dali_nerf.data.seeds import init_seed
from dali_nerf.train.fieldsetup import learned_background_init, scene_space
from dali_nerf.train.runtime import DistEnv, wrap_ddp
from dali_nerf.train.tasks import Method, Task
from dali_nerf.cli.trainer import trainer_main

__all__ = ["DDPMethod", "main"]


class DDPMethod(Method):
    name = "ddp"

    def __init__(self):
        self.sync_timers = {}

    def build_tasks(self, cfg, scene, env: DistEnv, feed):
        (source,) = feed.sources
        # the DALI ray sources keep their shard's part of each global batch (the baselines split it evenly)
        ray_graph = cfg.pipeline.name in RAY_GRAPH_SOURCES
        note = uneven_rays_note(feed.plan, stream_sizes(scene)) if env.rank == 0 and ray_graph else None
        if note:
            stderr_line(note)
        self.space = scene_space(cfg, scene)  # world / ndc / contract; the field's box is in it
        aabb = self.space.aabb
        torch.manual_seed(init_seed(cfg.pipeline.seed))  # identical initial replicas (DDP also broadcasts)
        # a learned background is a parameter of the field: all-reduced, optimised, checkpointed with it
        field = build_field(cfg.model, aabb, learned_background_init(scene)).to(env.device)
        occupancy = build_occupancy(cfg.model, aabb)
        if occupancy is not None:
            occupancy = occupancy.to(env.device)
        module, timer = wrap_ddp(field, env)
        self.sync_timers["ddp"] = timer
        optimizer, scheduler = make_optimizer(field, cfg)
        return [Task("ddp", source, module, field, occupancy, optimizer, scheduler, space=self.space)]

    def eval_field(self, cfg, tasks, env):
        return tasks[0].raw_field, tasks[0].occupancy


def main(argv=None) -> int:
    return trainer_main(DDPMethod, "ddp_objects", argv)


if __name__ == "__main__":
    exit_process(main())  # after Ctrl-C: os._exit(130), no unbounded interpreter shutdown
