"""SSDM cascading compression along a ring: the foil of the Marsit paper (§3.2), for benchmarks.

This is what Marsit is measured against, not a method to train with. Each hop of the ring
reduce-scatter *decompresses* the incoming partial sum, adds the local full-precision chunk and
*re-compresses* it with SSDM's stochastic sign (Safaryan & Richtárik): for a vector x,

    Q(x) = ‖x‖₂ · s,   s_j = +1 with probability 1/2 + x_j / (2‖x‖₂), else −1,

which is unbiased (E[Q(x)] = x) but has variance up to d·‖x‖₂² per vector. The chunk's owner
compresses the full sum once more and the compressed chunks travel by allgather; every rank then
decodes ``Q(…Q(Q(p_1) + p_2)… + p_N) / N`` (N recursive compressions, the paper's s₃). The mean is
unbiased but its deviation grows with N (paper, Theorem 2), which is why Marsit merges bits
instead.

Wire format per chunk: a float32 norm (4 bytes) + the chunk's sign bits, whole bytes; all chunks
are padded to the largest so the ring's even byte split lands on chunk boundaries. One-bit rounds,
full-precision rounds (every K steps) and the compensation (``sent = g_global``) follow the Marsit
compressor's config exactly as :class:`~lightning_gc.exchanges.marsit.MarsitExchange` does, so the only
difference is the merge. Stochastic signs come from the generator of (seed, step, group, hop, rank)
(hop 0 = the chunk's first compression).

Use: ``GCStrategy(compressor="marsit", collective="marsit_cascade")``, in the benchmark
``marsit:collective=marsit_cascade``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm.exchange import Timer
from ..comm.p2p_allreduce import ring_allreduce, ring_chunk_sizes
from ..compressors.base import GroupContext
from ..compressors.packing import pack_bits, unpack_bits
from .marsit import MarsitExchange

__all__ = ["SSDMCascadeExchange", "ssdm_encode", "ssdm_decode"]


def ssdm_encode(x: Tensor, nbytes: int, generator: torch.Generator) -> Tensor:
    """``Q(x)`` as a uint8 message: 4 bytes of float32 ‖x‖₂, then ``nbytes`` bytes of sign bits."""
    xf = x.float()
    norm = xf.norm().reshape(1)
    u = torch.rand(xf.numel(), generator=generator, device=xf.device, dtype=torch.float32)
    if float(norm) > 0:
        p_plus = 0.5 + xf / (2 * norm)
    else:
        p_plus = torch.full_like(xf, 0.5)
    bits = pack_bits(u < p_plus)
    out = torch.zeros(4 + nbytes, dtype=torch.uint8, device=xf.device)
    out[:4] = norm.view(torch.uint8)
    out[4:4 + bits.numel()] = bits
    return out


def ssdm_decode(msg: Tensor, n: int) -> Tensor:
    """Inverse of :func:`ssdm_encode`: the float32 vector ``‖x‖₂ · s`` of ``n`` elements."""
    norm = msg[:4].clone().view(torch.float32).reshape(())
    return unpack_bits(msg[4:], n).float().mul_(2).sub_(1).mul_(norm)


class SSDMCascadeExchange(MarsitExchange):
    """Marsit's schedule and compensation with SSDM re-compression at every hop instead of ⊙."""

    name = "marsit_cascade"

    def _one_bit(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        n = ctx.world_size
        sizes = ring_chunk_sizes(p.numel(), n)
        offsets = [sum(sizes[:i]) for i in range(n)]
        nbytes = (max(sizes) + 7) // 8
        msg = 4 + nbytes
        local = p.float()
        comp = self.compressor

        def chunk(i: int) -> Tensor:
            return local.narrow(0, offsets[i], sizes[i])

        buf = torch.zeros(n * msg, dtype=torch.uint8, device=p.device)
        # the first message of chunk r starts at rank r (ring step 0 sends chunk r)
        buf[ctx.rank * msg:(ctx.rank + 1) * msg] = ssdm_encode(
            chunk(ctx.rank), nbytes, comp.transient_generator(ctx, 0))

        def combine(acc: Tensor, incoming: Tensor, hop: int) -> Tensor:
            i = (ctx.rank - hop) % n  # ring step hop-1 receives chunk (rank - hop) % N
            x = ssdm_decode(incoming, sizes[i]).add_(chunk(i))
            return ssdm_encode(x, nbytes, comp.transient_generator(ctx, hop))

        timer.times.bytes_payload += msg
        timer.times.bytes_sent += timer.run(
            "comm", lambda: ring_allreduce(buf, group=self.group, combine=combine).bytes_sent)

        def decode() -> Tensor:
            parts = [ssdm_decode(buf[i * msg:(i + 1) * msg], sizes[i]) for i in range(n)]
            return torch.cat(parts).div_(n).to(p.dtype)

        mean = timer.run("compress", decode)
        return mean, mean
