"""Bit packing helpers: signs 8 per byte, small unsigned integers 2/4/8/16 bits wide.

Only torch ops are used, so packing runs on the gradients' device (CPU or CUDA).
"""

from __future__ import annotations

import torch
from torch import Tensor

_SHIFTS8 = torch.arange(8, dtype=torch.uint8)


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a 1-D bool tensor into uint8, 8 per byte (bit i of byte j = element 8j+i)."""
    n = bits.numel()
    pad = (-n) % 8
    b = bits.to(torch.uint8)
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    b = b.view(-1, 8) << _SHIFTS8.to(b.device)
    return b.sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: bool tensor of ``n`` elements."""
    bits = (packed.unsqueeze(1) >> _SHIFTS8.to(packed.device)) & 1
    return bits.reshape(-1)[:n].bool()


def uint_width(max_value: int) -> int:
    """Smallest width in {2, 4, 8, 16} bits that holds integers 0..max_value."""
    for w in (2, 4, 8, 16):
        if max_value < (1 << w):
            return w
    raise ValueError(f"max_value={max_value} does not fit in 16 bits")


def pack_uint(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers < 2**width (width in 2, 4, 8, 16) into a uint8 tensor."""
    if width == 16:
        return values.to(torch.int16).view(torch.uint8) if values.dtype != torch.int16 else values.view(torch.uint8)
    if width == 8:
        return values.to(torch.uint8)
    per = 8 // width
    n = values.numel()
    pad = (-n) % per
    v = values.to(torch.uint8)
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    shifts = (torch.arange(per, dtype=torch.uint8, device=v.device) * width)
    return (v.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_uint(packed: Tensor, width: int, n: int) -> Tensor:
    """Inverse of :func:`pack_uint`: int64 tensor of ``n`` elements."""
    if width == 16:
        return packed.view(torch.int16)[:n].to(torch.int64) & 0xFFFF
    if width == 8:
        return packed[:n].to(torch.int64)
    per = 8 // width
    shifts = (torch.arange(per, dtype=torch.uint8, device=packed.device) * width)
    mask = (1 << width) - 1
    vals = (packed.unsqueeze(1) >> shifts) & mask
    return vals.reshape(-1)[:n].to(torch.int64)


def packed_uint_nbytes(n: int, width: int) -> int:
    if width >= 8:
        return n * (width // 8)
    per = 8 // width
    return (n + per - 1) // per
