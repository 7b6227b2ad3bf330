"""Validate the alpha-beta model's choice of sparse collective on this cluster.

For every (preset, bandwidth, ratio) it runs ``lightning-gc bench`` with Top-k allgather (AG),
STAR AR-Topk over the P2P ring (ART-Ring) and tree (ART-Tree), and ``artopk_auto`` (plus dense DDP
where asked), then reports, next to the measured step and communication times, what the model
predicts for each collective with the α/β the automatic run measured in-band:

* how often the automatic choice is the measured-fastest collective, and its step time relative
  to the fastest (the target is ≤ 1.25×);
* the median of |predicted − measured| / measured communication time over all sparse runs, and
  per collective the median of predicted / measured;
* STAR-Topk vs dense DDP step time.

    python -m lightning_gc.bench.artopk_validation --presets mlp,cnn --ratios 0.1,0.01,0.001 \\
        --bandwidths 1gbit,100mbit --ranks 4 --out bench_out/artopk

Measured communication time is the engine's time inside the compressed exchange's collectives per
step, taken after the small stats allreduce that lines the ranks up (so it excludes most of the
wait for slower ranks); the prediction uses the formulas of docs/cost_model.md with
M = 4 bytes × the compressed elements of the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from ..comm.cost_model import NetworkModel

SPARSE = {"topk": "allgather", "star_topk:collective=art_ring": "art_ring", "star_topk:collective=art_tree": "art_tree"}


def _compressed_numel(preset: str, min_numel: int = 1024) -> int:
    from ..examples.presets import get_preset

    model = get_preset(preset).model
    return sum(p.numel() for p in model.parameters() if p.requires_grad and p.numel() >= min_numel)


def _parse_label(label: str) -> tuple[str, dict[str, str]]:
    name, *opts = label.split(":")
    return name, dict(o.split("=", 1) for o in opts if "=" in o)


def _find(results: list[dict], spec: str) -> dict | None:
    """The successful result whose method name and options include those of ``spec``."""
    want_name, want_opts = _parse_label(spec)
    for r in results:
        name, opts = _parse_label(r["label"])
        if name == want_name and all(opts.get(k) == v for k, v in want_opts.items()) and r.get("status") == "ok":
            return r
    return None


def run_grid(args: argparse.Namespace) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets.split(","):
        numel = _compressed_numel(preset)
        for bw in args.bandwidths.split(","):
            for ratio in (float(r) for r in args.ratios.split(",")):
                tag = f"{preset}_{bw}_{ratio:g}"
                path = out / f"{tag}.json"
                methods = list(SPARSE) + ["artopk_auto"]
                if ratio in args.dense_at:
                    methods = ["ddp", *methods]
                if not path.exists():
                    steps = args.steps if preset != "cnn" else args.cnn_steps
                    cmd = [sys.executable, "-m", "lightning_gc.cli", "bench", "--preset", preset, "--ranks",
                           str(args.ranks), "--bandwidth", bw, "--ratio", str(ratio), "--methods", ",".join(methods),
                           "--steps", str(steps), "--warmup", str(args.warmup), "--compute-steps", "3",
                           "--eval-every", str(steps), "--val-batches", "2", "--json", str(path)]
                    print(f"[artopk-validation] {tag}: {' '.join(cmd[3:])}", flush=True)
                    subprocess.run(cmd, check=False)
                if not path.exists():
                    print(f"[artopk-validation] {tag}: no result", flush=True)
                    continue
                doc = json.loads(path.read_text())
                rows.append(_analyse(doc, preset, bw, ratio, numel, args.ranks))
    return rows


def _analyse(doc: dict, preset: str, bw: str, ratio: float, numel: int, n: int) -> dict:
    res = doc["results"]
    auto = _find(res, "artopk_auto")
    row: dict = {"preset": preset, "bandwidth": bw, "ratio": ratio, "emulated": doc.get("emulated")}
    net = auto.get("network_model") if auto else None
    model = NetworkModel(net["alpha_s"], net["beta_s_per_byte"]) if net else None
    M = 4 * numel
    measured: dict[str, dict] = {}
    for label, coll in SPARSE.items():
        r = _find(res, label)
        if r is None:
            continue
        # prefer the exchange's own time (after the stats allreduce lines the ranks up); older
        # results only have the engine's total time in collectives
        comm = r.get("exchange_comm_s") or r.get("comm_time_s")
        entry = {"step_s": r["step_time_s"], "comm_s": comm,
                 "comm_source": "exchange" if r.get("exchange_comm_s") else "engine_total"}
        if model is not None:
            entry["predicted_s"] = model.sparse_costs(M, n, ratio)[coll]
            if comm:
                entry["predicted_over_measured"] = entry["predicted_s"] / comm
        measured[coll] = entry
    row["collectives"] = measured
    if model is not None:
        row["alpha_s"], row["beta_s_per_byte"] = model.alpha_s, model.beta_s_per_byte
        row["model_choice"] = model.choose_sparse_collective(M, n, ratio)
    if auto:
        choices = auto.get("collective_choices") or {}
        row["auto_choice"] = max(choices, key=choices.get) if choices else None
        row["auto_step_s"] = auto["step_time_s"]
        row["auto_predicted_s"] = auto.get("predicted_comm_s")
        row["auto_exchange_s"] = auto.get("exchange_comm_s")
    if measured:
        fastest = min(measured, key=lambda c: measured[c]["step_s"])
        row["fastest"] = fastest
        row["fastest_step_s"] = measured[fastest]["step_s"]
        if auto:
            row["auto_is_fastest"] = row.get("auto_choice") == fastest
            row["auto_vs_fastest"] = auto["step_time_s"] / measured[fastest]["step_s"]
    ddp = _find(res, "ddp")
    if ddp:
        row["ddp_step_s"] = ddp["step_time_s"]
        for coll in ("art_ring", "art_tree"):
            if coll in measured:
                row[f"star_{coll}_vs_ddp"] = measured[coll]["step_s"] / ddp["step_time_s"]
    return row


def summarise(rows: list[dict]) -> dict:
    with_auto = [r for r in rows if "auto_is_fastest" in r]
    errors = [abs(c["predicted_s"] - c["comm_s"]) / c["comm_s"]
              for r in rows for c in r.get("collectives", {}).values() if c.get("comm_s") and "predicted_s" in c]
    per_coll: dict[str, list[float]] = {}
    for r in rows:
        for coll, c in r.get("collectives", {}).items():
            if "predicted_over_measured" in c:
                per_coll.setdefault(coll, []).append(c["predicted_over_measured"])
    return {
        "configurations": len(rows),
        "median_predicted_over_measured": {k: statistics.median(v) for k, v in sorted(per_coll.items())},
        "auto_fastest_fraction": (sum(r["auto_is_fastest"] for r in with_auto) / len(with_auto)) if with_auto else None,
        "auto_vs_fastest_max": max((r["auto_vs_fastest"] for r in with_auto), default=None),
        "median_relative_comm_error": statistics.median(errors) if errors else None,
    }


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["| preset | bw | ratio | AG step (pred/meas comm) | ART-Ring step (pred/meas) | ART-Tree step (pred/meas) "
             "| auto choice | auto step | fastest | auto/fastest |", "|" + "---|" * 10]

    def cell(r, c):
        e = r.get("collectives", {}).get(c)
        if not e:
            return "–"
        pred = f"{1e3 * e['predicted_s']:.1f}" if "predicted_s" in e else "?"
        meas = f"{1e3 * e['comm_s']:.1f}" if e.get("comm_s") is not None else "?"
        return f"{e['step_s']:.3f}s ({pred}/{meas} ms)"

    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['bandwidth']} | {r['ratio']:g} | {cell(r, 'allgather')} | {cell(r, 'art_ring')} | "
            f"{cell(r, 'art_tree')} | {r.get('auto_choice')} | "
            f"{r.get('auto_step_s', float('nan')):.3f}s | {r.get('fastest')} | {r.get('auto_vs_fastest', float('nan')):.2f}× |"
        )
    lines += ["", f"Summary: {json.dumps(summary)}"]
    stars = [(r["preset"], r["bandwidth"], r.get("star_art_ring_vs_ddp"), r.get("star_art_tree_vs_ddp"))
             for r in rows if "ddp_step_s" in r]
    if stars:
        lines += ["", "| preset | bw | STAR ring / DDP | STAR tree / DDP |", "|---|---|---|---|"]
        for p, b, ring, tree in stars:
            lines.append(f"| {p} | {b} | {ring:.2f}× | {tree:.2f}× |" if ring and tree else f"| {p} | {b} | {ring} | {tree} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lightning_gc.bench.artopk_validation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="mlp,cnn")
    p.add_argument("--ratios", default="0.1,0.01,0.001")
    p.add_argument("--bandwidths", default="1gbit,100mbit")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cnn-steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dense-at", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.1],
                   help="ratios at which dense DDP is also run (for STAR vs DDP)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    rows = run_grid(args)
    summary = summarise(rows)
    out = Path(args.out)
    (out / "artopk_validation.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    (out / "artopk_validation.md").write_text(markdown(rows, summary))
    print(markdown(rows, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
