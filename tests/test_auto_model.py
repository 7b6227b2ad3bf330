"""The ``auto`` model against hand-written equations and a brute-force argmin (tests/auto_oracle.py)."""

from __future__ import annotations

import copy
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


# ---------------------------------------------------------------------- the re-decision trigger
class _FakeEngine:
    """Just what AutoChooser's drift path touches (one process: agreement is the identity)."""

    def __init__(self, network):
        from types import SimpleNamespace

        import torch

        self.world_size, self.process_group, self.step, self.device = 4, None, 0, torch.device("cpu")
        self.network = SimpleNamespace(pinned=True, model=network)
        self.plan = SimpleNamespace(groups=[SimpleNamespace(gid=0, exact=False)])
        self.config = SimpleNamespace(warmup_steps=1, seed=0)
        self.calls: list = []
        self.dense_mode = None  # as GCEngine: a dense mode runs every step on DDP's buckets
        self.last_step = None  # _walls sets it: the stats of the step that just ended
        self.carried = None  # carry_wall's value, for the next step's closing report
        self.dense_carry = False  # enable_dense_carry: dense steps carry it too (in their first bucket)

    def enable_dense_carry(self):
        self.dense_carry = True

    def step_is_dense(self):
        return self.dense_mode is not None

    def carry_wall(self, wall_s):
        self.carried = wall_s

    def raise_warmup_steps(self, steps):
        pass

    def shorten_warmup_steps(self, steps):
        self.config.warmup_steps = min(self.config.warmup_steps, steps)

    def synchronize(self):
        pass

    def set_dense_mode(self, mode):
        self.calls.append(("dense", mode))
        self.dense_mode = mode

    def set_group_method(self, gid, spec):
        self.calls.append(("slot", spec.compressor))

    def adopt_network(self, model):  # an unpinned network: the chooser's agreed model
        self.network.model = model


def test_drift_waits_for_a_settled_reference_and_patience_then_switches_only_on_a_new_choice(monkeypatch):
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    # 4 ranks in the model, one process here: the agreement is the identity
    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
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


def test_the_warm_up_dense_step_scales_every_probed_beta(monkeypatch):
    """The probe under-reads a slow link (small messages, the slowest rank's view); the profiled DDP
    step, shorter than the probed β predicts, sets a scale that every later probe gets too."""
    import torch
    from auto_oracle import step_by_hand

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.01, (0.01, 0.01), (500_000, 500_000))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True)]
    engine = _FakeEngine(None)
    engine.network.pinned = False
    engine.adopt_network = lambda net: engine.calls.append(("adopt", net.beta_s_per_byte))
    probes = iter([NetworkModel(1e-4, 8 / 10e6), NetworkModel(1e-4, 8 / 5e6)])  # 10 Mbit/s, then 5
    monkeypatch.setattr(AutoChooser, "_probe", lambda self, latency=None: next(probes))
    ch = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_every=0), torch.nn.Linear(1, 1), [])
    ch.workload, ch.costs = wl, costs
    d = dict(wl.as_dict(), other_s=0.0)
    wall = step_by_hand(costs[0].as_dict(), d, 1e-4, 8 / 16e6, 4)  # the DDP step ran as at 16 Mbit/s
    ch._decide(1, "warmup", probe=True, dense_wall_s=wall)
    assert ch.beta_scale == pytest.approx(10 / 16, rel=1e-6)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 16e6, rel=1e-6)
    assert ch.workload.other_s == pytest.approx(0.0, abs=1e-9)  # the link explains the step
    assert ch.history[-1]["beta_scale"] == ch.beta_scale and engine.calls[0] == ("adopt", ch.network.beta_s_per_byte)
    ch._decide(50, "periodic", probe=True)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 5e6 * 10 / 16, rel=1e-6)
    state = ch.state_dict()
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_every=0), torch.nn.Linear(1, 1), [])
    other.load_state_dict(state)
    assert other.beta_scale == ch.beta_scale


def _slow_link_chooser(monkeypatch, explore: int):
    """Two compressed candidates the raw model ranks lowrank < topk on a slow link (time per
    progress), while lowrank really runs much slower than modelled: the quickstart case at 20 Mbit/s."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0),
             MethodCost("lowrank", "lowrank", 0.0, 40_000.0, 0.3, True),
             MethodCost("topk", "allgather", 0.0, 20_000.0, 0.5, True)]
    engine = _FakeEngine(NetworkModel(1e-4, 8 / 2e7))
    cfg = AutoConfig(candidates=("ddp", "lowrank", "topk"), window=2, explore=explore, probe_every=0)
    chooser = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    chooser.workload, chooser.costs = wl, costs
    chooser._decide(0, "warmup", probe=False, dense_wall_s=0.5)
    return chooser, engine


def _window(chooser, step, wall):
    chooser._window = [wall, wall]
    chooser._check_drift(step)


def test_codecs_are_timed_only_when_a_lower_bound_leads_and_the_pick_equals_timing_them_all(monkeypatch):
    """``time_codecs="on_demand"``: the warm-up's costs carry no engine codec time (0, a lower bound);
    a decision whose best is such a bound times that codec and decides again, until its best is
    timed. Oracles: the brute-force argmin over the *true* costs (codec times pinned here, returned
    by the timing function) is the pick; which codecs are timed, and in what order, is replayed by
    hand (brute-force argmin over the bounds, the leader's true cost put in, again); every codec
    left untimed could not have won (its bound is no better than the pick's true figure). Random
    cases on fast and slow links: some decide on a dense mode without timing anything, some time one
    codec and keep the bound's pick, some time more because the codec's true cost sank the bound,
    and some leave codecs untimed that timing them all would have timed."""
    import dataclasses

    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    rng = random.Random(5)
    outcomes = {"untimed": 0, "timed_kept": 0, "timed_switched": 0, "some_left_untimed": 0}
    for _ in range(150):
        wl, net, n, costs = _random_case(rng)
        costs = [c for c in costs if c.name != "randomk"]  # not an auto candidate
        true = {c.name: c.codec_s for c in costs}
        engine_names = [c.name for c in costs if c.wire != "bucket"]
        bounds = [c if c.wire == "bucket" else dataclasses.replace(c, codec_s=0.0, codec_timed=False) for c in costs]
        engine = _FakeEngine(net)
        engine.world_size = n
        chooser = AutoChooser(engine, AutoConfig(candidates=tuple(c.name for c in costs), probe_every=0,
                                                 progress_weight=1.5), torch.nn.Linear(1, 1), [])
        chooser.workload, chooser.costs = wl, list(bounds)
        timed: list[str] = []
        monkeypatch.setattr(chooser_mod, "time_method_codec",
                            lambda cand, *a, _t=timed, _c=true, **k: _t.append(cand.name) or _c[cand.name])
        chooser._group_sample = lambda grads: (torch.zeros(1), None, 0.0)
        chooser._decide(0, "warmup", probe=False)
        d = dict(wl=wl.as_dict(), alpha=net.alpha_s, beta=net.beta_s_per_byte, n=n, w=1.5)
        want = argmin_by_hand([c.as_dict() for c in costs], *d.values())
        by_bound = argmin_by_hand([c.as_dict() for c in bounds], *d.values())
        assert chooser.chosen == want
        h = chooser.history[-1]
        # the replay by hand: the leader over the bounds gets its true codec cost while it is an engine method
        now, replayed = [c.as_dict() for c in bounds], []
        while (lead := argmin_by_hand(now, *d.values())) in engine_names and lead not in replayed:
            replayed.append(lead)
            now = [next(c.as_dict() for c in costs if c.name == lead) if c["name"] == lead else c for c in now]
        assert lead == want and replayed[:1] == ([by_bound] if by_bound in engine_names else [])
        assert timed == replayed and h["timed_codecs"] == replayed  # each timed once, in the replay's order
        for c in chooser.costs:  # the timed at their true cost; the rest still bounds
            assert (c.codec_s, c.codec_timed) == ((true[c.name], True) if c.name in replayed or c.wire == "bucket"
                                                  else (0.0, False)), c
        bound_marked = {k for k, p in chooser.predictions.items() if p.details.get("lower_bound")}
        assert bound_marked == set(engine_names) - set(replayed)
        tpp = {k: p.time_per_progress_s for k, p in chooser.predictions.items()}
        assert all(tpp[k] >= tpp[want] for k in bound_marked)  # an untimed bound could not have won
        if not replayed:  # a dense mode beat every bound: nothing timed
            outcomes["untimed"] += 1
        else:
            outcomes["timed_kept" if len(replayed) == 1 else "timed_switched"] += 1
            outcomes["some_left_untimed"] += bool(bound_marked)
        if bound_marked:  # a checkpoint keeps which codecs are still bounds (the next decision times them)
            other = AutoChooser(engine, chooser.config, torch.nn.Linear(1, 1), [])
            other.load_state_dict(copy.deepcopy(chooser.state_dict()))
            assert [(c.name, c.codec_s, c.codec_timed) for c in other.costs] == \
                [(c.name, c.codec_s, c.codec_timed) for c in chooser.costs]
    assert min(outcomes.values()) >= 5, outcomes


def test_the_errors_re_measurement_skips_only_candidates_that_cannot_win(monkeypatch):
    """The ``gain`` re-measurement measures the running method's error first, then only the candidates
    whose predicted step is at most the least time per unit of progress measured so far: a candidate
    above it loses whatever its error. Oracles, on random cases: the set measured is the by-hand
    bound's (the steps by hand, the running method's new error); the pick after the re-decision is
    the brute-force argmin with the measured errors, and the same with every skipped candidate's error
    set to 0 (its best case) or left as stored: skipping changed nothing. Some cases skip candidates,
    some measure them all."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    rng = random.Random(17)
    w = 1.5
    outcomes = {"skipped_some": 0, "measured_all": 0, "switched": 0}
    for _ in range(150):
        wl, net, n, costs = _random_case(rng)
        costs = [c for c in costs if c.name != "randomk"]  # not an auto candidate
        engine = _FakeEngine(net)
        engine.world_size = n
        chooser = AutoChooser(engine, AutoConfig(candidates=tuple(c.name for c in costs), probe_every=0,
                                                 progress_weight=w, gain_drift=0.0, switch_margin=0.0),
                              torch.nn.Linear(1, 1), [])
        chooser.workload, chooser.costs = wl, list(costs)
        chooser._group_sample = lambda grads: (torch.zeros(1), None, 0.0)
        chooser._decide(0, "warmup", probe=False)
        running = chooser.chosen
        new = {c.name: (0.0 if c.name == "ddp" else rng.uniform(0.0, 2.0)) for c in costs}
        calls: list[str] = []
        monkeypatch.setattr(chooser_mod, "measure_error", lambda cand, *a, _c=calls, _n=new, **k: _c.append(cand.name)
                            or _n[cand.name])
        chooser._check_gain(5, {})
        d = (wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n)
        steps = {c.name: step_by_hand(c.as_dict(), *d) for c in costs}
        run = next(c for c in costs if c.name == running)
        bound = steps[running] * (1 + w * (new[running] if run.error_feedback else new[running] / n))
        want = {running} | {name for name, s in steps.items() if s <= bound}
        assert calls[0] == running and set(calls) == want and len(calls) == len(want), (calls, want)
        check = chooser.gain_checks[-1]
        assert set(check["delta2"]) == want and set(check["skipped"]) == {c.name for c in costs} - want
        measured = [c.as_dict() | ({"delta2": new[c.name]} if c.name in want else {}) for c in costs]
        best_case = [c | ({} if c["name"] in want else {"delta2": 0.0}) for c in measured]
        pick = argmin_by_hand(measured, *d, w)
        assert chooser.chosen == pick == argmin_by_hand(best_case, *d, w)
        # gain_drift 0: any move re-decides (none where only an exact method was measured)
        assert (chooser.history[-1]["trigger"] == "gain") == (check["moved"] > 0)
        outcomes["skipped_some" if len(want) < len(costs) else "measured_all"] += 1
        outcomes["switched"] += pick != running
    assert min(outcomes.values()) >= 5, outcomes


@pytest.mark.parametrize("explore", [1, 0])
def test_a_method_slower_than_modelled_is_charged_alone_and_the_runner_up_is_measured(monkeypatch, explore):
    chooser, engine = _slow_link_chooser(monkeypatch, explore)
    assert chooser.chosen == "lowrank" and chooser._corrections == {"ddp": 0.0}  # the warm-up ran DDP's path
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    tpp = {k: p.time_per_progress_s for k, p in chooser.predictions.items()}
    assert tpp["lowrank"] < tpp["topk"] < tpp["ddp"]
    lowrank_real = raw["lowrank"] + 0.03  # 30 ms the model does not see, lowrank's own
    _window(chooser, 4, 1.0)  # settling
    _window(chooser, 6, lowrank_real)  # lowrank's first window: its correction
    assert chooser._corrections["lowrank"] == pytest.approx(0.03)
    assert chooser.predictions["lowrank"].step_s == pytest.approx(lowrank_real)
    if explore == 0:  # no exploration: the measured methods only (ddp is far slower): stays
        assert chooser.chosen == "lowrank" and chooser.history[-1]["trigger"] == "calibration"
        return
    # topk's raw prediction still beats lowrank's measured time per progress: measured next
    assert chooser.predictions["topk"].step_s == pytest.approx(raw["topk"])  # not charged lowrank's 30 ms
    assert chooser.chosen == "topk" and engine.calls[-2:] == [("slot", "topk"), ("dense", None)]
    assert chooser._explore_left == 0
    _window(chooser, 8, 1.0)  # settling
    _window(chooser, 10, raw["topk"] + 0.002)  # topk runs 2 ms over its model: still the best
    assert chooser._corrections["topk"] == pytest.approx(0.002) and chooser.chosen == "topk"
    assert [h["trigger"] for h in chooser.history] == ["warmup", "calibration", "calibration"]
    n = len(chooser.history)
    _window(chooser, 12, raw["topk"] + 0.002)  # both measured: no further calibration
    assert len(chooser.history) == n
    # a checkpoint carries the corrections and the exploration budget
    state = chooser.state_dict()
    other, _ = _slow_link_chooser(monkeypatch, explore)
    other.load_state_dict(state)
    assert other._corrections == chooser._corrections and other._explore_left == 0 and other.chosen == "topk"
    with pytest.raises(ValueError, match="version 1"):
        other.load_state_dict({**state, "version": 1})


def test_a_calibration_explores_only_on_a_lead_of_explore_margin(monkeypatch):
    """After lowrank's window, Top-k (unmeasured) leads lowrank's measured time per unit of progress
    by some fraction L (by hand from the recorded predictions). With explore_margin just under L it is
    explored (one of the budget spent); just over L the calibration stays on lowrank and keeps the
    budget, and so does a later periodic decision on the same link; a ``gain`` re-decision takes the
    plain minimum. The oracle is the lead itself, computed from the predictions, not from the chooser."""
    from dataclasses import replace

    def run(margin):
        chooser, engine = _slow_link_chooser(monkeypatch, 1)
        chooser.config = replace(chooser.config, explore_margin=margin)
        raw = chooser.predictions["lowrank"].step_s
        _window(chooser, 4, 1.0)
        _window(chooser, 6, raw + 0.03)
        return chooser

    probe = run(0.0)
    tpp = {k: p.time_per_progress_s for k, p in probe.predictions.items()}
    lead = 1.0 - tpp["topk"] / tpp["lowrank"]
    assert probe.chosen == "topk" and 0.05 < lead < 0.95  # the premise: a real lead, explored at margin 0
    under, over = run(lead - 0.01), run(lead + 0.01)
    assert under.chosen == "topk" and under._explore_left == 0
    assert over.chosen == "lowrank" and over._explore_left == 1
    assert over.history[-1]["trigger"] == "calibration" and over.history[-1]["chosen"] == "lowrank"
    over._decide(8, "periodic", probe=True)  # the same link and predictions: the margin holds here too
    assert over.chosen == "lowrank" and over.history[-1]["trigger"] == "periodic"
    over._decide(10, "gain", probe=False)  # a gain re-decision acts on new errors: the plain minimum
    assert over.chosen == "topk"


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


def _fast_settled_chooser(monkeypatch, shift: bool):
    """The ``lm`` case at 100 Mbit/s: the warm-up's profiled compute (0.2 s) is far above a settled
    step's; ``lowrank`` is picked and runs 0.15 s under its raw prediction."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.05, (0.1,), (1_000_000,), optimizer_s=0.05)
    costs = [MethodCost("ddp", "bucket", 0.0),
             MethodCost("lowrank", "lowrank", 0.0, 40_000.0, 0.05, True),
             MethodCost("topk", "allgather", 0.005, 60_000.0, 0.2, True)]
    engine = _FakeEngine(NetworkModel(1e-4, 8 / 1e8))
    cfg = AutoConfig(candidates=("ddp", "lowrank", "topk"), window=2, probe_every=0, compute_shift=shift)
    chooser = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    chooser.workload, chooser.costs = wl, costs
    chooser._decide(0, "warmup", probe=False, dense_wall_s=0.3)
    return chooser, engine


@pytest.mark.parametrize("shift", [True, False])
def test_a_speed_up_every_measured_method_showed_lowers_the_unmeasured_predictions(monkeypatch, shift):
    from dataclasses import replace

    chooser, engine = _fast_settled_chooser(monkeypatch, shift)
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    assert chooser.chosen == "lowrank"
    _window(chooser, 4, 1.0)  # settling
    _window(chooser, 6, raw["lowrank"] - 0.15)  # lowrank's first window: 0.15 s under the raw model
    assert chooser._corrections["lowrank"] == pytest.approx(-0.15)
    want = -0.15 if shift else 0.0
    assert chooser.history[-1]["shift_s"] == pytest.approx(want) and chooser.history[-1]["settled"] == ["lowrank"]
    for name in ("ddp", "topk"):  # ddp's profile correction (0) is not a window of its own: shifted too
        assert chooser.predictions[name].step_s == pytest.approx(raw[name] + want)
    assert chooser.chosen == "lowrank"
    # the errors re-measured: lowrank's grew (0.05 -> 0.6), Top-k's did not
    chooser.costs = [replace(c, delta2=0.6) if c.name == "lowrank" else c for c in chooser.costs]
    chooser._decide(8, "gain", probe=False)
    if not shift:  # judged by the raw model, Top-k looks 0.2 s slower than it is and is never tried
        assert chooser.chosen == "lowrank"
        return
    assert chooser.chosen == "topk" and engine.calls[-2:] == [("slot", "topk"), ("dense", None)]
    _window(chooser, 10, 1.0)  # settling
    _window(chooser, 12, raw["topk"] - 0.155)
    # its correction is against the raw prediction, not the shifted one the decision used
    assert chooser._corrections["topk"] == pytest.approx(-0.155)
    assert chooser.history[-1]["settled"] == ["lowrank", "topk"]
    assert chooser.history[-1]["shift_s"] == pytest.approx(-0.15)  # the smaller of the two speed-ups
    assert chooser.chosen == "topk"  # measured, it beats lowrank per unit of progress
    state = chooser.state_dict()
    other, _ = _fast_settled_chooser(monkeypatch, shift)
    other.load_state_dict(state)
    other._decide(14, "gain", probe=False)
    chooser._decide(14, "gain", probe=False)
    assert other.chosen == chooser.chosen and other.history[-1]["shift_s"] == chooser.history[-1]["shift_s"]


def _fp16_measured_on_a_fast_link(monkeypatch, **cfg):
    """fp16 picked at a 10 Gbit/s link and measured 30 ms under the raw model (the warm-up's slow
    compute); lowrank and Top-k are the compressed candidates. Returns the chooser, its engine and
    the costs and workload."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.002, (0.002,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.0005),
             MethodCost("lowrank", "lowrank", 0.002, 40_000.0, 0.3, True),
             MethodCost("topk", "allgather", 0.001, 20_000.0, 0.5, True)]
    engine = _FakeEngine(NetworkModel(1e-4, 8 / 1e10))
    # the figures below are set for a progress weight of 1 (Top-k's measured window must beat lowrank's)
    cfg = AutoConfig(**{"candidates": ("ddp", "fp16", "lowrank", "topk"), "window": 2, "explore": 1,
                        "probe_every": 0, "family_margin": 0.0, "progress_weight": 1.0, **cfg})
    chooser = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    chooser.workload, chooser.costs = wl, costs
    chooser._decide(0, "warmup", probe=False, dense_wall_s=0.04)
    assert chooser.chosen == "fp16"
    _window(chooser, 2, 1.0)
    _window(chooser, 4, chooser.predictions["fp16"].step_s - 0.03)
    assert chooser._corrections["fp16"] == pytest.approx(-0.03) and chooser.chosen == "fp16"
    return chooser, engine, costs, wl


