"""auto's decision rules: plain, agreed numbers in, a :class:`Decision` out.

Nothing here talks to the engine, the process group or the clock: every input is a number (or a
dataclass of numbers) already agreed across ranks, so identical inputs give the identical decision
on every rank, and each rule is tested with plain numbers (tests/test_auto_policy.py). The
participant (:class:`~lightning_gc.auto.chooser.AutoChooser`) measures, probes, agrees, calls
:func:`decide` and applies what comes out.

The rules, each a small function:

* :func:`explore_or_stay`: an unmeasured method the model favours is installed only on a lead of
  ``explore_margin`` over the best measured one;
* :func:`hold_or_switch`: a measured method replaces the running measured one only on a lead of
  ``switch_margin``;
* :func:`dense_sibling`: after a dense mode's first window, a sibling dense mode close enough runs one
  window (``family_margin``);
* :func:`valid_corrections`, :func:`shift_basis`, :func:`windowed`: which measured figures count;
* :func:`keeps_reference`, :func:`next_link_interval`, :func:`needs_switch_check`: what follows a
  decision;
* :func:`sentence`: the decision in one plain sentence.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from ..comm.cost_model import NetworkModel
from .config import AutoConfig
from .model import MethodCost, Prediction, Workload, choose_measured, overhead_used

#: a per-method correction measured on a link whose bandwidth differs from the current one by more
#: than this factor is not used (:func:`valid_corrections`)
STALE_NETWORK_FACTOR = 2.0
BETA_FLOOR = 1e-12  # s/byte (8 Tbit/s): an unlimited link (β = 0) compares as a very fast one


class Trigger(str, Enum):
    """Why a decision is made (a history entry records the value)."""

    WARMUP = "warmup"  #: the first decision, after the dense warm-up's profile
    DRIFT = "drift"  #: the step (or the link canary) says the link moved
    PERIODIC = "periodic"  #: ``probe_every`` steps after the last look at the link
    GAIN = "gain"  #: the candidates' re-measured errors moved (``gain_drift``)
    CALIBRATION = "calibration"  #: a method's first window on this link set its correction
    FAMILY = "family"  #: a dense sibling's one-window trial (``family_margin``)

    @property
    def is_fresh(self) -> bool:
        """A new decision (a fresh exploration budget), not the continuation of one: every trigger but
        a calibration or a sibling's trial."""
        return self not in (Trigger.CALIBRATION, Trigger.FAMILY)


#: the decisions made without a fresh look at the link that, moving from a compressed method to a dense
#: mode, first time the link with the canary's message (:func:`needs_switch_check`)
SWITCH_CHECK_TRIGGERS = (Trigger.GAIN, Trigger.CALIBRATION)


def lead(preds: Mapping[str, Prediction], a: str, b: str) -> float:
    """How much lower ``a``'s predicted time per unit of progress is than ``b``'s, relative to ``b``'s
    (the lead that ``explore_margin`` and ``switch_margin`` are compared with)."""
    return 1.0 - preds[a].time_per_progress_s / preds[b].time_per_progress_s


def overhead_in(entry: Mapping, name: str) -> float:
    """What a history entry's decision added to ``name``'s raw prediction (``model.overhead_used``);
    entries written before the compute shift have neither ``settled`` nor ``shift_s``."""
    return overhead_used(name, entry["corrections"], float(entry.get("shift_s", 0.0)), entry.get("settled"))


def explore_or_stay(best: str, preds: Mapping[str, Prediction], settled: Collection[str],
                    candidates: Sequence[str], explore_margin: float) -> str:
    """``best``, an unmeasured method the plain minimum would install, if its predicted time per unit
    of progress leads the best method measured in a window on this link (``settled``) by at least
    ``explore_margin``; else that measured method (ties to the earlier candidate). Without such a
    method (the warm-up, a link that moved) the plain minimum stands."""
    measured = [c for c in candidates if c in settled and c in preds]
    if not measured:
        return best
    stay = min(measured, key=lambda c: preds[c].time_per_progress_s)
    return best if lead(preds, best, stay) >= explore_margin else stay


def hold_or_switch(best: str, preds: Mapping[str, Prediction], settled: Collection[str], running: str | None,
                   switch_margin: float) -> tuple[str, str | None]:
    """``(best, None)``, or ``(running, best)`` when ``best`` would replace ``running`` while both were
    measured in a window on this link (``settled``) and ``best``'s predicted time per unit of progress
    is less than ``switch_margin`` below the running method's (its figure is the fresher one).
    ``running`` is the mode a dense sibling's trial interrupted at the calibration that ends the trial."""
    if running is None or best == running or best not in settled or running not in settled or running not in preds:
        return best, None
    return (best, None) if lead(preds, best, running) >= switch_margin else (running, best)


