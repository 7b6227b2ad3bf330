"""The pure rules of auto's family trial (lightning_gc/auto/sync_trial.py), against oracles written here.

Oracles: a brute-force gate and challenger rule (enumerate the candidates, smallest H among the hidden
ones, then the fewest fragments, else the fastest, ties to the first listed); Python's ``statistics.linear_regression`` for a
window's slope, with the standard error computed by hand from its residuals; the z-score written out
by hand (the bracketing family read at the middle window's mean loss; negated where DiLoCo brackets); noise-free exponential and quadratic loss curves, whose rate at a
given loss is known in closed form.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics

import pytest

from lightning_gc.auto import sync_trial
from lightning_gc.auto.progress import MIN_POINTS, Rate
from lightning_gc.auto.sync_trial import PHASES, Trial


# ---------------------------------------------------------------- gate and challenger
def _gate_oracle(incumbent: float, challenger: float, gate: float) -> bool:
    if incumbent <= 0 or challenger <= 0 or math.isnan(incumbent) or math.isnan(challenger):
        return False
    return incumbent >= gate * challenger


def test_gate_opens_matches_the_rule_on_a_grid_and_at_its_edge():
    values = [-1.0, 0.0, 0.05, 0.1, 0.2, 0.25, 0.5, 1.0, float("nan")]
    for inc, cha, gate in itertools.product(values, values, [1.0, 2.0, 4.0]):
        assert sync_trial.gate_opens(inc, cha, gate) == _gate_oracle(inc, cha, gate), (inc, cha, gate)
    assert sync_trial.gate_opens(0.5, 0.25, 2.0)  # exactly the gate's factor: open
    assert not sync_trial.gate_opens(0.5, 0.25 + 1e-12, 2.0)
    assert sync_trial.gate_opens(1.0, 1.0, 0.0)  # gate 0: open wherever both steps are known


def _challenger_oracle(steps: list[tuple[str, float]], hf: dict[str, tuple[int, int]], compute: float,
                       hide: float) -> str:
    best = None
    for name, s in steps:  # smallest H among the hidden ones, then fewest fragments, first listed on a tie
        if not s <= (1 + hide) * compute:
            continue
        (h, f), bh = hf[name], hf[best] if best is not None else None
        if best is None or h < bh[0] or (h == bh[0] and f < bh[1]):
            best = name
    if best is not None:
        return best
    for name, s in steps:  # else the fastest, first listed on a tie
        if best is None or s < dict(steps)[best]:
            best = name
    return best


def test_pick_challenger_hand_cases():
    h = {"diloco10": (10, 1), "diloco50": (50, 1), "sparseloco10": (10, 1), "sparseloco50": (50, 1),
         "diloco10f2": (10, 2), "diloco50f5": (50, 5)}
    # both hidden: the smaller H, though diloco50 is faster
    assert sync_trial.pick_challenger({"diloco10": 1.05, "diloco50": 1.01}, h, 1.0, 0.1) == "diloco10"
    # only the larger H hides the link
    assert sync_trial.pick_challenger({"diloco10": 1.5, "diloco50": 1.08}, h, 1.0, 0.1) == "diloco50"
    # none hidden: the fastest
    assert sync_trial.pick_challenger({"diloco10": 3.0, "diloco50": 1.5}, h, 1.0, 0.1) == "diloco50"
    # equal H, both hidden: the first listed, whichever order
    assert sync_trial.pick_challenger({"sparseloco10": 1.0, "diloco10": 1.0}, h, 1.0, 0.1) == "sparseloco10"
    assert sync_trial.pick_challenger({"diloco10": 1.0, "sparseloco10": 1.0}, h, 1.0, 0.1) == "diloco10"
    # exactly (1 + hide) * compute counts as hidden
    assert sync_trial.pick_challenger({"diloco10": 1.5, "diloco50": 1.25}, h, 1.0, 0.25) == "diloco50"
    assert sync_trial.pick_challenger({"diloco50": 1.25, "diloco10": 1.25}, h, 1.0, 0.25) == "diloco10"
    # streaming: of equal H and both hidden, the plain one, though the streaming one is faster
    assert sync_trial.pick_challenger({"diloco50f5": 1.0, "diloco50": 1.05}, h, 1.0, 0.1) == "diloco50"
    # streaming at a smaller H hides the link where plain DiLoCo needs the larger H
    assert sync_trial.pick_challenger({"diloco10": 1.5, "diloco10f2": 1.05, "diloco50": 1.08}, h, 1.0, 0.1) == "diloco10f2"
    # none hidden: the fastest, streaming or not
    assert sync_trial.pick_challenger({"diloco50": 1.6, "diloco50f5": 1.3, "diloco10": 3.0}, h, 1.0, 0.1) == "diloco50f5"


def test_pick_challenger_matches_brute_force_on_random_sets():
    rng = random.Random(7)
    h = {"diloco10": (10, 1), "diloco50": (50, 1), "sparseloco10": (10, 1), "sparseloco50": (50, 1),
         "diloco10f2": (10, 2), "diloco50f5": (50, 5), "diloco50f10": (50, 10), "sparseloco50f5": (50, 5)}
    names = list(h)
    for _ in range(800):
        chosen = rng.sample(names, rng.randint(1, len(names)))
        steps = [(n, rng.choice([1.0, 1.05, 1.1, 1.2, 1.5, 2.0])) for n in chosen]
        compute, hide = rng.choice([0.9, 1.0]), rng.choice([0.0, 0.1, 0.2])
        got = sync_trial.pick_challenger(dict(steps), h, compute, hide)
        assert got == _challenger_oracle(steps, h, compute, hide), (steps, compute, hide)


def test_pick_challenger_refuses_an_empty_set():
    with pytest.raises(ValueError, match="at least one DiLoCo candidate"):
        sync_trial.pick_challenger({}, {}, 1.0, 0.1)


def test_every_diloco_window_keeps_enough_points_however_its_first_round_is_cut():
    """Brute force: for every H, rounds and number of steps done at entering, a DiLoCo window of
    ``window_steps`` with the aligned first round (``window + first_round − H`` steps) has at least
    MIN_POINTS steps, and windows are whole rounds no longer than needed."""
    for h in range(1, 61):
        for rounds in (1, 2, 3):
            w = sync_trial.window_steps(h, rounds)
            assert w % h == 0 and w >= rounds * h
            shortest = min(w + sync_trial.first_round(done, h) - h for done in range(1, 3 * h))
            assert shortest >= MIN_POINTS, (h, rounds, w)
            if w > rounds * h:  # one round fewer would not do
                assert w - h + min(sync_trial.first_round(d, h) for d in range(1, 3 * h)) - h < MIN_POINTS


def test_window_steps_and_cumulative():
    assert sync_trial.window_steps(10, 3) == 30 and sync_trial.window_steps(50, 1) == 50
    assert sync_trial.cumulative([0.5, 0.25, 1.0]) == [0.5, 0.75, 1.75]
    assert sync_trial.cumulative([]) == []


@pytest.mark.parametrize("h", [1, 2, 3, 10, 50])
def test_first_round_reaches_the_next_multiple_of_h_at_least_half_a_round_away(h):
    """Brute force: the smallest later step count that is a multiple of H and at least ⌈H/2⌉ away."""
    for done in range(0, 4 * h + 3):
        want = next(e for e in itertools.count(done + 1) if e % h == 0 and e - done >= math.ceil(h / 2)) - done
        assert sync_trial.first_round(done, h) == want, (h, done)
    assert sync_trial.first_round(182, 50) == 68 and sync_trial.first_round(12, 50) == 38  # joined; cut


@pytest.mark.parametrize("h", [1, 2, 3, 10, 50])
def test_ends_round_marks_exactly_the_outer_steps_of_a_simulated_window(h):
    """Brute force: lay out a window's rounds (the first ``h + stretch`` steps, then ``h`` each) and
    list the steps that close one."""
    for stretch in range(-(h // 2), h):
        ends, left, length = set(), h + stretch, 0
        for n in range(1, 6 * h + 1):
            left -= 1
            if left == 0:
                ends.add(n)
                left = h
            length = n
        got = {n for n in range(1, length + 1) if sync_trial.ends_round(n, h, stretch)}
        assert got == ends, (h, stretch)
    assert all(sync_trial.ends_round(n, 0) for n in range(1, 5))  # a record without H: every step


def test_a_stretched_diloco_window_closes_after_its_first_round_and_leaves_it_out_of_recent():
    """A DiLoCo-first window of 2 rounds of H = 10 whose first round is 13 steps (stretch 3): full at
    23 steps; its recent rate is the hand fit of the 10 steps after the first round; the next window
    has no stretch."""
    rng = random.Random(3)
    tr = Trial(challenger="diloco10", start_step=0, window=20, incumbent="ddp", beta_s_per_byte=4e-7,
               order=sync_trial.DILOCO_FIRST, round_steps=10, stretch=3)
    durations, losses = _noisy_window(rng, 23, 0.2, 0.5, 0.01)
    full = [tr.add(d, v) for d, v in zip(durations, losses)]
    assert full == [False] * 22 + [True]
    tr.close_window()
    assert tr.recent["per_s"] == pytest.approx(_hand_rate(durations[13:], losses[13:])[0], rel=1e-9)
    assert tr.stretch == 0 and tr.rates[0]["points"] == 23
    assert [tr.add(0.3, 1.0) for _ in range(20)][-2:] == [False, True]


# ---------------------------------------------------------------- rates and the verdict
def _hand_rate(durations: list[float], losses: list[float]) -> tuple[float, float]:
    """(minus the slope, its standard error): statistics' slope, the error from the residuals by hand."""
    times = list(itertools.accumulate(durations))
    fit = statistics.linear_regression(times, losses)
    resid = [v - (fit.intercept + fit.slope * t) for t, v in zip(times, losses)]
    mean_t = statistics.fmean(times)
    sxx = sum((t - mean_t) ** 2 for t in times)
    return -fit.slope, math.sqrt(sum(r * r for r in resid) / (len(times) - 2) / sxx)


