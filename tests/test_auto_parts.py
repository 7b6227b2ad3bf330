"""auto's parts by role, driven with plain numbers (no process group, no engine): the drift tests
(lightning_gc/auto/drift.py), what follows a reference window and the running figure (policy.py), the
link look's pure steps (look.py), the errors' re-measurement record (measure.py), the agreed walls
(walls.py) and the checkpoint keys (state.py). Oracles: thresholds and medians worked out by hand from
the given numbers, and the key list auto's checkpoints have always had (written out here)."""

from __future__ import annotations

import statistics

import pytest

from lightning_gc.auto import drift, look, measure, policy
from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.model import MethodCost, Prediction, Workload
from lightning_gc.auto.policy import Trigger
from lightning_gc.auto.state import AutoState
from lightning_gc.auto.walls import StepWalls
from lightning_gc.comm.cost_model import NetworkModel
from lightning_gc.comm.link import LinkSchedule

CFG = AutoConfig(candidates=("ddp", "fp16", "topk"), window=4, drift=0.3, patience=2, min_interval=10,
                 severe_drift=2.0, severe_steps=3, probe_every=0)


def _pred(name: str, step: float, tpp: float | None = None) -> Prediction:
    return Prediction(name, step, step, 0.0, 0.0, 0.0, 1.0, step if tpp is None else tpp)


# ------------------------------------------------------------------ drift.window_action
def test_a_window_drifts_for_patience_windows_or_once_severely():
    # 10 ms reference; 13.5 ms is 35 % off (> drift 0.3) but under 2x (severe_drift)
    drifted, action, _ = drift.window_action(0.0135, 0.010, 0, 40, 20, False, False, CFG)
    assert (drifted, action) == (1, None)  # one window: patience is 2
    drifted, action, why = drift.window_action(0.0135, 0.010, drifted, 44, 20, False, False, CFG)
    assert (drifted, action) == (2, "window") and "for 2 windows" in why
    # the same two windows within min_interval (10) of the last decision: wait
    assert drift.window_action(0.0135, 0.010, 1, 28, 20, False, False, CFG)[1] is None
    # 12.9 ms is 29 % off: not a drift, the count restarts
    assert drift.window_action(0.0129, 0.010, 1, 44, 20, False, False, CFG)[:2] == (0, None)
    # 20 ms (2x) or 5 ms (0.5x): severe in one window, unless held; a severe one skips the check message
    assert drift.window_action(0.020, 0.010, 0, 22, 20, False, False, CFG)[1] == "severe_window"
    assert drift.window_action(0.005, 0.010, 0, 22, 20, False, False, CFG)[1] == "severe_window"
    assert drift.window_action(0.020, 0.010, 0, 22, 20, False, True, CFG)[1] is None
    assert drift.window_action(0.0199, 0.010, 0, 22, 20, False, False, CFG)[1] is None


def test_the_periodic_look_comes_first():
    cfg = AutoConfig(candidates=("ddp", "topk"), window=4, probe_every=50)
    # a severe window when the look is due: the look (it measures the link anyway)
    assert drift.window_action(0.020, 0.010, 0, 90, 90, True, False, cfg)[1] == "periodic"
    assert drift.window_action(0.010, 0.010, 0, 90, 80, True, False, cfg)[1] == "periodic"
    assert drift.window_action(0.010, 0.010, 0, 89, 80, False, False, cfg)[1] is None


def test_the_periodic_look_runs_on_the_link_schedule_that_every_probe_restarts():
    """auto's look is a client of the engine's one link schedule: due ``link_interval`` steps after the
    last look at the link, auto's own or any other client's probe (one probe serves all). Oracle: the
    steps, by hand."""
    schedule = LinkSchedule()
    st = AutoState(probe_every=50, gain_every=0, explore=0, schedule=schedule)
    st.looked_at_link(40, 50)
    assert not st.periodic_due(89) and st.periodic_due(90)
    schedule.probed(70)  # another client (e.g. OSP's first bound) probed the same link
    assert not st.periodic_due(90) and not st.periodic_due(119) and st.periodic_due(120)
    st.looked_at_link(120, 100)  # a calm look: twice as late
    assert (st.last_link_step, st.link_interval) == (120, 100)
    assert not st.periodic_due(219) and st.periodic_due(220)
    # probe_every 0: no periodic look, whatever the schedule's other clients ask for
    off = AutoState(probe_every=0, gain_every=0, explore=0, schedule=LinkSchedule())
    off.schedule.subscribe("engine", 10)
    off.looked_at_link(0, 0)
    assert not off.periodic_due(1000)