def windowed(history: Sequence[Mapping]) -> set[str]:
    """The methods measured in a window of their own (a decision whose step was then measured)."""
    return {h["chosen"] for h in history if h.get("measured_step_s") is not None}


def valid_corrections(corrections: Mapping[str, float], correction_beta: Mapping[str, float],
                      network: NetworkModel | None) -> dict[str, float]:
    """The corrections measured on a network like the current one: an additive correction holds for the
    link it was measured on, so one whose network's bandwidth differs from the current one by more
    than :data:`STALE_NETWORK_FACTOR` is left out (its method is judged by the raw model again)."""
    if network is None:
        return dict(corrections)
    now = network.beta_s_per_byte + BETA_FLOOR
    out = {}
    for name, corr in corrections.items():
        then = correction_beta.get(name)
        if then is not None and max(now / (then + BETA_FLOOR), (then + BETA_FLOOR) / now) > STALE_NETWORK_FACTOR:
            continue
        out[name] = corr
    return out


def shift_basis(windowed_methods: Collection[str], settled: Sequence[str], corrections: Collection[str],
                dense: Collection[str]) -> list[str]:
    """The methods the compute shift is taken from: the dense modes measured in a window of their own,
    on any link, if any (their path is the one the raw model describes best, and what they correct
    is mostly the warm-up's slow compute); else every method measured in a window on this link."""
    basis = sorted(m for m in windowed_methods if m in corrections and m in dense)
    return basis if basis else list(settled)


def switched_on_an_older_figure(last: Mapping | None) -> bool:
    """Whether the last decision replaced the running method at a re-decision (``gain``, ``periodic``,
    ``drift``) by one that had a figure on its link: its first window then decides again."""
    if last is None:
        return False
    return (last["trigger"] in (Trigger.GAIN, Trigger.PERIODIC, Trigger.DRIFT) and last.get("previous") is not None
            and last["previous"] != last["chosen"] and last["chosen"] in (last.get("corrections") or {}))


def dense_sibling(chosen: str, correction: float, measured_s: float, dense: Sequence[str],
                  predictions: Mapping[str, Prediction], valid: Collection[str], windowed_methods: Collection[str],
                  last: Mapping, family_margin: float) -> str | None:
    """The dense mode to run next for one window, or None. ``chosen`` is a dense mode just measured in a
    window with ``correction``; a sibling (``dense``, in candidate order) qualifies if not measured in a
    window of its own on this link and its raw prediction plus that correction, per unit of progress,
    is within ``family_margin`` of ``measured_s`` per unit of progress; the best-predicted one wins."""
    if chosen not in dense or len(dense) < 2:
        return None

    def per_progress(name: str, step_s: float) -> float:
        p = predictions[name]
        return step_s * (p.time_per_progress_s / p.step_s) if p.step_s > 0 else step_s

    limit = (1.0 + family_margin) * per_progress(chosen, measured_s)
    best, best_t = None, math.inf
    for name in dense:
        if name == chosen or (name in windowed_methods and name in valid) or name not in predictions:
            continue
        t = per_progress(name, predictions[name].step_s - overhead_in(last, name) + correction)
        if t <= limit and t < best_t:
            best, best_t = name, t
    return best


