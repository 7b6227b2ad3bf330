"""Oracles for the fast codec paths: wire layouts against plain reference implementations written
here (loops over Python ints, no code under test), decode-into-accumulator against the mean of
reference decodes, and exact equivalence of the narrowed MSTopK bisection with the full one."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gc.comm.collectives import pack_payload, packed_nbytes, unpack_payload
from lightning_gc.compressors import GroupContext, build_compressor
from lightning_gc.compressors.mstopk import threshold_topk_indices
from lightning_gc.compressors.packing import (
    pack_bits,
    pack_ge_zero,
    pack_uint,
    pack_uint8_codes,
    spread_bits,
    unpack_bits,
    unpack_uint,
    unpack_uint8_codes,
)


def ref_pack_bits(bits: list[int]) -> list[int]:
    out = [0] * ((len(bits) + 7) // 8)
    for i, b in enumerate(bits):
        out[i // 8] |= int(b) << (i % 8)
    return out


def ref_pack_uint(values: list[int], width: int) -> list[int]:
    if width == 16:
        out = []
        for v in values:
            out += [v & 0xFF, v >> 8]  # little-endian
        return out
    per = 8 // width
    out = [0] * ((len(values) + per - 1) // per)
    for i, v in enumerate(values):
        out[i // per] |= v << (width * (i % per))
    return out


@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 1000, 4099])
def test_sign_packing_layout_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    x[::5] = 0.0  # zero counts as positive
    bits = (x >= 0).tolist()
    ref = ref_pack_bits(bits)
    assert pack_bits(x >= 0).tolist() == ref
    work = torch.full(((n + 7) // 8 * 8,), 0xAB, dtype=torch.uint8)  # garbage must not leak
    assert pack_ge_zero(x, work).tolist() == ref
    assert pack_ge_zero(x).tolist() == ref
    assert unpack_bits(torch.tensor(ref, dtype=torch.uint8), n).tolist() == bits
    # spread: byte i of word j is bit i of packed byte j
    words = spread_bits(torch.tensor(ref, dtype=torch.uint8))
    assert words.view(torch.uint8)[:n].tolist() == [int(b) for b in bits]


@pytest.mark.parametrize("width", [2, 4, 8, 16])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 1000, 1001])
def test_uint_packing_layout_matches_reference(width, n):
    g = torch.Generator().manual_seed(width * 1000 + n)
    v = torch.randint(0, 2**width, (n,), generator=g)
    ref = ref_pack_uint(v.tolist(), width)
    packed = pack_uint(v, width)
    assert packed.dtype == torch.uint8 and packed.tolist() == ref
    assert unpack_uint(packed, width, n).tolist() == v.tolist()
    if width <= 8:
        codes = v.to(torch.uint8)
        assert pack_uint8_codes(codes, width).tolist() == ref
        assert pack_uint8_codes(codes[1:], width).tolist() == ref_pack_uint(v.tolist()[1:], width)  # odd offset
        assert unpack_uint8_codes(packed, width, n).tolist() == v.tolist()


def test_payload_buffer_layout_matches_reference():
    parts = (torch.randn(3), torch.arange(5, dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.uint8),
             torch.randn(2).double(), torch.randn(4)[::2])  # a non-contiguous part too
    ref: list[int] = []
    for t in parts:
        b = t.contiguous().view(torch.uint8).tolist()
        ref += b + [0] * ((-len(b)) % 8)
    buf = pack_payload(parts)
    assert buf.tolist() == ref
    specs = [(tuple(t.shape), t.dtype) for t in parts]
    assert buf.numel() == packed_nbytes(specs)
    for a, b in zip(parts, unpack_payload(buf, specs)):
        assert torch.equal(a, b)


def _ctx(n, rank=0, ws=4, step=3):
    return GroupContext(step=step, rank=rank, world_size=ws, segments=(n,))


def ref_qsgd_decode(norms: torch.Tensor, packed: torch.Tensor, n: int, s: int, width: int, bs: int) -> torch.Tensor:
    """Reference: unpack the codes with Python ints, then (q − s)·norm/s in float64."""
    data = packed.tolist()
    if width == 16:
        codes = [data[2 * i] | (data[2 * i + 1] << 8) for i in range(n)]
    else:
        per = 8 // width
        codes = [(data[i // per] >> (width * (i % per))) & ((1 << width) - 1) for i in range(n)]
    nrm = norms.double().tolist()
    return torch.tensor([(q - s) * nrm[i // bs] / s for i, q in enumerate(codes)], dtype=torch.float64)


@pytest.mark.parametrize("levels,bucket", [(1, 64), (7, 512), (7, 100), (100, 128), (300, 256)])
def test_qsgd_aggregate_equals_mean_of_reference_decodes(levels, bucket):
    n = 1537  # a partial last bucket and an odd element count
    comp = build_compressor("qsgd", args={"levels": levels, "bucket_size": bucket})
    payloads, xs = [], []
    for r in range(4):
        x = torch.randn(n, generator=torch.Generator().manual_seed(r)) * (1 + r)
        x[r::97] = 0.0
        xs.append(x)
        payloads.append(comp.compress(x, _ctx(n, rank=r)).payload)
    refs = [ref_qsgd_decode(*p, n, levels, comp.width, bucket) for p in payloads]
    for x, ref in zip(xs, refs):
        # every level lies in [-s, s] and matches the element's sign; |level| is floor or ceil of s|x|/norm
        nb = math.ceil(n / bucket)
        norms = torch.stack([x[i * bucket:(i + 1) * bucket].double().norm() for i in range(nb)])
        q = ref * levels / norms.repeat_interleave(bucket)[:n]
        scaled = x.double().abs() * levels / norms.repeat_interleave(bucket)[:n]
        assert torch.all(q.round().abs() <= levels)
        assert torch.all((q.abs().round() - scaled.floor() >= -1e-6) & (q.abs().round() - scaled.ceil() <= 1e-6))
        assert torch.all((q == 0) | (torch.sign(q) == torch.sign(x.double())))
    mean = comp.aggregate_gathered(payloads, torch.float32, _ctx(n))
    expected = torch.stack(refs).mean(0)
    assert torch.allclose(mean.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    one = comp.decompress(payloads[2], torch.float32, _ctx(n))
    assert torch.allclose(one.double(), refs[2], rtol=1e-6, atol=1e-6 * float(refs[2].abs().max()))


def test_qsgd_zero_bucket_and_rank_identical_aggregate():
    n = 1024
    x = torch.randn(n)
    x[:512] = 0.0  # one all-zero bucket
    comp = build_compressor("qsgd", args={"bucket_size": 512})
    p = comp.compress(x, _ctx(n)).payload
    d = comp.decompress(p, torch.float32, _ctx(n))
    assert torch.all(d[:512] == 0)
    payloads = [comp.compress(torch.randn(n), _ctx(n, rank=r)).payload for r in range(4)]
    a = comp.aggregate_gathered(payloads, torch.float32, _ctx(n, rank=0))
    b = comp.aggregate_gathered([tuple(t.clone() for t in q) for q in payloads], torch.float32, _ctx(n, rank=3))
    assert torch.equal(a, b)  # what every rank computes from the same gathered bytes


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 8, 9])
def test_sign_aggregates_equal_dense_reference(ws):
    n = 1003
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 + r)) * (r + 1) for r in range(ws)]
    ctx = _ctx(n, ws=ws)
    for name in ("signsgd", "efsignsgd"):
        comp = build_compressor(name)
        payloads = [comp.compress(x, _ctx(n, rank=r, ws=ws)).payload for r, x in enumerate(xs)]
        scales = [float(x.abs().mean()) for x in xs]
        for p, s in zip(payloads, scales):
            assert math.isclose(float(p[0]), s, rel_tol=1e-5)
        signs = [torch.where(x >= 0, 1.0, -1.0) for x in xs]
        out = comp.aggregate_gathered(payloads, torch.float32, ctx)
        if name == "signsgd":  # majority vote (0 on ties) times the mean scale
            expected = torch.sign(sum(signs)) * (sum(float(p[0]) for p in payloads) / ws)
            assert torch.allclose(out, expected, rtol=1e-6)
        else:  # the dense mean of scale_r·sign_r, summed in rank order: bit-identical for ≤ 8 ranks
            acc = signs[0] * payloads[0][0]
            for s, p in zip(signs[1:], payloads[1:]):
                acc = acc + s * p[0]
            expected = acc / ws
            if ws <= 8:
                assert torch.equal(out, expected)
            else:
                assert torch.allclose(out, expected, rtol=1e-6)
        d = comp.decompress(payloads[0], torch.float32, ctx)
        assert torch.equal(d, signs[0] * payloads[0][0])


def ref_bisection(x: torch.Tensor, k: int, rounds: int) -> torch.Tensor:
    """The original MSTopK: count over the whole tensor every round."""
    a = x.abs().float()
    lo = torch.zeros(())
    hi = torch.nextafter(a.max(), torch.tensor(float("inf")))
    for _ in range(rounds):
        mid = (lo + hi) / 2
        enough = (a >= mid).sum() >= k
        lo = torch.where(enough, mid, lo)
        hi = torch.where(enough, hi, mid)
    sure = torch.nonzero(a >= hi).flatten()
    fill = torch.nonzero((a >= lo) & (a < hi)).flatten()[:k - sure.numel()]
    return torch.cat([sure, fill])


@pytest.mark.parametrize("layout", ["normal", "heavy_tail", "ties", "zeros"])
@pytest.mark.parametrize("rounds", [3, 25])
def test_mstopk_narrowed_bisection_selects_what_full_bisection_selects(layout, rounds):
    g = torch.Generator().manual_seed(7)
    n, k = 50_001, 500
    if layout == "normal":
        x = torch.randn(n, generator=g)
    elif layout == "heavy_tail":
        x = torch.randn(n, generator=g) ** 7
    elif layout == "ties":
        x = torch.randint(0, 4, (n,), generator=g).float()
    else:
        x = torch.zeros(n)
        x[:10] = 1.0
    got = threshold_topk_indices(x, k, rounds)
    assert torch.equal(got, ref_bisection(x, k, rounds))
    assert got.numel() == k and got.unique().numel() == k


def test_randomk_subset_is_uniform_and_rank_shared():
    """Each position is kept with probability k/n: counts over many steps match a binomial."""
    n, ratio, steps = 2000, 0.01, 3000
    comp = build_compressor("randomk", ratio=ratio)
    k = 20
    counts = torch.zeros(n)
    for t in range(steps):
        idx = comp.indices(_ctx(n, step=t))
        assert idx.numel() == k and idx.unique().numel() == k
        assert torch.all((idx >= 0) & (idx < n))
        counts[idx] += 1
    assert torch.equal(comp.indices(_ctx(n, rank=0, step=9)), comp.indices(_ctx(n, rank=3, step=9)))
    p = k / n
    mean, sd = steps * p, math.sqrt(steps * p * (1 - p))
    z = (counts - mean) / sd
    assert float(z.abs().max()) < 5.5  # 2000 coordinates, each within 5.5 σ
    # chi-square over coordinates: Σz² ≈ n ± a few √(2n)
    assert abs(float((z ** 2).sum()) - n) < 6 * math.sqrt(2 * n)
    # the first index of the subset is not biased towards small positions (draw order is random)
    firsts = torch.tensor([float(comp.indices(_ctx(n, step=t))[0]) for t in range(400)])
    assert abs(float(firsts.mean()) - (n - 1) / 2) < 5 * n / math.sqrt(12 * 400)
