"""When ``auto`` tries DiLoCo, which configuration it tries, and how the trial is judged. Pure.

Plain numbers in (agreed across ranks by the caller), a decision out; tested without processes.

**Why a trial.** A per-step method and DiLoCo cannot be ranked by step time: DiLoCo's step is
always the shorter (it sends once every H steps) and each of its steps does less for the loss.
Nor by the gradient-error proxy, which is not defined for DiLoCo. They are ranked on one scale,
loss removed per second of training (:mod:`lightning_gc.auto.progress`), measured on the run itself.

**The gate** (:func:`gate_opens`). A trial costs progress when DiLoCo loses, so one is run only where
the link makes exact per-step training expensive: the fastest exact per-step candidate's predicted
step (``ddp``, ``fp16``, ``bf16``: every element sent every step) is at least ``gate`` times
DiLoCo's predicted step (:func:`lightning_gc.auto.diloco_cost.predict_diloco`), i.e. a dense step
spends most of its time on the link. The running method is not the yardstick: a lossy compressor
(low rank, Top-k) can run as fast per step as DiLoCo and still make less progress per step, which
only the trial shows. On a fast link the gate stays shut and auto stays per-step at no cost.

**The challenger** (:func:`pick_challenger`): the candidate with the smallest H whose predicted step
is within ``hide`` of compute alone (the exchange amortised out of sight); where none is, the one
with the fastest predicted step. Smaller H keeps the replicas closer, so this is the least drift
that hides the link.

**The trial** (ABA, :func:`verdict`): ``rounds·H`` steps of the incumbent (A), as many of DiLoCo
(B), as many of the incumbent again. A's rate is read at B's mean loss, interpolated between its
two windows, which bracket B's (:func:`lightning_gc.auto.progress.at_level`): the flattening of the
loss curve across the trial cancels out, even where the slope falls by a large factor, as it does
early in a run. DiLoCo wins when its rate leads by ``threshold`` standard errors; otherwise the
incumbent stays.

**Winning early** (:func:`wins_early`): where DiLoCo's window already leads the incumbent's first
window by ``threshold`` standard errors, it wins without the second incumbent window. A loss curve
flattens as training goes on, so a window measured later looks slower: B after A is biased against
B, and a lead it shows despite that is a lead the bracket would show too. A trial DiLoCo wins
early costs no second switch and one window less.

**Leaving DiLoCo** (:func:`link_moved`): while DiLoCo runs, each outer exchange's agreed time (the
slowest rank's) is compared with the first one's after entering, a measurement on the link it was
chosen on (not the model's prediction, whose error would read as a move); ``severe`` times slower or
faster means the link moved, and auto goes back to per-step and decides again on a fresh probe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from .progress import MIN_POINTS, Rate, Verdict, at_level, compare, window_rate

#: the trial's three windows, in order
PHASES = ("incumbent_before", "diloco", "incumbent_after")


def gate_opens(dense_step_s: float, challenger_step_s: float, gate: float) -> bool:
    """Whether an exact per-step method's predicted step is at least ``gate`` times DiLoCo's."""
    if not (dense_step_s > 0 and challenger_step_s > 0):
        return False
    return dense_step_s >= gate * challenger_step_s


def pick_challenger(step_s: Mapping[str, float], inner_steps: Mapping[str, int], compute_s: float,
                    hide: float) -> str:
    """The DiLoCo candidate to try (see the module docstring); ``step_s``: predicted step per candidate,
    in tie-break order; ``inner_steps``: each one's H."""
    if not step_s:
        raise ValueError("pick_challenger needs at least one DiLoCo candidate.")
    hidden = [n for n, s in step_s.items() if s <= (1.0 + hide) * compute_s]
    if hidden:
        return min(hidden, key=lambda n: inner_steps[n])  # min() keeps the first of equal H
    return min(step_s, key=lambda n: step_s[n])


