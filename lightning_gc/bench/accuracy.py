"""Accuracy table over seeds: one row per method from several ``lightning-gc bench`` result files.

The bench measures one seed per invocation. An accuracy comparison needs several seeds and a
tolerance taken from how much the dense baseline itself moves between seeds; this module reads the
JSON documents of runs that differ only in ``--seed`` and reports, per method:

* the final metric of every seed and their mean;
* the metric at a fixed wall-clock budget (training time, validation excluded, as the bench's
  ``metric_curve`` records it): linear interpolation between the two evaluations around the
  budget; the final value when the method had finished before it; ``None`` when its first
  evaluation came after it. The default budget is DDP's mean training time over the seeds, so the
  column answers "what did each method reach in the time DDP needed for the whole run";
* engine bytes and wire bytes per rank and step (mean over seeds), and the ratio to DDP's;
* the mean final metric's distance from DDP's, in the metric's "worse" direction, and whether it is
  within the tolerance.

Tolerance: ``k`` times DDP's seed-to-seed spread (max − min of its final metric over the seeds),
``k = 3`` by default, unless given as a number. With two seeds the spread of a mean is of the order
of the spread itself, so ``3×`` tolerates what seed noise alone could produce in either run and
not much more; ``tolerance_floor`` keeps it from collapsing to 0 when DDP's seeds agree exactly.

Usage (``python -m lightning_gc.bench.accuracy --help``)::

    lightning-gc bench --preset gpt --ranks 4 --bandwidth 100mbit --steps 600 --eval-every 50 \\
        --val-batches 16 --seed 0 --methods "$(python -m lightning_gc.bench.accuracy --methods)" --json s0.json
    # ... the same with --seed 1 --json s1.json
    python -m lightning_gc.bench.accuracy s0.json s1.json --out table.md

Further methods measured later with the same settings join the table: pass their documents too
(``s0.json s1.json more_s0.json more_s1.json``); documents of one seed are merged, a method may
appear only once per seed, and every seed must end up with the same methods.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_gc.bench.report import fmt_cell

__all__ = ["ADAMW_TABLE_METHODS", "AccuracyError", "MethodRow", "accuracy_rows", "metric_at", "markdown", "main"]

#: The methods of the AdamW accuracy table: DDP fp32, torch's fp16 and PowerSGD hooks, every
#: lightning_gc compressor at its defaults (the bench adds ``--ratio`` to those that take one),
#: OSP, OMGS and the adaptive-ratio controller on Top-k, and the run-time choice ``auto``.
ADAMW_TABLE_METHODS = (
    "ddp,fp16,powersgd,gc_dense,gc_fp16,gc_bf16,topk,lwtopk,mstopk,randomk,qsgd,signsgd,efsignsgd,marsit,"
    "gradiveq,lowrank,star_topk,var_topk,artopk_auto,topk:sync=osp,topk:plan=omgs,topk:adaptive=shadow,auto"
)

# the configuration keys that must agree between the documents of one table (the seed may not)
_SAME = ("preset", "preset_args", "ranks", "hosts", "bandwidth", "schedule_spec", "steps", "eval_every",
         "val_batches", "network", "metric", "mode")


class AccuracyError(ValueError):
    """Documents that cannot form one table; the message says which and why."""


@dataclass
class MethodRow:
    label: str
    finals: list[float | None]
    final_mean: float | None
    at_budget: list[float | None]
    at_budget_mean: float | None
    bytes_per_step: float | None
    wire_bytes_per_step: float | None
    bytes_ratio_vs_ddp: float | None
    delta_vs_ddp: float | None  # > 0: worse than DDP by this much
    within_tolerance: bool | None
    errors: list[str]


def metric_at(curve: list[dict], budget_s: float) -> float | None:
    """The metric at training time ``budget_s`` from a bench ``metric_curve`` (points with
    ``train_time_s`` and ``value``, in training order); see the module docstring."""
    pts = [(float(p["train_time_s"]), float(p["value"])) for p in curve if p.get("value") is not None]
    if not pts or budget_s < pts[0][0]:
        return None
    if budget_s >= pts[-1][0]:
        return pts[-1][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t0 <= budget_s <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (budget_s - t0) / (t1 - t0)
    raise AssertionError("unreachable: budget inside the curve's time range")


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if len(vals) == len(values) and vals else None


def _check_same(docs: list[dict]) -> None:
    first = docs[0]["config"]
    for doc in docs[1:]:
        diff = {k: (first.get(k), doc["config"].get(k)) for k in _SAME if first.get(k) != doc["config"].get(k)}
        if diff:
            raise AccuracyError(f"the runs differ in more than the seed and the methods: {diff} (seed "
                                f"{first.get('seed')} vs {doc['config'].get('seed')}); rerun with the same settings")


def merge_by_seed(docs: list[dict]) -> list[dict]:
    """One document per seed, in order of first appearance: the results of several documents of
    the same seed (a second bench run of further methods with the same settings) are concatenated,
    the first document's config kept. Refuses documents whose settings differ beyond the seed and
    the methods, and a method that appears twice for one seed (which run would count?)."""
    if not docs:
        raise AccuracyError("no documents given: pass the bench JSON of each seed")
    _check_same(docs)
    merged: dict = {}
    for doc in docs:
        seed = doc["config"].get("seed")
        if seed not in merged:
            merged[seed] = {**doc, "results": list(doc["results"])}
            continue
        have = {r["label"] for r in merged[seed]["results"]}
        dup = sorted(have & {r["label"] for r in doc["results"]})
        if dup:
            raise AccuracyError(f"seed {seed}: method(s) {dup} appear in two documents; keep one run of each "
                                "method per seed")
        merged[seed]["results"] += doc["results"]
    out = list(merged.values())
    if len(out) < 2:
        raise AccuracyError(f"an accuracy table needs runs of at least 2 seeds; got seed(s) {list(merged)}")
    return out


def accuracy_rows(docs: list[dict], *, budget_s: float | None = None, tolerance: float | None = None,
                  tolerance_k: float = 3.0, tolerance_floor: float = 1e-3) -> tuple[list[MethodRow], dict]:
    """One :class:`MethodRow` per method label (in the first document's order) and a summary dict
    (``mode``, ``metric``, ``seeds``, ``budget_s``, ``tolerance``, ``ddp_spread``). ``docs`` may hold
    several documents per seed (see :func:`merge_by_seed`)."""
    docs = merge_by_seed(docs)
    mode, metric = docs[0]["config"]["mode"], docs[0]["config"]["metric"]
    by_label = [{r["label"]: r for r in d["results"]} for d in docs]
    labels = [r["label"] for r in docs[0]["results"]]
    for i, d in enumerate(by_label[1:], start=1):
        if set(d) != set(labels):
            raise AccuracyError(f"seed {docs[i]['config'].get('seed')} has methods {sorted(d)}, seed "
                                f"{docs[0]['config'].get('seed')} has {sorted(labels)}; run the same --methods")
    if "ddp" not in labels or any(d["ddp"]["status"] != "ok" for d in by_label):
        raise AccuracyError("every run needs a successful 'ddp' result: the tolerance and the budget come from it")
    ddp_finals = [d["ddp"]["final_metric"] for d in by_label]
    ddp_times = [d["ddp"]["metric_curve"][-1]["train_time_s"] for d in by_label]
    spread = max(ddp_finals) - min(ddp_finals)
    tol = float(tolerance) if tolerance is not None else max(tolerance_k * spread, tolerance_floor)
    budget = float(budget_s) if budget_s is not None else statistics.fmean(ddp_times)
    ddp_final_mean = statistics.fmean(ddp_finals)
    ddp_bytes = _mean([d["ddp"]["bytes_per_step"] for d in by_label])
    rows = []
    for label in labels:
        runs = [d[label] for d in by_label]
        errors = [f"seed {doc['config'].get('seed')}: {r['error']}" for doc, r in zip(docs, runs) if r["status"] != "ok"]
        ok = not errors
        finals = [r["final_metric"] if ok else None for r in runs]
        at_budget = [metric_at(r["metric_curve"], budget) if ok else None for r in runs]
        final_mean = _mean(finals)
        delta = None
        if final_mean is not None:
            delta = final_mean - ddp_final_mean if mode == "min" else ddp_final_mean - final_mean
        b = _mean([r["bytes_per_step"] for r in runs]) if ok else None
        rows.append(MethodRow(
            label=label, finals=finals, final_mean=final_mean, at_budget=at_budget, at_budget_mean=_mean(at_budget),
            bytes_per_step=b, wire_bytes_per_step=_mean([r["wire_bytes_per_step"] for r in runs]) if ok else None,
            bytes_ratio_vs_ddp=None if b is None or not ddp_bytes else b / ddp_bytes,
            delta_vs_ddp=delta, within_tolerance=None if delta is None else delta <= tol, errors=errors,
        ))
    summary = {"metric": metric, "mode": mode, "seeds": [d["config"].get("seed") for d in docs], "budget_s": budget,
               "tolerance": tol, "ddp_spread": spread, "tolerance_rule": (
                   "given" if tolerance is not None else f"max({tolerance_k:g} x DDP spread, {tolerance_floor:g})")}
    return rows, summary


def markdown(rows: list[MethodRow], summary: dict, docs: list[dict]) -> str:
    cfg = docs[0]["config"]
    m = summary["metric"]
    seeds = summary["seeds"]
    lines = [
        f"# Accuracy over seeds {', '.join(map(str, seeds))} — preset `{cfg['preset']}`, {cfg['ranks']} ranks, "
        f"{cfg['steps']} steps, link {cfg.get('bandwidth') or cfg.get('schedule_spec') or 'unshaped'} "
        f"({'emulated' if docs[0].get('emulated') else 'NOT emulated: ' + str(docs[0].get('network', {}).get('reason'))})",
        "",
        f"Tolerance {summary['tolerance']:.4f} = {summary['tolerance_rule']} (DDP spread {summary['ddp_spread']:.4f}); "
        f"budget {summary['budget_s']:.1f} s of training time (validation excluded).",
        "",
        f"| method | final {m} per seed | mean | Δ vs DDP | within | {m} at budget (mean) | bytes/step | "
        f"wire bytes/step | bytes / DDP |",
        "|---|---|---:|---:|:-:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.errors:
            lines.append(f"| `{r.label}` | failed: {'; '.join(r.errors)[:200]} | – | – | – | – | – | – | – |")
            continue
        lines.append(
            f"| `{r.label}` | {' / '.join(fmt_cell(v) for v in r.finals)} | {fmt_cell(r.final_mean)} | {fmt_cell(r.delta_vs_ddp, '{:+.3f}')} "
            f"| {'yes' if r.within_tolerance else 'NO'} | {fmt_cell(r.at_budget_mean)} | "
            f"{fmt_cell(r.bytes_per_step, '{:,.0f}')} | {fmt_cell(r.wire_bytes_per_step, '{:,.0f}')} | "
            f"{fmt_cell(r.bytes_ratio_vs_ddp, '{:.4f}')} |"
        )
    lines += ["", "Commands:"] + [f"    {d['config'].get('command', '?')}" for d in docs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_gc.bench.accuracy", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="bench JSON documents (--json): one or more per seed, merged by seed")
    p.add_argument("--budget", type=float, default=None, help="wall-clock training budget in seconds "
                   "(default: DDP's mean training time)")
    p.add_argument("--tolerance", type=float, default=None, help="absolute tolerance on the mean final metric")
    p.add_argument("--tolerance-k", type=float, default=3.0, help="tolerance = K x DDP's seed spread")
    p.add_argument("--out", default=None, help="write the Markdown table here (default: stdout)")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--methods", action="store_true", help="print the table's --methods list and exit")
    args = p.parse_args(argv)
    if args.methods:
        print(ADAMW_TABLE_METHODS)
        return 0
    try:
        docs = []
        for path in args.runs:
            with open(path) as fh:
                docs.append(json.load(fh))
        rows, summary = accuracy_rows(docs, budget_s=args.budget, tolerance=args.tolerance,
                                      tolerance_k=args.tolerance_k)
    except (OSError, json.JSONDecodeError, KeyError, AccuracyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = markdown(rows, summary, docs)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": [r.__dict__ for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
