"""Validate ``lightning-gc advise`` against the steps a bench run measured.

Given a bench JSON (one run, or a ``--bandwidth a,b,...`` sweep), for every link of it this runs
:func:`lightning_gc.bench.advise.run` for the same preset, preset arguments, world size and link rate,
and sets each measured method's median step beside the prediction of the advise candidate that models
it (:data:`MODELS`: the candidate of the same name, with the candidate's own options; torch's
``powersgd`` hook beside ``lowrank``, our PowerSGD family, since advise has no model of the hook itself).

**What advise is given.** The validation plays a user who knows two figures of their cluster and
nothing of its network: the per-rank compute of a step and how fast their codec runs relative to
this machine. Both come from the bench run itself, not from its step times: ``compute_scale`` =
the bench's per-rank compute (``compute_time_s``: training step, backward and optimizer replayed
with no communication, on the ranks that shared the cores) divided by advise's single-process
profile of the same step; ``codec_scale`` is the same factor (the codecs shared the cores the same
way). The link is the bench's shaped rate with advise's default latency.

With ``--other-from LINK`` the user also knows their job's step on the network they have today:
``other_ms`` (what a real step holds beyond compute and communication: the training loop, data,
logging, processes sharing cores) is set so that advise's ``ddp`` prediction equals the bench's
measured DDP step on ``LINK`` -- the live chooser's own calibration (``calibrate_other``) -- and the
other links are predicted with it. Without it no step time of the bench enters any prediction.

A run on emulated hosts (``--ranks 4 --hosts 2``) is advised with ``--ranks-per-node`` (ranks / hosts),
the link inside a host given by ``--intra-bandwidth`` (loopback, unshaped; default 10 Gbit/s) and the
run's per-rank compute given as ``compute_ms``: a flat method is set beside advise's flat column, a
``topology=nodes`` method beside its nodes column (docs/topology.md).

    python -m lightning_gc.bench.advise_validation bench_out/sweep.json --other-from 1gbit --out bench_out/advise.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: bench method -> the advise candidate that models it
MODELS = {"ddp": "ddp", "fp16": "fp16", "topk": "topk", "qsgd": "qsgd", "efsign": "efsign",
          "lowrank": "lowrank", "powersgd": "lowrank", "lowbit": "lowbit"}
#: the link inside an emulated host (loopback, unshaped) as advise is told it with ``--hosts``
DEFAULT_INTRA_BANDWIDTH = "10gbit"


def _modelled(r: dict) -> bool:
    """A finished method advise has a candidate for, whose options (but its topology, flat or nodes) are
    the candidate's own (``topk:ratio=0.01``, ``lowbit:bits=4``)."""
    from ..auto.candidates import CANDIDATES

    if r.get("status") != "ok" or r["method"] not in MODELS:
        return False
    opts = dict(r.get("options") or {})
    if opts.pop("topology", "flat") not in ("flat", "nodes"):
        return False
    cand = CANDIDATES[MODELS[r["method"]]]
    own = {**cand.compressor_args, **({"ratio": cand.ratio} if cand.ratio is not None else {})}
    return all(k in own and own[k] == v for k, v in opts.items())


def _runs(doc: dict) -> list[dict]:
    if doc.get("schema", "").startswith("lightning_gc.bench.sweep"):
        return list(doc["runs"])
    if "results" in doc:
        return [doc]
    raise ValueError("advise_validation: the file is neither a bench run nor a bench sweep (no 'results'/'runs'); "
                     "give the JSON written by `lightning-gc bench --json`.")


