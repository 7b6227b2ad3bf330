"""The link canary: a dense step that sees a fallen link before it sends its gradient, and stops.

Why: under ``compressor="auto"`` a dense mode (fp32 or a 16-bit cast on DDP's buckets) is the pick on
a fast link. When the link falls, the next dense step sends the whole gradient at the fallen rate
before any test that reads a step's wall can act: on the ``mlp`` preset at 10 Mbit/s one 16-bit
step took 3.0-3.4 s, where the best static method ran the whole 146-step round in 8.6-8.9 s
(docs/auto-measurements.md).

How (:meth:`GCEngine.sing_canary`, called between steps; the engine runs it on its ordered worker,
so it overlaps the next step's forward and backward): every rank sends ``nbytes`` of padding to
every other rank at once (the direct exchange, :mod:`lightning_gc.comm.direct`), timed; then one
more direct exchange (an allgather of two floats per rank) shares each rank's time and a value the
caller carries (the ``auto`` chooser's step wall: it rides here at no message of its own). Every
rank then holds the same list and takes the same verdict: the link fell when the *fastest* rank's
time is at least ``factor`` times what the agreed network model gives the message and at least
``margin_s`` more. A verdict "fell" is timed once more, with a second message, and stands only if
that one says so too. The step's gradient buckets wait on the worker behind the canary, so the
first one sent already knows the verdict. On "fell" the dense step **stops**: each rank keeps its
own gradient of every compressed group (after any error memory that was due) as its error memory,
sends the step's exact group (the small tensors) by a direct allreduce, and the compressed groups'
gradients of the step are zero on every rank (:func:`defer_bucket`); ``StepStats.dense_stopped``
tells the chooser, which re-decides at the step's end.

Why the fastest rank's time: a rank that enters early waits in the exchange for the others, so its
time holds their lateness. The latest rank waits for nobody: its time is the network's, less the
others' lead where that lead is longer than the transfer (a fall can then be missed, never invented).

Why a second message: one message slowed by a scheduler stall (4 ranks share 2 cores on this
project's machine) would otherwise stop a step on a link that never fell. On a fallen link the second
costs one more message (~160 ms for 64 KiB on 4 ranks at 10 Mbit/s). Its figures are the verdict's:
a shaper's burst allowance let part of the first message out at line rate, the first spent it, so
the second times the link's own rate.

Why 64 KiB: on a 4-rank group each rank sends three copies, 192 KiB. The bench's shaper lets 64 KiB
out at line rate (``tc`` ``tbf`` burst, ``lightning_gc.bench.netns.tc_burst_bytes``); the 128 KiB
beyond it take ~105 ms at 10 Mbit/s.

Why on the worker, sung before the step: three placements were measured (docs/auto.md, "The link
canary"). Timed at the step's first gradient bucket, its two exchanges fell in the middle of
backward and held the bucket's own send back: ~7 ms of a ~57 ms fp16 step on ``mlp`` at 1 Gbit/s.
Sung on the training thread before the step, it was a barrier that the ranks' skew between steps
(data loading, the optimizer) had to wait out: ~7 ms too. Sung at the end of each step it never saw
the bench's falls, which come between steps.

Nothing is lost: what a stopped step did not send is error memory, sent by the next step's method (a
dense mode adds it to its next step's buckets; a compressed method's error feedback, or its one-off
flush where it has none: the slot rule of :mod:`lightning_gc.engine.slots`). A step whose deferred
gradient is non-finite on some rank is a non-finite step on every rank (a flag in the exact group's
message), and the memory stays as it was.

What it does not see: a link that falls *during* a step's exchange makes that step slow (the
``auto`` chooser's one-step test acts on its wall); the canary before the next step sees it first.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..comm import cost_model
from ..comm.direct import direct_allgather, direct_allreduce


@dataclass(frozen=True)
class LinkCanary:
    """When the canary says the link fell (see the module docstring).

    Args:
        nbytes: bytes each rank sends to each other rank. Above the link's burst allowance divided
            by ``N-1``, or a fall does not show; more costs more on a fast link.
        factor: the link fell when the fastest rank's time is at least this many times the model's ...
        margin_s: ... and at least this many seconds more (scheduling noise on a busy host).
    """

    nbytes: int = 64 * 1024
    factor: float = 4.0
    margin_s: float = 0.02

    def __post_init__(self) -> None:
        b = self.nbytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"canary_bytes={b!r} must be an integer >= 1: the bytes each rank sends each other rank "
                             "to time the link (e.g. 65536).")
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1:
            raise ValueError(f"canary_factor={f!r} must be a finite number >= 1: how many times the model's time the "
                             "message must take for the link to count as fallen (e.g. 4).")
        m = self.margin_s
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
            raise ValueError(f"canary_margin_s={m!r} must be a finite number of seconds >= 0: how much longer than the "
                             "model's time the message must take for the link to count as fallen (e.g. 0.02).")

    def predicted_s(self, network: Any, world_size: int) -> float | None:
        """The model's time for the message (the direct exchange's α-β cost; None without a model)."""
        if network is None:
            return None
        return cost_model.direct_cost(network.alpha_s, network.beta_s_per_byte, self.nbytes, world_size)

    def fell(self, fastest_s: float, predicted_s: float | None) -> bool:
        """The rule: the fastest rank's time against the model's (no model: never)."""
        if predicted_s is None:
            return False
        return fastest_s >= self.factor * predicted_s and fastest_s >= predicted_s + self.margin_s


@dataclass
class CanaryResult:
    """What every rank learned (identical on every rank)."""

    fell: bool
    fastest_s: float  # the fastest rank's time for the (last) message
    predicted_s: float | None  # the model's
    carried: float  # the mean over the ranks of the value each rank carried (the step's wall)
    messages: int  # 1, or 2 where the first said "fell"


def _timed(nbytes: int, carry: float, group: Any, world_size: int, device: torch.device) -> tuple[float, float]:
    """One message of ``nbytes`` to every other rank, timed, then the times and ``carry`` shared:
    (the fastest rank's time, the mean of the carried values)."""
    pad = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    parts = [torch.empty_like(pad) for _ in range(world_size)]
    t0 = time.perf_counter()
    direct_allgather(parts, pad, group)
    if pad.is_cuda:
        torch.cuda.current_stream().synchronize()
    mine = time.perf_counter() - t0
    shared = torch.tensor([mine, float(carry)], dtype=torch.float64, device=device)
    rows = [torch.empty_like(shared) for _ in range(world_size)]
    direct_allgather(rows, shared, group)
    vals = [r.cpu().tolist() for r in rows]  # rank order: the same list on every rank
    return min(v[0] for v in vals), sum(v[1] for v in vals) / world_size


def sing(canary: LinkCanary, carry: float, network: Any, group: Any, world_size: int,
         device: torch.device) -> CanaryResult:
    """Time the canary (twice where the first says "fell") and agree ``carry``'s mean. A collective:
    every rank of ``group`` calls it at the same point (up to 8 ranks, off NCCL: the direct exchange)."""
    predicted = canary.predicted_s(network, world_size)
    fastest, carried = _timed(canary.nbytes, carry, group, world_size, device)
    if not canary.fell(fastest, predicted):
        return CanaryResult(False, fastest, predicted, carried, 1)
    fastest, _ = _timed(canary.nbytes, carry, group, world_size, device)
    return CanaryResult(canary.fell(fastest, predicted), fastest, predicted, carried, 2)


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
    off = 0
    for g in exact:
        g.copy_(msg[off:off + g.numel()].view_as(g))
        off += g.numel()
    nonfinite = bool(msg[-1] != 0) or not bool(torch.isfinite(msg[:-1]).all())
    return nonfinite, sent
