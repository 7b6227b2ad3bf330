"""bench/advise_validation.py: the rows, the compute scale and the other_ms calibration, by hand.

advise itself is replaced by a stand-in whose predictions are a known function of its inputs, so
that what the validation passes to it (compute and codec scale, other_ms) and what it reports
(error = predicted / measured - 1, medians) can be checked against hand values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import lightning_gc.bench.advise as advise_mod
from lightning_gc.auto.model import MethodCost, Workload
from lightning_gc.bench import advise_validation as av

BASE_STEP = {"1gbit": 0.010, "20mbit": 0.050}  # the stand-in's raw prediction per link (any method)
SINGLE = Workload(0.001, (0.002,), (10,), 0.001)  # 4 ms of compute alone


def _fake_advise(calls):
    """Stand-ins for advise.run (one measurement: 4 ms of compute, a 1 ms codec per candidate) and
    advise.advise (a prediction that is a known function of what it is given)."""
    def run(preset, world_size, bandwidth, *, preset_args=None, candidates=(), repeats=3, seed=0, **kw):
        calls.append({"run": bandwidth, "candidates": list(candidates), "kw": kw})
        costs = [MethodCost(c, "bucket" if c == "ddp" else "allgather", 0.001) for c in candidates]
        return SimpleNamespace(workload=SINGLE, costs=costs, network=bandwidth, world_size=world_size,
                               progress_weight=1.0)

    def advise(workload, costs, network, world_size, progress_weight):
        compute = workload.forward_s + workload.backward_total_s + workload.optimizer_s
        calls.append({"compute_s": compute, "other_s": workload.other_s, "codec_s": [c.codec_s for c in costs]})
        preds = {c.name: SimpleNamespace(step_s=BASE_STEP[network] * (2 if c.name == "ddp" else 1) + compute
                                         + workload.other_s + c.codec_s) for c in costs}
        return min(preds, key=lambda k: preds[k].step_s), preds
    return run, advise


def _patch(monkeypatch, calls):
    run, advise = _fake_advise(calls)
    monkeypatch.setattr(advise_mod, "run", run)
    monkeypatch.setattr(advise_mod, "advise", advise)


def _run(link, steps, compute=0.008):
    return {"config": {"preset": "quickstart", "ranks": 4, "bandwidth": link, "preset_args": {}, "seed": 0,
                       "threads": 1},
            "results": [{"method": m, "label": m, "status": "ok", "step_time_s": s, "compute_time_s": compute}
                        for m, s in steps.items()]
            + [{"method": "topk", "label": "topk", "status": "failed", "step_time_s": None, "compute_time_s": None}]}


def test_rows_compare_the_modelled_candidate_with_the_measured_step(monkeypatch):
    calls: list = []
    _patch(monkeypatch, calls)
    res = av.validate_run(_run("20mbit", {"ddp": 0.125, "powersgd": 0.040, "lowrank": 0.060}))
    measured, given = calls
    assert measured["kw"] == {}  # measured once, unscaled
    assert measured["candidates"] == ["ddp", "lowrank"]  # powersgd is modelled by lowrank; failed runs left out
    assert given["compute_s"] == pytest.approx(0.008)  # scale 2 = 8 ms in the run / 4 ms alone
    assert given["codec_s"] == pytest.approx([0.002, 0.002]) and given["other_s"] == 0.0
    assert res["scale"] == pytest.approx(2.0)
    by = {r["method"]: r for r in res["rows"]}
    assert by["powersgd"]["model"] == "lowrank"
    # stand-in: 50 ms (100 for ddp) + 8 ms of compute + 2 ms of codec
    assert by["ddp"]["predicted_step_s"] == pytest.approx(0.110)
    assert by["ddp"]["error"] == pytest.approx(0.110 / 0.125 - 1)
    assert by["powersgd"]["error"] == pytest.approx(0.060 / 0.040 - 1)
    assert res["median_abs_error"] == pytest.approx(sorted(abs(r["error"]) for r in res["rows"])[1])


def test_other_from_calibrates_on_that_links_ddp_and_validates_the_others(monkeypatch):
    calls: list = []
    _patch(monkeypatch, calls)
    doc = {"schema": "lightning_gc.bench.sweep/1",
           "runs": [_run("1gbit", {"ddp": 0.030, "topk": 0.020}), _run("20mbit", {"ddp": 0.125, "topk": 0.060})]}
    # at 1gbit the stand-in predicts ddp 20 + 8 + 2 = 30 ms; measured 36 ms: other = 6 ms
    doc["runs"][0]["results"][0]["step_time_s"] = 0.036
    out = av.validate(doc, other_from="1gbit")
    assert [r["bandwidth"] for r in out] == ["20mbit"]
    assert out[0]["other_ms"] == pytest.approx(6.0)
    assert calls[-1]["other_s"] == pytest.approx(0.006)
    by = {r["method"]: r for r in out[0]["rows"]}
    assert by["ddp"]["predicted_step_s"] == pytest.approx(0.100 + 0.008 + 0.002 + 0.006)
    assert "DDP's step at 1gbit" in av.report(out)
    with pytest.raises(ValueError, match="no run on that link"):
        av.validate(doc, other_from="10mbit")
    with pytest.raises(ValueError, match="neither a bench run"):
        av.validate({"schema": "x"})


def test_a_run_on_hosts_is_advised_by_nodes_and_each_method_meets_its_column(monkeypatch):
    calls: list = []
    run, advise = _fake_advise(calls)

    def run_nodes(preset, world_size, bandwidth, *, preset_args=None, candidates=(), repeats=3, seed=0, **kw):
        base = run(preset, world_size, bandwidth, preset_args=preset_args, candidates=candidates, repeats=repeats,
                   seed=seed, **kw)
        if kw.get("ranks_per_node", 1) == 1:
            return base
        # stand-in topology table: flat 100 ms + index, by nodes 50 ms + index; qsgd refused by nodes
        rows = [SimpleNamespace(name=c, flat=SimpleNamespace(step_s=0.100 + i / 1e3),
                                nodes=None if c == "qsgd" else SimpleNamespace(step_s=0.050 + i / 1e3))
                for i, c in enumerate(candidates)]
        return SimpleNamespace(**vars(base), topology=SimpleNamespace(rows=rows, best=("topk", "nodes")))

    monkeypatch.setattr(advise_mod, "run", run_nodes)
    monkeypatch.setattr(advise_mod, "advise", advise)
    doc = _run("20mbit", {"fp16": 0.2, "topk": 0.1})
    doc["config"]["hosts"] = 2
    extra = [{"method": "topk", "label": "topk:topology=nodes", "options": {"topology": "nodes"}},
             {"method": "qsgd", "label": "qsgd:topology=nodes", "options": {"topology": "nodes"}},
             {"method": "topk", "label": "topk:ratio=0.1", "options": {"ratio": 0.1}},  # not a candidate: left out
             {"method": "qsgd", "label": "qsgd:topology=auto", "options": {"topology": "auto"}}]  # nor this
    doc["results"] += [{**e, "status": "ok", "step_time_s": 0.08, "compute_time_s": 0.008} for e in extra]
    res = av.validate_run(doc, intra_bandwidth="5gbit")
    told = calls[-1]["kw"]
    assert told["ranks_per_node"] == 2 and told["intra_bandwidth"] == "5gbit"
    assert told["compute_ms"] == pytest.approx(8.0) and told["codec_scale"] == pytest.approx(2.0)
    by = {r["method"]: r for r in res["rows"]}
    assert set(by) == {"fp16", "topk", "topk:topology=nodes"}  # qsgd refused by nodes: no prediction to meet
    names = calls[0]["candidates"]
    assert by["fp16"]["predicted_step_s"] == pytest.approx(0.100 + names.index("fp16") / 1e3)
    assert by["topk"]["predicted_step_s"] == pytest.approx(0.100 + names.index("topk") / 1e3)
    assert by["topk:topology=nodes"]["predicted_step_s"] == pytest.approx(0.050 + names.index("topk") / 1e3)
    assert by["topk:topology=nodes"]["error"] == pytest.approx((0.050 + names.index("topk") / 1e3) / 0.08 - 1)
    assert res["ranks_per_node"] == 2 and "by nodes: 2 ranks per emulated host" in av.report([res])
