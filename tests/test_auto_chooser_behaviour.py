"""``compressor="auto"``'s chooser driven through its public API only: a fake engine implementing the
``MethodControl`` port, a fake clock, checkpoints (``state_dict``/``load_state_dict``) and the step
boundary (``after_optimizer_step``). Expected picks and figures are worked out by hand in each test
(leads, corrections, medians) or by the hand-written model (tests/auto_oracle.py)."""

from __future__ import annotations

import copy

import pytest
from auto_drive import (
    Clock,
    FakeEngine,
    redecide,
    resume,
    resume_after_warmup,
    resumed_with,
    sampling_at,
    step_end,
    walls,
    window,
)
from auto_oracle import step_by_hand

from lightning_gc.auto import policy
from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.model import MethodCost, Workload
from lightning_gc.auto.policy import Trigger
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.engine.ports import MethodControl


@pytest.fixture
def clock(monkeypatch):
    return Clock(monkeypatch)


def _state(ch, key):
    return ch.state_dict()[key]


def test_the_fake_engine_implements_the_port():
    assert isinstance(FakeEngine(NetworkModel(0.0, 0.0)), MethodControl)


# ---------------------------------------------------------------------- drift and patience
def test_drift_waits_for_a_settled_reference_and_patience_then_switches_only_on_a_new_choice(clock):
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True)]
    cfg = AutoConfig(candidates=("ddp", "topk"), window=2, drift=0.3, patience=2, min_interval=1)
    ch, engine = resume_after_warmup(clock, cfg, wl, costs, NetworkModel(0.0, 8 / 1e13))  # fast: ddp
    assert ch.chosen == "ddp" and engine.dense_mode == "fp32"
    ddp_step = ch.predictions["ddp"].step_s
    window(ch, 10, 9.0, clock)  # the first window after a decision holds the switch: ignored
    assert _state(ch, "reference") is None
    window(ch, 12, ddp_step, clock)  # the reference; the calibration finds no error: no switch
    assert _state(ch, "reference") == pytest.approx(ddp_step) and ch.history[0]["measured_step_s"] == pytest.approx(ddp_step)
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"] and ch.chosen == "ddp"
    window(ch, 14, 1.5 * ddp_step, clock)  # +50 %: one drifted window, patience 2
    assert len(ch.history) == 2
    window(ch, 16, 1.1 * ddp_step, clock)  # back within 30 %: the count restarts
    window(ch, 18, 1.6 * ddp_step, clock)
    assert len(ch.history) == 2
    engine.network.model = NetworkModel(0.0, 8 / 1e6)  # the link fell to 1 Mbit/s
    window(ch, 20, 1.6 * ddp_step, clock)  # second drifted window in a row: re-decide with the new network
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration", "drift"]
    assert ch.chosen == "topk" and engine.calls == [("slot", "topk"), ("dense", None)]
    topk_step = ch.predictions["topk"].step_s
    window(ch, 30, 5.0, clock)  # settling
    window(ch, 32, topk_step + 0.002, clock)  # reference: 2 ms slower than modelled
    assert ch.history[-1]["trigger"] == "calibration"
    assert ch.predictions["topk"].step_s == pytest.approx(topk_step + 0.002)
    assert ch.chosen == "topk" and len(engine.calls) == 2  # still the best: nothing switched
    window(ch, 34, 2 * topk_step, clock)
    window(ch, 36, 2 * topk_step, clock)  # drift again, the network unchanged: the same choice, nothing switched
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration", "drift", "calibration", "drift"]
    assert ch.chosen == "topk" and len(engine.calls) == 2


def _settled(clock, severe, min_interval=1):
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 80_000.0, 0.5, True)]
    cfg = AutoConfig(candidates=("ddp", "topk"), window=2, drift=0.3, patience=3, min_interval=min_interval,
                     probe_every=0, severe_drift=severe)
    ch, _ = resume_after_warmup(clock, cfg, wl, costs, NetworkModel(0.0, 8 / 1e13))
    ref = ch.predictions["ddp"].step_s
    window(ch, 2, 9.0, clock)  # settling
    window(ch, 4, ref, clock)  # reference (calibration: no error, no switch)
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    return ch, ref


def test_a_severe_drift_re_decides_after_one_window_a_moderate_one_waits_for_patience(clock):
    """A window at >= severe_drift x the reference (either way) re-decides at once; +50 % waits for
    ``patience`` windows; ``min_interval`` still holds; ``severe_drift=0`` turns the shortcut off."""
    ch, ref = _settled(clock, 2.0)
    window(ch, 6, 1.5 * ref, clock)  # moderate: 1 of 3 windows
    window(ch, 8, 1.9 * ref, clock)  # just under 2x: 2 of 3
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    window(ch, 10, 1.0 * ref, clock)  # back: the count restarts
    window(ch, 12, 2.0 * ref, clock)  # 2x: at once, although only one window drifted
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration", "drift"]

    ch, ref = _settled(clock, 2.0)
    window(ch, 6, 0.5 * ref, clock)  # twice as fast counts as well (a link that came back)
    assert [h["trigger"] for h in ch.history][-1] == "drift"

    ch, ref = _settled(clock, 0)
    for step in (6, 8):
        window(ch, step, 10 * ref, clock)  # off: even 10x waits for patience
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    window(ch, 10, 10 * ref, clock)
    assert [h["trigger"] for h in ch.history][-1] == "drift"

    ch, ref = _settled(clock, 2.0, min_interval=50)
    for step in (6, 8, 10):
        window(ch, step, 1.5 * ref, clock)  # moderate, 3 windows (patience): within min_interval of any decision
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
    window(ch, 12, 10 * ref, clock)  # severe: min_interval holds it only after another severe re-decision
    assert [(h["step"], h["trigger"], h["drift_test"]) for h in ch.history[2:]] == [(12, "drift", "severe_window")]
    window(ch, 14, 1.0, clock)  # settling
    window(ch, 16, ref, clock)  # the reference
    window(ch, 18, 10 * ref, clock)  # 6 steps after the severe re-decision at 12: held
    assert len(ch.history) == 3


# ---------------------------------------------------------------------- calibration and exploration
def _slow_link(clock, explore: int, **cfg):
    """Two compressed candidates the raw model ranks lowrank < topk on a slow link (time per
    progress), while lowrank really runs much slower than modelled: the quickstart case at 20 Mbit/s."""
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0),
             MethodCost("lowrank", "lowrank", 0.0, 40_000.0, 0.3, True),
             MethodCost("topk", "allgather", 0.0, 20_000.0, 0.5, True)]
    config = AutoConfig(**{"candidates": ("ddp", "lowrank", "topk"), "window": 2, "explore": explore,
                           "probe_every": 0, **cfg})
    return resume_after_warmup(clock, config, wl, costs, NetworkModel(1e-4, 8 / 2e7), dense_wall_s=0.5)


@pytest.mark.parametrize("explore", [1, 0])
def test_a_method_slower_than_modelled_is_charged_alone_and_the_runner_up_is_measured(clock, explore):
    ch, engine = _slow_link(clock, explore)
    assert ch.chosen == "lowrank" and _state(ch, "corrections") == {"ddp": 0.0}  # the warm-up ran DDP's path
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    tpp = {k: p.time_per_progress_s for k, p in ch.predictions.items()}
    assert tpp["lowrank"] < tpp["topk"] < tpp["ddp"]
    lowrank_real = raw["lowrank"] + 0.03  # 30 ms the model does not see, lowrank's own
    window(ch, 4, 1.0, clock)  # settling
    window(ch, 6, lowrank_real, clock)  # lowrank's first window: its correction
    assert _state(ch, "corrections")["lowrank"] == pytest.approx(0.03)
    assert ch.predictions["lowrank"].step_s == pytest.approx(lowrank_real)
    if explore == 0:  # no exploration: the measured methods only (ddp is far slower): stays
        assert ch.chosen == "lowrank" and ch.history[-1]["trigger"] == "calibration"
        return
    # topk's raw prediction still beats lowrank's measured time per progress: measured next
    assert ch.predictions["topk"].step_s == pytest.approx(raw["topk"])  # not charged lowrank's 30 ms
    assert ch.chosen == "topk" and engine.calls == [("slot", "topk"), ("dense", None)]
    assert _state(ch, "explore_left") == 0
    window(ch, 8, 1.0, clock)  # settling
    window(ch, 10, raw["topk"] + 0.002, clock)  # topk runs 2 ms over its model: still the best
    assert _state(ch, "corrections")["topk"] == pytest.approx(0.002) and ch.chosen == "topk"
    assert [h["trigger"] for h in ch.history] == ["warmup", "calibration", "calibration"]
    n = len(ch.history)
    window(ch, 12, raw["topk"] + 0.002, clock)  # both measured: no further calibration
    assert len(ch.history) == n
    # a checkpoint carries the corrections and the exploration budget
    state = ch.state_dict()
    other, _ = _slow_link(clock, explore)
    other.load_state_dict(state)
    assert _state(other, "corrections") == _state(ch, "corrections") and _state(other, "explore_left") == 0
    assert other.chosen == "topk"
    with pytest.raises(ValueError, match="version 1"):
        other.load_state_dict({**state, "version": 1})


def test_a_calibration_explores_only_on_a_lead_of_explore_margin(clock):
    """After lowrank's window, Top-k (unmeasured) leads lowrank's measured time per unit of progress
    by some fraction L (by hand from the recorded predictions). With explore_margin just under L it is
    explored (one of the budget spent); just over L the calibration stays on lowrank and keeps the
    budget, and so does a later periodic decision on the same link; a ``gain`` re-decision takes the
    plain minimum."""
    def run(margin):
        ch, _ = _slow_link(clock, 1, explore_margin=margin)
        raw = ch.predictions["lowrank"].step_s
        window(ch, 4, 1.0, clock)
        window(ch, 6, raw + 0.03, clock)
        return ch

    probe = run(0.0)
    tpp = {k: p.time_per_progress_s for k, p in probe.predictions.items()}
    lead = 1.0 - tpp["topk"] / tpp["lowrank"]
    assert probe.chosen == "topk" and 0.05 < lead < 0.95  # the premise: a real lead, explored at margin 0
    under, over = run(lead - 0.01), run(lead + 0.01)
    assert under.chosen == "topk" and _state(under, "explore_left") == 0
    assert over.chosen == "lowrank" and _state(over, "explore_left") == 1
    assert over.history[-1]["trigger"] == "calibration" and over.history[-1]["chosen"] == "lowrank"
    # the same link and predictions: the margin holds at a periodic decision too; a gain re-decision acts on
    # new errors: the plain minimum
    assert redecide(over, Trigger.PERIODIC).chosen == "lowrank"
    assert redecide(over, Trigger.GAIN).chosen == "topk"


