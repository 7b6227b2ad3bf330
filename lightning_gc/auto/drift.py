"""When auto looks again: the drift tests on agreed step walls. Plain numbers in, a verdict out.

Every input is agreed across ranks (the walls' means, the history, the configuration), so every rank
reaches the same verdict and issues the same collectives after it. Tested with plain numbers
(tests/test_auto_policy.py).

* :func:`window_action`: a window's median against the reference (``drift`` for ``patience``
  windows, ``severe_drift`` in one, or the periodic look at the link);
* :func:`severe_verdict`: the every-step tests (``severe_steps``): the last steps' walls, one dense
  step's wall (:data:`ONE_STEP_FACTOR`), a compressed method's exchange time;
* :func:`severe_held`, :func:`calibrated_prediction`, :func:`gain_due`: what those tests depend on.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..comm.link import factor_apart, steps_apart
from .config import AutoConfig
from .model import Prediction

#: the exchange test re-decides only on a change of at least this share of the reference step: a
#: small exchange's time on a fast link moves by 2x with the host's scheduling alone, and a change
#: that small would not change the pick
EXCHANGE_SHARE = 0.1

#: the one-step test: while a dense mode runs, one agreed step this many times ``severe_drift`` slower
#: than its reference re-decides at once (unless :meth:`AutoChooser.mark_wall` named it). A dense mode
#: on a fallen link pays the whole exchange at the new rate every step, so one step is evidence
#: enough; lower it to react to smaller falls, raise it on a host whose steps stall now and then
ONE_STEP_FACTOR = 4.0

#: the tests of ``severe_drift`` as a decision's history records them (``drift_test``)
SEVERE_TESTS = ("severe_window", "steps", "step", "exchange", "reference_window")


@dataclass(frozen=True)
class Verdict:
    """A severe test that fired: its name (``drift_test``), the wall it saw (for β from a dense step;
    None for the exchange test) and what it compared, in words."""

    test: str
    wall_s: float | None
    what: str


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f} ms"


def severe_held(history: Sequence[Mapping], step: int, min_interval: int) -> bool:
    """Whether a severe re-decision must wait: within ``min_interval`` steps of the last severe one."""
    last = next((h["step"] for h in reversed(history) if h.get("drift_test") in SEVERE_TESTS), None)
    return last is not None and step - last < min_interval


def calibrated_prediction(chosen: str | None, history: Sequence[Mapping],
                          predictions: Mapping[str, Prediction], windowed: set[str]) -> float | None:
    """The running method's predicted step when it carries the method's own correction, measured in a
    window on this link; else None (a method not measured so is expected to be off)."""
    if chosen is None or not history or chosen not in predictions:
        return None
    calibrated = chosen in (history[-1].get("corrections") or {}) and chosen in windowed
    return predictions[chosen].step_s if calibrated else None


def link_moved(measured: Sequence[float], calibrated: float | None, severe_drift: float) -> bool:
    """Whether walls ``severe_drift`` times or more off a calibrated prediction say the link moved
    between the decision and the window (:func:`steps_apart`)."""
    return bool(severe_drift) and calibrated is not None and steps_apart(list(measured), calibrated, severe_drift)


def window_action(med: float, reference: float, drifted: int, step: int, last_decision: int | None,
                  periodic_due: bool, held: bool, cfg: AutoConfig) -> tuple[int, str | None, str]:
    """A window of median ``med`` after the reference window: (windows drifted in a row, the action,
    why). The action is ``"periodic"`` (``periodic_due``: the link schedule says auto's look is due),
    ``"window"`` (``drift`` for ``patience`` windows, ``min_interval`` after the last decision),
    ``"severe_window"`` (``severe_drift`` in one window, unless ``held``) or None."""
    moved = abs(med - reference) / reference > cfg.drift if reference > 0 else False
    drifted = drifted + 1 if moved else 0
    sv = cfg.severe_drift
    severe = bool(sv) and factor_apart(med, reference, sv)
    if periodic_due:
        return drifted, "periodic", ""
    last = last_decision if last_decision is not None else -10**9
    moderate = drifted >= cfg.patience and step - last >= cfg.min_interval
    if not (moderate or (severe and not held)):
        return drifted, None, ""
    why = (f"at least {sv:g}x in one window" if severe and drifted < cfg.patience else
           f"drift > {100 * cfg.drift:.0f}% for {drifted} windows")
    return drifted, "severe_window" if severe else "window", why


def severe_verdict(recent: Sequence[float], reference: float | None, calibrated: float | None, cfg: AutoConfig,
                   one_step: bool, recent_exchange: Sequence[float], reference_exchange: float | None,
                   label: str = "") -> Verdict | None:
    """The every-step tests, in order; the first that fires, or None.

    * ``steps``: every one of the last ``severe_steps`` agreed walls ``severe_drift`` or more off the
      reference the same way, or their median twice that far (before the reference window: off the
      calibrated prediction);
    * ``step`` (``one_step``: a dense mode runs and the newest wall is not a marked one): the newest
      wall :data:`ONE_STEP_FACTOR` · ``severe_drift`` times its reference (or calibrated prediction);
    * ``exchange``: the median of the last exchange times ``severe_drift`` times or more *faster* than
      the reference window's fastest, by at least :data:`EXCHANGE_SHARE` of the reference step. Only
      faster: a fall shows in the step tests, and a small exchange on a shaped link has two modes.

    ``label`` names the newest wall's step and the method in the ``step`` test's words."""
    n, sv = cfg.severe_steps, cfg.severe_drift
    if not n or not sv:
        return None
    if len(recent) >= n:
        base = reference if reference is not None else calibrated
        if base is not None and steps_apart(list(recent), base, sv):
            return Verdict("steps", statistics.median(recent),
                           f"the last {n} steps ran {_ms(min(recent))}-{_ms(max(recent))} (median "
                           f"{_ms(statistics.median(recent))}) against {_basis(reference, calibrated)}")
    base = reference if reference is not None else calibrated
    if one_step and recent and base is not None and recent[-1] >= ONE_STEP_FACTOR * sv * base:
        return Verdict("step", recent[-1], f"one step {label}ran {_ms(recent[-1])}, {ONE_STEP_FACTOR * sv:g}x or more "
                                           f"against {_basis(reference, calibrated)}")
    if reference and reference_exchange and len(recent_exchange) >= n:
        med = statistics.median(recent_exchange)
        if med * sv <= reference_exchange and reference_exchange - med >= EXCHANGE_SHARE * reference:
            return Verdict("exchange", None, f"the last {n} steps' exchanges took {_ms(med)} (median) against "
                                             f"{_ms(reference_exchange)} in the reference window (step {_ms(reference)})")
    return None


def _basis(reference: float | None, calibrated: float | None) -> str:
    if reference is not None:
        return f"{_ms(reference)} after the last decision"
    return f"{_ms(calibrated or 0.0)} predicted from its own measured step"


def gain_due(step: int, interval: int, cfg: AutoConfig, measured_again: bool, last_gain_step: int | None,
             in_trial: bool) -> bool:
    """Whether the next step's gradients are sampled to measure the candidates' errors again:
    ``gain_first`` (then the interval, ``gain_every`` doubling up to ``gain_every_max``) steps after the
    last measurement, and not while a method is on trial (its window is measured first)."""
    every = interval if cfg.gain_every else 0
    if every and cfg.gain_first and not measured_again:
        every = min(every, cfg.gain_first)
    due = bool(every) and last_gain_step is not None and step + 1 - last_gain_step >= every
    return due and not in_trial
