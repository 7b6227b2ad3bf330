"""OMGS: the merge plan that minimises the modelled iteration time (OMGS-SGD, Shi et al. 2020).

Layer-wise sparsification (LAGS, ``plan="layer"``) overlaps each tensor's exchange with the rest of
backward but pays one message start-up (α) and one selection per tensor; one merged group
(TopK-SGD, ``plan="model"``) pays one start-up but waits for the whole backward. OMGS chooses which
*adjacent* tensors (in gradient-ready order) to merge so that the modelled iteration time is
minimal.

The timeline model (paper §II-D, Eq. 2-9, with merged layers Eq. 13-15)
-----------------------------------------------------------------------
Tensors ``0 .. L-1`` in gradient-ready order (backward order), ``b[i]`` seconds of backward each,
``d[i]`` elements each. A *partition* splits them into contiguous groups; a group of ``D`` elements
costs ``t_s(D)`` seconds of sparsification and ``t_c(D)`` seconds of communication. Two resources
work in parallel: the one that computes backward and the network. Where sparsification runs is the
``sparsify_on`` choice:

``"compute"`` (the paper, Eq. 6-8): a group is sparsified on the compute stream right after its
    last tensor's backward, delaying the next tensor's backward::

        C_g = C_{g-1} + Σ_{i∈g} b[i] + t_s(D_g)         (compute stream, Eq. 6-7, 15)
        M_g = max(C_g, M_{g-1}) + t_c(D_g)               (network, Eq. 8)

``"worker"`` (this engine: the DDP hook hands a complete group to the ordered worker thread, which
    runs error feedback, selection and the exchange one group after the other)::

        R_g = Σ_{i ≤ last(g)} b[i]                       (gradient ready, backward never waits)
        M_g = max(R_g, M_{g-1}) + t_s(D_g) + t_c(D_g)    (worker)

The iteration time counted from the start of backward is ``M`` of the last group (Eq. 17; the
forward time is a constant every plan shares and is left out).

Planners
--------
``"omgs"``       exact: a dynamic programme over prefixes that keeps, for each prefix, the Pareto
                 set of (compute-end, comm-end) pairs reachable by partitions of that prefix. Both
                 successor times are non-decreasing in both coordinates, so a dominated pair can
                 never lead to a better plan: the programme returns the minimum of the model over
                 all 2^(L-1) partitions (tests check against brute force). With
                 ``sparsify_on="worker"`` the compute end is fixed and the set has one pair.
                 Among the plans within ``tie_tolerance`` (default 2 %) of that minimum it then
                 returns one with the fewest groups (:func:`fewest_groups_partition`, also exact).
``"omgs_paper"`` Algorithm 1 (FindMergedLayers) as published: one pass from the first tensor in
                 backward order, merging tensor *l* into the next one when the local conditions
                 Q3 ∧ Q5 hold. Its optimality proof only compares single flips, and it is not
                 optimal in general (docs/omgs.md gives a counterexample); kept for comparison.

Both need measured backward times (:class:`~lightning_gc.plans.ParamFacts` ``backward_s``) and a
cost model (``PlanRequest.cost``, an :class:`OMGSCost`), which
:class:`lightning_gc.engine.omgs.OMGSController` measures on the running job. Until they exist
(the first, dense, profiling steps) both planners return the MGS threshold plan under their own
kind, marked ``provisional`` in :func:`is_provisional`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .base import ParamFacts, Plan, PlanRequest, assemble_plan, register_planner
from .static import threshold_plan

SparsifyOn = Literal["compute", "worker"]
CostFn = Callable[[int], float]

__all__ = [
    "OMGSCost",
    "GroupTimes",
    "timeline",
    "modelled_iteration_time",
    "optimal_partition",
    "fewest_groups_partition",
    "find_merged_layers",
    "partition_from_plan",
    "ready_order",
    "is_provisional",
]


def _check_sparsify_on(sparsify_on: str) -> None:
    if sparsify_on not in ("compute", "worker"):
        raise ValueError(
            f"sparsify_on={sparsify_on!r} is invalid: use 'worker' (this engine: selection runs on the "
            "exchange worker, one group after the other) or 'compute' (the paper: selection delays backward)."
        )


def _check_partition(partition: Sequence[int], n: int) -> None:
    if any(int(s) < 1 for s in partition) or sum(partition) != n:
        raise ValueError(
            f"partition={list(partition)!r} must be positive group sizes (tensors per group, in backward "
            f"order) summing to the number of tensors, {n}."
        )


@dataclass(frozen=True)
class GroupTimes:
    """One group on the modelled timeline (seconds from the start of backward)."""

    first: int  # index of its first tensor in backward order
    count: int
    numel: int
    ready_s: float  # all its gradients computed (compute mode: incl. earlier groups' selection)
    sparsify_start_s: float
    sparsify_end_s: float
    comm_start_s: float
    comm_end_s: float


def timeline(
    partition: Sequence[int],
    backward_s: Sequence[float],
    numels: Sequence[int],
    t_s: CostFn,
    t_c: CostFn,
    sparsify_on: SparsifyOn = "worker",
) -> list[GroupTimes]:
    """The modelled timeline of a partition (see the module docstring for the equations).

    Args:
        partition: group sizes in tensors, in backward order, summing to ``len(backward_s)``.
        backward_s: backward time of each tensor, in backward order (seconds; the first includes
            everything from the start of backward until the first gradient is ready).
        numels: elements of each tensor, in backward order.
        t_s, t_c: sparsification and communication seconds of a group of ``D`` elements.
        sparsify_on: ``"worker"`` (this engine) or ``"compute"`` (the paper).
    """
    _check_sparsify_on(sparsify_on)
    if len(backward_s) != len(numels):
        raise ValueError(f"{len(backward_s)} backward times but {len(numels)} sizes; give one of each per tensor.")
    _check_partition(partition, len(backward_s))
    out: list[GroupTimes] = []
    compute = 0.0  # end of the compute stream
    comm = 0.0  # end of the network (worker)
    i = 0
    for size in partition:
        d = int(sum(numels[i:i + size]))
        compute += float(sum(backward_s[i:i + size]))
        ts, tc = t_s(d), t_c(d)
        if sparsify_on == "compute":
            s0 = compute
            compute += ts
            c0 = max(compute, comm)
            comm = c0 + tc
            out.append(GroupTimes(i, size, d, s0, s0, s0 + ts, c0, comm))
        else:
            s0 = max(compute, comm)
            comm = s0 + ts + tc
            out.append(GroupTimes(i, size, d, compute, s0, s0 + ts, s0 + ts, comm))
        i += size
    return out


def modelled_iteration_time(
    partition: Sequence[int],
    backward_s: Sequence[float],
    t_s: CostFn,
    t_c: CostFn,
    numels: Sequence[int],
    sparsify_on: SparsifyOn = "worker",
) -> float:
    """Modelled iteration time of a partition: seconds from the start of backward until the last
    group's exchange ends (Eq. 17; forward is a constant every plan shares).

    ``partition``: group sizes (tensors per group) in backward order; ``backward_s``: each tensor's
    backward time; ``t_s``/``t_c``: sparsification / communication seconds of a group of ``D``
    elements; ``numels``: each tensor's element count; ``sparsify_on``: see the module docstring.
    """
    return timeline(partition, backward_s, numels, t_s, t_c, sparsify_on)[-1].comm_end_s


def _prefix_sums(backward_s: Sequence[float], numels: Sequence[int]) -> tuple[list[float], list[int]]:
    """Prefix sums of backward seconds and of elements (``pb[i]``, ``pd[i]``: tensors ``0..i-1``)."""
    if len(backward_s) != len(numels):
        raise ValueError(f"{len(backward_s)} backward times but {len(numels)} sizes; give one of each per tensor.")
    pb, pd = [0.0], [0]
    for b, d in zip(backward_s, numels):
        pb.append(pb[-1] + float(b))
        pd.append(pd[-1] + int(d))
    return pb, pd


def _pareto(cands: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The non-dominated (compute end, comm end, …) entries, sorted by compute end ascending with
    comm end strictly descending."""
    cands.sort(key=lambda x: (x[0], x[1]))
    kept: list[tuple[float, float, int, int]] = []
    for cand in cands:
        if not kept or cand[1] < kept[-1][1]:
            kept.append(cand)
    return kept


