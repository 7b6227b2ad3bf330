"""Shared machinery of the sparse (values + int32 indices) formats."""

from __future__ import annotations

import torch
from torch import Tensor

from .workspace import empty_output, scratch


def scatter_sparse(values: Tensor, indices: Tensor, numel: int) -> Tensor:
    """Dense tensor with ``values`` added at ``indices``; duplicates add (``index_add_``)."""
    out = empty_output(numel, values.dtype, values.device).zero_()
    out.index_add_(0, indices.long(), values)
    return out


def gather_sparse_mean(payloads: list[tuple[Tensor, ...]], numel: int, world_size: int) -> Tensor:
    """Mean over ranks of sparse (values, int32 indices) payloads with one ``index_add_``.

    The k·N values are divided by N *before* they are scattered, so no pass over the dense
    result is needed. For a power-of-two N this is exact; otherwise each output element is
    ``Σ_r (v_r / N)`` instead of ``(Σ_r v_r) / N`` — the two differ by at most a few units in
    the last place (one rounding per term instead of one at the end). Every rank runs the same
    operations on the same gathered payloads, so the result is identical on all ranks.
    """
    values = torch.cat([p[0] for p in payloads]).div_(world_size)
    indices = torch.cat([p[1] for p in payloads])
    return scatter_sparse(values, indices, numel)


_SAMPLE = 65536  # elements sampled to estimate the top-k threshold


def topk_indices(x: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest magnitudes of ``x`` — the same selection as ``torch.topk``.

    For large tensors a full ``torch.topk`` dominates compression time on CPUs. Instead, a strided
    sample of ``|x|`` gives a threshold ``t`` a bit *below* the estimated k-th largest magnitude; if
    at least ``k`` elements reach ``t`` then ``t`` is ≤ the true k-th largest, so every true top-k
    element is among those candidates and an exact ``torch.topk`` over the candidates (≈2k of them)
    returns the same selection. If the estimate was too high (fewer than ``k`` candidates) it falls
    back to ``torch.topk`` over everything, so the result is always exact (ties at the k-th
    magnitude may resolve to other indices).
    """
    n = x.numel()
    xf = x.reshape(-1)
    # |x| into a reused buffer: a fresh 44 MB tensor costs ~8 streaming passes in page faults
    a = torch.abs(xf, out=scratch("topk.abs", n, xf.dtype, xf.device))
    if n < 4 * _SAMPLE or k * 8 > n:
        return torch.topk(a, k, sorted=False).indices
    stride = n // _SAMPLE
    sample = a[::stride]
    m = sample.numel()
    # rank of the threshold in the sample: half the expected count of top-k members, so ~2k
    # candidates survive and the estimate is low with overwhelming probability
    j = max(1, int(m * k / n * 2))
    if j >= m:
        return torch.topk(a, k, sorted=False).indices
    t = torch.topk(sample, j, sorted=False).values.min()
    cand = torch.nonzero(a >= t, as_tuple=False).flatten()
    if cand.numel() < k:
        return torch.topk(a, k, sorted=False).indices
    sub = torch.topk(torch.index_select(a, 0, cand), k, sorted=False).indices
    return torch.index_select(cand, 0, sub)
