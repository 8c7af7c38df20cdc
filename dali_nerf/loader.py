"""RayLoader: the prefetching iterator over our DALI ray pipeline.

The stream is defined per *ray position*: position ``s`` of rank ``r`` is a pixel of the rank's
shard chosen by the operator from ``(mode, seed, rank, s)`` alone (see ARCHITECTURE.md), and step
``k`` (counted from position 0) is positions ``[k * B, (k + 1) * B)``. Each DALI run samples
``K = ceil(rays_per_run / B)`` steps' worth (``K * B`` rays) to amortise the fixed per-run cost;
``__next__`` hands out zero-copy step slices of the run's outputs. Neither ``prefetch`` nor
``rays_per_run`` changes the stream, and ``state_dict()`` resumes it exactly.

Epoch mode: permutation ``e`` of the rank's ``P`` pixels occupies positions ``[e * P, (e + 1) * P)``.
``set_epoch(e)`` moves to position ``e * P`` (the start of permutation ``e``). An epoch is
``len(loader) = ceil(max_r P_r / B)`` steps — the same on every rank, so DDP ranks stay in lockstep
— and its last step may run past ``(e + 1) * P`` into the next permutation (the stream is
continuous; without ``set_epoch`` it simply continues). The first ``P_r`` rays after ``set_epoch``
visit every pixel of rank r's shard exactly once; shards are disjoint, so across ranks every pixel
of the split is visited exactly once.

>>> loader = RayLoader(scene, rays_per_batch=4096, rank=0, world_size=1, seed=0, prefetch=2)
>>> batch = next(loader)
>>> batch["origins"].shape, batch["indices"].dtype
(torch.Size([4096, 3]), torch.int64)
>>> loader.stats()["stall_fraction"] < 0.05
True
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import numpy as np
import torch

from .errors import ConfigError

__all__ = ["RayLoader", "BatchStats", "BATCH_KEYS", "resolve_device"]

BATCH_KEYS = ("origins", "directions", "rgb", "indices", "near", "far")
"""Keys a batch may carry (near/far only when the scene has bounds)."""


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when available else "cpu"; "cuda" without a GPU is a ConfigError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: use cpu, cuda or auto")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda: no CUDA device is visible; use device=cpu")
    return device


class BatchStats:
    """Time blocked in ``__next__`` vs wall time since the first ``__next__`` (shared by every source).

    ``as_dict()`` -> {"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s", "runs"}.
    """

    def __init__(self):
        self.steps = 0
        self.wait_s = 0.0
        self.rays = 0
        self.runs = 0
        self.t0: Optional[float] = None

    def start(self) -> float:
        now = time.perf_counter()
        if self.t0 is None:
            self.t0 = now
        return now

    def stop(self, t_enter: float, rays: int) -> None:
        self.wait_s += time.perf_counter() - t_enter
        self.steps += 1
        self.rays += rays

    def as_dict(self) -> dict:
        elapsed = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        return {
            "steps": self.steps,
            "wait_s": self.wait_s,
            "stall_fraction": (self.wait_s / elapsed) if elapsed > 0 else 0.0,
            "rays_per_s": (self.rays / elapsed) if elapsed > 0 else 0.0,
            "elapsed_s": elapsed,
            "runs": self.runs,
        }


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ConfigError(f"{name}={v!r}: must be an integer > 0")


def check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode):
    """Shared argument checks of every batch source (one-line ConfigError)."""
    _positive("rays_per_batch", rays_per_batch)
    _positive("world_size", world_size)
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r}: must be in [0, world_size={world_size})")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed={seed!r}: must be an integer >= 0")
    if not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise ConfigError(f"prefetch={prefetch!r}: must be an integer >= 0")
    if mode not in ("random", "epoch"):
        raise ConfigError(f"mode={mode!r}: use random or epoch")


class RayLoader:
    """Prefetching iterator of ray batches from our DALI pipeline (infinite; see module doc).

    Args:
        scene: the split to sample (a :class:`~dali_nerf.scenes.Scene`).
        rays_per_batch: B, rays per step for this rank.
        rank, world_size: this rank's shard (DALI's rule, see ``pipelines/decode.py``).
        seed: stream key; mode: "random" (iid) | "epoch" (each pixel once per epoch).
        prefetch: DALI runs computed ahead of the consumer (0 = synchronous).
        device: "cpu" | "cuda" (nvJPEG decode, GPU op, CUDA tensors) | "auto".
        num_threads: DALI CPU threads.
        rays_per_run: rays per DALI run, rounded up to a multiple of B (K = ceil(rays_per_run / B)).
        cache: a pre-decoded :class:`~dali_nerf.pipelines.decode.ImageCache` of this shard.
        output_map: batch keys to return (near/far dropped when the scene has no bounds).
        max_bytes: decoded-image budget; a larger shard is refused (streaming not implemented yet).
    Yields:
        dict: origins (B, 3) f32, directions (B, 3) f32 unit, rgb (B, 3) f32, indices (B, 3) i64,
        near/far (B, 1) f32 when the scene has bounds.
    """

    def __init__(self, scene, rays_per_batch: int = 4096, rank: int = 0, world_size: int = 1, seed: int = 0,
                 prefetch: int = 2, mode: str = "random", device: str = "cpu", num_threads: int = 2,
                 rays_per_run: int = 262144, cache=None,
                 output_map: Sequence[str] = ("origins", "directions", "rgb", "indices", "near", "far"),
                 max_bytes: Optional[int] = None, decode_batch: int = 8):
        from dali_nerf.pipelines.decode import decode_cache, shard_sizes

        check_common(scene, rays_per_batch, rank, world_size, seed, prefetch, mode)
        _positive("rays_per_run", rays_per_run)
        _positive("num_threads", num_threads)
        for k in output_map:
            if k not in BATCH_KEYS:
                raise ConfigError(f"output_map: unknown key {k!r}; valid: {', '.join(BATCH_KEYS)}")
        self.scene = scene
        self.rays_per_batch = int(rays_per_batch)
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        self.prefetch, self.mode = int(prefetch), mode
        self.device = resolve_device(device)
        self.num_threads = int(num_threads)
        self.steps_per_run = max(1, math.ceil(int(rays_per_run) / self.rays_per_batch))
        self.rays_per_run = self.steps_per_run * self.rays_per_batch
        self.output_map = tuple(k for k in output_map if scene.has_bounds or k not in ("near", "far"))
        self._shard_pixels = shard_sizes(scene, self.world_size)
        need = int(self._shard_pixels[self.rank]) * 3
        if cache is None and max_bytes is not None and need > max_bytes:
            raise ConfigError(
                f"cache.max_bytes={max_bytes}: rank {self.rank}'s shard needs {need} bytes decoded and streaming "
                f"windows are not implemented yet; raise cache.max_bytes, use more ranks or a downscale"
            )
        if cache is None:
            cache = decode_cache(scene, self.rank, self.world_size, device=self.device,
                                 num_threads=self.num_threads, batch=decode_batch)
        elif (cache.rank, cache.world_size) != (self.rank, self.world_size):
            raise ConfigError(f"cache: holds shard {cache.rank}/{cache.world_size}, loader is {self.rank}/{self.world_size}")
        self.cache = cache
        self.num_pixels = cache.num_pixels
        self.position = 0
        self.epoch = 0
        self._stats = BatchStats()
        self._pipe = None
        self._run = None  # dict of torch tensors (K*B, ...) of the current run
        self._run_start = 0  # stream position of self._run's first ray
        self._closed = False

    # ---- construction from a config ------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, rank: int = 0, world_size: int = 1, scene=None) -> "RayLoader":
        """RayLoader from a :class:`~dali_nerf.config.Config` (``cfg.pipeline``, ``cfg.cache``, ``cfg.scene``)."""
        if scene is None:
            scene = scene_from_config(cfg)
        p = cfg.pipeline
        return cls(scene, rays_per_batch=p.rays_per_batch, rank=rank, world_size=world_size, seed=p.seed,
                   prefetch=p.prefetch, mode=p.mode, device=cfg.train.device, num_threads=p.num_threads,
                   rays_per_run=p.rays_per_run, max_bytes=cfg.cache.max_bytes, decode_batch=cfg.cache.decode_batch)

    # ---- iteration ------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Steps per epoch (epoch mode): ceil(max over ranks of shard pixels / B)."""
        if self.mode != "epoch":
            raise TypeError("RayLoader in random mode is an infinite stream and has no len(); use mode='epoch'")
        return math.ceil(int(self._shard_pixels.max()) / self.rays_per_batch)

    def _build(self):
        from dali_nerf.pipelines.rays import ray_pipeline

        device_id = torch.cuda.current_device() if self.device == "cuda" else None
        self._pipe = ray_pipeline(self.cache, self.rays_per_run, self.mode, self.seed, self.rank, self.world_size,
                                  first_start=self.position, device=self.device, num_threads=self.num_threads,
                                  prefetch=self.prefetch, device_id=device_id)
        self._next_run_start = self.position

    def _fetch_run(self):
        if self._pipe is None:
            self._build()
        outs = self._pipe.run()
        self._stats.runs += 1
        names = ("origins", "directions", "rgb", "indices", "near", "far", "consumed")
        out = dict(zip(names, outs))
        consumed = int(np.asarray(out["consumed"].as_cpu()[0] if self.device == "cuda" else out["consumed"][0]).reshape(-1)[0])
        if consumed != self.rays_per_run:
            raise RuntimeError(f"ray_sampler consumed {consumed} positions for {self.rays_per_run} rays")
        run = {}
        for k in self.output_map:
            run[k] = self._to_torch(out[k])
        self._run = run
        self._run_start = self._next_run_start
        self._next_run_start += self.rays_per_run

    def _to_torch(self, tl) -> torch.Tensor:
        if self.device == "cuda":  # pragma: no cover - needs a GPU
            from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

            t = tl[0] if hasattr(tl, "__getitem__") else tl.as_tensor()
            dst = torch.empty(tuple(t.shape()), dtype=to_torch_type[t.dtype], device="cuda")
            feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream())  # device-to-device
            return dst
        # zero copy: DALI 2.4 keeps the buffer alive while referenced (each run gets new memory)
        return torch.from_numpy(np.asarray(tl[0]))

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("RayLoader is closed")
        t = self._stats.start()
        B = self.rays_per_batch
        off = self.position - self._run_start
        if self._run is None or off < 0 or off + B > self.rays_per_run:
            if self._run is not None and self._pipe is not None and self.position != self._next_run_start:
                self._drop_pipeline()
            self._run = None
            self._fetch_run()
            off = self.position - self._run_start
        batch = {k: v[off:off + B] for k, v in self._run.items()}
        self.position += B
        self._stats.stop(t, B)
        return batch

    # ---- epochs, state --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: move to the start of permutation ``epoch`` (position epoch * P). Random
        mode: only recorded (the iid stream has no epochs)."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}): epoch must be an integer >= 0")
        self.epoch = int(epoch)
        if self.mode == "epoch":
            self._seek(self.epoch * self.num_pixels)

    def _seek(self, position: int) -> None:
        if position != self.position:
            self.position = int(position)
            if self._pipe is not None and self.position != self._next_run_start:
                # keep the current run if the position falls inside it, else rebuild lazily
                off = self.position - self._run_start
                if self._run is None or off < 0 or off + self.rays_per_batch > self.rays_per_run:
                    self._drop_pipeline()

    def _drop_pipeline(self):
        self._run = None
        pipe, self._pipe = self._pipe, None
        del pipe

    def state_dict(self) -> dict:
        """{"position", "epoch", "steps", "mode", "seed", "rank", "world_size", "rays_per_batch", "num_pixels"}."""
        return {"position": self.position, "epoch": self.epoch, "steps": self._stats.steps, "mode": self.mode,
                "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "rays_per_batch": self.rays_per_batch, "num_pixels": self.num_pixels}

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly: the next batch is the one the saved loader would have returned."""
        for k in ("mode", "seed", "rank", "world_size", "num_pixels"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {getattr(self, k)!r}; "
                                  f"resume with the same settings")
        self.epoch = int(state.get("epoch", 0))
        self._seek(int(state["position"]))

    # ---- stats, shutdown ------------------------------------------------------------------------
    def stats(self) -> dict:
        """{"steps", "wait_s", "stall_fraction", "rays_per_s", "elapsed_s", "runs"} since the first next()."""
        return self._stats.as_dict()

    def close(self) -> None:
        """Release the DALI pipeline (its threads end with it). Idempotent."""
        if not self._closed:
            self._closed = True
            self._drop_pipeline()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"RayLoader(rank={self.rank}/{self.world_size}, B={self.rays_per_batch}, K={self.steps_per_run}, "
                f"mode={self.mode}, seed={self.seed}, prefetch={self.prefetch}, device={self.device}, "
                f"pixels={self.num_pixels})")


def scene_from_config(cfg):
    """Load ``cfg.scene``'s training split."""
    from dali_nerf.scenes import load_scene

    s = cfg.scene
    return load_scene(s.path, split=s.train_split, format=s.format, downscale=s.downscale, background=s.background)
