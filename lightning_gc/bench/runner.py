"""Orchestration of ``lightning-gc bench``: build the network, run every method, aggregate.

For each method the runner starts ``ranks`` worker processes (:mod:`lightning_gc.bench.worker`),
``procs_per_host = ranks / hosts`` per host, inside the host namespaces of an
:class:`~lightning_gc.bench.netns.EmulatedCluster` (or on loopback when namespaces are not
available), applies the bandwidth schedule when rank 0 reaches a phase boundary (rank 0 waits for
the new rate before starting that step, the other ranks wait for rank 0 inside the allreduce),
prints progress, and stops every rank as soon as one fails. All methods share one cluster and one
schedule; the rate is reset to the first phase before each method.

:func:`aggregate` turns the per-rank files into one result per method; see ``docs/bench.md`` for
the definition of every field.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_gc._validation import check_int
from lightning_gc.bench import netns
from lightning_gc.bench.methods import (
    AUTO,
    BASELINES,
    MethodSpec,
    analytic_bytes_per_step,
    auto_config,
    hook_marker,
    parse_methods,
    ring_factor,
)
from lightning_gc.bench.repeats import combine_rounds
from lightning_gc.bench.report import auto_pick
from lightning_gc.bench.schedule import Schedule, format_rate, parse_rate, parse_schedule
from lightning_gc.bench.worker import PEER_LOST_EXIT
from lightning_gc.bench.workloads import meets_target

__all__ = ["BenchConfig", "BenchError", "RankFailure", "run_bench", "aggregate", "prepare", "collect", "SCHEMA"]

SCHEMA = "lightning_gc.bench/1"
_STRIP_ENV_PREFIXES = ("SLURM_", "LSB_", "OMPI_", "PMI_", "TORCHELASTIC_", "PL_")
_STRIP_ENV = {"RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK",
              "LOCAL_RANK", "GLOBAL_RANK", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES"}


class BenchError(RuntimeError):
    """A benchmark that cannot run as configured; the message names the value, the reason and the fix."""


class RankFailure(BenchError):
    """A worker rank exited with an error (the other ranks were stopped)."""

    def __init__(self, message: str, rank: int, exit_code: int | None, log_tail: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code
        self.log_tail = log_tail


@dataclass
class BenchConfig:
    preset: str = "mlp"
    preset_args: dict = field(default_factory=dict)
    ranks: int = 4
    hosts: int | None = None  # default: one host per rank
    bandwidth: str | None = None  # constant link rate, e.g. "100mbit"; None = unshaped
    schedule: str | None = None  # spec or file, see schedule.py (exclusive with bandwidth)
    # 0: each rate change before its boundary step starts; in (0, 1): that share of a step into it (see worker.py)
    change_in_step: float = 0.0
    methods: str = "ddp,powersgd,fp16,topk"
    ratio: float | None = 0.01
    steps: int = 20
    budget_s: float | None = None  # train until the target or this much training time; steps is the cap
    warmup: int = 3
    compute_steps: int = 5
    eval_every: int | None = None  # default: steps // 4
    val_batches: float = 8
    target: float | None = None  # default: the preset's target
    seed: int = 0
    threads: int | None = None  # torch threads per rank; default cpu_count // ranks
    shaper: str = "htb"
    shape_ingress: bool = True
    network: str = "auto"  # auto | netns | loopback
    timeout_s: float = 1800.0  # per method
    logs_dir: str | None = None  # keep per-rank logs here (default: temporary, removed)
    fidelity: bool = False  # add GradientFidelity to every method (one extra dense allreduce per step)
    repeat: int = 1  # rounds of the whole method list, interleaved; combined per method (repeats.py)
    seeds: tuple[int, ...] | None = None  # one round per seed (instead of --repeat rounds of `seed`)
    fail_rank: int | None = None  # test hook: this rank raises ...
    fail_step: int | None = None  # ... at this step


# --------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, lo: int, hint: str) -> int:
    """:func:`check_int` raising :class:`BenchError` (the CLI prints it without a traceback)."""
    return check_int(name, value, lo, hint, error=BenchError, phrasing="must")


def resolve(cfg: BenchConfig) -> dict:
    """Validate ``cfg``; returns the derived settings (method specs, schedule, layout)."""
    ranks = _check_int("--ranks", cfg.ranks, 2, "one rank has no gradient exchange to measure; use --ranks 2 or more")
    hosts = ranks if cfg.hosts is None else _check_int("--hosts", cfg.hosts, 1, "e.g. --hosts 2")
    if ranks % hosts:
        raise BenchError(
            f"--ranks {ranks} is not divisible by --hosts {hosts}: every host runs the same number of processes; "
            f"use e.g. --ranks {hosts * max(1, ranks // hosts)} --hosts {hosts}"
        )
    steps = _check_int("--steps", cfg.steps, 2, "e.g. --steps 20")
    warmup = _check_int("--warmup", cfg.warmup, 1, "the first step includes DDP bucket setup; use --warmup 3")
    if steps <= warmup:
        raise BenchError(
            f"--steps {steps} <= --warmup {warmup}: no step would be measured; use --steps {warmup + 10} or a "
            f"smaller --warmup"
        )
    _check_int("--compute-steps", cfg.compute_steps, 1, "e.g. --compute-steps 5")
    repeat = _check_int("--repeat", cfg.repeat, 1, "e.g. --repeat 3 (each method runs 3 times, in rounds)")
    if cfg.seeds is None:
        seeds = [_check_int("--seed", cfg.seed, 0, "e.g. --seed 0")] * repeat
    else:
        seeds = list(cfg.seeds)
        if not seeds:
            raise BenchError("--seeds is empty: list at least one seed, e.g. --seeds 0,1,2")
        for sd in seeds:
            _check_int("--seeds", sd, 0, "seeds are integers >= 0, e.g. --seeds 0,1,2")
        if repeat != 1:
            raise BenchError(f"--repeat {repeat} with --seeds {','.join(map(str, seeds))}: --seeds runs one round per "
                             "seed; to repeat a seed, list it again (e.g. --seeds 0,0,1,1) and drop --repeat")
        repeat = len(seeds)
    budget_s = cfg.budget_s
    if budget_s is not None:
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
            raise BenchError(f"--budget {budget_s!r} must be a number of seconds > 0 (training time per method); "
                             f"e.g. --budget 120")
        if cfg.schedule is not None:
            raise BenchError(
                f"--budget with --schedule {cfg.schedule!r}: a schedule changes the link at fixed steps, but under a "
                f"budget every method stops at its own step; use a constant --bandwidth with --budget"
            )
        budget_s = float(budget_s)
    eval_every = cfg.eval_every if cfg.eval_every is not None else max(1, steps // 4)
    _check_int("--eval-every", eval_every, 1, "e.g. --eval-every 10")
    if cfg.ratio is not None and not (0 < float(cfg.ratio) <= 1):
        raise BenchError(f"--ratio {cfg.ratio!r} must be in (0, 1] (fraction of gradient entries kept); e.g. 0.01")
    if cfg.network not in ("auto", "netns", "loopback"):
        raise BenchError(f"--network {cfg.network!r} is not one of auto, netns, loopback")
    if cfg.shaper not in ("tbf", "htb"):
        raise BenchError(f"--shaper {cfg.shaper!r} is not one of tbf, htb")
    if cfg.bandwidth is not None and cfg.schedule is not None:
        raise BenchError(
            f"--bandwidth {cfg.bandwidth!r} and --schedule {cfg.schedule!r} both set the link rate; give one of them "
            f"(a constant rate is the schedule '0:{cfg.bandwidth}')"
        )
    cis = cfg.change_in_step
    if isinstance(cis, bool) or not isinstance(cis, (int, float)) or not 0 <= cis < 1:
        raise BenchError(f"--change-in-step {cis!r} must be a share of a step in [0, 1) (0: each rate change before "
                         f"its boundary step starts; 0.5: half a step into it); e.g. --change-in-step 0.5")
    if cis > 0 and cfg.schedule is None:
        raise BenchError(f"--change-in-step {cis!r} moves a schedule's rate changes into their steps, but no --schedule "
                         f"is given; add one (e.g. --schedule '0:1gbit,0.3:10mbit,0.6:1gbit') or drop --change-in-step")
    schedule: Schedule | None = None
    if cfg.schedule is not None:
        schedule = parse_schedule(cfg.schedule)
    elif cfg.bandwidth is not None and str(cfg.bandwidth).lower() not in ("none", "unshaped", "unlimited"):
        schedule = Schedule.constant(parse_rate(cfg.bandwidth, what="--bandwidth"))
    boundaries = schedule.boundaries(steps) if schedule else []
    specs = parse_methods(cfg.methods, default_ratio=cfg.ratio)
    for s in specs:
        if s.gc and s.name == AUTO:
            a = auto_config(s)
            dense = max(int(s.options.get("warmup_steps", 1) or 0), a.dense_steps_needed)
            if dense > warmup:
                raise BenchError(
                    f"method {s.label!r}: auto sends the first {dense} steps dense (skip_steps={a.skip_steps} + "
                    f"profile_steps={a.profile_steps}, at least warmup_steps) and measures its candidates and the "
                    f"network at the end of the last of them, but measurement starts at --warmup {warmup}, so the "
                    f"profile and the decision would be timed; use --warmup {dense}, or fewer "
                    f"auto:profile_steps/auto:skip_steps"
                )
        elif s.gc and int(s.options.get("warmup_steps", 1) or 0) > warmup:
            raise BenchError(
                f"method {s.label!r}: GCStrategy sends dense gradients for warmup_steps={s.options['warmup_steps']} "
                f"steps but measurement starts at --warmup {warmup}, so dense steps would be timed; use --warmup "
                f"{s.options['warmup_steps']} or a smaller warmup_steps"
            )
        if not s.gc and s.name == "powersgd" and int(s.options.get("start_iter", 2)) > warmup:
            raise BenchError(
                f"method {s.label!r}: PowerSGD starts compressing at step {s.options.get('start_iter')} but "
                f"measurement starts at --warmup {warmup}, so dense steps would be timed; use --warmup "
                f"{s.options.get('start_iter')} or a smaller start_iter"
            )
    threads = cfg.threads if cfg.threads is not None else max(1, (os.cpu_count() or 1) // ranks)
    _check_int("--threads", threads, 1, "e.g. --threads 1")
    return {
        "ranks": ranks,
        "hosts": hosts,
        "procs_per_host": ranks // hosts,
        "steps": steps,
        "budget_s": budget_s,
        "warmup": warmup,
        "eval_every": eval_every,
        "schedule": schedule,
        "boundaries": boundaries,
        "specs": specs,
        "threads": threads,
        "repeat": repeat,
        "seeds": seeds,  # the training seed of each round
    }


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError:
        return "(no log)"


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _base_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _STRIP_ENV and not k.startswith(_STRIP_ENV_PREFIXES)}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    cwd = os.getcwd()  # 'module:factory' presets from the current directory keep working in the workers
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


#: what a worker reads as given (BenchConfig fields) and as resolved (:func:`resolve`)
_WORKER_CONFIG = ("preset", "preset_args", "seed", "target", "compute_steps", "val_batches", "change_in_step",
                  "fail_rank", "fail_step")
_WORKER_RESOLVED = ("steps", "budget_s", "warmup", "eval_every", "hosts", "procs_per_host", "threads")


def worker_config(spec: MethodSpec, cfg: BenchConfig, r: dict, run_dir: str, *, ifname: str | None,
                  with_schedule: bool) -> dict:
    """The JSON config one method's workers read (see :mod:`lightning_gc.bench.worker`)."""
    return {
        "method": {"name": spec.name, "options": spec.options, "gc": spec.gc},
        **{k: getattr(cfg, k) for k in _WORKER_CONFIG},
        **{k: r[k] for k in _WORKER_RESOLVED},
        "fidelity": bool(cfg.fidelity),
        "ifname": ifname,
        "boundaries": [list(b) for b in r["boundaries"][1:]] if with_schedule else [],
        "run_dir": run_dir,
    }