def optimal_partition(
    backward_s: Sequence[float],
    numels: Sequence[int],
    t_s: CostFn,
    t_c: CostFn,
    sparsify_on: SparsifyOn = "worker",
) -> tuple[list[int], float]:
    """Exact minimum of :func:`modelled_iteration_time` over all contiguous partitions.

    Dynamic programme over prefixes ``0..j``; ``front[j]`` is the Pareto set of
    (compute end, comm end) over all partitions of the prefix. A group ``[j, k)`` maps a pair to
    ``(C + B + t_s, max(C + B + t_s, M) + t_c)`` (compute) or ``(C + B, max(C + B, M) + t_s + t_c)``
    (worker): non-decreasing in ``C`` and ``M``, so dropping dominated pairs loses nothing.
    O(L² · |front|) cost evaluations; with ``"worker"`` |front| = 1. Returns (group sizes, time).
    """
    _check_sparsify_on(sparsify_on)
    pb, pd = _prefix_sums(backward_s, numels)
    n = len(pb) - 1
    if n == 0:
        return [], 0.0
    # Bound: a pair (C, M) at prefix k ends no earlier than max(C + remaining backward,
    # M + t_c(remaining elements)) (t_c is affine with α ≥ 0, so one group sends the rest fastest).
    # Pairs whose bound exceeds the best reference plan (one group; one group per tensor; in compute
    # mode also the worker-mode optimum) cannot lead to a better plan and are dropped; exactness is
    # kept (the bound is a lower bound, and the best reference is returned when nothing beats it).
    # Without it the compute-mode sets grow large.
    refs = [[n], [1] * n]
    if sparsify_on == "compute":  # the worker-model optimum is usually close: a much tighter bound
        refs.append(optimal_partition(backward_s, numels, t_s, t_c, "worker")[0])
    ref_times = [modelled_iteration_time(r, backward_s, t_s, t_c, numels, sparsify_on) for r in refs]
    upper = min(ref_times) * (1 + 1e-12)
    # front[j]: list of (C, M, prev_j, prev_index) sorted by C ascending, M strictly descending
    front: list[list[tuple[float, float, int, int]]] = [[] for _ in range(n + 1)]
    front[0] = [(0.0, 0.0, -1, -1)]
    compute_mode = sparsify_on == "compute"
    for k in range(1, n + 1):
        rest = pb[n] - pb[k]
        rest_tc = t_c(pd[n] - pd[k]) if k < n else 0.0  # t_c is affine: one group sends the rest fastest
        cands: list[tuple[float, float, int, int]] = []
        for j in range(k):
            if not front[j]:
                continue
            dsz = pd[k] - pd[j]
            bsum = pb[k] - pb[j]
            ts, tc = t_s(dsz), t_c(dsz)
            for idx, (c, m, _, _) in enumerate(front[j]):
                if compute_mode:
                    c2 = c + bsum + ts
                    m2 = max(c2, m) + tc
                else:
                    c2 = c + bsum
                    m2 = max(c2, m) + ts + tc
                if max(c2 + rest, m2 + rest_tc) <= upper:
                    cands.append((c2, m2, j, idx))
        front[k] = _pareto(cands)
    if not front[n]:  # nothing beat the reference plans
        r = min(range(len(refs)), key=lambda i: ref_times[i])
        return list(refs[r]), ref_times[r]
    best_i = min(range(len(front[n])), key=lambda i: front[n][i][1])
    best = front[n][best_i][1]
    sizes: list[int] = []
    k, i = n, best_i
    while k > 0:
        _, _, j, pi = front[k][i]
        sizes.append(k - j)
        k, i = j, pi
    return sizes[::-1], best


