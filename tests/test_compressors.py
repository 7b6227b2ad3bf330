"""Single-process oracles for every compressor: what it keeps, what it sends, that it is unbiased
where it claims to be, and that bad settings are refused with a useful message."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gc.comm.collectives import pack_payload, packed_nbytes, unpack_payload
from lightning_gc.compressors import (
    GroupContext,
    available_compressors,
    build_compressor,
    ratio_to_k,
    takes_ratio,
)
from lightning_gc.compressors.mstopk import threshold_topk_indices
from lightning_gc.compressors.packing import pack_bits, pack_uint, unpack_bits, unpack_uint


def ctx(n: int, step: int = 0, rank: int = 0, world_size: int = 2, segments=None) -> GroupContext:
    return GroupContext(step=step, rank=rank, world_size=world_size, segments=tuple(segments or (n,)))


def roundtrip(name: str, x: torch.Tensor, c: GroupContext, **kw):
    comp = build_compressor(name, **kw)
    out = comp.compress(x, c)
    return comp, out, comp.decompress(out.payload, out.meta, c)


@pytest.mark.parametrize("name", available_compressors())
def test_payload_matches_declared_specs(name):
    """The engine unpacks gathered bytes with payload_specs: they must describe compress() exactly."""
    x = torch.randn(3001)
    c = ctx(3001, segments=(1000, 2000, 1))
    comp = build_compressor(name, ratio=0.05 if takes_ratio(name) else None)
    out = comp.compress(x, c)
    assert [(tuple(t.shape), t.dtype) for t in out.payload] == comp.payload_specs(c, x.dtype)
    # and the packed buffer has a rank-independent size
    out2 = comp.compress(torch.randn(3001) * 100, ctx(3001, rank=1, segments=(1000, 2000, 1)))
    assert pack_payload(out.payload).numel() == pack_payload(out2.payload).numel()


def test_k_rule():
    assert ratio_to_k(0.01, 1000) == 10
    assert ratio_to_k(0.01, 1001) == 11  # ceil
    assert ratio_to_k(1e-9, 5) == 1  # at least one
    assert ratio_to_k(1.0, 7) == 7


def test_topk_keeps_exactly_the_largest_magnitudes():
    x = torch.randn(1000)
    _, out, d = roundtrip("topk", x, ctx(1000), ratio=0.05)
    vals, idx = out.payload
    assert idx.dtype == torch.int32 and idx.numel() == 50
    expected = set(torch.topk(x.abs(), 50).indices.tolist())
    assert set(idx.tolist()) == expected
    assert torch.equal(d[idx.long()], x[idx.long()])
    mask = torch.ones(1000, dtype=torch.bool)
    mask[idx.long()] = False
    assert torch.all(d[mask] == 0)


def test_topk_ratio_one_is_lossless():
    x = torch.randn(777)
    _, _, d = roundtrip("topk", x, ctx(777), ratio=1.0)
    assert torch.equal(d, x)


def test_lwtopk_selects_per_layer():
    x = torch.cat([torch.randn(100) * 100, torch.randn(900) * 0.01])  # global top-k would ignore layer 2
    c = ctx(1000, segments=(100, 900))
    _, out, d = roundtrip("lwtopk", x, c, ratio=0.1)
    idx = out.payload[1].long()
    assert (idx < 100).sum() == 10 and (idx >= 100).sum() == 90
    assert set(idx[idx >= 100].tolist()) == set((torch.topk(x[100:].abs(), 90).indices + 100).tolist())
    assert torch.equal(d[idx], x[idx])


@pytest.mark.parametrize("n,ratio", [(1000, 0.01), (4097, 0.003), (50, 0.5), (10, 1.0)])
def test_mstopk_exactly_k_and_matches_topk_without_ties(n, ratio):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    k = ratio_to_k(ratio, n)
    idx = threshold_topk_indices(x, k, rounds=40)
    assert idx.numel() == k
    assert idx.unique().numel() == k
    assert set(idx.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_mstopk_exactly_k_with_heavy_ties_and_zeros():
    x = torch.tensor([1.0] * 30 + [0.0] * 70)
    for k in (1, 10, 30, 31, 100):
        idx = threshold_topk_indices(x, k, rounds=25)
        assert idx.numel() == k and idx.unique().numel() == k
    assert threshold_topk_indices(torch.zeros(64), 5, 25).numel() == 5


def test_randomk_indices_shared_across_ranks_and_fresh_each_step():
    comp = build_compressor("randomk", ratio=0.1)
    a = comp.indices(ctx(1000, step=3, rank=0))
    b = comp.indices(ctx(1000, step=3, rank=1))
    c = comp.indices(ctx(1000, step=4, rank=0))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.unique().numel() == 100


def test_randomk_and_qsgd_do_not_touch_global_rng():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    for name in ("randomk", "qsgd"):
        comp = build_compressor(name, ratio=0.1 if takes_ratio(name) else None)
        comp.compress(torch.randn(100, generator=torch.Generator().manual_seed(0)), ctx(100))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("name,kw,trials", [("randomk", {"ratio": 0.25}, 4000), ("qsgd", {"compressor_args": {"levels": 2}}, 3000)])
def test_unbiased_estimators(name, kw, trials):
    """E[decompress(compress(x))] = x: the empirical mean over independent draws is within
    5 standard errors of x in every coordinate (standard errors estimated from the draws)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g)
    args = {"ratio": kw.get("ratio")} if "ratio" in kw else {"args": kw["compressor_args"]}
    comp = build_compressor(name, **args)
    draws = []
    for t in range(trials):
        c = ctx(64, step=t)
        out = comp.compress(x, c)
        draws.append(comp.decompress(out.payload, out.meta, c).double())
    d = torch.stack(draws)
    mean, se = d.mean(0), d.std(0) / math.sqrt(trials)
    z = (mean - x.double()).abs() / se.clamp_min(1e-12)
    assert z.max() < 5.0, f"max z-score {z.max():.2f}"
    # and the estimator is not trivially exact (it really is random)
    assert d.std(0).mean() > 0.01


