"""SparseLoCo's pseudo-gradient codec: chunked Top-k, 2- or 4-bit values with a per-chunk scale.

SparseLoCo (Sarfi et al., *Communication Efficient LLM Pre-training with SparseLoCo*, 2025) sends
DiLoCo's pseudo-gradient Δ as a very sparse, low-bit message and keeps what it did not send in a
per-replica error memory. This module is the codec; DiLoCo (:mod:`lightning_gc.sync.diloco`) adds
the memory (``e ← β·e + Δ``; send ``C(e)``; ``e ← e − sent``, per rank) and runs the exchange
(an allgather of every rank's payload: the ranks keep different supports, so nothing can be summed
on the way). It is reached with ``GCStrategy(sync="diloco", diloco_compressor="sparseloco")``.

One compression of a flat fp32 tensor of ``n`` elements:

* **Chunks.** The tensor is cut into ``⌈n/C⌉`` chunks of ``C = chunk`` elements (the last one
  zero-padded); in every chunk the ``k = ⌈density·C⌉`` largest magnitudes are kept (``torch.topk``
  per row), in ascending offset order.
* **Values.** A chunk's kept values share one fp32 scale ``s = max|v| / M`` with ``M = 2^(bits−1)``
  magnitude levels; each value travels as a sign bit and a level ``q ∈ {1 … M}`` (decoded as
  ``sign·q·s``): 2 bits give ``±s, ±2s`` (``±max/2, ±max``), 4 bits ``±s … ±8s``. Top-k keeps large
  values, so no code is spent on zero. ``rounding="nearest"``: ``q = round(|v|/s)``;
  ``"stochastic"``: ``q = ⌊|v|/s + u⌋`` with the dither ``u`` of
  :func:`~lightning_gc.compressors.lowbit.dither_words` drawn from
  ``GroupContext.private_generator(salt=1)`` (a pure function of seed, step, group and rank, one draw
  per kept value in chunk-then-offset order): a reference, or a resumed run, replays the same draws.
  ``q`` is clamped to ``[1, M]``; what rounding moves is left in the error memory.
* **Indices.** The offset of each kept value inside its chunk, as 16 bits (``C ≤ 65536``).

Payload (fixed size for a given ``n``, so it can be allgathered): ``(scales fp32 [chunks], codes
uint8 [⌈chunks·k·bits/8⌉], offsets int16 [chunks·k])``. Bytes per element of Δ:
``density·(bits/8 + 2) + 4/C`` (:func:`sparseloco_payload_bytes` is exact, before the exchange's
8-byte alignment of each part). The receiver decodes every rank's payload and adds it into one fp32
sum, rank by rank in rank order (a rank's offsets are distinct, so each scatter-add is
deterministic), then divides by N: every rank computes the same bits.

Tuning: ``density`` sets the bytes (the 16-bit offsets are most of them); ``bits=4`` costs 1/4 more
bytes than ``bits=2`` at 1 % density and rounds 4× finer; ``chunk`` trades the scales' bytes
against how local the selection is (a smaller chunk spreads the kept values more evenly over the
model). docs/diloco.md ("SparseLoCo") lists the settings chosen from the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext
from .lowbit import dither_words
from .packing import pack_uint8_codes, unpack_uint8_codes

__all__ = ["SparseLoCoCompressor", "SparseLoCoConfig", "sparseloco_payload_bytes"]

_BITS = (2, 4)
_ROUNDING = ("nearest", "stochastic")
_MAX_CHUNK = 1 << 16  # offsets travel as 16 bits
_DITHER_SALT = 1


@dataclass(frozen=True)
class SparseLoCoConfig:
    """Options of SparseLoCo's Δ codec (``diloco_compressor_args``).

    Attributes:
        density: fraction of each chunk kept, in (0, 1]; ``k = ⌈density·chunk⌉`` per chunk. The
            paper works at 1–3 %; 1/64 keeps 64 of 4096.
        chunk: C, elements per chunk (2 … 65536: offsets travel as 16 bits).
        bits: bits per kept value, sign included: 2 (levels ±max/2, ±max) or 4 (±max/8 … ±max).
        rounding: ``"nearest"`` (deterministic) or ``"stochastic"`` (unbiased within ``[s, M·s]``,
            seeded per (seed, outer step, rank)).
    """

    density: float = 1 / 64
    chunk: int = 4096
    bits: int = 2
    rounding: str = "nearest"

    def __post_init__(self) -> None:
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d <= 1.0:
            raise ValueError(f"density={d!r} is invalid for SparseLoCo: it is the fraction of each chunk kept and must "
                             "lie in (0, 1]. Use e.g. density=0.015625 (64 of 4096, the paper's 1–3 % range).")
        c = self.chunk
        if isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= _MAX_CHUNK:
            raise ValueError(f"chunk={c!r} is invalid for SparseLoCo: it is the number of elements per Top-k chunk and "
                             f"must be an integer in [2, {_MAX_CHUNK}] (offsets inside a chunk travel as 16 bits). "
                             "Use chunk=4096.")
        if isinstance(self.bits, bool) or self.bits not in _BITS:
            raise ValueError(f"bits={self.bits!r} is invalid for SparseLoCo: kept values travel as a sign and a level "
                             "in 2 bits (4 codes per byte) or 4 bits (2 per byte). Use bits=2 or bits=4.")
        if self.rounding not in _ROUNDING:
            raise ValueError(f"rounding={self.rounding!r} is invalid for SparseLoCo: use 'nearest' (deterministic) "
                             "or 'stochastic' (seeded per outer step and rank).")

    @property
    def kept(self) -> int:
        """k, values kept per chunk."""
        return min(self.chunk, max(1, math.ceil(self.density * self.chunk)))

    @property
    def levels(self) -> int:
        """M, magnitude levels: ``q ∈ {1 … M}``."""
        return 1 << (self.bits - 1)


def sparseloco_payload_bytes(numel: int, config: SparseLoCoConfig) -> int:
    """Bytes of one rank's payload for ``numel`` elements (scales, packed codes, 16-bit offsets)."""
    chunks = -(-numel // config.chunk)
    kept = chunks * config.kept
    return 4 * chunks + -(-kept * config.bits // 8) + 2 * kept


class SparseLoCoCompressor(Compressor):
    """The codec of the module docstring; DiLoCo keeps the error memory and runs the allgather."""

    name = "sparseloco"
    wire_format = "allgather"
    default_error_feedback = True
    wire_description = "per chunk: an fp32 scale, k 2/4-bit sign-level codes and k 16-bit offsets, different on every rank"

    def __init__(self, config: SparseLoCoConfig | None = None) -> None:
        self.config = config or SparseLoCoConfig()

    @property
    def payload_fraction(self) -> float:
        c = self.config
        return (c.kept * (c.bits / 8 + 2) + 4) / (4 * c.chunk)

    def chunks(self, numel: int) -> int:
        return -(-numel // self.config.chunk)

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        cfg = self.config
        n, nc, k, m = x.numel(), self.chunks(x.numel()), cfg.kept, cfg.levels
        v = torch.zeros(nc * cfg.chunk, dtype=torch.float32, device=x.device)
        v[:n].copy_(x.reshape(-1))
        v = v.view(nc, cfg.chunk)
        offsets = torch.topk(v.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
        vals = torch.gather(v, 1, offsets)
        mag = vals.abs()
        scale = mag.amax(dim=1).div_(m)
        inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        t = mag.mul_(inv.unsqueeze(1))
        if cfg.rounding == "stochastic":
            u = dither_words(nc * k, ctx.private_generator(salt=_DITHER_SALT), x.device).to(torch.float32)
            t.add_(u.add_(0.5).mul_(1.0 / (1 << 15)).view(nc, k)).floor_()
        else:
            t.round_()
        q = t.clamp_(1, m).to(torch.uint8).sub_(1)
        codes = q.bitwise_or_((vals < 0).to(torch.uint8) << (cfg.bits - 1))
        packed = pack_uint8_codes(codes.reshape(-1), cfg.bits)
        return Compressed((scale, packed, offsets.to(torch.int32).to(torch.int16).reshape(-1)), meta=x.dtype)

    def _decoded(self, payload: tuple[Tensor, ...], nc: int) -> tuple[Tensor, Tensor]:
        """(values ``sign·q·s`` as fp32 ``(chunks, k)``, offsets as int64 ``(chunks, k)``)."""
        cfg = self.config
        k, m = cfg.kept, cfg.levels
        scale, packed, offsets = payload
        codes = unpack_uint8_codes(packed.reshape(-1), cfg.bits, nc * k).view(nc, k)
        level = codes.bitwise_and(m - 1).to(torch.float32).add_(1)
        negative = codes.bitwise_right_shift(cfg.bits - 1).to(torch.bool)
        vals = torch.where(negative, -level, level).mul_(scale.view(nc, 1))
        off = offsets.reshape(nc, k).to(torch.int64).bitwise_and_(0xFFFF)
        return vals, off

    def _accumulate(self, out: Tensor, payload: tuple[Tensor, ...], nc: int) -> None:
        vals, off = self._decoded(payload, nc)
        out.view(nc, self.config.chunk).scatter_add_(1, off, vals)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        nc = self.chunks(ctx.numel)
        out = torch.zeros(nc * self.config.chunk, dtype=torch.float32, device=payload[0].device)
        self._accumulate(out, payload, nc)
        dtype = meta if isinstance(meta, torch.dtype) else torch.float32
        return out[: ctx.numel].to(dtype)

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        """``Σ_r decode(payload_r) / N`` in fp32, ranks added in rank order (identical on every rank)."""
        nc = self.chunks(ctx.numel)
        out = torch.zeros(nc * self.config.chunk, dtype=torch.float32, device=payloads[0][0].device)
        for p in payloads:
            self._accumulate(out, p, nc)
        out = out[: ctx.numel].div_(ctx.world_size)
        return out.to(meta) if isinstance(meta, torch.dtype) else out

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        nc, cfg = self.chunks(ctx.numel), self.config
        kept = nc * cfg.kept
        return [((nc,), torch.float32), ((-(-kept * cfg.bits // 8),), torch.uint8), ((kept,), torch.int16)]

    def describe(self) -> str:
        c = self.config
        return f"{self.name}(density={c.density},chunk={c.chunk},bits={c.bits},rounding={c.rounding})"
