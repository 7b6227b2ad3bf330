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
    assert s._compressor_config.unbiased is False


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
    from lightning_gc.comm.registry import available_collectives

    assert cli_main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    items = [ln.split()[0] for ln in lines if ln.startswith("  ")]
    aliases = [n for n, e in StrategyRegistry.items() if e["strategy"] is GCStrategy]
    expected = [*COMPRESSORS, *available_collectives(), *available_planners(), *aliases]
    assert items == expected
    # gc_<c>, gc_<c>_find_unused_parameters_true, gc_<c>_osp, plus gc_omgs and gc_osp
    assert len(aliases) == 3 * len(COMPRESSORS) + 2
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
    assert names == [*BASELINES, *(f"gc_{n}" for n in COMPRESSORS)]
    for name in names:  # every listed name is accepted and means what its section says
        (spec,) = parse_methods(name, default_ratio=0.01)
        assert spec.gc == name.startswith("gc_")
        if spec.gc:
            assert spec.name == name[3:]
