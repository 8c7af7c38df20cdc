"""nerfstudio 1.1.x: a DataManager backed by :class:`~dali_nerf.RayLoader`, and ``dali-nerfacto``
(splatfacto's image datamanager and ``dali-splatfacto``: :mod:`dali_nerf.integrations.nerfstudio_splat`).

Install the extra (its own environment: ``constraints/nerfstudio.txt``, ``scripts/test_nerfstudio.sh``)
and train with::

    ns-train dali-nerfacto --data <scene>                  # transforms.json (nerfstudio-data)
    ns-train dali-nerfacto --data <scene> blender-data     # a Blender scene

Any method that uses nerfstudio's vanilla datamanager switches by config::

    from dali_nerf.integrations.nerfstudio import DaliDataManagerConfig
    config.pipeline.datamanager = DaliDataManagerConfig(dataparser=..., train_num_rays_per_batch=4096)

**Training batches.** nerfstudio's dataparser runs as usual (its orientation, centring and scale
are applied to the cameras it returns). :func:`scene_from_dataset` turns the train dataset's
cameras and image files into our :class:`~dali_nerf.Scene` (same OpenGL convention, pixel centres
at +0.5), and a RayLoader decodes this rank's shard of the images once and samples rays with our
operator while the model trains (``prefetch`` DALI runs ahead). :meth:`DaliDataManager.next_train`
returns what :class:`~nerfstudio.data.datamanagers.base_datamanager.VanillaDataManager` returns:

* ``RayBundle``: ``origins``, ``directions`` (B, 3) from our operator, ``pixel_area`` (B, 1) and
  ``metadata["directions_norm"]`` (B, 1) as nerfstudio's ``Cameras.generate_rays`` computes them,
  ``camera_indices`` (B, 1) int64 (the camera optimiser of the model keys on these);
* ``batch``: ``"image"`` (B, 3) float32 in [0, 1] (RGBA composited over the dataparser's
  ``alpha_color``), ``"indices"`` (B, 3) int64 ``(camera, row, col)`` of the train split — the
  contract of nerfstudio's pixel samplers and ``RayGenerator``.

Equality with nerfstudio's own ``RayGenerator`` applied to the same indices of the same images is
tested (``tests/nerfstudio_extra/test_datamanager.py``). Cameras that are not plain pinholes (distortion
parameters, fisheye, equirectangular) or whose rotations are not orthonormal keep our sampling and
colours but take their rays from nerfstudio's ``RayGenerator`` for the sampled indices.

**Ranks.** Under nerfstudio's launcher (``--machine.num-devices``) each rank's RayLoader decodes and
samples only its shard of the images (rank = ``torch.distributed.get_rank()``), the ``seed`` of the
config and the rank key the stream (``stream: global``: the seed alone, global batches of
``global_batch`` rays, or ``train_num_rays_per_batch`` x ranks, see :class:`DaliDataManagerConfig`).

**Unchanged from nerfstudio**: the eval dataset, ``next_eval``, ``next_eval_image`` and the eval
dataloaders (inherited). **Masks** (the dataparser's ``mask_filenames``): our RayLoader samples the
unmasked pixels only, as nerfstudio's pixel sampler does (the same pixels: tests/nerfstudio_extra/
test_masks.py). **Not supported** (a one-line ConfigError at set-up): patch
sampling (``patch_size > 1``), ``train_num_images_to_sample_from``, ``camera_res_scale_factor !=
1`` (use the dataparser's ``downscale_factor``), RGBA images without an ``alpha_color``. A resumed
``ns-train`` run restarts the ray stream at its beginning with ``stream: shard`` (nerfstudio does
not checkpoint datamanager state); with ``stream: global`` it continues at nerfstudio's step, on
any number of ranks when ``global_batch`` fixes G (else G = rays x ranks changes with them).

**LPIPS.** nerfacto's model builds torchmetrics' LPIPS at set-up, which downloads AlexNet weights
from the internet (and fails offline). ``dali-nerfacto`` uses :class:`DaliNerfactoModel`, whose
``lpips`` field is off by default: eval metrics then have no ``lpips`` entry, and set-up prints so.
``--pipeline.model.lpips True`` restores it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Literal, Optional, Tuple, Type

try:
    import nerfstudio  # noqa: F401  (first, so that a missing extra is named as such)
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("dali_nerf.integrations.nerfstudio needs nerfstudio: pip install -e '.[nerfstudio]' "
                              "(its own environment; see constraints/nerfstudio.txt)", name="nerfstudio") from e
import numpy as np
import torch
import torch.distributed as dist
import torchmetrics.image.lpip as tm_lpip  # nerfacto's populate_modules looks the LPIPS class up here
from nerfstudio.cameras.camera_optimizers import CameraOptimizerConfig
from nerfstudio.cameras.cameras import CameraType
from nerfstudio.cameras.rays import RayBundle
from nerfstudio.configs.base_config import ViewerConfig
from nerfstudio.data.datamanagers.base_datamanager import VanillaDataManager, VanillaDataManagerConfig
from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig
from nerfstudio.engine.optimizers import AdamOptimizerConfig
from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig
from nerfstudio.engine.trainer import TrainerConfig
from nerfstudio.model_components.ray_generators import RayGenerator
from nerfstudio.models.nerfacto import NerfactoModel, NerfactoModelConfig
from nerfstudio.pipelines.base_pipeline import VanillaPipelineConfig
from nerfstudio.plugins.types import MethodSpecification
from nerfstudio.utils.rich_utils import CONSOLE

from dali_nerf import RayLoader, Scene
from dali_nerf.data.plan import SamplingPlan, global_batch_share
from dali_nerf.sources import make_source
from dali_nerf.errors import ConfigError
from dali_nerf.data.imageio import read_header

__all__ = [
    "DaliDataManagerConfig", "DaliDataManager", "DaliNerfactoModelConfig", "DaliNerfactoModel",
    "scene_from_dataset", "pinhole_ray_terms", "dali_nerfacto",
]


def scene_from_dataset(dataset, split: str = "train") -> Scene:
    """nerfstudio ``InputDataset`` (its cameras after the dataparser's transform and scale) ->
    our :class:`~dali_nerf.Scene` of the same images in the same order (camera index = position).

    Masks (``mask_filenames``) go with the images, which they match in size (nerfstudio asserts it).
    Raises ConfigError for what the RayLoader cannot reproduce (RGBA without alpha colour). The
    cameras' lenses are left to nerfstudio's RayGenerator (DaliDataManager); the image datamanager
    adds them (:func:`dali_nerf.integrations.nerfstudio_splat.image_scene_from_dataset`).
    """
    out = dataset._dataparser_outputs
    cams = dataset.cameras
    paths = [Path(p) for p in out.image_filenames]
    n = len(paths)
    if cams.camera_to_worlds.shape[0] != n:
        raise ConfigError(f"pipeline.datamanager: {cams.camera_to_worlds.shape[0]} cameras for {n} images; "
                          f"DaliDataManager needs one camera per image")
    if out.alpha_color is None and paths and read_header(paths[0]).channels == 4:
        raise ConfigError(f"{paths[0]}: RGBA image and the dataparser has no alpha_color; set one "
                          f"(e.g. blender-data --alpha-color white)")
    bg = np.ones(3, np.float32) if out.alpha_color is None else out.alpha_color.detach().cpu().numpy()
    c2w = cams.camera_to_worlds.detach().cpu().numpy()
    intr = torch.cat([cams.fx, cams.fy, cams.cx, cams.cy], -1).detach().cpu().numpy()
    wfs = np.eye(4)
    wfs[:3, :] = out.dataparser_transform.detach().cpu().numpy()
    wfs[:3, :] *= float(out.dataparser_scale)
    aabb = out.scene_box.aabb.detach().cpu().numpy() if out.scene_box is not None else None
    wh = np.stack([cams.width.reshape(-1).cpu().numpy(), cams.height.reshape(-1).cpu().numpy()], 1)
    masks = {} if out.mask_filenames is None else dict(mask_paths=[str(p) for p in out.mask_filenames], mask_wh=wh)
    return Scene(image_paths=tuple(str(p) for p in paths), c2w=c2w, intrinsics=intr, width=wh[:, 0], height=wh[:, 1],
                 split=split, format="nerfstudio-dataparser", root=str(paths[0].parent if paths else "."),
                 background=bg, world_from_source=wfs, aabb=aabb, **masks)


def _pinhole_ok(cams) -> bool:
    """True when every camera is an undistorted pinhole with an orthonormal rotation, so that
    :func:`pinhole_ray_terms` equals ``Cameras.generate_rays``."""
    if not bool((cams.camera_type == CameraType.PERSPECTIVE.value).all()):
        return False
    if cams.distortion_params is not None and bool((cams.distortion_params != 0).any()):
        return False
    r = cams.camera_to_worlds[:, :3, :3].double()
    eye = torch.eye(3, dtype=torch.float64)
    return bool(((r.transpose(1, 2) @ r - eye).abs().max() < 1e-4).all())


def pinhole_ray_terms(indices: torch.Tensor, intr: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """nerfstudio's ``pixel_area`` and ``directions_norm`` of pinhole rays, from indices alone.

    Args:
        indices: (B, 3) int64 (camera, row, col).
        intr: (N, 4) float32 fx, fy, cx, cy per camera (same device).
    Returns:
        pixel_area (B, 1), directions_norm (B, 1) float32: ``Cameras.generate_rays``'s values for
        cameras with orthonormal rotations (the norms and distances it measures in world space are
        the camera-space ones), computed without the rotation.

    On the CPU the arithmetic runs in numpy, single-threaded: the RayLoader's DALI threads share
    the cores, and torch's multi-threaded small ops then waited 10-20 ms per op on a 2-core machine
    (measured; 0.2 ms with one thread). On a GPU it runs in torch.
    """
    lib, xp = (torch, indices) if indices.is_cuda else (np, indices.numpy())
    k = (intr if indices.is_cuda else intr.numpy())[xp[:, 0]]
    fx, fy, cx, cy = k[:, 0], k[:, 1], k[:, 2], k[:, 3]
    x = xp[:, 2].astype(np.float32) + np.float32(0.5) if lib is np else xp[:, 2].to(torch.float32) + 0.5
    y = xp[:, 1].astype(np.float32) + np.float32(0.5) if lib is np else xp[:, 1].to(torch.float32) + 0.5
    u, v = (x - cx) / fx, (y - cy) / fy
    u1, v1 = (x - cx + 1) / fx, (y - cy + 1) / fy
    n0 = lib.sqrt(u * u + v * v + 1)  # |(u, -v, -1)|
    nx = lib.sqrt(u1 * u1 + v * v + 1)
    ny = lib.sqrt(u * u + v1 * v1 + 1)
    # |d0 - dx| and |d0 - dy| of the unit directions, component by component as nerfstudio does
    dx = lib.sqrt((u / n0 - u1 / nx) ** 2 + (v / n0 - v / nx) ** 2 + (1 / n0 - 1 / nx) ** 2)
    dy = lib.sqrt((u / n0 - u / ny) ** 2 + (v / n0 - v1 / ny) ** 2 + (1 / n0 - 1 / ny) ** 2)
    area, norm = (dx * dy)[:, None], n0[:, None]
    if lib is np:
        return torch.from_numpy(np.ascontiguousarray(area, np.float32)), torch.from_numpy(np.ascontiguousarray(norm, np.float32))
    return area, norm


@dataclass
class DaliDataManagerConfig(VanillaDataManagerConfig):
    """VanillaDataManagerConfig whose training rays come from dali_nerf's RayLoader."""

    _target: Type = field(default_factory=lambda: DaliDataManager)
    """Target class to instantiate."""
    seed: int = 0
    """Seed of the ray stream; each rank's stream is keyed by (seed, rank)."""
    prefetch: int = 2
    """DALI runs computed ahead of training (0 = synchronous sampling)."""
    num_threads: int = 0
    """DALI threads per rank (decode once, then sampling); 0 = the host's budget per local rank, as
    the trainers' (dali_nerf.data.plan: usable cores / LOCAL_WORLD_SIZE - 1, 1 to 4)."""
    rays_per_run: int = 0
    """Rays one DALI run samples (several steps; does not change the ray stream); 0 = the host's
    budget (65536 per sampler thread, at most 262144)."""
    sampler_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the decoded images live and rays are sampled: auto = the datamanager's device."""
    stream: Literal["shard", "global"] = "shard"
    """shard: each rank's own stream over its image shard, train_num_rays_per_batch rays a step.
    global: the split's stream of global batches (G = global_batch, or train_num_rays_per_batch x
    ranks, rays a step: the same batches on any number of ranks for the same G, every pixel once
    per epoch across ranks); a rank's batch is the part in its shard (its size varies around
    G / ranks), and the first batch is nerfstudio's step's (a resumed ns-train continues the
    stream, on any number of ranks when global_batch keeps G).
    nerfstudio's losses average over the rank's batch, so under DDP the ranks' rays are weighted
    by 1 / their count rather than 1 / G: shard is the default."""
    global_batch: int = 0
    """stream: global only: G, rays of all ranks a step, whatever the number of devices (each rank
    samples G / ranks rays a step on average, in place of train_num_rays_per_batch; the ranks must
    divide G). nerfstudio's checkpoint does not store G: set it to restart ns-train on another
    device count with the same stream. 0 = G is train_num_rays_per_batch x ranks."""


class DaliDataManager(VanillaDataManager):
    """VanillaDataManager with ``next_train`` served by a RayLoader (see the module docstring).

    The RayLoader (DALI decode of this rank's image shard, then our ray-sampler operator) is built
    at the first ``next_train``, so constructing the datamanager reads no image.
    """

    config: DaliDataManagerConfig

    def setup_train(self):
        c = self.config
        if c.patch_size != 1:
            raise ConfigError(f"pipeline.datamanager.patch-size: DaliDataManager samples single pixels, got {c.patch_size}")
        if c.train_num_images_to_sample_from != -1:
            raise ConfigError("pipeline.datamanager.train-num-images-to-sample-from: DaliDataManager samples every "
                              "image of the rank's shard; leave it at -1")
        if c.camera_res_scale_factor != 1.0:
            raise ConfigError("pipeline.datamanager.camera-res-scale-factor: must be 1.0 with DaliDataManager; "
                              "downscale with the dataparser's --downscale-factor instead")
        self.train_scene = scene_from_dataset(self.train_dataset, "train")
        cams = self.train_dataset.cameras
        self.train_ray_generator = RayGenerator(cams.to(self.device))
        self.register_buffer("train_intrinsics", torch.cat([cams.fx, cams.fy, cams.cx, cams.cy], -1).float(),
                             persistent=False)
        self.pinhole = _pinhole_ok(cams)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(self.local_rank)
        self._rays_per_batch()  # a global_batch that cannot be: refused at set-up
        self._loader: Optional[RayLoader] = None
        self._iter = None
        CONSOLE.print(f"DaliDataManager: rank {self.rank}/{self.world_size}, {self.train_scene.num_images} train images; "
                      f"rays {'from the dali_nerf operator' if self.pinhole else 'from nerfstudio RayGenerator (non-pinhole cameras)'}")

    def _rays_per_batch(self) -> int:
        """train_num_rays_per_batch, or G / ranks with ``global_batch`` G (one-line refusals)."""
        c, W = self.config, int(self.world_size)
        G = int(c.global_batch)
        if not G:
            return int(c.train_num_rays_per_batch)
        key = f"pipeline.datamanager.global-batch={G}"
        if G < 0:
            raise ConfigError(f"{key}: must be >= 0")
        if c.stream != "global":
            raise ConfigError(f"{key}: fixes the global stream's batch; add --pipeline.datamanager.stream global "
                              f"or leave it 0")
        return global_batch_share(G, W, key, "devices")

    def _sampler_device(self) -> str:
        dev = torch.device(self.device)
        want = self.config.sampler_device
        return ("cuda" if dev.type == "cuda" else "cpu") if want == "auto" else want

    def _start(self) -> None:
        c = self.config
        sdev = self._sampler_device()
        ctx = torch.cuda.device(torch.device(self.device)) if sdev == "cuda" else contextlib.nullcontext()
        with ctx:
            plan = SamplingPlan.for_loader(self._rays_per_batch(), rank=self.rank, world_size=int(self.world_size),
                                           seed=c.seed, prefetch=c.prefetch, device=sdev,
                                           num_threads=c.num_threads or None, rays_per_run=c.rays_per_run or None,
                                           stream=c.stream)
            self._loader = make_source("rays", self.train_scene, plan,
                                       output_map=("origins", "directions", "rgb", "indices"))
        self._iter = iter(self._loader)

    def next_train(self, step: int) -> Tuple[RayBundle, Dict]:
        """(RayBundle of B rays, {"image": (B, 3) float32, "indices": (B, 3) int64}) on ``self.device``."""
        self.train_count += 1
        if self._iter is None:
            self._start()
            if self.config.stream == "global":  # the stream's state is the global step: nerfstudio's
                self._loader.set_step(int(step))
        b = next(self._iter)
        dev = self.train_intrinsics.device
        idx = b["indices"].to(dev, non_blocking=True)
        batch = {"image": b["rgb"].to(dev, non_blocking=True), "indices": idx}
        if not self.pinhole:
            return self.train_ray_generator(idx), batch
        area, dnorm = pinhole_ray_terms(idx, self.train_intrinsics)
        bundle = RayBundle(origins=b["origins"].to(dev, non_blocking=True),
                           directions=b["directions"].to(dev, non_blocking=True),
                           pixel_area=area, camera_indices=idx[:, :1].contiguous(),
                           metadata={"directions_norm": dnorm})
        return bundle, batch

    def get_train_rays_per_batch(self) -> int:
        return self._rays_per_batch()

    def loader_stats(self) -> dict:
        """The RayLoader's ``stats()`` (steps, wait_s, stall_fraction, rays_per_s, ...); {} before the first step."""
        return self._loader.stats() if self._loader is not None else {}

    def close(self) -> None:
        """Stop the RayLoader's DALI pipeline (also done at interpreter exit)."""
        if self._loader is not None:
            self._loader.close()
            self._loader, self._iter = None, None


class _LpipsOff(torch.nn.Module):
    """Takes the place of torchmetrics' LPIPS when ``lpips`` is off: built without downloading
    anything; its NaN is dropped from the eval metrics by DaliNerfactoModel."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, gt, pred):
        return torch.tensor(float("nan"))


@dataclass
class DaliNerfactoModelConfig(NerfactoModelConfig):
    """nerfacto with LPIPS optional (its AlexNet weights come from the internet)."""

    _target: Type = field(default_factory=lambda: DaliNerfactoModel)
    """Target class to instantiate."""
    lpips: bool = False
    """Report LPIPS in eval metrics. torchmetrics downloads AlexNet weights on set-up, which fails
    offline; off by default."""


class DaliNerfactoModel(NerfactoModel):
    """NerfactoModel whose LPIPS metric is built only when ``config.lpips`` is true."""

    config: DaliNerfactoModelConfig

    def populate_modules(self):
        if self.config.lpips:
            super().populate_modules()
            return
        real = tm_lpip.LearnedPerceptualImagePatchSimilarity
        tm_lpip.LearnedPerceptualImagePatchSimilarity = _LpipsOff  # nerfacto builds self.lpips from this name
        try:
            super().populate_modules()
        finally:
            tm_lpip.LearnedPerceptualImagePatchSimilarity = real
        CONSOLE.print("dali-nerfacto: LPIPS metric disabled (its AlexNet weights download from the internet); "
                      "enable with --pipeline.model.lpips True")

    def get_image_metrics_and_images(self, outputs, batch):
        metrics, images = super().get_image_metrics_and_images(outputs, batch)
        if not self.config.lpips:
            metrics.pop("lpips", None)
        return metrics, images


def _dali_nerfacto_config() -> TrainerConfig:
    """nerfstudio 1.1.5's ``nerfacto`` method config with DaliDataManager and DaliNerfactoModel."""
    return TrainerConfig(
        method_name="dali-nerfacto",
        steps_per_eval_batch=500,
        steps_per_save=2000,
        max_num_iterations=30000,
        mixed_precision=True,
        pipeline=VanillaPipelineConfig(
            datamanager=DaliDataManagerConfig(
                dataparser=NerfstudioDataParserConfig(),
                train_num_rays_per_batch=4096,
                eval_num_rays_per_batch=4096,
            ),
            model=DaliNerfactoModelConfig(
                eval_num_rays_per_chunk=1 << 15,
                average_init_density=0.01,
                camera_optimizer=CameraOptimizerConfig(mode="SO3xR3"),
            ),
        ),
        optimizers={
            "proposal_networks": {
                "optimizer": AdamOptimizerConfig(lr=1e-2, eps=1e-15),
                "scheduler": ExponentialDecaySchedulerConfig(lr_final=0.0001, max_steps=200000),
            },
            "fields": {
                "optimizer": AdamOptimizerConfig(lr=1e-2, eps=1e-15),
                "scheduler": ExponentialDecaySchedulerConfig(lr_final=0.0001, max_steps=200000),
            },
            "camera_opt": {
                "optimizer": AdamOptimizerConfig(lr=1e-3, eps=1e-15),
                "scheduler": ExponentialDecaySchedulerConfig(lr_final=1e-4, max_steps=5000),
            },
        },
        viewer=ViewerConfig(num_rays_per_chunk=1 << 15),
        vis="viewer",
    )


dali_nerfacto = MethodSpecification(
    config=_dali_nerfacto_config(),
    description="nerfacto with dali_nerf's RayLoader as its train datamanager (decode once, C++ ray sampler, "
                "prefetch; one image shard per rank); LPIPS off by default (offline)",
)
"""Registered as ``dali-nerfacto`` through the ``nerfstudio.method_configs`` entry point (setup.cfg)."""
