"""One-bit compressors: signSGD with majority vote, and EF-signSGD.

Both send the signs of the (error-fed) gradient packed 8 per byte plus one fp32 scale per rank,
≈0.125 bytes per element (1/32 of dense), by allgather.

``signsgd`` (Bernstein et al., majority vote): the update is ``sign(Σ_r sign(g_r))`` — each
coordinate moves in the direction most ranks agree on (0 on a tie) — multiplied by the mean over
ranks of the scale. No error feedback by default (majority vote is robust on its own but biased).

``efsignsgd`` (Karimireddy et al.): each rank sends ``C(p) = scale·sign(p)`` with
``scale = ‖p‖₁/n``, keeps ``p − C(p)`` as error memory, and the update is the mean of the ranks'
``C(p)``. Error feedback restores convergence to SGD's rate.

``scale="none"`` sends pure signs (scale 1): then the learning rate alone sets the step size, as
in the original signSGD; use a learning rate ~100× smaller than for SGD.
A zero element counts as positive (its bit is 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext
from .packing import pack_ge_zero, spread_bits, unpack_bits
from .workspace import empty_output, scratch


@dataclass(frozen=True)
class SignConfig:
    """Attributes:
    scale: ``"l1"`` multiplies signs by ‖p‖₁/n (mean magnitude) so SGD learning rates carry over;
        ``"none"`` sends bare signs.
    """

    scale: Literal["l1", "none"] = "l1"

    def __post_init__(self) -> None:
        if self.scale not in ("l1", "none"):
            raise ValueError(f"scale={self.scale!r} is invalid: use 'l1' (mean magnitude) or 'none'.")


class _SignBase(Compressor):
    wire_format = "allgather"
    wire_description = "packed sign bits (1 bit per element) and one fp32 scale"

    def __init__(self, config: SignConfig | None = None) -> None:
        self.config = config or SignConfig()

    @property
    def payload_fraction(self) -> float:
        return 1 / 32

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        xf = x.reshape(-1)
        if self.config.scale == "l1":
            # ‖x‖₁/n: |x| into a reused buffer, then a sum (vector_norm(ord=1) is ~2× slower on CPU)
            absx = torch.abs(xf, out=scratch("sign.abs", xf.numel(), xf.dtype, xf.device))
            scale = (absx.sum(dtype=torch.float32) / xf.numel()).reshape(1)
        else:
            scale = torch.ones(1, dtype=torch.float32, device=x.device)
        work = scratch("sign.bits", (xf.numel() + 7) // 8 * 8, torch.uint8, x.device)
        return Compressed((scale, pack_ge_zero(xf, work)), meta=x.dtype)

    @staticmethod
    def _signs(packed: Tensor, n: int) -> Tensor:
        return unpack_bits(packed, n).float().mul_(2).sub_(1)

    @staticmethod
    def _table_decode(payloads: list[tuple[Tensor, ...]], n: int, table: Tensor, dtype) -> Tensor:
        """out[i] = table[code_i] with code_i = Σ_r bit_r(i)·2^r (≤ 8 ranks: one byte per element)."""
        code = spread_bits(payloads[0][1])
        for r, p in enumerate(payloads[1:], start=1):
            code.add_(spread_bits(p[1]).bitwise_left_shift_(r))  # lanes stay < 2^8: no carries
        idx = scratch("sign.idx", n, torch.int32, code.device)
        idx.copy_(code.view(torch.uint8)[:n])
        out = empty_output(n, table.dtype, code.device)
        torch.index_select(table, 0, idx, out=out)
        return out if dtype == out.dtype else out.to(dtype)

    @staticmethod
    def _code_signs(nranks: int, device) -> Tensor:
        """(2^N, N) matrix: entry [c, r] = +1 if bit r of c is set else −1."""
        codes = torch.arange(1 << nranks, device=device).unsqueeze(1)
        return ((codes >> torch.arange(nranks, device=device)) & 1).float().mul_(2).sub_(1)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        scale, packed = payload
        s = scale.reshape(()).float()
        bits = spread_bits(packed).view(torch.uint8)[:ctx.numel]
        # b·2s − s is exactly (2b − 1)·s: ±s (2s is exact, and so is 2s − s)
        out = empty_output(ctx.numel, torch.float32, packed.device).copy_(bits)
        out.mul_(2 * s).sub_(s)
        return out if out.dtype == meta else out.to(meta)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        return [((1,), torch.float32), (((ctx.numel + 7) // 8,), torch.uint8)]


class SignSGDCompressor(_SignBase):
    name = "signsgd"
    default_error_feedback = False

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        n = ctx.numel
        scale = torch.stack([p[0].reshape(()) for p in payloads]).mean()
        if len(payloads) > 255:  # byte lanes would overflow: count in int32
            votes = self._signs(payloads[0][1], n)
            for p in payloads[1:]:
                votes.add_(self._signs(p[1], n))
            return torch.sign(votes).mul_(scale).to(meta)
        # count of positive signs per element, eight byte-lanes per word (no carries for N ≤ 255)
        count = spread_bits(payloads[0][1])
        for p in payloads[1:]:
            count.add_(spread_bits(p[1]))
        c = count.view(torch.uint8)[:n]
        # vote = sign(2c − N) ∈ {−1, 0, 1} computed in bytes, then one int8 → float pass with the scale
        vote = scratch("signsgd.vote", n, torch.int8, c.device)
        voters = len(payloads)
        torch.gt(c, voters // 2, out=vote.view(torch.bool))  # 2c > N
        if voters % 2 == 0:  # an even number of voters can tie (2c = N): vote 0 there
            vote.sub_(torch.lt(c, voters // 2).view(torch.int8))
        else:  # no ties: −1 wherever not +1
            vote.mul_(2).sub_(1)
        # int8 → float copy, then the scale (a mixed-dtype multiply is ~8× slower on CPU)
        out = empty_output(n, torch.float32, c.device).copy_(vote).mul_(scale.float())
        return out if out.dtype == meta else out.to(meta)


class EFSignSGDCompressor(_SignBase):
    name = "efsignsgd"
    default_error_feedback = True
    adam_error_feedback = False  # see docs/compressors.md, "Error feedback under Adam"

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        """Mean of the ranks' ``scale_r·sign_r`` through a 2^N-entry table per group of ≤ 8 ranks.

        The table entries are computed with the same float32 operations, in the same rank order,
        as summing the dense contributions and dividing by N, so the result is bit-identical to
        that — only the per-element work is one byte of code and one table lookup.
        """
        n = ctx.numel
        out: Tensor | None = None
        for lo in range(0, len(payloads), 8):
            chunk = payloads[lo:lo + 8]
            signs = self._code_signs(len(chunk), chunk[0][1].device)
            table = None
            for r, p in enumerate(chunk):
                col = signs[:, r] * p[0].reshape(()).float()
                table = col if table is None else table + col
            if out is None:
                out = self._table_decode(chunk, n, table, torch.float32)
            else:  # more than 8 ranks: add the next group's partial sums (rounding order differs)
                out.add_(self._table_decode(chunk, n, table, torch.float32))
        assert out is not None
        out.div_(ctx.world_size)
        return out if out.dtype == meta else out.to(meta)