def test_the_shift_comes_from_the_dense_modes_measured_on_any_link(monkeypatch):
    """The changing-link case on the quickstart MLP: fp16, measured at a fast link, ran 30 ms under
    the raw model (the warm-up's slow compute). The link falls; the shift still comes from fp16
    (``shift_from``), not from ``lowrank``, picked next and only 5 ms under the raw model (its own
    cost): so Top-k, predicted with fp16's speed-up, is measured next and kept. With the shift taken
    from ``lowrank`` (the least speed-up on this link, the earlier rule) Top-k would be predicted
    25 ms slower, above ``lowrank``'s measured time per unit of progress, and never tried."""
    from auto_oracle import step_by_hand

    chooser, engine, costs, wl = _fp16_measured_on_a_fast_link(monkeypatch)
    slow = NetworkModel(1e-4, 8 / 1e7)  # 10 Mbit/s: fp16's correction is stale here
    engine.network.model = slow
    chooser._decide(10, "drift", probe=False)
    h = chooser.history[-1]
    assert h["settled"] == [] and h["shift_from"] == ["fp16"] and h["shift_s"] == pytest.approx(-0.03)
    other = h["workload"]["other_s"]

    def raw(name):  # the raw model by hand, with the warm-up's fitted `other`
        c = next(c for c in costs if c.name == name).as_dict()
        return step_by_hand(c, {**wl.as_dict(), "other_s": other}, slow.alpha_s, slow.beta_s_per_byte, 4)

    for name in ("lowrank", "topk"):
        assert chooser.predictions[name].step_s == pytest.approx(raw(name) - 0.03, rel=1e-9)
    assert chooser.chosen == "lowrank"  # the better per unit of progress by the shifted model
    _window(chooser, 12, 1.0)
    _window(chooser, 14, raw("lowrank") - 0.005)  # lowrank: only 5 ms under the raw model
    h = chooser.history[-1]
    assert h["settled"] == ["lowrank"] and h["shift_from"] == ["fp16"] and h["shift_s"] == pytest.approx(-0.03)
    eff = {k: p.step_s / p.time_per_progress_s for k, p in chooser.predictions.items()}
    lowrank_tpp = (raw("lowrank") - 0.005) / eff["lowrank"]
    assert (raw("topk") - 0.03) / eff["topk"] < lowrank_tpp < (raw("topk") - 0.005) / eff["topk"]  # the premise
    assert chooser.chosen == "topk" and h["trigger"] == "calibration"
    _window(chooser, 16, 1.0)
    _window(chooser, 18, raw("topk") - 0.02)
    assert chooser.chosen == "topk" and chooser._corrections["topk"] == pytest.approx(-0.02)


def test_a_reference_window_far_off_a_measured_prediction_re_decides_instead_of_calibrating(monkeypatch):
    """fp16 was measured on the fast link; a later (moderate drift) decision keeps it with a new
    reference due, and the link falls before its reference window: that window runs 10x its
    (measured) prediction. It is not taken as the
    reference (it would hide the fall from every later window): auto re-decides with a probe
    (trigger ``drift``, test ``reference_window``) on the slow link, although within
    ``min_interval`` of the last decision (a moderate one, not a severe one). A method never measured
    on this link, off by as much in its first window, is calibrated as usual."""
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=30)
    chooser._decide(6, "drift", probe=True, detail="window")  # fp16 kept, a new reference due
    assert chooser.chosen == "fp16" and chooser._reference is None
    fp16_pred = chooser.predictions["fp16"].step_s
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls to 10 Mbit/s
    _window(chooser, 8, 1.0)  # settling
    _window(chooser, 10, 10 * fp16_pred)
    assert chooser._reference is None
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (10, "drift", "reference_window") and chooser.chosen == "lowrank"
    assert h["network"][1] == pytest.approx(8 / 1e7)
    _window(chooser, 12, 1.0)  # settling
    lowrank_pred = chooser.predictions["lowrank"].step_s
    _window(chooser, 14, 3 * lowrank_pred)  # never measured on this link: its window calibrates it
    assert h["measured_step_s"] == pytest.approx(3 * lowrank_pred)  # taken as its window, not as a drift
    assert chooser.history[-1]["trigger"] == "calibration" and chooser._corrections["lowrank"] > 0


def test_the_periodic_re_probe_counts_from_the_last_look_at_the_link(monkeypatch):
    """probe_every (20) counts from the last decision that probed (the warm-up at step 0 here), not
    from a calibration (step 4) or a ``gain`` re-decision (step 12), which do not look at the link:
    the periodic re-probe comes at step 20, not 32; a checkpoint carries the count."""
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, probe_every=20)
    assert [(h["step"], h["trigger"]) for h in chooser.history] == [(0, "warmup"), (4, "calibration")]
    ref = chooser._reference
    chooser._decide(12, "gain", probe=False)
    # fp16 kept, and with it its reference: nothing about the link was measured, so no settling window
    assert chooser.chosen == "fp16" and chooser._reference == ref and chooser.history[-1]["kept_reference"]
    _window(chooser, 14, ref)
    _window(chooser, 16, ref)
    state = copy.deepcopy(chooser.state_dict())  # a checkpoint: saved as it is now
    _window(chooser, 18, ref)
    assert chooser.history[-1]["trigger"] == "gain"
    _window(chooser, 20, ref)
    assert (chooser.history[-1]["step"], chooser.history[-1]["trigger"]) == (20, "periodic")
    resumed, _, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, probe_every=20)
    resumed.load_state_dict(state)
    assert resumed.history[-1]["trigger"] == "gain"
    _window(resumed, 18, ref)
    _window(resumed, 20, ref)
    assert (resumed.history[-1]["step"], resumed.history[-1]["trigger"]) == (20, "periodic")


