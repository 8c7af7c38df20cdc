"""Gaussian-splatting trainer: data parallel over images (every rank renders its B images of the
step, the gradients are averaged over the ranks), fed by the image loader.

Every rank holds the same Gaussians (:mod:`dali_nerf.models.gaussians`, from the scene's sparse
points; seeded alike) and takes its B images of each global step from
:class:`~dali_nerf.sources.images.ImageLoader` (every image once per epoch across the ranks, decoded
once per node). The gradients are all-reduced as one flat buffer per step (DDP's average; not the
DDP wrapper, whose buckets cannot follow a densification that adds and removes Gaussians), so the
replicas stay identical and every rank takes the same densification decisions (the densifier's
per-step statistics travel in the same all-reduce, summed). Rendering: gsplat's ``rasterization`` on a GPU with gsplat
installed, else our pure-torch rasteriser (the CPU path; ``splat.backend``). The loop, checkpoints
(model, optimizer, densifier state, the loader's stream position), resume on another number of
ranks, periodic and final evaluation, renders, summary and progress are the NeRF trainers'
(:mod:`dali_nerf.train.loop`).

    torchrun --nproc_per_node=2 trainers/splat.py --config configs/splat_objects.yaml [key=value ...]
    python trainers/splat.py --config configs/splat_objects.yaml         # world size 1, no torchrun
    torchrun --nproc_per_node=1 trainers/splat.py --config ... --resume  # continue on another rank count
"""

from __future__ import annotations

from dali_nerf.interrupt import exit_process, quiet_startup

if __name__ == "__main__":
    quiet_startup()  # Ctrl-C while torch and DALI load: one line, exit 130

import time  # noqa: E402
from typing import Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dali_nerf.cli.trainer import trainer_main  # noqa: E402
from dali_nerf.data.seeds import init_seed  # noqa: E402
from dali_nerf.models.gaussians import (Densifier, GaussianModel, render_camera, splat_loss,  # noqa: E402
                                       splat_optimizer)
from dali_nerf.scenes.bounds import scene_bounds  # noqa: E402
from dali_nerf.train.loop import fetch_batch  # noqa: E402
from dali_nerf.train.runtime import DistEnv  # noqa: E402
from dali_nerf.train.tasks import Method, Task  # noqa: E402

__all__ = ["SplatMethod", "initial_gaussians", "scene_scale", "main"]


def scene_scale(scene) -> float:
    """gsplat's scene scale: 1.1 x the largest distance of a camera centre from their mean."""
    pos = scene.c2w[:, :, 3].astype(np.float64)
    return 1.1 * float(np.linalg.norm(pos - pos.mean(0), axis=1).max() or 1.0)


def initial_gaussians(cfg, scene) -> GaussianModel:
    """From ``Scene.points`` (COLMAP); without them ``splat.init_points`` Gaussians uniform in the
    scene's box (its aabb, else the cameras' frusta box), random colours. Seeded by the run's seed."""
    torch.manual_seed(init_seed(cfg.pipeline.seed))
    sp = cfg.splat
    if scene.points is not None and len(scene.points):
        pts, rgb = scene.points, scene.points_rgb
    else:
        box = np.asarray(scene.aabb if scene.aabb is not None else scene_bounds(scene), np.float64)
        u = torch.rand(sp.init_points, 3, dtype=torch.float64).numpy()
        pts = box[0] + u * (box[1] - box[0])
        rgb = (torch.rand(sp.init_points, 3) * 255).to(torch.uint8).numpy()
    return GaussianModel.from_points(pts, rgb, sp.sh_degree, sp.init_opacity, sp.init_scale)


