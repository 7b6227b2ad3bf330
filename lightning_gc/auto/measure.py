"""What auto measures, and the check that what a decision uses is the same on every rank.

* :func:`profile_entry` / :func:`workload_from_profile`: the dense warm-up's profiled steps (forward,
  each gradient's readiness, the optimizer, the wall, DDP's wait) into an agreed
  :class:`~lightning_gc.auto.model.Workload`;
* :func:`group_sample`: the compressed group's local gradient as the engine flattens it;
* :func:`measure_costs`: every candidate's codec cost, payload and error on that sample, agreed;
* :func:`remeasure_errors`: the candidates' errors again, only those that could still win;
* :func:`early_figures`: whether a skipped warm-up step waited mostly on the network;
* :func:`check_agreed` / :func:`decision_figures`: a decision's inputs compared across ranks;
* :class:`GradientTap`: the autograd hooks that time backward and copy a sampled step's gradients.

Every figure a decision uses is agreed across ranks (MAX of times, MEAN of errors) before the policy
(:mod:`lightning_gc.auto.policy`) sees it, so every rank takes the same branch. A figure that is not
(a bug: a local value where an agreed one belongs) would make the ranks choose differently and then
issue different collectives: a gloo abort or a hang far from the cause. :func:`check_agreed` turns
that into a clear error on every rank, naming each rank's value.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.cost_model import NetworkModel
from ..compressors import GroupContext
from ..engine.agreement import agree_values
from ..engine.ports import EngineView
from .candidates import AutoCandidate, measure_error, measure_method, squared_norm
from .model import MethodCost, Workload, efficiency


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


def early_figures(stamps: Mapping[int, float], complete: bool, t_start: float, t_closure_end: float,
                  t_end: float) -> list[float]:
    """A skipped dense step's exposed communication (the closure's end after the last gradient was ready:
    DDP's wait for its buckets), the rest of the step, and 1.0 where a gradient's time is missing (an
    unused parameter): agree them (MAX) and compare with ``early_comm_ratio``."""
    last_ready = max(stamps.values()) if complete and stamps else None
    exposed = max(t_closure_end - last_ready, 0.0) if last_ready is not None else 0.0
    return [exposed, max((t_end - t_start) - exposed, 0.0), 0.0 if last_ready is not None else 1.0]


def remeasure_errors(candidates: Sequence[AutoCandidate], costs: Sequence[MethodCost], step_s: Sequence[float],
                     running: str | None, sample: tuple[Tensor, GroupContext, float], world_size: int,
                     progress_weight: float, what: str, group: object,
                     device: torch.device | None) -> tuple[dict[int, float], float]:
    """The candidates' errors on ``sample`` again (agreed MEAN), branch and bound: the running method
    first, then every candidate whose predicted step (``step_s``, where the error does not enter) is at
    most the least time per unit of progress among those measured; one above it loses whatever its
    error. Returns (candidate index -> error, the bound). Each error is CPU on the step's critical path,
    so the bound spares most of them where one method leads clearly. Every rank measures the same
    candidates: the bound is computed from agreed values, checked (:func:`check_agreed`)."""
    flat, ctx, _ = sample
    norm2 = squared_norm(flat)  # once for every candidate's error
    names = [c.name for c in costs]
    errors: dict[int, float] = {}

    def measure(ks: list[int]) -> None:
        vals = agree_values([measure_error(candidates[k], flat, ctx, norm2=norm2) for k in ks], "mean", group, device)
        errors.update(zip(ks, vals))
        check_agreed([(f"delta2[{names[k]}]", errors[k]) for k in ks], what, group, device)

    measure([names.index(running) if running in names else min(range(len(names)), key=step_s.__getitem__)])
    bound = min(step_s[k] / efficiency(replace(costs[k], delta2=d2), world_size, progress_weight)
                for k, d2 in errors.items())
    rest = [k for k in range(len(names)) if k not in errors and step_s[k] <= bound]
    if rest:
        measure(rest)
    return errors, bound


def gain_check(step: int, costs: Sequence[MethodCost], errors: Mapping[int, float], bound: float, world_size: int,
               progress_weight: float, gain_drift: float) -> dict:
    """The record of an errors' re-measurement: each measured candidate's new error, the largest relative
    change of progress per step it makes, whether that re-decides (above ``gain_drift``), the skipped
    candidates and the bound."""
    names = [c.name for c in costs]

    def eff(k: int, d2: float) -> float:
        return efficiency(replace(costs[k], delta2=d2), world_size, progress_weight)
    moved = max((abs(eff(k, d2) - eff(k, costs[k].delta2)) / eff(k, costs[k].delta2) for k, d2 in errors.items()),
                default=0.0)
    return {"step": step, "delta2": {names[k]: errors[k] for k in sorted(errors)}, "moved": moved,
            "redecided": moved > gain_drift, "skipped": [n for k, n in enumerate(names) if k not in errors],
            "bound_s": bound}


def decision_figures(costs: Sequence[MethodCost], workload: Workload, network: NetworkModel, shift_s: float,
                     explore_left: int, valid: Mapping[str, float], walls: Sequence[float | None]) -> list[tuple[str, float]]:
    """Every figure a decision feeds the policy, named (for :func:`check_agreed`)."""
    named: list[tuple[str, float]] = []
    for c in costs:
        named += [(f"codec_s[{c.name}]", c.codec_s), (f"payload_bytes[{c.name}]", c.payload_bytes),
                  (f"delta2[{c.name}]", c.delta2), (f"codec_timed[{c.name}]", float(c.codec_timed))]
    w = workload
    named += [("network.alpha_s", network.alpha_s), ("network.beta_s_per_byte", network.beta_s_per_byte),
              ("workload.forward_s", w.forward_s), ("workload.backward_s", sum(w.backward_s)),
              ("workload.optimizer_s", w.optimizer_s), ("workload.other_s", w.other_s), ("shift_s", shift_s),
              ("explore_left", float(explore_left))]
    named += [(f"correction[{k}]", v) for k, v in sorted(valid.items())]
    return named + [(f"wall_s[{i}]", v) for i, v in enumerate(walls) if v is not None]


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


class GradientTap:
    """auto's autograd hooks: each gradient's readiness in backward (into ``walls.stamps``, for the
    warm-up's profile) and a copy of this rank's own gradients on a sampled step. A post-accumulate-grad
    hook runs before DDP's reducer or the engine touches the gradient, so the copy is this rank's; under
    gradient accumulation the last micro-batch's copy holds the full sum."""

    def __init__(self, params: Sequence[Tensor], walls: Any) -> None:
        self.params, self.walls = list(params), walls
        self.sample: dict[int, Tensor] | None = None  # parameter index -> copy; None: no step sampled
        self._timing: list[Any] = []
        self._sampling: list[Any] = []

    def start(self, module: torch.nn.Module) -> None:
        """Time the warm-up's steps and sample their gradients (the last profiled step's are measured)."""
        self.sample = {}
        self._timing = [p.register_post_accumulate_grad_hook(self._stamp(i)) for i, p in enumerate(self.params)]
        self._timing.append(module.register_forward_hook(self._on_forward))

    def _stamp(self, i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            self.walls.stamps[i] = time.perf_counter()  # before the copy: the copy is not backward's time
            self._keep(i, param)
        return hook

    def _on_forward(self, *_: Any) -> None:
        self.walls.t_fwd = time.perf_counter()

    def _keep(self, i: int, param: Tensor) -> None:
        if self.sample is not None and param.grad is not None:
            self.sample[i] = param.grad.detach().clone()

    def stop_timing(self) -> None:
        for h in self._timing:
            h.remove()
        self._timing = []

    @property
    def armed(self) -> bool:
        """Whether the next (or this) step's gradients are sampled (:meth:`arm`)."""
        return bool(self._sampling)

    def arm(self) -> None:
        """Copy the next step's local gradients (the errors' re-measurement, ``gain_every``)."""
        self.disarm()
        self.sample = {}
        self._sampling = [p.register_post_accumulate_grad_hook(lambda param, i=i: self._keep(i, param))
                          for i, p in enumerate(self.params)]

    def disarm(self) -> dict[int, Tensor] | None:
        """Stop sampling; returns what was sampled."""
        sample, self.sample = self.sample, None
        for h in self._sampling:
            h.remove()
        self._sampling = []
        return sample
