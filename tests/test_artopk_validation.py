"""The AR-Topk validation report: predictions from the probed model next to measurements."""

from __future__ import annotations

import pytest

from lightning_gc.bench.artopk_validation import _analyse, markdown, summarise
from lightning_gc.comm.cost_model import NetworkModel


def _doc(ag_step, ring_step, tree_step, auto_step, choices, alpha=1e-3, beta=8e-8, comm=(0.05, 0.04, 0.06)):
    def r(label, step, **kw):
        return {"label": label, "status": "ok", "step_time_s": step, **kw}

    return {
        "emulated": True,
        "results": [
            r("ddp", 1.0),
            r("topk:ratio=0.01", ag_step, comm_time_s=comm[0]),
            r("star_topk:ratio=0.01:collective=art_ring", ring_step, comm_time_s=comm[1]),
            r("star_topk:ratio=0.01:collective=art_tree", tree_step, comm_time_s=comm[2]),
            r("artopk_auto:ratio=0.01", auto_step, collective_choices=choices, predicted_comm_s=0.04,
              exchange_comm_s=0.05, network_model={"alpha_s": alpha, "beta_s_per_byte": beta}),
        ],
    }


def test_analyse_predictions_fastest_and_auto_ratio():
    numel = 1_000_000
    row = _analyse(_doc(0.5, 0.3, 0.4, 0.33, {"allgather": 0, "art_ring": 9, "art_tree": 1}), "mlp", "100mbit", 0.01,
                   numel, 4)
    model = NetworkModel(1e-3, 8e-8)
    costs = model.sparse_costs(4 * numel, 4, 0.01)
    for coll in ("allgather", "art_ring", "art_tree"):
        assert row["collectives"][coll]["predicted_s"] == pytest.approx(costs[coll])
    assert row["model_choice"] == model.choose_sparse_collective(4 * numel, 4, 0.01)
    assert row["fastest"] == "art_ring" and row["auto_choice"] == "art_ring" and row["auto_is_fastest"]
    assert row["auto_vs_fastest"] == pytest.approx(0.33 / 0.3)
    assert row["star_art_ring_vs_ddp"] == pytest.approx(0.3)


def test_summary_counts_and_median_error():
    rows = [
        _analyse(_doc(0.5, 0.3, 0.4, 0.33, {"art_ring": 5}), "mlp", "1gbit", 0.1, 10_000, 4),
        _analyse(_doc(0.2, 0.3, 0.4, 0.5, {"art_tree": 5}), "mlp", "1gbit", 0.01, 10_000, 4),
    ]
    s = summarise(rows)
    assert s["configurations"] == 2
    assert s["auto_fastest_fraction"] == 0.5
    assert s["auto_vs_fastest_max"] == pytest.approx(2.5)
    assert s["median_relative_comm_error"] is not None and s["median_relative_comm_error"] > 0
    assert "| mlp | 1gbit | 0.1 |" in markdown(rows, s)


def test_predicted_over_measured_per_collective_by_hand():
    # alpha 1 ms, beta 8e-8 s/B, numel 1e6 (M*c = 40 kB at c = 0.01), N = 4 (L = 2):
    # AG = 2e-3 + 2*40e3*8e-8*3 = 0.0212 s against 0.05 s measured;
    # ring = 1e-3*(6+2) + 40e3*8e-8*(1.5+2) = 0.0192 s against 0.04 s;
    # tree = 3e-3*2 + 3*40e3*8e-8*2 = 0.0252 s against 0.06 s
    row = _analyse(_doc(0.5, 0.3, 0.4, 0.33, {"art_ring": 5}), "mlp", "100mbit", 0.01, 1_000_000, 4)
    got = {c: row["collectives"][c]["predicted_over_measured"] for c in ("allgather", "art_ring", "art_tree")}
    assert got == pytest.approx({"allgather": 0.0212 / 0.05, "art_ring": 0.0192 / 0.04, "art_tree": 0.0252 / 0.06})
    other = _analyse(_doc(0.5, 0.3, 0.4, 0.33, {"art_ring": 5}, comm=(0.1, 0.02, 0.03)), "mlp", "100mbit", 0.01,
                     1_000_000, 4)
    med = summarise([row, other])["median_predicted_over_measured"]
    assert med["allgather"] == pytest.approx((0.0212 / 0.05 + 0.0212 / 0.1) / 2)
    assert med["art_tree"] == pytest.approx((0.0252 / 0.06 + 0.0252 / 0.03) / 2)
