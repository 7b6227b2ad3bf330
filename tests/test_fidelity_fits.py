"""The cost-model fits pinned to their closed forms, clamped and unclamped (exact rational arithmetic).

Two fits share one rule (weighted least squares of ``t = a + b·x``, negative coefficients clamped):
``lightning_gc.comm.probe.fit_latency_bandwidth`` (the network probe's α, β) and
``lightning_gc.plans.omgs_fit.fit_line`` (OMGS Eq. 10's γ through ``fit_sparsify``, Eq. 11's α, β
through ``fit_comm``). With relative weighting (weights ``1/t²``) the objective is
``Σ ((a + b·x − t)/t)²``; writing ``u = 1/t`` and ``v = x/t`` it is ``Σ (a·u + b·v − 1)²``, so

* unclamped: ``[Σu² Σuv; Σuv Σv²]·[a; b] = [Σu; Σv]`` (normal equations);
* intercept clamped to 0: ``b = Σv / Σv²``;
* slope clamped to 0: ``a = Σu / Σu²``;

and with uniform weighting (the probe's option) ``b = Σxt / Σx²`` and ``a = mean(t)``. The oracles
below compute these with :class:`fractions.Fraction` from the inputs, and the inputs are chosen so
that the unclamped solution really has the negative coefficient (checked here too).
"""

from __future__ import annotations

import math
from fractions import Fraction as Fr

import pytest

from lightning_gc.comm.probe import fit_latency_bandwidth
from lightning_gc.plans.omgs_fit import fit_comm, fit_line, fit_sparsify


def _normal(xs, ts) -> tuple[Fr, Fr]:
    """Unclamped relative-weighted least squares, exactly."""
    u = [1 / Fr(t) for t in ts]
    v = [Fr(x) / Fr(t) for x, t in zip(xs, ts)]
    suu, suv, svv = sum(a * a for a in u), sum(a * b for a, b in zip(u, v)), sum(b * b for b in v)
    su, sv = sum(u), sum(v)
    det = suu * svv - suv * suv
    return (su * svv - sv * suv) / det, (suu * sv - suv * su) / det


def _through_origin(xs, ts) -> Fr:
    v = [Fr(x) / Fr(t) for x, t in zip(xs, ts)]
    return sum(v) / sum(b * b for b in v)


def _flat(ts) -> Fr:
    u = [1 / Fr(t) for t in ts]
    return sum(u) / sum(a * a for a in u)


def _residuals(a, b, xs, ts) -> list[float]:
    return [float((Fr(a) + Fr(b) * Fr(x) - Fr(t)) / Fr(t)) for x, t in zip(xs, ts)]


# (xs, ts): a negative intercept, not on one line; a negative slope; a physical noisy fit
NEG_INTERCEPT = ([1.0, 2.0, 4.0, 7.0], [0.5, 1.5, 3.5, 6.25])
NEG_SLOPE = ([1.0, 2.0, 3.0, 5.0], [3.0, 2.0, 1.25, 1.0])
PHYSICAL = ([64.0, 1024.0, 16384.0, 262144.0], [3.1e-5, 3.3e-5, 5.2e-5, 2.9e-4])


def test_the_inputs_really_need_the_clamp():
    a, b = _normal(*NEG_INTERCEPT)
    assert a < 0 < b
    a, b = _normal(*NEG_SLOPE)
    assert b < 0 < a
    a, b = _normal(*PHYSICAL)
    assert a > 0 and b > 0


