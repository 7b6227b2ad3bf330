"""Method names/options -> strategies, and the byte models of the torch baselines."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_gc.bench.methods import (
    BASELINES,
    MethodError,
    MethodSpec,
    TorchHookDDPStrategy,
    analytic_bytes_per_step,
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
    assert all(s.is_baseline for s in specs)
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
    and only there."""
    import time
    from types import SimpleNamespace

    from lightning_gc.bench.worker import _make_callback

    cfg = {"boundaries": [], "run_dir": str(tmp_path), "warmup": 100, "steps": 7, "eval_every": 3,
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
    assert drained_at == [2, 5, 6]  # before the validations after steps 3 and 6, and at the end (7)
    assert [round(t >= 0.05) for t in cb.step_times] == [0, 0, 1, 0, 0, 1, 1]
    assert cb.train_time >= 0.15


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