def _walls(chooser, walls):
    """Step ends with these walls ({step: wall}), as after_optimizer_step feeds the every-step test.
    A _FakeEngine plays GCEngine's part: a compressed step's closing report carries the wall handed
    to carry_wall before it (one rank here: the mean is the value); a dense step drops it."""
    for step, wall in walls.items():
        _step_end(chooser, step, wall)


def _step_end(chooser, step, wall, exchange_s=None):
    """One step's end for the every-step tests: its wall and (compressed steps) its agreed exchange."""
    from types import SimpleNamespace

    engine = chooser.engine
    if isinstance(engine, _FakeEngine):
        dense, carried, engine.carried = engine.step_is_dense(), engine.carried, None
        lost = dense and not engine.dense_carry  # GCEngine: a dense step carries it only when enabled
        engine.last_step = SimpleNamespace(step=step, dense=dense, dense_stopped=False, carried_wall_mean_s=None if lost else carried,
                                           exchange_comm_mean_s=exchange_s)
    chooser._check_severe_steps(step, wall, exchange_s)


def test_a_window_reads_its_median_from_the_carried_walls_without_an_agreement(monkeypatch):
    """The windows' median comes from the walls carried in the steps' own messages (the mean over
    ranks, read one step late), shifted one step back, with no collective of its own; a window in
    which one carried wall was lost falls back to this rank's walls, agreed (one all-reduce). The
    carried walls here say the step tripled while this rank's own walls stayed at the reference, so
    the two sources give different decisions. ``severe_steps=0``: the walls are carried all the same."""
    from lightning_gc.auto import chooser as chooser_mod

    for lose in (None, 9):
        chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=1, severe_steps=0,
                                                               patience=9)
        agreed = []
        monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a, _seen=agreed: _seen.append(values) or list(values))
        ref = chooser._reference
        assert engine.dense_carry  # the chooser enabled it although the every-step test is off
        for step in range(5, 11):  # each step's wall read at the next step's end: steps 5-9 read by step 10
            if step == lose:
                engine.dense_carry = False  # this dense step drops the wall it should carry (step 8's)
            _step_end(chooser, step, 3 * ref)
            engine.dense_carry = True
        chooser._window = [ref, ref]  # this rank's own walls of steps 9-10
        chooser._check_drift(10)
        h = chooser.history[-1]
        if lose is None:  # the carried steps 8-9: 3x the reference, a severe window; no wall was agreed
            # (the decision agrees its own duration, decide_s, after the window)
            assert not any(v in ([ref], [3 * ref]) for v in agreed), agreed
            assert (h["step"], h["trigger"], h["drift_test"]) == (10, "drift", "severe_window")
        else:  # step 8's wall (carried by step 9) was lost: agreed from this rank's walls
            assert chooser._carried_walls[8] is None and chooser._carried_walls[9] == pytest.approx(3 * ref)
            assert agreed == [[ref]] and h["step"] == 4 and chooser._drifted == 0


def test_a_decision_steps_wall_is_carried_so_the_next_window_needs_no_agreement(monkeypatch):
    """Driven through ``after_optimizer_step`` with a fake clock: a periodic re-decision that keeps
    fp16 (step 6) keeps the window running, so the next window (steps 7-8, read as 6-7) holds the
    decision step's wall. That wall is carried like any other, so the window at step 8 issues no
    agreement; without it, the window fell back to the blocking all-reduce."""
    from types import SimpleNamespace

    from lightning_gc.auto import chooser as chooser_mod

    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=1, gain_every=0, probe_every=6)
    ref = chooser._reference
    agreed: list = []
    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a, _seen=agreed: _seen.append(list(values))
                        or [float(v) for v in values])
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(chooser_mod, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    chooser._t_prev_end = clock.now

    def step_end(s: int, wall: float) -> int:
        # GCEngine's part: step s's first bucket carried the wall handed to carry_wall at the step before
        engine.last_step = SimpleNamespace(step=s, dense=True, dense_stopped=False, carried_wall_mean_s=engine.carried,
                                           exchange_comm_mean_s=None)
        engine.carried, engine.step = None, s + 1
        clock.now += wall
        before = len(agreed)
        chooser.after_optimizer_step()
        return len(agreed) - before

    for s in (5, 6, 7):
        step_end(s, ref)
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["chosen"]) == (6, "periodic", "fp16") and chooser._reference == ref
    assert step_end(8, ref) == 0  # the window of steps 7-8, read from the walls of 6-7
    assert chooser._carried_walls[6] == pytest.approx(ref) and chooser._carried_walls[7] == pytest.approx(ref)


@pytest.mark.parametrize("factor", [10.0, 0.2, 3.0, 0.3])
def test_severe_drift_is_seen_within_severe_steps_of_the_change(monkeypatch, factor):
    """fp16 runs at its reference (measured at step 4); from step 10 every step takes ``factor``
    times as long (a link that fell tenfold, or a much faster one). Each step's agreed wall is read
    at the next step's end, and the step right after a decision (5) is left out. At 8x or more
    (``ONE_STEP_FACTOR`` times the factor, slower only, under a dense mode) that one step is enough:
    step 10's wall, read at step 11 (test ``step``). At 4x or more (or a quarter) the median of the
    last 3 (steps 9-11) sees it at step 12; a smaller change needs every one of them off (steps
    10-12, at step 13). Auto re-decides there with a probe (trigger ``drift``, test ``steps``),
    where the 5-step windows would first see it at step 14 or later. A single slow step under 8x (or
    any single fast one) never sets it off, two of three at 2.5x (or 0.4x) not either (the median of
    3 at 2x, the earlier test, fired on them); ``min_interval`` holds the decision back;
    ``severe_steps=0`` turns the test off."""
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    ref = chooser._reference
    assert ref is not None and chooser._last_decision_step == 4 and chooser.chosen == "fp16"
    if factor > 1:
        engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls to 10 Mbit/s
    # one step at 8x; the median at twice the factor; or all 3
    first = 11 if factor >= 8 else 12 if factor >= 4 or factor <= 0.25 else 13
    test = "step" if factor >= 8 else "steps"
    _walls(chooser, {s: ref for s in range(5, 10)} | {s: factor * ref for s in range(10, first)})
    assert chooser.history[-1]["step"] == 4  # steps 8-10 (9-11) still hold a step at the reference
    _walls(chooser, {first: factor * ref})
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (first, "drift", test)
    if factor > 1:  # re-decided on the slow link: a compressed method
        assert chooser.chosen == "lowrank" and h["network"][1] == pytest.approx(8 / 1e7)

    one, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    _walls(one, {s: ref for s in range(5, 10)} | {10: factor * ref} | {s: ref for s in range(11, 20)})
    if factor >= 8:  # one step at 8x or more under a dense mode: seen at step 11, alone
        assert (one.history[-1]["step"], one.history[-1]["drift_test"]) == (11, "step")
    else:
        assert one.history[-1]["step"] == 4  # one slow (or fast) step: no decision

    two, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    f2 = 2.5 if factor > 1 else 0.4
    _walls(two, {s: ref for s in range(5, 10)} | {s: (ref if s % 3 == 0 else f2 * ref) for s in range(10, 30)})
    assert two.history[-1]["step"] == 4  # two of three at 2.5x (0.4x), again and again: no decision

    held, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=30)
    _walls(held, {s: ref for s in range(5, 10)} | {s: factor * ref for s in range(10, first + 1)})
    assert (held.history[-1]["step"], held.history[-1]["drift_test"]) == (first, test)  # after a calibration
    _window(held, 14, 1.0)  # settling
    new_ref = held.predictions[held.chosen].step_s
    _window(held, 16, new_ref)  # the reference
    n = len(held.history)
    _walls(held, {s: new_ref / factor for s in range(17, 44)})  # back: held until 30 steps after `first`
    assert len(held.history) == n + 1 and (held.history[-1]["step"], held.history[-1]["drift_test"]) == (first + 30, "steps")

    off, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4, severe_steps=0)
    _walls(off, {s: ref for s in range(5, 10)} | {s: factor * ref for s in range(10, 20)})
    assert off.history[-1]["step"] == 4


@pytest.mark.parametrize("case", ["marked", "compressed", "just_under", "exactly"])
def test_the_one_step_test_acts_on_a_dense_mode_only_and_not_on_a_marked_step(monkeypatch, case):
    """The one-step test (ONE_STEP_FACTOR · severe_drift = 8x the reference by default): a dense mode's
    step of exactly 8x re-decides at the next step's end, with that step's wall as the drifted figure
    (the dense window the new β is solved from). Not when the step was marked (an epoch's first step,
    a checkpoint saved before it: mark_wall, the strategy's calls): the test of the last 3 sees the
    slow link a step later. Not under a compressed method, nor at 7.9x."""
    from lightning_gc.auto import chooser as chooser_mod

    assert chooser_mod.ONE_STEP_FACTOR == 4.0
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    ref = chooser._reference
    seen = []
    real = chooser._decide
    monkeypatch.setattr(chooser, "_decide", lambda *a, **kw: seen.append(kw.get("drift_wall_s")) or real(*a, **kw))
    if case == "compressed":
        chooser._apply("lowrank")
        chooser.chosen = "lowrank"
    _walls(chooser, {s: ref for s in range(5, 10)})
    if case == "marked":
        engine.step = 10  # the step about to run: its wall holds the epoch's boundary (or a checkpoint)
        chooser.mark_wall()
    factor = 7.9 if case == "just_under" else 8.0
    # the marked case: the link did fall, steps 10 and 11 are both slow
    _walls(chooser, {10: factor * ref, 11: factor * ref if case == "marked" else ref})
    h = chooser.history[-1]
    if case == "exactly":
        assert (h["step"], h["trigger"], h["drift_test"]) == (11, "drift", "step")
        assert seen == [pytest.approx(8.0 * ref)]  # step 10's wall alone, not the median of the last 3
    else:
        assert h["step"] == 4 and seen == []
    if case == "marked":  # step 11's wall, read at 12, is not marked: the two tests see the fall there
        _walls(chooser, {12: 8.0 * ref})
        assert (chooser.history[-1]["step"], chooser.history[-1]["drift_test"]) == (12, "steps")


def test_a_dense_modes_wall_agreed_at_once_decides_at_the_slow_step_itself(monkeypatch):
    """On a group that takes the direct exchange (up to 8 ranks off NCCL: ``_dense_walls_direct``) a
    dense mode's wall is agreed at its own step's end, by an agreement of its own, instead of riding
    in the next step's first bucket: the one-step test acts at the slow step itself (10, where the
    carried wall is read at 11), nothing is handed to ``carry_wall``, and every step's agreed wall
    is this rank's here (one process: the agreement is the identity). Once a compressed method runs,
    its wall rides in the closing report again (``carry_wall``)."""
    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.candidates import candidate

    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    chooser._dense_walls_direct = True
    agreed: list = []
    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a, _seen=agreed: _seen.append(list(values))
                        or [float(v) for v in values])
    ref = chooser._reference
    for s in range(5, 10):
        _walls(chooser, {s: ref * (1 + s / 100)})
        assert engine.carried is None and agreed[-1] == [pytest.approx(ref * (1 + s / 100))]
        assert chooser._carried_walls[s] == pytest.approx(ref * (1 + s / 100))  # the window reads it at once
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls to 10 Mbit/s (what the probe finds)
    _walls(chooser, {10: 8.0 * ref})
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (10, "drift", "step")
    assert candidate(chooser.chosen).compressor is not None  # a compressed method on the fallen link
    _walls(chooser, {11: 0.5 * ref})
    assert engine.carried == pytest.approx(0.5 * ref)  # carried in its closing report, not agreed alone


def test_a_step_the_link_canary_stopped_re_decides_at_once_on_its_beta(monkeypatch):
    """Under a dense mode on a group that takes the direct exchange, the engine sings the link canary
    before each step (at the start of its closure; GCEngine.sing_canary, played here by the fake
    engine), carrying nothing (NaN): each step's wall is agreed at its own end, as without the canary,
    so a fall inside a step is seen there (the one-step test), not only at the next canary. A step
    the canary stopped (StepStats.dense_stopped) makes auto re-decide at that step's end, whatever
    ``min_interval`` says (30 here; the last decision at step 4), on β from the canary (its time on
    the fastest rank less α, over the N-1 = 3 copies of its 64 KiB each rank sent; no probe):
    10 Mbit/s makes lowrank the pick, no canary is sung before the compressed steps after it, and
    the stopped step enters no window. A canary never gives a link faster than the model's.
    Oracles: β written out by hand; the history; the walls agreed."""
    import time

    from lightning_gc.engine.dense_stop import LinkCanary
    from lightning_gc.engine.stats import StepStats

    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=30)
    chooser._dense_walls_direct, chooser.canary = True, LinkCanary()
    engine.network.pinned = False
    sung: list[tuple[int, float]] = []  # (the step about to run, the wall it carries)
    engine.sing_canary = lambda carry: sung.append((engine.step, carry))
    alpha, ref = engine.network.model.alpha_s, chooser._reference
    for s in range(5, 10):
        engine.step = s
        chooser.wrap_closure(lambda: None)()  # the canary before step s
        engine.step = s + 1
        engine.last_step = StepStats(step=s, dense=True)
        chooser._t_prev_end = time.perf_counter() - ref * (1 + s / 100)
        chooser.after_optimizer_step()
        # step s's wall, agreed at its own end (the mean over ranks: one rank here)
        assert chooser._recent_pending is None and chooser._carried_walls[s] == pytest.approx(ref * (1 + s / 100),
                                                                                              rel=1e-3)
    assert [a for a, _ in sung] == [5, 6, 7, 8, 9] and chooser.history[-1]["step"] == 4
    assert all(c != c for _, c in sung)  # every canary carried NaN: nothing rides in it
    window = list(chooser._window)
    engine.step = 10
    chooser.wrap_closure(lambda: None)()
    engine.step = 11
    engine.last_step = StepStats(step=10, dense=True, dense_stopped=True, dense_check_s=0.16,
                                 dense_check_predicted_s=2e-4, dense_check_bytes=65536)
    chooser.after_optimizer_step()
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"], h["network_source"]) == (10, "drift", "canary", "canary")
    want = (0.16 - alpha) / (3 * 65536)  # 3 x 64 KiB at 10 Mbit/s (0.157 s), plus alpha
    assert h["network"] == [alpha, pytest.approx(want)] and engine.network.model.beta_s_per_byte == pytest.approx(want)
    assert chooser.chosen == "lowrank" and window and chooser._window == []  # reset by the decision; 10 not in it
    engine.step = 11
    chooser.wrap_closure(lambda: None)()  # a compressed method runs: no canary
    assert len(sung) == 6
    # a canary faster than the model's β (the fastest rank was early) never makes the link faster
    fast, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=30)
    fast.canary = LinkCanary()
    engine.network.pinned = False
    beta = engine.network.model.beta_s_per_byte
    fast._decide(10, "drift", probe=True, check_link=False, canary_s=1e-5, detail="canary")
    assert fast.history[-1]["network"][1] == beta


