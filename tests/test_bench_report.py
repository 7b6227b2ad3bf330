"""The bench JSON schema, the aggregation of per-rank measurements, Markdown and plots."""

from __future__ import annotations

import copy
import importlib.util
import json
import statistics

import pytest

from lightning_gc.bench import report
from lightning_gc.bench.methods import MethodSpec, parse_methods, ring_factor
from lightning_gc.bench.runner import (
    SCHEMA,
    BenchConfig,
    BenchError,
    add_ratios,
    aggregate,
    failed_result,
    resolve,
)
from lightning_gc.bench.schedule import parse_schedule


def _rank(g, pph, step_times, compute, tx=None, tx_s=None, evals=None, engine=None, num_params=1000, psgd=None):
    return {
        "global_rank": g, "node_rank": g // pph, "local_rank": g % pph, "steps_done": len(step_times),
        "step_times": step_times, "compute_times": compute, "tx_window": tx, "tx_window_s": tx_s,
        "tx_val_excluded": 0, "engine_window": engine, "engine_totals": None, "powersgd_numel_window": psgd,
        "powersgd_model_elements": None,
        "evals": evals or [], "comm_hook": None, "num_params": num_params, "metric": "val_acc", "mode": "max",
        "target": 0.8, "batch_size": 32, "threads": 1,
    }


def _layout(steps=6, warmup=2, ranks=4, hosts=2, schedule=None):
    sched = parse_schedule(schedule) if schedule else None
    return {"steps": steps, "warmup": warmup, "ranks": ranks, "hosts": hosts, "procs_per_host": ranks // hosts,
            "schedule": sched, "boundaries": sched.boundaries(steps) if sched else []}


EVALS_SLOW = [{"step": 3, "train_time_s": 3.0, "value": 0.5}, {"step": 6, "train_time_s": 6.0, "value": 0.9}]
EVALS_FAST = [{"step": 3, "train_time_s": 1.0, "value": 0.85}, {"step": 6, "train_time_s": 2.0, "value": 0.9}]


def test_aggregate_dense_baseline_on_two_hosts_with_a_schedule():
    # 0:100mbit for steps 0-2, 10mbit for steps 3-5; the window is steps 2..5
    r = _layout(schedule="0:100mbit,0.5:10mbit")
    times = [[5.0, 5.0, 1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 1.5, 1.0, 3.0, 9.0]]
    ranks = [
        _rank(0, 2, times[0], [0.2, 0.3], tx=4_000_000, tx_s=10.0, evals=EVALS_SLOW),
        _rank(1, 2, times[1], [0.4, 0.4], evals=EVALS_SLOW),
        _rank(2, 2, times[0], [0.1], tx=2_000_000, tx_s=10.0, evals=EVALS_SLOW),
        _rank(3, 2, times[0], [0.1], evals=EVALS_SLOW),
    ]
    res = aggregate(MethodSpec("ddp"), ranks, r, count_wire=True, target=0.8)
    window = [1.5, 2.0, 3.0, 9.0]  # slowest rank per step
    assert res["measured_steps"] == 4
    assert res["step_times_s"] == [5.0, 5.0, 1.5, 2.0, 3.0, 9.0]
    assert res["step_time_s"] == pytest.approx(statistics.median(window))
    assert res["step_time_iqr_s"] == pytest.approx(4.5 - 1.875)  # linear-interpolated quartiles
    assert res["step_time_mean_s"] == pytest.approx(statistics.fmean(window))
    assert res["compute_time_s"] == pytest.approx(0.4)  # slowest rank's median
    assert res["comm_exposed_s"] == pytest.approx(res["step_time_s"] - 0.4)
    assert res["bytes_per_step"] == pytest.approx(ring_factor(4) * 4 * 1000)
    assert res["bytes_source"] == "analytic"
    wire_host = (4_000_000 + 2_000_000) / 2 / 4
    assert res["wire_bytes_per_host_per_step"] == pytest.approx(wire_host)
    assert res["wire_bytes_per_step"] == pytest.approx(wire_host / 2)
    rates = [100e6, 10e6, 10e6, 10e6]  # window steps 2, 3, 4, 5
    assert res["floor_s"] == pytest.approx(statistics.fmean(max(0.4, wire_host * 8 / x) for x in rates))
    assert res["floor_basis"] == "wire"
    assert res["link_utilization"] == pytest.approx(wire_host * 8 * 4 / sum(x * t for x, t in zip(rates, window)))
    assert res["achieved_bandwidth_bps"] == pytest.approx(wire_host * 8 / statistics.fmean(window))
    assert res["final_metric"] == pytest.approx(0.9)
    assert res["time_to_target_s"] == pytest.approx(6.0)
    assert res["wire_counters"][0] == {"host": 0, "tx_bytes": 4_000_000, "seconds": 10.0,
                                       "validation_tx_bytes_excluded": 0}


