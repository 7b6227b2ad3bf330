"""The link canary: a dense step that sees a fallen link before it sends its gradient, and stops.

Why: when a dense mode (fp32 or a 16-bit cast on DDP's buckets) is auto's pick and the link falls, the
next dense step sends the whole gradient at the fallen rate before any test that reads a step's wall
can act. The canary times the link first, on the engine's ordered worker before the step (it overlaps
the step's forward and backward, and the step's buckets wait behind it): the engine's generic port
``GCEngine.run_before_step`` runs :class:`CanaryJob`, and a verdict "fell" stops the dense step
(lightning_gc/engine/dense_stop.py: its compressed groups' gradients become error memory, sent by the
next step's method; nothing is lost). auto then re-decides at the step's end.

How: every rank sends ``nbytes`` to every other rank at once (the direct exchange), timed; one more
direct exchange shares each rank's time and a value the caller carries (auto's step wall). Every rank
takes the same verdict: the link fell when the *fastest* rank's time (a rank that enters early waits
for the others, so a fall can be missed, never invented) is at least ``factor`` times the network
model's time for the message and ``margin_s`` more. A "fell" stands only if a second message says so
too: one scheduler stall must not stop a step, and the first message may have spent a shaper's burst.

Tuning: ``nbytes`` must exceed the link's burst allowance divided by ``N-1`` or a fall does not show;
``factor`` and ``margin_s`` trade missed falls against false stops on a busy host. What it does not
see: a link that falls *during* a step; auto's one-step test acts on that step's wall.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import cost_model
from ..comm.direct import direct_allgather
from ..engine.dense_stop import StopVerdict


@dataclass(frozen=True)
class LinkCanary:
    """When the canary says the link fell (see the module docstring).

    Args:
        nbytes: bytes each rank sends to each other rank. Above the link's burst allowance divided
            by ``N-1``, or a fall does not show; more costs more on a fast link.
        factor: the link fell when the fastest rank's time is at least this many times the model's ...
        margin_s: ... and at least this many seconds more (scheduling noise on a busy host).
    """

    nbytes: int = 64 * 1024
    factor: float = 4.0
    margin_s: float = 0.02

    def __post_init__(self) -> None:
        b = self.nbytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"canary_bytes={b!r} must be an integer >= 1: the bytes each rank sends each other rank "
                             "to time the link (e.g. 65536).")
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 1:
            raise ValueError(f"canary_factor={f!r} must be a finite number >= 1: how many times the model's time the "
                             "message must take for the link to count as fallen (e.g. 4).")
        m = self.margin_s
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0:
            raise ValueError(f"canary_margin_s={m!r} must be a finite number of seconds >= 0: how much longer than the "
                             "model's time the message must take for the link to count as fallen (e.g. 0.02).")

    def predicted_s(self, network: Any, world_size: int) -> float | None:
        """The model's time for the message (the direct exchange's α-β cost; None without a model)."""
        if network is None:
            return None
        return cost_model.direct_cost(network.alpha_s, network.beta_s_per_byte, self.nbytes, world_size)

    def fell(self, fastest_s: float, predicted_s: float | None) -> bool:
        """The rule: the fastest rank's time against the model's (no model: never)."""
        if predicted_s is None:
            return False
        return fastest_s >= self.factor * predicted_s and fastest_s >= predicted_s + self.margin_s


@dataclass
class CanaryResult:
    """What every rank learned (identical on every rank)."""

    fell: bool
    fastest_s: float  # the fastest rank's time for the (last) message
    predicted_s: float | None  # the model's
    carried: float  # the mean over the ranks of the value each rank carried (the step's wall)
    messages: int  # 1, or 2 where the first said "fell"


def _timed(nbytes: int, carry: float, group: Any, world_size: int, device: torch.device) -> tuple[float, float]:
    """One message of ``nbytes`` to every other rank, timed, then the times and ``carry`` shared:
    (the fastest rank's time, the mean of the carried values)."""
    pad = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    parts = [torch.empty_like(pad) for _ in range(world_size)]
    t0 = time.perf_counter()
    direct_allgather(parts, pad, group)
    if pad.is_cuda:
        torch.cuda.current_stream().synchronize()
    mine = time.perf_counter() - t0
    shared = torch.tensor([mine, float(carry)], dtype=torch.float64, device=device)
    rows = [torch.empty_like(shared) for _ in range(world_size)]
    direct_allgather(rows, shared, group)
    vals = [r.cpu().tolist() for r in rows]  # rank order: the same list on every rank
    return min(v[0] for v in vals), sum(v[1] for v in vals) / world_size


def sing(canary: LinkCanary, carry: float, network: Any, group: Any, world_size: int,
         device: torch.device) -> CanaryResult:
    """Time the canary (twice where the first says "fell") and agree ``carry``'s mean. A collective:
    every rank of ``group`` calls it at the same point (up to 8 ranks, off NCCL: the direct exchange)."""
    predicted = canary.predicted_s(network, world_size)
    fastest, carried = _timed(canary.nbytes, carry, group, world_size, device)
    if not canary.fell(fastest, predicted):
        return CanaryResult(False, fastest, predicted, carried, 1)
    fastest, _ = _timed(canary.nbytes, carry, group, world_size, device)
    return CanaryResult(canary.fell(fastest, predicted), fastest, predicted, carried, 2)



@dataclass
class CanaryJob:
    """The engine job (``GCEngine.run_before_step``) that sings ``canary`` before a step and stops a dense
    step on a fall; ``carry``: the value every rank adds to the canary's second message (NaN: none)."""

    canary: LinkCanary
    carry: float
    network: Any
    group: Any
    world_size: int
    device: torch.device

    def __call__(self) -> StopVerdict:
        res = sing(self.canary, self.carry, self.network, self.group, self.world_size, self.device)
        return StopVerdict(res.fell, res.carried, res.fastest_s, res.predicted_s, self.canary.nbytes)
