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

Either form takes Streaming DiLoCo's options as suffixes (docs/diloco.md): ``f<F>`` cuts the model
into F fragments sent in turn, and ``t<τ>`` overlaps each fragment's exchange with the next τ inner
steps. ``diloco50f5`` is H 50 in 5 fragments with τ = 5, half the 10 steps between two fragments'
sends (without ``t``, τ is ⌊H/F⌋ // 2: the exchange has half the gap to finish in, and the fragment
drops half as many local steps as the longest overlap would); ``diloco50f5t2`` sets τ = 2,
``diloco50t10`` overlaps a whole-model exchange. The merge α stays 0 (Streaming DiLoCo's default).
Streaming hides the link behind compute at the same bytes, at a cost in quality: the τ local steps
of each fragment are dropped when its outer step is applied. So a streaming candidate is picked
only where it hides an exchange that plain DiLoCo with the same H would leave exposed
(:func:`lightning_gc.auto.sync_trial.pick_challenger`).

Smaller H keeps the replicas closer (more progress per step), larger H hides a slower link. The
choice among them is :func:`lightning_gc.auto.sync_trial.pick_challenger`'s; whether DiLoCo pays at
all is measured by a trial on the training loss (:mod:`lightning_gc.auto.sync_trial`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..sync.diloco import DiLoCoConfig, split_fragments
from .diloco_cost import DiLoCoCandidate


@dataclass(frozen=True)
class DiLoCoChoice:
    """One DiLoCo candidate: its name, H, how its Δ is sent, and its streaming options (F, τ)."""

    name: str
    inner_steps: int
    delta: str  # "fp16" (cast, summed) or "sparseloco" (SparseLoCo's codec, gathered)
    fragments: int = 1
    overlap_steps: int = 0

    def config(self) -> DiLoCoConfig:
        """The :class:`~lightning_gc.sync.diloco.DiLoCoConfig` this candidate runs."""
        streaming = {"fragments": self.fragments, "overlap_steps": self.overlap_steps}
        if self.delta == "sparseloco":
            return DiLoCoConfig(inner_steps=self.inner_steps, compressor="sparseloco", error_decay=0.95, **streaming)
        return DiLoCoConfig(inner_steps=self.inner_steps, **streaming)

    def check_model(self, numels: list[int]) -> None:
        """Refuse a candidate with more fragments than the model has parameter tensors (at setup, not
        when auto first enters it)."""
        if self.fragments > len(numels):
            raise ValueError(f"auto_diloco: {self.name!r} cuts the model into {self.fragments} fragments, but it has "
                             f"{len(numels)} parameter tensors; each fragment needs one. Lower F (the number after "
                             f"'f'), e.g. {_name(self.delta, self.inner_steps, len(numels))!r}, or drop it.")

    def shares(self, numels: list[int]) -> tuple[float, ...]:
        """Each fragment's fraction of the model's elements, as DiLoCo cuts them (``split_fragments``)."""
        if self.fragments == 1:
            return ()
        total = float(sum(numels))
        return tuple(sum(numels[i] for i in idx) / total for idx in split_fragments(numels, self.fragments))

    def compressor(self) -> Any:
        """The Δ compressor passed to DiLoCo beside the config (None where the config names its own)."""
        if self.delta == "fp16":
            from ..compressors.cast import CastCompressor, CastConfig

            return CastCompressor(CastConfig(dtype="fp16"))
        return None

    def cost(self, numels: list[int]) -> DiLoCoCandidate:
        """The cost model's view of it (:mod:`lightning_gc.auto.diloco_cost`) for a model whose parameter
        tensors hold ``numels`` elements, in model order."""
        streaming = {"fragments": self.fragments, "overlap_steps": self.overlap_steps, "shares": self.shares(numels)}
        if self.delta == "sparseloco":
            from ..compressors.sparseloco import SparseLoCoConfig, sparseloco_payload_bytes

            numel = max(int(sum(numels)), 1)
            per_el = sparseloco_payload_bytes(numel, SparseLoCoConfig()) / numel
            return DiLoCoCandidate(self.inner_steps, delta_bytes_per_element=per_el, wire="allgather", **streaming)
        return DiLoCoCandidate(self.inner_steps, delta_bytes_per_element=2.0, wire="allreduce", **streaming)


#: the forms of Δ, as a name's prefix
DELTA_FORMS: dict[str, str] = {"diloco": "fp16", "sparseloco": "sparseloco"}
#: the names the docs use as examples: the small set of H the papers' small models run well with
DILOCO_CANDIDATES: tuple[str, ...] = ("diloco10", "diloco50", "diloco50f5", "sparseloco10", "sparseloco50")
_NAME = re.compile(r"^(diloco|sparseloco)([1-9][0-9]*)(?:f([1-9][0-9]*))?(?:t([0-9]+))?$")


def _name(form: str, inner_steps: int, fragments: int) -> str:
    prefix = next(p for p, f in DELTA_FORMS.items() if f == form)
    return f"{prefix}{inner_steps}" + (f"f{fragments}" if fragments > 1 else "")


def diloco_choice(name: str) -> DiLoCoChoice:
    """The DiLoCo candidate called ``name`` (``<form><H>[f<F>][t<τ>]``); other names are refused with the forms."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"auto_diloco: {name!r} is not a DiLoCo candidate; a name is a form of the pseudo-gradient "
                         f"({', '.join(DELTA_FORMS)}) followed by H, the inner steps per round, and optionally "
                         "Streaming DiLoCo's f<fragments> and t<overlap steps>, e.g. auto_diloco=['diloco10', "
                         "'diloco50'], ['sparseloco50'] or ['diloco50f5'].")
    h, f = int(m.group(2)), int(m.group(3) or 1)
    tau = int(m.group(4)) if m.group(4) is not None else (h // f) // 2 if f > 1 else 0
    if f > h or tau >= max(h // f, 1):
        raise ValueError(f"auto_diloco: {name!r} has F = {f} fragments and τ = {tau} overlap steps for H = {h}; a "
                         f"name needs F ≤ H and τ < H/F (each fragment's exchange is applied before the next is "
                         f"sent), e.g. {_name(DELTA_FORMS[m.group(1)], h, min(f, h))!r}.")
    return DiLoCoChoice(name, h, DELTA_FORMS[m.group(1)], f, tau)


__all__ = ["DELTA_FORMS", "DILOCO_CANDIDATES", "DiLoCoChoice", "diloco_choice"]
