"""Merge plans and the planner registry (which parameters are compressed and sent together)."""

from . import static  # noqa: F401  (registers the static planners)
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
