"""engine.agreement.agree_values: the one helper behind the controllers' agreed figures.

Three spawned gloo ranks with rank-dependent values (no rank largest in every element), checked
against MAX / SUM / MEAN computed by hand from every rank's values."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed

from lightning_gc.engine.agreement import agree_values


def _values(rank: int) -> list[float]:
    return [(1.0, 5.0, -2.0)[rank], (4.0, 0.5, 3.0)[rank], 0.25 * rank]


def _worker(rank: int, ws: int) -> dict:
    v = _values(rank)
    return {op: agree_values(v, op) for op in ("max", "sum", "mean")}


def test_max_sum_and_mean_over_ranks_equal_hand_values_on_every_rank():
    res = run_distributed(_worker, 3, timeout=120)
    cols = list(zip(*[_values(r) for r in range(3)]))
    want = {"max": [max(c) for c in cols], "sum": [sum(c) for c in cols], "mean": [sum(c) / 3 for c in cols]}
    for r, got in enumerate(res):
        for op in want:
            assert got[op] == pytest.approx(want[op], rel=1e-15), (r, op)
    assert res[0] == res[1] == res[2]


def test_without_a_process_group_the_values_come_back_and_a_bad_op_is_refused():
    assert agree_values([1, 2.5], "max") == [1.0, 2.5]
    with pytest.raises(ValueError, match="op='min'"):
        agree_values([1.0], "min")
