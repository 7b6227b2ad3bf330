"""``lightning-gc bench``: every method against DDP on an emulated (shaped) network.

Example::

    lightning-gc bench --preset mlp --ranks 4 --bandwidth 100mbit --methods ddp,topk --steps 20 --json out.json

Exit codes: 0 all methods measured, 1 at least one method failed (the others are still reported),
2 invalid arguments, 130 interrupted (Ctrl-C; namespaces and processes are cleaned up first).
"""

from __future__ import annotations

import argparse
import sys

from lightning_gc.bench.methods import MethodError
from lightning_gc.bench.regress import RegressError
from lightning_gc.bench.schedule import ScheduleError
from lightning_gc.bench.workloads import WorkloadError, preset_arg

__all__ = ["main", "build_parser"]


def _log(msg: str) -> None:
    print(msg, flush=True)


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integer seeds, e.g. 0,1,2") from None
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed, e.g. --seeds 0,1,2")
    return seeds


def _val_batches(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a batch count (8) or a fraction (0.25)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0; give a batch count (8) or a fraction (0.25)")
    return int(v) if v >= 1 and v == int(v) else v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-gc bench",
        description="Measure gradient-compression methods against dense DDP on an emulated cluster: one network "
        "namespace per host joined by a bridge, links shaped with tc (root needed; otherwise loopback, "
        "clearly marked). See docs/bench.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--preset", default="mlp", help="mlp | cnn | lm | gpt | quickstart | probe | deep | module:factory")
    w.add_argument("--preset-arg", action="append", type=preset_arg, default=[], metavar="KEY=VALUE",
                   help="extra keyword for the preset factory (repeatable)")
    w.add_argument("--steps", type=int, default=20, help="training steps per method (with --budget: the most)")
    w.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="train each method until it reaches the target or has trained this long (sum of its "
                        "step times), so time to target compares equal wall-clock budgets, not equal step counts")
    w.add_argument("--warmup", type=int, default=3, help="first steps excluded from timing and byte counts")
    w.add_argument("--compute-steps", type=int, default=5, help="replayed steps without sync to time compute")
    w.add_argument("--eval-every", type=int, default=None, help="validate every N steps (default steps/4)")
    w.add_argument("--val-batches", type=_val_batches, default=8, help="validation batches (count or fraction)")
    w.add_argument("--target", type=float, default=None, help="metric target for time-to-target (default: preset's)")
    w.add_argument("--seed", type=int, default=0, help="training seed (model init, data order) of every method")
    w.add_argument("--seeds", type=_seeds, default=None, metavar="S1,S2,...",
                   help="one round per seed (instead of --repeat rounds of --seed), combined as --repeat's rounds: "
                        "time to target on a noisy metric depends on the trajectory, so compare methods over several "
                        "(docs/bench.md, 'Seeds')")
    w.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run the method list R times in interleaved rounds and report each method's median over the "
                        "rounds, ratios taken within each round (the machine's speed drifts between methods; "
                        "docs/bench.md, 'Repeats')")
    w.add_argument("--fidelity", action="store_true",
                   help="measure every step how far each method's gradient and update are from exact DDP's "
                        "(GradientFidelity: one extra dense allreduce per step, so not for timing runs; docs/bench.md)")
    m = p.add_argument_group("methods")
    m.add_argument("--methods", default="ddp,powersgd,fp16,topk",
                   help="comma-separated NAME[:KEY=VALUE...] entries, or 'all'; see --list-methods")
    m.add_argument("--ratio", type=float, default=0.01, help="default ratio for compressors that take one")
    m.add_argument("--list-methods", action="store_true", help="print the method names and exit")
    n = p.add_argument_group("cluster and network")
    n.add_argument("--ranks", type=int, default=4, help="total training processes")
    n.add_argument("--hosts", type=int, default=None,
                   help="emulated hosts (network namespaces); ranks/hosts processes each; default: one per rank")
    n.add_argument("--bandwidth", default=None,
                   help="link rate per host and direction, e.g. 100mbit, 1gbit; several (1gbit,100mbit,20mbit) run "
                        "the bench once per link and add one table and one plot over the links")
    n.add_argument("--schedule", default=None,
                   help="rate schedule 'AT:RATE,...' (AT = fraction of steps), or a file with such entries")
    n.add_argument("--change-in-step", type=float, default=0.0, metavar="SHARE",
                   help="apply each schedule change this share of a step into its boundary step, while the step "
                        "runs (0.5: halfway), instead of before the step starts (0, the default); see docs/bench.md")
    n.add_argument("--shaper", choices=("htb", "tbf"), default="htb",
                   help="tc qdisc used for shaping (see docs/bench.md)")
    n.add_argument("--no-shape-ingress", action="store_true",
                   help="shape only host egress (default: both directions, like a full-duplex NIC)")
    n.add_argument("--network", choices=("auto", "netns", "loopback"), default="auto",
                   help="auto: namespaces if possible, else loopback; netns: fail without namespaces")
    n.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores/ranks)")
    n.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per method")
    n.add_argument("--cleanup-stale", action="store_true",
                   help="remove namespaces left by killed bench runs (whose process is gone) and exit")
    c = p.add_argument_group("real cluster (see docs/bench.md)")
    c.add_argument("--prepare", default=None, metavar="DIR",
                   help="write worker configs for a real cluster into DIR (shared file system) and print the "
                        "torchrun command of every method")
    c.add_argument("--collect", default=None, metavar="DIR", help="build the report from a --prepare'd DIR")
    c.add_argument("--ifname", default=None, help="with --prepare: NIC whose tx counter gives wire bytes, e.g. eth0")
    c.add_argument("--master-addr", default="NODE0_ADDRESS", help="with --prepare: address of node 0")
    c.add_argument("--master-port", type=int, default=29500, help="with --prepare: rendezvous port on node 0")
    g = p.add_argument_group("suites (docs/bench.md, 'The regression suite')")
    g.add_argument("--suite", choices=("regress",), default=None,
                   help="run a fixed suite of cases instead of --methods: 'regress' runs the engine's hot-path ratios on the "
                        "full-width cnn (4 ranks on 2 emulated hosts unless --preset/--ranks/--hosts are given) and "
                        "prints each beside the recorded baseline; exit 1 when one is worse beyond --tolerance")
    g.add_argument("--quick", action="store_true",
                   help="with --suite: every method once, a tiny preset, unshaped, 2 ranks (checks the plumbing; "
                        "nothing is compared)")
    g.add_argument("--cases", default=None, metavar="NAME,...", help="with --suite: only these cases")
    g.add_argument("--baseline", default=None, metavar="FILE",
                   help="with --suite: the baseline to compare with (default: lightning_gc/bench/regress_baseline.json)")
    g.add_argument("--tolerance", type=float, default=None, metavar="FRACTION",
                   help="with --suite: flag a ratio above its baseline by more than this fraction (default 0.10)")
    g.add_argument("--record", default=None, metavar="FILE",
                   help="with --suite: also write this run's ratios as a baseline file (date and machine included)")
    p.add_argument("--codec", action="store_true",
                   help="run the codec micro-benchmark instead (single process, no network); the other options "
                        "are those of `python -m lightning_gc.bench.codec --help` (docs/bench.md)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="FILE", help="write the result document here")
    o.add_argument("--out", default=None, metavar="DIR", help="write bench.json, bench.md and PNG plots here")
    o.add_argument("--logs", default=None, metavar="DIR", help="keep every rank's log here")
    return p


_BASELINE_LINES = {
    "ddp": "Lightning's DDPStrategy: dense fp32 allreduce (the baseline of every ratio)",
    "powersgd": "torch's powerSGD_hook (options: rank, start_iter, min_compression_rate, error_feedback, warm_start)",
    "fp16": "torch's fp16_compress_hook",
    "hsdp": "FSDP2's native HSDP in fp32 (2-D mesh: replicas = hosts); compare fsdp_<compressor> with it",
    "hsdp_bf16": "FSDP2's native HSDP with MixedPrecisionPolicy(reduce_dtype=bfloat16)",
}


def list_methods_text() -> str:
    """One line per method name: the torch baselines, every lightning_gc compressor as gc_NAME, then auto."""
    from lightning_gc.bench.methods import BASELINES
    from lightning_gc.compressors import available_compressors, get_entry

    lines = ["torch baselines (DDP with a torch communication hook):"]
    lines += [f"  {name:<16}{_BASELINE_LINES.get(name, '')}".rstrip() for name in BASELINES]
    names = available_compressors()
    clash = [n for n in names if n in BASELINES]
    lines.append("lightning_gc compressors (GCStrategy(compressor=NAME); the gc_ prefix may be dropped"
                 + (f" except for {', '.join('gc_' + n for n in clash)}, whose bare name is the torch baseline"
                    if clash else "") + "):")
    lines += [f"  {'gc_' + name:<16}{get_entry(name).summary}" for name in names]
    from lightning_gc.auto import CANDIDATES, DEFAULT_CANDIDATES
    from lightning_gc.bench.methods import _AUTO_FIELDS

    lines.append("run-time choice (GCStrategy(compressor='auto'); not part of 'all'):")
    lines.append(f"  {'auto':<16}picks one of its candidates after a profiled dense warm-up, re-decides on drift "
                 f"(options: {', '.join(_AUTO_FIELDS)}; candidates joined by '+', from {', '.join(CANDIDATES)}; "
                 f"default {'+'.join(DEFAULT_CANDIDATES)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--codec" in argv:  # the codec micro-benchmark has its own options
        from lightning_gc.bench.codec import main as codec_main

        return codec_main([a for a in argv if a != "--codec"])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error
        return int(exc.code or 0)

    if args.list_methods:
        print(list_methods_text())
        return 0
    if args.cleanup_stale:
        from lightning_gc.bench.netns import sweep_stale

        removed = sweep_stale(_log)
        _log(f"removed {len(removed)} stale namespace(s)")
        return 0

    from lightning_gc.bench import report
    from lightning_gc.bench.runner import BenchConfig, BenchError, collect, prepare, run_bench

    if args.suite:
        return _suite(args, argv)
    stray = [f for f, v in (("--quick", args.quick), ("--cases", args.cases), ("--baseline", args.baseline),
                            ("--tolerance", args.tolerance), ("--record", args.record)) if v]
    if stray:
        print(f"lightning-gc bench: error: {', '.join(stray)} only apply with --suite regress", file=sys.stderr)
        return 2

    cfg = BenchConfig(
        preset=args.preset, preset_args=dict(args.preset_arg), ranks=args.ranks, hosts=args.hosts,
        bandwidth=args.bandwidth, schedule=args.schedule, change_in_step=args.change_in_step, methods=args.methods, ratio=args.ratio,
        steps=args.steps, budget_s=args.budget, warmup=args.warmup, compute_steps=args.compute_steps, eval_every=args.eval_every,
        val_batches=args.val_batches, target=args.target, seed=args.seed, threads=args.threads,
        shaper=args.shaper, shape_ingress=not args.no_shape_ingress, network=args.network,
        timeout_s=args.timeout, logs_dir=args.logs, fidelity=args.fidelity, repeat=args.repeat, seeds=args.seeds,
    )
    if args.prepare and args.collect:
        print("lightning-gc bench: error: --prepare and --collect are two separate steps; give one of them",
              file=sys.stderr)
        return 2
    if args.prepare:
        try:
            prepare(cfg, args.prepare, ifname=args.ifname, master_addr=args.master_addr,
                    master_port=args.master_port, log=_log)
        except (BenchError, ScheduleError, MethodError) as exc:
            print(f"lightning-gc bench: error: {exc}", file=sys.stderr, flush=True)
            return 2
        return 0
    if args.json is None and args.out is None:
        _log("note: neither --json nor --out given; results are only printed")
    if args.bandwidth and "," in args.bandwidth:
        return _sweep(cfg, args, argv)
    doc, code = _guarded(lambda: collect(args.collect, log=_log) if args.collect else run_bench(cfg, log=_log))
    if code is not None:
        return code
    doc["config"]["command"] = "lightning-gc bench " + " ".join(argv)
    _log("")
    _log(report.markdown(doc))
    for path in report.write_outputs(doc, json_path=args.json, out_dir=args.out):
        _log(f"wrote {path}")
    failed = [r["label"] for r in doc["results"] if r["status"] != "ok"]
    if failed:
        print(f"lightning-gc bench: {len(failed)} method(s) failed: {', '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


def _suite(args, argv: list[str]) -> int:
    """``--suite regress``: run the cases, print each ratio beside the baseline (lightning_gc/bench/regress.py)."""
    import json
    from pathlib import Path

    from lightning_gc.bench import regress
    from lightning_gc.bench.runner import BenchConfig, run_bench

    if args.quick and args.record:
        print("lightning-gc bench: error: --record with --quick would record a tiny unshaped run as the baseline; "
              "record from the full suite on a quiet machine", file=sys.stderr)
        return 2
    tolerance = regress.DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if not tolerance >= 0:
        print(f"lightning-gc bench: error: --tolerance {args.tolerance} must be >= 0, e.g. 0.1", file=sys.stderr)
        return 2
    given = {a.split("=")[0] for a in argv}
    fixed = sorted(given & {"--methods", "--bandwidth", "--schedule", "--steps", "--warmup", "--budget", "--repeat",
                            "--seeds", "--eval-every", "--prepare", "--collect", "--out", "--fidelity", "--target"})
    if fixed:
        print(f"lightning-gc bench: error: --suite fixes each case's methods, link and steps; drop {', '.join(fixed)} "
              "(lightning_gc/bench/regress.py defines the cases; --cases selects some)", file=sys.stderr)
        return 2
    base = BenchConfig(
        preset=args.preset if "--preset" in given else "cnn", preset_args=dict(args.preset_arg),
        ranks=args.ranks, hosts=args.hosts if "--hosts" in given else (2 if args.ranks % 2 == 0 else None),
        compute_steps=args.compute_steps, val_batches=args.val_batches if "--val-batches" in given else 2,
        seed=args.seed, threads=args.threads, shaper=args.shaper, shape_ingress=not args.no_shape_ingress,
        network=args.network, timeout_s=args.timeout, logs_dir=args.logs, ratio=args.ratio,
    )

    def run():
        cases = regress.select(args.cases)
        baseline = regress.load_baseline(args.baseline or regress.DEFAULT_BASELINE)
        rows, docs = regress.run_suite(cases, base, quick=args.quick, run_bench=run_bench, log=_log)
        return rows, docs, baseline

    out, code = _guarded(run)
    if code is not None:
        return code
    rows, docs, baseline = out
    compared = regress.compare(rows, baseline, tolerance, quick=args.quick)
    _log("")
    _log(regress.markdown(compared, baseline, tolerance, quick=args.quick))
    command = "lightning-gc bench " + " ".join(argv)
    if args.json:
        suite = {"suite": "regress", "quick": args.quick, "tolerance": tolerance, "baseline": baseline,
                 "command": command, "rows": compared, "documents": docs}
        Path(args.json).write_text(json.dumps(suite, indent=1, default=str))
        _log(f"wrote {args.json}")
    if args.record:
        Path(args.record).write_text(json.dumps(regress.baseline_document(rows, command), indent=1) + "\n")
        _log(f"wrote {args.record}")
    bad = [r["ratio"] for r in compared if r["flag"] in ("worse", "failed")]
    if bad:
        print(f"lightning-gc bench: suite regress: {len(bad)} ratio(s) worse or failed: {', '.join(bad)}",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _guarded(run):
    """``(run(), None)``, or ``(None, exit code)`` after saying why: 2 for bad input, 130 for Ctrl-C
    (the runner has already removed its processes and namespaces)."""
    from lightning_gc.bench.runner import BenchError

    try:
        return run(), None
    except (BenchError, ScheduleError, MethodError, WorkloadError, RegressError) as exc:
        print(f"lightning-gc bench: error: {exc}", file=sys.stderr, flush=True)
        return None, 2
    except KeyboardInterrupt:
        print("lightning-gc bench: interrupted; processes and namespaces were cleaned up", file=sys.stderr, flush=True)
        return None, 130


def _sweep(cfg, args, argv: list[str]) -> int:
    """``--bandwidth A,B,...``: one bench run per link, then one table and one plot over the links."""
    import dataclasses
    import os

    from lightning_gc.bench import report
    from lightning_gc.bench.runner import resolve, run_bench

    links = [x.strip() for x in args.bandwidth.split(",") if x.strip()]
    if args.schedule or args.prepare or args.collect:
        print("lightning-gc bench: error: --bandwidth with several rates is a sweep run here, one bench per link; "
              "it cannot be combined with --schedule, --prepare or --collect (give one rate for those)",
              file=sys.stderr)
        return 2
    if len(links) < 2 or len(set(links)) != len(links):
        print(f"lightning-gc bench: error: --bandwidth {args.bandwidth!r}: a sweep needs two or more different "
              "rates, e.g. --bandwidth 1gbit,100mbit,20mbit", file=sys.stderr)
        return 2
    def run_links() -> list[dict]:
        for link in links:  # every link is checked before anything runs
            resolve(dataclasses.replace(cfg, bandwidth=link))
        docs = []
        for i, link in enumerate(links, 1):
            _log(f"== sweep: link {i}/{len(links)}: {link} ==")
            doc = run_bench(dataclasses.replace(cfg, bandwidth=link), log=_log)
            doc["config"]["command"] = "lightning-gc bench " + " ".join(argv)
            _log(report.markdown(doc))
            if args.out:
                for path in report.write_outputs(doc, out_dir=os.path.join(args.out, link)):
                    _log(f"wrote {path}")
            docs.append(doc)
        return docs

    docs, code = _guarded(run_links)
    if code is not None:
        return code
    sweep = report.sweep_document(docs, links)
    _log("")
    _log(report.sweep_markdown(sweep))
    for path in report.write_outputs(sweep, json_path=args.json, out_dir=args.out):
        _log(f"wrote {path}")
    failed = sorted({f"{r['label']} @ {link}" for link, doc in zip(links, docs) for r in doc["results"]
                     if r["status"] != "ok"})
    if failed:
        print(f"lightning-gc bench: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