@pytest.mark.parametrize("fit", ["probe", "omgs"])
def test_intercept_clamp_is_the_weighted_fit_through_the_origin(fit):
    xs, ts = NEG_INTERCEPT
    b = _through_origin(xs, ts)
    if fit == "probe":
        got = fit_latency_bandwidth(xs, ts)
        assert got.clamped == "intercept" and got.intercept_s == 0.0
        assert got.slope_s_per_byte == pytest.approx(float(b), rel=1e-12)
    else:
        got = fit_line(xs, ts)
        assert got.clamped == "intercept" and got.intercept == 0.0
        assert got.slope == pytest.approx(float(b), rel=1e-12)
        assert list(got.residuals) == pytest.approx(_residuals(0, b, xs, ts), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("fit", ["probe", "omgs"])
def test_slope_clamp_is_the_weighted_mean(fit):
    xs, ts = NEG_SLOPE
    a = _flat(ts)
    assert float(a) != pytest.approx(sum(ts) / len(ts), rel=1e-3)  # the unweighted mean would be wrong
    if fit == "probe":
        got = fit_latency_bandwidth(xs, ts)
        assert got.clamped == "slope" and got.slope_s_per_byte == 0.0
        assert got.intercept_s == pytest.approx(float(a), rel=1e-12)
    else:
        got = fit_line(xs, ts)
        assert got.clamped == "slope" and got.slope == 0.0
        assert got.intercept == pytest.approx(float(a), rel=1e-12)
        assert list(got.residuals) == pytest.approx(_residuals(a, 0, xs, ts), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("fit", ["probe", "omgs"])
def test_unclamped_fit_is_the_relative_least_squares_solution(fit):
    xs, ts = PHYSICAL
    a, b = _normal(xs, ts)
    if fit == "probe":
        got = fit_latency_bandwidth(xs, ts)
        assert got.clamped is None
        assert (got.intercept_s, got.slope_s_per_byte) == (pytest.approx(float(a), rel=1e-9),
                                                           pytest.approx(float(b), rel=1e-9))
    else:
        got = fit_line(xs, ts)
        assert got.clamped is None
        assert (got.intercept, got.slope) == (pytest.approx(float(a), rel=1e-9), pytest.approx(float(b), rel=1e-9))
        assert list(got.residuals) == pytest.approx(_residuals(a, b, xs, ts), rel=1e-6, abs=1e-12)


def test_probe_uniform_weighting_clamps_to_ordinary_least_squares_forms():
    xs, ts = NEG_INTERCEPT
    got = fit_latency_bandwidth(xs, ts, "uniform")
    b = sum(Fr(x) * Fr(t) for x, t in zip(xs, ts)) / sum(Fr(x) ** 2 for x in xs)
    assert got.clamped == "intercept" and got.slope_s_per_byte == pytest.approx(float(b), rel=1e-12)
    xs, ts = NEG_SLOPE
    got = fit_latency_bandwidth(xs, ts, "uniform")
    assert got.clamped == "slope" and got.intercept_s == pytest.approx(sum(ts) / len(ts), rel=1e-12)


def test_omgs_gamma_fit_clamped_against_its_closed_form():
    """Eq. 10 with a negative start-up: γ is the fit of t through the origin in x = ρ·D·ln D."""
    ratio = 0.01
    sizes = [1024, 4096, 16384, 65536]
    x = [ratio * d * math.log(d) for d in sizes]
    ts = [(1e-6 * xi - 2e-5) * f for xi, f in zip(x, (1.0, 1.05, 0.97, 1.02))]
    a, _ = _normal(x, ts)
    assert a < 0  # the unclamped start-up is negative: the clamp decides
    fit = fit_sparsify(sizes, ts, ratio)
    assert fit.intercept_s == 0.0
    assert fit.gamma_s == pytest.approx(float(_through_origin(x, ts)), rel=1e-12)
    assert fit(sizes[2]) == pytest.approx(fit.gamma_s * x[2], rel=1e-12)
    assert list(fit.residuals) == pytest.approx(_residuals(0, _through_origin(x, ts), x, ts), rel=1e-9, abs=1e-12)


def test_omgs_comm_fit_clamped_slope_against_its_closed_form():
    """Eq. 11 with times that fall with the payload (noise on a latency-bound link): β = 0 and α is
    the relative-weighted mean time."""
    nbytes = [800.0, 3200.0, 12800.0, 51200.0]
    ts = [4.1e-4, 3.9e-4, 3.6e-4, 3.7e-4]
    _, b = _normal(nbytes, ts)
    assert b < 0
    fit = fit_comm(nbytes, ts)
    assert fit.clamped == "slope" and fit.slope == 0.0
    assert fit.intercept == pytest.approx(float(_flat(ts)), rel=1e-12)
