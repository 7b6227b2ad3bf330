"""Readiness: which plan groups are complete, given the DDP buckets handed to the hook so far.

DDP hands the hook its gradient buckets one at a time, in bucket order, identically on every
rank. A plan group (defined over parameters) may span buckets; it can be exchanged as soon as
every parameter in it has arrived. The bucket Futures are completed by the engine once every
group they hold has been aggregated, written back and agreed on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..plans import Plan


class Readiness:
    def __init__(self, plan: Plan, params: list[Tensor]) -> None:
        self.plan = plan
        self._group_of = plan.group_of()
        self._pid_of_ptr = {p.data_ptr(): i for i, p in enumerate(params)}
        self._remaining: dict[int, int] = {}
        self._views: dict[int, Tensor] = {}

    def begin(self) -> None:
        self._remaining = {g.gid: len(g.param_ids) for g in self.plan.groups}
        self._views = {}

    def add_bucket(self, bucket: dist.GradBucket) -> list[int]:
        """Record a bucket's gradients; return the ids of the groups it completed, in gid order."""
        ready = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            pid = self.pid_of(p)
            gid = self._group_of.get(pid)
            if gid is None:  # left out of the plan this step (OSP defers it): not sent, not changed
                continue
            self._views[pid] = g
            self._remaining[gid] -= 1
            if self._remaining[gid] == 0:
                ready.append(gid)
        return sorted(ready)

    def pid_of(self, p: Tensor) -> int:
        """The engine's index of parameter ``p`` (DDP hands parameters, not indices)."""
        pid = self._pid_of_ptr.get(p.data_ptr())
        if pid is None:
            raise RuntimeError(
                "lightning_gc: DDP handed the hook a parameter the engine does not know (shape "
                f"{tuple(p.shape)}). Parameters must not be added, re-created or moved after the "
                "strategy has set up the model."
            )
        return pid

    def take_views(self, gid: int) -> list[Tensor]:
        """The gradient views (into DDP's bucket buffers) of group ``gid``, in flattening order."""
        return [self._views.pop(pid) for pid in self.plan.groups[gid].param_ids]

    def incomplete(self) -> list[int]:
        return sorted(gid for gid, n in self._remaining.items() if n > 0)


def new_future(buffer: Tensor) -> torch.futures.Future:
    if buffer.is_cuda:
        return torch.futures.Future(devices=[buffer.device])
    return torch.futures.Future()
