"""``auto``'s decision policy (lightning_gc/auto/policy.py) driven with plain numbers: no process group,
no chooser. Each test pins a behaviour the chooser relies on; the expected picks come from the
hand-written model and a brute-force argmin (tests/auto_oracle.py) or from leads worked out by hand."""

from __future__ import annotations

import dataclasses
import random

import pytest
from auto_oracle import argmin_by_hand

from lightning_gc.auto import policy
from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.model import MethodCost, Prediction, Workload
from lightning_gc.auto.policy import DecisionInputs, Trigger
from lightning_gc.comm.cost_model import NetworkModel


def _random_case(rng: random.Random):
    numels = tuple(rng.choice([300, 5_000, 80_000, 400_000, 2_000_000, 7_000_000]) for _ in range(rng.randint(1, 10)))
    wl = Workload(forward_s=rng.uniform(0.001, 0.05), backward_s=tuple(rng.uniform(0, 0.02) for _ in numels),
                  numels=numels, optimizer_s=rng.uniform(0, 0.01), other_s=rng.uniform(0, 0.01))
    net = NetworkModel(rng.choice([1e-5, 5e-4, 0.01]), 8 / rng.choice([1e7, 2e7, 1e8, 1e9, 1e10]))
    numel = wl.numel
    costs = [
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
    ]
    return wl, net, rng.choice([2, 4, 8, 64]), costs


def _never_timed(name):
    raise AssertionError(f"{name}'s codec was timed")


def _inputs(trigger, costs, wl, net, cfg, valid=None, settled=(), shift=0.0, running=None, explore_left=None,
            n=4, **kw):
    return DecisionInputs(trigger, tuple(costs), wl, net, n, cfg, dict(valid or {}), tuple(settled), shift, running,
                          cfg.explore if explore_left is None else explore_left, **kw)


def test_codecs_are_timed_only_when_a_lower_bound_leads_and_the_pick_equals_timing_them_all():
    """``time_codecs="on_demand"``: the warm-up's costs carry no engine codec time (0, a lower bound);
    a decision whose best is such a bound times that codec and decides again, until its best is
    timed. Oracles: the brute-force argmin over the *true* costs is the pick; which codecs are timed,
    and in what order, is replayed by hand (brute-force argmin over the bounds, the leader's true cost
    put in, again); every codec left untimed could not have won. Random cases on fast and slow links:
    some decide on a dense mode without timing anything, some time one codec and keep the bound's pick,
    some time more because the codec's true cost sank the bound, and some leave codecs untimed."""
    rng = random.Random(5)
    outcomes = {"untimed": 0, "timed_kept": 0, "timed_switched": 0, "some_left_untimed": 0}
    for _ in range(150):
        wl, net, n, costs = _random_case(rng)
        true = {c.name: c.codec_s for c in costs}
        engine_names = [c.name for c in costs if c.wire != "bucket"]
        bounds = [c if c.wire == "bucket" else dataclasses.replace(c, codec_s=0.0, codec_timed=False) for c in costs]
        cfg = AutoConfig(candidates=tuple(c.name for c in costs), probe_every=0, progress_weight=1.5)
        now_costs = list(bounds)
        timed: list[str] = []

        def time_codec(name, _now=now_costs, _t=timed, _c=true):
            _t.append(name)
            k = next(i for i, c in enumerate(_now) if c.name == name)
            _now[k] = dataclasses.replace(_now[k], codec_s=_c[name], codec_timed=True)
            return list(_now)

        d = policy.decide(_inputs(Trigger.WARMUP, bounds, wl, net, cfg, n=n), time_codec)
        o = dict(wl=wl.as_dict(), alpha=net.alpha_s, beta=net.beta_s_per_byte, n=n, w=1.5)
        want = argmin_by_hand([c.as_dict() for c in costs], *o.values())
        by_bound = argmin_by_hand([c.as_dict() for c in bounds], *o.values())
        assert d.chosen == want
        now, replayed = [c.as_dict() for c in bounds], []
        while (lead := argmin_by_hand(now, *o.values())) in engine_names and lead not in replayed:
            replayed.append(lead)
            now = [next(c.as_dict() for c in costs if c.name == lead) if c["name"] == lead else c for c in now]
        assert lead == want and replayed[:1] == ([by_bound] if by_bound in engine_names else [])
        assert timed == replayed and list(d.timed_codecs) == replayed  # each timed once, in the replay's order
        for c in d.costs:  # the timed at their true cost; the rest still bounds
            assert (c.codec_s, c.codec_timed) == ((true[c.name], True) if c.name in replayed or c.wire == "bucket"
                                                  else (0.0, False)), c
        bound_marked = {k for k, p in d.predictions.items() if p.details.get("lower_bound")}
        assert bound_marked == set(engine_names) - set(replayed)
        tpp = {k: p.time_per_progress_s for k, p in d.predictions.items()}
        assert all(tpp[k] >= tpp[want] for k in bound_marked)  # an untimed bound could not have won
        if not replayed:
            outcomes["untimed"] += 1
        else:
            outcomes["timed_kept" if len(replayed) == 1 else "timed_switched"] += 1
            outcomes["some_left_untimed"] += bool(bound_marked)
    assert min(outcomes.values()) >= 5, outcomes