def test_randomk_biased_variant_is_biased_by_k_over_n():
    x = torch.ones(40)
    comp = build_compressor("randomk", ratio=0.25, args={"unbiased": False})
    acc = torch.zeros(40)
    for t in range(2000):
        c = ctx(40, step=t)
        out = comp.compress(x, c)
        acc += comp.decompress(out.payload, out.meta, c)
    assert abs(float(acc.mean() / 2000) - 0.25) < 0.02


def test_qsgd_levels_in_range_and_norm_preserved_bucketwise():
    x = torch.randn(2000)
    comp = build_compressor("qsgd", args={"levels": 7, "bucket_size": 500})
    c = ctx(2000)
    out = comp.compress(x, c)
    norms, packed = out.payload
    assert norms.numel() == 4 and packed.numel() == 1000  # 4 bits per element
    assert torch.allclose(norms, x.view(4, 500).norm(dim=1))
    d = comp.decompress(out.payload, out.meta, c)
    q = d.view(4, 500) / norms.unsqueeze(1) * 7
    assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 7 + 1e-4
    assert torch.all(torch.sign(d[d != 0]) == torch.sign(x[d != 0]))


def test_sign_compressors_send_signs_and_l1_scale():
    x = torch.tensor([0.5, -2.0, 0.0, 3.0, -1.0, 1.0, -0.1, 0.2, 4.0])
    c = ctx(9)
    for name in ("signsgd", "efsignsgd"):
        comp, out, d = roundtrip(name, x, c)
        scale, packed = out.payload
        assert packed.numel() == 2 and packed.dtype == torch.uint8
        assert torch.isclose(scale, x.abs().mean().reshape(1)).all()
        assert torch.equal(torch.sign(d), torch.where(x >= 0, 1.0, -1.0))


