"""The ``auto`` model against hand-written equations and a brute-force argmin (tests/auto_oracle.py)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from auto_oracle import argmin_by_hand, buckets_by_hand, step_by_hand

from lightning_gc.auto.model import (
    MethodCost,
    Workload,
    calibrate_other,
    choose,
    choose_measured,
    ddp_buckets,
    efficiency,
    predict,
)
from lightning_gc.comm.cost_model import NetworkModel

BURST = 64 * 1024  # the bench shaper's token bucket (lightning_gc/bench/netns.py: tc_burst_bytes)


def _workload(rng: random.Random, tensors: int) -> Workload:
    numels = tuple(rng.choice([300, 5_000, 80_000, 400_000, 2_000_000, 7_000_000]) for _ in range(tensors))
    return Workload(forward_s=rng.uniform(0.001, 0.05), backward_s=tuple(rng.uniform(0, 0.02) for _ in numels),
                    numels=numels, optimizer_s=rng.uniform(0, 0.01), other_s=rng.uniform(0, 0.01))


def _costs(rng: random.Random, numel: int) -> list[MethodCost]:
    return [
        MethodCost("ddp", "bucket", 0.0),
        MethodCost("fp16", "bucket", rng.uniform(0, 0.01), delta2=1e-7),
        MethodCost("lowrank", "lowrank", rng.uniform(0, 0.05), 4 * numel * rng.uniform(0.001, 0.05),
                   rng.uniform(0.2, 0.9), True, exact_bytes=rng.choice([0.0, 4000.0])),
        MethodCost("topk", "allgather", rng.uniform(0, 0.05), 8 * numel * 0.01, rng.uniform(0.3, 0.95), True,
                   exact_bytes=rng.choice([0.0, 4000.0])),
        MethodCost("artopk", "sparse", rng.uniform(0, 0.05), 8 * numel * 0.01, rng.uniform(0.3, 0.95), True,
                   sparse_ratio=0.01, value_bytes=rng.choice([2.0, 4.0])),
        MethodCost("qsgd", "allgather", rng.uniform(0, 0.05), numel * rng.uniform(0.3, 1.2), rng.uniform(0.5, 3.0),
                   False),
        MethodCost("randomk", "allreduce", rng.uniform(0, 0.05), 4 * numel * 0.01, rng.uniform(10, 99), False),
    ]


def test_ddp_buckets_follow_ddps_caps():
    mb = 1 << 20
    # 0.5 MiB + 0.5 MiB closes the 1 MiB first bucket; then 25 MiB buckets
    numels = [mb // 8, mb // 8, 6 * mb, 1, mb]
    assert ddp_buckets(numels) == [2, 3]  # 24 MiB + 4 B + 4 MiB >= 25 MiB at the fifth tensor
    assert ddp_buckets(numels) == [len(b) for b in buckets_by_hand(numels)]
    assert ddp_buckets([10]) == [1]


def test_every_prediction_equals_the_hand_written_equations():
    rng = random.Random(0)
    for trial in range(60):
        wl = _workload(rng, rng.randint(1, 12))
        net = NetworkModel(rng.choice([0.0, 1e-5, 5e-4, 0.02]), 8 / rng.choice([1e7, 1e8, 1e9, 1e11]))
        n = rng.choice([1, 2, 3, 4, 7, 64, 1024])
        for c in _costs(rng, wl.numel):
            got = predict(c, wl, net, n, progress_weight=0.7)
            want = step_by_hand(c.as_dict(), wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n)
            assert got.step_s == pytest.approx(want, rel=1e-12, abs=1e-15), (trial, c.name)
            assert got.time_per_progress_s == pytest.approx(got.step_s / got.efficiency, rel=1e-12)


@pytest.mark.parametrize("weight", [0.0, 1.0, 3.0])
def test_the_choice_is_the_brute_force_minimum(weight):
    rng = random.Random(int(weight * 10) + 1)
    picks = set()
    for _ in range(120):
        wl, net, n, costs = _random_case(rng)
        rng.shuffle(costs)
        best, preds = choose(costs, wl, net, n, weight)
        assert best == argmin_by_hand([c.as_dict() for c in costs], wl.as_dict(), net.alpha_s,
                                      net.beta_s_per_byte, n, weight)
        picks.add(best)
    assert len(picks) >= 3, picks  # the grid exercises several winners, not one by every measure


def _random_case(rng: random.Random) -> tuple[Workload, NetworkModel, int, list[MethodCost]]:
    """A random workload, network, world size and candidate list for the brute-force choice tests."""
    wl = _workload(rng, rng.randint(1, 10))
    net = NetworkModel(rng.choice([1e-5, 5e-4, 0.01]), 8 / rng.choice([1e7, 2e7, 1e8, 1e9, 1e10]))
    return wl, net, rng.choice([2, 4, 8, 64]), _costs(rng, wl.numel)


@pytest.mark.parametrize("explore", [True, False])
def test_measured_choice_is_the_brute_force_minimum_over_corrected_and_raw_predictions(explore):
    rng = random.Random(11 + explore)
    switched = 0
    for _ in range(120):
        wl, net, n, costs = _random_case(rng)
        measured = rng.sample([c.name for c in costs], rng.randint(0, 3))
        corr = {m: rng.uniform(-0.01, 0.05) for m in measured}
        best, preds = choose_measured(costs, corr, wl, net, n, 1.0, explore=explore)
        # by hand: a measured candidate carries its correction, an unmeasured one none; without
        # exploration only the measured ones compete (all of them when none is measured)
        hand = [{**c.as_dict(), "overhead_s": corr.get(c.name, 0.0)} for c in costs]
        pool = hand if explore or not measured else [h for h in hand if h["name"] in corr]
        assert best == argmin_by_hand(pool, wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n, 1.0)
        assert set(preds) == {c.name for c in costs}  # every candidate predicted, for the record
        for h in hand:
            assert preds[h["name"]].step_s == pytest.approx(
                step_by_hand(h, wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n), rel=1e-12, abs=1e-15)
        switched += best != choose(costs, wl, net, n, 1.0)[0]
    assert switched >= 10  # the corrections change the choice in a good share of the cases


def test_ties_go_to_the_earlier_candidate_and_a_single_rank_sends_nothing():
    wl = Workload(0.01, (0.01, 0.02), (1000, 2000))
    same = [MethodCost("fp16", "bucket", 0.0), MethodCost("ddp", "bucket", 0.0)]
    assert choose(same, wl, NetworkModel(0.0, 0.0), 4)[0] == "fp16"
    assert choose(list(reversed(same)), wl, NetworkModel(0.0, 0.0), 4)[0] == "ddp"
    p = predict(MethodCost("topk", "allgather", 0.5, 1e9, 0.9, True), wl, NetworkModel(1.0, 1.0), 1)
    assert p.step_s == pytest.approx(0.04) and p.comm_s == 0.0


def test_relative_error_against_a_float64_reference_and_its_float32_sum_falls_back_where_it_cannot_hold():
    """The error sums in float32 (and ``‖x‖²`` once per sample, ``norm2``): against sums over float64
    copies written here, within 1e-7 relative on a heavy-tailed gradient for a 16-bit cast's rounding
    and a zeroed half; a sum of squares past float32's range (a thousand squares of 1e36) is float64's,
    not inf; an all-zero gradient has no error."""
    import torch

    from lightning_gc.auto.candidates import _relative_error, candidate, measure_error, squared_norm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(300_000, generator=g) * torch.rand(300_000, generator=g) ** 6
    x64 = x.double()
    assert squared_norm(x) == pytest.approx(float((x64 ** 2).sum()), rel=1e-7)
    for sent in (x.half().float(), x.bfloat16().float(), torch.where(torch.arange(x.numel()) % 2 == 0, x, 0.0)):
        want = float(((sent.double() - x64) ** 2).sum() / (x64 ** 2).sum())
        assert _relative_error(x, sent) == pytest.approx(want, rel=1e-7)
        assert _relative_error(x, sent, squared_norm(x)) == _relative_error(x, sent)
    assert measure_error(candidate("fp16"), x, None, norm2=squared_norm(x)) == pytest.approx(
        float(((x.half().double() - x64) ** 2).sum() / (x64 ** 2).sum()), rel=1e-7)
    big = torch.full((1000,), 1e18)
    assert squared_norm(big) == pytest.approx(1e39, rel=1e-6)
    assert _relative_error(big, big * 0.5) == pytest.approx(0.25, rel=1e-6)
    assert squared_norm(torch.zeros(10)) == 0.0 and _relative_error(torch.zeros(10), torch.ones(10)) == 0.0


def test_efficiency_divides_independent_errors_by_the_ranks():
    ef = MethodCost("topk", "allgather", 0.0, 1.0, delta2=0.5, error_feedback=True)
    unbiased = MethodCost("qsgd", "allgather", 0.0, 1.0, delta2=2.0, error_feedback=False)
    assert efficiency(ef, 8, 1.0) == pytest.approx(1 / 1.5)
    assert efficiency(unbiased, 8, 1.0) == pytest.approx(1 / 1.25)
    assert efficiency(unbiased, 8, 0.0) == 1.0


def test_calibrated_other_makes_the_ddp_prediction_the_measured_step():
    wl = Workload(0.01, (0.002, 0.003, 0.005), (4000, 300_000, 1_000_000), 0.004)
    net = NetworkModel(1e-4, 8 / 1e9)
    ddp = MethodCost("ddp", "bucket", 0.0)
    measured = predict(ddp, wl, net, 4).step_s + 0.0123
    other = calibrate_other(measured, wl, ddp, net, 4)
    assert other == pytest.approx(0.0123)
    assert calibrate_other(0.0, wl, ddp, net, 4) == 0.0  # never negative


def test_calibrated_beta_makes_the_ddp_prediction_the_measured_step_and_is_never_raised():
    """A DDP step shorter than the probed link predicts lowers β until the hand-written model's DDP
    step (other = 0) equals it; a longer one leaves β (other explains it); at most 4x lower."""
    from auto_oracle import step_by_hand

    from lightning_gc.auto.model import MIN_BETA_SCALE, calibrate_beta

    rng = random.Random(7)
    ddp = MethodCost("ddp", "bucket", 0.0)
    for _ in range(30):
        wl = _workload(rng, rng.randint(1, 8))
        d = dict(wl.as_dict(), other_s=0.0)
        n = rng.choice([2, 4, 16])
        alpha, beta = rng.uniform(1e-5, 1e-3), 8 / rng.uniform(1e7, 1e9)
        net = NetworkModel(alpha, beta)
        probed = step_by_hand(ddp.as_dict(), d, alpha, beta, n)
        true = step_by_hand(ddp.as_dict(), d, alpha, beta * rng.uniform(0.3, 0.95), n)
        got = calibrate_beta(true, wl, ddp, net, n)
        assert beta * MIN_BETA_SCALE <= got <= beta
        assert step_by_hand(ddp.as_dict(), d, alpha, got, n) == pytest.approx(true, rel=1e-9)
        assert calibrate_beta(probed + 0.01, wl, ddp, net, n) == beta  # slower than modelled: β kept
        floor = step_by_hand(ddp.as_dict(), d, alpha, beta * MIN_BETA_SCALE, n)
        if floor < probed:  # communication shows in the step: a step below the floor is not believed
            assert calibrate_beta(floor * 0.5, wl, ddp, net, n) == pytest.approx(beta * MIN_BETA_SCALE)


@pytest.mark.parametrize("bad, match", [
    (dict(wire="smoke"), "not a wire format"),
    (dict(name="fp8", wire="bucket"), "not one of"),
    (dict(codec_s=-1.0), "codec_s=-1.0"),
    (dict(delta2=float("nan")), "delta2=nan"),
])
def test_method_costs_are_validated(bad, match):
    base = dict(name="topk", wire="allgather", codec_s=0.0)
    with pytest.raises(ValueError, match=match):
        MethodCost(**{**base, **bad})


def test_workloads_are_validated():
    with pytest.raises(ValueError, match="one backward time per tensor"):
        Workload(0.0, (0.1,), (1, 2))
    with pytest.raises(ValueError, match="forward_s=-1"):
        Workload(-1, (0.1,), (1,))
    for a, b in itertools.product([0.1], [float("inf")]):
        with pytest.raises(ValueError):
            Workload(a, (b,), (1,))


def test_compute_shift_is_the_smallest_speed_up_every_settled_method_showed():
    from lightning_gc.auto.model import compute_shift

    assert compute_shift([]) == 0.0  # nothing measured in a window: the raw model
    assert compute_shift([-0.13]) == pytest.approx(-0.13)
    assert compute_shift([-0.13, -0.02, -0.2]) == pytest.approx(-0.02)  # the least speed-up
    assert compute_shift([-0.13, 0.01]) == 0.0  # one method ran over its prediction: nothing shared
    assert compute_shift([0.03]) == 0.0  # a positive correction is never shared


def test_the_measured_choice_with_a_shift_is_the_brute_force_minimum():
    """Settled methods carry their corrections; every other one (``ddp`` with its profile correction
    included) its correction, if any, plus the shift. By hand, against the hand-written equations."""
    rng = random.Random(29)
    moved = 0
    for _ in range(150):
        wl, net, n, costs = _random_case(rng)
        measured = rng.sample([c.name for c in costs], rng.randint(1, 3))
        corr = {m: rng.uniform(-0.05, 0.02) for m in measured}
        settled = rng.sample(measured, rng.randint(1, len(measured)))  # 1+: the shift comes from a window
        shift = -rng.uniform(0.2, 0.9) * (wl.forward_s + wl.backward_total_s + wl.optimizer_s)
        explore = rng.random() < 0.7
        best, preds = choose_measured(costs, corr, wl, net, n, 1.0, explore=explore, shift_s=shift, settled=settled)
        hand = [{**c.as_dict(), "overhead_s": corr.get(c.name, 0.0) + (0.0 if c.name in settled else shift)}
                for c in costs]
        pool = hand if explore else [h for h in hand if h["name"] in corr]
        assert best == argmin_by_hand(pool, wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n, 1.0)
        for h in hand:
            assert preds[h["name"]].step_s == pytest.approx(
                step_by_hand(h, wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n), rel=1e-12, abs=1e-15)
        moved += best != choose_measured(costs, corr, wl, net, n, 1.0, explore=explore, settled=settled)[0]
    assert moved >= 10  # the shift changes the choice in a good share of the cases


def test_every_step_severe_test_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match=r"auto_severe_steps=1 would re-decide on one slow step"):
        AutoConfig(severe_steps=1)
    with pytest.raises(ValueError, match=r"auto_severe_steps=-1 must be an integer >= 0"):
        AutoConfig(severe_steps=-1)
    assert AutoConfig(severe_steps=0).severe_steps == 0


def test_compute_shift_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match="auto_compute_shift"):
        AutoConfig(compute_shift=1)


def test_a_negative_correction_is_a_measured_step_and_is_not_floored_at_the_profiled_compute():
    """The raw model never predicts below forward + backward + optimizer; a measured method that ran
    faster than that (the profiled warm-up step is slow) is predicted at its measurement, so two
    measured methods under the floor still rank by what they did."""
    from lightning_gc.auto.model import predict

    wl = Workload(0.05, (0.1,), (1_000_000,), optimizer_s=0.05, other_s=0.02)  # compute 0.2 s
    net = NetworkModel(1e-4, 8 / 1e9)
    raw = predict(MethodCost("topk", "allgather", 0.01, 40_000.0), wl, net, 4).step_s
    assert raw >= 0.2  # the raw model is floored at the compute
    for overhead in (-0.15, -0.1, 0.03):
        got = predict(MethodCost("topk", "allgather", 0.01, 40_000.0, overhead_s=overhead), wl, net, 4).step_s
        assert got == pytest.approx(raw + overhead)
    a = predict(MethodCost("topk", "allgather", 0.01, 40_000.0, overhead_s=-0.15), wl, net, 4).step_s
    b = predict(MethodCost("topk", "allgather", 0.01, 40_000.0, overhead_s=-0.10), wl, net, 4).step_s
    assert a < b < 0.2


def _shaped_link(alpha: float, beta: float, sent: list[int]):
    """A simulated tc-shaped link: a message of S bytes takes α + max(S − bucket, 0)·β (the bucket's
    bytes leave at line rate). Returns the ``measure`` callable of probe_bandwidth: the slope between
    S/4 and S and the S-byte message's time, recording every message a real probe would send (one
    warm-up and three timed runs of each size)."""
    def t(size: int) -> float:
        return alpha + max(size - BURST, 0) * beta

    def measure(size: int) -> tuple[float, float]:
        small = size // 4
        sent.extend([small, size] * 4)
        return (t(size) - t(small)) / (size - small), t(size)
    return measure


@pytest.mark.parametrize("rate_bps, want_size", [(20e6, 256 * 1024), (10e6, 256 * 1024), (1e9, 1024 * 1024)])
def test_the_bandwidth_probe_is_sized_to_the_link_and_its_slope_is_the_links_beta(rate_bps, want_size):
    from lightning_gc.comm.link import probe_bandwidth, probe_start_bytes

    beta = 8 / rate_bps
    sent: list[int] = []
    start = probe_start_bytes(4 * 1_000_000)  # a 1M-parameter model: the full 256 KiB start
    assert start == 256 * 1024
    got, size, large_s = probe_bandwidth(_shaped_link(3e-4, beta, sent), start)
    assert size == want_size
    assert large_s == pytest.approx(3e-4 + (want_size - BURST) * beta)  # the link check's reference
    # both messages above the bucket: the bucket is a constant offset and the slope is exact
    assert got == pytest.approx(beta, rel=1e-9)
    if rate_bps < 1e8:  # a slow link: one round of 256 KiB + 64 KiB messages, not 1 MiB
        assert sum(sent) == 4 * (256 + 64) * 1024
        assert sum(sent) * 4 == 4 * (1024 + 256) * 1024  # a quarter of the fixed-size probe's bytes
    else:  # a fast link: the first round is too short (1.8 ms), 1 MiB is measured next
        assert sum(sent) == 4 * (256 + 64 + 1024 + 256) * 1024


def test_switch_margin_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    for bad in (-0.01, 1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="auto_switch_margin"):
            AutoConfig(switch_margin=bad)


def test_family_margin_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="auto_family_margin"):
            AutoConfig(family_margin=bad)


@pytest.mark.parametrize("bad", [1.0, 0.5, -1, float("inf"), True, "1.5"])
def test_probe_check_is_validated(bad):
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match="auto_probe_check=.* must be 0 .* or a factor > 1"):
        AutoConfig(probe_check=bad)


def test_link_unchanged_is_a_symmetric_factor_band():
    from lightning_gc.comm.link import link_unchanged

    assert link_unchanged(0.1, 0.1, 1.5) and link_unchanged(0.15, 0.1, 1.5) and link_unchanged(0.1, 0.15, 1.5)
    assert not link_unchanged(0.151, 0.1, 1.5) and not link_unchanged(0.1, 0.151, 1.5)
    assert not link_unchanged(0.1, 0.0, 1.5)  # no reference: probe


def test_no_beta_explains_a_dense_step_shorter_than_its_compute():
    from lightning_gc.auto.model import beta_from_dense_step

    wl = Workload(0.01, (0.01,), (1000,))
    assert beta_from_dense_step(0.015, wl, MethodCost("ddp", "bucket", 0.0), 1e-4, 4) is None


@pytest.mark.parametrize("bad", [-0.1, float("nan"), True])
def test_dense_probe_s_is_validated(bad):
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match="auto_dense_probe_s=.* must be a finite number of seconds >= 0"):
        AutoConfig(dense_probe_s=bad)


def test_the_check_size_without_a_probe_is_what_the_probe_would_settle_on():
    from lightning_gc.comm.link import check_bytes

    start = 256 * 1024  # a model of 512 KiB of fp32 gradient or more
    assert check_bytes(NetworkModel(1e-4, 8 / 20e6), start) == 256 * 1024  # 0.1 s at 20 Mbit/s: long enough
    # at 1 Gbit/s 256 KiB takes 2.2 ms: grown to the size that takes 5 ms (α + S·β = 5 ms)
    assert check_bytes(NetworkModel(1e-4, 8 / 1e9), start) == math.ceil((0.005 - 1e-4) / (8 / 1e9))
    assert check_bytes(NetworkModel(1e-4, 8 / 100e9), start) == 1024 * 1024  # never past 1 MiB
    assert check_bytes(NetworkModel(1e-4, 8 / 20e6), 168_000) == 168_000  # a small model: its start
    # ... which grows on a fast link as the probe's would, past half the model's gradient
    assert check_bytes(NetworkModel(1e-4, 8 / 1e9), 168_000) == math.ceil((0.005 - 1e-4) / (8 / 1e9))


def _rank3_group():
    """A group of a 40×30 matrix of rank 3 (singular values 5, 3, 2: the oracle of the low-rank
    candidates' errors, Eckart–Young) and a 40-element bias, with its one-rank context."""
    import torch

    from lightning_gc.compressors import GroupContext

    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(40, 3, generator=g))
    v, _ = torch.linalg.qr(torch.randn(30, 3, generator=g))
    m = u @ torch.diag(torch.tensor([5.0, 3.0, 2.0])) @ v.t()
    x = torch.cat([m.reshape(-1), torch.randn(40, generator=g)])
    ctx = GroupContext(step=5, rank=0, world_size=1, segments=(1200, 40), group_id=0, seed=0, device=x.device,
                       shapes=((40, 30), (40,)), names=("w", "b"))
    return x, ctx