def validate_run(run: dict, repeats: int = 3, other_ms: float | None = None,
                 intra_bandwidth: str = DEFAULT_INTRA_BANDWIDTH) -> dict[str, Any]:
    """Advise for one bench run's preset, ranks and link; one row per modelled method. A run on
    emulated hosts (``--hosts``) is advised with ``--ranks-per-node`` (:func:`_validate_by_nodes`)."""
    import torch

    from . import advise as advise_mod

    cfg = run["config"]
    torch.set_num_threads(int(cfg.get("threads") or 1))  # the ranks' own thread count
    ok = [r for r in run["results"] if _modelled(r)]
    if not ok:
        raise ValueError(f"advise_validation: no method of {sorted(MODELS)} finished in the run at {cfg['bandwidth']}.")
    names = sorted({MODELS[r["method"]] for r in ok}, key=list(MODELS.values()).index)
    preset_args = {k: v for k, v in (cfg.get("preset_args") or {}).items()}
    # measured once (profile and codecs); the scales are applied to that measurement, as
    # override_workload and measure_costs apply --compute-scale and --codec-scale
    base = advise_mod.run(cfg["preset"], int(cfg["ranks"]), cfg["bandwidth"], preset_args=preset_args,
                          candidates=names, repeats=repeats, seed=int(cfg.get("seed", 0)))
    w = base.workload
    single = w.forward_s + w.backward_total_s + w.optimizer_s
    cluster = statistics.median(r["compute_time_s"] for r in ok if r.get("compute_time_s"))
    scale = cluster / single
    k = int(cfg["ranks"]) // int(cfg.get("hosts") or cfg["ranks"])
    if k > 1:
        return _validate_by_nodes(run, ok, names, k, cluster, single, repeats, other_ms, intra_bandwidth)
    workload = advise_mod.override_workload(w, other_ms=other_ms, compute_scale=scale)
    costs = [dataclasses.replace(c, codec_s=c.codec_s * scale) for c in base.costs]
    pick, predictions = advise_mod.advise(workload, costs, base.network, base.world_size, base.progress_weight)
    rows = [_row(r, MODELS[r["method"]], predictions[MODELS[r["method"]]].step_s) for r in ok]
    return _result(cfg, single, cluster, pick, rows, other_ms)


def _row(r: dict, model: str, predicted_s: float) -> dict[str, Any]:
    m = r["step_time_s"]
    return {"method": r["label"], "model": model, "measured_step_s": m, "predicted_step_s": predicted_s,
            "error": (predicted_s - m) / m}


def _result(cfg: dict, single: float, cluster: float, pick: str, rows: list[dict], other_ms: float | None,
            **extra: Any) -> dict[str, Any]:
    return {"bandwidth": cfg["bandwidth"], "ranks": cfg["ranks"], "preset": cfg["preset"],
            "preset_args": dict(cfg.get("preset_args") or {}), "compute_single_s": single,
            "compute_cluster_s": cluster, "scale": cluster / single, "pick": pick, "rows": rows,
            "other_ms": other_ms, "median_abs_error": statistics.median(abs(x["error"]) for x in rows), **extra}


def _validate_by_nodes(run: dict, ok: list[dict], names: list[str], k: int, cluster: float, single: float,
                       repeats: int, other_ms: float | None, intra_bandwidth: str) -> dict[str, Any]:
    """A run of ``k`` ranks per emulated host: advise by nodes, told the run's per-rank compute
    (``compute_ms``) and the codec scale measured as in the flat case; a flat method is set beside the
    flat column of advise's topology table, a ``topology=nodes`` method beside its nodes column."""
    from . import advise as advise_mod

    cfg = run["config"]
    adv = advise_mod.run(cfg["preset"], int(cfg["ranks"]), cfg["bandwidth"], preset_args=dict(cfg.get("preset_args") or {}),
                         candidates=names, repeats=repeats, seed=int(cfg.get("seed", 0)), ranks_per_node=k,
                         intra_bandwidth=intra_bandwidth, compute_ms=1e3 * cluster, codec_scale=cluster / single,
                         other_ms=other_ms)
    by_name = {row.name: row for row in adv.topology.rows}
    rows = []
    for r in ok:
        topology = (r.get("options") or {}).get("topology", "flat")
        row = by_name[MODELS[r["method"]]]
        p = row.nodes if topology == "nodes" else row.flat
        if p is not None:  # None: refused by nodes in advise, nothing to compare
            rows.append(_row(r, f"{MODELS[r['method']]} ({topology})", p.step_s))
    return _result(cfg, single, cluster, "/".join(adv.topology.best), rows, other_ms, ranks_per_node=k,
                   intra_bandwidth=intra_bandwidth)


