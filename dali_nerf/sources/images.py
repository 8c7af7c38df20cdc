"""ImageLoader: whole images (or patches) with their cameras for Gaussian-splatting trainers, as
gsplat's ``examples/datasets/colmap.py`` Dataset hands them to ``simple_trainer.py`` (gsplat
90d7b4b, 2026-08-20), decoded once per node and prefetched.

Batch (dict of torch tensors, gsplat's keys; B images per rank per step)::

    K           (B, 3, 3) float32   the undistorted, downscaled camera (pixel centres at +0.5), its
                                    principal point shifted by the patch corner with patches
    camtoworld  (B, 4, 4) float32   camera-to-world in OpenCV camera axes (x right, y down, z forward),
                                    in the Scene's world (COLMAP's, unnormalised; Scene.points too)
    image       (B, H, W, 3) uint8  (gsplat's Dataset: float32 of the same whole numbers; its
                                    trainer divides by 255 either way)
    image_id    (B,) int64          index of the image in the split (gsplat's ``image_id``)
    camera_idx  (B,) int64          the image's camera, 0-based (``Scene.camera_idx``; 0 without one)

(gsplat also gives ``mask`` for its fisheye crop and ``exposure`` from EXIF: our undistortion
keeps every pixel valid, so no mask, and EXIF exposure is not read.) ``mask`` (B, H, W) bool is the
key a per-pixel mask will use.

The stream (:mod:`dali_nerf.data.imageorder`): every image of the split exactly once per epoch
across all ranks, B per rank per step, defined by the seed alone; ``state_dict()`` holds the next
global position, so ``load_state_dict`` continues it exactly on any number of ranks. Images are
decoded once per node into memory the node's ranks share (:mod:`dali_nerf.data.imagestore`,
:mod:`dali_nerf.data.nodeshare`), under ``max_bytes`` per node (windows beyond it); no worker
processes: one thread builds the batches ahead (:class:`~dali_nerf.sources.runner.RunAhead`), one
decodes. With ``device="cuda"`` batches are built in pinned memory and copied non-blocking on
torch's current stream in ``next()``: the GPU holds the batch handed out, nothing more.

>>> loader = ImageLoader(scene, images_per_batch=1, rank=0, world_size=1, seed=0)
>>> batch = next(loader); batch["image"].shape
torch.Size([1, 297, 420, 3])
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from dali_nerf.data.imageorder import IMAGE_STREAM, ImageStream, patch_offsets, step_positions
from dali_nerf.data.imagestore import ImageStore, plan_windows
from dali_nerf.data.nodeshare import NodeShare, default_key
from dali_nerf.errors import ConfigError
from dali_nerf.scenes import scene_fingerprint
from dali_nerf.sources.base import BatchSource, BatchStats, check_scene_state, global_epoch_steps, scene_state
from dali_nerf.sources.checks import MAX_PREFETCH, check_int
from dali_nerf.sources.runner import RunAhead

__all__ = ["ImageLoader", "IMAGE_KEYS", "opencv_camtoworld", "intrinsics_matrix", "total_memory"]

IMAGE_KEYS = ("K", "camtoworld", "image", "image_id", "camera_idx")
"""The keys of every image batch (gsplat's)."""


def total_memory() -> int:
    """Bytes of physical memory of this node (``MemTotal``): the same for every local rank."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def opencv_camtoworld(scene) -> np.ndarray:
    """(N, 4, 4) float32 camera-to-world in OpenCV axes of a Scene (OpenGL 3x4): y and z columns
    negated (exact), bottom row 0 0 0 1."""
    out = np.zeros((scene.num_images, 4, 4), np.float32)
    out[:, :3, :4] = scene.c2w
    out[:, :3, 1:3] *= -1.0
    out[:, 3, 3] = 1.0
    return out


def intrinsics_matrix(scene) -> np.ndarray:
    """(N, 3, 3) float32 K of a Scene's (undistorted, downscaled) cameras."""
    k = np.zeros((scene.num_images, 3, 3), np.float32)
    k[:, 0, 0], k[:, 1, 1], k[:, 0, 2], k[:, 1, 2] = scene.intrinsics.T
    k[:, 2, 2] = 1.0
    return k


class _Producer:
    """What the run-ahead thread calls: step k's batch of this rank (no reference to the loader)."""

    def __init__(self, loader: "ImageLoader", start: int, store: ImageStore):
        self.stream, self.store, self.start = loader._stream, store, start
        self.b, self.w, self.rank, self.seed, self.patch = (loader.images_per_batch, loader.world_size, loader.rank,
                                                            loader.seed, loader.patch_size)
        self.k, self.c2w, self.cam = loader._k, loader._c2w, loader._camera_idx
        self.scene, self.pin = loader.scene, loader.device == "cuda"
        self.step = 0

    def __call__(self, _pipe=None) -> dict:
        pos = step_positions(self.start, self.step, self.b, self.w, self.rank)
        self.step += 1
        ids = self.stream.images(pos)
        views = self.store.images(pos, ids)
        k = torch.from_numpy(self.k[ids].copy())
        if self.patch:
            p = self.patch
            x, y = patch_offsets(self.seed, pos, self.scene.width[ids], self.scene.height[ids], p)
            image = torch.from_numpy(np.stack([v[yy:yy + p, xx:xx + p] for v, xx, yy in zip(views, x, y)]))
            k[:, 0, 2] -= torch.from_numpy(x.astype(np.float32))
            k[:, 1, 2] -= torch.from_numpy(y.astype(np.float32))
        else:
            image = torch.from_numpy(np.stack(views))
        batch = {"K": k, "camtoworld": torch.from_numpy(self.c2w[ids].copy()), "image": image,
                 "image_id": torch.from_numpy(ids.copy()), "camera_idx": torch.from_numpy(self.cam[ids].copy())}
        if self.pin:  # pragma: no cover - needs a GPU
            batch = {n: t.pin_memory() for n, t in batch.items()}
        return batch


class ImageLoader(BatchSource):
    """Image batches of a split (module doc).

    Args:
        scene: the split (any format; COLMAP's is the splatting one).
        images_per_batch: B, images per rank per step (> 1 needs images of one size, or patches).
        rank, world_size: this rank and the number of ranks (a global step holds G = B x W images).
        seed: the stream's seed (order and patches).
        prefetch: batches built ahead (>= 1).
        patch_size: None (whole images) or p: a random p x p patch of each image.
        max_bytes: decoded pixels the node may hold (None: half the node's physical memory, a number
            every local rank reads alike: they must agree on the windows); beyond it the split
            streams through windows.
        local_rank, local_world_size: this rank on its node and the ranks there (default torchrun's
            LOCAL_RANK / LOCAL_WORLD_SIZE, else 0 / 1); the node's ranks share the decoded images.
        share_key: the string every local rank of the job passes alike (default from torchrun's
            environment; required with several local ranks outside torchrun).
        device: "cpu" | "cuda" (each rank decodes its part with nvJPEG on its GPU into the node's
            host memory; pinned batches, copied in ``next()``).
        num_threads, decode_batch: DALI decode threads and images per decode run.
    """

    def __init__(self, scene, images_per_batch: int = 1, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 2, patch_size: Optional[int] = None, max_bytes: Optional[int] = None,
                 local_rank: Optional[int] = None, local_world_size: Optional[int] = None,
                 share_key: Optional[str] = None, device: str = "cpu", num_threads: int = 2, decode_batch: int = 8):
        self._ahead = self._store = self._share = None
        check_int("images_per_batch", images_per_batch, 1, 1 << 20)
        check_int("world_size", world_size, 1, 1 << 20)
        check_int("rank", rank, 0, world_size - 1)
        check_int("seed", seed, 0, (1 << 63) - 1)
        check_int("prefetch", prefetch, 1, MAX_PREFETCH)
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device={device!r}: use cpu or cuda")
        self.scene, self.images_per_batch, self.rank, self.world_size = scene, int(images_per_batch), int(rank), int(world_size)
        self.seed, self.prefetch, self.device = int(seed), int(prefetch), device
        self.num_threads, self.decode_batch = int(num_threads), int(decode_batch)
        self.patch_size = None if patch_size in (None, 0) else int(patch_size)
        self._check_sizes()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else int(local_rank)
        self.local_world_size = (int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world_size is None
                                 else int(local_world_size))
        check_int("local_rank", self.local_rank, 0, self.local_world_size - 1)
        key = share_key or default_key()
        if self.local_world_size > 1 and not key:
            raise ConfigError(f"ImageLoader: {self.local_world_size} local ranks share the decoded images but no "
                              f"share_key was given (torchrun gives one); pass the same share_key on every local rank")
        self._share_key = f"{key or 'local'}/{scene_fingerprint(scene)['digest']}"
        self.max_bytes = int(max_bytes) if max_bytes is not None else total_memory() // 2
        try:
            self.keep_all, self.window = plan_windows(scene, self.global_batch, self.max_bytes, self.local_world_size,
                                                      self.decode_batch)
        except ValueError as e:
            raise ConfigError(f"ImageLoader: max_bytes={self.max_bytes}: {e}; raise it or lower images_per_batch") from None
        self._k, self._c2w = intrinsics_matrix(scene), opencv_camtoworld(scene)
        self._camera_idx = (np.zeros(scene.num_images, np.int64) if scene.camera_idx is None
                            else np.asarray(scene.camera_idx, np.int64))
        self._stream = ImageStream(scene.num_images, self.seed)
        self._stats = BatchStats()
        self.position = 0       # global position of the next step handed out
        self._started = False
        self._runs = 0

    def _check_sizes(self) -> None:
        sc, p = self.scene, self.patch_size
        if p is not None:
            check_int("patch_size", p, 1, 1 << 20)
            small = np.flatnonzero(np.minimum(sc.width, sc.height) < p)
            if len(small):
                i = int(small[0])
                raise ConfigError(f"patch_size={p}: {sc.image_paths[i]} is {int(sc.width[i])}x{int(sc.height[i])}, "
                                  f"smaller than a patch; use a patch of at most {int(np.minimum(sc.width, sc.height).min())}")
        elif self.images_per_batch > 1 and len({(int(w), int(h)) for w, h in zip(sc.width, sc.height)}) > 1:
            raise ConfigError(f"images_per_batch={self.images_per_batch}: the split's images differ in size, so a "
                              f"batch cannot stack them (gsplat refuses it too); use images_per_batch=1 or a patch_size")

    @property
    def global_batch(self) -> int:
        """G = B x W: images per global step."""
        return self.images_per_batch * self.world_size

    # ---- iteration -------------------------------------------------------------------------------
    def _start(self) -> None:
        self._share = self._share or NodeShare(self._share_key, self.local_rank, self.local_world_size)
        self._runs += 1  # every local rank seeks alike: the same run number names the same blocks
        self._store = ImageStore(self.scene, self._stream, self._share, self.window, self.keep_all,
                                 start=self.position, threads=self.num_threads, batch=self.decode_batch,
                                 tag=f"r{self._runs}", device=self.device)
        self._ahead = RunAhead(None, _Producer(self, self.position, self._store), depth=self.prefetch,
                               name="dali_nerf-image-batches")
        self._started = True

    def __next__(self) -> dict:
        t = self._stats.start()
        if not self._started:
            self._start()
        batch = self._ahead.get()
        self._ahead.release()
        self.position += self.global_batch
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            batch = {n: v.to("cuda", non_blocking=True) for n, v in batch.items()}
        self._stats.stop(t, self.images_per_batch)
        return batch

    def __len__(self) -> int:
        """Steps of the current epoch (the global steps whose first position is in it)."""
        return global_epoch_steps(self.epoch, self.scene.num_images, self.global_batch)[1]

    @property
    def epoch(self) -> int:
        return self.position // self.scene.num_images

    def set_epoch(self, epoch: int) -> None:
        """Go to the first step of ``epoch`` (:func:`~dali_nerf.sources.base.global_epoch_steps`)."""
        first, _ = global_epoch_steps(int(epoch), self.scene.num_images, self.global_batch)
        self._seek(first * self.global_batch)

    def _seek(self, position: int) -> None:
        self._stop_threads()
        self.position = int(position)

    # ---- state, stats, close ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"stream", "position", "images_per_batch", "world_size", "seed", "patch_size", "window",
        "scene"}``: ``position`` is the next global position; the window size is recorded (the
        order does not depend on it, so another budget continues the same stream)."""
        return {"stream": IMAGE_STREAM, "position": self.position, "images_per_batch": self.images_per_batch,
                "world_size": self.world_size, "seed": self.seed, "patch_size": self.patch_size or 0,
                "window": 0 if self.keep_all else self.window, **scene_state(self.scene)}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream of ``state`` (any world size and batch: the position is global).
        Refused in one line: another scene, stream formula or seed (another patch size is allowed:
        the same images follow, cropped otherwise)."""
        check_scene_state(state, self.scene, "ImageLoader")
        for k, now in (("stream", IMAGE_STREAM), ("seed", self.seed)):
            if state.get(k, now) != now:
                raise ConfigError(f"ImageLoader.load_state_dict: the state has {k}={state.get(k)!r}, this loader "
                                  f"{now!r}; build the loader with the state's {k}")
        self._seek(int(state["position"]))

    def stats(self) -> dict:
        """BatchStats' keys (``rays_per_s`` counts images) plus ``images_per_s``, ``decode_s``,
        ``peak_bytes`` (decoded pixels this node held at most), ``window`` (0: all kept),
        ``local_ranks`` sharing them."""
        d = self._stats.as_dict()
        d["images_per_s"] = d["rays_per_s"]
        st = self._store
        d.update(decode_s=st.decode_s if st else 0.0, peak_bytes=st.peak_bytes if st else 0,
                 window=0 if self.keep_all else self.window, local_ranks=self.local_world_size)
        return d

    def _stop_threads(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        if self._store is not None:
            self._store.close()
            self._store = None
        self._started = False

    def close(self) -> None:
        """Stop the threads, release the decoded images, close the node share (idempotent)."""
        self._stop_threads()
        if self._share is not None:
            self._share.close()
            self._share = None

    def time_to_first_batch(self) -> Optional[float]:
        """Seconds the first ``next()`` waited (None before it)."""
        return self._stats.warmup_s