def test_with_the_canary_on_a_fall_inside_a_dense_step_is_acted_on_at_that_steps_end(monkeypatch):
    """The link falls during step 8 (its canary, sung before it, saw the fast link): step 8 runs 10x
    its reference. Its wall, agreed at its own end, makes the one-step test re-decide there (test
    ``step``), and no canary is sung before step 9, which runs the compressed pick: the stopped step
    the canary would have added after the slow one never comes. Oracle: the history, the canaries."""
    import time

    from lightning_gc.engine.dense_stop import LinkCanary
    from lightning_gc.engine.stats import StepStats

    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=30)
    # the fake engine's network stays pinned, so the re-decision reads the fallen link from it (no probe)
    chooser._dense_walls_direct, chooser.canary = True, LinkCanary()
    sung: list[int] = []
    engine.sing_canary = lambda carry: sung.append(engine.step)
    ref = chooser._reference
    for s in range(5, 10):
        engine.step = s
        chooser.wrap_closure(lambda: None)()
        if s == 8:
            engine.network.model = NetworkModel(engine.network.model.alpha_s, 8 / 1e7)  # 10 Mbit/s, mid-step
        engine.step = s + 1
        engine.last_step = StepStats(step=s, dense=chooser.chosen == "fp16")
        chooser._t_prev_end = time.perf_counter() - (10 * ref if s == 8 else ref)
        chooser.after_optimizer_step()
        if s == 8:
            h = chooser.history[-1]
            assert (h["step"], h["trigger"], h["drift_test"]) == (8, "drift", "step"), h
            assert chooser.chosen == "lowrank"
    assert sung == [5, 6, 7, 8]  # none before step 9: a compressed method runs


@pytest.mark.parametrize("fell", [True, False])
def test_a_gain_move_from_a_compressed_method_to_a_dense_mode_times_the_link_first(monkeypatch, fell):
    """lowrank runs after the link fell (a drift decision on 10 Mbit/s); then the stored network says the
    link is fast again, and a gain re-decision (no probe) would move to fp16. Before it does, one canary
    message (LinkCanary's defaults: 64 KiB to each of the 3 others) times the link. If it fell (0.16 s
    against the model's fraction of a millisecond), auto re-decides on β from that message (test
    ``switch_check``; β by hand) and stays compressed; if not, fp16 is applied as the gain decision
    chose. A move between compressed methods, or one that keeps the method, sends nothing."""
    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.engine.dense_stop import CanaryResult, LinkCanary

    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # 10 Mbit/s, pinned in the fake engine: no probe
    chooser._decide(6, "drift", probe=True, detail="step")
    assert chooser.chosen == "lowrank"
    sung: list[int] = []
    fast = NetworkModel(1e-4, 8 / 1e10)

    def sing(canary, carry, network, group, world_size, device):
        sung.append(canary.nbytes)
        predicted = canary.predicted_s(network, world_size)
        return CanaryResult(fell, 0.16 if fell else predicted, predicted, float("nan"), 2 if fell else 1)

    monkeypatch.setattr(chooser_mod.dense_stop, "sing", sing)
    engine.exchange_group, engine.device = None, None
    chooser._switch_check = LinkCanary()
    engine.network.pinned = False  # as on a real group: the check, and a fall's β, come from the canary
    chooser.network = fast  # what the chooser last saw: the link back at 10 Gbit/s
    n = len(chooser.history)
    chooser._decide(40, "gain", probe=False)
    assert sung == [65536]
    if fell:
        h = chooser.history[-1]
        assert len(chooser.history) == n + 1
        assert (h["step"], h["trigger"], h["drift_test"], h["network_source"]) == (40, "drift", "switch_check", "canary")
        want = (0.16 - fast.alpha_s) / (3 * 65536)
        assert h["network"][1] == pytest.approx(want) and chooser.chosen == "lowrank"
        assert h["switch_check"]["fell"] is True and h["switch_check"]["bytes"] == 65536
    else:
        h = chooser.history[-1]
        assert (h["step"], h["trigger"], h["chosen"], h["previous"]) == (40, "gain", "fp16", "lowrank")
        assert h["switch_check"]["fell"] is False and chooser.chosen == "fp16"
        # a decision that keeps a dense mode, or picks one from a dense mode, sends nothing
        chooser._decide(41, "gain", probe=False)
        assert sung == [65536] and chooser.history[-1]["switch_check"] is None


def test_before_its_reference_a_calibrated_method_is_judged_by_its_prediction_every_step(monkeypatch):
    """A moderate drift decision at step 6 keeps fp16 (measured on this link): no reference until its
    second window. The link falls at once; steps from 8 on (7 is the switch's step, left out) run
    10x fp16's prediction, which carried its own correction: at step 9, where step 8's wall is
    read, auto re-decides (test ``step``: one step of a dense mode, 8x or more; the median of the
    last 3 would have seen it at step 11). The method it moves to, never measured on the slow link,
    runs 3x its raw prediction: that is what its first window calibrates, not a drift, and nothing
    re-decides."""
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    chooser._decide(6, "drift", probe=True, detail="window")
    assert chooser.chosen == "fp16" and chooser._reference is None
    fp16_pred = chooser.predictions["fp16"].step_s
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)
    _walls(chooser, {s: 10 * fp16_pred for s in range(7, 9)})
    assert chooser.history[-1]["step"] == 6
    _walls(chooser, {9: 10 * fp16_pred})
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (9, "drift", "step") and chooser.chosen == "lowrank"
    lowrank_pred = chooser.predictions["lowrank"].step_s
    _walls(chooser, {s: 3 * lowrank_pred for s in range(10, 30)})
    assert chooser.history[-1]["step"] == 9

    # one step at 8x fp16's (calibrated) prediction before the reference: the one-step test, at once
    one, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    one._decide(6, "drift", probe=True, detail="window")
    pred = one.predictions["fp16"].step_s
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls
    _walls(one, {7: pred, 8: 8.0 * pred})
    assert one.history[-1]["step"] == 6 and one._reference is None
    _walls(one, {9: pred})  # step 8's wall, read here
    assert (one.history[-1]["step"], one.history[-1]["drift_test"]) == (9, "step") and one.chosen == "lowrank"
    # ... but not at 7.9x, nor for a method never measured in a window on this link
    under, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    under._decide(6, "drift", probe=True, detail="window")
    _walls(under, {7: pred, 8: 7.9 * pred, 9: pred})
    assert under.history[-1]["step"] == 6

    # two steps of three at 3x fp16's prediction, again and again (a busy host), before the reference: nothing
    two, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4)
    two._decide(6, "drift", probe=True, detail="window")
    pred = two.predictions["fp16"].step_s
    _walls(two, {s: (pred if s % 3 == 0 else 3 * pred) for s in range(7, 16)})
    assert two.history[-1]["step"] == 6 and two._reference is None


def _lowrank_with_an_exchange_reference(monkeypatch, exchange_s, **cfg):
    """The link fell to 10 Mbit/s; a drift decision at step 6 moved fp16 to lowrank; its reference
    window (steps 9-12, the calibration at 12 keeps it) ran its predicted step, each step with
    ``exchange_s`` in the compressed exchange (agreed; or one value per step, a list)."""
    chooser, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4, explore=0, **cfg)
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)
    chooser._decide(6, "drift", probe=True)
    assert chooser.chosen == "lowrank"
    _window(chooser, 8, 1.0)  # settling
    step_s = chooser.predictions["lowrank"].step_s
    per_step = exchange_s if isinstance(exchange_s, list) else [exchange_s] * 4
    for s, x in zip(range(9, 13), per_step):
        _step_end(chooser, s, step_s, x)
    _window(chooser, 12, step_s)
    assert [(h["step"], h["trigger"]) for h in chooser.history][-1] == (12, "calibration")
    assert chooser.chosen == "lowrank" and chooser._reference == pytest.approx(step_s)
    return chooser, engine, step_s


def test_a_link_that_came_back_is_seen_in_a_compressed_methods_exchange(monkeypatch):
    """lowrank's reference window (55.5 ms steps, 20 ms of them in its exchange) on the fallen link;
    from step 15 the link is back at 10 Gbit/s: the step falls to 45 ms (under the 2x step test),
    the exchange to 2 ms. The median of the last 3 exchanges (14-16) is 10x off at step 16, and 18
    ms is over a tenth of the step: auto re-decides there (test ``exchange``) and the probe's fast
    link puts it back on fp16. A checkpoint carries the exchange reference. An exchange that moves
    by as large a factor but by less than a tenth of the step (4 ms → 1 ms), or for one step only,
    or that gets slower (a shaper's burst allowance spent), re-decides nothing; nor does anything
    with ``severe_steps=0``."""
    chooser, engine, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02)
    assert chooser._reference_exchange == pytest.approx(0.02)
    state = copy.deepcopy(chooser.state_dict())
    engine.network.model = NetworkModel(1e-4, 8 / 1e10)
    for s, (w, x) in {13: (step_s, 0.02), 14: (step_s, 0.02), 15: (0.045, 0.002)}.items():
        _step_end(chooser, s, w, x)
    assert chooser.history[-1]["step"] == 12
    _step_end(chooser, 16, 0.045, 0.002)
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (16, "drift", "exchange") and chooser.chosen == "fp16"
    assert h["network"][1] == pytest.approx(8 / 1e10)

    resumed, engine, _, _ = _fp16_measured_on_a_fast_link(monkeypatch, min_interval=4, explore=0)
    resumed.load_state_dict(state)
    assert resumed._reference_exchange == pytest.approx(0.02)
    engine.network.model = NetworkModel(1e-4, 8 / 1e10)
    for s, (w, x) in {13: (step_s, 0.02), 14: (step_s, 0.02), 15: (0.045, 0.002), 16: (0.045, 0.002)}.items():
        _step_end(resumed, s, w, x)
    assert (resumed.history[-1]["step"], resumed.history[-1]["drift_test"]) == (16, "exchange")  # as uninterrupted

    slower, _, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02)
    for s in range(13, 30):
        _step_end(slower, s, step_s, 0.2)  # 10x slower: the step test's business, not this one's
    assert slower.history[-1]["step"] == 12

    small, _, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.004)
    for s in range(13, 30):
        _step_end(small, s, step_s, 0.001)  # 4x, but 3 ms of a 55 ms step
    assert small.history[-1]["step"] == 12

    once, _, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02)
    for s in range(13, 30):
        _step_end(once, s, step_s, 0.002 if s == 20 else 0.02)
    assert once.history[-1]["step"] == 12

    off, _, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02, severe_steps=0)
    assert off._reference_exchange is None
    for s in range(13, 30):
        _step_end(off, s, 0.045, 0.002)
    assert off.history[-1]["step"] == 12


def test_the_exchange_reference_is_the_reference_windows_fastest_exchange(monkeypatch):
    """A small exchange on a steady shaped link has two modes (measured: Top-k at 20 Mbit/s). The
    reference window caught the slow one in 3 of its 4 steps (20 ms) and the fast one once (8 ms):
    the reference is 8 ms, so later steps in the fast mode (2.5x under the window's median, by 12 ms,
    more than a tenth of the step) re-decide nothing; a link that came back (0.5 ms) still does."""
    steady, _, step_s = _lowrank_with_an_exchange_reference(monkeypatch, [0.02, 0.008, 0.02, 0.02])
    assert steady._reference_exchange == pytest.approx(0.008)
    for s in range(13, 40):
        _step_end(steady, s, step_s, 0.008)
    assert steady.history[-1]["step"] == 12
    back, _, step_s = _lowrank_with_an_exchange_reference(monkeypatch, [0.02, 0.008, 0.02, 0.02])
    for s in range(13, 16):
        _step_end(back, s, step_s, 0.0005)
    h = back.history[-1]  # step 13 is left out (the step after the calibration): 12, 14, 15 at step 15
    assert (h["step"], h["trigger"], h["drift_test"]) == (15, "drift", "exchange")


