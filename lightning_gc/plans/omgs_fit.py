"""Fitting the OMGS cost models (Eq. 10-11) to timings taken on this machine.

* Sparsification, Eq. 10: ``t_s(D) = s0 + γ·ρ·D·ln D`` seconds for a group of ``D`` elements at
  ratio ``ρ`` (fraction kept). ``γ`` is in seconds per (element · ln element) per unit ratio, as in
  the paper; ``s0`` (seconds, ≥ 0) is the fixed cost of one call on this machine (kernel launches,
  Python), which the paper's GPU model leaves out and which matters on CPU for small groups. The
  paper fitted ``γ`` once for one GPU; here it is fitted from timed runs of the *active* compressor.
* Communication, Eq. 11: ``t_c(D) = α + β·B(D)`` seconds, ``B(D)`` the bytes of one rank's payload
  for a group of ``D`` elements (Top-k: ``k`` values + ``k`` int32 indices, ``k = ⌈ρD⌉``). ``α`` in
  seconds per message, ``β`` in seconds per payload byte at this world size (for an allgather it
  includes receiving the other ``N-1`` ranks' payloads), fitted from timed runs of the *active*
  exchange.

Both are weighted least squares with weights ``1/t²`` (relative error), so that the small sizes —
where the start-up terms live — are not drowned by the large ones. Negative coefficients are
clamped to 0 and the other refitted (a negative start-up or slope is noise, not physics). The
relative residuals ``(fit − t)/t`` are returned so that callers can log them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LineFit", "fit_line", "fit_sparsify", "fit_comm", "SparsifyFit"]


@dataclass(frozen=True)
class LineFit:
    """``t = intercept + slope·x`` with the relative residuals of the points it was fitted to."""

    intercept: float
    slope: float
    residuals: tuple[float, ...]
    clamped: str | None = None

    @property
    def max_abs_residual(self) -> float:
        return max((abs(r) for r in self.residuals), default=0.0)

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


def _check(xs: Sequence[float], ts: Sequence[float], what: str) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(ts, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(f"{what}: {x.size} sizes but {t.size} times; pass one time per size.")
    if len(set(x.tolist())) < 2:
        raise ValueError(f"{what}: sizes {x.tolist()} have fewer than two distinct values; time at least two sizes.")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"{what}: times {t.tolist()} must be finite and > 0 seconds; check that each size was timed.")
    return x, t


def fit_line(xs: Sequence[float], ts: Sequence[float], what: str = "fit") -> LineFit:
    """Least squares of ``t = a + b·x`` weighted by ``1/t²``, with ``a, b ≥ 0``."""
    x, t = _check(xs, ts, what)
    w = 1.0 / t  # rows scaled by 1/t: minimises Σ((a + b x − t)/t)²
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    clamped = None
    if a < 0:
        b = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
        a, clamped = 0.0, "intercept"
    if b < 0:
        a, b, clamped = float(np.sum(w * w * t) / np.sum(w * w)), 0.0, "slope"
    a, b = max(float(a), 0.0), max(float(b), 0.0)
    res = tuple(float(r) for r in ((a + b * x) - t) / t)
    return LineFit(a, b, res, clamped)


@dataclass(frozen=True)
class SparsifyFit:
    """Eq. 10 fitted: ``t_s(D) = intercept_s + gamma_s·ratio·D·ln D``."""

    gamma_s: float
    intercept_s: float
    ratio: float
    residuals: tuple[float, ...]

    def __call__(self, d: int) -> float:
        return self.intercept_s + self.gamma_s * self.ratio * d * math.log(d) if d > 1 else self.intercept_s


def fit_sparsify(numels: Sequence[int], times_s: Sequence[float], ratio: float) -> SparsifyFit:
    """Fit Eq. 10 to the median selection time of groups of ``numels`` elements at ``ratio``."""
    if not (0 < ratio <= 1):
        raise ValueError(f"ratio={ratio!r} must lie in (0, 1] (fraction of elements kept).")
    if any(int(d) < 2 for d in numels):
        raise ValueError(f"numels={list(numels)} must all be ≥ 2 (D·ln D vanishes below).")
    x = [ratio * d * math.log(d) for d in numels]
    line = fit_line(x, times_s, "sparsification fit")
    return SparsifyFit(line.slope, line.intercept, ratio, line.residuals)


def fit_comm(payload_bytes: Sequence[float], times_s: Sequence[float]) -> LineFit:
    """Fit Eq. 11, ``t_c = α + β·bytes``, to the median exchange time of payloads of these sizes."""
    return fit_line(payload_bytes, times_s, "communication fit")
