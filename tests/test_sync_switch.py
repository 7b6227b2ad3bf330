"""auto's family switch (lightning_gc/auto/sync_switch.py) driven in-process, step by step.

No process group: ``agree_values`` returns each rank's own figures, so the engine double is one rank
(the gate's tests, which agree nothing, use four). The DiLoCo side is a double that records when it
was entered and left. The training loss is synthetic, piecewise linear in training time with a known
rate per family (plus seeded noise), so which family is faster is known before the trial runs.

Oracles: the gate's DiLoCo step worked out by hand from the α-β costs of its Δ exchange; the steps at
which the trial must enter and leave DiLoCo (``rounds·H`` steps per window) counted by hand; the
losing trial's cost from the two known rates; a checkpoint taken mid-trial must give the same verdict,
figure for figure, as the run that was not interrupted.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from dist_harness import run_distributed

from lightning_gc.auto import sync_switch
from lightning_gc.auto.config import AutoConfig
from lightning_gc.auto.model import Prediction, Workload
from lightning_gc.auto.state import AutoState
from lightning_gc.auto.sync_switch import FamilySwitcher
from lightning_gc.comm.cost_model import NetworkModel

H, ROUNDS = 10, 2
W = H * ROUNDS  # steps per trial window
COMPUTE_S = 0.06  # forward 0.02 + backward 0.03 + optimizer 0.01
NUMEL = 1_000_000
SLOW = NetworkModel(1e-3, 8 / 20e6)  # 20 Mbit/s
FAST = NetworkModel(1e-3, 8 / 1e9)  # 1 Gbit/s
A_STEP_S, B_STEP_S = 0.3, 0.1  # the per-step method's step and DiLoCo's
A_DROP = 0.01  # loss removed per per-step step: 1/30 per second


class FakeSync:
    """The dormant DiLoCo participant: records every enter and leave with the step it came at."""

    def __init__(self) -> None:
        self.active, self.choice, self.last_stats = False, None, None
        self.calls: list[tuple[str, int, str]] = []
        self.now = -1  # the step being closed (set by the driver)

    def enter(self, choice: str, first_round: int | None = None) -> None:
        assert not self.active, "entered twice"
        self.active, self.choice, self.first_round = True, choice, first_round
        self.calls.append(("enter", self.now, choice))

    def leave(self) -> int:
        assert self.active, "left while dormant"
        self.calls.append(("leave", self.now, self.choice))
        self.active, self.choice = False, None
        return 4321


def _engine(world_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, process_group=None, device=torch.device("cpu"),
                           params=[torch.zeros(NUMEL)])


def _pred(name: str, step_s: float) -> Prediction:
    return Prediction(name, step_s, COMPUTE_S, 0.0, step_s - COMPUTE_S, step_s - COMPUTE_S, 1.0, step_s)


def _state(network: NetworkModel = SLOW, reference: float | None = A_STEP_S, dense: float | None = None) -> AutoState:
    """A per-step method running with its reference step measured; the last decision predicted a
    dense step of ``dense`` (default: the reference) for ddp and twice that for fp16 (the gate takes
    the faster exact one), and a lossy method faster than both (not an exact method: not the gate's)."""
    st = AutoState(probe_every=100, gain_every=50, explore=2)
    st.workload = Workload(forward_s=0.02, backward_s=(0.03,), numels=(NUMEL,), optimizer_s=0.01)
    st.network, st.chosen, st.reference, st.last_decision_step = network, "ddp", reference, 0
    d = A_STEP_S if dense is None and reference is None else (reference if dense is None else dense)
    st.predictions = {"ddp": _pred("ddp", d), "fp16": _pred("fp16", 2 * d), "topk": _pred("topk", COMPUTE_S)}
    return st


def _config(**kw) -> AutoConfig:
    """Per-step first (lead 0) unless ``diloco_lead`` is given; DiLoCo's rounds H steps from entering
    (the hand counts below) unless ``diloco_align`` is given."""
    return AutoConfig(**{"candidates": ("ddp",), "diloco": ("diloco10",), "diloco_rounds": ROUNDS,
                         "diloco_gate": 2.0, "diloco_lead": 0, "diloco_align": False, **kw})


class Run:
    """Drives one switcher: each step notes the loss at its start, then closes it. The loss falls by
    ``A_DROP`` per per-step step and ``b_drop`` per DiLoCo step, plus N(0, noise) drawn per step."""

    def __init__(self, config: AutoConfig, state: AutoState, b_drop: float, noise: float = 0.001,
                 world_size: int = 1, sync: FakeSync | None = None) -> None:
        self.sync = sync or FakeSync()
        self.redecided: list[int] = []
        self.sw = FamilySwitcher(_engine(world_size), config, state, self.sync, self.redecided.append)
        self.state, self.b_drop, self.noise = state, b_drop, noise
        self.level, self.step = 5.0, 0
        self.held: dict[int, bool] = {}

    def one(self, loss=None, stats=None, busy: bool = False) -> bool:
        diloco = self.sync.active
        if loss is None:
            loss = torch.tensor(self.level + random.Random(self.step).gauss(0.0, self.noise), dtype=torch.float64)
        self.sw.note_loss(loss)
        self.level -= self.b_drop if diloco else A_DROP
        if stats is not None:
            self.sync.last_stats = stats
        self.sync.now = self.step
        held = self.sw.after_step(self.step, B_STEP_S if diloco else A_STEP_S, busy)
        self.held[self.step] = held
        self.step += 1
        return held

    def until(self, step: int) -> None:
        """Run up to and including ``step``."""
        while self.step <= step:
            self.one()

    def events(self, kind: str) -> list[dict]:
        return [e for e in self.state.sync["events"] if e["event"] == kind]


# ---------------------------------------------------------------- the gate, by hand
def _hand_diloco_step(net: NetworkModel, n: int, h: int) -> float:
    """compute + (flag + Δ exchange) / H: Δ in fp16 (2 bytes an element), summed by the engine's
    allreduce, which takes the cheaper of the ring and the direct exchange at this size; the flag is
    one float32 on the ring."""
    a, b, payload = net.alpha_s, net.beta_s_per_byte, 2.0 * NUMEL
    ring = 2 * (n - 1) * a + 2 * (n - 1) / n * payload * b
    direct = a + (n - 1) * payload * b
    flag = 2 * (n - 1) * a + 2 * (n - 1) / n * 4 * b
    return COMPUTE_S + (flag + min(ring, direct)) / h


@pytest.mark.parametrize("net, challenger", [(SLOW, "diloco50"), (FAST, "diloco10")])
@pytest.mark.parametrize("above", [True, False])
def test_gate_opens_at_twice_the_hand_predicted_diloco_step(net, challenger, above):
    """Four ranks. On 20 Mbit/s neither H hides the exchange within 10 % of compute (the fastest,
    H = 50, is the challenger); on 1 Gbit/s H = 10 does. The trial starts exactly where the fastest
    exact method's predicted step (ddp's here; the faster lossy topk is not the yardstick) reaches
    ``diloco_gate`` times the challenger's step."""
    steps = {"diloco10": _hand_diloco_step(net, 4, 10), "diloco50": _hand_diloco_step(net, 4, 50)}
    hidden = [k for k, s in steps.items() if s <= 1.1 * COMPUTE_S]
    assert (hidden[:1] or [min(steps, key=steps.get)])[0] == challenger  # the hand case is what it says
    ref = 2.0 * steps[challenger] * (1 + 1e-9 if above else 1 - 1e-9)
    run = Run(_config(diloco=("diloco10", "diloco50")), _state(net, ref), b_drop=0.0, world_size=4)
    assert run.one() is above  # a trial holds auto's per-step watch from its first step
    trials = run.events("trial")
    assert run.sync.calls == []
    if not above:
        assert trials == [] and run.state.sync["trial"] is None
        return
    (ev,) = trials
    assert ev["challenger"] == challenger and ev["step"] == 0
    assert ev["window"] == int(challenger[-2:]) * ROUNDS
    for k, s in steps.items():
        assert ev["predicted_step_s"][k] == pytest.approx(s, rel=1e-12)
    assert run.state.sync["trial"]["start_step"] == 1 and run.state.sync["trial"]["phase"] == 0


def _hand_streaming_step(net: NetworkModel, n: int, h: int, f: int, tau: int) -> float:
    """compute + Σ over F equal fragments of (flag + what τ steps of compute do not hide of its Δ) / H."""
    a, b, payload = net.alpha_s, net.beta_s_per_byte, 2.0 * NUMEL / f
    x = min(2 * (n - 1) * a + 2 * (n - 1) / n * payload * b, a + (n - 1) * payload * b)
    flag = 2 * (n - 1) * a + 2 * (n - 1) / n * 4 * b
    return COMPUTE_S + f * (flag + max(0.0, x - tau * COMPUTE_S)) / h


@pytest.mark.parametrize("net, challenger", [(SLOW, "diloco50f5"), (FAST, "diloco50")])
def test_streaming_is_the_challenger_only_where_it_hides_what_plain_diloco_leaves(net, challenger):
    """Four ranks, the model in 5 equal tensors. On 20 Mbit/s plain H = 50 leaves its exchange exposed
    and 5 fragments each overlapped with 5 steps hide theirs: streaming is tried. On 1 Gbit/s plain H = 50
    hides the link too, and of equal H the one that drops no local steps is tried."""
    steps = {"diloco50": _hand_diloco_step(net, 4, 50), "diloco50f5": _hand_streaming_step(net, 4, 50, 5, 5)}
    assert (steps["diloco50"] > 1.1 * COMPUTE_S) == (net is SLOW) and steps["diloco50f5"] <= 1.1 * COMPUTE_S
    state = _state(net, 100.0)  # a dense step far slower than either: the gate opens
    state.workload = Workload(forward_s=0.02, backward_s=(0.03 / 5,) * 5, numels=(NUMEL // 5,) * 5, optimizer_s=0.01)
    engine = _engine(4)
    engine.params = [torch.zeros(NUMEL // 5) for _ in range(5)]
    sw = FamilySwitcher(engine, _config(diloco=("diloco50f5", "diloco50")), state, FakeSync(), lambda step: None)
    sw.after_step(0, 100.0, False)
    (ev,) = [e for e in state.sync["events"] if e["event"] == "trial"]
    assert ev["challenger"] == challenger
    for k, s in steps.items():
        assert ev["predicted_step_s"][k] == pytest.approx(s, rel=1e-12)


def test_a_streaming_candidate_with_more_fragments_than_tensors_is_refused_at_setup():
    with pytest.raises(ValueError, match="'diloco50f5' cuts the model into 5 fragments, but it has 1"):
        FamilySwitcher(_engine(4), _config(diloco=("diloco50f5",)), _state(), FakeSync(), lambda step: None)


def test_gate_shut_on_a_fast_link_runs_no_trial():
    """One rank: DiLoCo's step is compute alone (0.06 s); a dense step predicted at 0.07 s is under
    twice that, so nothing is tried however long the run."""
    run = Run(_config(), _state(FAST, 0.07), b_drop=0.02)
    run.until(100)
    assert run.state.sync["events"] == [] and run.sync.calls == [] and run.state.sync["last_trial"] is None
    assert not any(run.held.values())


def test_no_trial_without_a_reference_or_while_busy():
    run = Run(_config(), _state(SLOW, None), b_drop=0.02)
    run.until(5)
    assert run.events("trial") == []
    run.state.reference = A_STEP_S
    run.one(busy=True)  # a per-step trial is on
    assert run.events("trial") == []
    run.one()
    assert [e["step"] for e in run.events("trial")] == [7]


# ---------------------------------------------------------------- full trials
def test_diloco_faster_wins_after_the_bracket_and_runs_on():
    """DiLoCo removes 0.008 a step at 0.1 s (0.08/s) against the incumbent's 0.01 at 0.3 s (1/30 per
    s): far ahead already after its own window, it still waits for the incumbent's second window (no
    early win), then wins and is entered again. Windows counted from step 0: the incumbent 1..W
    (enter at W), DiLoCo W+1..2W (leave at 2W), the incumbent 2W+1..3W (verdict and enter at 3W)."""
    run = Run(_config(), _state(), b_drop=0.008)
    run.until(3 * W + 10)
    assert run.sync.calls == [("enter", W, "diloco10"), ("leave", 2 * W, "diloco10"), ("enter", 3 * W, "diloco10")]
    ev = [(e["step"], e["event"], e.get("why")) for e in run.state.sync["events"]]
    assert ev == [(0, "trial", None), (W, "enter", "trial"), (2 * W, "leave", "trial"), (3 * W, "verdict", None),
                  (3 * W, "enter", "won")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "challenger" and last["end_step"] == 3 * W and last["z"] >= 2.0
    assert [r["phase"] for r in last["rates"]] == ["incumbent_before", "diloco", "incumbent_after"]
    for r, want in zip(last["rates"], (A_DROP / A_STEP_S, 0.008 / B_STEP_S, A_DROP / A_STEP_S)):
        assert r["per_s"] == pytest.approx(want, rel=0.05) and r["points"] == W
    assert last["cost_s"] == 0.0 and not last["steepened"]  # DiLoCo was the faster: its window cost nothing
    assert run.state.sync["trial"] is None and run.state.sync["running"] == "diloco10" and run.sync.active
    assert all(run.held.values())  # the trial from step 0, then DiLoCo


def test_diloco_behind_the_first_window_wins_by_the_bracket():
    """A curve that flattens: the incumbent removes 0.02 a step in its first window (0.067/s at 0.3 s a
    step) and 0.0005 in its second (0.0017/s); DiLoCo 0.005 a step at 0.1 s (0.05/s) between them.
    Behind the first window alone, so it is left and the incumbent runs again; ahead of the bracket's
    mean (0.034/s), so it wins at the end: left at 40, entered again at 60."""
    cfg = _config()
    run = Run(cfg, _state(), b_drop=0.005)
    drops = {1: 0.02, 2: 0.0005}  # the incumbent's loss per step in window 1 and in window 2

    def a_drop(step: int) -> float:
        return drops[1] if step <= W else drops[2]
    while run.step <= 3 * W:
        diloco = run.sync.active
        run.sw.note_loss(torch.tensor(run.level + random.Random(run.step).gauss(0.0, 0.0002), dtype=torch.float64))
        run.level -= run.b_drop if diloco else a_drop(run.step)
        run.sync.now = run.step
        run.held[run.step] = run.sw.after_step(run.step, B_STEP_S if diloco else A_STEP_S, False)
        run.step += 1
    assert run.sync.calls == [("enter", W, "diloco10"), ("leave", 2 * W, "diloco10"), ("enter", 3 * W, "diloco10")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "challenger" and not last["steepened"] and last["end_step"] == 3 * W
    # the oracle: rates by hand, the bracket's mean of the incumbent's two windows
    a = (drops[1] / A_STEP_S + drops[2] / A_STEP_S) / 2
    assert last["rates"][1]["per_s"] > a and last["rates"][1]["per_s"] < drops[1] / A_STEP_S
    ev = [(e["step"], e["event"], e.get("why")) for e in run.state.sync["events"]]
    assert ev[-2:] == [(3 * W, "verdict", None), (3 * W, "enter", "won")]


def test_diloco_slower_loses_and_stays_dormant_until_the_link_moves():
    """DiLoCo removes 0.001 a step at 0.1 s (0.01/s): the incumbent wins; the trial cost the DiLoCo
    window's seconds times the share of the incumbent's progress it missed, 2 s · (1 − 0.3)."""
    cfg = _config()
    run = Run(cfg, _state(), b_drop=0.001)
    run.until(3 * W)
    assert run.sync.calls == [("enter", W, "diloco10"), ("leave", 2 * W, "diloco10")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "incumbent" and last["end_step"] == 3 * W and last["z"] <= -2.0
    assert last["cost_s"] == pytest.approx(W * B_STEP_S * (1 - 0.01 / (A_DROP / A_STEP_S)), rel=0.05)
    assert not run.sync.active and run.state.sync["running"] is None and run.state.sync["trial"] is None
    assert {s for s, h in run.held.items() if h} == set(range(3 * W))  # the trial, up to its verdict
    run.until(3 * W + 200)  # same link: the lost trial stands
    assert len(run.events("trial")) == 1 and len(run.sync.calls) == 2
    run.state.network = NetworkModel(SLOW.alpha_s, SLOW.beta_s_per_byte * 1.9)  # not moved by severe_drift
    run.until(3 * W + 210)
    assert len(run.events("trial")) == 1
    run.state.network = NetworkModel(SLOW.alpha_s, SLOW.beta_s_per_byte * cfg.severe_drift)
    run.one()
    assert [e["step"] for e in run.events("trial")] == [0, 3 * W + 211]


@pytest.mark.parametrize("redecide", ["chosen", "network"])
def test_per_step_redecision_in_window_one_aborts_the_trial(redecide):
    run = Run(_config(), _state(), b_drop=0.008)
    run.until(9)
    if redecide == "chosen":
        run.state.chosen = "fp16"
    else:  # the same method on a new network model: the windows would not be on one link
        run.state.network = NetworkModel(SLOW.alpha_s, SLOW.beta_s_per_byte * 1.01)
    run.one()
    last = run.state.sync["last_trial"]
    assert last["winner"] == "aborted" and last["end_step"] == 10 and run.state.sync["trial"] is None
    run.until(W + 1)  # past where window 1 would have ended
    assert run.sync.calls == [] and run.events("enter") == []
    # nothing was judged: the gate, still open on this link, tries again against the method now running
    (again,) = run.events("trial")[1:]
    assert again["step"] == 11 and again["incumbent"] == run.state.chosen


def test_a_redecision_that_keeps_method_and_network_does_not_abort():
    run = Run(_config(), _state(), b_drop=0.008)
    run.until(9)
    run.state.last_decision_step = 10  # e.g. a calibration that kept the method on the same network
    run.until(W)
    assert run.sync.calls == [("enter", W, "diloco10")]


def test_per_step_redecision_in_window_two_aborts_without_a_verdict():
    run = Run(_config(), _state(), b_drop=0.0012)  # behind the first window: not won early
    run.until(2 * W + 4)  # DiLoCo left at 2W; the incumbent's second window is on
    run.state.chosen = "fp16"
    run.one()
    last = run.state.sync["last_trial"]
    assert last["winner"] == "aborted" and last["end_step"] == 2 * W + 5 and "z" not in last
    run.until(3 * W + 1)
    assert run.sync.calls == [("enter", W, "diloco10"), ("leave", 2 * W, "diloco10")]
    assert [e["winner"] for e in run.events("verdict")] == ["aborted"] and not run.sync.active
    assert [e["step"] for e in run.events("trial")] == [0, 2 * W + 6]  # judged nothing: tried again


def test_nonfinite_loss_under_diloco_leaves_at_the_rounds_end_and_the_incumbent_stays():
    """DiLoCo's steps are agreed at the round's outer step (which discards a non-finite round on
    every rank), so the trial ends there: at step W + H, the round entered after step W."""
    run = Run(_config(), _state(), b_drop=0.008)
    run.until(W + 4)
    assert run.sync.active
    assert run.one(loss=torch.tensor(float("nan"))) is True  # a DiLoCo step
    run.until(W + H - 1)
    assert run.sync.calls == [("enter", W, "diloco10")]
    run.one()
    assert run.sync.calls == [("enter", W, "diloco10"), ("leave", W + H, "diloco10")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "incumbent" and "non-finite" in last["why"] and not run.sync.active


def test_a_missing_loss_during_a_trial_names_the_fix():
    run = Run(_config(), _state(), b_drop=0.008)
    run.until(4)
    run.sw.note_loss(None)
    with pytest.raises(ValueError, match="Return the loss from training_step"):
        run.sw.after_step(5, A_STEP_S, False)


# ---------------------------------------------------------------- DiLoCo first (diloco_lead)
@pytest.mark.parametrize("lead, first", [(None, "diloco"), (4.99, "diloco"), (5.01, "per_step"), (0.0, "per_step")])
def test_lead_decides_which_family_the_trial_starts_in(lead, first):
    """One rank: DiLoCo's step is compute alone, 0.06 s; the dense step 0.3 s is 5 times that. With
    ``diloco_lead`` below 5, DiLoCo is entered at the gate's own step; above it, or at 0, the
    per-step method runs first. None: the default (1.5, the gate's)."""
    if lead is None:
        cfg = AutoConfig(candidates=("ddp",), diloco=("diloco10",), diloco_rounds=ROUNDS)
        assert cfg.diloco_lead == cfg.diloco_gate == 1.5
    else:
        cfg = _config(diloco_lead=lead)
    run = Run(cfg, _state(), b_drop=0.008)
    run.one()
    (ev,) = run.events("trial")
    assert ev["order"] == f"{first}_first"
    assert run.sync.calls == ([("enter", 0, "diloco10")] if first == "diloco" else [])
    assert run.held[0] is True  # the trial holds auto's per-step watch, whichever family it starts in


def _diloco_first(b_drop: float, **kw) -> Run:
    return Run(_config(diloco_lead=2.0, **kw), _state(), b_drop=b_drop)


def test_diloco_first_faster_diloco_brackets_and_stays():
    """DiLoCo 0.08/s against the per-step 1/30 per s, DiLoCo first: steps 1..W in DiLoCo (entered at
    0), left at W, the per-step window W+1..2W, DiLoCo entered again at 2W, the verdict at 3W with
    DiLoCo running on. The per-step window cost its seconds times the share of DiLoCo's progress it
    missed, W·0.3 s · (1 − (1/30)/0.08)."""
    run = _diloco_first(b_drop=0.008)
    run.until(3 * W + 10)
    assert run.sync.calls == [("enter", 0, "diloco10"), ("leave", W, "diloco10"), ("enter", 2 * W, "diloco10")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "challenger" and last["separated"] and last["end_step"] == 3 * W and last["z"] >= 2.0
    assert [r["phase"] for r in last["rates"]] == ["diloco_before", "incumbent", "diloco_after"]
    assert last["cost_s"] == pytest.approx(W * A_STEP_S * (1 - (A_DROP / A_STEP_S) / 0.08), rel=0.05)
    assert run.sync.active and run.state.sync["running"] == "diloco10" and run.state.sync["trial"] is None
    assert all(run.held.values())  # the per-step window too: no per-step re-decision inside it


def test_aligned_rounds_end_every_diloco_window_on_a_multiple_of_h():
    """diloco_align (the default): the trial starts after step 6, so DiLoCo is entered with 7 steps
    done; the next multiple of H = 10 is 3 steps away, under H/2, so the first round runs to 20: 13
    steps, and the window of 2 rounds is 23 steps (7..29), left after step 29 (30 done). The per-step
    window is steps 30..49; DiLoCo is entered again with 50 done, a whole first round, its window
    50..69, the verdict after 69. By hand, not by sync_trial.first_round."""
    run = _diloco_first(b_drop=0.008, diloco_align=True)
    run.step = 6
    firsts = []
    enter = run.sync.enter
    run.sync.enter = lambda choice, first_round=None: (firsts.append(first_round), enter(choice, first_round))
    run.until(80)
    assert run.sync.calls == [("enter", 6, "diloco10"), ("leave", 29, "diloco10"), ("enter", 49, "diloco10")]
    assert firsts == [13, 10]
    assert [e["first_round"] for e in run.events("enter")] == [13, 10]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "challenger" and last["end_step"] == 69
    assert [r["points"] for r in last["rates"]] == [23, W, W]


def test_aligned_rounds_per_step_first_cut_a_round_short():
    """Per-step first from step 0: the incumbent's window 1..20, DiLoCo entered with 21 done: its first
    round runs the 9 steps to 30, its window 21..39 (19 steps), left after 39; the incumbent 40..59."""
    run = Run(_config(diloco_align=True), _state(), b_drop=0.01 * B_STEP_S / A_STEP_S)
    run.until(3 * W + 5)
    assert run.sync.calls == [("enter", W, "diloco10"), ("leave", 2 * W - 1, "diloco10")]
    assert [e["first_round"] for e in run.events("enter")] == [9]
    last = run.state.sync["last_trial"]
    assert last["end_step"] == 3 * W - 1 and [r["points"] for r in last["rates"]] == [W, W - 1, W]


@pytest.mark.parametrize("b_drop", [0.008, A_DROP * B_STEP_S / A_STEP_S])
def test_diloco_first_per_step_window_closes_at_the_hand_step(b_drop):
    """Windows of 6 rounds (60 steps): the per-step window ends at the first step, from the 20th on,
    where by hand it trails DiLoCo's first window without its first round by 2 standard errors, or
    (from a round's 10 steps) its standard error is at most DiLoCo's first window's; DiLoCo is
    entered again there, and its last window is whole rounds again. DiLoCo 2.4 times as fast per
    second: the trailing rule ends it; equally fast: the precision rule."""
    cfg = _config(diloco_lead=2.0, diloco_rounds=6)
    w = 6 * H
    run = Run(cfg, _state(), b_drop=b_drop, noise=0.003)
    first: list[tuple[float, float]] = []
    fed: list[tuple[float, float]] = []
    while not run.events("verdict"):
        diloco = run.sync.active
        loss = run.level + random.Random(run.step).gauss(0.0, 0.003)
        if run.step >= 1 and diloco and len(first) < w:
            first.append((B_STEP_S, loss))
        if not diloco and run.step > w:
            fed.append((A_STEP_S, loss))
        run.one(loss=torch.tensor(loss, dtype=torch.float64))
    first_se = run.state.sync["last_trial"]["rates"][0]["stderr"]
    recent = _hand_fit(first[H:])
    n = next(k for k in range(20, w + 1) if _trails_by_hand(recent, _hand_fit(fed[:k]))
             or (k >= H and _hand_fit(fed[:k])[1] <= first_se))
    assert n < w and len(fed) == n  # it closed early, where the hand rule says
    assert (n == 20) == (b_drop == 0.008)  # the trailing rule at its floor; the precision rule later
    assert run.sync.calls == [("enter", 0, "diloco10"), ("leave", w, "diloco10"), ("enter", w + n, "diloco10")]
    assert [r["points"] for r in run.state.sync["last_trial"]["rates"]] == [w, n, w]


def _trails_by_hand(recent: tuple[float, float], middle: tuple[float, float]) -> bool:
    return (recent[0] - middle[0]) / math.hypot(recent[1], middle[1]) >= 2.0


def _hand_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(minus the least-squares slope of loss against cumulative time, its standard error), by hand."""
    t, acc = [], 0.0
    for d, _ in points:
        acc += d
        t.append(acc)
    y = [v for _, v in points]
    tm, ym = sum(t) / len(t), sum(y) / len(y)
    sxx = sum((x - tm) ** 2 for x in t)
    b = sum((x - tm) * (v - ym) for x, v in zip(t, y)) / sxx
    resid = [v - ym - b * (x - tm) for x, v in zip(t, y)]
    return -b, math.sqrt(sum(r * r for r in resid) / (len(t) - 2) / sxx)


def test_diloco_first_faster_per_step_wins_after_dilocos_third_window():
    """DiLoCo 0.002 a step at 0.1 s (0.02/s) against 1/30 per s: the per-step window leads, but the
    verdict waits for DiLoCo's third window (entered at 2W); the per-step method wins at 3W and DiLoCo
    is left there."""
    run = _diloco_first(b_drop=0.002)
    run.until(3 * W + 10)
    assert run.sync.calls == [("enter", 0, "diloco10"), ("leave", W, "diloco10"), ("enter", 2 * W, "diloco10"),
                              ("leave", 3 * W, "diloco10")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "incumbent" and last["end_step"] == 3 * W and last["z"] <= -2.0
    assert last["cost_s"] == 0.0  # the per-step window was the faster: it cost nothing
    assert not run.sync.active and run.state.sync["running"] is None


def test_diloco_first_a_plateau_then_a_fall_is_judged_after_the_fall():
    """A loss that sits on a plateau for the first W steps (both families remove 0.0002 a step), then
    falls (0.01 a step): DiLoCo, at 0.1 s a step against 0.3 s, is three times as fast per second in
    both phases. Its first window saw only the plateau, the per-step window only the fall: five times
    faster than that window. The third window (DiLoCo in the fall) ran faster than the first by far:
    the curve steepened, the per-step window is judged against it alone, and DiLoCo wins and stays."""
    run = _diloco_first(b_drop=0.0)
    while run.step <= 3 * W + 5:
        plateau = run.step <= W
        run.b_drop = 0.0002 if plateau else 0.01
        diloco = run.sync.active
        run.sw.note_loss(torch.tensor(run.level + random.Random(run.step).gauss(0.0, 0.001), dtype=torch.float64))
        run.level -= run.b_drop if diloco or plateau else 0.01
        run.sync.now = run.step
        run.held[run.step] = run.sw.after_step(run.step, B_STEP_S if diloco else A_STEP_S, False)
        run.step += 1
    assert run.sync.calls == [("enter", 0, "diloco10"), ("leave", W, "diloco10"), ("enter", 2 * W, "diloco10")]
    last = run.state.sync["last_trial"]
    assert last["winner"] == "challenger" and last["steepened"] and last["end_step"] == 3 * W
    first, middle, third = (r["per_s"] for r in last["rates"])
    assert middle > 2 * first  # what misled a verdict after two windows
    assert third == pytest.approx(0.01 / B_STEP_S, rel=0.05) and middle == pytest.approx(0.01 / A_STEP_S, rel=0.05)
    assert last["z"] == pytest.approx((third - middle) / math.hypot(*(r["stderr"] for r in last["rates"][1:])), rel=1e-9)


def test_diloco_first_not_separable_keeps_diloco():
    """A threshold no lead reaches: the bracketing family, DiLoCo, stays (per-step first, the
    per-step method would: tests/test_auto_diloco_lightning.py)."""
    run = _diloco_first(b_drop=0.004, diloco_threshold=1e9)
    run.until(3 * W + 2)
    last = run.state.sync["last_trial"]
    assert last["winner"] == "challenger" and last["separated"] is False
    assert run.sync.calls[-1] == ("enter", 2 * W, "diloco10") and run.sync.active


def test_diloco_first_nonfinite_loss_in_its_first_window_leaves_at_the_rounds_end():
    run = _diloco_first(b_drop=0.008)
    run.until(4)
    run.one(loss=torch.tensor(float("inf")))
    run.until(H)
    assert run.sync.calls == [("enter", 0, "diloco10"), ("leave", H, "diloco10")]
    assert run.state.sync["last_trial"]["winner"] == "incumbent" and not run.sync.active


def test_diloco_first_redecision_in_the_per_step_window_aborts():
    run = _diloco_first(b_drop=0.008)
    run.until(W + 3)
    run.state.chosen = "fp16"
    run.one()
    last = run.state.sync["last_trial"]
    assert last["winner"] == "aborted" and last["end_step"] == W + 4 and not run.sync.active
    assert run.sync.calls == [("enter", 0, "diloco10"), ("leave", W, "diloco10")]


# ---------------------------------------------------------------- watching the link under DiLoCo
def test_an_outer_exchange_severe_drift_faster_leaves_and_redecides():
    cfg = _config()
    run = Run(cfg, _state(), b_drop=0.008)
    run.until(3 * W)
    assert run.sync.active and run.state.sync["reference_exchange_s"] is None
    run.until(3 * W + 5)
    run.one(stats=SimpleNamespace(comm_s=1.0))  # the first outer exchange: the reference
    assert run.state.sync["reference_exchange_s"] == {"0": 1.0}
    stats = SimpleNamespace(comm_s=1.0 / (0.95 * cfg.severe_drift))  # faster, not by severe_drift
    run.one(stats=stats)
    stats.comm_s = 0.01  # the same outer step seen again is not read again
    run.until(3 * W + 12)
    assert run.sync.active and run.redecided == []
    step = run.step
    assert run.one(stats=SimpleNamespace(comm_s=1.0 / cfg.severe_drift)) is True
    assert run.redecided == [step] and not run.sync.active
    assert run.sync.calls[-1] == ("leave", step, "diloco10")
    (ev,) = [e for e in run.events("leave") if e["why"] == "link_moved"]
    assert ev["step"] == step and ev["state_bytes"] == 4321
    assert (ev["exchange_s"], ev["reference_s"]) == (1.0 / cfg.severe_drift, 1.0)  # what the rule read
    assert run.state.sync["running"] is None and run.state.settling


def test_streaming_fragments_of_different_sizes_are_each_compared_with_their_own_first_exchange():
    """Streaming DiLoCo with fragments whose exchanges take 1.0 s and 0.2 s (5× apart, past
    severe_drift 2): each is compared with its own first, so alternating them moves nothing; fragment
    1 at 2× its own first is a moved link. A reference kept as one float (a checkpoint from before)
    is fragment 0's."""
    cfg = _config()
    run = Run(cfg, _state(), b_drop=0.008)
    run.until(3 * W + 5)
    assert run.sync.active
    for k in range(6):
        run.one(stats=SimpleNamespace(comm_s=(1.0, 0.2)[k % 2], fragment=k % 2))
    assert run.sync.active and run.redecided == [] and run.state.sync["reference_exchange_s"] == {"0": 1.0, "1": 0.2}
    step = run.step
    run.one(stats=SimpleNamespace(comm_s=0.2 * cfg.severe_drift, fragment=1))
    assert run.redecided == [step] and not run.sync.active
    (ev,) = [e for e in run.events("leave") if e["why"] == "link_moved"]
    assert (ev["exchange_s"], ev["reference_s"]) == (0.2 * cfg.severe_drift, 0.2)
    run2 = Run(cfg, _state(), b_drop=0.008)
    run2.until(3 * W + 5)
    run2.state.sync["reference_exchange_s"] = 1.0
    run2.one(stats=SimpleNamespace(comm_s=1.9, fragment=0))
    assert run2.sync.active and run2.state.sync["reference_exchange_s"] == {"0": 1.0}


# ---------------------------------------------------------------- resume mid-trial
@pytest.mark.parametrize("lead, cut", [(0.0, 0), (0.0, 3), (2.0, 0), (2.0, 3)])
def test_a_checkpoint_mid_trial_gives_the_same_verdict(lead, cut):
    """Cut in the middle window: DiLoCo's (per-step first; at a round's end, or 3 steps into a round,
    whose steps the checkpoint agrees first) or the per-step method's (DiLoCo first)."""
    cfg = _config(diloco_lead=lead)
    mid = W + W // 2 + cut  # inside the middle window
    run = Run(cfg, _state(), b_drop=0.004)  # not interrupted
    run.until(3 * W + 3)
    whole = run.state.sync
    first = Run(cfg, _state(), b_drop=0.004)  # saved after step mid
    first.until(mid)
    first.sw.flush(mid)
    assert first.sw._pending == []
    saved = json.loads(json.dumps(first.state.state_dict(False, 0)))
    level, cut_events = first.level, len(first.state.sync["events"])
    assert len(saved["sync"]["trial"]["durations"]) == W // 2 + cut  # every step of the window so far

    st = AutoState(probe_every=100, gain_every=50, explore=2)
    st.load(saved)
    sync = FakeSync()
    if not lead:
        sync.active, sync.choice = True, "diloco10"  # DiLoCo's own checkpoint restores it running
    resumed = Run(cfg, st, b_drop=0.004, sync=sync)
    resumed.level, resumed.step = level, mid + 1
    resumed.until(3 * W + 3)
    assert st.sync["last_trial"] == whole["last_trial"]
    assert st.sync["events"] == whole["events"] and len(whole["events"]) > cut_events
    assert sync.calls == [c for c in run.sync.calls if c[1] > mid]
    assert whole["last_trial"]["winner"] == "challenger" and math.isfinite(whole["last_trial"]["z"])


def test_the_dense_steps_calibration_is_not_counted_as_diloco_compute():
    """``other_s`` holds the network model's error on the dense exchange (the warm-up's calibration):
    DiLoCo's predicted step is compute plus its own exchange, the same with or without it."""
    run = Run(_config(diloco=("diloco10", "diloco50")), _state(SLOW), b_drop=0.0, world_size=4)
    plain = run.sw.predictions()
    w = run.state.workload
    run.state.workload = Workload(w.forward_s, w.backward_s, w.numels, w.optimizer_s, 5.0)
    for name, p in run.sw.predictions().items():
        assert p.step_s == pytest.approx(_hand_diloco_step(SLOW, 4, int(name[-2:])), rel=1e-12) == plain[name].step_s


def test_diloco_compute_is_at_most_the_running_methods_measured_step():
    """A profile three times the measured reference step (a slow first dense step): DiLoCo's compute
    is the reference, its exchange on top as before."""
    st = _state(SLOW, reference=COMPUTE_S / 3)
    run = Run(_config(diloco=("diloco10", "diloco50")), st, b_drop=0.0, world_size=4)
    for name, p in run.sw.predictions().items():
        exchange = _hand_diloco_step(SLOW, 4, int(name[-2:])) - COMPUTE_S
        assert p.compute_s == pytest.approx(COMPUTE_S / 3, rel=1e-12)
        assert p.step_s == pytest.approx(COMPUTE_S / 3 + exchange, rel=1e-12)


# ---------------------------------------------------------------- DiLoCo's steps agreed once a round
def _counting(calls: list[int]):
    plain = sync_switch.agree_values

    def agree(values, op, group, device):
        calls.append(len(values))
        return plain(values, op, group, device)
    return agree


def test_a_diloco_window_agrees_once_a_round_and_a_per_step_window_every_step(monkeypatch):
    """Per-step first: W per-step steps, one all-reduce of 4 figures each; then DiLoCo's window of
    ROUNDS rounds, one all-reduce of 4·H figures at each outer step, none between."""
    calls: list[int] = []
    monkeypatch.setattr(sync_switch, "agree_values", _counting(calls))
    run = Run(_config(), _state(), b_drop=0.001)  # DiLoCo slower: its window ends in a leave
    run.until(W)
    assert calls == [4] * W
    calls.clear()
    for _ in range(ROUNDS):
        run.until(run.step + H - 2)
        assert calls == [] and run.sync.active
        run.one()
        assert calls == [4 * H]
        calls.clear()
    assert not run.sync.active and len(run.state.sync["trial"]["rates"]) == 2


def _ranks_agree_diloco_steps(rank: int, world: int) -> tuple[dict, list[int], list[float]]:
    """DiLoCo first from step 0; rank r's step s takes 0.1 + 0.01·r + 0.001·s seconds at a loss of
    5 − 0.01·s + 0.1·r. A checkpoint's flush after step W − 1, then the window's last step."""
    calls: list[int] = []
    sync_switch.agree_values = _counting(calls)
    sync = FakeSync()
    state = _state()
    sw = FamilySwitcher(_engine(world), _config(diloco_gate=1.5, diloco_lead=1.5), state, sync, lambda s: None)
    flushed: list[float] = []
    for step in range(W + 1):
        sw.note_loss(torch.tensor(5.0 - 0.01 * step + 0.1 * rank, dtype=torch.float64))
        sync.now = step
        sw.after_step(step, 0.1 + 0.01 * rank + 0.001 * step, False)
        if step == W - 1:
            sw.flush(step)
            flushed = list(state.sync["trial"]["durations"])
    return state.sync, calls, flushed


def test_three_ranks_agree_diloco_steps_at_its_outer_steps_and_at_a_checkpoint():
    """Three gloo ranks with different step times and losses: the trial holds the ranks' mean of
    every step (by hand), identical on every rank; the all-reduces fall at the round's end (step H),
    at the flush (the H − 1 steps of the second round) and at the window's end (its last step)."""
    out = run_distributed(_ranks_agree_diloco_steps, 3)
    syncs, calls, flushed = zip(*out)
    assert syncs[0] == syncs[1] == syncs[2] and flushed[0] == flushed[1] == flushed[2]
    assert list(calls[0]) == [4 * H, 4 * (H - 1), 4]
    hand = [0.1 + 0.01 * 1 + 0.001 * s for s in range(1, W)]  # the mean rank is 1
    assert flushed[0] == pytest.approx(hand, abs=1e-12)
    first = syncs[0]["trial"]["rates"][0]
    assert first["points"] == W and first["seconds"] == pytest.approx(sum(hand) + 0.11 + 0.001 * W, abs=1e-9)
    assert first["per_s"] > 0 and [e["event"] for e in syncs[0]["events"]] == ["trial", "enter", "leave"]
