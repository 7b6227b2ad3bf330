"""In-memory snapshot of everything a rollback exploration may change, and its exact restoration.

Rollback exploration (the AR-Topk paper's checkpoint-restore, §3-E) trains each candidate ratio
for a few real steps and must then leave no trace. The public code restored only the model; a
run that explores must continue *exactly* as a run that never did, so this snapshot holds

* every parameter and buffer of the module (copied back **in place**: DDP's reducer, the engine
  and the optimizer keep references to these very tensors), and each parameter's ``.grad``;
* every optimizer's ``state_dict`` (momentum, Adam moments, step counts, param-group lrs), deep-copied;
  it is deep-copied again at each restore because ``Optimizer.load_state_dict`` adopts tensors
  that already have the right dtype and device, and the next step would update the snapshot in place;
* every LR scheduler's ``state_dict``;
* the step session (:meth:`~lightning_gc.engine.session.StepSession.snapshot`): the engine's
  ``state_dict()`` (step counter, error memory by parameter name, gain EWMA, totals, ratio, network
  tracker, exchange state such as VAR energies), the last step's statistics and the hook-call
  counter, every participant's exact in-memory state (OSP: split, schedule, carried residuals and
  the deferred exchange in flight; OMGS: plan, fits, windows) and the skipped-step counter;
* the RNG states: torch CPU, every CUDA device (when initialised), NumPy and Python's ``random``.

Memory: one copy of parameters, gradients, optimizer state and error memory (≈ 3–5× the model).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..engine import GCEngine
from ..engine.session import SessionSnapshot, StepSession


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainingSnapshot:
    """A restorable copy of module, optimizers, schedulers, engine and RNG states (one rank)."""

    module: torch.nn.Module
    optimizers: Sequence[torch.optim.Optimizer]
    schedulers: Sequence[Any]
    session: StepSession | None
    tensors: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    optimizer_states: list[dict]
    scheduler_states: list[dict]
    session_state: SessionSnapshot | None
    rng: dict[str, Any]
    extra: dict[str, Any]

    @classmethod
    def capture(cls, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (),
                schedulers: Sequence[Any] = (), engine: GCEngine | None = None,
                extra: dict[str, Any] | None = None, session: StepSession | None = None) -> TrainingSnapshot:
        """Copy the current state (call at a step boundary, on every rank). Pass the strategy's
        ``session`` (engine and participants); ``engine`` alone stands for a session without
        participants."""
        if session is None and engine is not None:
            session = StepSession(engine)
        # first: the session waits for work in flight, which may still write gradients
        session_state = session.snapshot() if session is not None else None
        tensors = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
        grads = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in module.named_parameters()}
        return cls(
            module=module, optimizers=list(optimizers), schedulers=list(schedulers), session=session,
            tensors=tensors, grads=grads,
            optimizer_states=[copy.deepcopy(o.state_dict()) for o in optimizers],
            scheduler_states=[copy.deepcopy(s.state_dict()) for s in schedulers],
            session_state=session_state, rng=_rng_state(), extra=copy.deepcopy(extra or {}),
        )

    def restore(self) -> None:
        """Put everything back; the snapshot stays valid for further restores."""
        if self.session is not None:
            self.session.engine.synchronize()
        with torch.no_grad():
            live = self.module.state_dict(keep_vars=True)
            if set(live) != set(self.tensors):
                raise RuntimeError(
                    "lightning_gc: the module's state_dict keys changed during exploration "
                    f"(added {sorted(set(live) - set(self.tensors))[:5]}, removed {sorted(set(self.tensors) - set(live))[:5]}); "
                    "a rollback cannot restore a module whose structure changes while it trains."
                )
            for k, t in live.items():
                t.data.copy_(self.tensors[k])
            for n, p in self.module.named_parameters():
                g = self.grads.get(n)
                if g is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
        for opt, st in zip(self.optimizers, self.optimizer_states):
            opt.load_state_dict(copy.deepcopy(st))
        for sch, st in zip(self.schedulers, self.scheduler_states):
            sch.load_state_dict(copy.deepcopy(st))
        if self.session is not None and self.session_state is not None:
            self.session.restore(self.session_state)
        _set_rng_state(self.rng)
