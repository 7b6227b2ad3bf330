"""Step walls for auto: each step's wall time, the walls agreed across ranks, and the windows' medians.

A step's wall runs from the end of the step before to the end of this one (as the bench counts it),
less time the strategy marks as not training (:meth:`StepWalls.pause` / :meth:`StepWalls.resume`
around validation). Each rank's wall is agreed (the mean over ranks) without a collective of its own:
it rides in the next step's messages (``GCEngine.carry_wall``), or, under a dense mode on a group
that takes the direct exchange, is agreed at once by one direct exchange so a link that fell during
a dense step is seen at that step's end. The drift tests (:mod:`lightning_gc.auto.drift`) read the
agreed walls kept here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

#: reads a carried wall's mean over the ranks at the next step's end (None where it was lost)
WallReader = Callable[[], "float | None"]


class StepWalls:
    """This rank's step timing and the agreed walls (see the module docstring)."""

    def __init__(self) -> None:
        self.stamps: dict[int, float] = {}  # each gradient's readiness in backward (parameter index -> time)
        self.t_start = self.t_fwd = self.t_closure_end = 0.0
        self.t_prev_end: float | None = None
        self.t_paused: float | None = None
        self.measured: list[float] = []  # this rank's walls since the first decision
        self.window: list[float] = []  # this rank's walls of the current window
        #: agreed walls for the every-step tests (the oldest first), the step of the newest, and the last
        #: step's wall still to be read (its step, its reader)
        self.recent: list[float] = []
        self.recent_step: int | None = None
        self.pending: tuple[int, WallReader] | None = None
        #: steps whose wall may hold time that is not a training step's (an epoch's first, a checkpoint)
        self.marked: set[int] = set()
        #: the agreed walls read so far (step -> mean over ranks, None where lost), the last few windows'
        self.carried: dict[int, float | None] = {}
        #: a compressed method's agreed exchange times of the last steps, and of the current window
        self.recent_exchange: list[float] = []
        self.window_exchange: list[float] = []

    # ------------------------------------------------------------------ this rank's clock
    def begin(self) -> None:
        self.stamps = {}
        self.t_start = self.t_fwd = time.perf_counter()

    def end_step(self) -> tuple[float, float | None]:
        """The step's end time and wall (None on the first step, or the first after a resume)."""
        t_end = time.perf_counter()
        wall = None if self.t_prev_end is None else t_end - self.t_prev_end
        self.t_prev_end = t_end
        return t_end, wall

    def restart(self) -> None:
        """Time spent between steps since the step's end (a measurement, a decision) is not a step's."""
        self.t_prev_end = time.perf_counter()

    def pause(self) -> None:
        self.t_paused = time.perf_counter()

    def resume(self) -> None:
        if self.t_paused is not None and self.t_prev_end is not None:
            self.t_prev_end += time.perf_counter() - self.t_paused
        self.t_paused = None

    # ------------------------------------------------------------------ agreed walls
    def read_pending(self, last_decision: int | None, severe_steps: int, window: int) -> None:
        """Read the wall still pending into :attr:`carried` and, unless it is the last decision's step or
        the switch's first step, into :attr:`recent`. Idempotent within a step."""
        if self.pending is None:
            return
        at, read = self.pending
        self.pending = None
        value = read()
        self.carried[at] = value
        for old in [k for k in self.carried if k < at - 4 * max(window, 1)]:
            del self.carried[old]
        last = last_decision if last_decision is not None else -10**9
        if severe_steps and value is not None and at > last + 1:
            self.recent = (self.recent + [value])[-severe_steps:]
            self.recent_step = at
        if self.marked:
            self.marked = {s for s in self.marked if s >= at}

    def carried_window(self, step: int) -> list[float | None]:
        """The agreed walls of the window that ends at ``step``, shifted one step back (the last step's
        wall arrives with the next step); None where one was lost."""
        n = len(self.window)
        return [self.carried.get(s) for s in range(step - n, step)]

    def window_median(self, step: int, agree_max: Callable[[float], float]) -> float:
        """The window's median, the same on every rank: from the carried walls where each arrived (no
        collective), else this rank's median agreed by ``agree_max`` (a blocking all-reduce)."""
        carried = self.carried_window(step)
        if self.window and all(v is not None for v in carried):
            return statistics.median(carried)  # type: ignore[type-var]
        return agree_max(statistics.median(self.window))

    def add_exchange(self, exchange_s: float, at: int, last_decision: int | None, n: int) -> None:
        """A compressed step's agreed exchange time (not the decision's step, nor the switch's first)."""
        last = last_decision if last_decision is not None else -10**9
        if at > last + 1:
            self.recent_exchange = (self.recent_exchange + [exchange_s])[-n:]
            self.window_exchange.append(exchange_s)

    def forget(self) -> None:
        """A decision that did not keep the running method's references: its windows start anew."""
        self.window, self.recent, self.recent_exchange, self.window_exchange = [], [], [], []

    def forget_process(self) -> None:
        """A resume: the walls of the process that saved are not carried."""
        self.forget()
        self.pending, self.carried, self.t_prev_end = None, {}, None
