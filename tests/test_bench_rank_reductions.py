"""The bench's reductions over ranks (``bench.runner.aggregate``) on ranks that differ.

Every rank writes its own step times, evaluations and engine counters; ``aggregate`` reduces them
to one result. Fixtures where all ranks report the same numbers cannot tell a maximum from a
minimum, or the mean over ranks from rank 0's value. Here each rank reports different numbers and
every expected figure is computed by hand in the test (written out as literals), following
docs/bench.md: a step's and an evaluation's training time is the **slowest** rank's, the task
metric is the **mean over the ranks** that report one, the time to target is the slowest rank's
training time at the first evaluation whose mean meets the target.
"""

from __future__ import annotations

import pytest

from lightning_gc.bench.methods import MethodSpec
from lightning_gc.bench.runner import aggregate


def _rank(g: int, pph: int, step_times: list[float], evals: list[dict], *, engine: dict | None = None,
          omgs: dict | None = None, mode: str = "max") -> dict:
    return {
        "global_rank": g, "node_rank": g // pph, "local_rank": g % pph, "steps_done": len(step_times),
        "step_times": step_times, "compute_times": [0.1], "tx_window": None, "tx_window_s": None,
        "tx_val_excluded": 0, "engine_window": engine, "engine_totals": None, "powersgd_numel_window": None,
        "powersgd_model_elements": None, "evals": evals, "comm_hook": None, "num_params": 1000,
        "metric": "val_acc" if mode == "max" else "val_loss", "mode": mode, "target": None, "batch_size": 32,
        "threads": 1, **({"omgs": omgs} if omgs is not None else {}),
    }


LAYOUT = {"steps": 5, "warmup": 1, "ranks": 3, "hosts": 1, "procs_per_host": 3, "schedule": None, "boundaries": []}
STEPS = [1.0, 0.5, 0.5, 0.5, 0.5]


def _ev(step: int, t: float, v: float | None) -> dict:
    return {"step": step, "train_time_s": t, "value": v}


# Three ranks, two evaluations each. Rank 1 is the slowest at the first evaluation, rank 2 at the
# second; rank 0 is the fastest at both and its metric is the lowest.
EVALS = [
    [_ev(2, 1.0, 0.70), _ev(5, 2.0, 0.80)],
    [_ev(2, 1.6, 0.90), _ev(5, 2.9, 0.95)],
    [_ev(2, 1.3, 0.80), _ev(5, 3.1, 0.86)],
]


def test_the_metric_curve_takes_the_slowest_ranks_time_and_the_mean_over_ranks():
    ranks = [_rank(g, 3, STEPS, EVALS[g]) for g in range(3)]
    res = aggregate(MethodSpec("ddp"), ranks, LAYOUT, count_wire=False, target=0.85)
    curve = res["metric_curve"]
    assert [pt["step"] for pt in curve] == [2, 5]
    assert [pt["train_time_s"] for pt in curve] == [1.6, 3.1]  # max(1.0, 1.6, 1.3), max(2.0, 2.9, 3.1)
    assert curve[0]["value"] == pytest.approx((0.70 + 0.90 + 0.80) / 3)  # 0.80
    assert curve[1]["value"] == pytest.approx((0.80 + 0.95 + 0.86) / 3)  # 0.87
    assert res["final_metric"] == pytest.approx(0.87)
    # 0.85 is met first by the mean at step 5 (rank 1 alone meets it at step 2, rank 0 never does):
    # the slowest rank's training time there
    assert res["time_to_target_s"] == pytest.approx(3.1)


def test_a_rank_without_a_value_is_left_out_of_the_mean_but_not_out_of_the_time():
    evals = [list(e) for e in EVALS]
    evals[1] = [_ev(2, 1.6, None), _ev(5, 2.9, 0.95)]  # rank 1 logged no metric at step 2
    ranks = [_rank(g, 3, STEPS, evals[g]) for g in range(3)]
    curve = aggregate(MethodSpec("ddp"), ranks, LAYOUT, count_wire=False, target=None)["metric_curve"]
    assert curve[0]["value"] == pytest.approx((0.70 + 0.80) / 2)
    assert curve[0]["train_time_s"] == 1.6


def test_a_min_metric_is_reached_when_the_mean_over_ranks_falls_to_the_target():
    """``mode="min"`` (a loss): rank 0 alone is below the target at step 2; the mean first is at step 5."""
    evals = [
        [_ev(2, 0.9, 0.30), _ev(5, 1.8, 0.20)],
        [_ev(2, 1.2, 0.60), _ev(5, 2.5, 0.30)],
    ]
    layout = dict(LAYOUT, ranks=2, procs_per_host=2)
    ranks = [_rank(g, 2, STEPS, evals[g], mode="min") for g in range(2)]
    res = aggregate(MethodSpec("ddp"), ranks, layout, count_wire=False, target=0.4)
    assert [pt["value"] for pt in res["metric_curve"]] == [pytest.approx(0.45), pytest.approx(0.25)]
    assert res["time_to_target_s"] == pytest.approx(2.5)
    assert res["final_metric"] == pytest.approx(0.25)


def test_step_times_engine_counters_and_omgs_windows_reduce_per_rank():
    """Per step the slowest rank; engine bytes: the mean over ranks per measured step; compressed
    steps: the fewest any rank took; OMGS's measured backward window: the slowest rank per step,
    then the median over the measured steps."""
    times = [[1.0, 0.2, 0.9, 0.3, 0.4], [2.0, 0.7, 0.1, 0.3, 0.8], [0.5, 0.4, 0.4, 1.1, 0.2]]
    engines = [{"steps": 4.0, "bytes_sent": 4000.0, "compressed_steps": 4},
               {"steps": 4.0, "bytes_sent": 8000.0, "compressed_steps": 3},
               {"steps": 4.0, "bytes_sent": 1600.0, "compressed_steps": 4}]
    measured = [[9.0, 0.10, 0.30, 0.20, 0.05], [9.0, 0.20, 0.10, 0.25, 0.40], [9.0, 0.05, 0.05, 0.60, 0.10]]
    ranks = [_rank(g, 3, times[g], EVALS[g], engine=engines[g],
                   omgs={"predicted_s": 0.2, "measured_s": measured[g]}) for g in range(3)]
    res = aggregate(MethodSpec("topk", {"ratio": 0.01}, gc=True), ranks, LAYOUT, count_wire=False, target=None)
    assert res["step_times_s"] == [2.0, 0.7, 0.9, 1.1, 0.8]
    assert res["step_time_s"] == pytest.approx(0.85)  # median of the window 0.7, 0.9, 1.1, 0.8
    assert res["bytes_per_step"] == pytest.approx((4000 + 8000 + 1600) / 3 / 4)
    assert res["engine_compressed_steps"] == 3
    # per step max over ranks: 0.2, 0.3, 0.6, 0.4 (the last 4 = measured steps); median 0.35
    assert res["omgs"]["measured_median_s"] == pytest.approx(0.35)