def find_merged_layers(
    backward_s: Sequence[float],
    numels: Sequence[int],
    t_s: CostFn,
    t_c: CostFn,
    alpha_s: float,
) -> list[int]:
    """Algorithm 1 (FindMergedLayers) of the paper, under its own ``"compute"`` timeline.

    Tensors in backward order (the paper's layer L is index 0). Scanning from the first tensor,
    tensor ``i`` is merged into tensor ``i+1`` when

    * Q3: ``u + t_s(d_i) + t_s(d_{i+1}) < τc_i + t_c(d_i)`` and
    * Q5: ``τc_i + α > u + t_s(d_i + d_{i+1})``, with ``u = τb_i + b_i + b_{i+1}``,

    evaluated on the current timeline (earlier merges applied, Eq. 13-15), after which the
    timeline is recomputed. ``alpha_s`` is the start-up term α of ``t_c``. Returns group sizes.
    O(L²). Not optimal in general: see :func:`optimal_partition` and docs/omgs.md.
    """
    n = len(backward_s)
    if n != len(numels):
        raise ValueError(f"{n} backward times but {len(numels)} sizes; give one of each per tensor.")
    if n == 0:
        return []
    tb = [float(b) for b in backward_s]
    d = [int(x) for x in numels]

    def ts_of(x: int) -> float:
        return t_s(x) if x > 0 else 0.0

    def tc_of(x: int) -> float:
        return t_c(x) if x > 0 else 0.0

    def schedule() -> tuple[list[float], list[float]]:
        """(τb, τc) of the current (merged) layers: CalculateCompStart + CalculateCommStart."""
        tau_b, tau_c = [0.0] * n, [0.0] * n
        t = 0.0
        comm_end = 0.0
        for i in range(n):
            tau_b[i] = t
            t += tb[i]
            sparsify_end = t + ts_of(d[i])
            t = sparsify_end
            tau_c[i] = max(sparsify_end, comm_end)
            comm_end = tau_c[i] + tc_of(d[i])
        return tau_b, tau_c

    merged_into_next = [False] * n
    tau_b, tau_c = schedule()
    for i in range(n - 1):
        u = tau_b[i] + tb[i] + tb[i + 1]
        q3 = u + ts_of(d[i]) + ts_of(d[i + 1]) < tau_c[i] + tc_of(d[i])
        q5 = tau_c[i] + alpha_s > u + ts_of(d[i] + d[i + 1])
        if q3 and q5:  # Merge (lines 37-41): tensor i's gradients go to i+1's message
            tb[i + 1] += tb[i]
            tb[i] = 0.0
            d[i + 1] += d[i]
            d[i] = 0
            merged_into_next[i] = True
            tau_b, tau_c = schedule()
    sizes, run = [], 0
    for i in range(n):
        run += 1
        if not merged_into_next[i]:
            sizes.append(run)
            run = 0
    return sizes


