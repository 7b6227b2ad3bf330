"""LWTopK: layer-wise Top-k — the k largest magnitudes of *each* parameter tensor in the group.

Every layer keeps ``k_l = max(1, ceil(ratio·n_l))`` elements, so small layers are never starved
by large ones (global Top-k may send nothing of a bias for many steps). Sends 8 bytes per kept
element like TopK; because of the per-layer ``max(1, ·)`` it keeps slightly more than ``ratio·n``.
Travels by allgather; indices are positions in the flat group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Compressed, GroupContext, ratio_to_k, validate_ratio
from .sparse import topk_indices
from .topk import SparseCompressor


@dataclass(frozen=True)
class LWTopKConfig:
    """Attributes:
    ratio: fraction of each layer's elements kept, in (0, 1].
    """

    ratio: float = 0.01

    def __post_init__(self) -> None:
        validate_ratio(self.ratio, "lwtopk")


class LWTopKCompressor(SparseCompressor):
    name = "lwtopk"

    def __init__(self, config: LWTopKConfig | None = None) -> None:
        self.config = config or LWTopKConfig()

    def num_kept(self, ctx: GroupContext) -> int:
        return sum(ratio_to_k(self.ratio, n) for n in ctx.segments if n > 0)

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        values, indices = [], []
        offset = 0
        for n in ctx.segments:
            if n == 0:
                continue
            seg = x[offset:offset + n]
            idx = topk_indices(seg, ratio_to_k(self.ratio, n))
            values.append(torch.index_select(seg, 0, idx))
            indices.append(idx + offset)
            offset += n
        return Compressed((torch.cat(values), torch.cat(indices).to(torch.int32)))