def _fast_settled(clock, shift: bool):
    """The ``lm`` case at 100 Mbit/s: the warm-up's profiled compute (0.2 s) is far above a settled
    step's; ``lowrank`` is picked and runs 0.15 s under its raw prediction."""
    wl = Workload(0.05, (0.1,), (1_000_000,), optimizer_s=0.05)
    costs = [MethodCost("ddp", "bucket", 0.0),
             MethodCost("lowrank", "lowrank", 0.0, 40_000.0, 0.05, True),
             MethodCost("topk", "allgather", 0.005, 60_000.0, 0.2, True)]
    cfg = AutoConfig(candidates=("ddp", "lowrank", "topk"), window=2, probe_every=0, compute_shift=shift)
    return resume_after_warmup(clock, cfg, wl, costs, NetworkModel(1e-4, 8 / 1e8), dense_wall_s=0.3)


@pytest.mark.parametrize("shift", [True, False])
def test_a_speed_up_every_measured_method_showed_lowers_the_unmeasured_predictions(clock, shift):
    from dataclasses import replace

    ch, engine = _fast_settled(clock, shift)
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    assert ch.chosen == "lowrank"
    window(ch, 4, 1.0, clock)  # settling
    window(ch, 6, raw["lowrank"] - 0.15, clock)  # lowrank's first window: 0.15 s under the raw model
    assert _state(ch, "corrections")["lowrank"] == pytest.approx(-0.15)
    want = -0.15 if shift else 0.0
    assert ch.history[-1]["shift_s"] == pytest.approx(want) and ch.history[-1]["settled"] == ["lowrank"]
    for name in ("ddp", "topk"):  # ddp's profile correction (0) is not a window of its own: shifted too
        assert ch.predictions[name].step_s == pytest.approx(raw[name] + want)
    assert ch.chosen == "lowrank"
    # the errors re-measured: lowrank's grew (0.05 -> 0.6), Top-k's did not
    grown = [replace(c, delta2=0.6) if c.name == "lowrank" else c for c in ch.costs]
    d = redecide(ch, Trigger.GAIN, costs=grown)
    # judged by the raw model, Top-k looks 0.2 s slower than it is and is never tried
    assert d.chosen == ("topk" if shift else "lowrank")
    assert d.predictions["topk"].step_s == pytest.approx(raw["topk"] + want)


def _fp16_measured_on_a_fast_link(clock, **cfg):
    """fp16 picked at a 10 Gbit/s link and measured 30 ms under the raw model (the warm-up's slow
    compute); lowrank and Top-k are the compressed candidates."""
    wl = Workload(0.002, (0.002,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.0005),
             MethodCost("lowrank", "lowrank", 0.002, 40_000.0, 0.3, True),
             MethodCost("topk", "allgather", 0.001, 20_000.0, 0.5, True)]
    # the figures below are set for a progress weight of 1 (Top-k's measured window must beat lowrank's)
    config = AutoConfig(**{"candidates": ("ddp", "fp16", "lowrank", "topk"), "window": 2, "explore": 1,
                           "probe_every": 0, "family_margin": 0.0, "progress_weight": 1.0, **cfg})
    ch, engine = resume_after_warmup(clock, config, wl, costs, NetworkModel(1e-4, 8 / 1e10), dense_wall_s=0.04)
    assert ch.chosen == "fp16"
    window(ch, 2, 1.0, clock)
    window(ch, 4, ch.predictions["fp16"].step_s - 0.03, clock)
    assert _state(ch, "corrections")["fp16"] == pytest.approx(-0.03) and ch.chosen == "fp16"
    return ch, engine, costs, wl


def test_the_shift_comes_from_the_dense_modes_measured_on_any_link(clock):
    """The changing-link case on the quickstart MLP: fp16, measured at a fast link, ran 30 ms under
    the raw model. The link falls (a severe window re-decides); the shift still comes from fp16
    (``shift_from``), not from ``lowrank``, picked next and only 5 ms under the raw model: so Top-k,
    predicted with fp16's speed-up, is measured next and kept. With the shift taken from ``lowrank``
    Top-k would be predicted 25 ms slower, above ``lowrank``'s measured time per unit of progress."""
    ch, engine, costs, wl = _fp16_measured_on_a_fast_link(clock)
    ref = _state(ch, "reference")
    slow = NetworkModel(1e-4, 8 / 1e7)  # 10 Mbit/s: fp16's correction is stale here
    engine.network.model = slow
    window(ch, 10, 10 * ref, clock)  # severe: a drift re-decision on the slow link
    h = ch.history[-1]
    assert (h["trigger"], h["drift_test"]) == ("drift", "severe_window")
    assert h["settled"] == [] and h["shift_from"] == ["fp16"] and h["shift_s"] == pytest.approx(-0.03)
    other = h["workload"]["other_s"]

    def raw(name):  # the raw model by hand, with the warm-up's fitted `other`
        c = next(c for c in costs if c.name == name).as_dict()
        return step_by_hand(c, {**wl.as_dict(), "other_s": other}, slow.alpha_s, slow.beta_s_per_byte, 4)

    for name in ("lowrank", "topk"):
        assert ch.predictions[name].step_s == pytest.approx(raw(name) - 0.03, rel=1e-9)
    assert ch.chosen == "lowrank"  # the better per unit of progress by the shifted model
    window(ch, 12, 1.0, clock)
    window(ch, 14, raw("lowrank") - 0.005, clock)  # lowrank: only 5 ms under the raw model
    h = ch.history[-1]
    assert h["settled"] == ["lowrank"] and h["shift_from"] == ["fp16"] and h["shift_s"] == pytest.approx(-0.03)
    eff = {k: p.step_s / p.time_per_progress_s for k, p in ch.predictions.items()}
    lowrank_tpp = (raw("lowrank") - 0.005) / eff["lowrank"]
    assert (raw("topk") - 0.03) / eff["topk"] < lowrank_tpp < (raw("topk") - 0.005) / eff["topk"]  # the premise
    assert ch.chosen == "topk" and h["trigger"] == "calibration"
    window(ch, 16, 1.0, clock)
    window(ch, 18, raw("topk") - 0.02, clock)
    assert ch.chosen == "topk" and _state(ch, "corrections")["topk"] == pytest.approx(-0.02)


def test_a_reference_window_far_off_a_measured_prediction_re_decides_instead_of_calibrating(clock):
    """fp16 was measured on the fast link; a moderate drift re-decision keeps it with a new reference
    due, and the link falls before its reference window: that window runs 10x its (measured)
    prediction. It is not taken as the reference: auto re-decides (trigger ``drift``, test
    ``reference_window``) on the slow link, although within ``min_interval`` of the last decision (a
    moderate one). A method never measured on this link, off by as much in its first window, is
    calibrated as usual."""
    ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=30, patience=2, drift=0.3)
    ref = _state(ch, "reference")
    for s in range(6, 34, 2):
        window(ch, s, ref, clock)
    window(ch, 34, 1.5 * ref, clock)
    window(ch, 36, 1.5 * ref, clock)  # patience, 30 steps after the last decision: fp16 kept, a new reference due
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"], h["chosen"]) == (36, "drift", "window", "fp16")
    assert _state(ch, "reference") is None
    fp16_pred = ch.predictions["fp16"].step_s
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls to 10 Mbit/s
    window(ch, 38, 1.0, clock)  # settling
    window(ch, 40, 10 * fp16_pred, clock)  # 4 steps after the moderate re-decision: not held
    assert _state(ch, "reference") is None
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (40, "drift", "reference_window") and ch.chosen == "lowrank"
    assert h["network"][1] == pytest.approx(8 / 1e7)
    window(ch, 42, 1.0, clock)  # settling
    lowrank_pred = ch.predictions["lowrank"].step_s
    window(ch, 44, 3 * lowrank_pred, clock)  # never measured on this link: its window calibrates it
    assert h["measured_step_s"] == pytest.approx(3 * lowrank_pred)  # taken as its window, not as a drift
    assert ch.history[-1]["trigger"] == "calibration" and _state(ch, "corrections")["lowrank"] > 0


def test_the_periodic_re_probe_counts_from_the_last_look_at_the_link(clock):
    """probe_every (20) counts from the last decision that looked at the link (the warm-up at step 0
    here), not from a calibration (step 4), which does not: the periodic re-decision comes at step 20,
    not 24; a checkpoint carries the count."""
    ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, probe_every=20)
    assert [(h["step"], h["trigger"]) for h in ch.history] == [(0, "warmup"), (4, "calibration")]
    ref = _state(ch, "reference")
    for s in (6, 8, 10, 12, 14, 16):
        window(ch, s, ref, clock)
    state = copy.deepcopy(ch.state_dict())  # a checkpoint: saved as it is now
    window(ch, 18, ref, clock)
    assert ch.history[-1]["trigger"] == "calibration"
    window(ch, 20, ref, clock)
    assert (ch.history[-1]["step"], ch.history[-1]["trigger"]) == (20, "periodic")
    # a gain re-decision does not look at the link: it keeps the running method's references
    assert policy.keeps_reference(Trigger.GAIN, "kept", "fp16", "fp16", True)
    resumed, _ = resume_after_warmup(clock, ch.config, *_fp16_inputs(), dense_wall_s=0.04)
    resume(resumed, state, clock, step=16)
    window(resumed, 18, ref, clock)
    window(resumed, 20, ref, clock)
    assert (resumed.history[-1]["step"], resumed.history[-1]["trigger"]) == (20, "periodic")


