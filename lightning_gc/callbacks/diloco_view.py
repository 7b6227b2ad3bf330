"""Evaluate θ_outer, not a rank's θ_local, and close the last DiLoCo round at the end of fit.

With ``GCStrategy(sync="diloco")`` each rank's parameters between outer steps are its own
``θ_local``; validation split over the ranks would average metrics of different models. The
strategy inserts this callback first in the Trainer's list, so that every other callback's
evaluation hooks and the evaluation loop itself see ``θ_outer`` (the only model every rank agrees
on); the rank's ``θ_local`` is put back when evaluation ends and training goes on from it. At the
end of fit an unfinished round is closed with one more outer step (docs/diloco.md).
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L


class DiLoCoView(L.Callback):
    """Swaps θ_outer in for validation, test and predict."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @staticmethod
    def _diloco(trainer: Any) -> Any:
        return getattr(trainer.strategy, "diloco", None)

    def _enter(self, trainer: Any) -> None:
        diloco = self._diloco(trainer)
        if diloco is None or self._stack is not None:
            return
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(diloco.outer_view())

    def _exit(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._enter(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._exit()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._enter(trainer)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._exit()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._enter(trainer)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._exit()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._exit()
