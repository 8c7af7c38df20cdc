"""Spatial segmentation: the ray sampler op routed to one cell, and the routed baselines.

Our source, :class:`SpatialRayLoader`, runs the same operator as the DDP pipeline with the
partition's centroids as a 4th input and ``cell=j``: each run emits exactly ``K * B`` rays that
cross cell j (exact closed-form test inside the op, no mask precompute) and reports how many
stream positions it consumed. The next run starts right where the previous one ended, a count
known only once that run is done; the pipeline feeds the op ``start = -1`` after its first run
("continue after your previous run", which the op tracks itself), so DALI computes ``prefetch``
runs ahead in its own threads like the DDP pipeline, and each run's outputs are fresh buffers
handed out zero copy. Every rank holds all images of the split — a ray of any image may cross
its cell.

The stream of cell j is keyed by (seed, rank=j, world_size=C): identical whichever rank trains the
cell. ``state_dict()`` = {"run_start", "offset"}: the run's first stream position and the rays of
it already handed out; the op is deterministic given ``start``, so resume is exact.

Baselines (the study's SS settings, same interface): :class:`RoutedSyncLocal` samples candidate
rays in the training thread with :class:`~dali_nerf.baseline.PixelSampler` and keeps those that
cross the cell (:func:`dali_nerf.partition.ray_cells`, vectorised numpy); :class:`RoutedSyncGlobal`
has rank 0 do that for every rank's cell and scatter the batches.

>>> src = spatial_loader(cfg, scene, partition, cell=0)
>>> next(src)["origins"].shape
torch.Size([4096, 3])
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dali_nerf.errors import ConfigError
from dali_nerf.loader import BatchSource, BatchStats, dali_to_torch, resolve_device
from dali_nerf.pipelines.rays import StartFeed, release_pipeline

__all__ = ["SpatialRayLoader", "RoutedSyncLocal", "RoutedSyncGlobal", "spatial_loader", "spatial_pipeline"]

_NAMES = ("origins", "directions", "rgb", "indices", "near", "far", "consumed")


def spatial_pipeline(cache, partition, cell: int, rays_per_run: int, mode: str, seed: int, *,
                     first_start: int = 0, prefetch: int = 2, device: str = "cpu", num_threads: int = 2,
                     device_id=None):
    """DALI pipeline of the op routed to ``cell``: run 0 starts at stream position ``first_start``,
    every later run where the previous one ended.

    Args:
        cache: the ImageCache (all images of the split); partition, cell: the routing.
        rays_per_run: R, accepted rays per run; mode, seed: the stream (its key also holds
            rank = cell, world_size = number of cells).
        prefetch: runs DALI computes ahead (``exec_async``; 0 = synchronous executor, whose output
            buffers are reused by the next run).
    Returns:
        A built pipeline whose ``run()`` gives origins/directions/rgb (R, 3) f32, indices (R, 3)
        i64, near/far (R, 1) f32 and consumed (1,) i64 (stream positions used by that run).
    """
    from nvidia.dali import fn, pipeline_def, types

    from dali_nerf.hostmem import dali_host_pool
    from dali_nerf.ops import load_plugin

    dali_host_pool()  # per-run output buffers from DALI's pool (dali_nerf.hostmem)
    load_plugin()
    gpu = device == "cuda"
    feed = StartFeed(first_start)
    srcs = {"pixels": [cache.pixels], "cameras": [cache.cameras], "layout": [cache.layout],
            "centroids": [np.ascontiguousarray(partition.centroids, np.float32)]}

    @pipeline_def
    def _routed():
        dev = "gpu" if gpu else "cpu"
        pixels = fn.external_source(source=lambda: srcs["pixels"], batch=True, no_copy=True, device=dev,
                                    dtype=types.UINT8, ndim=2, name="pixels")
        cameras = fn.external_source(source=lambda: srcs["cameras"], batch=True, no_copy=True, dtype=types.FLOAT, ndim=2)
        layout = fn.external_source(source=lambda: srcs["layout"], batch=True, no_copy=True, dtype=types.INT64, ndim=2)
        cents = fn.external_source(source=lambda: srcs["centroids"], batch=True, no_copy=True, dtype=types.FLOAT, ndim=2)
        start = fn.external_source(source=feed, batch=True, dtype=types.INT64, ndim=0, name="start")
        if gpu:
            cameras, layout, cents = cameras.gpu(), layout.gpu(), cents.gpu()
        return tuple(fn.dali_nerf.ray_sampler(
            pixels, cameras, layout, cents, rays=int(rays_per_run), mode=mode, seed=int(seed), rank=int(cell),
            world_size=int(partition.num_cells), start=start, cell=int(cell), margin=float(partition.margin),
            up=[float(u) for u in partition.up], dims=int(partition.dims),
            bounds=[] if partition.bounds is None else [float(v) for v in np.asarray(partition.bounds).ravel()],
            device=dev))

    sync = prefetch <= 0
    pipe = _routed(batch_size=1, num_threads=num_threads, device_id=device_id,
                   prefetch_queue_depth=max(1, int(prefetch)), exec_async=not sync, exec_pipelined=not sync)
    pipe.build()
    pipe._dali_nerf_sources = tuple(srcs.values())  # for release_pipeline
    return pipe


class SpatialRayLoader(BatchSource):
    """Batches of rays crossing one cell, sampled ahead by DALI (``prefetch`` runs).

    Args:
        scene: the split; cache: its ImageCache (all images, world_size 1) or None to decode.
        partition: :class:`~dali_nerf.partition.Partition`; cell: the cell j.
        rays_per_batch: B; rays_per_run: rounded up to K * B accepted rays per op run.
        prefetch: runs DALI computes ahead (0: synchronous, each run's outputs copied).
    Yields:
        the batch dict (origins, directions, rgb, indices, near, far), B rays of cell j: the
        accepted rays in stream order, so neither ``prefetch`` nor ``rays_per_run`` changes them.
    """

    def __init__(self, scene, partition, cell: int, rays_per_batch: int = 4096, seed: int = 0, prefetch: int = 2,
                 mode: str = "random", device: str = "cpu", num_threads: int = 2, rays_per_run: int = 262144,
                 cache=None, decode_batch: int = 8):
        from dali_nerf.pipelines.decode import decode_cache

        if not 0 <= cell < partition.num_cells:
            raise ConfigError(f"cell={cell}: partition has {partition.num_cells} cells")
        if not scene.has_bounds:
            raise ConfigError(f"{scene.root}: spatial routing needs per-image near/far bounds; use a scene format that defines them")
        self.scene, self.partition, self.cell = scene, partition, int(cell)
        self.rays_per_batch, self.seed, self.mode = int(rays_per_batch), int(seed), mode
        self.prefetch = int(prefetch)
        self.device = resolve_device(device)
        self.num_threads = int(num_threads)
        self.steps_per_run = max(1, math.ceil(int(rays_per_run) / self.rays_per_batch))
        self.rays_per_run = self.steps_per_run * self.rays_per_batch
        self.cache = cache if cache is not None else decode_cache(scene, 0, 1, device=self.device,
                                                                  num_threads=self.num_threads, batch=decode_batch)
        self.run_start, self.offset = 0, 0
        self._run = None            # (start, consumed, {name: (R, ...) tensor}) of the current run
        self._next_run_start = 0    # stream position of the next run the pipeline delivers
        self._consumed_total = 0
        self._accepted_total = 0
        self._stats = BatchStats()
        self._pipe = None
        self._closed = False

    # ---- producing ---------------------------------------------------------------------------
    def _fetch_run(self):
        """The pipeline's next run (a pipeline is built at ``_next_run_start`` when there is none)."""
        if self._pipe is None:
            device_id = torch.cuda.current_device() if self.device == "cuda" else None
            self._pipe = spatial_pipeline(self.cache, self.partition, self.cell, self.rays_per_run, self.mode,
                                          self.seed, first_start=self._next_run_start, prefetch=self.prefetch,
                                          device=self.device, num_threads=self.num_threads, device_id=device_id)
        outs = dict(zip(_NAMES, self._pipe.run()))
        run = {k: dali_to_torch(outs[k], self.device, copy=self.prefetch <= 0) for k in _NAMES[:-1]}
        consumed = outs["consumed"].as_cpu() if self.device == "cuda" else outs["consumed"]
        consumed = int(np.asarray(consumed[0]).reshape(-1)[0])
        start = self._next_run_start
        self._next_run_start += consumed
        return start, consumed, run

    def _drop_pipeline(self):
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            release_pipeline(pipe)

    # ---- iteration ---------------------------------------------------------------------------
    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("SpatialRayLoader is closed")
        t = self._stats.start()
        B = self.rays_per_batch
        if self._run is None or self.offset + B > self.rays_per_run:
            nxt = self.run_start + self._run[1] if self._run is not None else self.run_start
            if nxt != self._next_run_start:  # after load_state_dict: restart the pipeline there
                self._drop_pipeline()
                self._next_run_start = nxt
            start, consumed, run = self._fetch_run()
            if self._run is not None:
                self.offset = 0
            self._run = (start, consumed, run)
            self.run_start = start
            self._stats.runs += 1
            self._consumed_total += consumed
            self._accepted_total += self.rays_per_run
        run = self._run[2]
        batch = {k: v[self.offset:self.offset + B] for k, v in run.items()}
        self.offset += B
        self._stats.stop(t, B)
        return batch

    def state_dict(self) -> dict:
        start, off = self.run_start, self.offset
        if self._run is not None and off >= self.rays_per_run:
            start, off = start + self._run[1], 0
        return {"run_start": int(start), "offset": int(off), "cell": self.cell, "seed": self.seed,
                "mode": self.mode, "rays_per_batch": self.rays_per_batch, "rays_per_run": self.rays_per_run}

    def load_state_dict(self, state: dict) -> None:
        for k in ("cell", "seed", "mode", "rays_per_batch", "rays_per_run"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(f"load_state_dict: saved {k}={state[k]!r} but this loader has {getattr(self, k)!r}")
        self._drop_pipeline()
        self._run = None
        self.run_start, self.offset = int(state["run_start"]), int(state["offset"])
        self._next_run_start = self.run_start

    def stats(self) -> dict:
        d = self._stats.as_dict()
        d["acceptance"] = self._accepted_total / self._consumed_total if self._consumed_total else None
        return d

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._drop_pipeline()


# ---------------------------------------------------------------------------------------------
# routed baselines


class _RoutedSampler:
    """Candidate blocks from a PixelSampler, kept if they cross ``cell`` (numpy exact routing)."""

    def __init__(self, cache, scene, partition, seed: int, key: int, block: int):
        from dali_nerf.baseline import PixelSampler

        self.sampler = PixelSampler(cache, scene, seed, key, "random")
        self.partition, self.block = partition, int(block)

    def sample(self, position: int, cell: int, n: int):
        """(batch of n rays of ``cell``, next position, candidates used)."""
        from dali_nerf.partition import ray_cells

        parts, got, pos = [], 0, position
        while got < n:
            b = self.sampler.sample(pos, self.block)
            pos += self.block
            keep = ray_cells(self.partition, b["origins"].numpy(), b["directions"].numpy(),
                             b["near"].numpy()[:, 0], b["far"].numpy()[:, 0])[:, cell]
            idx = torch.from_numpy(np.nonzero(keep)[0])
            parts.append({k: v[idx] for k, v in b.items()})
            got += len(idx)
        out = {k: torch.cat([p[k] for p in parts])[:n] for k in parts[0]}
        return out, pos


class RoutedSyncLocal(BatchSource):
    """SS ``sync_local``: the rank samples its cell's batch in the training thread."""

    def __init__(self, scene, partition, cell: int, rays_per_batch: int = 4096, seed: int = 0, cache=None, num_threads: int = 2):
        from dali_nerf.pipelines.decode import decode_cache

        cache = cache if cache is not None else decode_cache(scene, 0, 1, num_threads=num_threads)
        self.cell, self.rays_per_batch = int(cell), int(rays_per_batch)
        self._s = _RoutedSampler(cache, scene, partition, seed, cell, 2 * rays_per_batch)
        self.position = 0
        self._stats = BatchStats()

    def __next__(self):
        t = self._stats.start()
        b, self.position = self._s.sample(self.position, self.cell, self.rays_per_batch)
        self._stats.stop(t, self.rays_per_batch)
        return b

    def state_dict(self):
        return {"position": self.position, "cell": self.cell}

    def load_state_dict(self, s):
        self.position = int(s["position"])



class RoutedSyncGlobal(BatchSource):
    """SS ``sync_global`` (the study's setting): rank 0 samples the batches of every rank's
    ``slot``-th cell in the training step and scatters them. A collective: every rank calls
    ``next()`` on its slot-th source in the same order."""

    _KEYS = ("origins", "directions", "rgb", "near", "far")

    def __init__(self, scene, partition, cells_per_rank, rank: int, slot: int, rays_per_batch: int = 4096,
                 seed: int = 0, cache=None, num_threads: int = 2):
        import torch.distributed as dist
        from dali_nerf.pipelines.decode import decode_cache

        self.world_size = len(cells_per_rank)
        if len({len(c) for c in cells_per_rank}) != 1:
            raise ConfigError(f"pipeline.name=sync_global with method ss needs the same number of cells on every rank "
                              f"({[len(c) for c in cells_per_rank]}); make partition cells a multiple of the world size")
        if self.world_size > 1 and not dist.is_initialized():
            raise ConfigError("pipeline.name=sync_global with world_size > 1 needs torchrun (an initialised process group)")
        self.rank, self.slot, self.rays_per_batch = int(rank), int(slot), int(rays_per_batch)
        self.cells = [c[slot] for c in cells_per_rank]
        self.position = [0] * self.world_size
        self._s = None
        if self.rank == 0:
            cache = cache if cache is not None else decode_cache(scene, 0, 1, num_threads=num_threads)
            self._s = _RoutedSampler(cache, scene, partition, seed, 10_000 + slot, 2 * rays_per_batch)
        self._stats = BatchStats()

    def __next__(self):
        import torch.distributed as dist

        t = self._stats.start()
        B, W = self.rays_per_batch, self.world_size
        if W == 1:
            b, self.position[0] = self._s.sample(self.position[0], self.cells[0], B)
        else:
            fl = torch.empty((B, 11), dtype=torch.float32)
            ix = torch.empty((B, 3), dtype=torch.int64)
            if self.rank == 0:
                fls, ixs = [], []
                for r in range(W):
                    g, self.position[r] = self._s.sample(self.position[r], self.cells[r], B)
                    fls.append(torch.cat([g[k] for k in self._KEYS], dim=1).contiguous())
                    ixs.append(g["indices"].contiguous())
                dist.scatter(fl, fls, src=0)
                dist.scatter(ix, ixs, src=0)
            else:
                dist.scatter(fl, None, src=0)
                dist.scatter(ix, None, src=0)
            b = {"origins": fl[:, 0:3], "directions": fl[:, 3:6], "rgb": fl[:, 6:9], "near": fl[:, 9:10],
                 "far": fl[:, 10:11], "indices": ix}
        self._stats.stop(t, B)
        return b

    def state_dict(self):
        return {"position": list(self.position), "slot": self.slot}

    def load_state_dict(self, s):
        self.position = [int(p) for p in s["position"]]



def spatial_loader(cfg, scene, partition, cell: int, *, cache=None, cells_per_rank=None, rank: int = 0, slot: int = 0):
    """The SS batch source of ``cell`` named by ``cfg.pipeline.name`` (rays | sync_local | sync_global)."""
    p = cfg.pipeline
    if p.name == "rays":
        return SpatialRayLoader(scene, partition, cell, rays_per_batch=p.rays_per_batch, seed=p.seed, prefetch=p.prefetch,
                                mode=p.mode, device=cfg.train.device, num_threads=p.num_threads,
                                rays_per_run=p.rays_per_run, cache=cache, decode_batch=cfg.cache.decode_batch)
    if p.mode != "random":
        raise ConfigError(f"pipeline.mode={p.mode}: the SS baselines sample iid rays only; use pipeline.mode=random")
    if p.name == "sync_local":
        return RoutedSyncLocal(scene, partition, cell, p.rays_per_batch, p.seed, cache=cache, num_threads=p.num_threads)
    if p.name == "sync_global":
        return RoutedSyncGlobal(scene, partition, cells_per_rank or [[cell]], rank, slot, p.rays_per_batch, p.seed,
                                cache=cache, num_threads=p.num_threads)
    raise ConfigError(f"pipeline.name={p.name}: method ss supports rays, sync_local, sync_global")