@pytest.mark.parametrize("check_s", [0.08, 0.5])
def test_a_periodic_decision_that_kept_the_method_on_an_unchanged_link_keeps_its_references(monkeypatch, check_s):
    """lowrank measured on the slow link (reference step and exchange); the periodic re-probe at step
    20 checks the link. Unchanged (0.08 s, as at the probe): lowrank is kept with its references, no
    settling window, and when the link comes back right after it (exchanges 10x faster from step 21)
    the exchange test sees it at step 23 against the old reference. Moved (0.5 s, not bandwidth-bound
    per the stub's slope 0): the full probe measured a new link, so the references start again."""
    from lightning_gc.auto.chooser import AutoChooser

    chooser, engine, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02)
    engine.network.pinned = False
    engine.adopt_network = lambda net: None
    chooser.probe_bytes, chooser.probe_time_s = 100_000, 0.08
    monkeypatch.setattr(AutoChooser, "_check_link", lambda self: (check_s, 0.0))
    monkeypatch.setattr(AutoChooser, "_probe", lambda self, latency=None: self.network)
    ref, ref_x = chooser._reference, chooser._reference_exchange
    for s in range(13, 20):
        _step_end(chooser, s, step_s, 0.02)
    chooser._decide(20, "periodic", probe=True)
    h = chooser.history[-1]
    assert (h["trigger"], h["chosen"], h["previous"]) == ("periodic", "lowrank", "lowrank")
    if check_s == 0.08:
        assert h["kept_reference"] and h["measured_step_s"] == ref
        assert (chooser._reference, chooser._reference_exchange, chooser._settling) == (ref, ref_x, False)
        for s in range(21, 24):
            _step_end(chooser, s, step_s, 0.002)
        h = chooser.history[-1]
        assert (h["step"], h["trigger"], h["drift_test"]) == (23, "drift", "exchange")
    else:
        assert not h["kept_reference"] and h["measured_step_s"] is None
        assert (chooser._reference, chooser._reference_exchange, chooser._settling) == (None, None, True)


@pytest.mark.parametrize("test", ["exchange", "steps"])
def test_a_faster_exchange_checks_the_link_before_probing_and_a_severe_step_probes_at_once(monkeypatch, test):
    """On an unpinned network: the exchange test's decision first times the check message, and a
    check within probe_check of the last probe keeps the stored network without a probe (a shaper's
    burst on an unchanged link); the step test's decision (a fall or rise of 2x or more) probes at once."""
    from lightning_gc.auto.chooser import AutoChooser

    chooser, engine, step_s = _lowrank_with_an_exchange_reference(monkeypatch, 0.02)
    engine.network.pinned = False
    engine.adopt_network = lambda net: None
    chooser.probe_bytes, chooser.probe_time_s = 100_000, 0.08
    calls = []
    monkeypatch.setattr(AutoChooser, "_check_link", lambda self: calls.append("check") or (0.08, 8e-7))
    monkeypatch.setattr(AutoChooser, "_probe", lambda self, latency=None: calls.append("probe") or self.network)
    stored = chooser.network
    walls = {"exchange": (step_s, 0.002), "steps": (5 * step_s, 0.02)}[test]
    for s in range(13, 17):
        _step_end(chooser, s, *walls)
    h = chooser.history[-1]
    # the exchange test reads this step's agreed time (step 13, right after the calibration at 12, is left
    # out: the median over 12, 14, 15 is fast at 15); the step test reads each wall one step later (at 16,
    # where two of the last 3 are 5x: the median at twice the factor)
    assert (h["step"], h["trigger"], h["drift_test"]) == ({"exchange": 15, "steps": 16}[test], "drift", test)
    if test == "exchange":
        assert calls == ["check"] and h["network_source"] == "check" and h["link_check"]["unchanged"]
        assert chooser.network == stored and chooser.chosen == "lowrank"
    else:
        assert calls == ["probe"] and h["link_check"] is None and h["network_source"] == "probe"


def test_every_step_severe_test_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match=r"auto_severe_steps=1 would re-decide on one slow step"):
        AutoConfig(severe_steps=1)
    with pytest.raises(ValueError, match=r"auto_severe_steps=-1 must be an integer >= 0"):
        AutoConfig(severe_steps=-1)
    assert AutoConfig(severe_steps=0).severe_steps == 0


def test_the_state_is_a_snapshot(monkeypatch):
    """state_dict() is the state of its moment: later decisions do not change a dict already taken."""
    chooser, _, _, _ = _fp16_measured_on_a_fast_link(monkeypatch)
    state = chooser.state_dict()
    n = len(state["history"])
    chooser._decide(12, "gain", probe=False)
    chooser.history[0]["chosen"] = "changed"
    assert len(state["history"]) == n and state["history"][0]["chosen"] == "fp16"


def test_compute_shift_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match="auto_compute_shift"):
        AutoConfig(compute_shift=1)


def test_a_severe_drift_re_decides_after_one_window_a_moderate_one_waits_for_patience(monkeypatch):
    """A window at >= severe_drift x the reference (either way) re-decides at once; +50 % waits for
    ``patience`` windows; ``min_interval`` still holds; ``severe_drift=0`` turns the shortcut off."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True)]

    def settled(severe, min_interval=1):
        engine = _FakeEngine(NetworkModel(0.0, 8 / 1e13))
        cfg = AutoConfig(candidates=("ddp", "topk"), window=2, drift=0.3, patience=3, min_interval=min_interval,
                         probe_every=0, severe_drift=severe)
        ch = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
        ch.workload, ch.costs = wl, costs
        ch._decide(0, "warmup", probe=False)
        ref = ch.predictions["ddp"].step_s
        _window(ch, 2, 9.0)  # settling
        _window(ch, 4, ref)  # reference (calibration: no error, no switch)
        assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
        return ch, ref

    ch, ref = settled(2.0)
    _window(ch, 6, 1.5 * ref)  # moderate: 1 of 3 windows
    _window(ch, 8, 1.9 * ref)  # just under 2x: 2 of 3
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    _window(ch, 10, 1.0 * ref)  # back: the count restarts
    _window(ch, 12, 2.0 * ref)  # 2x: at once, although only one window drifted
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration", "drift"]

    ch, ref = settled(2.0)
    _window(ch, 6, 0.5 * ref)  # twice as fast counts as well (a link that came back)
    assert [h["trigger"] for h in ch.history][-1] == "drift"

    ch, ref = settled(0)
    for step in (6, 8):
        _window(ch, step, 10 * ref)  # off: even 10x waits for patience
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    _window(ch, 10, 10 * ref)
    assert [h["trigger"] for h in ch.history][-1] == "drift"

    ch, ref = settled(2.0, min_interval=50)
    for step in (6, 8, 10):
        _window(ch, step, 1.5 * ref)  # moderate, 3 windows (patience): within min_interval of any decision
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    _window(ch, 12, 10 * ref)  # severe: min_interval holds it only after another severe re-decision
    assert [(h["step"], h["trigger"], h["drift_test"]) for h in ch.history[2:]] == [(12, "drift", "severe_window")]
    _window(ch, 14, 1.0)  # settling
    _window(ch, 16, ref)  # the reference
    _window(ch, 18, 10 * ref)  # 6 steps after the severe re-decision at 12: held
    assert len(ch.history) == 3

    with pytest.raises(ValueError, match=r"auto_severe_drift=1.0 must be 0 \(off\) or a factor > 1"):
        AutoConfig(severe_drift=1.0)


def test_a_correction_holds_for_the_link_it_was_measured_on(monkeypatch):
    """The quickstart run on a 1 Gbit/s -> 10 Mbit/s -> 1 Gbit/s link: ``lowrank`` runs far under its
    prediction on the slow link; carried back to the fast link that correction made it look faster
    than DDP, and auto stayed on it at 2.3x DDP's step. A correction is used only on a link within
    a factor 2 of the one it was measured on; a method already measured there keeps its newest
    figure, re-deciding only after a switch made on its older figure."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    fast, slow = NetworkModel(1e-4, 8 / 1e9), NetworkModel(1e-4, 8 / 1e7)
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("lowrank", "lowrank", 0.06, 40_000.0, 0.3, True)]
    engine = _FakeEngine(fast)
    cfg = AutoConfig(candidates=("ddp", "lowrank"), window=2, explore=0, probe_every=0, severe_drift=0)
    ch = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    ch.workload, ch.costs = wl, costs
    ch._decide(0, "warmup", probe=False)
    raw_fast = {k: p.step_s for k, p in ch.predictions.items()}  # nothing measured yet: the raw model
    assert ch.chosen == "ddp"
    _window(ch, 2, 9.0)
    _window(ch, 4, raw_fast["ddp"] + 0.002)  # ddp measured 2 ms over the model on the fast link
    assert ch._corrections == {"ddp": pytest.approx(0.002)}

    engine.network.model = slow
    ch._decide(6, "periodic", probe=True)
    raw_slow = {k: p.step_s for k, p in ch.predictions.items()}
    assert ch.chosen == "lowrank"
    _window(ch, 8, 9.0)
    _window(ch, 10, raw_slow["lowrank"] - 0.05)  # 50 ms under the model on the slow link
    assert ch._corrections["lowrank"] == pytest.approx(-0.05)
    assert ch.chosen == "lowrank" and ch.history[-1]["trigger"] == "calibration"
    # with -50 ms lowrank would look faster than DDP on the fast link: the premise of the test
    assert (raw_fast["lowrank"] - 0.05) * 1.3 < raw_fast["ddp"] + 0.002 < raw_fast["lowrank"]

    engine.network.model = fast
    ch._decide(12, "periodic", probe=True)
    assert ch.chosen == "ddp"
    assert ch.predictions["lowrank"].step_s == pytest.approx(raw_fast["lowrank"])  # judged by the raw model
    assert ch.predictions["ddp"].step_s == pytest.approx(raw_fast["ddp"] + 0.002)  # its fast-link correction holds
    n = len(ch.history)
    _window(ch, 14, 9.0)
    # ddp measured again, faster: the newer figure. The periodic decision switched to it on its older
    # figure, so this first window decides once more (a calibration), and keeps it
    _window(ch, 16, 0.5 * raw_fast["ddp"])
    assert ch._corrections["ddp"] == pytest.approx(-0.5 * raw_fast["ddp"]) and len(ch.history) == n + 1
    assert (ch.history[-1]["trigger"], ch.history[-1]["chosen"]) == ("calibration", "ddp")
    _window(ch, 18, 0.5 * raw_fast["ddp"])  # measured again on the same link, no switch before: no re-decision
    assert len(ch.history) == n + 1

    engine.network.model = slow  # back on the slow link, lowrank's slow-link correction counts again
    ch._decide(18, "periodic", probe=True)
    assert ch.chosen == "lowrank"
    assert ch.predictions["lowrank"].step_s == pytest.approx(raw_slow["lowrank"] - 0.05)

    state = ch.state_dict()  # the tags survive a checkpoint
    other = AutoChooser(_FakeEngine(slow), cfg, torch.nn.Linear(1, 1), [])
    other.load_state_dict(state)
    assert other._valid_corrections() == ch._valid_corrections()


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


# --------------------------------------------------------------------------- the bandwidth probe's size
BURST = 64 * 1024  # the bench shaper's token bucket (lightning_gc/bench/netns.py: tc_burst_bytes)


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
    from lightning_gc.auto.chooser import probe_bandwidth, probe_start_bytes

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


