"""auto's side of switching synchronisation families: per-step methods ⇄ DiLoCo (``auto_diloco``).

The rules are :mod:`lightning_gc.auto.sync_trial`'s (pure); this module runs them on the live job, at
the step boundary after DiLoCo's own post-step work (the DiLoCo participant runs before auto):

1. **Gate.** While a per-step method runs with a measured reference window, each step asks whether
   DiLoCo could run at least ``diloco_gate`` times as many steps per second as an exact per-step
   method (predicted from the agreed workload and network); if so, a trial against the running
   method starts, unless a lost trial on this link stands.
2. **Trial.** Three windows, the family the gate favours first and last (``diloco_lead``,
   sync_trial.first_family). The trial reads the ranks' mean training loss and step time of every
   step: a per-step window agrees them each step (one small all-reduce; the ranks wait for each
   other at every step anyway), a DiLoCo window once a round, at its outer step, for all of the
   round's steps (sync_trial.ends_round). An all-reduce every step would hold DiLoCo's ranks in
   lock-step, each step as slow as the slowest rank's, and the trial would measure DiLoCo slower
   than it runs. A checkpoint agrees the steps of the round so far first (:meth:`flush`). Between
   windows of different families, DiLoCo is entered (``enter``: θ_outer is the current θ, DDP's
   gradient synchronisation off, the first round up to the next multiple of H,
   sync_trial.first_round, so outer steps fall where a static DiLoCo run takes them) or left
   (``leave``: the round is closed, every rank holds θ_outer, the inner optimizer state becomes the
   ranks' mean, DDP on again); after the third window, the
   verdict. DiLoCo's window is whole rounds (the first one stretched or cut to that multiple of H),
   so leaving never cuts one; the per-step window between two of DiLoCo's may close sooner
   (``Trial.closes_early``). auto's per-step watch is held from the trial's start to its verdict, so
   no gain, drift or periodic check re-decides inside a window (such checks fall due on the step
   counter, which runs on through DiLoCo's steps); should the method or the network model change all
   the same, the trial ends unjudged (``aborted``).
3. **Running DiLoCo.** The first outer exchange's agreed time is the reference; an exchange
   ``severe_drift`` times slower or faster means the link moved: auto leaves DiLoCo and decides
   again, per-step, on a fresh probe (the gate may bring DiLoCo back once measured again).

While DiLoCo runs, the engine's hook is not called; auto counts the steps for it
(``count_local_step``), so every schedule keyed on the step stays the optimizer's. Everything
decided is in ``AutoState.sync`` (replicated, checkpointed), every event in its ``events``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from ..engine.agreement import agree_values
from ..engine.ports import MethodControl, SyncFamilyControl
from . import sync_trial
from .candidates import candidate
from .config import AutoConfig
from .diloco_candidates import diloco_choice
from .diloco_cost import predict_diloco
from .model import Workload
from .progress import trial_cost
from .state import AutoState

#: re-decide per-step after leaving DiLoCo on a moved link: (step) -> None
Redecide = Callable[[int], None]


def _as_float(loss: Any) -> float | None:
    """The closure's loss as a float (None: the closure returned none, e.g. Fabric without one)."""
    if isinstance(loss, Tensor) and loss.numel() == 1:
        return float(loss.detach())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    return None


