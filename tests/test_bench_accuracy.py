"""lightning_gc.bench.accuracy: the accuracy table over seeds built from bench documents.

Oracles: hand-made documents whose curves, bytes and finals give every table entry by hand
(interpolation, means, DDP spread, tolerance, direction of "worse")."""

from __future__ import annotations

import json

import pytest

from lightning_gc.bench.accuracy import ADAMW_TABLE_METHODS, AccuracyError, accuracy_rows, main, metric_at
from lightning_gc.bench.methods import parse_methods


def _result(label, curve, bytes_per_step=1000.0, status="ok", error=None):
    return {"label": label, "status": status, "error": error, "final_metric": curve[-1][1] if curve else None,
            "bytes_per_step": bytes_per_step, "wire_bytes_per_step": None,
            "metric_curve": [{"step": 10 * (i + 1), "train_time_s": t, "value": v} for i, (t, v) in enumerate(curve)]}


def _doc(seed, results, mode="min", steps=600):
    return {"config": {"seed": seed, "preset": "gpt", "preset_args": {}, "ranks": 4, "hosts": 4, "bandwidth": "100mbit",
                       "schedule_spec": None, "steps": steps, "eval_every": 50, "val_batches": 16, "network": "netns",
                       "metric": "val_bpb", "mode": mode, "command": f"lightning-gc bench --seed {seed}"},
            "emulated": True, "network": {"reason": None}, "results": results}


def test_metric_at_interpolates_holds_the_end_and_knows_nothing_before_the_first_evaluation():
    curve = [{"train_time_s": 10.0, "value": 4.0}, {"train_time_s": 20.0, "value": 3.0},
             {"train_time_s": 40.0, "value": 2.0}]
    assert metric_at(curve, 15.0) == pytest.approx(3.5)
    assert metric_at(curve, 25.0) == pytest.approx(3.0 - 1.0 * 5 / 20)  # 2.75
    assert metric_at(curve, 40.0) == 2.0 and metric_at(curve, 99.0) == 2.0
    assert metric_at(curve, 9.9) is None and metric_at([], 5.0) is None


def test_rows_by_hand_for_a_min_metric():
    docs = [
        _doc(0, [_result("ddp", [(50, 3.0), (100, 2.40)], 2000.0), _result("topk", [(30, 3.2), (60, 2.50)], 100.0),
                 _result("osp", [], status="error", error="refused: Adam")]),
        _doc(1, [_result("ddp", [(60, 3.1), (120, 2.42)], 2000.0), _result("topk", [(40, 3.3), (80, 2.43)], 120.0),
                 _result("osp", [], status="error", error="refused: Adam")]),
    ]
    rows, summary = accuracy_rows(docs)
    spread = 2.42 - 2.40
    assert summary["ddp_spread"] == pytest.approx(spread)
    assert summary["tolerance"] == pytest.approx(3 * spread)
    assert summary["budget_s"] == pytest.approx((100 + 120) / 2)  # DDP's mean training time
    ddp, topk, osp = rows
    assert ddp.final_mean == pytest.approx(2.41) and ddp.delta_vs_ddp == pytest.approx(0.0) and ddp.within_tolerance
    assert topk.finals == [2.50, 2.43] and topk.final_mean == pytest.approx(2.465)
    assert topk.delta_vs_ddp == pytest.approx(2.465 - 2.41)  # 0.055 worse, tolerance 0.06: within
    assert topk.within_tolerance is True
    assert topk.at_budget == [2.50, 2.43]  # both finished before the 110 s budget
    # DDP seed 0 ended at 100 s (held); seed 1 is between (60 s, 3.1) and (120 s, 2.42) at 110 s
    assert ddp.at_budget == pytest.approx([2.40, 3.1 - 0.68 * 50 / 60])
    assert topk.bytes_per_step == pytest.approx(110.0) and topk.bytes_ratio_vs_ddp == pytest.approx(110 / 2000)
    assert osp.final_mean is None and osp.within_tolerance is None and "refused: Adam" in osp.errors[0]
    rows, summary = accuracy_rows(docs, tolerance=0.05, budget_s=55.0)
    assert rows[1].within_tolerance is False  # 0.055 > 0.05
    # at 55 s: ddp seed 0 between (50, 3.0) and (100, 2.4); seed 1 has no evaluation yet
    assert rows[0].at_budget[0] == pytest.approx(3.0 - 0.6 * 5 / 50) and rows[0].at_budget[1] is None
    assert rows[0].at_budget_mean is None  # not every seed has a value