def window_steps(inner_steps: int, rounds: int) -> int:
    """Steps in each of the trial's windows: ``rounds`` whole DiLoCo rounds, and at least the
    :data:`~lightning_gc.auto.progress.MIN_POINTS` a window's rate needs."""
    h = int(inner_steps)
    return h * max(int(rounds), -(-MIN_POINTS // h))


def cumulative(durations_s: Sequence[float]) -> list[float]:
    """Training seconds at the end of each step, from each step's duration."""
    out, t = [], 0.0
    for d in durations_s:
        t += float(d)
        out.append(t)
    return out


def rate_of(durations_s: Sequence[float], losses: Sequence[float]) -> Rate:
    """A window's progress rate (:func:`lightning_gc.auto.progress.window_rate`) from its steps'
    agreed durations and mean losses."""
    return window_rate(cumulative(durations_s), losses)


def incumbent_rate(before: Rate, diloco: Rate, after: Rate) -> Rate:
    """The incumbent's rate where DiLoCo ran: at DiLoCo's mean loss, between its two windows."""
    return at_level(before, after, diloco.level)


def verdict(before: Rate, diloco: Rate, after: Rate, threshold: float) -> Verdict:
    """DiLoCo (``"challenger"``) against the incumbent bracketing it (``"incumbent"``); None: not separable."""
    return compare(incumbent_rate(before, diloco, after), diloco, threshold)


def wins_early(before: Rate, diloco: Rate, threshold: float) -> Verdict | None:
    """The verdict where DiLoCo's window leads the incumbent's first by ``threshold`` standard errors
    (see the module docstring: the later window is the one the flattening curve disfavours); else None."""
    v = compare(before, diloco, threshold)
    return v if v.winner == "challenger" else None


def link_moved(measured_s: float, predicted_s: float, severe: float) -> bool:
    """Whether an outer exchange took ``severe`` times longer or shorter than predicted (0: never)."""
    if not severe or not (predicted_s > 0) or not math.isfinite(measured_s):
        return False
    ratio = measured_s / predicted_s
    return ratio >= severe or ratio <= 1.0 / severe


def may_retry(step: int, last: Mapping | None, beta_s_per_byte: float, retry_every: int, severe: float) -> bool:
    """Whether a trial may run again after ``last`` (the previous trial's record, None: never tried;
    after a trial DiLoCo won, always: it left on a moved link, and may pay again on another; after an
    aborted one, always: it judged nothing, so no lost trial stands). After a lost trial: after
    ``retry_every`` steps (0: never on time alone), or at once where the link's β moved by ``severe``
    times either way since it ran (a new link is a new question)."""
    if last is None or last.get("winner") in ("challenger", "aborted"):
        return True
    if retry_every and step - int(last["end_step"]) >= retry_every:
        return True
    beta = float(last["beta_s_per_byte"])
    return link_moved(beta_s_per_byte, beta, severe) if beta > 0 else False


@dataclass
class Trial:
    """One ABA trial in progress (replicated: every figure in it is agreed)."""

    challenger: str
    start_step: int
    window: int  # steps per window
    incumbent: str
    beta_s_per_byte: float
    phase: int = 0  # index into PHASES
    durations: list[float] = field(default_factory=list)  # this window's agreed step durations
    losses: list[float] = field(default_factory=list)  # this window's mean losses over the ranks
    rates: list[dict] = field(default_factory=list)  # the finished windows' rates

    @property
    def phase_name(self) -> str:
        return PHASES[self.phase]

    def add(self, duration_s: float, loss: float) -> bool:
        """Record one step; returns whether the window is full (then :meth:`close_window`)."""
        self.durations.append(float(duration_s))
        self.losses.append(float(loss))
        return len(self.durations) >= self.window

    def close_window(self) -> Rate:
        r = rate_of(self.durations, self.losses)
        self.rates.append({"phase": self.phase_name, **asdict(r), "seconds": sum(self.durations)})
        self.durations, self.losses = [], []
        self.phase += 1
        return r

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Trial:
        return cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items()})


def rates_so_far(trial: Trial) -> list[Rate]:
    """The finished windows' rates, in PHASES order."""
    return [_rate(r) for r in trial.rates]


def rates(trial: Trial) -> tuple[Rate, Rate, Rate]:
    """The three finished windows' rates, in PHASES order."""
    if len(trial.rates) != len(PHASES):
        raise ValueError(f"the trial has {len(trial.rates)} finished windows of {len(PHASES)}.")
    return tuple(rates_so_far(trial))  # type: ignore[return-value]


def _rate(r: Mapping) -> Rate:
    """A finished window's rate from its record (``level`` NaN in records written before it was kept)."""
    return Rate(r["per_s"], r["stderr"], r["points"], r.get("level", math.nan))


__all__ = ["PHASES", "Trial", "cumulative", "gate_opens", "incumbent_rate", "link_moved", "may_retry",
           "pick_challenger", "rate_of", "rates", "rates_so_far", "verdict", "window_steps", "wins_early"]
