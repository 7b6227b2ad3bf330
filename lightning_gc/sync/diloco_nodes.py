"""DiLoCo with nodes as its workers (``GCStrategy(sync="diloco", topology="nodes")``).

Flat DiLoCo treats every rank as a worker: inner steps send nothing and the outer step averages
every rank's Δ over all ranks. By nodes, a *node* is the worker (torchft#171):

* **Inner steps** are synchronous data parallelism inside the node: after backward, the gradients of
  the node's ``k`` ranks are averaged in fp32 over the node's process group (one allreduce of the
  flat gradient, divided by ``k``), so the node's ranks train one replica and stay bit-identical.
  Nothing crosses nodes on inner steps. The mean runs after backward, not overlapped with it (the
  link inside a node is the fast one).
* **Outer step.** Δ is identical on the node's ranks, so local rank ``j`` takes shard ``j`` of it
  (``s = ⌈n/k⌉`` elements, zero-padded at the end, as :mod:`lightning_gc.comm.hierarchy` pads), adds
  its error memory for that shard (with a lossy Δ compressor), and averages the shard over the
  nodes on its inter-node group (one group per local rank index), dense fp32 or through the
  pseudo-gradient's compressor; then the node's ranks allgather the averaged shards. Every rank
  of every node then holds the same mean Δ and the outer optimizer steps identically everywhere.

Bytes per outer step of a model of ``M`` fp32 bytes, ``nodes`` nodes of ``k`` ranks: each rank sends
``2(nodes−1)/nodes · M/k`` between nodes for a dense Δ (the ring allreduce of its shard), so a node's
card carries ``2(nodes−1)/nodes · M``, the model once per node, not once per rank; inside the node
the allgather sends ``(k−1) · M/k`` per rank. An inner step sends ``2(k−1)/k · M`` per rank inside the
node (plus one presence flag per tensor, below). ``gc/bytes_inter_node`` and the summary's "between
nodes" line count the inter-node part.

Process groups. The inner-step mean (main thread) runs on the engine's intra-node group; the
outer exchange runs on groups of its own (one per node, one per local rank index) because with
``diloco_overlap_steps`` > 0 it runs on a worker thread while inner steps continue, and two threads
must never issue collectives on one group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.cost_model import allgather_bytes, ring_allreduce_bytes
from ..comm.hierarchy import NodeTopology, destroy_groups, shard_segments


class NodeWorkers:
    """The node layout as DiLoCo sees it: the inner-step node mean and the outer shard exchange.

    Build it on every rank in the same order (it makes process groups, a collective call).
    """

    def __init__(self, topology: NodeTopology, backend: Any) -> None:
        layout = topology.layout
        self.topology = topology
        self.k, self.nodes = layout.ranks_per_node, layout.nodes
        self.node, self.local = topology.node, topology.local
        intra = [dist.new_group(layout.node_ranks(n), backend=backend) for n in range(layout.nodes)]
        inter = [dist.new_group(layout.shard_ranks(j), backend=backend) for j in range(self.k)]
        self._all = intra + inter
        #: the outer exchange's groups: this node's ranks, and this shard's ranks on every node
        self.intra, self.inter = intra[self.node], inter[self.local]

    def describe(self) -> str:
        return f"nodes({self.nodes}x{self.k})"

    def shard_size(self, numel: int) -> int:
        return -(-numel // self.k)

    # ------------------------------------------------------------------ inner steps (main thread)
    def mean_gradients(self, params: list[Tensor]) -> tuple[int, int]:
        """Replace every parameter's gradient by its node's fp32 mean; returns (bytes this rank sent,
        payload bytes). A parameter without a gradient on some rank counts as zero there; it gets the
        mean only if some rank of the node has one (the flags travel with the gradients), so an
        optimizer still skips a parameter no rank of the node used."""
        grads = [p.grad.detach().to(torch.float32).reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), device=p.device) for p in params]
        flags = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        flat = torch.cat([*grads, flags])
        dist.all_reduce(flat, group=self.topology.intra)
        return self._write_back(params, flat), 4 * flat.numel()

    def _write_back(self, params: list[Tensor], flat: Tensor) -> int:
        present = flat[-len(params):]
        offset = 0
        for i, p in enumerate(params):
            n = p.numel()
            if present[i] > 0:
                mean = flat[offset:offset + n].div_(self.k).view_as(p)
                if p.grad is None:
                    p.grad = mean.to(p.dtype).clone()
                else:
                    p.grad.copy_(mean)
            offset += n
        return ring_allreduce_bytes(4 * flat.numel(), self.k)

    def allreduce_mean(self, flat: Tensor) -> tuple[int, int]:
        """``flat`` ← its mean over all ranks by nodes (floating buffers at an outer step; main
        thread, the engine's groups); returns (bytes this rank sent, of which between nodes)."""
        nbytes = flat.numel() * flat.element_size()
        flat.div_(self.k * self.nodes)
        self.topology.allreduce_sum(flat, None).wait()
        return self.topology.dense_bytes(nbytes)

    # ------------------------------------------------------------------ the outer exchange
    def take(self, delta: Tensor) -> Tensor:
        """This rank's shard of ``delta`` (zero-padded past the end), a fresh tensor."""
        s = self.shard_size(delta.numel())
        lo, hi = self.local * s, min((self.local + 1) * s, delta.numel())
        out = torch.zeros(s, dtype=delta.dtype, device=delta.device)
        if hi > lo:
            out[:hi - lo].copy_(delta[lo:hi])
        return out

    def context(self, ctx: Any, numel: int) -> Any:
        """The compressor's view of a shard: rank = node, world = nodes, the shard's segments."""
        s = self.shard_size(numel)
        lo = self.local * s
        return dataclasses.replace(ctx, rank=self.node, world_size=self.nodes, shapes=(), names=(), shard=self.local,
                                   segments=shard_segments(ctx.segments, lo, min(lo + s, numel), s))

    def dense_mean(self, shard: Tensor) -> tuple[Tensor, int]:
        """The shard's mean over the nodes (sum of ``shard / nodes``); returns it and the bytes sent."""
        out = shard.div(self.nodes)
        dist.all_reduce(out, group=self.inter)
        return out, ring_allreduce_bytes(out.numel() * out.element_size(), self.nodes)

    def gather(self, mean_shard: Tensor, numel: int) -> tuple[Tensor, int]:
        """Every shard's mean, gathered inside the node: the full mean Δ (``numel`` elements) and the
        bytes this rank sent."""
        s = mean_shard.numel()
        out = torch.empty(s * self.k, dtype=mean_shard.dtype, device=mean_shard.device)
        dist.all_gather_single(out, mean_shard.contiguous(), group=self.intra)
        return out[:numel], allgather_bytes(s * mean_shard.element_size(), self.k)

    def close(self) -> None:
        destroy_groups(self._all)


__all__ = ["NodeWorkers"]