def test_a_forced_sibling_is_taken_as_is_and_times_nothing():
    wl = Workload(0.01, (0.01,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.001),
             MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True, codec_timed=False)]
    cfg = AutoConfig(candidates=("ddp", "fp16", "topk"))
    d = policy.decide(_inputs(Trigger.FAMILY, costs, wl, NetworkModel(1e-4, 8 / 1e7), cfg, running="fp16",
                              force="ddp"), _never_timed)
    assert (d.chosen, d.previous, d.timed_codecs, d.held_by_margin) == ("ddp", "fp16", (), None)


def _preds(**tpp):
    return {k: Prediction(k, v, 0.0, 0.0, 0.0, 0.0, 1.0, v) for k, v in tpp.items()}


def test_explore_or_stay_installs_an_unmeasured_method_only_on_a_lead_of_explore_margin():
    preds = _preds(lowrank=0.10, topk=0.08, ddp=1.0)  # topk leads lowrank by 20 % (by hand)
    cands = ("ddp", "lowrank", "topk")
    assert policy.explore_or_stay("topk", preds, {"lowrank"}, cands, 0.19) == "topk"
    assert policy.explore_or_stay("topk", preds, {"lowrank"}, cands, 0.21) == "lowrank"
    assert policy.explore_or_stay("topk", preds, set(), cands, 0.99) == "topk"  # nothing measured: the minimum
    # the best measured one stays (ddp measured too, slower)
    assert policy.explore_or_stay("topk", preds, {"ddp", "lowrank"}, cands, 0.5) == "lowrank"


@pytest.mark.parametrize("lead, margin, switches", [(0.02, 0.03, False), (0.05, 0.03, True), (0.02, 0.0, True)])
def test_hold_or_switch_replaces_a_running_measured_method_only_on_a_lead_of_switch_margin(lead, margin, switches):
    preds = _preds(ddp=1.0, fp16=1.0 - lead)
    got = policy.hold_or_switch("fp16", preds, {"ddp", "fp16"}, "ddp", margin)
    assert got == (("fp16", None) if switches else ("ddp", "fp16"))
    # not both measured on this link, or no running method: the best, as is
    assert policy.hold_or_switch("fp16", preds, {"fp16"}, "ddp", margin) == ("fp16", None)
    assert policy.hold_or_switch("fp16", preds, {"ddp", "fp16"}, None, margin) == ("fp16", None)