def test_aggregate_engine_counts_loopback_and_ratios():
    r = _layout(steps=5, warmup=1, ranks=2, hosts=2, schedule="0:100mbit")
    eng = {"steps": 4.0, "bytes_sent": 4000.0, "bytes_payload": 3000.0, "bytes_dense": 16000.0,
           "compress_time_s": 0.04, "comm_time_s": 0.1}
    ranks = [_rank(g, 1, [1.0, 0.5, 0.5, 0.5, 0.5], [0.1], engine=eng, evals=EVALS_FAST) for g in range(2)]
    gc = aggregate(MethodSpec("topk", {"ratio": 0.01}, gc=True), ranks, r, count_wire=False, target=0.8)
    assert gc["bytes_per_step"] == 1000.0 and gc["bytes_source"] == "engine"
    assert gc["payload_bytes_per_step"] == 750.0 and gc["dense_bytes_per_step"] == 4000.0
    assert gc["compress_time_s"] == pytest.approx(0.01)
    assert gc["wire_bytes_per_step"] is None and gc["wire_counters"] is None  # loopback: no wire counts
    assert gc["floor_basis"] == "engine"  # nominal rate x engine bytes x procs per host
    assert gc["floor_s"] == pytest.approx(max(0.1, 1000 * 8 / 100e6))
    assert gc["time_to_target_s"] == pytest.approx(1.0)
    assert "osp_deferred_fraction_mean" not in gc  # BSP: no OSP keys

    # the deferred exchange: per step the slowest rank's (duration, wait), then the median over the steps
    ics = [[(4.0, 1.0), (5.0, 0.5), (6.0, 2.0)], [(4.5, 0.2), (4.0, 1.5), (9.0, 0.1)]]
    osp_ranks = [dict(rk, osp_deferred_fractions=[0.0, 0.5, 0.7], osp_ics=v) for rk, v in zip(ranks, ics)]
    osp = aggregate(MethodSpec("dense", {"sync": "osp"}, gc=True), osp_ranks, r, count_wire=False, target=0.8)
    assert osp["osp_deferred_fraction_mean"] == pytest.approx(0.4) and osp["osp_deferred_fraction_max"] == 0.7
    assert osp["osp_ics_comm_s"] == pytest.approx(5.0)  # steps: 4.5, 5.0, 9.0
    assert osp["osp_ics_wait_s"] == pytest.approx(1.5)  # steps: 1.0, 1.5, 2.0

    dense_ranks = [_rank(g, 1, [1.0, 1.0, 1.0, 1.0, 1.0], [0.1], evals=EVALS_SLOW) for g in range(2)]
    ddp = aggregate(MethodSpec("ddp"), dense_ranks, r, count_wire=False, target=0.8)
    broken = failed_result(MethodSpec("qsgd", gc=True), "rank 1 exited with code 1")
    results = [ddp, gc, broken]
    add_ratios(results)
    assert ddp["ratio_vs_ddp"] == 1.0
    assert gc["ratio_vs_ddp"] == pytest.approx(0.5)
    assert gc["time_to_target_ratio_vs_ddp"] == pytest.approx(1.0 / 6.0)
    assert broken["ratio_vs_ddp"] is None

    doc = {"schema": SCHEMA, "config": {"preset": "probe", "ranks": 2, "hosts": 2, "procs_per_host": 1,
                                        "steps": 5, "warmup": 1, "compute_steps": 5, "metric": "val_acc",
                                        "mode": "max", "target": 0.8, "schedule": None, "schedule_steps": None},
           "emulated": False, "network": {"mode": "loopback", "reason": "test"}, "results": results}
    report.validate_document(doc)
    json.loads(json.dumps(doc))  # plain JSON types only
    md = report.markdown(doc)
    assert "NOT emulated" in md and "`topk:ratio=0.01`" in md and "0.5×" in md and "failed" in md


