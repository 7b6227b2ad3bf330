"""The three objectives of the controller, measured per candidate ratio and agreed across ranks.

For a candidate ratio ``c`` (fraction of elements kept) the controller needs (Eq. 6 of the AR-Topk
paper):

``t_comp_s``  seconds per step to compress and decompress the gradient at ``c`` (measured: in shadow
              mode by compressing the live error-fed gradient ``p = g + e`` once more per candidate,
              in rollback mode the engine's own ``compress_time_s`` of the candidate's real steps);
``t_sync_s``  seconds per step the collective needs to move the compressed gradient: predicted for
              every collective the engine can use by :mod:`lightning_gc.comm.cost_model` from the
              probed (α, β), summed over the plan's compressed groups, and — where the candidate
              really ran — measured (the engine's ``exchange_comm_s``); the prediction is calibrated
              by measured/predicted (see :func:`calibration`);
``gain``      the compression gain ``E‖g_c‖² / E‖g_e‖²`` (GraVAC; paper 000 §2-C3): the energy of what
              is sent over the energy of the error-fed gradient, both summed over ranks and over the
              measured steps before dividing (a ratio of sums, not a mean of ratios). 1 = lossless.
              The decision minimises ``1/gain``.

Every number a decision uses goes through :func:`agree`: one float64 SUM all-reduce of the
per-rank values, divided by the world size, so every rank decides on bit-identical inputs.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from ..comm import cost_model
from ..comm.cost_model import NetworkModel
from ..compressors.base import Compressor, GroupContext
from ..engine.agreement import agree_values

#: collectives the controller can predict, and the cost formula of each (seconds for one group)
_SPARSE = ("allgather", "art_ring", "art_tree")


def _cost(collective: str, model: NetworkModel, numel: int, n: int, c: float, value_bytes: int) -> float:
    a, b, M = model.alpha_s, model.beta_s_per_byte, 4.0 * numel
    if collective == "allgather":
        return cost_model.sparse_allgather_cost(a, b, M, n, c, value_bytes)
    if collective in ("art_ring", "art_allreduce"):  # the backend allreduce is modelled as a ring
        return cost_model.art_ring_cost(a, b, M, n, c, value_bytes)
    if collective == "art_tree":
        return cost_model.art_tree_cost(a, b, M, n, c, value_bytes)
    if collective in ("allreduce", "ring"):  # summable values at shared indices (RandomK)
        return cost_model.ring_allreduce_cost(a, b, M * c * value_bytes / 4, n)
    if collective == "tree":
        return cost_model.tree_allreduce_cost(a, b, M * c * value_bytes / 4, n)
    raise ValueError(
        f"collective {collective!r} has no cost formula the controller knows; the adaptive ratio works with "
        f"Top-k family and RandomK compressors on {sorted(set(_SPARSE) | {'art_allreduce', 'allreduce', 'ring', 'tree', 'auto_sparse'})}."
    )


def collective_choices(exchange_name: str) -> tuple[str, ...]:
    """Collectives the engine's exchange can run: all three sparse ones for ``auto_sparse`` (it
    picks per step by the same model), otherwise just the exchange's own."""
    if exchange_name == "auto_sparse":
        return _SPARSE
    _cost(exchange_name, NetworkModel(0.0, 0.0), 1, 2, 0.5, 4)  # refuses an unknown collective
    return (exchange_name,)


def predicted_sync_s(model: NetworkModel, numels: Sequence[int], world_size: int, c: float, collective: str,
                     value_bytes: int = 4) -> float:
    """Model seconds per step at ratio ``c`` on ``collective``: the sum over compressed groups."""
    return sum(_cost(collective, model, n, world_size, c, value_bytes) for n in numels)


def agree(values: Sequence[float], group=None, device: torch.device | None = None) -> list[float]:
    """Mean over ranks of each value (one float64 SUM all-reduce); identity without a process group.

    A collective: every rank must call it with the same number of values at the same point.
    """
    return agree_values(values, "mean", group, device)