# ------------------------------------------------------------------ drift.severe_verdict
def test_the_every_step_tests_fire_on_every_step_off_or_the_median_twice_as_far():
    ref = 0.010
    # every one of the last 3 at 2x or more: "steps", β from their median
    v = drift.severe_verdict([0.021, 0.020, 0.030], ref, None, CFG, False, [], None)
    assert v is not None and v.test == "steps" and v.wall_s == pytest.approx(0.021)
    # one of three under 2x, the median 21 ms under 4x (twice the factor): nothing
    assert drift.severe_verdict([0.019, 0.021, 0.500], ref, None, CFG, False, [], None) is None
    # the median at 4x or more: fires although one step is fast
    assert drift.severe_verdict([0.009, 0.041, 0.050], ref, None, CFG, False, [], None).test == "steps"
    # faster the same way: every one at half the reference or less
    assert drift.severe_verdict([0.005, 0.004, 0.005], ref, None, CFG, False, [], None).test == "steps"
    # fewer than severe_steps walls: the step tests need all three
    assert drift.severe_verdict([0.5, 0.5], ref, None, CFG, False, [], None) is None
    # before the reference window: the calibrated prediction is the basis; without one, nothing
    assert drift.severe_verdict([0.021, 0.02, 0.03], None, ref, CFG, False, [], None).test == "steps"
    assert drift.severe_verdict([0.021, 0.02, 0.03], None, None, CFG, False, [], None) is None


def test_one_dense_step_fires_at_the_one_step_factor_times_severe_drift():
    ref, limit = 0.010, drift.ONE_STEP_FACTOR * CFG.severe_drift * 0.010  # 80 ms at the defaults (4 x 2 x 10 ms)
    assert limit == pytest.approx(0.080)
    v = drift.severe_verdict([0.010, limit], ref, None, CFG, True, [], None, label="(7) under 'fp16' ")
    assert v is not None and (v.test, v.wall_s) == ("step", limit) and "(7) under 'fp16'" in v.what
    assert drift.severe_verdict([0.010, 0.0799], ref, None, CFG, True, [], None) is None
    # not a dense mode, or a marked wall (one_step False): no one-step test
    assert drift.severe_verdict([0.010, 1.0], ref, None, CFG, False, [], None) is None


def test_the_exchange_test_fires_only_on_a_much_faster_exchange_that_matters_to_the_step():
    ref = 0.100  # step; the reference window's fastest exchange 40 ms
    assert drift.severe_verdict([0.1] * 3, ref, None, CFG, False, [0.02, 0.019, 0.018], 0.040).test == "exchange"
    # 2x faster, and the 15 ms saved are at least EXCHANGE_SHARE (10 %) of the 100 ms step: fires
    assert drift.severe_verdict([0.1] * 3, ref, None, CFG, False, [0.015] * 3, 0.030).test == "exchange"
    # 2x faster but 8 ms < 10 % of the step: nothing
    assert drift.severe_verdict([0.1] * 3, ref, None, CFG, False, [0.008] * 3, 0.016) is None
    # slower: never (a fall shows in the step tests)
    assert drift.severe_verdict([0.1] * 3, ref, None, CFG, False, [0.09] * 3, 0.040) is None


def test_severe_decisions_wait_min_interval_after_the_last_severe_one_only():
    hist = [{"step": 5, "drift_test": None}, {"step": 20, "drift_test": "steps"}, {"step": 25, "drift_test": "window"}]
    assert drift.severe_held(hist, 29, 10) and not drift.severe_held(hist, 30, 10)
    assert not drift.severe_held(hist[:1] + hist[2:], 26, 10)  # a moderate drift does not hold


def test_the_errors_are_sampled_gain_first_then_at_the_interval_and_never_on_trial():
    cfg = AutoConfig(candidates=("ddp", "topk"), gain_every=50, gain_first=20)
    assert not drift.gain_due(18, 50, cfg, False, 0, False) and drift.gain_due(19, 50, cfg, False, 0, False)
    assert not drift.gain_due(48, 50, cfg, True, 0, False) and drift.gain_due(49, 50, cfg, True, 0, False)
    assert not drift.gain_due(49, 50, cfg, True, 0, True)  # on trial: waits for the window
    assert not drift.gain_due(999, 50, AutoConfig(candidates=("ddp",), gain_every=0), False, 0, False)


