"""``compressor="auto"``: choose at run time the method that reaches the target soonest (docs/auto.md).

By role: :mod:`~lightning_gc.auto.config` (options, :class:`AutoConfig`); pure rules in
:mod:`~lightning_gc.auto.model` (step time and progress), :mod:`~lightning_gc.auto.policy` (the
decision) and :mod:`~lightning_gc.auto.drift` (when to look again); measurement in
:mod:`~lightning_gc.auto.measure`, :mod:`~lightning_gc.auto.candidates` and :mod:`~lightning_gc.auto.walls`;
the link through :mod:`~lightning_gc.auto.look` and :mod:`~lightning_gc.auto.canary`; switching to DiLoCo and
back in :mod:`~lightning_gc.auto.sync_trial` (pure) and :mod:`~lightning_gc.auto.sync_switch`; one decision in
:mod:`~lightning_gc.auto.decider` (recorded by :mod:`~lightning_gc.auto.record`, its state in
:mod:`~lightning_gc.auto.state`); the step participant :mod:`~lightning_gc.auto.chooser`. The same model
offline: ``lightning-gc advise`` (:mod:`lightning_gc.bench.advise`).

:class:`AutoChooser` is imported on first use, so that ``lightning_gc.config`` (which needs
:class:`AutoConfig` only) does not load the participant and torch.distributed with it.
"""

from typing import Any

from .candidates import CANDIDATES, DEFAULT_CANDIDATES, AutoCandidate
from .config import AutoConfig
from .diloco_candidates import DILOCO_CANDIDATES
from .model import MethodCost, Prediction, Workload, choose, predict

__all__ = ["CANDIDATES", "DEFAULT_CANDIDATES", "DILOCO_CANDIDATES", "AutoCandidate", "AutoChooser", "AutoConfig", "MethodCost",
           "Prediction", "Workload", "choose", "predict"]


def __getattr__(name: str) -> Any:
    if name == "AutoChooser":
        from .chooser import AutoChooser

        return AutoChooser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