@dataclass(frozen=True)
class DecisionInputs:
    """Everything :func:`decide` needs, agreed across ranks.

    ``valid``: the corrections measured on this link (:func:`valid_corrections`); ``settled``: the
    methods measured in a window on this link; ``shift_s``: the compute shift for unmeasured methods;
    ``running``: the method running now (None before the first decision); ``explore_left``: the
    exploration budget before this decision; ``force``: a dense sibling's trial (the pick, as is);
    ``trial_interrupted``: at the calibration that ends a sibling's trial, the mode it interrupted
    (None otherwise)."""

    trigger: Trigger
    costs: tuple[MethodCost, ...]
    workload: Workload
    network: NetworkModel
    world_size: int
    config: AutoConfig
    valid: Mapping[str, float]
    settled: tuple[str, ...]
    shift_s: float
    running: str | None
    explore_left: int
    force: str | None = None
    in_family_trial: bool = False
    trial_interrupted: str | None = None


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose: the method, the one it replaces (``previous``), every prediction, the
    method ``switch_margin`` held off (``held_by_margin``), the codecs timed on the way (in order), the
    costs after that timing, and the exploration budget left."""

    chosen: str
    previous: str | None
    predictions: dict[str, Prediction]
    held_by_margin: str | None
    timed_codecs: tuple[str, ...]
    costs: tuple[MethodCost, ...]
    explore_left: int


#: times one engine codec (by name) and returns the costs with it timed (the participant's side effect)
TimeCodec = Callable[[str], Sequence[MethodCost]]


def decide(inp: DecisionInputs, time_codec: TimeCodec) -> Decision:
    """The pick for ``inp``: the minimum predicted time per unit of progress (:func:`choose_measured`),
    with an untimed codec's lower bound timed (``time_codec``) until the best is timed (branch and
    bound: the others' bounds lost already and only grow), then :func:`explore_or_stay` (not at a
    ``gain`` re-decision, which acts on new information about the measured methods themselves) and
    :func:`hold_or_switch` (not at a calibration, which compares two recent windows, except the one
    ending a sibling's trial, where the interrupted mode holds). A forced sibling is taken as is."""
    cfg, trigger = inp.config, Trigger(inp.trigger)
    explore_left = cfg.explore if trigger.is_fresh else inp.explore_left
    explore = trigger.is_fresh or explore_left > 0
    costs = tuple(inp.costs)

    def pick() -> tuple[str, dict[str, Prediction]]:
        return choose_measured(costs, inp.valid, inp.workload, inp.network, inp.world_size, cfg.progress_weight,
                               explore=explore, shift_s=inp.shift_s, settled=list(inp.settled))

    best, preds = pick()
    timed: list[str] = []
    while inp.force is None and not next(c for c in costs if c.name == best).codec_timed:
        costs = tuple(time_codec(best))
        timed.append(best)
        best, preds = pick()
    held = None
    if inp.force is not None:
        best = inp.force
    else:
        if best not in inp.valid and trigger != Trigger.GAIN:
            best = explore_or_stay(best, preds, inp.settled, cfg.candidates, cfg.explore_margin)
        if trigger == Trigger.CALIBRATION and best not in inp.valid:
            explore_left -= 1
        if trigger != Trigger.CALIBRATION:
            best, held = hold_or_switch(best, preds, inp.settled, inp.running, cfg.switch_margin)
        elif inp.in_family_trial and best == inp.running:
            incumbent = inp.trial_interrupted if inp.trial_interrupted is not None else inp.running
            best, held = hold_or_switch(best, preds, inp.settled, incumbent, cfg.switch_margin)
    return Decision(best, inp.running, preds, held, tuple(timed), costs, explore_left)


def needs_switch_check(trigger: Trigger, probed: bool, canary_seen: bool, can_check: bool, running: str | None,
                       best: str, dense: Collection[str]) -> bool:
    """Whether a decision that did not look at the link (``gain``, ``calibration``), moving from a
    compressed method to a dense mode, first times the link with one canary message: a link that fell
    meanwhile would cost a whole dense step at the fallen rate before the one-step test sees it."""
    return (trigger in SWITCH_CHECK_TRIGGERS and not probed and not canary_seen and can_check
            and running is not None and best != running and best in dense and running not in dense)


def keeps_reference(trigger: Trigger, source: str, chosen: str, previous: str | None, has_reference: bool) -> bool:
    """Whether a decision keeps the running method's drift references: it kept the method on the link it
    measured (a calibration, or a periodic or gain re-decision that did not measure the link anew)."""
    return chosen == previous and has_reference and (
        trigger == Trigger.CALIBRATION
        or (trigger in (Trigger.PERIODIC, Trigger.GAIN) and source in ("check", "kept", "pinned")))


def next_link_interval(trigger: Trigger, source: str, chosen: str, previous: str | None, interval: int,
                       probe_every: int, probe_every_max: int) -> int:
    """Steps to the next periodic look after a decision that looked at the link: twice the last
    interval (up to ``probe_every_max``) after a periodic look that found the link as it was and kept
    the method; ``probe_every`` after any other."""
    calm = trigger == Trigger.PERIODIC and source in ("check", "pinned") and chosen == previous
    cap = max(probe_every_max, probe_every)
    return min(2 * interval, cap) if calm and probe_every_max else probe_every


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _rate(network: NetworkModel) -> str:
    bw = network.bandwidth_bits_per_s
    return "an unlimited link" if not math.isfinite(bw) else f"this {_num(bw / 1e6)} Mbit/s link"


def sentence(decision: Decision, network: NetworkModel, dense: Collection[str]) -> str:
    """The decision in one plain sentence. A switch names the runner-up by time per unit of progress:
    "chose topk over fp16: predicted 41 ms per unit of progress against 95 ms on this 20 Mbit/s link".
    A dense mode kept says what compressing would change in its step ("kept fp16: compressing would
    save 0.3 ms of a 22 ms step on this 667 Mbit/s link"); a compressed method kept, its lead."""
    preds, best = decision.predictions, decision.chosen
    link = _rate(network)
    held = (f" ({decision.held_by_margin} led by less than switch_margin)"
            if decision.held_by_margin is not None else "")
    others = sorted((p for n, p in preds.items() if n != best), key=lambda p: p.time_per_progress_s)
    me = preds[best]
    if best != decision.previous or not others:
        if not others:
            return f"chose {best}: the only candidate, predicted {_num(1e3 * me.step_s)} ms per step on {link}"
        runner = others[0]
        return (f"chose {best} over {runner.name}: predicted {_num(1e3 * me.time_per_progress_s)} ms per unit of "
                f"progress against {_num(1e3 * runner.time_per_progress_s)} ms on {link}{held}")
    compressed = [p for p in others if p.name not in dense]
    if best in dense and compressed:
        fastest = min(compressed, key=lambda p: p.step_s)
        diff = 1e3 * (me.step_s - fastest.step_s)
        change = f"save {_num(diff)} ms of" if diff >= 0 else f"add {_num(-diff)} ms to"
        return f"kept {best}: compressing would {change} a {_num(1e3 * me.step_s)} ms step on {link}{held}"
    runner = others[0]
    return (f"kept {best}: predicted {_num(1e3 * me.time_per_progress_s)} ms per unit of progress against "
            f"{_num(1e3 * runner.time_per_progress_s)} ms for {runner.name} on {link}{held}")


#: the fewest windows (the reference one included) whose median replaces the running method's figure at a
#: gain or periodic re-decision (:func:`running_correction`)
RUN_FIGURE_MIN_WINDOWS = 3


def in_trial(history: Sequence[Mapping], chosen: str | None, valid: Collection[str]) -> bool:
    """Whether the running method is on trial, its window not measured yet: a dense sibling's one window,
    a method a calibration installed that has no correction on this link, or a method a re-decision
    switched to on an older figure (:func:`switched_on_an_older_figure`)."""
    if not history:
        return False
    trigger = history[-1]["trigger"]
    return (trigger == Trigger.FAMILY or (trigger == Trigger.CALIBRATION and chosen not in valid)
            or switched_on_an_older_figure(history[-1]))


def calibration_next(chosen: str, raw_s: float, measured_s: float, was_valid: bool, history: Sequence[Mapping],
                     predictions: Mapping[str, Prediction], valid: Collection[str], dense: Sequence[str],
                     family_margin: float) -> tuple[Trigger, str | None] | None:
    """What follows a reference window that set ``chosen``'s correction (``measured_s - raw_s``): the
    decision to make now, as (trigger, forced sibling), or None. A sibling's trial ends in a
    calibration among the measured methods; a dense mode's first window may start a sibling's trial
    (:func:`dense_sibling`); a method without a valid correction before, or one switched to on an older
    figure, is decided on again at once (no probe)."""
    last = history[-1]
    if last["trigger"] == Trigger.FAMILY:
        return Trigger.CALIBRATION, None
    sibling = dense_sibling(chosen, measured_s - raw_s, measured_s, dense, predictions, valid, windowed(history),
                            last, family_margin)
    if sibling is not None:
        return Trigger.FAMILY, sibling
    if not was_valid or switched_on_an_older_figure(last):
        return Trigger.CALIBRATION, None
    return None


def running_correction(trigger: Trigger, source: str, chosen: str | None, corrections: Collection[str],
                       run_medians: Sequence[float], history: Sequence[Mapping],
                       predictions: Mapping[str, Prediction]) -> tuple[float, float] | None:
    """At a gain or periodic re-decision on the link the running method was measured on, its figure is the
    median of its windows since the reference (at least :data:`RUN_FIGURE_MIN_WINDOWS`), not the
    reference window alone (one short window on a busy host is often off by more than the margins):
    returns (that median, the correction it gives), or None when not used."""
    if (trigger not in (Trigger.GAIN, Trigger.PERIODIC) or source not in ("check", "kept", "pinned")
            or chosen is None or chosen not in corrections or len(run_medians) < RUN_FIGURE_MIN_WINDOWS
            or not history or chosen not in predictions):
        return None
    figure = statistics.median(run_medians)
    return figure, figure - (predictions[chosen].step_s - overhead_in(history[-1], chosen))
