"""OMGS on a running job: profile backward, fit the cost models, plan, watch, re-plan.

:class:`OMGSController` is built by :class:`~lightning_gc.GCStrategy` for ``plan="omgs"`` /
``"omgs_paper"`` (and, with ``omgs=...`` given, for any plan: it then only predicts). Its life:

1. **Profile**: a ``register_post_accumulate_grad_hook`` on every trainable parameter stamps when
   its gradient is ready, relative to the start of backward (the end of the DDP module's forward,
   stamped by a forward hook). Which steps are stamped is ``OMGSConfig.profile_on``:

   * ``"compressed"`` (default): the compressed steps of the provisional plan (``omgs:provisional``,
     the MGS threshold plan), after the engine's own warm-up; the process's first step and the first
     ``profile_skip_steps`` compressed steps are skipped. No dense step is added. The stamps are
     taken while the engine's worker runs the provisional plan's groups (error feedback, selection,
     the exchange) and nothing is subtracted: on a CPU the worker competes with backward for the
     cores, and the profile includes that, as the steps the plan will run do (docs/omgs.md gives
     the measured difference to dense steps). With ``overlap=False`` the exchanges run inside
     backward and would be counted as backward, so that combination is refused here
     (:meth:`~lightning_gc.config.GCConfig.from_flat` switches it to ``"dense"``).
   * ``"dense"``: dense warm-up steps ``1 + skip .. 1 + skip +
     profile_steps - 1``; the strategy raises ``warmup_steps`` to ``dense_steps_needed``.

   Which steps count is decided from replicated values only (the step counter, whether the step was
   dense), so every rank profiles the same steps. Per parameter the median over the profiled steps
   is taken, then the **MAX over ranks** (one float64 allreduce), so every rank plans from the same
   numbers; the result fills :class:`~lightning_gc.plans.ParamFacts` ``backward_s``.
2. **Fit** (at the step boundary after the profile, on every rank at once): the worker's group
   job — copy, error feedback, ‖p‖², the active exchange (compressor + collective), residual,
   write-back — is run on random groups of geometrically spaced sizes. The exchange's own timer
   gives the seconds inside the collectives (``t_c``); the rest of the job is ``t_s`` (selection
   plus the memory-bound work around it, all of which occupies the worker). Medians per size, MAX
   over ranks, then Eq. 10 and Eq. 11 are fitted (:mod:`lightning_gc.plans.omgs_fit`); the exact
   group's allreduce and the per-step open/close collectives are timed too. Fits and residuals
   are logged.
3. **Plan**: the planner named by ``plan`` runs on the agreed facts (identical on every rank), and
   :meth:`GCEngine.replace_plan` installs it (error memory remapped by name, signature verified).
4. **Watch and re-plan**: every compressed step's measured time from the start of backward until
   backward returned (DDP waits for the engine's Futures, so this includes non-overlapped
   communication) is compared with the model's prediction for the plan in force. Every
   ``replan_window`` steps the window's median is agreed by MAX over ranks; if it differs from the
   prediction by more than ``replan_drift`` (fraction), the cost models are re-fitted and the plan
   rebuilt — on every rank, at the same step boundary. The backward profile is kept.
   :meth:`request_replan` forces the same at the next step boundary (call it on every rank).
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from .._validation import check_int
from ..comm.exchange import ExchangeTimes, Timer, error_feedback_residual
from ..compressors.base import GroupContext
from ..plans import ParamFacts, Plan, PlanRequest, get_planner
from ..plans.omgs import GroupTimes, OMGSCost, partition_from_plan, predict_plan
from ..plans.omgs_fit import LineFit, SparsifyFit, fit_comm, fit_line, fit_sparsify
from .agreement import StepReport, agree_values
from .ports import EngineView, PlanControl
from .session import StepParticipant

log = logging.getLogger(__name__)

OMGS_PLANS = ("omgs", "omgs_paper")
#: the values of ``OMGSConfig.profile_on``
PROFILE_ON = ("compressed", "dense")


@dataclass(frozen=True)
class OMGSConfig:
    """How OMGS profiles, fits and re-plans.

    Attributes:
        profile_on: which steps the backward profile is taken on. ``"compressed"`` (default): the
            compressed steps of the provisional plan, so OMGS adds no dense step to the engine's
            own warm-up; the stamps include what the engine's worker takes from backward's cores
            (nothing is subtracted; docs/omgs.md). ``"dense"``: dense warm-up steps, as before;
            ``warmup_steps`` is raised to :attr:`dense_steps_needed`.
        profile_skip_steps: steps ignored before the profile: with ``"compressed"`` the first
            compressed steps (first selection, exchange buffers, error memory), with ``"dense"``
            the dense steps after the first (bucket rebuild, allocator warm-up).
        profile_steps: steps whose gradient-ready times are profiled (median taken; ≥ 20 is
            robust on a shared machine, fewer is faster).
        sparsify_on: ``"worker"`` (this engine: selection runs on the exchange worker) or
            ``"compute"`` (the paper's model: selection delays backward).
        calibration_sizes: number of group sizes timed for the fits (geometric, from
            ``min_compress_numel`` to the compressible model size capped at
            ``calibration_max_numel``).
        calibration_repeats: timed runs per size (after one untimed run); the median is used.
        calibration_max_numel: largest group timed (caps the fit's cost on big models).
        replan_drift: re-fit and re-plan when the measured step time differs from the prediction
            by more than this fraction (0 disables).
        replan_window: compressed steps per drift check (one 8-byte allreduce per window).
        tie_tolerance: ``plan="omgs"`` takes the plan with the fewest groups whose modelled
            iteration time is within this fraction of the minimum (0.02 = 2 %; 0 = the minimum,
            fewest groups only among exact ties). Per-message costs the model does not see make
            fewer groups the safer choice when plans are this close (docs/omgs.md).
    """

    profile_skip_steps: int = 2
    profile_steps: int = 20
    sparsify_on: str = "worker"
    calibration_sizes: int = 6
    calibration_repeats: int = 5
    calibration_max_numel: int = 1 << 22
    replan_drift: float = 0.3
    replan_window: int = 20
    tie_tolerance: float = 0.02
    profile_on: str = "compressed"

    def __post_init__(self) -> None:
        check_int("OMGSConfig.profile_skip_steps", self.profile_skip_steps, 0, "Use e.g. 2.")
        check_int("OMGSConfig.profile_steps", self.profile_steps, 1, "Use ≥ 20 for a robust median.")
        check_int("OMGSConfig.calibration_sizes", self.calibration_sizes, 2, "A line needs two sizes; use e.g. 6.")
        check_int("OMGSConfig.calibration_repeats", self.calibration_repeats, 1, "Use e.g. 5.")
        check_int("OMGSConfig.calibration_max_numel", self.calibration_max_numel, 2, "Use e.g. 4194304.")
        check_int("OMGSConfig.replan_window", self.replan_window, 1, "Use e.g. 20 steps.")
        if self.profile_on not in PROFILE_ON:
            raise ValueError(
                f"OMGSConfig.profile_on={self.profile_on!r} is invalid: use 'compressed' (profile backward on the "
                "provisional plan's compressed steps, no extra dense step; the default) or 'dense' (profile on "
                "dense warm-up steps: warmup_steps is raised to 1 + profile_skip_steps + profile_steps)."
            )
        if self.sparsify_on not in ("worker", "compute"):
            raise ValueError(f"OMGSConfig.sparsify_on={self.sparsify_on!r} is invalid: use 'worker' (this engine) "
                             "or 'compute' (the paper's model).")
        if isinstance(self.replan_drift, bool) or not isinstance(self.replan_drift, (int, float)) \
                or not self.replan_drift >= 0:
            raise ValueError(f"OMGSConfig.replan_drift={self.replan_drift!r} must be a fraction ≥ 0 "
                             "(e.g. 0.3 = 30%; 0 disables re-planning).")
        if isinstance(self.tie_tolerance, bool) or not isinstance(self.tie_tolerance, (int, float)) \
                or not 0 <= self.tie_tolerance < 1:
            raise ValueError(f"OMGSConfig.tie_tolerance={self.tie_tolerance!r} must be a fraction in [0, 1) "
                             "(e.g. 0.02 = within 2% of the modelled minimum; 0 = exact ties only).")

    @property
    def dense_steps_needed(self) -> int:
        """Dense warm-up steps the profile needs: 0 with ``profile_on="compressed"`` (the engine's own
        warm-up is kept); with ``"dense"`` step 0 (DDP bucket rebuild), the skipped and profiled steps."""
        return 1 + self.profile_skip_steps + self.profile_steps if self.profile_on == "dense" else 0

    @classmethod
    def coerce(cls, value: OMGSConfig | dict | None) -> OMGSConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            try:
                return cls(**value)
            except TypeError as e:
                raise ValueError(f"omgs={value!r}: {e}. Valid keys: {list(cls.__dataclass_fields__)}.") from None
        raise ValueError(f"omgs={value!r} must be an OMGSConfig, a dict of its fields, or None.")


@dataclass
class Calibration:
    """What the fit step measured (agreed over ranks) and fitted."""

    numels: list[int]
    payload_bytes: list[float]
    sparsify_s: list[float]
    comm_s: list[float]
    sparsify: SparsifyFit
    comm: LineFit
    payload: LineFit
    exact_s: float
    overhead_s: float


@dataclass
class OMGSState:
    """What the controller knows; read by GCMonitor and the benchmark."""

    plan: Plan | None = None
    predicted_s: float | None = None  # model's backward-window time of the plan in force
    timeline: list[GroupTimes] = field(default_factory=list)
    ordered: list[tuple[str, int, float]] = field(default_factory=list)  # (name, numel, ready s), ready order
    predictions: dict[str, float] = field(default_factory=dict)  # the static baselines' predictions
    measured_s: list[float] = field(default_factory=list)  # this rank's measured windows, compressed steps
    last_measured_s: float | None = None
    calibration: Calibration | None = None
    replans: int = 0
    plan_version: int = 0


class OMGSController(StepParticipant):
    """Profiler, fitter and (re-)planner for one engine. All methods are called on every rank.

    A participant of the :class:`~lightning_gc.engine.session.StepSession`: it times the closure
    (:meth:`wrap_closure`), profiles, fits and plans after each step (:meth:`after_optimizer_step`),
    owns the merge plan with ``plan="omgs"``/``"omgs_paper"`` (only predicts otherwise), re-plans
    when the compression ratio changes (:meth:`on_ratio_change`: the plan was fitted at the old
    ratio), and its checkpoint state (the agreed backward profile) is replicated.

    Raises:
        ValueError: the active exchange keeps state (the fit would disturb it), or
            ``profile_on="compressed"`` with an engine that runs its exchanges inside backward
            (``overlap=False``: the stamps would count them as backward; use ``profile_on="dense"``).
    """

    name = "omgs"
    state_scope = "replicated"

    def __init__(self, engine: EngineView, config: OMGSConfig, module: torch.nn.Module,
                 named_parameters: list[tuple[str, Tensor]], plan_kind: str) -> None:
        if engine.exchange.state_dict():
            raise ValueError(
                f"plan={plan_kind!r} times the active exchange ({engine.exchange.name}, the collective of "
                f"compressor={engine.compressor.name!r}) on random data to fit its cost, which would disturb this "
                "exchange's state (it remembers earlier steps); use a stateless collective (e.g. allgather) or "
                "plan='layer'/'model'."
            )
        if config.profile_on == "compressed" and not getattr(engine.config, "overlap", True):
            raise ValueError(
                "OMGSConfig(profile_on='compressed') with overlap=False: the engine runs every compressed exchange "
                "inside backward, so the gradient-ready stamps would count selection and communication as backward. "
                "Use omgs={'profile_on': 'dense'} (GCStrategy does this for overlap=False and raises warmup_steps "
                "to cover the profile), or overlap=True."
            )
        self.engine = engine
        self.config = config
        self.plan_kind = plan_kind
        self.replace = plan_kind in OMGS_PLANS
        self.owns_plan = self.replace  # type: ignore[misc] # per instance: a predict-only controller owns nothing
        self._plan_control: PlanControl = engine  # type: ignore[assignment] # the session re-binds it
        self.names = [n for n, _ in named_parameters]
        self.params = [p for _, p in named_parameters]
        self.state = OMGSState()
        self._stamps: dict[int, float] = {}
        self._profile: list[list[float]] = []  # per profiled step: ready seconds per param
        self._steps_seen = 0  # step boundaries this instance saw while profiling (replicated)
        self._skipped = 0  # eligible steps skipped so far (profile_skip_steps; replicated)
        self._t_backward = 0.0
        self._t_end = 0.0
        self._profiling = True
        self._in_closure = False
        self._window: list[float] = []
        self._replan_requested = False
        self.backward_s: list[float] | None = None
        self._param_handles: list[Any] = []
        self._install_param_hooks()
        self._forward_handle: Any = module.register_forward_hook(self._on_forward)

    # ------------------------------------------------------------------ read-only views
    @property
    def profiling(self) -> bool:
        """Whether the controller is taking its profile (its per-parameter hooks are installed)."""
        return self._profiling

    @property
    def profile(self) -> list[list[float]]:
        """The profiled steps so far (a copy): per step, each parameter's ready time in seconds."""
        return [list(row) for row in self._profile]

    @property
    def hooks_installed(self) -> int:
        """How many per-parameter gradient hooks are installed (0 once the profile is taken)."""
        return len(self._param_handles)

    # ------------------------------------------------------------------ stamps (autograd thread)
    def _install_param_hooks(self) -> None:
        if not self._param_handles:
            self._param_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                                   for i, p in enumerate(self.params)]

    def _remove_param_hooks(self) -> None:
        """The per-parameter hooks: ~µs each, not needed once the profile is taken."""
        for h in self._param_handles:
            h.remove()
        self._param_handles = []

    def _set_profiling(self, on: bool) -> None:
        self._profiling = on
        if on:
            self._install_param_hooks()
        else:
            self._remove_param_hooks()

    def _make_hook(self, pid: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            if self._in_closure and self._profiling:
                self._stamps[pid] = time.perf_counter()
        return hook

    def _on_forward(self, *_: Any) -> None:
        if self._in_closure:
            self._t_backward = time.perf_counter()
            self._stamps.clear()

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The optimizer closure, timed: forward end → backward returned (after DDP's Futures)."""
        def timed() -> Any:
            self._in_closure = True
            self._t_backward = time.perf_counter()
            try:
                out = closure()
            finally:
                self._in_closure = False
            self._t_end = time.perf_counter()
            return out
        return timed

    def bind_plan(self, control: PlanControl) -> None:
        self._plan_control = control

    def detach(self) -> None:
        self._remove_param_hooks()
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None

    def close(self, timeout: float = 60.0) -> None:
        self.detach()

    def after_optimizer_step(self) -> None:
        self.after_step()

    def on_ratio_change(self, ratio: float) -> None:
        """The plan and its prediction were fitted at the old ratio: re-fit and re-plan."""
        self.request_replan()

    def snapshot(self) -> dict:
        """Exact copy of what a step may change (rollback exploration), the plan in force included."""
        return copy.deepcopy({
            "state": self.state, "window": self._window, "replan": self._replan_requested,
            "profiling": self._profiling, "profile": self._profile, "backward_s": self.backward_s,
            "seen": self._steps_seen, "skipped": self._skipped,
        }) | {"plan": self.engine.plan}

    def restore(self, snapshot: dict) -> None:
        """Put the snapshot back. A rollback that crossed the end of the profile (an exploration
        started while OMGS was still profiling compressed steps) puts the profile back too: its
        hooks are re-installed and the profile goes on from where the snapshot was taken."""
        snap = copy.deepcopy({k: v for k, v in snapshot.items() if k != "plan"})
        self.state, self._window, self._replan_requested = snap["state"], snap["window"], snap["replan"]
        self._profile, self.backward_s = snap["profile"], snap["backward_s"]
        self._steps_seen, self._skipped = snap["seen"], snap["skipped"]
        if snap["profiling"] != self._profiling:
            self._set_profiling(snap["profiling"])
        if self.engine.plan.signature() != snapshot["plan"].signature():
            self._plan_control.replace_plan(snapshot["plan"], verify=False)

    def state_dict(self) -> dict:
        """The agreed backward profile (identical on all ranks), for checkpoints."""
        return {"backward_s": None if self.backward_s is None else list(self.backward_s), "names": list(self.names)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the profile; the cost models are re-fitted and the plan rebuilt at the next step
        boundary (the network and the machine may have changed since the checkpoint)."""
        prof = state.get("backward_s")
        if prof is None or list(state.get("names", [])) != self.names:
            return  # saved before profiling finished, or another model: profile again
        self.backward_s = [float(x) for x in prof]
        self._profile = []
        if self._profiling:
            self._set_profiling(False)
        self._replan_requested = True

    def request_replan(self) -> None:
        """Re-fit and re-plan at the next step boundary (call on every rank)."""
        self._replan_requested = True

    # ------------------------------------------------------------------ step boundary (main thread)
    def after_step(self) -> None:
        """Call after every optimizer step, on every rank."""
        engine = self.engine
        step = engine.step - 1  # the step that just finished
        stats = engine.last_step  # waits for the step's communication
        if stats is None or step < 0:
            return
        window = self._t_end - self._t_backward
        if self._profiling:
            cfg = self.config
            self._steps_seen += 1
            if self._profiled(step, stats.dense) and self._stamps:
                self._profile.append(self._row())
            if len(self._profile) >= cfg.profile_steps:
                self._finish_profile()
                self._plan_now("profiled")
            elif cfg.profile_on == "dense" and not stats.dense:  # the dense warm-up is over
                if self._profile:  # fewer dense steps than profile_steps: plan from those
                    self._finish_profile()
                    self._plan_now("profiled")
                elif engine.world_size > 1:
                    # no profile could be taken (too few dense steps): say so once, keep the plan in force
                    self._set_profiling(False)
                    log.warning("lightning_gc OMGS: no dense step was profiled (warmup_steps too small); the plan "
                                "stays %s.", engine.plan.kind)
            return
        if self._replan_requested:
            self._replan_requested = False
            self._window = []
            self._plan_now("requested")
            return
        if stats.dense or engine.world_size == 1:
            return
        self.state.last_measured_s = window
        self.state.measured_s.append(window)
        self._window.append(window)
        if self.config.replan_drift > 0 and len(self._window) >= self.config.replan_window:
            measured = self._agree_max([statistics.median(self._window)])[0]
            self._window = []
            pred = self.state.predicted_s
            if pred and abs(measured - pred) / pred > self.config.replan_drift:
                log.info("lightning_gc OMGS: measured %.2f ms vs predicted %.2f ms (drift > %.0f%%): re-planning",
                         1e3 * measured, 1e3 * pred, 100 * self.config.replan_drift)
                self._plan_now("drift")

    # ------------------------------------------------------------------ internals
    def _profiled(self, step: int, dense: bool) -> bool:
        """Whether the step that just ended is profiled; from replicated values only (the step
        counter, dense or not, how many boundaries this instance saw), so all ranks agree."""
        cfg = self.config
        if cfg.profile_on == "dense":
            return dense and step >= 1 + cfg.profile_skip_steps
        if dense or self._steps_seen <= 1:  # the process's first step: DDP's lazy set-up, first allocations
            return False
        if self._skipped < cfg.profile_skip_steps:
            self._skipped += 1
            return False
        return True

    def _row(self) -> list[float]:
        """Ready seconds per parameter of the step that just ended. A parameter without a stamp (no
        gradient this step: DDP marks it ready when backward ends) takes the step's last stamp."""
        last = max(self._stamps.values())
        return [self._stamps.get(i, last) - self._t_backward for i in range(len(self.params))]

    def _agree_max(self, values: list[float]) -> list[float]:
        """Element-wise MAX over ranks (identical on every rank afterwards; a seam the tests wrap)."""
        if self.engine.world_size == 1:
            return [float(v) for v in values]
        return agree_values(values, "max", self.engine.process_group, self.engine.device)

    def _finish_profile(self) -> None:
        self._set_profiling(False)
        medians = [statistics.median(col) for col in zip(*self._profile)]
        self.backward_s = self._agree_max([max(m, 0.0) for m in medians])
        on = "compressed steps of the provisional plan" if self.config.profile_on == "compressed" else "dense steps"
        rank_zero_info(f"lightning_gc OMGS: profiled {len(self._profile)} {on}; backward "
                       f"{1e3 * max(self.backward_s, default=0.0):.2f} ms (MAX over ranks), {len(self.backward_s)} tensors")

    def _request(self, cost: OMGSCost) -> PlanRequest:
        cfg = self.engine.config
        facts = tuple(ParamFacts(i, n, p.numel(), self.backward_s[i] if self.backward_s else None)
                      for i, (n, p) in enumerate(zip(self.names, self.params)))
        return PlanRequest(facts, threshold=cfg.plan_threshold, min_compress_numel=cfg.min_compress_numel,
                           compress=self.engine.compressor.lossy, network=self.engine.network, cost=cost)

    def _plan_now(self, reason: str) -> None:
        engine = self.engine
        if engine.world_size == 1 or self.backward_s is None:
            return
        self._replan_requested = False  # this plan is fitted now, at the ratio in force
        cal = self.calibrate()
        cost = OMGSCost(
            gamma_s=cal.sparsify.gamma_s, ratio=float(engine.compressor.ratio) if engine.compressor.has_ratio else 1.0,
            alpha_s=cal.comm.intercept, beta_s_per_byte=cal.comm.slope,
            payload_bytes_per_element=cal.payload.slope, payload_bytes_fixed=cal.payload.intercept,
            sparsify_intercept_s=cal.sparsify.intercept_s, exact_s=cal.exact_s, overhead_s=cal.overhead_s,
            sparsify_on=self.config.sparsify_on,  # type: ignore[arg-type]
            tie_tolerance=float(self.config.tie_tolerance),
        )
        request = self._request(cost)
        plan = get_planner(self.plan_kind)(request) if self.replace else engine.plan
        if self.replace and plan.signature() != engine.plan.signature():
            self._plan_control.replace_plan(plan)
        predicted, tl = predict_plan(plan, request)
        s = self.state
        s.plan, s.predicted_s, s.timeline, s.calibration = plan, predicted, tl, cal
        s.ordered = [(p.name, p.numel, float(p.backward_s or 0.0)) for p in partition_from_plan(plan, request)[0]]
        s.predictions = {}
        for kind in ("model", "layer", "threshold", "omgs", "omgs_paper"):
            try:
                s.predictions[kind] = predict_plan(get_planner(kind)(request), request)[0]
            except ValueError:  # a plan the timeline cannot describe
                pass
        s.plan_version += 1
        s.replans += int(reason != "profiled")
        pr = {k: 1e3 * s.predictions.get(k, math.nan) for k in ("model", "layer", "threshold", "omgs")}
        rank_zero_info(
            f"lightning_gc OMGS ({reason}): t_s = {cal.sparsify.intercept_s:.3g} s + {cal.sparsify.gamma_s:.3g} s·ρ·D·lnD "
            f"(ρ={cost.ratio:g}; rel. residuals max {100 * max(abs(r) for r in cal.sparsify.residuals):.0f}%), "
            f"t_c = {cal.comm.intercept:.3g} s + {cal.comm.slope:.3g} s/B·bytes (max {100 * cal.comm.max_abs_residual:.0f}%), "
            f"exact {cal.exact_s:.3g} s, overhead {cal.overhead_s:.3g} s; plan {plan.kind}: "
            f"{sum(1 for g in plan.groups if not g.exact)} groups, predicted {1e3 * predicted:.2f} ms (model "
            f"{pr['model']:.2f}, layer {pr['layer']:.2f}, threshold {pr['threshold']:.2f}, omgs {pr['omgs']:.2f})"
        )

    def calibration_sizes(self) -> list[int]:
        cfg = self.engine.config
        big = [p.numel() for p in self.params if p.numel() >= cfg.min_compress_numel]
        hi = max(min(sum(big), self.config.calibration_max_numel), 4)
        lo = max(min(cfg.min_compress_numel, hi // 2), 2)
        n = self.config.calibration_sizes
        return sorted({int(round(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)})

    def _time_group_job(self, src: Tensor, mem: Tensor, out: Tensor, ctx: GroupContext) -> tuple[float, float]:
        """One group job as the engine's worker runs it (flatten, error feedback, ‖p‖², exchange,
        residual, write-back): (seconds outside the collectives, seconds inside them)."""
        engine = self.engine
        cuda = src.is_cuda
        if cuda:
            torch.cuda.synchronize(src.device)
        t0 = time.perf_counter()
        p = src.clone()
        if engine.error_feedback:
            p.add_(mem)
        float(torch.linalg.vector_norm(p, dtype=torch.float32))
        times = ExchangeTimes()
        timer = Timer(src.device, times)
        mean, sent = engine.exchange.run(p, ctx, timer)
        if engine.error_feedback:
            error_feedback_residual(p, sent, in_place=True)
        out.copy_(mean)
        if cuda:
            torch.cuda.synchronize(src.device)
        total = time.perf_counter() - t0
        timer.resolve()
        return max(total - times.comm_s, 0.0), times.comm_s

    def calibrate(self) -> Calibration:
        """Time the active exchange over sizes (on every rank, between steps) and fit Eq. 10-11."""
        engine = self.engine
        engine.synchronize()  # the worker is idle: this thread may issue on the exchange group
        dev, dtype = engine.device, self.params[0].dtype
        gen = torch.Generator(device="cpu").manual_seed(engine.config.seed + 7919 * engine.rank + engine.step)
        sizes = self.calibration_sizes()
        local_s, local_c, nbytes = [], [], []
        for i, d in enumerate(sizes):
            ctx = GroupContext(step=engine.step, rank=engine.rank, world_size=engine.world_size, segments=(d,),
                               group_id=1_000_000 + i, seed=engine.config.seed, device=dev)
            nbytes.append(float(sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                                    for shape, dt in engine.compressor.payload_specs(ctx, dtype))))
            ts, tc = [], []
            src = torch.randn(d, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype)
            mem = torch.randn(d, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype).mul_(0.1)
            out = torch.empty_like(src)
            for r in range(self.config.calibration_repeats + 1):
                ts_r, tc_r = self._time_group_job(src, mem, out, ctx)
                if r > 0:
                    ts.append(ts_r)
                    tc.append(tc_r)
            local_s.append(statistics.median(ts))
            local_c.append(statistics.median(tc))
        exact = [g for g in engine.plan.groups if g.exact]
        exact_local, over_local = 0.0, 0.0
        if exact:
            n = exact[0].numel
            ctx = GroupContext(step=engine.step, rank=engine.rank, world_size=engine.world_size,
                               segments=(n,), group_id=2_000_000, seed=engine.config.seed, device=dev)
            runs = []
            for r in range(self.config.calibration_repeats + 1):
                times = ExchangeTimes()
                timer = Timer(dev, times)
                t0 = time.perf_counter()
                engine.exact_exchange.run(torch.zeros(n, dtype=dtype, device=dev), ctx, timer)
                timer.resolve()
                if r > 0:
                    runs.append(time.perf_counter() - t0)
            exact_local = statistics.median(runs)
        # the closing report's shape; the opening check runs every check_every steps only (agreement.py)
        small = StepReport().to_tensor(dev)
        runs = []
        for r in range(self.config.calibration_repeats + 1):
            t0 = time.perf_counter()
            dist.all_reduce(small, group=engine.exchange_group)
            if r > 0:
                runs.append(time.perf_counter() - t0)
        over_local = statistics.median(runs)
        agreed = self._agree_max(local_s + local_c + [exact_local, over_local])
        k = len(sizes)
        ts_med, tc_med = agreed[:k], agreed[k:2 * k]
        eps = 1e-9  # a timer can read 0 on a very fast call; the fits need positive times
        cal = Calibration(
            numels=sizes, payload_bytes=nbytes, sparsify_s=ts_med, comm_s=tc_med,
            sparsify=fit_sparsify(sizes, [max(t, eps) for t in ts_med],
                                  float(engine.compressor.ratio) if engine.compressor.has_ratio else 1.0),
            comm=fit_comm(nbytes, [max(t, eps) for t in tc_med]),
            payload=fit_line(sizes, nbytes, "payload bytes"),
            exact_s=agreed[2 * k], overhead_s=agreed[2 * k + 1],
        )
        for d, b, s_, c_ in zip(sizes, nbytes, ts_med, tc_med):
            log.info("lightning_gc OMGS calibration: D=%d payload=%d B t_s=%.3g s (fit %.3g) t_c=%.3g s (fit %.3g)",
                     d, b, s_, cal.sparsify(d), c_, cal.comm(b))
        return cal
