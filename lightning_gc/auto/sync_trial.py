"""When ``auto`` tries DiLoCo, which configuration it tries, and how the trial is judged. Pure.

Plain numbers in (agreed across ranks by the caller), a decision out; tested without processes.

**Why a trial.** A per-step method and DiLoCo cannot be ranked by step time: DiLoCo's step is
always the shorter (it sends once every H steps) and each of its steps does less for the loss.
Nor by the gradient-error proxy, which is not defined for DiLoCo. They are ranked on one scale,
loss removed per second of training (:mod:`lightning_gc.auto.progress`), measured on the run itself.

**The gate** (:func:`gate_opens`). A trial costs progress when DiLoCo loses, so one is run only
where the link makes exact per-step training expensive: the fastest exact per-step candidate's
predicted step (``ddp``, ``fp16``, ``bf16``: every element sent every step) is at least ``gate``
times DiLoCo's predicted step (:func:`lightning_gc.auto.diloco_cost.predict_diloco`), i.e. the link
takes a large share of a dense step (a third of it at the default 1.5). The running method is not
the yardstick: a lossy compressor (low rank, Top-k) can run as fast per step as DiLoCo and still
make less progress per step, which only the trial shows. On a fast link the gate stays shut and auto
stays per-step at no cost.

**The challenger** (:func:`pick_challenger`): the candidate with the smallest H whose predicted step
is within ``hide`` of compute alone (the exchange amortised out of sight), of equal H the one with
the fewest fragments; where none is, the one with the fastest predicted step. Smaller H keeps the
replicas closer, and fewer fragments drop fewer local steps (a streaming fragment's τ steps are
dropped at its outer step), so this is the least drift that hides the link: Streaming DiLoCo is
tried only where it hides what plain DiLoCo with the same H would leave exposed.

**The trial** (:func:`verdict`): three windows of ``rounds·H`` steps, the family expected to stay
run first and last, the other between (:func:`first_family`). Where a dense step is predicted at
least ``lead`` times DiLoCo's step, DiLoCo brackets the per-step method (``diloco_first``: DiLoCo,
per-step, DiLoCo); otherwise the per-step method brackets DiLoCo (``per_step_first``). The
bracketing family's rate is read at the middle window's mean loss, interpolated between its two
windows (:func:`lightning_gc.auto.progress.at_level`): the flattening of the loss curve across the
trial cancels out, even where the slope falls by a large factor, as it does early in a run (where
the curve steepened instead, its third window: below). A family wins by leading the other by ``threshold`` standard errors; where neither does, the
bracketing family stays. Either order costs about one window of the family that loses; the order
decides who stays where the trial cannot separate them, so the family the link favours brackets.

**A shorter per-step window** (:meth:`Trial.closes_early`). DiLoCo's windows are whole rounds;
the per-step window between two of them needs no such unit, and where DiLoCo leads it is the one
the trial pays for. After :data:`MIN_BALANCED_POINTS` steps it closes as soon as either holds:

* it trails DiLoCo's recent rounds (its first window without the first round) by ``threshold``
  standard errors (:func:`trails`). Taking a compressor up mid-run can have a transient of its own
  (a low-rank one, taken up after DiLoCo or after DDP alike, has raised the loss for tens of
  steps), and a window that has already lost this clearly only adds that cost. DiLoCo's recent
  rounds ran at a higher loss than this window, where rates are larger, so the comparison leans
  towards DiLoCo, the family the link favours in this order; leaving out the first round, where
  early in a run the loss falls fastest, keeps that lean small. What it cuts is this window only:
  the verdict still reads both families at the same loss, with DiLoCo's third window.
* after one round's steps too, its rate's standard error is no larger than DiLoCo's first window's:
  from there on the verdict's error is dominated by DiLoCo's windows, and more per-step steps add
  cost, not precision. This looks at the spread of the losses, never at the rate itself, so it
  does not bias the rate it stops.

**No early win.** The verdict always waits for the third window. Judging after two windows would
compare windows at different losses, which is sound only where the loss curve flattens (the later
window disfavoured), and two windows cannot show that. A curve can also steepen: some tasks sit on a
plateau, then fall steeply. With a plateau in the first window and the fall in the second, the
middle family looked several times faster on `mlp` though it was the slower to the target.

**A steepened curve** (:func:`steepened`): where the bracketing family's third window ran faster than
its first by ``threshold`` standard errors, the loss curve steepened during the trial, and reading
the bracket's rate at the middle window's loss (a line between a plateau and a fall) is not
meaningful. The middle window is then judged against the third alone: the two adjacent windows after
the change. A third window measured later is favoured while the curve still steepens, which leans to
the bracketing family, the one the link favours; on a flattening curve the rule never applies.

**Leaving DiLoCo** (:func:`link_moved`): while DiLoCo runs, each outer exchange's agreed time (the
slowest rank's) is compared with the same fragment's first one after entering (Streaming DiLoCo's
fragments differ in size), a measurement on the link it was
chosen on (not the model's prediction, whose error would read as a move); ``severe`` times slower or
faster means the link moved, and auto goes back to per-step and decides again on a fresh probe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from .progress import MIN_POINTS, Rate, Verdict, at_level, compare, window_rate

#: the per-step method first and last (DiLoCo between): the trial's three windows, in order
PER_STEP_FIRST = "per_step_first"
#: DiLoCo first and last (the per-step method between)
DILOCO_FIRST = "diloco_first"
ORDERS = {PER_STEP_FIRST: ("incumbent_before", "diloco", "incumbent_after"),
          DILOCO_FIRST: ("diloco_before", "incumbent", "diloco_after")}
PHASES = ORDERS[PER_STEP_FIRST]


#: fewest steps before a per-step window between DiLoCo's may close early: the residual variance of
#: fewer is itself too uncertain to stop on (its relative error is about 1/√(2(n − 2)), 17 % at 20)
MIN_BALANCED_POINTS = 20


def gate_opens(dense_step_s: float, challenger_step_s: float, gate: float) -> bool:
    """Whether an exact per-step method's predicted step is at least ``gate`` times DiLoCo's."""
    if not (dense_step_s > 0 and challenger_step_s > 0):
        return False
    return dense_step_s >= gate * challenger_step_s


def first_family(dense_step_s: float, challenger_step_s: float, lead: float) -> str:
    """The trial's order: DiLoCo first where a dense step is predicted at least ``lead`` times DiLoCo's
    (0: never), else the per-step method first."""
    return DILOCO_FIRST if lead and gate_opens(dense_step_s, challenger_step_s, lead) else PER_STEP_FIRST


def pick_challenger(step_s: Mapping[str, float], drift: Mapping[str, tuple[int, int]], compute_s: float,
                    hide: float) -> str:
    """The DiLoCo candidate to try (see the module docstring); ``step_s``: predicted step per candidate,
    in tie-break order; ``drift``: each one's (H, F)."""
    if not step_s:
        raise ValueError("pick_challenger needs at least one DiLoCo candidate.")
    hidden = [n for n, s in step_s.items() if s <= (1.0 + hide) * compute_s]
    if hidden:
        return min(hidden, key=lambda n: drift[n])  # min() keeps the first of equal (H, F)
    return min(step_s, key=lambda n: step_s[n])