def _noisy_window(rng: random.Random, n: int, step_s: float, rate: float, noise: float, start: float = 5.0):
    durations = [step_s * rng.uniform(0.8, 1.2) for _ in range(n)]
    times = itertools.accumulate(durations)
    return durations, [start - rate * t + rng.gauss(0.0, noise) for t in times]


def test_rate_of_matches_linear_regression_and_hand_stderr():
    rng = random.Random(3)
    for n in (3, 5, 20, 60):
        durations, losses = _noisy_window(rng, n, 0.3, 0.05, 0.01)
        r = sync_trial.rate_of(durations, losses)
        slope, se = _hand_rate(durations, losses)
        assert r.points == n
        assert r.per_s == pytest.approx(slope, rel=1e-9, abs=1e-12)
        assert r.stderr == pytest.approx(se, rel=1e-9)


def test_rate_of_refuses_fewer_than_three_points():
    with pytest.raises(ValueError, match="at least 3"):
        sync_trial.rate_of([0.1, 0.1], [1.0, 0.9])


def _hand_z(a1: tuple, b: tuple, a2: tuple) -> tuple[float, float]:
    """(lead, z) of B against A read at B's mean loss: each window is (rate, se, mean loss); A's rate
    is linear in the loss between its two windows, the weight held to [0, 1]."""
    w = min(1.0, max(0.0, (a1[2] - b[2]) / (a1[2] - a2[2])))
    r_a = (1 - w) * a1[0] + w * a2[0]
    se_a = math.sqrt(((1 - w) * a1[1]) ** 2 + (w * a2[1]) ** 2)
    return b[0] - r_a, (b[0] - r_a) / math.sqrt(b[1] ** 2 + se_a ** 2)


