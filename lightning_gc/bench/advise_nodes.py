"""``lightning-gc advise --ranks-per-node K``: each candidate flat and by nodes, side by side.

A cluster of ``nodes`` hosts with ``K`` ranks each: a fast link inside a host (``--intra-bandwidth``)
and the host's network card between hosts (``--bandwidth``). Two ways to send a step's gradient:

* **flat** (``topology="flat"``): the ``compressor="auto"`` model (:func:`lightning_gc.auto.model.predict`)
  on one link. Ranks are numbered host by host, so a ring over all ``N`` ranks crosses each host's
  card once per direction, one flow per card, and its other hops run inside the hosts: every hop
  moves the same chunk at the same time, so the slowest link bounds the ring. The flat link is
  therefore the slower of the two (its rate and its latency); for a ring allreduce or ring
  allgather that is the model's ``2(N−1)/N·M`` or ``(N−1)·P`` at the card's rate. The direct
  exchange (:mod:`lightning_gc.comm.direct`, used on at most 8 ranks off NCCL) is different: each of
  the ``K`` ranks of a host sends its message to the ``N − K`` ranks of the other hosts at once,
  ``K·(N−K)`` messages on the card, not the ``N − 1`` of one rank's link; advise charges the card's
  (:func:`lightning_gc.comm.cost_model.flat_direct_card_cost`).
* **by nodes** (``topology="nodes"``, :mod:`lightning_gc.comm.hierarchy`): a dense reduce-scatter
  inside the host, the candidate's collective between hosts on a ``1/K`` shard, the ``K`` ranks of a
  host sharing its card (each sees ``1/K`` of its rate), then an allgather inside the host
  (:func:`lightning_gc.comm.cost_model.nodes_exchange_cost`). The codec runs on the shard, with
  ``nodes`` payloads to aggregate: advise measures it on a shard of the gradient. DDP's buckets
  (``ddp``, ``fp16``, ``bf16``) go by the same three stages per bucket, overlapped with backward as
  flat. The error charge counts ``nodes`` payloads (a node sends one, of its mean).

Candidates ``topology="nodes"`` refuses (:func:`lightning_gc.comm.hierarchy.refusal`, the one list)
are shown with the reason.

**Left out** (as in the flat model): contention with other jobs, the intra-node reduction's
arithmetic, stragglers; the inter-node hop of the engine's small closing report is charged flat.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..auto.candidates import AutoCandidate
from ..auto.model import (
    BUCKET_MODES,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    ENGINE_CONTROL_BYTES,
    MethodCost,
    Prediction,
    Workload,
    ddp_buckets,
    efficiency,
    predict,
)
from ..comm import cost_model
from ..comm.cost_model import NetworkModel
from ..comm.direct import DIRECT_MAX_RANKS, allreduce_seconds, use_direct
from ..comm.hierarchy import refusal, shard_segments
from ..compressors import GroupContext, build_compressor

__all__ = ["Cluster", "Row", "TopologyAdvice", "card_bytes_flat", "card_bytes_nodes", "check_ranks_per_node",
           "compare", "node_refusal", "predict_flat", "predict_nodes", "shard_of"]

#: how advise names the option in its errors
_K = "--ranks-per-node"


def check_ranks_per_node(k: Any, world_size: int, error: type[Exception] = ValueError) -> int:
    """``k`` if it is a usable number of ranks per node for ``world_size`` ranks (an integer ``>= 1``
    that divides ``world_size``, and fewer than ``world_size`` unless ``k == 1``); else ``error``
    naming the value, the reason and the fix."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise error(f"{_K} {k!r} is not a number of ranks per node: give an integer >= 1 (the GPUs, i.e. "
                    f"processes, on one host), e.g. {_K} 8; 1 (the default) is one rank per host")
    if world_size % k:
        divisors = [d for d in range(2, world_size) if world_size % d == 0][:6]
        raise error(f"{_K} {k} does not divide --ranks {world_size}: every node runs as many ranks, so the world "
                    f"size is nodes x ranks per node. Give a divisor of {world_size} (e.g. {divisors or [1]}) or "
                    f"--ranks nodes*{k}")
    if k == world_size and k > 1:
        raise error(f"{_K} {k} with --ranks {world_size} is one node: there is no link between nodes to compare "
                    f"(topology='nodes' refuses one node). Give fewer ranks per node, or --ranks {2 * k} for two "
                    "such nodes")
    return k


