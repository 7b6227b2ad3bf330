"""Validate ``lightning-gc advise`` against the steps a bench run measured.

Given a bench JSON (one run, or a ``--bandwidth a,b,...`` sweep), for every link of it this runs
:func:`lightning_gc.auto.advise.run` for the same preset, preset arguments, world size and link rate,
and sets each measured method's median step beside the prediction of the advise candidate that models
it:

========================  ====================================================================
bench method              advise candidate
========================  ====================================================================
``ddp``, ``fp16``         ``ddp``, ``fp16`` (DDP's bucket path, torch's fp16 hook numerics)
``topk`` (1 %)            ``topk`` (allgather, error feedback)
``qsgd``, ``efsign``      ``qsgd``, ``efsign``
``lowrank``               ``lowrank`` (our PowerSGD family, rank 2)
``powersgd`` (torch)      ``lowrank`` -- advise has no model of torch's hook itself; the row says
                          how far our PowerSGD-family prediction is from the hook users run
========================  ====================================================================

**What advise is given.** The validation plays a user who knows two figures of their cluster and
nothing of its network: the per-rank compute of a step and how fast their codec runs relative to
this machine. Both come from the bench run itself, not from its step times: ``compute_scale`` =
the bench's per-rank compute (``compute_time_s``: training step, backward and optimizer replayed
with no communication, on the ranks that shared the cores) divided by advise's single-process
profile of the same step; ``codec_scale`` is the same factor (the codecs shared the cores the same
way). The link is the bench's shaped rate with advise's default latency; no step time and no
communication time of the bench enters the prediction.

    python -m lightning_gc.bench.advise_validation bench_out/sweep.json --out bench_out/advise.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: bench method -> the advise candidate that models it
MODELS = {"ddp": "ddp", "fp16": "fp16", "topk": "topk", "qsgd": "qsgd", "efsign": "efsign",
          "lowrank": "lowrank", "powersgd": "lowrank"}


def _runs(doc: dict) -> list[dict]:
    if doc.get("schema", "").startswith("lightning_gc.bench.sweep"):
        return list(doc["runs"])
    if "results" in doc:
        return [doc]
    raise ValueError("advise_validation: the file is neither a bench run nor a bench sweep (no 'results'/'runs'); "
                     "give the JSON written by `lightning-gc bench --json`.")


def validate_run(run: dict, repeats: int = 3) -> dict[str, Any]:
    """Advise for one bench run's preset, ranks and link; one row per modelled method."""
    import torch

    from ..auto.advise import run as advise_run

    cfg = run["config"]
    torch.set_num_threads(int(cfg.get("threads") or 1))  # the ranks' own thread count
    ok = [r for r in run["results"] if r.get("status") == "ok" and r["method"] in MODELS]
    if not ok:
        raise ValueError(f"advise_validation: no method of {sorted(MODELS)} finished in the run at {cfg['bandwidth']}.")
    names = sorted({MODELS[r["method"]] for r in ok}, key=list(MODELS.values()).index)
    preset_args = {k: v for k, v in (cfg.get("preset_args") or {}).items()}
    base = advise_run(cfg["preset"], int(cfg["ranks"]), cfg["bandwidth"], preset_args=preset_args,
                      candidates=names, repeats=repeats, seed=int(cfg.get("seed", 0)))
    w = base.workload
    single = w.forward_s + w.backward_total_s + w.optimizer_s
    cluster = statistics.median(r["compute_time_s"] for r in ok if r.get("compute_time_s"))
    scale = cluster / single
    adv = advise_run(cfg["preset"], int(cfg["ranks"]), cfg["bandwidth"], preset_args=preset_args, candidates=names,
                     repeats=repeats, seed=int(cfg.get("seed", 0)), compute_scale=scale, codec_scale=scale)
    rows = []
    for r in ok:
        p = adv.predictions[MODELS[r["method"]]]
        m = r["step_time_s"]
        rows.append({"method": r["label"], "model": MODELS[r["method"]], "measured_step_s": m,
                     "predicted_step_s": p.step_s, "error": (p.step_s - m) / m})
    return {"bandwidth": cfg["bandwidth"], "ranks": cfg["ranks"], "preset": cfg["preset"], "preset_args": preset_args,
            "compute_single_s": single, "compute_cluster_s": cluster, "scale": scale, "pick": adv.pick, "rows": rows,
            "median_abs_error": statistics.median(abs(x["error"]) for x in rows)}


def report(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines.append(f"### {res['preset']} {res['preset_args'] or ''} · {res['ranks']} ranks · {res['bandwidth']}")
        lines.append(f"compute: {1e3 * res['compute_single_s']:.2f} ms alone, {1e3 * res['compute_cluster_s']:.2f} ms "
                     f"per rank in the run (scale {res['scale']:.2f}); advise's pick: {res['pick']}")
        lines.append("")
        lines.append("| method | modelled as | measured step | predicted | error |")
        lines.append("|---|---|---:|---:|---:|")
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
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.bench_json.read_text())
        results = [validate_run(r, args.repeats) for r in _runs(doc)]
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
