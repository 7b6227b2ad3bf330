"""The link canary: before a dense mode's next step, time one small message and see whether the link fell.

Why: under ``compressor="auto"`` a dense mode (fp32 or a 16-bit cast on DDP's buckets) is the pick on
a fast link. When the link falls, the next dense step sends the whole gradient at the fallen rate
before any test that reads a step's wall can act: on the ``mlp`` preset at 10 Mbit/s one 16-bit
step took 3.0-3.4 s, where the best static method ran the whole 146-step round in 8.6-8.9 s
(docs/auto-measurements.md).

How: at the end of each step that a dense mode runs, where the step's wall is agreed anyway
(:meth:`AutoChooser._agree_wall_later`), every rank first sends ``nbytes`` of padding to every other
rank at once (the direct exchange, :mod:`lightning_gc.comm.direct`), timed; then one more direct
exchange (an allgather of two floats per rank) shares each rank's time and its step wall, which
replaces the wall's own agreement. Every rank then holds the same list and takes the same verdict:
the link fell when the *fastest* rank's time is at least ``factor`` times what the agreed network
model gives the message and at least ``margin_s`` more. A verdict "fell" is timed once more, with a
second message, and stands only if that one says so too; ``auto`` then re-decides before the next
step (docs/auto.md, "The link canary").

Why the fastest rank's time: a rank that enters the exchange early waits in it for the others, so
its time holds their lateness. The latest rank waits for nobody: its time is the network's, less the
others' lead where that lead is longer than the transfer (a fall can then be missed, never invented).

Why a second message: one message slowed by a scheduler stall (4 ranks share 2 cores on this
project's machine) would otherwise move auto off its method on a link that never fell. On a fallen
link the second costs one more message (~160 ms for 64 KiB on 4 ranks at 10 Mbit/s). Its figures are
the verdict's: a shaper's burst allowance let part of the first message out at line rate, the first
spent it, so the second times the link's own rate.

Why 64 KiB: on a 4-rank group each rank sends three copies, 192 KiB. The bench's shaper lets 64 KiB
out at line rate (``tc`` ``tbf`` burst, ``lightning_gc.bench.netns.tc_burst_bytes``); the 128 KiB
beyond it take ~105 ms at 10 Mbit/s, and the whole message takes a few tenths of a millisecond to
1.6 ms at 1 Gbit/s.

What it does not see: a link that falls *during* a dense step's exchange makes that step slow (the
one-step test acts at its end); the canary sees a fall that came before the next step begins.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import cost_model
from ..comm.direct import direct_allgather


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
