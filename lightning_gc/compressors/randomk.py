"""RandomK: k elements at random positions shared by every rank; only values travel.

Because every rank picks the *same* k positions (drawn from a generator seeded by
``(seed, step, group)``), the values are summable and travel by allreduce — 4 bytes per kept
element and no indices, half of TopK's 8. With ``unbiased=True`` (default) the kept values are
scaled by ``n/k`` so the estimate is unbiased: E[ĝ] = g. That multiplies the variance by ``n/k``;
use it without error feedback. With ``unbiased=False`` and error feedback on, RandomK behaves like
a slowly rotating exact sync (every element is sent every ``n/k`` steps on average).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._validation import check_bool
from .base import Compressed, Compressor, GroupContext, ratio_to_k, validate_ratio
from .sparse import scatter_sparse


@dataclass(frozen=True)
class RandomKConfig:
    """Attributes:
    ratio: fraction of elements kept, in (0, 1].
    unbiased: scale kept values by n/k so the estimator is unbiased.
    """

    ratio: float = 0.01
    unbiased: bool = True

    def __post_init__(self) -> None:
        validate_ratio(self.ratio, "randomk")
        check_bool("unbiased", self.unbiased, "unbiased=True scales kept values by n/k.")


class RandomKCompressor(Compressor):
    name = "randomk"
    wire_format = "allreduce"
    default_error_feedback = False
    wire_description = "k values at positions every rank draws identically (no indices)"

    def __init__(self, config: RandomKConfig | None = None) -> None:
        self.config = config or RandomKConfig()

    @property
    def ratio(self) -> float:
        return self.config.ratio

    def indices(self, ctx: GroupContext) -> Tensor:
        n = ctx.numel
        k = ratio_to_k(self.config.ratio, n)
        return torch.randperm(n, generator=ctx.shared_generator(), device=ctx.device)[:k]

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        idx = self.indices(ctx)
        values = x[idx]
        if self.config.unbiased:
            values = values * (x.numel() / idx.numel())
        return Compressed((values,), meta=idx)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        return scatter_sparse(payload[0], meta, ctx.numel)
