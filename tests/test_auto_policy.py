"""auto's decision rules (lightning_gc/auto/policy.py) driven with plain numbers: no process group, no
engine, nothing monkeypatched. Oracles: the brute-force argmin over the hand-written model of
tests/auto_oracle.py, margins and sentences computed by hand from the given numbers. The agreement
check of a decision's inputs runs on 2 gloo ranks with rank-dependent values."""

from __future__ import annotations

import math

import pytest
from auto_oracle import argmin_by_hand, time_per_progress_by_hand
from dist_harness import run_distributed

from lightning_gc.auto import policy
from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.model import MethodCost, Prediction, Workload
from lightning_gc.auto.policy import Decision, DecisionInputs, Trigger
from lightning_gc.comm.cost_model import NetworkModel

WL = Workload(0.004, (0.002, 0.002, 0.002), (400_000, 200_000, 100_000), 0.001)
N = 4
DENSE = frozenset({"ddp", "fp16", "bf16"})


def _costs(timed: bool = True) -> list[MethodCost]:
    m = 4 * sum(WL.numels)
    return [MethodCost("ddp", "bucket", 0.0),
            MethodCost("fp16", "bucket", 0.0005, delta2=1e-7),
            MethodCost("topk", "allgather", 0.003 if timed else 0.0, 0.02 * m, 0.4, True, codec_timed=timed),
            MethodCost("efsign", "allgather", 0.002 if timed else 0.0, m / 32, 0.7, True, codec_timed=timed)]


def _inputs(trigger=Trigger.WARMUP, costs=None, beta=8 / 20e6, weight=2.0, **kw) -> DecisionInputs:
    cfg = kw.pop("config", None) or AutoConfig(candidates=("ddp", "fp16", "topk", "efsign"), progress_weight=weight)
    base = dict(valid={}, settled=(), shift_s=0.0, running=None, explore_left=cfg.explore)
    base.update(kw)
    return DecisionInputs(trigger, tuple(costs or _costs()), WL, NetworkModel(1e-4, beta), N, cfg, **base)


def _never(name: str):
    raise AssertionError(f"no codec should be timed ({name})")


def _by_hand(costs: list[MethodCost], beta: float, weight: float) -> dict[str, float]:
    wl = dict(WL.as_dict(), other_s=0.0)
    return {c.name: time_per_progress_by_hand(c.as_dict(), wl, 1e-4, beta, N, weight) for c in costs}


@pytest.mark.parametrize("mbit", [5, 20, 100, 1000, 10_000])
@pytest.mark.parametrize("weight", [0.0, 2.0])
def test_a_first_decision_is_the_brute_force_minimum(mbit, weight):
    beta, costs = 8 / (mbit * 1e6), _costs()
    d = policy.decide(_inputs(costs=costs, beta=beta, weight=weight), _never)
    wl = dict(WL.as_dict(), other_s=0.0)
    assert d.chosen == argmin_by_hand([c.as_dict() for c in costs], wl, 1e-4, beta, N, weight)
    assert d.previous is None and d.held_by_margin is None and d.timed_codecs == ()


@pytest.mark.parametrize("mbit", [5, 20, 1000])
def test_untimed_codecs_are_timed_only_while_their_lower_bound_is_the_pick(mbit):
    """The pick equals the one with every codec timed; the codecs timed are, in order, those a replay by
    hand puts in (each was the brute-force minimum of the costs known at that moment)."""
    beta, full = 8 / (mbit * 1e6), {c.name: c for c in _costs(timed=True)}
    now = {c.name: c for c in _costs(timed=False)}
    calls = []

    def time_codec(name):
        calls.append(name)
        now[name] = full[name]
        return list(now.values())

    d = policy.decide(_inputs(costs=list(now.values()), beta=beta), time_codec)
    wl = dict(WL.as_dict(), other_s=0.0)
    assert d.chosen == argmin_by_hand([c.as_dict() for c in full.values()], wl, 1e-4, beta, N, 2.0)
    replay, known = [], {c.name: c for c in _costs(timed=False)}
    while True:
        best = argmin_by_hand([c.as_dict() for c in known.values()], wl, 1e-4, beta, N, 2.0)
        if known[best].codec_timed:
            break
        replay.append(best)
        known[best] = full[best]
    assert list(d.timed_codecs) == calls == replay