def _fp16_inputs():
    wl = Workload(0.002, (0.002,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.0005),
             MethodCost("lowrank", "lowrank", 0.002, 40_000.0, 0.3, True),
             MethodCost("topk", "allgather", 0.001, 20_000.0, 0.5, True)]
    return wl, costs, NetworkModel(1e-4, 8 / 1e10)


def test_a_correction_holds_for_the_link_it_was_measured_on(clock):
    """The quickstart run on a 1 Gbit/s -> 10 Mbit/s -> 1 Gbit/s link: ``lowrank`` runs far under its
    prediction on the slow link; carried back to the fast link that correction made it look faster
    than DDP. A correction is used only on a link within a factor 2 of the one it was measured on; a
    method already measured there keeps its newest figure, re-deciding only after a switch made on its
    older figure. The periodic re-decisions come every 2 steps after the last look at the link."""
    fast, slow = NetworkModel(1e-4, 8 / 1e9), NetworkModel(1e-4, 8 / 1e7)
    wl = Workload(0.001, (0.001,), (1_000_000,))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("lowrank", "lowrank", 0.06, 40_000.0, 0.3, True)]
    cfg = AutoConfig(candidates=("ddp", "lowrank"), window=2, explore=0, probe_every=2, probe_every_max=0,
                     severe_drift=0, drift=10.0)
    ch, engine = resume_after_warmup(clock, cfg, wl, costs, fast)
    raw_fast = {k: p.step_s for k, p in ch.predictions.items()}  # nothing measured yet: the raw model
    assert ch.chosen == "ddp"
    window(ch, 2, 9.0, clock)
    window(ch, 4, raw_fast["ddp"] + 0.002, clock)  # ddp measured 2 ms over the model on the fast link
    assert _state(ch, "corrections") == {"ddp": pytest.approx(0.002)}

    engine.network.model = slow
    window(ch, 6, raw_fast["ddp"] + 0.002, clock)  # the periodic look: the slow link
    raw_slow = {k: p.step_s for k, p in ch.predictions.items()}
    assert (ch.history[-1]["step"], ch.history[-1]["trigger"], ch.chosen) == (6, "periodic", "lowrank")
    window(ch, 8, 9.0, clock)
    window(ch, 10, raw_slow["lowrank"] - 0.05, clock)  # 50 ms under the model on the slow link
    assert _state(ch, "corrections")["lowrank"] == pytest.approx(-0.05)
    assert ch.chosen == "lowrank" and ch.history[-1]["trigger"] == "calibration"
    # with -50 ms lowrank would look faster than DDP on the fast link: the premise of the test
    assert (raw_fast["lowrank"] - 0.05) * 1.3 < raw_fast["ddp"] + 0.002 < raw_fast["lowrank"]

    engine.network.model = fast
    window(ch, 12, raw_slow["lowrank"] - 0.05, clock)  # the periodic look: the fast link again
    assert (ch.history[-1]["trigger"], ch.chosen) == ("periodic", "ddp")
    assert ch.predictions["lowrank"].step_s == pytest.approx(raw_fast["lowrank"])  # judged by the raw model
    assert ch.predictions["ddp"].step_s == pytest.approx(raw_fast["ddp"] + 0.002)  # its fast-link correction holds
    n = len(ch.history)
    window(ch, 14, 9.0, clock)
    # ddp measured again, faster: the newer figure. The periodic decision switched to it on its older
    # figure, so this first window decides once more (a calibration), and keeps it
    window(ch, 16, 0.5 * raw_fast["ddp"], clock)
    assert _state(ch, "corrections")["ddp"] == pytest.approx(-0.5 * raw_fast["ddp"]) and len(ch.history) == n + 1
    assert (ch.history[-1]["trigger"], ch.history[-1]["chosen"]) == ("calibration", "ddp")

    engine.network.model = slow  # back on the slow link, lowrank's slow-link correction counts again
    window(ch, 18, 0.5 * raw_fast["ddp"], clock)
    assert (ch.history[-1]["trigger"], ch.chosen) == ("periodic", "lowrank")
    assert ch.predictions["lowrank"].step_s == pytest.approx(raw_slow["lowrank"] - 0.05)

    state = ch.state_dict()  # the tags survive a checkpoint
    other, _ = resume_after_warmup(clock, cfg, wl, costs, slow)
    other.load_state_dict(state)
    got = policy.valid_corrections(_state(other, "corrections"), _state(other, "correction_beta"), slow)
    assert got == {"lowrank": pytest.approx(-0.05)}  # ddp's two figures were both measured on the fast link


# ---------------------------------------------------------------------- dense siblings and switch_margin
def _dense_pair(clock, margin: float, **cfg):
    """ddp and fp16 (and Top-k) on a fast link, after a warm-up whose DDP step was slow (its first
    steps), so the model puts DDP well above the 16-bit hook: the ``gpt`` case at 1 Gbit/s."""
    wl = Workload(0.02, (0.03, 0.03), (400_000, 400_000))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.001),
             MethodCost("topk", "allgather", 0.004, 64_000.0, 0.6, True)]
    config = AutoConfig(**{"candidates": ("ddp", "fp16", "topk"), "window": 2, "explore": 0, "probe_every": 0,
                           "family_margin": margin, **cfg})
    return resume_after_warmup(clock, config, wl, costs, NetworkModel(1e-4, 8 / 8e8), dense_wall_s=0.2)


@pytest.mark.parametrize("margin", [0.15, 0.0])
def test_a_dense_sibling_within_the_margin_runs_one_window_and_the_faster_is_kept(clock, margin):
    ch, engine = _dense_pair(clock, margin)
    assert ch.chosen == "fp16" and _state(ch, "corrections") == {"ddp": 0.0}
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    assert raw["fp16"] < raw["ddp"] == pytest.approx(0.2)  # ddp: the profiled step itself
    fp16_real = raw["fp16"] - 0.06  # the steady 16-bit step: 60 ms under the warm-up-based model
    tpp = {k: p.time_per_progress_s / p.step_s for k, p in ch.predictions.items()}
    ddp_moved = (raw["ddp"] + (fp16_real - raw["fp16"])) * tpp["ddp"]
    within = ddp_moved <= (1 + margin) * fp16_real * tpp["fp16"]
    assert within == (margin > 0)  # the premise: the 15 % margin admits DDP, 0 does not
    window(ch, 2, 1.0, clock)  # settling
    window(ch, 4, fp16_real, clock)  # fp16's first window
    assert _state(ch, "corrections")["fp16"] == pytest.approx(-0.06)
    if not within:  # no trial: the calibration keeps fp16 among the measured (explore=0)
        assert ch.chosen == "fp16" and [h["trigger"] for h in ch.history] == ["warmup", "calibration"]
        return
    assert ch.chosen == "ddp" and engine.calls[-1] == ("dense", "fp32")
    assert [h["trigger"] for h in ch.history] == ["warmup", "family"]
    state = copy.deepcopy(ch.state_dict())  # a checkpoint taken during the trial
    window(ch, 6, 1.0, clock)  # settling
    ddp_real = fp16_real - 0.011  # DDP really runs 11 ms faster (gpt at 1 Gbit/s)
    window(ch, 8, ddp_real, clock)
    assert _state(ch, "corrections")["ddp"] == pytest.approx(ddp_real - raw["ddp"])
    assert ch.chosen == "ddp" and [h["trigger"] for h in ch.history] == ["warmup", "family", "calibration"]
    assert ch.predictions["ddp"].step_s == pytest.approx(ddp_real)
    assert ch.predictions["fp16"].step_s == pytest.approx(fp16_real)
    n = len(ch.history)
    window(ch, 10, ddp_real, clock)  # both measured: no further trial or calibration
    assert len(ch.history) == n

    other, _ = _dense_pair(clock, margin)
    resume(other, state, clock)
    assert other.in_family_trial and other.chosen == "ddp" and policy.windowed(other.history) == {"fp16"}
    window(other, 6, 1.0, clock)
    window(other, 8, fp16_real + 0.02, clock)  # this time DDP is the slower one: back to fp16
    assert other.chosen == "fp16" and other.history[-1]["trigger"] == "calibration"
    assert not other.in_family_trial


@pytest.mark.parametrize("lead, margin, switches", [(0.02, 0.03, False), (0.05, 0.03, True), (0.02, 0.0, True)])
def test_a_measured_method_replaces_the_running_measured_one_only_on_a_lead_of_switch_margin(
        clock, lead, margin, switches):
    """fp16 measured, then DDP's trial window measured faster, so DDP runs. The host then slows: DDP's
    fresh figure is such that fp16's older one leads it by ``lead`` per unit of progress (set by hand).
    A periodic decision switches to fp16 only if that lead reaches ``switch_margin``; else DDP stays and
    fp16 is named as held off (the ``gpt`` ping-pong at 1 Gbit/s)."""
    ch, engine = _dense_pair(clock, 0.15, switch_margin=margin)
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    window(ch, 2, 1.0, clock)
    window(ch, 4, fp16_real, clock)
    window(ch, 6, 1.0, clock)
    window(ch, 8, fp16_real - 0.011, clock)
    assert ch.chosen == "ddp" and policy.windowed(ch.history) == {"ddp", "fp16"}
    per_progress = {k: p.time_per_progress_s / p.step_s for k, p in ch.predictions.items()}
    ddp_now = fp16_real * per_progress["fp16"] / (1.0 - lead) / per_progress["ddp"]
    corr = _state(ch, "corrections")
    d = redecide(ch, Trigger.PERIODIC, corrections={"ddp": corr["ddp"] + ddp_now - ch.predictions["ddp"].step_s})
    tpp = {k: p.time_per_progress_s for k, p in d.predictions.items()}
    assert 1.0 - tpp["fp16"] / tpp["ddp"] == pytest.approx(lead)  # the premise, from the predictions
    assert (d.chosen, d.previous) == ("fp16" if switches else "ddp", "ddp")
    assert d.held_by_margin == (None if switches else "fp16")


