"""bench/advise_validation.py: the rows, the compute scale and the other_ms calibration, by hand.

advise itself is replaced by a stand-in whose predictions are a known function of its inputs, so
that what the validation passes to it (compute and codec scale, other_ms) and what it reports
(error = predicted / measured - 1, medians) can be checked against hand values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import lightning_gc.auto.advise as advise_mod
from lightning_gc.auto.model import Workload
from lightning_gc.bench import advise_validation as av

BASE_STEP = {"1gbit": 0.010, "20mbit": 0.050}  # the stand-in's raw prediction per link (any method)
SINGLE = Workload(0.001, (0.002,), (10,), 0.001)  # 4 ms of compute alone


def _fake_run(calls):
    def run(preset, world_size, bandwidth, *, preset_args=None, candidates=(), repeats=3, seed=0, compute_scale=1.0,
            codec_scale=1.0, other_ms=None, **_):
        calls.append({"bandwidth": bandwidth, "compute_scale": compute_scale, "codec_scale": codec_scale,
                      "other_ms": other_ms, "candidates": list(candidates)})
        extra = (other_ms or 0.0) / 1e3 + 0.004 * (compute_scale - 1.0)
        preds = {c: SimpleNamespace(step_s=BASE_STEP[bandwidth] * (2 if c == "ddp" else 1) + extra) for c in candidates}
        return SimpleNamespace(workload=SINGLE, predictions=preds, pick=min(preds, key=lambda k: preds[k].step_s))
    return run


def _run(link, steps, compute=0.008):
    return {"config": {"preset": "quickstart", "ranks": 4, "bandwidth": link, "preset_args": {}, "seed": 0,
                       "threads": 1},
            "results": [{"method": m, "label": m, "status": "ok", "step_time_s": s, "compute_time_s": compute}
                        for m, s in steps.items()]
            + [{"method": "topk", "label": "topk", "status": "failed", "step_time_s": None, "compute_time_s": None}]}


def test_rows_compare_the_modelled_candidate_with_the_measured_step(monkeypatch):
    calls: list = []
    monkeypatch.setattr(advise_mod, "run", _fake_run(calls))
    res = av.validate_run(_run("20mbit", {"ddp": 0.125, "powersgd": 0.040, "lowrank": 0.060}))
    assert calls[0]["compute_scale"] == 1.0 and calls[1]["compute_scale"] == pytest.approx(2.0)  # 8 ms / 4 ms
    assert calls[1]["codec_scale"] == pytest.approx(2.0) and calls[1]["other_ms"] is None
    assert calls[1]["candidates"] == ["ddp", "lowrank"]  # powersgd is modelled by lowrank; failed runs left out
    by = {r["method"]: r for r in res["rows"]}
    assert by["powersgd"]["model"] == "lowrank"
    # stand-in: 50 ms (100 for ddp) + 4 ms of extra compute at scale 2
    assert by["ddp"]["predicted_step_s"] == pytest.approx(0.104)
    assert by["ddp"]["error"] == pytest.approx(0.104 / 0.125 - 1)
    assert by["powersgd"]["error"] == pytest.approx(0.054 / 0.040 - 1)
    assert res["median_abs_error"] == pytest.approx(sorted(abs(r["error"]) for r in res["rows"])[1])


def test_other_from_calibrates_on_that_links_ddp_and_validates_the_others(monkeypatch):
    calls: list = []
    monkeypatch.setattr(advise_mod, "run", _fake_run(calls))
    doc = {"schema": "lightning_gc.bench.sweep/1",
           "runs": [_run("1gbit", {"ddp": 0.030, "topk": 0.020}), _run("20mbit", {"ddp": 0.125, "topk": 0.060})]}
    out = av.validate(doc, other_from="1gbit")
    assert [r["bandwidth"] for r in out] == ["20mbit"]
    # at 1gbit the stand-in predicts ddp 20 + 4 ms; measured 30 ms: other = 6 ms
    assert out[0]["other_ms"] == pytest.approx(6.0)
    assert calls[-1]["other_ms"] == pytest.approx(6.0)
    by = {r["method"]: r for r in out[0]["rows"]}
    assert by["ddp"]["predicted_step_s"] == pytest.approx(0.100 + 0.004 + 0.006)
    assert "DDP's step at 1gbit" in av.report(out)
    with pytest.raises(ValueError, match="no run on that link"):
        av.validate(doc, other_from="10mbit")
    with pytest.raises(ValueError, match="neither a bench run"):
        av.validate({"schema": "x"})
