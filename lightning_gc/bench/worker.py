"""One benchmark rank: ``python -m lightning_gc.bench.worker CONFIG.json``.

Started by :mod:`lightning_gc.bench.runner` (inside a host namespace via ``ip netns exec`` when the
cluster is emulated) with ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``,
``LOCAL_RANK`` and ``GLOBAL_RANK`` set, so Lightning treats the processes as externally launched and
runs ``Trainer(num_nodes=hosts, devices=procs_per_host, accelerator="cpu")``. On a real cluster the
same module is started by ``torchrun`` (``RANK``/``GROUP_RANK`` are accepted for
``GLOBAL_RANK``/``NODE_RANK``) with a config written by ``lightning-gc bench --prepare``.

What it measures (written to ``<run_dir>/rank<G>.json``):

* ``step_times``: wall time of every training step on this rank, from the end of the previous step
  (or of the validation before it; for the first step, ``on_train_batch_start``) to
  ``on_train_batch_end``. The time *between* steps counts: work a method overlaps with later steps
  (Streaming DiLoCo's fragments, OSP's deferred stage) competes with the main thread there.
  Validation and the progress file are outside; ``--budget``'s agreement is inside the next step.
  The runner skips the first ``warmup`` steps.
* ``compute_times``: after training, every rank replays a few of the batches it trained on through
  ``training_step`` + ``backward`` + ``optimizer.step`` on the *unwrapped* LightningModule (no DDP
  reducer, no comm hook, so no communication at all), all ranks at once after a barrier so the CPU
  contention is the same as during training. The model is not used afterwards.
* ``tx_window``: on local rank 0 of an emulated host, the host interface's transmit counter over the
  measured steps (validation traffic inside the window subtracted); ``tx_window_s`` the wall time
  between the two counter reads.
* ``engine_window``: the change of ``strategy.engine.totals()`` over the measured steps (lightning_gc
  methods), ``powersgd_numel_window``: the change of PowerSGD's reduced element count.
* ``evals``: the task metric after each validation, with the training time (sum of step times) at
  that point, validation excluded.
* ``auto`` (``GCStrategy(compressor="auto")`` only, else ``None``): what the run-time chooser picked
  and why, from ``strategy.auto.history`` at the end of training (replicated, so every rank writes
  the same): the method in force at the end, one entry per decision and every re-measurement of
  the errors (:func:`_auto_state`). A decision's ``measured_step_s`` is the chooser's reference
  after it: the median of a ``window`` of steps once the switch has settled, slowest rank (``None``
  if the run ended before that window).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Any

__all__ = ["main"]


def _set_parent_death_signal() -> None:
    """Die with the runner even if it is SIGKILLed (Linux only; best effort)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def _metric_value(trainer, name: str) -> float | None:
    v = trainer.callback_metrics.get(name)
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _make_callback(cfg: dict, global_rank: int, local_rank: int):
    import lightning as L

    from lightning_gc.bench.netns import read_tx_bytes

    class BenchCallback(L.Callback):
        def __init__(self) -> None:
            self.step = 0
            self.t0 = 0.0
            self.t_ready: float | None = None  # end of the previous step's bookkeeping, or of a validation
            self.train_time = 0.0
            self.step_times: list[float] = []
            self.evals: list[dict] = []
            self.cache: list[Any] = []
            self.boundaries = {int(s): (k, int(r)) for k, (s, r) in enumerate(cfg["boundaries"])}
            # --change-in-step: rank 0 asks for each rate change this share of a step into the boundary
            # step (from a thread; the step does not wait), and records when the runner applied it
            self.change_in_step = float(cfg.get("change_in_step") or 0.0)
            self.rate_changes: list[dict] = []
            self._changers: list[threading.Thread] = []
            self.change_error: BaseException | None = None  # a change that failed: raised at the next step
            self.ifname = cfg.get("ifname") if local_rank == 0 else None
            self.window_open = False
            self.start: dict = {}  # the counters when the measured window opened (_counters)
            self.end: dict = {}  # ... and when it closed
            self.tx_val = 0
            self.tx_val_start = None
            self.comm_hook = None
            self.osp_fractions: list[float] = []  # OSP: deferred share of each measured step
            #: OSP: (the deferred exchange's duration, the step's wait for it) at each measured step that
            #: awaited one, seconds; a drained step records its own exchange
            self.osp_ics: list[tuple[float, float]] = []
            self.progress = os.path.join(cfg["run_dir"], "progress.jsonl") if global_rank == 0 else None
            self.budget_s = cfg.get("budget_s")
            self.stopped: str | None = None  # "target" / "budget" when --budget ended the run early

        # helpers ------------------------------------------------------------
        def _note(self, **kw) -> None:
            if self.progress:
                with open(self.progress, "a") as fh:
                    fh.write(json.dumps(kw) + "\n")

        def _tx(self):
            return read_tx_bytes(self.ifname) if self.ifname else None

        def _counters(self, trainer) -> dict:
            return {"tx": self._tx(), "t": time.monotonic(), "engine": self._engine(trainer),
                    "psgd": self._psgd(trainer)}

        def _close_window(self, trainer) -> None:
            self.window_open = False
            self.end = self._counters(trainer)

        def _maybe_stop(self, trainer, *, over_budget: bool, reached: bool) -> None:
            """--budget: stop every rank at the same step once the target is reached or the training
            time is spent on any rank (one 2-element MAX allreduce, outside the timed step)."""
            import torch

            flag = torch.tensor([float(over_budget), float(reached)])
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.any():
                self.stopped = "target" if flag[1] > 0 else "budget"
                self._close_window(trainer)
                trainer.should_stop = True
                self._note(stopped=self.stopped, step=self.step)

        @staticmethod
        def _engine(trainer):
            # GCStrategy's engine, or GCModelParallelStrategy's replica exchange (FSDP2)
            strategy = trainer.strategy
            return _totals(getattr(strategy, "engine", None) or getattr(strategy, "replica", None))

        @staticmethod
        def _psgd(trainer):
            state = getattr(trainer.strategy, "hook_state", None)
            return None if state is None else float(getattr(state, "total_numel_after_compression", 0))

        def _wait_for_rate(self, k: int, rate: int, step: int | None = None) -> None:
            step = self.step if step is None else step
            req = os.path.join(cfg["run_dir"], f"phase{k}.req")
            ack = os.path.join(cfg["run_dir"], f"phase{k}.ack")
            with open(req, "w") as fh:
                fh.write(str(rate))
            deadline = time.monotonic() + float(cfg.get("sync_timeout", 120))
            while not os.path.exists(ack):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rate change {k} (to {rate} bit/s) at step {step} was not acknowledged by the runner "
                        f"within {cfg.get('sync_timeout', 120)}s"
                    )
                time.sleep(0.002)

        def _change_in_step(self, k: int, rate: int) -> None:
            """Ask for rate change ``k`` ``change_in_step`` of a step (the median of the last five
            steps' walls) after now, the boundary step's start, from a thread: the step runs on
            while the runner applies it. Records the requested and the applied offset (CLOCK_MONOTONIC
            is one clock for every process of the machine, the runner's included)."""
            recent = self.step_times[-5:]
            delay = self.change_in_step * (statistics.median(recent) if recent else 0.0)
            start, step = time.monotonic(), self.step

            def change() -> None:
                try:
                    time.sleep(delay)
                    self._wait_for_rate(k, rate, step)
                    with open(os.path.join(cfg["run_dir"], f"phase{k}.ack")) as fh:
                        applied = float(fh.read().strip() or "nan")
                    self.rate_changes.append({"step": step, "rate_bps": rate, "requested_offset_s": delay,
                                              "applied_offset_s": applied - start})
                except BaseException as exc:  # noqa: BLE001 - the training thread raises it (not lost in a thread)
                    self.change_error = exc

            t = threading.Thread(target=change, name=f"rate-change-{k}", daemon=True)
            t.start()
            self._changers.append(t)

        def finish_rate_changes(self, timeout_s: float) -> None:
            """Wait for the rate changes asked for within steps (a change asked for in the run's last
            steps is applied by now, or soon) and raise one that failed."""
            for t in self._changers:
                t.join(timeout=timeout_s)
            if self.change_error is not None:
                raise self.change_error

        # hooks --------------------------------------------------------------
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            s = self.step
            if self.change_error is not None:
                raise self.change_error
            if s in self.boundaries and global_rank == 0:
                if self.change_in_step > 0:
                    self._change_in_step(*self.boundaries[s])
                else:
                    self._wait_for_rate(*self.boundaries[s])
            if cfg.get("fail_rank") == global_rank and s == int(cfg.get("fail_step") or 0):
                raise RuntimeError(f"injected failure on rank {global_rank} at step {s} (fail_rank test hook)")
            if s == cfg["warmup"]:
                self.window_open = True
                self.start = self._counters(trainer)
            now = time.perf_counter()
            self.t0 = now if self.t_ready is None else self.t_ready  # the time between steps is training time

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            nxt = self.step + 1
            if nxt % int(cfg["eval_every"]) == 0 or nxt == cfg["steps"] or nxt == cfg["warmup"]:
                # A validation follows (or training ends): wait here, inside the timed step, for
                # communication still in flight (OSP's deferred stage, Streaming DiLoCo's fragment
                # exchanges). Otherwise it would progress during validation, whose time is not
                # training time, and a method that overlaps would look faster than it is. Before the
                # measured window opens, the same wait keeps a warm-up step's traffic out of its
                # byte counts (the window then holds exactly its own steps' exchanges).
                drain = getattr(trainer.strategy, "drain", None)
                if callable(drain):
                    drain()
            dt = time.perf_counter() - self.t0
            self.step_times.append(dt)
            osp = getattr(trainer.strategy, "osp", None)
            if self.window_open and osp is not None and osp.last_stats is not None:
                self.osp_fractions.append(float(osp.last_stats.deferred_fraction))
                if osp.last_stats.ics_comm_s > 0:  # an exchange was awaited at this step (none after a drain)
                    self.osp_ics.append((float(osp.last_stats.ics_comm_s), float(osp.last_stats.ics_wait_s)))
            self.train_time += dt
            if self.window_open and len(self.cache) < max(1, int(cfg["compute_steps"])):
                self.cache.append(batch)
            self.step += 1
            if self.step == cfg["steps"] and self.window_open:
                self._close_window(trainer)
            self._note(step=self.step, dt=dt)
            # From here on the time belongs to the next step, --budget's agreement included: its
            # allreduce waits for the slowest rank and, on the link, behind whatever a method has in
            # flight (Streaming DiLoCo's fragments); left out, it hid that traffic.
            self.t_ready = time.perf_counter()
            if self.budget_s is not None and self.window_open:  # after at least one measured step
                self._maybe_stop(trainer, over_budget=self.train_time >= self.budget_s, reached=False)

        def on_validation_start(self, trainer, pl_module) -> None:
            self.t_ready = None  # the time from here to the validation's end is not training time
            if self.window_open:
                self.tx_val_start = self._tx()

        def on_validation_end(self, trainer, pl_module) -> None:
            if self.window_open and self.tx_val_start is not None:
                self.tx_val += (self._tx() or 0) - self.tx_val_start
            self.tx_val_start = None
            value = _metric_value(trainer, cfg["metric"])
            self.evals.append({"step": self.step, "train_time_s": self.train_time, "value": value})
            self._note(eval=value, step=self.step)
            if self.budget_s is not None and self.window_open:
                from lightning_gc.bench.workloads import meets_target

                reached = meets_target(value, cfg.get("target_value"), cfg.get("mode"))
                self._maybe_stop(trainer, over_budget=False, reached=reached)
            self.t_ready = time.perf_counter()

        def on_train_end(self, trainer, pl_module) -> None:
            getter = getattr(trainer.strategy.model, "_get_ddp_logging_data", None)
            if getter is not None:
                with contextlib.suppress(Exception):  # comm_hook stays None
                    self.comm_hook = getter().get("comm_hook")

    return BenchCallback()


