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


# ---------------------------------------------------------------------- the re-decision trigger
class _FakeEngine:
    """Just what AutoChooser's drift path touches (one process: agreement is the identity)."""

    def __init__(self, network):
        from types import SimpleNamespace

        self.world_size, self.process_group, self.step = 4, None, 0
        self.network = SimpleNamespace(pinned=True, model=network)
        self.plan = SimpleNamespace(groups=[SimpleNamespace(gid=0, exact=False)])
        self.calls: list = []

    def raise_warmup_steps(self, steps):
        pass

    def synchronize(self):
        pass

    def set_dense_mode(self, mode):
        self.calls.append(("dense", mode))

    def set_group_method(self, gid, spec):
        self.calls.append(("slot", spec.compressor))


def test_drift_waits_for_a_settled_reference_and_patience_then_switches_only_on_a_new_choice(monkeypatch):
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    # 4 ranks in the model, one process here: the agreement is the identity
    monkeypatch.setattr(chooser_mod, "_agree", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True)]
    engine = _FakeEngine(NetworkModel(0.0, 8 / 1e13))  # fast: ddp
    cfg = AutoConfig(candidates=("ddp", "topk"), window=2, drift=0.3, patience=2, min_interval=1)
    chooser = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    chooser.workload, chooser.costs = wl, costs
    chooser._decide(0, "warmup", probe=False)
    assert chooser.chosen == "ddp" and engine.calls == [("dense", "fp32")]

    def window(step, wall):
        chooser._window = [wall, wall]
        chooser._check_drift(step)

    ddp_step = chooser.predictions["ddp"].step_s
    window(10, 9.0)  # the first window after a decision holds the switch: ignored
    assert chooser._reference is None
    window(12, ddp_step)  # the reference; the bucket family's calibration finds no error: no switch
    assert chooser._reference == ddp_step and chooser.history[0]["measured_step_s"] == ddp_step
    assert [h["trigger"] for h in chooser.history] == ["warmup", "calibration"] and chooser.chosen == "ddp"
    window(14, 1.5 * ddp_step)  # +50 %: one drifted window, patience 2
    assert len(chooser.history) == 2
    window(16, 1.1 * ddp_step)  # back within 30 %: the count restarts
    window(18, 1.6 * ddp_step)
    assert len(chooser.history) == 2
    engine.network.model = NetworkModel(0.0, 8 / 1e6)  # the link fell to 1 Mbit/s
    window(20, 1.6 * ddp_step)  # second drifted window in a row: re-decide with the new network
    assert [h["trigger"] for h in chooser.history] == ["warmup", "calibration", "drift"]
    assert chooser.chosen == "topk" and engine.calls[-2:] == [("slot", "topk"), ("dense", None)]
    n_calls = len(engine.calls)
    topk_step = chooser.predictions["topk"].step_s
    window(30, 5.0)  # settling window
    window(32, topk_step + 0.002)  # reference: the engine family runs 2 ms slower than modelled
    assert chooser.history[-1]["trigger"] == "calibration"
    assert chooser.predictions["topk"].step_s == pytest.approx(topk_step + 0.002)
    assert chooser.chosen == "topk" and len(engine.calls) == n_calls  # still the best: nothing switched
    window(34, 2 * topk_step)
    window(36, 2 * topk_step)  # drift again, the network unchanged: the same choice, nothing switched
    assert [h["trigger"] for h in chooser.history] == ["warmup", "calibration", "drift", "calibration", "drift"]
    assert chooser.chosen == "topk" and len(engine.calls) == n_calls
