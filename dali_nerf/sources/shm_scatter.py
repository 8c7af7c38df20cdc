"""sync_global across emulated ranks: rank 0 samples every rank's batch in its training thread and
hands each rank its slice through shared memory (no process group: the emulated ranks of the study
and of ``train.device=emulated`` share one host). Its device side (rank 0's copy of the global
batch, the scatter of each slice) is enqueued on the rank's emulated device, whose step waits for it.

Built by the registry (:func:`dali_nerf.sources.registry.build_source` with ``scatter=ShmLink(...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dali_nerf.data.imagecache import CacheStore
from dali_nerf.data.seeds import routed_stream
from dali_nerf.sources.routed_workers import routed_batch
from dali_nerf.sources.sync import PixelSampler

__all__ = ["ShmScatter", "ShmLink", "global_scatter", "RAY_FLOATS"]

RAY_FLOATS = 11
"""float32 columns of a packed ray: origins 3, directions 3, rgb 3, near 1, far 1 (+ 3 int64 indices)."""


@dataclass
class ShmLink:
    """How the emulated ranks meet: ``buf``, a shared buffer of :meth:`ShmScatter.buffer_bytes`;
    ``barrier()``, the ranks' rendezvous; ``device``, this rank's emulated device (``h2d`` and
    ``scatter`` enqueue its transfers; replaceable per segment)."""

    buf: object
    barrier: object
    device: object


class ShmScatter:
    """sync_global across emulated ranks: rank 0 samples every rank's batch in its training thread
    (real host work), writes them into shared memory, and every rank copies its slice out (a real
    host copy) after a barrier, and enqueues the emulated transfer on its device (rank 0's
    host-to-device copy of the global batch, then the NCCL scatter of the slice): waited for with
    the step's compute (:meth:`EmulatedDevice.run`), counted as h2d.

    Args:
        sample: on rank 0, ``sample(step) -> list of W batch dicts`` (B rays each, with near/far);
            None on the other ranks.
        buf: a shared ``multiprocessing`` RawArray of ``2 * W * B * 68`` bytes (two slots: rank 0
            writes step s+2's slot only after every rank passed step s+1's barrier, so after every
            rank copied step s out).
        barrier: ``barrier()`` blocks until all W ranks called it (the scatter's rendezvous).
    """

    def __init__(self, sample, buf, barrier, rank: int, world_size: int, rays_per_batch: int, dev):
        self.sample, self.barrier, self.dev = sample, barrier, dev
        self.rank, self.W, self.B = int(rank), int(world_size), int(rays_per_batch)
        n = self.W * self.B
        raw = np.frombuffer(buf, dtype=np.uint8)
        need = 2 * n * (RAY_FLOATS * 4 + 24)
        if raw.size < need:
            raise ValueError(f"ShmScatter: shared buffer holds {raw.size} bytes, needs {need}")
        fbytes = n * RAY_FLOATS * 4
        self._slots = []
        for s in range(2):
            base = s * n * (RAY_FLOATS * 4 + 24)
            fl = raw[base:base + fbytes].view(np.float32).reshape(n, RAY_FLOATS)
            ix = raw[base + fbytes:base + fbytes + n * 24].view(np.int64).reshape(n, 3)
            self._slots.append((fl, ix))
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        fl, ix = self._slots[self.step % 2]
        B, W = self.B, self.W
        if self.rank == 0:
            parts = self.sample(self.step)
            for r, g in enumerate(parts):
                fl[r * B:(r + 1) * B] = torch.cat([g["origins"], g["directions"], g["rgb"], g["near"], g["far"]], 1).numpy()
                ix[r * B:(r + 1) * B] = g["indices"].numpy()
        if W > 1:
            self.barrier()
        mine_f = torch.from_numpy(fl[self.rank * B:(self.rank + 1) * B].copy())
        mine_i = torch.from_numpy(ix[self.rank * B:(self.rank + 1) * B].copy())
        # device: rank 0's copy of the global batch, then the scatter of each slice; no rank's slice
        # is there before both (enqueued, waited for with the step's compute)
        self.dev.h2d(W * B * (RAY_FLOATS * 4 + 24))
        self.dev.scatter(B * (RAY_FLOATS * 4 + 24), W)
        self.step += 1
        return {"origins": mine_f[:, 0:3], "directions": mine_f[:, 3:6], "rgb": mine_f[:, 6:9],
                "near": mine_f[:, 9:10], "far": mine_f[:, 10:11], "indices": mine_i}

    def close(self) -> None:
        self._slots = []  # its views of the shared buffer (a block cannot close while they exist)

    @staticmethod
    def buffer_bytes(world_size: int, rays_per_batch: int) -> int:
        return 2 * int(world_size) * int(rays_per_batch) * (RAY_FLOATS * 4 + 24)


def global_scatter(method: str, scene, plan, link: ShmLink, *, cache=None, store=None,
                   partition=None) -> ShmScatter:
    """sync_global across emulated ranks: rank 0 samples the step's ``plan.world_size`` batches in
    its training thread from one sampler over all images (``cache``, else the ``store``'s; needed on
    rank 0 only) — DDP: one global batch split in rank order; SS: each cell's routed batch (one
    cell per rank, rank 0's shared candidate stream) — and :class:`ShmScatter` hands every rank
    its own through ``link``."""
    W, B, seed, rank = plan.world_size, plan.rays_per_batch, plan.seed, plan.rank
    sample = None
    if rank == 0:
        cache = cache if cache is not None else (store or CacheStore(scene, plan)).full("cpu")
        if method == "ddp":
            ps = PixelSampler(cache, scene, seed, 0, "random")

            def sample(step):
                g = ps.sample(step * B * W, B * W)
                return [{k: v[r * B:(r + 1) * B] for k, v in g.items()} for r in range(W)]
        else:
            ps = PixelSampler(cache, scene, seed, routed_stream(slot=0), "random")

            def sample(step):
                return [routed_batch(ps, partition, c, step, B, 2 * B) for c in range(W)]
    return ShmScatter(sample, link.buf, link.barrier, rank, W, B, link.device)