# ------------------------------------------------------------------------------------ cost model
@dataclass(frozen=True)
class OMGSCost:
    """The fitted cost model a planner uses (all times in seconds).

    ``t_s(D) = sparsify_intercept_s + gamma_s * ratio * D * ln D`` (Eq. 10; the intercept is the
    fixed per-call cost of a selection on this machine, which the paper's GPU model leaves out),
    ``t_c(D) = alpha_s + beta_s_per_byte * payload_bytes(D)`` (Eq. 11; ``payload_bytes`` is one
    rank's message, e.g. k values + k int32 indices for Top-k, so ``beta`` here is per byte *of one
    rank's payload* at this world size, which for an allgather includes the (N-1) factor).
    ``exact_s``: the extra job of the small tensors sent exactly; ``overhead_s``: per-step fixed
    work on the worker (the closing report; the opening check runs every ``check_every`` steps only). ``sparsify_on``: see the module docs.
    ``tie_tolerance``: a planner setting carried with the model — ``plan="omgs"`` returns the plan
    with the fewest groups whose modelled iteration time is within this fraction of the minimum
    (0: only exact ties; see :func:`fewest_groups_partition`).
    """

    gamma_s: float
    ratio: float
    alpha_s: float
    beta_s_per_byte: float
    payload_bytes_per_element: float
    payload_bytes_fixed: float = 0.0
    sparsify_intercept_s: float = 0.0
    exact_s: float = 0.0
    overhead_s: float = 0.0
    sparsify_on: SparsifyOn = "worker"
    tie_tolerance: float = 0.02

    def __post_init__(self) -> None:
        _check_sparsify_on(self.sparsify_on)
        for name in ("gamma_s", "alpha_s", "beta_s_per_byte", "payload_bytes_per_element", "payload_bytes_fixed",
                     "sparsify_intercept_s", "exact_s", "overhead_s", "tie_tolerance"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"OMGSCost.{name}={v!r} must be a finite number ≥ 0 (a fitted time or size).")
        if not (0 < self.ratio <= 1):
            raise ValueError(f"OMGSCost.ratio={self.ratio!r} must lie in (0, 1] (fraction of elements kept).")
        if self.tie_tolerance >= 1:
            raise ValueError(f"OMGSCost.tie_tolerance={self.tie_tolerance!r} must lie in [0, 1) (a fraction of the "
                             "modelled iteration time, e.g. 0.02).")

    def t_s(self, d: int) -> float:
        if d <= 1:
            return self.sparsify_intercept_s if d == 1 else 0.0
        return self.sparsify_intercept_s + self.gamma_s * self.ratio * d * math.log(d)

    def payload_bytes(self, d: int) -> float:
        return self.payload_bytes_fixed + self.payload_bytes_per_element * d if d > 0 else 0.0

    def t_c(self, d: int) -> float:
        return self.alpha_s + self.beta_s_per_byte * self.payload_bytes(d) if d > 0 else 0.0