# ------------------------------------------------------------------ policy: after a reference window
def test_a_reference_window_ends_a_trial_starts_a_sibling_or_re_decides_a_new_figure():
    preds = {"ddp": _pred("ddp", 0.100), "fp16": _pred("fp16", 0.090), "topk": _pred("topk", 0.050, 0.080)}
    last = {"trigger": "warmup", "chosen": "ddp", "previous": None, "corrections": {"ddp": 0.0}, "settled": [],
            "shift_s": 0.0, "measured_step_s": 0.110}
    dense = ["ddp", "fp16"]
    # ddp measured 110 ms against 100 raw: fp16 raw 90 + 10 = 100 ms, within family_margin: its trial
    assert policy.calibration_next("ddp", 0.100, 0.110, True, [last], preds, {"ddp": 0.01}, dense, 0.15) == (
        Trigger.FAMILY, "fp16")
    # fp16 measured in a window on this link already: no trial, ddp was valid before: nothing
    fp16 = dict(last, chosen="fp16", measured_step_s=0.1)
    assert policy.calibration_next("ddp", 0.100, 0.110, True, [fp16, last], preds, {"ddp": 0.01, "fp16": 0.0},
                                   dense, 0.15) is None
    # ... but a method without a valid correction before re-decides at once
    assert policy.calibration_next("ddp", 0.100, 0.110, False, [fp16, last], preds, {"ddp": 0.01, "fp16": 0.0},
                                   dense, 0.15) == (Trigger.CALIBRATION, None)
    # the sibling's own window ends its trial
    trial = dict(last, trigger="family", chosen="fp16", previous="ddp")
    assert policy.calibration_next("fp16", 0.09, 0.1, False, [last, trial], preds, {}, dense, 0.15) == (
        Trigger.CALIBRATION, None)


def test_the_running_figure_is_the_median_of_its_windows_at_a_gain_or_periodic_look_on_its_link():
    preds = {"topk": _pred("topk", 0.050)}
    hist = [{"trigger": "calibration", "chosen": "topk", "corrections": {"topk": 0.004}, "settled": ["topk"],
             "shift_s": 0.0}]
    medians = [0.060, 0.052, 0.055]
    raw = 0.050 - 0.004  # the last decision's prediction less the correction it carried
    got = policy.running_correction(Trigger.GAIN, "kept", "topk", {"topk": 0.004}, medians, hist, preds)
    assert got == (pytest.approx(0.055), pytest.approx(0.055 - raw))
    assert policy.running_correction(Trigger.DRIFT, "kept", "topk", {"topk": 1}, medians, hist, preds) is None
    assert policy.running_correction(Trigger.PERIODIC, "probe", "topk", {"topk": 1}, medians, hist, preds) is None
    assert policy.running_correction(Trigger.GAIN, "kept", "topk", {"topk": 1}, medians[:2], hist, preds) is None


def test_on_trial_is_a_siblings_window_an_unmeasured_exploration_or_a_switch_on_an_older_figure():
    assert not policy.in_trial([], "ddp", {})
    assert policy.in_trial([{"trigger": "family", "chosen": "fp16"}], "fp16", {})
    assert policy.in_trial([{"trigger": "calibration", "chosen": "topk"}], "topk", {"ddp": 0.0})
    assert not policy.in_trial([{"trigger": "calibration", "chosen": "topk"}], "topk", {"topk": 0.0})
    switch = {"trigger": "periodic", "chosen": "fp16", "previous": "topk", "corrections": {"fp16": 0.001}}
    assert policy.in_trial([switch], "fp16", {"fp16": 0.001})
    assert not policy.in_trial([dict(switch, previous="fp16")], "fp16", {"fp16": 0.001})


# ------------------------------------------------------------------ look: pure steps
def test_a_link_check_keeps_the_network_or_reads_beta_from_its_own_slope():
    st = AutoState(100, 50, 2)
    st.network, st.probe_bytes, st.probe_time_s, st.beta_scale = NetworkModel(1e-4, 8e-9), 1 << 20, 0.010, 0.5
    source, rec = look.check_outcome(0.012, 9e-9, st, 1.5)  # within 1.5x: unchanged
    assert source == "check" and rec["unchanged"] and st.network == NetworkModel(1e-4, 8e-9)
    source, rec = look.check_outcome(0.100, 9e-8, st, 1.5)  # 10x slower and bandwidth-bound (>= 5 ms)
    assert source == "check_slope" and not rec["unchanged"] and rec["beta_s_per_byte"] == 9e-8
    assert st.network == NetworkModel(1e-4, 9e-8 * 0.5) and st.probe_time_s == 0.100  # scaled as a probe's β
    st.probe_time_s = 0.010
    assert look.check_outcome(0.004, 1e-9, st, 1.5)[0] == "probe"  # moved, under 5 ms: a full probe tells
    st.probe_time_modelled = True  # a modelled reference is replaced by the first check that agrees with it
    assert look.check_outcome(0.011, 1e-9, st, 1.5)[0] == "check" and (st.probe_time_s, st.probe_time_modelled) == (
        0.011, False)


