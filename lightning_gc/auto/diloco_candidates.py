"""The DiLoCo configurations ``compressor="auto"`` may switch to (``auto_diloco``), and their costs.

A DiLoCo candidate is a whole synchronisation family, not a codec: every rank trains alone for H
optimizer steps, then the ranks average the pseudo-gradient Δ = θ_outer − θ_local (docs/diloco.md).
A name is a form of Δ followed by H; the form fixes how Δ travels and the outer optimizer that suits it:

* ``diloco<H>`` (``diloco10``, ``diloco50``, ...): Δ cast to fp16 and summed (the engine's
  allreduce), the published outer optimizer (SGD, lr 0.7, Nesterov momentum 0.9). Half DDP's fp32
  bytes, once every H steps.
* ``sparseloco<H>``: SparseLoCo's Δ (chunked Top-k 1/64, 2-bit values, per-rank error feedback with
  decay 0.95, allgathered; outer SGD lr 1 without momentum, as in the paper). A payload of about
  1/110 of the fp32 model per rank (each rank receives N − 1 of them), once every H steps.

Smaller H keeps the replicas closer (more progress per step), larger H hides a slower link. The
choice among them is :func:`lightning_gc.auto.sync_trial.pick_challenger`'s; whether DiLoCo pays at
all is measured by a trial on the training loss (:mod:`lightning_gc.auto.sync_trial`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..sync.diloco import DiLoCoConfig
from .diloco_cost import DiLoCoCandidate


@dataclass(frozen=True)
class DiLoCoChoice:
    """One DiLoCo candidate: its name, H, and how its Δ is sent."""

    name: str
    inner_steps: int
    delta: str  # "fp16" (cast, summed) or "sparseloco" (SparseLoCo's codec, gathered)

    def config(self) -> DiLoCoConfig:
        """The :class:`~lightning_gc.sync.diloco.DiLoCoConfig` this candidate runs."""
        if self.delta == "sparseloco":
            return DiLoCoConfig(inner_steps=self.inner_steps, compressor="sparseloco", error_decay=0.95)
        return DiLoCoConfig(inner_steps=self.inner_steps)

    def compressor(self) -> Any:
        """The Δ compressor passed to DiLoCo beside the config (None where the config names its own)."""
        if self.delta == "fp16":
            from ..compressors.cast import CastCompressor, CastConfig

            return CastCompressor(CastConfig(dtype="fp16"))
        return None

    def cost(self, numel: int) -> DiLoCoCandidate:
        """The cost model's view of it (:mod:`lightning_gc.auto.diloco_cost`) for a model of ``numel`` elements."""
        if self.delta == "sparseloco":
            from ..compressors.sparseloco import SparseLoCoConfig, sparseloco_payload_bytes

            per_el = sparseloco_payload_bytes(max(int(numel), 1), SparseLoCoConfig()) / max(int(numel), 1)
            return DiLoCoCandidate(self.inner_steps, delta_bytes_per_element=per_el, wire="allgather")
        return DiLoCoCandidate(self.inner_steps, delta_bytes_per_element=2.0, wire="allreduce")


#: the forms of Δ, as a name's prefix
DELTA_FORMS: dict[str, str] = {"diloco": "fp16", "sparseloco": "sparseloco"}
#: the names the docs use as examples: the small set of H the papers' small models run well with
DILOCO_CANDIDATES: tuple[str, ...] = ("diloco10", "diloco50", "sparseloco10", "sparseloco50")
_NAME = re.compile(r"^(diloco|sparseloco)([1-9][0-9]*)$")


def diloco_choice(name: str) -> DiLoCoChoice:
    """The DiLoCo candidate called ``name`` (``<form><H>``); other names are refused with the forms."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"auto_diloco: {name!r} is not a DiLoCo candidate; a name is a form of the pseudo-gradient "
                         f"({', '.join(DELTA_FORMS)}) followed by H, the inner steps per round, e.g. "
                         f"auto_diloco=['diloco10', 'diloco50'] or ['sparseloco50'].")
    return DiLoCoChoice(name, int(m.group(2)), DELTA_FORMS[m.group(1)])


__all__ = ["DELTA_FORMS", "DILOCO_CANDIDATES", "DiLoCoChoice", "diloco_choice"]
