"""``--repeat``: rounds of the method list combined per method (lightning_gc/bench/repeats.py).

The oracle is hand arithmetic on made-up rounds: which round's step is the low median, the median
of the per-round ratios (not the ratio of the medians), an unreached target counted as infinitely
slow, a round without a reference left out."""

from __future__ import annotations

import copy

import pytest

from lightning_gc.bench import report
from lightning_gc.bench.repeats import combine_rounds
from lightning_gc.bench.runner import BenchConfig, BenchError, add_ratios, build_document, prepare, resolve


def _res(method, step, ttt=None, final=0.9, label=None, status="ok"):
    return {"method": method, "label": label or method, "options": {}, "status": status,
            "error": None if status == "ok" else "boom", "step_time_s": step, "step_time_iqr_s": 0.0,
            "step_time_mean_s": step, "compute_time_s": 0.001, "comm_exposed_s": step - 0.001 if step else None,
            "bytes_per_step": 100.0, "wire_bytes_per_step": None, "final_metric": final, "time_to_target_s": ttt,
            "floor_s": 0.001, "ratio_vs_ddp": None, "time_to_target_ratio_vs_ddp": None,
            "step_times_s": [step] * 3 if step else [], "metric_curve": [], "metric": "val_acc", "mode": "max",
            "target": 0.85}


def _rounds():
    # round k: (ddp, fp16, topk) steps and times to target
    table = [
        ((0.040, 2.0), (0.020, 1.0), (0.030, 1.5)),   # topk/fp16 = 1.5
        ((0.080, 4.0), (0.040, 2.0), (0.044, None)),  # machine twice as slow; topk did not reach: inf
        ((0.042, 2.1), (0.022, 1.1), (0.022, 1.0)),   # topk/fp16 = 1.0
    ]
    rounds = []
    for row in table:
        rnd = [_res(m, s, t) for m, (s, t) in zip(("ddp", "fp16", "topk"), row)]
        add_ratios(rnd)
        rounds.append(rnd)
    return rounds


def test_a_method_is_its_median_round_and_ratios_are_medians_of_within_round_ratios():
    rounds = _rounds()
    out = {r["label"]: r for r in combine_rounds(copy.deepcopy(rounds))}
    topk = out["topk"]
    # steps 0.030, 0.044, 0.022 -> low median 0.030, round 0
    assert topk["step_time_s"] == pytest.approx(0.030)
    assert topk["median_round"] == 0
    # within-round ratios to the best baseline (fp16 each round): 1.5, 1.1, 1.0 -> 1.1
    assert topk["ratio_vs_best_baseline"] == pytest.approx(1.1)
    # the ratio of the combined medians would be 0.030 / 0.022 = 1.36: not what is reported
    assert topk["ratio_vs_best_baseline"] != pytest.approx(0.030 / 0.022)
    # vs DDP: 0.75, 0.55, 0.5238 -> 0.55
    assert topk["ratio_vs_ddp"] == pytest.approx(0.044 / 0.080)
    # time to target 1.5, inf, 1.0 -> 1.5; its ratio: 1.5, inf, 0.909 -> 1.5
    assert topk["time_to_target_s"] == pytest.approx(1.5)
    assert topk["time_to_target_ratio_vs_best_baseline"] == pytest.approx(1.5)
    assert topk["time_to_target_ratio_vs_ddp"] == pytest.approx(0.75)
    assert [rd["step_time_s"] for rd in topk["rounds"]] == [0.030, 0.044, 0.022]
    # every round's own step times, not the median round's copied
    assert [rd["step_times_s"] for rd in topk["rounds"]] == [[0.030] * 3, [0.044] * 3, [0.022] * 3]
    assert topk["rounds"][1]["time_to_target_s"] is None
    # an even count: the low median is a measured round, never an average of two
    two = {r["label"]: r for r in combine_rounds(copy.deepcopy(rounds[:2]))}
    assert two["topk"]["step_time_s"] == pytest.approx(0.030)
    assert two["topk"]["ratio_vs_best_baseline"] == pytest.approx((1.5 + 1.1) / 2)
    # fp16 is the best baseline in every round
    assert out["fp16"]["best_baseline_step"] == "fp16"
    assert out["fp16"]["ratio_vs_best_baseline"] == pytest.approx(1.0)


def test_not_reaching_the_target_in_most_rounds_is_not_reached():
    rounds = _rounds()
    rounds[0][2]["time_to_target_s"] = None
    for rnd in rounds:
        add_ratios(rnd)
    topk = combine_rounds(rounds)[2]
    assert topk["time_to_target_s"] is None
    assert topk["time_to_target_ratio_vs_best_baseline"] is None


