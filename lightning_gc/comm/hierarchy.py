"""Topology: send a group flat across all ranks, or by nodes (compress only the hop between nodes).

``topology="flat"`` (the default) treats the job as N equal ranks on one link: every exchange runs on
the engine's process group of all ranks. ``topology="nodes"`` follows the cluster's shape, nodes of
``k`` ranks joined by a fast link inside and a slow one between them (Horovod's hierarchical
allreduce, BytePS's two levels, HSDP's replica dimension). For each group of ``n`` elements:

1. **reduce-scatter inside the node**, dense (fp32, or bf16 with ``intra_dtype="bf16"``): local
   rank ``j`` ends with shard ``j`` (``s = ⌈n/k⌉`` elements, zero-padded at the end) of the sum of its
   node's gradients, divided by ``k``: the node's mean;
2. **the configured compressor and collective across nodes**, on shard ``j`` only, with the same-
   shard ranks of the other nodes (one process group per local rank index). The engine adds error
   memory to the shard and keeps ``q − sent`` per shard: memory is per shard, as the exchange is;
3. **allgather inside the node** of the shard's mean over nodes, giving every rank the full mean.

Ranks are numbered node by node (``rank = node · k + local_rank``), as torchrun, SLURM and
Lightning (``Trainer(num_nodes=..., devices=k)``) number them.

Bytes (docs/topology.md, "Byte model"; :func:`~lightning_gc.comm.cost_model.nodes_exchange_bytes`):
for an allgather codec a node's card carries ``k²`` times fewer bytes than flat, ``k`` from the
node-level averaging (one payload per node, not per rank) and ``k`` from the shards; for allreduce-
based exchanges the saving is small (a flat ring already crosses each card once per direction).
:class:`~lightning_gc.engine.stats.StepStats` counts the inter-node part separately
(``bytes_inter_node``; ``gc/bytes_inter_node``; the summary's "between nodes" line).

How to tune: it pays when the link between nodes is much slower than the one inside (Ethernet
between, NVLink/PCIe/loopback inside), and most for allgather codecs (Top-k, QSGD, signSGD), whose
flat bytes grow with N. ``intra_dtype="bf16"`` halves the intra-node bytes at bf16's rounding of the
node sum; the default keeps the node mean exact in fp32.

``topology="auto"`` measures both links when the engine is built (:func:`measure_node_links`: the
probe sized to the link, on the intra-node groups, then on the inter-node ones, agreed over all
ranks) and takes ``nodes`` when a byte takes ``auto_ratio`` times as long or longer between nodes as
inside one (:func:`choose_kind`), else ``flat``. Where ``nodes`` would be refused, or there is one
node or one rank per node, it is ``flat`` without measuring (:func:`auto_fallback`).

What works under it, and what is refused (:func:`refusal`, the one list): see docs/topology.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_int, check_number
from ..compressors.base import GroupContext
from .cost_model import allgather_bytes, ring_allreduce_bytes
from .link import agree_max, probe_sized

#: the collectives whose exchange runs on any process group of the ranks that hold the same shard;
#: the others are refused under ``topology="nodes"`` (reasons in :data:`_COLLECTIVE_REASONS`)
NODE_COLLECTIVES = ("allreduce", "allgather", "lowbit")
_COLLECTIVE_REASONS = {
    "ring": "lightning_gc's point-to-point ring has not been verified on a sub-group of the ranks",
    "tree": "lightning_gc's point-to-point tree has not been verified on a sub-group of the ranks",
    "art_allreduce": "AR-Topk's source rank and its index broadcast are defined over all ranks, not a shard's group",
    "art_ring": "AR-Topk's source rank and its index broadcast are defined over all ranks, not a shard's group",
    "art_tree": "AR-Topk's source rank and its index broadcast are defined over all ranks, not a shard's group",
    "auto_sparse": "its collective is chosen from an alpha-beta model of one flat link",
    "marsit": "its P2P sign ring and full-precision rounds are defined over all ranks",
    "marsit_cascade": "its P2P sign ring is defined over all ranks",
    "gradiveq_ring": "its PCA basis is fitted per tensor slice (shapes), which a shard of the flat group cuts",
    "gradiveq_allreduce": "its PCA basis is fitted per tensor slice (shapes), which a shard of the flat group cuts",
    "lowrank": "it factorises each gradient matrix (shapes), which a shard of the flat group cuts",
}


#: the compressors whose natural collective each of those is (for the refusals' fix)
_COMPRESSORS_OF = {"allreduce": "dense, fp16, bf16, randomk", "allgather": "topk, lwtopk, mstopk, qsgd, signsgd, efsignsgd",
                   "lowbit": "lowbit", "lowrank": "lowrank"}


@dataclass(frozen=True)
class TopologyConfig:
    """How the ranks are arranged for communication.

    Attributes:
        kind: ``"flat"`` (every exchange across all ranks; the default), ``"nodes"`` (dense inside
            a node, the compressor only between nodes; docs/topology.md) or ``"auto"`` (``nodes``
            when the link between nodes is measured ``auto_ratio`` times slower per byte than the
            link inside a node, else ``flat``).
        ranks_per_node: ranks on one node; ``None`` takes the launcher's (Lightning's
            ``devices``/``num_processes``, else ``LOCAL_WORLD_SIZE``). Set it to emulate nodes on
            one machine (e.g. 2 on 4 processes: two "nodes" of two).
        intra_dtype: ``"fp32"`` (exact node sum; the default) or ``"bf16"`` (half the intra-node
            bytes; the node sum rounded to bf16).
        auto_ratio: with ``kind="auto"``: take ``nodes`` when a byte takes at least this many times
            as long between nodes as inside one (β between / β inside, measured when the engine is
            built). By nodes, the slow hop carries a node's shard once instead of every rank's
            message, at the price of two dense hops inside the node; those cost little only when
            the inside link is several times faster. Lower it (towards 2) for allgather codecs
            (Top-k, QSGD), whose flat bytes grow with the ranks; raise it where the inside hops are
            costly (GPUs that share a PCIe switch).
    """

    kind: Literal["flat", "nodes", "auto"] = "flat"
    ranks_per_node: int | None = None
    intra_dtype: Literal["fp32", "bf16"] = "fp32"
    auto_ratio: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "nodes", "auto"):
            raise ValueError(f"topology={self.kind!r} is invalid: use 'flat' (all ranks as one group), 'nodes' "
                             "(dense inside a node, compressed between nodes; docs/topology.md) or 'auto' (nodes "
                             "when the link between nodes is measured much slower than the one inside).")
        check_number("topology_auto_ratio", self.auto_ratio, "a number > 1, e.g. 4 (nodes when the link between "
                     "nodes is at least that many times slower per byte than the link inside a node).", above=1.0)
        if self.ranks_per_node is not None:
            check_int("topology_ranks_per_node", self.ranks_per_node, 1,
                      "Use the number of processes per node, or None for the launcher's.")
        if self.intra_dtype not in ("fp32", "bf16"):
            raise ValueError(f"topology_intra_dtype={self.intra_dtype!r} is invalid: use 'fp32' (exact node mean) "
                             "or 'bf16' (half the intra-node bytes).")
        if self.kind == "flat" and (self.ranks_per_node is not None or self.intra_dtype != "fp32"):
            raise ValueError(f"topology_ranks_per_node={self.ranks_per_node!r}/topology_intra_dtype="
                             f"{self.intra_dtype!r} only apply with topology='nodes' or 'auto'; pass one of them "
                             "too, or drop them.")
        if self.kind != "auto" and self.auto_ratio != 4.0:
            raise ValueError(f"topology_auto_ratio={self.auto_ratio!r} only applies with topology='auto'; pass "
                             "topology='auto' too, or drop it.")


def refusal(*, collective: str, sync: str, omgs: bool, auto: bool, adaptive: bool = False,
            intra_dtype: str = "fp32") -> str | None:
    """Why ``topology="nodes"`` cannot run this configuration (with the fix), or None: the one list.

    Pure: plain values in. :class:`~lightning_gc.config.GCConfig` calls it at construction, the
    adaptive-ratio callback when it attaches to an engine. With ``sync="diloco"``, ``collective`` is
    the pseudo-gradient's (``"allgather"`` for ``diloco_compressor="sparseloco"``)."""
    if auto:
        return ("topology='nodes' with compressor='auto' is not supported: auto's cost model predicts one flat "
                "link. Pick the compressor yourself (e.g. compressor='topk'), or use topology='flat'.")
    if sync == "osp":
        return ("topology='nodes' with sync='osp' is not supported: OSP's deferred stage sends its layers on a "
                "flat group of its own. Use sync='bsp', or topology='flat'.")
    why = diloco_refusal(collective, intra_dtype) if sync == "diloco" else None
    if why is not None:
        return why
    if omgs:
        return ("topology='nodes' with plan='omgs' is not supported: OMGS's cost model times flat collectives of "
                "whole groups. Use plan='model', 'layer' or 'threshold', or topology='flat'.")
    if adaptive:
        return ("topology='nodes' with the AdaptiveRatio callback is not supported: its cost model picks the "
                "collective for one flat link of all ranks. Drop the callback (a fixed ratio), or use "
                "topology='flat'.")
    return subgroup_refusal(collective, NODE_COLLECTIVES, "topology='nodes'", ", or topology='flat'")