def test_aggregate_flags_a_torch_hook_that_did_not_run():
    r = _layout(steps=4, warmup=1, ranks=2, hosts=2)
    ranks = [_rank(g, 1, [1.0, 1.0, 1.0, 1.0], [0.1]) for g in range(2)]
    res = aggregate(MethodSpec("fp16"), ranks, r, count_wire=False, target=None)
    assert res["status"] == "error" and "fp16_compress_hook did not run" in res["error"]
    ranks[0]["comm_hook"] = "fp16_compress_hook"
    assert aggregate(MethodSpec("fp16"), ranks, r, count_wire=False, target=None)["status"] == "ok"


def _valid_doc():
    r = _layout(steps=4, warmup=1, ranks=2, hosts=2)
    ranks = [_rank(g, 1, [1.0, 1.0, 1.0, 1.0], [0.1], tx=100, tx_s=1.0, evals=EVALS_FAST) for g in range(2)]
    res = aggregate(MethodSpec("ddp"), ranks, r, count_wire=True, target=0.8)
    add_ratios([res])
    return {"schema": SCHEMA, "config": {"preset": "probe"}, "emulated": True, "results": [res]}


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d.pop("emulated"), "'emulated' must be a bool"),
        (lambda d: d.__setitem__("results", {}), "'results' must be a list"),
        (lambda d: d["results"][0].pop("floor_s"), "missing keys ['floor_s']"),
        (lambda d: d["results"][0].__setitem__("step_time_s", None), "step_time_s must be a number"),
        (lambda d: d["results"][0].__setitem__("ratio_vs_ddp", "1.0"), "ratio_vs_ddp must be a number or null"),
        (lambda d: d["results"][0].__setitem__("status", "meh"), "status 'meh'"),
        (lambda d: d.__setitem__("emulated", False), "wire_bytes_per_step must be null"),
    ],
)
def test_schema_validation_names_the_bad_field(mutate, fragment):
    doc = _valid_doc()
    report.validate_document(copy.deepcopy(doc))
    mutate(doc)
    with pytest.raises(ValueError) as exc:
        report.validate_document(doc)
    assert fragment in str(exc.value)


def test_outputs_json_markdown_and_plots(tmp_path):
    doc = _valid_doc()
    doc["config"].update(ranks=2, hosts=2, procs_per_host=1, steps=4, warmup=1, compute_steps=5, metric="val_acc",
                         mode="max", target=0.8, schedule=[{"at": 0.0, "rate": "100mbit", "rate_bps": 10**8}],
                         schedule_steps=[{"step": 0, "rate_bps": 10**8}])
    doc["network"] = {"mode": "netns", "shaper": "tbf"}
    paths = report.write_outputs(doc, json_path=str(tmp_path / "a" / "out.json"), out_dir=str(tmp_path / "o"))
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert "out.json" in names and "bench.json" in names and "bench.md" in names
    assert json.loads((tmp_path / "a" / "out.json").read_text())["results"][0]["method"] == "ddp"
    assert "**Network: emulated**" in (tmp_path / "o" / "bench.md").read_text()
    pngs = ("step_time.png", "bytes.png", "step_trace.png", "metric.png")
    if importlib.util.find_spec("matplotlib") is None:  # the plots extra is not installed: no plots, said so
        assert not any(png in names for png in pngs), names
        return
    for png in pngs:
        data = (tmp_path / "o" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"ranks": 1}, "--ranks=1"),
        ({"ranks": 4, "hosts": 3}, "not divisible by --hosts 3"),
        ({"steps": 3, "warmup": 3}, "no step would be measured"),
        ({"bandwidth": "1gbit", "schedule": "0:1gbit"}, "give one of them"),
        ({"network": "wifi"}, "--network 'wifi'"),
        ({"ratio": 0.0}, "--ratio 0.0"),
        ({"methods": "powersgd:start_iter=5", "warmup": 3}, "use --warmup 5"),
        ({"change_in_step": 0.5}, "no --schedule is given"),
        ({"change_in_step": 1.0, "schedule": "0:1gbit,0.5:10mbit"}, "--change-in-step 1.0 must be a share of a step in [0, 1)"),
        ({"change_in_step": -0.2, "schedule": "0:1gbit,0.5:10mbit"}, "--change-in-step -0.2"),
        ({"change_in_step": True, "schedule": "0:1gbit,0.5:10mbit"}, "--change-in-step True"),
    ],
)
def test_config_errors_name_value_reason_and_fix(kwargs, fragment):
    with pytest.raises(BenchError) as exc:
        resolve(BenchConfig(**{"methods": "ddp", **kwargs}))
    assert fragment in str(exc.value)


