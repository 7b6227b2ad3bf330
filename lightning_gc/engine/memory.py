"""Error memory: what each rank has not sent yet, per plan group, staged until the step is agreed.

Error feedback keeps ``e ← p − sent`` with ``p = g + e``. The engine computes the new memory while
the step's exchanges run, but a step whose gradient turns out to be non-finite on some rank must
leave memory untouched on *every* rank, and that is only known when the step's closing agreement
has arrived. So new memories are *staged* per group and either committed or discarded, all at
once, after the agreement.

Memory is stored as one flat tensor per plan group (what the exchange works on), and exported /
imported keyed by parameter name, so it survives DDP's bucket rebuilds, checkpoints and a change
of plan (:meth:`remap`). ‖e‖² is kept per group as it is computed, so the monitored norm costs no
extra pass over the memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from ..plans import Plan


class ErrorMemory:
    def __init__(self) -> None:
        self._mem: dict[int, Tensor] = {}
        self._sq: dict[int, float] = {}
        self._staged: dict[int, tuple[Tensor, float | None]] = {}

    # ------------------------------------------------------------------ per step
    def get(self, gid: int) -> Tensor | None:
        return self._mem.get(gid)

    def stage(self, gid: int, memory: Tensor, sq: float | None = None) -> None:
        """New memory of group ``gid`` for this step; ``sq`` = ‖memory‖² if already known."""
        self._staged[gid] = (memory, sq)

    def stage_clear(self, gid: int) -> None:
        """Group ``gid`` keeps no memory after this step (a method without error feedback flushed it)."""
        self._staged[gid] = (None, 0.0)  # type: ignore[assignment]

    def commit(self) -> None:
        for gid, (m, sq) in self._staged.items():
            if m is None:
                self._mem.pop(gid, None)
                self._sq.pop(gid, None)
                continue
            self._mem[gid] = m
            self._sq[gid] = float(m.double().pow(2).sum()) if sq is None else sq
        self._staged.clear()

    def discard(self) -> None:
        self._staged.clear()

    # ------------------------------------------------------------------ views
    @property
    def groups(self) -> Mapping[int, Tensor]:
        """Committed memory per group id (read-only view)."""
        return dict(self._mem)

    def norm(self) -> float:
        """‖e‖₂ over all groups."""
        for gid, m in self._mem.items():
            if gid not in self._sq:
                self._sq[gid] = float(m.double().pow(2).sum())
        return math.sqrt(sum(self._sq[g] for g in self._mem))

    # ------------------------------------------------------------------ by parameter name
    def by_name(self, plan: Plan) -> dict[str, Tensor]:
        """Committed memory split per parameter name (CPU copies)."""
        out: dict[str, Tensor] = {}
        for gid, mem in self._mem.items():
            g = plan.groups[gid]
            off = 0
            for name, n in zip(g.names, g.numels):
                out[name] = mem[off:off + n].detach().cpu().clone()
                off += n
        return out

    def load_by_name(self, plan: Plan, saved: Mapping[str, Tensor], dtypes: list[torch.dtype],
                     device: torch.device) -> list[str]:
        """Replace all memory from a name-keyed mapping laid out by ``plan``.

        Returns the names that were missing or had the wrong size (their memory starts at zero).
        ``dtypes`` is indexed by parameter id. An empty mapping means "nothing compressed yet".
        """
        self._mem, self._sq, self._staged = {}, {}, {}
        missing: list[str] = []
        if not saved:
            return missing
        for g in plan.groups:
            if g.exact:
                continue
            parts = []
            for name, n, pid in zip(g.names, g.numels, g.param_ids):
                t = saved.get(name)
                if t is None or t.numel() != n:
                    missing.append(name)
                    t = torch.zeros(n, dtype=dtypes[pid])
                parts.append(t.reshape(-1).to(dtype=dtypes[pid]))
            self._mem[g.gid] = torch.cat(parts).to(device)
        return missing

    def remap(self, old: Plan, new: Plan, dtypes: list[torch.dtype], device: torch.device) -> list[str]:
        """Re-lay the memory out for a new plan (same parameters, other grouping)."""
        return self.load_by_name(new, self.by_name(old), dtypes, device)

    def clear(self) -> None:
        self._mem, self._sq, self._staged = {}, {}, {}
