"""The engine that runs inside DDP's communication hook."""

from ..plans import Group, Plan, available_planners, build_plan
from .config import EngineConfig
from .hook import GCEngine, gc_comm_hook
from .stats import StepStats, Totals

__all__ = ["EngineConfig", "GCEngine", "Group", "Plan", "StepStats", "Totals", "available_planners", "build_plan",
           "gc_comm_hook"]
