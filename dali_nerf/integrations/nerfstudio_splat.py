"""nerfstudio 1.1.x, Gaussian splatting: splatfacto's FullImageDatamanager backed by
:class:`~dali_nerf.ImageLoader` (:class:`DaliFullImageDatamanager`: its docstring says what it
returns and where it differs from nerfstudio's), and the ``dali-splatfacto`` method.

    ns-train dali-splatfacto --data <scene>                # transforms.json (nerfstudio-data)

Any FullImageDatamanager method switches by config::

    from dali_nerf.integrations.nerfstudio_splat import DaliFullImageDatamanagerConfig
    config.pipeline.datamanager = DaliFullImageDatamanagerConfig(dataparser=..., cache_images_type="uint8")

splatfacto renders with gsplat's CUDA kernels: on a machine without a GPU the datamanager and the
method's config work (tests/nerfstudio_extra/test_splat_datamanager.py), training does not.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Type

import numpy as np
import torch
import torch.distributed as dist
from nerfstudio.cameras.cameras import Cameras, CameraType
from nerfstudio.configs.base_config import ViewerConfig
from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager, FullImageDatamanagerConfig
from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig
from nerfstudio.engine.optimizers import AdamOptimizerConfig
from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig
from nerfstudio.engine.trainer import TrainerConfig
from nerfstudio.pipelines.base_pipeline import VanillaPipelineConfig
from nerfstudio.plugins.types import MethodSpecification
from nerfstudio.utils import comms
from nerfstudio.utils.rich_utils import CONSOLE

from dali_nerf import Scene
from dali_nerf.errors import ConfigError
from dali_nerf.integrations.nerfstudio import scene_from_dataset
from dali_nerf.launch_env import launch_env
from dali_nerf.scenes._util import lens_arrays
from dali_nerf.sources.registry import image_loader

__all__ = ["DaliFullImageDatamanagerConfig", "DaliFullImageDatamanager", "image_scene_from_dataset", "dali_splatfacto"]


def image_scene_from_dataset(dataset, split: str = "train") -> Scene:
    """:func:`~dali_nerf.integrations.nerfstudio.scene_from_dataset` with the cameras' lenses
    (:func:`_lens_from_cameras`): its images are undistorted at decode and its ``intrinsics`` are
    the undistorted pinholes'."""
    scene = scene_from_dataset(dataset, split)
    wh = np.stack([scene.width, scene.height], 1)
    got = _lens_from_cameras(dataset.cameras, np.asarray(scene.intrinsics, np.float64), wh, scene.image_paths)
    if got is None:
        return scene
    return dataclasses.replace(scene, intrinsics=got[0], distortion=got[1], fisheye=got[2], file_intrinsics=got[3],
                               file_wh=wh)


def _lens_from_cameras(cams, intr: np.ndarray, wh: np.ndarray, paths) -> Optional[tuple]:
    """nerfstudio's lenses as our Scene's (:func:`dali_nerf.scenes._util.lens_arrays`): None when no
    camera is distorted; else (undistorted intrinsics (N, 4), OpenCV coefficients (N, 8), fisheye
    (N,), the files' intrinsics (N, 4)). nerfstudio's ``distortion_params`` are (k1, k2, k3, k4, p1,
    p2): a PERSPECTIVE camera's go to OpenCV's (k1, k2, p1, p2, k3) as nerfstudio's own image
    undistortion orders them (its k4 must be 0, as there); FISHEYE's k1..k4 to ``cv2.fisheye``.
    Other camera types: a one-line ConfigError naming the first such image."""
    n = len(paths)
    types = cams.camera_type.reshape(-1).cpu().numpy()
    if types.size == 1 and n > 1:
        types = np.repeat(types, n)
    known = {CameraType.PERSPECTIVE.value, CameraType.FISHEYE.value}
    bad = np.flatnonzero(~np.isin(types, list(known)))
    if len(bad):
        i = int(bad[0])
        raise ConfigError(f"{paths[i]}: camera type {CameraType(int(types[i])).name} has no undistorted pinhole image; "
                          f"the image datamanager takes PERSPECTIVE and FISHEYE cameras (else use splatfacto's own "
                          f"FullImageDatamanager)")
    fisheye = types == CameraType.FISHEYE.value
    if cams.distortion_params is None and not fisheye.any():
        return None
    d = (np.zeros((n, 6)) if cams.distortion_params is None
         else cams.distortion_params.detach().cpu().numpy().astype(np.float64).reshape(-1, 6))
    if len(d) == 1 and n > 1:  # one camera for every image
        d = np.repeat(d, n, 0)
    coef = np.zeros((n, 8), np.float64)
    persp = ~fisheye
    if np.any(d[persp, 3] != 0):
        i = int(np.flatnonzero(persp & (d[:, 3] != 0))[0])
        raise ConfigError(f"{paths[i]}: PERSPECTIVE camera with k4={d[i, 3]:g}; nerfstudio's image undistortion takes "
                          f"k1, k2, k3, p1, p2 only, and so does this datamanager")
    coef[persp, :5] = d[persp][:, [0, 1, 4, 5, 2]]
    coef[fisheye, :4] = d[fisheye, :4]
    return lens_arrays(intr.astype(np.float64), wh, wh, wh, coef, fisheye)


