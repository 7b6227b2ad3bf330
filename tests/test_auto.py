"""``compressor="auto"`` inside real Lightning training on 2 spawned CPU/gloo ranks.

The network is pinned (``network_alpha_s``/``network_beta_s_per_byte``) so that the choice depends
on measured compute and codec costs only; the oracle recomputes the choice from the inputs the
chooser recorded (agreed across ranks) with the hand-written equations of tests/auto_oracle.py.
"""


from __future__ import annotations

import lightning as L
import pytest
import torch
from auto_lit import SLOW_LINK, SLOWER_LINK, _fit, _strategy
from auto_oracle import argmin_by_hand

from lightning_gc import GCStrategy
from lightning_gc.auto.model import DEFAULT_PROGRESS_WEIGHT
from lightning_gc.config import GCConfig

pytestmark = pytest.mark.slow


def test_ranks_choose_alike_and_the_choice_is_the_brute_force_minimum(tmp_path):
    reports, autos = _fit(tmp_path, _strategy(progress_weight=0.5))
    assert autos[0]["history"] == autos[1]["history"]  # every input and prediction agreed
    (h,) = autos[0]["history"]  # gain_every 50: no re-measurement in 16 steps
    assert h["trigger"] == "warmup" and h["step"] == 1  # 1 skipped + 1 profiled dense step
    assert h["network"] == [SLOW_LINK["network_alpha_s"], SLOW_LINK["network_beta_s_per_byte"]]
    want = argmin_by_hand(h["costs"], h["workload"], *h["network"], 2, 0.5)
    assert h["chosen"] == want
    # at 2 Mbit/s fp32 DDP cannot be the pick: any 16-bit or compressed method sends less
    assert want != "ddp"
    _check_codec_timing(h, 0.5)
    a = autos[0]
    if want in ("fp16", "bf16"):
        assert a["dense_mode"] == want and a["compressed_steps"] == 0
    else:
        assert a["dense_mode"] is None and a["compressed_steps"] == 16 - 2
        assert all(s["spec"]["compressor"] for s in a["slots"] if "spec" in s)
    for k, v in reports[0]["params"].items():
        assert torch.equal(v, reports[1]["params"][k]), k


def _check_codec_timing(h: dict, weight: float) -> None:
    """time_codecs="on_demand": the decision timed the engine codecs by branch and bound. Replayed by
    hand from the costs it recorded (the timed ones at their measured time): start from the lower
    bounds (every engine codec at 0); while the brute-force pick is an engine method still at its
    bound, put in its timed cost and pick again. The codecs that replay put in, in that order, are
    the ones the decision timed; the rest are still untimed (0); the last pick is the chosen one."""
    engine_names = [c["name"] for c in h["costs"] if c["wire"] != "bucket"]
    now = [c if c["wire"] == "bucket" else {**c, "codec_s": 0.0} for c in h["costs"]]
    replayed = []
    while True:
        best = argmin_by_hand(now, h["workload"], *h["network"], 2, weight)
        if best not in engine_names or best in replayed:
            break
        replayed.append(best)
        true = next(c for c in h["costs"] if c["name"] == best)
        assert true["codec_timed"] and true["codec_s"] > 0, true
        now = [true if c["name"] == best else c for c in now]
    assert h["timed_codecs"] == replayed
    assert best == h["chosen"]
    # where the decision's time went: codecs timed iff any was; a pinned network is neither probed nor checked
    parts = h["decide_parts_s"]
    assert (parts["codecs"] > 0) == bool(replayed) and all(0 <= v <= h["decide_s"] for v in parts.values())
    assert parts["latency"] == parts["probe"] == parts["check"] == 0.0
    assert all(not c["codec_timed"] and c["codec_s"] == 0 for c in h["costs"]
               if c["name"] in engine_names and c["name"] not in replayed)


