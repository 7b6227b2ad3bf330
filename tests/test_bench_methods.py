"""Method names/options -> strategies, and the byte models of the torch baselines."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_gc.auto import AutoConfig
from lightning_gc.bench.methods import (
    BASELINES,
    MethodError,
    MethodSpec,
    TorchHookDDPStrategy,
    analytic_bytes_per_step,
    auto_config,
    available_methods,
    build_strategy,
    parse_methods,
    powersgd_elements,
    ring_factor,
)


def test_baselines_parse_with_options_and_labels():
    specs = parse_methods("ddp, powersgd:rank=4:start_iter=3, fp16", default_ratio=0.01)
    assert [s.label for s in specs] == ["ddp", "powersgd:rank=4:start_iter=3", "fp16"]
    assert specs[1].options == {"rank": 4, "start_iter": 3}
    assert not any(s.gc for s in specs)
    assert specs[0].to_json() == {"method": "ddp", "label": "ddp", "compressor": None, "options": {}}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "empty"),
        ("ddp:bucket=1", "takes no options"),
        ("powersgd:rank=0", "rank=0 must be an integer >= 1"),
        ("powersgd:start_iter=1", "start_iter=1 must be an integer >= 2"),
        ("powersgd:colour=red", "unknown PowerSGD option"),
        ("powersgd:rank", "not KEY=VALUE"),
        ("ddp,ddp", "more than once"),
    ],
)
def test_bad_method_lists_name_value_reason_and_fix(text, fragment):
    with pytest.raises(MethodError, match=fragment):
        parse_methods(text, default_ratio=0.01)


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(MethodError) as exc:
        parse_methods("ddp,warp_drive", default_ratio=0.01)
    msg = str(exc.value)
    assert "'warp_drive'" in msg
    for name in BASELINES:
        assert name in msg


def test_gc_methods_get_the_default_ratio_and_fp16_clash_is_resolved():
    from lightning_gc.compressors import available_compressors, takes_ratio

    specs = parse_methods("topk,topk:ratio=0.001,gc_fp16,fp16", default_ratio=0.01)
    assert [s.label for s in specs] == ["topk:ratio=0.01", "topk:ratio=0.001", "gc_fp16", "fp16"]
    assert specs[0].gc and specs[1].gc and specs[2].gc and not specs[3].gc
    assert specs[2].name == "fp16" and specs[2].method == "gc_fp16"
    # every compressor is reachable by its name (or gc_NAME on a clash with a torch baseline)
    methods = available_methods()
    for name in available_compressors():
        assert (f"gc_{name}" if name in BASELINES else name) in methods
    # ratio only for compressors that take one
    for name in available_compressors():
        spec = parse_methods(f"gc_{name}", default_ratio=0.05)[0]
        assert ("ratio" in spec.options) == bool(takes_ratio(name))
    with pytest.raises(MethodError, match="ratio=2 must be a number in"):
        parse_methods("topk:ratio=2", default_ratio=0.01)


def test_build_strategy_for_baselines():
    assert type(build_strategy(MethodSpec("ddp"))) is DDPStrategy
    s = build_strategy(MethodSpec("powersgd", {"rank": 2}))
    assert isinstance(s, TorchHookDDPStrategy) and s.hook_name == "powersgd" and s.hook_options == {"rank": 2}
    assert isinstance(build_strategy(MethodSpec("fp16")), TorchHookDDPStrategy)
    # PowerSGD on gloo needs one DDP bucket (its per-bucket collectives race otherwise); fp16 keeps DDP's buckets
    assert s._ddp_kwargs["bucket_cap_mb"] >= 1_000_000
    assert "bucket_cap_mb" not in build_strategy(MethodSpec("fp16"))._ddp_kwargs


def test_ring_model_bytes():
    assert ring_factor(1) == 0.0
    assert ring_factor(2) == 1.0
    assert ring_factor(4) == 1.5
    d = 1000
    assert analytic_bytes_per_step(MethodSpec("ddp"), 4, d) == 1.5 * 4 * d
    assert analytic_bytes_per_step(MethodSpec("fp16"), 4, d) == 1.5 * 2 * d
    assert analytic_bytes_per_step(MethodSpec("powersgd"), 4, d, 100) == 1.5 * 4 * 100
    with pytest.raises(MethodError):
        analytic_bytes_per_step(MethodSpec("topk", gc=True), 4, d)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)  # 8 x 27 matrix: worth compressing at rank 1, not at rank 4
        self.fc1 = nn.Linear(8 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 3)  # 3 x 64: never worth compressing at min_compression_rate 2

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _powersgd_counts(rank, world_size, approx_rank):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = _Net()
    ddp = DDP(net)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=approx_rank,
                                        start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    counts = []
    for step in range(5):
        before = state.total_numel_after_compression
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        counts.append(state.total_numel_after_compression - before)
    return counts, powersgd_elements(net, approx_rank)


@pytest.mark.parametrize("approx_rank", [1, 4])
def test_powersgd_element_model_matches_what_the_torch_hook_reduces(approx_rank):
    results = run_distributed(_powersgd_counts, 2, approx_rank)
    for counts, model_count in results:
        assert counts[:2] == [0, 0]  # vanilla allreduce before start_powerSGD_iter: hook counts nothing
        assert counts[2:] == [model_count] * 3
    dense = sum(p.numel() for p in _Net().parameters())
    assert results[0][1] < dense


def test_bench_counts_communication_in_flight_before_a_validation_as_training_time(tmp_path):
    """Work in flight when a validation starts (OSP's deferred stage, Streaming DiLoCo's exchanges)
    is waited for inside the timed step before it, so it cannot progress during the untimed
    validation: the bench drains the strategy at each step that a validation (or the end) follows,
    and before the measured window opens (so a warm-up step's traffic is not counted in it), and only
    there."""
    import time
    from types import SimpleNamespace

    from lightning_gc.bench.worker import _make_callback

    cfg = {"boundaries": [], "run_dir": str(tmp_path), "warmup": 2, "steps": 7, "eval_every": 3,
           "compute_steps": 1}
    cb = _make_callback(cfg, global_rank=1, local_rank=1)
    drained_at: list[int] = []

    def drain():
        drained_at.append(cb.step)
        time.sleep(0.05)

    trainer = SimpleNamespace(strategy=SimpleNamespace(drain=drain))
    for i in range(7):
        cb.on_train_batch_start(trainer, None, None, i)
        cb.on_train_batch_end(trainer, None, None, None, i)
    # before the window opens at step 3 (index 2), the validations after steps 3 and 6, and the end (7)
    assert drained_at == [1, 2, 5, 6]
    assert [round(t >= 0.05) for t in cb.step_times] == [0, 1, 1, 0, 0, 1, 1]
    assert cb.train_time >= 0.2


def test_bench_counts_the_time_between_steps_but_not_validation(tmp_path):
    """Work that a method overlaps with the next steps competes with the main thread between the
    timed callbacks too; that gap is training time. A validation is not."""
    import time
    from types import SimpleNamespace

    from lightning_gc.bench.worker import _make_callback

    cfg = {"boundaries": [], "run_dir": str(tmp_path), "warmup": 100, "steps": 6, "eval_every": 100,
           "compute_steps": 1, "metric": "val_acc"}
    cb = _make_callback(cfg, global_rank=1, local_rank=1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(), callback_metrics={"val_acc": 0.5})
    for i in range(4):
        cb.on_train_batch_start(trainer, None, None, i)
        cb.on_train_batch_end(trainer, None, None, None, i)
        if i == 1:  # a validation of 0.3 s after step 2
            cb.on_validation_start(trainer, None)
            time.sleep(0.3)
            cb.on_validation_end(trainer, None)
        else:  # 0.1 s between the steps: a fragment's exchange holding the CPU, the data loader
            time.sleep(0.1)
    # step 0 starts at its callback; steps 1 and 3 include the 0.1 s before them, step 2 does not
    # include the validation before it
    assert [t >= 0.1 for t in cb.step_times] == [False, True, False, True]
    assert all(t < 0.25 for t in cb.step_times), cb.step_times
    assert 0.2 <= cb.train_time < 0.45
    assert cb.evals[0]["train_time_s"] == pytest.approx(sum(cb.step_times[:2]))


# --------------------------------------------------------------------------- auto (GCStrategy(compressor="auto"))


def test_auto_parses_without_a_ratio_and_its_options_reach_gc_strategy():
    from lightning_gc.strategy import GCStrategy

    specs = parse_methods("ddp,auto,auto:progress_weight=0.5:candidates=ddp+fp16+topk:warmup_steps=5:bucket_cap_mb=1,"
                          "gc_auto:auto_drift=0.5:auto_window=4:seed=3", default_ratio=0.01)
    plain, tuned, flat = specs[1:]
    assert [s.label for s in specs[1:]] == ["auto", "auto:progress_weight=0.5:candidates=ddp+fp16+topk:warmup_steps=5:"
                                            "bucket_cap_mb=1", "auto:auto_drift=0.5:auto_window=4:seed=3"]
    assert plain.gc and plain.method == "auto" and plain.options == {}  # --ratio does not apply to auto
    assert plain.to_json() == {"method": "auto", "label": "auto", "compressor": "auto", "options": {}}

    s = build_strategy(plain)
    assert isinstance(s, GCStrategy) and s.config.auto == AutoConfig()
    s = build_strategy(tuned)
    assert s.config.auto.candidates == ("ddp", "fp16", "topk") and s.config.auto.progress_weight == 0.5
    assert s.config.engine.warmup_steps == 5  # an engine key goes to GCStrategy as for any compressor
    assert s._ddp_kwargs["bucket_cap_mb"] == 1
    s = build_strategy(flat)  # auto_<field> is the same field
    assert (s.config.auto.drift, s.config.auto.window, s.config.engine.seed) == (0.5, 4, 3)
    # the profile's dense steps: skip_steps + profile_steps, at least warmup_steps
    assert build_strategy(parse_methods("auto:skip_steps=0:profile_steps=2", default_ratio=0.01)[0]) \
        .config.engine.warmup_steps == 2
    assert auto_config(tuned).dense_steps_needed == 2 and auto_config(plain) == AutoConfig()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("auto:ratio=0.1", "auto chooses the compressor, its ratio and collective itself, so ratio=0.1"),
        ("auto:collective=allgather", "collective='allgather' cannot be given"),
        ("auto:levels=4", "unknown auto option 'levels'"),
        ("auto:adaptive=shadow", "unknown auto option 'adaptive'"),
        ("auto:candidates=fp16+topk", "must include 'ddp'"),
        ("auto:candidates=ddp+warp", "auto candidate 'warp' is unknown; valid: ddp, fp16"),
        ("auto:candidates=ddp+topk:auto_candidates=ddp", "candidates is given twice"),
        ("auto:progress_weight=-1", "auto_progress_weight=-1 must be a finite number >= 0"),
        ("auto:window=1", "auto_window=1 must be an integer >= 2"),
        ("auto:sync=osp", "compressor='auto' with sync='osp' is not supported"),
        ("auto:plan=layer", "compressor='auto' with plan='layer' is not supported"),
    ],
)
def test_bad_auto_options_are_refused_when_the_list_is_parsed(text, fragment):
    with pytest.raises(MethodError) as exc:
        parse_methods(text, default_ratio=0.01)
    assert fragment in str(exc.value) and repr(text) in str(exc.value)


def test_auto_is_listed_but_not_part_of_all_and_its_options_need_auto():
    assert "auto" in available_methods()
    assert "auto" not in [s.name for s in parse_methods("all", default_ratio=0.01)]
    with pytest.raises(MethodError, match="choose from .*auto"):
        parse_methods("autoo", default_ratio=0.01)
    with pytest.raises(ValueError, match="auto options .* only apply with compressor='auto'"):
        build_strategy(parse_methods("topk:auto_drift=0.5", default_ratio=0.01)[0])
    with pytest.raises(MethodError, match="is not auto"):
        auto_config(MethodSpec("topk", gc=True))


def test_worker_records_the_choosers_decisions_from_its_history():
    from types import SimpleNamespace

    from lightning_gc.bench.worker import _auto_state

    def pred(step, tpp):
        return {"step_s": step, "compute_s": 0.01, "codec_s": 0.0, "comm_s": 0.0, "exposed_s": 0.0,
                "efficiency": 1.0, "time_per_progress_s": tpp}

    history = [
        {"step": 3, "trigger": "warmup", "chosen": "ddp", "previous": None, "network": [1e-4, 8e-9],
         "workload": {"forward_s": 0.01, "backward_s": [0.02, 0.01], "optimizer_s": 0.005},
         "costs": [{"name": "ddp", "delta2": 0.0}, {"name": "topk", "delta2": 0.6}], "beta_scale": 0.8,
         "predictions": {"ddp": pred(0.05, 0.05), "topk": pred(0.03, 0.06)},
         "dense_wall_s": 0.05, "measured_step_s": 0.052, "decide_s": 0.2},
        {"step": 40, "trigger": "drift", "chosen": "topk", "previous": "ddp", "network": [1e-4, 8e-8],
         "workload": {}, "costs": [], "predictions": {"ddp": pred(0.4, 0.4), "topk": pred(0.04, 0.08)},
         "dense_wall_s": None, "measured_step_s": None, "decide_s": 0.3, "network_source": "check",
         "decide_parts_s": {"latency": 0.0, "probe": 0.0, "check": 0.07, "codecs": 0.2},
         "shift_s": -0.012, "settled": ["ddp"], "shift_from": ["fp16"], "drift_test": "steps",
         "kept_reference": True, "held_by_margin": "ddp", "running_figure_s": 0.041,
         "link_check": {"check_s": 0.07, "probe_s": 0.065, "bytes": 168_000, "unchanged": True,
                        "reference": "modelled"}},
    ]
    gains = [{"step": 53, "delta2": {"ddp": 0.0, "topk": 0.5}, "moved": 0.07, "redecided": False}]
    events = [{"step": 60, "event": "trial", "challenger": "diloco10"}, {"step": 90, "event": "enter", "choice": "diloco10"}]
    chooser = SimpleNamespace(chosen="topk", history=history, config=AutoConfig(candidates=("ddp", "topk")),
                              gain_checks=gains, sync_events=events)
    rec = _auto_state(SimpleNamespace(auto=chooser))
    assert rec["chosen"] == "topk" and rec["candidates"] == ["ddp", "topk"]
    assert rec["sync_events"] == events and rec["sync_events"] is not events  # a copy of the record
    first, second = rec["decisions"]
    assert first == {"step": 3, "trigger": "warmup", "chosen": "ddp", "previous": None, "predicted_step_s": 0.05,
                     "measured_step_s": 0.052, "predictions": {"ddp": 0.05, "topk": 0.03},
                     "time_per_progress_s": {"ddp": 0.05, "topk": 0.06},
                     "network": {"alpha_s": 1e-4, "beta_s_per_byte": 8e-9}, "dense_wall_s": 0.05, "decide_s": 0.2,
                     "delta2": {"ddp": 0.0, "topk": 0.6}, "beta_scale": 0.8, "compute_s": pytest.approx(0.045),
                     "link_check": None, "network_source": None, "shift_s": None, "settled": [],
                     "shift_from": [], "drift_test": None, "kept_reference": False, "held_by_margin": None,
                     "running_figure_s": None, "decide_parts_s": {}, "switch_check": None}
    assert second["decide_parts_s"] == {"latency": 0.0, "probe": 0.0, "check": 0.07, "codecs": 0.2}
    assert second["drift_test"] == "steps" and second["kept_reference"] is True and second["held_by_margin"] == "ddp"
    assert second["running_figure_s"] == 0.041
    assert second["predicted_step_s"] == 0.04 and second["measured_step_s"] is None and second["previous"] == "ddp"
    assert second["delta2"] == {} and second["beta_scale"] is None and second["compute_s"] is None
    assert second["network_source"] == "check"
    assert second["shift_s"] == -0.012 and second["settled"] == ["ddp"] and second["shift_from"] == ["fp16"]
    assert second["link_check"] == {"check_s": 0.07, "probe_s": 0.065, "bytes": 168_000, "unchanged": True,
                                    "retimed": False, "reference": "modelled", "beta_s_per_byte": None}
    # a check of an earlier version has no next_interval nor skipped: recorded as None
    assert rec["gain_checks"] == [dict(gains[0], next_interval=None, skipped=None)]
    chooser.gain_checks = [dict(gains[0], next_interval=100, skipped=["topk3"])]
    assert _auto_state(SimpleNamespace(auto=chooser))["gain_checks"] == chooser.gain_checks
    assert _auto_state(SimpleNamespace(auto=None)) is None
    assert _auto_state(DDPStrategy()) is None


def _steps(cb, trainer, n, work_s):
    import time

    for i in range(n):
        t = time.monotonic()
        cb.on_train_batch_start(trainer, None, None, i)
        started = time.monotonic() - t
        time.sleep(work_s)
        cb.on_train_batch_end(trainer, None, None, None, i)
        yield i, started


def test_a_rate_change_within_a_step_is_asked_for_mid_step_and_recorded_with_its_offsets(tmp_path):
    """--change-in-step 0.5: at the boundary step rank 0 does not wait; half the median of its last walls
    later it asks for the change, and the runner's time of applying it (a stand-in here, 30 ms late)
    comes back as the offset into that step."""
    import os
    import statistics
    import threading
    import time
    from types import SimpleNamespace

    from lightning_gc.bench.worker import _make_callback

    cfg = {"boundaries": [[3, 10_000_000]], "run_dir": str(tmp_path), "warmup": 100, "steps": 6, "eval_every": 100,
           "compute_steps": 1, "change_in_step": 0.5, "sync_timeout": 5}
    cb = _make_callback(cfg, global_rank=0, local_rank=0)
    seen: list[float] = []

    def runner():  # the bench runner's part: see the request, apply (30 ms), write the time it took effect
        req, ack = tmp_path / "phase0.req", tmp_path / "phase0.ack"
        while not req.exists():
            time.sleep(0.001)
        seen.append(time.monotonic())
        time.sleep(0.03)
        (tmp_path / "ack.tmp").write_text(repr(time.monotonic()))
        os.replace(tmp_path / "ack.tmp", ack)

    th = threading.Thread(target=runner, daemon=True)
    th.start()
    trainer = SimpleNamespace(strategy=SimpleNamespace())
    starts = dict(_steps(cb, trainer, 6, 0.06))
    th.join(5)
    cb.finish_rate_changes(5)
    assert starts[3] < 0.01  # the boundary step did not wait for the rate
    (change,) = cb.rate_changes
    assert change["step"] == 3 and change["rate_bps"] == 10_000_000
    assert change["requested_offset_s"] == pytest.approx(0.5 * statistics.median(cb.step_times[:3]))
    assert change["requested_offset_s"] + 0.03 <= change["applied_offset_s"] < change["requested_offset_s"] + 0.2


def test_a_rate_change_within_a_step_that_is_never_applied_fails_the_run(tmp_path):
    """No runner answers: the thread's timeout is raised on the training thread at a later step, with
    the step and the rate, instead of being lost in the thread."""
    from types import SimpleNamespace

    from lightning_gc.bench.worker import _make_callback

    cfg = {"boundaries": [[1, 10_000_000]], "run_dir": str(tmp_path), "warmup": 100, "steps": 20,
           "eval_every": 100, "compute_steps": 1, "change_in_step": 0.5, "sync_timeout": 0.05}
    cb = _make_callback(cfg, global_rank=0, local_rank=0)
    with pytest.raises(TimeoutError, match=r"rate change 0 \(to 10000000 bit/s\) at step 1 was not acknowledged"):
        for _ in _steps(cb, SimpleNamespace(strategy=SimpleNamespace()), 20, 0.02):
            pass
