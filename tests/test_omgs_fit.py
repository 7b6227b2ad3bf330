"""Cost-model fits recover known coefficients from synthetic timings (noise-free and noisy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_gc.plans.omgs_fit import fit_comm, fit_line, fit_sparsify


def test_sparsify_fit_recovers_known_gamma_and_intercept():
    gamma, s0, ratio = 3.7e-9, 4e-5, 0.01
    sizes = [2**k for k in range(10, 23, 2)]
    t = [s0 + gamma * ratio * d * math.log(d) for d in sizes]
    fit = fit_sparsify(sizes, t, ratio)
    assert fit.gamma_s == pytest.approx(gamma, rel=1e-9)
    assert fit.intercept_s == pytest.approx(s0, rel=1e-9)
    assert max(abs(r) for r in fit.residuals) < 1e-9
    assert fit(10**6) == pytest.approx(s0 + gamma * ratio * 1e6 * math.log(1e6))


def test_comm_fit_with_noise_and_clamping():
    rng = np.random.default_rng(0)
    alpha, beta = 2.5e-4, 8e-8
    b = np.geomspace(64, 4e6, 9)
    t = (alpha + beta * b) * (1 + 0.03 * rng.standard_normal(b.size))
    fit = fit_comm(b, t)
    assert fit.intercept == pytest.approx(alpha, rel=0.1)
    assert fit.slope == pytest.approx(beta, rel=0.1)
    assert fit.max_abs_residual < 0.15
    assert fit.clamped is None
    # a decreasing series is noise: the slope is clamped to 0, the intercept is the weighted mean
    flat = fit_line([1, 2, 3], [3.0, 2.0, 1.0])
    assert flat.slope == 0.0 and flat.clamped == "slope"
    # a line through a negative intercept: clamped to 0, slope refitted through the origin
    through = fit_line([1, 2, 4], [0.5, 1.5, 3.5])
    assert through.intercept == 0.0 and through.clamped == "intercept" and through.slope > 0


def test_fit_errors_name_the_problem():
    with pytest.raises(ValueError, match="two distinct"):
        fit_comm([8, 8], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_comm([8, 16], [1.0, 0.0])
    with pytest.raises(ValueError, match="ratio"):
        fit_sparsify([100, 1000], [1.0, 2.0], ratio=0)
