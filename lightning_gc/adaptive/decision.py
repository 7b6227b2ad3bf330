"""The decision: the objectives over log c, NSGA-II (pymoo) over c and the collective, one front point.

1. **Objectives as functions of c.** The measured objectives (``t_comp``, ``1/gain``) are known at
   the candidate ratios only; between them they are interpolated piecewise-linearly in ``log c``
   (the candidates are spaced geometrically, and both vary smoothly in ``log c``), and held
   constant outside ``[c_min, c_max]`` (which the search never leaves). ``t_sync`` needs no
   interpolation: the alpha-beta model is analytic in ``c`` (:meth:`ObjectiveData.t_sync_s`).
2. **Search.** pymoo's NSGA-II minimises ``(t_comp, t_sync, 1/gain)`` over ``x0 = log c`` in
   ``[log c_min, log c_max]`` and, when the engine can run more than one collective
   (``artopk_auto``), ``x1`` in ``[0, K)`` whose integer part indexes the collective: a discrete
   second variable. For a fixed ``c`` only ``t_sync`` depends on the collective, so the front
   holds the model's cheapest collective — which is what ``artopk_auto`` runs — except at exact ties.
3. **One point.** The front is normalised per objective: ``1/gain`` to ``[0, 1]`` by its ideal
   and nadir points; the two times by the measured step time (``normalise="step"``, default: a
   time objective counts as the fraction of a step it adds over its best value) or, like ``1/gain``,
   by the front's range (``normalise="front"``); then ``rule="asf"`` picks
   ``argmin max_i w_i·f̂_i`` (pymoo's ASF with weights ``1/w``, as in pymoo's MCDM guide; the
   paper's rule), ``rule="pseudo_weights"`` the point whose pseudo-weights ``(f̂max_i − f̂_i)/Σ``
   are closest to ``w`` (pymoo's PseudoWeights, which always normalises by the front's range).
   Ties are broken by the smallest ``(c, collective)``: the front is sorted first.

Determinism: the inputs are agreed across ranks (bit-identical), NSGA-II runs with a fixed seed,
so every rank computes the same decision; the Callback still applies it through
``GCEngine.set_ratio``, which compares the value across ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .config import OBJECTIVES, AdaptiveConfig
from .objectives import ObjectiveData


class Objectives:
    """``F(c, collective) = (t_comp_s, t_sync_s, 1/gain)`` from one :class:`ObjectiveData`."""

    def __init__(self, data: ObjectiveData) -> None:
        cands = sorted(data.candidates, key=lambda x: x.c)
        if len(cands) < 2:
            raise ValueError(f"{len(cands)} candidate(s) measured: at least two are needed to interpolate over c.")
        bad = [x.c for x in cands if not (x.gain > 0 and math.isfinite(x.gain) and math.isfinite(x.t_comp_s))]
        if bad:
            raise ValueError(
                f"candidates {bad} have no finite positive gain or compression time (a non-finite step, or a "
                "zero gradient); the controller keeps the ratio in force and explores again later."
            )
        self.data = data
        self.log_c = np.log(np.array([x.c for x in cands], dtype=np.float64))
        self.t_comp = np.array([x.t_comp_s for x in cands], dtype=np.float64)
        self.inv_gain = np.array([1.0 / x.gain for x in cands], dtype=np.float64)
        self.collectives = data.collectives

    def at(self, c: float | np.ndarray, collective: str) -> np.ndarray:
        """Objectives at ratio(s) ``c``: shape ``(3,)`` or ``(len(c), 3)``."""
        cs = np.atleast_1d(np.asarray(c, dtype=np.float64))
        lc = np.log(cs)
        t_comp = np.interp(lc, self.log_c, self.t_comp)
        inv_gain = np.interp(lc, self.log_c, self.inv_gain)
        t_sync = np.array([self.data.t_sync_s(float(x), collective) for x in cs])
        out = np.stack([t_comp, t_sync, inv_gain], axis=1)
        return out[0] if np.ndim(c) == 0 else out


@dataclass
class Decision:
    """One decision: the chosen point, the front it came from, and how it was chosen."""

    c: float
    collective: str
    objectives: tuple[float, float, float]  # (t_comp_s, t_sync_s, 1/gain) at the chosen point
    front: list[tuple[float, str, float, float, float]]  # (c, collective, t_comp_s, t_sync_s, 1/gain)
    rule: str
    weights: tuple[float, float, float]

    def as_dict(self) -> dict:
        return asdict(self)


def normalise(F: np.ndarray) -> np.ndarray:
    """Per-objective ``(F − ideal) / (nadir − ideal)`` over the rows of ``F``; a constant objective → 0."""
    ideal, nadir = F.min(axis=0), F.max(axis=0)
    span = np.where(nadir - ideal > 0, nadir - ideal, 1.0)
    return (F - ideal) / span


def pick(F: np.ndarray, weights: tuple[float, float, float], rule: str, time_scale_s: float | None = None) -> int:
    """Index of the chosen row of a Pareto front ``F`` (rows already in tie-break order).

    ``time_scale_s`` (ASF only): divide the two time objectives' distances from their best value by
    this many seconds (the measured step) instead of by the front's range."""
    w = np.asarray(weights, dtype=np.float64)
    nF = normalise(F)
    if time_scale_s is not None and time_scale_s > 0:
        nF[:, :2] = (F[:, :2] - F[:, :2].min(axis=0)) / time_scale_s
    if rule == "asf":
        from pymoo.decomposition.asf import ASF

        with np.errstate(divide="ignore"):
            inv = np.where(w > 0, 1.0 / np.where(w > 0, w, 1.0), np.inf)
        return int(np.argmin(ASF().do(nF, inv)))
    if rule == "pseudo_weights":
        from pymoo.mcdm.pseudo_weights import PseudoWeights

        if len(F) == 1:
            return 0
        return int(PseudoWeights(w).do(nF))
    raise ValueError(f"rule={rule!r} is unknown: use 'asf' or 'pseudo_weights'.")


