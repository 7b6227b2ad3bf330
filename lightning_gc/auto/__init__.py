"""``compressor="auto"``: choose at run time the method that reaches the target soonest (docs/auto.md).

* :mod:`~lightning_gc.auto.model` -- the step-time and progress model (pure functions);
* :mod:`~lightning_gc.auto.candidates` -- the methods chosen among, measured on a live gradient;
* :mod:`~lightning_gc.auto.chooser` -- the step participant that profiles, decides and re-decides;
* :mod:`~lightning_gc.bench.advise` -- the same model offline (``lightning-gc advise``, beside the bench).
"""

from .candidates import CANDIDATES, DEFAULT_CANDIDATES, AutoCandidate
from .chooser import AutoChooser, AutoConfig
from .model import MethodCost, Prediction, Workload, choose, predict

__all__ = ["CANDIDATES", "DEFAULT_CANDIDATES", "AutoCandidate", "AutoChooser", "AutoConfig", "MethodCost",
           "Prediction", "Workload", "choose", "predict"]
