"""Direct exchange: a small allreduce or allgather in one round of messages.

Every rank sends its message to every other rank at once and sums (allreduce) or keeps (allgather)
what it receives. One message latency instead of the ring's ``2(N-1)`` (allreduce) or ``N-1``
(allgather) in sequence, for ``N-1`` times the message on the rank's link instead of the ring's
``2(N-1)/N`` times (allreduce; the allgather sends the same bytes either way). So it pays where
latency dominates: small messages on a few ranks, which is what the engine's control messages (the
closing report, the opening check) and the small payloads of ``lowrank``, Top-k and QSGD are.

Why not the backend's collective: gloo runs every ``all_reduce`` as a ring. The direct exchange wins
for small messages at any link rate, and loses for larger ones on a slow link, where its copies of
the message outweigh the ring's latency (docs/cost_model.md, "Direct exchange").

When (:func:`use_direct`, the same inputs on every rank, so every rank takes the same path):

* at most :data:`DIRECT_MAX_RANKS` ranks (``N-1`` messages per rank; a larger group keeps the
  backend's collective), on a backend other than NCCL (NCCL has its own low-latency protocol);
* and either ``(N-1)·M`` is at most :data:`DIRECT_SMALL_BYTES` (below it direct wins at any rate:
  docs/cost_model.md), or an agreed network model (``alpha``, ``beta``) predicts it cheaper than the
  ring (:func:`lightning_gc.comm.cost_model.direct_cost` against ``ring_allreduce_cost``).

The sum is taken in rank order (rank 0's message first, this rank's own in its place) on every rank,
so every rank holds the same bits: the replicas stay identical. It differs from gloo's ring sum in
the last bits at 3 or more ranks (another order of the same additions); at 2 ranks ``a + b`` is the
ring's sum bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import cost_model
from .cost_model import allgather_bytes, ring_allreduce_bytes
from .p2p import batch_send_recv

#: the most ranks a direct exchange serves (each rank sends N-1 messages at once)
DIRECT_MAX_RANKS = 8
#: ``(N-1)·M`` bytes at or below which the direct exchange is used without a network model
DIRECT_SMALL_BYTES = 12 * 1024


def backend_allows(group: Any) -> bool:
    """Whether ``group``'s backend takes the direct exchange (every backend but NCCL)."""
    return "nccl" not in str(dist.get_backend(group)).lower()


def use_direct(nbytes: float, world_size: int, network: Any = None) -> bool:
    """Whether an ``nbytes`` allreduce on ``world_size`` ranks goes by :func:`direct_allreduce`
    (see the module docstring). ``network``: a :class:`~lightning_gc.comm.cost_model.NetworkModel`
    agreed across ranks, or None. Pure: the same arguments give the same answer on every rank."""
    if world_size < 2 or world_size > DIRECT_MAX_RANKS:
        return False
    if (world_size - 1) * nbytes <= DIRECT_SMALL_BYTES:
        return True
    if network is None:
        return False
    a, b = network.alpha_s, network.beta_s_per_byte
    return cost_model.direct_cost(a, b, nbytes, world_size) < cost_model.ring_allreduce_cost(a, b, nbytes, world_size)


