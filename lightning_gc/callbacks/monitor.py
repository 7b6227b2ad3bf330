"""GCMonitor: per-optimizer-step communication metrics to the Trainer's logger (TensorBoard).

Tags (all under ``gc/``; values are rank 0's view unless marked "all ranks"): docs/monitoring.md
describes the tags this module logs (tests/test_docs.py checks the literal ones), and beside them
``gc/auto_delta2/<m>``: with compressor="auto", candidate ``m``'s latest measured relative error (the
ranks' mean on local gradients; re-measured every ``auto_gain_every`` steps).

``gc/bytes_sent``, ``gc/bytes_dense`` and ``gc/bytes_ratio`` as GCMonitor writes them are the mean per
optimizer step over the steps since the previous written point (:class:`ByteWindow`; a change of
communication mode starts a new window), so that a schedule which sends in bursts — DiLoCo's outer
step every H steps, Marsit's full-precision rounds — cannot alias with ``log_every_n_steps``: the
written series averages to the bytes per step of the run. :func:`step_metrics` itself gives the
step's own bytes.

Logging frequency follows the Trainer's ``log_every_n_steps``, with one exception: the step where
communication changes mode (the first step, the first compressed step after warm-up, and any
later switch between dense, sample and compressed steps, :attr:`StepStats.mode`) is always
written, so the end of warm-up is visible in TensorBoard whatever ``log_every_n_steps`` is. On the
other steps the values are neither computed nor handed to ``self.log`` (Lightning would drop them;
the calls alone cost a few milliseconds per step), unless ``prog_bar=True``.

:func:`step_metrics` builds the tag dictionary from a strategy's engine (and its OMGS/OSP parts);
Lightning Fabric users log the same dictionary with ``fabric.log_dict`` (docs/fabric.md).

At the end of ``fit`` rank zero prints the strategy's :meth:`~lightning_gc.GCStrategy.summary`
(compressor and collective, compressed vs dense steps, bytes vs the dense equivalent, time in
compression and communication, skipped steps); ``GCMonitor(summary=False)`` turns it off.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .._validation import check_bool
from ..engine.stats import PHASE_MODES
from ..exchanges.registry import collective_code


def payload_fraction(s: Any, world_size: int) -> float:
    """Fraction of the dense fp32 payload this rank's payload took on step ``s`` (1.0 without one):
    ``bytes_payload`` over the gradient bytes, which ``bytes_dense`` holds times the ring's 2(N−1)/N."""
    if world_size <= 1 or not s.bytes_dense:
        return 1.0
    dense_payload = s.bytes_dense * world_size / (2 * (world_size - 1))
    return float(s.bytes_payload / dense_payload)


def step_ratio(engine: Any, s: Any) -> float:
    """``gc/ratio`` of step ``s``: 1.0 on steps sent exactly; on compressed steps the ``ratio``
    option in force for compressors that have one (Top-k family, RandomK: the fraction of elements
    kept, what ``ratio=`` or AdaptiveRatio set), otherwise — and on GradiVeQ's sample steps — the
    fraction of the dense fp32 payload the step's payload took."""
    mode = s.mode
    if mode == "dense":
        return 1.0
    if mode == "compressed" and engine.compressor.has_ratio:
        return float(s.ratio)
    return payload_fraction(s, engine.world_size)