def test_lowrank1_candidate_sends_rank_one_factors_and_errs_more_than_rank_two():
    """The opt-in ``lowrank1`` candidate is ``lowrank`` at rank 1: per compressed matrix ``n × m`` it
    sends ``(n + m)`` floats where rank 2 sends ``2·(n + m)`` (the bias travels dense in both), and its
    error after the warm-started steps exceeds rank 2's on a matrix of rank 3 (computed here from the
    singular values: a rank-r power iteration cannot beat the truncated SVD, Eckart–Young)."""
    from lightning_gc.auto.candidates import candidate, measure_method

    x, ctx = _rank3_group()
    c1, c2 = candidate("lowrank1"), candidate("lowrank")
    assert (c1.compressor, c1.compressor_args, c2.compressor_args) == ("lowrank", {"rank": 1}, {"rank": 2})
    m1 = measure_method(c1, x, ctx, world_size=2, repeats=1)
    m2 = measure_method(c2, x, ctx, world_size=2, repeats=1)
    assert (m1.wire, m1.payload_bytes, m2.payload_bytes) == ("lowrank", 4 * (70 + 40), 4 * (2 * 70 + 40))
    energy = float(x.double().pow(2).sum())
    assert m1.delta2 >= (3.0 ** 2 + 2.0 ** 2) / energy * (1 - 1e-6)  # at best the rank-1 truncation's loss
    assert m2.delta2 >= 2.0 ** 2 / energy * (1 - 1e-6)
    assert m1.delta2 > m2.delta2