def _dense_pair_chooser(monkeypatch, margin: float):
    """ddp and fp16 (and Top-k) on a fast link, after a warm-up whose DDP step was slow (its first
    steps), so the model puts DDP well above the 16-bit hook: the ``gpt`` case at 1 Gbit/s."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    wl = Workload(0.02, (0.03, 0.03), (400_000, 400_000))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.001),
             MethodCost("topk", "allgather", 0.004, 64_000.0, 0.6, True)]
    engine = _FakeEngine(NetworkModel(1e-4, 8 / 8e8))
    cfg = AutoConfig(candidates=("ddp", "fp16", "topk"), window=2, explore=0, probe_every=0, family_margin=margin)
    chooser = AutoChooser(engine, cfg, torch.nn.Linear(1, 1), [])
    chooser.workload, chooser.costs = wl, costs
    chooser._decide(0, "warmup", probe=False, dense_wall_s=0.2)  # the profiled DDP step: 200 ms
    return chooser, engine


@pytest.mark.parametrize("margin", [0.15, 0.0])
def test_a_dense_sibling_within_the_margin_runs_one_window_and_the_faster_is_kept(monkeypatch, margin):
    chooser, engine = _dense_pair_chooser(monkeypatch, margin)
    assert chooser.chosen == "fp16" and chooser._corrections == {"ddp": 0.0}
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    assert raw["fp16"] < raw["ddp"] == pytest.approx(0.2)  # ddp: the profiled step itself
    fp16_real = raw["fp16"] - 0.06  # the steady 16-bit step: 60 ms under the warm-up-based model
    # by hand: ddp's raw prediction plus fp16's correction, against fp16's measured step (both exact
    # enough that progress is ~1: compare per unit of progress as the rule does)
    tpp = {k: p.time_per_progress_s / p.step_s for k, p in chooser.predictions.items()}
    ddp_moved = (raw["ddp"] + (fp16_real - raw["fp16"])) * tpp["ddp"]
    within = ddp_moved <= (1 + margin) * fp16_real * tpp["fp16"]
    assert within == (margin > 0)  # the premise: the 15 % margin admits DDP, 0 does not
    _window(chooser, 2, 1.0)  # settling
    _window(chooser, 4, fp16_real)  # fp16's first window
    assert chooser._corrections["fp16"] == pytest.approx(-0.06)
    if not within:  # no trial: the calibration keeps fp16 among the measured (explore=0)
        assert chooser.chosen == "fp16" and [h["trigger"] for h in chooser.history] == ["warmup", "calibration"]
        return
    assert chooser.chosen == "ddp" and engine.calls[-1] == ("dense", "fp32")
    assert [h["trigger"] for h in chooser.history] == ["warmup", "family"]
    state = copy.deepcopy(chooser.state_dict())  # a checkpoint taken during the trial (saved as it is now)
    _window(chooser, 6, 1.0)  # settling
    ddp_real = fp16_real - 0.011  # DDP really runs 11 ms faster (gpt at 1 Gbit/s: 126 vs 137 ms)
    _window(chooser, 8, ddp_real)
    assert chooser._corrections["ddp"] == pytest.approx(ddp_real - raw["ddp"])
    assert chooser.chosen == "ddp" and [h["trigger"] for h in chooser.history] == ["warmup", "family", "calibration"]
    assert chooser.predictions["ddp"].step_s == pytest.approx(ddp_real)
    assert chooser.predictions["fp16"].step_s == pytest.approx(fp16_real)
    n = len(chooser.history)
    _window(chooser, 10, ddp_real)  # both measured: no further trial or calibration
    assert len(chooser.history) == n

    other, _ = _dense_pair_chooser(monkeypatch, margin)
    other.load_state_dict(state)
    assert other.in_family_trial and other.chosen == "ddp" and other._windowed() == {"fp16"}
    _window(other, 6, 1.0)
    _window(other, 8, fp16_real + 0.02)  # this time DDP is the slower one: back to fp16
    assert other.chosen == "fp16" and other.history[-1]["trigger"] == "calibration"
    assert not other.in_family_trial


@pytest.mark.parametrize("lead, margin, switches", [(0.02, 0.03, False), (0.05, 0.03, True), (0.02, 0.0, True)])
def test_a_measured_method_replaces_the_running_measured_one_only_on_a_lead_of_switch_margin(
        monkeypatch, lead, margin, switches):
    """fp16 measured, then DDP's trial window measured faster, so DDP runs (as above). The host then
    slows: DDP's fresh figure is such that fp16's older one leads it by ``lead`` per unit of progress
    (set by hand). A periodic decision switches to fp16 only if that lead reaches ``switch_margin``;
    else DDP stays and the history names fp16 as held off (the ``gpt`` ping-pong at 1 Gbit/s)."""
    from dataclasses import replace

    chooser, engine = _dense_pair_chooser(monkeypatch, 0.15)
    chooser.config = replace(chooser.config, switch_margin=margin)
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    _window(chooser, 2, 1.0)
    _window(chooser, 4, fp16_real)
    _window(chooser, 6, 1.0)
    _window(chooser, 8, fp16_real - 0.011)
    assert chooser.chosen == "ddp" and chooser._windowed() == {"ddp", "fp16"}
    per_progress = {k: p.time_per_progress_s / p.step_s for k, p in chooser.predictions.items()}
    ddp_now = fp16_real * per_progress["fp16"] / (1.0 - lead) / per_progress["ddp"]
    chooser._corrections["ddp"] += ddp_now - chooser.predictions["ddp"].step_s
    calls = len(engine.calls)
    chooser._decide(9, "periodic", probe=False)
    h = chooser.history[-1]
    tpp = {k: v["time_per_progress_s"] for k, v in h["predictions"].items()}
    assert 1.0 - tpp["fp16"] / tpp["ddp"] == pytest.approx(lead)  # the premise, from the recorded predictions
    assert (h["chosen"], h["previous"]) == ("fp16" if switches else "ddp", "ddp")
    assert h["held_by_margin"] == (None if switches else "fp16")
    assert (engine.calls[calls:] == [("dense", "fp16")]) == switches and (len(engine.calls) == calls) != switches


@pytest.mark.parametrize("ddp_over_fp16, kept, held", [
    (1.014, "fp16", None),  # DDP's trial 1.4 % slower (gpt at 1 Gbit/s: 133.9 against 132.0 ms): fp16 back
    (0.975, "fp16", "ddp"),  # 2.5 % faster, under switch_margin: fp16, the mode the trial interrupted, holds
    (0.96, "ddp", None),  # 4 % faster: DDP replaces it
])
def test_the_calibration_after_a_dense_siblings_trial_keeps_the_interrupted_mode_unless_the_sibling_leads_by_switch_margin(
        monkeypatch, ddp_over_fp16, kept, held):
    """fp16 measured, then DDP's trial window measured ``ddp_over_fp16`` times fp16's step. The
    calibration that ends the trial weighs DDP against fp16 as any switch between measured methods
    is weighed, with fp16 (the mode the trial interrupted) as the running one: DDP is kept only on
    a lead of ``switch_margin`` (3 %); a smaller lead is recorded as held. Oracle: the leads are set
    by hand and read back from the recorded predictions."""
    chooser, engine = _dense_pair_chooser(monkeypatch, 0.15)
    assert chooser.config.switch_margin == 0.03  # the default
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    _window(chooser, 2, 1.0)
    _window(chooser, 4, fp16_real)
    assert chooser.chosen == "ddp" and chooser.in_family_trial
    _window(chooser, 6, 1.0)
    _window(chooser, 8, fp16_real * ddp_over_fp16)
    h = chooser.history[-1]
    tpp = {k: v["time_per_progress_s"] for k, v in h["predictions"].items()}
    assert tpp["ddp"] / tpp["fp16"] == pytest.approx(ddp_over_fp16, rel=1e-3)  # the premise, as recorded
    assert (h["trigger"], h["chosen"], h["previous"], h["held_by_margin"]) == ("calibration", kept, "ddp", held)
    assert engine.calls[-1] == (("dense", "fp16") if kept == "fp16" else ("dense", "fp32"))
    assert not chooser.in_family_trial and chooser.chosen == kept


def test_at_the_end_of_a_siblings_trial_a_third_measured_method_is_taken_as_any_calibration_takes_it(monkeypatch):
    """The interrupted mode holds only against the sibling. Here Top-k was measured on this link
    before, and at the calibration that ends DDP's trial its figure is the best: 2 % under fp16's
    per unit of progress (under ``switch_margin``), DDP's 1 % under. Top-k is taken, as any
    calibration takes the faster, and nothing is held. Oracle: the figures are set by hand."""
    chooser, engine = _dense_pair_chooser(monkeypatch, 0.15)
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    per = {k: p.time_per_progress_s / p.step_s for k, p in chooser.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    _window(chooser, 2, 1.0)
    _window(chooser, 4, fp16_real)
    assert chooser.chosen == "ddp" and chooser.in_family_trial
    # Top-k measured in a window of its own on this link earlier: a correction and a windowed decision
    topk_step = 0.98 * fp16_real * per["fp16"] / per["topk"]
    chooser._corrections["topk"] = topk_step - raw["topk"]
    chooser._correction_beta["topk"] = chooser.network.beta_s_per_byte
    chooser.history.insert(0, {"step": -1, "trigger": "warmup", "chosen": "topk", "measured_step_s": topk_step})
    _window(chooser, 6, 1.0)
    _window(chooser, 8, 0.99 * fp16_real * per["fp16"] / per["ddp"])
    h = chooser.history[-1]
    tpp = {k: v["time_per_progress_s"] for k, v in h["predictions"].items()}
    assert tpp["topk"] < tpp["ddp"] < tpp["fp16"] < tpp["topk"] / 0.97  # the premise: every lead under 3 %
    assert (h["trigger"], h["chosen"], h["previous"], h["held_by_margin"]) == ("calibration", "topk", "ddp", None)
    assert engine.calls[-2:] == [("slot", "topk"), ("dense", None)]


def _fp16_back_after_ddps_trial(monkeypatch, ddp_slower_s: float | None):
    """fp16 measured 60 ms under the warm-up's model, then DDP's trial window measured slower (by
    ``ddp_slower_s``, or 10 % if None), and the calibration back on fp16. Returns the chooser, its
    engine, the raw predictions and fp16's true step."""
    chooser, engine = _dense_pair_chooser(monkeypatch, 0.15)
    raw = {k: p.step_s for k, p in chooser.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    _window(chooser, 2, 1.0)
    _window(chooser, 4, fp16_real)  # fp16 measured; DDP's trial
    _window(chooser, 6, 1.0)
    _window(chooser, 8, 1.1 * fp16_real if ddp_slower_s is None else fp16_real + ddp_slower_s)
    return chooser, engine, raw, fp16_real


@pytest.mark.parametrize("trigger", ["gain", "periodic"])
@pytest.mark.parametrize("confirmed", [False, True])
def test_a_switch_on_an_older_figure_is_decided_again_after_the_new_methods_first_window(
        monkeypatch, trigger, confirmed):
    """fp16 and DDP measured (fp16 faster), fp16 runs. The host slows: fp16's fresh figure is set 8 %
    above DDP's older one, so a re-decision (``gain`` or ``periodic``) switches to DDP. DDP's first
    window then re-decides (trigger ``calibration``) between two figures a window apart: back to fp16
    when DDP's window reads slower than fp16's figure, DDP kept when faster. The calibration's own
    switch back is not decided again. Meanwhile DDP is on trial (no re-measurement of the errors).
    The ``cnn`` case at 1 Gbit/s: DDP ran 199 ms after a switch made on its 172 ms figure against
    fp16's fresh 179 ms."""
    chooser, engine, raw, fp16_real = _fp16_back_after_ddps_trial(monkeypatch, 0.01)
    assert chooser.chosen == "fp16" and [h["trigger"] for h in chooser.history] == ["warmup", "family", "calibration"]
    ddp_figure = chooser.predictions["ddp"].step_s
    assert ddp_figure == pytest.approx(fp16_real + 0.01)
    chooser._corrections["fp16"] += 1.08 * ddp_figure - chooser.predictions["fp16"].step_s  # fp16's fresh figure
    chooser._last_gain_step = 0
    chooser._decide(30, trigger, probe=False)
    h = chooser.history[-1]
    assert (h["trigger"], h["previous"], h["chosen"]) == (trigger, "fp16", "ddp")
    assert chooser.in_trial and not chooser._gain_due(500)
    fp16_figure = chooser.predictions["fp16"].step_s
    assert fp16_figure == pytest.approx(1.08 * ddp_figure)
    ddp_window = fp16_figure * (0.95 if confirmed else 1.11)  # by hand: faster or slower than fp16's figure
    _window(chooser, 32, 1.0)  # settling
    _window(chooser, 34, ddp_window)
    h = chooser.history[-1]
    assert (h["step"], h["trigger"], h["previous"]) == (34, "calibration", "ddp")
    assert h["chosen"] == ("ddp" if confirmed else "fp16")
    assert engine.calls[-1] == ("dense", "fp32" if confirmed else "fp16")
    assert not chooser.in_trial and chooser._gain_due(500)
    n = len(chooser.history)
    steady = chooser.predictions[chooser.chosen].step_s
    _window(chooser, 36, steady)  # settling after the switch back, or a steady window
    _window(chooser, 38, steady)  # the calibration's own switch is not decided again
    assert len(chooser.history) == n


@pytest.mark.parametrize("windows", [0, 1, 2, 8])
def test_a_re_decision_weighs_the_running_method_by_all_its_windows_not_its_reference_alone(monkeypatch, windows):
    """fp16 and DDP measured, fp16 runs; its reference window after the calibration read 20 % slow
    (an outlier), and DDP's older figure is 10 % above fp16's true step. With at least 3 windows
    (the reference and 2 more), a ``gain`` re-decision takes fp16's figure from the median of all
    of them (by hand: the true step) and keeps fp16; with fewer it uses the reference window and
    switches to DDP. The ``cnn`` case at 1 Gbit/s: 200.7 ms in the reference window, 169.5 ms over
    the next 50 steps."""
    chooser, engine, raw, fp16_real = _fp16_back_after_ddps_trial(monkeypatch, None)  # a switch: a new reference
    assert chooser.chosen == "fp16" and chooser.predictions["ddp"].step_s == pytest.approx(1.1 * fp16_real)
    _window(chooser, 10, 1.0)  # settling
    _window(chooser, 12, 1.2 * fp16_real)  # the reference window: an outlier; fp16 was measured, no decision
    assert [h["trigger"] for h in chooser.history] == ["warmup", "family", "calibration"]
    assert chooser.chosen == "fp16" and chooser._corrections["fp16"] == pytest.approx(1.2 * fp16_real - raw["fp16"])
    for k in range(windows):  # within drift (30 %) of the reference: no re-decision
        _window(chooser, 14 + 2 * k, fp16_real)
    assert len(chooser.history) == 3
    chooser._decide(40, "gain", probe=False)
    h = chooser.history[-1]
    medians = [1.2 * fp16_real] + [fp16_real] * windows  # by hand
    if len(medians) >= 3:
        assert h["running_figure_s"] == pytest.approx(sorted(medians)[len(medians) // 2])
        assert h["predictions"]["fp16"]["step_s"] == pytest.approx(fp16_real)
        assert h["chosen"] == "fp16"
    else:
        assert h["running_figure_s"] is None
        assert h["predictions"]["fp16"]["step_s"] == pytest.approx(1.2 * fp16_real)
        assert (h["chosen"], h["previous"]) == ("ddp", "fp16")
    # replicated state: a checkpoint carries the windows
    other, _ = _dense_pair_chooser(monkeypatch, 0.15)
    state = copy.deepcopy(chooser.state_dict())
    other.load_state_dict(state)
    assert other._run_medians == chooser._run_medians


def test_switch_margin_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    for bad in (-0.01, 1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="auto_switch_margin"):
            AutoConfig(switch_margin=bad)


def test_a_gain_re_measurement_waits_until_a_trial_window_is_measured(monkeypatch):
    """A re-measurement of the errors that fell due while a method was on trial (a dense sibling's
    window, or a method an exploration installed) is not taken until that window has been measured;
    before and after a trial it is taken when due. The ``cnn`` case at 1 Gbit/s: the first
    re-measurement (20 steps after the warm-up's) came inside DDP's trial and cut it short."""
    chooser, _ = _dense_pair_chooser(monkeypatch, 0.15)
    chooser._last_gain_step = 1  # the warm-up's errors, measured on step 1
    due = 1 + chooser.config.gain_first - 1  # by hand: gain_first (20) steps after step 1's sample
    assert not chooser._gain_due(due - 1) and chooser._gain_due(due)  # not on trial: taken when due
    _window(chooser, 2, 1.0)  # settling
    _window(chooser, 4, chooser.predictions["fp16"].step_s - 0.06)  # fp16 measured: DDP's trial begins
    assert chooser.in_trial and chooser.chosen == "ddp"
    assert not chooser._gain_due(due) and not chooser._gain_due(due + 100)
    resumed, _ = _dense_pair_chooser(monkeypatch, 0.15)
    resumed.load_state_dict(copy.deepcopy(chooser.state_dict()))  # a checkpoint taken during the trial
    assert resumed.in_trial and not resumed._gain_due(due)
    _window(chooser, 6, 1.0)  # settling
    assert not chooser._gain_due(due)  # the trial's window is still to come
    _window(chooser, 8, chooser.predictions["fp16"].step_s - 0.011)  # DDP's window measured
    assert chooser.history[-1]["trigger"] == "calibration" and not chooser.in_trial
    assert chooser._gain_due(due)

    # an exploration's trial: topk installed by the calibration, unmeasured until its window
    explorer, _ = _slow_link_chooser(monkeypatch, 1)
    explorer._last_gain_step = 0
    assert explorer._gain_due(50) and not explorer.in_trial  # the warm-up's pick is the model's, not a trial
    _window(explorer, 4, 1.0)
    _window(explorer, 6, explorer.predictions["lowrank"].step_s + 0.03)
    assert explorer.chosen == "topk" and explorer.history[-1]["trigger"] == "calibration"
    assert explorer.in_trial and not explorer._gain_due(50)
    _window(explorer, 8, 1.0)
    _window(explorer, 10, explorer.predictions["topk"].step_s + 0.002)
    assert explorer.chosen == "topk" and not explorer.in_trial and explorer._gain_due(50)


def test_family_margin_is_validated():
    from lightning_gc.auto.chooser import AutoConfig

    for bad in (-0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="auto_family_margin"):
            AutoConfig(family_margin=bad)


# ---------------------------------------------------------------------- the link check of a re-decision
class _ShapedProbe:
    """Stands in for ``probe_network`` on a simulated tc-shaped link (α + bytes above the bucket · β),
    recording every message a real probe would send: ``warmup + repeats`` runs of every size."""

    def __init__(self, rate_bps: float) -> None:
        self.alpha, self.beta, self.sent, self.noise = 2e-4, 8 / rate_bps, [], 2.3e-3
        self.stalls: list[float] = []  # seconds added to the next calls' times (a descheduled rank)

    def __call__(self, group, config, device=None):
        from types import SimpleNamespace

        self.sent.extend(list(config.sizes_bytes) * (config.warmup + config.repeats))
        stall = self.stalls.pop(0) if self.stalls else 0.0
        times = tuple(self.alpha + max(s - BURST, 0) * self.beta + stall for s in config.sizes_bytes)
        # a busy host: scheduling delays add 2.3 ms to every size's median (a constant, so the slope
        # keeps β), while the fastest repeat got through undelayed
        return SimpleNamespace(sizes_bytes=tuple(config.sizes_bytes), min_times_s=times,
                               median_times_s=tuple(t + self.noise for t in times))


def _probing_chooser(monkeypatch, rate_bps: float, **cfg):
    """An AutoChooser on the quickstart MLP's size (the probe's cap is half its gradient) whose probes
    go to a simulated shaped link; one process, so the agreement is the identity."""
    import torch

    from lightning_gc.auto import chooser as chooser_mod
    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    monkeypatch.setattr(chooser_mod, "agree_values", lambda values, *a: [float(v) for v in values])
    link = _ShapedProbe(rate_bps)
    monkeypatch.setattr(chooser_mod, "probe_network", link)
    engine = _FakeEngine(None)
    engine.network.pinned = False
    engine.adopt_network = lambda net: None
    params = [("w", torch.zeros(84_000, requires_grad=True))]
    ch = AutoChooser(engine, AutoConfig(**{"candidates": ("ddp", "topk"), **cfg}), torch.nn.Linear(1, 1), params)
    ch.workload = Workload(0.001, (0.001,), (84_000,))
    ch.costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 8_000.0, 0.5, True)]
    return ch, link, engine, params


@pytest.mark.parametrize("rate_bps, rounds", [(20e6, 1), (1e9, 2)])
def test_a_small_model_starts_at_half_its_gradient_and_grows_to_1_mib_on_a_fast_link(monkeypatch, rate_bps, rounds):
    """The quickstart MLP (84k parameters), through the chooser's own probe on a simulated shaped link:
    the first round times 168 kB, half its fp32 gradient (not 256 KiB: on a slow link that round is
    several of its dense steps), and 80 KiB. At 20 Mbit/s that message is bandwidth-bound (67 ms) and
    the probe stops; at 1 Gbit/s it takes 1.6 ms, in the scheduling noise of a busy host, and the
    probe grows it to 1 MiB (the model's size no longer caps the growth). Either way β is the link's."""
    from lightning_gc.auto.chooser import (
        PROBE_LATENCY,
        PROBE_MAX_BYTES,
        PROBE_TARGET_S,
        next_probe_bytes,
        probe_start_bytes,
    )

    ch, link, _, _ = _probing_chooser(monkeypatch, rate_bps)
    ch._decide(1, "warmup", probe=True)
    start = probe_start_bytes(4 * 84_000)
    assert start == 2 * 84_000
    per_size = PROBE_LATENCY.warmup + PROBE_LATENCY.repeats
    bandwidth = link.sent[len(PROBE_LATENCY.sizes_bytes) * per_size:]  # after the latency round
    want = [80 * 1024, start] * 4  # one warm-up and three timed runs of each size
    if rounds == 2:  # grown by 20 ms over the first message's (median) time, 3.3 ms here: 1.01 MB
        t_large = link.alpha + (start - BURST) * link.beta + link.noise
        grown = round(start * PROBE_TARGET_S / t_large)
        assert start * 4 < grown <= PROBE_MAX_BYTES
        want += [grown // 4, grown] * 3  # no warm-up run: the first round warmed the connections
    assert bandwidth == want and ch.probe_bytes == want[-1]
    assert ch.network.beta_s_per_byte == pytest.approx(8 / rate_bps, rel=1e-9)
    assert next_probe_bytes(1000, PROBE_TARGET_S / 4, 10**9) is None  # long enough
    assert next_probe_bytes(1000, PROBE_TARGET_S / 2000, 10**9) == 1000 * 2000  # x target / time
    assert next_probe_bytes(1000, PROBE_TARGET_S / 4.5, 10**9) == 4500
    assert next_probe_bytes(1000, 1e-6, 5000) == 5000  # never past the cap


@pytest.mark.parametrize("check", [1.5, 0.0])
def test_a_re_decision_checks_the_link_with_one_message_and_probes_again_only_when_it_moved(monkeypatch, check):
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    ch, link, engine, params = _probing_chooser(monkeypatch, 20e6, probe_check=check)
    cap = 2 * 84_000
    ch._decide(1, "warmup", probe=True)
    small = 80 * 1024  # a quarter of the cap would sit inside the shaper's bucket: floored above it
    full_probe = [64, 256] * 8 + [small, cap] * 4  # latency (1 warm-up + 7), then one sized round
    assert link.sent == full_probe and ch.probe_bytes == cap
    assert ch.probe_time_s == pytest.approx(2e-4 + (cap - BURST) * 8 / 20e6 + link.noise)
    # α from the fastest 64-byte shift, not the median that the host's noise inflated to 2.5 ms
    assert ch.network.alpha_s == pytest.approx(2e-4 - 64 * 8 / 20e6)
    assert ch.history[-1]["link_check"] is None  # a first decision always probes in full
    beta_20 = ch.network.beta_s_per_byte
    assert beta_20 == pytest.approx(8 / 20e6)

    link.sent = []
    ch._decide(101, "periodic", probe=True)  # the same link
    if check:
        assert link.sent == [small, cap]  # the check alone: a quarter of the probe's sized round
        assert ch.history[-1]["link_check"] == {"check_s": ch.probe_time_s, "probe_s": ch.probe_time_s,
                                                "bytes": cap, "unchanged": True, "retimed": False,
                                                "reference": "measured"}
    else:
        assert link.sent == full_probe and ch.history[-1]["link_check"] is None
    assert ch.network.beta_s_per_byte == pytest.approx(beta_20)

    if check:  # one check message stalled (0.4 s, a descheduled rank): timed again, the faster kept
        link.sent, link.stalls = [], [0.4]
        ch._decide(151, "periodic", probe=True)
        assert link.sent == [small, cap] * 2 and ch.history[-1]["link_check"]["retimed"]
        assert ch.history[-1]["link_check"]["unchanged"] and ch.history[-1]["network_source"] == "check"
        assert ch.network.beta_s_per_byte == pytest.approx(beta_20)

    link.sent, link.beta = [], 8 / 10e6  # the link fell to 10 Mbit/s: the check moved ~2x, twice
    ch._decide(201, "drift", probe=True)
    # the check's message is bandwidth-bound (its 80 ms > 5 ms): its slope is the new β, no full probe
    assert link.sent == ([small, cap] * 2 if check else full_probe)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 10e6)
    # α kept from the last full probe with the check (that probe's 64-byte term at 20 Mbit/s); probed without
    assert ch.network.alpha_s == pytest.approx(2e-4 - 64 * 8 / (20e6 if check else 10e6))
    if check:
        moved = ch.history[-1]["link_check"]
        assert not moved["unchanged"] and moved["retimed"] and moved["check_s"] / moved["probe_s"] > 1.5
        assert moved["beta_s_per_byte"] == pytest.approx(8 / 10e6) and ch.history[-1]["network_source"] == "check_slope"
        assert ch.probe_time_s == pytest.approx(2e-4 + (cap - BURST) * 8 / 10e6 + link.noise)  # the new reference

    link.sent, link.beta = [], 8 / 10e6 * 1.4  # 40 % slower, inside the 1.5x check: the network is kept
    ch._decide(301, "periodic", probe=True)
    assert link.sent == ([small, cap] if check else full_probe)
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 10e6 if check else 8 / 10e6 * 1.4)

    if check:  # back to 1 Gbit/s: the check moved, but its message (3.6 ms) is not bandwidth-bound: full probe
        link.sent, link.beta = [], 8 / 1e9
        ch._decide(401, "periodic", probe=True)
        assert link.sent[:4] == [small, cap] * 2 and link.sent[4:20] == [64, 256] * 8
        assert ch.history[-1]["network_source"] == "probe" and not ch.history[-1]["link_check"]["unchanged"]
        assert ch.network.beta_s_per_byte == pytest.approx(8 / 1e9)

    state = ch.state_dict()  # the reference travels with a checkpoint
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_check=check), torch.nn.Linear(1, 1),
                        params)
    other.load_state_dict(state)
    assert (other.probe_bytes, other.probe_time_s) == (ch.probe_bytes, ch.probe_time_s)


