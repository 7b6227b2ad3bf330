"""MSTopK: Top-k by threshold binary search — no sort, exactly k elements.

``torch.topk`` on tens of millions of elements is slow on some devices; MSTopK (multiple-sampling
Top-k) instead bisects a magnitude threshold for ``search_rounds`` rounds keeping the invariant
``count(|x| ≥ lo) ≥ k > count(|x| ≥ hi)``, takes every element ``≥ hi`` and fills up to *exactly*
k with elements in ``[lo, hi)`` in index order. Exactly k matters: the allgather that follows uses
a fixed size, and public implementations whose k differs by one across ranks deadlock there.

The selected set may differ from true Top-k only among elements within ``(hi − lo)`` of the k-th
magnitude, which after 25 rounds is ``max|x|·2⁻²⁵``. Sends 8 bytes per kept element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Compressed, GroupContext, validate_ratio
from .topk import SparseCompressor
from .workspace import scratch


@dataclass(frozen=True)
class MSTopKConfig:
    """Attributes:
    ratio: fraction of elements kept, in (0, 1].
    search_rounds: bisection rounds (each one pass over the group); 20–30 is plenty.
    """

    ratio: float = 0.01
    search_rounds: int = 25

    def __post_init__(self) -> None:
        validate_ratio(self.ratio, "mstopk")
        if isinstance(self.search_rounds, bool) or not isinstance(self.search_rounds, int) or self.search_rounds < 1:
            raise ValueError(
                f"search_rounds={self.search_rounds!r} must be a positive integer (bisection rounds); "
                "use 25."
            )


def threshold_topk_indices(x: Tensor, k: int, rounds: int) -> Tensor:
    """Indices of exactly ``k`` large-magnitude elements found by threshold bisection.

    On CPU the bisection counts only the elements still inside the bracket ``[lo, hi)`` (plus a
    running count of those ``≥ hi``), so after the first rounds each round touches a small
    fraction of the group; the thresholds, and therefore the selection, are exactly those of
    counting over the whole tensor every round. On accelerators every round counts over the
    whole tensor without a host synchronisation.
    """
    xf = x.reshape(-1)
    if xf.dtype not in (torch.float32, torch.float64):
        xf = xf.float()
    a = torch.abs(xf, out=scratch("mstopk.abs", xf.numel(), xf.dtype, xf.device))
    lo = torch.zeros((), dtype=a.dtype, device=a.device)
    hi = torch.nextafter(a.max(), torch.tensor(float("inf"), dtype=a.dtype, device=a.device))
    if a.device.type == "cpu":
        # inside holds every element in [lo, hi) and possibly some ≥ hi (``extra`` of them, all
        # also counted in ``above`` = count(|x| ≥ hi)); it is only copied when lo rises
        inside = a
        above = 0
        extra = 0
        for _ in range(rounds):
            mid = (lo + hi) / 2
            upper = inside >= mid
            in_upper = int(torch.count_nonzero(upper))  # (a bool .sum() widens to int64 first)
            c = above + in_upper - extra  # = count(|x| ≥ mid)
            if c >= k:
                lo = mid
                inside = inside[upper]
            else:
                hi, above, extra = mid, c, in_upper
    else:
        for _ in range(rounds):
            mid = (lo + hi) / 2
            enough = (a >= mid).sum() >= k
            lo = torch.where(enough, mid, lo)
            hi = torch.where(enough, hi, mid)
    # every element ≥ hi, then the first (in index order) of those in [lo, hi) up to exactly k:
    # one pass for the candidates ≥ lo (≥ k of them, few more after enough rounds), then small work
    cand = torch.nonzero(a >= lo, as_tuple=False).flatten()
    vals = torch.index_select(a, 0, cand)
    top = vals >= hi
    sure = cand[top]
    fill = cand[~top][:k - sure.numel()]
    return torch.cat([sure, fill])


class MSTopKCompressor(SparseCompressor):
    name = "mstopk"

    def __init__(self, config: MSTopKConfig | None = None) -> None:
        self.config = config or MSTopKConfig()

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        idx = threshold_topk_indices(x, self.num_kept(ctx), self.config.search_rounds)
        # index_select, not x[idx]: advanced indexing is ~10× slower on CPU for 1e5 indices
        return Compressed((torch.index_select(x.reshape(-1), 0, idx), idx.to(torch.int32)))
