"""AR-Topk exchanges: broadcast the source's indices, allreduce every rank's values there.

Three reductions for the values, so that ring vs tree is a real choice on any backend:
``"allreduce"`` (the backend's own broadcast and allreduce), ``"ring"`` and ``"tree"`` (our P2P
implementations in :mod:`lightning_gc.comm.p2p_allreduce`, with the indices broadcast along a P2P
binomial tree — the ``ceil(log2 N)``-round broadcast the cost model assumes; gloo's own broadcast is flat and
pushes N−1 copies through the source's link). :class:`AutoSparseExchange` picks per group and step among
Top-k allgather (AG), ART-Ring and ART-Tree from the alpha-beta model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import allgather_bytes, ring_allreduce_bytes
from ..comm.exchange import AllgatherExchange, Exchange, SparseSent, Timer
from ..comm.network import NetworkState
from ..comm.p2p_allreduce import binomial_broadcast, ring_allreduce, tree_allreduce
from ..compressors.artopk import ARTopKCompressor, select_source
from ..compressors.base import GroupContext, ratio_to_k
from ..compressors.sparse import scatter_sparse


class ARTopkExchange(Exchange):
    """Broadcast source indices, then reduce values with ``reduce`` ∈ {allreduce, ring, tree}."""

    formats = frozenset({"artopk"})
    summable = True

    def __init__(self, compressor: ARTopKCompressor, group=None, reduce: str = "allreduce") -> None:
        super().__init__(compressor, group)
        if reduce not in ("allreduce", "ring", "tree"):
            raise ValueError(f"reduce={reduce!r} must be 'allreduce', 'ring' or 'tree'")
        self.reduce = reduce
        self.name = {"allreduce": "art_allreduce", "ring": "art_ring", "tree": "art_tree"}[reduce]
        # VAR's smoothed per-rank energies, one vector per plan group (keyed by ctx.group_id):
        # replicated on every rank (built from all-gathered values) and saved in checkpoints
        self._energy: dict[int, Tensor] = {}

    def state_dict(self) -> dict:
        """VAR's smoothed energies per plan group (CPU float64), for checkpoints."""
        return {"var_energy": {int(g): e.detach().cpu().clone() for g, e in self._energy.items()}}

    def load_state_dict(self, state: dict, world_size: int | None = None) -> None:
        """Restore :meth:`state_dict`. Vectors whose length is not ``world_size`` (the job was
        resumed on another number of ranks) are dropped: smoothing restarts from the next step's
        energies for those groups, which is what a fresh run does."""
        energy = state.get("var_energy") or {}
        self._energy = {
            int(g): torch.as_tensor(e, dtype=torch.float64).clone()
            for g, e in energy.items()
            if world_size is None or torch.as_tensor(e).numel() == world_size
        }

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def _var_source(self, local_values: Tensor, ctx: GroupContext, timer: Timer) -> int:
        cfg = self.compressor.config
        energy = local_values.double().pow(2).sum().reshape(1)
        gathered = [torch.empty_like(energy) for _ in range(ctx.world_size)]
        timer.run("comm", lambda: dist.all_gather(gathered, energy, group=self.group))
        timer.times.bytes_sent += allgather_bytes(8, ctx.world_size)
        e = torch.cat(gathered).cpu()
        if cfg.var_smoothing > 0:
            prev = self._energy.get(ctx.group_id)
            if prev is not None and prev.numel() == e.numel():
                e = cfg.var_smoothing * prev + (1 - cfg.var_smoothing) * e
            self._energy[ctx.group_id] = e
        return select_source("var", ctx, e)

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor | SparseSent]:
        c = self.compressor
        k = ratio_to_k(c.ratio, ctx.numel)
        local = timer.run("compress", lambda: c.compress(p, ctx))
        if c.config.selection == "var":
            src = self._var_source(local.payload[0], ctx, timer)
        else:
            src = select_source("star", ctx)
        idx = local.payload[1] if ctx.rank == src else torch.empty(k, dtype=torch.int32, device=p.device)
        idx = idx.contiguous()
        if self.reduce == "allreduce":  # fully native: the backend's broadcast (flat on gloo)
            timer.run("comm", lambda: dist.broadcast(idx, src=self._global(src), group=self.group))
            if ctx.rank == src:
                timer.times.bytes_sent += (ctx.world_size - 1) * 4 * k
        else:  # P2P binomial tree: the ceil(log2 N)-round broadcast of the cost model
            timer.times.bytes_sent += timer.run("comm", lambda: binomial_broadcast(idx, src, self.group))
        timer.times.bytes_payload += 4 * k + p.element_size() * k
        idx_long = idx.long()
        values = timer.run("compress", lambda: torch.index_select(p, 0, idx_long))
        summed = values.clone()
        if self.reduce == "allreduce":
            timer.run("comm", lambda: dist.all_reduce(summed, group=self.group))
            timer.times.bytes_sent += ring_allreduce_bytes(summed.numel() * summed.element_size(), ctx.world_size)
        else:
            fn = ring_allreduce if self.reduce == "ring" else tree_allreduce
            stats = timer.run("comm", lambda: fn(summed, group=self.group))
            timer.times.bytes_sent += stats.bytes_sent
        mean = timer.run("compress", lambda: scatter_sparse(summed.div_(ctx.world_size), idx, ctx.numel))
        return mean, SparseSent(values, idx)


class AutoSparseExchange(Exchange):
    """Per group and step, the collective the alpha-beta model predicts fastest.

    Candidates: ``allgather`` (plain Top-k), ``art_ring``, ``art_tree`` (STAR AR-Topk). The choice
    depends only on replicated values (the agreed network model, the group size, N and the ratio),
    so every rank picks the same collective. Without a network model (not yet probed) it uses
    allgather.
    """

    name = "auto_sparse"
    formats = frozenset({"artopk_auto"})
    needs_network = True

    def __init__(self, compressor: ARTopKCompressor, group=None, network: NetworkState | None = None) -> None:
        super().__init__(compressor, group, network)
        # the AR-Topk compressor's local selection is Top-k's: the allgather candidate reuses it, so
        # the ratio lives in one place (the compressor's config)
        self._ag = AllgatherExchange(compressor, group)
        self._ring = ARTopkExchange(compressor, group, "ring")
        self._tree = ARTopkExchange(compressor, group, "tree")
        self.last_choice: str | None = None

    def choose(self, ctx: GroupContext, element_size: int = 4) -> tuple[str, float | None]:
        """The collective and its predicted seconds for a group of ``ctx.numel`` elements whose
        values are ``element_size`` bytes each (the gradient's dtype; indices are always int32).

        Units as in docs/cost_model.md: ``M = 4 * numel`` (so ``M*c`` = index bytes) and
        ``value_bytes = element_size`` (values take ``M*c*element_size/4`` bytes).
        """
        model = self.network.model
        if model is None or ctx.world_size == 1:
            return "allgather", None
        M = 4 * ctx.numel
        costs = model.sparse_costs(M, ctx.world_size, self.compressor.ratio, value_bytes=element_size)
        choice = model.choose_sparse_collective(M, ctx.world_size, self.compressor.ratio, value_bytes=element_size)
        return choice, costs[choice]

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor | SparseSent]:
        choice, predicted = self.choose(ctx, p.element_size())
        self.last_choice = choice
        timer.times.add_choice(choice, predicted)
        ex = {"allgather": self._ag, "art_ring": self._ring, "art_tree": self._tree}[choice]
        return ex.run(p, ctx, timer)
