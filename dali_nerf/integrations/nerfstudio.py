"""nerfstudio 1.1.x: a DataManager backed by :class:`~dali_nerf.RayLoader`, and ``dali-nerfacto``;
a FullImageDatamanager backed by :class:`~dali_nerf.ImageLoader`, and ``dali-splatfacto``
(:class:`DaliFullImageDatamanager`: its docstring says what it returns and where it differs).

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
import copy
import secrets
import socket
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
from nerfstudio.cameras.cameras import Cameras
from nerfstudio.data.datamanagers.base_datamanager import VanillaDataManager, VanillaDataManagerConfig
from nerfstudio.data.datamanagers.full_images_datamanager import FullImageDatamanager, FullImageDatamanagerConfig
from nerfstudio.data.dataparsers.nerfstudio_dataparser import NerfstudioDataParserConfig
from nerfstudio.engine.optimizers import AdamOptimizerConfig
from nerfstudio.engine.schedulers import ExponentialDecaySchedulerConfig
from nerfstudio.engine.trainer import TrainerConfig
from nerfstudio.model_components.ray_generators import RayGenerator
from nerfstudio.models.nerfacto import NerfactoModel, NerfactoModelConfig
from nerfstudio.pipelines.base_pipeline import VanillaPipelineConfig
from nerfstudio.plugins.types import MethodSpecification
from nerfstudio.utils.rich_utils import CONSOLE

from dali_nerf import ImageLoader, RayLoader, Scene
from dali_nerf.launch_env import launch_env
from dali_nerf.scenes._util import lens_arrays
from dali_nerf.data.plan import SamplingPlan, global_batch_share
from dali_nerf.sources import make_source
from dali_nerf.errors import ConfigError
from dali_nerf.data.imageio import read_header

__all__ = [
    "DaliDataManagerConfig", "DaliDataManager", "DaliNerfactoModelConfig", "DaliNerfactoModel",
    "scene_from_dataset", "pinhole_ray_terms", "dali_nerfacto",
    "DaliFullImageDatamanagerConfig", "DaliFullImageDatamanager", "dali_splatfacto",
]


def scene_from_dataset(dataset, split: str = "train", undistort: bool = False) -> Scene:
    """nerfstudio ``InputDataset`` (its cameras after the dataparser's transform and scale) ->
    our :class:`~dali_nerf.Scene` of the same images in the same order (camera index = position).

    Masks (``mask_filenames``) go with the images, which they match in size (nerfstudio asserts it).
    Raises ConfigError for what the RayLoader cannot reproduce (RGBA without alpha colour).
    ``undistort``: the cameras' lenses go with the Scene (:func:`_lens_from_cameras`), so that its
    images are undistorted at decode and its ``intrinsics`` are the undistorted pinholes' (the image
    datamanager's); else the lenses are left to nerfstudio's RayGenerator (the ray datamanager's).
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
    lens = {}
    if undistort:
        got = _lens_from_cameras(cams, intr, wh, paths)
        if got is not None:
            intr = got[0]
            lens = dict(distortion=got[1], fisheye=got[2], file_intrinsics=got[3], file_wh=wh)
    return Scene(image_paths=tuple(str(p) for p in paths), c2w=c2w, intrinsics=intr, width=wh[:, 0], height=wh[:, 1],
                 split=split, format="nerfstudio-dataparser", root=str(paths[0].parent if paths else "."),
                 background=bg, world_from_source=wfs, aabb=aabb, **masks, **lens)


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
         else cams.distortion_params.detach().cpu().numpy().astype(np.float64).reshape(n, 6))
    dist = np.zeros((n, 8), np.float64)
    persp = ~fisheye
    if np.any(d[persp, 3] != 0):
        i = int(np.flatnonzero(persp & (d[:, 3] != 0))[0])
        raise ConfigError(f"{paths[i]}: PERSPECTIVE camera with k4={d[i, 3]:g}; nerfstudio's image undistortion takes "
                          f"k1, k2, k3, p1, p2 only, and so does this datamanager")
    dist[persp, :5] = d[persp][:, [0, 1, 4, 5, 2]]
    dist[fisheye, :4] = d[fisheye, :4]
    return lens_arrays(intr.astype(np.float64), wh, wh, wh, dist, fisheye)


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


@dataclass
class DaliFullImageDatamanagerConfig(FullImageDatamanagerConfig):
    """FullImageDatamanagerConfig (splatfacto's) whose training images come from dali_nerf's
    ImageLoader: decoded once per node, held once, each image once per epoch across the ranks."""

    _target: Type = field(default_factory=lambda: DaliFullImageDatamanager)
    """Target class to instantiate."""
    seed: int = 0
    """Seed of the image order (every training image once per epoch across all ranks)."""
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
    the next batches while the model trains. ``next_train`` returns what nerfstudio's does:
    ``(camera, data)``, ``camera`` the image's (1,) :class:`Cameras` with ``metadata["cam_idx"]``,
    ``data`` {``image_idx``, ``image`` (H, W, 3) uint8 (or float32 / 255 with
    ``cache_images_type: float32``), ``mask`` (H, W, 1) bool where the dataparser has masks}.

    What differs from nerfstudio's:

    * the order: every training image exactly once per epoch across all ranks (nerfstudio: each
      rank shuffles the whole split by itself), defined by ``seed`` alone; a resumed ``ns-train``
      places it at its step (the loader's ``set_step``): exactly where it stopped on the same
      number of devices (nerfstudio's checkpoint does not say how many there were);
    * distorted cameras (PERSPECTIVE k1, k2, k3, p1, p2; FISHEYE k1..k4) are undistorted to the same
      size with alpha = 0 (:func:`dali_nerf.scenes._util.undistorted_intrinsics`), the cameras
      handed out being those pinholes; nerfstudio crops to OpenCV's valid region instead. Masks are
      undistorted with their images (nearest-neighbour); the eval side is nerfstudio's own.

    Ranks: under torchrun the node's ranks are torchrun's; under nerfstudio's own launcher (no
    torchrun variables) they are found from the process group (the ranks on this host by name).
    """

    config: DaliFullImageDatamanagerConfig

    def __init__(self, config: DaliFullImageDatamanagerConfig, device="cpu", test_mode="val", world_size: int = 1,
                 local_rank: int = 0, **kwargs):
        if config.camera_res_scale_factor != 1.0:
            raise ConfigError("pipeline.datamanager.camera-res-scale-factor: must be 1.0 with DaliFullImageDatamanager; "
                              "downscale with the dataparser's --downscale-factor instead")
        super().__init__(config, device=device, test_mode=test_mode, world_size=world_size, local_rank=local_rank,
                         **kwargs)
        self.train_scene = scene_from_dataset(self.train_dataset, "train", undistort=True)
        sc = self.train_scene
        cams = copy.deepcopy(self.train_dataset.cameras)
        k = torch.from_numpy(np.array(sc.intrinsics, np.float32))
        for j, name in enumerate(("fx", "fy", "cx", "cy")):  # the undistorted pinholes the images are
            setattr(cams, name, k[:, j:j + 1].to(getattr(cams, name).dtype).contiguous())
        if cams.distortion_params is not None:
            cams.distortion_params = torch.zeros_like(cams.distortion_params)
        cams.camera_type = torch.full_like(cams.camera_type, CameraType.PERSPECTIVE.value)
        self.train_cameras = cams.to(self.device)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(self.local_rank)
        self._loader = None
        CONSOLE.print(f"DaliFullImageDatamanager: rank {self.rank}/{self.world_size}, {sc.num_images} train images "
                      f"decoded once per node{' (undistorted)' if sc.distortion is not None else ''}")

    def _node(self) -> tuple:
        """(local_rank, local_world_size, share_key) for the ImageLoader (see the class docstring)."""
        env = launch_env()
        W = int(self.world_size)
        if env.run_id or W == 1 or not (dist.is_available() and dist.is_initialized()):
            return None, None, None  # torchrun's variables, or one rank: the loader's own defaults
        hosts = [None] * W
        dist.all_gather_object(hosts, socket.gethostname())
        key = [secrets.token_hex(8) if self.rank == 0 else None]
        dist.broadcast_object_list(key, src=0)
        mine = [r for r, h in enumerate(hosts) if h == hosts[self.rank]]
        return mine.index(self.rank), len(mine), f"nerfstudio/{key[0]}"

    def _start(self, step: int) -> None:
        c = self.config
        local_rank, local_world, key = self._node()
        self._loader = ImageLoader(self.train_scene, images_per_batch=1, rank=self.rank, world_size=int(self.world_size),
                                   seed=c.seed, prefetch=c.prefetch, max_bytes=c.max_bytes or None,
                                   local_rank=local_rank, local_world_size=local_world, share_key=key,
                                   num_threads=c.num_threads)
        self._loader.set_step(int(step))  # nerfstudio keeps no datamanager state: its step is the stream's

    def next_train(self, step: int) -> Tuple[Cameras, Dict]:
        """This rank's image of global step ``step`` (the first call places the stream there)."""
        self.train_count += 1
        if self._loader is None:
            self._start(step)
        b = next(self._loader)
        idx = int(b["image_id"][0])
        image = b["image"][0]
        if self.config.cache_images_type == "float32":  # nerfstudio's get_image_float32: uint8 / 255.0
            image = image.float() / 255.0
        data = {"image_idx": idx, "image": image.to(self.device)}
        if "mask" in b:
            data["mask"] = b["mask"][0, :, :, None]
        camera = self.train_cameras[idx:idx + 1].to(self.device)
        camera.metadata = dict(camera.metadata or {}, cam_idx=idx)
        return camera, data

    def get_train_rays_per_batch(self) -> int:
        """Pixels of the first training image (nerfstudio's rule), without decoding the split."""
        return int(self.train_scene.width[0]) * int(self.train_scene.height[0])

    def loader_stats(self) -> dict:
        """The ImageLoader's ``stats()`` (wait_s, stall_fraction, images_per_s, decode_closed, ...); {} before the
        first step."""
        return self._loader.stats() if self._loader is not None else {}

    def close(self) -> None:
        """Stop the ImageLoader (also done at interpreter exit)."""
        if self._loader is not None:
            self._loader.close()
            self._loader = None


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
