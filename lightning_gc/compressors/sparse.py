"""Shared machinery of the sparse (values + int32 indices) formats."""

from __future__ import annotations

import torch
from torch import Tensor


def scatter_sparse(values: Tensor, indices: Tensor, numel: int) -> Tensor:
    """Dense tensor with ``values`` added at ``indices``; duplicates add (``index_add_``)."""
    out = values.new_zeros(numel)
    out.index_add_(0, indices.long(), values)
    return out


def gather_sparse_mean(payloads: list[tuple[Tensor, ...]], numel: int, world_size: int) -> Tensor:
    """Mean over ranks of sparse (values, int32 indices) payloads with one ``index_add_``."""
    values = torch.cat([p[0] for p in payloads])
    indices = torch.cat([p[1] for p in payloads])
    return scatter_sparse(values, indices, numel).div_(world_size)
