"""``compressor="auto"``: choose at run time the method that reaches the target soonest (docs/auto.md).

* :mod:`~lightning_gc.auto.config` -- its options, in sections (:class:`AutoConfig`);
* :mod:`~lightning_gc.auto.model` -- the step-time and progress model (pure functions);
* :mod:`~lightning_gc.auto.candidates` -- the methods chosen among, measured on a live gradient;
* :mod:`~lightning_gc.auto.chooser` -- the step participant that profiles, decides and re-decides;
* :mod:`~lightning_gc.bench.advise` -- the same model offline (``lightning-gc advise``, beside the bench).

:class:`AutoChooser` is imported on first use, so that ``lightning_gc.config`` (which needs
:class:`AutoConfig` only) does not load the participant and torch.distributed with it.
"""

from typing import Any

from .candidates import CANDIDATES, DEFAULT_CANDIDATES, AutoCandidate
from .config import AutoConfig
from .model import MethodCost, Prediction, Workload, choose, predict

__all__ = ["CANDIDATES", "DEFAULT_CANDIDATES", "AutoCandidate", "AutoChooser", "AutoConfig", "MethodCost",
           "Prediction", "Workload", "choose", "predict"]


def __getattr__(name: str) -> Any:
    if name == "AutoChooser":
        from .chooser import AutoChooser

        return AutoChooser
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