def test_network_line_says_where_in_its_step_each_rate_change_landed():
    """Before the step by default; with --change-in-step, the share asked for and the offsets the run measured
    (every method's changes, from rank 0's clock: the runner's tc commands take time of their own)."""
    doc = _valid_doc()
    doc["emulated"] = True
    doc["network"] = {"mode": "netns", "shaper": "htb"}
    doc["config"].update(hosts=4, procs_per_host=1, schedule=[{"at": 0.0, "rate": "1gbit", "rate_bps": 10**9},
                                                              {"at": 0.3, "rate": "10mbit", "rate_bps": 10**7}])
    line = report._network_line(doc)
    assert "to 1gbit from 0%, 10mbit from 30% (each change before its step starts)" in line, line
    doc["config"]["change_in_step"] = 0.5
    doc["results"][0]["rate_changes"] = [{"step": 3, "rate_bps": 10**7, "requested_offset_s": 0.03,
                                          "applied_offset_s": 0.0524}]
    doc["results"].append(dict(doc["results"][0], rate_changes=[{"step": 3, "rate_bps": 10**7,
                                                                 "requested_offset_s": 0.03, "applied_offset_s": 0.0961}]))
    line = report._network_line(doc)
    assert "(each change asked for 0.5 of a step into its step, applied 52-96 ms into it)" in line, line


def test_resolve_defaults_to_one_host_per_rank():
    r = resolve(BenchConfig(methods="ddp", ranks=4, bandwidth="100mbit", steps=12))
    assert r["hosts"] == 4 and r["procs_per_host"] == 1 and r["boundaries"] == [(0, 100_000_000)]
    r = resolve(BenchConfig(methods="ddp", ranks=4, hosts=2, schedule="0:1gbit,0.5:50mbit", steps=12))
    assert r["procs_per_host"] == 2 and r["boundaries"] == [(0, 10**9), (6, 50 * 10**6)]
    assert resolve(BenchConfig(methods="ddp", bandwidth="unshaped"))["schedule"] is None


def _ok(label, method, step, ttt):
    return {"label": label, "method": method, "status": "ok", "step_time_s": step, "time_to_target_s": ttt}


def test_best_baseline_is_the_fastest_torch_baseline_of_the_run_per_step_and_to_target():
    # the 16-bit hook has the fastest step, PowerSGD (with an option) the shortest time to target;
    # the gc_fp16 compressor and a failed ddp are not baselines
    results = [
        _ok("ddp", "ddp", 1.0, 10.0),
        _ok("fp16", "fp16", 0.5, 6.5),
        _ok("powersgd:rank=2", "powersgd", 0.6, 6.0),
        _ok("gc_fp16", "gc_fp16", 0.2, 5.0),
        _ok("topk:ratio=0.01", "topk", 0.3, None),
        {"label": "qsgd", "method": "qsgd", "status": "error", "step_time_s": None, "time_to_target_s": None},
    ]
    add_ratios(results)
    by = {r["label"]: r for r in results}
    assert {r["best_baseline_step"] for r in results} == {"fp16"}
    assert {r["best_baseline_ttt"] for r in results} == {"powersgd:rank=2"}
    assert by["topk:ratio=0.01"]["ratio_vs_best_baseline"] == pytest.approx(0.3 / 0.5)
    assert by["topk:ratio=0.01"]["time_to_target_ratio_vs_best_baseline"] is None  # never reached it
    assert by["gc_fp16"]["ratio_vs_best_baseline"] == pytest.approx(0.4)
    assert by["gc_fp16"]["time_to_target_ratio_vs_best_baseline"] == pytest.approx(5.0 / 6.0)
    assert by["ddp"]["ratio_vs_best_baseline"] == pytest.approx(2.0) and by["ddp"]["ratio_vs_ddp"] == 1.0
    assert by["qsgd"]["ratio_vs_best_baseline"] is None

    # without any torch baseline in the run there is nothing to compare with
    alone = [_ok("topk", "topk", 0.3, 3.0)]
    add_ratios(alone)
    assert alone[0]["best_baseline_step"] is None and alone[0]["ratio_vs_best_baseline"] is None


