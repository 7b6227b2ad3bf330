"""Independent reference for the adaptive controller's decision: exhaustive grid + own ASF.

Nothing here imports lightning_gc: the objectives are re-derived from the raw candidate numbers
(piecewise-linear interpolation in log c, the paper's Eq. 4a/4b and AG formulas for fp32 values),
the Pareto front is found by brute-force dominance, and the ASF / pseudo-weights rules are written
out from their definitions.
"""

from __future__ import annotations

import math

import numpy as np


def paper_sync_s(coll: str, alpha: float, beta: float, numels, n: int, c: float, calibration: float = 1.0) -> float:
    L = math.ceil(math.log2(n))
    tot = 0.0
    for numel in numels:
        M = 4.0 * numel
        if coll == "allgather":
            tot += alpha * L + 2 * M * c * beta * (n - 1)
        elif coll == "art_ring":
            tot += alpha * (2 * (n - 1) + L) + M * c * beta * (2 * (n - 1) / n + L)
        elif coll == "art_tree":
            tot += 3 * alpha * L + 3 * M * c * beta * L
        else:
            raise ValueError(coll)
    return calibration * tot


def grid_points(cands, colls, alpha, beta, numels, n, c_min, c_max, calibration=1.0, points=801):
    """cands: list of (c, t_comp_s, gain). Returns (c, coll, F) for every grid point."""
    cands = sorted(cands)
    lcs = np.log([x[0] for x in cands])
    tc = np.array([x[1] for x in cands])
    ig = np.array([1.0 / x[2] for x in cands])
    grid = np.exp(np.linspace(math.log(c_min), math.log(c_max), points))
    cs, names, rows = [], [], []
    for coll in colls:
        for c in grid:
            rows.append((np.interp(math.log(c), lcs, tc), paper_sync_s(coll, alpha, beta, numels, n, c, calibration),
                         np.interp(math.log(c), lcs, ig)))
            cs.append(c)
            names.append(coll)
    return np.array(cs), names, np.array(rows)


def pareto_mask(F: np.ndarray) -> np.ndarray:
    keep = np.ones(len(F), dtype=bool)
    for start in range(0, len(F), 400):
        block = F[start:start + 400]
        le = (F[None, :, :] <= block[:, None, :]).all(axis=2)
        lt = (F[None, :, :] < block[:, None, :]).any(axis=2)
        keep[start:start + 400] = ~(le & lt).any(axis=1)
    return keep


def choose(F: np.ndarray, weights, rule: str, step_s: float | None = None) -> int:
    lo, hi = F.min(axis=0), F.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    if step_s and rule == "asf":  # time objectives as fractions of a step, 1/gain by the front's range
        span = np.array([step_s, step_s, span[2]])
    nF = (F - lo) / span
    w = np.asarray(weights) / np.sum(weights)
    if rule == "asf":
        return int(np.argmin((nF * w).max(axis=1)))
    pw = (1.0 - nF)
    pw = pw / pw.sum(axis=1, keepdims=True)
    return int(np.argmin(np.abs(pw - w).sum(axis=1)))


def grid_decision(cands, colls, alpha, beta, numels, n, c_min, c_max, weights, rule="asf", calibration=1.0,
                  step_s=None):
    cs, names, F = grid_points(cands, colls, alpha, beta, numels, n, c_min, c_max, calibration)
    m = pareto_mask(F)
    cs, F = cs[m], F[m]
    names = [x for x, k in zip(names, m) if k]
    i = choose(F, weights, rule, step_s)
    return float(cs[i]), names[i], F
