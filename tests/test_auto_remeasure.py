"""``compressor="auto"`` in Lightning training on 2 spawned ranks: the candidates' errors, measured on
local gradients and agreed, and when they are measured again (oracles: errors written by hand from the
methods' definitions, intervals by hand)."""

from __future__ import annotations

import pytest
import torch
from auto_lit import _fit, _strategy, errors_by_hand
from auto_oracle import argmin_by_hand

pytestmark = pytest.mark.slow


def test_errors_are_the_ranks_mean_on_local_gradients_and_re_measured_every_gain_every_steps(tmp_path):
    """The warm-up measures every candidate's error on each rank's *local* gradient of the profiled
    step (step 1) and agrees the mean; every ``gain_every`` (4) steps the next step's local gradients
    are measured again (steps 5, 9, 13). With ``gain_drift=0`` each re-measurement re-decides (trigger
    ``gain``), and each choice is the brute-force minimum on its inputs. The ranks' batches differ,
    so a MAX over ranks or the averaged gradient gives other values."""
    steps = (1, 5, 9, 13)
    reports, autos = _fit(tmp_path, _strategy(progress_weight=0.5, gain_every=4, gain_every_max=0, gain_drift=0.0),
                          keep_steps=steps)
    assert autos[0]["history"] == autos[1]["history"] and autos[0]["gain_checks"] == autos[1]["gain_checks"]
    hist = autos[0]["history"]
    assert [(h["step"], h["trigger"]) for h in hist] == [(1, "warmup"), (5, "gain"), (9, "gain"), (13, "gain")]
    checks = autos[0]["gain_checks"]
    assert [c["step"] for c in checks] == [5, 9, 13] and all(c["redecided"] for c in checks)
    before = None
    for h in hist:
        per_rank = [errors_by_hand(autos[r]["grads"][h["step"]]) for r in range(2)]
        got = {c["name"]: c["delta2"] for c in h["costs"]}
        # a re-measurement skips the candidates that could not win (their stored error stays)
        skipped = next((c["skipped"] for c in checks if c["step"] == h["step"]), [])
        for name in ("ddp", "fp16", "topk", "efsign"):
            if name in skipped:
                assert got[name] == before[name], (h["step"], name)
                continue
            want = (per_rank[0][name] + per_rank[1][name]) / 2
            assert got[name] == pytest.approx(want, rel=1e-5, abs=1e-12), (h["step"], name)
        before = got
        # the ranks' errors differ by far more than the check above resolves (rel 1e-5): a MAX over the
        # ranks, or one rank's value, would fail it
        assert per_rank[0]["topk"] != pytest.approx(per_rank[1]["topk"], rel=1e-4)
        assert h["chosen"] == argmin_by_hand(h["costs"], h["workload"], *h["network"], 2, 0.5)
    for c, h in zip(checks, hist[1:]):
        assert c["delta2"] == {k["name"]: k["delta2"] for k in h["costs"] if k["name"] not in c["skipped"]}
    for k, v in reports[0]["params"].items():
        assert torch.equal(v, reports[1]["params"][k]), k


def test_the_first_re_measurement_comes_after_gain_first_steps_then_every_gain_every(tmp_path):
    """By hand: the warm-up decides at step 1; the first re-measurement waits min(gain_every, gain_first) =
    5 steps (the sampled step 1 + 5 = 6), the next gain_every = 9 more (15). Without gain_first the first
    would wait 9 (step 10)."""
    _, autos = _fit(tmp_path, _strategy(gain_every=9, gain_first=5, gain_every_max=0, gain_drift=0.0))
    for a in autos:
        assert [c["step"] for c in a["gain_checks"]] == [6, 15], a["gain_checks"]


def test_the_re_measurement_interval_doubles_while_the_pick_stands(tmp_path):
    """By hand: the warm-up decides at step 1; with errors that never move enough to re-decide (gain_drift
    1e9) the re-measurements come at 1 + 3 = 4, then 6 later (10), then 12 later (22, past the 16 steps);
    without doubling (gain_every_max 0) every 3 steps: 4, 7, 10, 13. With a re-decision at every one
    (gain_drift 0) the interval doubles where the re-decision kept the method and is 3 again where it
    switched (the rule, applied to the run's own decisions)."""
    kw = dict(gain_every=3, gain_first=0, gain_drift=1e9)
    for every_max, steps, intervals in ((12, [4, 10], [6, 12]), (0, [4, 7, 10, 13], [3, 3, 3, 3])):
        _, autos = _fit(tmp_path / str(every_max), _strategy(gain_every_max=every_max, **kw))
        assert autos[0]["gain_checks"] == autos[1]["gain_checks"]
        checks = autos[0]["gain_checks"]
        assert [c["step"] for c in checks] == steps and not any(c["redecided"] for c in checks), checks
        assert [c["next_interval"] for c in checks] == intervals
    _, autos = _fit(tmp_path / "act", _strategy(gain_every=3, gain_first=0, gain_drift=0.0, gain_every_max=12))
    checks, hist = autos[0]["gain_checks"], autos[0]["history"]
    assert checks and all(c["redecided"] for c in checks), checks
    interval, at = 3, 1
    for c in checks:
        assert c["step"] == at + interval, (c, checks)
        (h,) = [h for h in hist if h["step"] == c["step"] and h["trigger"] == "gain"]
        interval = min(2 * interval, 12) if h["chosen"] == h["previous"] else 3
        assert c["next_interval"] == interval, (c, h["chosen"], h["previous"])
        at = c["step"]