def run_method(
    spec: MethodSpec,
    index: int,
    cfg: BenchConfig,
    r: dict,
    cluster: netns.EmulatedCluster | None,
    run_dir: str,
    log: Callable[[str], None],
) -> list[dict]:
    """Run one method on all ranks; returns the per-rank result dicts or raises :class:`RankFailure`."""
    os.makedirs(run_dir, exist_ok=True)
    ranks, pph = r["ranks"], r["procs_per_host"]
    if cluster is not None:
        master, port, ifname = cluster.host_ip(0), 29500 + index, netns.IFNAME
    else:
        master, port, ifname = "127.0.0.1", _free_port(), None
    wcfg = worker_config(spec, cfg, r, run_dir, ifname=ifname, with_schedule=cluster is not None)
    cfg_path = os.path.join(run_dir, "worker.json")
    Path(cfg_path).write_text(json.dumps(wcfg, indent=1))
    if cluster is not None and r["schedule"] is not None:
        cluster.set_rate(r["schedule"].initial_rate_bps)

    env0 = _base_env(r["threads"])
    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    handle = netns.register_cleanup(lambda: _kill(procs))
    try:
        for g in range(ranks):
            h, local = divmod(g, pph)
            env = dict(env0, MASTER_ADDR=master, MASTER_PORT=str(port), WORLD_SIZE=str(ranks), NODE_RANK=str(h),
                       LOCAL_RANK=str(local), GLOBAL_RANK=str(g), GLOO_SOCKET_IFNAME=ifname or "lo")
            cmd = [sys.executable, "-m", "lightning_gc.bench.worker", cfg_path]
            if cluster is not None:
                cmd = cluster.exec_prefix(h) + cmd
            path = os.path.join(run_dir, f"rank{g}.log")
            logs.append(path)
            with open(path, "w") as out:
                procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        _monitor(spec, cfg, r, cluster, run_dir, procs, logs, log)
    finally:
        _kill(procs)
        netns.unregister_cleanup(handle)
    return [_read_json(os.path.join(run_dir, f"rank{g}.json")) for g in range(ranks)]


