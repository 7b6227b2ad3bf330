"""PGP importance (OSP §4.1.1, Eq. 4) and the ranked per-layer split.

The importance of layer ``l`` is ``I_l = Σ_j |g_j · p_j|`` over its elements: a first-order
estimate of how much the loss changes if the layer's parameters were removed. OSP computes it from
the *previous* step so that the split is known before the next backward starts. Here every input
is replicated — the aggregated (global) gradient and the parameters before the update — so every
rank computes the same numbers from the same bits and arrives at the same split without exchanging
it. A "layer" is one parameter tensor (a weight and its bias rank separately).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def layer_importance(grad: Tensor, param: Tensor) -> float:
    """``Σ|g ⊙ p|`` in float64 (deterministic for identical inputs on identical hardware)."""
    return float(torch.sum(torch.abs(grad.detach().double() * param.detach().double())))


def rank_split(importance: Sequence[float], numels: Sequence[int], budget: int) -> tuple[frozenset[int], float]:
    """Choose the deferred (ICS) layers: least important first, while their sizes fit ``budget``.

    Layers are visited in ascending importance (ties: lower index first, so the order is total and
    identical on every rank); a layer joins the deferred set if it still fits the element budget,
    otherwise it is skipped and smaller, more important layers may still fit (the budget is a
    bound, as in the paper's ``S(Gu) ≤ Umax``). Non-finite importances rank as most important.

    Returns ``(deferred layer ids, threshold)`` where ``threshold`` is the largest importance that
    was deferred (``-1.0`` if none): every routine layer scoring below it was too large to fit.
    """
    if len(importance) != len(numels):
        raise ValueError(f"{len(importance)} importances for {len(numels)} layers: give one per layer")
    if budget <= 0:
        return frozenset(), -1.0

    def key(i: int) -> tuple[float, int]:
        v = float(importance[i])
        return (v if v == v and v != float("inf") else float("inf"), i)

    chosen: list[int] = []
    used = 0
    threshold = -1.0
    for i in sorted(range(len(numels)), key=key):
        if used + numels[i] <= budget:
            chosen.append(i)
            used += numels[i]
            threshold = max(threshold, key(i)[0])
    return frozenset(chosen), threshold