def test_a_max_metric_counts_lower_as_worse():
    docs = [_doc(0, [_result("ddp", [(10, 0.90)]), _result("qsgd", [(10, 0.95)])], mode="max"),
            _doc(1, [_result("ddp", [(10, 0.80)]), _result("qsgd", [(10, 0.70)])], mode="max")]
    rows, summary = accuracy_rows(docs, tolerance_k=1.0)
    assert summary["tolerance"] == pytest.approx(0.10)
    assert rows[1].delta_vs_ddp == pytest.approx(0.85 - 0.825)  # mean 0.825 vs DDP 0.85: 0.025 worse
    assert rows[1].within_tolerance is True


def test_documents_that_differ_beyond_the_seed_are_refused():
    a = _doc(0, [_result("ddp", [(10, 2.0)])])
    with pytest.raises(AccuracyError, match="at least 2 seeds"):
        accuracy_rows([a])
    with pytest.raises(AccuracyError, match=r"seed 0: method\(s\) \['ddp'\] appear in two documents"):
        accuracy_rows([a, _doc(0, [_result("ddp", [(10, 2.0)])]), _doc(1, [_result("ddp", [(10, 2.0)])])])
    with pytest.raises(AccuracyError, match=r"at least 2 seeds; got seed\(s\) \[0\]"):
        accuracy_rows([a, _doc(0, [_result("topk", [(10, 2.0)])])])
    with pytest.raises(AccuracyError, match="'steps': \\(600, 400\\)"):
        accuracy_rows([a, _doc(1, [_result("ddp", [(10, 2.0)])], steps=400)])
    with pytest.raises(AccuracyError, match="same --methods"):
        accuracy_rows([a, _doc(1, [_result("ddp", [(10, 2.0)]), _result("topk", [(10, 2.0)])])])
    with pytest.raises(AccuracyError, match="successful 'ddp'"):
        accuracy_rows([_doc(0, [_result("topk", [(10, 2.0)])]), _doc(1, [_result("topk", [(10, 2.0)])])])


def test_documents_of_one_seed_are_merged():
    """A later run of more methods with the same settings adds rows; DDP's budget and spread
    still come from the seed's DDP, whichever document holds it."""
    docs = [_doc(0, [_result("ddp", [(50, 3.0), (100, 2.40)], 2000.0)]),
            _doc(1, [_result("ddp", [(60, 3.1), (120, 2.42)], 2000.0)]),
            _doc(1, [_result("marsit", [(40, 3.3), (90, 2.60)], 50.0)]),
            _doc(0, [_result("marsit", [(30, 3.2), (80, 2.50)], 70.0)])]
    rows, summary = accuracy_rows(docs)
    assert [r.label for r in rows] == ["ddp", "marsit"] and summary["seeds"] == [0, 1]
    assert summary["budget_s"] == pytest.approx(110.0) and summary["ddp_spread"] == pytest.approx(0.02)
    marsit = rows[1]
    assert marsit.finals == [2.50, 2.60] and marsit.delta_vs_ddp == pytest.approx(2.55 - 2.41)
    assert marsit.bytes_per_step == pytest.approx(60.0) and marsit.within_tolerance is False  # 0.14 > 0.06
    with pytest.raises(AccuracyError, match="same --methods"):  # seed 1 lacks the extra run
        accuracy_rows(docs[:3])


def test_cli_writes_the_table_and_the_method_list_parses(tmp_path, capsys):
    paths = []
    for seed, final in ((0, 2.40), (1, 2.42)):
        p = tmp_path / f"s{seed}.json"
        p.write_text(json.dumps(_doc(seed, [_result("ddp", [(100, final)], 2000.0)])))
        paths.append(str(p))
    out = tmp_path / "table.md"
    assert main([*paths, "--out", str(out)]) == 0
    text = out.read_text()
    assert "| `ddp` | 2.400 / 2.420 | 2.410 | +0.000 | yes |" in text and "Tolerance 0.0600" in text
    assert main([paths[0]]) == 2 and "at least 2 seeds" in capsys.readouterr().err
    assert main(["--methods"]) == 0 and capsys.readouterr().out.strip() == ADAMW_TABLE_METHODS
    labels = [s.label for s in parse_methods(ADAMW_TABLE_METHODS, default_ratio=0.01)]
    assert labels[:3] == ["ddp", "fp16", "powersgd"] and len(labels) == len(set(labels)) == 23
    assert "lowrank" in labels and labels[-1] == "auto"