def _read_json(path: str) -> Any:
    with open(path) as fh:
        return json.load(fh)


def _monitor(spec, cfg, r, cluster, run_dir, procs, logs, log) -> None:
    steps = r["steps"]
    progress = os.path.join(run_dir, "progress.jsonl")
    offset = 0
    times: list[float] = []
    last_print = 0.0
    printed_at = -1
    start = time.monotonic()
    pending = {k: rate for k, (_, rate) in enumerate(r["boundaries"][1:])} if cluster is not None else {}
    label = spec.label
    rate_now = r["schedule"].initial_rate_bps if r["schedule"] else None
    while True:
        if os.path.exists(progress):
            with open(progress) as fh:
                fh.seek(offset)
                chunk = fh.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete)
            for line in complete.splitlines():
                ev = json.loads(line)
                if "dt" in ev:
                    times.append(ev["dt"])
                elif "eval" in ev:
                    v = ev["eval"]
                    log(f"  [{label}] step {ev['step']}/{steps}: validation metric = "
                        f"{'n/a' if v is None else f'{v:.4g}'}")
                elif ev.get("phase") == "compute":
                    log(f"  [{label}] training done; timing compute-only steps (no gradient sync)")
        for k in sorted(pending):
            if os.path.exists(os.path.join(run_dir, f"phase{k}.req")):
                rate_now = pending.pop(k)
                cluster.set_rate(rate_now)
                # the time it took effect (CLOCK_MONOTONIC, one clock for the machine's processes): a change
                # asked for within a step (--change-in-step) records its offset from it; written whole, then renamed
                ack = os.path.join(run_dir, f"phase{k}.ack")
                with open(ack + ".tmp", "w") as fh:
                    fh.write(repr(time.monotonic()))
                os.replace(ack + ".tmp", ack)
                log(f"  [{label}] step {r['boundaries'][k + 1][0]}/{steps}: link rate -> {format_rate(rate_now)}")
        now = time.monotonic()
        if times and (now - last_print > 2.0 or len(times) == steps) and len(times) != printed_at:
            med = statistics.median(times[r["warmup"]:] or times)
            log(f"  [{label}] step {len(times)}/{steps}  last {times[-1]:.3f}s  median {med:.3f}s"
                + (f"  link {format_rate(rate_now)}" if cluster is not None and rate_now else ""))
            last_print, printed_at = now, len(times)
        codes = [p.poll() for p in procs]
        bad = [(g, c) for g, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            g, c = _root_cause(procs)
            _kill(procs)
            tail = _tail(logs[g])
            raise RankFailure(
                f"method {label!r}: rank {g} exited with code {c}; the other ranks were stopped. Last lines of its "
                f"log:\n{tail}",
                g, c, tail,
            )
        if all(c == 0 for c in codes):
            return
        if now - start > cfg.timeout_s:
            _kill(procs)
            raise RankFailure(
                f"method {label!r} did not finish within --timeout {cfg.timeout_s:.0f}s (at step {len(times)}/{steps}); "
                f"all ranks were stopped. Raise --timeout, lower --steps or raise --bandwidth. Rank 0 log tail:\n"
                f"{_tail(logs[0])}",
                0, None, _tail(logs[0]),
            )
        # a change asked for within a step lands a poll's time late at most: poll finely while one may come
        time.sleep(0.002 if pending and cfg.change_in_step > 0 else 0.05)


def _root_cause(procs, grace_s: float = 3.0) -> tuple[int, int]:
    """Pick the rank whose failure to report once one rank has exited non-zero.

    When one rank raises, its peers usually die a moment later inside a collective, often aborted by
    gloo (a negative exit code: a signal). Which of them the monitor sees first is a matter of
    scheduling, so reporting the first non-zero code seen would sometimes blame a bystander. Give the
    others ``grace_s`` to exit, then prefer a rank that exited with 1 (its own Python exception, whose
    log holds the real traceback), then one that exited with ``PEER_LOST_EXIT`` (a collective lost its
    peer: a bystander), then one killed by a signal; within a class, the one seen exiting first.
    """
    order: list[int] = []
    deadline = time.monotonic() + grace_s
    while True:
        for g, p in enumerate(procs):
            if g not in order and p.poll() is not None:
                order.append(g)
        if len(order) == len(procs) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    bad = [(g, procs[g].returncode) for g in order if procs[g].returncode != 0]
    own = [(g, c) for g, c in bad if c > 0 and c != PEER_LOST_EXIT]
    lost = [(g, c) for g, c in bad if c == PEER_LOST_EXIT]
    return (own or lost or bad)[0]


# --------------------------------------------------------------------------- aggregation


#: engine window totals -> result keys, per measured step (mean over the ranks; only when every rank has it)
_ENGINE_PER_STEP = (("bytes_payload", "payload_bytes_per_step"), ("bytes_dense", "dense_bytes_per_step"),
                    ("compress_time_s", "compress_time_s"),
                    ("comm_time_s", "comm_time_s"),  # time inside the engine's collectives
                    ("overhead_s", "overhead_s"),  # the engine's own time (docs/bench.md, "Overhead")
                    ("exchange_comm_s", "exchange_comm_s"))  # compressed exchanges only, ranks lined up


def _engine_extra(eng: list[dict], measured: int) -> dict[str, Any]:
    """The per-step figures of the engine's counts over the measured window (``eng``: one per rank)."""
    extra: dict[str, Any] = {}
    for key, out in _ENGINE_PER_STEP:
        if all(key in e for e in eng):
            extra[out] = statistics.fmean(e[key] for e in eng) / measured
    if "overhead_s" in extra:
        for key in ("engine_own_s", "control_comm_s"):
            extra[key] = statistics.fmean(e.get(key, 0.0) for e in eng) / measured
    if all("steps" in e for e in eng):
        extra["engine_steps"] = statistics.fmean(e["steps"] for e in eng)
    if all("compressed_steps" in e for e in eng):
        extra["engine_compressed_steps"] = min(e["compressed_steps"] for e in eng)
    if all(e.get("predicted_comm_s") for e in eng):  # model-chosen collectives (artopk_auto)
        extra["predicted_comm_s"] = statistics.fmean(e["predicted_comm_s"] for e in eng) / measured
        extra["collective_choices"] = {
            name: int(eng[0].get(f"chose_{name}", 0)) for name in ("allgather", "art_ring", "art_tree")
        }
    return extra


def _osp_ics(ranks: list[dict]) -> dict:
    """OSP's deferred exchange over the measured steps: its duration on the worker and the step's wait
    for it, each the slowest rank's per step, then the median over steps (empty without records)."""
    per_rank = [rk.get("osp_ics") or [] for rk in ranks]
    steps = min(len(v) for v in per_rank)
    if not steps:
        return {}
    slowest = [(max(v[i][0] for v in per_rank), max(v[i][1] for v in per_rank)) for i in range(steps)]
    return {"osp_ics_comm_s": statistics.median(c for c, _ in slowest),
            "osp_ics_wait_s": statistics.median(w for _, w in slowest)}


def aggregate(spec: MethodSpec, ranks: list[dict], r: dict, *, count_wire: bool, target: float | None) -> dict:
    """One result dict from the per-rank dicts of a method (fields documented in docs/bench.md)."""
    steps, warmup, pph, n = r["steps"], r["warmup"], r["procs_per_host"], r["ranks"]
    per_step = [max(rk["step_times"][i] for rk in ranks) for i in range(min(len(rk["step_times"]) for rk in ranks))]
    window = per_step[warmup:steps]
    measured = len(window)
    compute = [statistics.median(rk["compute_times"]) for rk in ranks if rk["compute_times"]]
    compute_s = max(compute) if compute else None
    step_s = statistics.median(window)
    mean_s = statistics.fmean(window)
    p25, _, p75 = statistics.quantiles(window, n=4, method="inclusive") if measured > 1 else [window[0]] * 3

    # bytes counted by the engine / modelled
    eng = [rk["engine_window"] for rk in ranks if rk.get("engine_window")]
    extra_stop = {"stopped_by": ranks[0]["stopped"]} if ranks[0].get("stopped") else {}
    dense_per_step = ring_factor(n) * 4 * ranks[0]["num_params"]
    extra: dict[str, Any] = {}
    if spec.gc:
        if eng and all("bytes_sent" in e for e in eng):
            bytes_per_step = statistics.fmean(e["bytes_sent"] for e in eng) / measured
            source = "engine"
            extra = _engine_extra(eng, measured)
        else:
            bytes_per_step, source = None, "unavailable"
        if ranks[0].get("network_model"):
            extra["network_model"] = ranks[0]["network_model"]
        if ranks[0].get("omgs"):  # OMGS: predicted backward window vs measured (median over the timed steps)
            om = dict(ranks[0]["omgs"])
            per_rank = [rk["omgs"]["measured_s"] for rk in ranks if rk.get("omgs")]
            tail = [max(v) for v in zip(*per_rank)][-measured:] if per_rank else []
            om["measured_median_s"] = statistics.median(tail) if tail else None
            om.pop("measured_s", None)
            extra["omgs"] = om
        fractions = ranks[0].get("osp_deferred_fractions")
        if fractions:  # OSP: share of the model's elements deferred, over the measured steps
            extra["osp_deferred_fraction_mean"] = statistics.fmean(fractions)
            extra["osp_deferred_fraction_max"] = max(fractions)
            extra.update(_osp_ics(ranks))
        if ranks[0].get("adaptive"):  # the controller's decisions: step, trigger, c, collective, overhead
            extra["adaptive"] = ranks[0]["adaptive"]
        if ranks[0].get("auto"):  # compressor="auto": what it picked, when and why (replicated: rank 0's)
            extra["auto"] = ranks[0]["auto"]
            chooser = chooser_seconds(ranks[0]["auto"], warmup, steps)
            if chooser is not None and "overhead_s" in extra:  # the chooser's work is overhead too
                extra["chooser_s"] = chooser / measured
                extra["overhead_s"] += chooser / measured
    else:
        psgd = ranks[0].get("powersgd_numel_window")
        psgd_per_step = None
        if spec.name == "powersgd":
            psgd_per_step = psgd / measured if psgd else ranks[0].get("powersgd_model_elements")
        bytes_per_step = analytic_bytes_per_step(spec, n, ranks[0]["num_params"], psgd_per_step, hosts=n // pph)
        source = "analytic"
    extra.setdefault("dense_bytes_per_step", dense_per_step)

    # bytes counted by the interfaces
    counted = [rk for rk in ranks if rk["local_rank"] == 0 and rk.get("tx_window") is not None]  # one per host
    host_tx = [rk["tx_window"] for rk in counted]
    counters = [{"host": rk["node_rank"], "tx_bytes": rk["tx_window"], "seconds": rk.get("tx_window_s"),
                 "validation_tx_bytes_excluded": rk.get("tx_val_excluded")} for rk in counted]
    if count_wire and len(host_tx) == r["hosts"]:
        wire_host = statistics.fmean(host_tx) / measured
        wire_rank = wire_host / pph
    else:
        wire_host = wire_rank = None

    # link rate per measured step and the physical floor
    sched: Schedule | None = r["schedule"]
    rates = [sched.rate_at_step(i, steps) for i in range(warmup, steps)] if sched else None
    if wire_host is not None:
        host_bytes, basis = wire_host, "wire"
    elif bytes_per_step is not None:
        host_bytes, basis = bytes_per_step * pph, "engine"
    else:
        host_bytes, basis = None, "compute"
    floor_s = None
    if compute_s is not None:
        if rates and host_bytes is not None:
            floor_s = statistics.fmean(max(compute_s, host_bytes * 8 / rate) for rate in rates)
        else:
            floor_s, basis = compute_s, "compute"
    achieved = util = None
    if wire_host is not None:
        achieved = wire_host * 8 / mean_s
        if rates:
            util = wire_host * 8 * measured / sum(rate * t for rate, t in zip(rates, window))

    # task metric
    evals = [rk["evals"] for rk in ranks]
    curve = []
    for j in range(min(len(e) for e in evals)):
        vals = [e[j]["value"] for e in evals if e[j]["value"] is not None]
        curve.append({
            "step": evals[0][j]["step"],
            "train_time_s": max(e[j]["train_time_s"] for e in evals),
            "value": statistics.fmean(vals) if vals else None,
        })
    final_metric = curve[-1]["value"] if curve else None
    mode = ranks[0]["mode"]
    ttt = next((pt["train_time_s"] for pt in curve if meets_target(pt["value"], target, mode)), None)

    if extra.get("overhead_s") is not None:
        extra["overhead_share"] = extra["overhead_s"] / step_s if step_s else None
    hook = ranks[0].get("comm_hook")
    fid = [rk["fidelity"] for rk in ranks if rk.get("fidelity")]
    if fid:  # --fidelity: each figure's mean over the steps, then over the ranks (local-step methods differ)
        extra["fidelity"] = {k: (statistics.fmean(f[k] for f in fid) if all(f.get(k) is not None for f in fid)
                                 else None) for k in fid[0] if k != "per_parameter"}
        if fid[0].get("per_parameter"):  # rank 0's (synchronous methods: every rank's is the same)
            extra["fidelity"]["per_parameter"] = fid[0]["per_parameter"]
    result = {
        "method": spec.method,
        "label": spec.label,
        "options": dict(spec.options),
        "status": "ok",
        "error": None,
        "measured_steps": measured,
        "step_time_s": step_s,
        "step_time_iqr_s": p75 - p25,
        "step_time_p25_s": p25,
        "step_time_p75_s": p75,
        "step_time_mean_s": mean_s,
        "compute_time_s": compute_s,
        "comm_exposed_s": None if compute_s is None else max(0.0, step_s - compute_s),
        "bytes_per_step": bytes_per_step,
        "bytes_source": source,
        "wire_bytes_per_step": wire_rank,
        "wire_bytes_per_host_per_step": wire_host,
        "wire_counters": counters if count_wire else None,
        "achieved_bandwidth_bps": achieved,
        "link_utilization": util,
        "floor_s": floor_s,
        "floor_basis": basis,
        "metric": ranks[0]["metric"],
        "mode": mode,
        "final_metric": final_metric,
        "target": target,
        "time_to_target_s": ttt,
        "ratio_vs_ddp": None,
        "time_to_target_ratio_vs_ddp": None,
        "comm_hook": hook,
        "step_times_s": per_step,
        # --change-in-step: each rate change's step and its requested and applied offsets into that step (rank 0)
        "rate_changes": ranks[0].get("rate_changes") or [],
        "metric_curve": curve,
        **extra,
        **extra_stop,
    }
    marker = hook_marker(spec)
    if marker is not None and (hook is None or marker not in str(hook)):
        result["status"] = "error"
        result["error"] = (f"the torch comm hook {marker} did not run (DDP reports comm_hook={hook!r}); the "
                           f"measured numbers are plain DDP and must not be used")
    return result


def chooser_seconds(auto: dict, warmup: int, steps: int) -> float | None:
    """Seconds the ``auto`` chooser's decisions took in the measured steps (``warmup`` to ``steps``), less
    their probes (wire time): each decision's ``decide_s`` is the slowest rank's. None without decisions
    that record it."""
    timed = [d for d in auto.get("decisions") or [] if d.get("decide_s") is not None]
    if not timed:
        return None
    inside = [d for d in timed if warmup <= int(d["step"]) < steps]
    return sum(float(d["decide_s"]) - float((d.get("decide_parts_s") or {}).get("probe", 0.0)) for d in inside)


#: the figures of a result, every one null in a failed result
_FIGURES = ("measured_steps", "step_time_s", "step_time_iqr_s", "step_time_p25_s", "step_time_p75_s",
            "step_time_mean_s", "compute_time_s", "comm_exposed_s", "bytes_per_step", "bytes_source",
            "wire_bytes_per_step", "wire_bytes_per_host_per_step", "wire_counters", "achieved_bandwidth_bps",
            "link_utilization", "floor_s", "floor_basis", "metric", "mode", "final_metric", "target",
            "time_to_target_s", "ratio_vs_ddp", "time_to_target_ratio_vs_ddp", "comm_hook")


def failed_result(spec: MethodSpec, error: str) -> dict:
    return {"method": spec.method, "label": spec.label, "options": dict(spec.options), "status": "error",
            "error": error, **dict.fromkeys(_FIGURES), "step_times_s": [], "metric_curve": []}


def add_ratios(results: list[dict]) -> None:
    """Ratios against ``ddp`` and against the best torch baseline of the same run.

    The best baseline is what a user already has without lightning_gc: the fastest of fp32 DDP,
    torch's 16-bit hook and torch PowerSGD that ran in this run (``BASELINES``, any options). It is
    taken separately for the step (lowest median step: ``best_baseline_step``) and for time to
    target (lowest time among those that reached it: ``best_baseline_ttt``); a method that beats
    DDP but not the 16-bit hook does not pay, and only this column shows it."""
    _add_best_baseline_ratios(results)
    ddp = next((x for x in results if x["method"] == "ddp" and x["status"] == "ok"), None)
    if ddp is None:
        return
    for x in results:
        if x["status"] != "ok":
            continue
        if ddp["step_time_s"]:
            x["ratio_vs_ddp"] = x["step_time_s"] / ddp["step_time_s"]
        if ddp.get("step_time_mean_s") and x.get("step_time_mean_s") is not None:
            x["mean_ratio_vs_ddp"] = x["step_time_mean_s"] / ddp["step_time_mean_s"]
        if x["time_to_target_s"] is not None and ddp["time_to_target_s"]:
            x["time_to_target_ratio_vs_ddp"] = x["time_to_target_s"] / ddp["time_to_target_s"]


def _add_best_baseline_ratios(results: list[dict]) -> None:
    baselines = [x for x in results if x["method"] in BASELINES and x["status"] == "ok"]
    step_best = min((x for x in baselines if x["step_time_s"]), key=lambda x: x["step_time_s"], default=None)
    ttt_best = min((x for x in baselines if x["time_to_target_s"]), key=lambda x: x["time_to_target_s"],
                   default=None)
    for x in results:
        x["best_baseline_step"] = step_best["label"] if step_best else None
        x["best_baseline_ttt"] = ttt_best["label"] if ttt_best else None
        x["ratio_vs_best_baseline"] = None
        x["time_to_target_ratio_vs_best_baseline"] = None
        if x["status"] != "ok":
            continue
        if step_best is not None and x["step_time_s"] is not None:
            x["ratio_vs_best_baseline"] = x["step_time_s"] / step_best["step_time_s"]
        if ttt_best is not None and x["time_to_target_s"] is not None:
            x["time_to_target_ratio_vs_best_baseline"] = x["time_to_target_s"] / ttt_best["time_to_target_s"]


# --------------------------------------------------------------------------- the whole benchmark


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark described by ``cfg`` and return the JSON document (see docs/bench.md)."""
    r = resolve(cfg)
    specs: list[MethodSpec] = r["specs"]
    if not any(s.method == "ddp" for s in specs):
        log("note: 'ddp' is not in --methods, so ratio_vs_ddp will be null; add it to compare against dense DDP")

    emulated, reason = False, ""
    if cfg.network in ("auto", "netns"):
        ok, reason = netns.namespaces_available()
        if not ok and cfg.network == "netns":
            raise BenchError(f"--network netns: cannot build an emulated cluster: {reason}; run as root with "
                             f"iproute2, or use --network loopback")
        emulated = ok
    else:
        reason = "--network loopback requested"

    restore_signals = netns.install_signal_handlers()
    cluster: netns.EmulatedCluster | None = None
    tmp_root = None
    rounds: list[list[dict]] = []
    started = time.time()
    try:
        if emulated:
            cluster = netns.EmulatedCluster(hosts=r["hosts"], shaper=cfg.shaper, shape_ingress=cfg.shape_ingress,
                                            log=log)
            cluster.create()
            shaped = (f"links shaped with tc {cfg.shaper} to {r['schedule'].describe()}" if r["schedule"]
                      else "links NOT shaped (no --bandwidth/--schedule)")
            log(f"network: EMULATED - {r['hosts']} host namespaces ({cluster.prefix}-h*) on a bridge, "
                f"{r['procs_per_host']} process(es) per host, {shaped}; no latency emulation (netem unavailable)")
        else:
            log(f"network: LOOPBACK - NOT emulated ({reason}). All ranks talk over 127.0.0.1 without shaping; "
                f"wire_bytes_per_step is null and any --bandwidth/--schedule is only used for floor_s")
        if cfg.logs_dir:
            base = cfg.logs_dir
            os.makedirs(base, exist_ok=True)
        else:
            tmp_root = base = tempfile.mkdtemp(prefix="lgc-bench-")
        for rnd in range(r["repeat"]):
            results: list[dict] = [{} for _ in specs]  # in the method list's order, whatever order they ran in
            for position, i in enumerate(round_order(len(specs), rnd)):
                results[i] = _run_one(specs[i], i, rnd, cfg, r, cluster, base, emulated, log, position)
            rounds.append(results)
    finally:
        if cluster is not None:
            cluster.destroy()
            log(f"network: removed namespaces {cluster.prefix}-*")
        if tmp_root:
            shutil.rmtree(tmp_root, ignore_errors=True)
        restore_signals()
    shaped = bool(emulated and r["schedule"])
    network = _network("netns" if emulated else "loopback", reason, shaper=cfg.shaper if shaped else None,
                       shape_ingress=shaped and cfg.shape_ingress,
                       wire_counter="tx_bytes of the host interface (Ethernet+IP+TCP headers included)" if emulated
                       else None)
    return build_document(cfg, r, rounds, network, started)


def _network(mode: str, reason: str, *, shaper: str | None = None, shape_ingress: bool = False,
             wire_counter: str | None = None) -> dict:
    """The document's ``network`` entry; links are shaped exactly when a shaper is named."""
    return {"mode": mode, "reason": reason, "shaped": shaper is not None, "shaper": shaper,
            "shape_ingress": bool(shape_ingress), "latency_emulation": False, "wire_counter": wire_counter}


def round_order(n: int, rnd: int) -> list[int]:
    """The order in which round ``rnd`` (0-based) runs the ``n`` methods: as listed, then reversed,
    alternately (ABBA), so that a drift of the host's speed, steady over a pair of rounds, falls on
    every method alike instead of always on the methods listed last."""
    forward = list(range(n))
    return forward if rnd % 2 == 0 else forward[::-1]


def _run_one(spec: MethodSpec, i: int, rnd: int, cfg: BenchConfig, r: dict, cluster, base: str, emulated: bool,
             log: Callable[[str], None], position: int | None = None) -> dict:
    """Run and aggregate one method of one round (a failure becomes a failed result, the run goes on).
    ``position``: where it runs in its round's order (:func:`round_order`; ``i`` when not given),
    recorded in the result for the round's summary (:func:`lightning_gc.bench.repeats.round_summary`)."""
    position = i if position is None else position
    specs, many = r["specs"], r["repeat"] > 1
    where = f"round {rnd + 1}/{r['repeat']}, " if many else ""
    if cfg.seeds is not None:
        where += f"seed {r['seeds'][rnd]}, "
    log(f"[{where}{position + 1}/{len(specs)}] {spec.label}: {r['ranks']} ranks on {r['hosts']} host(s), "
        f"{r['steps']} steps ({r['warmup']} warm-up), preset {cfg.preset}")
    t0 = time.monotonic()
    name = f"{i:02d}-{spec.label.replace(':', '_').replace('=', '-')}" + (f"-round{rnd + 1}" if many else "")
    try:
        # the round's training seed (--seeds; else --seed in every round)
        seeded = cfg if r["seeds"][rnd] == cfg.seed else replace(cfg, seed=r["seeds"][rnd])
        # a distinct port per run (index): a port of the previous round may still be in TIME_WAIT
        rank_results = run_method(spec, i + rnd * len(specs), seeded, r, cluster, os.path.join(base, name), log)
    except RankFailure as exc:
        log(f"  [{spec.label}] FAILED: {exc}")
        return {**failed_result(spec, str(exc)), "seed": r["seeds"][rnd], "position": position}
    target = cfg.target if cfg.target is not None else rank_results[0]["target"]
    res = aggregate(spec, rank_results, r, count_wire=emulated, target=target)
    res["seed"], res["position"] = r["seeds"][rnd], position
    res["wall_time_s"] = time.monotonic() - t0
    if res["status"] != "ok":
        log(f"  [{spec.label}] INVALID: {res['error']}")
    else:
        log(f"  [{spec.label}] done in {res['wall_time_s']:.0f}s: step {res['step_time_s']:.3f}s "
            f"(IQR {res['step_time_iqr_s']:.3f}), compute {_fmt_s(res['compute_time_s'])}, "
            f"engine {_fmt_b(res['bytes_per_step'])}/step, wire {_fmt_b(res['wire_bytes_per_step'])}/step, "
            f"{res['metric']} {_fmt_v(res['final_metric'])}"
            + (f", OSP deferred {res['osp_deferred_fraction_mean']:.0%} of the model on average"
               if res.get("osp_deferred_fraction_mean") is not None else "")
            + (f", its exchange {_fmt_s(res['osp_ics_comm_s'])} a step, waited for {_fmt_s(res['osp_ics_wait_s'])}"
               if res.get("osp_ics_comm_s") is not None else "")
            + (f", auto picked {auto_pick(res)}" if res.get("auto") else ""))
    return res


def build_document(cfg: BenchConfig, r: dict, rounds: list[list[dict]], network: dict, started: float) -> dict:
    """The JSON document (schema in docs/bench.md) from the aggregated results: one list per round
    (``--repeat``), each with its own ratios, combined per method when there are several."""
    for results in rounds:
        add_ratios(results)
    results = rounds[0] if len(rounds) == 1 else combine_rounds(rounds)
    for row in results:  # a round's order is in its entry of `rounds`, not on the combined row
        row.pop("position", None)
    first_ok = next((x for x in results if x["status"] == "ok"), None)
    sched = r["schedule"]
    config = {
        **{k: v for k, v in asdict(cfg).items() if k not in ("fail_rank", "fail_step", "logs_dir", "schedule")},
        "schedule_spec": cfg.schedule,
        "hosts": r["hosts"],
        "procs_per_host": r["procs_per_host"],
        "num_nodes": r["hosts"],
        "eval_every": r["eval_every"],
        "threads": r["threads"],
        "bandwidth_bps": sched.initial_rate_bps if sched and sched.is_constant else None,
        "schedule": sched.to_json() if sched else None,
        "schedule_steps": [{"step": s, "rate_bps": b} for s, b in r["boundaries"]] if sched else None,
        "methods": [s.to_json() for s in r["specs"]],
        "metric": first_ok["metric"] if first_ok else None,
        "mode": first_ok["mode"] if first_ok else None,
        "target": first_ok["target"] if first_ok else cfg.target,
        "versions": _versions(),
        "rounds": len(rounds),
        "seeds": r["seeds"],
        "started_unix": started,
    }
    return {
        "schema": SCHEMA,
        "config": config,
        "emulated": network["mode"] == "netns",
        "network": network,
        "results": results,
    }


# --------------------------------------------------------------------------- real clusters

PLAN_FILE = "plan.json"


def prepare(cfg: BenchConfig, plan_dir: str, *, ifname: str | None = None, master_addr: str = "NODE0_ADDRESS",
            master_port: int = 29500, log: Callable[[str], None] = print) -> list[str]:
    """Write worker configs for a real cluster and return the launch command of every method.

    Every node runs each command (with its own ``--node-rank``), method after method; ``plan_dir``
    must be on a file system all nodes share (or be copied to every node and the ``rank*.json``
    files gathered back into it) before :func:`collect` builds the report.
    """
    if cfg.schedule is not None:
        raise BenchError(
            f"--schedule {cfg.schedule!r} cannot be applied on a real cluster (no tc shaping there); drop it, or run "
            f"the emulated cluster instead"
        )
    r = resolve(cfg)
    if r["repeat"] > 1:
        raise BenchError(
            f"--repeat {r['repeat']} (or --seeds) with --prepare: a real cluster's methods are launched by hand, one after another; "
            "run the plan again (a new --prepare directory, --seed for another seed) and compare the reports, or drop "
            "--repeat/--seeds"
        )
    plan_dir = os.path.abspath(plan_dir)
    os.makedirs(plan_dir, exist_ok=True)
    commands, run_dirs = [], []
    for i, spec in enumerate(r["specs"]):
        run_dir = os.path.join(plan_dir, f"{i:02d}-{spec.label.replace(':', '_').replace('=', '-')}")
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "worker.json")
        Path(path).write_text(json.dumps(worker_config(spec, cfg, r, run_dir, ifname=ifname, with_schedule=False),
                                         indent=1))
        run_dirs.append(os.path.basename(run_dir))
        commands.append(
            f"torchrun --nnodes {r['hosts']} --nproc-per-node {r['procs_per_host']} --node-rank $NODE_RANK "
            f"--master-addr {master_addr} --master-port {master_port} -m lightning_gc.bench.worker {path}"
        )
    plan = {"schema": SCHEMA, "config": {k: v for k, v in asdict(cfg).items() if k != "logs_dir"}, "ifname": ifname,
            "run_dirs": run_dirs}
    Path(plan_dir, PLAN_FILE).write_text(json.dumps(plan, indent=1))
    log(f"wrote {len(commands)} method config(s) under {plan_dir}; on every node (NODE_RANK = 0..{r['hosts'] - 1}, "
        f"node 0 reachable at {master_addr}) run, one after another:")
    for c in commands:
        log("  " + c)
    log(f"then: lightning-gc bench --collect {plan_dir} --out REPORT_DIR")
    return commands


def collect(plan_dir: str, log: Callable[[str], None] = print) -> dict:
    """Aggregate the rank files of a run set up by :func:`prepare` into the JSON document."""
    path = os.path.join(plan_dir, PLAN_FILE)
    try:
        plan = _read_json(path)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--collect {plan_dir!r}: cannot read {PLAN_FILE} ({exc}); point it at a directory written "
                         f"by 'lightning-gc bench --prepare'") from exc
    cfg = BenchConfig(**plan["config"])
    r = resolve(cfg)
    ifname = plan.get("ifname")
    results = []
    for spec, sub in zip(r["specs"], plan["run_dirs"]):
        run_dir = os.path.join(plan_dir, sub)
        files = [os.path.join(run_dir, f"rank{g}.json") for g in range(r["ranks"])]
        missing = [os.path.basename(f) for f in files if not os.path.exists(f)]
        if missing:
            results.append(failed_result(spec, f"method {spec.label!r}: missing {missing} in {run_dir}; the run did not "
                                               f"finish on every rank, or the files were not gathered there"))
            log(f"[{spec.label}] incomplete: missing {missing}")
            continue
        ranks = [_read_json(f) for f in files]
        target = cfg.target if cfg.target is not None else ranks[0]["target"]
        results.append(aggregate(spec, ranks, r, count_wire=ifname is not None, target=target))
        log(f"[{spec.label}] collected {len(files)} rank files")
    network = _network("cluster", "ranks launched externally (torchrun) on real hosts",
                       wire_counter=f"tx_bytes of {ifname} on each node: ALL traffic of that NIC, not only training"
                       if ifname else None)
    return build_document(cfg, r, [results], network, os.path.getmtime(path))


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "lightning"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}s"


def _fmt_b(x: float | None) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _fmt_v(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"
