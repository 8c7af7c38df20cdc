"""ReadySource: the benchmark floor, a source whose batches cost nothing.

It hands out one batch, taken once from a real source, again and again: a step with this source
is the same step with no data cost (no sampling, no hand-over beyond a dict). The study runs it
beside every configuration (``pipeline.name: ready`` for the trainers, the emulated launches'
floor), so that what a baseline loses to data is measured as its step minus the floor's, whatever
the phase it shows up in (the wait, a collective that waits for a straggler, compute slowed by
sampling threads). Training on it fits one batch: for timing only, never for a model.

>>> src = ReadySource.first_of(SyncLocalSampler(scene, 4096))
>>> next(src)["origins"].shape
torch.Size([4096, 3])
"""

from __future__ import annotations

from dali_nerf.sources.base import BatchSource, BatchStats

__all__ = ["ReadySource"]


class ReadySource(BatchSource):
    """Hands out ``batch`` (a dict of tensors) on every ``next()``; a fresh dict each time, the
    same tensors (do not modify them in place)."""

    def __init__(self, batch: dict):
        self.batch = dict(batch)
        self.rays_per_batch = int(next(iter(self.batch.values())).shape[0])
        self._stats = BatchStats()

    @classmethod
    def first_of(cls, source) -> "ReadySource":
        """The first batch of ``source`` (copied), which is then closed."""
        try:
            return cls({k: v.clone() for k, v in next(source).items()})
        finally:
            source.close()

    def __next__(self) -> dict:
        t = self._stats.start()
        batch = dict(self.batch)
        self._stats.stop(t, self.rays_per_batch)
        return batch

    def state_dict(self) -> dict:
        return {"steps": self._stats.steps}

    def load_state_dict(self, state: dict) -> None:
        pass