def test_markdown_names_the_best_baselines_and_shows_the_columns():
    r = _layout(steps=4, warmup=1, ranks=2, hosts=2)
    fast = [_rank(g, 1, [1.0, 0.5, 0.5, 0.5], [0.1], evals=EVALS_FAST) for g in range(2)]
    slow = [_rank(g, 1, [1.0, 1.0, 1.0, 1.0], [0.1], evals=EVALS_SLOW) for g in range(2)]
    for rk in fast + slow:
        rk["comm_hook"] = "fp16_compress_hook"
    results = [aggregate(MethodSpec("ddp"), [dict(x, comm_hook=None) for x in slow], r, count_wire=False, target=0.8),
               aggregate(MethodSpec("fp16"), fast, r, count_wire=False, target=0.8)]
    add_ratios(results)
    doc = {"schema": SCHEMA, "config": {"preset": "probe", "ranks": 2, "steps": 4, "warmup": 1, "compute_steps": 5,
                                        "metric": "val_acc", "mode": "max", "target": 0.8},
           "emulated": False, "network": {"mode": "loopback", "reason": "test"}, "results": results}
    report.validate_document(doc)
    md = report.markdown(doc)
    assert "best torch baseline in this run (step: `fp16`; time to target: `fp16`)" in md
    assert "| step / best baseline |" in md and "| TTT / best baseline |" in md
    ddp_row = next(line for line in md.splitlines() if line.startswith("| `ddp`"))
    assert "| 2× |" in ddp_row  # ddp's step is twice the 16-bit hook's


# --------------------------------------------------------------------------- auto: its pick in every report


def _decision(step, trigger, chosen, predicted, measured, previous=None):
    preds = {"ddp": 0.040, "fp16": 0.022, "topk": 0.012}
    return {"step": step, "trigger": trigger, "chosen": chosen, "previous": previous, "predicted_step_s": predicted,
            "measured_step_s": measured, "predictions": preds, "time_per_progress_s": {**preds, "topk": 0.018},
            "network": {"alpha_s": 1e-4, "beta_s_per_byte": 8e-8}, "dense_wall_s": 0.04, "decide_s": 0.2}


def _auto_record(*decisions):
    return {"chosen": decisions[-1]["chosen"] if decisions else None, "candidates": ["ddp", "fp16", "topk"],
            "decisions": list(decisions)}


def _auto_doc(step_auto=0.5, record=None, label="auto"):
    r = _layout(steps=4, warmup=1, ranks=2, hosts=2)
    record = record if record is not None else _auto_record(_decision(0, "warmup", "topk", 0.012, 0.013))
    slow = [_rank(g, 1, [1.0, 1.0, 1.0, 1.0], [0.1], evals=EVALS_SLOW) for g in range(2)]
    fast = [dict(_rank(g, 1, [1.0] + [step_auto] * 3, [0.1], evals=EVALS_FAST, engine={"steps": 3.0, "bytes_sent": 300.0}),
                 auto=record) for g in range(2)]
    spec = parse_methods(label, default_ratio=0.01)[0]
    results = [aggregate(MethodSpec("ddp"), slow, r, count_wire=False, target=0.8),
               aggregate(spec, fast, r, count_wire=False, target=0.8)]
    add_ratios(results)
    return {"schema": SCHEMA, "config": {"preset": "probe", "ranks": 2, "hosts": 2, "procs_per_host": 1, "steps": 4,
                                         "warmup": 1, "compute_steps": 5, "metric": "val_acc", "mode": "max",
                                         "target": 0.8, "schedule": None, "schedule_steps": None},
            "emulated": False, "network": {"mode": "loopback", "reason": "test"}, "results": results}


