"""The Marsit exchange: one-bit ring allreduce with the unbiased ⊙ merge at every hop.

One round on one plan group (``p = g + c`` is the error-fed gradient of this rank, d elements):

one-bit round (``step % K != 0``, or always when K = 0)
    1. ``bits = pack_bits(p ≥ 0)`` (⌈d/8⌉ bytes) and this rank's ``‖p‖₁/d``;
    2. η_s = mean over ranks of ``‖p‖₁/d``: one allreduce of a single float32 (``scale="l1"``;
       skipped for ``scale="none"``);
    3. ring reduce-scatter of the packed bytes: the byte buffer is split into N chunks of whole
       bytes (sizes from :func:`~lightning_gc.comm.p2p_allreduce.ring_chunk_sizes`); at hop h
       (h = 1 … N−1) a rank merges the incoming chunk, which aggregates h ranks, into its own bits
       with :func:`~lightning_gc.compressors.marsit.merge_packed` at ``m = h + 1``, transient bits
       drawn from the generator of (seed, step, group, hop, rank);
    4. ring allgather of the merged chunks (the owner's chunk overwrites everyone's);
    5. ``g_global = η_s · (2·bits − 1)`` in p's dtype — identical on every rank.

    Returns ``(g_global, sent = g_global)``: the engine keeps ``p − sent = (g + c) − g_global``,
    which is Marsit's global compensation (Algorithm 1, line 11).

full-precision round (``K > 0`` and ``step % K == 0``)
    ``g_global = Σ_r p_r / N`` by the backend's allreduce (p divided by N first, as DDP does), and
    ``sent = p``, so the compensation becomes ``p − p = 0`` (line 13).

Bytes per rank in a one-bit round: the ring sends exactly
``ring_bytes_sent(⌈d/8⌉, 1, N, rank)`` ≈ ``2(N−1)/N · d/8`` bytes, plus the η_s allreduce of
4 bytes (counted as a ring allreduce of 4 bytes). Everything is reported in
``timer.times.bytes_sent``; ``timer.times.full_precision`` tells the engine which kind of
round ran (all groups of a step run the same kind: the decision depends on the step only).

The ring is :func:`~lightning_gc.comm.p2p_allreduce.ring_allreduce` over a uint8 tensor with a
``combine`` closure; it sends through :mod:`lightning_gc.comm.p2p`, so the same code runs on gloo
(CPU tensors directly, CUDA tensors through host memory) and NCCL (CUDA), and the transient bits are
drawn on the gradients' device.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import ring_allreduce_bytes
from ..comm.exchange import Exchange, Timer
from ..comm.network import NetworkState
from ..comm.p2p_allreduce import ring_allreduce
from ..compressors.base import GroupContext
from ..compressors.marsit.codec import merge_packed
from ..compressors.marsit.compressor import MarsitCompressor
from ..compressors.packing import pack_bits

__all__ = ["MarsitExchange", "marsit_one_bit_bytes"]


def marsit_one_bit_bytes(numel: int, world_size: int, rank: int, scale: str = "l1") -> int:
    """Exact bytes group rank ``rank`` sends in one one-bit round of ``numel`` elements."""
    from ..comm.p2p_allreduce import ring_bytes_sent

    ring = ring_bytes_sent((numel + 7) // 8, 1, world_size, rank)
    return ring + (ring_allreduce_bytes(4, world_size) if scale == "l1" else 0)


class MarsitExchange(Exchange):
    """Marsit's ring (see the module docstring); the compressor must be a :class:`MarsitCompressor`."""

    name = "marsit"
    formats = frozenset({"marsit"})
    ring_combinable = True

    def __init__(self, compressor: MarsitCompressor, group=None, network: NetworkState | None = None) -> None:
        self._require(compressor, MarsitCompressor, "Marsit's bit-merging ring")
        super().__init__(compressor, group, network)
        self.compressor: MarsitCompressor = compressor

    # ------------------------------------------------------------------ rounds
    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        if ctx.world_size == 1:
            return p.clone(), p
        if self.compressor.full_precision_round(ctx.step):
            timer.times.full_precision = True
            return self._full_precision(p, ctx, timer)
        timer.times.full_precision = False
        return self._one_bit(p, ctx, timer)

    def _full_precision(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        buf = p.div(ctx.world_size)  # divide first, like DDP: the sum cannot overflow a 16-bit dtype
        timer.run("comm", lambda: dist.all_reduce(buf, group=self.group))
        nbytes = buf.numel() * buf.element_size()
        timer.times.bytes_sent += ring_allreduce_bytes(nbytes, ctx.world_size)
        timer.times.bytes_payload += nbytes
        return buf, p  # c ← 0

    def global_scale(self, p: Tensor, ctx: GroupContext, timer: Timer) -> Tensor:
        """η_s agreed across ranks (float32 scalar tensor)."""
        local = timer.run("compress", lambda: self.compressor.local_scale(p))
        if self.compressor.config.scale == "none":
            return local.reshape(())
        timer.run("comm", lambda: dist.all_reduce(local, group=self.group))
        timer.times.bytes_sent += ring_allreduce_bytes(local.numel() * local.element_size(), ctx.world_size)
        timer.times.bytes_payload += local.numel() * local.element_size()
        return local.reshape(()).div_(ctx.world_size)

    def merge_ring(self, bits: Tensor, ctx: GroupContext) -> int:
        """Reduce-scatter with the ⊙ merge, then allgather, in place on packed ``bits``; bytes sent."""
        comp = self.compressor

        def combine(acc: Tensor, incoming: Tensor, hop: int) -> Tensor:
            # acc holds this rank's own bits of the chunk (each chunk is merged into once per rank)
            return merge_packed(incoming, acc, hop + 1, comp.transient_generator(ctx, hop))

        return ring_allreduce(bits, group=self.group, combine=combine).bytes_sent

    def _one_bit(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        eta = self.global_scale(p, ctx, timer)
        bits = timer.run("compress", lambda: pack_bits(p >= 0))
        timer.times.bytes_payload += bits.numel()
        timer.times.bytes_sent += timer.run("comm", lambda: self.merge_ring(bits, ctx))
        mean = timer.run("compress", lambda: MarsitCompressor.signs(bits, p.numel()).mul_(eta).to(p.dtype))
        return mean, mean  # sent = g_global: the engine's p − sent is the global compensation