def _chained(rng: random.Random, rates: tuple[float, float, float], noise: float) -> list[tuple]:
    """Three windows of one run, each starting at the loss the one before ended at."""
    out, level = [], 5.0
    for rate, step_s in zip(rates, (0.3, 0.1, 0.3)):
        durations, losses = _noisy_window(rng, 20, step_s, rate, noise, start=level)
        level -= rate * sum(durations)
        out.append((durations, losses))
    return out


@pytest.mark.parametrize("order, sign, middle, bracket", [
    (sync_trial.PER_STEP_FIRST, 1, "challenger", "incumbent"), (sync_trial.DILOCO_FIRST, -1, "incumbent", "challenger")])
def test_verdict_matches_the_hand_z_on_noisy_windows(order, sign, middle, bracket):
    """The hand z is the middle window's lead over the bracket read at its loss. Per-step first the
    middle is DiLoCo, so the verdict's z (DiLoCo's lead) is the hand z; DiLoCo first, its negative."""
    rng = random.Random(11)
    seen = set()
    for i in range(60):
        lead = (-0.02, 0.0, 0.002, 0.005, 0.02)[i % 5]
        windows = _chained(rng, (0.06, 0.05 + lead, 0.04), 0.01)
        hand = [(*_hand_rate(*w), statistics.fmean(w[1])) for w in windows]
        want_lead, z = _hand_z(*hand)
        v = sync_trial.verdict(*(sync_trial.rate_of(*w) for w in windows), threshold=2.0, order=order)
        assert v.z == pytest.approx(sign * z, rel=1e-7)
        assert v.lead_per_s == pytest.approx(sign * want_lead, rel=1e-7, abs=1e-12)
        assert v.winner == (middle if z >= 2.0 else bracket if z <= -2.0 else None)
        seen.add(v.winner)
    assert seen == {"challenger", "incumbent", None}  # every outcome exercised
    with pytest.raises(ValueError, match="order is one of"):
        sync_trial.verdict(*(sync_trial.rate_of(*w) for w in windows), threshold=2.0, order="aba")


