"""What auto measures, and the check that what a decision uses is the same on every rank.

* :func:`profile_entry` / :func:`workload_from_profile`: the dense warm-up's profiled steps (forward,
  each gradient's readiness, the optimizer, the wall, DDP's wait) into an agreed
  :class:`~lightning_gc.auto.model.Workload`;
* :func:`group_sample`: the compressed group's local gradient as the engine flattens it;
* :func:`measure_costs`: every candidate's codec cost, payload and error on that sample, agreed;
* :func:`check_agreed`: a decision's inputs compared across ranks.

Every figure a decision uses is agreed across ranks (MAX of times, MEAN of errors) before the policy
(:mod:`lightning_gc.auto.policy`) sees it, so every rank takes the same branch. A figure that is not
(a bug: a local value where an agreed one belongs) would make the ranks choose differently and then
issue different collectives: a gloo abort or a hang far from the cause. :func:`check_agreed` turns
that into a clear error on every rank, naming each rank's value.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..compressors import GroupContext
from ..engine.agreement import agree_values
from ..engine.ports import EngineView
from .candidates import AutoCandidate, measure_method, squared_norm
from .model import MethodCost, Workload


def profile_entry(stamps: Mapping[int, float], t_start: float, t_fwd: float, t_closure_end: float, t_end: float,
                  wall: float) -> dict:
    """One profiled dense step: forward time, the gradients' ready order and times (from the end of
    forward), the optimizer's time, the step's wall and DDP's wait for its buckets (the end of the
    closure after the last gradient was ready)."""
    order = sorted(sorted(stamps), key=lambda i: stamps[i])  # ties by index
    return {"forward_s": t_fwd - t_start, "order": order, "ready": [stamps[i] - t_fwd for i in order],
            "optimizer_s": max(t_end - t_closure_end, 0.0), "wall_s": wall,
            "exposed_s": max(t_closure_end - max(stamps.values()), 0.0)}


def workload_from_profile(profile: Sequence[dict], numels: Sequence[int], group: object,
                          device: torch.device | None) -> tuple[Workload, float, float]:
    """The agreed workload of the profiled steps (medians over steps, then the MAX over ranks: the
    slowest rank sets a synchronous step), with the agreed wall and DDP's wait. Each tensor's
    backward time is its ready time less the one before, in the agreed ready order (ties by index, so
    every rank sorts alike)."""
    n = len(numels)
    ready_by_param = [statistics.median(p["ready"][p["order"].index(i)] for p in profile) for i in range(n)]
    local = ([statistics.median(p[k] for p in profile) for k in ("forward_s", "optimizer_s", "wall_s", "exposed_s")]
             + ready_by_param)
    agreed = agree_values(local, "max", group, device)
    fwd, opt, wall, exposed = agreed[:4]
    ready = agreed[4:]
    order = sorted(range(n), key=lambda i: (ready[i], i))
    t_prev, durations = 0.0, []
    for i in order:
        durations.append(max(ready[i] - t_prev, 0.0))
        t_prev = max(ready[i], t_prev)
    return Workload(fwd, tuple(durations), tuple(numels[i] for i in order), opt, 0.0), wall, exposed


def group_sample(engine: EngineView, params: Sequence[Tensor],
                 grads: Mapping[int, Tensor]) -> tuple[Tensor, GroupContext, float]:
    """The compressed group's local gradient (``grads``: index in ``params`` → this rank's copy) as the
    engine flattens it, its context, and the bytes of the tensors sent exactly beside it. A tensor
    without a gradient on this rank counts as zeros, as the engine sends it. The plan must have a
    group to compress (auto runs DDP's path without one)."""
    lossy = [g for g in engine.plan.groups if not g.exact]
    exact_bytes = float(sum(4 * n for g in engine.plan.groups if g.exact for n in g.numels))
    g = lossy[0]
    index = {id(p): i for i, p in enumerate(params)}
    views = []
    for pid in g.param_ids:
        param = engine.params[pid]
        grad = grads.get(index[id(param)])
        views.append(torch.zeros(param.numel(), device=param.device) if grad is None else grad.reshape(-1).float())
    flat = torch.cat(views)
    ctx = GroupContext(step=engine.step, rank=engine.rank, world_size=engine.world_size, segments=g.numels,
                       group_id=g.gid, seed=engine.config.seed, device=flat.device,
                       shapes=tuple(tuple(engine.params[pid].shape) for pid in g.param_ids), names=g.names)
    return flat, ctx, exact_bytes


def measure_costs(candidates: Sequence[AutoCandidate], sample: tuple[Tensor, GroupContext, float], world_size: int,
                  repeats: int, time_codecs: bool, group: object, device: torch.device | None) -> list[MethodCost]:
    """Every candidate's codec time, payload and error on this rank's ``sample``, agreed: the MAX of
    times and payloads (the slowest rank sets a synchronous step), the MEAN of the errors (each rank
    compresses its own gradient). Engine codecs are timed only with ``time_codecs`` (else on demand)."""
    flat, ctx, exact_bytes = sample
    norm2 = squared_norm(flat)  # once for every candidate's error
    local = [measure_method(c, flat, ctx, world_size, repeats, exact_bytes, time_codec=time_codecs, norm2=norm2)
             for c in candidates]
    vals = []
    for m in local:
        vals += [m.codec_s, m.payload_bytes]
    agreed = agree_values(vals, "max", group, device)
    errors = agree_values([m.delta2 for m in local], "mean", group, device)
    return [MethodCost(m.name, m.wire, agreed[2 * k], agreed[2 * k + 1], errors[k], m.error_feedback,
                       m.sparse_ratio, m.value_bytes, m.exact_bytes, codec_timed=m.codec_timed)
            for k, m in enumerate(local)]


class InputsDisagree(RuntimeError):
    """A decision's inputs differ across ranks (raised on every rank alike)."""


def check_agreed(named: Sequence[tuple[str, float]], what: str, group: object = None,
                 device: torch.device | None = None) -> None:
    """Raise :class:`InputsDisagree` on every rank if any of ``named`` (name, value) differs across the
    ranks of ``group``, naming the value on each rank; ``what`` says which decision. One all-gather of
    the values (float64, compared bit for bit, so NaN equals NaN and -0.0 differs from 0.0: a decision
    can branch on either). Nothing to check without an initialised process group or on one rank."""
    if not named or not (dist.is_available() and dist.is_initialized()):
        return
    ws = dist.get_world_size(group)
    if ws < 2:
        return
    mine = torch.tensor([float(v) for _, v in named], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(every, mine, group=group)
    bits = torch.stack([t.cpu() for t in every]).view(torch.int64)
    differ = (bits != bits[0]).any(dim=0).nonzero().flatten().tolist()
    if not differ:
        return
    rows = torch.stack([t.cpu() for t in every])
    detail = "; ".join(f"{named[k][0]}: " + ", ".join(f"rank {r} = {float(rows[r, k])!r}" for r in range(ws))
                       for k in differ[:8])
    more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
    raise InputsDisagree(
        f"lightning_gc auto: the inputs of {what} differ across ranks, so the ranks would choose differently and "
        f"then deadlock: {detail}{more}. Every figure a decision uses must be agreed across ranks (MAX or MEAN) "
        "before the decision; a value measured on one rank only reached it. Please report this with the lines above.")