# ------------------------------------------------------------------------------------ planners
def ready_order(params: Sequence[ParamFacts]) -> list[ParamFacts]:
    """Order by measured ready time; ties (and unmeasured) keep reverse registration order."""
    rank = {p.pid: i for i, p in enumerate(list(params)[::-1])}
    return sorted(params, key=lambda p: (p.backward_s if p.backward_s is not None else math.inf, rank[p.pid]))


def _durations(ordered: Sequence[ParamFacts]) -> list[float]:
    out, prev = [], 0.0
    for p in ordered:
        t = float(p.backward_s or 0.0)
        out.append(max(t - prev, 0.0))
        prev = max(prev, t)
    return out


def is_provisional(plan: Plan) -> bool:
    """True for the plan an OMGS planner returns before profiling and fitting have happened."""
    return plan.kind.endswith(":provisional")


def partition_from_plan(plan: Plan, request: PlanRequest) -> tuple[list[ParamFacts], list[int]]:
    """The compressible tensors in ready order and the plan's group sizes over them.

    Raises if the plan's compressed groups are not contiguous in that order (then the timeline
    model does not describe it).
    """
    big, _ = request.split_small()
    ordered = ready_order(big)
    pos = {p.pid: i for i, p in enumerate(ordered)}
    sizes, nxt = [], 0
    for g in sorted((g for g in plan.groups if not g.exact), key=lambda g: min(pos[i] for i in g.param_ids)):
        ids = sorted(pos[i] for i in g.param_ids)
        if ids != list(range(nxt, nxt + len(ids))):
            raise ValueError(f"plan {plan.kind!r}: group {g.gid} is not contiguous in gradient-ready order.")
        sizes.append(len(ids))
        nxt += len(ids)
    return ordered, sizes


