"""Synchronisation models: BSP (the engine alone, the default), OSP two-stage synchronisation and DiLoCo.

* :mod:`.osp` — the coordinator (``GCStrategy(sync="osp")``): per step, the routine (RS) layers go
  through the engine; the deferred (ICS) layers keep their local gradient for this step's update and
  are all-reduced on a process group of their own while the next step computes;
* :mod:`.lgp` — local-gradient-based parameter correction (LGP), exact per optimizer;
* :mod:`.importance` — per-layer importance ``Σ|g ⊙ p|`` (PGP) and the ranked split;
* :mod:`.schedule` — how many elements to defer: ``S(Gu)`` and the ring bound ``Umax``;
* :mod:`.diloco` — DiLoCo (``GCStrategy(sync="diloco")``): local inner steps with no gradient
  synchronisation, then an outer step on the averaged (optionally compressed) pseudo-gradient.
"""

from .diloco import DiLoCoConfig, DiLoCoSync
from .importance import layer_importance, rank_split
from .lgp import LGPSnapshot, check_optimizer
from .osp import OSPConfig, OSPSync, osp_comm_hook
from .schedule import DeferredSchedule, ring_umax

__all__ = [
    "DiLoCoConfig",
    "DiLoCoSync",
    "DeferredSchedule",
    "LGPSnapshot",
    "OSPConfig",
    "OSPSync",
    "check_optimizer",
    "layer_importance",
    "osp_comm_hook",
    "rank_split",
    "ring_umax",
]
