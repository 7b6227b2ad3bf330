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
from .packing import pack_bits, unpack_bits


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
    def ratio(self) -> float:
        return 1 / 32

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        if self.config.scale == "l1":
            scale = x.float().abs().mean().reshape(1)
        else:
            scale = torch.ones(1, dtype=torch.float32, device=x.device)
        return Compressed((scale, pack_bits(x >= 0)), meta=x.dtype)

    @staticmethod
    def _signs(packed: Tensor, n: int) -> Tensor:
        return unpack_bits(packed, n).float().mul_(2).sub_(1)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        scale, packed = payload
        return self._signs(packed, ctx.numel).mul_(scale).to(meta)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        return [((1,), torch.float32), (((ctx.numel + 7) // 8,), torch.uint8)]


class SignSGDCompressor(_SignBase):
    name = "signsgd"
    default_error_feedback = False

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        votes = self._signs(payloads[0][1], ctx.numel)
        for p in payloads[1:]:
            votes.add_(self._signs(p[1], ctx.numel))
        scale = torch.stack([p[0].reshape(()) for p in payloads]).mean()
        return torch.sign(votes).mul_(scale).to(meta)


class EFSignSGDCompressor(_SignBase):
    name = "efsignsgd"
    default_error_feedback = True