def fewest_groups_partition(
    backward_s: Sequence[float],
    numels: Sequence[int],
    t_s: CostFn,
    t_c: CostFn,
    limit_s: float,
    max_groups: int,
    sparsify_on: SparsifyOn = "worker",
) -> tuple[list[int], float] | None:
    """The partition with the fewest groups (at most ``max_groups``) whose modelled iteration time
    (:func:`modelled_iteration_time`) is ≤ ``limit_s``, and its time; ``None`` if there is none.

    Why: the timeline model charges each message α and each selection its fitted cost, but a real
    group also pays per-message costs the model does not see (hook and worker hand-offs, one more
    Future, more variance). When several partitions tie — e.g. every plan whose exchanges end
    before the small tensors' exact group is ready — or differ by less than the model's accuracy,
    fewer groups is the safer choice. :func:`omgs_plan` calls this with the minimum time times
    ``1 + tie_tolerance``.

    How: a dynamic programme over (groups ``k``, prefix ``i``) keeping, per cell, the Pareto set
    of (compute end, comm end) over the partitions of the prefix into exactly ``k`` groups, for
    ``k = 1, 2, …`` until some partition of the whole sequence meets the limit. Pairs whose comm end
    cannot meet the limit are dropped (``max(C + remaining backward, M + t_c(remaining elements))``
    bounds the end of any completion from below), which keeps the sets small. Exact: brute force
    over all partitions agrees (tests). In ``"worker"`` mode each cell is one number and a layer
    is one vectorised minimum.
    """
    _check_sparsify_on(sparsify_on)
    pb, pd = _prefix_sums(backward_s, numels)
    n = len(pb) - 1
    if n == 0:
        return [], 0.0
    costs: dict[tuple[int, int], tuple[float, float]] = {}

    def cost(j: int, i: int) -> tuple[float, float]:
        c = costs.get((j, i))
        if c is None:
            dsz = pd[i] - pd[j]
            c = costs[(j, i)] = (t_s(dsz), t_c(dsz))
        return c

    compute_mode = sparsify_on == "compute"
    limit = float(limit_s) * (1 + 1e-12)
    if not compute_mode:
        return _fewest_groups_worker(pb, pd, cost, t_c, limit, max_groups)
    # compute mode: layers[k][i]: Pareto list of (C, M, prev_j, prev_index) for prefix i in exactly k groups
    layers: list[list[list[tuple[float, float, int, int]]]] = [[[(0.0, 0.0, -1, -1)]] + [[] for _ in range(n)]]
    for k in range(1, min(max_groups, n) + 1):
        prev = layers[-1]
        cur: list[list[tuple[float, float, int, int]]] = [[] for _ in range(n + 1)]
        for i in range(k, n + 1):
            rest = pb[n] - pb[i]
            rest_tc = t_c(pd[n] - pd[i]) if i < n else 0.0
            cands: list[tuple[float, float, int, int]] = []
            for j in range(k - 1, i):
                if not prev[j]:
                    continue
                ts, tc = cost(j, i)
                bsum = pb[i] - pb[j]
                for idx, (c, m, _, _) in enumerate(prev[j]):
                    c2 = c + bsum + ts
                    m2 = max(c2, m) + tc
                    if max(c2 + rest, m2 + rest_tc) <= limit:  # a lower bound of any completion's end
                        cands.append((c2, m2, j, idx))
            cur[i] = _pareto(cands)
        layers.append(cur)
        if cur[n]:
            best_i = min(range(len(cur[n])), key=lambda x: cur[n][x][1])
            best = cur[n][best_i][1]
            sizes: list[int] = []
            i, idx = n, best_i
            for kk in range(k, 0, -1):
                _, _, j, pidx = layers[kk][i][idx]
                sizes.append(i - j)
                i, idx = j, pidx
            return sizes[::-1], best
    return None


def _fewest_groups_worker(pb: list[float], pd: list[int], cost: Callable[[int, int], tuple[float, float]],
                          t_c: CostFn, limit: float, max_groups: int) -> tuple[list[int], float] | None:
    """:func:`fewest_groups_partition` for ``sparsify_on="worker"``: the compute end of a prefix is
    fixed (its backward), so each (groups, prefix) cell holds one number, the least comm end, and a
    layer of the programme is one vectorised min over predecessors (O(L²) per layer)."""
    import numpy as np

    n = len(pb) - 1
    ready = np.asarray(pb, dtype=np.float64)
    work = np.full((n + 1, n + 1), np.inf)  # work[j, i]: t_s + t_c of the group [j, i)
    for j in range(n):
        for i in range(j + 1, n + 1):
            ts, tc = cost(j, i)
            work[j, i] = ts + tc
    rest_tc = np.array([t_c(pd[n] - pd[i]) if i < n else 0.0 for i in range(n + 1)])
    end = np.full(n + 1, np.inf)
    end[0] = 0.0
    back: list[np.ndarray] = []
    for k in range(1, min(max_groups, n) + 1):
        cand = np.maximum(ready[None, :], end[:, None]) + work  # [j, i]: the group [j, i) after prefix j
        arg = np.argmin(cand, axis=0)
        new = cand[arg, np.arange(n + 1)]
        new[np.maximum(ready[n], new + rest_tc) > limit] = np.inf  # cannot meet the limit
        back.append(arg)
        end = new
        if np.isfinite(end[n]):
            sizes, i = [], n
            for kk in range(k - 1, -1, -1):
                j = int(back[kk][i])
                sizes.append(i - j)
                i = j
            return sizes[::-1], float(end[n])
    return None


