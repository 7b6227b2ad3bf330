"""Per-step agreement across ranks: what every rank must know identically, and nothing more.

Two small collectives, both issued by the engine's ordered worker (never by the hook), so neither
blocks backward:

* **Opening check** (before a step's first exchange; on dense steps before the warm-up's buckets):
  each rank hashes what it is about to do — step number, dense or compressed, plan, compressor
  configuration (ratio included), collective and the network model it will decide with — and the
  hashes are all-gathered (8 bytes per rank). If any rank differs, every rank raises at once,
  naming the ranks by what they would have done, instead of issuing mismatched collectives (which
  on gloo ends in a C++ abort, "Received data size doesn't match expected size", and on NCCL in a
  hang). A compressed step runs it at the first step after construction or a checkpoint load,
  after a change no other collective compared (a probe's new network model, a plan installed with
  ``verify=False``) and every ``EngineConfig.check_every`` steps — a schedule of replicated values,
  so every rank runs it on the same steps.
* **Closing report** (compressed steps, after the step's last exchange): one float64 sum-allreduce
  of named fields — how many ranks saw a non-finite gradient, Σ‖sent‖² and Σ‖p‖² for the
  compression gain, the exchange time with its model prediction for the network tracker, a figure a
  caller asked to have agreed (``GCEngine.carry_wall``: the ``auto`` chooser's step wall), and the
  same hash as the opening check, as its two 16-bit halves and their squares: the ranks agree iff
  ``N·Σh² = (Σh)²`` for both halves (exact in float64 up to ~1400 ranks). So every compressed step is
  checked, at no extra message; a difference found here stops the step on every rank before its
  error memory is committed or its gradient handed to the optimizer. Error memory is committed only
  after it, so a non-finite step leaves memory untouched on every rank.

**The report riding in the last message** (:class:`RiddenReport`): where a step's last exchange is one
sum-allreduce that can take a few more elements (``Exchange.carries_report``: ``lowrank``'s ``Q``
message), the report travels there instead of in a collective of its own, in the message's dtype
(fp32 or bfloat16), not float64. What changes so that nothing is lost:

* the counts (non-finite ranks, malformed ranks, ranks that carried a figure) are sums of 0/1 per rank
  and the hash travels as its 32 bits, one element each: every rank sent the same hash iff each
  bit's sum is 0 or N. Both are sums of small integers, exact in the dtype while N stays below
  :data:`RIDER_MAX_RANKS` (2^24 ranks in fp32, 256 in bfloat16; above it the report goes alone);
* Σ‖sent‖², Σ‖p‖² and the carried wall are summed in the dtype: about 7 significant digits in fp32,
  about 2-3 in bfloat16 (the gain is a ratio of the two, for the controllers' drift tests);
* the exchange time cannot describe the message it rides in: the report carries the *previous*
  step's exchange time (:attr:`RiddenReport.exchange_step`), and only where no exchange of the step
  needs the network tracker's prediction (the engine sends the report alone then).

Why: the closing report is one more latency-bound collective per step on the exchange's process
group, a visible share of a step on a slow link (docs/concepts.md, "The closing report").

Why not the opening check on every step: it is one more latency-bound collective between the first
bucket and the first exchange, so the default schedule makes compressed steps shorter than a check on
every step (docs/concepts.md, "The opening check").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import check_descriptor, descriptor_hash
from ..comm.direct import allreduce_chosen

__all__ = ["RIDER_MAX_RANKS", "RiddenReport", "StepReport", "agree", "check_descriptor",
           "descriptor_hash"]  # the opening check lives in comm

#: The most ranks whose report can ride in a message of this dtype: its counts and the hash's bits are
#: sums of 0/1 per rank, exact while below 2^(significand bits) (24 in fp32, 8 in bfloat16). A dtype not
#: listed (float16: its range is too small for Σ‖p‖²) never carries the report.
RIDER_MAX_RANKS: dict[torch.dtype, int] = {torch.float32: 2 ** 24, torch.bfloat16: 2 ** 8}
_HASH_BITS = 32


@dataclass
class StepReport:
    """The closing report of a compressed step: summed over ranks by :func:`agree`."""

    nonfinite_ranks: float = 0.0
    sent2: float = 0.0
    p2: float = 0.0
    exchange_comm_s: float = 0.0
    predicted_comm_s: float = 0.0
    has_prediction: float = 0.0
    malformed_ranks: float = 0.0
    carried_wall_s: float = 0.0  # a caller's per-step figure (GCEngine.carry_wall), summed over ranks
    carried_ranks: float = 0.0  # how many ranks carried one
    digest_hi: float = 0.0  # the step's descriptor hash, upper 16 bits (summed over ranks)
    digest_hi2: float = 0.0  # ... squared
    digest_lo: float = 0.0  # lower 16 bits
    digest_lo2: float = 0.0  # ... squared

    def set_digest(self, digest: int) -> None:
        """This rank's share of the descriptor check: the hash's halves and their squares."""
        hi, lo = (digest >> 16) & 0xFFFF, digest & 0xFFFF
        self.digest_hi, self.digest_hi2 = float(hi), float(hi * hi)
        self.digest_lo, self.digest_lo2 = float(lo), float(lo * lo)

    def digests_agree(self, world_size: int) -> bool:
        """On the summed report: whether every rank's hash was the same (zero variance of both halves)."""
        n = float(world_size)
        return n * self.digest_hi2 == self.digest_hi ** 2 and n * self.digest_lo2 == self.digest_lo ** 2

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepReport:
        return cls(*(float(v) for v in t.cpu().tolist()))