def _preds(tpp: dict[str, float]) -> dict[str, Prediction]:
    return {n: Prediction(n, t, t, 0.0, 0.0, 0.0, 1.0, t) for n, t in tpp.items()}


@pytest.mark.parametrize("margin, want", [(0.0, "topk"), (0.099, "topk"), (0.101, "fp16"), (0.5, "fp16")])
def test_an_unmeasured_method_is_installed_only_on_a_lead_of_explore_margin(margin, want):
    preds = _preds({"ddp": 1.2, "fp16": 1.0, "topk": 0.9})  # topk leads fp16 by 1 - 0.9/1.0 = 10 %
    assert policy.explore_or_stay("topk", preds, {"ddp", "fp16"}, ("ddp", "fp16", "topk"), margin) == want
    assert policy.explore_or_stay("topk", preds, set(), ("ddp", "fp16", "topk"), margin) == "topk"  # none measured


@pytest.mark.parametrize("margin, want", [(0.0, ("fp16", None)), (0.019, ("fp16", None)),
                                          (0.021, ("ddp", "fp16")), (0.03, ("ddp", "fp16"))])
def test_a_measured_method_replaces_the_running_one_only_on_a_lead_of_switch_margin(margin, want):
    preds = _preds({"ddp": 1.0, "fp16": 0.98})  # fp16 leads by 2 %
    assert policy.hold_or_switch("fp16", preds, {"ddp", "fp16"}, "ddp", margin) == want
    # not both measured in a window on this link: the margin does not apply
    assert policy.hold_or_switch("fp16", preds, {"fp16"}, "ddp", margin) == ("fp16", None)


def test_decide_holds_the_running_method_by_switch_margin_and_not_at_a_calibration():
    """ddp and fp16 both measured (correction 0): by hand, fp16's lead over ddp; a switch_margin just
    above it holds ddp at a periodic re-decision, just below it switches; a calibration never holds."""
    costs = [c for c in _costs() if c.name in ("ddp", "fp16")]
    beta = 8 / 400e6
    tpp = _by_hand(costs, beta, 2.0)
    lead = 1 - tpp["fp16"] / tpp["ddp"]
    assert lead > 0.005  # fp16 ahead on this link
    for margin, want, held in [(1.5 * lead, "ddp", "fp16"), (0.5 * lead, "fp16", None)]:
        cfg = AutoConfig(candidates=("ddp", "fp16"), switch_margin=margin)
        kw = dict(costs=costs, beta=beta, config=cfg, valid={"ddp": 0.0, "fp16": 0.0}, settled=("ddp", "fp16"),
                  running="ddp")
        d = policy.decide(_inputs(Trigger.PERIODIC, **kw), _never)
        assert (d.chosen, d.held_by_margin, d.previous) == (want, held, "ddp")
        d = policy.decide(_inputs(Trigger.CALIBRATION, **kw), _never)
        assert (d.chosen, d.held_by_margin) == ("fp16", None)