def window_steps(inner_steps: int, rounds: int) -> int:
    """Steps in each of the trial's windows: ``rounds`` whole DiLoCo rounds, and enough of them that
    the window keeps the :data:`~lightning_gc.auto.progress.MIN_POINTS` a window's rate needs even when
    its first round is cut to ⌈H/2⌉ steps (:func:`first_round`), i.e. ⌊H/2⌋ short."""
    h = int(inner_steps)
    return h * max(int(rounds), -(-(MIN_POINTS + h // 2) // h))


def first_round(steps_done: int, inner_steps: int) -> int:
    """Inner steps of DiLoCo's first round when it is entered after ``steps_done`` optimizer steps: up
    to the next multiple of H, where a run that started in DiLoCo synchronises, so evaluations,
    checkpoints and logs at multiples of H see a θ_outer just updated, as they would with a static
    DiLoCo. A first round shorter than H/2 is joined to the next, so it has ⌈H/2⌉ to ⌈H/2⌉ + H − 1
    steps: never an exchange for a handful of steps."""
    h = int(inner_steps)
    r = (-int(steps_done)) % h
    return r + h if r < (h + 1) // 2 else r


def ends_round(steps: int, round_steps: int, stretch: int = 0) -> bool:
    """Whether the ``steps``-th step (from 1) of a DiLoCo window ends one of its rounds: the first has
    ``round_steps + stretch`` steps, the later ones ``round_steps``. A record without ``round_steps``
    (0, from before it was kept) ends one every step."""
    if round_steps <= 0:
        return True
    first = round_steps + stretch
    return steps >= first and (steps - first) % round_steps == 0


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


def bracket_rate(first: Rate, middle: Rate, last: Rate) -> Rate:
    """The bracketing family's rate where the middle one ran: at the middle's mean loss, between its two windows."""
    return at_level(first, last, middle.level)


def _families(order: str, bracket: Rate, middle: Rate) -> tuple[Rate, Rate]:
    """(the per-step method's rate, DiLoCo's) from the bracketing family's and the middle one's."""
    if order not in ORDERS:
        raise ValueError(f"a trial's order is one of {sorted(ORDERS)}, not {order!r}.")
    return (bracket, middle) if order == PER_STEP_FIRST else (middle, bracket)


def keeper(order: str) -> str:
    """Who stays where the trial does not separate the two: the bracketing family."""
    return "incumbent" if order == PER_STEP_FIRST else "challenger"


def steepened(first: Rate, last: Rate, threshold: float) -> bool:
    """Whether the bracketing family's ``last`` window removed loss faster than its ``first`` by
    ``threshold`` standard errors of their difference: the curve steepened during the trial."""
    return last.per_s - first.per_s >= threshold * math.hypot(first.stderr, last.stderr)


def bracket_for(first: Rate, middle: Rate, last: Rate, threshold: float) -> Rate:
    """The bracketing family's rate the middle window is judged against (module docstring): read at the
    middle window's loss between its two windows, or its third window alone where the curve steepened."""
    return last if steepened(first, last, threshold) else bracket_rate(first, middle, last)


def verdict(first: Rate, middle: Rate, last: Rate, threshold: float, order: str = PER_STEP_FIRST) -> Verdict:
    """DiLoCo (``"challenger"``) against the per-step method (``"incumbent"``), the middle window against
    :func:`bracket_for`; ``z`` is DiLoCo's lead in standard errors; winner None: not separable."""
    return compare(*_families(order, bracket_for(first, middle, last, threshold), middle), threshold)


def trails(diloco: Rate, middle: Rate, threshold: float) -> bool:
    """Whether the per-step ``middle`` window trails DiLoCo's rate ``diloco`` by ``threshold`` standard errors."""
    return compare(middle, diloco, threshold).winner == "challenger"


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
    """One trial in progress (replicated: every figure in it is agreed)."""

    challenger: str
    start_step: int
    window: int  # steps per window
    incumbent: str
    beta_s_per_byte: float
    phase: int = 0  # index into ORDERS[order]
    durations: list[float] = field(default_factory=list)  # this window's agreed step durations
    losses: list[float] = field(default_factory=list)  # this window's mean losses over the ranks
    rates: list[dict] = field(default_factory=list)  # the finished windows' rates
    order: str = PER_STEP_FIRST  # which family brackets the other (ORDERS)
    round_steps: int = 0  # DiLoCo's H (0 in records from before it was kept)
    recent: dict | None = None  # the first window without its first round (closes_early)
    stretch: int = 0  # steps this DiLoCo window's first round has beyond H (first_round − H; may be < 0)
    nonfinite: bool = False  # a DiLoCo step agreed early (at a checkpoint) had a non-finite loss

    @property
    def phase_name(self) -> str:
        return ORDERS[self.order][self.phase]

    @property
    def in_diloco(self) -> bool:
        """Whether the window now measured is DiLoCo's."""
        return self.phase_name.startswith("diloco")

    def add(self, duration_s: float, loss: float) -> bool:
        """Record one step; returns whether the window is full (then :meth:`close_window`): ``window``
        steps, DiLoCo's with its first round's ``stretch``, so it ends on an outer step."""
        self.durations.append(float(duration_s))
        self.losses.append(float(loss))
        return len(self.durations) >= self.window + self.stretch

    def closes_early(self, threshold: float) -> bool:
        """Whether the window now measured may close before ``window`` steps (module docstring): only
        the per-step window between two of DiLoCo's, after :data:`MIN_BALANCED_POINTS` steps, once it
        trails DiLoCo's recent rounds by ``threshold`` standard errors (:func:`trails`), or, after one
        round's steps too, once its standard error is at most DiLoCo's first window's."""
        n = len(self.durations)
        if self.order != DILOCO_FIRST or self.phase != 1 or n < MIN_BALANCED_POINTS:
            return False
        rate, first = rate_of(self.durations, self.losses), rate_record(self.rates[0])
        recent = rate_record(self.recent) if self.recent is not None else first
        return trails(recent, rate, threshold) or (n >= self.round_steps and rate.stderr <= first.stderr)

    def close_window(self) -> Rate:
        r = rate_of(self.durations, self.losses)
        if self.phase == 0:
            self.recent = asdict(self._later_rounds())
        self.rates.append({"phase": self.phase_name, **asdict(r), "seconds": sum(self.durations)})
        self.durations, self.losses, self.stretch = [], [], 0
        self.phase += 1
        return r

    def _later_rounds(self) -> Rate:
        """This window's rate without its first round (the whole window where that leaves too few points)."""
        k = self.round_steps + self.stretch
        k = k if len(self.durations) - k >= MIN_POINTS else 0
        return rate_of(self.durations[k:], self.losses[k:])

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Trial:
        return cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items()})


def rates_so_far(trial: Trial) -> list[Rate]:
    """The finished windows' rates, in the trial's order."""
    return [rate_record(r) for r in trial.rates]


def rates(trial: Trial) -> tuple[Rate, Rate, Rate]:
    """The three finished windows' rates, in the trial's order."""
    if len(trial.rates) != 3:
        raise ValueError(f"the trial has {len(trial.rates)} finished windows of 3.")
    return tuple(rates_so_far(trial))  # type: ignore[return-value]


def rate_record(r: Mapping) -> Rate:
    """A finished window's rate from its record (``level`` NaN in records written before it was kept)."""
    return Rate(r["per_s"], r["stderr"], r["points"], r.get("level", math.nan))


__all__ = ["DILOCO_FIRST", "MIN_BALANCED_POINTS", "ORDERS", "PER_STEP_FIRST", "PHASES", "Trial", "bracket_rate", "cumulative",
           "ends_round", "first_family", "first_round", "gate_opens", "keeper", "link_moved", "may_retry", "pick_challenger",
           "rate_of", "rate_record", "rates", "rates_so_far", "steepened", "bracket_for", "trails", "verdict",
           "window_steps"]