def test_on_a_fast_link_a_dense_pick_times_no_codec_and_ranks_agree(tmp_path):
    """100 Gbit/s: a dense mode beats every compressed method's lower bound (its codec untimed, 0),
    so no codec is timed, the engine candidates' predictions are marked as bounds, and both ranks
    hold the same history (the untimed flags agreed like every other cost)."""
    fast = dict(network_alpha_s=1e-6, network_beta_s_per_byte=8 / 1e11)
    _, autos = _fit(tmp_path, _strategy(fast))
    assert autos[0]["history"] == autos[1]["history"]
    (h,) = autos[0]["history"]
    # the oracle weighs progress as the chooser does (the default progress_weight)
    w = DEFAULT_PROGRESS_WEIGHT
    assert h["chosen"] in ("ddp", "fp16") and h["chosen"] == argmin_by_hand(h["costs"], h["workload"], *h["network"], 2, w)
    _check_codec_timing(h, w)
    assert h["timed_codecs"] == []
    engine_names = {c["name"] for c in h["costs"] if c["wire"] != "bucket"}
    assert engine_names and {k for k, p in h["predictions"].items() if p["details"].get("lower_bound")} == engine_names


def test_a_resumed_run_keeps_the_choice_and_is_exact(tmp_path):
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1)
    # gain_every 7: the step after the warm-up's decision (1) + 7 - 1 = 7 arms the sampling of step 8,
    # so the epoch-0 checkpoint (after step 7) is saved armed, and the resumed run samples step 8
    # codecs timed upfront: on demand, a codec first timed after the checkpoint is timed by each run on
    # its own and could tilt a close pick between the two runs (its time is a measurement, like a window)
    kw = dict(candidates=["ddp", "topk", "efsign"], gain_every=7, gain_every_max=0, gain_drift=0.0,
              time_codecs="upfront")
    full, full_auto = _fit(tmp_path / "a", _strategy(SLOWER_LINK, **kw), callbacks=[ckpt], enable_checkpointing=True)
    first = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))[0]
    resumed, resumed_auto = _fit(tmp_path / "b", _strategy(SLOWER_LINK, **kw), ckpt_path=str(first))
    def decisions(history):  # measured by the run itself: the first window after a decision, the decision's time
        return [{k: v for k, v in h.items() if k not in ("measured_step_s", "decide_s", "decide_parts_s")}
                for h in history]

    assert decisions(resumed_auto[0]["history"]) == decisions(full_auto[0]["history"])  # no second profile
    assert [c["step"] for c in full_auto[0]["gain_checks"]] == [8, 15]
    assert resumed_auto[0]["gain_checks"] == full_auto[0]["gain_checks"]
    assert resumed_auto[0]["chosen"] == full_auto[0]["chosen"] != "ddp"
    for r in range(2):
        for k, v in full[r]["params"].items():
            assert torch.equal(v, resumed[r]["params"][k]), f"rank {r} {k} differs after resume"


@pytest.mark.parametrize("kwargs, match", [
    (dict(compressor="auto", ratio=0.1), "ratio=0.1 cannot be given"),
    (dict(compressor="auto", sync="osp"), "sync='osp' is not supported"),
    (dict(compressor="auto", plan="layer"), "plan='layer' is not supported"),
    (dict(compressor="topk", auto={"progress_weight": 2.0}), "only apply with compressor='auto'"),
    (dict(compressor="auto", auto={"candidates": ["fp16", "topk"]}), "must include 'ddp'"),
    (dict(compressor="auto", auto={"candidates": ["ddp", "zip"]}), "candidate 'zip' is unknown"),
    (dict(compressor="auto", auto={"progress_weight": -1}), "progress_weight=-1"),
    (dict(compressor="auto", auto={"windw": 3}), r"unknown option\(s\) \['windw'\]"),
    (dict(compressor="auto", auto={"gain_every": -1}), "auto_gain_every=-1 must be an integer >= 0"),
    (dict(compressor="auto", auto={"gain_every_max": -5}), "auto_gain_every_max=-5 must be an integer >= 0"),
    (dict(compressor="auto", auto={"gain_first": -1}), "auto_gain_first=-1 must be an integer >= 0"),
    (dict(compressor="auto", auto={"early_comm_ratio": -0.5}), "auto_early_comm_ratio=-0.5 must be a finite"),
    (dict(compressor="auto", auto={"gain_drift": float("nan")}), "auto_gain_drift=nan must be a finite number"),
    (dict(compressor="auto", auto={"explore_margin": 1.0}), r"auto_explore_margin=1.0 must be a number in \[0, 1\)"),
    (dict(compressor="auto", auto={"explore_margin": -0.1}), r"auto_explore_margin=-0.1 must be a number in \[0, 1\)"),
])
def test_bad_auto_settings_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GCStrategy(**kwargs)


