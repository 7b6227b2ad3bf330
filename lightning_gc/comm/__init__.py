"""Collectives and the network model: P2P ring/tree allreduce, the alpha-beta cost model, the probe."""

# importing these registers the "marsit" and "marsit_cascade" exchanges
from lightning_gc.comm import marsit as _marsit  # noqa: F401
from lightning_gc.comm import ssdm_cascade as _ssdm_cascade  # noqa: F401
from lightning_gc.comm.cost_model import (
    NetworkModel,
    SparseCollective,
    choose_sparse_collective,
    choose_sparse_collective_by_rules,
)
from lightning_gc.comm.p2p_allreduce import P2PAllreduceStats, ring_allreduce, tree_allreduce
from lightning_gc.comm.probe import (
    PinnedNetwork,
    ProbeConfig,
    ProbePolicy,
    ProbeResult,
    ensure_replicated,
    probe_network,
)

__all__ = [
    "NetworkModel",
    "SparseCollective",
    "choose_sparse_collective",
    "choose_sparse_collective_by_rules",
    "P2PAllreduceStats",
    "ring_allreduce",
    "tree_allreduce",
    "PinnedNetwork",
    "ProbeConfig",
    "ProbePolicy",
    "ProbeResult",
    "ensure_replicated",
    "probe_network",
]
