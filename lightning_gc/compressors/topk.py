"""TopK: keep the k largest-magnitude elements of the whole group.

Sends k fp32 values + k int32 indices = 8 bytes per kept element, i.e. ``8·ratio`` bytes per
gradient element against dense's 4. Travels by allgather with the same k on every rank, so no
size exchange is needed. With error feedback (on by default) what is not sent now is added to the
next step's gradient, which is what keeps ratios of 0.01–0.001 converging.

Tuning: ratio 0.01 is a good start for MLPs/CNNs; below 0.001 convergence usually needs a dense
warm-up (``warmup_steps``) and more steps. The allgather costs ``(N−1)·8·k`` bytes per rank, which
grows with the world size: past a few dozen ranks prefer an allreduce-friendly variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext, ratio_to_k, validate_ratio
from .sparse import gather_sparse_mean, scatter_sparse, topk_indices


@dataclass(frozen=True)
class TopKConfig:
    """Attributes:
    ratio: fraction of elements kept, in (0, 1]; ``k = max(1, ceil(ratio·n))``.
    """

    ratio: float = 0.01

    def __post_init__(self) -> None:
        validate_ratio(self.ratio, "topk")


class SparseCompressor(Compressor):
    """Common decompress/aggregate for formats whose payload is (values, int32 indices).

    ``sends_exact_subset``: the payload values are exactly the input at the indices, so error
    feedback can zero those positions in place instead of subtracting a dense tensor.
    """

    wire_format = "allgather"
    default_error_feedback = True
    sends_exact_subset = True
    wire_description = "k selected values with their int32 indices, different on every rank"

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        return scatter_sparse(payload[0], payload[1], ctx.numel)

    def aggregate_gathered(self, payloads: list[tuple[Tensor, ...]], meta: Any, ctx: GroupContext) -> Tensor:
        return gather_sparse_mean(payloads, ctx.numel, ctx.world_size)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        k = self.num_kept(ctx)
        return [((k,), dtype), ((k,), torch.int32)]

    def num_kept(self, ctx: GroupContext) -> int:
        return ratio_to_k(self.ratio, ctx.numel)


class TopKCompressor(SparseCompressor):
    name = "topk"
    adam_error_feedback = False  # see docs/compressors.md, "Error feedback under Adam"

    def __init__(self, config: TopKConfig | None = None) -> None:
        self.config = config or TopKConfig()

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        idx = topk_indices(x, self.num_kept(ctx))
        # index_select, not x[idx]: advanced indexing is ~10× slower on CPU for 1e5 indices
        return Compressed((torch.index_select(x.reshape(-1), 0, idx), idx.to(torch.int32)))
