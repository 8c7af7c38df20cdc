"""ImageLoader: whole images (or patches) with their cameras for Gaussian-splatting trainers, as
gsplat's ``examples/datasets/colmap.py`` Dataset hands them to ``simple_trainer.py`` (as read at
gsplat commits 0714fc6 for colmap.py and 00877bf for simple_trainer.py; docs/SPLATTING.md), decoded
once per node and prefetched.

Batch (dict of torch tensors, gsplat's keys; B images per rank per step)::

    K           (B, 3, 3) float32   the undistorted, downscaled camera (pixel centres at +0.5), its
                                    principal point shifted by the patch corner with patches
    camtoworld  (B, 4, 4) float32   camera-to-world in OpenCV camera axes (x right, y down, z forward),
                                    in the Scene's world (COLMAP's, unnormalised; Scene.points too)
    image       (B, H, W, 3) uint8  (gsplat's Dataset: float32 of the same whole numbers; its
                                    trainer divides by 255 either way)
    image_id    (B,) int64          index of the image in the split (gsplat's ``image_id``)
    camera_idx  (B,) int64          the image's camera, 0-based (``Scene.camera_idx``; 0 without one)
    mask        (B, H, W) bool      only when the scene has masks (``Scene.mask_paths``; not with
                                    ``scene.masks: ignore``): True = keep the pixel, cropped
                                    with the patch (gsplat's key and dtype)
    exposure    (B,) float32        only when the scene's exposure was read (``scene.exposure:
                                    true``, :func:`dali_nerf.scenes.exif.with_exposure`) and
                                    some image has one: EV relative to the capture's mean
                                    (gsplat's ``load_exposure``)

(gsplat gives ``mask`` for its fisheye crop, whole images only; ours is the scene's per-pixel
mask, finished with the image: undistorted, downscaled, the undistortion border masked,
:mod:`dali_nerf.data.masks`.) The mask is decoded once per
node with its image, one byte a pixel beside it in the node's shared block.

The stream (:mod:`dali_nerf.data.imageorder`): every image of the split exactly once per epoch
across all ranks, B per rank per step, defined by the seed alone; ``state_dict()`` holds the next
global position, so ``load_state_dict`` continues it exactly on any number of ranks. Images are
decoded once per node into memory the node's ranks share (:mod:`dali_nerf.data.imagestore`,
:mod:`dali_nerf.data.nodeshare`), under ``max_bytes`` per node (windows beyond it); no worker
processes: one thread builds the batches ahead (the runner's), one decodes until the split is
held (kept whole; through windows it goes on). With ``device="cuda"`` batches are built in pinned
memory and copied non-blocking on torch's current stream in ``next()``: the GPU holds the batch
handed out, nothing more.

Host memory a rank holds beyond the node's shared images: the batches built ahead (``prefetch``
steps a run; a run's steps are freed on the run-ahead thread once the loader has moved past the
run, so the training thread never pays for freeing a batch it dropped inside the run) and what
decoding leaves in the process (DALI's pool, kept small by cutting its runs by bytes). Kept whole,
once every image is decoded the decode thread ends and gives its memory back, and ``stats()``
says ``decode_closed: True`` (:mod:`dali_nerf.data.imagestore`); a seek, a loaded state or
``set_epoch`` then goes on with the same store (nothing is decoded again; before the first batch
the store is built at the loaded position). Through windows a seek builds a new store there.

The loader is the image *producer* (:class:`ImageProducer`) plugged into the sources' one runner
(:class:`~dali_nerf.sources.runner.RunSource`: run-ahead thread, stall and warm-up accounting, the
cursor and its state with the split's fingerprint, close): a graph is the node's store of decoded
images from a stream position, a run is ``prefetch`` steps of batches built on the run-ahead thread.

>>> loader = ImageLoader(scene, images_per_batch=1, rank=0, world_size=1, seed=0)
>>> batch = next(loader); batch["image"].shape
torch.Size([1, 297, 420, 3])
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from dali_nerf.data.imagecache import meminfo_bytes
from dali_nerf.data.imageorder import IMAGE_STREAM, ImageStream, patch_offsets, step_positions
from dali_nerf.data.imagestore import ImageStore, plan_windows
from dali_nerf.data.nodeshare import NodeShare, default_key
from dali_nerf.errors import ConfigError
from dali_nerf.launch_env import launch_env
from dali_nerf.scenes import scene_fingerprint
from dali_nerf.sources.base import global_epoch_steps
from dali_nerf.sources.checks import MAX_PREFETCH, check_int
from dali_nerf.sources.runner import Run, RunSource

__all__ = ["ImageLoader", "IMAGE_KEYS", "MASKED_KEYS", "opencv_camtoworld", "intrinsics_matrix", "total_memory"]

IMAGE_KEYS = ("K", "camtoworld", "image", "image_id", "camera_idx")
"""The keys of every image batch (gsplat's); a masked scene's batches add ``mask``."""
MASKED_KEYS = IMAGE_KEYS + ("mask",)


def total_memory() -> int:
    """Bytes of physical memory of this node (``MemTotal``): the same for every local rank."""
    return meminfo_bytes("MemTotal", "SC_PHYS_PAGES")


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


class _Graph:
    """The run-ahead thread's handle: the node's store of decoded images and the next global
    position of this rank's stream."""

    def __init__(self, store: ImageStore, start: int):
        self.store, self.next = store, int(start)


class ImageProducer:
    """The image batch kind (the runner's producer contract, :mod:`dali_nerf.sources.runner`): a
    run is ``steps_per_run`` global steps of G = B x W positions, this rank's B images of each
    (``counts``); the stream is not the runner's linear one (a state or an epoch lands on a step
    boundary of the global stream, and a graph is built there)."""

    kind, thread_name, ahead, linear = "ImageLoader", "dali_nerf-image-batches", True, False

    def __init__(self, scene, b: int, rank: int, world: int, seed: int, steps: int, patch: Optional[int],
                 keep_all: bool, window: int, share_key: str, local_rank: int, local_world: int, device: str,
                 threads: int, decode_batch: int):
        self.scene, self.b, self.rank, self.world, self.seed, self.patch = scene, b, rank, world, seed, patch
        self.steps_per_run, self.phase_rank, self.who = steps, rank, f"ImageLoader rank {rank}"
        self.keep_all, self.window, self.device, self.threads, self.decode_batch = (keep_all, window, device, threads,
                                                                                    decode_batch)
        self.share_key, self.local_rank, self.local_world = share_key, local_rank, local_world
        self.stream = ImageStream(scene.num_images, seed)
        self.keys = IMAGE_KEYS if scene.mask_paths is None else MASKED_KEYS
        ev = scene.exposure
        self.exposure = None if ev is None or not np.isfinite(ev).any() else np.asarray(ev, np.float32)
        if self.exposure is not None:
            self.keys = self.keys + ("exposure",)
        self.k, self.c2w = intrinsics_matrix(scene), opencv_camtoworld(scene)
        self.cam = (np.zeros(scene.num_images, np.int64) if scene.camera_idx is None
                    else np.asarray(scene.camera_idx, np.int64))
        self.share: Optional[NodeShare] = None
        self.builds, self.decode_s, self.peak_bytes = 0, 0.0, 0
        self._live: Optional[ImageStore] = None

    @property
    def stride(self) -> int:
        return self.b * self.world

    def build(self, start: int) -> _Graph:
        if self.share is None:  # the node's share, opened at the first build (every local rank builds alike)
            self.share = NodeShare(self.share_key, self.local_rank, self.local_world)
        if self.keep_all and self._live is not None:
            # kept whole, the live store serves any position (by image id; its decode, if still
            # running, goes on in its own order, so a seek before the split is decoded waits for
            # that order to reach its images): a seek, a loaded state or set_epoch decodes nothing
            # again. A store whose decode failed raises its error again (every local rank keeps its
            # store alike, so the node's block names, by build number, stay the same on all)
            return _Graph(self._live, start)
        self.builds += 1  # every local rank seeks alike: the same build number names the same blocks
        self._live = ImageStore(self.scene, self.stream, self.share, self.window, self.keep_all, start=start,
                                threads=self.threads, batch=self.decode_batch, tag=f"r{self.builds}",
                                device=self.device, first=self.stride * self.steps_per_run)
        return _Graph(self._live, start)

    def produce(self, graph: _Graph) -> Run:
        steps = []
        for _ in range(self.steps_per_run):
            steps.append(self._step(graph.store, step_positions(graph.next, 0, self.b, self.world, self.rank)))
            graph.next += self.stride
        return Run(steps, stride=self.stride, consumed=self.stride * len(steps), keys=self.keys,
                   counts=[self.b] * len(steps))

    def _step(self, store: ImageStore, pos: np.ndarray) -> tuple:
        """This rank's batch at global positions ``pos`` (B,), in ``self.keys`` order."""
        ids = self.stream.images(pos)
        views, masks = store.views(pos, ids)
        k = torch.from_numpy(self.k[ids].copy())
        if self.patch:
            p = self.patch
            x, y = patch_offsets(self.seed, pos, self.scene.width[ids], self.scene.height[ids], p)

            def crop(vs):
                return np.stack([v[yy:yy + p, xx:xx + p] for v, xx, yy in zip(vs, x, y)])

            k[:, 0, 2] -= torch.from_numpy(x.astype(np.float32))
            k[:, 1, 2] -= torch.from_numpy(y.astype(np.float32))
        else:
            crop = np.stack
        out = (k, torch.from_numpy(self.c2w[ids].copy()), torch.from_numpy(crop(views)), torch.from_numpy(ids.copy()),
               torch.from_numpy(self.cam[ids].copy()))
        if self.scene.mask_paths is not None:
            out += (torch.from_numpy(crop(masks)),)
        if self.exposure is not None:
            out += (torch.from_numpy(self.exposure[ids]),)
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            out = tuple(t.pin_memory() for t in out)
        return out

    def release(self, graph: _Graph) -> None:
        st = graph.store
        if self.keep_all and st is self._live:
            return  # kept for the next graph (build); closed with the producer (close)
        st.close()
        self.decode_s += st.decode_s
        self.peak_bytes = max(self.peak_bytes, st.peak_bytes)
        if st is self._live:
            self._live = None

    def state(self, start: int, offset: int) -> dict:
        return {"stream": IMAGE_STREAM, "position": int(start) + int(offset), "images_per_batch": self.b,
                "world_size": self.world, "seed": self.seed, "patch_size": self.patch or 0,
                "window": 0 if self.keep_all else self.window}

    def load_state(self, state: dict) -> tuple:
        for k, now in (("stream", IMAGE_STREAM), ("seed", self.seed)):
            if state.get(k, now) != now:
                raise ConfigError(f"ImageLoader.load_state_dict: the state has {k}={state.get(k)!r}, this loader "
                                  f"{now!r}; build the loader with the state's {k}")
        return int(state["position"]), 0

    def info(self) -> dict:
        live = self._live
        return {"decode_s": self.decode_s + (live.decode_s if live else 0.0),
                "peak_bytes": max(self.peak_bytes, live.peak_bytes if live else 0),
                "window": 0 if self.keep_all else self.window, "local_ranks": self.local_world,
                "decode_closed": bool(live is not None and live.complete)}

    def close(self) -> None:
        live, self._live = self._live, None
        if live is not None:  # no longer the live store: released for good
            self.release(_Graph(live, 0))
        if self.share is not None:
            self.share.close()
            self.share = None


class ImageLoader(RunSource):
    """Image batches of a split (module doc).

    Args:
        scene: the split (any format; COLMAP's is the splatting one).
        images_per_batch: B, images per rank per step (> 1 needs images of one size, or patches).
        rank, world_size: this rank and the number of ranks (a global step holds G = B x W images).
        seed: the stream's seed (order and patches).
        prefetch: batches built ahead (>= 1): the steps of one run of the runner.
        patch_size: None (whole images) or p: a random p x p patch of each image.
        max_bytes: decoded pixels the node may hold (None: half the node's physical memory, a number
            every local rank reads alike: they must agree on the windows); beyond it the split
            streams through windows.
        local_rank, local_world_size: this rank on its node and the ranks there (default the
            launcher's, :func:`dali_nerf.launch_env.launch_env`; else 0 / 1); the node's ranks share
            the decoded images.
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
        check_int("images_per_batch", images_per_batch, 1, 1 << 20)
        check_int("world_size", world_size, 1, 1 << 20)
        check_int("rank", rank, 0, world_size - 1)
        check_int("seed", seed, 0, (1 << 63) - 1)
        check_int("prefetch", prefetch, 1, MAX_PREFETCH)
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device={device!r}: use cpu or cuda")
        self.scene, self.images_per_batch, self.rank, self.world_size = scene, int(images_per_batch), int(rank), int(world_size)
        self.seed, self.prefetch, self.device = int(seed), int(prefetch), device
        self.patch_size = None if patch_size in (None, 0) else int(patch_size)
        self._check_sizes()
        launch = launch_env()  # torchrun's local rank and ranks on this host (1 without a launcher)
        local_rank = launch.local_rank if local_rank is None else int(local_rank)
        local_world = launch.local_world_size if local_world_size is None else int(local_world_size)
        check_int("local_rank", local_rank, 0, local_world - 1)
        key = share_key or default_key()
        if local_world > 1 and not key:
            raise ConfigError(f"ImageLoader: {local_world} local ranks share the decoded images but no "
                              f"share_key was given (torchrun gives one); pass the same share_key on every local rank")
        self.max_bytes = int(max_bytes) if max_bytes is not None else total_memory() // 2
        try:
            keep_all, window = plan_windows(scene, self.global_batch, self.max_bytes, local_world, decode_batch)
        except ValueError as e:
            raise ConfigError(f"ImageLoader: max_bytes={self.max_bytes}: {e}; raise it or lower images_per_batch") from None
        super().__init__(ImageProducer(scene, self.images_per_batch, self.rank, self.world_size, self.seed,
                                       self.prefetch, self.patch_size, keep_all, window,
                                       f"{key or 'local'}/{scene_fingerprint(scene)['digest']}", local_rank, local_world,
                                       device, int(num_threads), int(decode_batch)))

    def _check_sizes(self) -> None:
        sc, p = self.scene, self.patch_size
        ev = sc.exposure
        if ev is not None and np.isfinite(ev).any() and not np.isfinite(ev).all():
            i = int(np.flatnonzero(~np.isfinite(ev))[0])
            raise ConfigError(f"{sc.image_paths[i]}: no EXIF exposure in its original image while "
                              f"{int(np.isfinite(ev).sum())} of the split have one (gsplat cannot batch them either); "
                              f"set scene.exposure: false, or give every image its EXIF")
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

    @property
    def window(self) -> int:
        """Images per window (0: the split is kept whole)."""
        return 0 if self.producer.keep_all else self.producer.window

    @property
    def local_world_size(self) -> int:
        return self.producer.local_world

    @property
    def num_threads(self) -> int:
        """DALI decode threads of this rank."""
        return self.producer.threads

    def __next__(self) -> dict:
        batch = super().__next__()
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            batch = {n: v.to("cuda", non_blocking=True) for n, v in batch.items()}
        return batch

    def __len__(self) -> int:
        """Steps of the current epoch (the global steps whose first position is in it)."""
        return global_epoch_steps(self.epoch, self.scene.num_images, self.global_batch)[1]

    @property
    def epoch(self) -> int:
        return self.position // self.scene.num_images

    @property
    def step(self) -> int:
        """The global step of the next batch (its first position / G)."""
        return sum(self._cursor()) // self.global_batch

    def set_step(self, step: int) -> None:
        """Go to global step ``step`` (positions [step G, (step + 1) G)), whatever the number of
        ranks the stream ran on before: the next batch is this rank's B images of that step (a
        trainer that keeps only its step count resumes the epoch exactly with it)."""
        check_int("set_step: step", step, 0, ((1 << 62) - 1) // self.global_batch)
        if int(step) * self.global_batch != sum(self._cursor()):
            self._restart(int(step) * self.global_batch, 0)

    def set_epoch(self, epoch: int) -> None:
        """Go to the first step of ``epoch`` (:func:`~dali_nerf.sources.base.global_epoch_steps`)."""
        first, _ = global_epoch_steps(int(epoch), self.scene.num_images, self.global_batch)
        self._restart(first * self.global_batch, 0)

    def stats(self) -> dict:
        """The runner's (BatchStats: ``rays_per_s`` counts images) plus ``images_per_s``,
        ``decode_s``, ``peak_bytes`` (decoded pixels this node held at most), ``window`` (0: all
        kept), ``local_ranks`` sharing them and ``decode_closed`` (True once the split is kept
        whole, every image decoded and the decode thread's memory given back, as its last step; a
        moment after the last image is in; always False through windows)."""
        d = super().stats()
        d["images_per_s"] = d["rays_per_s"]
        return d

    def time_to_first_batch(self) -> Optional[float]:
        """Seconds the first ``next()`` waited (None before it)."""
        return self._stats.warmup_s