def test_a_gain_re_decision_ignores_explore_margin_and_a_calibration_spends_the_budget():
    costs, beta = _costs(), 8 / 5e6
    tpp = _by_hand(costs, beta, 2.0)
    best = min(tpp, key=tpp.get)
    assert best not in ("ddp",)
    cfg = AutoConfig(candidates=("ddp", "fp16", "topk", "efsign"), explore_margin=0.99)
    kw = dict(costs=costs, beta=beta, config=cfg, valid={"ddp": 0.0}, settled=("ddp",), running="ddp")
    assert policy.decide(_inputs(Trigger.GAIN, **kw), _never).chosen == best
    assert policy.decide(_inputs(Trigger.PERIODIC, **kw), _never).chosen == "ddp"  # a 99 % lead is asked for
    cfg = AutoConfig(candidates=("ddp", "fp16", "topk", "efsign"))
    kw["config"] = cfg
    d = policy.decide(_inputs(Trigger.CALIBRATION, explore_left=1, **kw), _never)
    assert d.chosen == best and d.explore_left == 0  # an unmeasured pick spends one exploration
    d = policy.decide(_inputs(Trigger.CALIBRATION, explore_left=0, **kw), _never)
    assert d.chosen == "ddp"  # no budget: only the measured methods
    d = policy.decide(_inputs(Trigger.DRIFT, explore_left=0, **kw), _never)
    assert d.chosen == best and d.explore_left == cfg.explore  # a fresh decision: a fresh budget


def test_a_forced_sibling_is_taken_as_is():
    d = policy.decide(_inputs(Trigger.FAMILY, force="fp16", running="ddp", beta=8 / 5e6), _never)
    assert d.chosen == "fp16" and d.previous == "ddp" and d.held_by_margin is None


@pytest.mark.parametrize("fp16_step, correction, want", [(0.100, 0.005, "fp16"), (0.108, 0.005, "fp16"),
                                                         (0.112, 0.005, None), (0.090, 0.030, None)])
def test_a_dense_sibling_runs_a_window_within_family_margin(fp16_step, correction, want):
    """By hand: fp16's raw step plus ddp's correction against 1.15 x ddp's measured 0.10 s
    (efficiency 1: time per progress is the step)."""
    preds = _preds({"ddp": 0.1, "fp16": fp16_step, "topk": 0.05})
    last = {"corrections": {}, "shift_s": 0.0, "settled": []}
    got = policy.dense_sibling("ddp", correction, 0.1, ["ddp", "fp16"], preds, {}, set(), last, 0.15)
    assert got == want
    assert (fp16_step + correction <= 0.115) == (want is not None)
    assert policy.dense_sibling("topk", correction, 0.1, ["ddp", "fp16"], preds, {}, set(), last, 0.15) is None


def test_stale_corrections_and_the_shift_basis():
    net = NetworkModel(0.0, 8 / 100e6)
    beta = {"ddp": 8 / 100e6, "topk": 8 / 10e6, "fp16": 8 / 60e6}  # topk's is 10x away, fp16's 1.67x
    assert policy.valid_corrections({"ddp": 0.01, "topk": -0.02, "fp16": 0.0}, beta, net) == {"ddp": 0.01, "fp16": 0.0}
    assert policy.shift_basis({"ddp", "topk"}, ["topk"], {"ddp": 0.0, "topk": 0.0}, DENSE) == ["ddp"]
    assert policy.shift_basis({"topk"}, ["topk"], {"topk": 0.0}, DENSE) == ["topk"]


def test_what_follows_a_decision():
    assert policy.keeps_reference(Trigger.CALIBRATION, "kept", "ddp", "ddp", True)
    assert policy.keeps_reference(Trigger.PERIODIC, "check", "ddp", "ddp", True)
    assert not policy.keeps_reference(Trigger.PERIODIC, "probe", "ddp", "ddp", True)
    assert not policy.keeps_reference(Trigger.GAIN, "kept", "fp16", "ddp", True)
    assert not policy.keeps_reference(Trigger.DRIFT, "kept", "ddp", "ddp", True)
    assert policy.next_link_interval(Trigger.PERIODIC, "check", "ddp", "ddp", 100, 100, 400) == 200
    assert policy.next_link_interval(Trigger.PERIODIC, "check", "ddp", "ddp", 300, 100, 400) == 400
    assert policy.next_link_interval(Trigger.PERIODIC, "probe", "ddp", "ddp", 300, 100, 400) == 100
    assert policy.next_link_interval(Trigger.PERIODIC, "check", "ddp", "ddp", 100, 100, 0) == 100
    assert policy.needs_switch_check(Trigger.GAIN, False, False, True, "topk", "fp16", DENSE)
    assert not policy.needs_switch_check(Trigger.GAIN, True, False, True, "topk", "fp16", DENSE)
    assert not policy.needs_switch_check(Trigger.DRIFT, False, False, True, "topk", "fp16", DENSE)
    assert not policy.needs_switch_check(Trigger.GAIN, False, False, True, "ddp", "fp16", DENSE)
    assert Trigger("calibration") is Trigger.CALIBRATION and not Trigger.FAMILY.is_fresh and Trigger.GAIN.is_fresh