def test_markdown_names_autos_pick_and_lists_its_decisions():
    doc = _auto_doc(label="auto:candidates=ddp+fp16+topk")
    auto = doc["results"][1]
    assert auto["auto"]["chosen"] == "topk" and "auto" not in doc["results"][0]  # rank 0's record, auto only
    report.validate_document(doc)
    assert report.auto_pick(auto) == "topk" and report.auto_pick(doc["results"][0]) is None
    assert report.display_label(auto) == "auto:candidates=ddp+fp16+topk → topk"
    md = report.markdown(doc)
    assert "| `auto:candidates=ddp+fp16+topk` → topk | 500.0 ms |" in md
    assert "| `ddp` | 1.00 s |" in md  # other rows unchanged
    assert "## What `auto` picked" in md
    row = next(line for line in md.splitlines() if line.startswith("| `auto:candidates=ddp+fp16+topk` | 0 |"))
    assert row == ("| `auto:candidates=ddp+fp16+topk` | 0 | warmup | topk | 100 Mbit/s, α 0.1 ms | 12.0 ms | 13.0 ms "
                   "| ddp 40.0 ms (40.0 ms), fp16 22.0 ms (22.0 ms), **topk 12.0 ms** (18.0 ms) |")
    doc["results"] = doc["results"][:1]
    assert "## What `auto` picked" not in report.markdown(doc)  # no auto, no section


def test_a_drift_decision_names_the_test_that_saw_it():
    drift = dict(_decision(40, "drift", "topk", 0.012, None, previous="fp16"), drift_test="steps")
    doc = _auto_doc(record=_auto_record(_decision(0, "warmup", "fp16", 0.022, 0.023), drift))
    report.validate_document(doc)
    rows = [line for line in report.markdown(doc).splitlines() if line.startswith("| `auto` | ")]
    assert [r.split(" | ")[1:3] for r in rows] == [["0", "warmup"], ["40", "drift (steps)"]]


def test_a_decision_that_held_the_running_method_names_the_method_held_off():
    held = dict(_decision(100, "periodic", "fp16", 0.022, None, previous="fp16"), held_by_margin="ddp")
    doc = _auto_doc(record=_auto_record(_decision(0, "warmup", "fp16", 0.022, 0.023), held))
    report.validate_document(doc)
    rows = [line for line in report.markdown(doc).splitlines() if line.startswith("| `auto` | ")]
    assert [r.split(" | ")[3] for r in rows] == ["fp16", "fp16 (kept: ddp led by < switch_margin)"]


def test_a_re_decision_shows_the_sequence_and_a_run_without_a_decision_says_so():
    record = _auto_record(_decision(0, "warmup", "ddp", 0.04, 0.041), _decision(2, "drift", "ddp", 0.04, None),
                          _decision(3, "drift", "topk", 0.012, None, previous="ddp"))
    doc = _auto_doc(record=record)
    report.validate_document(doc)
    assert report.auto_pick(doc["results"][1]) == "ddp→topk"  # the kept ddp adds nothing to the sequence
    md = report.markdown(doc)
    assert "| `auto` → ddp→topk |" in md and md.count("| `auto` | ") == 3  # but every decision has its row
    doc = _auto_doc(record=_auto_record())
    report.validate_document(doc)
    assert "| `auto` → no decision |" in report.markdown(doc)


@pytest.mark.parametrize("winner, early, order, want", [
    ("challenger", False, "per_step_first", "topk→diloco50"),  # won by the bracket: entered again
    ("challenger", True, "per_step_first", "topk→diloco50"),  # won early: stayed
    ("challenger", False, "diloco_first", "topk→diloco50"),  # kept as the bracketing family
    ("incumbent", True, "diloco_first", "topk"),  # the per-step method won early
    ("incumbent", False, "per_step_first", "topk")])
