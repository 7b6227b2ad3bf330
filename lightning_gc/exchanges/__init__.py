"""The compressed exchanges and the registry of ``collective=`` names.

An exchange carries one compressor's payload across the ranks: it sits above both the
compressors (pure tensor transforms, :mod:`lightning_gc.compressors`) and the transport
(collectives, P2P ring and tree, the cost model: :mod:`lightning_gc.comm`, which also holds the
:class:`~lightning_gc.comm.exchange.Exchange` base class and the generic allreduce/allgather/ring/tree
exchanges).

* :mod:`.registry` — names users pass as ``collective=`` → exchange factories, with validation of
  the compressor/collective pairing; add one with :func:`register_exchange`;
* :mod:`.artopk` — AR-Topk (source rank's indices, values allreduced) and the cost-model choice
  among the sparse collectives (``artopk_auto``);
* :mod:`.marsit` and :mod:`.ssdm_cascade` — Marsit's one-bit ring and the SSDM cascade foil;
* :mod:`.gradiveq` — GradiVeQ's allreduce of PCA coefficients and its ring of Algorithm 1;
* :mod:`.lowrank` — the PowerSGD family's two allreduces with an orthogonalisation between.

The codec and compressor of each method stay in its package under :mod:`lightning_gc.compressors`.
"""

from .registry import (
    COLLECTIVE_CODES,
    ExchangeEntry,
    available_collectives,
    collective_code,
    compatible_collectives,
    make_exchange,
    register_exchange,
    validate_collective,
)

__all__ = [
    "COLLECTIVE_CODES",
    "ExchangeEntry",
    "available_collectives",
    "collective_code",
    "compatible_collectives",
    "make_exchange",
    "register_exchange",
    "validate_collective",
]
