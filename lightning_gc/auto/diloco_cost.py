"""DiLoCo's step time, predicted from the same measured inputs as the per-step methods' (auto/model.py).

Pure: plain numbers in, a prediction out, so a DiLoCo configuration can be ranked beside the per-step
candidates on one scale (seconds per optimizer step) by ``auto`` and ``lightning-gc advise``.

**The schedule** (:mod:`lightning_gc.sync.diloco`, flat: every rank is a worker). An inner step computes
(forward, backward, optimizer, whatever else the step holds) and sends nothing. Fragment ``p`` of ``F``
(about ``1/F`` of the model) is averaged once every ``H`` inner steps: one finiteness flag (a latency-bound
allreduce) and then the fragment's Δ on the link, taking ``x`` seconds by its wire format. With
``overlap_steps`` τ = 0 the main thread waits for it, so all of ``x`` is exposed; with τ > 0 it runs on a
worker thread behind the next τ inner steps' compute ``c`` and only ``max(0, x − τ·c)`` is exposed. So

    step = c + Σ_p (flag + exposed_p) / H,        exposed_p = max(0, x_p − τ·c),

summed over the F fragments, ``x_p`` the time of fragment ``p``'s share of Δ (equal shares unless
given: DiLoCo cuts whole tensors, so shares differ a little).

What it leaves out, and how to read it:

* the outer optimizer's own arithmetic (one pass over θ_outer per fragment, small beside ``c``);
* a link that the background exchange shares with nothing else: on one CPU or GPU stream the exchange
  also takes compute time, so with τ > 0 the prediction is a lower bound;
* DiLoCo by nodes (``topology="nodes"``) adds an intra-node gradient mean to every inner step; this model
  is the flat schedule.

The step time is only half of a choice between families: DiLoCo takes more steps than per-step DDP to a
given loss as H grows, which a time-per-step comparison cannot see (the progress estimate is separate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..comm import cost_model
from ..comm.cost_model import NetworkModel
from ..comm.direct import allgather_seconds, allreduce_seconds
from .model import Workload

#: how the fragment's Δ travels: ``dense`` is DiLoCo's own fp32 ``all_reduce`` (gloo's ring), ``allreduce``
#: a compressor whose payload is summed (the 16-bit casts, through the engine's allreduce), ``allgather``
#: one whose payloads are gathered and decoded (Top-k, SparseLoCo)
DeltaWire = Literal["dense", "allreduce", "allgather"]

#: bytes of the finiteness flag each fragment exchange agrees on first (one float32)
FLAG_BYTES = 4


@dataclass(frozen=True)
class DiLoCoCandidate:
    """One DiLoCo configuration as a candidate.

    Attributes:
        inner_steps: H, inner steps between a fragment's outer steps (≥ 1).
        fragments: F, Streaming DiLoCo's fragments (1 ≤ F ≤ H).
        overlap_steps: τ, inner steps a fragment's exchange runs behind (0 ≤ τ < H/F).
        delta_bytes_per_element: payload bytes per model element of one Δ (4 for fp32, 2 for an fp16
            cast, about ``density · (value + offset bytes)`` for a sparse format).
        wire: how the payload travels (:data:`DeltaWire`).
        shares: each fragment's fraction of the model's elements, in send order (empty: F equal
            fragments). DiLoCo cuts whole tensors, so a large embedding makes one fragment larger,
            and with τ > 0 the largest fragment is the one whose exchange shows.
    """

    inner_steps: int
    fragments: int = 1
    overlap_steps: int = 0
    delta_bytes_per_element: float = 4.0
    wire: DeltaWire = "dense"
    shares: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        h, f, tau = self.inner_steps, self.fragments, self.overlap_steps
        if not (isinstance(h, int) and h >= 1):
            raise ValueError(f"DiLoCoCandidate.inner_steps={h!r} must be an integer ≥ 1, e.g. 50.")
        if not (isinstance(f, int) and 1 <= f <= h):
            raise ValueError(f"DiLoCoCandidate.fragments={f!r} must be an integer in [1, inner_steps={h}], e.g. 1.")
        if not (isinstance(tau, int) and 0 <= tau < h // f):
            raise ValueError(f"DiLoCoCandidate.overlap_steps={tau!r} must be an integer in [0, H/F) = [0, {h // f}): "
                             "a fragment's exchange is applied before the next one is sent. Lower it, or raise H.")
        b = self.delta_bytes_per_element
        if not (math.isfinite(b) and b > 0):
            raise ValueError(f"DiLoCoCandidate.delta_bytes_per_element={b!r} must be a number > 0, e.g. 2.0 (fp16).")
        if self.wire not in ("dense", "allreduce", "allgather"):
            raise ValueError(f"DiLoCoCandidate.wire={self.wire!r} must be 'dense', 'allreduce' or 'allgather'.")
        s = self.shares
        if s and (len(s) != f or any(not (math.isfinite(x) and x > 0) for x in s) or abs(sum(s) - 1.0) > 1e-6):
            raise ValueError(f"DiLoCoCandidate.shares={s!r} must hold fragments={f} positive fractions summing to 1, "
                             "or be empty (equal fragments).")

    def describe(self) -> str:
        parts = [f"H={self.inner_steps}"]
        if self.fragments > 1:
            parts.append(f"F={self.fragments}")
        if self.overlap_steps:
            parts.append(f"tau={self.overlap_steps}")
        return f"diloco({','.join(parts)},{self.delta_bytes_per_element:g}B/el,{self.wire})"


@dataclass(frozen=True)
class DiLoCoPrediction:
    """Seconds and bytes of one DiLoCo configuration, per inner (optimizer) step unless named otherwise."""

    step_s: float
    compute_s: float
    exchange_s: float  # one fragment's Δ on the link (the largest fragment's with unequal shares)
    exposed_s: float  # of which the main thread waits, per fragment exchange (mean over the fragments)
    bytes_per_step: float  # bytes this rank sends, averaged over the H steps


def exchange_seconds(cand: DiLoCoCandidate, network: NetworkModel, world_size: int, payload: float) -> float:
    """Time of one fragment's Δ (``payload`` bytes per rank) on the link, by its wire format."""
    if cand.wire == "dense":
        return cost_model.ring_allreduce_cost(network.alpha_s, network.beta_s_per_byte, payload, world_size)
    if cand.wire == "allreduce":
        return allreduce_seconds(network, payload, world_size)
    return allgather_seconds(network, payload, world_size)


