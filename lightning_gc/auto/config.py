"""The options of ``compressor="auto"`` (:class:`AutoConfig`), in sections.

Every option keeps its flat name (``GCStrategy(compressor="auto", auto={"window": 5})``,
``auto_window=5``, a recipe's ``auto:`` block, the bench's ``auto:window=5``); the section an option
belongs to is declared on its field (``metadata["section"]``), and :data:`SECTIONS` /
:func:`section_of` are derived from the fields, never listed by hand. The sections:

* ``choice``: what is chosen among and how progress is weighed;
* ``profile``: the dense warm-up that measures compute, and when codecs are timed;
* ``watch``: the drift tests on the step time that re-decide when the link moves;
* ``link``: when and how the link is looked at again (probe, check, a dense step as the measurement);
* ``explore``: how far the raw model is trusted, and the margins that keep measured methods from
  taking turns;
* ``gain``: when the candidates' errors are measured again;
* ``canary``: the link canary before each dense step (off by default);
* ``sync``: the DiLoCo configurations auto may switch to, and the trial that decides it (off by default).

Each field's docstring says why it exists and how to tune it (docs/auto.md has the measurements).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .._validation import check_int, check_number
from .canary import LinkCanary
from .candidates import DEFAULT_CANDIDATES, candidate
from .diloco_candidates import diloco_choice
from .model import DEFAULT_PROGRESS_WEIGHT

#: values of ``AutoConfig.time_codecs``
TIME_CODECS = ("on_demand", "upfront")


def _opt(section: str, default: Any) -> Any:
    """A field of ``section`` with ``default`` (the section is what :data:`SECTIONS` is derived from)."""
    return field(default=default, metadata={"section": section})


def _int(name: str, value: Any, lo: int, fix: str) -> None:
    check_int(f"auto_{name}", value, lo, fix, phrasing="must")


@dataclass(frozen=True)
class AutoConfig:
    """Options of ``compressor="auto"`` (flat names ``auto_<field>``; docs/auto.md). Each field's
    docstring is its tuning guide; :data:`SECTIONS` groups them."""

    # ------------------------------------------------------------------ choice
    candidates: tuple[str, ...] = _opt("choice", DEFAULT_CANDIDATES)
    """Methods to choose among, in tie-break order (``lightning_gc.auto.CANDIDATES``). ``ddp`` must be
    among them: the dense warm-up measures it, and it is the safe fallback. Drop a method you know
    cannot pay (its measurement costs a little at the warm-up and at every re-measurement)."""
    progress_weight: float = _opt("choice", DEFAULT_PROGRESS_WEIGHT)
    """``w`` of the progress proxy ``1/(1 + w·delta2)``; 0 ranks by step time only. Raise it if lossy
    picks need many more steps than they save, lower it if they converge as well as dense."""

    # ------------------------------------------------------------------ profile
    skip_steps: int = _opt("profile", 1)
    """Dense steps not profiled first (allocator and thread warm-up make them unlike later steps)."""
    profile_steps: int = _opt("profile", 1)
    """Dense steps profiled; the engine's warm-up is raised to ``skip_steps + profile_steps``. On a
    slow link each dense step costs the whole exchange, and what one step gets wrong the per-method
    calibration corrects; raise it for a steadier first decision on a fast link."""
    repeats: int = _opt("profile", 3)
    """Timed runs per codec (the median is kept). Raise it on a noisy host; each run is one
    compression of the live gradient on the step's critical path."""
    early_comm_ratio: float = _opt("profile", 1.0)
    """If the first (skipped) dense step's exposed communication (DDP's wait for its buckets after
    the last gradient was ready) is at least this many times the rest of its wall, that step is
    profiled and decided on at once and the dense warm-up ends there: on a slow link a second dense
    step costs more than the profile gains. 0: always profile after ``skip_steps``. A configured
    ``warmup_steps`` above ``skip_steps + profile_steps`` still holds."""
    time_codecs: str = _opt("profile", "on_demand")
    """When the engine candidates' codecs are timed. ``"on_demand"``: the warm-up measures payloads
    and errors only; a decision whose best candidate has an untimed codec (a lower bound) times it and
    decides again until its best is timed, which gives the pick timing them all would give without
    timing codecs that cannot win. ``"upfront"``: time every codec at the warm-up (every prediction
    in the history is then a full one)."""

    # ------------------------------------------------------------------ watch
    window: int = _opt("watch", 5)
    """Steps per drift window (median of the step walls). Shorter windows see a moved link sooner
    and are noisier; a drift is acted on after ``patience`` windows."""
    drift: float = _opt("watch", 0.3)
    """Relative change of a window's median step against the reference that counts as drift."""
    patience: int = _opt("watch", 2)
    """Drifted windows in a row before a (moderate) re-decision."""
    severe_drift: float = _opt("watch", 2.0)
    """A window whose median step is at least this many times the reference, or at most its inverse,
    re-decides at once, without waiting for ``patience`` or for ``min_interval`` after another kind
    of decision; 0 turns it off. A median of ``window`` steps moves this far only if most of the
    window moved, so one slow step (a validation, a pause) does not trigger it, and a false trigger
    costs one probe."""
    severe_steps: int = _opt("watch", 3)
    """The severe test, also made every step on the last this many agreed step walls (every one of
    them ``severe_drift`` off the same way, or their median twice that far), so a link that fell is
    seen within a few steps instead of at a window's end. Under a dense mode one step
    ``ONE_STEP_FACTOR · severe_drift`` slower is enough (not an epoch's first step nor the step after
    a checkpoint); under a compressed method the exchange time is tested too (a link that came back
    shows there first). 0: windows only; otherwise at least 2, since one step's wall may hold a
    validation or a checkpoint."""
    min_interval: int = _opt("watch", 30)
    """Steps between a decision and a drift re-decision at least; a severe one waits this long only
    after the last severe one. Keeps moderate noise from switching methods back and forth, and
    bounds the probes that severe re-decisions cost."""

    # ------------------------------------------------------------------ link
    probe_every: int = _opt("link", 100)
    """Look at the link again (and decide) this many steps after the last look at it, even without
    drift: a link that got faster may barely move a compressed method's step. Costs a probe or, with
    ``probe_check``, one check message. The clock is the engine's one link schedule, so a probe made
    for another client (OSP, ``AdaptiveRatio``) counts as a look. 0: never."""
    probe_every_max: int = _opt("link", 400)
    """The periodic look's interval doubles, up to this many steps, each time it keeps the method on
    a link its check found unchanged, and returns to ``probe_every`` after any other look. Lower it
    where the link changes in ways the step does not show; 0: no doubling. Never below
    ``probe_every``."""
    probe_check: float = _opt("link", 1.5)
    """A periodic or moderate drift re-decision first times one message of the last probe's size and
    compares it with the probe's time: within this factor either way the link counts as unchanged and
    the stored network decides, sparing the full probe (about four times the traffic). A coarse factor
    keeps one message's noise from forcing a probe. 0: always the full probe."""
    dense_probe_s: float = _opt("link", 0.1)
    """When the profiled dense step waited at least this long (seconds, slowest rank) for DDP's
    buckets after its last gradient was ready, that step is the bandwidth measurement (β solved from
    the model's DDP step) and the warm-up's bandwidth probe is skipped; a dense mode's drifted window
    is used the same way. Below the threshold the wait is mostly CPU, not the link. 0: always probe."""

    # ------------------------------------------------------------------ explore
    explore: int = _opt("explore", 2)
    """After a calibration, how many not-yet-measured candidates may still be installed and measured
    (one window each) because the raw model favours them, per probed decision. 0 settles on the
    measured methods at once; more tries more methods whose real step the model misses."""
    explore_margin: float = _opt("explore", 0.0)
    """A decision installs a method not yet measured on this link only if its (optimistic) prediction
    per unit of progress is at least this fraction below the best method measured in a window on this
    link. A small predicted lead is often the model's optimism, and a window on the wrong method costs
    its steps. Try 0.1 where the candidates' steps are close and a wrong lossy pick costs progress."""
    family_margin: float = _opt("explore", 0.15)
    """After the first window of a dense mode (``ddp``, ``fp16``, ``bf16``), a dense sibling not yet
    measured on this link runs one window when its raw prediction plus the measured mode's correction
    is within this fraction of the measured step (per unit of progress): the model cannot tell such
    close paths apart. Costs at most one window; 0 tries a sibling only if predicted as fast."""
    switch_margin: float = _opt("explore", 0.03)
    """A measured method replaces the running measured one only if its time per unit of progress is
    at least this fraction lower (else the history records it as ``held_by_margin``): the running
    method's figure is the fresher one, and on a host whose speed drifts it always looks a little
    worse. Costs at most this fraction of the step; 0 switches on any lead. Also the bar a dense
    sibling must clear over the mode its trial interrupted."""
    compute_shift: bool = _opt("explore", True)
    """Lower every unmeasured method's prediction by the smallest speed-up the measured methods showed
    against the raw model (the dense modes' when any were measured): the warm-up's profiled compute is
    slower than a settled step's for every method alike. False: unmeasured methods by the raw model."""

    # ------------------------------------------------------------------ gain
    gain_every: int = _opt("gain", 50)
    """Every this many steps after the last measurement of the candidates' errors, the next step's
    local gradients are copied and the errors measured again between steps (a gradient's
    compressibility changes as training goes on). Costs one gradient copy and one compression per
    candidate that could still win. 0: only at the warm-up."""
    gain_every_max: int = _opt("gain", 400)
    """The re-measurement's interval doubles, up to this many steps, after each one that left the
    method as it was, and returns to ``gain_every`` after a switch: errors that keep the pick need not
    be measured that often. A slow change that would move the pick is then seen up to this many steps
    late. 0: no doubling. Never below ``gain_every``."""
    gain_first: int = _opt("gain", 20)
    """The first re-measurement comes this many steps after the warm-up's (or after ``gain_every`` if
    sooner): the first gradients of training are unlike later ones. 0: after ``gain_every``."""
    gain_drift: float = _opt("gain", 0.1)
    """Re-measured errors re-decide (trigger ``"gain"``, no probe) when some candidate's progress per
    step moved by more than this, relative, from what the last decision used; smaller changes keep the
    stored errors, so a slow drift still adds up against them. 0: re-decide on every re-measurement."""

    # ------------------------------------------------------------------ canary
    canary_bytes: int = _opt("canary", 0)
    """Off (0) by default. With e.g. 65536, before each step a dense mode runs the engine sends this
    many bytes from every rank to every other rank, timed; on a fallen link the step stops (its
    gradient kept as error memory) and auto re-decides at its end (lightning_gc/auto/canary.py).
    For links known to fall to a small fraction of their rate; it costs a few milliseconds of every
    dense step. Must exceed the link's burst allowance divided by ``N-1`` or a fall does not show.
    Only on 2-8 ranks off NCCL, with a plan that sends every parameter every step, and with a network
    auto measures (not one pinned by ``network_alpha_s``/``network_beta_s_per_byte``)."""
    canary_factor: float = _opt("canary", 4.0)
    """The link fell when the fastest rank's time for the canary is at least this many times the
    network model's for it ..."""
    canary_margin_s: float = _opt("canary", 0.02)
    """... and at least this many seconds more (scheduling noise on a busy host)."""

    # ------------------------------------------------------------------ sync
    diloco: tuple[str, ...] = _opt("sync", ())
    """DiLoCo configurations auto may switch the run to, each a form of Δ and H
    (:mod:`lightning_gc.auto.diloco_candidates`): ``diloco<H>`` (fp16 Δ) or ``sparseloco<H>``, with
    Streaming DiLoCo's ``f<F>`` fragments and ``t<τ>`` overlap steps as optional suffixes, e.g.
    ``("diloco10", "diloco50")`` or ``("diloco10", "diloco50", "diloco50f5")`` (a string joins names
    with ``+``); empty (the default): per-step methods only. Where the gate opens, a trial on the
    training loss decides (docs/auto-diloco.md)."""
    diloco_gate: float = _opt("sync", 1.5)
    """A trial runs only where an exact per-step method's predicted step (the fastest of ``ddp``,
    ``fp16``, ``bf16`` among the candidates) is at least this many times DiLoCo's predicted step.
    1.5 opens it where the link takes at least a third of a dense step: DiLoCo can win there by
    progressing more per step, not only by stepping faster, and a compute-bound job (a fast link)
    stays shut. Lower it to try DiLoCo on faster links (each losing trial costs about one window of
    slower progress); raise it to try only where the link dominates a dense step. 0: try at once
    after the first decision, whatever the link (to compare the families on your job)."""
    diloco_lead: float = _opt("sync", 1.5)
    """Where that dense step is predicted at least this many times DiLoCo's, the trial starts in DiLoCo
    and brackets the per-step method (DiLoCo, per-step, DiLoCo), and DiLoCo stays unless the
    per-step method is shown faster; below it, the per-step method brackets DiLoCo and stays unless
    DiLoCo is shown faster. Either way a trial costs about one window of the family it leaves; the
    order decides who stays where the trial cannot separate them. The default, equal to
    ``diloco_gate``'s, starts every trial in DiLoCo: where the gate opens, the link takes a large
    share of a dense step. Raise it (0: always per-step first) where a per-step method usually
    wins on such links."""
    diloco_rounds: int = _opt("sync", 3)
    """DiLoCo rounds (of H steps) in each of the trial's three windows. More rounds separate smaller
    differences in progress and cost more when DiLoCo loses."""
    diloco_threshold: float = _opt("sync", 2.0)
    """Standard errors by which DiLoCo's progress rate must lead the incumbent's to win the trial
    (progress.compare). Raise it to switch families less often on a noisy loss."""
    diloco_hide: float = _opt("sync", 0.1)
    """The challenger is the smallest H whose predicted step is within this fraction of compute alone."""
    diloco_retry_every: int = _opt("sync", 0)
    """Steps after a lost trial before another (0: only once the link's β moved by ``severe_drift``)."""
    diloco_align: bool = _opt("sync", True)
    """Keep DiLoCo's outer steps on multiples of H of the optimizer step, where a run that started
    in DiLoCo takes them: the first round after entering runs to the next multiple (joined to the
    one after where that is under H/2 steps away), so validation, checkpoints and logs every H (or
    a multiple of it) see a θ_outer just updated. False: the first round is H steps from entering."""

    def __post_init__(self) -> None:
        self._check_choice()
        self._check_profile()
        self._check_watch()
        self._check_link()
        self._check_explore()
        self._check_gain()
        self._check_canary()
        self._check_sync()

    def _check_choice(self) -> None:
        cands = tuple(self.candidates)
        object.__setattr__(self, "candidates", cands)
        if not cands:
            raise ValueError("auto_candidates is empty: list at least 'ddp', e.g. ('ddp', 'fp16', 'topk').")
        for c in cands:
            candidate(c)
        if len(set(cands)) != len(cands):
            raise ValueError(f"auto_candidates={cands!r} lists a method twice.")
        if "ddp" not in cands:
            raise ValueError(f"auto_candidates={cands!r} must include 'ddp': the warm-up measures it, and it is the "
                             "method auto falls back to.")
        check_number("auto_progress_weight", self.progress_weight,
                     "a finite number >= 0 (0: step time only; default 2).", at_least=0)

    def _check_profile(self) -> None:
        _int("skip_steps", self.skip_steps, 0, "Use 0 to profile from the first step.")
        _int("profile_steps", self.profile_steps, 1, "Use at least 1 (3 by default: the median of three).")
        _int("repeats", self.repeats, 1, "Use at least 1.")
        check_number("auto_early_comm_ratio", self.early_comm_ratio,
                     "a finite number >= 0 (0: always profile after skip_steps; 1, the default: decide on the first "
                     "dense step when it waited on the network at least as long as it did anything else).", at_least=0)
        if self.time_codecs not in TIME_CODECS:
            raise ValueError(f"auto_time_codecs={self.time_codecs!r} is not one of {', '.join(TIME_CODECS)} "
                             "('on_demand': time a codec only when its lower bound would be picked; 'upfront': "
                             "time every codec at the warm-up).")

    def _check_watch(self) -> None:
        _int("window", self.window, 2, "Use at least 2 steps per window.")
        _int("patience", self.patience, 1, "Use at least 1.")
        check_number("auto_severe_drift", self.severe_drift,
                     "0 (off) or a factor > 1 (e.g. 2.0: a window at twice or half the reference step re-decides "
                     "at once).", above=1, or_zero=True)
        _int("severe_steps", self.severe_steps, 0, "Use 0 to test severe drift on windows only, or e.g. 3.")
        if self.severe_steps == 1:
            raise ValueError("auto_severe_steps=1 would re-decide on one slow step: a step's wall includes any "
                             "validation or checkpoint before it. Use 0 (windows only) or at least 2 (e.g. 3).")
        _int("min_interval", self.min_interval, 1, "Use at least 1.")
        check_number("auto_drift", self.drift, "> 0 (a relative change, e.g. 0.3).", above=0, finite=False)

    def _check_link(self) -> None:
        _int("probe_every", self.probe_every, 0, "Use 0 to re-decide on drift only.")
        _int("probe_every_max", self.probe_every_max, 0, "Use 0 for no doubling, or e.g. 400.")
        check_number("auto_dense_probe_s", self.dense_probe_s,
                     "a finite number of seconds >= 0 (0: always probe the bandwidth; e.g. 0.1: a dense step that "
                     "waited 0.1 s on the network measures it).", at_least=0)
        check_number("auto_probe_check", self.probe_check,
                     "0 (always the full probe) or a factor > 1 (e.g. 1.5: a check message within 1.5x of the "
                     "last probe's time keeps the probed network).", above=1, or_zero=True)

    def _check_explore(self) -> None:
        _int("explore", self.explore, 0, "Use 0 to settle on measured methods after the first calibration.")
        check_number("auto_explore_margin", self.explore_margin,
                     "a number in [0, 1) (a relative lead, e.g. 0.1: an unmeasured method replaces the best measured "
                     "one only if predicted 10% faster per unit of progress; 0: any lead, the default).",
                     at_least=0, below=1)
        check_number("auto_switch_margin", self.switch_margin,
                     "a number in [0, 1) (a relative lead, e.g. 0.03: a measured method replaces the running "
                     "measured one only if 3% faster per unit of progress; 0: any lead).", at_least=0, below=1)
        check_number("auto_family_margin", self.family_margin,
                     "a finite number >= 0 (a relative margin, e.g. 0.15; 0: try a dense sibling only if the "
                     "transferred correction makes it at least as fast).", at_least=0)
        if not isinstance(self.compute_shift, bool):
            raise ValueError(f"auto_compute_shift={self.compute_shift!r} must be true or false (true: a speed-up "
                             "every measured method showed also lowers the unmeasured methods' predictions).")

    def _check_gain(self) -> None:
        _int("gain_every", self.gain_every, 0, "Use 0 to measure the candidates' errors at the warm-up only.")
        _int("gain_every_max", self.gain_every_max, 0, "Use 0 for no doubling, or e.g. 400.")
        _int("gain_first", self.gain_first, 0, "Use e.g. 20 steps after the warm-up; 0 waits gain_every steps.")
        check_number("auto_gain_drift", self.gain_drift,
                     "a finite number >= 0 (a relative change of a candidate's progress per step, e.g. 0.1; 0 "
                     "re-decides on every re-measurement).", at_least=0)

    def _check_canary(self) -> None:
        _int("canary_bytes", self.canary_bytes, 0, "Use 0 (the default) to leave the link canary off, or e.g. 65536.")
        try:  # the factor's and the margin's own checks, whether the canary is on or not
            LinkCanary(self.canary_bytes or 1, self.canary_factor, self.canary_margin_s)
        except ValueError as e:
            raise ValueError(f"auto_{e}") from None

    def _check_sync(self) -> None:
        d = self.diloco
        names = tuple(n.strip() for n in d.split("+") if n.strip()) if isinstance(d, str) else tuple(d)
        object.__setattr__(self, "diloco", names)
        for n in names:
            diloco_choice(n)
        if len(set(names)) != len(names):
            raise ValueError(f"auto_diloco={names!r} lists a configuration twice.")
        if self.diloco_gate != 0:
            check_number("auto_diloco_gate", self.diloco_gate,
                         "0 (try at once) or a finite factor >= 1 (e.g. 2.0: try DiLoCo where a dense per-step "
                         "step is predicted at least twice DiLoCo's).", at_least=1)
        if self.diloco_lead != 0:
            check_number("auto_diloco_lead", self.diloco_lead,
                         "0 (always start the trial per-step) or a finite factor >= 1 (e.g. 2.0: start in DiLoCo "
                         "where a dense step is predicted at least twice DiLoCo's).", at_least=1)
        _int("diloco_rounds", self.diloco_rounds, 1, "Use at least 1 round per window, e.g. 3.")
        check_number("auto_diloco_threshold", self.diloco_threshold,
                     "a positive number of standard errors, e.g. 2.0.", above=0)
        check_number("auto_diloco_hide", self.diloco_hide, "a finite fraction >= 0 of compute, e.g. 0.1.", at_least=0)
        _int("diloco_retry_every", self.diloco_retry_every, 0, "Use 0 to retry only on a new link, or e.g. 1000.")
        if not isinstance(self.diloco_align, bool):
            raise ValueError(f"auto_diloco_align={self.diloco_align!r} must be true or false (true: DiLoCo's outer "
                             "steps fall on multiples of H of the optimizer step, as a static DiLoCo run's do).")

    def canary(self) -> LinkCanary | None:
        """The :class:`~lightning_gc.auto.canary.LinkCanary` of these options (None: off)."""
        if not self.canary_bytes:
            return None
        return LinkCanary(self.canary_bytes, self.canary_factor, self.canary_margin_s)

    @property
    def dense_steps_needed(self) -> int:
        """Dense steps the warm-up must run for auto's profile (``skip_steps + profile_steps``)."""
        return self.skip_steps + self.profile_steps

    @classmethod
    def coerce(cls, value: AutoConfig | dict | None) -> AutoConfig:
        """An :class:`AutoConfig` from itself, a dict of its fields (YAML) or ``None`` (defaults). A
        dict may give a section's options as a nested dict under the section's name
        (``{"watch": {"window": 5}}``) beside flat ones."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            flat = _flatten(value)
            known = set(section_of())
            unknown = sorted(set(flat) - known)
            if unknown:
                raise ValueError(f"auto={value!r}: unknown option(s) {unknown}; valid: {sorted(known)}.")
            return cls(**flat)
        raise TypeError(f"auto={value!r} must be an AutoConfig, a dict of its fields or None.")

    def as_dict(self) -> dict:
        """The flat fields (``candidates`` as a list), as :meth:`coerce` reads them back."""
        return {**asdict(self), "candidates": list(self.candidates), "diloco": list(self.diloco)}

    def sections(self) -> dict[str, dict[str, Any]]:
        """The options grouped by section (``{"watch": {"window": 5, ...}, ...}``)."""
        out: dict[str, dict[str, Any]] = {}
        for name, value in self.as_dict().items():
            out.setdefault(section_of()[name], {})[name] = value
        return out


def section_of() -> dict[str, str]:
    """Flat option name → its section, derived from :class:`AutoConfig`'s fields."""
    return {f.name: f.metadata["section"] for f in fields(AutoConfig)}


#: section → its options' flat names, in declaration order (derived from the fields)
SECTIONS: dict[str, tuple[str, ...]] = {}
for _name, _section in section_of().items():
    SECTIONS[_section] = (*SECTIONS.get(_section, ()), _name)


def _flatten(value: dict) -> dict:
    """Nested section dicts (``{"watch": {...}}``) spread into flat names; flat names kept. ``explore``
    is both a section and an option (the exploration budget): a dict there is the section."""
    flat: dict = {}
    for key, val in value.items():
        if key in SECTIONS and isinstance(val, dict):
            flat.update(val)
        else:
            flat[key] = val
    return flat
