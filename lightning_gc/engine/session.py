"""The step session: the one owner of how the engine and its participants compose per step.

* a :class:`StepSession` holds the :class:`~lightning_gc.engine.GCEngine` and an ordered list of
  :class:`StepParticipant` s (OSP, OMGS, later synchronisation models);
* every optimizer step — Lightning's and the controller's rollback steps alike — goes through
  :meth:`StepSession.optimizer_step`, which calls the participants in their order at fixed points
  (closure wrapping, after backward, prepare or skip, after the step);
* the merge plan has **one owner**: the session hands a :class:`~lightning_gc.engine.ports.PlanControl`
  to the single participant that declares ``owns_plan = True`` and refuses a second one;
* checkpoint state (:meth:`StepSession.state_dict`) and the in-memory rollback snapshot
  (:meth:`StepSession.snapshot`) cover the engine and every participant.

A step, in order (identical on every rank)::

    closure = p_n.wrap_closure(... p_1.wrap_closure(closure))        # e.g. OMGS times backward
    run(decide):  loss = closure()                                   # forward + backward (hook runs)
                  bad = any(p.before_optimizer_step(loss)) or engine.before_optimizer_step()
                  if bad and skip_nonfinite: p.skip_step() for all; gradients dropped; skipped += 1
                  else: p.prepare_step(optimizer) for all
                  → optimizer.step() (by ``run``, i.e. Lightning's precision plugin)
    engine.after_optimizer_step(); p.after_optimizer_step() for all
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from .ports import EngineControl, PlanControl

StateScope = Literal["rank", "replicated"]


class StepParticipant:
    """One part of the step lifecycle, plugged into a :class:`StepSession`.

    Subclasses override what they need; every method has a no-op default so that the session calls
    all participants uniformly (no capability discovered with ``hasattr``). All methods are called
    on every rank, in the same order, at the same step boundary.

    Class attributes:
        name: key of the participant's state in checkpoints and snapshots (unique per session).
        owns_plan: ``True`` if the participant replaces the engine's merge plan; the session gives
            it a :class:`~lightning_gc.engine.ports.PlanControl` through :meth:`bind_plan` and
            refuses a second owner.
        state_scope: ``"rank"`` — :meth:`state_dict` is saved per rank (like error memory);
            ``"replicated"`` — identical on every rank, one copy is saved.
    """

    name: ClassVar[str] = "participant"
    owns_plan: ClassVar[bool] = False
    state_scope: ClassVar[StateScope] = "rank"

    def bind_plan(self, control: PlanControl) -> None:
        """Receive the plan control (only called on the plan owner)."""
        raise TypeError(f"{type(self).__name__} does not own the plan (owns_plan=False)")

    def on_bucket(self, bucket: dist.GradBucket) -> None:
        """DDP hands a gradient bucket to the hook (autograd thread), before the engine sees it."""

    def wrap_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Wrap the optimizer closure (forward + backward) of the coming step."""
        return closure

    def before_optimizer_step(self, loss: Any) -> bool:
        """After backward, before the step decision; return True if this participant saw a
        non-finite value that every rank agreed on (the step is then skipped on every rank)."""
        return False

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step is about to be taken."""

    def skip_step(self) -> None:
        """The optimizer step is skipped on every rank (non-finite gradient)."""

    def after_optimizer_step(self) -> None:
        """After the optimizer step (and after the engine's own ``after_optimizer_step``)."""

    def on_ratio_change(self, ratio: float) -> None:
        """The engine's compression ratio changed (between steps, on every rank)."""

    def drain(self, timeout: float | None = None) -> bool:
        """Finish work in flight so that parameters may be read or written outside a step.
        Returns False if it did not finish within ``timeout``."""
        return True

    def state_dict(self) -> dict | None:
        """Checkpoint state (called after :meth:`drain`); ``None``: nothing to save."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (called before the engine's own state is loaded)."""

    def shared_state_dict(self) -> dict | None:
        """Checkpoint state identical on every rank, saved once beside a rank-scoped
        :meth:`state_dict` (DiLoCo's θ_outer and outer optimizer); ``None``: nothing."""
        return None

    def load_shared_state_dict(self, state: dict) -> None:
        """Restore :meth:`shared_state_dict` (before any rank-scoped state; also on a world-size change)."""

    def snapshot(self) -> Any:
        """An exact in-memory copy of everything a training step may change, for a rollback
        exploration that must leave no trace (work in flight included, not drained)."""
        return None

    def restore(self, snapshot: Any) -> None:
        """Put :meth:`snapshot` back (it stays valid for further restores)."""

    def close(self, timeout: float = 60.0) -> None:
        """Release threads, hooks and process groups (teardown)."""

    # ------------------------------------------------------------------ training lifecycle
    # Called by the front door (GCStrategy, its SessionHooks callback, GCFabricStrategy) on every rank
    # at the same point; the session dispatches them in the participants' order.
    def on_train_start(self) -> None:
        """Training begins (after the optimizers are set up and a checkpoint restored)."""

    def on_train_batch_start(self, batch_idx: int) -> None:
        """A training batch begins (``batch_idx`` restarts at 0 with every epoch)."""

    def on_validation_start(self) -> None:
        """Evaluation begins between training steps (its time is not a training step's)."""

    def on_validation_end(self) -> None:
        """Evaluation ended (after the checkpoints written at its end)."""

    def on_checkpoint_saved(self) -> None:
        """A checkpoint was written between training steps."""

    def on_train_end(self) -> None:
        """Training ended; called before any user hook reads the trained model (on every rank).
        What must hold for the model at the end of fit is made true here (DiLoCo's closing round)."""

    def finish(self) -> None:
        """The end of a run that trained without error, if :meth:`on_train_end` did not run (a run
        resumed at its last step); a second call must change nothing."""

    @contextlib.contextmanager
    def evaluation_view(self) -> Iterator[bool]:
        """Inside the block the module's parameters are the model every rank agrees on (for
        evaluation and the weights of a checkpoint); yields whether they were swapped."""
        yield False

    def on_optimizer_state_loaded(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The optimizers' state was restored from a checkpoint (rank 0's state, on every rank)."""

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_value: float, algorithm: str,
                       plain: Callable[[], Any]) -> None:
        """Clip this step's gradients (``algorithm`` ``"norm"`` or ``"value"``); ``plain()`` clips them
        as without this participant (the next participant's clipping, or the precision plugin's)."""
        plain()


@dataclass
class SessionSnapshot:
    """Engine state, reporting state, participants' snapshots and the skip counter (one rank)."""

    engine_state: dict
    engine_reporting: tuple
    participants: dict[str, Any]
    skipped_steps: int
    extra: dict[str, Any] = field(default_factory=dict)
    check_pending: bool = False  # the engine's opening-check flag at the snapshot


class StepSession:
    """Owner of the step lifecycle: the engine plus an ordered list of participants.

    Build it on every rank with the same participants in the same order, after the engine. Register
    :func:`session_comm_hook` with it as DDP's communication hook.

    Args:
        engine: the communication engine (typed by what the session uses, :class:`EngineControl`
            plus ``on_bucket``, ``state_dict`` and ``load_state_dict``).
        participants: in calling order.
        skip_nonfinite: skip the optimizer step on every rank when the gradient is non-finite on
            any rank (``GCStrategy(nonfinite="skip")`` without an AMP GradScaler, which skips by
            itself). ``False`` hands the non-finite gradient to the optimizer, like plain DDP.
    """

    def __init__(self, engine: Any, participants: Sequence[StepParticipant] = (), *,
                 skip_nonfinite: bool = True) -> None:
        self.engine = engine
        self.participants: tuple[StepParticipant, ...] = tuple(participants)
        names = [p.name for p in self.participants]
        if len(set(names)) != len(names):
            raise ValueError(f"step session participants need distinct names, got {names}")
        owners = [p for p in self.participants if p.owns_plan]
        if len(owners) > 1:
            raise ValueError(
                f"two participants want to own the merge plan: {[p.name for p in owners]}. Each replaces the "
                "engine's plan at its own step boundaries, so their plans would overwrite each other. Use one of them."
            )
        self.plan_owner: StepParticipant | None = owners[0] if owners else None
        if self.plan_owner is not None:
            self.plan_owner.bind_plan(engine)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.skipped_steps = 0

    # ------------------------------------------------------------------ the hook (autograd thread)
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        for p in self.participants:
            p.on_bucket(bucket)
        return self.engine.on_bucket(bucket)

    # ------------------------------------------------------------------ the step (main thread)
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       run: Callable[[Callable[[], Any]], Any]) -> Any:
        """One optimizer step: ``run(closure)`` must evaluate the closure and take the optimizer
        step (Lightning's ``Strategy.optimizer_step``, or ``optimizer.step(closure)``)."""
        for p in self.participants:
            closure = p.wrap_closure(closure)
        if self.participants or self.skip_nonfinite:
            out = run(self._deciding(optimizer, closure))
        else:
            out = run(closure)
        self.engine.after_optimizer_step()
        for p in self.participants:
            p.after_optimizer_step()
        return out

    def _deciding(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        def closure_then_decide() -> Any:
            out = closure()
            bad = False
            for p in self.participants:
                bad = p.before_optimizer_step(out) or bad
            bad = self.engine.before_optimizer_step() or bad
            if not (bad and self.skip_nonfinite):
                for p in self.participants:
                    p.prepare_step(optimizer)
                return out
            for p in self.participants:
                p.skip_step()
            # optimizers skip parameters without a gradient: no update, no momentum, no decay
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None
            self.skipped_steps += 1
            rank_zero_warn(
                f"lightning_gc: non-finite gradient at step {self.engine.step - 1}; the optimizer step was "
                "skipped on every rank and error memory left unchanged."
            )
            return out

        return closure_then_decide

    def set_ratio(self, ratio: float) -> None:
        """Change the compression ratio from the next step on (every rank, same value) and tell
        the participants (OMGS re-plans: its plan was fitted at the old ratio)."""
        self.engine.set_ratio(ratio)
        for p in self.participants:
            p.on_ratio_change(ratio)

    def drain(self, timeout: float | None = None) -> bool:
        """Finish every participant's work in flight (before checkpoints, evaluation, teardown)."""
        ok = True
        for p in self.participants:
            ok = p.drain(timeout) and ok
        return ok

    def close(self, timeout: float = 60.0) -> None:
        """Teardown: participants first (they may still use the engine), then the engine."""
        for p in self.participants:
            p.close(timeout)
        self.engine.close(timeout)

    # ------------------------------------------------------------------ training lifecycle
    def on_train_start(self) -> None:
        for p in self.participants:
            p.on_train_start()

    def on_train_batch_start(self, batch_idx: int) -> None:
        for p in self.participants:
            p.on_train_batch_start(batch_idx)

    def on_validation_start(self) -> None:
        for p in self.participants:
            p.on_validation_start()

    def on_validation_end(self) -> None:
        for p in self.participants:
            p.on_validation_end()

    def on_checkpoint_saved(self) -> None:
        for p in self.participants:
            p.on_checkpoint_saved()

    def on_train_end(self) -> None:
        """Work in flight finished first, then each participant's end of training."""
        self.drain()
        for p in self.participants:
            p.on_train_end()

    def finish(self) -> None:
        """End of a run that trained without error (teardown): what :meth:`on_train_end` would do,
        if it did not run; idempotent."""
        self.drain()
        for p in self.participants:
            p.finish()

    @contextlib.contextmanager
    def evaluation_view(self) -> Iterator[bool]:
        """Every participant's evaluation view, entered in order; yields whether any swapped parameters."""
        with contextlib.ExitStack() as stack:
            swapped = [stack.enter_context(p.evaluation_view()) for p in self.participants]
            yield any(swapped)

    def on_optimizer_state_loaded(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for p in self.participants:
            p.on_optimizer_state_loaded(optimizers)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_value: float, algorithm: str,
                       plain: Callable[[], Any]) -> None:
        """Clip through every participant, the first one outermost; the innermost ``plain`` is the
        precision plugin's clipping."""
        clip = plain
        for p in reversed(self.participants):
            clip = _bind_clip(p, optimizer, max_value, algorithm, clip)
        clip()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Every rank's state gathered (call on every rank): the engine's and the rank-scoped
        participants' per rank, replicated participants' once."""
        engine = self.engine
        self.drain()
        local = engine.state_dict()
        for p in self.participants:
            if p.state_scope == "rank":
                st = p.state_dict()
                if st is not None:
                    local[p.name] = st
        if engine.world_size > 1:
            states: list[Any] = [None] * engine.world_size
            dist.all_gather_object(states, local, group=engine.process_group)
        else:
            states = [local]
        out: dict[str, Any] = {"world_size": engine.world_size, "ranks": states}
        for p in self.participants:
            if p.state_scope == "replicated":
                st = p.state_dict()
                if st is not None:
                    out[p.name] = st
            shared = p.shared_state_dict()
            if shared is not None:
                out[f"{p.name}/shared"] = shared
        return out

    def load_state_dict(self, state: dict) -> list[str]:
        """Restore :meth:`state_dict`. Returns the names whose error memory was missing. On a
        world-size change per-rank error memory is reset with a warning (replicated parts kept)."""
        engine = self.engine
        for p in self.participants:
            if p.state_scope == "replicated" and state.get(p.name):
                p.load_state_dict(state[p.name])
            if state.get(f"{p.name}/shared") is not None:
                p.load_shared_state_dict(state[f"{p.name}/shared"])
        saved_ws = int(state.get("world_size", -1))
        ranks = state.get("ranks") or []
        if saved_ws != engine.world_size or len(ranks) != saved_ws:
            rank_zero_warn(
                f"lightning_gc: the checkpoint was written with world size {saved_ws}, this run has "
                f"{engine.world_size}; per-rank error memory cannot be mapped and is reset to zero. "
                "The step counter and statistics are kept."
            )
            if ranks:
                engine.load_state_dict(ranks[0], restore_memory=False)
            return []
        own = ranks[engine.rank]
        for p in self.participants:  # first: the plan owner sets the plan the memory is keyed by
            if p.state_scope == "rank" and own.get(p.name) is not None:
                p.load_state_dict(own[p.name])
        return engine.load_state_dict(own)

    # ------------------------------------------------------------------ rollback snapshots
    def snapshot(self, extra: dict[str, Any] | None = None) -> SessionSnapshot:
        """Exact in-memory copy of the session (engine + participants) at a step boundary."""
        self.engine.synchronize()
        return SessionSnapshot(
            engine_state=copy.deepcopy(self.engine.state_dict()),
            engine_reporting=self.engine.reporting_state(),
            participants={p.name: p.snapshot() for p in self.participants},
            skipped_steps=self.skipped_steps,
            extra=copy.deepcopy(extra or {}),
            check_pending=self.engine.check_pending,
        )

    def restore(self, snap: SessionSnapshot) -> None:
        """Put :meth:`snapshot` back (participants first: the plan owner restores the plan)."""
        self.engine.synchronize()
        for p in self.participants:
            p.restore(snap.participants.get(p.name))
        self.engine.load_state_dict(copy.deepcopy(snap.engine_state), check_next=snap.check_pending)
        self.engine.restore_reporting_state(snap.engine_reporting)
        self.skipped_steps = snap.skipped_steps


def _bind_clip(p: StepParticipant, optimizer: torch.optim.Optimizer, max_value: float, algorithm: str,
               inner: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: p.clip_gradients(optimizer, max_value, algorithm, inner)


def session_comm_hook(session: StepSession, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: ``ddp_model.register_comm_hook(session, session_comm_hook)``."""
    return session.on_bucket(bucket)


# DDP inspects the hook's annotations and rejects string annotations (postponed evaluation here)
session_comm_hook.__annotations__ = {
    "session": StepSession,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}

__all__ = ["EngineControl", "SessionSnapshot", "StepParticipant", "StepSession", "session_comm_hook"]
