"""The ``auto`` model against hand-written equations and a brute-force argmin (tests/auto_oracle.py)."""

from __future__ import annotations

import itertools
import random

import pytest
from auto_oracle import argmin_by_hand, buckets_by_hand, step_by_hand

from lightning_gc.auto.model import (
    MethodCost,
    Workload,
    calibrate_other,
    choose,
    ddp_buckets,
    efficiency,
    predict,
)
from lightning_gc.comm.cost_model import NetworkModel


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
        wl = _workload(rng, rng.randint(1, 10))
        net = NetworkModel(rng.choice([1e-5, 5e-4, 0.01]), 8 / rng.choice([1e7, 2e7, 1e8, 1e9, 1e10]))
        n = rng.choice([2, 4, 8, 64])
        costs = _costs(rng, wl.numel)
        rng.shuffle(costs)
        best, preds = choose(costs, wl, net, n, weight)
        assert best == argmin_by_hand([c.as_dict() for c in costs], wl.as_dict(), net.alpha_s,
                                      net.beta_s_per_byte, n, weight)
        picks.add(best)
    assert len(picks) >= 3, picks  # the grid exercises several winners, not one by every measure


def test_ties_go_to_the_earlier_candidate_and_a_single_rank_sends_nothing():
    wl = Workload(0.01, (0.01, 0.02), (1000, 2000))
    same = [MethodCost("fp16", "bucket", 0.0), MethodCost("ddp", "bucket", 0.0)]
    assert choose(same, wl, NetworkModel(0.0, 0.0), 4)[0] == "fp16"
    assert choose(list(reversed(same)), wl, NetworkModel(0.0, 0.0), 4)[0] == "ddp"
    p = predict(MethodCost("topk", "allgather", 0.5, 1e9, 0.9, True), wl, NetworkModel(1.0, 1.0), 1)
    assert p.step_s == pytest.approx(0.04) and p.comm_s == 0.0


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
