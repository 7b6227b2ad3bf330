"""A dense step that stops before it sends its gradient: the engine's side of a pre-step check.

A caller hands the engine a job to run before the next step (``GCEngine.run_before_step``; e.g. the
link canary of ``compressor="auto"``, :mod:`lightning_gc.auto.canary`). The engine runs it on its
ordered worker, so it overlaps the step's forward and backward and the step's gradient buckets wait
behind it; the job returns a :class:`StopVerdict`. A verdict ``stop`` on a dense mode's step stops
that step: each rank keeps its own gradient of every compressed group (after any error memory that was
due) as its error memory, sends the step's exact group (the small tensors) by a direct allreduce, and
the compressed groups' gradients of the step are zero on every rank (:func:`defer_bucket`);
``StepStats.dense_stopped`` tells the caller.

Nothing is lost: what a stopped step did not send is error memory, sent by the next step's method (a
dense mode adds it to its next step's buckets; a compressed method's error feedback, or its one-off
flush where it has none: the slot rule of :mod:`lightning_gc.engine.slots`). A step whose deferred
gradient is non-finite on some rank is a non-finite step on every rank (a flag in the exact group's
message), and the memory stays as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..comm.collectives import unflatten_into
from ..comm.direct import direct_allreduce


@dataclass(frozen=True)
class StopVerdict:
    """What a job run before a step tells it (identical on every rank): ``stop`` a dense step; a value
    each rank carried, averaged over the ranks (``StepStats.carried_wall_mean_s``; NaN: none); and the
    check's figures for the step's statistics (``dense_check_s``, ``dense_check_predicted_s``,
    ``dense_check_bytes``)."""

    stop: bool
    carried: float = math.nan
    check_s: float | None = None
    predicted_s: float | None = None
    nbytes: int = 0


def defer_bucket(layout: list[tuple[Tensor, int | None, int]], deferred: dict[int, Tensor],
                 group_sizes: dict[int, tuple[int, torch.dtype]], group, world_size: int) -> tuple[bool, int]:
    """A bucket of a stopped step: each compressed group's gradient view (``gid`` not None) goes into
    ``deferred[gid]`` at its offset and is zeroed; the exact views (``gid`` None) are averaged by a
    direct allreduce, with one more element: whether this rank's deferred gradient was non-finite.
    Returns (non-finite on some rank, bytes sent). A collective (every rank, the same layout)."""
    bad = 0.0
    exact: list[Tensor] = []
    for grad, gid, off in layout:
        if gid is None:
            exact.append(grad)
            continue
        n, dtype = group_sizes[gid]
        mem = deferred.get(gid)
        if mem is None:
            mem = deferred[gid] = torch.zeros(n, dtype=dtype, device=grad.device)
        flat = grad.reshape(-1)
        mem[off:off + flat.numel()].copy_(flat)
        if not bool(torch.isfinite(flat).all()):
            bad = 1.0
        grad.zero_()
    dtype = exact[0].dtype if exact else torch.float32
    device = exact[0].device if exact else layout[0][0].device
    msg = torch.cat([g.reshape(-1) for g in exact] + [torch.tensor([bad], dtype=dtype, device=device)])
    msg.div_(world_size)
    sent = direct_allreduce(msg, group)
    unflatten_into(msg, exact)
    nonfinite = bool(msg[-1] != 0) or not bool(torch.isfinite(msg[:-1]).all())
    return nonfinite, sent
