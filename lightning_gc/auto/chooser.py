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
5. **Switch families** (``auto_diloco``, :mod:`lightning_gc.auto.sync_switch`): where DiLoCo could
   run much faster per step, a trial on the training loss decides between it and the per-step method.

Everything a decision used is in :attr:`AutoChooser.history` (replicated, checkpointed, logged).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from ..comm.direct import DIRECT_MAX_RANKS, backend_allows
from ..engine.agreement import agree_values
from ..engine.ports import MethodControl, SyncFamilyControl
from ..engine.session import StepParticipant
from . import drift, measure, policy
from .canary import CanaryJob, LinkCanary
from .candidates import AutoCandidate, candidate
from .config import AutoConfig
from .decider import Decider
from .model import choose_measured
from .policy import Trigger
from .state import AutoState, state_attr
from .sync_switch import FamilySwitcher
from .walls import StepWalls


class AutoChooser(StepParticipant):
    """Profiles, measures, chooses and re-chooses the method (see the module docstring)."""

    name = "auto"
    state_scope = "replicated"

    chosen = state_attr("chosen", "The method running now (None before the first decision).")
    history = state_attr("history", "Every decision: step, trigger, inputs, predictions, choice.")
    workload = state_attr("workload", "The profiled workload (agreed).")
    costs = state_attr("costs", "Every candidate's measured costs (agreed).")
    network = state_attr("network", "The network model of the last decision (agreed).")
    predictions = state_attr("predictions", "The last decision's predictions.")
    gain_checks = state_attr("gain_checks", "Every re-measurement of the candidates' errors.")
    probe_bytes = state_attr("probe_bytes", "The last bandwidth probe's large message (bytes).")
    probe_time_s = state_attr("probe_time_s", "That message's agreed time: the link check's reference.")
    probe_time_modelled = state_attr("probe_time_modelled", "Whether probe_time_s is modelled, not timed.")
    beta_scale = state_attr("beta_scale", "Every probe's β is multiplied by this (the warm-up's calibration).")

    def __init__(self, engine: MethodControl, config: AutoConfig, module: torch.nn.Module,
                 named_parameters: list[tuple[str, Tensor]], sync: SyncFamilyControl | None = None) -> None:
        self.engine, self.config = engine, config
        self.candidates: list[AutoCandidate] = [candidate(c) for c in config.candidates]
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
        canary = config.canary() if direct and engine.plan_sends_every_param else None
        self.state = AutoState(config.probe_every, config.gain_every, config.explore, schedule=engine.link.schedule)
        self.walls = StepWalls()
        self.decider = Decider(engine, config, self.state, self.walls, self.candidates, self.params, canary,
                               (canary or LinkCanary()) if direct else None)
        self._profile: list[dict] = []
        self.tap = measure.GradientTap(self.params, self.walls)
        if engine.world_size > 1 and not self.nothing_to_compress:
            self.tap.start(module)
        #: per-step ⇄ DiLoCo (auto_diloco); ``sync``: the dormant DiLoCo participant the assembly built
        self.families = (FamilySwitcher(engine, config, self.state, sync, self._after_leaving)
                         if config.diloco and sync is not None and not self.nothing_to_compress else None)

    @property
    def sync_events(self) -> list[dict]:
        """Every family trial, verdict, entry into DiLoCo and exit from it (``auto_diloco``; replicated)."""
        return self.state.sync["events"]

    @property
    def measured(self) -> list[float]:
        """This rank's step walls since the first decision."""
        return self.walls.measured

    @property
    def canary(self) -> LinkCanary | None:
        """The link canary before each dense step (``AutoConfig.canary_bytes``; None: off)."""
        return self.decider.canary

    @canary.setter
    def canary(self, value: LinkCanary | None) -> None:
        self.decider.canary = value

    @property
    def in_family_trial(self) -> bool:
        """Whether a dense sibling is running its one window."""
        return self.decider.in_family_trial

    @property
    def in_trial(self) -> bool:
        """Whether the running method is on trial, its window not measured yet (:func:`policy.in_trial`)."""
        return policy.in_trial(self.history, self.chosen, self.decider.valid())

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            if self._dense_walls_direct and self.canary is not None and self._dense_mode_runs() \
                    and not (self.families is not None and self.families.in_diloco):
                engine = self.engine  # nothing carried: the step before's wall was agreed at its end
                engine.run_before_step(CanaryJob(self.canary, math.nan, engine.network.model, engine.exchange_group,
                                                  engine.world_size, engine.device))
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

    def before_optimizer_step(self, loss: Any) -> bool:
        if self.families is not None:
            self.families.note_loss(loss)
        return False

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
        if self.families is not None and self.families.in_diloco:
            engine.count_local_step()  # DiLoCo's inner step: the hook did not run
        step = engine.step - 1  # the step that just finished
        if self.nothing_to_compress:
            if self.chosen is None:
                self._run_dense_only(step)
            return
        if self.chosen is None:
            self._profile_step(step, t_end, wall)
            return
        if self.families is not None and self.families.after_step(
                step, t_end - w.t_start if wall is None else wall, self.in_trial or self.in_family_trial):
            self._hold_per_step()  # DiLoCo ran this step, or the family changed at its end
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
        if self.tap.armed:  # this step was sampled: measure the errors again
            self._check_gain(step, self.tap.disarm() or {})
            w.restart()
        elif len(w.window) >= self.config.window:
            self._check_drift(step)
            w.restart()
        if wall is not None:
            self._watch_step(step, wall)
        if drift.gain_due(step, self.state.gain_interval, self.config, bool(self.gain_checks),
                          self.state.last_gain_step, self.in_trial):
            self.tap.arm()

    def _hold_per_step(self) -> None:
        """The per-step watch does not see DiLoCo's steps: no wall carried or sampled, windows anew."""
        self.walls.pending = None
        self.walls.forget()
        self.tap.disarm()
        self.walls.restart()

    def _after_leaving(self, step: int) -> None:
        """DiLoCo's outer exchange showed the link moved: decide per-step again on a fresh probe."""
        self.decider.decide(step, Trigger.DRIFT, probe=True, check_link=False, detail="diloco_exchange")

    def _profile_step(self, step: int, t_end: float, wall: float | None) -> None:
        cfg, w, engine = self.config, self.walls, self.engine
        complete = len(w.stamps) == len(self.params)
        entry = lambda wall_s: measure.profile_entry(w.stamps, w.t_start, w.t_fwd, w.t_closure_end, t_end, wall_s)  # noqa: E731
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
        exposed, rest, missing = agree_values(measure.early_figures(w.stamps, complete, w.t_start, w.t_closure_end, t_end),
                                              "max", self.engine.process_group, self.engine.device)
        return not missing and exposed > 0.0 and exposed >= ratio * rest

    def _run_dense_only(self, step: int) -> None:
        rank_zero_warn(f"lightning_gc auto: the plan has no tensor to compress (every one is below min_compress_numel="
                       f"{self.engine.config.min_compress_numel} elements), so auto runs DDP's dense path from step "
                       f"{step + 1} on. Lower min_compress_numel to let it choose among methods.")
        self.chosen = "ddp"
        self.decider.apply("ddp")

    def _on_dense_stop(self, step: int, stats: Any) -> None:
        """The canary before dense step ``step`` saw the link fall and the step stopped (its gradient is
        error memory): re-decide now whatever ``min_interval`` says, β from the canary's message."""
        fastest, predicted = stats.dense_check_s, stats.dense_check_predicted_s
        rank_zero_info(f"lightning_gc auto: the link canary before step {step} under {self.chosen!r} took "
                       f"{1e3 * fastest:.1f} ms on the fastest rank (twice), {1e3 * predicted:.2f} ms on the network "
                       "model: the link fell, the step kept its gradient as error memory; re-deciding")
        self.tap.disarm()
        self.decider.decide(step, Trigger.DRIFT, probe=True, check_link=False, canary_s=fastest, detail="canary")
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
        self.decider.decide(step, Trigger.DRIFT, probe=True, check_link=v.test == "exchange", drift_wall_s=v.wall_s,
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
                                                      st.periodic_due(step), held, cfg)
        st.run_medians.append(med)
        if action == "periodic":
            self.decider.decide(step, Trigger.PERIODIC, probe=True)
        elif action is not None:
            rank_zero_info(f"lightning_gc auto: step {1e3 * med:.1f} ms vs {1e3 * st.reference:.1f} ms after the last "
                           f"decision ({why}): re-deciding")
            # a severe window: the link most likely moved, and a check would only add its message to the probe
            self.decider.decide(step, Trigger.DRIFT, probe=True, check_link=action == "window", drift_wall_s=med, detail=action)

    def _reference_window(self, step: int, med: float, window_exchange: list[float], held: bool) -> None:
        st, n = self.state, self.config.severe_steps
        if drift.link_moved([med], self._calibrated(), self.config.severe_drift):
            # not a reference: a window measured across a link change would hide it from every later one
            if not held:
                rank_zero_info(f"lightning_gc auto: {self.chosen!r} ran {1e3 * med:.1f} ms, predicted "
                               f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms from its own measured "
                               f"step on this link: the link moved, re-deciding")
                self.decider.decide(step, Trigger.DRIFT, probe=True, check_link=False, drift_wall_s=med,
                             detail="reference_window")
            return
        st.reference, st.run_medians = med, [med]
        # the fastest exchange, not the median: a small exchange on a steady shaped link has two modes
        st.reference_exchange = min(window_exchange) if n and len(window_exchange) >= n else None
        if st.history:
            st.history[-1]["measured_step_s"] = med
        self.decider.calibrate(step, med)

    # ------------------------------------------------------------------ measurement
    def _first_decision(self, step: int) -> None:
        engine = self.engine
        engine.synchronize()
        self.tap.stop_timing()
        if not self._profile:
            raise RuntimeError(
                "lightning_gc auto: no dense step could be profiled (every gradient must reach backward on every "
                "step); pass find_unused_parameters=False models, or raise auto_profile_steps/warmup_steps.")
        self.workload, wall, exposed = measure.workload_from_profile(self._profile, [p.numel() for p in self.params],
                                                             engine.process_group, engine.device)
        self.costs = measure.measure_costs(self.candidates, self.decider.group_sample(self.tap.disarm() or {}),
                                   engine.world_size, self.config.repeats, self.config.time_codecs == "upfront",
                                   engine.process_group, engine.device)
        self.state.last_gain_step = step
        self.decider.decide(step, Trigger.WARMUP, probe=True, dense_wall_s=wall, dense_exposed_s=exposed)

    def _check_gain(self, step: int, grads: dict[int, Tensor]) -> None:
        """Measure the candidates' errors again (:func:`remeasure_errors`) and re-decide (``gain``, no
        probe) if some candidate's progress per step moved by more than ``gain_drift``."""
        engine, cfg, st = self.engine, self.config, self.state
        assert st.costs is not None and st.workload is not None and st.network is not None
        ws, w = engine.world_size, cfg.progress_weight
        valid, settled, _, shift = self.decider.model_inputs()
        _, preds = choose_measured(st.costs, valid, st.workload, st.network, ws, w, shift_s=shift, settled=settled)
        step_s = [preds[c.name].step_s for c in st.costs]
        errors, bound = measure.remeasure_errors(self.candidates, st.costs, step_s, self.chosen,
                                                 self.decider.group_sample(grads), ws, w,
                                                 f"the errors' re-measurement at step {step}", engine.process_group,
                                                 engine.device)
        entry = measure.gain_check(step, st.costs, errors, bound, ws, w, cfg.gain_drift)
        moved, act = entry["moved"], entry["redecided"]
        st.gain_checks.append(entry)
        st.last_gain_step, running = step, self.chosen
        if act:
            st.costs = [replace(c, delta2=errors[k]) if k in errors else c for k, c in enumerate(st.costs)]
            rank_zero_info(f"lightning_gc auto: the candidates' errors moved (progress per step by up to "
                           f"{100 * moved:.0f}%): re-deciding")
            self.decider.decide(step, Trigger.GAIN, probe=False)
        # the pick stood: look again twice as late (gain_every_max); a switch starts from gain_every
        stood = self.chosen == running and bool(cfg.gain_every_max)
        cap = max(cfg.gain_every_max, cfg.gain_every)
        st.gain_interval = min(2 * st.gain_interval, cap) if stood else cfg.gain_every
        entry["next_interval"] = st.gain_interval

    # ------------------------------------------------------------------ decision
    def state_dict(self) -> dict:
        if self.families is not None:  # called on every rank (Session.state_dict)
            self.families.flush(self.engine.step - 1)
        return self.state.state_dict(bool(self.tap.armed), int(self.engine.config.warmup_steps))

    def load_state_dict(self, state: dict) -> None:
        st, engine = self.state, self.engine
        st.load(state)
        if self.families is not None:
            self.families.discard_pending()
        if st.network is not None and not engine.network.pinned:
            engine.adopt_network(st.network)
        if st.chosen is not None and state.get("warmup_steps") is not None:  # an early end of the warm-up
            engine.shorten_warmup_steps(int(state["warmup_steps"]))
        self.walls.forget_process()
        if st.chosen is not None:
            self.tap.stop_timing()
            self.tap.disarm()
            if state.get("sampling"):  # saved between arming a sampled step and measuring it
                self.tap.arm()

    def close(self, timeout: float = 60.0) -> None:
        self.tap.stop_timing()
        self.tap.disarm()
        if self.walls.pending is not None:  # every rank issued it: wait, so no collective is left in flight
            self.walls.pending[1]()
            self.walls.pending = None