def _compute_phase(model, trainer, cache: list, n: int) -> list[float]:
    """Time ``training_step`` + backward + optimizer step without any gradient synchronisation."""
    import torch

    if not cache or n <= 0 or not getattr(model, "automatic_optimization", True):
        return []
    opts = trainer.optimizers
    if opts:
        opt = opts[0]
    else:
        conf = model.configure_optimizers()
        opt = conf["optimizer"] if isinstance(conf, dict) else (conf[0] if isinstance(conf, (list, tuple)) else conf)
        if isinstance(opt, (list, tuple)):
            opt = opt[0]
    model.log = lambda *a, **k: None  # training_step may log; there is no loop to log into here
    model.log_dict = lambda *a, **k: None
    model.train()
    times = []
    # FSDP2 (a model-parallel strategy): no reduce-scatter and no replica exchange in these steps
    fsdp = hasattr(trainer.strategy, "fully_shard_kwargs")
    with trainer.strategy.block_backward_sync() if fsdp else contextlib.nullcontext():
        for i in range(n + 1):  # first replay is a warm-up
            batch = cache[i % len(cache)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            out = model.training_step(batch, i)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            if i > 0:
                times.append(dt)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return times


def _ranks() -> tuple[int, int, int]:
    env = os.environ
    try:
        g = int(env.get("GLOBAL_RANK", env.get("RANK", "")))
        local = int(env["LOCAL_RANK"])
        node = int(env.get("NODE_RANK", env.get("GROUP_RANK", "")))
    except (KeyError, ValueError) as exc:
        raise RuntimeError(
            "the bench worker needs LOCAL_RANK plus GLOBAL_RANK (or RANK) and NODE_RANK (or GROUP_RANK) in the "
            f"environment ({exc}); start it through 'lightning-gc bench' or torchrun"
        ) from exc
    return g, local, node


def run(cfg: dict) -> dict:
    import lightning as L
    import torch

    from lightning_gc.bench.methods import (
        MethodSpec,
        build_callbacks,
        build_strategy,
        dense_grad_elements,
        powersgd_elements,
    )
    from lightning_gc.bench.workloads import resolve_preset

    global_rank, local_rank, node_rank = _ranks()
    torch.set_num_threads(max(1, int(cfg["threads"])))
    L.seed_everything(int(cfg["seed"]), workers=True, verbose=False)

    preset = resolve_preset(cfg["preset"], seed=int(cfg["seed"]), **cfg.get("preset_args", {}))
    cfg["metric"] = preset.metric
    cfg["mode"] = preset.mode
    cfg["target_value"] = cfg.get("target") if cfg.get("target") is not None else preset.target
    m = cfg["method"]
    spec = MethodSpec(m["name"], dict(m["options"]), gc=bool(m["gc"]))
    strategy = build_strategy(spec)
    cb = _make_callback(cfg, global_rank, local_rank)
    # before the bench callback: a controller's exploration at a step's end counts in that step's time
    extra_callbacks = build_callbacks(spec)
    fidelity = None
    if cfg.get("fidelity"):
        from lightning_gc.callbacks import GradientFidelity

        # the presets clip inside configure_gradient_clipping: the shadow optimizer clips the same way
        clip = float(getattr(preset.model, "hparams", {}).get("grad_clip", 0.0) or 0.0)
        fidelity = GradientFidelity(clip_norm=clip if clip > 0 else None, log=False, per_parameter=True)
    eval_every = int(cfg["eval_every"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(cfg["procs_per_host"]),
        num_nodes=int(cfg["hosts"]),
        strategy=strategy,
        max_steps=int(cfg["steps"]),
        max_epochs=-1,
        val_check_interval=eval_every,
        check_val_every_n_epoch=None,
        limit_val_batches=cfg["val_batches"],
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*extra_callbacks, *([fidelity] if fidelity is not None else []), cb],
    )
    trainer.fit(preset.model, datamodule=preset.datamodule)
    if not cb.evals or cb.evals[-1]["step"] != cb.step:
        trainer.validate(preset.model, datamodule=preset.datamodule, verbose=False)
    if global_rank == 0:
        cb._note(phase="compute")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    compute_times = _compute_phase(preset.model, trainer, cb.cache, int(cfg["compute_steps"]))

    def delta(a, b):
        if a is None or b is None:
            return None
        return {k: b[k] - a.get(k, 0.0) for k in b} if isinstance(b, dict) else b - a

    cb.finish_rate_changes(float(cfg.get("sync_timeout", 120)))
    window = {k: delta(cb.start.get(k), cb.end.get(k)) for k in ("tx", "t", "engine", "psgd")}
    engine = getattr(strategy, "engine", None)
    return {
        "global_rank": global_rank,
        "node_rank": node_rank,
        "local_rank": local_rank,
        "steps_done": cb.step,
        "step_times": cb.step_times,
        "rate_changes": cb.rate_changes,
        "compute_times": compute_times,
        "tx_window": None if window["tx"] is None else window["tx"] - cb.tx_val,
        "tx_val_excluded": cb.tx_val,
        "tx_window_s": window["t"],
        "engine_window": window["engine"],
        "network_model": _network_model(engine),
        "omgs": _omgs_state(strategy),
        "osp_deferred_fractions": cb.osp_fractions,
        "osp_ics": cb.osp_ics,
        "powersgd_numel_window": window["psgd"],
        "evals": cb.evals,
        "stopped": cb.stopped,
        "comm_hook": cb.comm_hook,
        "num_params": dense_grad_elements(preset.model),
        "powersgd_model_elements": (
            powersgd_elements(preset.model, int(spec.options.get("rank", 1)),
                              float(spec.options.get("min_compression_rate", 2)))
            if (not spec.gc and spec.name == "powersgd") else None
        ),
        "adaptive": [
            {k: h[k] for k in ("step", "trigger", "mode", "c", "collective", "overhead_s")}
            for c in extra_callbacks for h in getattr(c, "history", [])
        ] or None,
        "auto": _auto_state(strategy),
        "fidelity": fidelity.summary() if fidelity is not None else None,
        "metric": preset.metric,
        "mode": preset.mode,
        "target": preset.target,
        "batch_size": preset.batch_size,
        "threads": torch.get_num_threads(),
    }


def _num(x) -> float | None:
    return None if x is None else float(x)


def _compute_s(workload: dict | None) -> float | None:
    """Forward + backward + optimizer seconds of an auto workload record, or ``None``."""
    if not workload:
        return None
    return float(workload["forward_s"]) + float(sum(workload["backward_s"])) + float(workload["optimizer_s"])


def _auto_state(strategy) -> dict | None:
    """``compressor="auto"``: the chooser's decisions (see the module docstring), or ``None``."""
    chooser = getattr(strategy, "auto", None)
    if chooser is None:
        return None
    decisions = []
    for h in chooser.history:
        preds = h.get("predictions") or {}
        chosen = h.get("chosen")
        net = h.get("network") or [None, None]
        decisions.append({
            "step": int(h["step"]), "trigger": str(h["trigger"]), "chosen": chosen, "previous": h.get("previous"),
            "predicted_step_s": _num(preds.get(chosen, {}).get("step_s")),
            "measured_step_s": _num(h.get("measured_step_s")),
            "predictions": {name: float(p["step_s"]) for name, p in preds.items()},
            "time_per_progress_s": {name: float(p["time_per_progress_s"]) for name, p in preds.items()},
            "network": {"alpha_s": _num(net[0]), "beta_s_per_byte": _num(net[1])},
            "dense_wall_s": _num(h.get("dense_wall_s")), "decide_s": _num(h.get("decide_s")),
            # where the decision's own time went (latency, probe, check, reference, codecs; slowest rank each)
            "decide_parts_s": {k: float(v) for k, v in (h.get("decide_parts_s") or {}).items()},
            "delta2": {c["name"]: float(c["delta2"]) for c in h.get("costs") or []},
            "beta_scale": _num(h.get("beta_scale")),
            "link_check": _link_check(h.get("link_check")), "network_source": h.get("network_source"),
            "compute_s": _compute_s(h.get("workload")),
            # the compute shift (docs/auto.md, step 7): added to the methods not measured in a window of their own
            "shift_s": _num(h.get("shift_s")), "settled": list(h.get("settled") or []),
            "shift_from": list(h.get("shift_from") or []),  # whose speed-ups the shift is the least of
            "drift_test": h.get("drift_test"),  # which test saw a drift: window, steps, step, exchange, reference_window
            # a gain or calibration move to a dense mode that timed the link first (None: none; docs/auto.md)
            "switch_check": h.get("switch_check"),
            # a periodic or gain decision that kept the method on an unchanged link kept its reference
            "kept_reference": bool(h.get("kept_reference", False)),
            # a measured method that led the running one by less than switch_margin (the running one stayed)
            "held_by_margin": h.get("held_by_margin"),
            # the running method's figure from all its windows since its reference (gain, periodic; else None)
            "running_figure_s": _num(h.get("running_figure_s")),
        })
    gains = [{"step": int(c["step"]), "delta2": {k: float(v) for k, v in c["delta2"].items()},
              "moved": float(c["moved"]), "redecided": bool(c["redecided"]),
              # steps to the next re-measurement (gain_every_max; None in checkpoints of earlier versions)
              "next_interval": c.get("next_interval"),
              # the candidates whose errors were not measured again: they could not win (None: earlier versions)
              "skipped": c.get("skipped")} for c in getattr(chooser, "gain_checks", [])]
    # auto_diloco: every trial, verdict, entry into DiLoCo and leaving it (auto/sync_switch.py)
    return {"chosen": chooser.chosen, "candidates": list(chooser.config.candidates), "decisions": decisions,
            "gain_checks": gains, "sync_events": copy.deepcopy(chooser.sync_events)}


def _link_check(check: dict | None) -> dict | None:
    """A re-decision's link check (``AutoChooser``, ``probe_check``). ``reference``: ``"measured"`` (a
    probe's or an earlier check's message) or ``"modelled"`` (the model's time after a dense step
    measured β); ``beta_s_per_byte``: the β a moved check measured itself, else ``None``."""
    if not check:
        return None
    return {"check_s": _num(check.get("check_s")), "probe_s": _num(check.get("probe_s")),
            "bytes": int(check.get("bytes", 0)), "unchanged": bool(check.get("unchanged")),
            "retimed": bool(check.get("retimed", False)), "reference": check.get("reference"),
            "beta_s_per_byte": _num(check.get("beta_s_per_byte"))}


def _omgs_state(strategy) -> dict | None:
    """OMGS: the plan's predicted backward-window time, the measured windows, and the fits."""
    ctl = getattr(strategy, "omgs", None)
    if ctl is None or ctl.state.plan is None:
        return None
    s = ctl.state
    cal = s.calibration
    return {
        "plan": s.plan.kind, "groups": sum(1 for g in s.plan.groups if not g.exact),
        "predicted_s": s.predicted_s, "measured_s": list(s.measured_s), "predictions": dict(s.predictions),
        "replans": s.replans, "backward_s": max(ctl.backward_s or [0.0]),
        "fit": None if cal is None else {
            "gamma_s": cal.sparsify.gamma_s, "sparsify_intercept_s": cal.sparsify.intercept_s,
            "sparsify_residuals": list(cal.sparsify.residuals), "alpha_s": cal.comm.intercept,
            "beta_s_per_byte": cal.comm.slope, "comm_residuals": list(cal.comm.residuals),
            "exact_s": cal.exact_s, "overhead_s": cal.overhead_s,
        },
    }


def _network_model(engine) -> dict | None:
    """The alpha-beta model the engine ended with (probed or pinned), if it used one."""
    net = getattr(getattr(engine, "network", None), "model", None)
    if net is None:
        return None
    return {"alpha_s": float(net.alpha_s), "beta_s_per_byte": float(net.beta_s_per_byte),
            "pinned": bool(engine.network.pinned), "probes": int(engine.network.probes)}


def _totals(engine) -> dict | None:
    """The engine's numeric running totals, or ``None`` without an engine."""
    if engine is None or not hasattr(engine, "totals"):
        return None
    return {k: float(v) for k, v in engine.totals().items() if isinstance(v, (int, float))}


PEER_LOST_EXIT = 3
"""Exit code of a rank that failed because a collective lost its peer (not its own fault).

The runner reports a rank that exited with 1 (its own exception) before one that exited with this
code, so a rank that merely noticed another's crash is not blamed for it."""


def _is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed reporting a broken connection to another rank.

    torch raises ``DistBackendError``/``DistNetworkError`` for some of these, but gloo's transport
    errors reach Python as a plain ``RuntimeError`` whose message names gloo's tcp transport (seen:
    "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ... typically caused by a remote
    worker crashing"), so those are recognised by that origin.
    """
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistBackendError", None), getattr(dist, "DistNetworkError", None)) if k)
    if kinds and isinstance(exc, kinds):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and "gloo/transport/" in text and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                  "remote worker crashing"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lightning_gc.bench.worker CONFIG.json (started by 'lightning-gc bench')",
              file=sys.stderr)
        return 2
    _set_parent_death_signal()
    with open(argv[0]) as fh:
        cfg = json.load(fh)
    rank = os.environ.get("GLOBAL_RANK", os.environ.get("RANK", "?"))
    try:
        result = run(cfg)
    except BaseException as exc:  # noqa: BLE001 - reported to the runner through the log and exit code
        traceback.print_exc()
        sys.stderr.flush()
        return PEER_LOST_EXIT if _is_peer_loss(exc) else 1
    _write_json(os.path.join(cfg["run_dir"], f"rank{rank}.json"), result)
    return 0


if __name__ == "__main__":
    code = main()
    # The result is on disk. Skip the interpreter's finalisation: with torch's own DDP hooks
    # (the `fp16` baseline) a rank was seen aborting there ("terminate called without an active
    # exception", exit -6) after its measurement had finished, which failed a finished method.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