def nsga2_front(obj: Objectives, c_min: float, c_max: float, pop_size: int, n_gen: int, seed: int
                ) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Run NSGA-II; returns the front's ratios, collectives and objective rows, sorted by (c, collective)."""
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.problem import Problem
    from pymoo.optimize import minimize

    names = obj.collectives
    k = len(names)
    lo, hi = math.log(c_min), math.log(c_max)

    def decode(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = np.exp(np.clip(X[:, 0], lo, hi))
        idx = np.zeros(len(X), dtype=int) if k == 1 else np.clip(np.floor(X[:, 1]).astype(int), 0, k - 1)
        return c, idx

    class _Problem(Problem):
        def __init__(self) -> None:
            xl = np.array([lo] if k == 1 else [lo, 0.0])
            xu = np.array([hi] if k == 1 else [hi, float(k) - 1e-9])
            super().__init__(n_var=len(xl), n_obj=3, xl=xl, xu=xu)

        def _evaluate(self, X, out, *args, **kwargs):
            c, idx = decode(X)
            F = np.empty((len(X), 3))
            for j, name in enumerate(names):
                rows = idx == j
                if rows.any():
                    F[rows] = obj.at(c[rows], name)
            out["F"] = F

    res = minimize(_Problem(), NSGA2(pop_size=pop_size), ("n_gen", n_gen), seed=seed, verbose=False)
    X = np.atleast_2d(res.X)
    c, idx = decode(X)
    F = np.atleast_2d(res.F)
    order = sorted(range(len(c)), key=lambda i: (c[i], idx[i]))
    return c[order], [names[i] for i in idx[order]], F[order]


def decide(data: ObjectiveData, config: AdaptiveConfig) -> Decision:
    """NSGA-II over the objective data, then one point by ``config.rule`` and ``config.weights``."""
    obj = Objectives(data)
    c, colls, F = nsga2_front(obj, config.c_min, config.c_max, config.pop_size, config.n_gen, config.seed)
    scale = data.step_s if config.normalise == "step" and data.step_s > 0 else None
    i = pick(F, config.weights, config.rule, scale)
    front = [(float(c[j]), colls[j], *map(float, F[j])) for j in range(len(c))]
    return Decision(c=float(c[i]), collective=colls[i], objectives=tuple(map(float, F[i])),  # type: ignore[arg-type]
                    front=front, rule=config.rule, weights=config.weights)


__all__ = ["OBJECTIVES", "Decision", "Objectives", "decide", "normalise", "nsga2_front", "pick"]
