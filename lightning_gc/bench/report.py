"""Outputs of ``lightning-gc bench``: the JSON document, a Markdown table and PNG plots.

``--json FILE`` writes the document (schema in ``docs/bench.md``); ``--out DIR`` writes
``DIR/bench.json``, ``DIR/bench.md`` and, when matplotlib is installed, ``DIR/step_time.png``
(stacked compute + exposed communication per method with the IQR and the physical floor),
``DIR/bytes.png`` (engine vs wire bytes per rank per step), ``DIR/step_trace.png`` (every step's
time over the run, with the warm-up and schedule phases marked) and ``DIR/metric.png`` (task metric
against training time, with the target).

``auto`` results carry the chooser's decisions (optional key ``auto``). Wherever the method is
named, its pick is shown (:func:`auto_pick`: ``topk``, or ``ddp→topk`` if it re-decided), and a
section after the table lists every decision.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from lightning_gc.bench.schedule import format_rate

__all__ = ["validate_document", "write_json", "markdown", "write_plots", "write_outputs", "REQUIRED_RESULT_KEYS",
           "auto_pick", "display_label"]

REQUIRED_RESULT_KEYS = (
    "method", "label", "status", "error", "step_time_s", "step_time_iqr_s", "compute_time_s", "comm_exposed_s",
    "bytes_per_step", "wire_bytes_per_step", "final_metric", "time_to_target_s", "floor_s", "ratio_vs_ddp",
    "time_to_target_ratio_vs_ddp",
)


def validate_document(doc: Any) -> None:
    """Raise ``ValueError`` naming the first field that does not follow the documented schema."""
    if not isinstance(doc, dict):
        raise ValueError(f"bench document must be an object, got {type(doc).__name__}")
    for key, typ in (("config", dict), ("emulated", bool), ("results", list)):
        if not isinstance(doc.get(key), typ):
            raise ValueError(f"bench document: top-level {key!r} must be a {typ.__name__}, got {doc.get(key)!r:.80}")
    num = (int, float)
    for i, res in enumerate(doc["results"]):
        where = f"results[{i}] ({res.get('label', '?')})"
        missing = [k for k in REQUIRED_RESULT_KEYS if k not in res]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        if res["status"] not in ("ok", "error"):
            raise ValueError(f"{where}: status {res['status']!r} is not 'ok' or 'error'")
        nullable_num = ["time_to_target_s", "ratio_vs_ddp", "time_to_target_ratio_vs_ddp", "final_metric",
                        "wire_bytes_per_step", "bytes_per_step", "compute_time_s", "floor_s", "comm_exposed_s",
                        "ratio_vs_best_baseline", "time_to_target_ratio_vs_best_baseline"]  # the last two optional
        if res["status"] == "ok":
            for k in ("step_time_s", "step_time_iqr_s"):
                if not isinstance(res[k], num) or res[k] < 0:
                    raise ValueError(f"{where}: {k} must be a number >= 0, got {res[k]!r}")
        else:
            nullable_num += ["step_time_s", "step_time_iqr_s"]
            if not isinstance(res["error"], str):
                raise ValueError(f"{where}: a failed result needs an 'error' string")
        for k in nullable_num:
            if res.get(k) is not None and not _is_num(res[k]):
                raise ValueError(f"{where}: {k} must be a number or null, got {res[k]!r}")
        if res.get("auto") is not None:
            _validate_auto(where, res["auto"])
        real_nic = (doc.get("network") or {}).get("mode") == "cluster"
        if not doc["emulated"] and not real_nic and res["wire_bytes_per_step"] is not None:
            raise ValueError(f"{where}: wire_bytes_per_step must be null when emulated is false (loopback)")


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _validate_auto(where: str, auto: Any) -> None:
    """The optional ``auto`` key of a result: the chooser's pick and its decisions (see worker.py)."""
    if not isinstance(auto, dict):
        raise ValueError(f"{where}: auto must be an object or null, got {auto!r:.80}")
    if auto.get("chosen") is not None and not isinstance(auto["chosen"], str):
        raise ValueError(f"{where}: auto.chosen must be a method name or null, got {auto['chosen']!r}")
    decisions = auto.get("decisions")
    if not isinstance(decisions, list):
        raise ValueError(f"{where}: auto.decisions must be a list, got {decisions!r:.80}")
    for j, d in enumerate(decisions):
        at = f"{where}: auto.decisions[{j}]"
        if not isinstance(d, dict):
            raise ValueError(f"{at} must be an object, got {d!r:.80}")
        missing = [k for k in ("step", "trigger", "chosen", "predicted_step_s", "measured_step_s", "predictions")
                   if k not in d]
        if missing:
            raise ValueError(f"{at}: missing keys {missing}")
        if not isinstance(d["step"], int) or isinstance(d["step"], bool) or d["step"] < 0:
            raise ValueError(f"{at}: step must be an integer >= 0, got {d['step']!r}")
        for k in ("trigger", "chosen"):
            if not isinstance(d[k], str):
                raise ValueError(f"{at}: {k} must be a string, got {d[k]!r}")
        for k in ("predicted_step_s", "measured_step_s"):
            if d[k] is not None and not _is_num(d[k]):
                raise ValueError(f"{at}: {k} must be a number or null, got {d[k]!r}")
        preds = d["predictions"]
        if not isinstance(preds, dict) or not all(isinstance(k, str) and _is_num(v) for k, v in preds.items()):
            raise ValueError(f"{at}: predictions must map candidate names to predicted step seconds, got {preds!r:.80}")


