"""Per-group method slots: which compressor and collective each plan group is sent with.

Until now one compressor and one collective served every lossy group. A :class:`MethodSlot` gives a
group its own (compressor, exchange, error feedback); groups without one use the engine's default
slot (what ``GCStrategy(compressor=..., collective=...)`` configured). A slot is described by a
:class:`MethodSpec` — plain, replicated values (compressor name, ratio, options, collective, error
feedback) — so that it can be compared across ranks (the engine's signature and its per-step
opening check include every slot), saved in checkpoints and rebuilt on resume.

Switching a group's method happens between steps (``GCEngine.set_group_method``) on every rank with
the same spec. **Error memory on a switch** (the rule, tested in tests/test_slots.py):

* the new method uses error feedback → the group's memory is **kept**: it is in gradient units
  (what was not sent), independent of the compressor that left it, and the new compressor sends it;
* the new method has no error feedback → the memory is **flushed**: added once to the group's next
  error-fed gradient (so nothing already owed is lost) and then cleared; a non-finite step leaves
  it pending for the next one.

Slots are keyed by the group's parameter names; a plan change (OMGS, OSP) keeps the slots whose
groups still exist with the same names and drops the others (those groups fall back to the default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..comm.exchange import Exchange
from ..comm.network import NetworkState
from ..compressors.base import Compressor
from ..compressors.registry import build_compressor
from ..exchanges.registry import make_exchange


@dataclass(frozen=True)
class MethodSpec:
    """How a group is sent: replicated, JSON-able values.

    Attributes:
        compressor: a registered compressor name (``lightning-gc list``), e.g. ``"topk"``, ``"qsgd"``,
            ``"bf16"``, ``"dense"``.
        ratio: its ratio when it takes one (``None``: its default).
        compressor_args: further options of the compressor.
        collective: ``"auto"`` (the compressor's natural collective) or an explicit compatible one.
        error_feedback: ``None``: the compressor's default.
    """

    compressor: str
    ratio: float | None = None
    compressor_args: dict[str, Any] = field(default_factory=dict)
    collective: str = "auto"
    error_feedback: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MethodSlot:
    """A built method: the compressor, its exchange on the engine's group, and error feedback."""

    spec: MethodSpec | None  # None: the engine's default slot (configured at construction)
    compressor: Compressor
    exchange: Exchange
    error_feedback: bool

    def describe(self) -> str:
        """Part of the cross-rank signature and of the per-step opening check."""
        return f"{self.compressor.describe()}|{self.exchange.describe()}|ef={self.error_feedback}"


def build_slot(spec: MethodSpec, group: Any, network: NetworkState, default_needs_network: bool) -> MethodSlot:
    """Build a slot from its spec (validated: a bad name, ratio or collective raises ValueError)."""
    compressor = build_compressor(spec.compressor, spec.ratio, dict(spec.compressor_args) or None)
    exchange = make_exchange(compressor, spec.collective, group, network)
    if type(exchange).needs_network and not default_needs_network:
        raise ValueError(
            f"collective {exchange.name!r} for a group chooses from the network model, which this engine does "
            "not keep (its default collective does not need one). Use an explicit collective (e.g. "
            "'allgather' or 'art_ring'), or configure the strategy with collective that needs it."
        )
    ef = compressor.default_error_feedback if spec.error_feedback is None else bool(spec.error_feedback)
    return MethodSlot(spec, compressor, exchange, ef and compressor.lossy)
