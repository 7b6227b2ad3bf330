"""``lightning-gc bench --suite regress``: cases, ratios, the baseline comparison and its flags.

The comparison is checked against hand-made results (analytic ratios); the plumbing end to end by
one real ``--quick`` case through the CLI (two methods on 2 unshaped ranks), whose values are not
checked, only that every ratio and the baseline columns are there.
"""

from __future__ import annotations

import json

import pytest

from lightning_gc.bench import regress
from lightning_gc.bench.cli import main as bench_main
from lightning_gc.bench.runner import BenchConfig


def _result(label: str, step: float, floor: float = 1.0, exposed: float = 0.5) -> dict:
    return {"label": label, "status": "ok", "step_time_s": step, "floor_s": floor, "comm_exposed_s": exposed,
            "overhead_share": 0.01}


class FakeBench:
    """Stands in for runner.run_bench: a result per method of the config, step times from a table."""

    def __init__(self, steps: dict[str, float], fail: str | None = None) -> None:
        self.steps, self.fail, self.configs = steps, fail, []

    def __call__(self, cfg: BenchConfig, log=print) -> dict:
        self.configs.append(cfg)
        results = []
        for m in cfg.methods.split(","):
            r = _result(m, self.steps.get(m, 1.0), floor=0.5, exposed=self.steps.get(m, 1.0) - 0.25)
            if m == self.fail:
                r = {"label": m, "status": "error"}
            results.append(r)
        return {"results": results}


def test_every_case_is_one_run_on_its_link_and_every_ratio_follows_from_the_results():
    steps = {"ddp": 2.0, "dense:sync=osp:osp_deferred_fraction=0.8": 1.8, "topk:ratio=0.01": 1.2,
             "powersgd:rank=1": 1.0, "topk:plan=threshold:overlap=false": 1.5, "topk:plan=threshold:overlap=true": 1.0,
             "fp16": 1.6, "auto": 1.7}
    bench = FakeBench(steps)
    rows, docs = regress.run_suite(regress.CASES, BenchConfig(preset="cnn", ranks=4, hosts=2), quick=False,
                                   run_bench=bench, log=lambda s: None)
    assert [c.bandwidth for c in bench.configs] == [c.bandwidth for c in regress.CASES]
    assert all(c.preset == "cnn" and c.ranks == 4 and c.hosts == 2 for c in bench.configs)
    assert all(c.eval_every == c.steps for c in bench.configs)  # one validation, at the end
    got = {r["ratio"]: r["value"] for r in rows}
    assert got == pytest.approx({
        "osp_step_vs_ddp": 1.8 / 2.0,
        "topk_overlap_step_vs_floor": 1.0 / 0.5,
        "topk_overlap_exposed_vs_sync": (1.0 - 0.25) / (1.5 - 0.25),
        "topk_step_vs_powersgd": 1.2 / 1.0,
        "auto_fast_step_vs_best_dense": 1.7 / 1.6,
        "auto_slow_step_vs_best": 1.7 / 1.0,
    })


def test_quick_runs_each_method_once_unshaped_and_never_flags():
    bench = FakeBench({})
    rows, _ = regress.run_suite(regress.CASES, BenchConfig(), quick=True, run_bench=bench, log=lambda s: None)
    (cfg,) = bench.configs
    methods = cfg.methods.split(",")
    assert len(methods) == len(set(methods)) == 8
    assert cfg.bandwidth is None and cfg.network == "loopback" and cfg.ranks == 2
    compared = regress.compare(rows, {"ratios": {r["ratio"]: {"value": 0.01} for r in rows}}, 0.1, quick=True)
    assert {r["flag"] for r in compared} == {"not compared"}


def test_a_ratio_worse_than_baseline_beyond_the_tolerance_is_flagged():
    rows = [{"case": "c", "ratio": name, "what": name, "value": v, "bound": None, "failed_methods": [],
             "overhead_share": {}} for name, v in (("a", 2.18), ("b", 2.22), ("c", 0.5), ("d", 1.0))]
    rows.append({**rows[0], "ratio": "e", "value": None, "failed_methods": ["auto"]})
    # the tolerance is relative: 2.18 is 9 % over 2.0 (ok), 2.22 is 11 % over (worse)
    base = {"ratios": {"a": {"value": 2.0}, "b": {"value": 2.0}, "c": {"value": 1.0}, "e": {"value": 1.0}}}
    flags = {r["ratio"]: r["flag"] for r in regress.compare(rows, base, 0.10, quick=False)}
    assert flags == {"a": "ok", "b": "worse", "c": "ok", "d": "no baseline", "e": "failed"}
    md = regress.markdown(regress.compare(rows, base, 0.10, quick=False), base, 0.10, quick=False)
    assert "**1 ratio(s) worse than the baseline**: b" in md
    assert "overhead above" not in md  # every share is under the 5 % bound here
    rows[0]["overhead_share"] = {"topk": 0.06, "ddp": None}
    md = regress.markdown(regress.compare(rows, base, 0.10, quick=False), base, 0.10, quick=False)
    assert "Engine overhead above 5% of the step: c/topk 6.0%." in md


def test_a_failed_method_leaves_its_case_without_ratio():
    bench = FakeBench({}, fail="powersgd:rank=1")
    (case,) = regress.select("topk_powersgd")
    rows, _ = regress.run_suite((case,), BenchConfig(), quick=False, run_bench=bench, log=lambda s: None)
    assert rows[0]["value"] is None and rows[0]["failed_methods"] == ["powersgd"]


def test_the_recorded_baseline_names_its_date_machine_and_known_ratios():
    doc = regress.load_baseline(regress.DEFAULT_BASELINE)
    assert doc["date"] and doc["machine"] and doc["source"]
    names = {r.name for c in regress.CASES for r in c.ratios}
    assert set(doc["ratios"]) <= names
    with pytest.raises(regress.RegressError, match="unknown case"):
        regress.select("osp,nope")


def test_the_cli_refuses_what_the_suite_fixes_and_suite_options_without_it(capsys):
    assert bench_main(["--suite", "regress", "--steps", "5"]) == 2
    assert "drop --steps" in capsys.readouterr().err
    assert bench_main(["--quick"]) == 2
    assert "only apply with --suite" in capsys.readouterr().err


def test_quick_case_end_to_end_through_the_cli(tmp_path, capsys):
    out = tmp_path / "regress.json"
    code = bench_main(["--suite", "regress", "--quick", "--cases", "topk_powersgd", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["ratio"] == "topk_step_vs_powersgd" and row["value"] is not None and row["value"] > 0
    assert {"baseline", "vs_baseline", "flag"} <= set(row) and row["flag"] == "not compared"
    assert "| case | ratio | value | baseline | value / baseline | bound | flag |" in text
    topk = doc["documents"][0]["results"][0]
    assert topk["overhead_s"] is not None  # the engine's own time reached the report