def validate(doc: dict, repeats: int = 3, other_from: str | None = None,
             intra_bandwidth: str = DEFAULT_INTRA_BANDWIDTH) -> list[dict[str, Any]]:
    """Every link of a bench document; with ``other_from``, ``other_ms`` calibrated on that link's
    DDP step (see the module docstring) and the remaining links validated."""
    runs = _runs(doc)
    if other_from is None:
        return [validate_run(r, repeats, intra_bandwidth=intra_bandwidth) for r in runs]
    base = [r for r in runs if r["config"]["bandwidth"] == other_from]
    if not base:
        raise ValueError(f"--other-from {other_from!r}: no run on that link in the file (links: "
                         f"{[r['config']['bandwidth'] for r in runs]}); name one of them.")
    first = validate_run(base[0], repeats, intra_bandwidth=intra_bandwidth)
    ddp = [r for r in first["rows"] if r["method"] == "ddp"]
    if not ddp:
        raise ValueError(f"--other-from {other_from!r}: the run on that link has no finished 'ddp' method to "
                         "calibrate on; add ddp to the bench's --methods.")
    other_ms = 1e3 * max(ddp[0]["measured_step_s"] - ddp[0]["predicted_step_s"], 0.0)
    out = [validate_run(r, repeats, other_ms, intra_bandwidth) for r in runs if r["config"]["bandwidth"] != other_from]
    for res in out:
        res["other_from"] = other_from
    return out


def report(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines.append(f"### {res['preset']} {res['preset_args'] or ''} · {res['ranks']} ranks · {res['bandwidth']}")
        other = (f"; other {res['other_ms']:.1f} ms (DDP's step at {res['other_from']})"
                 if res.get("other_ms") is not None else "; other 0")
        if res.get("ranks_per_node"):
            lines.append(f"by nodes: {res['ranks_per_node']} ranks per emulated host, told {res['intra_bandwidth']} "
                         "inside a host; flat methods against advise's flat column, topology=nodes against its nodes column")
        lines.append(f"compute: {1e3 * res['compute_single_s']:.2f} ms alone, {1e3 * res['compute_cluster_s']:.2f} ms "
                     f"per rank in the run (scale {res['scale']:.2f}){other}; advise's pick: {res['pick']}")
        lines += ["", "| method | modelled as | measured step | predicted | error |", "|---|---|---:|---:|---:|"]
        for r in res["rows"]:
            lines.append(f"| {r['method']} | {r['model']} | {1e3 * r['measured_step_s']:.1f} ms | "
                         f"{1e3 * r['predicted_step_s']:.1f} ms | {100 * r['error']:+.0f} % |")
        lines.append(f"\nmedian |error|: {100 * res['median_abs_error']:.0f} %\n")
    every = [abs(r["error"]) for res in results for r in res["rows"]]
    if every:
        lines.append(f"**median |error| over all links and methods: {100 * statistics.median(every):.0f} %** "
                     f"({len(every)} steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_gc.bench.advise_validation",
                                description="advise's predicted steps against a bench run's measured steps")
    p.add_argument("bench_json", type=Path, help="JSON written by `lightning-gc bench --json` (one run or a sweep)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per codec measurement")
    p.add_argument("--other-from", default=None, metavar="LINK",
                   help="calibrate advise's other_ms on the DDP step measured on this link of the file (e.g. 1gbit) "
                        "and validate the other links")
    p.add_argument("--intra-bandwidth", default=DEFAULT_INTRA_BANDWIDTH,
                   help="for a run on emulated hosts (--hosts): the link inside a host advise is told (loopback)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.bench_json.read_text())
        results = validate(doc, args.repeats, args.other_from, args.intra_bandwidth)
    except (OSError, ValueError) as exc:
        print(f"advise_validation: {exc}", file=sys.stderr)
        return 2
    text = report(results)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
