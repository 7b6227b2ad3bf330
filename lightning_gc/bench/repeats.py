"""``--repeat R``: the method list run R times in interleaved rounds, combined into one row per method.

Why: on a shared machine its speed moves between the methods of one run by more than the ratios
worth telling apart. Rounds spread slow phases over all methods, and a ratio taken *within* a round
compares methods measured minutes apart rather than a whole run apart. The rounds alternate the
order (:func:`lightning_gc.bench.runner.round_order`).

How rounds are combined (:func:`combine_rounds`), per method:

* ``step_time_s``: the low median (``statistics.median_low``) over the rounds' median steps, so it is
  one round's measured value; that round's result supplies everything that is not combined (its
  per-step times, IQR, metric curve, ``auto`` history): ``median_round`` names it.
* ``final_metric``, ``time_to_target_s``, ``step_time_mean_s``, ``compute_time_s``,
  ``comm_exposed_s``: the median over rounds; a round that did not reach the target counts as
  infinitely slow, so the median is "not reached" when half or more of the rounds did not reach it.
* every ratio (vs DDP, vs the best baseline, step and time to target): the median over rounds of
  the ratio *within each round* (a paired comparison), not a ratio of the combined medians. The
  best baseline can differ between rounds; ``best_baseline_step``/``best_baseline_ttt`` name the
  one most rounds had.
* ``rounds``: one entry per round with its step, time to target, final metric, ratios,
  ``auto``'s picks, and its every step time and evaluation (``step_times_s``, ``metric_curve``), so
  the spread is in the document and the report.

A method that failed in any round is reported failed (the error of its first failed round): a
method that crashes one time in three is not a method to report a median for.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import Counter
from collections.abc import Sequence

#: per-round figures combined by their median over rounds (None = not measured in that round)
MEDIAN_FIELDS = ("step_time_mean_s", "compute_time_s", "comm_exposed_s", "final_metric", "overhead_s",
                 "overhead_share")
#: ratios taken within each round, then their median over rounds
STEP_RATIO_FIELDS = ("ratio_vs_ddp", "mean_ratio_vs_ddp", "ratio_vs_best_baseline")
#: time-to-target ratios: a round that did not reach the target counts as infinitely slow
TTT_RATIO_FIELDS = ("time_to_target_ratio_vs_ddp", "time_to_target_ratio_vs_best_baseline")


def _median_or_none(values: Sequence[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _median_unreached(values: Sequence[float | None]) -> float | None:
    """Median where ``None`` (target not reached) is +inf; None when that median is infinite."""
    if not values:
        return None
    m = statistics.median([math.inf if v is None else float(v) for v in values])
    return None if math.isinf(m) else m


def _most_common(values: Sequence[str | None]) -> str | None:
    counted = Counter(v for v in values if v is not None)
    return counted.most_common(1)[0][0] if counted else None


def _ddp_reached(results: Sequence[dict]) -> bool:
    ddp = next((x for x in results if x["method"] == "ddp" and x["status"] == "ok"), None)
    return ddp is not None and ddp.get("time_to_target_s") is not None


def round_summary(index: int, result: dict) -> dict:
    """What the document keeps of one round's result beside the combined row."""
    from .report import auto_pick  # the report owns how an auto result's picks are written

    # position: its place in the order the round ran its methods in (runner.round_order)
    out = {"round": index, "status": result["status"], "seed": result.get("seed"), "position": result.get("position")}
    for k in ("step_time_s", "time_to_target_s", "final_metric", *STEP_RATIO_FIELDS, *TTT_RATIO_FIELDS,
              "best_baseline_step", "best_baseline_ttt"):
        out[k] = result.get(k)
    # every step and evaluation of every round, not only the median round's: what happened in the
    # other rounds (a slow phase, a late switch) is otherwise lost to the document
    out["step_times_s"] = list(result.get("step_times_s") or [])
    out["metric_curve"] = list(result.get("metric_curve") or [])
    out["auto_pick"] = auto_pick(result) if result.get("auto") else None
    if result.get("auto"):  # every round's decisions, not only the median round's (the row's `auto`)
        out["auto"] = result["auto"]
    if result["status"] != "ok":
        out["error"] = result.get("error")
    return out


def combine_rounds(rounds: Sequence[Sequence[dict]]) -> list[dict]:
    """One result per method from R rounds of the same method list (each round's ratios already
    added by :func:`lightning_gc.bench.runner.add_ratios`). See the module docstring for the rules."""
    if not rounds:
        raise ValueError("combine_rounds: no rounds to combine")
    labels = [x["label"] for x in rounds[0]]
    for k, rnd in enumerate(rounds):
        if [x["label"] for x in rnd] != labels:
            raise ValueError(f"combine_rounds: round {k} ran {[x['label'] for x in rnd]}, round 0 ran {labels}; "
                             "every round must run the same methods in the same order")
    # a round whose reference (DDP, the best baseline) did not reach the target has no time-to-target
    # ratio and is left out; one where the reference reached it and a method did not counts as
    # infinitely slow for that method
    ddp_reached = [_ddp_reached(rnd) for rnd in rounds]
    combined = []
    for j in range(len(labels)):
        reps = [rnd[j] for rnd in rounds]
        summaries = [round_summary(k, x) for k, x in enumerate(reps)]
        failed = next((x for x in reps if x["status"] != "ok"), None)
        if failed is not None:
            out = copy.deepcopy(failed)
            bad = [s["round"] for s in summaries if s["status"] != "ok"]
            out["error"] = f"failed in round(s) {bad} of {len(reps)}: {failed.get('error')}"
            out["rounds"] = summaries
            combined.append(out)
            continue
        step = statistics.median_low([x["step_time_s"] for x in reps])
        k_med = next(k for k, x in enumerate(reps) if x["step_time_s"] == step)
        out = copy.deepcopy(reps[k_med])  # its step_time_s is the low median
        out["median_round"] = k_med
        for f in MEDIAN_FIELDS:
            out[f] = _median_or_none([x.get(f) for x in reps])
        out["time_to_target_s"] = _median_unreached([x.get("time_to_target_s") for x in reps])
        for f in STEP_RATIO_FIELDS:
            out[f] = _median_or_none([x.get(f) for x in reps])
        out["time_to_target_ratio_vs_ddp"] = _median_unreached(
            [x.get("time_to_target_ratio_vs_ddp") for x, ok in zip(reps, ddp_reached) if ok])
        out["time_to_target_ratio_vs_best_baseline"] = _median_unreached(
            [x.get("time_to_target_ratio_vs_best_baseline") for x in reps if x.get("best_baseline_ttt") is not None])
        out["best_baseline_step"] = _most_common([x.get("best_baseline_step") for x in reps])
        out["best_baseline_ttt"] = _most_common([x.get("best_baseline_ttt") for x in reps])
        out["rounds"] = summaries
        combined.append(out)
    return combined