class _Sync:
    """The all-reduce of one step's gradients (their mean over the ranks) and of the densifier's
    statistics (their sum), as one flat buffer, timed on the host (``sync_s``)."""

    def __init__(self):
        self.seconds, self.measured = 0.0, True

    def __call__(self, params, world: int, extra: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if world <= 1:
            return extra
        t0 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        parts = [g.reshape(-1) for g in grads] + ([extra.reshape(-1) / world] if extra is not None else [])
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(p)
            off += n
        out = flat[off:].view_as(extra) * world if extra is not None else None  # the sum over the ranks
        self.seconds += time.perf_counter() - t0
        return out


class SplatMethod(Method):
    name = "splat"

    def __init__(self):
        self.sync_timers = {"splat": _Sync()}

    def build_tasks(self, cfg, scene, env: DistEnv, feed):
        (source,) = feed.sources  # the image loader (the registry's image_source)
        model = initial_gaussians(cfg, scene).to(env.device)
        self.scale = scene_scale(scene)
        self.env, self.seed = env, int(cfg.pipeline.seed)
        images = cfg.images.images_per_batch * env.world_size
        optimizer, scheduler = splat_optimizer(model, self.scale, cfg.train.steps, images)
        sp = cfg.splat
        self.densifier = Densifier(self.scale, sp.refine_start, sp.refine_stop, sp.refine_every, sp.reset_every,
                                   sp.grad_threshold, max_gaussians=sp.max_gaussians)
        self.background = torch.as_tensor(np.array(scene.background), dtype=torch.float32, device=env.device)
        self.backend = sp.backend
        return [Task("splat", source, model, model, None, optimizer, scheduler)]

    def train_step(self, cfg, env, task: Task, step: int, timer):
        """One data-parallel step (module doc); returns (the rank's batch MSE, pixels rendered): the
        metrics' ``loss`` / ``psnr`` columns are the images' MSE and PSNR, as the NeRF trainers' (the
        optimised loss is gsplat's L1 + SSIM)."""
        model, opt = task.raw_field, task.optimizer
        batch, m1, m2 = fetch_batch(task, timer, env.device)
        loss, mse, info = self.batch_loss(cfg, model, batch)
        b, h, w = batch["image"].shape[:3]
        m3 = timer.mark()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        m4 = timer.mark()
        sync = self.sync_timers["splat"]
        s0 = sync.seconds
        inc = self.densifier.increments(info) if self.densifier.active(step) else None
        self.densifier.add(model, sync(list(model.parameters()), env.world_size, inc))
        opt.step()
        task.scheduler.step()
        if self.densifier.due(step):
            self.densifier.refine(model, opt, step, self.seed)
        self.densifier.maybe_reset(model, opt, step)
        m5 = timer.mark()
        timer.span("h2d", m1, m2)
        timer.span("forward", m2, m3)
        timer.span("backward", m3, m4)
        timer.host("sync", sync.seconds - s0)
        timer.span("optimizer", m4, m5, sync.seconds - s0)
        return mse, b * h * w

    def batch_loss(self, cfg, model, batch: dict):
        """``(loss, mse, info)`` of a batch: its images rendered, the optimised loss (gsplat's L1 +
        SSIM, :func:`~dali_nerf.models.gaussians.splat_loss`) and the logged MSE, both over the
        batch's kept pixels when it has a ``mask`` (B, H, W) bool, as gsplat's ``simple_trainer``:
        L1 over the kept pixels, SSIM of both images with the masked pixels zeroed: a masked
        pixel's colour never reaches a gradient."""
        pixels = batch["image"].float() / 255.0
        b, h, w = pixels.shape[:3]
        colors, _, info = model.render(torch.linalg.inv(batch["camtoworld"]), batch["K"], w, h,
                                       backgrounds=self.background.expand(b, 3), backend=self.backend)
        self.used_backend = info.get("backend", self.backend)
        if info["means2d"].requires_grad:
            info["means2d"].retain_grad()
        mask = batch.get("mask")
        loss = splat_loss(colors, pixels, cfg.splat.ssim_lambda, mask)
        err = (colors.detach() - pixels) ** 2  # logged (metrics "loss", "psnr"); the step optimises ``loss``
        mse = err[mask].mean() if mask is not None and bool(mask.any()) else err.mean()
        return loss, mse, info

    def eval_field(self, cfg, tasks, env):
        return tasks[0].raw_field, None

    def render_view(self, field, sub, i: int, width: int, height: int, background):
        """(H, W, 3) render of view ``i`` of the Scene ``sub`` (evaluation)."""
        return render_camera(field, sub.c2w[i], sub.intrinsics[i], width, height, background, self.backend)

    def extra_summary(self, cfg, tasks, env, eval_scene, field, occupancy, views=None) -> dict:
        # a step takes whole images (or patches), not pipeline.rays_per_batch rays of a ray pipeline;
        # rays_per_s counts the pixels of its batches
        return {"pipeline": "images", "rays_per_batch": None,
                "gaussians": tasks[0].raw_field.num_gaussians, "images_per_batch": cfg.images.images_per_batch,
                "patch_size": cfg.images.patch_size, "scene_scale": self.scale,
                "rasteriser": getattr(self, "used_backend", None)}


def main(argv=None) -> int:
    return trainer_main(SplatMethod, "splat_objects", argv)


if __name__ == "__main__":
    exit_process(main())  # after Ctrl-C: os._exit(130), no unbounded interpreter shutdown
