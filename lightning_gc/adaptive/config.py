"""Typed, validated settings of the adaptive compression-ratio controller.

Every field is checked when the object is built, so a bad setting fails when the Callback is
constructed (or, for what depends on the strategy — a compressor without a ratio — at ``setup``),
not half-way through training on one rank. Messages give the value, the reason and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .._validation import check_bool, check_int

Mode = Literal["shadow", "rollback"]
Rule = Literal["asf", "pseudo_weights"]
Normalise = Literal["step", "front"]

#: what ``weights`` weigh, in order: the three objectives of Eq. 6 of the AR-Topk paper
OBJECTIVES = ("t_comp_s", "t_sync_s", "inv_gain")


def _ratio(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < float(value) <= 1.0):
        raise ValueError(
            f"{name}={value!r} is invalid: a compression ratio is the fraction of gradient elements kept "
            "and must lie in (0, 1]. Use e.g. c_min=0.001, c_max=0.1 (the paper's range)."
        )
    return float(value)


def _fraction(name: str, value: object, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (float(value) > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} is invalid: it must be a finite number > 0. {hint}")
    return float(value)


def candidate_ratios(c_min: float, c_max: float, factor: float) -> tuple[float, ...]:
    """``c_max, c_max/factor, ...`` down to ``c_min`` (included), largest first.

    With the defaults (0.001, 0.1, 3) this gives 0.1, 0.0333, 0.0111, 0.0037, 0.001: the paper's
    0.1, 0.033, 0.011, 0.004, 0.001. The last step is shortened so that ``c_min`` itself is a
    candidate (the bounds of the search are always measured, never extrapolated).
    """
    out = [c_max]
    c = c_max
    while c / factor > c_min * (1 + 1e-9):
        c /= factor
        out.append(c)
    if out[-1] > c_min:
        # the last ×factor step would overshoot c_min: measure c_min itself instead of stopping short
        if out[-1] / c_min < math.sqrt(factor) and len(out) > 1:
            out[-1] = c_min
        else:
            out.append(c_min)
    return tuple(out)


@dataclass(frozen=True)
class AdaptiveConfig:
    """How the controller explores, decides and re-explores.

    Search space and candidates:
        c_min, c_max: bounds of the ratio (fraction of elements kept), ``0 < c_min < c_max ≤ 1``.
            Small ``c_min`` risks losing important updates; large ``c_max`` costs bandwidth.
        factor: candidates are ``c_max, c_max/factor, …, c_min`` (the paper: 3, five candidates).

    Exploration (see docs/adaptive.md for the costs):
        mode: ``"shadow"`` — score every candidate on the live steps' error-fed gradients without
            sending them (compression time and gain measured locally, communication time from the
            alpha-beta model calibrated by the measured time of the ratio in force); costs no
            training steps, only the extra compressions on ``shadow_steps`` steps.
            ``"rollback"`` — the paper's: each candidate trains ``steps_per_candidate`` real steps
            (on the last training batches), then model, optimizer, LR schedulers, error memory,
            engine counters and RNG states are restored from an in-memory snapshot; costs
            ``len(candidates) × steps_per_candidate`` extra steps per exploration.
        shadow_steps: live steps whose gradients score the candidates (shadow mode).
        steps_per_candidate: real steps per candidate (rollback mode; the paper used 10).

    Decision:
        weights: importance of (compression time, communication time, 1/gain); any non-negative
            numbers with a positive sum, normalised to sum 1. Default (0.3, 0.3, 0.4): the paper's
            0.6 time / 0.4 gain, the time share split equally between its two parts. More weight on
            the gain keeps more elements (larger c); more on time compresses harder.
        rule: how one point of the Pareto front is chosen: ``"asf"`` (achievement scalarisation on
            the front normalised to [0, 1]: minimise ``max_i w_i·f̂_i``; the paper's) or
            ``"pseudo_weights"`` (the front point whose pseudo-weight vector is closest to ``weights``).
        normalise: how ASF puts the objectives on one scale. ``"step"`` (default): each time
            objective's distance from its best value on the front, divided by the measured step
            time (agreed across ranks), so saving 5 ms of a 200 ms step counts as 0.025, however
            small the front's range is; 1/gain by the front's range. ``"front"`` (the usual MCDM
            normalisation): every objective by the front's range, so the smallest time saving on
            offer weighs as much as the largest accuracy loss. ``pseudo_weights`` always uses it.
        pop_size, n_gen, seed: NSGA-II population, generations and seed (a fixed seed makes every
            rank find the same front from the same agreed inputs).

    Triggers:
        warmup_steps: optimizer steps before the first exploration; the engine sends dense during
            them (the controller raises the strategy's ``warmup_steps`` to this if it is lower).
            With the defaults the first decision lands at step ``warmup_steps + shadow_steps``
            (23) in shadow mode and at ``warmup_steps`` in rollback mode: within 50 steps.
        gain_threshold: re-explore when the smoothed gain moved by at least this fraction from its
            value after the last decision (the paper: 10 %).
        network_threshold: re-explore when the probed latency or bandwidth moved by at least this
            fraction since the last decision.
        probe_every: optimizer steps between network probes asked for by the controller (only when
            the engine itself does not keep a probed model, i.e. collectives that do not choose by the
            model); 0 = probe only at explorations. The probe is the engine's link observer's
            (``lightning_gc.comm.link``): a probe made for another client (OSP) restarts this count,
            and with another client's shorter interval the link is probed at that one, for both.
        min_interval: optimizer steps between two explorations at least.
        settle_steps: steps after a decision before the smoothed gain is taken as the reference
            of the gain trigger (the EWMA needs ~1/(1−β) steps to forget the previous ratio).
        calibrate: scale the model's communication times by measured/predicted of the measured
            candidates (the model ignores software overheads); the factor is logged.
    """

    mode: Mode = "shadow"
    c_min: float = 0.001
    c_max: float = 0.1
    factor: float = 3.0
    shadow_steps: int = 3
    steps_per_candidate: int = 5
    weights: tuple[float, float, float] = (0.3, 0.3, 0.4)
    rule: Rule = "asf"
    normalise: Normalise = "step"
    pop_size: int = 40
    n_gen: int = 40
    seed: int = 0
    warmup_steps: int = 20
    gain_threshold: float = 0.1
    network_threshold: float = 0.5
    probe_every: int = 50
    min_interval: int = 50
    settle_steps: int = 10
    calibrate: bool = True
    candidates: tuple[float, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.mode not in ("shadow", "rollback"):
            raise ValueError(
                f"mode={self.mode!r} is not an exploration mode: use 'shadow' (score candidates on the live "
                "gradient, no extra steps) or 'rollback' (run each candidate, then restore)."
            )
        c_min, c_max = _ratio("c_min", self.c_min), _ratio("c_max", self.c_max)
        if not c_min < c_max:
            raise ValueError(
                f"c_min={self.c_min!r} must be smaller than c_max={self.c_max!r}: the controller searches the "
                "ratio between them. Swap them, or use a static ratio (GCStrategy(ratio=...)) without the "
                "controller if you want one value."
            )
        factor = _fraction("factor", self.factor, "Use e.g. 3 (candidates ×3 apart).")
        if factor <= 1.0:
            raise ValueError(f"factor={self.factor!r} must be > 1 (candidates are c_max, c_max/factor, …); use 3.")
        check_int("shadow_steps", self.shadow_steps, 1, "Use e.g. 3 live steps to score candidates on.")
        check_int("steps_per_candidate", self.steps_per_candidate, 1, "Use e.g. 5 (the paper: 10).")
        w = tuple(self.weights) if isinstance(self.weights, (list, tuple)) else ()
        if len(w) != 3 or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in w):
            raise ValueError(
                f"weights={self.weights!r} must be three numbers: (compression time, communication time, 1/gain); "
                "use e.g. (0.3, 0.3, 0.4)."
            )
        if any(x < 0 for x in w) or not sum(w) > 0:
            raise ValueError(
                f"weights={self.weights!r} must be non-negative and sum to a positive number (sum={sum(w)!r}): they "
                "say how much each objective matters; use e.g. (0.3, 0.3, 0.4) = 0.6 time / 0.4 gain."
            )
        object.__setattr__(self, "weights", tuple(float(x) / sum(w) for x in w))
        if self.rule not in ("asf", "pseudo_weights"):
            raise ValueError(f"rule={self.rule!r} is unknown: use 'asf' (the paper's) or 'pseudo_weights'.")
        if self.normalise not in ("step", "front"):
            raise ValueError(f"normalise={self.normalise!r} is unknown: use 'step' (time objectives as fractions "
                             "of the measured step) or 'front' (every objective by the front's range).")
        check_int("pop_size", self.pop_size, 4, "Use e.g. 40.")
        check_int("n_gen", self.n_gen, 1, "Use e.g. 40.")
        check_int("seed", self.seed, 0, "Use any non-negative integer.")
        check_int("warmup_steps", self.warmup_steps, 1, "Use e.g. 20 dense steps before the first exploration.")
        _fraction("gain_threshold", self.gain_threshold, "Use e.g. 0.1 (10 %).")
        _fraction("network_threshold", self.network_threshold, "Use e.g. 0.5 (50 %).")
        check_int("probe_every", self.probe_every, 0, "Use e.g. 50, or 0 to probe only when exploring.")
        check_int("min_interval", self.min_interval, 1, "Use e.g. 50 steps between explorations.")
        check_int("settle_steps", self.settle_steps, 0, "Use e.g. 10.")
        check_bool("calibrate", self.calibrate, "True scales model times by measured/predicted.")
        object.__setattr__(self, "c_min", c_min)
        object.__setattr__(self, "c_max", c_max)
        object.__setattr__(self, "factor", factor)
        object.__setattr__(self, "candidates", candidate_ratios(c_min, c_max, factor))