def auto_sequence(result: dict) -> list[str]:
    """The methods an ``auto`` result ran after its decisions, in order (a re-decision that kept the
    method adds nothing), DiLoCo where a trial was won (``auto_diloco``; a trial's own windows are not
    listed); empty without decisions."""
    auto = result.get("auto") or {}
    ran = [(int(d["step"]), 0, d["chosen"]) for d in auto.get("decisions") or []]
    for e in auto.get("sync_events") or []:
        if e.get("event") == "verdict" and e.get("winner") == "challenger":  # whichever order, early or not
            ran.append((int(e["step"]), 1, str(e["challenger"])))
        elif e.get("event") == "leave" and e.get("why") == "link_moved":  # the per-step method it left for
            ran.append((int(e["step"]), 1, "per-step"))
    seq = [chosen for chosen, _ in itertools.groupby(name for _, _, name in sorted(ran))]
    if not seq and auto.get("chosen"):
        seq = [auto["chosen"]]
    return seq


def auto_pick(result: dict) -> str | None:
    """``"topk"``, ``"ddp→topk"`` after a re-decision, ``"no decision"`` if it never decided;
    ``None`` for a result that is not ``auto``'s."""
    if not result.get("auto"):
        return None
    return "→".join(auto_sequence(result)) or "no decision"


def display_label(result: dict) -> str:
    """The method's label, with ``auto``'s pick: ``auto → topk``."""
    pick = auto_pick(result)
    return result["label"] if pick is None else f"{result['label']} → {pick}"


def write_json(doc: dict, path: str) -> str:
    """Validate and write a bench document, or a sweep document (its runs are validated)."""
    if isinstance(doc, dict) and doc.get("schema") == SWEEP_SCHEMA:
        for run in doc.get("runs") or []:
            validate_document(run)
    else:
        validate_document(doc)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=False)
        fh.write("\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- Markdown


def _s(x: float | None) -> str:
    if x is None:
        return "–"
    if x >= 10:
        return f"{x:.1f} s"
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1000:.1f} ms"


def _b(x: float | None) -> str:
    if x is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} B"


def _r(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}×"