class ByteWindow:
    """Bytes sent and dense-equivalent bytes of the optimizer steps since the last written point."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sent, self.dense, self.inter, self.steps = 0.0, 0.0, 0.0, 0

    def add(self, sent: float, dense: float, inter: float = 0.0) -> None:
        self.sent += sent
        self.dense += dense
        self.inter += inter
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        """``gc/bytes_*`` as the mean per step over the window, with ``gc/bytes_inter_node`` where
        some crossed between nodes (only ``topology="nodes"`` counts them)."""
        n = max(self.steps, 1)
        out = {"gc/bytes_sent": self.sent / n, "gc/bytes_dense": self.dense / n,
               "gc/bytes_ratio": self.sent / self.dense if self.dense else 1.0}
        if self.inter > 0:
            out["gc/bytes_inter_node"] = self.inter / n
        return out


def diloco_step_metrics(diloco: Any) -> dict[str, float]:
    """The ``gc/*`` tags of the optimizer step DiLoCo just took (``sync="diloco"``)."""
    o = diloco.last_stats
    outer = o is not None and o.inner_step == diloco.inner_step
    # by nodes (topology="nodes"), every inner step also sends the node mean of the gradients
    sent = (float(o.bytes_sent) if outer else 0.0) + float(diloco.inner_bytes)
    dense = float(diloco.dense_bytes_per_step)
    metrics = {
        "gc/diloco_outer_step": float(outer),
        "gc/bytes_sent": sent,
        "gc/bytes_dense": dense,
        "gc/bytes_ratio": sent / dense if dense else 1.0,
    }
    if diloco.nodes is not None:
        metrics["gc/bytes_inter_node"] = float(o.bytes_inter_node) if outer else 0.0
    if outer:
        metrics["gc/diloco_delta_norm"] = float(o.delta_norm)
        metrics["gc/diloco_comm_ms"] = 1e3 * o.comm_s
        metrics["gc/diloco_wait_ms"] = 1e3 * o.wait_s
        metrics["gc/diloco_fragment"] = float(o.fragment)
        metrics["gc/diloco_error_norm"] = float(o.error_norm)
        metrics["gc/diloco_discarded"] = float(o.discarded)
    return metrics


def auto_metrics(auto: Any) -> dict[str, float]:
    """``gc/auto_*`` of the method in force (docs/monitoring.md)."""
    if auto.chosen is None:
        return {"gc/auto_method": -1.0}
    out = {"gc/auto_method": float(list(auto.config.candidates).index(auto.chosen))}
    pred = auto.predictions.get(auto.chosen)
    if pred is not None:
        out["gc/auto_predicted_step_ms"] = 1e3 * pred.step_s
    measured = auto.history[-1].get("measured_step_s") if auto.history else None
    if measured is not None:
        out["gc/auto_measured_step_ms"] = 1e3 * measured
    if auto.gain_checks:  # the latest measured errors, acted on or not
        for name, d2 in auto.gain_checks[-1]["delta2"].items():
            out[f"gc/auto_delta2/{name}"] = float(d2)
    elif auto.costs is not None:
        for c in auto.costs:
            out[f"gc/auto_delta2/{c.name}"] = float(c.delta2)
    return out


def step_metrics(engine: Any, s: Any, omgs: Any = None, osp: Any = None) -> dict[str, float]:
    """The ``gc/*`` tags of step ``s`` (a :class:`~lightning_gc.engine.stats.StepStats` of
    ``engine``), with the OMGS controller's and OSP synchroniser's when given; the dictionary
    GCMonitor logs, and what Fabric users pass to ``fabric.log_dict``."""
    mode = s.mode
    metrics = {
        "gc/ratio": step_ratio(engine, s),
        "gc/dense_step": float(mode == "dense"),
        "gc/bytes_sent": float(s.bytes_sent),
        "gc/bytes_dense": float(s.bytes_dense),
        "gc/bytes_ratio": float(s.bytes_sent / s.bytes_dense) if s.bytes_dense else 1.0,
        "gc/compress_ms": 1e3 * s.compress_time_s,
        "gc/comm_ms": 1e3 * s.comm_time_s,
        "gc/error_norm": float(s.error_norm),
        "gc/nonfinite": float(s.nonfinite),
    }
    if s.bytes_inter_node:  # topology="nodes" (docs/topology.md)
        metrics["gc/bytes_inter_node"] = float(s.bytes_inter_node)
    if s.gain is not None:
        metrics["gc/gain"] = float(s.gain)
    if s.gain_ewma is not None:
        metrics["gc/gain_ewma"] = float(s.gain_ewma)
    if s.collective is not None:
        metrics["gc/collective"] = collective_code(s.collective)
        metrics["gc/exchange_comm_ms"] = 1e3 * s.exchange_comm_s
        if s.predicted_comm_s is not None:
            metrics["gc/predicted_comm_ms"] = 1e3 * s.predicted_comm_s
    if s.alpha_s is not None and s.beta_s_per_byte is not None:
        metrics["gc/net_alpha_us"] = 1e6 * s.alpha_s
        metrics["gc/net_bandwidth_mbit"] = 8e-6 / s.beta_s_per_byte if s.beta_s_per_byte > 0 else float("inf")
    if s.full_precision is not None:
        metrics["gc/full_precision"] = float(s.full_precision)
        metrics["gc/compensation_norm"] = float(s.error_norm)
    for key, value in (s.compressor_metrics or {}).items():
        metrics[f"gc/{key}"] = float(value)
    if any(key.split("/")[0] == engine.compressor.name for key in PHASE_MODES):  # GradiVeQ
        metrics["gc/sample_step"] = float(mode == "sample")
    if s.probe_s > 0:
        metrics["gc/probe_ms"] = 1e3 * s.probe_s
    if omgs is not None and not s.dense and omgs.state.predicted_s is not None:
        metrics["gc/omgs_predicted_ms"] = 1e3 * omgs.state.predicted_s
        if omgs.state.last_measured_s is not None:
            metrics["gc/omgs_measured_ms"] = 1e3 * omgs.state.last_measured_s
    o = osp.last_stats if osp is not None else None
    if o is not None:  # sync="osp": what the two-stage synchronisation did at this step
        metrics["gc/osp_ics_fraction"] = float(o.deferred_fraction)
        metrics["gc/osp_ics_layers"] = float(o.deferred_layers)
        metrics["gc/osp_importance_threshold"] = float(o.threshold)
        metrics["gc/osp_correction_norm"] = float(o.correction_norm)
        metrics["gc/osp_ics_wait_ms"] = 1e3 * o.ics_wait_s
        metrics["gc/osp_ics_comm_ms"] = 1e3 * o.ics_comm_s
        if o.umax is not None:
            metrics["gc/osp_umax_fraction"] = float(o.umax) / max(osp.total_numel, 1)
    return metrics


class GCMonitor(Callback):
    """Log lightning_gc engine statistics after every optimizer step.

    Args:
        prog_bar: also show ``gc/bytes_ratio`` and ``gc/gain_ewma`` in the progress bar
            (``Trainer(callbacks=[GCMonitor(prog_bar=True)])``; the strategy then adds no second one).
        summary: print the end-of-fit summary on rank zero.

    Logging frequency follows the Trainer's ``log_every_n_steps``; steps where communication
    switches between dense and compressed are always logged.
    """

    def __init__(self, prog_bar: bool = False, summary: bool = True) -> None:
        check_bool("prog_bar", prog_bar, "True also shows gc/bytes_ratio and gc/gain_ewma in the progress bar.")
        check_bool("summary", summary, "True prints the end-of-fit summary on rank zero.")
        self.prog_bar = prog_bar
        self.summary = summary
        self._last_step: object = -1  # an engine step, or ("diloco", inner step)
        self._last_mode: str | None = None
        #: optimizer steps (engine numbering) written outside the log_every_n_steps schedule
        self.forced_steps: list[int] = []
        self._omgs_figure_version = 0
        self._auto_logged = 0
        #: OMGS plan figures written (plan versions), for tests
        self.omgs_figures: list[int] = []
        self._bytes = ByteWindow()

    def _log_plan_figure(self, trainer: Any, state: Any) -> None:
        if not trainer.is_global_zero:
            return
        from .omgs_figure import plan_figure

        fig = plan_figure(state)
        if fig is None:
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            add_figure = getattr(getattr(logger, "experiment", None), "add_figure", None)
            if add_figure is not None:  # TensorBoard's SummaryWriter
                add_figure("gc/omgs_plan", fig, global_step=step)
                self.omgs_figures.append(state.plan_version)

    def _log_diloco(self, diloco: Any, pl_module: Any, writes: bool) -> None:
        key = ("diloco", diloco.inner_step)  # never equal to a per-step step under auto's switches
        if key == self._last_step:  # accumulation micro-batch: no new optimizer step
            return
        self._last_step = key
        metrics = diloco_step_metrics(diloco)
        self._bytes.add(metrics.pop("gc/bytes_sent"), metrics.pop("gc/bytes_dense"),
                        metrics.pop("gc/bytes_inter_node", 0.0))
        del metrics["gc/bytes_ratio"]
        if writes:  # the window's mean: with H = log_every_n_steps every written step is an outer step
            metrics.update(self._bytes.metrics())
            self._bytes.reset()
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        diloco = getattr(trainer.strategy, "diloco", None)
        if diloco is not None and diloco.active:  # under auto_diloco: only while DiLoCo runs
            self._log_diloco(diloco, pl_module, trainer._logger_connector.should_update_logs)
            return
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or engine.last_step is None:
            return
        s = engine.last_step
        if s.step == self._last_step:  # accumulation micro-batch: no new optimizer step
            return
        self._last_step = s.step
        mode = s.mode
        mode_changed = self._last_mode is None or mode != self._last_mode
        self._last_mode = mode
        if mode_changed:  # a written point never mixes dense and compressed steps
            self._bytes.reset()
        self._bytes.add(float(s.bytes_sent), float(s.bytes_dense), float(s.bytes_inter_node))
        auto = getattr(trainer.strategy, "auto", None)
        if auto is not None:
            self._log_auto_decision(trainer, auto)
        writes = trainer._logger_connector.should_update_logs
        if not (writes or mode_changed or self.prog_bar):
            # Lightning would drop these values (log_every_n_steps): computing and self.log-ing ~20 of
            # them every step can cost more than DDP's whole exchange on a small model
            return
        metrics = step_metrics(engine, s, getattr(trainer.strategy, "omgs", None),
                               getattr(trainer.strategy, "osp", None))
        metrics.update(self._bytes.metrics())
        if writes or mode_changed:  # written: the next point's window starts after this step
            self._bytes.reset()
        omgs = getattr(trainer.strategy, "omgs", None)
        if omgs is not None and not s.dense and omgs.state.predicted_s is not None:
            if omgs.state.plan_version != self._omgs_figure_version:
                self._omgs_figure_version = omgs.state.plan_version
                self._log_plan_figure(trainer, omgs.state)
        if mode_changed and not writes:
            # Lightning would not write this step: write it to the loggers directly, at the step
            # Lightning uses for this batch's metrics (rank zero only, like self.log(rank_zero_only)).
            if trainer.is_global_zero and trainer.loggers:
                step = trainer.fit_loop.epoch_loop._batches_that_stepped
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
                self.forced_steps.append(s.step)
        if auto is not None:
            metrics.update(auto_metrics(auto))
        for key, value in metrics.items():
            pl_module.log(
                key,
                value,
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
                batch_size=1,
                prog_bar=self.prog_bar and key in ("gc/bytes_ratio", "gc/gain_ewma"),
            )

    def _log_auto_decision(self, trainer: Any, auto: Any) -> None:
        if len(auto.history) == self._auto_logged or not trainer.is_global_zero:
            return
        from ..auto.model import Prediction, table

        for h in auto.history[self._auto_logged:]:
            preds = {k: Prediction(**v) for k, v in h["predictions"].items()}
            text = (f"step {h['step']}, trigger {h['trigger']}: chose {h['chosen']} (was {h['previous']}); "
                    f"network alpha {h['network'][0]:.3g} s, beta {h['network'][1]:.3g} s/B\n\n    "
                    + table(preds, h["chosen"]).replace("\n", "\n    "))
            for logger in trainer.loggers:
                add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
                if add_text is not None:
                    add_text("gc/auto_decision", text, global_step=h["step"])
        self._auto_logged = len(auto.history)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        summary = getattr(trainer.strategy, "summary", None)
        if not self.summary or summary is None:
            return
        result = summary()
        if result is not None:
            rank_zero_info(result.format())