@dataclass
class CandidateResult:
    """Agreed measurements of one candidate ratio (units: seconds per step, gain dimensionless)."""

    c: float
    t_comp_s: float
    gain: float
    t_sync_measured_s: float | None = None  # measured exchange time per step (None: not sent)
    t_sync_predicted_s: dict[str, float] = field(default_factory=dict)  # per collective, uncalibrated
    steps: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ObjectiveData:
    """Everything one decision is computed from (agreed across ranks, stored in the history)."""

    candidates: list[CandidateResult]
    collectives: tuple[str, ...]
    alpha_s: float
    beta_s_per_byte: float
    numels: tuple[int, ...]
    world_size: int
    value_bytes: int = 4
    calibration: float = 1.0
    step_s: float = 0.0  # measured wall time of a training step (median of recent steps, mean over ranks)

    @property
    def network(self) -> NetworkModel:
        return NetworkModel(self.alpha_s, self.beta_s_per_byte)

    def t_sync_s(self, c: float, collective: str) -> float:
        """Calibrated model seconds per step at any ``c`` (the model is analytic in ``c``)."""
        return self.calibration * predicted_sync_s(self.network, self.numels, self.world_size, c, collective,
                                                   self.value_bytes)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["candidates"] = [x.as_dict() for x in self.candidates]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ObjectiveData:
        d = dict(d)
        d["candidates"] = [CandidateResult(**x) for x in d["candidates"]]
        d["collectives"] = tuple(d["collectives"])
        d["numels"] = tuple(d["numels"])
        return cls(**d)


def calibration(candidates: Sequence[CandidateResult], collective_used: Callable[[float], str],
                bounds: tuple[float, float] = (0.1, 10.0)) -> float:
    """Median of measured/predicted over the candidates that were really sent, clipped to ``bounds``.

    The alpha-beta model predicts the wire time of the collective's schedule; the measured time
    also holds software overhead (packing, Python, thread hand-off) that the model does not see.
    One multiplicative factor keeps the model's shape in ``c`` and its choice of collective, and
    puts its level where the measurements are. 1.0 when nothing was measured.
    """
    ratios = []
    for cand in candidates:
        pred = cand.t_sync_predicted_s.get(collective_used(cand.c))
        if cand.t_sync_measured_s is not None and pred and pred > 0:
            ratios.append(cand.t_sync_measured_s / pred)
    if not ratios:
        return 1.0
    ratios.sort()
    mid = len(ratios) // 2
    med = ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])
    return min(max(med, bounds[0]), bounds[1])


def _sq(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2


class ShadowScorer:
    """Engine group observer that scores candidate ratios on the live error-fed gradient.

    The engine calls it on its runner thread with each lossy group's ``p = g + e`` just before the
    group's exchange (``GCEngine.group_observer``). For every candidate it compresses ``p`` with a
    copy of the engine's compressor set to that ratio, decompresses it (what aggregation costs),
    and accumulates ``‖sent‖²``, ``‖p‖²`` and the elapsed seconds. Nothing is sent and ``p`` is not
    modified. Call :meth:`results` on every rank after the scored steps: it agrees the sums.

    For AR-Topk compressors the local Top-k selection stands for the source rank's: the gain of a
    broadcast index set is not known without sending it (rollback mode measures the real one).
    """

    def __init__(self, compressor: Compressor, candidates: Sequence[float]) -> None:
        self.candidates = tuple(float(c) for c in candidates)
        self._compressors = []
        for c in self.candidates:
            comp = copy.copy(compressor)
            comp.set_ratio(c)  # only the copy's config changes: the live compressor keeps its ratio
            self._compressors.append(comp)
        self.sent2 = [0.0] * len(self.candidates)
        self.time_s = [0.0] * len(self.candidates)
        self.p2 = 0.0
        self.steps: set[int] = set()

    def __call__(self, gid: int, p: Tensor, ctx: GroupContext) -> None:
        self.steps.add(ctx.step)
        self.p2 += _sq(p)
        cuda = p.is_cuda
        for i, comp in enumerate(self._compressors):
            if cuda:
                torch.cuda.synchronize(p.device)
            t0 = time.perf_counter()
            out = comp.compress(p, ctx)
            sent = out.payload[0] if comp.sends_exact_subset else None
            dense = comp.decompress(out.payload, out.meta, ctx)
            if sent is None:
                sent = dense
            s2 = _sq(sent)
            if cuda:
                torch.cuda.synchronize(p.device)
            self.time_s[i] += time.perf_counter() - t0
            self.sent2[i] += s2

    def results(self, group=None, device: torch.device | None = None) -> list[CandidateResult]:
        """Agreed per-candidate results (a collective: call on every rank)."""
        steps = max(len(self.steps), 1)
        vals = agree([self.p2, *self.sent2, *self.time_s, float(len(self.steps))], group, device)
        k = len(self.candidates)
        p2, sent2, times = vals[0], vals[1:1 + k], vals[1 + k:1 + 2 * k]
        out = []
        for c, s2, t in zip(self.candidates, sent2, times):
            gain = s2 / p2 if p2 > 0 else math.nan
            out.append(CandidateResult(c=c, t_comp_s=t / steps, gain=gain, steps=steps))
        return out
