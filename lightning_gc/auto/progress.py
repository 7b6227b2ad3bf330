"""Progress per second from the training loss: one scale for per-step methods and DiLoCo.

Pure: plain numbers in, a verdict out, so every rank decides the same from the same agreed numbers
(the mean over the ranks of the training loss and of the step time) and the rule is tested without
processes.

**Noise model.** The training loss of step ``t`` is ``ℓ_t = L(τ_t) + ε_t``: ``L`` the expected loss as a
function of training wall time ``τ``, and ``ε_t`` independent, zero-mean minibatch noise whose variance
``σ²`` is constant within a window of steps. Over a short window ``L`` is close to a line, so a
least-squares line through the window's ``(τ, ℓ)`` gives its slope ``b`` with the standard error
``σ̂ / √Σ(τ − τ̄)²``, ``σ̂²`` the residual variance on ``n − 2`` degrees of freedom. The progress rate is
``−b``: loss removed per second of training. For DiLoCo the loss is each rank's local model's, averaged
over the ranks, at every inner step; the outer step's effect lands in the window that contains it.

**Drift.** ``L``'s slope shrinks as training goes on, so a method measured later would look slower.
Trials therefore run A, B, A with windows of equal length (A: whichever family the trial brackets
with), A's two bracketing B's, and A's rate is
read where B ran, in one of two ways:

* **at B's loss level** (:func:`at_level`, what auto's family trial uses): the question "which
  method reaches a lower loss sooner" is a question about each method's rate *at the loss the run
  is at*, so A's rate is interpolated linearly in the loss between its two windows' (mean loss,
  rate) points, at B's mean loss. This is exact where the loss approaches its floor exponentially
  (``L = L∞ + c·e^{−τ/T}``: the rate ``(L − L∞)/T`` is linear in ``L``), however far the slope falls
  across the trial; it also serves a B faster than A, whose window ends lower;
* **at B's time** (:func:`bracketed`): the mean of A's two rates, exact where the slope changes
  linearly in time (``L`` quadratic). Early in a run, where the slope falls by a large factor
  within a trial, that mean overstates A at B's time (the slope is convex in time) and so favours A.

**Verdict.** ``z = (r_B − r_A) / √(se_A² + se_B²)``: B wins when ``z ≥ threshold``, A when
``z ≤ −threshold``, and neither otherwise (keep the incumbent; a longer trial can separate them). With
the default threshold 2 a method no faster than the incumbent replaces it about 2–3 % of the time
under the noise model (one-sided; Student's t on the windows' degrees of freedom). Raise it to
switch less often on noisy losses; lower it to follow smaller gains.

Tuning the windows: the standard error falls as ``σ / (span · √n)``, so longer windows separate
smaller differences; a trial window of a slower challenger costs the progress it falls short by
(:func:`trial_cost`), which the caller bounds and reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: the |z| above which one rate is called faster than the other
DEFAULT_THRESHOLD = 2.0
#: fewest points of a window: a line and a residual variance need 3
MIN_POINTS = 3


@dataclass(frozen=True)
class Rate:
    """Loss removed per second (``per_s``), its standard error, the points behind it, and the window's
    mean loss (``level``; NaN where unknown)."""

    per_s: float
    stderr: float
    points: int
    level: float = math.nan


@dataclass(frozen=True)
class Verdict:
    """Which of two rates is faster (``"incumbent"``, ``"challenger"`` or None: not separable) and the
    z-score of the challenger's lead."""

    winner: str | None
    z: float
    lead_per_s: float


def window_rate(times_s: Sequence[float], losses: Sequence[float]) -> Rate:
    """The progress rate of one window: minus the least-squares slope of loss against training time.

    ``times_s``: cumulative training seconds at each logged step (strictly increasing); ``losses``: the
    loss logged at each."""
    n = len(times_s)
    if n != len(losses) or n < MIN_POINTS:
        raise ValueError(f"window_rate needs as many losses as times and at least {MIN_POINTS} of each; got "
                         f"{n} times and {len(losses)} losses.")
    if any(not (math.isfinite(t) and math.isfinite(v)) for t, v in zip(times_s, losses)):
        raise ValueError("window_rate: times and losses must be finite (a diverged loss is not a progress figure).")
    if any(b <= a for a, b in zip(times_s, times_s[1:])):
        raise ValueError("window_rate: times_s must be strictly increasing cumulative training seconds.")
    t_mean = sum(times_s) / n
    v_mean = sum(losses) / n
    sxx = sum((t - t_mean) ** 2 for t in times_s)
    slope = sum((t - t_mean) * (v - v_mean) for t, v in zip(times_s, losses)) / sxx
    resid = sum((v - v_mean - slope * (t - t_mean)) ** 2 for t, v in zip(times_s, losses))
    return Rate(per_s=-slope, stderr=math.sqrt(resid / (n - 2) / sxx), points=n, level=v_mean)


def bracketed(before: Rate, after: Rate) -> Rate:
    """A's rate at the time of the window between its two windows (ABA; equal window lengths)."""
    return Rate(per_s=(before.per_s + after.per_s) / 2,
                stderr=math.sqrt(before.stderr ** 2 + after.stderr ** 2) / 2,
                points=before.points + after.points)


def at_level(before: Rate, after: Rate, level: float) -> Rate:
    """A's rate at the loss ``level`` (ABA; see the module docstring): linear in the loss between its
    two windows' (level, rate) points, the weight held to [0, 1] (never extrapolated). The standard
    error is the weighted one's, the weight taken as exact. Where the two windows' levels are equal
    or unknown (no progress to read a level from) it is :func:`bracketed`."""
    span = before.level - after.level
    if not (math.isfinite(span) and span != 0.0 and math.isfinite(level)):
        return bracketed(before, after)
    w = min(1.0, max(0.0, (before.level - level) / span))
    return Rate(per_s=(1.0 - w) * before.per_s + w * after.per_s,
                stderr=math.hypot((1.0 - w) * before.stderr, w * after.stderr),
                points=before.points + after.points, level=level)


def compare(incumbent: Rate, challenger: Rate, threshold: float = DEFAULT_THRESHOLD) -> Verdict:
    """The verdict of the module docstring; identical on every rank for identical inputs."""
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold={threshold!r} must be a positive number of standard errors, e.g. 2.0.")
    lead = challenger.per_s - incumbent.per_s
    se = math.hypot(incumbent.stderr, challenger.stderr)
    if se == 0.0:
        z = 0.0 if lead == 0 else math.copysign(math.inf, lead)
    else:
        z = lead / se
    winner = "challenger" if z >= threshold else "incumbent" if z <= -threshold else None
    return Verdict(winner=winner, z=z, lead_per_s=lead)


def trial_cost(window_s: float, incumbent: Rate, challenger: Rate) -> float:
    """What a challenger window of ``window_s`` seconds cost, in seconds of incumbent training: the
    progress it fell short of the incumbent's rate by, over that rate (0 when the challenger was at
    least as fast, or when the incumbent made no progress to lose)."""
    if not (math.isfinite(window_s) and window_s >= 0):
        raise ValueError(f"window_s={window_s!r} must be a finite number of seconds >= 0.")
    if incumbent.per_s <= 0:
        return 0.0
    return window_s * max(0.0, 1.0 - challenger.per_s / incumbent.per_s)


__all__ = ["DEFAULT_THRESHOLD", "MIN_POINTS", "Rate", "Verdict", "at_level", "bracketed", "compare", "trial_cost",
           "window_rate"]