@pytest.mark.parametrize("xs,want", [
    # 3 voters: no ties
    ([[1.0, -1.0, 2.0, -3.0], [1.0, 1.0, -2.0, -1.0], [-1.0, 1.0, -2.0, 5.0]], [1.0, 1.0, -1.0, -1.0]),
    # 2 voters: agreement gives ±1, disagreement a tie (0); a zero counts as +
    ([[1.0, -1.0, 2.0, -3.0, 0.0], [2.0, -1.0, -2.0, 1.0, -1.0]], [1.0, -1.0, 0.0, 0.0, 0.0]),
    # 4 voters: 4-0, 3-1, 2-2 (tie), 1-3, 0-4, and a tie made of zeros
    ([[1.0, 1.0, 1.0, -1.0, -1.0, 0.0], [1.0, 1.0, -1.0, -1.0, -1.0, 0.0],
      [1.0, 1.0, 1.0, 1.0, -1.0, -1.0], [1.0, -1.0, -1.0, -1.0, -1.0, -2.0]], [1.0, 1.0, 0.0, -1.0, -1.0, 0.0]),
], ids=["ws3", "ws2", "ws4"])
def test_signsgd_majority_vote_aggregate(xs, want):
    """The documented rule by hand: +1 where more ranks are non-negative, −1 where fewer, 0 on a tie."""
    xs = [torch.tensor(x) for x in xs]
    comp = build_compressor("signsgd")
    c = ctx(xs[0].numel(), world_size=len(xs))
    payloads = [comp.compress(x, c).payload for x in xs]
    out = comp.aggregate_gathered(payloads, torch.float32, c)
    mean_scale = sum(float(x.abs().mean()) for x in xs) / len(xs)
    assert torch.allclose(out, torch.tensor(want) * mean_scale, rtol=1e-6), out


@pytest.mark.parametrize("voters", [256, 257])
def test_signsgd_majority_vote_beyond_byte_lanes(voters):
    """More than 255 voters count in int32 (byte lanes would overflow): the same rule, ties → 0."""
    n = 24
    g = torch.Generator().manual_seed(voters)
    comp = build_compressor("signsgd", args={"scale": "none"})
    c = ctx(n, world_size=voters)
    # column j: the first pos[j] voters are non-negative; pos spans ties (even N), near-ties and landslides
    half = voters // 2
    pos = [0, voters, half, half + 1, half - 1, 1, voters - 1, 200] + torch.randint(0, voters + 1, (n - 8,), generator=g).tolist()
    xs = [torch.tensor([1.0 if r < pos[j] else -1.0 for j in range(n)]) for r in range(voters)]
    out = comp.aggregate_gathered([comp.compress(x, c).payload for x in xs], torch.float32, c)
    want = [1.0 if 2 * q > voters else -1.0 if 2 * q < voters else 0.0 for q in pos]
    assert out.tolist() == want
    assert (0.0 in want) == (voters % 2 == 0)


def test_bit_packing_roundtrip():
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 8, 9, 1000):
        bits = torch.rand(n, generator=g) > 0.5
        assert torch.equal(unpack_bits(pack_bits(bits), n), bits)
    for width in (2, 4, 8, 16):
        for n in (1, 3, 17, 1000):
            v = torch.randint(0, 2**width, (n,), generator=g)
            assert torch.equal(unpack_uint(pack_uint(v, width), width, n), v)


def test_payload_byte_packing_roundtrip_and_alignment():
    parts = (torch.randn(3), torch.arange(5, dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.uint8), torch.randn(2).double())
    specs = [(tuple(t.shape), t.dtype) for t in parts]
    buf = pack_payload(parts)
    assert buf.numel() == packed_nbytes(specs) and buf.numel() % 8 == 0
    for a, b in zip(parts, unpack_payload(buf, specs)):
        assert torch.equal(a, b)


