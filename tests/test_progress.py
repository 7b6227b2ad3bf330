"""Progress from the training loss (lightning_gc/auto/progress.py), against analytic expectations.

Oracles: an exact line has its slope and no error; Python's own ``statistics.linear_regression`` gives
the slope; the standard error is checked against the spread of slopes over many noise draws (what it
claims to estimate); a quadratic loss curve makes the ABA bracket cancel the drift exactly, where a
plain A-then-B comparison is biased; the false-switch rate under the noise model is about the one-sided
tail of the threshold, and a faster method wins.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from lightning_gc.auto.progress import Rate, bracketed, compare, trial_cost, window_rate

WINDOW = 20  # steps per window
STEP_S = 0.5


def _curve(tau: float) -> float:
    """A loss whose slope shrinks linearly with training time (quadratic in it)."""
    return 6.0 - 0.04 * tau + 0.0001 * tau ** 2


def _window(start_s: float, speed: float, t0: float, noise: float = 0.0, rng: random.Random | None = None):
    """WINDOW steps from wall time ``start_s``; the method moves along the curve ``speed`` times as fast,
    from curve time ``t0``. Returns (times, losses, curve time at the end)."""
    times, losses = [], []
    for i in range(1, WINDOW + 1):
        t = start_s + i * STEP_S
        curve_t = t0 + speed * i * STEP_S
        times.append(t)
        losses.append(_curve(curve_t) + (rng.gauss(0.0, noise) if rng else 0.0))
    return times, losses, t0 + speed * WINDOW * STEP_S


def _aba(speed_b: float, noise: float = 0.0, rng: random.Random | None = None, start: float = 10.0):
    span = WINDOW * STEP_S
    ta, la, c = _window(start, 1.0, start, noise, rng)
    tb, lb, c = _window(start + span, speed_b, c, noise, rng)
    ta2, la2, _ = _window(start + 2 * span, 1.0, c, noise, rng)
    return window_rate(ta, la), window_rate(tb, lb), window_rate(ta2, la2)


def test_an_exact_line_has_its_slope_and_no_error():
    times = [0.5 * i for i in range(1, 11)]
    r = window_rate(times, [5.0 - 0.3 * t for t in times])
    assert r.per_s == pytest.approx(0.3) and r.stderr == pytest.approx(0.0, abs=1e-12) and r.points == 10


def test_the_slope_is_the_least_squares_one():
    rng = random.Random(1)
    times = [0.3 * i + rng.random() * 0.1 for i in range(30)]
    losses = [4.0 - 0.1 * t + rng.gauss(0, 0.05) for t in times]
    want = statistics.linear_regression(times, losses).slope
    assert window_rate(times, losses).per_s == pytest.approx(-want, rel=1e-9)


def test_the_standard_error_matches_the_spread_of_slopes_over_noise_draws():
    rng = random.Random(2)
    times = [STEP_S * i for i in range(WINDOW)]
    rates, ses = [], []
    for _ in range(2000):
        r = window_rate(times, [3.0 - 0.05 * t + rng.gauss(0.0, 0.1) for t in times])
        rates.append(r.per_s)
        ses.append(r.stderr)
    sxx = sum((t - statistics.fmean(times)) ** 2 for t in times)
    assert statistics.fmean(rates) == pytest.approx(0.05, abs=3 * 0.1 / math.sqrt(sxx) / math.sqrt(2000))
    assert statistics.stdev(rates) == pytest.approx(0.1 / math.sqrt(sxx), rel=0.05)  # σ/√Sxx, the true spread
    assert statistics.fmean(ses) == pytest.approx(0.1 / math.sqrt(sxx), rel=0.05)  # what the SE estimates


def test_the_aba_bracket_cancels_a_linear_drift_of_the_slope_where_a_then_b_does_not():
    a1, b, a2 = _aba(speed_b=1.0)  # the same method three times: no lead is the truth
    assert a1.per_s > b.per_s > a2.per_s  # the slope drifts down through the three windows
    assert bracketed(a1, a2).per_s == pytest.approx(b.per_s, rel=1e-9)
    assert compare(bracketed(a1, a2), b).lead_per_s == pytest.approx(0.0, abs=1e-12)
    assert compare(a1, b).lead_per_s < -1e-3  # A then B alone: B looks slower than it is


def test_a_faster_method_wins_and_a_slower_one_loses_without_noise():
    a1, b, a2 = _aba(speed_b=1.5)
    v = compare(bracketed(a1, a2), b)
    assert v.winner == "challenger" and v.z > 50  # the only residual is the curve's bend over a window
    a1, b, a2 = _aba(speed_b=0.6)
    assert compare(bracketed(a1, a2), b).winner == "incumbent"


def test_under_noise_an_equal_method_rarely_switches_and_a_faster_one_usually_wins():
    rng = random.Random(3)
    trials = 1500
    null = [compare(bracketed(a1, a2), b).winner for a1, b, a2 in (_aba(1.0, 0.02, rng) for _ in range(trials))]
    false_switch = null.count("challenger") / trials
    assert 0.008 <= false_switch <= 0.05, false_switch  # one-sided t tail at 2 (about 2.5 % on these windows)
    assert null.count(None) / trials > 0.9
    fast = [compare(bracketed(a1, a2), b).winner for a1, b, a2 in (_aba(1.5, 0.02, rng) for _ in range(300))]
    assert fast.count("challenger") / 300 > 0.9


def test_a_higher_threshold_switches_less():
    a, b = Rate(0.10, 0.01, 20), Rate(0.13, 0.01, 20)  # z = 0.03 / 0.01414 = 2.12
    assert compare(a, b).winner == "challenger" and compare(a, b, threshold=3.0).winner is None
    assert compare(a, b).z == pytest.approx(0.03 / math.hypot(0.01, 0.01))


def test_trial_cost_is_the_progress_a_slower_challenger_fell_short_by():
    inc = Rate(0.20, 0.01, 20)
    assert trial_cost(10.0, inc, Rate(0.15, 0.01, 20)) == pytest.approx(2.5)  # 10 s at 3/4 of the rate
    assert trial_cost(10.0, inc, Rate(0.30, 0.01, 20)) == 0.0
    assert trial_cost(10.0, Rate(-0.01, 0.01, 20), Rate(0.0, 0.01, 20)) == 0.0


@pytest.mark.parametrize("times, losses, match", [
    ([0.0, 1.0], [1.0, 0.9], "at least 3"),
    ([0.0, 1.0, 1.0], [1.0, 0.9, 0.8], "strictly increasing"),
    ([0.0, 1.0, 2.0], [1.0, float("nan"), 0.8], "finite"),
    ([0.0, 1.0, 2.0], [1.0, 0.9], "as many losses"),
])
def test_bad_windows_are_refused(times, losses, match):
    with pytest.raises(ValueError, match=match):
        window_rate(times, losses)


def test_a_bad_threshold_is_refused():
    with pytest.raises(ValueError, match="threshold=0"):
        compare(Rate(0.1, 0.01, 5), Rate(0.1, 0.01, 5), threshold=0)