def test_verdict_threshold_is_inclusive_both_ways():
    flat = Rate(1.0, 0.0, 20, 3.0)
    b_at = 2.5  # B's mean loss between A's two windows' (3.0 and 2.0): the weight is 1/2
    # z = (2 − 1) / 0.5 = 2 exactly: the challenger wins at the threshold
    assert sync_trial.verdict(flat, Rate(2.0, 0.5, 20, b_at), Rate(1.0, 0.0, 20, 2.0), 2.0).winner == "challenger"
    assert sync_trial.verdict(flat, Rate(2.0, 0.5, 20, b_at), Rate(1.0, 0.0, 20, 2.0), 2.0 + 1e-9).winner is None
    assert sync_trial.verdict(flat, Rate(0.0, 0.5, 20, b_at), Rate(1.0, 0.0, 20, 2.0), 2.0).winner == "incumbent"
    # halfway: se_A = sqrt((0.6/2)² + (0.8/2)²) = 0.5, A's rate 1.5, z = 0.5 / sqrt(0.25 + 0.25)
    v = sync_trial.verdict(Rate(2.0, 0.6, 20, 3.0), Rate(2.0, 0.5, 20, b_at), Rate(1.0, 0.8, 20, 2.0), 1.0)
    assert v.z == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-12)
    assert v.winner is None
    # B's level outside A's two: the weight is held at the nearer window (never extrapolated)
    assert sync_trial.bracket_rate(Rate(1.0, 0.1, 20, 3.0), Rate(5.0, 0.1, 20, 1.0),
                                     Rate(0.5, 0.1, 20, 2.0)).per_s == 0.5
    # no progress between A's windows: no level to read, the two rates' mean
    assert sync_trial.bracket_rate(Rate(1.0, 0.1, 20, 3.0), Rate(5.0, 0.1, 20, 1.0),
                                     Rate(0.5, 0.1, 20, 3.0)).per_s == 0.75


def test_steepened_is_the_third_window_ahead_of_the_first_by_the_threshold():
    """The bracketing family's third window 1.0 ahead of its first, whose rates have standard errors 0.3
    and 0.4 (0.5 for the difference): exactly two standard errors, steepened; a hair less, not; behind,
    never. keeper: the bracketing family."""
    first = Rate(1.0, 0.3, 20, 3.0)
    assert sync_trial.steepened(first, Rate(2.0, 0.4, 20, 1.0), 2.0)
    assert not sync_trial.steepened(first, Rate(2.0 - 1e-9, 0.4, 20, 1.0), 2.0)
    assert not sync_trial.steepened(first, Rate(0.2, 0.4, 20, 1.0), 2.0)
    per, dil = sync_trial.PER_STEP_FIRST, sync_trial.DILOCO_FIRST
    assert (sync_trial.keeper(per), sync_trial.keeper(dil)) == ("incumbent", "challenger")


def test_on_a_steepened_curve_the_middle_window_is_judged_against_the_third_alone():
    """The windows of an `mlp` trial (DiLoCo first): DiLoCo removed 0.0259 ± 0.0014 loss/s on a plateau
    at loss 2.164, the per-step method 0.0853 ± 0.0016 at 1.618 as the loss began to fall, DiLoCo
    0.1004 ± 0.0019 at 0.81. Read between DiLoCo's windows at 1.618, DiLoCo trails; against its third
    window alone, DiLoCo leads by (0.1004 − 0.0853) / √(0.0016² + 0.0019²) standard errors (by hand)."""
    first, middle, last = Rate(0.0259, 0.0014, 138, 2.164), Rate(0.0853, 0.0016, 150, 1.618), Rate(0.1004, 0.0019, 150, 0.81)
    v = sync_trial.verdict(first, middle, last, 2.0, sync_trial.DILOCO_FIRST)
    z = (0.1004 - 0.0853) / math.sqrt(0.0016 ** 2 + 0.0019 ** 2)
    assert v.z == pytest.approx(z, rel=1e-9) and v.winner == "challenger"
    assert sync_trial.bracket_for(first, middle, last, 2.0) is last
    interpolated = sync_trial.bracket_rate(first, middle, last)
    assert interpolated.per_s < middle.per_s  # what the at-level reading said: the per-step method ahead
    # on a flattening curve (the third window slower than the first) the at-level reading stands
    flat_last = Rate(0.02, 0.0019, 150, 0.81)
    assert sync_trial.bracket_for(first, middle, flat_last, 2.0) == sync_trial.bracket_rate(first, middle, flat_last)


def test_a_window_records_its_later_rounds_rate():
    """Loss 5 − 0.02·t² over 30 steps of 0.2 s (rounds of 10): the later rounds' rate (``recent``, which
    a per-step window closing early is compared with) is the hand rate of steps 10-29, above the whole
    window's; on 5 − 0.5·t, equal to it within the noise."""
    for curve, steep in ((lambda t: 5.0 - 0.02 * t * t, True), (lambda t: 5.0 - 0.5 * t, False)):
        rng = random.Random(1)
        tr = Trial(challenger="diloco10", start_step=0, window=30, incumbent="ddp", beta_s_per_byte=4e-7,
                   round_steps=10)
        times = [0.2 * (i + 1) for i in range(30)]
        losses = [curve(t) + rng.gauss(0.0, 0.001) for t in times]
        for v in losses:
            tr.add(0.2, v)
        tr.close_window()
        assert tr.recent["per_s"] == pytest.approx(_hand_rate([0.2] * 20, losses[10:])[0], rel=1e-9)
        first, recent = sync_trial.rates_so_far(tr)[0], sync_trial.rate_record(tr.recent)
        assert (recent.per_s - first.per_s > 2.0 * recent.stderr) is steep