def test_lowrank_bf16_candidate_sends_rank_two_in_half_the_bytes_at_rank_two_error():
    """``lowrank_bf16`` is ``lowrank`` rank 2 in bfloat16 messages: 2 bytes per element of the same
    factors and dense tensors (so the plan's exact group, riding in the ``P`` message, is charged 2
    bytes per element too), and an error within bfloat16's rounding of rank 2's, far below rank 1's
    (a rank-3 matrix whose singular values set the oracle, Eckart–Young)."""
    from lightning_gc.auto.candidates import candidate, measure_method

    x, ctx = _rank3_group()
    c16 = candidate("lowrank_bf16")
    assert (c16.compressor, c16.compressor_args) == ("lowrank", {"rank": 2, "wire_dtype": "bfloat16"})
    m16 = measure_method(c16, x, ctx, world_size=2, repeats=1, exact_bytes=400.0)
    m32 = measure_method(candidate("lowrank"), x, ctx, world_size=2, repeats=1, exact_bytes=400.0)
    assert (m16.wire, m16.payload_bytes, m16.exact_bytes) == ("lowrank", 2 * (2 * 70 + 40), 200.0)
    assert (m32.payload_bytes, m32.exact_bytes) == (4 * (2 * 70 + 40), 400.0)
    energy = float(x.double().pow(2).sum())
    assert m16.delta2 >= 2.0 ** 2 / energy * (1 - 1e-6)  # rank 2 at best
    assert m16.delta2 == pytest.approx(m32.delta2, abs=2.0 ** -6 * (m32.delta2 + 1e-3))
    assert m16.delta2 < (3.0 ** 2 + 2.0 ** 2) / energy  # below rank 1's best


