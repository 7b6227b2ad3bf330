"""Low-bit allreduce: k-bit blocks with their own fp32 scale, stochastic rounding, fp32 partial sums.

Why it exists. Allgather codecs (QSGD, signs, Top-k values + indices) send every rank's payload to
every rank, so the bytes each rank receives grow with the number of ranks N. A quantised payload
cannot simply be summed either (each rank's blocks have their own scales). ``lowbit`` keeps the
bytes of a ring allreduce, ``2(N−1)/N`` of the message per rank, by reducing *along* the ring:

* the group is cut into blocks of ``block_size`` elements; a block travels as one fp32 scale
  ``s = max|v|/L`` (``L = 2^(k−1) − 1``: 7 for 4 bits, 127 for 8) and one ``k``-bit code per
  element, ``q + L`` with ``q = floor(v/s + u)``, ``u`` uniform in [0, 1) (stochastic rounding:
  ``E[q·s] = v``); 4-bit codes are packed two per byte;
* ring reduce-scatter: at every hop a rank dequantises the chunk it receives, adds its own fp32
  values in fp32, and requantises only what it sends on (the partial sum is never summed in the
  quantised domain);
* the owner of each fully reduced chunk quantises the mean once more and a ring allgather passes
  those k-bit chunks around unchanged; every rank (the owner too) decodes the same bytes, so the
  result is bit-identical on all ranks.

Error. One quantisation of a block with scale ``s`` moves each element by less than ``s``
(``|D(Q(v)) − v| < s = max|v|/L``), with mean 0 and variance ≤ ``s²/4``. A chunk is quantised
N times on its way (N − 1 reduce-scatter hops on partial sums, and the mean at the owner), so the
result differs from the exact mean by less than ``(Σ_{h<N} s_h)/N + s_N`` per element, where
``s_h`` is the scale of the element's block at hop h (the partial sums grow, so later hops have
larger scales), and it is unbiased: ``E[result] = mean`` because each rounding is unbiased given
what it rounds (tower rule). The variance grows about linearly with N relative to the mean's.

Randomness. The dither of rank r at hop h (h = 1 … N−1 on the reduce-scatter, h = N for the
owner's final quantisation) is drawn from ``GroupContext.private_generator(salt=h)``, a pure
function of (seed, step, group, hop, rank): a resumed run draws the same numbers, and no two hops
or ranks share a draw. The global RNG is never touched. The dither takes 2^15 values
(:func:`dither_words`), so "unbiased" holds up to 2^−15 of a rounding step.

Error feedback (off by default: the estimator is unbiased). With ``error_feedback=True`` on the
strategy, each rank keeps the quantisation errors *it* made (at its hops, and ×N for the final
one, in sum units): the ranks' errors add up to exactly ``Σ_r p_r − N·result``, so the next step
re-sends what this step lost. The exchange reports ``sent = p − (errors of this rank)``.

Tuning. ``bits=4`` sends ≈ ``2(N−1)/N · (0.5 + 4/block_size)`` bytes per element and rank (1/8 of
fp32 DDP's bytes plus the scales); ``bits=8`` twice the codes, with 18× less rounding noise per
hop. ``block_size`` trades the scales' bytes (4 per block) against noise: a smaller block has a
smaller ``max|v|`` and so a finer step. See docs/lowbit.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .base import Compressed, Compressor, GroupContext
from .packing import pack_uint8_codes

__all__ = ["LowBitConfig", "LowBitCompressor", "decode_blocks", "ring_error_factor", "dither_words", "encode_blocks", "levels_of",
           "message_bytes"]

_BITS = (4, 8)


@dataclass(frozen=True)
class LowBitConfig:
    """Attributes:
    bits: k, bits per element on the wire: 4 (two codes per byte, 15 levels) or 8 (255 levels).
    block_size: elements sharing one fp32 scale (even, 2 … 2^20); 128 adds 0.25 bit per element.
    """

    bits: int = 4
    block_size: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in _BITS:
            raise ValueError(
                f"bits={self.bits!r} is invalid: the low-bit allreduce packs codes of 4 bits (two per byte) or "
                "8 bits (one per byte); other widths do not pack into whole bytes per block. Use bits=4 (fewest "
                "bytes) or bits=8 (finer rounding)."
            )
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 2 or b > (1 << 20) or b % 2:
            raise ValueError(
                f"block_size={b!r} is invalid: it is the number of elements sharing one fp32 scale and must be an "
                "even integer in [2, 1048576] (two 4-bit codes share a byte). Use 128."
            )


def levels_of(bits: int) -> int:
    """L, the largest level magnitude: codes ``q + L`` span ``2L + 1 ≤ 2^bits`` values."""
    return (1 << (bits - 1)) - 1


def ring_error_factor(world_size: int) -> float:
    """Variance of the ring's mean error in units of one rounding of one rank's gradient, when the
    ranks' gradients are equal (the worst case: the partial sum after h ranks is h·g, so hop h rounds
    with h times the step): ``Σ_{h<N} h²/N² + 1 = (N−1)(2N−1)/(6N) + 1``. Independent gradients of
    equal size give about ``(N−1)/(2N) + 1/N``. The worst case grows linearly with N: the price of
    requantising partial sums (docs/lowbit.md); an allgather of the same codes averages N
    independent roundings instead (variance ``1/N``)."""
    n = max(int(world_size), 1)
    return (n - 1) * (2 * n - 1) / (6 * n) + 1.0


def message_bytes(blocks: int, block_size: int, bits: int) -> int:
    """Bytes of one message of ``blocks`` blocks: an fp32 scale per block, then the packed codes."""
    return blocks * 4 + blocks * block_size * bits // 8


def dither_words(numel: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """The dither's raw draws: ``numel`` int16 values uniform on 0 … 32767, four per int64 word of
    ``random_`` masked to 15 bits (``random_`` leaves the word's top bit 0, so the fourth lane's own
    top bit would be biased). The dither is ``u = (r + 0.5)·2^−15``, uniform on 2^15 points of (0, 1)."""
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
    words.random_(generator=generator)
    return words.view(torch.int16)[:numel].bitwise_and_(0x7FFF)


_U_ONE = float(1 << 15)


def encode_blocks(v: Tensor, bits: int, generator: torch.Generator, msg: Tensor, dq: Tensor | None = None) -> None:
    """Quantise the fp32 blocks ``v`` (shape ``(b, block_size)``) into the uint8 message ``msg``.

    ``msg`` must hold :func:`message_bytes` bytes: ``b`` fp32 scales (native byte order), then
    the codes. ``dq`` (optional, like ``v``) receives the dequantised values ``q·s``.
    ``q = floor(v/s + u)`` with the dither ``u`` of :func:`dither_words` (row-major order), computed
    as ``floor((r + v·2^15/s + 0.5)·2^−15)``: one int16 draw per element, no float ``rand``
    (several times slower on CPU). The dither's resolution, 2^−15 of a step, is the only bias.
    """
    L = levels_of(bits)
    b = v.shape[0]
    scale = v.abs().amax(dim=1).div_(L) if v.numel() else v.new_zeros(b)
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)).mul_(_U_ONE)
    t = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    t.view(-1).copy_(dither_words(v.numel(), generator, v.device))
    t.addcmul_(v, inv.unsqueeze(1)).add_(0.5).mul_(1.0 / _U_ONE)
    t.floor_().clamp_(-L, L)  # the clamp only catches ulps at ±max
    if dq is not None:
        torch.mul(t, scale.unsqueeze(1), out=dq)
    msg[: 4 * b].copy_(scale.view(torch.uint8))
    codes = t.add_(L).to(torch.uint8)
    msg[4 * b:].copy_(pack_uint8_codes(codes.view(-1), bits))


_TABLES: dict[tuple[str, int], Tensor] = {}


def _nibble_table(device: torch.device, L: int) -> Tensor:
    """Row ``byte`` = the two levels (low nibble first) of a packed byte, minus L, as fp32."""
    key = (str(device), L)
    tab = _TABLES.get(key)
    if tab is None:
        byte = torch.arange(256, device=device)
        tab = torch.stack([byte & 0xF, byte >> 4], dim=1).float().sub_(L).contiguous()
        _TABLES[key] = tab
    return tab


def decode_blocks(msg: Tensor, blocks: int, block_size: int, bits: int, out: Tensor, add: Tensor | None = None) -> None:
    """``out = q·s`` (+ ``add``, fp32, in one pass) for a message of ``blocks`` blocks; ``out`` and
    ``add`` have shape ``(blocks, block_size)`` (``add`` may be ``out`` itself: accumulate in place)."""
    L = levels_of(bits)
    head = msg[: 4 * blocks]
    scale = (head if head.storage_offset() % 4 == 0 else head.clone()).view(torch.float32)
    codes = msg[4 * blocks:]
    if bits == 8:
        levels = codes.to(torch.float32).sub_(L)
    else:
        idx = codes.to(torch.int64)
        pairs = torch.index_select(_nibble_table(msg.device, L).view(torch.int64).view(-1), 0, idx)
        levels = pairs.view(torch.float32)
    levels = levels.view(blocks, block_size)
    if add is None:
        torch.mul(levels, scale.unsqueeze(1), out=out)
    else:
        torch.addcmul(add, levels, scale.unsqueeze(1), out=out)


class LowBitCompressor(Compressor):
    """Local half of the low-bit allreduce: the block codec and its per-hop generators.

    The ring (reduce-scatter with dequantise-accumulate-requantise at every hop, then the k-bit
    allgather) is the ``lowbit`` exchange, :mod:`lightning_gc.exchanges.lowbit`. ``compress`` /
    ``decompress`` quantise a whole group once (hop 1): what auto's error measurement and the codec
    benchmark read.
    """

    name = "lowbit"
    wire_format = "lowbit"
    wire_description = ("k-bit codes with an fp32 scale per block, reduced hop by hop along a ring in fp32 "
                        "and gathered in k bits")
    default_error_feedback = False  # unbiased rounding; error feedback is an option, see docs/lowbit.md

    def __init__(self, config: LowBitConfig | None = None) -> None:
        self.config = config or LowBitConfig()

    @property
    def bits(self) -> int:
        return self.config.bits

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def payload_fraction(self) -> float:
        return (self.bits / 8 + 4 / self.block_size) / 4

    def blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    def generator(self, ctx: GroupContext, hop: int) -> torch.Generator:
        """The dither of rank ``ctx.rank`` at ``hop`` (1 … N): (seed, step, group, hop, rank)."""
        return ctx.private_generator(salt=hop)

    def padded(self, x: Tensor) -> Tensor:
        """``x`` as fp32 blocks ``(blocks, block_size)``, zero-padded at the end (a fresh tensor)."""
        n = x.numel()
        out = torch.zeros(self.blocks(n) * self.block_size, dtype=torch.float32, device=x.device)
        out[:n].copy_(x.reshape(-1))
        return out.view(-1, self.block_size)

    def compress(self, x: Tensor, ctx: GroupContext) -> Compressed:
        v = self.padded(x)
        msg = torch.empty(message_bytes(v.shape[0], self.block_size, self.bits), dtype=torch.uint8, device=x.device)
        encode_blocks(v, self.bits, self.generator(ctx, 1), msg)
        return Compressed((msg,), meta=x.dtype)

    def decompress(self, payload: tuple[Tensor, ...], meta: Any, ctx: GroupContext) -> Tensor:
        b = self.blocks(ctx.numel)
        out = torch.empty(b, self.block_size, dtype=torch.float32, device=payload[0].device)
        decode_blocks(payload[0], b, self.block_size, self.bits, out)
        dtype = meta if isinstance(meta, torch.dtype) else torch.float32
        return out.view(-1)[: ctx.numel].to(dtype)

    def payload_specs(self, ctx: GroupContext, dtype: torch.dtype):
        return [((message_bytes(self.blocks(ctx.numel), self.block_size, self.bits),), torch.uint8)]

    def describe(self) -> str:
        return f"{self.name}(bits={self.bits},block_size={self.block_size})"
