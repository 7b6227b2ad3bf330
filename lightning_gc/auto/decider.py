"""How auto makes one decision: look at the link, ask the policy, apply the pick, record it.

:class:`Decider` is the impure half of a decision (collectives, the engine); every rule it follows is a
pure function: the link look's sources (:mod:`lightning_gc.auto.look`), the pick
(:func:`lightning_gc.auto.policy.decide`), what follows it (:func:`~lightning_gc.auto.policy.keeps_reference`,
:func:`~lightning_gc.auto.policy.next_link_interval`, :func:`~lightning_gc.auto.policy.needs_switch_check`)
and the record (:mod:`lightning_gc.auto.record`). Every input is agreed across ranks and checked
(:func:`~lightning_gc.auto.measure.check_agreed`) before the policy sees it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from ..compressors import GroupContext
from ..engine.agreement import agree_values
from ..engine.ports import MethodControl
from . import policy, record
from .canary import LinkCanary, sing
from .candidates import AutoCandidate, candidate, time_method_codec
from .config import AutoConfig
from .look import LinkIO, LookRequest, look
from .measure import check_agreed, decision_figures, group_sample
from .model import MethodCost, Workload, calibrate_other, compute_shift
from .policy import Trigger
from .state import AutoState, state_attr
from .walls import StepWalls


class Decider:
    """Makes auto's decisions on ``engine`` from the replicated ``state`` (see the module docstring).

    ``canary``: the link canary before each dense step (None: off); ``switch_check``: the canary message
    timed before a gain or calibration decision leaves a compressed method for a dense mode (None: no
    direct exchange on this group, or a pinned network)."""

    chosen = state_attr("chosen")
    history = state_attr("history")
    costs = state_attr("costs")
    network = state_attr("network")
    predictions = state_attr("predictions")

    def __init__(self, engine: MethodControl, config: AutoConfig, state: AutoState, walls: StepWalls,
                 candidates: Sequence[AutoCandidate], params: Sequence[Tensor], canary: LinkCanary | None,
                 switch_check: LinkCanary | None) -> None:
        self.engine, self.config, self.state, self.walls = engine, config, state, walls
        self.candidates, self.params = list(candidates), list(params)
        self.dense_names = frozenset(c.name for c in self.candidates if c.compressor is None)
        self.canary, self.switch_check = canary, switch_check

    @property
    def in_family_trial(self) -> bool:
        """Whether a dense sibling is running its one window."""
        return bool(self.history) and self.history[-1]["trigger"] == Trigger.FAMILY

    def _dense_mode_runs(self) -> bool:
        return self.chosen is not None and candidate(self.chosen).compressor is None

    def group_sample(self, grads: dict[int, Tensor]) -> tuple[Tensor, GroupContext, float]:
        return group_sample(self.engine, self.params, grads)

    def _live_sample(self) -> tuple[Tensor, GroupContext, float]:
        return self.group_sample({i: p.grad for i, p in enumerate(self.params) if p.grad is not None})

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

    def valid(self) -> dict[str, float]:
        st = self.state
        return policy.valid_corrections(st.corrections, st.correction_beta, st.network)

    def model_inputs(self) -> tuple[dict[str, float], list[str], list[str], float]:
        """The valid corrections, the methods settled on this link, the compute shift's basis and the shift."""
        valid, windowed = self.valid(), policy.windowed(self.history)
        settled = sorted(windowed & set(valid))
        shift_from = policy.shift_basis(windowed, settled, self.state.corrections, self.dense_names)
        shift = (compute_shift([self.state.corrections[m] for m in shift_from]) if self.config.compute_shift
                 else 0.0)
        return valid, settled, shift_from, shift

    def decide(self, step: int, trigger: Trigger | str, probe: bool, dense_wall_s: float | None = None,
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
        valid, settled, shift_from, shift = self.model_inputs()
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
        entry = record.entry(step, trigger, d, ctx, st, self.dense_names)
        # the slowest rank's times, like every other figure here (one agreement for all)
        took = agree_values([time.perf_counter() - t0] + [parts[k] for k in record.DECIDE_PARTS], "max",
                            engine.process_group, engine.device)
        entry["decide_s"], entry["decide_parts_s"] = took[0], dict(zip(record.DECIDE_PARTS, took[1:]))
        st.history.append(entry)
        rank_zero_info(f"lightning_gc auto (step {step}): {entry['sentence']}")
        rank_zero_info(record.log_text(step, trigger, d, ctx, st, self.config))

    def calibrate(self, step: int, measured_s: float) -> None:
        """The reference window sets the running method's correction, tagged with its network; then the
        choice may be made again at once (:func:`policy.calibration_next`)."""
        st, chosen = self.state, self.chosen
        assert chosen is not None and st.network is not None
        was_valid = chosen in self.valid()
        raw = st.predictions[chosen].step_s - policy.overhead_in(st.history[-1], chosen)
        st.corrections[chosen] = measured_s - raw
        st.correction_beta[chosen] = st.network.beta_s_per_byte
        dense = [c for c in self.config.candidates if c in self.dense_names]
        nxt = policy.calibration_next(chosen, raw, measured_s, was_valid, st.history, st.predictions, self.valid(),
                                      dense, self.config.family_margin)
        if nxt is not None:
            self.decide(step, nxt[0], probe=False, force=nxt[1])

    def _look(self, req: LookRequest, timed: Callable[..., Any]) -> tuple[str, dict | None]:
        engine, st = self.engine, self.state
        assert st.workload is not None and st.costs is not None
        net = engine.network
        pinned = net.model if net.pinned and net.model is not None else None
        running = next(c for c in st.costs if c.name == self.chosen) if self._dense_mode_runs() else None
        fall = self.canary or self.switch_check
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
        check = self.switch_check
        if check is None or not policy.needs_switch_check(trigger, probe, canary_s is not None,
                                                          self.network is not None, self.chosen, best,
                                                          self.dense_names):
            return None
        engine = self.engine
        res = timed("check", sing, check, math.nan, self.network, engine.exchange_group,
                    engine.world_size, engine.device)
        out = {"fell": res.fell, "fastest_s": res.fastest_s, "predicted_s": res.predicted_s,
               "messages": res.messages, "bytes": check.nbytes}
        if res.fell:
            rank_zero_info(f"lightning_gc auto: before leaving {self.chosen!r} for {best!r} ({trigger.value}), one "
                           f"{check.nbytes} B message per rank took {1e3 * res.fastest_s:.1f} ms on the fastest rank "
                           f"(twice), {1e3 * (res.predicted_s or 0.0):.2f} ms on the network model: the link fell, "
                           "re-deciding on it")
            self.decide(step, Trigger.DRIFT, probe=True, check_link=False, canary_s=res.fastest_s,
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
            self.apply(best)
            st.gain_interval = cfg.gain_every  # a new method: its errors looked at as often as at first
        st.chosen, st.predictions = best, preds
        kept = policy.keeps_reference(trigger, source, best, previous, st.reference is not None)
        if not kept:
            st.forget_references()
            self.walls.forget()
        st.last_decision_step = step
        if looked:
            st.looked_at_link(step, policy.next_link_interval(trigger, source, best, previous, st.link_interval,
                                                              cfg.probe_every, cfg.probe_every_max))
        return kept

    def apply(self, name: str) -> None:
        engine, cand = self.engine, candidate(name)
        if cand.compressor is None:
            engine.set_dense_mode(cand.dense_mode)
            return
        for g in engine.plan.groups:
            if not g.exact:
                engine.set_group_method(g.gid, cand.spec())
        engine.set_dense_mode(None)