def test_topk3_candidate_sends_three_percent_and_its_error_is_the_exact_top_k_residual():
    """The opt-in ``topk3`` candidate is Top-k at 3 % on allgather: its payload is k values (fp32)
    and k int32 indices with k = round(0.03·n), and its error is that of keeping the k largest
    magnitudes, computed here by sorting (not the library's selection)."""
    import torch

    from lightning_gc.auto.candidates import candidate, measure_method
    from lightning_gc.compressors import GroupContext

    g = torch.Generator().manual_seed(7)
    x = torch.randn(10_000, generator=g) * torch.linspace(0.1, 3.0, 10_000)
    ctx = GroupContext(step=5, rank=0, world_size=1, segments=(10_000,), group_id=0, seed=0, device=x.device,
                       shapes=((10_000,),), names=("w",))
    c3, c1 = candidate("topk3"), candidate("topk")
    assert (c3.compressor, c3.ratio, c3.collective) == ("topk", 0.03, "allgather")
    m3 = measure_method(c3, x, ctx, world_size=2, repeats=1)
    m1 = measure_method(c1, x, ctx, world_size=2, repeats=1)
    assert (m3.wire, m3.payload_bytes, m1.payload_bytes) == ("allgather", 300 * 8, 100 * 8)
    order = x.abs().sort(descending=True).values
    for m, k in ((m3, 300), (m1, 100)):
        want = float(order[k:].double().pow(2).sum() / order.double().pow(2).sum())
        assert m.delta2 == pytest.approx(want, rel=1e-7)  # the error's sums are float32 cascades (~1e-8)
    assert m3.delta2 < m1.delta2