def test_the_dense_step_that_measures_the_link_is_the_warmups_or_a_dense_modes_drifted_window():
    wl = Workload(0.010, (0.010,), (1000,), 0.005)
    ddp, fp16 = MethodCost("ddp", "bucket", 0.0), MethodCost("fp16", "bucket", 0.001)
    warm = look.LookRequest(True, dense_wall_s=0.2, dense_exposed_s=0.15)
    assert look.dense_measurement(warm, None, ddp, wl, 4) == (0.2, 0.15, ddp)
    # a drifted window of fp16: its wall less the model's step on a free network (25 ms compute + 1 ms cast)
    got = look.dense_measurement(look.LookRequest(True, drift_wall_s=0.5), fp16, ddp, wl, 4)
    assert got[0] == 0.5 and got[1] == pytest.approx(0.5 - 0.026) and got[2] is fp16
    assert look.dense_measurement(look.LookRequest(True, drift_wall_s=0.5), None, ddp, wl, 4) is None


# ------------------------------------------------------------------ measure.gain_check
def test_the_errors_record_names_the_largest_change_of_progress_and_the_skipped():
    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 0.001, 1e4, 0.5, True),
             MethodCost("qsgd", "allgather", 0.001, 1e4, 0.2, False)]
    rec = measure.gain_check(7, costs, {1: 0.75}, 0.02, 4, 2.0, 0.1)
    # efficiency 1/(1 + 2·δ²): 1/2 before, 1/2.5 after: progress moved by 20 %
    assert rec["moved"] == pytest.approx(0.2) and rec["redecided"]
    assert rec["delta2"] == {"topk": 0.75} and rec["skipped"] == ["ddp", "qsgd"] and rec["bound_s"] == 0.02
    # qsgd (no error feedback: δ²/N): 1/(1 + 2·0.05) before, 1/(1 + 2·0.055) after
    rec = measure.gain_check(7, costs, {2: 0.22}, 0.02, 4, 2.0, 0.1)
    assert rec["moved"] == pytest.approx(1 - 1.1 / 1.11) and not rec["redecided"]


# ------------------------------------------------------------------ walls
def test_carried_walls_enter_the_every_step_tests_except_the_decisions_and_the_switchs_steps():
    w = StepWalls()
    for step, value in ((10, 0.1), (11, 0.2), (12, 0.3), (13, 0.4)):
        w.pending = (step, lambda v=value: v)
        w.read_pending(last_decision=10, severe_steps=3, window=4)
    assert w.recent == [0.3, 0.4] and w.recent_step == 13  # 10 (the decision) and 11 (the switch) left out
    assert w.carried == {10: 0.1, 11: 0.2, 12: 0.3, 13: 0.4}
    w.window = [9.0, 9.0, 9.0, 9.0]  # this rank's walls of steps 10-13: the carried ones (10-13) decide
    assert w.window_median(14, lambda v: pytest.fail("no agreement needed")) == statistics.median([0.1, 0.2, 0.3, 0.4])
    w.pending = (14, lambda: None)  # a lost wall: the window is agreed from this rank's walls instead
    w.read_pending(10, 3, 4)
    w.window = [1.0, 2.0, 3.0, 4.0]
    assert w.window_median(15, lambda v: 10 * v) == 25.0


# ------------------------------------------------------------------ checkpoints
KEYS_V2 = {"version", "chosen", "history", "workload", "costs", "network", "reference", "drifted", "settling",
           "reference_exchange", "run_medians", "corrections", "explore_left", "correction_beta",
           "last_decision_step", "last_link_step", "link_interval", "gain_interval", "last_gain_step", "gain_checks",
           "beta_scale", "sampling", "warmup_steps", "probe_bytes", "probe_time_s", "probe_time_modelled", "sync"}


def test_the_state_keeps_its_checkpoint_keys_and_reads_an_older_checkpoint():
    st = AutoState(100, 50, 2)
    assert set(st.state_dict(False, 3)) == KEYS_V2
    old = {"version": 2, "chosen": "topk", "history": [{"predictions": {"topk": _pred("topk", 0.05).as_dict()}}],
           "network": [1e-4, 8e-9], "last_decision_step": 40, "corrections": {"topk": 0.01}}
    st.load(old)
    # what the missing keys stood for: the last decision's step, the configured intervals, no reference
    assert (st.last_link_step, st.last_gain_step, st.link_interval, st.gain_interval) == (40, 40, 100, 50)
    assert st.correction_beta == {} and st.probe_bytes == 0 and st.beta_scale == 1.0 and st.explore_left == 2
    assert st.predictions["topk"].step_s == 0.05 and st.network == NetworkModel(1e-4, 8e-9)
    # before auto_diloco: per-step, no trial, no event
    assert st.sync == {"trial": None, "last_trial": None, "running": None, "reference_exchange_s": None, "events": []}
    with pytest.raises(ValueError, match="unsupported auto chooser state version 1"):
        st.load({"version": 1})