@dataclass
class DaliFullImageDatamanagerConfig(FullImageDatamanagerConfig):
    """FullImageDatamanagerConfig (splatfacto's) whose training images come from dali_nerf's
    ImageLoader: decoded once per node, held once, each image once per epoch across the ranks, in
    the order ``train_cameras_sampling_seed`` defines (``random`` sampling only)."""

    _target: Type = field(default_factory=lambda: DaliFullImageDatamanager)
    """Target class to instantiate."""
    prefetch: int = 2
    """Batches built ahead of training (>= 1)."""
    num_threads: int = 2
    """DALI decode threads of this rank."""
    max_bytes: int = 0
    """Decoded pixels the node may hold; beyond it the split streams through windows (decoded
    again each epoch). 0 = half the node's physical memory."""


class DaliFullImageDatamanager(FullImageDatamanager):
    """splatfacto's datamanager with ``next_train`` served by an :class:`~dali_nerf.ImageLoader`.

    nerfstudio's FullImageDatamanager decodes (and undistorts) every training image in every
    process before the first step and keeps them (on the GPU up to 500 images); here the images
    are decoded once per node with DALI, into memory the node's ranks share, and one thread builds
    the next batches while the model trains. ``next_train`` returns nerfstudio's ``(camera,
    data)``: ``camera`` the image's (1,) :class:`Cameras` with ``metadata["cam_idx"]``, ``data``
    {``image_idx``, ``image`` (H, W, 3) uint8 (or float32 / 255 with ``cache_images_type:
    float32``) on the device, ``mask`` (H, W, 1) bool on the host where the dataparser has masks
    (splatfacto moves it)}. RGB images equal nerfstudio's bit for bit (tested).

    What differs from nerfstudio's:

    * the order: every training image exactly once per epoch across all ranks (nerfstudio: each
      rank shuffles the whole split by itself), defined by ``train_cameras_sampling_seed`` alone
      (``fps`` sampling is refused); a resumed ``ns-train`` places it at its step (the loader's
      ``set_step``): exactly where it stopped on the same number of devices (nerfstudio's
      checkpoint does not say how many there were);
    * distorted cameras (PERSPECTIVE k1, k2, k3, p1, p2; FISHEYE k1..k4, also all zero: the
      equidistant model, which nerfstudio then leaves as it is) are undistorted to the same size
      with alpha = 0 (:func:`dali_nerf.scenes._util.undistorted_intrinsics`), the cameras handed out
      being those pinholes (also after nerfstudio caches its eval images, which resets its own
      ``train_cameras``); nerfstudio crops to OpenCV's valid region instead. Masks are undistorted
      with their images (nearest-neighbour); the eval side is nerfstudio's own;
    * RGBA images composited over the dataparser's ``alpha_color`` round where nerfstudio's uint8
      path truncates (within 1); a ``mask_color`` is refused; the dataset's other keys (depth
      images) are not carried; ``cache_images`` and ``max_thread_workers`` have no effect.

    Ranks: under torchrun the node's ranks are torchrun's; under nerfstudio's own launcher (no
    torchrun variables) they are its per-machine process group's. In ``test_mode="inference"``
    (``ns-render``, ``ns-export``) nothing of the training split is read, as nerfstudio does.
    """

    config: DaliFullImageDatamanagerConfig

    def __init__(self, config: DaliFullImageDatamanagerConfig, device="cpu", test_mode="val", world_size: int = 1,
                 local_rank: int = 0, **kwargs):
        key = "pipeline.datamanager"
        if config.camera_res_scale_factor != 1.0:
            raise ConfigError(f"{key}.camera-res-scale-factor: must be 1.0 with DaliFullImageDatamanager; "
                              f"downscale with the dataparser's --downscale-factor instead")
        if config.train_cameras_sampling_strategy != "random":
            raise ConfigError(f"{key}.train-cameras-sampling-strategy: DaliFullImageDatamanager takes random (each image "
                              f"once an epoch, in the seed's order), got {config.train_cameras_sampling_strategy!r}")
        super().__init__(config, device=device, test_mode=test_mode, world_size=world_size, local_rank=local_rank,
                         **kwargs)
        self._loader, self._started = None, False
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(self.local_rank)
        if test_mode == "inference":  # nerfstudio opens no image then (its dataparser's downscale is 1)
            self.train_scene, self._pinholes = None, None
            return
        if self.train_dataset.mask_color is not None:
            raise ConfigError(f"{key}.dataparser: mask_color {self.train_dataset.mask_color} fills masked pixels in "
                              f"nerfstudio's images; DaliFullImageDatamanager does not: drop it (splatfacto masks the "
                              f"loss with the mask instead)")
        self.train_scene = image_scene_from_dataset(self.train_dataset, "train")
        sc = self.train_scene
        cams = copy.deepcopy(self.train_dataset.cameras)
        k = torch.from_numpy(np.array(sc.intrinsics, np.float32))
        for j, name in enumerate(("fx", "fy", "cx", "cy")):  # the undistorted pinholes the images are
            setattr(cams, name, k[:, j:j + 1].to(getattr(cams, name).dtype).contiguous())
        if cams.distortion_params is not None:
            cams.distortion_params = torch.zeros_like(cams.distortion_params)
        cams.camera_type = torch.full_like(cams.camera_type, CameraType.PERSPECTIVE.value)
        self._pinholes = cams.to(self.device)
        local_rank, local_world, share = self._node()
        try:  # built now (its images are decoded at the first batch): a bad setting fails before the model
            self._loader = image_loader(sc, images_per_batch=1, rank=self.rank, world_size=int(self.world_size),
                                        seed=int(config.train_cameras_sampling_seed), prefetch=config.prefetch,
                                        max_bytes=config.max_bytes or None, local_rank=local_rank,
                                        local_world_size=local_world, share_key=share, num_threads=config.num_threads)
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
        if self.rank == 0:
            CONSOLE.print(f"DaliFullImageDatamanager: {self.world_size} rank(s), {sc.num_images} train images decoded "
                          f"once per node{' (undistorted)' if sc.distortion is not None else ''}")

    @property
    def train_cameras(self):
        """The training cameras handed out: the undistorted pinholes of the images we decode.
        nerfstudio's ``_load_images`` assigns its own here whenever it caches a split (also the eval
        split); those assignments are ignored."""
        return self._pinholes

    @train_cameras.setter
    def train_cameras(self, value) -> None:
        pass

    def _node(self) -> tuple:
        """(local_rank, local_world_size, share_key) for the ImageLoader (see the class docstring):
        torchrun's variables (the loader's defaults); nerfstudio's launcher's per-machine process
        group (``nerfstudio.utils.comms``) and, for the key, the launcher's process id, the parent
        of every rank it spawned on this machine (no collective call: nerfstudio does not set each
        rank's CUDA device, which NCCL's object collectives need); else this rank alone."""
        if launch_env().run_id or int(self.world_size) == 1:
            return None, None, None
        if comms.is_dist_avail_and_initialized() and comms.LOCAL_PROCESS_GROUP is not None:
            return comms.get_local_rank(), comms.get_local_size(), f"nerfstudio/{os.getppid()}"
        CONSOLE.print("DaliFullImageDatamanager: ranks not launched by torchrun or nerfstudio's launcher: each holds "
                      "its own copy of the decoded images")
        return 0, 1, None

    def next_train(self, step: int) -> Tuple[Cameras, Dict]:
        """This rank's image of global step ``step`` (the first call places the stream there)."""
        if self._loader is None:
            raise RuntimeError("DaliFullImageDatamanager: no training images in test_mode='inference'")
        self.train_count += 1
        if not self._started:
            self._loader.set_step(int(step))  # nerfstudio keeps no datamanager state: its step is the stream's
            self._started = True
        b = next(self._loader)
        idx = int(b["image_id"][0])
        image = b["image"][0].to(self.device)
        if self.config.cache_images_type == "float32":  # nerfstudio's get_image_float32: uint8 / 255.0
            image = image.float() / 255.0
        data = {"image_idx": idx, "image": image}
        if "mask" in b:
            data["mask"] = b["mask"][0, :, :, None]
        camera = self.train_cameras[idx:idx + 1].to(self.device)
        camera.metadata = dict(camera.metadata or {}, cam_idx=idx)
        return camera, data

    def get_train_rays_per_batch(self) -> int:
        """Pixels of the first training image (nerfstudio's rule), without decoding the split."""
        if self.train_scene is None:  # inference: nerfstudio's own answer
            return super().get_train_rays_per_batch()
        return int(self.train_scene.width[0]) * int(self.train_scene.height[0])

    def loader_stats(self) -> dict:
        """The ImageLoader's ``stats()`` (wait_s, stall_fraction, images_per_s, decode_closed, ...); {} in
        inference mode."""
        return self._loader.stats() if self._loader is not None else {}

    def close(self) -> None:
        """Stop the ImageLoader (also done at interpreter exit)."""
        if self._loader is not None:
            self._loader.close()
            self._loader = None


