"""Adaptive compression ratio: a controller that keeps choosing c (and the collective) while training.

- :mod:`.config`      typed, validated settings (:class:`AdaptiveConfig`), the candidate ratios
- :mod:`.objectives`  per-candidate measurements (compression time, communication time measured
  and predicted, compression gain), agreed across ranks
- :mod:`.decision`    objectives over log c, pymoo NSGA-II, one front point by ASF / pseudo-weights
- :mod:`.snapshot`    in-memory snapshot / restore for rollback exploration
- :mod:`.callback`    :class:`AdaptiveRatio`, the Lightning Callback users add

See docs/adaptive.md.
"""

from .callback import AdaptiveRatio, pareto_figure
from .config import AdaptiveConfig, candidate_ratios
from .decision import Decision, Objectives, decide, pick
from .objectives import CandidateResult, ObjectiveData, ShadowScorer, agree, predicted_sync_s
from .snapshot import TrainingSnapshot

__all__ = [
    "AdaptiveConfig",
    "AdaptiveRatio",
    "CandidateResult",
    "Decision",
    "ObjectiveData",
    "Objectives",
    "ShadowScorer",
    "TrainingSnapshot",
    "agree",
    "candidate_ratios",
    "decide",
    "pareto_figure",
    "pick",
    "predicted_sync_s",
]