def test_the_pick_shows_diloco_wherever_a_trial_ended_for_it(winner, early, order, want):
    """A trial's own windows are not picks; its verdict is, whichever order the trial ran in."""
    record = _auto_record(_decision(0, "warmup", "topk", 0.012, 0.013))
    enter = {"event": "enter", "step": 1 if order == "diloco_first" else 31, "choice": "diloco50", "why": "trial"}
    record["sync_events"] = [{"event": "trial", "step": 1, "challenger": "diloco50", "order": order}, enter,
                             {"event": "verdict", "step": 91, "challenger": "diloco50", "incumbent": "topk",
                              "winner": winner, "early": early}]
    doc = _auto_doc(record=record)
    assert report.auto_pick(doc["results"][1]) == want
    if winner == "challenger":  # DiLoCo then left on a moved link
        record["sync_events"].append({"event": "leave", "step": 200, "choice": "diloco50", "why": "link_moved"})
        assert report.auto_pick(_auto_doc(record=record)["results"][1]) == want + "→per-step"


def test_the_link_column_says_where_each_decisions_network_came_from():
    warm = dict(_decision(0, "warmup", "topk", 0.012, 0.013), network_source="dense_step")
    kept = dict(_decision(2, "periodic", "topk", 0.012, None), network_source="check",
                link_check={"check_s": 0.07, "probe_s": 0.065, "bytes": 168_000, "unchanged": True})
    moved = dict(_decision(3, "drift", "topk", 0.012, None), network_source="probe",
                 link_check={"check_s": 0.2, "probe_s": 0.065, "bytes": 168_000, "unchanged": False, "retimed": True})
    stalled = dict(_decision(4, "periodic", "topk", 0.012, None), network_source="check",
                   link_check={"check_s": 0.07, "probe_s": 0.065, "bytes": 168_000, "unchanged": True,
                               "retimed": True})
    slope = dict(_decision(5, "periodic", "topk", 0.012, None), network_source="check_slope",
                 link_check={"check_s": 0.2, "probe_s": 0.065, "bytes": 168_000, "unchanged": False, "retimed": True,
                             "beta_s_per_byte": 8e-8})
    modelled = dict(_decision(6, "periodic", "topk", 0.012, None), network_source="check",
                    link_check={"check_s": 0.07, "probe_s": 0.065, "bytes": 168_000, "unchanged": True,
                                "reference": "modelled"})
    doc = _auto_doc(record=_auto_record(warm, kept, moved, stalled, slope, modelled))
    report.validate_document(doc)
    rows = [line for line in report.markdown(doc).splitlines() if line.startswith("| `auto` | ")]
    assert [r.split(" | ")[4] for r in rows] == ["100 Mbit/s, α 0.1 ms (β from the dense step)",
                                                 "100 Mbit/s, α 0.1 ms (check: unchanged, not re-probed)",
                                                 "100 Mbit/s, α 0.1 ms (check twice: moved, re-probed)",
                                                 "100 Mbit/s, α 0.1 ms (check twice: unchanged, not re-probed)",
                                                 "100 Mbit/s, α 0.1 ms (check twice: moved, β from the check)",
                                                 "100 Mbit/s, α 0.1 ms (check against the model's time: unchanged, "
                                                 "not re-probed)"]