@pytest.mark.parametrize("bad", [1.0, 0.5, -1, float("inf"), True, "1.5"])
def test_probe_check_is_validated(bad):
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match="auto_probe_check=.* must be 0 .* or a factor > 1"):
        AutoConfig(probe_check=bad)


def test_link_unchanged_is_a_symmetric_factor_band():
    from lightning_gc.auto.chooser import link_unchanged

    assert link_unchanged(0.1, 0.1, 1.5) and link_unchanged(0.15, 0.1, 1.5) and link_unchanged(0.1, 0.15, 1.5)
    assert not link_unchanged(0.151, 0.1, 1.5) and not link_unchanged(0.1, 0.151, 1.5)
    assert not link_unchanged(0.1, 0.0, 1.5)  # no reference: probe


@pytest.mark.parametrize("exposed_s, dense_probe_s", [(0.2, 0.1), (0.05, 0.1), (0.2, 0.0)])
def test_a_dense_step_that_waited_on_the_network_measures_beta_instead_of_the_bandwidth_probe(
        monkeypatch, exposed_s, dense_probe_s):
    """A profiled DDP step that waited at least dense_probe_s for its buckets sets β: the value at which
    the hand-written DDP step (tests/auto_oracle.py) equals the measured wall, with other_s = 0; only the
    latency round is sent. Below the threshold, or with it off, the bandwidth probe runs as before."""
    from auto_oracle import step_by_hand

    ch, link, _, _ = _probing_chooser(monkeypatch, 26e6, dense_probe_s=dense_probe_s)  # the probe would read 26
    wl = ch.workload = Workload(0.0004, (0.0001, 0.0001), (42_000, 42_000))
    costs = ch.costs
    true_beta = 8 / 20e6
    alpha = link.alpha - 64 * true_beta  # the latency round's fastest 64-byte shift is α + 64·β
    wall = step_by_hand(costs[0].as_dict(), dict(wl.as_dict(), other_s=0.0), alpha, true_beta, 4)
    ch._decide(1, "warmup", probe=True, dense_wall_s=wall, dense_exposed_s=exposed_s)
    h = ch.history[-1]
    if exposed_s >= dense_probe_s > 0:
        assert link.sent == [64, 256] * 8  # the latency round alone: no bandwidth probe, no reference message
        assert ch.network.beta_s_per_byte == pytest.approx(true_beta, rel=1e-6)
        assert ch.network.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert ch.workload.other_s == pytest.approx(0.0, abs=1e-9)  # the link explains the whole step
        assert h["network_source"] == "dense_step"
        # the link check's reference: the model's time for the probe's large message (half the gradient,
        # bandwidth-bound at 20 Mbit/s), α + bytes·β by hand
        assert ch.probe_bytes == 2 * 84_000
        assert ch.probe_time_s == pytest.approx(alpha + 2 * 84_000 * true_beta, rel=1e-6)
        assert ch.probe_time_modelled
    else:
        assert link.sent == [64, 256] * 8 + [80 * 1024, 2 * 84_000] * 4
        assert h["network_source"] == "probe"
        # the probe over-read the link (26 Mbit/s): the DDP step, slower than it predicts, is other's
        assert ch.network.beta_s_per_byte == pytest.approx(8 / 26e6, rel=1e-6)