@pytest.mark.parametrize("ddp_over_fp16, kept, held", [
    (1.014, "fp16", None),  # DDP's trial 1.4 % slower: fp16 back
    (0.975, "fp16", "ddp"),  # 2.5 % faster, under switch_margin: fp16, the mode the trial interrupted, holds
    (0.96, "ddp", None),  # 4 % faster: DDP replaces it
])
def test_the_calibration_after_a_dense_siblings_trial_keeps_the_interrupted_mode_unless_the_sibling_leads_by_switch_margin(
        clock, ddp_over_fp16, kept, held):
    ch, engine = _dense_pair(clock, 0.15)
    assert ch.config.switch_margin == 0.03  # the default
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    window(ch, 2, 1.0, clock)
    window(ch, 4, fp16_real, clock)
    assert ch.chosen == "ddp" and ch.in_family_trial
    window(ch, 6, 1.0, clock)
    window(ch, 8, fp16_real * ddp_over_fp16, clock)
    h = ch.history[-1]
    tpp = {k: v["time_per_progress_s"] for k, v in h["predictions"].items()}
    assert tpp["ddp"] / tpp["fp16"] == pytest.approx(ddp_over_fp16, rel=1e-3)  # the premise, as recorded
    assert (h["trigger"], h["chosen"], h["previous"], h["held_by_margin"]) == ("calibration", kept, "ddp", held)
    assert engine.calls[-1] == (("dense", "fp16") if kept == "fp16" else ("dense", "fp32"))
    assert not ch.in_family_trial and ch.chosen == kept


def test_at_the_end_of_a_siblings_trial_a_third_measured_method_is_taken_as_any_calibration_takes_it(clock):
    """The interrupted mode holds only against the sibling. Here Top-k was measured on this link
    before (a checkpoint says so), and at the calibration that ends DDP's trial its figure is the best:
    2 % under fp16's per unit of progress (under ``switch_margin``), DDP's 1 % under. Top-k is taken,
    as any calibration takes the faster, and nothing is held."""
    ch, engine = _dense_pair(clock, 0.15)
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    per = {k: p.time_per_progress_s / p.step_s for k, p in ch.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    window(ch, 2, 1.0, clock)
    window(ch, 4, fp16_real, clock)
    assert ch.chosen == "ddp" and ch.in_family_trial
    topk_step = 0.98 * fp16_real * per["fp16"] / per["topk"]
    state = ch.state_dict()
    state["corrections"]["topk"] = topk_step - raw["topk"]
    state["correction_beta"]["topk"] = ch.network.beta_s_per_byte
    state["history"].insert(0, {"step": -1, "trigger": "warmup", "chosen": "topk", "measured_step_s": topk_step})
    resume(ch, state, clock)
    window(ch, 6, 1.0, clock)
    window(ch, 8, 0.99 * fp16_real * per["fp16"] / per["ddp"], clock)
    h = ch.history[-1]
    tpp = {k: v["time_per_progress_s"] for k, v in h["predictions"].items()}
    assert tpp["topk"] < tpp["ddp"] < tpp["fp16"] < tpp["topk"] / 0.97  # the premise: every lead under 3 %
    assert (h["trigger"], h["chosen"], h["previous"], h["held_by_margin"]) == ("calibration", "topk", "ddp", None)
    assert engine.calls[-2:] == [("slot", "topk"), ("dense", None)]


# ---------------------------------------------------------------------- older figures, running figures
def _fp16_back_after_ddps_trial(clock, ddp_slower_s, **cfg):
    """fp16 measured 60 ms under the warm-up's model, then DDP's trial window measured slower (by
    ``ddp_slower_s``, or 10 % if None), and the calibration back on fp16."""
    ch, engine = _dense_pair(clock, 0.15, **cfg)
    raw = {k: p.step_s for k, p in ch.predictions.items()}
    fp16_real = raw["fp16"] - 0.06
    window(ch, 2, 1.0, clock)
    window(ch, 4, fp16_real, clock)  # fp16 measured; DDP's trial
    window(ch, 6, 1.0, clock)
    window(ch, 8, 1.1 * fp16_real if ddp_slower_s is None else fp16_real + ddp_slower_s, clock)
    return ch, engine, raw, fp16_real


@pytest.mark.parametrize("confirmed", [False, True])
def test_a_switch_on_an_older_figure_is_decided_again_after_the_new_methods_first_window(clock, confirmed):
    """fp16 and DDP measured (fp16 faster), fp16 runs. The host slows: fp16's fresh figure (its new
    reference window) is 8 % above DDP's older one, so the periodic re-decision switches to DDP (a
    ``gain`` re-decision chooses the same: the policy, by hand below). DDP's first window then
    re-decides (trigger ``calibration``) between two figures a window apart: back to fp16 when DDP's
    window reads slower than fp16's figure, DDP kept when faster. The calibration's own switch back is
    not decided again. Meanwhile DDP is on trial: no re-measurement of the errors falls due."""
    ch, engine, raw, fp16_real = _fp16_back_after_ddps_trial(clock, 0.01, probe_every=30, gain_first=0,
                                                             gain_every=400)
    assert ch.chosen == "fp16" and [h["trigger"] for h in ch.history] == ["warmup", "family", "calibration"]
    ddp_figure = ch.predictions["ddp"].step_s
    assert ddp_figure == pytest.approx(fp16_real + 0.01)
    state = ch.state_dict()
    state["last_gain_step"] = 0  # the errors were measured at step 0: the next re-measurement is due from step 400
    resume(ch, state, clock)
    window(ch, 10, 1.08 * ddp_figure, clock)  # settling after the switch back
    window(ch, 12, 1.08 * ddp_figure, clock)  # fp16's reference: its fresh figure, no decision
    assert len(ch.history) == 3
    assert redecide(ch, Trigger.GAIN).chosen == "ddp"
    for s in range(14, 30, 2):
        window(ch, s, 1.08 * ddp_figure, clock)
    window(ch, 30, 1.08 * ddp_figure, clock)  # 30 steps after the warm-up's look at the link: periodic
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["previous"], h["chosen"]) == (30, "periodic", "fp16", "ddp")
    assert ch.in_trial and not sampling_at(ch, 500, clock)
    fp16_figure = ch.predictions["fp16"].step_s
    assert fp16_figure == pytest.approx(1.08 * ddp_figure)
    ddp_window = fp16_figure * (0.95 if confirmed else 1.11)  # by hand: faster or slower than fp16's figure
    window(ch, 32, 1.0, clock)  # settling
    window(ch, 34, ddp_window, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["previous"]) == (34, "calibration", "ddp")
    assert h["chosen"] == ("ddp" if confirmed else "fp16")
    assert engine.calls[-1] == ("dense", "fp32" if confirmed else "fp16")
    assert not ch.in_trial and sampling_at(ch, 500, clock)
    n = len(ch.history)
    steady = ch.predictions[ch.chosen].step_s
    window(ch, 36, steady, clock)  # settling after the switch back, or a steady window
    window(ch, 38, steady, clock)  # the calibration's own switch is not decided again
    assert len(ch.history) == n


