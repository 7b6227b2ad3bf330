"""Per-step agreement across ranks: what every rank must know identically, and nothing more.

Two small collectives per step, both issued by the engine's ordered worker (never by the hook),
so neither blocks backward:

* **Opening check** (every step, before the step's first exchange): each rank hashes what it is
  about to do — step number, dense or compressed, plan, compressor configuration (ratio
  included), collective and the network model it will decide with — and the hashes are
  all-gathered (8 bytes per rank). If any rank differs, every rank raises at once, naming the
  ranks by what they would have done, instead of issuing mismatched collectives (which on gloo
  ends in a C++ abort, "Received data size doesn't match expected size", and on NCCL in a hang).
* **Closing report** (compressed steps, after the step's last exchange): one float64 sum-allreduce
  of named fields — how many ranks saw a non-finite gradient, Σ‖sent‖² and Σ‖p‖² for the
  compression gain, and the exchange time with its model prediction for the network tracker. Error
  memory is committed only after it, so a non-finite step leaves memory untouched on every rank.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.collectives import allgather_bytes, ring_allreduce_bytes


def descriptor_hash(text: str) -> int:
    return zlib.crc32(text.encode())


def check_descriptor(text: str, step: int, group, world_size: int, device: torch.device) -> int:
    """All-gather the hash of ``text``; raise on every rank if ranks differ. Returns bytes sent."""
    mine = torch.tensor([descriptor_hash(text)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    hashes = [int(t.item()) for t in gathered]
    if len(set(hashes)) > 1:
        by_hash: dict[int, list[int]] = {}
        for r, h in enumerate(hashes):
            by_hash.setdefault(h, []).append(r)
        raise RuntimeError(
            f"lightning_gc: at step {step} the ranks are about to issue different exchanges and would "
            f"deadlock or abort. Ranks grouped by what they would do: {list(by_hash.values())}. This "
            f"rank's step: {text}. Every rank must run the same plan, compressor options, ratio, "
            "collective and step counter; change the ratio or plan only through GCEngine.set_ratio / "
            "replace_plan (which check the ranks agree), and resume every rank from the same checkpoint."
        )
    return allgather_bytes(8, world_size)


@dataclass
class StepReport:
    """The closing report of a compressed step: summed over ranks by :func:`agree`."""

    nonfinite_ranks: float = 0.0
    sent2: float = 0.0
    p2: float = 0.0
    exchange_comm_s: float = 0.0
    predicted_comm_s: float = 0.0
    has_prediction: float = 0.0

    def to_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepReport:
        return cls(*(float(v) for v in t.cpu().tolist()))


def agree(report: StepReport, group, world_size: int, device: torch.device) -> tuple[StepReport, int]:
    """Sum the reports of all ranks. Returns (summed report, bytes this rank sent)."""
    t = report.to_tensor(device)
    dist.all_reduce(t, group=group)
    return StepReport.from_tensor(t), ring_allreduce_bytes(t.numel() * 8, world_size)
