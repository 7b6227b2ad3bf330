"""What a new user meets before training starts: argument checking, refusals, the command's front door.

No processes are spawned here; the multi-process behaviour is in test_strategy_usability.py.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_gc
from lightning_gc import GCMonitor, GCStrategy
from lightning_gc.cli import main as cli_main
from lightning_gc.compressors import COMPRESSORS, available_compressors, build_compressor, build_config
from lightning_gc.compressors.base import Compressor
from lightning_gc.engine import EngineConfig
from lightning_gc.plans import available_planners


# ---------------------------------------------------------------- 1. strings read as booleans
@pytest.mark.parametrize("name", ["error_feedback", "check_finite", "monitor"])
@pytest.mark.parametrize("value", ["no", "false", "False", 0, 1])
def test_strategy_booleans_refuse_non_booleans(name, value):
    with pytest.raises(ValueError, match=rf"{name}={value!r} is invalid: it must be True.*Pass {name}=True or {name}=False"):
        GCStrategy(**{name: value})


def test_strategy_booleans_accept_booleans_and_keep_their_value():
    s = GCStrategy(compressor="topk", error_feedback=False, check_finite=False, monitor=False)
    assert s.engine_config.error_feedback is False and s.engine_config.check_finite is False
    assert GCStrategy(compressor="qsgd", error_feedback=None).engine_config.error_feedback is False  # QSGD default
    assert GCStrategy(compressor="qsgd", error_feedback=True).engine_config.error_feedback is True


@pytest.mark.parametrize("name", ["error_feedback", "check_finite"])
def test_engine_config_booleans_refuse_strings(name):
    with pytest.raises(ValueError, match=rf"{name}='no' is invalid.*bool\('no'\) would be True"):
        EngineConfig(**{name: "no"})


def test_compressor_config_booleans_refuse_strings():
    with pytest.raises(ValueError, match=r"unbiased='false' is invalid.*Pass unbiased=True or unbiased=False"):
        build_config("randomk", 0.05, {"unbiased": "false"})
    assert build_config("randomk", 0.05, {"unbiased": False}).unbiased is False


@pytest.mark.parametrize("name", ["prog_bar", "summary"])
def test_monitor_booleans_refuse_strings(name):
    with pytest.raises(ValueError, match=rf"{name}='yes' is invalid"):
        GCMonitor(**{name: "yes"})


def test_yaml_booleans_still_arrive_as_booleans(tmp_path, monkeypatch):
    """jsonargparse converts YAML true/false before GCStrategy sees them."""
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  strategy:\n    class_path: lightning_gc.GCStrategy\n"
        "    init_args: {compressor: randomk, error_feedback: false, check_finite: false,\n"
        "                compressor_args: {unbiased: false}}\n"
        "model: {class_path: lightning_gc.examples.MLPClassifier, init_args: {num_features: 8, hidden: [16]}}\n"
        "data: {class_path: lightning_gc.examples.TeacherClassificationData, init_args: {num_features: 8}}\n"
    )
    s = LightningCLI(args=["--config", str(cfg)], run=False).trainer.strategy
    assert s.engine_config.error_feedback is False and s.engine_config.check_finite is False
    assert s.config.compression.compressor_config().unbiased is False


# ---------------------------------------------------------------- 5. refusals describe the compressor
def test_every_compressor_describes_its_own_payload():
    default = Compressor.wire_description
    for name in available_compressors():
        assert build_compressor(name).wire_description != default, f"{name} has no wire_description"


@pytest.mark.parametrize(
    "compressor,collective,must,must_not,sparse_hint",
    [
        ("qsgd", "ring", r"norm per bucket.*quantisation level", ["indices"], False),
        ("signsgd", "allreduce", r"packed sign bits", ["indices", "norm"], False),
        ("efsignsgd", "tree", r"packed sign bits", ["indices"], False),
        ("topk", "allreduce", r"values with their int32 indices", ["norm", "sign bits"], True),
        ("mstopk", "ring", r"int32 indices", ["sign bits"], True),
        ("randomk", "allgather", r"positions every rank draws identically", ["sign bits"], False),
        ("fp16", "art_ring", r"cast to fp16", ["indices"], False),
        ("star_topk", "allgather", r"indices one source rank broadcasts", ["sign bits"], False),
    ],
)
def test_collective_refusal_describes_the_refused_compressor(compressor, collective, must, must_not, sparse_hint):
    import re

    with pytest.raises(ValueError, match=f"cannot travel by collective='{collective}'") as info:
        GCStrategy(compressor=compressor, collective=collective)
    msg = str(info.value)
    # the clause that describes what the compressor sends
    sent = re.search(r"it sends (.*?) \(wire format", msg)
    assert sent, msg
    assert re.search(must, sent.group(1)), msg
    for word in must_not:
        assert word not in sent.group(1), f"{word!r} does not describe {compressor}: {msg}"
    # the AR-Topk / RandomK suggestion only where the refused payload is (values, indices)
    assert ("compressor='star_topk'" in msg) == sparse_hint, msg


# ---------------------------------------------------------------- 10. misspelled DDP keywords
@pytest.mark.parametrize(
    "kwargs,closest",
    [({"bucket_cap_mbb": 25}, "bucket_cap_mb"), ({"find_unused_parameter": True}, "find_unused_parameters"),
     ({"gradient_as_bucket": True}, "gradient_as_bucket_view"), ({"compresor": "qsgd"}, "compressor")],
)
def test_misspelled_keyword_is_refused_at_construction_naming_the_closest(kwargs, closest):
    (key,) = kwargs
    with pytest.raises(ValueError, match=rf"unknown keyword argument {key}=.*Did you mean {closest}=\?"):
        GCStrategy(**kwargs)


def test_valid_ddp_keywords_still_reach_ddp():
    s = GCStrategy(compressor="topk", bucket_cap_mb=5, find_unused_parameters=True, static_graph=False)
    assert s._ddp_kwargs == {"bucket_cap_mb": 5, "find_unused_parameters": True, "static_graph": False}
    with pytest.raises(ValueError, match="device_ids= cannot be passed.*Trainer's devices="):
        GCStrategy(device_ids=[0])


# ---------------------------------------------------------------- 11. drop-in positional arguments
def _positional(cls) -> list[str]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]


def test_positional_order_is_ddpstrategys_and_own_arguments_are_keyword_only():
    assert _positional(GCStrategy) == _positional(DDPStrategy)
    own = [p for p in inspect.signature(GCStrategy.__init__).parameters.values()
           if p.name not in _positional(DDPStrategy) and p.name not in ("self", "kwargs")]
    assert own and all(p.kind is p.KEYWORD_ONLY for p in own)
    assert {"compressor", "ratio", "warmup_steps"} <= {p.name for p in own}


def test_accelerator_as_first_positional_argument_like_ddpstrategy():
    acc = CPUAccelerator()
    s = GCStrategy(acc, None, None, None, None, None, None, None, None, "gloo", None, "spawn", compressor="qsgd")
    ref = DDPStrategy(acc, None, None, None, None, None, None, None, None, "gloo", None, "spawn")
    assert s.accelerator is acc and s.compressor_name == "qsgd"
    assert (s.process_group_backend, s._timeout, s._start_method) == (
        ref.process_group_backend, ref._timeout, ref._start_method)
    with pytest.raises(ValueError, match="installs its own DDP communication hook, so ddp_comm_hook="):
        GCStrategy(None, None, None, None, None, None, print)


@pytest.mark.parametrize("value, fix", [("qsgd", "GCStrategy(compressor='qsgd')"),
                                        ("qsdg", "GCStrategy(compressor='qsgd')"),  # misspelt: the closest
                                        ("gloo", "GCStrategy(compressor='topk')")])  # nothing close: the default
def test_positional_string_that_is_no_accelerator_is_refused_with_the_keyword_form(value, fix):
    """GCStrategy("qsgd") used to become accelerator="qsgd" and fail at setup with a registry KeyError."""
    with pytest.raises(ValueError) as info:
        GCStrategy(value)
    msg = str(info.value)
    assert f"GCStrategy({value!r})" in msg  # the value
    assert "first positional argument" in msg and "`accelerator`" in msg  # the reason
    assert f"use {fix}" in msg and "Trainer(accelerator=...)" in msg  # the fix
    assert ("is a compressor" in msg) == (value == "qsgd")


def test_accelerator_names_are_still_accepted_positionally():
    s = GCStrategy("cpu", compressor="qsgd")  # DDPStrategy accepts a registered accelerator name
    assert s.accelerator == "cpu" and s.compressor_name == "qsgd"


def test_misspelt_alias_points_to_the_closest_alias_and_the_list():
    import lightning as L

    with pytest.raises(ValueError) as info:
        L.Trainer(strategy="gc_topkk", accelerator="cpu", devices=1, logger=False)
    msg = str(info.value)
    assert "strategy='gc_topkk' is not a registered strategy" in msg  # value
    assert "lightning_gc's aliases" in msg  # reason
    assert "Did you mean strategy='gc_topk'?" in msg and "lightning-gc list" in msg  # fix
    with pytest.raises(ValueError, match=r"Did you mean strategy='gc_qsgd_osp'\?"):
        L.Trainer(strategy="GC_QSGD_OPS", accelerator="cpu", devices=1, logger=False)
    # names outside lightning_gc's namespace keep Lightning's own message; registered ones still work
    with pytest.raises(ValueError, match="You selected an invalid strategy name: `strategy='ddpp'`"):
        L.Trainer(strategy="ddpp", accelerator="cpu", devices=1, logger=False)
    assert "gc_topk" in StrategyRegistry.available_strategies()
    assert "ddpp" not in StrategyRegistry.available_strategies()
    assert isinstance(L.Trainer(strategy="gc_topk", accelerator="cpu", devices=2, logger=False).strategy, GCStrategy)


def test_aliases_still_register_with_their_arguments():
    for name in available_compressors():
        assert StrategyRegistry[f"gc_{name}"]["init_params"] == {"compressor": name}
        assert StrategyRegistry[f"gc_{name}_find_unused_parameters_true"]["init_params"] == {
            "compressor": name, "find_unused_parameters": True}
    s = StrategyRegistry.get("gc_qsgd_find_unused_parameters_true")
    assert isinstance(s, GCStrategy) and s.compressor_name == "qsgd"
    assert s._ddp_kwargs == {"find_unused_parameters": True}


# ---------------------------------------------------------------- 8. the command's front door
def test_help_says_what_the_tool_is(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("fit", "validate", "bench", "list", "recipes", "quickstart.yaml", "GCStrategy"):
        assert word in out
    assert f"lightning-gc {lightning_gc.__version__}" in out


def test_version(capsys):
    import lightning
    import torch

    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"lightning-gc {lightning_gc.__version__} (lightning {lightning.__version__}, torch {torch.__version__})")


def test_console_entry_point_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "lightning_gc.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith(f"lightning-gc {lightning_gc.__version__}")


def test_unknown_command_and_no_command_exit_2(capsys):
    assert cli_main(["fitt"]) == 2
    assert "unknown command 'fitt'" in capsys.readouterr().err
    assert cli_main([]) == 2


def test_list_has_one_line_per_compressor_collective_plan_and_alias(capsys):
    from lightning_gc.exchanges.registry import available_collectives

    assert cli_main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    items = [ln.split()[0] for ln in lines if ln.startswith("  ")]
    aliases = [n for n, e in StrategyRegistry.items() if e["strategy"] is GCStrategy]
    expected = [*COMPRESSORS, "auto", *available_collectives(), *available_planners(), *aliases]
    assert items == expected
    # gc_<c>, gc_<c>_find_unused_parameters_true, gc_<c>_osp, gc_<c>_diloco, plus gc_auto, gc_omgs, gc_osp, gc_diloco
    assert len(aliases) == 4 * len(COMPRESSORS) + 4
    assert StrategyRegistry["gc_auto"]["init_params"] == {"compressor": "auto"}
    assert StrategyRegistry["gc_omgs"]["init_params"] == {"compressor": "topk", "plan": "omgs"}
    assert StrategyRegistry["gc_osp"]["init_params"] == {"compressor": "dense", "sync": "osp"}
    assert StrategyRegistry["gc_qsgd_osp"]["init_params"] == {"compressor": "qsgd", "sync": "osp"}
    by_name = {ln.split()[0]: ln for ln in lines if ln.startswith("  ")}
    assert by_name["qsgd"].endswith("[allgather]") and by_name["star_topk"].endswith("[art_allreduce]")
    assert "find_unused_parameters=True" in by_name["gc_topk_find_unused_parameters_true"]


def test_bench_list_methods_names_every_method_one_way(capsys):
    from lightning_gc.bench.cli import main as bench_main
    from lightning_gc.bench.methods import BASELINES, parse_methods

    assert bench_main(["--list-methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [ln.split()[0] for ln in lines if ln.startswith("  ")]
    assert names == [*BASELINES, *(f"gc_{n}" for n in COMPRESSORS), "auto"]
    for name in names:  # every listed name is accepted and means what its section says
        (spec,) = parse_methods(name, default_ratio=0.01)
        assert spec.gc == (name.startswith("gc_") or name == "auto")
        if name.startswith("gc_"):
            assert spec.name == name[3:]


# ---------------------------------------------------------------- bench plots stay readable with many methods
@pytest.mark.parametrize("n", [3, 10, 13, 20, 31])
def test_bench_method_styles_are_distinct(n):
    pytest.importorskip("matplotlib")
    from lightning_gc.bench.report import method_styles

    labels = [f"m{i}" for i in range(n)]
    styles = method_styles(labels)
    colours = [styles[x][0] for x in labels]
    markers = [styles[x][1] for x in labels]
    assert len(set(colours)) == n  # Matplotlib's default cycle repeats after 10
    assert len(set(zip(colours, markers))) == n
    assert len(set(markers)) == min(n, 15)


def test_bench_trace_and_metric_plots_draw_each_method_in_its_own_style(tmp_path, monkeypatch):
    """A 13-method document (the case where ddp and gradiveq shared a colour): every line of the
    per-step trace and of the metric plot has a colour and a marker no other method has."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_gc.bench import report

    methods = ["ddp", "fp16", "bf16", "powersgd", "topk", "lwtopk", "mstopk", "randomk", "qsgd", "signsgd",
               "efsignsgd", "marsit", "gradiveq"]
    results = [{"status": "ok", "label": m, "method": m, "compute_time_s": 0.1, "step_time_s": 0.2 + i / 100,
                "step_time_p25_s": 0.19, "step_time_p75_s": 0.25 + i / 100, "floor_s": None, "ratio_vs_ddp": 1.0,
                "bytes_per_step": 1000 + i, "wire_bytes_per_step": None, "dense_bytes_per_step": 4000,
                "step_times_s": [0.3, 0.2 + i / 100, 0.21], "metric_curve": [
                    {"train_time_s": 1.0, "value": 0.5}, {"train_time_s": 2.0, "value": 0.6 + i / 100}]}
               for i, m in enumerate(methods)]
    doc = {"results": results, "network": {"mode": "loopback"},
           "config": {"preset": "mlp", "ranks": 4, "hosts": 4, "schedule": None, "warmup": 1, "target": 0.85,
                      "metric": "val_acc"}}
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), real_close(fig)))
    paths = report.write_plots(doc, str(tmp_path))
    assert {p.rsplit("/", 1)[-1] for p in paths} >= {"step_trace.png", "metric.png"}
    for fig in figures[2:]:  # the trace and the metric plot: one line per method
        lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines() if ln.get_label() in methods}
        assert sorted(lines) == sorted(methods)
        styles = {(matplotlib.colors.to_hex(ln.get_color()), ln.get_marker()) for ln in lines.values()}
        assert len({c for c, _ in styles}) == len(methods) and len({m for _, m in styles}) == len(methods)