def _v(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _p(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def fmt_cell(x: float | None, fmt: str = "{:.3f}") -> str:
    """A table cell: ``x`` formatted by ``fmt``, or ``–`` when it is missing."""
    return "–" if x is None else fmt.format(x)


def _network_line(doc: dict) -> str:
    c, net = doc["config"], doc.get("network", {})
    if net.get("mode") == "cluster":
        return (f"**Network: real cluster** — {c['hosts']} nodes × {c['procs_per_host']} process(es), launched "
                f"externally; nominal link {c.get('bandwidth') or 'unknown'}; wire bytes: "
                f"{net.get('wire_counter') or 'not counted'}.")
    if doc["emulated"]:
        if c.get("schedule"):
            rates = ", ".join(f"{p['rate']} from {p['at']:.0%}" for p in c["schedule"])
            shaping = f"links shaped with tc {net.get('shaper')} to {rates}"
            share = c.get("change_in_step") or 0.0
            if share:
                applied = [1e3 * ch["applied_offset_s"] for r in doc.get("results", [])
                           for ch in r.get("rate_changes") or []]
                seen = f", applied {min(applied):.0f}-{max(applied):.0f} ms into it" if applied else ""
                shaping += f" (each change asked for {share:g} of a step into its step{seen})"
            else:
                shaping += " (each change before its step starts)"
        else:
            shaping = "links not shaped"
        return (f"**Network: emulated** — {c['hosts']} host namespaces × {c['procs_per_host']} process(es) on a "
                f"bridge, {shaping}; no latency emulation.")
    return (f"**Network: loopback, NOT emulated** ({net.get('reason', '')}) — no shaping; wire bytes unavailable; "
            f"floors use the nominal rate.")


def _best_baselines(doc: dict) -> str:
    """Which torch baseline (ddp, fp16, powersgd) was fastest per step and to the target."""
    first = next(iter(doc["results"]), {})
    step, ttt = first.get("best_baseline_step"), first.get("best_baseline_ttt")
    if step is None:
        return "none ran"
    return f"step: `{step}`; time to target: " + (f"`{ttt}`" if ttt else "none reached it")


def markdown(doc: dict) -> str:
    c = doc["config"]
    metric = c.get("metric") or "metric"
    target = c.get("target")
    varying = len(c.get("schedule") or []) > 1  # a schedule: floor_s is a mean, so show the mean step too
    lines = [
        f"# lightning-gc bench — preset `{c['preset']}`, {c['ranks']} ranks",
        "",
        _network_line(doc),
        "",
        (f"Each method trains until it reaches the target or {c['budget_s']:g} s of training (at most {c['steps']} "
         f"steps)" if c.get("budget_s") else f"{c['steps']} steps per method")
        + f", first {c['warmup']} not timed; compute time from {c['compute_steps']} "
        f"replayed steps without gradient sync. Bytes are per rank per step. Ratios are against `ddp` in this run "
        f"and against the best torch baseline in this run ({_best_baselines(doc)})."
        + (f" **{c['rounds']} rounds**: every method ran once per round, rounds one after another; each row is the "
           "method's median over the rounds, and each ratio the median of the ratios within a round (per round: "
           "'Rounds' below)." if (c.get("rounds") or 1) > 1 else ""),
        "",
        f"| method | step (median) | IQR |{' step (mean) |' if varying else ''} compute | exposed comm | "
        "overhead (ms/step, % of step) | "
        f"{'floor (mean)' if varying else 'floor'} | step / DDP | step / best baseline | engine bytes | wire bytes "
        f"| link use | {metric} | time to {metric} {'≥' if c.get('mode') == 'max' else '≤'} {_v(target)} | TTT / DDP "
        "| TTT / best baseline |",
        "|---|---:|---:|" + ("---:|" if varying else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        if r["status"] != "ok":
            lines.append(f"| `{r['label']}` | failed |" + " |" * (15 if varying else 14))
            continue
        pick = auto_pick(r)
        lines.append(
            f"| `{r['label']}`{f' → {pick}' if pick else ''} | {_s(r['step_time_s'])} | {_s(r['step_time_iqr_s'])} |"
            + (f" {_s(r.get('step_time_mean_s'))} |" if varying else "")
            + f" {_s(r['compute_time_s'])} "
            f"| {_s(r['comm_exposed_s'])} | {overhead_cell(r)} | {_s(r['floor_s'])} | {_r(r['ratio_vs_ddp'])} "
            f"| {_r(r.get('ratio_vs_best_baseline'))} | {_b(r['bytes_per_step'])} "
            f"| {_b(r['wire_bytes_per_step'])} | {_p(r.get('link_utilization'))} | {_v(r['final_metric'])} "
            f"| {_s(r['time_to_target_s']) if r['time_to_target_s'] is not None else 'not reached'} "
            f"| {_r(r['time_to_target_ratio_vs_ddp'])} | {_r(r.get('time_to_target_ratio_vs_best_baseline'))} |"
        )
    lines += _rounds_section(doc)
    lines += _auto_section(doc)
    lines += _fidelity_section(doc)
    errors = [r for r in doc["results"] if r["status"] != "ok"]
    if errors:
        lines += ["", "## Failed methods", ""]
        for r in errors:
            text = [ln.strip() for ln in (r["error"] or "").strip().splitlines() if ln.strip()]
            summary = text[0] if text else ""
            if len(text) > 1:
                summary += f" … `{text[-1][:300]}`"
            lines.append(f"- `{r['label']}`: {summary}")
    lines += [
        "",
        "How to read it: *step* is the median wall time of a training step (slowest rank), *compute* the same "
        "step without any communication, *exposed comm* their difference, *overhead* the lightning_gc engine's own "
        "time per step outside the codec, gradient collectives and probes (bookkeeping, agreements, copies, "
        "error-memory arithmetic, auto's decisions; summed over the engine's threads, so partly hidden behind "
        "backward when it overlaps; – for torch's hooks), *floor* max(compute, bytes on the "
        "host's link / link rate) — no method can beat it on this link. *engine bytes* are what the method's "
        "byte model counts (lightning_gc engine, or the analytic ring model for ddp/fp16/powersgd), *wire bytes* "
        "what the host interface transmitted (headers included) divided by processes per host, *link use* the "
        "fraction of the link's capacity the wire bytes filled during the measured steps. See docs/bench.md.",
        "",
    ]
    return "\n".join(lines)


def overhead_cell(r: dict) -> str:
    """The overhead column: ms per step and its share of the step (docs/bench.md, 'Overhead')."""
    o = r.get("overhead_s")
    if o is None:
        return "–"
    share = r.get("overhead_share")
    return f"{o * 1e3:.1f} ms" + (f" ({100 * share:.1f}%)" if share is not None else "")


def _rounds_section(doc: dict) -> list[str]:
    """Per method and round (``--repeat``): step and time to target, each with its ratio to that
    round's best baseline, so the spread behind the medians is visible."""
    rows = [r for r in doc["results"] if r.get("rounds")]
    if not rows:
        return []
    n = max(len(r["rounds"]) for r in rows)
    seeds = (doc.get("config") or {}).get("seeds") or []
    seeded = len(seeds) == n and len(set(seeds)) > 1  # --seeds: each round its own trajectory

    def head(k: int) -> str:
        return f"round {k + 1} (seed {seeds[k]})" if seeded else f"round {k + 1}"

    lines = ["", "## Rounds", "",
             "Each round's median step and time to target, in brackets the ratio to that round's best baseline; "
             "the row above is their median (the step's from the round marked *). The rounds ran the methods "
             "as listed, then in reverse, alternately, so that a drift of the host's speed falls on every method alike."
             + (" Each round trained with its own seed (`--seeds`): a time to target on a noisy metric moves "
                "with the trajectory, and the ratios compare methods on the same one." if seeded else ""), "",
             "| method | " + " | ".join(head(k) for k in range(n)) + " |",
             "|---|" + "---|" * n]
    for r in rows:
        cells = []
        for rd in r["rounds"]:
            if rd["status"] != "ok":
                cells.append("failed")
                continue
            step, ttt = _vs_best_cells(rd)
            mark = "*" if r.get("median_round") == rd["round"] else ""
            cells.append(f"{mark}{step}; TTT {ttt}" + (f"; picked {rd['auto_pick']}" if rd.get("auto_pick") else ""))
        lines.append(f"| `{r['label']}` | " + " | ".join(cells) + " |")
    return lines


def _vs_best_cells(r: dict) -> tuple[str, str]:
    """The step and the time to target of a result or a round, each with its ratio to the best baseline."""
    ttt = "not reached" if r["time_to_target_s"] is None else (
        f"{_s(r['time_to_target_s'])} ({_r(r.get('time_to_target_ratio_vs_best_baseline'))})")
    return f"{_s(r['step_time_s'])} ({_r(r.get('ratio_vs_best_baseline'))})", ttt


def _link(network: dict | None) -> str:
    if not network or network.get("beta_s_per_byte") is None:
        return "–"
    beta, alpha = network["beta_s_per_byte"], network.get("alpha_s")
    rate = "unlimited"
    if beta > 0:
        bits = 8 / beta
        unit, scale = next(((u, f) for u, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6)) if bits >= f), ("kbit/s", 1e3))
        rate = f"{bits / scale:.3g} {unit}"
    return rate if alpha is None else f"{rate}, α {_s(alpha)}"


def _fidelity_section(doc: dict) -> list[str]:
    """``--fidelity``: each method's mean gradient and update fidelity (none measured: no lines)."""
    rows = [r for r in doc["results"] if r["status"] == "ok" and r.get("fidelity")]
    if not rows:
        return []

    def f(x, fmt="{:.3g}"):
        return "–" if x is None else fmt.format(x)

    lines = ["", "## Gradient fidelity (`--fidelity`: means over the steps, then over the ranks)", "",
             "| method | steps | grad rel. error ‖ĝ−ḡ‖²/‖ḡ‖² | grad cos | ‖ĝ‖/‖ḡ‖ | update cos | update rel. error "
             "| grad window cos | update window cos |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fd = r["fidelity"]
        lines.append(f"| `{display_label(r)}` | {f(fd.get('steps'), '{:.0f}')} | {f(fd.get('grad_rel_error'))} "
                     f"| {f(fd.get('grad_cos'))} | {f(fd.get('grad_norm_ratio'))} | {f(fd.get('update_cos'))} "
                     f"| {f(fd.get('update_rel_error'))} | {f(fd.get('grad_window_cos'))} "
                     f"| {f(fd.get('update_window_cos'))} |")
    lines += ["", "ĝ: the gradient the optimizer received; ḡ: the exact mean of the ranks' gradients; update: "
              "the real step against a shadow optimizer fed ḡ along the same run; window: the same cosines of the sums "
              "over 50 steps, which show what error feedback delivers late (docs/monitoring.md, GradientFidelity)."]
    return lines


def _auto_section(doc: dict) -> list[str]:
    """One row per decision of every ``auto`` result (none: no lines)."""
    rows = []
    for r in doc["results"]:
        if r["status"] != "ok" or not r.get("auto"):
            continue
        decisions = r["auto"].get("decisions") or []
        if not decisions:
            rows.append(f"| `{r['label']}` | – | – | no decision | – | – | – | – |")
        for d in decisions:
            tpp = d.get("time_per_progress_s") or {}
            cands = ", ".join(
                (f"**{name} {_s(step)}**" if name == d["chosen"] else f"{name} {_s(step)}")
                + (f" ({_s(tpp[name])})" if name in tpp else "")
                for name, step in d["predictions"].items())
            if d.get("shift_s"):  # the compute shift (docs/auto.md, step 7)
                settled = set(d.get("settled") or [])
                unmeasured = [n for n in d["predictions"] if n not in settled]
                basis = d.get("shift_from") or []
                cands += f"; {', '.join(unmeasured)} shifted {_s(d['shift_s'])}" + (
                    f" (from {', '.join(basis)})" if basis else "")
            check = d.get("link_check")
            how = " twice" if check and check.get("retimed") else ""  # a first message that looked moved
            if check and check.get("reference") == "modelled":  # against the model's time, after a dense step
                how += " against the model's time"
            checked = "" if not check else (f" (check{how}: unchanged, not re-probed)" if check["unchanged"] else
                                            f" (check{how}: moved, re-probed)")
            if d.get("network_source") == "dense_step":
                checked = " (β from the dense step)"
            elif d.get("network_source") == "canary":  # the link canary (or the switch check) saw a fall
                checked = " (β from the link canary)" if d.get("drift_test") != "switch_check" else \
                    " (β from the switch check's message)"
            elif d.get("network_source") == "check_slope":  # moved, and the check's messages measured β
                checked = f" (check{how}: moved, β from the check)"
            trigger = d["trigger"] + (f" ({d['drift_test']})" if d.get("drift_test") else "")
            held = d.get("held_by_margin")
            picked = d["chosen"] + (f" (kept: {held} led by < switch_margin)" if held else "")
            rows.append(f"| `{r['label']}` | {d['step']} | {trigger} | {picked} | {_link(d.get('network'))}{checked} "
                        f"| {_s(d['predicted_step_s'])} | {_s(d['measured_step_s'])} | {cands} |")
    if not rows:
        return []
    return [
        "", "## What `auto` picked", "",
        "One row per decision, by trigger: `warmup` (after the profiled dense steps), `calibration` (a method's "
        "first measured window), `family` (a dense sibling run for one window), `drift` (the step time moved; in brackets which test saw it: "
        "*window* (moderate, for `patience` windows), *severe_window*, *steps* (the median of the last few steps, "
        "tested every step), *step* (one step of a dense mode 8x its reference at the defaults), *exchange* (a compressed "
        "method's exchange got much faster), *reference_window*, *canary* (the link canary before a dense step saw a "
        "fall) or *switch_check* (a gain or calibration move from a compressed method to a dense mode timed the link "
        "first and found it fallen)), "
        "`periodic` (a scheduled re-probe), `gain` (the candidates' errors, measured again, moved). *kept: X led "
        "by < switch_margin*: a method measured on this link led the running one by less than `switch_margin`, "
        "so the running one stayed. *link*: "
        "the network as auto probed it (a periodic or drift re-decision first times one message against the last "
        "probe (a message that looks moved is timed once more: *check twice*) and probes again only if it "
        "moved: *check*; a moved check whose message was bandwidth-bound gives β from its two messages: *β from the "
        "check*; a warm-up step that waited long on the network gives β itself: *β from the dense step*, and the "
        "next check is then timed against the model's time for its message: *check against the model's time*); "
        "*predicted*: its model's step for the pick; *measured*: auto's own "
        "measurement after the decision, the median of a window of steps once the switch has settled (slowest "
        "rank; – if the run ended first). Per candidate: the predicted step and, in brackets, the predicted time "
        "per unit of progress, which the pick minimises; *shifted*: the methods not yet measured in a window of "
        "their own, predicted by the raw model lowered by the least speed-up the measured ones showed (docs/auto.md).",
        "",
        "| method | step | trigger | picked | link (probed) | predicted step | measured step "
        "| candidates: predicted step (per progress) |",
        "|---|---:|---|---|---|---:|---:|---|",
        *rows,
    ]


# --------------------------------------------------------------------------- plots

#: 15 marker shapes that stay distinguishable at plot size (filled, so colour shows too)
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "p", "h", "8", "H", "d")


def method_styles(labels: list[str]) -> dict[str, tuple[str, str]]:
    """A distinct colour (hex) and marker per method label, in order: ``tab10``, then ``tab20``'s
    light shades (method 10 + j: method j's colour, lighter), then evenly spaced hues, so no two
    methods share a colour (Matplotlib's default cycle repeats after ten); :data:`MARKERS` in turn."""
    from matplotlib import colormaps
    from matplotlib.colors import hsv_to_rgb, to_hex

    n = len(labels)
    if n <= 10:
        colours = [to_hex(colormaps["tab10"](i)) for i in range(n)]
    elif n <= 20:
        colours = [to_hex(colormaps["tab10"](i)) for i in range(10)]
        colours += [to_hex(colormaps["tab20"](2 * i + 1)) for i in range(n - 10)]
    else:
        colours = [to_hex(hsv_to_rgb((i / n, 0.75, 0.85 if i % 2 else 0.6))) for i in range(n)]
    return {label: (colours[i], MARKERS[i % len(MARKERS)]) for i, label in enumerate(labels)}


def _pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(doc: dict, out_dir: str) -> list[str]:
    """PNG plots into ``out_dir``; returns the paths (empty when matplotlib is missing)."""
    plt = _pyplot()
    if plt is None:
        return []
    ok = [r for r in doc["results"] if r["status"] == "ok"]
    if not ok:
        return []
    c = doc["config"]
    net = {"netns": "emulated", "cluster": "real cluster"}.get((doc.get("network") or {}).get("mode"),
                                                               "loopback (not emulated)")
    rate = " → ".join(p["rate"] for p in c.get("schedule") or []) or "unshaped"
    title_tail = f"{c['preset']}, {c['ranks']} ranks / {c['hosts']} hosts, {rate}, {net}"
    paths = []
    labels = [r["label"] for r in ok]
    styles = method_styles(labels)
    shown = [display_label(r) for r in ok]  # auto's pick with its label
    y = list(range(len(ok)))

    # 1. step time: compute + exposed comm, IQR, floor
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(ok) + 1.8))
    comp = [r["compute_time_s"] or 0.0 for r in ok]
    expo = [max(0.0, r["step_time_s"] - (r["compute_time_s"] or 0.0)) for r in ok]
    ax.barh(y, comp, color="#4c72b0", label="compute")
    ax.barh(y, expo, left=comp, color="#dd8452", label="exposed communication")
    xerr = [[r["step_time_s"] - r["step_time_p25_s"] for r in ok], [r["step_time_p75_s"] - r["step_time_s"] for r in ok]]
    ax.errorbar([r["step_time_s"] for r in ok], y, xerr=xerr, fmt="none", ecolor="black", capsize=3, label="IQR")
    fl = [(r["floor_s"], i) for i, r in enumerate(ok) if r["floor_s"] is not None]
    if fl:
        ax.scatter([f for f, _ in fl], [i for _, i in fl], marker="|", s=300, color="red", zorder=5,
                   label="physical floor")
    for i, r in enumerate(ok):
        if r["ratio_vs_ddp"] is not None:
            ax.text(r["step_time_p75_s"], i, f"  {r['ratio_vs_ddp']:.2f}× DDP", va="center", fontsize=8)
    _method_rows(ax, shown, "seconds per training step (median)", f"Step time — {title_tail}")
    ax.set_xlim(right=max(r["step_time_p75_s"] for r in ok) * 1.3)
    paths.append(_save(fig, out_dir, "step_time.png"))

    # 2. bytes: engine vs wire
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(ok) + 1.8))
    h = 0.38
    eng = [r["bytes_per_step"] or 0 for r in ok]
    wire = [r["wire_bytes_per_step"] or 0 for r in ok]
    ax.barh([i - h / 2 for i in y], eng, height=h, color="#55a868", label="engine / model count")
    if any(wire):
        ax.barh([i + h / 2 for i in y], wire, height=h, color="#8172b2", label="wire (interface tx)")
    for i, (e, w_) in enumerate(zip(eng, wire)):
        if e:
            ax.text(e, i - h / 2, f" {_b(e)}", va="center", fontsize=7)
        if w_:
            ax.text(w_, i + h / 2, f" {_b(w_)}", va="center", fontsize=7)
    dense = ok[0].get("dense_bytes_per_step")
    if dense:
        ax.axvline(dense, color="gray", ls="--", lw=1, label="dense ring allreduce")
    ax.set_xscale("log")
    _method_rows(ax, shown, "bytes sent per rank per step (log)", f"Bytes — {title_tail}")
    paths.append(_save(fig, out_dir, "bytes.png"))

    # 3. per-step trace
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in ok:
        colour, marker = styles[r["label"]]
        ax.plot(range(len(r["step_times_s"])), r["step_times_s"], color=colour, marker=marker, markersize=4, lw=1,
                label=display_label(r))
    ax.axvspan(-0.5, c["warmup"] - 0.5, color="gray", alpha=0.15, label="warm-up (not timed)")
    for b in c.get("schedule_steps") or []:
        if b["step"] > 0:
            ax.axvline(b["step"] - 0.5, color="black", ls=":", lw=1)
            ax.text(b["step"] - 0.4, ax.get_ylim()[1], format_rate(b["rate_bps"]), va="top", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("step time (s, slowest rank)")
    ax.set_title(f"Step times over the run — {title_tail}", fontsize=9)
    ax.legend(fontsize=8, ncol=2 if len(ok) > 8 else 1)
    paths.append(_save(fig, out_dir, "step_trace.png"))

    # 4. metric vs training time
    curves = [r for r in ok if r.get("metric_curve")]
    if curves:
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in curves:
            pts = [(p["train_time_s"], p["value"]) for p in r["metric_curve"] if p["value"] is not None]
            if pts:
                colour, marker = styles[r["label"]]
                ax.plot(*zip(*pts), color=colour, marker=marker, label=display_label(r))
        if c.get("target") is not None:
            ax.axhline(c["target"], color="red", ls="--", lw=1, label=f"target {c['target']:g}")
        ax.set_xlabel("training time (s, sum of step times)")
        ax.set_ylabel(c.get("metric") or "metric")
        ax.set_title(f"Task metric — {title_tail}", fontsize=9)
        ax.legend(fontsize=8, ncol=2 if len(curves) > 8 else 1)
        paths.append(_save(fig, out_dir, "metric.png"))
    return paths


def _method_rows(ax, shown: list[str], xlabel: str, title: str) -> None:
    """A horizontal bar chart's labels: one row per method, top to bottom in the list's order."""
    ax.set_yticks(range(len(shown)), shown)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")


def _save(fig, out_dir: str, name: str) -> str:
    """Lay out ``fig``, write it to ``out_dir/name`` and close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(doc: dict, *, json_path: str | None = None, out_dir: str | None = None) -> list[str]:
    """Write the requested outputs of a bench or a sweep document (``DIR/bench.*`` or ``DIR/sweep.*``);
    returns every path written."""
    sweep = doc.get("schema") == SWEEP_SCHEMA
    written = []
    if json_path:
        written.append(write_json(doc, json_path))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        stem = "sweep" if sweep else "bench"
        written.append(write_json(doc, os.path.join(out_dir, f"{stem}.json")))
        md = os.path.join(out_dir, f"{stem}.md")
        with open(md, "w") as fh:
            fh.write(sweep_markdown(doc) if sweep else markdown(doc))
        written.append(md)
        written += write_sweep_plot(doc, out_dir) if sweep else write_plots(doc, out_dir)
    return written


# --------------------------------------------------------------------------- bandwidth sweep
SWEEP_SCHEMA = "lightning_gc.bench.sweep/1"


def sweep_document(docs: list[dict], links: list[str]) -> dict:
    """One document for a ``--bandwidth A,B,...`` sweep: the per-link bench documents, in order."""
    if len(docs) != len(links):
        raise ValueError(f"sweep: {len(docs)} documents for {len(links)} links {links}")
    for doc in docs:
        validate_document(doc)
    return {"schema": SWEEP_SCHEMA, "links": list(links), "runs": docs}


def _sweep_labels(sweep: dict) -> list[str]:
    labels: list[str] = []
    for doc in sweep["runs"]:
        labels += [r["label"] for r in doc["results"] if r["label"] not in labels]
    return labels


def sweep_markdown(sweep: dict) -> str:
    """Step and time to target per method per link, each with its ratio to the run's best baseline;
    ``auto``'s step cell names what it picked on that link."""
    links, runs = sweep["links"], sweep["runs"]
    c = runs[0]["config"]
    metric, target = c.get("metric") or "metric", c.get("target")
    op = "≥" if c.get("mode") == "max" else "≤"
    lines = [
        f"# lightning-gc bench sweep — preset `{c['preset']}`, {c['ranks']} ranks, links {', '.join(links)}",
        "",
        "One bench run per link (same methods, seed and steps"
        + (f"; {c['rounds']} rounds each, `--repeat`: medians over the rounds, ratios taken within a round"
           if (c.get("rounds") or 1) > 1 and len(set(c.get("seeds") or [0])) <= 1 else "")
        + (f"; one round per seed ({', '.join(map(str, c['seeds']))}), `--seeds`: medians over the rounds, "
           "ratios taken within a round" if len(set(c.get("seeds") or [0])) > 1 else "")
        + "). *step*: median step time; *TTT*: time to "
        f"{metric} {op} {_v(target)}. In brackets: the ratio to the best torch baseline of that link's run "
        "(the fastest of ddp, fp16, powersgd per step, resp. to the target)"
        + ("; for `auto`, the method it picked on that link (`ddp→topk`: it re-decided)."
           if any(r.get("auto") for doc in runs for r in doc["results"]) else "."),
        "",
        "| method | " + " | ".join(f"step @ {link} | TTT @ {link}" for link in links) + " |",
        "|---|" + "---:|---:|" * len(links),
    ]
    for label in _sweep_labels(sweep):
        cells = []
        for doc in runs:
            r = next((x for x in doc["results"] if x["label"] == label), None)
            if r is None or r["status"] != "ok":
                cells += ["failed" if r is not None else "–", ""]
                continue
            step, ttt = _vs_best_cells(r)
            if auto_pick(r) is not None:
                step += f" (picked {auto_pick(r)})"
            cells += [step, ttt]
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_sweep_plot(sweep: dict, out_dir: str) -> list[str]:
    """``sweep.png``: step time and time to target against the link, one line per method; each of
    ``auto``'s points is labelled with the method it picked on that link."""
    plt = _pyplot()
    if plt is None:
        return []
    links, runs = sweep["links"], sweep["runs"]
    labels = _sweep_labels(sweep)
    styles = method_styles(labels)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in labels:
        colour, marker = styles[label]
        for ax, key in zip(axes, ("step_time_s", "time_to_target_s")):
            pts = []
            for i, doc in enumerate(runs):
                r = next((x for x in doc["results"] if x["label"] == label and x["status"] == "ok"), None)
                if r is not None and r[key] is not None:
                    pts.append((i, r[key], auto_pick(r)))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, marker=marker, label=label)
            for x, y, pick in pts:  # auto: the method it picked on that link, next to its point
                if pick is not None:
                    last = x == len(links) - 1  # inside the axes: left of the rightmost point
                    ax.annotate(pick, (x, y), xytext=(-5 if last else 5, 5), textcoords="offset points",
                                ha="right" if last else "left", fontsize=7, color=colour)
    c = runs[0]["config"]
    for ax, title in zip(axes, ("median step time (s)", f"time to {c.get('metric') or 'target'} (s)")):
        ax.set_xticks(range(len(links)), links)
        ax.set_yscale("log")
        ax.set_xlabel("link rate per host")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8, ncol=2 if len(labels) > 8 else 1)  # every method that ran has a step
    fig.suptitle(f"{c['preset']}, {c['ranks']} ranks: one run per link", fontsize=10)
    os.makedirs(out_dir, exist_ok=True)
    return [_save(fig, out_dir, "sweep.png")]