def test_first_family_is_diloco_from_lead_times_its_step():
    dil, per = sync_trial.DILOCO_FIRST, sync_trial.PER_STEP_FIRST
    assert sync_trial.first_family(4.0, 1.0, 4.0) == dil
    assert sync_trial.first_family(4.0 * (1 - 1e-12), 1.0, 4.0) == per
    assert sync_trial.first_family(100.0, 1.0, 0.0) == per  # 0: never DiLoCo first
    assert sync_trial.first_family(100.0, 0.0, 4.0) == per  # no DiLoCo prediction
    rng = random.Random(2)
    for _ in range(200):
        d, c, lead = rng.uniform(0.01, 5), rng.uniform(0.01, 1), rng.choice([0.0, 1.0, 2.5, 4.0])
        assert sync_trial.first_family(d, c, lead) == (dil if lead and d >= lead * c else per)


# A noise-free loss that approaches its floor exponentially: L = L∞ + c·exp(−τ/T), so the rate at
# any loss is (L − L∞)/T: linear in the loss. A method k times as fast runs on the time scale T/k.
L_INF, C0, T_A, STEP_S, N = 2.0, 3.0, 10.6, 0.5, 20  # the slope falls about 17x over the trial


def _exponential_trial(speed_b: float) -> tuple[Rate, Rate, Rate]:
    """A, B, A on one run: each window starts at the loss the one before ended at."""
    windows, level = [], L_INF + C0
    for speed in (1.0, speed_b, 1.0):
        times = [STEP_S * (i + 1) for i in range(N)]
        losses = [L_INF + (level - L_INF) * math.exp(-t * speed / T_A) for t in times]
        windows.append(sync_trial.rate_of([STEP_S] * N, losses))
        level = losses[-1]
    return windows[0], windows[1], windows[2]


def test_reading_a_at_b_loss_is_exact_on_an_exponential_curve_where_the_time_bracket_favours_a():
    """One method three times: the truth is no lead. Every window's least-squares slope is the same
    multiple of its (mean loss − L∞), so A's rate read at B's loss is B's own, to rounding; the time
    bracket (the mean of A's two rates) overstates A by half, the curve's convexity."""
    a1, b, a2 = _exponential_trial(1.0)
    assert a1.per_s / a2.per_s > 6  # the slope falls steeply across the trial
    assert sync_trial.verdict(a1, b, a2, 2.0).lead_per_s == pytest.approx(0.0, abs=1e-12)
    assert (a1.per_s + a2.per_s) / 2 > 1.4 * b.per_s  # the time bracket would call B much slower


def test_a_faster_challenger_wins_at_its_loss_where_the_time_bracket_would_keep_a():
    """B 1.5x as fast at every loss: A's rate read at B's mean loss is (L̄_B − L∞)/T up to the window's
    least-squares factor, B's is 1.5 times that; the mean of A's two rates is above B's."""
    a1, b, a2 = _exponential_trial(1.5)
    inc = sync_trial.bracket_rate(a1, b, a2)
    assert b.per_s / inc.per_s == pytest.approx(1.5, rel=0.05)
    assert sync_trial.verdict(a1, b, a2, 2.0).winner == "challenger"
    assert (a1.per_s + a2.per_s) / 2 > b.per_s


def test_on_a_quadratic_curve_the_reading_at_b_loss_is_within_a_percent():
    """L = C − A·τ + Q·τ² (the slope linear in time, where the time bracket is exact): the rate at a
    loss is √(A² − 4Q(C − L)), concave in L, so the linear reading errs low, by under 1 % here."""
    c, a, q = 6.0, 0.04, 0.0002
    windows, start = [], 0.0
    for _ in PHASES:
        times = [start + STEP_S * (i + 1) for i in range(N)]
        windows.append(sync_trial.rate_of([STEP_S] * N, [c - a * t + q * t * t for t in times]))
        start = times[-1]
    a1, b, a2 = windows
    inc = sync_trial.bracket_rate(a1, b, a2)
    assert math.sqrt(a * a - 4 * q * (c - b.level)) == pytest.approx(b.per_s, rel=2e-3)  # the curve's rate there
    assert 0 < (b.per_s - inc.per_s) / b.per_s < 0.01