@dataclass(frozen=True)
class Cluster:
    """``world_size`` ranks, ``ranks_per_node`` per host; ``inter``: a host's network card (its whole
    rate, shared by the host's ranks), ``intra``: the link between two ranks of a host."""

    world_size: int
    ranks_per_node: int
    inter: NetworkModel
    intra: NetworkModel

    def __post_init__(self) -> None:
        check_ranks_per_node(self.ranks_per_node, self.world_size)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def flat(self) -> NetworkModel:
        """The one link a flat ring runs on: its slowest hop bounds it (module docstring)."""
        if self.ranks_per_node == 1:
            return self.inter
        return NetworkModel(max(self.inter.alpha_s, self.intra.alpha_s),
                            max(self.inter.beta_s_per_byte, self.intra.beta_s_per_byte))

    @property
    def shard_link(self) -> NetworkModel:
        """What one rank sees between nodes when its host's ranks all send: ``1/K`` of the card."""
        return NetworkModel(self.inter.alpha_s, cost_model.shared_card_beta(self.inter.beta_s_per_byte,
                                                                            self.ranks_per_node))


# ---------------------------------------------------------------------------------------------- refusals, shard
def node_collective(cand: AutoCandidate) -> str:
    """The collective a candidate runs (``"auto"`` resolved as GCConfig resolves it)."""
    if cand.compressor is None:
        return "allreduce"  # DDP's buckets: a dense allreduce
    from ..exchanges.registry import validate_collective

    comp = build_compressor(cand.compressor, cand.ratio, dict(cand.compressor_args) or None)
    return validate_collective(comp, cand.collective)


def node_refusal(cand: AutoCandidate) -> str | None:
    """Why ``topology="nodes"`` refuses the candidate (:func:`lightning_gc.comm.hierarchy.refusal`), or None."""
    return refusal(collective=node_collective(cand), sync="bsp", omgs=False, auto=False)


