"""``compressor="auto"``: choose, at run time, the method that reaches the target soonest.

The step participant (name ``"auto"``) that the strategy adds when ``compressor="auto"``. On every
rank, at the same step boundaries:

1. **Profile** the dense warm-up steps the engine runs anyway (forward, each gradient's readiness,
   the optimizer, the step's wall), then **measure** every candidate's codec cost, payload and error
   on the live gradient (:mod:`lightning_gc.auto.measure`) and the link (:mod:`lightning_gc.auto.look`).
   Every figure is agreed across ranks before it is used.
2. **Decide** (:func:`lightning_gc.auto.policy.decide`) and **apply** the pick to the engine through
   :class:`~lightning_gc.engine.ports.MethodControl` (a dense bucket mode, or an engine method on every
   compressed group).
3. **Watch** the agreed step walls (:mod:`lightning_gc.auto.walls`, :mod:`lightning_gc.auto.drift`):
   a window that drifted, a few steps off by ``severe_drift``, a dense step that fell, or the periodic
   look at the link re-decides; so do the candidates' errors measured again (``gain_every``).
4. **Calibrate**: a method's first window on a link sets its correction (measured step minus the raw
   model's), and the choice is made again among measured methods, exploring at most ``explore``
   unmeasured ones the model still favours, and trying a close dense sibling for one window
   (:func:`lightning_gc.auto.policy.calibration_next`).

Everything a decision used is in :attr:`AutoChooser.history` (replicated, checkpointed, logged).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from ..comm.direct import DIRECT_MAX_RANKS, backend_allows
from ..compressors import GroupContext
from ..engine import dense_stop
from ..engine.agreement import agree_values
from ..engine.dense_stop import LinkCanary
from ..engine.ports import MethodControl
from ..engine.session import StepParticipant
from . import drift, policy, record
from .candidates import AutoCandidate, candidate, time_method_codec
from .config import AutoConfig
from .look import LinkIO, LookRequest, look
from .measure import (
    check_agreed,
    decision_figures,
    early_figures,
    group_sample,
    measure_costs,
    profile_entry,
    remeasure_errors,
    workload_from_profile,
)
from .model import MethodCost, Workload, calibrate_other, choose_measured, compute_shift, efficiency
from .policy import Trigger
from .state import AutoState
from .walls import StepWalls


def _state_attr(name: str, doc: str) -> Any:
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v), doc=doc)


class AutoChooser(StepParticipant):
    """Profiles, measures, chooses and re-chooses the method (see the module docstring)."""

    name = "auto"
    state_scope = "replicated"

    chosen = _state_attr("chosen", "The method running now (None before the first decision).")
    history = _state_attr("history", "Every decision: step, trigger, inputs, predictions, choice.")
    workload = _state_attr("workload", "The profiled workload (agreed).")
    costs = _state_attr("costs", "Every candidate's measured costs (agreed).")
    network = _state_attr("network", "The network model of the last decision (agreed).")
    predictions = _state_attr("predictions", "The last decision's predictions.")
    gain_checks = _state_attr("gain_checks", "Every re-measurement of the candidates' errors.")
    probe_bytes = _state_attr("probe_bytes", "The last bandwidth probe's large message (bytes).")
    probe_time_s = _state_attr("probe_time_s", "That message's agreed time: the link check's reference.")
    probe_time_modelled = _state_attr("probe_time_modelled", "Whether probe_time_s is modelled, not timed.")
    beta_scale = _state_attr("beta_scale", "Every probe's β is multiplied by this (the warm-up's calibration).")

    def __init__(self, engine: MethodControl, config: AutoConfig, module: torch.nn.Module,
                 named_parameters: list[tuple[str, Tensor]]) -> None:
        self.engine, self.config = engine, config
        self.candidates: list[AutoCandidate] = [candidate(c) for c in config.candidates]
        self._dense_names = frozenset(c.name for c in self.candidates if c.compressor is None)
        self.params = [p for _, p in named_parameters]
        self.names = [n for n, _ in named_parameters]
        # a warm-up of at most skip_steps + profile_steps was raised for auto (GCConfig): the early path may
        # shorten it to 1 (DDP's bucket rebuild); a longer one was asked for and is kept
        w = int(engine.config.warmup_steps)
        self._configured_warmup = w if w > config.dense_steps_needed else 1
        engine.raise_warmup_steps(config.dense_steps_needed)
        #: no group to compress (every tensor below min_compress_numel): auto runs DDP's path, measures nothing
        self.nothing_to_compress = not any(not g.exact for g in engine.plan.groups)
        # a dense mode's wall is agreed at once by a direct exchange where the group allows one, else it rides
        # in the next step's first gradient bucket; a compressed step's rides in its closing report
        self._dense_walls_direct = (1 < engine.world_size <= DIRECT_MAX_RANKS and dist.is_available()
                                    and dist.is_initialized() and backend_allows(engine.process_group)
                                    and not self.nothing_to_compress)
        if not self._dense_walls_direct and not self.nothing_to_compress:
            engine.enable_dense_carry()
        # not under a pinned network: a fall could not re-read the link, and every dense step would stop
        pinned = bool(engine.network.pinned and engine.network.model is not None)
        direct = self._dense_walls_direct and not pinned
        #: the link canary before each dense step (AutoConfig.canary_bytes; None: off)
        self.canary = config.canary() if direct and engine.plan_sends_every_param else None
        #: one canary message before a gain or calibration decision leaves a compressed method for a dense mode
        self._switch_check = (self.canary or LinkCanary()) if direct else None
        if self.canary is not None:
            engine.enable_canary(self.canary)
        self.state = AutoState(config.probe_every, config.gain_every, config.explore)
        self.walls = StepWalls()
        self._profile: list[dict] = []
        self._handles: list[Any] = []
        #: this rank's local gradients of a sampled step (parameter index -> copy), None when none is sampled
        self._sample: dict[int, Tensor] | None = None
        self._sample_handles: list[Any] = []
        if engine.world_size > 1 and not self.nothing_to_compress:
            self._sample = {}
            self._handles = [p.register_post_accumulate_grad_hook(self._stamp(i)) for i, p in enumerate(self.params)]
            self._handles.append(module.register_forward_hook(self._on_forward))

    @property
    def measured(self) -> list[float]:
        """This rank's step walls since the first decision."""
        return self.walls.measured

    @property
    def in_family_trial(self) -> bool:
        """Whether a dense sibling is running its one window."""
        return bool(self.history) and self.history[-1]["trigger"] == Trigger.FAMILY

    @property
    def in_trial(self) -> bool:
        """Whether the running method is on trial, its window not measured yet (:func:`policy.in_trial`)."""
        return policy.in_trial(self.history, self.chosen, self._valid())

    # ------------------------------------------------------------------ timing (autograd / main thread)
    def _stamp(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self.walls.stamps[i] = time.perf_counter()  # before the copy: the copy is not backward's time
            self._keep(i, param)
        return hook

    def _keep(self, i: int, param: Tensor) -> None:
        """Copy this rank's own gradient of a sampled step (before DDP's reducer touches it; under
        gradient accumulation the last micro-batch's copy holds the full sum)."""
        if self._sample is not None and param.grad is not None:
            self._sample[i] = param.grad.detach().clone()

    def _arm_sample(self) -> None:
        self._disarm_sample()
        self._sample = {}
        self._sample_handles = [p.register_post_accumulate_grad_hook(lambda param, i=i: self._keep(i, param))
                                for i, p in enumerate(self.params)]

    def _disarm_sample(self) -> dict[int, Tensor] | None:
        sample, self._sample = self._sample, None
        for h in self._sample_handles:
            h.remove()
        self._sample_handles = []
        return sample

    def _on_forward(self, *_: Any) -> None:
        self.walls.t_fwd = time.perf_counter()

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            if self._dense_walls_direct and self.canary is not None and self._dense_mode_runs():
                self.engine.sing_canary(math.nan)  # on the engine's worker: the step's buckets wait behind it
            self.walls.begin()
            out = closure()
            self.walls.t_closure_end = time.perf_counter()
            return out
        return timed

    # ------------------------------------------------------------------ the participant's lifecycle hooks
    def pause_walls(self) -> None:
        """Time until :meth:`resume_walls` (validation, its checkpoint) is not a training step's."""
        self.walls.pause()

    def resume_walls(self) -> None:
        self.walls.resume()

    def mark_wall(self) -> None:
        """The step now running may hold time that is not a training step's (an epoch's first batch, a
        checkpoint saved before it): the one-step test leaves it out. Every rank alike."""
        self.walls.marked.add(int(self.engine.step))

    def on_validation_start(self) -> None:
        self.pause_walls()

    def on_validation_end(self) -> None:
        self.resume_walls()

    def on_train_batch_start(self, batch_idx: int) -> None:
        if batch_idx == 0:
            self.mark_wall()

    def on_checkpoint_saved(self) -> None:
        self.mark_wall()

    # ------------------------------------------------------------------ step boundary
    def after_optimizer_step(self) -> None:
        engine, w = self.engine, self.walls
        t_end, wall = w.end_step()
        if engine.world_size == 1:
            return
        step = engine.step - 1  # the step that just finished
        if self.nothing_to_compress:
            if self.chosen is None:
                self._run_dense_only(step)
            return
        if self.chosen is None:
            self._profile_step(step, t_end, wall)
            return
        stats = engine.last_step
        if stats is not None and stats.step == step and stats.dense_stopped:
            self._read_carried()  # the step before's wall (agreed at its end)
            self._on_dense_stop(step, stats)
            return
        if wall is not None:  # None on the first step after a resume
            w.measured.append(wall)
            w.window.append(wall)
        self._read_carried()
        if self._sample_handles:  # this step was sampled: measure the errors again
            self._check_gain(step, self._disarm_sample() or {})
            w.restart()
        elif len(w.window) >= self.config.window:
            self._check_drift(step)
            w.restart()
        if wall is not None:
            self._watch_step(step, wall)
        if drift.gain_due(step, self.state.gain_interval, self.config, bool(self.gain_checks),
                          self.state.last_gain_step, self.in_trial):
            self._arm_sample()

    def _profile_step(self, step: int, t_end: float, wall: float | None) -> None:
        cfg, w, engine = self.config, self.walls, self.engine
        complete = len(w.stamps) == len(self.params)
        entry = lambda wall_s: profile_entry(w.stamps, w.t_start, w.t_fwd, w.t_closure_end, t_end, wall_s)  # noqa: E731
        if step >= cfg.skip_steps and wall is not None and complete:
            self._profile.append(entry(wall))
        elif step < cfg.skip_steps and step + 1 >= self._configured_warmup and self._early(t_end, complete):
            self._profile = [entry(t_end - w.t_start)]  # the skipped step waited mostly on the network
            engine.shorten_warmup_steps(step + 1)
        if len(self._profile) >= cfg.profile_steps or not engine.step_is_dense():
            self._first_decision(step)
            w.restart()  # the measurement is not a step

    def _early(self, t_end: float, complete: bool) -> bool:
        """Whether a skipped dense step waited on the network at least ``early_comm_ratio`` times the
        rest of it, on the slowest rank (agreed: every rank takes the same path)."""
        ratio, w = self.config.early_comm_ratio, self.walls
        if not ratio:
            return False
        exposed, rest, missing = agree_values(early_figures(w.stamps, complete, w.t_start, w.t_closure_end, t_end),
                                              "max", self.engine.process_group, self.engine.device)
        return not missing and exposed > 0.0 and exposed >= ratio * rest

    def _run_dense_only(self, step: int) -> None:
        rank_zero_warn(f"lightning_gc auto: the plan has no tensor to compress (every one is below min_compress_numel="
                       f"{self.engine.config.min_compress_numel} elements), so auto runs DDP's dense path from step "
                       f"{step + 1} on. Lower min_compress_numel to let it choose among methods.")
        self.chosen = "ddp"
        self._apply("ddp")

    def _on_dense_stop(self, step: int, stats: Any) -> None:
        """The canary before dense step ``step`` saw the link fall and the step stopped (its gradient is
        error memory): re-decide now whatever ``min_interval`` says, β from the canary's message."""
        fastest, predicted = stats.dense_check_s, stats.dense_check_predicted_s
        rank_zero_info(f"lightning_gc auto: the link canary before step {step} under {self.chosen!r} took "
                       f"{1e3 * fastest:.1f} ms on the fastest rank (twice), {1e3 * predicted:.2f} ms on the network "
                       "model: the link fell, the step kept its gradient as error memory; re-deciding")
        self._disarm_sample()
        self._decide(step, Trigger.DRIFT, probe=True, check_link=False, canary_s=fastest, detail="canary")
        self.walls.restart()

    # ------------------------------------------------------------------ walls and drift
    def _read_carried(self) -> None:
        self.walls.read_pending(self.state.last_decision_step, self.config.severe_steps, self.config.window)

    def _agree_wall_later(self, step: int, wall: float) -> Callable[[], float | None]:
        """Agree step ``step``'s wall: now by a direct exchange under a dense mode that allows one, else
        carried in the next step's messages (``GCEngine.carry_wall``), read at that step's end."""
        engine = self.engine
        if self._dense_agreed_now():
            value = agree_values([wall], "mean", engine.process_group, engine.device)[0]
            return lambda: value
        engine.carry_wall(wall)

        def carried() -> float | None:
            stats = engine.last_step
            return stats.carried_wall_mean_s if stats is not None and stats.step == step + 1 else None
        return carried

    def _dense_mode_runs(self) -> bool:
        return self.chosen is not None and candidate(self.chosen).compressor is None

    def _dense_agreed_now(self) -> bool:
        return self._dense_walls_direct and self._dense_mode_runs()

    def _calibrated(self) -> float | None:
        return drift.calibrated_prediction(self.chosen, self.history, self.predictions, policy.windowed(self.history))

    def _watch_step(self, step: int, wall: float) -> None:
        """Carry this step's wall, and run the every-step severe tests (not on a decision's step)."""
        w, st, cfg = self.walls, self.state, self.config
        if st.last_decision_step == step:
            if w.pending is None:  # carried all the same: the next window reads it
                w.pending = (step, self._agree_wall_later(step, wall))
            return
        self._read_carried()
        w.pending = (step, self._agree_wall_later(step, wall))
        if self._dense_agreed_now():  # agreed already: this step's wall enters the tests now
            self._read_carried()
        n, sv = cfg.severe_steps, cfg.severe_drift
        if not n or not sv:
            return
        stats = self.engine.last_step
        if not self._dense_mode_runs() and stats is not None and not stats.dense \
                and stats.exchange_comm_mean_s is not None:  # agreed by the step's closing report
            at = step if stats.exchange_comm_mean_step is None else stats.exchange_comm_mean_step
            w.add_exchange(stats.exchange_comm_mean_s, at, st.last_decision_step, n)
        if drift.severe_held(st.history, step, cfg.min_interval):
            return
        one = self._dense_mode_runs() and w.recent_step not in w.marked
        v = drift.severe_verdict(w.recent, st.reference, self._calibrated(), cfg, one, w.recent_exchange,
                                 st.reference_exchange, label=f"({w.recent_step}) under {self.chosen!r} ")
        if v is None:
            return
        rank_zero_info(f"lightning_gc auto: {v.what} (at least {sv:g}x apart): re-deciding")
        self._decide(step, Trigger.DRIFT, probe=True, check_link=v.test == "exchange", drift_wall_s=v.wall_s,
                     detail=v.test)
        w.restart()

    def _check_drift(self, step: int) -> None:
        """A full window: the first after a decision settles, the next is the reference (and calibrates),
        later ones are compared with it (:func:`drift.window_action`)."""
        st, w, cfg = self.state, self.walls, self.config
        window_exchange, w.window_exchange = w.window_exchange, []
        if st.settling:  # the first window after a decision holds the switch itself
            st.settling, w.window = False, []
            return
        engine = self.engine
        med = w.window_median(step, lambda v: agree_values([v], "max", engine.process_group, engine.device)[0])
        w.window = []
        held = drift.severe_held(st.history, step, cfg.min_interval)
        if st.reference is None:
            self._reference_window(step, med, window_exchange, held)
            return
        st.drifted, action, why = drift.window_action(med, st.reference, st.drifted, step, st.last_decision_step,
                                                      st.last_link_step, st.link_interval, held, cfg)
        st.run_medians.append(med)
        if action == "periodic":
            self._decide(step, Trigger.PERIODIC, probe=True)
        elif action is not None:
            rank_zero_info(f"lightning_gc auto: step {1e3 * med:.1f} ms vs {1e3 * st.reference:.1f} ms after the last "
                           f"decision ({why}): re-deciding")
            # a severe window: the link most likely moved, and a check would only add its message to the probe
            self._decide(step, Trigger.DRIFT, probe=True, check_link=action == "window", drift_wall_s=med, detail=action)

    def _reference_window(self, step: int, med: float, window_exchange: list[float], held: bool) -> None:
        st, n = self.state, self.config.severe_steps
        if drift.link_moved([med], self._calibrated(), self.config.severe_drift):
            # not a reference: a window measured across a link change would hide it from every later one
            if not held:
                rank_zero_info(f"lightning_gc auto: {self.chosen!r} ran {1e3 * med:.1f} ms, predicted "
                               f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms from its own measured "
                               f"step on this link: the link moved, re-deciding")
                self._decide(step, Trigger.DRIFT, probe=True, check_link=False, drift_wall_s=med,
                             detail="reference_window")
            return
        st.reference, st.run_medians = med, [med]
        # the fastest exchange, not the median: a small exchange on a steady shaped link has two modes
        st.reference_exchange = min(window_exchange) if n and len(window_exchange) >= n else None
        if st.history:
            st.history[-1]["measured_step_s"] = med
        self._calibrate(step, med)

    def _calibrate(self, step: int, measured_s: float) -> None:
        """The reference window sets the running method's correction, tagged with its network; then the
        choice may be made again at once (:func:`policy.calibration_next`)."""
        st, chosen = self.state, self.chosen
        assert chosen is not None and st.network is not None
        was_valid = chosen in self._valid()
        raw = st.predictions[chosen].step_s - policy.overhead_in(st.history[-1], chosen)
        st.corrections[chosen] = measured_s - raw
        st.correction_beta[chosen] = st.network.beta_s_per_byte
        dense = [c for c in self.config.candidates if c in self._dense_names]
        nxt = policy.calibration_next(chosen, raw, measured_s, was_valid, st.history, st.predictions, self._valid(),
                                      dense, self.config.family_margin)
        if nxt is not None:
            self._decide(step, nxt[0], probe=False, force=nxt[1])

    # ------------------------------------------------------------------ measurement
    def _first_decision(self, step: int) -> None:
        engine = self.engine
        engine.synchronize()
        self._remove_hooks()
        if not self._profile:
            raise RuntimeError(
                "lightning_gc auto: no dense step could be profiled (every gradient must reach backward on every "
                "step); pass find_unused_parameters=False models, or raise auto_profile_steps/warmup_steps.")
        self.workload, wall, exposed = workload_from_profile(self._profile, [p.numel() for p in self.params],
                                                             engine.process_group, engine.device)
        self.costs = measure_costs(self.candidates, self._group_sample(self._disarm_sample() or {}),
                                   engine.world_size, self.config.repeats, self.config.time_codecs == "upfront",
                                   engine.process_group, engine.device)
        self.state.last_gain_step = step
        self._decide(step, Trigger.WARMUP, probe=True, dense_wall_s=wall, dense_exposed_s=exposed)

    def _group_sample(self, grads: dict[int, Tensor]) -> tuple[Tensor, GroupContext, float]:
        return group_sample(self.engine, self.params, grads)

    def _live_sample(self) -> tuple[Tensor, GroupContext, float]:
        return self._group_sample({i: p.grad for i, p in enumerate(self.params) if p.grad is not None})

    def _time_codecs(self, names: Collection[str], sample: tuple[Tensor, GroupContext, float]) -> None:
        """Time the untimed codecs among ``names`` on ``sample`` (a codec's time depends on the sizes, not
        the values), agree the MAX and store it. Every rank alike: the caller's need is agreed."""
        engine, costs = self.engine, self.costs
        assert costs is not None
        untimed = [k for k, c in enumerate(costs) if not c.codec_timed and c.name in names]
        if not untimed:
            return
        flat, ctx, _ = sample
        by_name = {c.name: c for c in self.candidates}
        local = [time_method_codec(by_name[costs[k].name], flat, ctx, engine.world_size, self.config.repeats)
                 for k in untimed]
        for k, s in zip(untimed, agree_values(local, "max", engine.process_group, engine.device)):
            costs[k] = replace(costs[k], codec_s=float(s), codec_timed=True)

    def _valid(self) -> dict[str, float]:
        st = self.state
        return policy.valid_corrections(st.corrections, st.correction_beta, st.network)

    def _model_inputs(self) -> tuple[dict[str, float], list[str], list[str], float]:
        """The valid corrections, the methods settled on this link, the compute shift's basis and the shift."""
        valid, windowed = self._valid(), policy.windowed(self.history)
        settled = sorted(windowed & set(valid))
        shift_from = policy.shift_basis(windowed, settled, self.state.corrections, self._dense_names)
        shift = (compute_shift([self.state.corrections[m] for m in shift_from]) if self.config.compute_shift
                 else 0.0)
        return valid, settled, shift_from, shift

    def _check_gain(self, step: int, grads: dict[int, Tensor]) -> None:
        """Measure the candidates' errors again (:func:`remeasure_errors`) and re-decide (``gain``, no
        probe) if some candidate's progress per step moved by more than ``gain_drift``."""
        engine, cfg, st = self.engine, self.config, self.state
        assert st.costs is not None and st.workload is not None and st.network is not None
        ws, w = engine.world_size, cfg.progress_weight
        valid, settled, _, shift = self._model_inputs()
        _, preds = choose_measured(st.costs, valid, st.workload, st.network, ws, w, shift_s=shift, settled=settled)
        step_s = [preds[c.name].step_s for c in st.costs]
        errors, bound = remeasure_errors(self.candidates, st.costs, step_s, self.chosen, self._group_sample(grads), ws,
                                         w, f"the errors' re-measurement at step {step}", engine.process_group,
                                         engine.device)
        names = [c.name for c in st.costs]
        moved = max((abs(efficiency(replace(st.costs[k], delta2=d2), ws, w) - efficiency(st.costs[k], ws, w))
                     / efficiency(st.costs[k], ws, w) for k, d2 in errors.items()), default=0.0)
        act = moved > cfg.gain_drift
        entry = {"step": step, "delta2": {names[k]: errors[k] for k in sorted(errors)}, "moved": moved,
                 "redecided": act, "skipped": [n for k, n in enumerate(names) if k not in errors], "bound_s": bound}
        st.gain_checks.append(entry)
        st.last_gain_step, running = step, self.chosen
        if act:
            st.costs = [replace(c, delta2=errors[k]) if k in errors else c for k, c in enumerate(st.costs)]
            rank_zero_info(f"lightning_gc auto: the candidates' errors moved (progress per step by up to "
                           f"{100 * moved:.0f}%): re-deciding")
            self._decide(step, Trigger.GAIN, probe=False)
        # the pick stood: look again twice as late (gain_every_max); a switch starts from gain_every
        stood = self.chosen == running and bool(cfg.gain_every_max)
        cap = max(cfg.gain_every_max, cfg.gain_every)
        st.gain_interval = min(2 * st.gain_interval, cap) if stood else cfg.gain_every
        entry["next_interval"] = st.gain_interval

    # ------------------------------------------------------------------ decision
    def _decide(self, step: int, trigger: Trigger | str, probe: bool, dense_wall_s: float | None = None,
                force: str | None = None, dense_exposed_s: float | None = None, check_link: bool = True,
                drift_wall_s: float | None = None, detail: str | None = None,
                canary_s: float | None = None) -> None:
        """Look at the link as asked, decide (:func:`policy.decide`), apply, and record the decision."""
        st, engine, trigger = self.state, self.engine, Trigger(trigger)
        assert st.workload is not None and st.costs is not None
        t0, parts = time.perf_counter(), dict.fromkeys(record.DECIDE_PARTS, 0.0)

        def timed(part: str, fn: Callable[..., Any], *args: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args)
            parts[part] += time.perf_counter() - start
            return out

        engine.synchronize()
        source, link_check = self._look(LookRequest(probe, check_link, dense_wall_s, dense_exposed_s, drift_wall_s,
                                                    canary_s), timed)
        if dense_wall_s is not None:
            self._calibrate_other(dense_wall_s)
        running = policy.running_correction(trigger, source, self.chosen, st.corrections, st.run_medians,
                                            self.history, self.predictions)
        if running is not None:
            st.corrections[self.chosen] = running[1]  # type: ignore[index]
        valid, settled, shift_from, shift = self._model_inputs()
        assert st.network is not None
        check_agreed(decision_figures(st.costs, st.workload, st.network, shift, st.explore_left, valid,
                                      (dense_wall_s, drift_wall_s)),
                     f"the {trigger.value} decision at step {step}", engine.process_group, engine.device)
        d = policy.decide(policy.DecisionInputs(
            trigger, tuple(st.costs), st.workload, st.network, engine.world_size, self.config, valid, tuple(settled),
            shift, self.chosen, st.explore_left, force, self.in_family_trial,
            self.history[-1].get("previous") if self.history else None), self._codec_timer(timed))
        st.explore_left = d.explore_left
        switch_check = self._switch_check_fell(step, trigger, probe, canary_s, d.chosen, timed)
        if switch_check is not None and switch_check["fell"]:
            return
        kept = self._adopt(step, trigger, d.chosen, d.predictions, source, probe or dense_wall_s is not None)
        ctx = record.Context(source, link_check, dense_wall_s, dense_exposed_s, valid, settled, shift, shift_from,
                             None if running is None else running[0], detail, switch_check, kept)
        entry = record.entry(step, trigger, d, ctx, st, self._dense_names)
        # the slowest rank's times, like every other figure here (one agreement for all)
        took = agree_values([time.perf_counter() - t0] + [parts[k] for k in record.DECIDE_PARTS], "max",
                            engine.process_group, engine.device)
        entry["decide_s"], entry["decide_parts_s"] = took[0], dict(zip(record.DECIDE_PARTS, took[1:]))
        st.history.append(entry)
        rank_zero_info(f"lightning_gc auto (step {step}): {entry['sentence']}")
        rank_zero_info(record.log_text(step, trigger, d, ctx, st, self.config))

    def _look(self, req: LookRequest, timed: Callable[..., Any]) -> tuple[str, dict | None]:
        engine, st = self.engine, self.state
        assert st.workload is not None and st.costs is not None
        net = engine.network
        pinned = net.model if net.pinned and net.model is not None else None
        running = next(c for c in st.costs if c.name == self.chosen) if self._dense_mode_runs() else None
        fall = self.canary or self._switch_check
        io = LinkIO(engine.process_group, engine.device, engine.world_size, 4 * sum(p.numel() for p in self.params))
        out = look(st, req, io, self.config, st.workload, st.costs, running, pinned,
                   None if fall is None else fall.nbytes, timed)
        if not net.pinned:
            engine.adopt_network(st.network)  # AR-Topk's per-step choice uses it; auto owns re-probing
        return out

    def _calibrate_other(self, dense_wall_s: float) -> None:
        """The warm-up's profiled DDP step: ``other_s`` makes the model's DDP step its wall, so ``ddp`` is
        measured (correction 0) on this network."""
        st = self.state
        assert st.workload is not None and st.costs is not None and st.network is not None
        ddp = next(c for c in st.costs if c.name == "ddp")
        w = st.workload
        other = calibrate_other(dense_wall_s, w, ddp, st.network, self.engine.world_size)
        st.workload = Workload(w.forward_s, w.backward_s, w.numels, w.optimizer_s, other)
        st.corrections.setdefault("ddp", 0.0)
        st.correction_beta.setdefault("ddp", st.network.beta_s_per_byte)

    def _codec_timer(self, timed: Callable[..., Any]) -> Callable[[str], list[MethodCost]]:
        """The policy's ``time_codec``: times one codec on the live gradient (sampled once per decision)."""
        sample: list[tuple[Tensor, GroupContext, float]] = []

        def time_codec(name: str) -> list[MethodCost]:
            if not sample:
                sample.append(timed("codecs", self._live_sample))
            timed("codecs", self._time_codecs, [name], sample[0])
            assert self.costs is not None
            return self.costs
        return time_codec

    def _switch_check_fell(self, step: int, trigger: Trigger, probe: bool, canary_s: float | None, best: str,
                           timed: Callable[..., Any]) -> dict | None:
        """Before a decision that did not look at the link leaves a compressed method for a dense mode, one
        canary message (:func:`policy.needs_switch_check`); on a fall, re-decide on the fallen link
        instead. Returns the check's record (None: no check)."""
        check = self._switch_check
        if check is None or not policy.needs_switch_check(trigger, probe, canary_s is not None,
                                                          self.network is not None, self.chosen, best,
                                                          self._dense_names):
            return None
        engine = self.engine
        res = timed("check", dense_stop.sing, check, math.nan, self.network, engine.exchange_group,
                    engine.world_size, engine.device)
        out = {"fell": res.fell, "fastest_s": res.fastest_s, "predicted_s": res.predicted_s,
               "messages": res.messages, "bytes": check.nbytes}
        if res.fell:
            rank_zero_info(f"lightning_gc auto: before leaving {self.chosen!r} for {best!r} ({trigger.value}), one "
                           f"{check.nbytes} B message per rank took {1e3 * res.fastest_s:.1f} ms on the fastest rank "
                           f"(twice), {1e3 * (res.predicted_s or 0.0):.2f} ms on the network model: the link fell, "
                           "re-deciding on it")
            self._decide(step, Trigger.DRIFT, probe=True, check_link=False, canary_s=res.fastest_s,
                         detail="switch_check")
            if self.history:
                self.history[-1]["switch_check"] = out
        return out

    def _adopt(self, step: int, trigger: Trigger, best: str, preds: dict, source: str, looked: bool) -> bool:
        """Apply the pick and move the bookkeeping on; returns whether the running method's drift references
        were kept (:func:`policy.keeps_reference`)."""
        st, cfg = self.state, self.config
        previous = st.chosen
        if best != previous:
            self._apply(best)
            st.gain_interval = cfg.gain_every  # a new method: its errors looked at as often as at first
        st.chosen, st.predictions = best, preds
        kept = policy.keeps_reference(trigger, source, best, previous, st.reference is not None)
        if not kept:
            st.forget_references()
            self.walls.forget()
        st.last_decision_step = step
        if looked:
            st.last_link_step = step
            st.link_interval = policy.next_link_interval(trigger, source, best, previous, st.link_interval,
                                                         cfg.probe_every, cfg.probe_every_max)
        return kept

    def _apply(self, name: str) -> None:
        engine, cand = self.engine, candidate(name)
        if cand.compressor is None:
            engine.set_dense_mode(cand.dense_mode)
            return
        for g in engine.plan.groups:
            if not g.exact:
                engine.set_group_method(g.gid, cand.spec())
        engine.set_dense_mode(None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return self.state.state_dict(bool(self._sample_handles), int(self.engine.config.warmup_steps))

    def load_state_dict(self, state: dict) -> None:
        st, engine = self.state, self.engine
        st.load(state)
        if st.network is not None and not engine.network.pinned:
            engine.adopt_network(st.network)
        if st.chosen is not None and state.get("warmup_steps") is not None:  # an early end of the warm-up
            engine.shorten_warmup_steps(int(state["warmup_steps"]))
        self.walls.forget_process()
        if st.chosen is not None:
            self._remove_hooks()
            self._disarm_sample()
            if state.get("sampling"):  # saved between arming a sampled step and measuring it
                self._arm_sample()

    def close(self, timeout: float = 60.0) -> None:
        self._remove_hooks()
        self._disarm_sample()
        if self.walls.pending is not None:  # every rank issued it: wait, so no collective is left in flight
            self.walls.pending[1]()
            self.walls.pending = None