def test_a_round_without_a_reference_reaching_the_target_is_left_out_of_its_ratio():
    rounds = _rounds()
    for m in (0, 1):  # in round 2 neither DDP nor fp16 reached the target
        rounds[2][m]["time_to_target_s"] = None
    for rnd in rounds:
        add_ratios(rnd)
    topk = combine_rounds(rounds)[2]
    # rounds 0 and 1 only: 1.5 and inf -> median inf -> None? no: median of (1.5, inf) is inf
    assert topk["time_to_target_ratio_vs_best_baseline"] is None
    rounds[1][2]["time_to_target_s"] = 2.2  # now reached in round 1: 2.2 / 2.0 = 1.1
    for rnd in rounds:
        add_ratios(rnd)
    topk = combine_rounds(rounds)[2]
    assert topk["time_to_target_ratio_vs_best_baseline"] == pytest.approx((1.5 + 1.1) / 2)
    assert topk["time_to_target_ratio_vs_ddp"] == pytest.approx((0.75 + 0.55) / 2)


def test_a_method_that_failed_in_any_round_is_failed():
    rounds = _rounds()
    rounds[1][2] = _res("topk", None, status="error")
    add_ratios(rounds[1])
    topk = combine_rounds(rounds)[2]
    assert topk["status"] == "error"
    assert "round(s) [1] of 3" in topk["error"]
    assert [rd["status"] for rd in topk["rounds"]] == ["ok", "error", "ok"]


def test_rounds_must_run_the_same_methods():
    rounds = _rounds()
    rounds[1] = rounds[1][:2]
    with pytest.raises(ValueError, match="every round must run the same methods"):
        combine_rounds(rounds)


def test_the_document_and_report_of_three_rounds():
    cfg = BenchConfig(preset="quickstart", methods="ddp,fp16,topk", steps=10, warmup=3, repeat=3)
    r = resolve(cfg)
    rounds = [[_res(m, s, t) for m, (s, t) in zip(("ddp", "fp16", "topk:ratio=0.01"), row)] for row in
              (((0.04, 2.0), (0.02, 1.0), (0.03, 1.5)), ((0.08, 4.0), (0.04, 2.0), (0.044, None)),
               ((0.042, 2.1), (0.022, 1.1), (0.022, 1.0)))]
    doc = build_document(cfg, r, rounds, {"mode": "loopback"}, 0.0)
    report.validate_document(doc)
    assert doc["config"]["rounds"] == 3
    md = report.markdown(doc)
    assert "**3 rounds**" in md and "## Rounds" in md
    topk_row = next(line for line in md.splitlines() if line.startswith("| `topk:ratio=0.01` | *30.0 ms"))
    assert "(1.5×)" in topk_row and "44.0 ms (1.1×)" in topk_row and "not reached" in topk_row
    sweep = report.sweep_markdown(report.sweep_document([doc, doc], ["1gbit", "20mbit"]))
    assert "3 rounds each, `--repeat`" in sweep
    one = build_document(cfg, r, rounds[:1], {"mode": "loopback"}, 0.0)
    assert "## Rounds" not in report.markdown(one) and "rounds" not in one["results"][0]
    assert "rounds each" not in report.sweep_markdown(report.sweep_document([one], ["1gbit"]))


def test_repeat_is_validated_and_refused_for_a_prepared_cluster(tmp_path):
    with pytest.raises(BenchError, match=r"--repeat=0 must be an integer >= 1"):
        resolve(BenchConfig(preset="quickstart", methods="ddp", repeat=0))
    with pytest.raises(BenchError, match=r"--repeat 2 \(or --seeds\) with --prepare"):
        prepare(BenchConfig(preset="quickstart", methods="ddp", repeat=2), str(tmp_path), log=lambda _: None)
    with pytest.raises(BenchError, match=r"--repeat 2 \(or --seeds\) with --prepare"):
        prepare(BenchConfig(preset="quickstart", methods="ddp", seeds=(0, 1)), str(tmp_path), log=lambda _: None)


