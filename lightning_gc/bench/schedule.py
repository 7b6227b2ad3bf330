"""Link rates and bandwidth schedules for the emulated cluster.

Rates are written the way ``tc`` writes them, in *bits* per second with SI prefixes:
``500kbit``, ``100mbit``, ``1gbit``, ``2.5gbit`` (case-insensitive, an optional ``/s`` suffix is
accepted: ``100Mbit/s``). Byte units (``mbps``, ``MB/s``) are rejected on purpose: ``tc`` reads
``mbps`` as *megabytes* per second, which is a classic factor-of-8 mistake.

A schedule changes the rate while a run trains. It is a comma- or newline-separated list of
``AT:RATE`` entries, where ``AT`` is the fraction of the run's training steps (``0 <= AT < 1``) at
which ``RATE`` starts to apply::

    0:1gbit,0.33:50mbit,0.66:200mbit

means 1 Gbit/s for the first third of the steps, 50 Mbit/s for the second and 200 Mbit/s after.
The first entry must be at ``0``; entries must be strictly increasing. ``AT`` may also be written
as a percentage (``33%``). A file holds the same entries, one per line or comma-separated, with
``#`` comments and blank lines allowed, and ``AT RATE`` (whitespace) accepted as well as ``AT:RATE``.
A single rate (``100mbit``) is a one-phase schedule.

Fractions map to steps as ``step = round(AT * steps)``; a phase that maps to the same step as the
previous one is an error (the run is too short for the schedule) rather than being dropped silently.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

__all__ = [
    "ScheduleError",
    "Phase",
    "Schedule",
    "parse_rate",
    "format_rate",
    "parse_schedule",
]

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-zA-Z]+)(/s)?\s*$")
MIN_RATE_BPS = 8_000  # tc cannot shape meaningfully below a few kbit/s
MAX_RATE_BPS = 400 * 10**9


class ScheduleError(ValueError):
    """A rate or schedule string that cannot be used; the message names the value, reason and fix."""


def parse_rate(text: str, *, what: str = "rate", shaped: bool = True) -> int:
    """Parse ``"100mbit"`` -> ``100_000_000`` (bits per second). ``shaped=False`` accepts rates above
    what ``tc`` can shape (``lightning-gc advise`` models a link, it does not shape one)."""
    if not isinstance(text, str):
        raise ScheduleError(f"{what} {text!r}: expected a string like '100mbit', got {type(text).__name__}")
    m = _RATE_RE.match(text)
    if not m:
        raise ScheduleError(
            f"{what} {text!r} is not a rate: expected a number followed by a unit "
            f"({', '.join(_UNITS)}), e.g. '100mbit' or '1gbit'"
        )
    number, exp, unit, _ = m.groups()
    unit_l = unit.lower()
    if unit_l not in _UNITS:
        if unit_l in {"bps", "kbps", "mbps", "gbps", "tbps", "b", "kb", "mb", "gb", "byte", "kbyte", "mbyte",
                      "gbyte"}:
            raise ScheduleError(
                f"{what} {text!r} uses a byte unit ({unit!r}); tc reads 'mbps' as megaBYTES per second, which "
                f"is ambiguous: write bits per second instead, e.g. '{number}mbit' for {number} megabits/s"
            )
        raise ScheduleError(
            f"{what} {text!r} has unknown unit {unit!r}: use one of {', '.join(_UNITS)} (bits per second, "
            f"SI prefixes), e.g. '100mbit'"
        )
    value = float(number) * (10 ** int(exp) if exp else 1) * _UNITS[unit_l]
    if not math.isfinite(value) or value < MIN_RATE_BPS:
        raise ScheduleError(
            f"{what} {text!r} = {value:g} bit/s is below the minimum of {format_rate(MIN_RATE_BPS)}: "
            f"tc cannot shape that slowly and a training step would take hours; use at least '8kbit'"
        )
    if value > MAX_RATE_BPS and shaped:
        raise ScheduleError(
            f"{what} {text!r} = {value:g} bit/s is above {format_rate(MAX_RATE_BPS)}, faster than any "
            f"emulated link here could carry; leave --bandwidth unset for an unshaped link instead"
        )
    return int(round(value))


def format_rate(bps: float | None) -> str:
    """``100_000_000`` -> ``"100mbit"`` (exact when possible, otherwise 3 significant digits)."""
    if bps is None:
        return "unshaped"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            v = bps / scale
            return f"{v:.0f}{unit}" if abs(v - round(v)) < 1e-9 else f"{v:.3g}{unit}"
    return f"{bps:.0f}bit"


@dataclass(frozen=True)
class Phase:
    at: float  # fraction of the run's steps where this phase starts, 0 <= at < 1
    rate_bps: int

    def to_json(self) -> dict:
        return {"at": self.at, "rate": format_rate(self.rate_bps), "rate_bps": self.rate_bps}


@dataclass(frozen=True)
class Schedule:
    phases: tuple[Phase, ...]
    source: str = ""

    @classmethod
    def constant(cls, rate_bps: int) -> Schedule:
        return cls((Phase(0.0, int(rate_bps)),), source=format_rate(rate_bps))

    @property
    def initial_rate_bps(self) -> int:
        return self.phases[0].rate_bps

    @property
    def is_constant(self) -> bool:
        return len(self.phases) == 1

    def _steps(self, steps: int) -> list[int]:
        return [int(round(ph.at * steps)) for ph in self.phases]

    def boundaries(self, steps: int) -> list[tuple[int, int]]:
        """``[(first_step, rate_bps), ...]`` for a run of ``steps`` training steps (first entry is step 0)."""
        if steps < 1:
            raise ScheduleError(f"steps={steps}: a schedule needs a run of at least 1 step")
        starts = self._steps(steps)
        for i in range(1, len(starts)):
            if starts[i] <= starts[i - 1]:
                raise ScheduleError(
                    f"schedule {self.source!r}: phase at {self.phases[i].at:g} starts at step {starts[i]} of {steps}, "
                    f"the same step as the phase before it, so it would never apply; use more --steps (at least "
                    f"{self.min_steps()}) or fewer phases"
                )
        return [(st, ph.rate_bps) for st, ph in zip(starts, self.phases)]

    def min_steps(self) -> int:
        """Smallest run length for which every phase gets at least one step."""
        for steps in range(1, 1_000_000):
            starts = self._steps(steps)
            if all(b > a for a, b in zip(starts, starts[1:])):
                return steps
        return 1_000_000

    def rate_at_step(self, step: int, steps: int) -> int:
        rate = self.phases[0].rate_bps
        for start, r in self.boundaries(steps):
            if step >= start:
                rate = r
        return rate

    def to_json(self) -> list[dict]:
        return [p.to_json() for p in self.phases]

    def describe(self) -> str:
        return ", ".join(f"{format_rate(p.rate_bps)} from {p.at:.0%}" for p in self.phases)


def _parse_at(text: str, entry: str, source: str) -> float:
    t = text.strip()
    try:
        at = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise ScheduleError(
            f"schedule {source!r}: entry {entry!r} starts with {t!r}, which is not a fraction of the run; "
            f"write AT:RATE with AT in [0, 1) (or a percentage), e.g. '0.33:50mbit'"
        ) from None
    if not math.isfinite(at) or at < 0 or at >= 1:
        raise ScheduleError(
            f"schedule {source!r}: entry {entry!r} has AT={t!r} outside [0, 1): AT is the fraction of the run's "
            f"steps where the rate starts (0 = start, 0.5 = halfway); e.g. '0:1gbit,0.5:100mbit'"
        )
    return at


def parse_schedule(spec: str) -> Schedule:
    """Parse a schedule from an inline spec or a file path (see module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ScheduleError(
            f"schedule {spec!r} is empty: give AT:RATE entries like '0:1gbit,0.33:50mbit' or a file with them"
        )
    source = spec.strip()
    text = source
    looks_like_path = os.sep in source or source.endswith((".txt", ".sched", ".schedule", ".csv"))
    if os.path.isfile(source):
        try:
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ScheduleError(f"schedule file {source!r} cannot be read ({exc}); check the path and permissions") from exc
    elif looks_like_path:
        raise ScheduleError(
            f"schedule {source!r} looks like a file path but no such file exists; give an existing file or an "
            f"inline spec like '0:1gbit,0.33:50mbit,0.66:200mbit'"
        )

    entries: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        entries.extend(e.strip() for e in line.split(",") if e.strip())
    if not entries:
        raise ScheduleError(f"schedule {source!r} has no entries; expected AT:RATE lines like '0 100mbit'")

    if len(entries) == 1 and ":" not in entries[0] and len(entries[0].split()) == 1:
        return Schedule((Phase(0.0, parse_rate(entries[0], what="schedule rate")),), source=source)

    phases: list[Phase] = []
    for entry in entries:
        if ":" in entry:
            at_s, _, rate_s = entry.partition(":")
        else:
            parts = entry.split()
            if len(parts) != 2:
                raise ScheduleError(
                    f"schedule {source!r}: entry {entry!r} is not AT:RATE; write e.g. '0.5:100mbit' (or '0.5 100mbit' "
                    f"in a file)"
                )
            at_s, rate_s = parts
        at = _parse_at(at_s, entry, source)
        rate = parse_rate(rate_s.strip(), what=f"schedule entry {entry!r} rate")
        if phases and at <= phases[-1].at:
            raise ScheduleError(
                f"schedule {source!r}: entry {entry!r} starts at {at:g}, not after the previous entry at "
                f"{phases[-1].at:g}; list the entries in strictly increasing order of AT"
            )
        phases.append(Phase(at, rate))
    if phases[0].at != 0.0:
        raise ScheduleError(
            f"schedule {source!r} starts at {phases[0].at:g}, so the rate before it is undefined; add a first "
            f"entry at 0, e.g. '0:1gbit,{entries[0]}'"
        )
    return Schedule(tuple(phases), source=source)