@pytest.mark.parametrize("windows", [0, 1, 7])
def test_a_re_decision_weighs_the_running_method_by_all_its_windows_not_its_reference_alone(clock, windows):
    """fp16 and DDP measured, fp16 runs; its reference window after the calibration read 20 % slow
    (an outlier), and DDP's older figure is 10 % above fp16's true step. With at least 3 windows
    (the reference and 2 more), a periodic re-decision on the same link takes fp16's figure from the
    median of all of them (by hand: the true step) and keeps fp16; with fewer it uses the reference
    window and switches to DDP."""
    ch, engine, raw, fp16_real = _fp16_back_after_ddps_trial(clock, None, probe_every=1000)
    assert ch.chosen == "fp16" and ch.predictions["ddp"].step_s == pytest.approx(1.1 * fp16_real)
    window(ch, 10, 1.0, clock)  # settling
    window(ch, 12, 1.2 * fp16_real, clock)  # the reference window: an outlier; fp16 was measured, no decision
    assert [h["trigger"] for h in ch.history] == ["warmup", "family", "calibration"]
    assert ch.chosen == "fp16" and _state(ch, "corrections")["fp16"] == pytest.approx(1.2 * fp16_real - raw["fp16"])
    for k in range(windows):  # within drift (30 %) of the reference: no re-decision
        window(ch, 14 + 2 * k, fp16_real, clock)
    assert len(ch.history) == 3
    assert _state(ch, "run_medians") == pytest.approx([1.2 * fp16_real] + [fp16_real] * windows)
    # the periodic look falls at the next window (a checkpoint whose last look at the link was 1000 steps ago)
    state = ch.state_dict()
    state["last_link_step"] = 40 - 1000
    resume(ch, state, clock, step=38)
    window(ch, 40, fp16_real, clock)  # this window counts too
    medians = [1.2 * fp16_real] + [fp16_real] * (windows + 1)  # by hand
    h = ch.history[-1]
    assert (h["step"], h["trigger"]) == (40, "periodic")
    if len(medians) >= 3:
        assert h["running_figure_s"] == pytest.approx(sorted(medians)[len(medians) // 2])
        assert h["predictions"]["fp16"]["step_s"] == pytest.approx(fp16_real)
        assert h["chosen"] == "fp16"
    else:
        assert h["running_figure_s"] is None
        assert h["predictions"]["fp16"]["step_s"] == pytest.approx(1.2 * fp16_real)
        assert (h["chosen"], h["previous"]) == ("ddp", "fp16")


def test_a_gain_re_measurement_waits_until_a_trial_window_is_measured(clock):
    """A re-measurement of the errors that fell due while a method was on trial (a dense sibling's
    window, or a method an exploration installed) is not taken until that window has been measured;
    before and after a trial it is taken when due (read as the chooser arming the next step's gradient
    sample). The ``cnn`` case at 1 Gbit/s: the first re-measurement came inside DDP's trial."""
    ch, _ = _dense_pair(clock, 0.15)
    state = ch.state_dict()
    state["last_gain_step"] = 1  # the warm-up's errors, measured on step 1
    resume(ch, state, clock)
    due = 1 + ch.config.gain_first - 1  # by hand: gain_first (20) steps after step 1's sample
    assert not sampling_at(ch, due - 1, clock) and sampling_at(ch, due, clock)  # not on trial: when due
    window(ch, 2, 1.0, clock)  # settling
    window(ch, 4, ch.predictions["fp16"].step_s - 0.06, clock)  # fp16 measured: DDP's trial begins
    assert ch.in_trial and ch.chosen == "ddp"
    assert not sampling_at(ch, due, clock) and not sampling_at(ch, due + 100, clock)
    window(ch, 6, 1.0, clock)  # settling
    assert not sampling_at(ch, due, clock)  # the trial's window is still to come
    window(ch, 8, ch.predictions["fp16"].step_s - 0.011, clock)  # DDP's window measured
    assert ch.history[-1]["trigger"] == "calibration" and not ch.in_trial
    assert sampling_at(ch, due, clock)

    # an exploration's trial: topk installed by the calibration, unmeasured until its window
    explorer, _ = _slow_link(clock, 1)
    state = explorer.state_dict()
    state["last_gain_step"] = 0
    resume(explorer, state, clock)
    assert sampling_at(explorer, 50, clock) and not explorer.in_trial  # the warm-up's pick is not a trial
    window(explorer, 4, 1.0, clock)
    window(explorer, 6, explorer.predictions["lowrank"].step_s + 0.03, clock)
    assert explorer.chosen == "topk" and explorer.history[-1]["trigger"] == "calibration"
    assert explorer.in_trial and not sampling_at(explorer, 50, clock)
    window(explorer, 8, 1.0, clock)
    window(explorer, 10, explorer.predictions["topk"].step_s + 0.002, clock)
    assert explorer.chosen == "topk" and not explorer.in_trial and sampling_at(explorer, 50, clock)


def test_the_state_is_a_snapshot(clock):
    """state_dict() is the state of its moment: later decisions do not change a dict already taken."""
    ch, _, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=1)
    state = ch.state_dict()
    n = len(state["history"])
    window(ch, 6, 10 * _state(ch, "reference"), clock)  # a severe drift: a decision
    assert len(ch.history) == n + 1 and len(state["history"]) == n


# ---------------------------------------------------------------------- the errors' re-measurement
def _errors_by_hand(g):
    """Each candidate's relative error on the gradient ``g``, in float64, written from the definitions:
    a 16-bit cast's rounding, Top-k's residual (every element but the k largest by magnitude)."""
    import math

    import torch

    x = g.double()
    total = float((x ** 2).sum())

    def top(ratio):
        k = max(1, math.ceil(ratio * x.numel()))
        return float((x.abs().sort(descending=True).values[k:] ** 2).sum()) / total

    def cast(dtype):
        return float(((g.to(dtype).double() - x) ** 2).sum()) / total

    return {"ddp": 0.0, "fp16": cast(torch.float16), "bf16": cast(torch.bfloat16), "topk": top(0.01),
            "topk3": top(0.03)}


def test_the_errors_re_measurement_skips_only_candidates_that_cannot_win(clock):
    """The ``gain`` re-measurement (due ``gain_first`` steps after the last one: the chooser samples the
    next step's gradients) measures the running method's error first, then only the candidates whose
    predicted step is at most the least time per unit of progress measured so far: a candidate above
    it loses whatever its error. Oracles, on random cases: the set measured is the by-hand bound's (the
    steps by hand, the running method's error by hand on the sampled gradient); the pick after the
    re-decision is the brute-force argmin with the errors by hand, and the same with every skipped
    candidate's error set to 0 (its best case): skipping changed nothing."""
    import random

    import torch
    from auto_oracle import argmin_by_hand

    rng = random.Random(17)
    w = 1.5
    outcomes = {"skipped_some": 0, "measured_all": 0, "switched": 0}
    for _ in range(80):
        numels = tuple(rng.choice([5_000, 80_000, 400_000, 2_000_000]) for _ in range(rng.randint(1, 6)))
        wl = Workload(rng.uniform(0.001, 0.05), tuple(rng.uniform(0, 0.02) for _ in numels), numels,
                      rng.uniform(0, 0.01), rng.uniform(0, 0.01))
        net = NetworkModel(rng.choice([0.0, 1e-5, 5e-4]), 8 / rng.choice([1e7, 1e8, 1e9, 1e10, 1e13, 1e13]))
        n, numel = rng.choice([2, 4, 8]), wl.numel

        def codec(top):
            return rng.choice([0.0, rng.uniform(0, top)])
        costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", codec(0.01), delta2=1e-7),
                 MethodCost("topk", "allgather", codec(0.03), 8 * numel * 0.01, rng.uniform(0.0, 0.95), True),
                 MethodCost("topk3", "allgather", codec(0.03), 24 * numel * 0.01, rng.uniform(0.0, 0.9), True)]
        cfg = AutoConfig(candidates=tuple(c.name for c in costs), probe_every=0, progress_weight=w, gain_drift=0.0,
                         switch_margin=0.0)
        param = torch.nn.Parameter(torch.zeros(1000))
        engine = FakeEngine(net, n, params=[param])
        ch, _ = resume_after_warmup(clock, cfg, wl, costs, net, n, engine=engine, last_gain_step=0)
        running = ch.chosen
        step_end(ch, 19, 0.01, clock)  # the re-measurement falls due: the next step is sampled
        assert ch.state_dict()["sampling"]
        g = torch.randn(1000, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        g = g * torch.rand(1000, generator=torch.Generator().manual_seed(rng.randrange(10**6))) ** rng.choice([0, 2, 6])
        (param * g).sum().backward()  # the sampled step's backward: this rank's gradient is g
        step_end(ch, 20, 0.01, clock)
        new = _errors_by_hand(g)
        d = (wl.as_dict(), net.alpha_s, net.beta_s_per_byte, n)
        steps = {c.name: step_by_hand(c.as_dict(), *d) for c in costs}
        run = next(c for c in costs if c.name == running)
        bound = steps[running] * (1 + w * (new[running] if run.error_feedback else new[running] / n))
        want = {running} | {name for name, s in steps.items() if s <= bound}
        check = ch.gain_checks[-1]
        assert set(check["delta2"]) == want and set(check["skipped"]) == {c.name for c in costs} - want
        for name, d2 in check["delta2"].items():
            assert d2 == pytest.approx(new[name], rel=1e-5, abs=1e-12)
        measured = [c.as_dict() | ({"delta2": new[c.name]} if c.name in want else {}) for c in costs]
        best_case = [c | ({} if c["name"] in want else {"delta2": 0.0}) for c in measured]
        pick = argmin_by_hand(measured, *d, w)
        assert ch.chosen == pick == argmin_by_hand(best_case, *d, w)
        # gain_drift 0: any move re-decides (none where only an exact method was measured)
        assert (ch.history[-1]["trigger"] == "gain") == (check["moved"] > 0)
        outcomes["skipped_some" if len(want) < len(costs) else "measured_all"] += 1
        outcomes["switched"] += pick != running
    assert outcomes["skipped_some"] >= 5 and outcomes["measured_all"] >= 2 and outcomes["switched"] >= 5, outcomes


# ---------------------------------------------------------------------- the every-step tests (severe_steps)
LONG = 1000  # a window so long that only the every-step tests act


def _every_step(clock, **cfg):
    """fp16 measured on the fast link (its reference set at step 4), resumed at step 4 with the long
    window; from here on the engine carries each step's wall to the next step (as GCEngine does)."""
    ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, **cfg)
    ref = _state(ch, "reference")
    assert ref is not None and _state(ch, "last_decision_step") == 4 and ch.chosen == "fp16"
    sev = resumed_with(ch, clock, window=LONG)
    engine.carry = True
    return sev, engine, ref