class FamilySwitcher:
    """Gate, trial and watch of the module docstring, on every rank alike."""

    def __init__(self, engine: MethodControl, config: AutoConfig, state: AutoState, sync: SyncFamilyControl,
                 redecide: Redecide) -> None:
        self.engine, self.config, self.state, self.sync = engine, config, state, sync
        self.choices = [diloco_choice(n) for n in config.diloco]
        numels = [p.numel() for p in engine.params]  # model order, as DiLoCo cuts its fragments
        for c in self.choices:
            c.check_model(numels)
        self.costs = {c.name: c.cost(numels) for c in self.choices}  # the model's shape: fixed for the run
        self._redecide = redecide
        self._loss: float | None = None
        self._pending: list[tuple[float, float | None]] = []  # this rank's DiLoCo trial steps not yet agreed
        self._seen_stats: Any = None  # the last outer step's stats already watched

    @property
    def s(self) -> dict:
        return self.state.sync

    @property
    def in_diloco(self) -> bool:
        """Whether the step now running is a DiLoCo inner step."""
        return bool(self.sync.active)

    def note_loss(self, loss: Any) -> None:
        """The step's training loss (before the optimizer step), kept while a trial measures it."""
        self._loss = _as_float(loss) if self.s["trial"] is not None else None

    # ------------------------------------------------------------------ the step boundary
    def after_step(self, step: int, duration_s: float, busy: bool) -> bool:
        """Run the module docstring's rules for the step that just ended. ``busy``: a per-step trial
        is on (no family trial starts then). Returns whether auto's per-step watch holds this step:
        it was DiLoCo's, the family changed at its end, or a trial is on (its per-step windows
        measure one method: no gain, drift or periodic re-decision until the verdict)."""
        was_diloco = self.in_diloco
        loss, self._loss = self._loss, None
        if self.s["trial"] is not None:
            self._trial_step(step, duration_s, loss)
        elif was_diloco:
            self._watch_exchange(step)
        elif not busy:
            self._maybe_start(step)
        return was_diloco or self.in_diloco or self.s["trial"] is not None

    def _event(self, step: int, event: str, **detail: Any) -> None:
        self.s["events"].append({"step": step, "event": event, **detail})

    # ------------------------------------------------------------------ gate
    def predictions(self) -> dict[str, Any]:
        """Every DiLoCo candidate's predicted step on the agreed workload and network.

        Its compute is the profiled forward, backward and optimizer, at most the running method's
        measured reference step (which holds them): the profile comes from the first dense steps,
        which can run slower than later ones. The workload's ``other_s`` is left out: the warm-up
        sets it so that the model's dense step equals the measured one, so on a slow link it holds
        the network model's error on the dense exchange, which DiLoCo does not send each step
        (auto/decider.py, ``_calibrate_other``)."""
        st = self.state
        assert st.workload is not None and st.network is not None
        w = st.workload
        profiled = w.forward_s + sum(w.backward_s) + w.optimizer_s
        k = min(1.0, st.reference / profiled) if st.reference and profiled > 0 else 1.0
        compute = Workload(k * w.forward_s, tuple(k * b for b in w.backward_s), w.numels, k * w.optimizer_s, 0.0)
        return {n: predict_diloco(cost, compute, st.network, self.engine.world_size) for n, cost in self.costs.items()}

    def _dense_step(self) -> float:
        """The fastest exact per-step candidate's predicted step (ddp, fp16, bf16; ddp is always one)."""
        preds = self.state.predictions
        return min(p.step_s for n, p in preds.items() if candidate(n).compressor is None)

    def _maybe_start(self, step: int) -> None:
        st, cfg = self.state, self.config
        if st.network is None or st.workload is None or st.chosen is None or (cfg.diloco_gate and st.reference is None):
            return
        if not sync_trial.may_retry(step, self.s["last_trial"], st.network.beta_s_per_byte, cfg.diloco_retry_every,
                                    cfg.severe_drift):
            return
        preds = self.predictions()
        compute = next(iter(preds.values())).compute_s
        name = sync_trial.pick_challenger({n: p.step_s for n, p in preds.items()},
                                          {c.name: (c.inner_steps, c.fragments) for c in self.choices}, compute,
                                          cfg.diloco_hide)
        dense = self._dense_step()
        if cfg.diloco_gate and not sync_trial.gate_opens(dense, preds[name].step_s, cfg.diloco_gate):
            return
        window = sync_trial.window_steps(diloco_choice(name).inner_steps, cfg.diloco_rounds)
        order = sync_trial.first_family(dense, preds[name].step_s, cfg.diloco_lead)
        trial = sync_trial.Trial(challenger=name, start_step=step + 1, window=window, incumbent=st.chosen,
                                 beta_s_per_byte=st.network.beta_s_per_byte, order=order,
                                 round_steps=diloco_choice(name).inner_steps)
        self._event(step, "trial", challenger=name, incumbent=st.chosen, incumbent_step_s=st.reference,
                    dense_step_s=dense, predicted_step_s={n: p.step_s for n, p in preds.items()}, window=window,
                    order=order)
        bracket = name if trial.in_diloco else st.chosen
        rank_zero_info(f"lightning_gc auto (step {step}): a dense step is predicted at {1e3 * dense:.0f} ms, "
                       f"{name!r} at {1e3 * preds[name].step_s:.0f} ms: trying it against {st.chosen!r} on the training loss "
                       f"({window} steps of each, {bracket!r} before and after)")
        if trial.in_diloco:
            trial.stretch = self._enter(step, name, "trial") - trial.round_steps
        self.s["trial"] = trial.as_dict()

    # ------------------------------------------------------------------ trial
    def _agree_pending(self, step: int) -> list[tuple[float, float]] | None:
        """The steps not yet agreed, as (mean duration, mean loss) over the ranks, in one all-reduce;
        None where some rank's loss was non-finite. Every rank holds as many (they count steps)."""
        pending, self._pending = self._pending, []
        m, n = len(pending), self.engine.world_size
        has = [float(loss is not None) for _, loss in pending]
        finite = [float(loss is not None and math.isfinite(loss)) for _, loss in pending]
        losses = [loss if ok else 0.0 for (_, loss), ok in zip(pending, finite)]
        out = agree_values(has + finite + [d for d, _ in pending] + losses, "sum",
                           self.engine.process_group, self.engine.device)
        missing = [step - m + 1 + i for i in range(m) if out[i] != n]
        if missing:
            raise ValueError("lightning_gc auto: auto_diloco judges DiLoCo by the training loss, and some rank's "
                             f"step {missing[0]} returned none. Return the loss from training_step (Trainer), or pass "
                             "optimizer.step a closure that returns it (Fabric); or drop auto_diloco.")
        if any(out[m + i] != n for i in range(m)):
            return None
        return [(out[2 * m + i] / n, out[3 * m + i] / n) for i in range(m)]

    def flush(self, step: int) -> None:
        """Agree the DiLoCo trial steps of the round so far into the trial (before a checkpoint, on
        every rank), so that the replicated state saved holds them. A non-finite loss among them
        ends the trial at the round's end, as it would have without the checkpoint."""
        if not self._pending or self.s["trial"] is None:
            return
        tr = sync_trial.Trial.from_dict(self.s["trial"])
        agreed = self._agree_pending(step)
        if agreed is None:
            tr.nonfinite = True
        else:
            for dt, mean_loss in agreed:  # the round's outer step is still ahead: the window is not full
                tr.add(dt, mean_loss)
        self.s["trial"] = tr.as_dict()

    def discard_pending(self) -> None:
        """Forget this rank's unagreed steps (the state was loaded from a checkpoint, which holds them)."""
        self._pending = []

    def _trial_step(self, step: int, duration_s: float, loss: float | None) -> None:
        tr = sync_trial.Trial.from_dict(self.s["trial"])
        st = self.state
        beta = st.network.beta_s_per_byte if st.network is not None else None
        if not tr.in_diloco and (st.chosen != tr.incumbent or beta != tr.beta_s_per_byte):
            self._end(step, tr, "aborted", why=f"auto re-decided: {st.chosen!r} on β {beta!r} s/B")
            return
        self._pending.append((duration_s, loss))
        if tr.in_diloco and not sync_trial.ends_round(len(tr.durations) + len(self._pending), tr.round_steps,
                                                      tr.stretch):
            return
        agreed = self._agree_pending(step)
        if agreed is None or tr.nonfinite:
            if tr.in_diloco:
                self._end(step, tr, "incumbent", why="the loss went non-finite under DiLoCo")
            else:
                self._end(step, tr, "aborted", why="the loss went non-finite under the per-step method")
            return
        for dt, mean_loss in agreed:
            full = tr.add(dt, mean_loss)
        if not (full or tr.closes_early(self.config.diloco_threshold)):
            self.s["trial"] = tr.as_dict()
            return
        was_diloco = tr.in_diloco
        tr.close_window()
        if tr.phase == 3:
            self._judge(step, tr)
            return
        if was_diloco:
            self._leave(step, "trial")
        else:
            tr.stretch = self._enter(step, tr.challenger, "trial") - tr.round_steps
        self.s["trial"] = tr.as_dict()

    def _judge(self, step: int, tr: sync_trial.Trial) -> None:
        first, middle, last = sync_trial.rates(tr)
        threshold = self.config.diloco_threshold
        v = sync_trial.verdict(first, middle, last, threshold, tr.order)
        cost = trial_cost(tr.rates[1]["seconds"], sync_trial.bracket_for(first, middle, last, threshold), middle)
        winner = v.winner or sync_trial.keeper(tr.order)
        self._end(step, tr, winner, z=v.z, lead_per_s=v.lead_per_s, cost_s=cost, separated=v.winner is not None,
                  steepened=sync_trial.steepened(first, last, threshold))
        if winner == "challenger" and not self.in_diloco:
            self._enter(step, tr.challenger, "won")

    def _end(self, step: int, tr: sync_trial.Trial, winner: str, **detail: Any) -> None:
        """Record the verdict; leave DiLoCo unless it won (the trial may end inside its window)."""
        if self.in_diloco and winner != "challenger":
            self._leave(step, "trial_" + winner)
        record = {"end_step": step, "challenger": tr.challenger, "incumbent": tr.incumbent, "winner": winner,
                  "beta_s_per_byte": tr.beta_s_per_byte, "rates": tr.rates, **detail}
        self.s["trial"], self.s["last_trial"] = None, record
        self._event(step, "verdict", **{k: v for k, v in record.items() if k != "end_step"})
        z = detail.get("z")
        rank_zero_info(f"lightning_gc auto (step {step}): the trial of {tr.challenger!r} against {tr.incumbent!r} "
                       f"ended: {winner}" + (f" (z = {z:.2f})" if z is not None else f" ({detail.get('why')})"))

    # ------------------------------------------------------------------ the two verbs
    def _enter(self, step: int, name: str, why: str) -> int:
        """Enter DiLoCo after ``step``, its first round up to the next multiple of H
        (sync_trial.first_round; H steps without ``diloco_align``); returns that round's steps."""
        h = diloco_choice(name).inner_steps
        first = sync_trial.first_round(step + 1, h) if self.config.diloco_align else h
        self.sync.enter(name, first)
        self.s["running"], self.s["reference_exchange_s"] = name, None
        self._seen_stats = None
        self._event(step, "enter", choice=name, why=why, first_round=first)
        return first

    def _leave(self, step: int, why: str, **detail: Any) -> None:
        name = self.sync.choice
        sent = self.sync.leave()
        self.s["running"], self.s["reference_exchange_s"] = None, None
        self.state.settling = True  # the first per-step window after it holds the switch
        self._event(step, "leave", choice=name, why=why, state_bytes=sent, **detail)

    # ------------------------------------------------------------------ running DiLoCo
    def _watch_exchange(self, step: int) -> None:
        stats = self.sync.last_stats
        if stats is None or stats is self._seen_stats:
            return
        self._seen_stats = stats
        took = agree_values([stats.comm_s], "max", self.engine.process_group, self.engine.device)[0]
        # per fragment: Streaming DiLoCo's fragments differ in size (whole tensors), so each exchange is
        # compared with the same fragment's first one; a float is a record from before (one fragment)
        refs = self.s["reference_exchange_s"]
        refs = {"0": refs} if isinstance(refs, (int, float)) else dict(refs or {})
        key = str(getattr(stats, "fragment", 0))
        first = key not in refs  # this fragment's first exchange: the reference
        ref = refs.setdefault(key, took)
        self.s["reference_exchange_s"] = refs
        if first:
            return
        if sync_trial.link_moved(took, ref, self.config.severe_drift):
            rank_zero_info(f"lightning_gc auto (step {step}): DiLoCo's outer exchange took {took:.2f} s against "
                           f"{ref:.2f} s at first: the link moved, back to per-step and re-deciding")
            self._leave(step, "link_moved", exchange_s=took, reference_s=ref)
            self._redecide(step)


__all__ = ["FamilySwitcher"]