def shard_of(flat: Tensor, ctx: GroupContext, k: int, nodes: int) -> tuple[Tensor, GroupContext]:
    """Local rank 0's shard of the group (``⌈n/k⌉`` elements, zero-padded as the engine pads it) and
    the context the exchange between nodes sees (NodeTopology.enter: rank = node, world = nodes)."""
    n = flat.numel()
    s = -(-n // k)
    shard = torch.zeros(s, dtype=flat.dtype, device=flat.device)
    shard[:min(s, n)].copy_(flat[:s])
    seg = shard_segments(tuple(ctx.segments), 0, min(s, n), s)
    return shard, dataclasses.replace(ctx, rank=0, world_size=nodes, segments=seg, shapes=(), names=())


# ---------------------------------------------------------------------------------------------- predictions
def _direct(cost: MethodCost, n: int, network: NetworkModel) -> bool:
    """Whether the engine sends ``cost``'s payload to ``n`` peers over ``network`` by the direct exchange."""
    if cost.wire == "allgather":
        return 1 < n <= DIRECT_MAX_RANKS
    return cost.wire == "allreduce" and use_direct(cost.payload_bytes, n, network)


def _with_extra(p: Prediction, extra: float, cost: MethodCost, workload: Workload, n: int, w: float) -> Prediction:
    step = p.step_s + extra
    eff = efficiency(cost, n, w)
    return dataclasses.replace(p, step_s=step, comm_s=p.comm_s + extra,
                               exposed_s=max(step - p.compute_s - workload.other_s, 0.0), time_per_progress_s=step / eff)


def predict_flat(cost: MethodCost, workload: Workload, cluster: Cluster, w: float) -> Prediction:
    """The flat step: :func:`lightning_gc.auto.model.predict` on :attr:`Cluster.flat`, plus, for the
    direct exchange with several ranks per host, the card's ``K·(N−K)`` messages in place of one
    rank's ``N − 1`` (module docstring)."""
    n, k, net = cluster.world_size, cluster.ranks_per_node, cluster.flat
    p = predict(cost, workload, net, n, w)
    if k == 1 or cost.wire == "bucket" or not _direct(cost, n, net):
        return p
    a, b = net.alpha_s, net.beta_s_per_byte
    card = cost_model.flat_direct_card_cost(a, cluster.inter.beta_s_per_byte, cost.payload_bytes, n, k)
    extra = max(card - cost_model.direct_cost(a, b, cost.payload_bytes, n), 0.0)
    return _with_extra(p, extra, cost, workload, n, w)


def _nodes_allreduce(cluster: Cluster, nbytes: float, direct_ok: bool = True) -> float:
    """A dense allreduce of ``nbytes`` by nodes (the engine's exact group: direct between nodes where
    :func:`~lightning_gc.comm.direct.use_direct` says so; DDP's buckets: ``direct_ok=False``, a ring)."""
    c, k = cluster, cluster.ranks_per_node
    direct = direct_ok and use_direct(nbytes / k, c.nodes, c.shard_link)
    return cost_model.nodes_exchange_cost(c.intra.alpha_s, c.intra.beta_s_per_byte, c.inter.alpha_s,
                                          c.inter.beta_s_per_byte, nbytes, c.nodes, k, "allreduce", direct=direct)


def _bucket_end(cost: MethodCost, workload: Workload, cluster: Cluster) -> tuple[float, float]:
    """DDP's bucket timeline (as in auto.model.predict) with each bucket's allreduce by nodes: (end, comm)."""
    w, per_elem = workload, BUCKET_MODES[cost.name]
    t_ready = t_net = comm = 0.0
    i = 0
    for size in ddp_buckets(w.numels, DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES):
        t_ready += sum(w.backward_s[i:i + size])
        elems = sum(w.numels[i:i + size])
        tc = _nodes_allreduce(cluster, per_elem * elems, direct_ok=False)
        t_net = max(t_ready, t_net) + cost.codec_s * elems / w.numel + tc
        comm += tc
        i += size
    return max(w.backward_total_s, t_net), comm


def predict_nodes(cost: MethodCost, workload: Workload, cluster: Cluster, w: float) -> Prediction:
    """The step by nodes (module docstring). ``cost``: for an engine method, measured on a shard
    (codec, shard payload, error), with ``exact_bytes`` the whole model's small tensors; for a bucket
    mode, as flat (its cast runs on the whole bucket before the reduce-scatter)."""
    wl, c = workload, cluster
    compute = wl.forward_s + wl.backward_total_s + wl.optimizer_s
    if cost.wire == "bucket":
        end, comm = _bucket_end(cost, wl, c)
    elif cost.wire in ("allreduce", "allgather", "lowbit"):
        group = 4.0 * max(wl.numel - int(cost.exact_bytes // 4), 1)
        tc = cost_model.nodes_exchange_cost(c.intra.alpha_s, c.intra.beta_s_per_byte, c.inter.alpha_s,
                                            c.inter.beta_s_per_byte, group, c.nodes, c.ranks_per_node, cost.wire,
                                            cost.payload_bytes, _direct(cost, c.nodes, c.shard_link))
        comm = tc + allreduce_seconds(c.flat, ENGINE_CONTROL_BYTES, c.world_size)
        if cost.exact_bytes > 0:
            comm += _nodes_allreduce(c, cost.exact_bytes)
        end = wl.backward_total_s + cost.codec_s + comm
    else:
        raise ValueError(f"predict_nodes: {cost.name!r} sends by {cost.wire!r}, which topology='nodes' refuses.")
    step = max(wl.forward_s + end + wl.optimizer_s + wl.other_s + cost.overhead_s, compute)
    # DDP's buckets are cast on every rank before the reduce-scatter: N roundings, as flat; an engine
    # method compresses its node's mean: nodes payloads
    eff = efficiency(cost, c.world_size if cost.wire == "bucket" else c.nodes, w)
    return Prediction(cost.name, step, compute, cost.codec_s, comm, max(step - compute - wl.other_s, 0.0), eff,
                      step / eff, {"topology": "nodes"})


# ---------------------------------------------------------------------------------------------- bytes on a card
def card_bytes_flat(cost: MethodCost, workload: Workload, cluster: Cluster) -> float | None:
    """Bytes a host's card sends per step flat (:func:`lightning_gc.comm.cost_model.flat_card_bytes`):
    DDP's buckets a ring of the whole gradient; an engine method its collective and the exact group's
    allreduce (the closing report's tens of bytes left out); ``lowrank`` its two allreduces (the exact
    group rides in the first). None for AR-Topk's ``sparse`` wire (a broadcast tree and a ring: not
    modelled per card)."""
    n, k, net = cluster.world_size, cluster.ranks_per_node, cluster.flat
    if cost.wire == "bucket":
        return cost_model.flat_card_bytes("allreduce", BUCKET_MODES[cost.name] * workload.numel, n, k)
    if cost.wire == "sparse":
        return None
    if cost.wire == "lowrank":
        halves = (cost.payload_bytes / 2 + cost.exact_bytes, cost.payload_bytes / 2)
        return sum(cost_model.flat_card_bytes("allreduce", h, n, k, use_direct(h, n, net)) for h in halves)
    out = cost_model.flat_card_bytes(cost.wire, cost.payload_bytes, n, k, _direct(cost, n, net))
    if cost.exact_bytes > 0:
        direct = use_direct(cost.exact_bytes, n, cluster.flat)
        out += cost_model.flat_card_bytes("allreduce", cost.exact_bytes, n, k, direct)
    return out


def card_bytes_nodes(cost: MethodCost, workload: Workload, cluster: Cluster) -> float:
    """Bytes a host's card sends per step by nodes (:func:`lightning_gc.comm.cost_model.nodes_exchange_bytes`;
    ``cost`` as for :func:`predict_nodes`)."""
    c, k = cluster, cluster.ranks_per_node
    if cost.wire == "bucket":
        return cost_model.nodes_exchange_bytes(BUCKET_MODES[cost.name] * workload.numel, c.nodes, k).card
    group = 4.0 * max(workload.numel - int(cost.exact_bytes // 4), 1)
    out = cost_model.nodes_exchange_bytes(group, c.nodes, k, cost.wire, cost.payload_bytes,
                                          _direct(cost, c.nodes, c.shard_link)).card
    if cost.exact_bytes > 0:
        direct = use_direct(cost.exact_bytes / k, c.nodes, c.shard_link)
        out += cost_model.nodes_exchange_bytes(cost.exact_bytes, c.nodes, k, "allreduce", direct=direct).card
    return out


# ---------------------------------------------------------------------------------------------- the comparison
@dataclass
class Row:
    """One candidate flat and by nodes (``nodes`` None when refused: ``refused`` says why)."""

    name: str
    flat: Prediction
    flat_card_bytes: float | None
    nodes: Prediction | None = None
    nodes_card_bytes: float | None = None
    refused: str | None = None

    @property
    def faster(self) -> str:
        if self.nodes is None:
            return "flat"
        return "nodes" if self.nodes.step_s < self.flat.step_s else "flat"

    def as_dict(self) -> dict:
        return {"name": self.name, "flat": self.flat.as_dict(), "flat_card_bytes": self.flat_card_bytes,
                "nodes": None if self.nodes is None else self.nodes.as_dict(),
                "nodes_card_bytes": self.nodes_card_bytes, "refused": self.refused, "faster": self.faster}


@dataclass
class TopologyAdvice:
    """Every candidate flat and by nodes, and the best of all (least time per unit of progress)."""

    cluster: Cluster
    rows: list[Row]
    best: tuple[str, str] = ("", "")  # (candidate, "flat" | "nodes")
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        c = self.cluster
        return {"ranks_per_node": c.ranks_per_node, "nodes": c.nodes,
                "inter": {"alpha_s": c.inter.alpha_s, "bandwidth_bits_per_s": c.inter.bandwidth_bits_per_s},
                "intra": {"alpha_s": c.intra.alpha_s, "bandwidth_bits_per_s": c.intra.bandwidth_bits_per_s},
                "rows": [r.as_dict() for r in self.rows], "best": {"candidate": self.best[0], "topology": self.best[1]}}

    def text(self) -> str:
        width = max([12] + [len(r.name) + 1 for r in self.rows])
        head = (f"{'candidate':{width}s} {'flat step':>10s} {'ms/prog':>9s} {'card MB':>9s} | {'nodes step':>10s} "
                f"{'ms/prog':>9s} {'card MB':>9s} | faster")
        lines = [head]
        for r in self.rows:
            card = "-" if r.flat_card_bytes is None else f"{r.flat_card_bytes / 1e6:.3f}"
            left = f"{r.name:{width}s} {1e3 * r.flat.step_s:10.2f} {1e3 * r.flat.time_per_progress_s:9.2f} {card:>9s} | "
            if r.nodes is None:
                lines.append(left + f"{'refused under nodes (below)':>30s} | flat")
                continue
            ratio = r.flat.step_s / r.nodes.step_s if r.nodes.step_s > 0 else math.inf
            lines.append(left + f"{1e3 * r.nodes.step_s:10.2f} {1e3 * r.nodes.time_per_progress_s:9.2f} "
                         f"{r.nodes_card_bytes / 1e6:9.3f} | {r.faster} ({ratio:.2f}x flat/nodes)")
        for r in self.rows:
            if r.refused:
                lines.append(f"refused under nodes: {r.name}: {r.refused}")
        lines.append(f"best of both: {self.best[0]} {self.best[1]} (least ms per unit of progress)")
        lines.extend(self.notes)
        return "\n".join(lines)


def compare(workload: Workload, flat_costs: Sequence[MethodCost], node_costs: Mapping[str, MethodCost],
            refusals: Mapping[str, str], cluster: Cluster, w: float) -> TopologyAdvice:
    """One :class:`Row` per flat candidate: its flat prediction, and by nodes either its prediction
    (``node_costs[name]``: measured on a shard, see :func:`predict_nodes`) or the refusal's reason."""
    rows, best, best_t = [], ("", ""), math.inf
    for cost in flat_costs:
        flat = predict_flat(cost, workload, cluster, w)
        row = Row(cost.name, flat, card_bytes_flat(cost, workload, cluster))
        if cost.name in refusals:
            row.refused = refusals[cost.name]
        else:
            nc = node_costs[cost.name]
            row.nodes = predict_nodes(nc, workload, cluster, w)
            row.nodes_card_bytes = card_bytes_nodes(nc, workload, cluster)
        for kind, p in (("flat", row.flat), ("nodes", row.nodes)):
            if p is not None and p.time_per_progress_s < best_t:
                best, best_t = (cost.name, kind), p.time_per_progress_s
        rows.append(row)
    return TopologyAdvice(cluster, rows, best)