def _exchange(t: Tensor, group: Any) -> list[Tensor]:
    """Every rank's copy of ``t`` in group rank order (this rank's is ``t`` itself)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    out: list[Tensor] = []
    works: list = []
    for r in range(n):
        if r == me:
            out.append(t)
            continue
        peer = dist.get_global_rank(group, r) if group is not None else r
        buf = torch.empty_like(t)
        out.append(buf)
        works += batch_send_recv(t, peer, buf, peer, group)
    for w in works:
        w.wait()
    return out


def direct_allreduce(t: Tensor, group: Any = None, op: str = "sum") -> int:
    """Reduce ``t`` over the ranks of ``group`` in place (``op``: ``"sum"`` or ``"max"``,
    element-wise), in one round of messages; returns the bytes this rank sent. Every rank combines
    the messages in rank order, so every rank holds the same bits. A collective: every rank of the
    group calls it with a tensor of the same shape and dtype."""
    if op not in ("sum", "max"):
        raise ValueError(f"direct_allreduce(op={op!r}): use 'sum' or 'max'.")
    if not t.is_contiguous():
        raise ValueError("direct_allreduce needs a contiguous tensor (it is sent as it lies in memory); "
                         "pass t.contiguous() and copy the result back.")
    parts = _exchange(t, group)
    total = parts[0].clone()
    for p in parts[1:]:
        if op == "sum":
            total.add_(p)
        else:
            torch.maximum(total, p, out=total)
    t.copy_(total)
    return allgather_bytes(t.numel() * t.element_size(), len(parts))


def direct_allgather(out: list[Tensor], t: Tensor, group: Any = None) -> int:
    """``dist.all_gather(out, t, group)`` in one round of messages; returns the bytes this rank sent
    (the same as the ring allgather's: ``N-1`` copies of ``t``)."""
    parts = _exchange(t.contiguous(), group)
    if len(out) != len(parts):
        raise ValueError(f"direct_allgather: {len(out)} output tensors for a group of {len(parts)} ranks; "
                         "pass one per rank.")
    for o, p in zip(out, parts):
        o.copy_(p)
    return allgather_bytes(t.numel() * t.element_size(), len(parts))


def allreduce_chosen(t: Tensor, group: Any = None, network: Any = None, op: str = "sum") -> int:
    """Allreduce ``t`` in place (``op``: ``"sum"`` or ``"max"``) by the direct exchange where
    :func:`use_direct` says so, else by the backend's ``all_reduce`` (a ring); returns the bytes this
    rank sent (modelled)."""
    n = dist.get_world_size(group)
    nbytes = t.numel() * t.element_size()
    if backend_allows(group) and t.is_contiguous() and use_direct(nbytes, n, network):
        return direct_allreduce(t, group, op)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return ring_allreduce_bytes(nbytes, n)


def allgather(out: list[Tensor], t: Tensor, group: Any = None) -> int:
    """``dist.all_gather`` by the direct exchange on at most :data:`DIRECT_MAX_RANKS` ranks (the same
    bytes as the ring, one latency instead of ``N-1``), else by the backend's; returns the bytes this
    rank sent."""
    n = dist.get_world_size(group)
    if 1 < n <= DIRECT_MAX_RANKS and backend_allows(group):
        return direct_allgather(out, t, group)
    dist.all_gather(out, t, group=group)
    return allgather_bytes(t.numel() * t.element_size(), n)


def allreduce_seconds(network: Any, nbytes: float, world_size: int) -> float:
    """The α-β time of an ``nbytes`` allreduce by the algorithm :func:`allreduce_chosen` takes for it
    (off NCCL): :func:`~lightning_gc.comm.cost_model.direct_cost` where :func:`use_direct`, else
    the ring's. What the ``auto`` model charges an engine allreduce (lightning_gc/auto/model.py)."""
    a, b = network.alpha_s, network.beta_s_per_byte
    if use_direct(nbytes, world_size, network):
        return cost_model.direct_cost(a, b, nbytes, world_size)
    return cost_model.ring_allreduce_cost(a, b, nbytes, world_size)


def allgather_seconds(network: Any, nbytes: float, world_size: int) -> float:
    """The α-β time of :func:`allgather` of ``nbytes`` per rank (off NCCL): the direct exchange's on
    up to :data:`DIRECT_MAX_RANKS` ranks, else the ring allgather's (``cost_model.allgather_cost``)."""
    a, b = network.alpha_s, network.beta_s_per_byte
    if 1 < world_size <= DIRECT_MAX_RANKS:
        return cost_model.direct_cost(a, b, nbytes, world_size)
    return cost_model.allgather_cost(a, b, nbytes, world_size)
