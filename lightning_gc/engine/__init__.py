"""The engine that runs inside DDP's communication hook."""

from .config import EngineConfig
from .hook import GCEngine, gc_comm_hook
from .plans import PLAN_KINDS, Group, Plan, build_plan
from .state import StepStats, Totals

__all__ = ["EngineConfig", "GCEngine", "Group", "PLAN_KINDS", "Plan", "StepStats", "Totals", "build_plan", "gc_comm_hook"]
