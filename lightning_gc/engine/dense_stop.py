"""A dense step that can stop: time the first slice of its exchange, and defer the rest if the link fell.

Why: under ``compressor="auto"`` a dense mode (fp32 or a 16-bit cast on DDP's buckets) is the pick on
a fast link. When the link falls, the first dense step at the fallen rate pays the whole gradient at
that rate before any test can see it: on the ``mlp`` preset at 10 Mbit/s one 16-bit step took
3.0-3.4 s, where the best static method ran the whole 146-step round in 8.6-8.9 s
(docs/auto-measurements.md). Every test that reads a step's wall acts after that step.

How: the first gradient bucket of such a step (the first one DDP hands over) sends its first
``chunk_bytes`` on the wire first, by the direct exchange (one round of messages;
:mod:`lightning_gc.comm.direct`), and times it on every rank. One more direct exchange (an allgather of
two floats) shares each rank's time, and the value the ``auto`` chooser hands in with
:meth:`GCEngine.carry_wall` (the step before's wall: it rides here at no message of its own). Every
rank then holds the same list of times and takes the same decision:

* **go on** (the usual case): the chunk's sum is kept, the rest of the bucket and the later buckets
  are sent as DDP's own hook sends them;
* **stop**, when the *fastest* rank's time is at least ``factor`` times what the agreed network model
  predicts for the chunk and at least ``margin_s`` more than that: nothing more of the step is sent
  dense. Each rank keeps its own gradient of every compressed group (after any error memory that was
  due) as its error memory, and sends the step's exact group (the small tensors) by a direct
  allreduce; the compressed groups' gradients of the step are zero on every rank. The chooser sees
  ``StepStats.dense_stopped`` and re-decides at once (docs/auto.md, "A dense step that stops").

Why the fastest rank's time: a rank that reaches its first bucket early waits in the chunk's exchange
for the others, so its time holds their lateness (backward's skew between ranks, several ms on this
project's 2-core machine). The latest rank waits for nobody; its time is the network's, less the
skew when the skew is longer than the transfer (a stop can then be missed, never caused).

Why 64 KiB by default: on a 4-rank group each rank sends three copies, 192 KiB. The bench's shaper
lets 64 KiB out at line rate (``tc`` ``tbf`` burst, ``lightning_gc.bench.netns.tc_burst_bytes``), so a
chunk of 16 KiB (48 KiB on the link) left at line rate on a link fallen to 10 Mbit/s and showed
nothing. At 10 Mbit/s the 128 KiB beyond the burst take about 105 ms; at 1 Gbit/s the whole chunk
takes 1-2 ms.

Nothing is lost: what a stopped step did not send is error memory, sent by the next step's method (a
dense mode adds it to its next step's buckets; a compressed method's error feedback, or its one-off
flush where it has none: the slot rule of :mod:`lightning_gc.engine.slots`). A step whose deferred
gradient is non-finite on some rank is a non-finite step on every rank (a flag in the exact group's
message), and the memory stays as it was.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import cost_model
from ..comm.direct import direct_allgather, direct_allreduce


@dataclass(frozen=True)
class DenseStop:
    """When a dense step stops (see the module docstring).

    Args:
        chunk_bytes: bytes of the first bucket sent first and timed (on the wire, in the step's
            dtype). Above the shaper's or policer's burst allowance divided by ``N-1``, or a fallen link
            does not show; larger costs more on a fast link (``N-1`` copies by the direct exchange).
        factor: stop when the fastest rank's time is at least this many times the model's.
        margin_s: and at least this much more than the model's (scheduling noise on a busy host).
    """

    chunk_bytes: int = 64 * 1024
    factor: float = 4.0
    margin_s: float = 0.02

    def __post_init__(self) -> None:
        b = self.chunk_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"DenseStop.chunk_bytes={b!r} must be an integer >= 1: the bytes of the first bucket "
                             "timed before the rest is sent (e.g. 65536).")
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1:
            raise ValueError(f"DenseStop.factor={f!r} must be a finite number >= 1: how many times the model's time "
                             "the chunk must take to stop the step (e.g. 4).")
        m = self.margin_s
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
            raise ValueError(f"DenseStop.margin_s={m!r} must be a finite number of seconds >= 0: how much longer than "
                             "the model's time the chunk must take to stop the step (e.g. 0.02).")

    def predicted_s(self, network, nbytes: int, world_size: int) -> float | None:
        """The model's time for the chunk's direct exchange (None without a network model)."""
        if network is None:
            return None
        return cost_model.direct_cost(network.alpha_s, network.beta_s_per_byte, nbytes, world_size)

    def stops(self, fastest_s: float, predicted_s: float | None) -> bool:
        """The rule: the fastest rank's time against the model's (no model: never)."""
        if predicted_s is None:
            return False
        return fastest_s >= self.factor * predicted_s and fastest_s >= predicted_s + self.margin_s


@dataclass
class CheckResult:
    """What every rank learned from the chunk (identical on every rank)."""

    stop: bool
    fastest_s: float  # the fastest rank's time for the chunk
    predicted_s: float | None  # the model's
    carried: float | None  # the mean over the ranks of the carried value (None if some rank had none)
    bytes_sent: int  # this rank's bytes for the chunk and the agreement
    chunk_bytes: int  # the chunk's bytes (the timed message)
    payload_bytes: int = 0  # the chunks' bytes, all attempts (check_wire)
    attempts: int = 1


def check_chunk(chunk: Tensor, carry: float | None, stop: DenseStop, network, group, world_size: int) -> CheckResult:
    """Sum ``chunk`` (contiguous, already divided by N) over the ranks in place by the direct
    exchange, timed; share the times and ``carry``; decide. A collective: every rank calls it with a
    chunk of the same size and dtype."""
    nbytes = chunk.numel() * chunk.element_size()
    t0 = time.perf_counter()
    sent = direct_allreduce(chunk, group)
    if chunk.is_cuda:
        torch.cuda.current_stream().synchronize()
    mine = time.perf_counter() - t0
    shared = torch.tensor([mine, math.nan if carry is None else float(carry)], dtype=torch.float64)
    if chunk.is_cuda:
        shared = shared.to(chunk.device)
    parts = [torch.empty_like(shared) for _ in range(world_size)]
    sent += direct_allgather(parts, shared, group)
    rows = [p.cpu().tolist() for p in parts]  # rank order: the same list on every rank
    fastest = min(r[0] for r in rows)
    carried_vals = [r[1] for r in rows]
    carried = None if any(math.isnan(v) for v in carried_vals) else sum(carried_vals) / world_size
    predicted = stop.predicted_s(network, nbytes, world_size)
    return CheckResult(stop.stops(fastest, predicted), fastest, predicted, carried, sent, nbytes, nbytes)


def check_wire(wire: Tensor, carry: float | None, stop: DenseStop, network, group,
               world_size: int) -> tuple[CheckResult, int]:
    """The first bucket's check: time ``wire``'s first chunk (:func:`check_chunk`); where it says
    stop, time the next chunk as well (the same one again where the bucket holds no more) and stop
    only if that one says so too. Returns the verdict (the last attempt's figures) and how many of
    ``wire``'s leading elements are already summed and divided by N in place (0 on a stop: ``wire``
    untouched). ``wire`` is not yet divided by N.

    Why a second chunk: one chunk slowed by a scheduler stall on the fastest rank (this project's
    2-core machine runs 4 ranks) would stop a step on a good link and move auto off its method on a
    β that the link never had. Two in a row are rarer; on a fallen link the second costs one more
    chunk (~160 ms at 10 Mbit/s for 64 KiB on 4 ranks). Why its figures: a shaper's burst allowance
    let part of the first chunk out at line rate, and the first chunk spent it, so the second
    times the link's own rate."""
    n = world_size
    k = min(wire.numel(), max(1, stop.chunk_bytes // wire.element_size()))
    first = wire[:k] / n  # a copy: the bucket stays this rank's gradient until the verdict
    res = check_chunk(first, carry, stop, network, group, n)
    if not res.stop:
        wire[:k].copy_(first)
        return res, k
    end = min(wire.numel(), 2 * k)
    second = (wire[k:end] if end > k else wire[:k]) / n
    again = check_chunk(second, None, stop, network, group, n)
    again.carried, again.attempts = res.carried, 2
    again.bytes_sent += res.bytes_sent
    again.payload_bytes += res.payload_bytes
    if again.stop:
        return again, 0
    wire[:k].copy_(first)
    if end > k:
        wire[k:end].copy_(second)
        return again, end
    return again, k


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


def usable(group) -> bool:
    """Whether ``group`` takes the direct exchange this needs (see :func:`lightning_gc.comm.direct.backend_allows`)."""
    from ..comm.direct import DIRECT_MAX_RANKS, backend_allows
    return (dist.is_available() and dist.is_initialized()
            and 1 < dist.get_world_size(group) <= DIRECT_MAX_RANKS and backend_allows(group))