def test_a_correction_is_valid_only_on_a_link_within_a_factor_two_of_its_own():
    corr, beta = {"ddp": 0.002, "lowrank": -0.05, "fp16": 0.001}, {"ddp": 8 / 1e9, "lowrank": 8 / 1e7}
    fast, slow = NetworkModel(1e-4, 8 / 1e9), NetworkModel(1e-4, 8 / 1e7)
    assert policy.valid_corrections(corr, beta, fast) == {"ddp": 0.002, "fp16": 0.001}  # untagged: always valid
    assert policy.valid_corrections(corr, beta, slow) == {"lowrank": -0.05, "fp16": 0.001}
    assert policy.valid_corrections(corr, beta, NetworkModel(1e-4, 8 / 0.51e9)) == {"ddp": 0.002, "fp16": 0.001}
    assert policy.valid_corrections(corr, beta, NetworkModel(1e-4, 8 / 0.49e9)) == {"fp16": 0.001}
    assert policy.valid_corrections(corr, beta, None) == corr


def test_the_shift_basis_is_the_dense_modes_windowed_on_any_link_else_the_settled_methods():
    dense = {"ddp", "fp16"}
    assert policy.shift_basis({"fp16", "lowrank"}, ["lowrank"], {"fp16": -0.03, "lowrank": -0.005}, dense) == ["fp16"]
    assert policy.shift_basis({"lowrank"}, ["lowrank"], {"ddp": 0.0, "lowrank": -0.005}, dense) == ["lowrank"]
    assert policy.shift_basis(set(), [], {"ddp": 0.0}, dense) == []


def test_windowed_methods_are_those_whose_decision_was_measured():
    history = [{"chosen": "fp16", "measured_step_s": 0.1}, {"chosen": "ddp", "measured_step_s": None},
               {"chosen": "topk"}]
    assert policy.windowed(history) == {"fp16"}


def test_a_dense_sibling_runs_next_only_within_family_margin():
    """fp16 measured at 0.08 s with correction −0.06; ddp's raw prediction 0.2 s, so with fp16's correction
    0.14 s: within 15 % of 0.08 s? No (by hand: 0.14 > 0.092); with a 0.16 s raw prediction 0.10 s is
    within 30 % (≤ 0.104)."""
    last = {"corrections": {"ddp": 0.0}, "shift_s": 0.0, "settled": []}
    for ddp_raw, margin, want in [(0.2, 0.15, None), (0.16, 0.15, None), (0.16, 0.30, "ddp")]:
        preds = _preds(ddp=ddp_raw, fp16=0.14, topk=0.05)
        got = policy.dense_sibling("fp16", -0.06, 0.08, ["ddp", "fp16"], preds, {"ddp": 0.0}, set(), last, margin)
        assert got == want, (ddp_raw, margin)
    preds = _preds(ddp=0.16, fp16=0.14)
    # a sibling already measured in a window on this link, a compressed pick, or a single dense mode: none
    assert policy.dense_sibling("fp16", -0.06, 0.08, ["ddp", "fp16"], preds, {"ddp": 0.0}, {"ddp"}, last, 0.3) is None
    assert policy.dense_sibling("topk", -0.06, 0.08, ["ddp", "fp16"], preds, {}, set(), last, 0.3) is None
    assert policy.dense_sibling("fp16", -0.06, 0.08, ["fp16"], preds, {}, set(), last, 0.3) is None


