"""The ``lowbit`` exchange: a k-bit ring allreduce that sums in fp32 at every hop.

One round on one plan group of n elements (``p`` = this rank's error-fed gradient), N ranks:

1. ``p`` is cut into ``nb = ⌈n/B⌉`` blocks of B = ``block_size`` elements (zero-padded at the end)
   and the blocks into N ring chunks of whole blocks (sizes from
   :func:`~lightning_gc.comm.p2p_allreduce.ring_chunk_sizes` over blocks);
2. reduce-scatter, steps s = 0 … N−2 (hop h = s + 1): rank r quantises chunk ``(r − s) mod N``
   (its own values at s = 0, afterwards the fp32 partial sum it accumulated at the previous step)
   with the dither of (seed, step, group, h, r), sends the k-bit message to ``r + 1``, receives chunk
   ``(r − s − 1) mod N`` from ``r − 1``, dequantises it and adds it to its own fp32 values;
3. after N − 1 hops rank r holds the fp32 sum of chunk ``(r + 1) mod N``; it quantises the mean
   (sum / N) with hop h = N, and a ring allgather passes the k-bit messages around unchanged;
4. every rank decodes all N messages, its own included: the result is bit-identical everywhere.

Bytes per rank: ``2(N−1)`` messages, each a chunk of ≈ nb/N blocks at ``4 + B·k/8`` bytes per
block, so ≈ ``2(N−1)/N · nb·(4 + B·k/8)`` — flat in N (:func:`lowbit_bytes_sent` is exact).

Transport: :func:`lightning_gc.comm.p2p.batch_send_recv`, the sends of every other ring of this
package: on gloo CPU tensors go directly and CUDA tensors through host memory; on NCCL CUDA
tensors go directly (the quantiser and the dither run on the gradients' device either way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import p2p
from ..comm.exchange import Exchange, Timer
from ..comm.network import NetworkState
from ..comm.p2p_allreduce import ring_chunk_sizes
from ..compressors.base import GroupContext
from ..compressors.lowbit import LowBitCompressor, decode_blocks, encode_blocks, message_bytes

__all__ = ["LowBitExchange", "lowbit_bytes_sent", "lowbit_ring"]


def lowbit_bytes_sent(numel: int, bits: int, block_size: int, world_size: int, rank: int) -> int:
    """Exact bytes group rank ``rank`` sends in one :func:`lowbit_ring` of ``numel`` elements."""
    n = world_size
    if n == 1:
        return 0
    blocks = ring_chunk_sizes(-(-numel // block_size), n)
    chunks = [(rank - s) % n for s in range(n - 1)] + [(rank + 1 - s) % n for s in range(n - 1)]
    return sum(message_bytes(blocks[c], block_size, bits) for c in chunks if blocks[c])


class _Ring:
    """Ring geometry of one call: chunk c is ``blocks[c]`` blocks from block ``first[c]``."""

    def __init__(self, nblocks: int, world_size: int, rank: int, block_size: int, bits: int) -> None:
        self.n, self.rank, self.bits, self.block_size = world_size, rank, bits, block_size
        self.blocks = ring_chunk_sizes(nblocks, world_size)
        self.first = [sum(self.blocks[:c]) for c in range(world_size)]
        self.nbytes = [message_bytes(b, block_size, bits) for b in self.blocks]
        # messages sit at 4-byte aligned offsets of the gather buffer (their scales are read as fp32)
        self.byte_at = [sum(-(-k // 4) * 4 for k in self.nbytes[:c]) for c in range(world_size + 1)]

    def rows(self, t: Tensor, c: int) -> Tensor:
        return t.narrow(0, self.first[c], self.blocks[c])

    def msg(self, buf: Tensor, c: int) -> Tensor:
        return buf.narrow(0, self.byte_at[c], self.nbytes[c])


def _send_recv(send: Tensor, recv: Tensor, right: int, left: int, group) -> int:
    """One ring step; returns the bytes sent (empty chunks travel as nothing)."""
    works = p2p.batch_send_recv(send if send.numel() else None, right, recv if recv.numel() else None, left, group)
    for w in works:
        w.wait()
    return send.numel()


def lowbit_ring(x: Tensor, comp: LowBitCompressor, ctx: GroupContext, group=None) -> tuple[Tensor, Tensor, int]:
    """The k-bit ring on the fp32 blocks ``x`` (shape ``(nb, B)``, consumed: it holds partial sums after).

    Returns ``(mean blocks, err blocks, bytes sent)``: ``mean`` identical on every rank; ``err`` the
    quantisation errors this rank made, in sum units (Σ over ranks of ``x_r − err_r`` = N·mean).
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    ring = _Ring(x.shape[0], n, rank, comp.block_size, comp.bits)
    right = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n
    err = torch.zeros_like(x)
    send = torch.empty(max(ring.nbytes), dtype=torch.uint8, device=x.device)
    recv = torch.empty_like(send)
    sent = 0
    for s in range(n - 1):  # reduce-scatter: quantise what is sent, sum what arrives in fp32
        out_c, in_c = (rank - s) % n, (rank - s - 1) % n
        part, dq = ring.rows(x, out_c), ring.rows(err, out_c)
        encode_blocks(part, comp.bits, comp.generator(ctx, s + 1), send[: ring.nbytes[out_c]], dq)
        dq.neg_().add_(part)  # err = partial sum − what the message stands for
        sent += _send_recv(send[: ring.nbytes[out_c]], recv[: ring.nbytes[in_c]], right, left, group)
        acc = ring.rows(x, in_c)
        decode_blocks(recv[: ring.nbytes[in_c]], ring.blocks[in_c], comp.block_size, comp.bits, acc, add=acc)
    gathered = torch.empty(ring.byte_at[n], dtype=torch.uint8, device=x.device)
    own = (rank + 1) % n
    mean_part, e = ring.rows(x, own).div_(n), ring.rows(err, own)
    encode_blocks(mean_part, comp.bits, comp.generator(ctx, n), ring.msg(gathered, own), e)
    e.neg_().add_(mean_part).mul_(n)
    for s in range(n - 1):  # allgather of the k-bit mean chunks, forwarded unchanged
        sent += _send_recv(ring.msg(gathered, (rank + 1 - s) % n), ring.msg(gathered, (rank - s) % n),
                           right, left, group)
    mean = torch.empty_like(x)
    for c in range(n):
        decode_blocks(ring.msg(gathered, c), ring.blocks[c], comp.block_size, comp.bits, ring.rows(mean, c))
    return mean, err, sent


class LowBitExchange(Exchange):
    """The low-bit ring (module docstring); the compressor must be a :class:`LowBitCompressor`."""

    name = "lowbit"
    formats = frozenset({"lowbit"})
    ring_combinable = True

    def __init__(self, compressor: LowBitCompressor, group=None, network: NetworkState | None = None) -> None:
        self._require(compressor, LowBitCompressor, "the low-bit ring allreduce")
        super().__init__(compressor, group, network)
        self.compressor: LowBitCompressor = compressor

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        if ctx.world_size == 1:
            return p.clone(), p
        comp = self.compressor
        n = p.numel()
        x = timer.run("compress", lambda: comp.padded(p))
        # the per-hop codec work runs between the sends, so it is counted with them as "comm"
        mean, err, nbytes = timer.run("comm", lambda: lowbit_ring(x, comp, ctx, self.group))
        timer.times.bytes_sent += nbytes
        timer.times.bytes_payload += message_bytes(x.shape[0], comp.block_size, comp.bits)
        out = mean.view(-1)[:n].to(p.dtype)
        sent = timer.run("compress", lambda: p - err.view(-1)[:n].to(p.dtype))
        return out, sent