@pytest.mark.parametrize("factor", [10.0, 0.2, 3.0, 0.3])
def test_severe_drift_is_seen_within_severe_steps_of_the_change(clock, factor):
    """fp16 runs at its reference (measured at step 4); from step 10 every step takes ``factor``
    times as long. Each step's agreed wall is read at the next step's end, and the step right after a
    decision (5) is left out. At 8x or more (slower only, under a dense mode) that one step is enough:
    step 10's wall, read at step 11 (test ``step``). At 4x or more (or a quarter) the median of the
    last 3 (steps 9-11) sees it at step 12; a smaller change needs every one of them off (steps
    10-12, at step 13). A single slow step under 8x (or any single fast one) never sets it off, two
    of three at 2.5x (or 0.4x) not either; ``min_interval`` holds the decision back;
    ``severe_steps=0`` turns the test off."""
    ch, engine, ref = _every_step(clock, min_interval=4)
    if factor > 1:
        engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls to 10 Mbit/s
    first = 11 if factor >= 8 else 12 if factor >= 4 or factor <= 0.25 else 13  # by hand, as above
    test = "step" if factor >= 8 else "steps"
    walls(ch, {s: ref for s in range(5, 10)} | {s: factor * ref for s in range(10, first)}, clock)
    assert ch.history[-1]["step"] == 4
    walls(ch, {first: factor * ref}, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (first, "drift", test)
    if factor > 1:  # re-decided on the slow link: a compressed method
        assert ch.chosen == "lowrank" and h["network"][1] == pytest.approx(8 / 1e7)

    one, engine, _ = _every_step(clock, min_interval=4)
    walls(one, {s: ref for s in range(5, 10)} | {10: factor * ref} | {s: ref for s in range(11, 20)}, clock)
    if factor >= 8:  # one step at 8x or more under a dense mode: seen at step 11, alone
        assert (one.history[-1]["step"], one.history[-1]["drift_test"]) == (11, "step")
    else:
        assert one.history[-1]["step"] == 4  # one slow (or fast) step: no decision

    two, engine, _ = _every_step(clock, min_interval=4)
    f2 = 2.5 if factor > 1 else 0.4
    walls(two, {s: ref for s in range(5, 10)} | {s: (ref if s % 3 == 0 else f2 * ref) for s in range(10, 30)}, clock)
    assert two.history[-1]["step"] == 4  # two of three at 2.5x (0.4x), again and again: no decision

    held, engine, _ = _every_step(clock, min_interval=30)
    walls(held, {s: ref for s in range(5, 10)} | {s: factor * ref for s in range(10, first + 1)}, clock)
    assert (held.history[-1]["step"], held.history[-1]["drift_test"]) == (first, test)
    engine.carry = False  # the new method's settling and reference windows, on its own walls
    w2 = resumed_with(held, clock, window=2)
    window(w2, first + 2, 1.0, clock)  # settling
    new_ref = w2.predictions[w2.chosen].step_s
    window(w2, first + 4, new_ref, clock)  # the reference
    n = len(w2.history)
    engine.carry = True
    back = resumed_with(w2, clock, step=first + 4, window=LONG)
    walls(back, {s: new_ref / factor for s in range(first + 5, first + 32)}, clock)  # held until 30 steps after
    assert len(back.history) == n + 1
    assert (back.history[-1]["step"], back.history[-1]["drift_test"]) == (first + 30, "steps")

    off, engine, _ = _every_step(clock, min_interval=4, severe_steps=0)
    walls(off, {s: ref for s in range(5, 10)} | {s: factor * ref for s in range(10, 20)}, clock)
    assert off.history[-1]["step"] == 4


@pytest.mark.parametrize("case", ["marked", "compressed", "just_under", "exactly"])
def test_the_one_step_test_acts_on_a_dense_mode_only_and_not_on_a_marked_step(clock, case):
    """The one-step test (4 x severe_drift = 8x the reference by default): a dense mode's step of
    exactly 8x re-decides at the next step's end. Not when the step was marked (``mark_wall``: an
    epoch's first step, a checkpoint saved before it): the test of the last 3 sees the slow link a step
    later. Not under a compressed method (a checkpoint in which lowrank runs), nor at 7.9x."""
    ch, engine, ref = _every_step(clock, min_interval=4)
    if case == "compressed":
        ch = resumed_with(ch, clock, edit=lambda st: st.update(chosen="lowrank"))
        assert engine.dense_mode is None
    walls(ch, {s: ref for s in range(5, 10)}, clock)
    if case == "marked":
        engine.step = 10  # the step about to run: its wall holds the epoch's boundary (or a checkpoint)
        ch.mark_wall()
    factor = 7.9 if case == "just_under" else 8.0
    # the marked case: the link did fall, steps 10 and 11 are both slow
    walls(ch, {10: factor * ref, 11: factor * ref if case == "marked" else ref}, clock)
    h = ch.history[-1]
    if case == "exactly":
        assert (h["step"], h["trigger"], h["drift_test"]) == (11, "drift", "step")
    else:
        assert h["step"] == 4
    if case == "marked":  # step 11's wall, read at 12, is not marked: the two tests see the fall there
        walls(ch, {12: 8.0 * ref}, clock)
        assert (ch.history[-1]["step"], ch.history[-1]["drift_test"]) == (12, "steps")


def _kept_with_a_new_reference_due(clock):
    """A moderate drift re-decision at step 8 keeps fp16 (measured on this link): no reference until its
    second window. Resumed there with the long window and carried walls."""
    ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=4, drift=0.3, patience=2)
    ref = _state(ch, "reference")
    window(ch, 6, 1.5 * ref, clock)
    window(ch, 8, 1.5 * ref, clock)
    h = ch.history[-1]
    assert (h["step"], h["drift_test"], h["chosen"]) == (8, "window", "fp16") and _state(ch, "reference") is None
    sev = resumed_with(ch, clock, window=LONG)
    engine.carry = True
    return sev, engine


def test_before_its_reference_a_calibrated_method_is_judged_by_its_prediction_every_step(clock):
    """fp16 kept at step 8 with a new reference due. The link falls at once; steps from 10 on (9 is the
    switch's step, left out) run 10x fp16's prediction, which carried its own correction: at step 11,
    where step 10's wall is read, auto re-decides (test ``step``). The method it moves to, never
    measured on the slow link, runs 3x its raw prediction: that is what its first window calibrates,
    not a drift, and nothing re-decides."""
    ch, engine = _kept_with_a_new_reference_due(clock)
    fp16_pred = ch.predictions["fp16"].step_s
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)
    walls(ch, {s: 10 * fp16_pred for s in range(9, 11)}, clock)
    assert ch.history[-1]["step"] == 8
    walls(ch, {11: 10 * fp16_pred}, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (11, "drift", "step") and ch.chosen == "lowrank"
    lowrank_pred = ch.predictions["lowrank"].step_s
    walls(ch, {s: 3 * lowrank_pred for s in range(12, 32)}, clock)
    assert ch.history[-1]["step"] == 11

    # one step at 8x fp16's (calibrated) prediction before the reference: the one-step test, at once
    one, engine = _kept_with_a_new_reference_due(clock)
    pred = one.predictions["fp16"].step_s
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls
    walls(one, {9: pred, 10: 8.0 * pred}, clock)
    assert one.history[-1]["step"] == 8 and _state(one, "reference") is None
    walls(one, {11: pred}, clock)  # step 10's wall, read here
    assert (one.history[-1]["step"], one.history[-1]["drift_test"]) == (11, "step") and one.chosen == "lowrank"
    # ... but not at 7.9x
    under, engine = _kept_with_a_new_reference_due(clock)
    walls(under, {9: pred, 10: 7.9 * pred, 11: pred}, clock)
    assert under.history[-1]["step"] == 8

    # two steps of three at 3x fp16's prediction, again and again (a busy host), before the reference: nothing
    two, engine = _kept_with_a_new_reference_due(clock)
    walls(two, {s: (pred if s % 3 == 0 else 3 * pred) for s in range(9, 18)}, clock)
    assert two.history[-1]["step"] == 8 and _state(two, "reference") is None


def _lowrank_with_an_exchange_reference(clock, exchange_s, **cfg):
    """The link fell to 10 Mbit/s; a severe window at step 6 moved fp16 to lowrank; resumed there with
    4-step windows and carried walls, its reference window (steps 11-14, the calibration at 14 keeps it)
    ran its predicted step, each step with ``exchange_s`` in the compressed exchange (agreed; or one value
    per step, a list)."""
    ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=4, explore=0, **cfg)
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)
    window(ch, 6, 10 * _state(ch, "reference"), clock)
    assert ch.chosen == "lowrank" and ch.history[-1]["step"] == 6
    x = resumed_with(ch, clock, window=4)
    engine.carry = True
    step_s = x.predictions["lowrank"].step_s
    walls(x, {s: step_s for s in range(7, 11)}, clock)  # settling
    per_step = exchange_s if isinstance(exchange_s, list) else [exchange_s] * 4
    walls(x, {s: (step_s, e) for s, e in zip(range(11, 15), per_step)}, clock)
    assert [(h["step"], h["trigger"]) for h in x.history][-1] == (14, "calibration")
    assert x.chosen == "lowrank" and _state(x, "reference") == pytest.approx(step_s)
    return x, engine, step_s


def test_a_link_that_came_back_is_seen_in_a_compressed_methods_exchange(clock):
    """lowrank's reference window on the fallen link (20 ms of each step in its exchange); from step 17
    the link is back at 10 Gbit/s: the step falls to 45 ms (under the 2x step test), the exchange to
    2 ms. The median of the last 3 exchanges (16-18) is 10x off at step 18, and 18 ms is over a tenth of
    the step: auto re-decides there (test ``exchange``) and the fast link puts it back on fp16. A
    checkpoint carries the exchange reference. An exchange that moves by as large a factor but by less
    than a tenth of the step (4 ms → 1 ms), or for one step only, or that gets slower, re-decides
    nothing; nor does anything with ``severe_steps=0``."""
    ch, engine, step_s = _lowrank_with_an_exchange_reference(clock, 0.02)
    assert _state(ch, "reference_exchange") == pytest.approx(0.02)
    state = copy.deepcopy(ch.state_dict())
    engine.network.model = NetworkModel(1e-4, 8 / 1e10)
    walls(ch, {15: (step_s, 0.02), 16: (step_s, 0.02), 17: (0.045, 0.002)}, clock)
    assert ch.history[-1]["step"] == 14
    walls(ch, {18: (0.045, 0.002)}, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (18, "drift", "exchange") and ch.chosen == "fp16"
    assert h["network"][1] == pytest.approx(8 / 1e10)

    resumed = resumed_with(ch, clock, step=14, edit=lambda st: (st.clear(), st.update(copy.deepcopy(state))))
    assert _state(resumed, "reference_exchange") == pytest.approx(0.02) and resumed.chosen == "lowrank"
    walls(resumed, {15: (step_s, 0.02), 16: (step_s, 0.02), 17: (0.045, 0.002), 18: (0.045, 0.002)}, clock)
    assert (resumed.history[-1]["step"], resumed.history[-1]["drift_test"]) == (18, "exchange")  # as uninterrupted

    slower, _, step_s = _lowrank_with_an_exchange_reference(clock, 0.02)
    walls(slower, {s: (step_s, 0.2) for s in range(15, 32)}, clock)  # 10x slower: the step test's business
    assert slower.history[-1]["step"] == 14

    small, _, step_s = _lowrank_with_an_exchange_reference(clock, 0.004)
    walls(small, {s: (step_s, 0.001) for s in range(15, 32)}, clock)  # 4x, but 3 ms of a 55 ms step
    assert small.history[-1]["step"] == 14

    once, _, step_s = _lowrank_with_an_exchange_reference(clock, 0.02)
    walls(once, {s: (step_s, 0.002 if s == 22 else 0.02) for s in range(15, 32)}, clock)
    assert once.history[-1]["step"] == 14

    off, engine, _ = _every_step(clock, min_interval=4, severe_steps=0)
    assert _state(off, "reference_exchange") is None


def test_the_exchange_reference_is_the_reference_windows_fastest_exchange(clock):
    """A small exchange on a steady shaped link has two modes. The reference window caught the slow one
    in 3 of its 4 steps (20 ms) and the fast one once (8 ms): the reference is 8 ms, so later steps in
    the fast mode re-decide nothing; a link that came back (0.5 ms) still does."""
    steady, _, step_s = _lowrank_with_an_exchange_reference(clock, [0.02, 0.008, 0.02, 0.02])
    assert _state(steady, "reference_exchange") == pytest.approx(0.008)
    walls(steady, {s: (step_s, 0.008) for s in range(15, 42)}, clock)
    assert steady.history[-1]["step"] == 14
    back, _, step_s = _lowrank_with_an_exchange_reference(clock, [0.02, 0.008, 0.02, 0.02])
    walls(back, {s: (step_s, 0.0005) for s in range(15, 18)}, clock)
    h = back.history[-1]  # step 15 is left out (the step after the calibration): 14, 16, 17 at step 17
    assert (h["step"], h["trigger"], h["drift_test"]) == (17, "drift", "exchange")


def test_a_periodic_decision_that_kept_the_method_on_an_unchanged_link_keeps_its_references(clock):
    """lowrank measured on the slow link (reference step and exchange); the periodic look at step 22 finds
    the (pinned) link as it was and keeps lowrank with its references, no settling window, and when the
    link comes back right after it (exchanges 10x faster from step 23) the exchange test sees it at step
    25 against the old reference. (A look that measured a new link starts the references again:
    ``policy.keeps_reference``, tests/test_auto_policy_behaviour.py.)"""
    ch, engine, step_s = _lowrank_with_an_exchange_reference(clock, 0.02)
    ref, ref_x = _state(ch, "reference"), _state(ch, "reference_exchange")
    # the last look at the link was the drift decision at step 6: the next one 16 steps later, at step 22
    per = resumed_with(ch, clock, step=14, probe_every=16, edit=lambda st: st.update(link_interval=16))
    walls(per, {s: (step_s, 0.02) for s in range(15, 23)}, clock)
    h = per.history[-1]
    assert (h["step"], h["trigger"], h["chosen"], h["previous"]) == (22, "periodic", "lowrank", "lowrank")
    assert h["kept_reference"] and h["measured_step_s"] == ref
    st = per.state_dict()
    assert (st["reference"], st["reference_exchange"], st["settling"]) == (ref, ref_x, False)
    walls(per, {s: (step_s, 0.002) for s in range(23, 26)}, clock)
    h = per.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (25, "drift", "exchange")


def test_a_window_reads_its_median_from_the_carried_walls(clock):
    """The windows' median comes from the walls carried in the steps' own messages (the mean over ranks,
    read one step late), shifted one step back. The other ranks' steps here took 3.67x this rank's (the
    mean: 3x), so the carried walls say the step tripled while this rank's own walls stayed at the
    reference: the two sources give different decisions. A window in which one carried wall was lost
    falls back to this rank's walls (agreed)."""
    for lose in (None, 9):
        ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=1, severe_steps=0, patience=9)
        ref = _state(ch, "reference")
        engine.carry = True
        walls(ch, {s: ref for s in range(5, 9)}, clock)  # two windows at the reference, the ranks alike
        assert ch.history[-1]["step"] == 4
        engine.others_factor = (3 * 4 - 1) / 3  # from step 8 on the mean over 4 ranks is 3x this rank's wall
        for s in (9, 10):
            engine.carry = s != lose  # the lost case: step 9 drops the wall it should carry (step 8's)
            walls(ch, {s: ref}, clock)
        h = ch.history[-1]
        if lose is None:  # the carried steps 8-9: 3x the reference, a severe window
            assert (h["step"], h["trigger"], h["drift_test"]) == (10, "drift", "severe_window")
        else:  # step 8's wall was lost: this rank's walls, at the reference
            assert h["step"] == 4 and _state(ch, "drifted") == 0


