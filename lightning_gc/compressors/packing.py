"""Bit packing helpers: signs 8 per byte, small unsigned integers 2/4/8/16 bits wide.

Only torch ops are used, so packing runs on the gradients' device (CPU or CUDA). Layouts (the
wire format; tests check them against a plain reference):

* bits: bit ``i`` of byte ``j`` is element ``8j + i``;
* ``width``-bit integers (width 2 or 4): bits ``[w·i, w·(i+1))`` of byte ``j`` hold element
  ``(8/w)·j + i``; width 8 is one byte per element, width 16 two bytes little-endian.

Speed (why the code looks the way it does): nothing is widened to one int64 per element. Signs are
packed eight at a time with one 64-bit multiply per 8 elements (each byte 0/1 in a word; the
product's top byte gathers them), and unpacked with a 256-entry table that spreads a byte into a
word of eight 0/1 bytes — lanes that can be *added* across ranks without carries (counts ≤ 255),
which is how signSGD's vote and EF-signSGD's mean are decoded (see ``sign.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: each part of a packed payload starts at a multiple of this many bytes
_ALIGN = 8

_SHIFTS8 = torch.arange(8, dtype=torch.uint8)
# byte j of the product = bit 7-j ... : (w * _GATHER) >> 56 puts byte i's low bit at bit i
_GATHER = 0x0102040810204080
# _SPREAD[b] has byte i equal to bit i of b
_SPREAD = ((torch.arange(256, dtype=torch.int64).unsqueeze(1) >> torch.arange(8)) & 1).mul(
    torch.tensor([1 << (8 * i) for i in range(8)], dtype=torch.int64)).sum(1)


def _pack_bytes01(b: Tensor) -> Tensor:
    """Pack a uint8 tensor of 0/1 values (numel a multiple of 8, owned by the caller: it is
    overwritten) into bytes, 8 per byte."""
    w = b.view(torch.int64)
    w.mul_(_GATHER).bitwise_right_shift_(56).bitwise_and_(0xFF)
    return w.to(torch.uint8)


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a 1-D bool tensor into uint8, 8 per byte (bit i of byte j = element 8j+i)."""
    n = bits.numel()
    b = bits.reshape(-1).to(torch.uint8)  # a copy: packing works in place on it
    if b.data_ptr() == bits.data_ptr():
        b = b.clone()
    pad = (-n) % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return _pack_bytes01(b)


def pack_ge_zero(x: Tensor, work: Tensor | None = None) -> Tensor:
    """``pack_bits(x >= 0)`` without the bool→uint8 copy; ``work`` (uint8, ≥ ``ceil(n/8)·8``
    elements, overwritten) avoids allocating the comparison result."""
    n = x.numel()
    m = (n + 7) // 8 * 8
    b = work[:m] if work is not None else torch.empty(m, dtype=torch.uint8, device=x.device)
    torch.ge(x.reshape(-1), 0, out=b[:n].view(torch.bool))
    if m != n:
        b[n:].zero_()
    return _pack_bytes01(b)