def _bytes_sent(cand: DiLoCoCandidate, payload: float, world_size: int) -> float:
    if cand.wire == "allgather":
        return float(cost_model.allgather_bytes(int(round(payload)), world_size))
    return float(cost_model.ring_allreduce_bytes(int(round(payload)), world_size))


def predict_diloco(cand: DiLoCoCandidate, workload: Workload, network: NetworkModel,
                   world_size: int) -> DiLoCoPrediction:
    """The mean step of ``cand`` on ``world_size`` ranks (see the module docstring for the schedule)."""
    compute = workload.forward_s + workload.backward_total_s + workload.optimizer_s + workload.other_s
    if world_size <= 1:
        return DiLoCoPrediction(compute, compute, 0.0, 0.0, 0.0)
    flag = cost_model.ring_allreduce_cost(network.alpha_s, network.beta_s_per_byte, FLAG_BYTES, world_size)
    hidden = cand.overlap_steps * compute  # compute the exchange runs behind (0 without overlap)
    xs, exposed, sent = [], 0.0, 0.0
    for share in cand.shares or (1.0 / cand.fragments,) * cand.fragments:
        payload = workload.numel * cand.delta_bytes_per_element * share
        x = exchange_seconds(cand, network, world_size, payload)
        xs.append(x)
        exposed += max(0.0, x - hidden)
        sent += _bytes_sent(cand, payload, world_size)
    per_round = cand.fragments * flag + exposed
    return DiLoCoPrediction(step_s=compute + per_round / cand.inner_steps, compute_s=compute, exchange_s=max(xs),
                            exposed_s=exposed / cand.fragments, bytes_per_step=sent / cand.inner_steps)


__all__ = ["DeltaWire", "DiLoCoCandidate", "DiLoCoPrediction", "exchange_seconds", "predict_diloco"]