def test_a_decision_steps_wall_is_carried_so_the_next_window_reads_it(clock):
    """A periodic re-decision that keeps fp16 (step 6) keeps the window running, so the next window
    (steps 7-8, read as 6-7) holds the decision step's wall, carried like any other: with the other
    ranks at 3x (the mean over ranks), that window is a severe one at step 8."""
    ch, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=1, gain_every=0, probe_every=6)
    ref = _state(ch, "reference")
    engine.carry = True
    walls(ch, {5: ref, 6: ref}, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["chosen"]) == (6, "periodic", "fp16") and _state(ch, "reference") == ref
    engine.others_factor = (3 * 4 - 1) / 3  # from step 6 on, the others take 3.67x: the mean 3x
    walls(ch, {7: ref, 8: ref}, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (8, "drift", "severe_window")


# ---------------------------------------------------------------------- intervals
def test_the_periodic_look_at_an_unchanged_link_comes_twice_as_late_each_time_up_to_probe_every_max(clock):
    """probe_every 10, probe_every_max 40, a window every 2 steps on a steady (pinned) link: the periodic
    re-decisions come at steps 10, 30, 70, 110, 150 (each found the link as it was and kept the method,
    so the interval went 10 → 20 → 40 → 40). The interval travels with a checkpoint. With probe_every_max
    0: every probe_every steps. (A look that finds the link moved starts from probe_every again:
    ``policy.next_link_interval``.) Oracle: the steps, by hand."""
    wl, costs, net = _fp16_inputs()
    for cap, want in ((40, [10, 30, 70, 110, 150]), (0, [10, 20, 30, 40, 50])):
        cfg = AutoConfig(candidates=("ddp", "fp16", "lowrank", "topk"), window=2, patience=99, min_interval=1,
                         probe_every=10, probe_every_max=cap, severe_drift=0, gain_every=0, explore=0,
                         family_margin=0.0)
        ch, engine = resume_after_warmup(clock, cfg, wl, costs, net, dense_wall_s=0.04)
        step = ch.predictions[ch.chosen].step_s
        periodic = []
        for at in range(2, 2 * want[-1] // 2 + 1, 2):
            n = len(ch.history)
            window(ch, at, step, clock)
            if len(ch.history) > n and ch.history[-1]["trigger"] == "periodic":
                periodic.append((at, ch.history[-1]["link_interval"]))
            if at == 120 and cap:
                other = resumed_with(ch, clock, step=120)
                assert _state(other, "link_interval") == 40
        assert [a for a, _ in periodic] == want
        if cap:
            assert [i for _, i in periodic] == [20, 40, 40, 40, 40]


def test_the_errors_re_measurement_interval_travels_with_a_checkpoint(clock):
    """gain_every_max: the doubled interval is in the state; a state written before it had one resumes at
    gain_every."""
    wl, costs, net = _fp16_inputs()
    cfg = AutoConfig(candidates=("ddp", "fp16", "lowrank", "topk"), gain_every=5, gain_every_max=40)
    ch, _ = resume_after_warmup(clock, cfg, wl, costs, net, dense_wall_s=0.04)
    other = resumed_with(ch, clock, edit=lambda st: st.update(gain_interval=20))
    assert _state(other, "gain_interval") == 20
    older = resumed_with(ch, clock, edit=lambda st: st.pop("gain_interval"))
    assert _state(older, "gain_interval") == 5


# ---------------------------------------------------------------------- a group that takes the direct exchange
@pytest.fixture
def one_rank_gloo():
    """Starts (when called) an initialised gloo process group of one rank: a chooser built after it agrees
    dense walls at once (the direct exchange) and sings the link canary, while every agreement is still
    the identity. The setup before it runs without one (walls from this rank's own windows)."""
    import torch.distributed as dist

    yield lambda: dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _dense_step(ch, step, wall, clock, **stats):
    """Step ``step`` through the strategy's calls: the closure (the canary before it, when due), then its
    end after ``wall`` seconds with the engine's ``StepStats``."""
    from lightning_gc.engine.stats import StepStats

    engine = ch.engine
    engine.step = step
    ch.wrap_closure(lambda: None)()
    engine.step = step + 1
    engine.last_step = StepStats(step=step, dense=engine.step_is_dense(), **stats)
    clock.now += wall
    ch.after_optimizer_step()


def test_a_dense_modes_wall_agreed_at_once_decides_at_the_slow_step_itself(clock, one_rank_gloo):
    """On a group that takes the direct exchange (up to 8 ranks off NCCL) a dense mode's wall is agreed at
    its own step's end instead of riding in the next step's first bucket: the one-step test acts at the
    slow step itself (10; a carried wall is read at 11), and nothing is handed to ``carry_wall``. Once a
    compressed method runs, its wall rides in the closing report again (``carry_wall``)."""
    from lightning_gc.auto.candidates import candidate

    ch0, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=4)
    one_rank_gloo()
    ch = resumed_with(ch0, clock, window=LONG)
    ref = _state(ch, "reference")
    for s in range(5, 10):
        _dense_step(ch, s, ref * (1 + s / 100), clock)
        assert engine.carried is None
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)  # the link falls to 10 Mbit/s (pinned: what it finds)
    _dense_step(ch, 10, 8.0 * ref, clock)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"]) == (10, "drift", "step")
    assert candidate(ch.chosen).compressor is not None  # a compressed method on the fallen link
    _dense_step(ch, 11, 0.5 * ref, clock)
    assert engine.carried == pytest.approx(0.5 * ref)  # carried in its closing report, not agreed alone


def test_a_step_the_link_canary_stopped_re_decides_at_once_on_its_beta(clock, one_rank_gloo):
    """Under a dense mode on a group that takes the direct exchange, with the canary on, the engine sings
    it before each step (the closure's start), carrying nothing (NaN). A step the canary stopped
    (StepStats.dense_stopped) makes auto re-decide at that step's end, whatever ``min_interval`` says
    (30; the last decision at step 4), on β from the canary (its time on the fastest rank less α, over
    the N-1 = 3 copies of its 64 KiB each rank sent; no probe): 10 Mbit/s makes lowrank the pick, and no
    canary is sung before the compressed steps after it. A canary never gives a link faster than the
    model's. Oracle: β written out by hand."""
    ch0, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=30)
    engine.network.pinned = False
    one_rank_gloo()
    ch = resumed_with(ch0, clock, window=LONG, canary_bytes=65536)
    assert engine.canary is not None and engine.canary.nbytes == 65536
    alpha, ref = engine.network.model.alpha_s, _state(ch, "reference")
    for s in range(5, 10):
        _dense_step(ch, s, ref * (1 + s / 100), clock)
    assert [a for a, _ in engine.sung] == [5, 6, 7, 8, 9] and ch.history[-1]["step"] == 4
    assert all(c != c for _, c in engine.sung)  # every canary carried NaN: nothing rides in it
    _dense_step(ch, 10, 0.2, clock, dense_stopped=True, dense_check_s=0.16, dense_check_predicted_s=2e-4,
                dense_check_bytes=65536)
    h = ch.history[-1]
    assert (h["step"], h["trigger"], h["drift_test"], h["network_source"]) == (10, "drift", "canary", "canary")
    want = (0.16 - alpha) / (3 * 65536)  # 3 x 64 KiB at 10 Mbit/s (0.157 s), plus alpha
    assert h["network"] == [alpha, pytest.approx(want)] and engine.network.model.beta_s_per_byte == pytest.approx(want)
    assert ch.chosen == "lowrank"
    _dense_step(ch, 11, 0.05, clock)  # a compressed method runs: no canary
    assert len(engine.sung) == 6

    # a canary faster than the model's β (the fastest rank was early) never makes the link faster
    import torch.distributed as dist

    dist.destroy_process_group()  # the setup without a group, as above
    ch0, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=30)
    engine.network.pinned = False
    beta = engine.network.model.beta_s_per_byte
    one_rank_gloo()
    fast = resumed_with(ch0, clock, window=LONG, canary_bytes=65536)
    _dense_step(fast, 5, 0.01, clock, dense_stopped=True, dense_check_s=1e-5, dense_check_predicted_s=2e-4,
                dense_check_bytes=65536)
    assert fast.history[-1]["drift_test"] == "canary" and fast.history[-1]["network"][1] == beta