def test_diloco_first_on_an_exponential_curve_keeps_the_faster_diloco():
    """DiLoCo 1.5x as fast at every loss, run first and last: read at the per-step window's loss,
    DiLoCo's bracket is 1.5 times the per-step rate and wins; the same method three times is a tie."""
    windows, level = [], L_INF + C0
    for speed in (1.5, 1.0, 1.5):
        times = [STEP_S * (i + 1) for i in range(N)]
        losses = [L_INF + (level - L_INF) * math.exp(-t * speed / T_A) for t in times]
        windows.append(sync_trial.rate_of([STEP_S] * N, losses))
        level = losses[-1]
    b1, a, b2 = windows
    assert sync_trial.bracket_rate(b1, a, b2).per_s / a.per_s == pytest.approx(1.5, rel=0.05)
    assert sync_trial.verdict(b1, a, b2, 2.0, sync_trial.DILOCO_FIRST).winner == "challenger"
    a1, b, a2 = _exponential_trial(1.0)
    assert sync_trial.verdict(a1, b, a2, 2.0, sync_trial.DILOCO_FIRST).lead_per_s == pytest.approx(0.0, abs=1e-12)


def test_verdict_calls_the_same_method_a_tie_under_drift():
    """One method three times on the exponential curve with a little noise: no difference found,
    where comparing B with A's earlier window alone would call B slower."""
    rng = random.Random(5)
    clean = [list(w) for w in _exponential_windows()]
    noisy = [(d, [v + rng.gauss(0.0, 0.002) for v in losses]) for d, losses in clean]
    rates = [sync_trial.rate_of(*x) for x in noisy]
    hand = [(*_hand_rate(*x), statistics.fmean(x[1])) for x in noisy]
    v = sync_trial.verdict(*rates, threshold=2.0)
    assert v.z == pytest.approx(_hand_z(*hand)[1], rel=1e-7)
    assert abs(v.z) < 2.0 and v.winner is None
    naive = (hand[1][0] - hand[0][0]) / math.hypot(hand[0][1], hand[1][1])
    assert naive <= -2.0  # the drift alone would have judged B the slower


def _exponential_windows() -> list[tuple[list[float], list[float]]]:
    out, level = [], L_INF + C0
    for _ in PHASES:
        times = [STEP_S * (i + 1) for i in range(N)]
        losses = [L_INF + (level - L_INF) * math.exp(-t / T_A) for t in times]
        out.append(([STEP_S] * N, losses))
        level = losses[-1]
    return out


# ---------------------------------------------------------------- leaving DiLoCo, retrying a trial
def test_link_moved_edges():
    assert sync_trial.link_moved(2.0, 1.0, 2.0) and sync_trial.link_moved(0.5, 1.0, 2.0)
    assert not sync_trial.link_moved(1.99, 1.0, 2.0) and not sync_trial.link_moved(0.51, 1.0, 2.0)
    assert sync_trial.link_moved(30.0, 1.0, 2.0) and sync_trial.link_moved(0.01, 1.0, 2.0)
    assert not sync_trial.link_moved(100.0, 1.0, 0.0)  # severe 0: never
    assert not sync_trial.link_moved(1.0, 0.0, 2.0)  # no prediction to compare with
    assert not sync_trial.link_moved(float("nan"), 1.0, 2.0)
    assert not sync_trial.link_moved(float("inf"), 1.0, 2.0)


def _lost(end_step: int = 100, beta: float = 4e-7, winner: str = "incumbent") -> dict:
    return {"end_step": end_step, "winner": winner, "beta_s_per_byte": beta}


def test_may_retry():
    beta = 4e-7
    assert sync_trial.may_retry(0, None, beta, 0, 2.0)  # never tried
    assert sync_trial.may_retry(101, _lost(winner="challenger"), beta, 0, 2.0)  # DiLoCo won: may come back
    assert not sync_trial.may_retry(10_000, _lost(), beta, 0, 2.0)  # same link, no retry interval
    # an aborted trial (a per-step re-decision, or a non-finite per-step loss) judged nothing: no lost
    # trial stands, so the gate may try again on the same link
    assert sync_trial.may_retry(101, _lost(winner="aborted"), beta, 0, 2.0)
    assert not sync_trial.may_retry(149, _lost(), beta, 50, 2.0)
    assert sync_trial.may_retry(150, _lost(), beta, 50, 2.0)
    assert sync_trial.may_retry(101, _lost(), 2 * beta, 0, 2.0)  # a link half as fast
    assert sync_trial.may_retry(101, _lost(), beta / 2, 0, 2.0)  # twice as fast
    assert not sync_trial.may_retry(101, _lost(), 1.9 * beta, 0, 2.0)
    assert not sync_trial.may_retry(101, _lost(), beta / 1.9, 0, 2.0)
    assert not sync_trial.may_retry(101, _lost(), 10 * beta, 0, 0.0)  # severe 0: β never counts as moved
    assert not sync_trial.may_retry(101, _lost(beta=0.0), beta, 0, 2.0)  # no β recorded


