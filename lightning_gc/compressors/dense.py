"""Dense: the exact allreduce, bit-for-bit what DDP itself does (divide by N, then sum)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext
from .workspace import empty_output


@dataclass(frozen=True)
class DenseConfig:
    """No options: dense sends every element in the gradient's own dtype."""


class DenseCompressor(Compressor):
    """Identity transform; the engine's fast path runs it as DDP's own bucketed async allreduce.

    Sends 4 bytes per fp32 element. Use it as the baseline, or to get lightning_gc's monitoring on
    otherwise unchanged DDP training.
    """

    name = "dense"
    wire_format = "allreduce"
    lossy = False
    default_error_feedback = False
    wire_description = "every gradient element in the gradient's own dtype"

    def __init__(self, config: DenseConfig | None = None) -> None:
        self.config = config or DenseConfig()

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        out = empty_output(x.numel(), x.dtype, x.device).view(x.shape)  # huge pages: cheaper first touch
        return Compressed((torch.div(x, ctx.world_size, out=out),))

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        p = payload[0]
        return torch.mul(p, ctx.world_size, out=empty_output(p.numel(), p.dtype, p.device).view(p.shape))

    def aggregate_summed(self, summed: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        return summed[0]