def test_with_the_canary_on_a_fall_inside_a_dense_step_is_acted_on_at_that_steps_end(clock, one_rank_gloo):
    """The link falls during step 8 (its canary, sung before it, saw the fast link): step 8 runs 30x its
    reference. Its wall, agreed at its own end, makes the one-step test re-decide there (test ``step``;
    the new β from that dense step, no probe), and no canary is sung before step 9, which runs a
    compressed pick: the stopped step the canary would have added after the slow one never comes."""
    from lightning_gc.auto.candidates import candidate

    ch0, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=30)
    engine.network.pinned = False
    one_rank_gloo()
    ch = resumed_with(ch0, clock, window=LONG, canary_bytes=65536)
    ref = _state(ch, "reference")
    wl = ch.workload
    assert 30 * ref - (wl.forward_s + wl.backward_total_s + wl.optimizer_s + wl.other_s) >= ch.config.dense_probe_s
    for s in range(5, 10):
        _dense_step(ch, s, 30 * ref if s == 8 else ref, clock)
        if s == 8:
            h = ch.history[-1]
            assert (h["step"], h["trigger"], h["drift_test"], h["network_source"]) == (8, "drift", "step", "dense_step")
            assert candidate(ch.chosen).compressor is not None
    assert [a for a, _ in engine.sung] == [5, 6, 7, 8]  # none before step 9: a compressed method runs


@pytest.mark.parametrize("fell", [True, False])
def test_a_calibration_move_from_a_compressed_method_to_a_dense_mode_times_the_link_first(clock, one_rank_gloo,
                                                                                          monkeypatch, fell):
    """lowrank runs after the link fell (a severe window on 10 Mbit/s); then the chooser's network says
    the link is fast again (a checkpoint whose last look found it so), and lowrank's first window, far
    slower than modelled, makes the calibration move to fp16. Before it does, one canary message
    (64 KiB to each of the 3 others; ``lightning_gc.engine.dense_stop.sing`` stands in for the network)
    times the link. If it fell (0.16 s against the model's fraction of a millisecond), auto re-decides on
    β from that message (test ``switch_check``; β by hand) and stays compressed; if not, fp16 is applied.
    A decision that keeps a dense mode sends nothing."""
    from lightning_gc.engine import dense_stop
    from lightning_gc.engine.dense_stop import CanaryResult

    sung: list[int] = []

    def sing(canary, carry, network, group, world_size, device):
        sung.append(canary.nbytes)
        predicted = canary.predicted_s(network, world_size)
        return CanaryResult(fell, 0.16 if fell else predicted, predicted, float("nan"), 2 if fell else 1)

    monkeypatch.setattr(dense_stop, "sing", sing)
    ch0, engine, _, _ = _fp16_measured_on_a_fast_link(clock, min_interval=4, explore=0)
    engine.network.model = NetworkModel(1e-4, 8 / 1e7)
    window(ch0, 6, 10 * _state(ch0, "reference"), clock)
    assert ch0.chosen == "lowrank"
    fast = NetworkModel(1e-4, 8 / 1e10)
    engine.network.pinned, engine.network.model = False, fast
    one_rank_gloo()
    ch = resumed_with(ch0, clock, edit=lambda st: st.update(network=[fast.alpha_s, fast.beta_s_per_byte]))
    window(ch, 8, 1.0, clock)  # settling
    window(ch, 10, 20 * ch.predictions["lowrank"].step_s, clock)  # lowrank's first window: far slower
    assert sung == [65536]
    h = ch.history[-1]
    if fell:
        assert (h["step"], h["trigger"], h["drift_test"], h["network_source"]) == (10, "drift", "switch_check", "canary")
        want = (0.16 - fast.alpha_s) / (3 * 65536)
        assert h["network"][1] == pytest.approx(want) and ch.chosen == "lowrank"
        assert h["switch_check"]["fell"] is True and h["switch_check"]["bytes"] == 65536
    else:
        assert (h["step"], h["trigger"], h["chosen"], h["previous"]) == (10, "calibration", "fp16", "lowrank")
        assert h["switch_check"]["fell"] is False and ch.chosen == "fp16"
        window(ch, 12, 1.0, clock)  # settling
        window(ch, 14, ch.predictions["fp16"].step_s, clock)  # fp16 measured again here: nothing re-decided
        assert sung == [65536]


def test_a_dense_mode_whose_link_fell_measures_the_new_beta_from_its_drifted_window(clock):
    """DDP runs on a fast (probed, not pinned) link; the link falls to 10 Mbit/s and DDP's window grows
    many times (severe drift). That window, a dense step that waited long on the network, gives the new
    β (the hand-written step at 10 Mbit/s, with the α of the last look at the link, is what it measured):
    nothing is sent (no probe runs without a process group: one would fail here), not a latency round
    (α is kept), nor a reference message for the link check (the model's time for it, α + bytes·β, on
    the quickstart MLP's size: half its gradient), and auto moves to Top-k."""
    import torch

    fast = NetworkModel(2e-4, 8 / 1e9)
    wl = Workload(0.0004, (0.0001, 0.0001), (42_000, 42_000))
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.0, 8_000.0, 0.5, True)]
    cfg = AutoConfig(candidates=("ddp", "topk"), window=2, patience=2, min_interval=1, probe_every=0)
    engine = FakeEngine(fast, params=[torch.nn.Parameter(torch.zeros(42_000)), torch.nn.Parameter(torch.zeros(42_000))],
                        pinned=False)
    fast_wall = step_by_hand(costs[0].as_dict(), dict(wl.as_dict(), other_s=0.0), fast.alpha_s, fast.beta_s_per_byte, 4)
    ch, _ = resume_after_warmup(clock, cfg, wl, costs, fast, dense_wall_s=fast_wall + 0.006, engine=engine)
    assert ch.chosen == "ddp"
    other = ch.workload.other_s
    assert other == pytest.approx(0.006)  # 6 ms of framework in the profiled step
    step = ch.predictions["ddp"].step_s
    window(ch, 3, 1.0, clock)  # settling
    window(ch, 5, step, clock)  # reference
    slow_beta = 8 / 10e6
    slow_wall = step_by_hand(costs[0].as_dict(), dict(wl.as_dict(), other_s=other), fast.alpha_s, slow_beta, 4)
    window(ch, 7, slow_wall, clock)  # many times the reference: severe
    h = ch.history[-1]
    assert h["trigger"] == "drift" and h["network_source"] == "dense_step"
    assert h["decide_parts_s"]["latency"] == 0.0 and h["decide_parts_s"]["probe"] == 0.0
    assert ch.network.beta_s_per_byte == pytest.approx(slow_beta, rel=1e-6)
    assert ch.network.alpha_s == pytest.approx(fast.alpha_s, rel=1e-6)
    assert engine.network.model.beta_s_per_byte == pytest.approx(slow_beta, rel=1e-6)  # adopted
    assert ch.probe_bytes == 2 * 84_000 and ch.probe_time_modelled  # 134 ms at 10 Mbit/s: bandwidth-bound
    assert ch.probe_time_s == pytest.approx(fast.alpha_s + 2 * 84_000 * slow_beta, rel=1e-6)
    assert ch.chosen == "topk" and ch.workload.other_s == other  # other_s is the warm-up's, kept


def test_a_checkpoint_keeps_which_codecs_are_still_lower_bounds(clock):
    """``time_codecs="on_demand"``: a warm-up that timed Top-k's codec (its bound led) and left lowrank's
    a bound (0 s, untimed) checkpoints both as they are, so the next decision times lowrank's when its
    bound leads. Oracle: the costs written before the checkpoint."""
    import dataclasses

    wl = Workload(0.001, (0.001,), (1_000_000,))
    true = {"lowrank": 0.5, "topk": 0.002}
    costs = [MethodCost("ddp", "bucket", 0.0),
             MethodCost("lowrank", "lowrank", 0.0, 400_000.0, 0.9, True, codec_timed=False),
             MethodCost("topk", "allgather", 0.0, 20_000.0, 0.5, True, codec_timed=False)]
    now = list(costs)

    def time_codec(name):
        k = next(i for i, c in enumerate(now) if c.name == name)
        now[k] = dataclasses.replace(now[k], codec_s=true[name], codec_timed=True)
        return list(now)

    cfg = AutoConfig(candidates=("ddp", "lowrank", "topk"), window=2, probe_every=0)
    engine = FakeEngine(NetworkModel(1e-4, 8 / 2e7))
    ch, _ = resume_after_warmup(clock, cfg, wl, costs, NetworkModel(1e-4, 8 / 2e7), engine=engine,
                                time_codec=time_codec)
    assert ch.chosen == "topk" and ch.history[-1]["timed_codecs"] == ["topk"]
    got = [(c.name, c.codec_s, c.codec_timed) for c in ch.costs]
    assert got == [("ddp", 0.0, True), ("lowrank", 0.0, False), ("topk", 0.002, True)]
    other = resumed_with(ch, clock)
    assert [(c.name, c.codec_s, c.codec_timed) for c in other.costs] == got