@pytest.mark.parametrize("noise", ["model-like", "burst"])
def test_a_modelled_reference_is_replaced_by_the_first_check_on_the_link(monkeypatch, noise):
    """After a dense step measured β, the first periodic check is compared with the model's time for its
    message. A check the model describes (the stub's scheduling delay equal to the shaper's burst, so the
    check takes α + bytes·β): unchanged, one message, and its own time is the reference from then on. A
    check that reads 0.66x the model (the stub's 64 KiB burst passes at line rate, below 1/1.5): moved,
    timed again, and being bandwidth-bound it sets β from its slope, which is the link's: the same β,
    no full probe, two messages. Either way the next check is judged against a measured time."""
    import torch
    from auto_oracle import step_by_hand

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    ch, link, engine, params = _probing_chooser(monkeypatch, 20e6, dense_probe_s=0.1)
    wl = ch.workload = Workload(0.0004, (0.0001, 0.0001), (42_000, 42_000))
    true_beta, cap, small = 8 / 20e6, 2 * 84_000, 80 * 1024
    alpha = link.alpha - 64 * true_beta
    wall = step_by_hand(ch.costs[0].as_dict(), dict(wl.as_dict(), other_s=0.0), alpha, true_beta, 4)
    ch._decide(1, "warmup", probe=True, dense_wall_s=wall, dense_exposed_s=0.2)
    assert ch.probe_time_modelled and ch.history[-1]["network_source"] == "dense_step"
    modelled = alpha + cap * true_beta
    state = ch.state_dict()  # the flag travels with a checkpoint
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk")), torch.nn.Linear(1, 1), params)
    other.load_state_dict(state)
    assert (other.probe_time_s, other.probe_time_modelled) == (pytest.approx(modelled), True)

    if noise == "model-like":
        link.noise = BURST * true_beta
    check_s = link.alpha + (cap - BURST) * true_beta + link.noise  # the stub's median time of the check
    link.sent = []
    ch._decide(101, "periodic", probe=True)
    lc = ch.history[-1]["link_check"]
    assert lc["reference"] == "modelled" and lc["probe_s"] == pytest.approx(modelled)
    if noise == "model-like":
        assert check_s / modelled == pytest.approx(1.0, abs=0.01)
        assert link.sent == [small, cap] and lc["unchanged"] and ch.history[-1]["network_source"] == "check"
    else:
        assert check_s / modelled < 1 / 1.5
        assert link.sent == [small, cap] * 2 and not lc["unchanged"] and lc["retimed"]
        assert ch.history[-1]["network_source"] == "check_slope"
    assert ch.network.beta_s_per_byte == pytest.approx(true_beta, rel=1e-6)
    assert (ch.probe_time_s, ch.probe_time_modelled) == (pytest.approx(check_s), False)

    link.sent = []
    ch._decide(201, "periodic", probe=True)  # the same link, against the measured reference: one message
    lc = ch.history[-1]["link_check"]
    assert link.sent == [small, cap] and lc["unchanged"] and lc["reference"] == "measured"
    assert ch.history[-1]["network_source"] == "check"


def test_no_beta_explains_a_dense_step_shorter_than_its_compute():
    from lightning_gc.auto.model import beta_from_dense_step

    wl = Workload(0.01, (0.01,), (1000,))
    assert beta_from_dense_step(0.015, wl, MethodCost("ddp", "bucket", 0.0), 1e-4, 4) is None


@pytest.mark.parametrize("bad", [-0.1, float("nan"), True])
def test_dense_probe_s_is_validated(bad):
    from lightning_gc.auto.chooser import AutoConfig

    with pytest.raises(ValueError, match="auto_dense_probe_s=.* must be a finite number of seconds >= 0"):
        AutoConfig(dense_probe_s=bad)


def test_a_severe_drift_probes_at_once_and_a_moderate_one_checks_the_link_first(monkeypatch):
    ch, link, _, _ = _probing_chooser(monkeypatch, 20e6, window=2, patience=2, min_interval=1, probe_every=0)
    ch._decide(1, "warmup", probe=True)
    full_probe = [64, 256] * 8 + [80 * 1024, 2 * 84_000] * 4
    step = ch.predictions[ch.chosen].step_s

    def window(at, wall):
        ch._window = [wall, wall]
        ch._check_drift(at)

    window(3, 1.0)  # settling
    window(5, step)  # reference (and calibration)
    link.sent = []
    window(7, 1.5 * step)
    window(9, 1.5 * step)  # +50 % for two windows: a moderate drift checks the link first; unchanged
    assert ch.history[-1]["trigger"] == "drift" and link.sent == [80 * 1024, 2 * 84_000]
    window(11, 1.0)
    window(13, step)  # the new reference
    link.sent = []
    window(15, 3 * step)  # 3x in one window: severe, the full probe without a check
    assert ch.history[-1]["trigger"] == "drift" and link.sent == full_probe
    assert ch.history[-1]["link_check"] is None and ch.history[-1]["network_source"] == "probe"


def test_the_periodic_look_at_an_unchanged_link_comes_twice_as_late_each_time_up_to_probe_every_max(monkeypatch):
    """probe_every 10, probe_every_max 40, a window every 2 steps on a steady 20 Mbit/s link: the
    periodic re-decisions come at steps 11, 31, 71, 111 (each check found the link unchanged and kept
    the method, so the interval went 10 → 20 → 40 → 40). The link falls to 10 Mbit/s before the one at
    151: that check finds it moved, the interval is back to 10, and the next periodic look is at 161.
    The interval travels with a checkpoint. Oracle: the steps, by hand."""
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    ch, link, engine, params = _probing_chooser(monkeypatch, 20e6, window=2, patience=99, min_interval=1,
                                                probe_every=10, probe_every_max=40, severe_drift=0, gain_every=0)
    ch._decide(1, "warmup", probe=True)
    step = ch.predictions[ch.chosen].step_s
    periodic = []
    for at in range(3, 170, 2):
        if at == 141:
            link.beta = 8 / 10e6  # the link falls; the steps (driven here) do not show it
        n = len(ch.history)
        _window(ch, at, step)
        if len(ch.history) > n and ch.history[-1]["trigger"] == "periodic":
            h = ch.history[-1]
            periodic.append((at, h["network_source"], h["link_interval"]))
        if at == 121:
            other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), probe_every=10, probe_every_max=40),
                                torch.nn.Linear(1, 1), params)
            other.load_state_dict(ch.state_dict())
            assert other._link_interval == 40
    assert periodic == [(11, "check", 20), (31, "check", 40), (71, "check", 40), (111, "check", 40),
                        (151, "check_slope", 10), (161, "check", 20)]
    # probe_every_max 0: every probe_every steps, as before the doubling
    ch, link, _, _ = _probing_chooser(monkeypatch, 20e6, window=2, patience=99, min_interval=1, probe_every=10,
                                      probe_every_max=0, severe_drift=0, gain_every=0)
    ch._decide(1, "warmup", probe=True)
    for at in range(3, 52, 2):
        _window(ch, at, ch.predictions[ch.chosen].step_s)
    assert [h["step"] for h in ch.history if h["trigger"] == "periodic"] == [11, 21, 31, 41, 51]


def test_the_errors_re_measurement_interval_travels_with_a_checkpoint(monkeypatch):
    """gain_every_max: the doubled interval is in the state; a state written before it had one resumes at
    gain_every."""
    import torch

    from lightning_gc.auto.chooser import AutoChooser, AutoConfig

    ch, _, engine, params = _probing_chooser(monkeypatch, 20e6, gain_every=5, gain_every_max=40)
    ch._decide(1, "warmup", probe=True)
    ch._gain_interval = 20
    state = ch.state_dict()
    other = AutoChooser(engine, AutoConfig(candidates=("ddp", "topk"), gain_every=5), torch.nn.Linear(1, 1), params)
    other.load_state_dict(state)
    assert other._gain_interval == 20
    state.pop("gain_interval")
    other.load_state_dict(state)
    assert other._gain_interval == 5


def test_a_dense_mode_whose_link_fell_measures_the_new_beta_from_its_drifted_window(monkeypatch):
    """DDP runs on a fast link; the link falls to 10 Mbit/s and DDP's window doubles (severe drift). That
    window, a dense step that waited long on the network, gives the new β (the hand-written step at
    10 Mbit/s, with the α the fast link's probe measured, is what it measured): nothing is sent, not
    the full probe (0.9 s on the quickstart MLP at 10 Mbit/s), nor a latency round (α is kept), nor a
    reference message for the link check (the model's time for it, α + bytes·β), and auto moves to
    Top-k."""
    from auto_oracle import step_by_hand

    ch, link, _, _ = _probing_chooser(monkeypatch, 1e9, window=2, patience=2, min_interval=1, probe_every=0)
    ch.workload = Workload(0.0004, (0.0001, 0.0001), (42_000, 42_000))
    fast_wall = step_by_hand(ch.costs[0].as_dict(), dict(ch.workload.as_dict(), other_s=0.0), link.alpha, link.beta, 4)
    ch._decide(1, "warmup", probe=True, dense_wall_s=fast_wall + 0.006, dense_exposed_s=0.005)  # 6 ms of framework
    assert ch.chosen == "ddp" and ch.history[-1]["network_source"] == "probe"
    other = ch.workload.other_s
    assert other > 0.0

    def window(at, wall):
        ch._window = [wall, wall]
        ch._check_drift(at)

    step = ch.predictions["ddp"].step_s
    window(3, 1.0)  # settling
    window(5, step)  # reference
    link.sent, link.beta = [], 8 / 10e6
    alpha = ch.network.alpha_s  # the fast link's probe: its fastest 64-byte shift less 64·β there
    assert alpha == pytest.approx(link.alpha - 64 * 8 / 1e9)
    slow_wall = step_by_hand(ch.costs[0].as_dict(), dict(ch.workload.as_dict(), other_s=other), alpha, link.beta, 4)
    window(7, slow_wall)  # many times the reference: severe
    h = ch.history[-1]
    assert h["trigger"] == "drift" and h["network_source"] == "dense_step"
    assert link.sent == []  # no message: α kept, β from the window, the check's reference modelled
    assert h["decide_parts_s"]["latency"] == 0.0
    assert ch.network.beta_s_per_byte == pytest.approx(8 / 10e6, rel=1e-6)
    assert ch.network.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert ch.probe_bytes == 2 * 84_000 and ch.probe_time_modelled  # 134 ms at 10 Mbit/s: bandwidth-bound
    assert ch.probe_time_s == pytest.approx(alpha + 2 * 84_000 * 8 / 10e6, rel=1e-6)
    assert ch.chosen == "topk" and ch.workload.other_s == other  # other_s is the warm-up's, kept


def test_the_check_size_without_a_probe_is_what_the_probe_would_settle_on():
    from lightning_gc.auto.chooser import check_bytes

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