def test_the_sentence_of_a_kept_dense_mode_and_of_a_switch():
    preds = {"fp16": Prediction("fp16", 0.022, 0.02, 0.0, 0.002, 0.002, 1.0, 0.022),
             "topk": Prediction("topk", 0.0217, 0.02, 0.001, 0.001, 0.0017, 0.5, 0.0434)}
    kept = Decision("fp16", "fp16", preds, None, (), (), 0)
    assert policy.sentence(kept, NetworkModel(1e-4, 8 / 667e6), DENSE) == (
        "kept fp16: compressing would save 0.3 ms of a 22 ms step on this 667 Mbit/s link")
    preds = {"fp16": Prediction("fp16", 0.095, 0.02, 0.0, 0.07, 0.075, 1.0, 0.095),
             "lowrank_bf16": Prediction("lowrank_bf16", 0.035, 0.02, 0.003, 0.01, 0.015, 0.85, 0.041),
             "ddp": Prediction("ddp", 0.17, 0.02, 0.0, 0.15, 0.15, 1.0, 0.17)}
    switch = Decision("lowrank_bf16", "fp16", preds, None, (), (), 0)
    assert policy.sentence(switch, NetworkModel(1e-4, 8 / 20e6), DENSE) == (
        "chose lowrank_bf16 over fp16: predicted 41 ms per unit of progress against 95 ms on this 20 Mbit/s link")
    slower = {**preds, "lowrank_bf16": Prediction("lowrank_bf16", 0.1, 0.02, 0.003, 0.01, 0.015, 0.85, 0.2)}
    assert policy.sentence(Decision("fp16", "fp16", slower, None, (), (), 0), NetworkModel(0, 8 / 20e6), DENSE) == (
        "kept fp16: compressing would add 5 ms to a 95 ms step on this 20 Mbit/s link")
    assert "unlimited link" in policy.sentence(kept, NetworkModel(0.0, 0.0), DENSE)
    assert not math.isfinite(NetworkModel(0.0, 0.0).bandwidth_bits_per_s)


def _agree_check(rank: int, world_size: int, perturb: bool) -> str | None:
    from lightning_gc.auto.measure import InputsDisagree, check_agreed

    error = 0.5 + (0.125 * rank if perturb else 0.0)  # a rank-local error where an agreed one belongs
    try:
        check_agreed([("network.beta_s_per_byte", 4e-7), ("delta2[topk]", error)], "the drift decision at step 7")
    except InputsDisagree as e:
        return str(e)
    return None


def test_a_decisions_inputs_that_differ_across_ranks_fail_on_every_rank_naming_each_value():
    msgs = run_distributed(_agree_check, 2, True)
    for m in msgs:  # every rank raised, the same message: no hang, no gloo abort
        assert m is not None and m == msgs[0]
        assert "the drift decision at step 7" in m and "delta2[topk]: rank 0 = 0.5, rank 1 = 0.625" in m
        assert "beta" not in m  # the agreed input is not named
    assert run_distributed(_agree_check, 2, False) == [None, None]