def diloco_refusal(collective: str, intra_dtype: str = "fp32") -> str | None:
    """Why DiLoCo with nodes as its workers cannot run this configuration (with the fix), or None.

    Inner steps average the gradients inside a node in fp32 and the outer step gathers the averaged
    shards of Δ inside the node; between nodes each local rank sends its shard of Δ through the
    pseudo-gradient's compressor, so its collective must run on a shard's group of ranks."""
    if intra_dtype != "fp32":
        return (f"topology='nodes' with sync='diloco' and topology_intra_dtype={intra_dtype!r} is not supported: the "
                "inner steps' node mean is an fp32 allreduce (DDP's arithmetic inside the node) and the outer step "
                "gathers the averaged Δ inside the node in fp32; no bf16 path is built for DiLoCo. Use "
                "topology_intra_dtype='fp32' (the default).")
    return subgroup_refusal(collective, NODE_COLLECTIVES, "topology='nodes' with sync='diloco' (the pseudo-gradient's "
                            "exchange between nodes)", ", or topology='flat'")


def subgroup_refusal(collective: str, allowed: tuple[str, ...], where: str, alternative: str = "") -> str | None:
    """Why ``collective`` cannot run on a sub-group of the ranks (one shard's ranks across nodes)
    under ``where``, with the fix; None if it is one of ``allowed``."""
    if collective in allowed:
        return None
    why = _COLLECTIVE_REASONS.get(collective, "it is not known to run on a sub-group of the ranks")
    names = ", ".join(_COMPRESSORS_OF.get(c, c) for c in allowed)
    return (f"{where} with collective={collective!r} is not supported: {why}. Use a compressor whose collective is "
            f"one of {list(allowed)} ({names}){alternative}.")


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks share a node (pure arithmetic; ranks numbered node by node)."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        k, n = self.ranks_per_node, self.world_size
        if k < 1 or n % k != 0:
            raise ValueError(f"topology='nodes' with {n} ranks and topology_ranks_per_node={k}: the world size must "
                             "be a multiple of the ranks per node (every node runs as many ranks). Set "
                             "topology_ranks_per_node to a divisor of the world size, or start the same number of "
                             "processes on every node.")
        if n // k < 2:
            raise ValueError(f"topology='nodes' with {n} ranks on {n // k} node ({k} per node): there is no hop "
                             "between nodes to compress. Use topology='flat' on one node, or set "
                             "topology_ranks_per_node to fewer ranks than the world size to emulate nodes.")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node`` (the intra-node group)."""
        k = self.ranks_per_node
        return list(range(node * k, (node + 1) * k))

    def shard_ranks(self, local: int) -> list[int]:
        """The ranks that hold shard ``local`` (one per node: the inter-node group)."""
        return [node * self.ranks_per_node + local for node in range(self.nodes)]


def resolve_ranks_per_node(option: int | None, launcher: int | None) -> int | None:
    """Ranks per node: the option, else the launcher's figure (Lightning's processes per node), else
    ``LOCAL_WORLD_SIZE`` (torchrun), else None (unknown)."""
    if option is not None:
        return int(option)
    if launcher is not None:
        return int(launcher)
    env = os.environ.get("LOCAL_WORLD_SIZE")
    return int(env) if env else None


def shard_segments(segments: tuple[int, ...], lo: int, hi: int, size: int) -> tuple[int, ...]:
    """The parts of the group's tensors (``segments``) inside ``[lo, hi)``, then the zero padding up
    to ``size`` elements (layer-wise compressors see the shard's own layer boundaries)."""
    out: list[int] = []
    start = 0
    for n in segments:
        a, b = max(start, lo), min(start + n, hi)
        if b > a:
            out.append(b - a)
        start += n
    pad = size - sum(out)
    if pad > 0:
        out.append(pad)
    return tuple(out)


@dataclass
class Visit:
    """One group's trip through a topology: the tensor the exchange runs on, its context, and what
    :meth:`Topology.leave` needs to give back a tensor of the group's size."""

    tensor: Tensor
    ctx: GroupContext
    numel: int = 0
    dtype: torch.dtype = torch.float32
    inter_mark: int = 0


class Topology:
    """Flat: every exchange on the engine's group of all ranks; :meth:`enter`/:meth:`leave` are the
    identity and a dense bucket is one allreduce."""

    kind = "flat"

    def __init__(self, group: Any, world_size: int, chosen: str | None = None) -> None:
        #: the process group the engine's exchanges run on
        self.group = group
        self.world_size = world_size
        #: ``topology="auto"``: why this kind was chosen (None: the user chose it)
        self.chosen = chosen

    def describe(self) -> str:
        return self.kind

    def enter(self, flat: Tensor, ctx: GroupContext, timer: Any) -> Visit:
        """What the group's exchange runs on (``timer``: the step's :class:`~.exchange.Timer`)."""
        return Visit(flat, ctx)

    def leave(self, visit: Visit, mean: Tensor, timer: Any) -> Tensor:
        """The group's mean from the exchange's result."""
        return mean

    def dense_bytes(self, nbytes: int) -> tuple[int, int]:
        """(bytes this rank sends, of which between nodes) for a dense bucket of ``nbytes``; flat
        does not know the nodes: 0 between them (the wire counters measure it)."""
        return ring_allreduce_bytes(nbytes, self.world_size), 0

    def allreduce_sum(self, wire: Tensor, group: Any) -> torch.futures.Future:
        """Sum ``wire`` over all ranks; a Future of ``[result]`` (the backend's allreduce)."""
        return dist.all_reduce(wire, group=group, async_op=True).get_future()

    def memory_layout(self, plan: Any) -> Any:
        """The plan by which error memory is keyed in checkpoints (names and sizes per group)."""
        return plan

    def close(self) -> None:
        return None


class NodeTopology(Topology):
    """By nodes (module docstring): the engine's exchanges run on this rank's shard group."""

    kind = "nodes"

    def __init__(self, layout: NodeLayout, rank: int, backend: Any, intra_dtype: str = "fp32") -> None:
        self.layout = layout
        self.rank = rank
        self.k = layout.ranks_per_node
        self.node = layout.node_of(rank)
        self.local = layout.local_of(rank)
        self.intra_dtype = torch.bfloat16 if intra_dtype == "bf16" else None
        # every rank creates every group, in the same order (new_group is collective over the world)
        intra = [dist.new_group(layout.node_ranks(n), backend=backend) for n in range(layout.nodes)]
        inter = [dist.new_group(layout.shard_ranks(j), backend=backend) for j in range(self.k)]
        self.intra, self.inter = intra[self.node], inter[self.local]
        self._all = intra + inter
        super().__init__(self.inter, layout.nodes)

    def describe(self) -> str:
        dtype = "bf16" if self.intra_dtype is not None else "fp32"
        return f"nodes({self.layout.nodes}x{self.k},intra={dtype})"

    def shard_size(self, numel: int) -> int:
        return -(-numel // self.k)

    # ------------------------------------------------------------------ a group's exchange
    def enter(self, flat: Tensor, ctx: GroupContext, timer: Any) -> Visit:
        """Node mean of this rank's shard (fp32 unless the group is lower precision), and the
        context the inter-node exchange sees (rank = node, world = nodes, the shard's segments)."""
        n, s = flat.numel(), self.shard_size(flat.numel())
        node_sum = timer.run("comm", lambda: self._reduce_scatter(flat, s, timer.times))
        lo = self.local * s
        shard_ctx = dataclasses.replace(ctx, rank=self.node, world_size=self.layout.nodes,
                                        segments=shard_segments(ctx.segments, lo, min(lo + s, n), s),
                                        shapes=(), names=(), shard=self.local)
        return Visit(node_sum.div_(self.k), shard_ctx, n, flat.dtype, timer.times.bytes_sent)

    def leave(self, visit: Visit, mean: Tensor, timer: Any) -> Tensor:
        """The full group's mean: the inter-node exchange's bytes are counted as between nodes, then
        the shards' means are gathered inside the node."""
        times = timer.times
        times.bytes_inter_node += times.bytes_sent - visit.inter_mark
        s = visit.tensor.numel()
        out = torch.empty(s * self.k, dtype=mean.dtype, device=mean.device)
        timer.run("comm", lambda: dist.all_gather_single(out, mean.contiguous(), group=self.intra))
        times.bytes_sent += allgather_bytes(s * mean.element_size(), self.k)
        return out[:visit.numel].to(visit.dtype)

    def _reduce_scatter(self, flat: Tensor, s: int, times: Any) -> Tensor:
        """Sum of the node's ``flat`` (zero-padded to ``k·s``), shard ``local`` of it (fp32 out)."""
        wire_dtype = self.intra_dtype or flat.dtype
        padded = torch.zeros(s * self.k, dtype=wire_dtype, device=flat.device)
        padded[:flat.numel()].copy_(flat)
        out = torch.empty(s, dtype=wire_dtype, device=flat.device)
        dist.reduce_scatter_single(out, padded, group=self.intra)
        times.bytes_sent += allgather_bytes(s * padded.element_size(), self.k)  # a ring sends (k−1)/k of it
        return out.float() if out.dtype != torch.float32 and out.dtype != flat.dtype else out

    # ------------------------------------------------------------------ a dense bucket
    def dense_bytes(self, nbytes: int) -> tuple[int, int]:
        shard = self.shard_size(nbytes)
        inter = ring_allreduce_bytes(shard, self.layout.nodes)
        scatter = shard // 2 if self.intra_dtype is not None else shard  # an fp32 bucket in bf16
        return allgather_bytes(scatter, self.k) + allgather_bytes(shard, self.k) + inter, inter

    def allreduce_sum(self, wire: Tensor, group: Any) -> torch.futures.Future:
        """Sum ``wire`` over all ranks by nodes, synchronously (three collectives on two groups; the
        reduce-scatter in ``intra_dtype`` where that is narrower); returns a completed Future of
        ``[result]`` (``group``, the flat one, is not used)."""
        n, s = wire.numel(), self.shard_size(wire.numel())
        narrow = self.intra_dtype if self.intra_dtype is not None and wire.dtype == torch.float32 else wire.dtype
        padded = torch.zeros(s * self.k, dtype=narrow, device=wire.device)
        padded[:n].copy_(wire.reshape(-1))
        shard = torch.empty(s, dtype=narrow, device=wire.device)
        dist.reduce_scatter_single(shard, padded, group=self.intra)
        shard = shard.to(wire.dtype)
        dist.all_reduce(shard, group=self.inter)
        gathered = torch.empty(s * self.k, dtype=wire.dtype, device=wire.device)
        dist.all_gather_single(gathered, shard, group=self.intra)
        wire.reshape(-1).copy_(gathered[:n])
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([wire])
        return fut

    # ------------------------------------------------------------------ error memory per shard
    def memory_layout(self, plan: Any) -> Any:
        """Each group's memory is this rank's shard: keyed ``"<name>[a:b]"`` by the slices of the
        group's tensors it covers (and ``"<first name>[pad]"`` for the padding), so a checkpoint says
        which part of which tensor a rank's memory is, and another layout finds nothing to load."""
        groups = []
        for g in plan.groups:
            s = self.shard_size(g.numel)
            lo, hi = self.local * s, min((self.local + 1) * s, g.numel)
            names, numels, ids, start = [], [], [], 0
            for name, n, pid in zip(g.names, g.numels, g.param_ids):
                a, b = max(start, lo), min(start + n, hi)
                if b > a:
                    names.append(f"{name}[{a - start}:{b - start}]@{self.describe()}/{self.local}")
                    numels.append(b - a)
                    ids.append(pid)
                start += n
            if s - sum(numels) > 0:
                names.append(f"{g.names[0]}[pad]@{self.describe()}/{self.local}")
                numels.append(s - sum(numels))
                ids.append(g.param_ids[0])
            groups.append(dataclasses.replace(g, param_ids=tuple(ids), names=tuple(names), numels=tuple(numels)))
        return dataclasses.replace(plan, groups=tuple(groups))  # (plans sit above comm: no import of them)

    def close(self) -> None:
        destroy_groups(self._all)


def destroy_groups(groups: list[Any]) -> None:
    """Destroy process groups this module made (every rank alike); one already gone is skipped."""
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            pass


def choose_kind(beta_intra: float, beta_inter: float, ratio: float) -> tuple[str, str]:
    """``topology="auto"``'s rule (pure): ``"nodes"`` when a byte takes ``ratio`` times as long or longer
    between nodes as inside one (agreed β, seconds per byte), else ``"flat"``; with the reason in words.
    A β of 0 is a link too fast for the probe to see: inside, any measured β between is slower."""
    if beta_intra > 0:
        slower = beta_inter / beta_intra
    else:
        slower = math.inf if beta_inter > 0 else 1.0
    kind = "nodes" if slower >= ratio else "flat"
    times = "many" if math.isinf(slower) else f"{slower:.1f}"
    return kind, (f"a byte took {times} times as long between nodes as inside a node "
                  f"({'at least' if kind == 'nodes' else 'under'} topology_auto_ratio={ratio:g})")


def auto_fallback(world_size: int, ranks_per_node: int | None, refused: str | None) -> str | None:
    """Why ``topology="auto"`` is ``flat`` without measuring (pure), or None when it measures: ``nodes``
    would be refused for this configuration (``refused``: :func:`refusal`'s text), or there is no
    hop between nodes to spare (unknown ranks per node, one node, one rank per node)."""
    if refused is not None:
        return "nodes is not supported here: " + refused.split(": ", 1)[-1].split(". ")[0]
    if ranks_per_node is None:
        return "the launcher gave no ranks per node (pass topology_ranks_per_node)"
    if ranks_per_node >= world_size or ranks_per_node == 1:
        return "one node" if ranks_per_node >= world_size else "one rank per node"
    if world_size % ranks_per_node:
        return f"{world_size} ranks are not whole nodes of {ranks_per_node}"
    return None


def link_beta(group: Any, device: Any, model_bytes: int) -> float:
    """This rank's view of a group's link: β (seconds per byte) of the probe sized to the link
    (:func:`~lightning_gc.comm.link.probe_sized`, agreed over ``group``). A collective over ``group``."""
    return probe_sized(group, device, model_bytes).network.beta_s_per_byte


def measure_node_links(topology: NodeTopology, group: Any, device: Any, model_bytes: int,
                       probe: Callable[[Any, Any, int], float] = link_beta) -> tuple[float, float]:
    """β inside a node and β between nodes: ``probe`` on this rank's intra-node group, then on its
    inter-node group, then the MAX of each over ``group`` (all ranks), so every rank decides on the
    same numbers. A collective: every rank calls it alike. Every node probes at once, as every node
    sends at once in a step."""
    intra = probe(topology.intra, device, model_bytes)
    inter = probe(topology.inter, device, model_bytes)
    beta_intra, beta_inter = agree_max([intra, inter], group, device)
    return beta_intra, beta_inter


def build_topology(config: TopologyConfig, group: Any, world_size: int, rank: int,
                   ranks_per_node: int | None, *, device: Any = None, model_bytes: int = 0,
                   refused: str | None = None,
                   probe: Callable[[Any, Any, int], float] = link_beta) -> Topology:
    """The engine's topology: flat on ``group``, or by nodes (which makes its process groups: a
    collective call, every rank builds it with the same arguments). With ``kind="auto"``, measured
    here (:func:`measure_node_links` with ``probe``, a collective) unless :func:`auto_fallback` says ``flat``; the reason is kept in
    ``chosen``. ``refused``: why ``nodes`` cannot run this configuration (:func:`refusal`), if so."""
    if config.kind == "flat" or world_size <= 1:
        return Topology(group, world_size)
    k = resolve_ranks_per_node(config.ranks_per_node, ranks_per_node)
    if config.kind == "auto":
        why = auto_fallback(world_size, k, refused)
        if why is not None:
            return Topology(group, world_size, chosen=why)
    if k is None:
        raise ValueError("topology='nodes' does not know how many ranks share a node: the launcher gave none "
                         "(Trainer(devices=...), LOCAL_WORLD_SIZE). Pass topology_ranks_per_node=<processes per "
                         "node>.")
    nodes = NodeTopology(NodeLayout(world_size, k), rank, dist.get_backend(group), config.intra_dtype)
    if config.kind == "auto":
        kind, why = choose_kind(*measure_node_links(nodes, group, device, model_bytes, probe), config.auto_ratio)
        if kind == "flat":
            nodes.close()
            return Topology(group, world_size, chosen=why)
        nodes.chosen = why
    return nodes