@dataclass
class RiddenReport:
    """The closing report as it travels inside a step's last message (see the module docs): the
    summed fields, whether every rank's hash was the same, and the previous step's exchange time.

    ``report``: the summed :class:`StepReport` (its digest, exchange and prediction fields unused).
    ``digests_agree``: every bit of the 32-bit hash summed to 0 or N.
    ``exchange_comm_s``: Σ over the ranks of the previous step's time in the compressed exchanges, or
    ``None`` unless every rank carried one; ``exchange_step``: which step that was."""

    report: StepReport
    digests_agree: bool
    exchange_comm_s: float | None
    exchange_step: int | None

    #: elements before the hash's bits: nonfinite, malformed, sent2, p2, carried wall and ranks,
    #: previous exchange time and ranks
    FIELDS = 8

    @classmethod
    def encode(cls, report: StepReport, digest: int, previous_exchange_s: float | None,
               device: torch.device) -> Tensor:
        """This rank's share, fp32 (the exchange casts it to its message's dtype): the fields in the
        order of :attr:`FIELDS`, then the hash's 32 bits, least significant first."""
        prev = 0.0 if previous_exchange_s is None else float(previous_exchange_s)
        values = [report.nonfinite_ranks, report.malformed_ranks, report.sent2, report.p2,
                  report.carried_wall_s, report.carried_ranks, prev, 0.0 if previous_exchange_s is None else 1.0]
        values += [float((digest >> i) & 1) for i in range(_HASH_BITS)]
        return torch.tensor(values, dtype=torch.float32, device=device)

    @classmethod
    def numel(cls) -> int:
        return cls.FIELDS + _HASH_BITS

    @classmethod
    def decode(cls, summed: Tensor, world_size: int, step: int) -> RiddenReport:
        """The sums of :meth:`encode` over the ranks (``step``: the step that sent them)."""
        v = [float(x) for x in summed.double().cpu().tolist()]
        if len(v) != cls.numel():
            raise ValueError(f"a ridden report has {cls.numel()} elements, got {len(v)}")
        n = float(world_size)
        report = StepReport(nonfinite_ranks=v[0], malformed_ranks=v[1], sent2=v[2], p2=v[3],
                            carried_wall_s=v[4], carried_ranks=v[5])
        agree = all(b == 0.0 or b == n for b in v[cls.FIELDS:])
        every = v[7] == n
        return cls(report, agree, v[6] if every else None, step - 1 if every else None)


_OPS = ("max", "sum", "mean")


def agree_values(values, op: str, group=None, device: torch.device | None = None) -> list[float]:
    """Element-wise ``"max"``, ``"sum"`` or ``"mean"`` over the ranks of ``group`` of a list of
    floats, identical on every rank afterwards (one float64 all-reduce; through ``device`` when it is
    a CUDA device, as NCCL needs); the values themselves without a process group or on one rank.

    The one helper behind every measured figure the controllers agree on (the ``auto`` chooser's
    MAX of times, OMGS's MAX of its profile and calibration, AdaptiveRatio's means). A collective:
    every rank must call it with the same number of values at the same point. On up to 8 ranks off
    NCCL it goes by the direct exchange (one message latency; :mod:`lightning_gc.comm.direct`)."""
    if op not in _OPS:
        raise ValueError(f"agree_values(op={op!r}): use 'max', 'sum' or 'mean'.")
    vals = [float(v) for v in values]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return vals
    n = dist.get_world_size(group)
    t = torch.tensor(vals, dtype=torch.float64)
    if device is not None and device.type == "cuda":
        t = t.to(device)
    allreduce_chosen(t, group, op="max" if op == "max" else "sum")
    out = t.cpu().tolist()
    return [float(x) / n for x in out] if op == "mean" else [float(x) for x in out]


def agree(report: StepReport, group, world_size: int, device: torch.device) -> tuple[StepReport, int]:
    """Sum the reports of all ranks. Returns (summed report, bytes this rank sent). A report is a
    few hundred bytes: it goes by the direct exchange on up to 8 ranks (one message latency instead
    of the ring's ``2(N-1)``; :mod:`lightning_gc.comm.direct`)."""
    t = report.to_tensor(device)
    sent = allreduce_chosen(t, group)
    return StepReport.from_tensor(t), sent