def test_auto_config_round_trips_through_flat_names():
    cfg = GCConfig.from_flat(compressor="auto", auto_progress_weight=0.25, auto_candidates=("ddp", "qsgd"),
                             auto_gain_every=20)
    assert cfg.auto.progress_weight == 0.25 and cfg.auto.candidates == ("ddp", "qsgd") and cfg.auto.gain_every == 20
    assert cfg.engine.warmup_steps == cfg.auto.dense_steps_needed == 2
    assert GCConfig.from_flat(**cfg.to_flat()) == cfg


def test_a_first_dense_step_that_waited_on_the_network_is_profiled_and_ends_the_warm_up(tmp_path):
    """early_comm_ratio: step 0's exposed communication against the rest of it; with a ratio this
    small any wait counts, so the decision comes after step 0 (not 1) and step 1 is the chosen method's."""
    reports, autos = _fit(tmp_path, _strategy(SLOWER_LINK, candidates=["ddp", "topk", "efsign"], early_comm_ratio=1e-9))
    assert autos[0]["history"] == autos[1]["history"]
    (h,) = autos[0]["history"]
    assert h["trigger"] == "warmup" and h["step"] == 0
    # the oracle weighs progress as the chooser does (the default progress_weight)
    assert h["chosen"] == argmin_by_hand(h["costs"], h["workload"], *h["network"], 2, DEFAULT_PROGRESS_WEIGHT) != "ddp"
    assert autos[0]["dense_mode"] is None and autos[0]["compressed_steps"] == 16 - 1  # one dense step only
    for k, v in reports[0]["params"].items():
        assert torch.equal(v, reports[1]["params"][k]), k



def test_monitor_reports_the_latest_measured_errors():
    """gc/auto_delta2/<m>: the last re-measurement's agreed errors, or the warm-up's before any."""
    from types import SimpleNamespace

    from lightning_gc.auto.model import MethodCost
    from lightning_gc.callbacks.monitor import auto_metrics

    costs = [MethodCost("ddp", "bucket", 0.0), MethodCost("topk", "allgather", 1e-3, 100.0, 0.6, True)]
    auto = SimpleNamespace(chosen="topk", config=SimpleNamespace(candidates=("ddp", "topk")), predictions={},
                           history=[], costs=costs, gain_checks=[])
    assert auto_metrics(auto)["gc/auto_delta2/topk"] == 0.6 and auto_metrics(auto)["gc/auto_method"] == 1.0
    auto.gain_checks = [{"step": 5, "delta2": {"ddp": 0.0, "topk": 0.45}, "moved": 0.1, "redecided": False}]
    assert auto_metrics(auto)["gc/auto_delta2/topk"] == 0.45


def test_the_strategy_marks_an_epochs_first_step_and_a_checkpoint_for_the_one_step_test(monkeypatch, tmp_path):
    """The one-step test (``AutoChooser.mark_wall``) leaves out a step whose wall may hold what is not
    a training step's: GCStrategy marks the first batch of every epoch (batch index 0, not the others)
    and every checkpoint save (after the file is written: its time is in the next step's wall), on
    every rank alike; without ``auto`` nothing is called."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_gc.auto import AutoChooser
    from lightning_gc.engine.session import StepSession

    calls = []
    strategy = GCStrategy(compressor="auto")
    chooser = AutoChooser.__new__(AutoChooser)  # only its lifecycle methods run: no engine behind it
    chooser.mark_wall = lambda: calls.append("mark")
    strategy._session = StepSession(object(), [chooser])
    strategy._gather_state = dict
    for batch_idx in (0, 1, 7, 0):
        strategy.on_train_batch_start(None, batch_idx)
    assert calls == ["mark", "mark"]
    written = []
    monkeypatch.setattr(DDPStrategy, "save_checkpoint", lambda self, ckpt, path, storage_options=None:
                        written.append((path, list(calls))))
    strategy.save_checkpoint({}, tmp_path / "a.ckpt")
    assert written == [(tmp_path / "a.ckpt", ["mark", "mark"])] and calls == ["mark"] * 3  # marked after writing
    plain = GCStrategy(compressor="topk")
    plain.on_train_batch_start(None, 0)
    plain.save_checkpoint({}, tmp_path / "b.ckpt")
    assert calls == ["mark"] * 3
