"""Forward the Trainer's evaluation and end-of-training events to the step session, first.

Lightning calls the callbacks' hooks of an event before the module's and the strategy's. What must
hold before any of them reads the model is therefore done by this callback, which
:class:`~lightning_gc.GCStrategy` keeps first in the Trainer's list (it moves it there if the user
listed it elsewhere):

* before evaluation, at an epoch's end and at the end of fit, work in flight is finished
  (``StepSession.drain``: OSP's deferred correction);
* validation, test and predict run inside ``StepSession.evaluation_view`` (DiLoCo: θ_outer, the
  model every rank agrees on; the rank's θ_local is put back afterwards and training goes on from it);
* at the end of fit ``StepSession.on_train_end`` runs before every other ``on_train_end`` (DiLoCo
  closes its last round there), so callbacks and the module see the final model, the same on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L


class SessionHooks(L.Callback):
    """The step session's evaluation view, drains and end of training, ahead of every other callback."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @staticmethod
    def _session(trainer: Any) -> Any:
        return getattr(trainer.strategy, "session", None)

    def _enter(self, trainer: Any) -> None:
        session = self._session(trainer)
        if session is None or self._stack is not None:
            return
        session.drain()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(session.evaluation_view())

    def _exit(self, *_: Any) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        session = self._session(trainer)
        if session is not None:
            session.drain()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        session = self._session(trainer)
        if session is not None:
            session.on_train_end()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._enter(trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._enter(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._enter(trainer)

    on_validation_end = on_test_end = on_predict_end = on_exception = _exit  # type: ignore[assignment]


def put_first(callbacks: list[Any]) -> None:
    """Make a :class:`SessionHooks` the first callback (the user's own, if listed, else a new one)."""
    own = [cb for cb in callbacks if isinstance(cb, SessionHooks)]
    for cb in own:
        callbacks.remove(cb)
    callbacks.insert(0, own[0] if own else SessionHooks())
