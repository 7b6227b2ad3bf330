"""Static planners: the grouping is fixed by parameter sizes alone.

``"model"``     every compressible parameter in one group (TopK-SGD, AR-Topk: global selection;
                communication starts only after the whole backward).
``"layer"``     one group per parameter tensor (LAGS: per-layer, pipelined with backward; pays one
                message start-up per tensor).
``"threshold"`` consecutive parameters (in backward order) merged until the group holds
                ``threshold`` elements (MGS-SGD; 8192 in its paper).
"""

from __future__ import annotations

from .base import Plan, PlanRequest, assemble_plan, register_planner


def model_plan(request: PlanRequest) -> Plan:
    big, small = request.split_small()
    return assemble_plan("model", [big] if big else [], small)


def layer_plan(request: PlanRequest) -> Plan:
    big, small = request.split_small()
    return assemble_plan("layer", [[p] for p in big], small)


def threshold_plan(request: PlanRequest) -> Plan:
    big, small = request.split_small()
    chunks, cur, size = [], [], 0
    for p in big:
        cur.append(p)
        size += p.numel
        if size >= request.threshold:
            chunks.append(cur)
            cur, size = [], 0
    if cur:
        chunks.append(cur)
    return assemble_plan("threshold", chunks, small)


register_planner("model", model_plan, "every compressible tensor in one group: global selection (default)")
register_planner("layer", layer_plan, "one group per tensor: layer-wise selection")
register_planner("threshold", threshold_plan, "consecutive tensors merged up to plan_threshold elements per group")