def test_a_decision_with_a_compute_shift_names_the_shifted_methods():
    shifted = dict(_decision(2, "calibration", "topk", 0.012, None), shift_s=-0.074, settled=["topk"])
    plain = dict(_decision(3, "gain", "topk", 0.012, None), shift_s=0.0, settled=["topk"])
    dense = dict(_decision(4, "drift", "topk", 0.012, None), shift_s=-0.03, settled=[], shift_from=["fp16"])
    doc = _auto_doc(record=_auto_record(shifted, plain, dense))
    report.validate_document(doc)
    rows = [line for line in report.markdown(doc).splitlines() if line.startswith("| `auto` | ")]
    assert rows[0].endswith("; ddp, fp16 shifted -74.0 ms |"), rows[0]
    assert "shifted" not in rows[1]  # no shift: nothing added
    assert rows[2].endswith("; ddp, fp16, topk shifted -30.0 ms (from fp16) |"), rows[2]


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda a: a.__setitem__("decisions", None), "auto.decisions must be a list"),
        (lambda a: a.__setitem__("chosen", 3), "auto.chosen must be a method name or null"),
        (lambda a: a["decisions"][0].pop("trigger"), "auto.decisions[0]: missing keys ['trigger']"),
        (lambda a: a["decisions"][0].__setitem__("step", -1), "step must be an integer >= 0"),
        (lambda a: a["decisions"][0].__setitem__("chosen", None), "chosen must be a string"),
        (lambda a: a["decisions"][0].__setitem__("predicted_step_s", "fast"), "predicted_step_s must be a number"),
        (lambda a: a["decisions"][0].__setitem__("predictions", {"ddp": None}), "predictions must map candidate"),
    ],
)
def test_schema_validation_checks_the_auto_record(mutate, fragment):
    doc = _auto_doc()
    report.validate_document(doc)
    doc["results"][1]["auto"] = None  # optional: null is fine
    report.validate_document(doc)
    doc = _auto_doc()
    mutate(doc["results"][1]["auto"])
    with pytest.raises(ValueError) as exc:
        report.validate_document(doc)
    assert fragment in str(exc.value) and "results[1] (auto)" in str(exc.value)
    doc["results"][1]["auto"] = "topk"
    with pytest.raises(ValueError, match="auto must be an object or null"):
        report.validate_document(doc)


def test_sweep_table_and_plot_mark_autos_pick_per_link(tmp_path, monkeypatch):
    fast_link = _auto_doc(step_auto=0.9, record=_auto_record(_decision(0, "warmup", "fp16", 0.02, 0.02)))
    slow_link = _auto_doc(record=_auto_record(_decision(0, "warmup", "ddp", 0.04, 0.05),
                                              _decision(2, "drift", "topk", 0.012, None, previous="ddp")))
    sweep = report.sweep_document([fast_link, slow_link], ["1gbit", "20mbit"])
    table = report.sweep_markdown(sweep)
    row = next(line for line in table.splitlines() if line.startswith("| `auto` |"))
    assert "900.0 ms (0.9×) (picked fp16)" in row and "500.0 ms (0.5×) (picked ddp→topk)" in row
    assert "for `auto`, the method it picked on that link" in table
    assert "picked" not in next(line for line in table.splitlines() if line.startswith("| `ddp` |"))
    plain = [copy.deepcopy(d) for d in (fast_link, slow_link)]
    for doc in plain:
        doc["results"] = doc["results"][:1]
    assert "picked" not in report.sweep_markdown(report.sweep_document(plain, ["1gbit", "20mbit"]))
    if importlib.util.find_spec("matplotlib") is None:
        return
    texts = []
    save = report._save

    def spy(fig, out_dir, name):
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts)
        return save(fig, out_dir, name)

    monkeypatch.setattr(report, "_save", spy)
    (path,) = report.write_sweep_plot(sweep, str(tmp_path))
    assert path.endswith("sweep.png")
    # auto's step on both links and its time to target on both links, each labelled with its pick
    assert sorted(texts) == sorted(["fp16", "ddp→topk"] * 2)
    texts.clear()
    report.write_plots(fast_link, str(tmp_path))
    assert texts  # the per-run plots still render with auto (its tick label carries the pick)


def test_resolve_refuses_a_warmup_shorter_than_autos_dense_profile():
    with pytest.raises(BenchError) as exc:
        resolve(BenchConfig(methods="ddp,auto:profile_steps=3", warmup=3, steps=10))
    msg = str(exc.value)
    assert "auto sends the first 4 steps dense (skip_steps=1 + profile_steps=3" in msg and "use --warmup 4" in msg
    with pytest.raises(BenchError, match="use --warmup 6"):
        resolve(BenchConfig(methods="auto:warmup_steps=6", warmup=4, steps=10))
    assert [s.name for s in resolve(BenchConfig(methods="ddp,auto", warmup=4, steps=10))["specs"]] == ["ddp", "auto"]
    resolve(BenchConfig(methods="auto:skip_steps=0:profile_steps=2", warmup=2, steps=10))