def test_seeds_run_one_round_per_seed_and_each_round_trains_with_its_own(monkeypatch, tmp_path):
    """``--seeds 3,5``: two rounds; every method of round k is launched with seed k's value (what the
    workers read), the round summaries and the document name the seeds, and the report heads each
    round with its seed. The oracle is the seed each launch received, recorded by a stand-in launcher."""
    from lightning_gc.bench import runner

    launched: list[tuple[str, int]] = []

    def fake_run_method(spec, index, cfg, r, cluster, run_dir, log):
        launched.append((spec.label, runner.worker_config(spec, cfg, r, run_dir, ifname=None,
                                                          with_schedule=False)["seed"]))
        return [{"target": 0.85}]

    ttt = {("ddp", 3): 2.0, ("topk:ratio=0.01", 3): 1.5, ("ddp", 5): 2.0, ("topk:ratio=0.01", 5): 3.0}
    monkeypatch.setattr(runner, "run_method", fake_run_method)
    monkeypatch.setattr(runner, "aggregate", lambda spec, rr, r, count_wire, target:
                        _res(spec.method, 0.02, ttt[(spec.label, launched[-1][1])], label=spec.label))
    cfg = BenchConfig(preset="quickstart", methods="ddp,topk", steps=10, warmup=3, seeds=(3, 5), network="loopback")
    r = resolve(cfg)
    assert r["repeat"] == 2 and r["seeds"] == [3, 5]
    rounds = [[runner._run_one(s, i, k, cfg, r, None, str(tmp_path), False, lambda _: None)
               for i, s in enumerate(r["specs"])] for k in range(2)]
    assert launched == [("ddp", 3), ("topk:ratio=0.01", 3), ("ddp", 5), ("topk:ratio=0.01", 5)]
    doc = build_document(cfg, r, rounds, {"mode": "loopback"}, 0.0)
    report.validate_document(doc)
    assert doc["config"]["seeds"] == [3, 5]
    topk = next(x for x in doc["results"] if x["method"] == "topk")
    assert [(x["seed"], x["time_to_target_ratio_vs_ddp"]) for x in topk["rounds"]] == [(3, 0.75), (5, 1.5)]
    md = report.markdown(doc)
    assert "| method | round 1 (seed 3) | round 2 (seed 5) |" in md and "(`--seeds`)" in md
    # --seed alone: every round the same seed, headed as before
    same = resolve(BenchConfig(preset="quickstart", methods="ddp", seed=4, repeat=2))
    assert same["seeds"] == [4, 4]


def test_seeds_are_validated():
    with pytest.raises(BenchError, match="--repeat 2 with --seeds 0,1"):
        resolve(BenchConfig(preset="quickstart", methods="ddp", seeds=(0, 1), repeat=2))
    with pytest.raises(BenchError, match="--seeds is empty"):
        resolve(BenchConfig(preset="quickstart", methods="ddp", seeds=()))
    with pytest.raises(BenchError, match=r"--seeds=-1 must be an integer >= 0"):
        resolve(BenchConfig(preset="quickstart", methods="ddp", seeds=(0, -1)))


def test_rounds_alternate_the_order_of_the_methods_and_keep_the_lists_order_in_the_document(monkeypatch):
    """``--repeat 3`` over three methods: round 1 launches them as listed, round 2 in reverse, round 3
    as listed (ABBA); every round's results, the combined rows and the report stay in the list's order,
    and each round entry records where the method ran. Oracle: the launches a stand-in launcher saw."""
    from lightning_gc.bench import runner

    launched: list[str] = []

    def fake_run_method(spec, index, cfg, r, cluster, run_dir, log):
        launched.append(spec.label)
        return [{"target": 0.85}]

    steps = {"ddp": 0.04, "fp16": 0.03, "topk:ratio=0.01": 0.02}
    monkeypatch.setattr(runner, "run_method", fake_run_method)
    monkeypatch.setattr(runner, "aggregate", lambda spec, rr, r, count_wire, target:
                        _res(spec.method, steps[spec.label], 10 * steps[spec.label], label=spec.label))
    cfg = BenchConfig(preset="quickstart", methods="ddp,fp16,topk", steps=10, warmup=3, repeat=3, network="loopback")
    doc = runner.run_bench(cfg, log=lambda _: None)
    labels = ["ddp", "fp16", "topk:ratio=0.01"]
    assert launched == labels + labels[::-1] + labels
    report.validate_document(doc)
    assert [x["label"] for x in doc["results"]] == labels
    for x in doc["results"]:
        k = labels.index(x["label"])
        assert [rd["position"] for rd in x["rounds"]] == [k, 2 - k, k]
        assert x["step_time_s"] == steps[x["label"]]  # each row still carries its own method's figures
        assert "position" not in x  # the order is a round's, not the combined row's
    assert runner.round_order(1, 1) == [0] and runner.round_order(4, 3) == [3, 2, 1, 0]
