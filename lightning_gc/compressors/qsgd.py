"""QSGD: stochastic quantisation to ``levels`` magnitude levels per bucket of elements.

Each bucket of ``bucket_size`` elements is sent as its L2 norm (fp32) and, per element, an
integer ``q ∈ [−s, s]`` (s = ``levels``) drawn so that ``E[q]·norm/s = x`` (unbiased stochastic
rounding of ``s·|x|/norm``). The integers are packed ``w`` bits each, with ``w`` the smallest of
2/4/8/16 that holds ``2s+1`` values: s=1 → 2 bits, s ≤ 7 → 4 bits, s ≤ 127 → 8 bits.

Bytes per element ≈ ``w/8 + 4/bucket_size``; the default (s=7, bucket 512) sends ≈0.51 bytes per
element, about 1/8 of dense. Fewer levels → more variance; smaller buckets → less variance, more
norms. QSGD is unbiased, so error feedback is off by default. Travels by allgather (payloads from
different ranks have different norms and cannot be summed as they are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext
from .packing import pack_uint, packed_uint_nbytes, uint_width, unpack_uint


@dataclass(frozen=True)
class QSGDConfig:
    """Attributes:
    levels: number of positive quantisation levels s (1 ≤ s ≤ 32767).
    bucket_size: elements sharing one norm (≥ 1).
    """

    levels: int = 7
    bucket_size: int = 512

    def __post_init__(self) -> None:
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or not (1 <= self.levels <= 32767):
            raise ValueError(
                f"levels={self.levels!r} is invalid: QSGD needs an integer number of levels in "
                "[1, 32767]; 7 packs into 4 bits per element, 127 into 8."
            )
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ValueError(f"bucket_size={self.bucket_size!r} must be a positive integer; use 512.")


class QSGDCompressor(Compressor):
    name = "qsgd"
    wire_format = "allgather"
    wire_description = "one fp32 norm per bucket and a packed signed quantisation level per element"
    default_error_feedback = False

    def __init__(self, config: QSGDConfig | None = None) -> None:
        self.config = config or QSGDConfig()
        self.width = uint_width(2 * self.config.levels)

    @property
    def ratio(self) -> float:
        return (self.width / 8 + 4 / self.config.bucket_size) / 4

    def _buckets(self, n: int) -> int:
        return math.ceil(n / self.config.bucket_size)

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        s = self.config.levels
        n = x.numel()
        nb = self._buckets(n)
        xf = x.float()
        pad = nb * self.config.bucket_size - n
        if pad:
            xf = torch.cat([xf, xf.new_zeros(pad)])
        xb = xf.view(nb, self.config.bucket_size)
        norms = torch.linalg.vector_norm(xb, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = xb.abs() / safe.unsqueeze(1) * s
        low = scaled.floor()
        u = torch.rand(scaled.shape, generator=ctx.private_generator(), device=x.device)
        level = low + (u < (scaled - low)).float()
        q = (torch.sign(xb) * level).flatten()[:n].to(torch.int64) + s
        return Compressed((norms, pack_uint(q, self.width)), meta=x.dtype)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        norms, packed = payload
        n = ctx.numel
        s = self.config.levels
        q = (unpack_uint(packed, self.width, n) - s).float()
        nb = norms.numel()
        bs = self.config.bucket_size
        per_elem = norms.repeat_interleave(bs)[:n] if nb * bs >= n else norms
        out = q * per_elem / s
        return out.to(meta if isinstance(meta, torch.dtype) else torch.float32)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        n = ctx.numel
        return [((self._buckets(n),), torch.float32), ((packed_uint_nbytes(n, self.width),), torch.uint8)]
