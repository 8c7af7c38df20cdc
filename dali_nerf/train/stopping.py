"""The ranks' agreement on where a signalled run stops (the checkpoint signal,
:func:`dali_nerf.interrupt.stop_signal`).

A rank that stops alone leaves the others hanging: DDP ranks in the next gradient all-reduce, any
rank in the next checkpoint's gather. So after every step each rank posts whether it has the
signal, in a non-blocking all-reduce (MAX, a 4-byte tensor, on a gloo group of its own so that it
never waits for a device), and reads the results in order as they complete. The first step ``s``
whose result says "some rank has it" fixes the stop step ``T = s + lag`` the same on every rank:
a rank waits for the result of step ``k - lag`` before it goes past step ``k``, so no rank can be
beyond ``T`` when it learns of ``s``. Every rank then trains up to ``T`` — a step all of them
complete — and the loop checkpoints it.

``lag`` bounds how far apart the ranks may drift: DDP ranks are in lockstep anyway (the gradient
all-reduce), so 1 costs nothing and stops one step later at most; the spatial-segmentation ranks
train their cells with no collective per step, so their lag (8) lets a rank run 8 steps ahead of
the slowest before it waits, and a signal costs at most 8 more steps. With one rank ``T`` is the
step at which it saw the signal.

>>> vote = StopVote(env, lag=1)
>>> target = vote.after_step(step, request.received)   # None, or the step every rank stops after
>>> vote.finish(request.received)                       # after the loop: did any rank get it?
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["StopVote", "LAG"]

LAG = {"ddp": 1, "ss": 8}
"""Steps a rank may run past an unread result, per method (module doc)."""


class StopVote:
    """One vote per step (module doc). Every rank makes the same calls: :meth:`after_step` after
    each step, then :meth:`finish` once."""

    def __init__(self, env, lag: int = 1):
        self.lag = max(0, int(lag))
        self.distributed = bool(env.distributed)
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.pending: deque = deque()
        self.target: Optional[int] = None

    def after_step(self, step: int, received: bool) -> Optional[int]:
        """Post this rank's flag for ``step``; return the step every rank stops after, once known
        (None before). The returned step is >= ``step``."""
        if not self.distributed:
            if received and self.target is None:
                self.target = step
            return self.target
        t = torch.tensor([int(bool(received))], dtype=torch.int32)
        self.pending.append((step, dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True), t))
        self._read(step - self.lag)
        return self.target

    def _read(self, must: int) -> None:
        """Read the results in order: wait for those of steps <= ``must``, take the others that
        have completed."""
        while self.pending:
            s, work, t = self.pending[0]
            if s > must and not work.is_completed():
                break
            work.wait()
            self.pending.popleft()
            if t.item() and self.target is None:
                self.target = s + self.lag

    def finish(self, received: bool) -> bool:
        """After the loop (every rank at the same last step): wait for the outstanding votes, then
        one blocking vote; whether any rank got the signal (so that all leave, or none)."""
        if not self.distributed:
            return bool(received) or self.target is not None
        self._read(float("inf"))
        t = torch.tensor([int(bool(received) or self.target is not None)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())
