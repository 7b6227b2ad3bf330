"""``AdaptiveRatio``: the Lightning Callback that keeps choosing the compression ratio while training.

Life of a run (all on every rank, at optimizer-step boundaries, from replicated values only):

1. **Warm-up.** The engine sends dense for ``warmup_steps`` optimizer steps (the controller raises
   the strategy's ``warmup_steps`` to its own if lower).
2. **Exploration** (trigger ``warmup``): every candidate ratio is measured —
   in ``shadow`` mode on the next ``shadow_steps`` live steps (the engine's group observer hands
   the controller each group's error-fed gradient; nothing extra is sent), in ``rollback`` mode
   by training each candidate ``steps_per_candidate`` real steps on the last training batches and
   restoring the snapshot taken before (:class:`~lightning_gc.adaptive.snapshot.TrainingSnapshot`).
3. **Decision** (:func:`~lightning_gc.adaptive.decision.decide`): NSGA-II over ``c`` and the
   collective, one point by ASF (or pseudo-weights); applied with ``GCEngine.set_ratio`` (from the
   next step, compared across ranks).
4. **Re-exploration** when the smoothed gain moved by ``gain_threshold`` from its reference (taken
   ``settle_steps`` after the decision) or the probed network moved by ``network_threshold``, at
   least ``min_interval`` steps after the previous exploration.

Logged (rank zero, through the Trainer's loggers): ``adaptive/c`` and ``adaptive/collective`` every
logged step (next to GCMonitor's ``gc/ratio``), and at each decision ``adaptive/decision_c``,
``adaptive/decision_collective``, ``adaptive/trigger``, ``adaptive/explore_s``,
``adaptive/calibration``, ``adaptive/step_ms``, each candidate's ``adaptive/gain@c=…``, ``adaptive/t_comp_ms@c=…`` and
``adaptive/t_sync_ms@c=…``, and — with a TensorBoard logger and matplotlib — a figure of the Pareto
front (``adaptive/pareto_front``). See docs/adaptive.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from typing import Any, cast

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..comm.cost_model import SPARSE_COLLECTIVE_TIE_ORDER, NetworkModel
from ..comm.hierarchy import refusal
from ..comm.probe import ProbeConfig
from ..compressors import build_config
from ..engine.owner import SessionOwner
from ..engine.ports import EngineControl, LinkPort
from ..exchanges.registry import collective_code
from .config import AdaptiveConfig
from .decision import Decision, decide
from .objectives import (
    CandidateResult,
    ObjectiveData,
    ShadowScorer,
    agree,
    calibration,
    collective_choices,
    predicted_sync_s,
)
from .snapshot import TrainingSnapshot

STATE_VERSION = 1
TRIGGER_CODES = {"warmup": 0, "gain": 1, "network": 2}
#: the controller's network probe (when the engine keeps no model): up to 1 MiB, so that a probe on
#: a slow link stays around a second
PROBE = ProbeConfig(sizes_bytes=(64, 16384, 262144, 1048576), warmup=1, repeats=5)
#: the controller's name among the link observer's clients
LINK_CLIENT = "adaptive"


class AdaptiveRatio(Callback):
    """Choose the compression ratio ``c`` (and the collective) by NSGA-II while training runs.

    Use with a :class:`~lightning_gc.GCStrategy` whose compressor takes a ratio (Top-k family,
    AR-Topk, RandomK)::

        Trainer(strategy=GCStrategy(compressor="artopk_auto"), callbacks=[AdaptiveRatio(mode="shadow")])

    All arguments are those of :class:`~lightning_gc.adaptive.config.AdaptiveConfig` (see it, and
    docs/adaptive.md, for what each does and how to tune it), plus ``log_figures``: write a figure
    of the Pareto front at each decision (needs matplotlib and a TensorBoard logger).

    Bad input is refused at construction (``c_min ≥ c_max``, ratios outside (0, 1], weights that do
    not sum to a positive number) or at ``setup`` (a compressor without a ratio, a strategy that is
    not a GCStrategy), with the value, the reason and the fix.
    """

    def __init__(
        self,
        mode: str = "shadow",
        c_min: float = 0.001,
        c_max: float = 0.1,
        factor: float = 3.0,
        shadow_steps: int = 3,
        steps_per_candidate: int = 5,
        weights: tuple[float, float, float] = (0.3, 0.3, 0.4),
        rule: str = "asf",
        normalise: str = "step",
        pop_size: int = 40,
        n_gen: int = 40,
        seed: int = 0,
        warmup_steps: int = 20,
        gain_threshold: float = 0.1,
        network_threshold: float = 0.5,
        probe_every: int = 50,
        min_interval: int = 50,
        settle_steps: int = 10,
        calibrate: bool = True,
        log_figures: bool = True,
    ) -> None:
        self.config = AdaptiveConfig(
            mode=mode, c_min=c_min, c_max=c_max, factor=factor, shadow_steps=shadow_steps,  # type: ignore[arg-type]
            steps_per_candidate=steps_per_candidate, weights=weights, rule=rule,  # type: ignore[arg-type]
            normalise=normalise,  # type: ignore[arg-type]
            pop_size=pop_size, n_gen=n_gen, seed=seed, warmup_steps=warmup_steps, gain_threshold=gain_threshold,
            network_threshold=network_threshold, probe_every=probe_every, min_interval=min_interval,
            settle_steps=settle_steps, calibrate=calibrate,
        )
        if not isinstance(log_figures, bool):
            raise ValueError(f"log_figures={log_figures!r} must be True or False.")
        self.log_figures = log_figures
        #: every decision: step, trigger, objective data, the decision, overhead (checkpointed)
        self.history: list[dict] = []
        self.c: float | None = None
        self.collective: str | None = None
        self.last_explore_step: int | None = None
        self.decision_step: int | None = None
        self.gain_ref: float | None = None
        self.net_ref: tuple[float, float] | None = None
        self.pending_trigger: str | None = None
        self._shadow: ShadowScorer | None = None
        self._shadow_comm: list[float] = []
        self._shadow_trigger: str | None = None
        self._last_seen = -1
        self._step_end: float | None = None  # when the last optimizer step's hook finished
        self._step_times: deque = deque(maxlen=20)  # recent training-step wall times (s), local
        self._batches: deque = deque(maxlen=self.config.steps_per_candidate)
        self._loaded: dict | None = None

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _strategy(trainer: Any):
        strategy = trainer.strategy
        if not isinstance(strategy, SessionOwner):
            raise ValueError(
                f"AdaptiveRatio needs a lightning_gc GCStrategy, got {type(strategy).__name__}: it changes the "
                "compression ratio of the strategy's engine. Use Trainer(strategy=GCStrategy(compressor='topk'), ...) "
                "or strategy='gc_topk'."
            )
        return strategy

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = self._strategy(trainer)
        name = strategy.compressor_name
        if strategy.config.auto is not None:
            raise ValueError(
                "AdaptiveRatio cannot run with compressor='auto': both would change the method in force between "
                "steps (auto chooses the compressor and its ratio from measured costs, docs/auto.md). Drop the "
                "callback, or pick a compressor with a ratio (e.g. compressor='artopk_auto') for AdaptiveRatio."
            )
        if strategy.config.topology.kind == "nodes":
            raise ValueError(refusal(collective=strategy.config.engine.collective, sync=strategy.config.sync,
                                     omgs=False, auto=False, adaptive=True))
        cfg = build_config(name)
        if not any(f.name == "ratio" for f in dataclasses.fields(cfg)):
            raise ValueError(
                f"AdaptiveRatio cannot tune compressor {name!r}: it has no ratio (fraction of elements kept) to "
                "choose. Use a compressor that takes one: topk, lwtopk, mstopk, randomk, star_topk, var_topk or "
                "artopk_auto (the latter also lets the controller pick the collective)."
            )
        if self.config.mode == "rollback" and not pl_module.automatic_optimization:
            raise ValueError(
                "AdaptiveRatio(mode='rollback') drives the candidates' steps itself and supports automatic "
                "optimization only; use mode='shadow' with manual optimization."
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        engine = self._engine(trainer)
        if engine is None:
            return
        if engine.topology.kind != "flat":  # topology="auto" measured the links and chose nodes
            raise ValueError(refusal(collective=engine.exchange.name, sync="bsp", omgs=False, auto=False, adaptive=True)
                             + f" (topology='auto' chose nodes: {engine.topology.chosen})")
        collective_choices(engine.exchange.name)  # refuses an exchange without a cost formula
        engine.raise_warmup_steps(self.config.warmup_steps)  # same Callback arguments on every rank
        if not engine.keeps_network_model:  # the engine's model, when it keeps one, is read instead
            cast(LinkPort, engine).link.subscribe(LINK_CLIENT, self.config.probe_every, at_start=True)
        if self._loaded is not None:
            self._apply_loaded(engine)

    @staticmethod
    def _engine(trainer: Any):
        engine = AdaptiveRatio._strategy(trainer).engine
        if engine is None or engine.world_size == 1:
            return None
        return engine

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.config.mode == "rollback":
            self._batches.append((batch, batch_idx))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine(trainer)
        if engine is None or engine.last_step is None:
            return
        s = engine.last_step
        if s.step == self._last_seen:  # a gradient-accumulation micro-batch: no new optimizer step
            return
        self._last_seen = s.step
        try:
            self._on_step(trainer, pl_module, engine, s)
        finally:
            # the next step's wall time starts here: this hook's own work (an exploration,
            # logging) is not part of a training step
            self._step_end = time.perf_counter()

    def _on_step(self, trainer: Any, pl_module: Any, engine: EngineControl, s: Any) -> None:
        now = time.perf_counter()
        if self._step_end is not None:
            self._step_times.append(now - self._step_end)
        step = engine.step  # optimizer steps completed
        if self._shadow is not None:
            self._shadow_comm.append(s.exchange_comm_s)
            if len(self._shadow_comm) >= self.config.shadow_steps:
                self._finish_shadow(trainer, engine, step)
        else:
            if self.gain_ref is None and self.decision_step is not None and engine.gain_ewma is not None \
                    and step >= self.decision_step + self.config.settle_steps:
                self.gain_ref = float(engine.gain_ewma)  # replicated: from the closing report's sums
            trigger = self.pending_trigger or self.trigger(engine, step)
            if trigger is not None:
                self.pending_trigger = None
                self._explore(trainer, pl_module, engine, step, trigger)
        self._log_step(pl_module, engine)

    def trigger(self, engine: EngineControl, step: int) -> str | None:
        """Why the controller would explore at ``step`` (``"warmup"``, ``"gain"``, ``"network"``), or None:
        a read of replicated state (the engine's agreed gain and link model), the same on every rank."""
        cfg = self.config
        if self.c is None:
            return "warmup" if step >= max(cfg.warmup_steps, engine.config.warmup_steps) else None
        assert self.last_explore_step is not None
        if step - self.last_explore_step < cfg.min_interval:
            return None
        g = engine.gain_ewma
        if self.gain_ref is not None and g is not None and self.gain_ref > 0 \
                and abs(g - self.gain_ref) / self.gain_ref >= cfg.gain_threshold:
            return "gain"
        net = self._network_model(engine, step, refresh=False)
        if net is not None and self.net_ref is not None and self._moved(net, self.net_ref):
            return "network"
        return None

    def _moved(self, net: NetworkModel, ref: tuple[float, float]) -> bool:
        thr = self.config.network_threshold
        for new, old in ((net.alpha_s, ref[0]), (net.beta_s_per_byte, ref[1])):
            if old > 0 and abs(new - old) / old >= thr:
                return True
            if old == 0 and new > 0:
                return True
        return False

    def _network_model(self, engine: EngineControl, step: int, refresh: bool) -> NetworkModel | None:
        """The agreed alpha-beta model, from the engine's link observer: the engine's model when it
        keeps one (probed or pinned), else the observer's last measurement, refreshed when the
        observer's schedule is due (``probe_every`` steps after the last probe of any client) and when
        ``refresh``."""
        link = cast(LinkPort, engine).link
        if engine.keeps_network_model and link.model is not None:
            return link.model
        if refresh or link.model is None or link.due(step):
            engine.synchronize()
            link.refresh(step, engine.process_group, engine.device, PROBE)
        return link.model

    # ------------------------------------------------------------------ exploration
    def _explore(self, trainer: Any, pl_module: Any, engine: EngineControl, step: int, trigger: str) -> None:
        self.last_explore_step = step
        if self.config.mode == "shadow":
            engine.synchronize()
            self._shadow = ShadowScorer(engine.compressor, self.config.candidates)
            self._shadow_comm = []
            self._shadow_trigger = trigger
            engine.set_group_observer(self._shadow)
            return
        t0 = time.perf_counter()
        results = self._rollback(trainer, pl_module, engine)
        self._decide(trainer, engine, step, trigger, results, measured_live=None,
                     overhead_s=time.perf_counter() - t0)

    def _finish_shadow(self, trainer: Any, engine: EngineControl, step: int) -> None:
        scorer, self._shadow = self._shadow, None
        assert scorer is not None
        engine.set_group_observer(None)
        results = scorer.results(engine.process_group, engine.device)
        live_comm = agree([sum(self._shadow_comm) / len(self._shadow_comm)], engine.process_group, engine.device)[0]
        # the extra work shadow mode did: the candidates' compressions (mean over ranks); the live
        # steps themselves were training steps
        self._decide(trainer, engine, step, self._shadow_trigger, results,
                     measured_live=(float(engine.compressor.ratio), live_comm),
                     overhead_s=sum(r.t_comp_s * r.steps for r in results))

    def _rollback(self, trainer: Any, pl_module: Any, engine: EngineControl) -> list[CandidateResult]:
        if not self._batches:
            raise RuntimeError("lightning_gc: rollback exploration found no cached training batch to run on.")
        batches = list(self._batches)
        optimizers = list(trainer.optimizers)
        schedulers = [cfg.scheduler for cfg in trainer.lr_scheduler_configs]
        strategy = self._strategy(trainer)
        # the session's snapshot covers the engine, every participant (OSP, OMGS) and the skip counter
        snap = TrainingSnapshot.capture(pl_module, optimizers, schedulers, session=strategy.session)
        sums: list[float] = []
        gains: list[list[float]] = []
        try:
            for c in self.config.candidates:
                engine.set_ratio(c)
                t_comp = t_sync = 0.0
                g: list[float] = []
                for b, idx in batches:
                    st = self._real_step(trainer, pl_module, engine, optimizers[0], b, idx)
                    t_comp += st.compress_time_s
                    t_sync += st.exchange_comm_s
                    if st.gain is not None:
                        g.append(st.gain)
                sums += [t_comp / len(batches), t_sync / len(batches)]
                gains.append(g)
                snap.restore()
        finally:
            snap.restore()
        vals = agree(sums, engine.process_group, engine.device)
        out = []
        for i, c in enumerate(self.config.candidates):
            gain = sum(gains[i]) / len(gains[i]) if gains[i] else math.nan  # replicated per-step gains
            out.append(CandidateResult(c=c, t_comp_s=vals[2 * i], gain=gain, t_sync_measured_s=vals[2 * i + 1],
                                       steps=len(batches)))
        return out

    @staticmethod
    def _real_step(trainer: Any, pl_module: Any, engine: EngineControl, optimizer: Any, batch: Any, batch_idx: int):
        """One real training step on ``batch`` outside Lightning's loop (logging muted).

        It goes through the strategy's ``optimizer_step`` like Lightning's own steps: the step
        session (engine, OSP, OMGS, the non-finite skip) and the precision plugin (gradient
        clipping, ``on_before_optimizer_step``) all take part."""
        strategy = trainer.strategy
        pl_module.log = _mute
        pl_module.log_dict = _mute

        def closure() -> Any:
            with torch.enable_grad():
                optimizer.zero_grad()
                out = strategy.training_step(batch, batch_idx)
                loss = out["loss"] if isinstance(out, dict) else out
                strategy.backward(loss, optimizer)
            return loss

        try:
            strategy.optimizer_step(optimizer, closure)
        finally:
            del pl_module.log
            del pl_module.log_dict
        return engine.last_step

    # ------------------------------------------------------------------ decision
    def _decide(self, trainer: Any, engine: EngineControl, step: int, trigger: str, results: list[CandidateResult],
                measured_live: tuple[float, float] | None, overhead_s: float) -> None:
        net = self._network_model(engine, step, refresh=True)
        assert net is not None  # refreshed above unless the engine's model was in force
        choices = collective_choices(engine.exchange.name)
        numels = tuple(g.numel for g in engine.plan.groups if not g.exact)
        value_bytes = engine.params[0].element_size()
        n = engine.world_size
        for r in results:
            r.t_sync_predicted_s = {k: predicted_sync_s(net, numels, n, r.c, k, value_bytes) for k in choices}

        def used(c: float) -> str:  # what the engine runs at c (auto_sparse: the model's cheapest)
            costs = {k: predicted_sync_s(net, numels, n, c, k, value_bytes) for k in choices}
            order = [k for k in SPARSE_COLLECTIVE_TIE_ORDER if k in choices] or list(choices)
            return min(order, key=lambda k: costs[k])  # first in tie order wins ties, like the engine

        cal = 1.0
        if self.config.calibrate:
            if measured_live is not None:
                c0, t0 = measured_live
                pred = predicted_sync_s(net, numels, n, c0, used(c0), value_bytes)
                cal = min(max(t0 / pred, 0.1), 10.0) if pred > 0 and t0 > 0 else 1.0
            else:
                cal = calibration(results, used)
        # the step time that scales the time objectives (normalise="step"): median of this rank's
        # recent steps (robust to a validation pass in between), mean over ranks
        recent = sorted(self._step_times)
        local = recent[len(recent) // 2] if recent else 0.0
        step_s = agree([local], engine.process_group, engine.device)[0]
        data = ObjectiveData(candidates=results, collectives=choices, alpha_s=net.alpha_s,
                             beta_s_per_byte=net.beta_s_per_byte, numels=numels, world_size=n,
                             value_bytes=value_bytes, calibration=cal, step_s=step_s)
        try:
            decision = decide(data, self.config)
        except ValueError as e:
            rank_zero_warn(f"lightning_gc: adaptive ratio kept c={engine.compressor.ratio!r} at step {step}: {e}")
            self.pending_trigger = None
            return
        # from the next step; compared across ranks; participants told (OMGS re-plans)
        self._strategy(trainer).session.set_ratio(decision.c)
        self.c, self.collective = decision.c, decision.collective
        self.decision_step, self.gain_ref = step, None
        self.net_ref = (net.alpha_s, net.beta_s_per_byte)
        entry = {"step": step, "trigger": trigger, "mode": self.config.mode, "c": decision.c,
                 "collective": decision.collective, "overhead_s": overhead_s, "data": data.as_dict(),
                 "decision": decision.as_dict()}
        self.history.append(entry)
        rank_zero_info(
            f"lightning_gc: adaptive ratio at step {step} ({trigger}, {self.config.mode}): c={decision.c:.4g} "
            f"collective={decision.collective} gains={[round(r.gain, 3) for r in results]} "
            f"overhead={overhead_s:.2f}s"
        )
        self._log_decision(trainer, step, entry, data, decision)

    # ------------------------------------------------------------------ logging
    def _log_step(self, pl_module: Any, engine: EngineControl) -> None:
        metrics = {"adaptive/c": float(engine.compressor.ratio) if not engine.step_is_dense() else 1.0}
        if self.collective is not None:
            metrics["adaptive/collective"] = collective_code(self.collective)
        for k, v in metrics.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    def _log_decision(self, trainer: Any, step: int, entry: dict, data: ObjectiveData, decision: Decision) -> None:
        if not trainer.is_global_zero or not trainer.loggers:
            return
        gstep = trainer.global_step
        metrics = {
            "adaptive/decision_c": decision.c,
            "adaptive/decision_collective": collective_code(decision.collective),
            "adaptive/trigger": float(TRIGGER_CODES[entry["trigger"]]),
            "adaptive/explore_s": entry["overhead_s"],
            "adaptive/calibration": data.calibration,
            "adaptive/step_ms": 1e3 * data.step_s,
            "adaptive/net_alpha_us": 1e6 * data.alpha_s,
            "adaptive/net_bandwidth_mbit": 8e-6 / data.beta_s_per_byte if data.beta_s_per_byte > 0 else float("inf"),
        }
        for r in data.candidates:
            tag = f"c={r.c:.4g}"
            metrics[f"adaptive/gain@{tag}"] = r.gain
            metrics[f"adaptive/t_comp_ms@{tag}"] = 1e3 * r.t_comp_s
            metrics[f"adaptive/t_sync_ms@{tag}"] = 1e3 * data.t_sync_s(r.c, decision.collective)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=gstep)
        if self.log_figures:
            from lightning.pytorch.loggers import TensorBoardLogger

            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    fig = pareto_figure(data, decision, title=f"step {step} ({entry['trigger']})")
                    if fig is not None:
                        logger.experiment.add_figure("adaptive/pareto_front", fig, global_step=gstep)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION, "c": self.c, "collective": self.collective, "history": self.history,
            "last_explore_step": self.last_explore_step, "decision_step": self.decision_step,
            "gain_ref": self.gain_ref, "net_ref": self.net_ref,
            # an exploration in progress (shadow) is not saved: it starts again after a resume
            "pending_trigger": self._shadow_trigger if self._shadow is not None else self.pending_trigger,
            "candidates": list(self.config.candidates),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(
                f"AdaptiveRatio state version {state_dict.get('version')!r} is not {STATE_VERSION}; resume with the "
                "lightning_gc version that wrote the checkpoint, or drop the callback state."
            )
        self._loaded = dict(state_dict)
        self.c, self.collective = state_dict["c"], state_dict["collective"]
        self.history = list(state_dict["history"])
        self.last_explore_step, self.decision_step = state_dict["last_explore_step"], state_dict["decision_step"]
        self.gain_ref = state_dict["gain_ref"]
        self.net_ref = tuple(state_dict["net_ref"]) if state_dict["net_ref"] is not None else None
        self.pending_trigger = state_dict["pending_trigger"]

    def _apply_loaded(self, engine: EngineControl) -> None:
        """After a resume: the engine's checkpoint restored its ratio; make sure it is the decided one."""
        self._loaded = None
        if self.c is not None and float(engine.compressor.ratio) != float(self.c):
            engine.set_ratio(self.c)


def _mute(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` during rollback steps (they must leave no trace)."""


def pareto_figure(data: ObjectiveData, decision: Decision, title: str = ""):
    """Matplotlib figure of one decision (``None`` without matplotlib).

    Left: the Pareto front in (step time = t_comp + t_sync, 1/gain), colour = log10 c, the chosen
    point starred, the measured candidates as crosses (at their model collective's time). Right: the
    three objectives against c (log axis), the chosen c as a vertical line.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import numpy as np

    from .decision import Objectives

    obj = Objectives(data)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4))
    front = decision.front
    t = np.array([1e3 * (f[2] + f[3]) for f in front])
    ig = np.array([f[4] for f in front])
    sc = ax0.scatter(t, ig, c=np.log10([f[0] for f in front]), cmap="viridis", s=18)
    fig.colorbar(sc, ax=ax0, label="log10 c")
    cand_t = [1e3 * (r.t_comp_s + data.t_sync_s(r.c, decision.collective)) for r in data.candidates]
    ax0.scatter(cand_t, [1 / r.gain for r in data.candidates], marker="x", color="k", label="measured candidates")
    ax0.scatter([1e3 * (decision.objectives[0] + decision.objectives[1])], [decision.objectives[2]], marker="*",
                s=200, color="r", label=f"chosen c={decision.c:.4g} ({decision.collective})")
    ax0.set_xlabel("t_comp + t_sync per step (ms)")
    ax0.set_ylabel("1 / gain")
    ax0.legend(fontsize=7)
    cs = np.exp(np.linspace(math.log(min(r.c for r in data.candidates)), math.log(max(r.c for r in data.candidates)), 200))
    for name in data.collectives:
        F = obj.at(cs, name)
        ax1.plot(cs, 1e3 * F[:, 1], label=f"t_sync {name} (ms)")
    F = obj.at(cs, data.collectives[0])
    ax1.plot(cs, 1e3 * F[:, 0], label="t_comp (ms)")
    ax1.set_xscale("log")
    ax1.set_xlabel("c (fraction kept)")
    ax1.set_ylabel("ms per step")
    ax2 = ax1.twinx()
    ax2.plot(cs, F[:, 2], "k--", label="1/gain")
    ax2.set_ylabel("1 / gain")
    ax1.axvline(decision.c, color="r")
    ax1.legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
