"""``lightning-gc bench`` command line: arguments, errors and a real (loopback) run end to end."""

from __future__ import annotations

import json

import pytest

from lightning_gc.bench import report
from lightning_gc.bench.cli import main


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--ranks", "3", "--hosts", "2", "--methods", "ddp"], "not divisible by --hosts 2"),
        (["--bandwidth", "100mbps", "--methods", "ddp"], "byte unit"),
        (["--schedule", "0.5:1gbit", "--methods", "ddp"], "add a first entry at 0"),
        (["--methods", "ddp,nosuch"], "unknown method 'nosuch'"),
        (["--steps", "2", "--warmup", "3", "--methods", "ddp"], "no step would be measured"),
    ],
)
def test_bad_arguments_exit_2_with_a_useful_message(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "lightning-gc bench: error:" in err and fragment in err


def test_usage_errors_and_help_return_codes(capsys):
    assert main(["--val-batches", "zero"]) == 2
    assert "is not a number" in capsys.readouterr().err
    assert main(["--preset-arg", "novalue"]) == 2
    assert main(["--help"]) == 0
    assert "--schedule" in capsys.readouterr().out


def test_list_methods(capsys):
    assert main(["--list-methods"]) == 0
    out = capsys.readouterr().out
    names = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ")]
    assert names[:3] == ["ddp", "powersgd", "fp16"] and "gc_fp16" in names and "gc_topk" in names


@pytest.mark.slow
def test_loopback_run_end_to_end_writes_a_valid_document(tmp_path, capsys):
    js, out = tmp_path / "out.json", tmp_path / "report"
    argv = ["--preset", "probe", "--preset-arg", "width=128", "--ranks", "2", "--methods", "ddp,fp16,powersgd:rank=2",
            "--steps", "6", "--warmup", "2", "--compute-steps", "2", "--eval-every", "3", "--val-batches", "2",
            "--network", "loopback", "--bandwidth", "100mbit", "--threads", "1", "--json", str(js), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "LOOPBACK - NOT emulated" in printed  # said clearly in the output ...
    assert "[ddp] step" in printed and "validation metric" in printed  # ... with progress while running
    doc = json.loads(js.read_text())
    report.validate_document(doc)
    assert doc["emulated"] is False and doc["network"]["mode"] == "loopback"  # ... and in the JSON
    assert doc["config"]["ranks"] == 2 and doc["config"]["bandwidth"] == "100mbit"
    assert doc["config"]["command"].startswith("lightning-gc bench --preset probe")
    by = {r["method"]: r for r in doc["results"]}
    assert set(by) == {"ddp", "fp16", "powersgd"} and all(r["status"] == "ok" for r in by.values())
    d = 128 * 128 + 128
    assert by["ddp"]["bytes_per_step"] == 4 * d  # ring factor 2(N-1)/N = 1 for N = 2
    assert by["fp16"]["bytes_per_step"] == 2 * d
    assert by["powersgd"]["bytes_per_step"] == 4 * (2 * (128 + 128) + 128)  # P, Q at rank 2 + the bias
    assert by["fp16"]["comm_hook"] == "fp16_compress_hook"  # the torch hook really ran on CPU
    assert "powerSGD_hook" in by["powersgd"]["comm_hook"]
    assert by["ddp"]["ratio_vs_ddp"] == 1.0
    for r in by.values():
        assert r["wire_bytes_per_step"] is None
        assert r["measured_steps"] == 4 and len(r["step_times_s"]) == 6
        assert [p["step"] for p in r["metric_curve"]] == [3, 6]
        assert r["final_metric"] == r["metric_curve"][-1]["value"]
        assert r["floor_s"] >= r["compute_time_s"] > 0
    assert (out / "bench.md").read_text().count("| `") == 3
    assert json.loads((out / "bench.json").read_text())["results"][0]["method"] == "ddp"


@pytest.mark.slow
def test_real_cluster_path_prepare_torchrun_collect(tmp_path, capsys):
    """--prepare writes configs and torchrun commands; running them (one node here) and --collect gives a report."""
    import os
    import subprocess
    import sys

    from dist_harness import free_port

    plan = tmp_path / "plan"
    port = free_port()
    assert main(["--prepare", str(plan), "--preset", "probe", "--preset-arg", "width=64", "--ranks", "2", "--hosts", "1",
                 "--methods", "ddp,fp16", "--steps", "5", "--warmup", "2", "--compute-steps", "2", "--val-batches", "1",
                 "--threads", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]) == 0
    commands = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("torchrun ")]
    assert len(commands) == 2 and "--nnodes 1 --nproc-per-node 2" in commands[0]
    # run the first method as a node would; leave the second one unrun to check incomplete runs are reported
    args = commands[0].replace("$NODE_RANK", "0").split()[1:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], check=True, timeout=300, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    js = tmp_path / "out.json"
    assert main(["--collect", str(plan), "--json", str(js)]) == 1  # one method incomplete
    doc = json.loads(js.read_text())
    report.validate_document(doc)
    assert doc["emulated"] is False and doc["network"]["mode"] == "cluster"
    ddp, fp16 = doc["results"]
    assert ddp["status"] == "ok" and ddp["bytes_per_step"] == 4 * (64 * 64 + 64) and ddp["measured_steps"] == 3
    assert fp16["status"] == "error" and "missing ['rank0.json', 'rank1.json']" in fp16["error"]


@pytest.mark.slow
def test_budget_stops_every_rank_at_the_target_or_when_the_training_time_is_spent(tmp_path):
    """--budget: a method stops at the first validation that reaches the target, or once it has trained
    for the budget; the steps are the cap. Both ranks stop at the same step (otherwise DDP would hang)."""
    base = ["--preset", "probe", "--preset-arg", "width=64", "--ranks", "2", "--methods", "ddp,topk",
            "--steps", "40", "--warmup", "2", "--compute-steps", "1", "--eval-every", "4", "--val-batches", "1",
            "--network", "loopback", "--threads", "1"]
    # an easy target (val_loss <= 100): reached at the first validation, step 4
    js = tmp_path / "target.json"
    assert main([*base, "--budget", "1000", "--target", "100", "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    report.validate_document(doc)
    assert doc["config"]["budget_s"] == 1000.0
    for r in doc["results"]:
        assert r["status"] == "ok" and r["stopped_by"] == "target", r
        assert len(r["step_times_s"]) == 4 and r["measured_steps"] == 2
        assert [p["step"] for p in r["metric_curve"]] == [4] and r["time_to_target_s"] is not None
    # a budget spent by the first measured step: stop right after it, target not reached
    js = tmp_path / "budget.json"
    assert main([*base, "--budget", "1e-9", "--target", "-1", "--json", str(js)]) == 0
    for r in json.loads(js.read_text())["results"]:
        assert r["stopped_by"] == "budget" and len(r["step_times_s"]) == 3 and r["measured_steps"] == 1, r
        assert r["time_to_target_s"] is None


def test_budget_is_validated():
    from lightning_gc.bench.runner import BenchConfig, BenchError, resolve

    with pytest.raises(BenchError, match=r"--budget 0 must be a number of seconds > 0"):
        resolve(BenchConfig(methods="ddp", budget_s=0))
    with pytest.raises(BenchError, match=r"--budget with --schedule .*use a constant --bandwidth"):
        resolve(BenchConfig(methods="ddp", budget_s=10, schedule="0:100mbit,0.5:10mbit"))
    assert resolve(BenchConfig(methods="ddp", budget_s=10))["budget_s"] == 10.0


@pytest.mark.slow
def test_bandwidth_sweep_runs_once_per_link_and_writes_one_table_and_one_plot(tmp_path, capsys):
    """... with auto among the methods: it decides on every link (a short profile, within --warmup)
    and the sweep's table names its pick per link."""
    js, out = tmp_path / "sweep.json", tmp_path / "out"
    auto = "auto:skip_steps=0:profile_steps=2:candidates=ddp+fp16+topk"
    argv = ["--preset", "probe", "--preset-arg", "width=64", "--ranks", "2", "--methods", f"ddp,fp16,{auto}",
            "--steps", "4", "--warmup", "2", "--compute-steps", "1", "--eval-every", "4", "--val-batches", "1",
            "--network", "loopback", "--threads", "1", "--bandwidth", "100mbit,20mbit",
            "--json", str(js), "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(js.read_text())
    assert doc["schema"] == report.SWEEP_SCHEMA and doc["links"] == ["100mbit", "20mbit"]
    assert [run["config"]["bandwidth"] for run in doc["runs"]] == ["100mbit", "20mbit"]
    picks = []
    for run in doc["runs"]:
        report.validate_document(run)
        assert [r["label"] for r in run["results"]] == ["ddp", "fp16", auto]
        rec = run["results"][2]["auto"]
        assert run["results"][2]["status"] == "ok" and rec["candidates"] == ["ddp", "fp16", "topk"]
        (decision,) = rec["decisions"]  # decided once, at the end of the last warm-up step
        assert decision["step"] == 1 and decision["trigger"] == "warmup" and decision["chosen"] == rec["chosen"]
        assert set(decision["predictions"]) == {"ddp", "fp16", "topk"} and decision["predicted_step_s"] > 0
        picks.append(rec["chosen"])
    # the floor follows each run's nominal rate (loopback: bytes / rate): 5x longer at 20 Mbit/s
    ddp = [next(r for r in run["results"] if r["label"] == "ddp") for run in doc["runs"]]
    assert ddp[1]["floor_basis"] == "engine"  # 16.6 kB at 20 Mbit/s: 6.7 ms, far above the compute
    assert ddp[1]["floor_s"] == pytest.approx(ddp[1]["bytes_per_step"] * 8 / 20e6)
    assert ddp[0]["floor_s"] == pytest.approx(max(ddp[0]["bytes_per_step"] * 8 / 100e6, ddp[0]["compute_time_s"]))
    table = (out / "sweep.md").read_text()
    assert "| method | step @ 100mbit | TTT @ 100mbit | step @ 20mbit | TTT @ 20mbit |" in table
    assert table.count("| `ddp` |") == 1 and table.count("| `fp16` |") == 1
    auto_row = next(line for line in table.splitlines() if line.startswith(f"| `{auto}` |"))
    assert [f"(picked {p})" in cell for p, cell in zip(picks, auto_row.split(" | ")[1::2])] == [True, True]
    assert f"| `{auto}` → {picks[1]} |" in (out / "20mbit" / "bench.md").read_text()
    assert (out / "sweep.png").exists() and (out / "100mbit" / "bench.md").exists() and (out / "20mbit" / "bench.md").exists()
    assert "sweep: link 2/2: 20mbit" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--bandwidth", "100mbit,100mbit"], "two or more different rates"),
    (["--bandwidth", "100mbit,20mbit", "--schedule", "0:1gbit"], "cannot be combined with --schedule"),
    (["--bandwidth", "100mbit,fast"], "fast"),
])
def test_bandwidth_sweep_refuses_bad_input_before_running(argv, fragment, capsys):
    assert main(["--preset", "probe", "--ranks", "2", "--methods", "ddp", "--network", "loopback", *argv]) == 2
    assert fragment in capsys.readouterr().err
