"""Merge plans and the planner registry (which parameters are compressed and sent together)."""

from . import omgs, static  # noqa: F401  (register the planners)
from .base import (
    Group,
    ParamFacts,
    Plan,
    PlanRequest,
    assemble_plan,
    available_planners,
    build_plan,
    get_planner,
    planner_summaries,
    register_planner,
)

__all__ = [
    "Group",
    "ParamFacts",
    "Plan",
    "PlanRequest",
    "assemble_plan",
    "available_planners",
    "build_plan",
    "get_planner",
    "planner_summaries",
    "register_planner",
]
