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
from .packing import pack_uint, pack_uint8_codes, packed_uint_nbytes, uint_width
from .workspace import empty_output, scratch

_U_ONE = float(1 << 15)  # the dither's unit: u = r·2^-15


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
        self._tables: dict = {}

    @property
    def payload_fraction(self) -> float:
        return (self.width / 8 + 4 / self.config.bucket_size) / 4

    def _buckets(self, n: int) -> int:
        return math.ceil(n / self.config.bucket_size)

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        s = self.config.levels
        bs = self.config.bucket_size
        n = x.numel()
        xf = x.reshape(-1)
        if xf.dtype != torch.float32:
            xf = xf.float()
        full, tail = divmod(n, bs)
        norms = torch.empty(self._buckets(n), dtype=torch.float32, device=x.device)
        if full:
            torch.linalg.vector_norm(xf[:full * bs].view(full, bs), dim=1, out=norms[:full])
        if tail:
            norms[full] = torch.linalg.vector_norm(xf[full * bs:])
        # inv = s / norm (0 for an all-zero bucket); scaled to the 2^-15 units of the dither below
        inv = torch.where(norms > 0, s / norms, torch.zeros_like(norms)).mul_(_U_ONE)
        # dither u = (2r+1)·2^-15 with r uniform on 0..2^14-1: 14-bit, centred; see the module doc
        words = scratch("qsgd.rand", (n + 3) // 4, torch.int64, x.device)
        words.random_(generator=ctx.private_generator())
        r = words.view(torch.int16)[:n]
        r.bitwise_and_(0x3FFF).bitwise_left_shift_(1).bitwise_or_(1)
        # t = 2^15·(s·x/norm + sign(x)·u); the level is trunc(t·2^-15) = sign(x)·floor(s|x|/norm + u)
        t = scratch("qsgd.t", n, torch.float32, x.device)
        t.copy_(r).copysign_(xf)
        if full:
            t[:full * bs].view(full, bs).addcmul_(xf[:full * bs].view(full, bs), inv[:full].unsqueeze(1))
        if tail:
            t[full * bs:].addcmul_(xf[full * bs:], inv[full:])
        t.mul_(1.0 / _U_ONE)
        if s <= 126:  # |level| ≤ s + 1 fits int8; codes = level + s as uint8 (wraps correctly)
            lv = scratch("qsgd.lv8", n, torch.int8, x.device)
            lv.copy_(t).clamp_(-s, s)
            codes = lv.view(torch.uint8).add_(s)
            packed = pack_uint8_codes(codes, self.width)
        else:
            lv32 = scratch("qsgd.lv32", n, torch.int32, x.device)
            lv32.copy_(t).clamp_(-s, s).add_(s)
            packed = pack_uint(lv32, self.width)
        return Compressed((norms, packed), meta=x.dtype)

    def _accumulate(self, payloads: list[tuple[Tensor, ...]], n: int, weight: float, device) -> Tensor:
        """Σ_r weight·(q_r − s)·norm_r/s decoded straight into one float32 accumulator."""
        s = self.config.levels
        bs = self.config.bucket_size
        full, tail = divmod(n, bs)
        out = empty_output(n, torch.float32, device)
        per = 8 // self.width if self.width < 8 else 1
        lv = scratch("qsgd.dec", -(-n // per) * per, torch.float32, device)
        for i, (norms, packed) in enumerate(payloads):
            c = norms.float() * (weight / s)  # per-bucket factor
            self._levels_into(packed, n, lv)
            for lo, rows, cols, cb in ((0, full, bs, c[:full]), (full * bs, 1 if tail else 0, tail, c[full:])):
                if rows == 0:
                    continue
                src = lv[lo:lo + rows * cols].view(rows, cols)
                dst = out[lo:lo + rows * cols].view(rows, cols)
                if i == 0:
                    torch.mul(src, cb.unsqueeze(1), out=dst)
                else:
                    dst.addcmul_(src, cb.unsqueeze(1))
        return out

    def _levels_table(self, device) -> Tensor:
        """For widths 2/4: row ``b`` = the signed levels (q − s) of the 8/w codes packed in byte ``b``."""
        key = (str(device),)
        tab = self._tables.get(key)
        if tab is None:
            w = self.width
            per = 8 // w
            b = torch.arange(256, device=device).unsqueeze(1)
            tab = ((b >> (torch.arange(per, device=device) * w)) & ((1 << w) - 1)).float().sub_(self.config.levels)
            self._tables[key] = tab = tab.contiguous()
        return tab

    def _levels_into(self, packed: Tensor, n: int, out: Tensor) -> None:
        """Signed levels q − s of one payload as float32 into ``out[:n]``.

        ``out`` must hold ``packed.numel()·8/width`` elements for widths 2 and 4: each byte is
        looked up in a 256-row table of its 8/w levels (one gather of 8/16-byte rows, no unpacked
        codes and no int64 per element).
        """
        s = self.config.levels
        w = self.width
        if w == 16:
            out[:n].copy_(packed.view(torch.int16)[:n].to(torch.int32).bitwise_and_(0xFFFF).sub_(s))
            return
        if w == 8:
            out[:n].copy_(packed[:n].sub(s).view(torch.int8))  # 2s ≤ 254: q − s fits int8 after the wrap
            return
        per = 8 // w
        m = packed.numel()
        idx = scratch("qsgd.idx", m, torch.int32, packed.device)
        idx.copy_(packed)
        tab = self._levels_table(packed.device)
        rows = out[:m * per].view(m, per)
        if per == 2:  # two fp32 levels = one 64-bit row
            torch.index_select(tab.view(torch.int64).view(-1), 0, idx, out=rows.view(torch.int64).view(-1))
        else:
            torch.index_select(tab, 0, idx, out=rows)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        out = self._accumulate([payload], ctx.numel, 1.0, payload[1].device)
        return out.to(meta if isinstance(meta, torch.dtype) else torch.float32)

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        out = self._accumulate(payloads, ctx.numel, 1.0 / ctx.world_size, payloads[0][1].device)
        return out.to(meta if isinstance(meta, torch.dtype) else torch.float32)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        n = ctx.numel
        return [((self._buckets(n),), torch.float32), ((packed_uint_nbytes(n, self.width),), torch.uint8)]