# ---------------------------------------------------------------- the Trial record
def _trial(window: int = 4) -> Trial:
    return Trial(challenger="diloco10", start_step=7, window=window, incumbent="ddp", beta_s_per_byte=4e-7)


def test_trial_windows_close_in_phase_order():
    tr, rng = _trial(), random.Random(1)
    feeds = []
    for k, name in enumerate(PHASES):
        assert tr.phase == k and tr.phase_name == name
        for i in range(tr.window):
            d, loss = 0.1 * (k + 1) + 0.001 * i, 5.0 - 0.1 * (i + 4 * k) + rng.gauss(0, 0.01)
            feeds.append((d, loss))
            assert tr.add(d, loss) == (i == tr.window - 1)
        window = feeds[-tr.window:]
        assert tr.durations == [d for d, _ in window] and tr.losses == [v for _, v in window]
        r = tr.close_window()
        assert tr.durations == [] and tr.losses == [] and len(tr.rates) == k + 1
        slope, se = _hand_rate([d for d, _ in window], [v for _, v in window])
        assert r.per_s == pytest.approx(slope, rel=1e-9) and r.stderr == pytest.approx(se, rel=1e-9)
        assert tr.rates[-1]["phase"] == name
        assert tr.rates[-1]["seconds"] == pytest.approx(sum(d for d, _ in window))
        assert (tr.rates[-1]["per_s"], tr.rates[-1]["stderr"], tr.rates[-1]["points"]) == (r.per_s, r.stderr, 4)
    assert [x["phase"] for x in tr.rates] == ["incumbent_before", "diloco", "incumbent_after"]
    got = sync_trial.rates(tr)
    assert [g.per_s for g in got] == [x["per_s"] for x in tr.rates]


def test_rates_refuses_an_unfinished_trial():
    tr = _trial(window=3)
    for k in range(2):
        for i in range(3):
            tr.add(0.1, 1.0 - 0.1 * i - k + 0.001 * (i % 2))
        tr.close_window()
        with pytest.raises(ValueError, match=f"{k + 1} finished windows of 3"):
            sync_trial.rates(tr)


def test_a_diloco_first_trial_names_its_windows_and_families():
    tr = Trial(challenger="diloco10", start_step=7, window=3, incumbent="ddp", beta_s_per_byte=4e-7,
               order=sync_trial.DILOCO_FIRST)
    seen = []
    for k in range(3):
        seen.append((tr.phase_name, tr.in_diloco))
        for i in range(3):
            tr.add(0.1, 2.0 - 0.1 * (i + 3 * k) + 0.001 * (i == 1))
        tr.close_window()
    assert seen == [("diloco_before", True), ("incumbent", False), ("diloco_after", True)]
    assert [x["phase"] for x in tr.rates] == ["diloco_before", "incumbent", "diloco_after"]
    assert Trial.from_dict(json.loads(json.dumps(tr.as_dict()))) == tr
    old = _trial().as_dict()
    del old["order"]  # a trial checkpointed before the order was kept ran per-step first
    assert Trial.from_dict(old).order == sync_trial.PER_STEP_FIRST and not Trial.from_dict(old).in_diloco


def _hand_trails(recent: tuple[float, float], middle: tuple[float, float], threshold: float = 2.0) -> bool:
    """DiLoCo's recent rate leads the middle one's by ``threshold`` standard errors of the difference."""
    return (recent[0] - middle[0]) / math.hypot(recent[1], middle[1]) >= threshold


