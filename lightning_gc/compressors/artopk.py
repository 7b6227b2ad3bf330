"""AR-Topk: Top-k made allreduce-friendly (Tyagi & Swany 2023, §3-A/B).

Every rank computes the top-k indices of its own error-fed gradient, but only one *source* rank's
indices are used: the source broadcasts its k int32 indices, every rank contributes its own values
at those positions, and the values are summed by an allreduce (native, P2P ring or P2P tree) and
divided by N. Error feedback runs on every rank at every coordinate: a rank keeps as residual
everything it did not send — including, on non-source ranks, its own large elements the source did
not pick.

Source selection:

``star`` (staleness-based): source = step mod N — round-robin, every rank leads once every N steps.
``var`` (variance-based): source = the rank whose local top-k values carry the most energy
    ‖g_r[topk_r]‖² (gathered with one allgather of N floats). Ties go to the lowest rank.
    ``var_smoothing`` β ∈ [0, 1) smooths each rank's energy over steps,
    ``s_r ← β·s_r + (1−β)·‖g_r[topk_r]‖²`` (its state is replicated: every rank keeps the
    gathered smoothed vector of all ranks); 0 (default) uses the current step alone.

Bytes per rank and step: the source sends 4k bytes of indices (broadcast), then the values travel
by allreduce: ≈ 2(N−1)/N · 4k (ring) — independent of N, unlike Top-k's allgather (N−1)·8k.

``artopk_auto`` uses STAR selection and picks, per group and step, whichever of plain Top-k
allgather (AG), AR-Topk over a P2P ring (ART-Ring) or over a P2P tree (ART-Tree) the alpha-beta
model predicts fastest with the measured (or pinned) α and β (docs/cost_model.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .base import Compressed, GroupContext, validate_ratio
from .sparse import topk_indices
from .topk import SparseCompressor


@dataclass(frozen=True)
class ARTopKConfig:
    """Attributes:
    ratio: fraction of elements kept, in (0, 1].
    selection: ``"star"`` (round-robin source) or ``"var"`` (largest local top-k energy).
    var_smoothing: EWMA factor β ∈ [0, 1) for VAR's per-rank energy (0 = this step only).
    """

    ratio: float = 0.01
    selection: Literal["star", "var"] = "star"
    var_smoothing: float = 0.0

    def __post_init__(self) -> None:
        validate_ratio(self.ratio, "AR-Topk")
        if self.selection not in ("star", "var"):
            raise ValueError(f"selection={self.selection!r} is invalid: use 'star' or 'var'.")
        if not isinstance(self.var_smoothing, (int, float)) or not (0.0 <= self.var_smoothing < 1.0):
            raise ValueError(f"var_smoothing={self.var_smoothing!r} must lie in [0, 1); use 0 for none.")


class ARTopKCompressor(SparseCompressor):
    """Local top-k selection; the exchange decides whose indices are used."""

    name = "star_topk"
    wire_format = "artopk"
    wire_description = "k values at the indices one source rank broadcasts each step"

    def __init__(self, config: ARTopKConfig | None = None) -> None:
        self.config = config or ARTopKConfig()

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        idx = topk_indices(x, self.num_kept(ctx))
        # index_select, not x[idx]: advanced indexing is ~10× slower on CPU for 1e5 indices
        return Compressed((torch.index_select(x.reshape(-1), 0, idx), idx.to(torch.int32)))


class STARTopKCompressor(ARTopKCompressor):
    name = "star_topk"

    def __init__(self, config: ARTopKConfig | None = None) -> None:
        super().__init__(config or ARTopKConfig(selection="star"))


class VARTopKCompressor(ARTopKCompressor):
    name = "var_topk"

    def __init__(self, config: ARTopKConfig | None = None) -> None:
        super().__init__(config or ARTopKConfig(selection="var"))


class AutoARTopKCompressor(ARTopKCompressor):
    """STAR AR-Topk whose collective (AG / ART-Ring / ART-Tree) is chosen by the cost model."""

    name = "artopk_auto"
    wire_format = "artopk_auto"

    def __init__(self, config: ARTopKConfig | None = None) -> None:
        super().__init__(config or ARTopKConfig(selection="star"))


def select_source(selection: str, ctx: GroupContext, energies: Any = None) -> int:
    """Rank whose indices are used: STAR = step mod N; VAR = argmax of energies (lowest rank on ties)."""
    if selection == "star":
        return ctx.step % ctx.world_size
    e = torch.as_tensor(energies, dtype=torch.float64)
    best = float(e.max())
    return int(torch.nonzero(e == best, as_tuple=False)[0])