def _facts_ready(request: PlanRequest) -> bool:
    return request.cost is not None and all(p.backward_s is not None for p in request.params)


def _provisional(kind: str, request: PlanRequest) -> Plan:
    base = threshold_plan(request)
    return Plan(f"{kind}:provisional", base.groups)


def omgs_plan(request: PlanRequest) -> Plan:
    if not _facts_ready(request):
        return _provisional("omgs", request)
    cost: OMGSCost = request.cost
    big, small = request.split_small()
    ordered = ready_order(big)
    durations, numels = _durations(ordered), [p.numel for p in ordered]
    sizes, best = optimal_partition(durations, numels, cost.t_s, cost.t_c, cost.sparsify_on)
    if len(sizes) > 1:
        # Fewest groups within tie_tolerance of the minimum, judged on the whole modelled step
        # (the small tensors' exact group included, as in predict_plan): M is acceptable when
        # _full(M) ≤ (1 + tol)·_full(best).
        floor, extra = _exact_floor(request)
        limit_full = (max(best, floor) + extra) * (1 + cost.tie_tolerance)
        fewer = fewest_groups_partition(durations, numels, cost.t_s, cost.t_c, limit_full - extra,
                                        len(sizes) - 1, cost.sparsify_on)
        if fewer is not None:
            sizes = fewer[0]
    return _assemble("omgs", ordered, sizes, small)


def _exact_floor(request: PlanRequest) -> tuple[float, float]:
    """(floor, extra) of the whole-step model: a partition whose groups end at ``M`` is predicted
    at ``max(M, floor) + extra`` (see :func:`predict_plan`)."""
    cost: OMGSCost = request.cost
    if cost.exact_s > 0:
        small_ready = max((p.backward_s or 0.0 for p in request.params if p.numel < request.min_compress_numel),
                          default=0.0)
        return small_ready, cost.exact_s + cost.overhead_s
    return 0.0, cost.overhead_s


def omgs_paper_plan(request: PlanRequest) -> Plan:
    if not _facts_ready(request):
        return _provisional("omgs_paper", request)
    cost: OMGSCost = request.cost
    big, small = request.split_small()
    ordered = ready_order(big)
    sizes = find_merged_layers(_durations(ordered), [p.numel for p in ordered], cost.t_s, cost.t_c, cost.alpha_s)
    return _assemble("omgs_paper", ordered, sizes, small)


def _assemble(kind: str, ordered: list[ParamFacts], sizes: list[int], small: list[ParamFacts]) -> Plan:
    chunks, i = [], 0
    for s in sizes:
        chunks.append(ordered[i:i + s])
        i += s
    return assemble_plan(kind, chunks, small)


def predict_plan(plan: Plan, request: PlanRequest) -> tuple[float, list[GroupTimes]]:
    """Modelled backward-window time of any contiguous plan (seconds) and its timeline.

    Adds the cost model's ``exact_s`` (small tensors' allreduce, after the last group) and
    ``overhead_s`` to the last group's end.
    """
    cost: OMGSCost = request.cost
    ordered, sizes = partition_from_plan(plan, request)
    if not ordered:
        return 0.0, []
    tl = timeline(sizes, _durations(ordered), [p.numel for p in ordered], cost.t_s, cost.t_c, cost.sparsify_on)
    floor, extra = _exact_floor(request)
    return max(tl[-1].comm_end_s, floor) + extra, tl


register_planner("omgs", omgs_plan,
                 "optimal merge of adjacent tensors under the measured timeline model (exact dynamic programme)")
register_planner("omgs_paper", omgs_paper_plan,
                 "the OMGS paper's FindMergedLayers (Algorithm 1); not optimal in general, for comparison")
