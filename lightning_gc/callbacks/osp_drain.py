"""Apply pending OSP corrections before anything reads the parameters outside a training step.

With ``GCStrategy(sync="osp")`` the deferred layers of the last step are corrected only before
the next optimizer step. Lightning calls strategy hooks *after* the callbacks' hooks of the same
name, so a callback reading the model in ``on_train_end`` (or a checkpoint written in
``on_train_epoch_end``) would see uncorrected, rank-dependent values. The strategy inserts this
callback first in the Trainer's list, so the correction is applied before every other callback.
"""

from __future__ import annotations

from typing import Any

import lightning as L


class OSPDrain(L.Callback):
    """Drains the strategy's OSP synchroniser at epoch end, before evaluation and at the end of fit."""

    @staticmethod
    def _drain(trainer: Any) -> None:
        osp = getattr(trainer.strategy, "osp", None)
        if osp is not None:
            osp.drain()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._drain(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._drain(trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._drain(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._drain(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._drain(trainer)