def test_cast_compressors_halve_bytes():
    x = torch.randn(100)
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        comp, out, d = roundtrip(name, x, ctx(100, world_size=1))
        assert out.payload[0].dtype == dt and out.nbytes == 200
        assert torch.allclose(d, x, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_ratio_outside_unit_interval_is_refused(ratio):
    with pytest.raises(ValueError, match=r"ratio=.* must lie in \(0, 1\]"):
        build_compressor("topk", ratio=ratio)


def test_unknown_compressor_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown compressor 'tpok'.*topk.*qsgd"):
        build_compressor("tpok")


def test_ratio_for_compressor_without_ratio_is_refused():
    with pytest.raises(ValueError, match=r"'qsgd' does not take a ratio"):
        build_compressor("qsgd", ratio=0.1)


def test_unknown_compressor_option_names_valid_options():
    with pytest.raises(ValueError, match=r"\['level'\] are not options of compressor 'qsgd'.*levels"):
        build_compressor("qsgd", args={"level": 4})


@pytest.mark.parametrize("args,match", [({"levels": 0}, "levels=0"), ({"levels": 40000}, "levels=40000"), ({"bucket_size": 0}, "bucket_size=0")])
def test_qsgd_bad_options(args, match):
    with pytest.raises(ValueError, match=match):
        build_compressor("qsgd", args=args)


def test_mstopk_bad_rounds():
    with pytest.raises(ValueError, match="search_rounds=0"):
        build_compressor("mstopk", args={"search_rounds": 0})


def test_sign_bad_scale():
    with pytest.raises(ValueError, match="scale='l2'"):
        build_compressor("signsgd", args={"scale": "l2"})


@pytest.mark.parametrize("layout", ["normal", "heavy_tail", "spikes_off_stride", "constant"])
def test_sampled_threshold_topk_selects_exactly_what_torch_topk_selects(layout):
    from lightning_gc.compressors.sparse import topk_indices

    n, k = 600_001, 3000
    g = torch.Generator().manual_seed(3)
    if layout == "normal":
        x = torch.randn(n, generator=g)
    elif layout == "heavy_tail":
        x = torch.randn(n, generator=g) ** 5
    elif layout == "spikes_off_stride":  # the big values sit where a strided sample never looks
        x = torch.randn(n, generator=g) * 1e-3
        x[1::7][:k] = 100.0 + torch.rand(k, generator=g)
    else:
        x = torch.ones(n)
    idx = topk_indices(x, k)
    assert idx.numel() == k and idx.unique().numel() == k
    ref_vals = torch.topk(x.abs(), k).values
    assert torch.equal(x.abs()[idx].sort(descending=True).values, ref_vals)  # same multiset of magnitudes
    if layout != "constant":  # without ties the index set itself is unique
        assert set(idx.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


# ------------------------------------------------------------------------------------------
# QSGD decoded by hand from the wire format; its rounding noise; majority vote by counting
# ------------------------------------------------------------------------------------------
def _unpack_nibbles(packed: torch.Tensor, n: int) -> list[int]:
    """4-bit fields, element 2j in the low nibble of byte j (the documented packing), by hand."""
    out = []
    for b in packed.tolist():
        out += [b & 0xF, b >> 4]
    return out[:n]


def test_qsgd_payload_decoded_by_hand_rounds_to_adjacent_levels():
    s, bs, n = 7, 64, 200  # 4 buckets, the last one partial
    x = torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    comp = build_compressor("qsgd", args={"levels": s, "bucket_size": bs})
    c = ctx(n, step=5)
    norms, packed = comp.compress(x, c).payload
    levels = [q - s for q in _unpack_nibbles(packed, n)]
    moved_up = 0
    for i in range(n):
        b = i // bs
        norm = math.sqrt(sum(float(v) ** 2 for v in x[b * bs:(b + 1) * bs]))
        assert float(norms[b]) == pytest.approx(norm, rel=1e-6)
        scaled = s * abs(float(x[i])) / norm
        lvl = abs(levels[i])
        assert lvl in (math.floor(scaled), math.ceil(scaled)), (i, scaled, levels[i])
        if lvl:
            assert (levels[i] > 0) == (float(x[i]) > 0)
        moved_up += lvl == math.ceil(scaled) != math.floor(scaled)
    assert 0 < moved_up < n  # random rounding, not a fixed rule
    dec = comp.decompress((norms, packed), None, c)
    hand = torch.tensor([levels[i] * float(norms[i // bs]) / s for i in range(n)])
    assert torch.allclose(dec, hand, rtol=1e-6, atol=1e-7)


def test_qsgd_noise_variance_is_stochastic_roundings_and_independent_across_ranks():
    """Per element the rounding noise has variance (norm/s)²·f(1−f), f = frac(s|x|/norm) — the
    exact variance of unbiased stochastic rounding to adjacent levels (below QSGD's
    min(n/s², √n/s)·‖x‖² bound). Ranks draw independently: the mean of 4 ranks' quantisations of the
    same x has a quarter of one rank's noise power, and two ranks' noises are uncorrelated."""
    s, n, trials, ws = 3, 256, 400, 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(11))
    comp = build_compressor("qsgd", args={"levels": s, "bucket_size": n})
    norm = float(x.double().norm())
    f = (s * x.double().abs() / norm) % 1
    exact = float(((norm / s) ** 2 * f * (1 - f)).sum())
    assert exact <= min(n / s**2, math.sqrt(n) / s) * norm**2
    one, avg, cross = 0.0, 0.0, 0.0
    for t in range(trials):
        noise = []
        for r in range(ws):
            c = ctx(n, step=t, rank=r, world_size=ws)
            out = comp.compress(x, c)
            noise.append(comp.decompress(out.payload, out.meta, c).double() - x.double())
        one += float(noise[0].pow(2).sum()) / trials
        avg += float((sum(noise) / ws).pow(2).sum()) / trials
        cross += float((noise[0] * noise[1]).sum()) / trials
    assert one == pytest.approx(exact, rel=0.1)
    assert avg == pytest.approx(exact / ws, rel=0.15)  # shared noise would give ≈ exact
    assert abs(cross) < 0.1 * exact


@pytest.mark.parametrize("ws", [3, 4, 5])
def test_signsgd_majority_vote_counts_votes(ws):
    """Majority vote by counting: +1 where more than half the ranks are non-negative, −1 where
    fewer, 0 on a tie (even ws); times the mean scale. Vote sums range over ±1, ±3, … (odd ws) or
    0, ±2, ±4 (even ws), so a mean of signs or a plain sum of signs would not pass."""
    n = 400
    g = torch.Generator().manual_seed(ws)
    xs = [torch.randn(n, generator=g) * (0.5 + r) for r in range(ws)]
    comp = build_compressor("signsgd")
    c = ctx(n, world_size=ws)
    out = comp.aggregate_gathered([comp.compress(x, c).payload for x in xs], torch.float32, c)
    scale = sum(float(x.abs().mean()) for x in xs) / ws
    for i in range(n):
        pos = sum(float(x[i]) >= 0 for x in xs)
        want = 1.0 if 2 * pos > ws else -1.0 if 2 * pos < ws else 0.0
        assert float(out[i]) == pytest.approx(want * scale, rel=1e-6), (i, pos)
    votes = [sum(1 if float(x[i]) >= 0 else -1 for x in xs) for i in range(n)]
    assert {abs(v) for v in votes} - {0, 1}, "every vote sum is 0 or ±1: the data does not test the sign"


def test_randomk_values_are_p_times_n_over_k_at_k_shared_positions():
    n, ratio = 1000, 0.03
    k = math.ceil(ratio * n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    comp = build_compressor("randomk", ratio=ratio)
    seen = set()
    for step in range(3):
        decs = []
        for r in range(3):
            c = ctx(n, step=step, rank=r, world_size=3)
            out = comp.compress(x * (r + 1), c)
            decs.append(comp.decompress(out.payload, out.meta, c))
        support = torch.nonzero(decs[0]).flatten()
        assert support.numel() == k
        for r, d in enumerate(decs):
            assert torch.equal(torch.nonzero(d).flatten(), support)  # the same positions on every rank
            assert torch.allclose(d[support], x[support] * (r + 1) * (n / k))
        seen.add(tuple(support.tolist()))
    assert len(seen) == 3  # fresh positions every step
