"""Compressors written out by hand for the tests' oracles (never the library's selection code)."""

from __future__ import annotations

import torch


def topk_keep(p: torch.Tensor, ratio: float) -> torch.Tensor:
    """Dense tensor of p's k largest magnitudes (k = ceil(ratio·n), by ``torch.topk``), zeros elsewhere."""
    k = max(1, int(torch.ceil(torch.tensor(ratio * p.numel())).item()))
    idx = torch.topk(p.abs(), k).indices
    out = torch.zeros_like(p)
    out[idx] = p[idx]
    return out
