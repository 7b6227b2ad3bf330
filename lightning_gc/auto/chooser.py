"""``compressor="auto"``: choose, at run time, the method that reaches the target soonest.

A :class:`~lightning_gc.engine.session.StepParticipant` (name ``"auto"``) that the strategy adds
when ``compressor="auto"``. Its life, on every rank at the same step boundaries:

1. **Profile** (dense warm-up steps, which the engine runs anyway: DDP's own fp32 bucket path).
   For ``profile_steps`` steps after ``skip_steps`` it times forward, each gradient tensor's
   readiness in backward (post-accumulate-grad hooks), the optimizer step and the step's wall time
   (end of the previous step to the end of this one, as the bench counts it).
2. **Measure** (once, between steps): every candidate's codec cost, payload and error on the live
   averaged gradient (:func:`~lightning_gc.auto.candidates.measure_method`), and the network by an
   in-band probe. Every number is agreed across ranks (MAX for times, so the slowest rank counts,
   as it does in synchronous training).
3. **Decide** with :func:`~lightning_gc.auto.model.choose` (identical inputs on every rank → the
   same choice) and **apply**: a bucket mode with ``GCEngine.set_dense_mode``, an engine method with
   ``GCEngine.set_group_method`` on every compressed group (error memory follows the slot rule; a
   dense mode flushes it into its next step).
4. **Watch**: the median step of every ``window`` steps (agreed, MAX) is compared with a reference:
   the second window after the decision (the first holds the switch itself). A drift of more than
   ``drift`` (relative) for ``patience`` windows in a row (one window if the step moved by
   ``severe_drift``× or more), at least ``min_interval`` steps after the
   last decision (a severe one: after the last severe one), re-probes the network and decides again from the stored compute and codec
   measurements (trigger ``"drift"``); the method is switched only if the choice changed (every
   re-decision is in the history either way). The ``severe_drift`` test is also made every step,
   on the last ``severe_steps`` agreed step walls (every one of them off, or their median twice as far;
   an all-reduce issued at each
   step's end and read at the next: ``_check_severe_steps``), so that a link that fell is seen
   within a few steps rather than at the end of the window it fell in.
5. **Calibrate**: the first reference window of a method sets *that method's* correction
   (measured − predicted step), and the choice is made again at once (trigger ``"calibration"``,
   no probe) by :func:`~lightning_gc.auto.model.choose_measured`: measured methods with their
   corrections, unmeasured ones by the raw (optimistic) model. So a method whose real step the model
   misses (the engine's worker and agreements, Python per step, its own collective) is judged by
   what it did, and an unmeasured one that the model still favours is measured next, at most
   ``explore`` of them after each probed decision. Unmeasured ones are predicted by the raw model
   lowered by the least speed-up every measured method showed against it (``compute_shift``: the
   warm-up's profiled compute is slower than a settled step's, for every method alike), taken from
   the dense modes measured in a window (on any link) when there are any (``policy.shift_basis``). The dense
   warm-up measured ``ddp`` (``other`` is fitted to it), so ``ddp`` starts measured.
6. **Try the dense sibling**: the dense modes (``ddp``, ``fp16``, ``bf16``) run the same path on
   DDP's buckets and differ only in the bytes and the cast, so the first window of one of them also
   tells what the model misses for the others. A sibling not yet measured in a window on this link,
   whose raw prediction plus the measured one's correction lies within ``family_margin`` of the
   measured step (time per unit of progress), runs the next window (trigger ``"family"``), and the
   choice is then made among the measured methods, the mode the trial interrupted holding unless
   the sibling leads it by ``switch_margin`` (:func:`~lightning_gc.auto.policy.hold_or_switch`).

The rules of a decision are pure functions of agreed numbers in :mod:`lightning_gc.auto.policy`;
what is measured, and how, is in :mod:`lightning_gc.auto.measure`; the options in
:mod:`lightning_gc.auto.config`. This module is the step participant that measures, agrees, asks
the policy and applies its decision to the engine (:class:`~lightning_gc.engine.ports.MethodControl`).

Everything a decision used is in :attr:`AutoChooser.history` (checkpointed, replicated) and logged
(see :mod:`lightning_gc.callbacks.monitor`, ``auto/*``); the end-of-fit summary names the choice.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from ..comm.cost_model import NetworkModel
from ..comm.direct import DIRECT_MAX_RANKS, backend_allows
from ..comm.link import (  # noqa: F401 (re-exported: the names auto always had)
    PROBE_LATENCY,
    PROBE_MAX_BYTES,
    PROBE_SMALL_MIN_BYTES,
    PROBE_START_BYTES,
    PROBE_TARGET_S,
    check_bytes,
    factor_apart,
    link_unchanged,
    modelled_check_s,
    next_probe_bytes,
    probe_bandwidth,
    probe_small_bytes,
    probe_start_bytes,
    steps_apart,
)
from ..comm.probe import ProbeConfig, probe_network
from ..compressors import GroupContext
from ..engine import dense_stop
from ..engine.agreement import agree_values
from ..engine.dense_stop import LinkCanary
from ..engine.ports import MethodControl
from ..engine.session import StepParticipant
from . import policy
from .candidates import (
    AutoCandidate,
    candidate,
    measure_error,
    squared_norm,
    time_method_codec,
)
from .config import AutoConfig
from .measure import check_agreed, group_sample, measure_costs, profile_entry, workload_from_profile
from .model import (
    MethodCost,
    Prediction,
    Workload,
    beta_from_dense_step,
    calibrate_beta,
    calibrate_other,
    choose_measured,
    compute_shift,
    efficiency,
    predict,
    table,
)
from .policy import Trigger

log = logging.getLogger(__name__)

#: the exchange test (``_check_severe_steps``) re-decides only on a change of the exchange time of at
#: least this share of the reference step: an exchange of a few hundred microseconds on a fast link
#: moves by 2x with the host's scheduling alone, and a change that small would not change the pick
EXCHANGE_SHARE = 0.1

#: the one-step test (``_check_severe_steps``, test ``step``): while a dense mode runs, one agreed step
#: this many times ``severe_drift`` slower than the reference re-decides at once (8x at the defaults),
#: unless that step's wall may hold time that is not a training step's (:meth:`AutoChooser.mark_wall`).
#: Why: a dense mode on a fallen link pays every step the whole exchange at the new rate (the
#: quickstart MLP: fp16 ~22 ms → 206-234 ms at 10 Mbit/s, DDP 17 → 406-466 ms; ``mlp``: ~60 ms → ~3 s),
#: and the test of the last ``severe_steps`` needed two such steps beside the one the read lags.
#: How safe: over 41 156 steps of static methods on steady links in the bench runs kept on the
#: development machine, none took 3x the median of the 5 before it (docs/auto-measurements.md)
ONE_STEP_FACTOR = 4.0

#: the tests of ``severe_drift`` as a decision's history records them (``drift_test``)
SEVERE_TESTS = ("severe_window", "steps", "step", "exchange", "reference_window")


#: the parts of a decision's own time its history records (``decide_parts_s``, slowest rank each): the
#: latency round, the bandwidth probe, the link check (both messages, a retimed one included) and the
#: codecs timed on demand (a link check's reference where β came from a dense step is modelled, not
#: timed: :func:`modelled_check_s`). Each is the slowest rank's, so they need not add up to ``decide_s`` (the slowest rank's
#: whole decision), which also holds the model, the agreements and the switch itself
DECIDE_PARTS = ("latency", "probe", "check", "codecs")

#: the fewest windows (the reference one included) whose median replaces the running method's figure
#: at a gain or periodic re-decision (AutoChooser._running_figure)
RUN_FIGURE_MIN_WINDOWS = 3


class AutoChooser(StepParticipant):
    """Profiles, measures, chooses and re-chooses the method (see the module docstring)."""

    name = "auto"
    state_scope = "replicated"

    def __init__(self, engine: MethodControl, config: AutoConfig, module: torch.nn.Module,
                 named_parameters: list[tuple[str, Tensor]]) -> None:
        self.engine = engine
        self.config = config
        self.candidates: list[AutoCandidate] = [candidate(c) for c in config.candidates]
        #: the candidates that are bucket modes (no compressor: ``ddp``, ``fp16``, ``bf16``)
        self._dense_names = frozenset(c.name for c in self.candidates if c.compressor is None)
        self.params = [p for _, p in named_parameters]
        self.names = [n for n, _ in named_parameters]
        #: the early path (early_comm_ratio) never shortens the warm-up below this: the configuration
        #: raised a warm-up of at most skip_steps + profile_steps to that sum for auto (GCConfig), so
        #: such a warm-up is auto's; 1 is the engine's own (DDP's bucket rebuild after step 0); a
        #: longer one was asked for and is kept
        w = int(engine.config.warmup_steps)
        self._configured_warmup = w if w > config.dense_steps_needed else 1
        engine.raise_warmup_steps(config.dense_steps_needed)
        #: the plan has no group to compress (every tensor below ``min_compress_numel``): nothing to choose, so
        #: auto runs DDP's dense path from the first step boundary on and measures nothing (replicated: the
        #: plan is the same on every rank)
        self.nothing_to_compress = not any(not g.exact for g in engine.plan.groups)
        # every step's wall rides in the next step's messages (the every-step test and the windows read
        # them there): a compressed step's closing report. A dense mode's is agreed at once by a direct
        # exchange (one message latency) where the group allows one, else it rides in the next step's
        # first gradient bucket (see _agree_wall_later)
        self._dense_walls_direct = (1 < engine.world_size <= DIRECT_MAX_RANKS and dist.is_available()
                                 and dist.is_initialized() and backend_allows(engine.process_group)
                                 and not self.nothing_to_compress)
        if not self._dense_walls_direct and not self.nothing_to_compress:
            engine.enable_dense_carry()
        #: the link canary before each step a dense mode runs (AutoConfig.canary_bytes; None: off; the engine
        #: sings it, lightning_gc/engine/dense_stop.py); each dense step's wall is still agreed at its own end
        #: (_agree_wall_later), for a fall during a step. Not under a network the user pinned: a fall it saw could not
        #: re-read the link (the pinned figures are not recalibrated), and every dense step would stop
        pinned = bool(engine.network.pinned and engine.network.model is not None)
        self.canary = (config.canary() if self._dense_walls_direct and not pinned and engine.plan_sends_every_param
                       else None)
        #: before a decision that did not look at the link moves from a compressed method to a dense mode, one
        #: canary message tells whether the link fell meanwhile (a compressed method's step may not show it:
        #: its exchange can fit the shaper's burst). The user's canary if on, else the defaults; None where the
        #: group takes no direct exchange or the network is pinned. See _decide and docs/auto.md
        self._switch_check = ((self.canary or LinkCanary()) if self._dense_walls_direct and not pinned else None)
        if self.canary is not None:
            engine.enable_canary(self.canary)
        #: every decision (replicated, checkpointed): step, trigger, inputs, predictions, choice
        self.history: list[dict] = []
        self.chosen: str | None = None
        self.workload: Workload | None = None
        self.costs: list[MethodCost] | None = None
        self.network: NetworkModel | None = None
        self.predictions: dict[str, Prediction] = {}
        self.measured: list[float] = []  # this rank's step walls (profile, then windows)
        self._profile: list[dict] = []
        self._reference: float | None = None
        self._settling = True
        #: measured step minus raw prediction, per method that has run (replicated: agreed windows)
        self._corrections: dict[str, float] = {}
        #: per method: the network's β (s/byte) when its correction was measured (see _valid_corrections)
        self._correction_beta: dict[str, float] = {}
        self._explore_left = config.explore
        #: the large message of the last bandwidth probe (bytes; 0 before any probe or with a pinned network)
        self.probe_bytes = 0
        #: that message's time in the last full probe (agreed, MAX over ranks): the link check's reference
        self.probe_time_s = 0.0
        #: whether :attr:`probe_time_s` is the model's time for that message, not a measured one (a network
        #: measured by a dense step: :func:`modelled_check_s`); the first check's own time replaces it
        self.probe_time_modelled = False
        #: every probe's β is multiplied by this (replicated): the warm-up's profiled DDP step divided
        #: by what the model gave it at the probed β, when shorter (model.calibrate_beta); 1 otherwise
        self.beta_scale = 1.0
        self._drifted = 0
        self._window: list[float] = []
        #: agreed step walls for the every-step severe test (severe_steps; the mean over ranks, carried in the
        #: next step's closing report or first gradient bucket), the oldest first, and the last step's wall
        #: still to be read (its step, its reader; see _agree_wall_later)
        self._recent: list[float] = []
        self._recent_pending: tuple[int, Callable[[], float | None]] | None = None
        self._recent_step: int | None = None  # the step of the newest wall in _recent
        #: steps whose wall may hold time that is not a training step's (mark_wall: an epoch's first step,
        #: a checkpoint saved before it): the one-step test (ONE_STEP_FACTOR) leaves them out
        self._marked_walls: set[int] = set()
        #: the walls read so far (step -> the mean over ranks, None where it was lost), the last few:
        #: the windows' medians come from them without an agreement of their own (see _check_drift)
        self._carried_walls: dict[int, float | None] = {}
        #: a compressed method's exchange times of the last steps (the closing report's mean over ranks),
        #: the current window's, and the reference window's fastest (the exchange test's reference; None before)
        self._recent_exchange: list[float] = []
        self._window_exchange: list[float] = []  # the agreed exchanges of the current window's steps
        self._reference_exchange: float | None = None
        #: the agreed medians of the running method's windows since its reference window (that one
        #: first; replicated, checkpointed): its figure at a gain or periodic re-decision (see _decide)
        self._run_medians: list[float] = []
        self._last_decision_step: int | None = None
        # the last decision that looked at the link (a probe, a link check, a dense step's β): the
        # periodic re-probe counts from it, not from a calibration's, a trial's or a gain re-decision's
        self._last_link_step: int | None = None
        self._link_interval = config.probe_every  # the periodic re-decision's interval now (probe_every_max)
        self._gain_interval = config.gain_every  # the errors' re-measurement interval now (gain_every_max)
        self._stamps: dict[int, float] = {}
        self._t_start = self._t_fwd = self._t_closure_end = 0.0
        self._t_prev_end: float | None = None
        self._t_paused: float | None = None  # pause_walls: when the validation (or other non-training time) began
        self._handles: list[Any] = []
        #: this rank's local gradients of the step being sampled (parameter index → copy), or None when
        #: no step is sampled: the warm-up's dense steps (the last profiled one is measured) and, every
        #: ``gain_every`` steps, one armed step (see _arm_sample)
        self._sample: dict[int, Tensor] | None = None
        self._sample_handles: list[Any] = []
        #: the step whose gradients the candidates' stored errors were last measured on (replicated)
        self._last_gain_step: int | None = None
        #: every re-measurement of the errors (replicated, checkpointed): step, each candidate's
        #: agreed delta2, the largest relative change of progress per step, whether it re-decided
        self.gain_checks: list[dict] = []
        if engine.world_size > 1 and not self.nothing_to_compress:
            self._sample = {}
            self._handles = [p.register_post_accumulate_grad_hook(self._stamp(i)) for i, p in enumerate(self.params)]
            self._handles.append(module.register_forward_hook(self._on_forward))

    # ------------------------------------------------------------------ timing (autograd / main thread)
    def _stamp(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self._stamps[i] = time.perf_counter()  # before the copy: the copy is not backward's time
            self._keep(i, param)
        return hook

    def _keep(self, i: int, param: Tensor) -> None:
        """Copy a parameter's local gradient if this step is sampled. A post-accumulate-grad hook runs
        when the tensor's gradient is complete on this rank and before DDP's reducer (a hook of the
        same autograd node, run after it) or the engine has touched it, so it is this rank's own
        gradient; under gradient accumulation the last micro-batch's copy (the full sum) is kept."""
        if self._sample is not None and param.grad is not None:
            self._sample[i] = param.grad.detach().clone()

    def _arm_sample(self) -> None:
        """Copy the next step's local gradients (for the errors' re-measurement, see ``gain_every``)."""
        self._disarm_sample()
        self._sample = {}

        def keeper(i: int) -> Callable[[Tensor], None]:
            return lambda param: self._keep(i, param)
        self._sample_handles = [p.register_post_accumulate_grad_hook(keeper(i)) for i, p in enumerate(self.params)]

    def _disarm_sample(self) -> dict[int, Tensor] | None:
        sample, self._sample = self._sample, None
        for h in self._sample_handles:
            h.remove()
        self._sample_handles = []
        return sample

    def _on_forward(self, *_: Any) -> None:
        self._t_fwd = time.perf_counter()

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            if self._canary_due():  # on the engine's worker: the step's buckets wait behind it
                self.engine.sing_canary(math.nan)  # nothing carried: the step before's wall was agreed at its end
            self._stamps = {}
            self._t_start = time.perf_counter()
            self._t_fwd = self._t_start
            out = closure()
            self._t_closure_end = time.perf_counter()
            return out
        return timed

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ step boundary
    def pause_walls(self) -> None:
        """Time from now until :meth:`resume_walls` is not a training step's (the strategy calls the
        two around validation, and the checkpoint saved at its end). Why: a validation in a step's wall
        makes a steady link look moved, and the false re-decision it sets off then holds a real one
        back for ``min_interval`` steps. The bench leaves validation out of its step times the same way."""
        self._t_paused = time.perf_counter()

    def mark_wall(self) -> None:
        """The step now running (or about to) may hold time that is not a training step's: the strategy
        calls this at an epoch's first batch (the loop's epoch end, a data loader's workers starting)
        and when a checkpoint is saved between steps. Such a step still counts in the windows and the
        test of the last ``severe_steps``; the one-step test (:data:`ONE_STEP_FACTOR`) leaves it out.
        Called on every rank alike (the batch index and the checkpoint's save are the same on every
        rank), so every rank leaves out the same steps."""
        self._marked_walls.add(int(self.engine.step))

    def resume_walls(self) -> None:
        """End of :meth:`pause_walls`: the next step's wall starts where the last step ended, plus the pause."""
        if self._t_paused is not None and self._t_prev_end is not None:
            self._t_prev_end += time.perf_counter() - self._t_paused
        self._t_paused = None

    def after_optimizer_step(self) -> None:
        engine = self.engine
        t_end = time.perf_counter()
        wall = None if self._t_prev_end is None else t_end - self._t_prev_end
        self._t_prev_end = t_end
        if engine.world_size == 1:
            return
        step = engine.step - 1  # the step that just finished
        if self.nothing_to_compress:
            if self.chosen is None:
                self._run_dense_only(step)
            return
        if self.chosen is None:
            cfg = self.config
            complete = len(self._stamps) == len(self.params)
            if step >= cfg.skip_steps and wall is not None and complete:
                self._profile.append(self._profile_entry(t_end, wall))
            elif step < cfg.skip_steps and step + 1 >= self._configured_warmup and self._early(t_end, complete):
                # the skipped step waited mostly on the network: profile it and end the warm-up here
                self._profile = [self._profile_entry(t_end, t_end - self._t_start)]
                engine.shorten_warmup_steps(step + 1)
            if len(self._profile) >= cfg.profile_steps or not engine.step_is_dense():
                self._first_decision(step)
                self._t_prev_end = time.perf_counter()  # the measurement is not a step
            return
        stats = engine.last_step
        if stats is not None and stats.step == step and stats.dense_stopped:
            self._read_carried()  # the step before's wall (agreed at its end; nothing pending then)
            self._on_dense_stop(step, stats)
            return
        if wall is not None:  # None on the first step after a resume
            self.measured.append(wall)
            self._window.append(wall)
        self._read_carried()  # the step before's wall, carried in this step's messages
        if self._sample_handles:  # this step was sampled: measure the errors again
            self._check_gain(step, self._disarm_sample() or {})
            self._t_prev_end = time.perf_counter()  # the measurement is not a step
        elif len(self._window) >= self.config.window:
            self._check_drift(step)
            self._t_prev_end = time.perf_counter()
        if wall is not None and self._last_decision_step == step and self._recent_pending is None:
            # a decision's step: its wall is carried all the same (the next window reads it; the severe
            # test leaves it out)
            self._recent_pending = (step, self._agree_wall_later(step, wall))
        if wall is not None and self._last_decision_step != step:
            exchange_s, exchange_step = None, None
            if candidate(self.chosen).compressor is not None:  # agreed by the step's closing report
                stats = engine.last_step
                if stats is not None and not stats.dense:
                    # this step's, or the step before's where the report rode in the last message
                    exchange_s, exchange_step = stats.exchange_comm_mean_s, stats.exchange_comm_mean_step
            self._check_severe_steps(step, wall, exchange_s, exchange_step)
        if self._gain_due(step):
            self._arm_sample()

    def _run_dense_only(self, step: int) -> None:
        """Nothing to compress (:attr:`nothing_to_compress`): run DDP's fp32 path from the next step on and
        say so once. No profile, measurement or decision follows: every candidate would send the same
        exact tensors. Every rank gets here at the same step (the plan is replicated)."""
        rank_zero_warn(f"lightning_gc auto: the plan has no tensor to compress (every one is below min_compress_numel="
                       f"{self.engine.config.min_compress_numel} elements), so auto runs DDP's dense path from step "
                       f"{step + 1} on. Lower min_compress_numel to let it choose among methods.")
        self.chosen = "ddp"
        self._apply("ddp")

    # ------------------------------------------------------------------ the participant's lifecycle hooks
    def on_validation_start(self) -> None:
        """Validation time is not a training step's (:meth:`pause_walls`)."""
        self.pause_walls()

    def on_validation_end(self) -> None:
        """Back from validation (:meth:`resume_walls`)."""
        self.resume_walls()

    def on_train_batch_start(self, batch_idx: int) -> None:
        """An epoch's first batch holds the epoch's end and start in its wall (:meth:`mark_wall`)."""
        if batch_idx == 0:
            self.mark_wall()

    def on_checkpoint_saved(self) -> None:
        """A checkpoint saved between steps is in the next step's wall (:meth:`mark_wall`)."""
        self.mark_wall()

    def _on_dense_stop(self, step: int, stats: Any) -> None:
        """Step ``step`` was a dense mode's, and the link canary before it saw the link fall: the step
        stopped (lightning_gc/engine/dense_stop.py; its compressed groups' gradients are error memory;
        the verdict is agreed, so every rank is here). Re-decide now (trigger ``drift``, test
        ``canary``), whatever ``min_interval`` says: until a decision looks at the link again, every
        dense step would stop. The network for it: β from the canary itself (its second message's time
        on the fastest rank, less the model's α, over the ``N-1`` copies each rank sent), no probe.
        Why: on a fallen link a probe that starts small and grows is slow, and the canary timed the link
        at the size a probe ends at. The stopped step is not a step of the
        method (it sent its exact group only) and enters no window; a gradient sample armed for it
        is dropped (the next one comes at the next due step)."""
        canary = self.canary
        assert canary is not None
        fastest, predicted = stats.dense_check_s, stats.dense_check_predicted_s
        rank_zero_info(f"lightning_gc auto: the link canary before step {step} under {self.chosen!r} took "
                       f"{1e3 * fastest:.1f} ms on the fastest rank (twice), {1e3 * predicted:.2f} ms on the network "
                       "model: the link fell, the step kept its gradient as error memory; re-deciding")
        self._disarm_sample()
        self._decide(step, "drift", probe=True, check_link=False, canary_s=fastest, detail="canary")
        self._t_prev_end = time.perf_counter()  # the decision is not a step

    def _gain_due(self, step: int) -> bool:
        """Whether the next step's gradients are sampled to measure the candidates' errors again:
        ``gain_first`` (then ``gain_every``) steps after the last measurement, and not while a method
        is on trial (:attr:`in_trial`). A re-decision in the middle of a trial cut it short: its
        window was never measured, and the trial ran again later. Deferred, the
        sample is taken at the first step after the trial's window is measured. The interval
        doubles while the pick stands (``gain_every_max``)."""
        every, first = (self._gain_interval if self.config.gain_every else 0), self.config.gain_first
        if every and first and not self.gain_checks:  # not re-measured yet: the warm-up's errors are the first
            every = min(every, first)
        due = bool(every) and self._last_gain_step is not None and step + 1 - self._last_gain_step >= every
        return due and not self.in_trial

    def _profile_entry(self, t_end: float, wall: float) -> dict:
        return profile_entry(self._stamps, self._t_start, self._t_fwd, self._t_closure_end, t_end, wall)

    def _early(self, t_end: float, complete: bool) -> bool:
        """Whether a skipped dense step's exposed communication (closure end after the last
        gradient was ready: DDP's wait for its buckets) was at least ``early_comm_ratio`` times the
        rest of the step (its start to its end), on the slowest rank (agreed, so every rank takes
        the same path). A step without every gradient's time (an unused parameter): no."""
        ratio = self.config.early_comm_ratio
        if not ratio:
            return False
        last_ready = max(self._stamps.values()) if complete and self._stamps else None
        exposed = max(self._t_closure_end - last_ready, 0.0) if last_ready is not None else 0.0
        rest = max((t_end - self._t_start) - exposed, 0.0)
        missing = 0.0 if last_ready is not None else 1.0
        exposed, rest, missing = agree_values([exposed, rest, missing], "max", self.engine.process_group,
                                              self.engine.device)
        return not missing and exposed > 0.0 and exposed >= ratio * rest

    def _check_severe_steps(self, step: int, wall: float, exchange_s: float | None = None,
                            exchange_step: int | None = None) -> None:
        """The every-step severe tests (``severe_steps``; see :class:`AutoConfig`), at least
        ``min_interval`` steps after the last severe re-decision (:meth:`_severe_held`); each
        re-decides with a probe (trigger ``drift``). Every input is agreed, so every rank takes the same path.

        * **The step** (test ``steps``): reads the agreed wall of the step before (issued there;
          complete by now) and issues this step's; every one of the last ``severe_steps`` agreed
          walls ``severe_drift`` or more off the reference the same way, or their median twice that
          far (:func:`steps_apart`; or off a calibrated prediction, before the reference window).
        * **The exchange** (test ``exchange``; compressed methods): ``exchange_s``, step
          ``exchange_step``'s time in the compressed exchanges averaged over the ranks (the step's
          closing report, agreed already; the step before's where the report rode in the step's
          last message, ``EngineConfig.report_rides``), against the fastest exchange of the reference window: the median of the last
          ``severe_steps`` ``severe_drift`` times or more *faster* and by at least
          :data:`EXCHANGE_SHARE` of the reference step. The fastest, not the median: a reference
          window that caught the slow mode of a two-mode exchange (below) would fire on the fast one.
          Why: a compressed method's step can hide a link that came back; the exchange is the part
          of the step that the link sets.

          Only faster, since a fall shows in the step test, and a small exchange's time on a shaped,
          steady link has two modes (likely the shaper's burst allowance). So the decision this test
          starts begins with the link check (``probe_check``: one message of the last probe's size,
          above any burst allowance), and on an unchanged link the stored network decides without
          the probe."""
        n, sv = self.config.severe_steps, self.config.severe_drift
        self._read_carried()
        # carried whatever the test's setting: the windows read their medians from these walls too
        self._recent_pending = (step, self._agree_wall_later(step, wall))
        if self._dense_agreed_now():  # agreed already (a dense mode): this step's wall enters the tests now
            self._read_carried()
        if not n or not sv:
            return
        last = self._last_decision_step if self._last_decision_step is not None else -10**9
        at = step if exchange_step is None else exchange_step
        if exchange_s is not None and at > last + 1:  # not the decision's step, nor the switch's first
            self._recent_exchange = (self._recent_exchange + [exchange_s])[-n:]
            self._window_exchange.append(exchange_s)
        if self._severe_held(step):
            return
        test = basis = None
        if len(self._recent) >= n:
            # every one of the last n steps off by the factor the same way, or their median twice that far
            # (steps_apart; not the median at the factor: two slow steps of three are scheduling noise often
            # enough on a busy host)
            slow, fast = min(self._recent), max(self._recent)
            if self._reference is not None:
                if steps_apart(self._recent, self._reference, sv):
                    test, basis = "steps", f"{1e3 * self._reference:.1f} ms after the last decision"
            elif self._link_moved_under(self._recent):
                test = "steps"
                basis = f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms predicted from its own measured step"
            what = (f"the last {n} steps ran {1e3 * slow:.1f}-{1e3 * fast:.1f} ms (median "
                    f"{1e3 * statistics.median(self._recent):.1f} ms)")
        if test is None and self._one_step_fell():
            test, one = "step", self._recent[-1]
            what = (f"one step ({self._recent_step}) ran {1e3 * one:.1f} ms under {self.chosen!r}, "
                    f"{ONE_STEP_FACTOR * self.config.severe_drift:g}x or more")
            basis = (f"{1e3 * self._reference:.1f} ms after the last decision" if self._reference is not None else
                     f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms predicted from its own measured step")
        ref_x = self._reference_exchange
        if test is None and ref_x and self._reference and len(self._recent_exchange) >= n:
            med_x = statistics.median(self._recent_exchange)
            # faster only: a fall shows in the step test, and a small exchange's time on a shaped, steady
            # link has two modes (likely the shaper's burst allowance; see the docstring)
            if med_x * sv <= ref_x and ref_x - med_x >= EXCHANGE_SHARE * self._reference:
                test, what = "exchange", f"the last {n} steps' exchanges took {1e3 * med_x:.1f} ms (median)"
                basis = f"{1e3 * ref_x:.1f} ms in the reference window (step {1e3 * self._reference:.1f} ms)"
        if test is None:
            return
        rank_zero_info(f"lightning_gc auto: {what} against {basis} (at least {sv:g}x apart): re-deciding")
        # the step test saw a fall, or a rise, of 2x or more: the link most likely moved, and a check would only
        # add its message to the probe. A faster exchange may come from an unchanged link (see the docstring):
        # the check (one message above any burst allowance) tells, and spares the probe
        drift_wall = {"steps": statistics.median(self._recent), "step": self._recent[-1]}.get(test)
        self._decide(step, "drift", probe=True, check_link=test == "exchange", drift_wall_s=drift_wall, detail=test)
        self._t_prev_end = time.perf_counter()  # the decision is not a step

    def _one_step_fell(self) -> bool:
        """The one-step test: a dense mode runs, and the newest agreed wall (:attr:`_recent`, not a
        step :meth:`mark_wall` named) is ``ONE_STEP_FACTOR · severe_drift`` times its reference or
        more; before the reference window, its calibrated prediction (as :meth:`_link_moved_under`).
        Why the prediction too: on ``cnn`` width 16 a dense sibling's trial had just ended when the
        link fell, and fp16's reference window was not measured yet: three ~2 s steps ran before the
        test of the last 3 saw it (docs/auto.md). Slower only: a dense mode's step is the one a fall
        inflates by the whole exchange; a faster link under it is seen by the test of the last
        ``severe_steps``."""
        sv = self.config.severe_drift
        ref = self._reference if self._reference is not None else self._calibrated_prediction()
        if not self._recent or ref is None or not sv or self.chosen is None:
            return False
        if candidate(self.chosen).compressor is not None or self._recent_step in self._marked_walls:
            return False
        return self._recent[-1] >= ONE_STEP_FACTOR * sv * ref

    def _read_carried(self) -> None:
        """Read the wall still pending (handed to the engine at the step before, carried in this step's
        messages; see :meth:`_agree_wall_later`): into :attr:`_carried_walls` for the windows, and, unless
        it is the last decision's step or the switch's first step, into the severe test's last walls.
        Idempotent within a step (nothing pending after the first call)."""
        if self._recent_pending is None:
            return
        at, read = self._recent_pending
        self._recent_pending = None
        value = read()
        self._carried_walls[at] = value
        for old in [k for k in self._carried_walls if k < at - 4 * max(self.config.window, 1)]:
            del self._carried_walls[old]
        last = self._last_decision_step if self._last_decision_step is not None else -10**9
        n = self.config.severe_steps
        if n and value is not None and at > last + 1:  # not the decision's step, nor the switch's first step
            self._recent = (self._recent + [value])[-n:]
            self._recent_step = at
        if self._marked_walls:  # usually empty: an epoch's first step, a checkpoint
            self._marked_walls = {s for s in self._marked_walls if s >= at}

    def _window_median(self, step: int) -> float:
        """The median step of the window that ends at ``step`` (:attr:`_window`, this rank's walls),
        the same on every rank. From the walls carried in the steps' own messages where every one of
        them arrived: the window shifted one step back (steps ``step - len .. step - 1``: the last
        one's wall arrives with the next step), the mean over ranks of each step, no collective. Else
        (a lost wall: a resume, a step not carried) the median of this rank's walls, agreed as the MAX
        over ranks: a blocking all-reduce, which the carried walls spare every window."""
        n = len(self._window)
        carried = [self._carried_walls.get(s) for s in range(step - n, step)]
        if n and all(v is not None for v in carried):
            return statistics.median(carried)
        engine = self.engine
        return agree_values([statistics.median(self._window)], "max", engine.process_group, engine.device)[0]

    def _agree_wall_later(self, step: int, wall: float) -> Callable[[], float | None]:
        """Hand step ``step``'s ``wall`` to the engine; the returned function reads its mean over the
        ranks at the next step's end (None if it was lost: see below). It rides in the next step's
        messages, at no message of its own (:meth:`GCEngine.carry_wall`): a compressed step's closing
        report, or a dense step's first gradient bucket (:meth:`GCEngine.enable_dense_carry`; in the
        bucket's dtype, so about 3 significant digits under a 16-bit mode). Why: a separate 8-byte
        all-reduce per step is one more latency-bound collective on the process group the exchanges
        use, and it showed in every step. A rank that lost its value (a resume) makes it None on every
        rank, and the test skips it (the step after a decision is left out anyway).

        **Under a dense mode** on up to 8 ranks off NCCL the wall is agreed now instead, by a direct
        exchange of its own (one message latency; lightning_gc/comm/direct.py), and the returned
        function gives that mean. Why: carried in the next step's first bucket, a wall was read one
        step late, so a link that fell under a dense mode cost two dense steps at the fallen rate
        before the one-step test could act; agreed now, the test acts at the end of the first (one
        message latency, less than gloo's ring all-reduce of the same bytes). **With the link canary
        on** (:attr:`canary`) too: the canary sees a fall that comes before the next step, the wall
        one that came during this step."""
        engine = self.engine
        if self._dense_agreed_now():
            value = agree_values([wall], "mean", engine.process_group, engine.device)[0]
            return lambda: value
        engine.carry_wall(wall)

        def carried() -> float | None:
            stats = engine.last_step
            return stats.carried_wall_mean_s if stats is not None and stats.step == step + 1 else None
        return carried

    def _dense_agreed_now(self) -> bool:
        """Whether a step's wall is agreed at its own end (a dense mode runs, on a group that takes the
        direct exchange, with or without the link canary; :meth:`_agree_wall_later`), not carried
        into the next step. Replicated."""
        return self._dense_walls_direct and self._dense_mode_runs()

    def _sing_switch_check(self) -> dense_stop.CanaryResult:
        """One canary message (:class:`LinkCanary`, twice where the first says "fell") on the training thread,
        between steps, on every rank alike (a collective; the decision that calls it is replicated, and has
        synchronized the engine already)."""
        engine = self.engine
        assert self._switch_check is not None
        return dense_stop.sing(self._switch_check, math.nan, self.network, engine.exchange_group, engine.world_size,
                               engine.device)

    def _canary_due(self) -> bool:
        """Whether the link canary goes before the next step (a dense mode runs, the canary is on).
        Replicated."""
        return self._dense_walls_direct and self.canary is not None and self._dense_mode_runs()

    def _dense_mode_runs(self) -> bool:
        return self.chosen is not None and candidate(self.chosen).compressor is None

    def _check_drift(self, step: int) -> None:
        window_exchange, self._window_exchange = self._window_exchange, []
        if self._settling:  # the first window after a decision holds the switch itself: not a reference
            self._settling, self._window = False, []
            return
        med = self._window_median(step)
        self._window = []
        last = self._last_decision_step if self._last_decision_step is not None else -10**9
        if self._reference is None:
            if self._link_moved_under([med]):
                # not a reference: a step measured across a link change would hide that change from
                # every later window. Re-decided with a probe (severe: see _severe_held)
                if not self._severe_held(step):
                    rank_zero_info(f"lightning_gc auto: {self.chosen!r} ran {1e3 * med:.1f} ms, predicted "
                                   f"{1e3 * self.predictions[self.chosen].step_s:.1f} ms from its own measured "
                                   f"step on this link: the link moved, re-deciding")
                    self._decide(step, "drift", probe=True, check_link=False, drift_wall_s=med,
                                 detail="reference_window")
                return
            self._reference = med
            self._run_medians = [med]
            n = self.config.severe_steps
            # the window's fastest exchange, not its median: a small exchange's time on a steady shaped link
            # has two modes (see _check_severe_steps), and a reference in the slow one made the fast one
            # look like a link that came back
            self._reference_exchange = min(window_exchange) if n and len(window_exchange) >= n else None
            if self.history:
                self.history[-1]["measured_step_s"] = med
            self._calibrate(step, med)
            return
        moved = abs(med - self._reference) / self._reference > self.config.drift if self._reference > 0 else False
        self._drifted = self._drifted + 1 if moved else 0
        self._run_medians.append(med)
        sv = self.config.severe_drift
        severe = bool(sv) and factor_apart(med, self._reference, sv)
        last_link = self._last_link_step if self._last_link_step is not None else last
        if self.config.probe_every and step - last_link >= self._link_interval:
            self._decide(step, "periodic", probe=True)
            return
        moderate = self._drifted >= self.config.patience and step - last >= self.config.min_interval
        if moderate or (severe and not self._severe_held(step)):
            why = (f"at least {sv:g}x in one window" if severe and self._drifted < self.config.patience else
                   f"drift > {100 * self.config.drift:.0f}% for {self._drifted} windows")
            rank_zero_info(f"lightning_gc auto: step {1e3 * med:.1f} ms vs {1e3 * self._reference:.1f} ms after the last "
                           f"decision ({why}): re-deciding")
            # a window at severe_drift x or more: the link most likely moved, and a check would only add
            # its message to the full probe (on a link that fell to 10 Mbit/s, 0.2 s on the quickstart MLP)
            self._decide(step, "drift", probe=True, check_link=not severe, drift_wall_s=med,
                         detail="severe_window" if severe else "window")

    def _severe_held(self, step: int) -> bool:
        """Whether a severe re-decision (any test of ``severe_drift``: a window, the last steps, a
        reference window, the exchange) must wait: within ``min_interval`` steps of the last severe
        one. Not after other decisions (see ``min_interval`` in :class:`AutoConfig`). From the
        history, so a checkpoint carries it and every rank reads the same."""
        last = next((h["step"] for h in reversed(self.history) if h.get("drift_test") in SEVERE_TESTS), None)
        return last is not None and step - last < self.config.min_interval

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
        self._measure_costs(self._disarm_sample() or {})
        self._last_gain_step = step
        self._decide(step, "warmup", probe=True, dense_wall_s=wall, dense_exposed_s=exposed)

    def _group_sample(self, grads: dict[int, Tensor]) -> tuple[Tensor, GroupContext, float]:
        """The compressed group's local gradient, its context and the exact bytes (:func:`group_sample`)."""
        return group_sample(self.engine, self.params, grads)

    def _measure_costs(self, grads: dict[int, Tensor]) -> None:
        """Every candidate's codec time, payload and error on this rank's local gradient of the last
        profiled step, agreed (:func:`measure_costs`)."""
        engine = self.engine
        self.costs = measure_costs(self.candidates, self._group_sample(grads), engine.world_size, self.config.repeats,
                                   self.config.time_codecs == "upfront", engine.process_group, engine.device)

    def _time_codecs(self, names: Collection[str],
                     sample: tuple[Tensor, GroupContext, float] | None = None) -> list[str]:
        """Time the untimed codecs among ``names`` with :func:`time_method_codec` on this rank's
        gradients as they are now (the last step's, after its exchange: a codec's time depends on
        the sizes, not the values; ``sample``: that group sample, taken already), agree the MAX and
        store it; returns the names timed. Called on every rank alike: whether a decision needs it
        depends on agreed values only."""
        engine = self.engine
        assert self.costs is not None
        untimed = [k for k, c in enumerate(self.costs) if not c.codec_timed and c.name in names]
        if not untimed:
            return []
        flat, ctx, _ = sample or self._live_sample()
        by_name = {c.name: c for c in self.candidates}
        local = [time_method_codec(by_name[self.costs[k].name], flat, ctx, engine.world_size, self.config.repeats)
                 for k in untimed]
        agreed = agree_values(local, "max", engine.process_group, engine.device)
        for k, s in zip(untimed, agreed):
            self.costs[k] = replace(self.costs[k], codec_s=float(s), codec_timed=True)
        return [self.costs[k].name for k in untimed]

    def _live_sample(self) -> tuple[Tensor, GroupContext, float]:
        """The group sample (:meth:`_group_sample`) of the gradients as they are now."""
        return self._group_sample({i: p.grad for i, p in enumerate(self.params) if p.grad is not None})

    def _check_inputs_agree(self, step: int, trigger: Trigger, valid: dict[str, float], shift: float,
                            *walls: float | None) -> None:
        """Every figure the decision at ``step`` feeds the policy, checked to be the same on every rank
        (:func:`~lightning_gc.auto.measure.check_agreed`): a disagreement raises a clear error on every rank
        instead of a gloo abort in the collectives that divergent decisions would issue."""
        assert self.costs is not None and self.workload is not None and self.network is not None
        named: list[tuple[str, float]] = []
        for c in self.costs:
            named += [(f"codec_s[{c.name}]", c.codec_s), (f"payload_bytes[{c.name}]", c.payload_bytes),
                      (f"delta2[{c.name}]", c.delta2), (f"codec_timed[{c.name}]", float(c.codec_timed))]
        w = self.workload
        named += [("network.alpha_s", self.network.alpha_s), ("network.beta_s_per_byte", self.network.beta_s_per_byte),
                  ("workload.forward_s", w.forward_s), ("workload.backward_s", sum(w.backward_s)),
                  ("workload.optimizer_s", w.optimizer_s), ("workload.other_s", w.other_s), ("shift_s", shift),
                  ("explore_left", float(self._explore_left))]
        named += [(f"correction[{k}]", v) for k, v in sorted(valid.items())]
        named += [(f"wall_s[{i}]", v) for i, v in enumerate(walls) if v is not None]
        check_agreed(named, f"the {trigger.value} decision at step {step}", self.engine.process_group,
                     self.engine.device)

    def _model_inputs(self) -> tuple[dict[str, float], list[str], list[str], float]:
        """What a decision predicts with besides the costs, the workload and the network: the valid
        corrections, the methods settled on this link, the compute shift's basis and the shift."""
        valid = self._valid_corrections()
        windowed = self._windowed()
        settled = sorted(windowed & set(valid))
        shift_from = policy.shift_basis(windowed, settled, self._corrections, self._dense_names)
        shift = compute_shift([self._corrections[m] for m in shift_from]) if self.config.compute_shift else 0.0
        return valid, settled, shift_from, shift

    def _check_gain(self, step: int, grads: dict[int, Tensor]) -> None:
        """Measure the candidates' errors again on this step's local gradients (agreed mean, as at the
        warm-up) and re-decide (trigger ``"gain"``, no probe) if some measured candidate's progress
        per step moved by more than ``gain_drift`` from what the last decision used.

        Only the candidates that could win are measured (branch and bound on the error): the running
        method first, then every candidate whose predicted step (the gain decision's own model, in
        which the error does not enter the step) is at most the least time per unit of progress
        among those measured. A candidate above that bound loses whatever its error (its time per
        progress is its step over an efficiency of at most 1); its stored error stays, marked in
        ``gain_checks[].skipped``. Why: every error measured is CPU on the step's critical path (4 ranks
        share 2 cores on this project's machine); on ``mlp`` at 10 Mbit/s five of the six candidates'
        predicted steps were 2.7-57x the pick's time per progress, and measuring the pick alone took
        that step from 204-206 ms to 140-177 ms, against ~60 ms steps (docs/auto-measurements.md).
        Every rank measures the same candidates: the bound is computed from agreed values only."""
        engine = self.engine
        assert self.costs is not None and self.workload is not None and self.network is not None
        flat, ctx, _ = self._group_sample(grads)
        ws, w = engine.world_size, self.config.progress_weight
        valid, settled, _, shift = self._model_inputs()
        _, preds = choose_measured(self.costs, valid, self.workload, self.network, ws, w, shift_s=shift,
                                   settled=settled)
        step_s = [preds[c.name].step_s for c in self.costs]
        errors: dict[int, float] = {}
        norm2 = squared_norm(flat)  # once for every candidate's error

        def measure(ks: list[int]) -> None:
            vals = agree_values([measure_error(self.candidates[k], flat, ctx, norm2=norm2) for k in ks], "mean",
                                engine.process_group, engine.device)
            errors.update(zip(ks, vals))

        names = [c.name for c in self.costs]
        first = names.index(self.chosen) if self.chosen in names else min(range(len(names)), key=step_s.__getitem__)
        measure([first])
        # the bound below sets which candidates are measured next: a rank-local error would make the ranks
        # issue different agreements
        check_agreed([(f"delta2[{names[k]}]", d2) for k, d2 in sorted(errors.items())],
                     f"the errors' re-measurement at step {step}", engine.process_group, engine.device)
        bound = min(step_s[k] / efficiency(replace(self.costs[k], delta2=d2), ws, w) for k, d2 in errors.items())
        rest = [k for k in range(len(names)) if k not in errors and step_s[k] <= bound]
        if rest:
            measure(rest)
            check_agreed([(f"delta2[{names[k]}]", errors[k]) for k in rest],
                         f"the errors' re-measurement at step {step}", engine.process_group, engine.device)
        skipped = [names[k] for k in range(len(names)) if k not in errors]
        moved = 0.0
        for k, d2 in errors.items():
            old = self.costs[k]
            before, after = efficiency(old, ws, w), efficiency(replace(old, delta2=d2), ws, w)
            moved = max(moved, abs(after - before) / before)
        act = moved > self.config.gain_drift
        entry = {"step": step, "delta2": {names[k]: errors[k] for k in sorted(errors)}, "moved": moved,
                 "redecided": act, "skipped": skipped, "bound_s": bound}
        self.gain_checks.append(entry)
        self._last_gain_step = step
        running = self.chosen
        if act:
            self.costs = [replace(c, delta2=errors[k]) if k in errors else c for k, c in enumerate(self.costs)]
            rank_zero_info(f"lightning_gc auto: the candidates' errors moved (progress per step by up to "
                           f"{100 * moved:.0f}%): re-deciding")
            self._decide(step, "gain", probe=False)
        # the pick stood (the errors stayed put, or moved and the re-decision kept the method): look again twice
        # as late (gain_every_max); a switch starts from gain_every
        every, cap = self.config.gain_every, max(self.config.gain_every_max, self.config.gain_every)
        stood = self.chosen == running and bool(self.config.gain_every_max)
        self._gain_interval = min(2 * self._gain_interval, cap) if stood else every
        entry["next_interval"] = self._gain_interval

    # ------------------------------------------------------------------ decision
    def _decide(self, step: int, trigger: Trigger | str, probe: bool, dense_wall_s: float | None = None,
                force: str | None = None, dense_exposed_s: float | None = None, check_link: bool = True,
                drift_wall_s: float | None = None, detail: str | None = None,
                canary_s: float | None = None) -> None:
        engine = self.engine
        assert self.workload is not None and self.costs is not None
        trigger = Trigger(trigger)
        t0 = time.perf_counter()
        parts = dict.fromkeys(DECIDE_PARTS, 0.0)

        def timed(part: str, fn: Callable[..., Any], *args: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args)
            parts[part] += time.perf_counter() - start
            return out

        engine.synchronize()
        ws = engine.world_size
        ddp = next(c for c in self.costs if c.name == "ddp")
        pinned = engine.network.pinned and engine.network.model is not None
        link_check: dict | None = None  # a re-decision's check of the link before (or instead of) a probe
        source = "pinned" if pinned else "kept"  # where this decision's network came from
        dense_beta = latency = None  # β from a dense step that waited long on the network (dense_probe_s)
        dense = None  # (that step's wall, its wait on the network, the dense method it ran)
        if dense_wall_s is not None and dense_exposed_s is not None:  # the warm-up's profiled DDP step
            dense = (dense_wall_s, dense_exposed_s, ddp)
        elif drift_wall_s is not None and self.chosen is not None and candidate(self.chosen).compressor is None:
            # a drift window of a dense mode: its median step less the step the model gives it on a free network
            cost = next(c for c in self.costs if c.name == self.chosen)
            free = predict(cost, self.workload, NetworkModel(0.0, 0.0), ws).step_s
            dense = (drift_wall_s, drift_wall_s - free, cost)
        fall_check = self.canary or self._switch_check
        if not pinned and canary_s is not None and self.network is not None and fall_check is not None:
            # the link canary (or the switch check) saw a fall: β from its message, α as last looked at; never
            # faster than the model that gave the message far less time
            alpha0, latency_bytes = self.network.alpha_s, 0
            dense_beta = max((canary_s - alpha0) / ((ws - 1) * fall_check.nbytes), self.network.beta_s_per_byte)
        elif not pinned and probe and dense is not None and self.config.dense_probe_s \
                and dense[1] >= self.config.dense_probe_s:
            if dense_wall_s is None and self.network is not None:
                # a dense mode's drifted window: α from the last look at the link, no latency round. Why: right
                # after the steps of a fallen link that round took 38-73 ms on the quickstart MLP and 0.33-0.49 s
                # on `mlp` (10 Mbit/s), and the β solved from a step that waited 0.1 s or more on the network
                # barely depends on α; a probe measures α again at the next periodic look (docs/auto.md)
                alpha0, latency_bytes = self.network.alpha_s, 0
            else:
                latency = timed("latency", self._probe_latency)
                # agreed before β is solved from it, so that every rank solves the same equation
                alpha0 = agree_values([latency.min_times_s[0]], "max", engine.process_group, engine.device)[0]
                latency_bytes = latency.sizes_bytes[0]
            # what the model already charges to other_s (calibrated at the warm-up; 0 there) is not the link's
            dense_beta = beta_from_dense_step(dense[0] - self.workload.other_s, self.workload, dense[2], alpha0, ws,
                                              latency_bytes=latency_bytes)
        if pinned:  # network_alpha_s/beta given: no probe, and the user's figures are not recalibrated
            self.network = engine.network.model
        elif dense_beta is not None:  # the dense step measured the link: no bandwidth probe
            alpha = max(alpha0 - dense_beta * latency_bytes, 0.0)
            self.network, self.beta_scale = NetworkModel(alpha, dense_beta), 1.0
            source = "canary" if canary_s is not None else "dense_step"
            # the link check's reference: the model's time for the message a probe would have settled on
            # (modelled_check_s), not a timed one. Without a reference the first periodic re-decision probed
            # in full (0.5 s at 20 Mbit/s on the quickstart MLP); timing it cost 0.27-0.37 s of the decision
            # where the quickstart's link fell to 10 Mbit/s, a message that decision did not need
            # (docs/auto.md). The first check's own time replaces it.
            self.probe_bytes = check_bytes(self.network, self._probe_start())
            self.probe_time_s, self.probe_time_modelled = modelled_check_s(self.network, self.probe_bytes), True
        elif probe or self.network is None:
            source = "probe"
            if check_link and probe and dense_wall_s is None and self.network is not None and self.config.probe_check \
                    and self.probe_bytes > 0 and self.probe_time_s > 0:
                (check_s, check_beta), retimed = timed("check", self._check_link), False
                if not link_unchanged(check_s, self.probe_time_s, self.config.probe_check):
                    # a message that looks moved is timed once more and the faster kept: this host's
                    # scheduling only adds time. One check on `lm` at 20 Mbit/s read 0.40 s against
                    # 0.12 s, the full probe that followed read the link at half its rate, and auto
                    # left the method it was on (docs/auto.md). Every rank agreed the first time, so
                    # every rank times the second message.
                    (check_s, check_beta), retimed = min((check_s, check_beta), timed("check", self._check_link)), True
                link_check = {"check_s": check_s, "probe_s": self.probe_time_s, "bytes": self.probe_bytes,
                              "unchanged": link_unchanged(check_s, self.probe_time_s, self.config.probe_check),
                              "retimed": retimed, "reference": "modelled" if self.probe_time_modelled else "measured"}
                source = "check" if link_check["unchanged"] else "probe"
                if link_check["unchanged"] and self.probe_time_modelled:  # measured on the same link: the reference
                    self.probe_time_s, self.probe_time_modelled = check_s, False
                if not link_check["unchanged"] and check_s >= PROBE_TARGET_S / 4 and check_beta > 0:
                    # moved, and the check's message is bandwidth-bound at its size (where the probe would
                    # stop growing it): the check was one round of the probe's measurement. β from its
                    # slope, α kept (a latency round timed now would wait behind the check's bytes in the
                    # shaper's queue). Why: when the quickstart's link fell to 10 Mbit/s under a periodic
                    # re-probe, the full probe after the check made that step 1.79 s (docs/auto.md)
                    self.network = NetworkModel(self.network.alpha_s, check_beta * self.beta_scale)
                    self.probe_time_s, self.probe_time_modelled, source = check_s, False, "check_slope"
                    link_check["beta_s_per_byte"] = check_beta
            if source == "probe":  # no check, or a moved one that could not measure β itself
                probed = timed("probe", self._probe, latency)
                if dense_wall_s is not None:  # the profiled DDP step bounds the link's β from above
                    beta = calibrate_beta(dense_wall_s, self.workload, ddp, probed, ws)
                    self.beta_scale = beta / probed.beta_s_per_byte if probed.beta_s_per_byte > 0 else 1.0
                self.network = NetworkModel(probed.alpha_s, probed.beta_s_per_byte * self.beta_scale)
        if not engine.network.pinned:
            engine.adopt_network(self.network)  # AR-Topk's per-step choice uses it; auto owns re-probing
        if dense_wall_s is not None:
            other = calibrate_other(dense_wall_s, self.workload, ddp, self.network, ws)
            w = self.workload
            self.workload = Workload(w.forward_s, w.backward_s, w.numels, w.optimizer_s, other)
            # the profiled steps ran DDP's path and `other` makes its prediction their wall: measured
            self._corrections.setdefault("ddp", 0.0)
            self._correction_beta.setdefault("ddp", self.network.beta_s_per_byte)
        running_figure = self._running_figure(trigger, source)
        valid, settled, shift_from, shift = self._model_inputs()
        self._check_inputs_agree(step, trigger, valid, shift, dense_wall_s, drift_wall_s)
        sample: list[tuple[Tensor, GroupContext, float]] = []

        def time_codec(name: str) -> list[MethodCost]:
            # the best is a lower bound: time its codec (the policy decides again, until the best is timed)
            if not sample:
                sample.append(timed("codecs", self._live_sample))
            timed("codecs", self._time_codecs, [name], sample[0])
            assert self.costs is not None
            return self.costs

        last = self.history[-1] if self.history else None
        decision = policy.decide(policy.DecisionInputs(
            trigger, tuple(self.costs), self.workload, self.network, ws, self.config, valid, tuple(settled), shift,
            self.chosen, self._explore_left, force, self.in_family_trial,
            last.get("previous") if last is not None else None), time_codec)
        self._explore_left = decision.explore_left
        best, preds, held, timed_codecs = (decision.chosen, decision.predictions, decision.held_by_margin,
                                           list(decision.timed_codecs))
        switch_check = None
        if policy.needs_switch_check(trigger, probe, canary_s is not None, self._switch_check is not None
                                     and self.network is not None, self.chosen, best, self._dense_names):
            assert self._switch_check is not None
            # about to leave a compressed method for a dense mode on a network last looked at earlier: a link that
            # fell meanwhile would cost a whole dense step at the fallen rate before the one-step test
            res = timed("check", self._sing_switch_check)
            switch_check = {"fell": res.fell, "fastest_s": res.fastest_s, "predicted_s": res.predicted_s,
                            "messages": res.messages, "bytes": self._switch_check.nbytes}
            if res.fell:
                rank_zero_info(f"lightning_gc auto: before leaving {self.chosen!r} for {best!r} ({trigger.value}), one "
                               f"{self._switch_check.nbytes} B message per rank took {1e3 * res.fastest_s:.1f} ms on the "
                               f"fastest rank (twice), {1e3 * (res.predicted_s or 0.0):.2f} ms on the network model: the "
                               "link fell, re-deciding on it")
                self._decide(step, Trigger.DRIFT, probe=True, check_link=False, canary_s=res.fastest_s,
                             detail="switch_check")
                if self.history:
                    self.history[-1]["switch_check"] = switch_check
                return
        previous = self.chosen
        if best != previous:
            self._apply(best)
            self._gain_interval = self.config.gain_every  # a new method: its errors looked at as often as at first
        self.chosen, self.predictions = best, preds
        # a decision that keeps the method on the link it measured keeps its references: a calibration (it was
        # just measured), and a periodic or gain re-decision that did not measure the link anew (a link check
        # that found it unchanged, or the stored network). Why: the reference window after such a decision
        # measured whatever came next as the new normal; on the quickstart MLP the periodic re-probe kept
        # `lowrank` one step before 10 Mbit/s went back to 1 Gbit/s, and `lowrank` ran to the end of the run
        # on the fast link where fp16 runs at half its step (docs/auto.md)
        kept = policy.keeps_reference(trigger, source, best, previous, self._reference is not None)
        if not kept:
            self._reference, self._drifted, self._window, self._settling = None, 0, [], True
            self._run_medians = []
            self._recent, self._recent_exchange, self._reference_exchange = [], [], None
            self._window_exchange = []
        self._last_decision_step = step
        if probe or dense_wall_s is not None:
            self._last_link_step = step
            # a periodic look that found the link as it was and kept the method: look again twice as late
            # (probe_every_max); anything else that looked at the link starts from probe_every again
            self._link_interval = policy.next_link_interval(trigger, source, best, previous, self._link_interval,
                                                            self.config.probe_every, self.config.probe_every_max)
        entry = {"step": step, "trigger": trigger.value, "chosen": best, "previous": previous,
                 "network": [self.network.alpha_s, self.network.beta_s_per_byte], "probe_bytes": self.probe_bytes,
                 "beta_scale": self.beta_scale, "link_check": link_check, "network_source": source,
                 "dense_exposed_s": dense_exposed_s,
                 "workload": self.workload.as_dict(), "costs": [c.as_dict() for c in self.costs],
                 "predictions": {k: v.as_dict() for k, v in preds.items()},
                 # a decision that kept its reference was measured by it already
                 "dense_wall_s": dense_wall_s, "measured_step_s": self._reference if kept else None,
                 "kept_reference": kept,
                 "corrections": dict(valid), "settled": settled, "shift_s": shift, "shift_from": shift_from,
                 "explore_left": self._explore_left,
                 # steps from the last look at the link to the next periodic re-decision (probe_every_max)
                 "link_interval": self._link_interval,
                 # the codecs this decision timed, in order (each one's lower bound was the best when it was
                 # timed; time_codecs="on_demand")
                 "timed_codecs": timed_codecs,
                 # a measured method that led the running one by less than switch_margin, which stayed (at the
                 # end of a dense sibling's trial: the sibling, which led the mode it interrupted by less)
                 "held_by_margin": held,
                 # the running method's figure from all its windows since its reference (None: not used)
                 "running_figure_s": running_figure,
                 # which test saw a drift: "window" (moderate, patience), "severe_window", "steps", "step",
                 # "exchange" (severe_steps), "reference_window"
                 "drift_test": detail,
                 # a gain or calibration move from a compressed method to a dense mode timed the link first
                 # (_switch_check): what it saw (None: no such move, or no check on this group)
                 "switch_check": switch_check,
                 # the decision in one plain sentence (also logged)
                 "sentence": policy.sentence(decision, self.network, self._dense_names)}
        # replicated state: the slowest rank's times, like every other figure here (one agreement for all)
        took = agree_values([time.perf_counter() - t0] + [parts[k] for k in DECIDE_PARTS], "max",
                            engine.process_group, engine.device)
        entry["decide_s"] = took[0]
        entry["decide_parts_s"] = dict(zip(DECIDE_PARTS, took[1:]))
        self.history.append(entry)
        bw = self.network.bandwidth_bits_per_s
        checked = "" if link_check is None else (
            f" (link check: {1e3 * link_check['check_s']:.1f} ms vs {1e3 * link_check['probe_s']:.1f} ms "
            f"{'modelled after a dense step measured the link' if link_check['reference'] == 'modelled' else 'at the last probe'}"
            f", {'unchanged, not re-probed' if link_check['unchanged'] else 'changed, β from the check' if source == 'check_slope' else 'changed, re-probed'})")
        shifted = (f"methods not yet measured predicted {1e3 * -shift:.1f} ms under the raw model (the least "
                   f"speed-up of {', '.join(shift_from)}); ") if shift else ""
        notes = (f"timed the codecs of {', '.join(timed_codecs)} (their lower bound led); "
                 if timed_codecs else "")
        if held is not None:
            kept_mode = "the mode its trial interrupted comes back" if held == previous else "the running method stays"
            notes += (f"{held!r} leads by less than switch_margin "
                      f"({100 * self.config.switch_margin:g}%), so {kept_mode}; ")
        rank_zero_info(f"lightning_gc auto (step {step}): {entry['sentence']}")
        head = (f"lightning_gc auto ({trigger.value}, step {step}): network α={1e3 * self.network.alpha_s:.3f} ms, "
                f"{bw / 1e6:.1f} Mbit/s{checked}; {shifted}{notes}")
        if best == previous:
            nxt = (f"; next periodic look at the link in {self._link_interval} steps"
                   if trigger == Trigger.PERIODIC and self.config.probe_every else "")
            rank_zero_info(head + f"kept {best!r} (predicted {1e3 * preds[best].step_s:.1f} ms/step){nxt}")
        else:
            rank_zero_info(head + f"chose {best!r}" + (f" (was {previous!r})" if previous else "") + "\n"
                           + table(preds, best))

    def _calibrate(self, step: int, measured_s: float) -> None:
        """Every reference window sets the running method's correction: its measured step minus the
        raw model's prediction (what the model does not see: the engine's worker and agreements,
        Python per step, contention, its own collective), tagged with the network it was measured on.
        If the method had no valid correction before (it had not run, or only on another network),
        the choice is made again at once without a new probe (trigger ``"calibration"``): see
        :func:`choose_measured`. So it is, too, after a re-decision that switched to a method
        already measured here (:meth:`_switched_on_an_older_figure`). Otherwise a method already
        measured on this network just keeps the newer figure (no re-decision; at a later decision
        ``switch_margin`` keeps two measured methods from taking turns, see :meth:`_hold_or_switch`)."""
        chosen = self.chosen
        assert chosen is not None and self.costs is not None and self.network is not None
        was_valid = chosen in self._valid_corrections()
        # the last decision's predictions used the corrections (and shift) its history entry records
        raw = self.predictions[chosen].step_s - policy.overhead_in(self.history[-1], chosen)
        self._corrections[chosen] = measured_s - raw
        self._correction_beta[chosen] = self.network.beta_s_per_byte
        if self.in_family_trial:  # the sibling's window: choose among what has been measured
            self._decide(step, "calibration", probe=False)
            return
        sibling = self._dense_sibling(chosen, measured_s - raw, measured_s)
        if sibling is not None:
            self._decide(step, "family", probe=False, force=sibling)
            return
        if not was_valid or self._switched_on_an_older_figure():
            self._decide(step, "calibration", probe=False)

    def _running_figure(self, trigger: str, source: str) -> float | None:
        """At a ``gain`` or ``periodic`` re-decision on the link the running method was measured on
        (the network kept, or a link check that found it unchanged), set the running method's
        correction from the median of its windows since its reference window (at least
        :data:`RUN_FIGURE_MIN_WINDOWS` of them), not from the reference window alone; returns that
        median (None when not used). Replicated: the windows' medians are agreed.

        Why: one 5-step window on a host shared by 4 ranks is off by 10-20 % often enough to decide.
        On ``cnn`` width 16 at 1 Gbit/s the 16-bit mode's reference window read 200.7 ms while its
        next 50 steps averaged 169.5 ms; the ``gain`` re-decision at step 72 weighed the 200.7 ms
        against DDP's 193.0 ms and switched, and DDP ran 174-183 ms from there
        (docs/auto-measurements.md)."""
        chosen = self.chosen
        if (trigger not in ("gain", "periodic") or source not in ("check", "kept", "pinned") or chosen is None
                or chosen not in self._corrections or len(self._run_medians) < RUN_FIGURE_MIN_WINDOWS
                or not self.history or chosen not in self.predictions):
            return None
        figure = statistics.median(self._run_medians)
        raw = self.predictions[chosen].step_s - policy.overhead_in(self.history[-1], chosen)
        self._corrections[chosen] = figure - raw
        return figure

    def _switched_on_an_older_figure(self) -> bool:
        """Whether the last decision switched on an older figure (:func:`policy.switched_on_an_older_figure`)."""
        return policy.switched_on_an_older_figure(self.history[-1] if self.history else None)
    @property
    def in_family_trial(self) -> bool:
        """Whether a dense sibling is running its one window (the last decision was its trial)."""
        return bool(self.history) and self.history[-1]["trigger"] == "family"

    @property
    def in_trial(self) -> bool:
        """Whether the running method is on trial, its window not measured yet: a dense sibling's one
        window (:attr:`in_family_trial`), a method an exploration installed (a ``"calibration"``
        decision) that has no correction on this link, or a method a re-decision switched to on an
        older figure (:meth:`_switched_on_an_older_figure`). Derived from the history and the
        corrections, so a checkpoint carries it and every rank reads the same."""
        if not self.history:
            return False
        trigger = self.history[-1]["trigger"]
        return (trigger == "family" or (trigger == "calibration" and self.chosen not in self._valid_corrections())
                or self._switched_on_an_older_figure())

    def _windowed(self) -> set[str]:
        """The methods measured in a window of their own (:func:`policy.windowed`; from the history, so a
        checkpoint carries it)."""
        return policy.windowed(self.history)
    def _dense_sibling(self, chosen: str, correction: float, measured_s: float) -> str | None:
        """The dense mode to run next for one window (step 6 of the module docstring; :func:`policy.dense_sibling`)."""
        dense = [c for c in self.config.candidates if c in self._dense_names]
        return policy.dense_sibling(chosen, correction, measured_s, dense, self.predictions, self._valid_corrections(),
                                    self._windowed(), self.history[-1], self.config.family_margin)
    def _link_moved_under(self, measured: Sequence[float]) -> bool:
        """Whether a reference window's median is ``severe_drift`` times or more off the running
        method's prediction although that prediction carried the method's own correction, measured
        in a window on this link: then the window, not the model, is what changed (the link moved
        between the decision and the window). A method not yet measured so is expected to be off
        (that is what its first window calibrates), and is never judged here.

        Why: on the quickstart MLP, with the link falling from 1 Gbit/s to 10 Mbit/s at step 100,
        auto switched to fp16 (measured before, 19.5 ms) at step 100; the switch's reference window
        fell on the slow link and read 222 ms, and that became the drift reference, so no later
        window looked drifted: fp16 ran 222 ms steps until the periodic re-probe at step 200, where
        Top-k ran 36 ms (docs/auto.md).

        ``measured``: a window's median (one value), or the last few steps' times (the every-step
        test); judged by :func:`steps_apart`."""
        sv, predicted = self.config.severe_drift, self._calibrated_prediction()
        return bool(sv) and predicted is not None and steps_apart(list(measured), predicted, sv)

    def _calibrated_prediction(self) -> float | None:
        """The running method's predicted step when that prediction carries the method's own
        correction, measured in a window on this link (see :meth:`_link_moved_under`); else None."""
        chosen = self.chosen
        if chosen is None or not self.history or chosen not in self.predictions:
            return None
        calibrated = chosen in (self.history[-1].get("corrections") or {}) and chosen in self._windowed()
        return self.predictions[chosen].step_s if calibrated else None

    def _valid_corrections(self) -> dict[str, float]:
        """The corrections measured on a network like the current one (:func:`policy.valid_corrections`)."""
        return policy.valid_corrections(self._corrections, self._correction_beta, self.network)
    def _probe(self, latency: Any = None) -> NetworkModel:
        """α from 64-byte ring shifts timed before any large message, β from the slope between two
        larger shifts, ``S/4`` and ``S`` bytes (each rank's medians, then the MAX), ``S`` grown from
        :data:`PROBE_START_BYTES` until its message is bandwidth-bound (:func:`next_probe_bytes`).

        Not one least-squares line over interleaved sizes (the probe's default): on tc-shaped links a
        large message's send completes while its bytes still sit in the shaper's queue, and the small
        message timed next waits behind them. Fitted that way, α came out at 1.4-17 ms, and taken from
        the 64-byte message of the interleaved run at 3-105 ms (quickstart, 4 ranks, 1 Gbit/s to
        20 Mbit/s), while Top-k's measured 31 ms steps at 20 Mbit/s, with ~20 α-terms per step in the
        model, bound α below 2 ms; that error alone decided against every engine candidate."""
        engine = self.engine
        small = latency if latency is not None else self._probe_latency()  # the warm-up's may have run already

        rounds = []

        def measure(size: int) -> tuple[float, float]:
            # a warm-up run in the first round only: a grown round reuses the connections it warmed
            # (at 1 MiB + 256 KiB and 1 Gbit/s a warm-up run is ~11 ms)
            large = probe_network(engine.process_group,
                                  ProbeConfig(sizes_bytes=(probe_small_bytes(size), size), warmup=0 if rounds else 1,
                                              repeats=3),
                                  device=engine.device)
            rounds.append(size)
            (s0, s1), (t0, t1) = large.sizes_bytes, large.median_times_s
            beta, t_large = agree_values([max((t1 - t0) / (s1 - s0), 0.0), t1], "max", engine.process_group,
                                         engine.device)
            return beta, t_large

        beta, self.probe_bytes, self.probe_time_s = probe_bandwidth(
            measure, self._probe_start())
        self.probe_time_modelled = False
        # each rank's fastest 64-byte shift, not its median: on 2 cores shared by 4 ranks a median of
        # 2.5 ms was read once where other runs read 0.2-0.3 ms, and with ~20 α-terms per compressed
        # step that alone put every compressor above the 16-bit hook at 20 Mbit/s (docs/auto.md)
        alpha = max(small.min_times_s[0] - beta * small.sizes_bytes[0], 0.0)
        a = agree_values([alpha], "max", engine.process_group, engine.device)[0]
        return NetworkModel(a, beta)

    def _probe_start(self) -> int:
        """The bandwidth probe's first message for this model (:func:`probe_start_bytes`)."""
        return probe_start_bytes(4 * sum(p.numel() for p in self.params))

    def _probe_latency(self) -> Any:
        """The latency round (:data:`PROBE_LATENCY`), timed before any large message; ``min_times_s[0]``
        is this rank's fastest 64-byte shift (not agreed: the caller agrees what it derives)."""
        return probe_network(self.engine.process_group, PROBE_LATENCY, device=self.engine.device)

    def _check_link(self) -> tuple[float, float]:
        """One message of the last probe's size, after its small partner (the order the probe
        times them in), timed on every rank: returns that message's time, compared with the probe's
        by :func:`link_unchanged`, and the slope between the two messages (β, as one round of the
        probe's own measurement would give it; used when the link moved, see :meth:`_decide`), both
        agreed (MAX). About a quarter of a full probe's traffic, and no latency round."""
        engine = self.engine
        size = self.probe_bytes
        small = probe_small_bytes(size)
        r = probe_network(engine.process_group, ProbeConfig(sizes_bytes=(small, size), warmup=0, repeats=1),
                          device=engine.device)
        t0, t1 = r.median_times_s
        slope = max((t1 - t0) / (size - small), 0.0) if size > small else 0.0
        t1, slope = agree_values([t1, slope], "max", engine.process_group, engine.device)
        return t1, slope

    def _apply(self, name: str) -> None:
        engine = self.engine
        cand = candidate(name)
        if cand.compressor is None:
            engine.set_dense_mode(cand.dense_mode)
            return
        for g in engine.plan.groups:
            if not g.exact:
                engine.set_group_method(g.gid, cand.spec())
        engine.set_dense_mode(None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {
            # copies: the state of this moment, not lists that later decisions append to
            "version": 2, "chosen": self.chosen, "history": copy.deepcopy(self.history),
            "workload": self.workload.as_dict() if self.workload is not None else None,
            "costs": [c.as_dict() for c in self.costs] if self.costs is not None else None,
            "network": [self.network.alpha_s, self.network.beta_s_per_byte] if self.network is not None else None,
            "reference": self._reference, "drifted": self._drifted, "settling": self._settling,
            "reference_exchange": self._reference_exchange, "run_medians": list(self._run_medians),
            "corrections": dict(self._corrections), "explore_left": self._explore_left,
            "correction_beta": dict(self._correction_beta),
            "last_decision_step": self._last_decision_step, "last_link_step": self._last_link_step,
            "link_interval": self._link_interval, "gain_interval": self._gain_interval,
            "last_gain_step": self._last_gain_step, "gain_checks": copy.deepcopy(self.gain_checks), "beta_scale": self.beta_scale,
            "sampling": bool(self._sample_handles), "warmup_steps": int(self.engine.config.warmup_steps),
            "probe_bytes": self.probe_bytes, "probe_time_s": self.probe_time_s,
            "probe_time_modelled": self.probe_time_modelled,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 2:
            raise ValueError(f"unsupported auto chooser state version {state.get('version')!r}: this version reads 2 "
                             "(version 1, per-family corrections, was written before the per-method ones); resume "
                             "with the lightning_gc that wrote the checkpoint, or start the run anew.")
        self.chosen = state["chosen"]
        self.history = list(state["history"])
        wl = state.get("workload")
        self.workload = None if wl is None else Workload(wl["forward_s"], tuple(wl["backward_s"]), tuple(wl["numels"]),
                                                         wl["optimizer_s"], wl["other_s"])
        costs = state.get("costs")
        self.costs = None if costs is None else [MethodCost(**c) for c in costs]
        net = state.get("network")
        self.network = None if net is None else NetworkModel(*net)
        if self.network is not None and not self.engine.network.pinned:
            self.engine.adopt_network(self.network)
        self._reference, self._drifted = state.get("reference"), int(state.get("drifted", 0))
        self._settling = bool(state.get("settling", True))
        self._corrections = {str(k): float(v) for k, v in state.get("corrections", {}).items()}
        # written before corrections were tagged with their network: every correction counts as current
        self._correction_beta = {str(k): float(v) for k, v in state.get("correction_beta", {}).items()}
        self._explore_left = int(state.get("explore_left", self.config.explore))
        self._last_decision_step = state.get("last_decision_step")
        # written before the periodic re-probe counted from the last look at the link: the last decision
        self._last_link_step = state.get("last_link_step", self._last_decision_step)
        # written before the interval doubled: probe_every
        self._link_interval = int(state.get("link_interval", self.config.probe_every))
        # written before the re-measurement's interval doubled: gain_every
        self._gain_interval = int(state.get("gain_interval", self.config.gain_every))
        # written before the errors were re-measured: the last decision's step stands for the last measurement
        self._last_gain_step = state.get("last_gain_step", self._last_decision_step)
        self.gain_checks = list(state.get("gain_checks", []))
        self._run_medians = [float(v) for v in state.get("run_medians", [])]  # older checkpoints: none yet
        self.beta_scale = float(state.get("beta_scale", 1.0))  # written before the calibration: none
        # written before the link check: no reference, so the next re-decision probes in full
        self.probe_bytes, self.probe_time_s = int(state.get("probe_bytes", 0)), float(state.get("probe_time_s", 0.0))
        self.probe_time_modelled = bool(state.get("probe_time_modelled", False))  # before: always measured
        if self.chosen is not None and state.get("warmup_steps") is not None:  # an early end of the warm-up
            self.engine.shorten_warmup_steps(int(state["warmup_steps"]))
        self._window = []
        self._recent, self._recent_pending = [], None  # walls of the process that saved: not carried
        self._carried_walls = {}
        self._recent_exchange, self._window_exchange = [], []
        self._reference_exchange = state.get("reference_exchange")
        self._t_prev_end = None
        if self.chosen is not None:
            self._remove_hooks()
            self._disarm_sample()
            if state.get("sampling"):  # saved between arming a sampled step and measuring it
                self._arm_sample()
            if self.history:
                preds = self.history[-1]["predictions"]
                self.predictions = {k: Prediction(**v) for k, v in preds.items()}

    def close(self, timeout: float = 60.0) -> None:
        self._remove_hooks()
        self._disarm_sample()
        if self._recent_pending is not None:  # every rank issued it: wait, so no collective is left in flight
            self._recent_pending[1]()
            self._recent_pending = None