def test_only_the_per_step_window_between_dilocos_closes_early_by_the_hand_rule():
    """DiLoCo first: the middle window may close after 20 steps, at the first step where, by hand, it
    trails DiLoCo's first window without its first round, or (after a round's 25 steps) its standard
    error is at most the first window's; no other window, nor per-step first. Every window here
    removes the same loss per second, so the precision rule is the one that fires."""
    rng = random.Random(4)
    for order in (sync_trial.DILOCO_FIRST, sync_trial.PER_STEP_FIRST):
        tr = Trial(challenger="diloco10", start_step=0, window=80, incumbent="ddp", beta_s_per_byte=4e-7, order=order,
                   round_steps=25)
        feeds, first = [], None
        for k in range(3):
            for i in range(80):
                loss = 5.0 - 0.01 * (i + 80 * k) + rng.gauss(0.0, 0.01 if k != 1 else 0.003)  # a quieter middle
                feeds.append((0.1, loss))
                full = tr.add(0.1, loss)
                n = len(tr.durations)
                mid = _hand_rate(*zip(*feeds[-n:])) if k == 1 and n >= 3 else None
                want = k == 1 and order == sync_trial.DILOCO_FIRST and 20 <= n < 80 and (
                    _hand_trails(_hand_rate(*zip(*first[25:])), mid)
                    or (n >= 25 and mid[1] <= tr.rates[0]["stderr"]))
                assert tr.closes_early(2.0) == want, (order, k, n)
                if full or want:
                    break
            first = first or feeds[:]
            tr.close_window()
            if order == sync_trial.DILOCO_FIRST and k == 1:
                assert 25 <= tr.rates[1]["points"] < 80  # it did close early, on this noise, by precision
        assert [r["points"] for r in tr.rates][::2] == [80, 80]
    short = Trial(challenger="diloco10", start_step=0, window=80, incumbent="ddp", beta_s_per_byte=4e-7,
                  order=sync_trial.DILOCO_FIRST, phase=1, rates=[{"per_s": 0.0, "stderr": 1.0, "points": 80}],
                  round_steps=5)
    for i in range(sync_trial.MIN_BALANCED_POINTS):  # a huge first error, yet never before 20 points
        short.add(0.3, 1.0 - 0.01 * i)
        assert short.closes_early(2.0) == (i + 1 >= sync_trial.MIN_BALANCED_POINTS)


def test_a_per_step_window_that_trails_dilocos_recent_rounds_closes_at_the_hand_step():
    """A per-step window whose loss rises (as after taking a compressor up mid-run) closes at the
    first step, from the 20th, where by hand it trails DiLoCo's first window without its first
    round; the recorded recent rate is that hand fit. A per-step window as fast as DiLoCo is not cut
    by the trailing rule, though it trails the whole first window (which ran where the loss fell faster)."""
    for seed in range(5):
        rng = random.Random(seed)
        tr = Trial(challenger="diloco50", start_step=0, window=150, incumbent="lowrank_bf16", beta_s_per_byte=4e-7,
                   order=sync_trial.DILOCO_FIRST, round_steps=50)
        durations = [0.2 * rng.uniform(0.9, 1.1) for _ in range(150)]
        t = list(itertools.accumulate(durations))
        losses = [1.7 + 2.0 * math.exp(-x / 6.0) + rng.gauss(0.0, 0.05) for x in t]  # fast early, slower later
        for d, v in zip(durations, losses):
            tr.add(d, v)
        tr.close_window()
        recent = _hand_rate(durations[50:], losses[50:])
        assert tr.recent["per_s"] == pytest.approx(recent[0], rel=1e-9)
        assert tr.recent["stderr"] == pytest.approx(recent[1], rel=1e-9)
        feeds, closed_at = [], None
        for i in range(150):
            d, loss = 0.25, 1.75 + 0.004 * i + rng.gauss(0.0, 0.05)  # rising
            feeds.append((d, loss))
            tr.add(d, loss)
            want = i + 1 >= 20 and _hand_trails(recent, _hand_rate(*zip(*feeds)))
            assert tr.closes_early(2.0) == want, (seed, i)
            if want:
                closed_at = i + 1
                break
        assert closed_at is not None and closed_at < 50  # before the precision rule could close it
    # as fast as DiLoCo's recent rounds, measured later: the whole first window would call it trailing
    mid_tr = Trial(challenger="diloco50", start_step=0, window=150, incumbent="lowrank_bf16", beta_s_per_byte=4e-7,
                   order=sync_trial.DILOCO_FIRST, round_steps=50)
    for x in (0.2 * (i + 1) for i in range(150)):
        mid_tr.add(0.2, 1.7 + 2.0 * math.exp(-x / 6.0))
    mid_tr.close_window()
    whole, recent = mid_tr.rates[0], mid_tr.recent
    for i in range(20):  # the recent rounds' own slope, continued, with a little noise
        mid_tr.add(0.2, 2.0 - recent["per_s"] * 0.2 * i + 0.001 * (-1) ** i)
    mid = _hand_rate([0.2] * 20, mid_tr.losses)
    assert _hand_trails((whole["per_s"], whole["stderr"]), mid)
    assert not _hand_trails((recent["per_s"], recent["stderr"]), mid)
    assert not mid_tr.closes_early(2.0)


def test_trial_round_trips_through_a_plain_dict():
    tr = _trial(window=3)
    for i in range(3):
        tr.add(0.2, 2.0 - 0.05 * i + 0.001 * (i == 1))
    tr.close_window()
    tr.add(0.05, 1.7)
    d = json.loads(json.dumps(tr.as_dict()))  # what a checkpoint can hold
    back = Trial.from_dict(d)
    assert back == tr
    assert back.phase_name == "diloco" and back.durations == [0.05] and back.rates == tr.rates
    back.add(0.05, 1.6)
    assert tr.durations == [0.05]  # the copy does not share lists with the original
