"""OMGS planners against brute force over every contiguous partition (the timeline model is the
oracle's own, independent enumeration), plus the timeline model against hand-computed cases."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from lightning_gc.plans import build_plan
from lightning_gc.plans.base import ParamFacts, PlanRequest
from lightning_gc.plans.omgs import (
    OMGSCost,
    fewest_groups_partition,
    find_merged_layers,
    modelled_iteration_time,
    optimal_partition,
    partition_from_plan,
    predict_plan,
    timeline,
)


def all_partitions(n: int):
    """Every composition of n (2^(n-1) of them), from the cut positions."""
    for cuts in itertools.product((0, 1), repeat=n - 1):
        sizes, run = [], 1
        for c in cuts:
            if c:
                sizes.append(run)
                run = 1
            else:
                run += 1
        sizes.append(run)
        yield sizes


def brute_force(b, d, ts, tc, mode):
    best, arg = math.inf, None
    for part in all_partitions(len(b)):
        t = modelled_iteration_time(part, b, ts, tc, numels=d, sparsify_on=mode)
        if t < best - 1e-15:
            best, arg = t, part
    return best, arg


def random_case(rng: random.Random, n: int):
    b = [rng.uniform(0.1e-3, 5e-3) * rng.choice((0.1, 1, 1, 3)) for _ in range(n)]
    d = [int(10 ** rng.uniform(3, 6.5)) for _ in range(n)]
    cost = OMGSCost(
        gamma_s=10 ** rng.uniform(-10, -7), ratio=rng.choice((0.001, 0.01, 0.1)),
        alpha_s=10 ** rng.uniform(-5, -2.3), beta_s_per_byte=10 ** rng.uniform(-10, -7),
        payload_bytes_per_element=8 * 0.01, sparsify_intercept_s=rng.choice((0.0, 1e-4)),
    )
    return b, d, cost


def test_timeline_hand_computed():
    # two tensors, b = 1, 2 s; t_s = D/10 s, t_c = 1 + D/100 s with D = 10 and 20 elements
    ts = lambda D: D / 10  # noqa: E731
    tc = lambda D: 1 + D / 100  # noqa: E731
    b, d = [1.0, 2.0], [10, 20]
    # paper mode, unmerged: compute 1 | s 1 -> 2 | b 2 -> 4 | s 2 -> 6 ; comm: [2, 3.1], [6, 7.2]
    assert modelled_iteration_time([1, 1], b, ts, tc, numels=d, sparsify_on="compute") == pytest.approx(7.2)
    # paper mode, merged: compute 3, s 3 -> 6, comm 6 + 1.3
    assert modelled_iteration_time([2], b, ts, tc, numels=d, sparsify_on="compute") == pytest.approx(7.3)
    # worker mode, unmerged: ready 1, 3; worker [1, 1+1+1.1=3.1], [3.1, 3.1+2+1.2=6.3]
    assert modelled_iteration_time([1, 1], b, ts, tc, numels=d, sparsify_on="worker") == pytest.approx(6.3)
    # worker mode, merged: ready 3, 3 + 3 + 1.3
    assert modelled_iteration_time([2], b, ts, tc, numels=d, sparsify_on="worker") == pytest.approx(7.3)
    tl = timeline([1, 1], b, d, ts, tc, "compute")
    assert [g.comm_start_s for g in tl] == pytest.approx([2.0, 6.0])
    with pytest.raises(ValueError, match="summing to the number of tensors"):
        modelled_iteration_time([1], b, ts, tc, numels=d)
    with pytest.raises(ValueError, match="sparsify_on"):
        modelled_iteration_time([2], b, ts, tc, numels=d, sparsify_on="gpu")


@pytest.mark.parametrize("mode", ["worker", "compute"])
def test_exact_planner_matches_brute_force(mode):
    rng = random.Random(1234 if mode == "worker" else 4321)
    for trial in range(60):
        n = rng.randint(1, 11) if trial < 55 else 13
        b, d, cost = random_case(rng, n)
        want, _ = brute_force(b, d, cost.t_s, cost.t_c, mode)
        sizes, got = optimal_partition(b, d, cost.t_s, cost.t_c, mode)
        assert sum(sizes) == n
        # the returned partition really has the returned time, and it is the minimum
        assert modelled_iteration_time(sizes, b, cost.t_s, cost.t_c, numels=d, sparsify_on=mode) == pytest.approx(got)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (trial, n, sizes)


@pytest.mark.parametrize("mode", ["worker", "compute"])
@pytest.mark.parametrize("tol", [0.0, 0.02, 0.1])
def test_fewest_groups_within_tolerance_matches_brute_force(mode, tol):
    """Oracle: enumerate every partition, keep those within (1 + tol) of the minimum, take the fewest
    groups and, among those, the fastest. The programme must return that count and that time."""
    rng = random.Random(11)
    for _ in range(60):
        n = rng.randint(1, 9)
        b, d, cost = random_case(rng, n)
        times = [(modelled_iteration_time(p, b, cost.t_s, cost.t_c, numels=d, sparsify_on=mode), p)
                 for p in all_partitions(n)]
        limit = min(t for t, _ in times) * (1 + tol)
        ok = [(len(p), t) for t, p in times if t <= limit * (1 + 1e-12)]
        want_groups = min(g for g, _ in ok)
        want_time = min(t for g, t in ok if g == want_groups)
        got = fewest_groups_partition(b, d, cost.t_s, cost.t_c, limit, n, mode)
        assert got is not None
        sizes, t = got
        assert len(sizes) == want_groups and sum(sizes) == n
        assert t == pytest.approx(want_time, rel=1e-12)
        assert modelled_iteration_time(sizes, b, cost.t_s, cost.t_c, numels=d, sparsify_on=mode) == pytest.approx(t)
        if want_groups > 1:  # with fewer groups allowed than needed there is no answer
            assert fewest_groups_partition(b, d, cost.t_s, cost.t_c, limit, want_groups - 1, mode) is None


def _tie_request(exact_s: float, tol: float):
    """Six compressible tensors whose exchanges all finish before the last small tensor is ready
    (its exact allreduce, exact_s, then decides the step): every partition ties."""
    names = [f"w{i}" for i in range(6)] + ["bias_first_layer"]
    numels = [20_000] * 6 + [100]
    # registration order; backward runs in reverse, so the bias (registered last) is ready first —
    # put it first in registration order instead so that it is ready last
    names, numels = names[::-1], numels[::-1]
    ready = [0.070] + [0.010 * (6 - i) for i in range(6)]  # bias ready at 70 ms, weights 10..60 ms
    cost = OMGSCost(gamma_s=1e-9, ratio=0.01, alpha_s=1e-4, beta_s_per_byte=1e-9, payload_bytes_per_element=0.08,
                    exact_s=exact_s, tie_tolerance=tol)
    facts = tuple(ParamFacts(i, nm, k, r) for i, (nm, k, r) in enumerate(zip(names, numels, ready)))
    return PlanRequest(facts, cost=cost), names, numels, ready, cost


def test_ties_go_to_the_fewest_groups():
    request, names, numels, ready, cost = _tie_request(exact_s=0.05, tol=0.0)
    plan = build_plan(names, numels, kind="omgs", backward_s=ready, cost=cost)
    _, sizes = partition_from_plan(plan, request)
    assert sizes == [6]  # one group: every partition predicts max(M, 60 ms) + 50 ms
    t_plan, _ = predict_plan(plan, request)
    for kind in ("layer", "threshold"):
        t_other, _ = predict_plan(build_plan(names, numels, kind=kind, backward_s=ready, cost=cost), request)
        assert t_plan == pytest.approx(t_other)  # a tie indeed
    # without the exact group the minimum is strict and tolerance 0 keeps the optimum
    request0, *_ = _tie_request(exact_s=0.0, tol=0.0)
    plan0 = build_plan(names, numels, kind="omgs", backward_s=ready, cost=request0.cost)
    ordered, sizes0 = partition_from_plan(plan0, request0)
    b = [ordered[0].backward_s] + [y.backward_s - x.backward_s for x, y in zip(ordered, ordered[1:])]
    _, best = optimal_partition(b, [p.numel for p in ordered], cost.t_s, cost.t_c, "worker")
    assert predict_plan(plan0, request0)[0] == pytest.approx(best)
    assert len(sizes0) > 1


def test_paper_algorithm_is_not_always_optimal():
    """Algorithm 1 under its own (compute) model: record how often it misses the optimum."""
    rng = random.Random(7)
    misses, total = [], 0
    for _ in range(80):
        n = rng.randint(2, 10)
        b, d, cost = random_case(rng, n)
        want, _ = brute_force(b, d, cost.t_s, cost.t_c, "compute")
        sizes = find_merged_layers(b, d, cost.t_s, cost.t_c, cost.alpha_s)
        assert sum(sizes) == n
        got = modelled_iteration_time(sizes, b, cost.t_s, cost.t_c, numels=d, sparsify_on="compute")
        assert got >= want * (1 - 1e-12)  # never below the optimum (the model is the same)
        total += 1
        if got > want * (1 + 1e-9):
            misses.append((got / want, n))
    assert misses, "Algorithm 1 matched brute force on every case: the counterexample in docs/omgs.md is stale"
    assert len(misses) < total


def test_documented_counterexample():
    """The counterexample of docs/omgs.md: Algorithm 1 merges greedily and loses to the optimum."""
    b = [1.0, 1.0, 1.0]
    d = [100, 100, 100]
    ts = lambda D: 0.0  # noqa: E731
    tc = lambda D: 1.5 + 0.01 * D  # noqa: E731
    greedy = find_merged_layers(b, d, ts, tc, alpha_s=1.5)
    best, t_best = optimal_partition(b, d, ts, tc, "compute")
    t_greedy = modelled_iteration_time(greedy, b, ts, tc, numels=d, sparsify_on="compute")
    assert greedy == [3]
    assert best == [1, 2]
    assert t_best == pytest.approx(7.0) and t_greedy == pytest.approx(7.5)


def test_planner_registry_and_large_model_fast():
    rng = random.Random(3)
    n = 300
    names = [f"layer{i}.weight" for i in range(n)]
    numels = [int(10 ** rng.uniform(3.2, 6)) for _ in range(n)]
    ready = sorted(rng.uniform(0, 0.3) for _ in range(n))[::-1]  # registration order: last ready first
    cost = OMGSCost(gamma_s=2e-9, ratio=0.01, alpha_s=3e-4, beta_s_per_byte=2e-8, payload_bytes_per_element=0.08)
    t0 = time.perf_counter()
    plan = build_plan(names, numels, kind="omgs", backward_s=ready, cost=cost)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0  # generous (shared 2-core machine); docs report the typical figure
    request = PlanRequest(tuple(ParamFacts(i, nm, k, r) for i, (nm, k, r) in enumerate(zip(names, numels, ready))),
                          cost=cost)
    t_omgs, _ = predict_plan(plan, request)
    for kind in ("model", "layer", "threshold", "omgs_paper"):
        other = build_plan(names, numels, kind=kind, backward_s=ready, cost=cost)
        t_other, _ = predict_plan(other, request)
        assert t_omgs <= t_other * (1 + cost.tie_tolerance) * (1 + 1e-12), kind
    ordered, sizes = partition_from_plan(plan, request)
    assert [p.backward_s for p in ordered] == sorted(ready)
    assert sum(sizes) == n


def test_provisional_without_profile():
    plan = build_plan(["a", "b"], [5000, 5000], kind="omgs")
    assert plan.kind == "omgs:provisional"
    assert [g.numel for g in plan.groups] == [10000]  # the MGS threshold plan (8192 elements)


def test_plan_figure_draws_every_tensor_and_group():
    pytest.importorskip("matplotlib")
    from lightning_gc.callbacks.omgs_figure import plan_figure
    from lightning_gc.engine.omgs import OMGSState

    names = [f"w{i}" for i in range(5)]
    numels = [4000, 3000, 8000, 2000, 5000]
    ready = [0.005, 0.004, 0.003, 0.002, 0.001]
    cost = OMGSCost(gamma_s=1e-9, ratio=0.01, alpha_s=1e-3, beta_s_per_byte=1e-8, payload_bytes_per_element=0.08)
    plan = build_plan(names, numels, kind="omgs", backward_s=ready, cost=cost)
    request = PlanRequest(tuple(ParamFacts(i, n, k, r) for i, (n, k, r) in enumerate(zip(names, numels, ready))),
                          cost=cost)
    predicted, tl = predict_plan(plan, request)
    ordered, _ = partition_from_plan(plan, request)
    state = OMGSState(plan=plan, predicted_s=predicted, timeline=tl, predictions={"omgs": predicted},
                      ordered=[(p.name, p.numel, p.backward_s) for p in ordered])
    fig = plan_figure(state)
    ax = fig.axes[0]
    # one bar collection per tensor (backward lane) + two per group (sparsify, communicate)
    assert len(ax.collections) == len(names) + 2 * len(tl)
    assert len(ax.lines) == len(tl)  # one boundary per group