def spread_bits(packed: Tensor) -> Tensor:
    """int64 words, one per packed byte, whose byte ``i`` is bit ``i`` of that byte (0 or 1).

    Viewed as uint8 this is the unpacked 0/1 sequence; as words, tensors from several ranks can be
    summed (or shifted and summed) lane-wise as long as every lane stays below 256.
    """
    table = _SPREAD.to(packed.device)
    return torch.index_select(table, 0, packed.reshape(-1).to(torch.int32))


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: bool tensor of ``n`` elements."""
    return spread_bits(packed).view(torch.uint8)[:n].view(torch.bool)


def uint_width(max_value: int) -> int:
    """Smallest width in {2, 4, 8, 16} bits that holds integers 0..max_value."""
    for w in (2, 4, 8, 16):
        if max_value < (1 << w):
            return w
    raise ValueError(f"max_value={max_value} does not fit in 16 bits")


_WORD = {2: torch.int16, 4: torch.int32}  # codes per byte -> word holding that many bytes


def pack_uint8_codes(codes: Tensor, width: int) -> Tensor:
    """Pack uint8 codes ``< 2**width`` (width 2, 4 or 8) into bytes; no wider intermediates.

    The ``8/width`` codes of one output byte are adjacent bytes, read as one 16/32-bit word and
    merged with shifts and masks (a handful of passes over ``n`` bytes).
    """
    if width == 8:
        return codes.reshape(-1).clone()
    per = 8 // width
    n = codes.numel()
    pad = (-n) % per
    v = codes.reshape(-1)
    if pad or v.storage_offset() % per:
        v = torch.cat([v, v.new_zeros(pad)])
    w = v.view(_WORD[per])
    mask = (1 << width) - 1
    acc = w & mask
    for i in range(1, per):
        acc.bitwise_or_((w >> (8 * i - width * i)).bitwise_and_(mask << (width * i)))
    return acc.to(torch.uint8)


def pack_uint(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers < 2**width (width in 2, 4, 8, 16) into a uint8 tensor."""
    if width == 16:
        v = values.reshape(-1)
        if v.dtype != torch.int16:
            v = v.to(torch.int32).to(torch.int16)  # 0..65535 wraps into int16's bit pattern
        return v.contiguous().view(torch.uint8)
    return pack_uint8_codes(values.reshape(-1).to(torch.uint8), width)


def unpack_uint8_codes(packed: Tensor, width: int, n: int) -> Tensor:
    """Inverse of :func:`pack_uint8_codes`: uint8 tensor of ``n`` codes (a fresh tensor)."""
    if width == 8:
        return packed[:n].clone()
    per = 8 // width
    mask = (1 << width) - 1
    w = packed.reshape(-1).to(_WORD[per])
    acc = w & mask
    for i in range(1, per):
        acc.bitwise_or_((w & (mask << (width * i))).bitwise_left_shift_(8 * i - width * i))
    return acc.view(torch.uint8)[:n]


def unpack_uint(packed: Tensor, width: int, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Inverse of :func:`pack_uint`: tensor of ``n`` elements of ``dtype`` (default int64)."""
    if width == 16:
        return (packed.view(torch.int16)[:n].to(torch.int32) & 0xFFFF).to(dtype)
    return unpack_uint8_codes(packed, width, n).to(dtype)


def packed_uint_nbytes(n: int, width: int) -> int:
    if width >= 8:
        return n * (width // 8)
    per = 8 // width
    return (n + per - 1) // per


# ------------------------------------------------------------------------------------------
# a payload (a tuple of tensors) as one byte buffer: what the allgather exchange moves


def pack_payload(tensors: tuple[Tensor, ...]) -> Tensor:
    """Concatenate tensors into one uint8 buffer, each part padded to 8-byte alignment.

    Each part is copied once, straight into its slot of the buffer (no intermediate list of
    byte views and padding tensors for ``torch.cat``); padding bytes are zero.
    """
    sizes = [t.numel() * t.element_size() for t in tensors]
    total = sum(n + (-n) % _ALIGN for n in sizes)
    device = tensors[0].device if tensors else torch.device("cpu")
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    off = 0
    for t, n in zip(tensors, sizes):
        if n:
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
        pad = (-n) % _ALIGN
        if pad:
            buf[off + n:off + n + pad].zero_()
        off += n + pad
    return buf


def unpack_payload(buf: Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[Tensor, ...]:
    """Inverse of :func:`pack_payload` given each part's shape and dtype."""
    out = []
    off = 0
    for shape, dtype in specs:
        nbytes = _part_nbytes(shape, dtype)
        out.append(buf[off:off + nbytes].view(dtype).reshape(shape))
        off += nbytes + (-nbytes) % _ALIGN
    return tuple(out)


def packed_nbytes(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(n + (-n) % _ALIGN for n in (_part_nbytes(shape, dtype) for shape, dtype in specs))


def _part_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