def test_what_keeps_the_references_and_when_the_link_is_looked_at_next():
    T = Trigger
    assert policy.keeps_reference(T.CALIBRATION, "kept", "fp16", "fp16", True)
    for source in ("check", "kept", "pinned"):
        assert policy.keeps_reference(T.PERIODIC, source, "fp16", "fp16", True)
        assert policy.keeps_reference(T.GAIN, source, "fp16", "fp16", True)
    assert not policy.keeps_reference(T.PERIODIC, "probe", "fp16", "fp16", True)  # a new link measured
    assert not policy.keeps_reference(T.DRIFT, "kept", "fp16", "fp16", True)
    assert not policy.keeps_reference(T.PERIODIC, "check", "ddp", "fp16", True)  # a switch
    assert not policy.keeps_reference(T.CALIBRATION, "kept", "fp16", "fp16", False)
    # a calm periodic look doubles the interval up to probe_every_max; anything else starts from probe_every
    assert policy.next_link_interval(T.PERIODIC, "check", "fp16", "fp16", 100, 100, 400) == 200
    assert policy.next_link_interval(T.PERIODIC, "pinned", "fp16", "fp16", 300, 100, 400) == 400
    assert policy.next_link_interval(T.PERIODIC, "probe", "fp16", "fp16", 300, 100, 400) == 100
    assert policy.next_link_interval(T.PERIODIC, "check", "ddp", "fp16", 300, 100, 400) == 100
    assert policy.next_link_interval(T.DRIFT, "check", "fp16", "fp16", 300, 100, 400) == 100
    assert policy.next_link_interval(T.PERIODIC, "check", "fp16", "fp16", 300, 100, 0) == 100  # no doubling


def test_a_move_to_a_dense_mode_without_a_look_at_the_link_times_it_first():
    dense = {"ddp", "fp16"}
    assert policy.needs_switch_check(Trigger.GAIN, False, False, True, "lowrank", "fp16", dense)
    assert policy.needs_switch_check(Trigger.CALIBRATION, False, False, True, "topk", "ddp", dense)
    assert not policy.needs_switch_check(Trigger.PERIODIC, True, False, True, "lowrank", "fp16", dense)
    assert not policy.needs_switch_check(Trigger.GAIN, False, False, True, "lowrank", "topk", dense)  # compressed
    assert not policy.needs_switch_check(Trigger.GAIN, False, False, True, "ddp", "fp16", dense)  # dense to dense
    assert not policy.needs_switch_check(Trigger.GAIN, False, False, True, "fp16", "fp16", dense)  # kept
    assert not policy.needs_switch_check(Trigger.GAIN, False, True, True, "lowrank", "fp16", dense)  # canary saw it
    assert not policy.needs_switch_check(Trigger.GAIN, False, False, False, "lowrank", "fp16", dense)  # cannot


def test_a_switch_on_an_older_figure_is_one_made_at_a_re_decision_onto_a_measured_method():
    base = {"previous": "fp16", "chosen": "ddp", "corrections": {"ddp": 0.001, "fp16": 0.0}}
    for trigger in (Trigger.GAIN, Trigger.PERIODIC, Trigger.DRIFT):
        assert policy.switched_on_an_older_figure({**base, "trigger": trigger})
    assert not policy.switched_on_an_older_figure({**base, "trigger": Trigger.CALIBRATION})
    assert not policy.switched_on_an_older_figure({**base, "trigger": Trigger.GAIN, "corrections": {"fp16": 0.0}})
    assert not policy.switched_on_an_older_figure({**base, "trigger": Trigger.GAIN, "previous": "ddp"})
    assert not policy.switched_on_an_older_figure(None)


def test_the_decision_sentence_names_the_runner_up_and_what_compressing_would_change():
    preds = {"fp16": Prediction("fp16", 0.022, 0.02, 0.0, 0.002, 0.002, 1.0, 0.022),
             "topk": Prediction("topk", 0.0217, 0.02, 0.001, 0.001, 0.0017, 0.5, 0.0434)}
    net = NetworkModel(1e-4, 8 / 667e6)
    kept = policy.Decision("fp16", "fp16", preds, None, (), (), 0)
    assert policy.sentence(kept, net, {"fp16"}) == \
        "kept fp16: compressing would save 0.3 ms of a 22 ms step on this 667 Mbit/s link"
    chose = policy.Decision("topk", "fp16", {**preds, "topk": dataclasses.replace(preds["topk"], time_per_progress_s=0.0041)},
                            None, (), (), 0)
    assert policy.sentence(chose, net, {"fp16"}) == \
        "chose topk over fp16: predicted 4.1 ms per unit of progress against 22 ms on this 667 Mbit/s link"