def _dali_splatfacto_config() -> TrainerConfig:
    """nerfstudio 1.1.5's ``splatfacto`` method config with DaliFullImageDatamanager (its settings,
    optimisers and schedules as nerfstudio's method_configs has them)."""
    from nerfstudio.models.splatfacto import SplatfactoModelConfig  # imports gsplat: only when the method is built

    def adam(lr, sched=None):
        return {"optimizer": AdamOptimizerConfig(lr=lr, eps=1e-15), "scheduler": sched}

    return TrainerConfig(
        method_name="dali-splatfacto",
        steps_per_eval_image=100,
        steps_per_eval_batch=0,
        steps_per_save=2000,
        steps_per_eval_all_images=1000,
        max_num_iterations=30000,
        mixed_precision=False,
        pipeline=VanillaPipelineConfig(
            datamanager=DaliFullImageDatamanagerConfig(
                dataparser=NerfstudioDataParserConfig(load_3D_points=True),
                cache_images_type="uint8",
            ),
            model=SplatfactoModelConfig(),
        ),
        optimizers={
            "means": adam(1.6e-4, ExponentialDecaySchedulerConfig(lr_final=1.6e-6, max_steps=30000)),
            "features_dc": adam(0.0025),
            "features_rest": adam(0.0025 / 20),
            "opacities": adam(0.05),
            "scales": adam(0.005),
            "quats": adam(0.001),
            "camera_opt": adam(1e-4, ExponentialDecaySchedulerConfig(lr_final=5e-7, max_steps=30000, warmup_steps=1000,
                                                                     lr_pre_warmup=0)),
            "bilateral_grid": adam(2e-3, ExponentialDecaySchedulerConfig(lr_final=1e-4, max_steps=30000,
                                                                         warmup_steps=1000, lr_pre_warmup=0)),
        },
        viewer=ViewerConfig(num_rays_per_chunk=1 << 15),
        vis="viewer",
    )


dali_splatfacto = MethodSpecification(
    config=_dali_splatfacto_config(),
    description="splatfacto with dali_nerf's ImageLoader as its train datamanager (decode once per node, each image "
                "once per epoch across ranks, batches built ahead, resumes its order at the step)",
)
"""Registered as ``dali-splatfacto`` through the ``nerfstudio.method_configs`` entry point (setup.cfg)."""
