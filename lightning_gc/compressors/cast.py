"""fp16 / bf16 cast: halve the bytes, keep every element.

Like torch's ``fp16_compress_hook``, each rank divides by the world size *before* casting so the
sum cannot overflow fp16's range (max 65504) when many ranks add large gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext
from .workspace import empty_output, scratch

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CastConfig:
    """Options for the cast compressors.

    Attributes:
        dtype: ``"fp16"`` (10-bit mantissa, narrow range) or ``"bf16"`` (7-bit mantissa, fp32
            range). fp16 is more precise for well-scaled gradients; bf16 never overflows.
    """

    dtype: Literal["fp16", "bf16"] = "fp16"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype={self.dtype!r} is not a supported cast: use one of {sorted(_DTYPES)}."
            )


def _widen(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` into a huge-page backed result (cheaper first-touch page faults on CPU)."""
    return empty_output(t.numel(), dtype, t.device).view(t.shape).copy_(t)


class CastCompressor(Compressor):
    """Send every element in 16 bits (2 bytes per element instead of 4).

    Linear, so it travels by allreduce (the sum is accumulated in 16 bits by the backend). Error
    feedback is off by default: the rounding error is tiny and unbiased in practice; switch it on
    with ``error_feedback=True`` for very long runs at low learning rates.
    """

    wire_format = "allreduce"
    default_error_feedback = False
    wire_description = "every gradient element cast to 16 bits"

    def __init__(self, config: CastConfig | None = None) -> None:
        self.config = config or CastConfig()
        self.name = self.config.dtype  # type: ignore[misc]
        self._dtype = _DTYPES[self.config.dtype]

    @property
    def payload_fraction(self) -> float:
        return 0.5

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        # divide into a reused buffer (a fresh group-sized tensor costs more in page faults than
        # the division), then cast: same values as x.div(N).to(dtype)
        tmp = torch.div(x, ctx.world_size, out=scratch("cast.div", x.numel(), x.dtype, x.device).view_as(x))
        return Compressed((tmp.to(self._dtype),), meta=x.dtype)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        return _widen(payload[0], meta).mul_(ctx.world_size)

    def aggregate_summed(self, summed: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        return _widen(summed[0], meta)


class FP16Compressor(CastCompressor):
    name = "fp16"
    wire_description = "every gradient element cast to fp16"

    def __init__(self, config: CastConfig | None = None) -> None:
        super().__init__(config or CastConfig("fp16"))


class BF16Compressor(CastCompressor):
    name = "bf16"
    wire_description = "every gradient element cast to bf16"

    def __init__(self, config: CastConfig | None = None) -> None:
        super().__init__(config or CastConfig("bf16"))
