"""The network model the engine currently believes, shared by the exchanges that need it."""

from __future__ import annotations

from .cost_model import NetworkModel


class NetworkState:
    """Current alpha-beta model (probed or pinned) and how often it was probed.

    One instance per engine; exchanges that declare ``needs_network`` read ``model`` when they
    decide. Its owner, the engine's :class:`~lightning_gc.comm.link.LinkObserver`, replaces ``model``
    only between steps, from values agreed by all ranks (the probe's MAX reduction, or arguments
    every rank received), so decisions stay replicated.
    """

    def __init__(self, model: NetworkModel | None = None, pinned: bool = False) -> None:
        self.model = model
        self.pinned = pinned
        self.probes = 0
