"""Exchanges: compressor + collective = one group's trip across the ranks.

An exchange takes the error-fed flat gradient ``p`` of one group on every rank and returns

* ``mean``  — the aggregated gradient (identical on every rank), and
* ``sent``  — what *this* rank's contribution stood for, decompressed (error feedback keeps
  ``p − sent``).

Which exchanges a compressor may use follows from its wire format; anything else is refused at
construction (:func:`make_exchange`) with a message naming the valid choices.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..compressors.base import Compressor, GroupContext
from .collectives import allgather_payload, allreduce


@dataclass
class SparseSent:
    """What a rank contributed, when it is exactly its input at ``indices`` (sparse formats).

    Lets the engine update error memory in place (zero those positions) and get ‖sent‖² from the
    k values, instead of materialising and subtracting a dense tensor.
    """

    values: Tensor
    indices: Tensor


@dataclass
class ExchangeTimes:
    """Wall-clock split of one exchange plus the bytes it moved (this rank)."""

    compress_s: float = 0.0
    comm_s: float = 0.0
    bytes_sent: int = 0
    bytes_payload: int = 0
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Accumulates compute and communication wall time; synchronises CUDA so times are real."""

    def __init__(self, device: torch.device, times: ExchangeTimes) -> None:
        self.device = device
        self.times = times

    def run(self, kind: str, fn: Callable):
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn()
        _sync(self.device)
        dt = time.perf_counter() - t0
        if kind == "comm":
            self.times.comm_s += dt
        else:
            self.times.compress_s += dt
        return out


class Exchange(ABC):
    """One way of moving a compressor's payload."""

    #: name users pass as ``collective=...``
    name: str = ""

    def __init__(self, compressor: Compressor, group=None) -> None:
        self.compressor = compressor
        self.group = group

    @abstractmethod
    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor | SparseSent]:
        """Return (mean over ranks, this rank's contribution: dense, or :class:`SparseSent`)."""


class AllreduceExchange(Exchange):
    """Linear payloads summed by the backend's allreduce (or a P2P ring/tree via ``reduce_fn``)."""

    name = "allreduce"

    def __init__(self, compressor: Compressor, group=None, reduce_fn: Callable | None = None) -> None:
        super().__init__(compressor, group)
        self.reduce_fn = reduce_fn

    def _reduce(self, tensors: list[Tensor]) -> int:
        if self.reduce_fn is None:
            return allreduce(tensors, self.group)
        return sum(int(self.reduce_fn(t, self.group)) for t in tensors)

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        c = self.compressor
        comp = timer.run("compress", lambda: c.compress(p, ctx))
        sent = timer.run("compress", lambda: c.decompress(comp.payload, comp.meta, ctx))
        timer.times.bytes_payload += comp.nbytes
        payload = [t.clone() for t in comp.payload]
        timer.times.bytes_sent += timer.run("comm", lambda: self._reduce(payload))
        mean = timer.run("compress", lambda: c.aggregate_summed(tuple(payload), comp.meta, ctx))
        return mean, sent


class AllgatherExchange(Exchange):
    """Fixed-size payloads gathered from every rank in one allgather of a byte buffer."""

    name = "allgather"

    def run(self, p: Tensor, ctx: GroupContext, timer: Timer) -> tuple[Tensor, Tensor]:
        c = self.compressor
        comp = timer.run("compress", lambda: c.compress(p, ctx))
        specs = c.payload_specs(ctx, p.dtype)
        payloads, nbytes, payload_bytes = timer.run(
            "comm", lambda: allgather_payload(comp.payload, specs, self.group)
        )
        timer.times.bytes_sent += nbytes
        timer.times.bytes_payload += payload_bytes
        mean = timer.run("compress", lambda: c.aggregate_gathered(payloads, comp.meta, ctx))
        if getattr(c, "sends_exact_subset", False):
            return mean, SparseSent(comp.payload[0], comp.payload[1])
        sent = timer.run("compress", lambda: c.decompress(comp.payload, comp.meta, ctx))
        return mean, sent


def _p2p(reduce: str) -> Callable[..., Exchange]:
    def factory(compressor: Compressor, group=None) -> Exchange:
        from .p2p_allreduce import ring_allreduce, tree_allreduce

        fn = ring_allreduce if reduce == "ring" else tree_allreduce
        ex = AllreduceExchange(compressor, group, reduce_fn=lambda t, g: fn(t, group=g).bytes_sent)
        ex.name = reduce
        return ex

    return factory


def _art(reduce: str) -> Callable[..., Exchange]:
    def factory(compressor: Compressor, group=None) -> Exchange:
        from .artopk import ARTopkExchange

        return ARTopkExchange(compressor, group, reduce)  # type: ignore[arg-type]

    return factory


def _auto_sparse(compressor: Compressor, group=None) -> Exchange:
    from .artopk import AutoSparseExchange

    return AutoSparseExchange(compressor, group)  # type: ignore[arg-type]


# name -> (exchange factory, wire formats it can carry)
_EXCHANGES: dict[str, tuple[Callable[..., Exchange], frozenset[str]]] = {
    "allreduce": (AllreduceExchange, frozenset({"allreduce"})),
    "ring": (_p2p("ring"), frozenset({"allreduce"})),
    "tree": (_p2p("tree"), frozenset({"allreduce"})),
    "allgather": (AllgatherExchange, frozenset({"allgather"})),
    "art_allreduce": (_art("allreduce"), frozenset({"artopk"})),
    "art_ring": (_art("ring"), frozenset({"artopk"})),
    "art_tree": (_art("tree"), frozenset({"artopk"})),
    "auto_sparse": (_auto_sparse, frozenset({"artopk_auto"})),
}
# what collective="auto" means for each wire format
_DEFAULT_FOR_FORMAT = {
    "allreduce": "allreduce",
    "allgather": "allgather",
    "artopk": "art_allreduce",
    "artopk_auto": "auto_sparse",
}


def register_exchange(
    name: str, factory: Callable[..., Exchange], formats: frozenset[str], default_for: frozenset[str] = frozenset()
) -> None:
    """Add a collective choice (e.g. P2P ring/tree allreduce, AR-Topk, Marsit).

    ``default_for``: wire formats for which this exchange is what ``collective="auto"`` means.
    """
    _EXCHANGES[name] = (factory, formats)
    for fmt in default_for:
        _DEFAULT_FOR_FORMAT[fmt] = name


def compatible_collectives(compressor: Compressor) -> list[str]:
    fmt = compressor.wire_format
    return [n for n, (_, fmts) in _EXCHANGES.items() if fmt in fmts]


def validate_collective(compressor: Compressor, collective: str) -> str:
    """Resolve ``"auto"`` and refuse incompatible pairs with a helpful message."""
    valid = compatible_collectives(compressor)
    if collective == "auto":
        return _DEFAULT_FOR_FORMAT[compressor.wire_format]
    if collective not in _EXCHANGES:
        raise ValueError(
            f"unknown collective {collective!r}; valid collectives: {['auto', *_EXCHANGES]}."
        )
    if collective not in valid:
        hint = (
            " Its (values, indices) payloads from different ranks cannot be summed element-wise;"
            " for an allreduce-friendly sparse format use compressor='star_topk' (AR-Topk) or 'randomk'."
            if compressor.wire_format == "allgather"
            else ""
        )
        raise ValueError(
            f"compressor {compressor.name!r} cannot travel by collective={collective!r}: its wire format is "
            f"{compressor.wire_format!r}.{hint} Valid collectives for {compressor.name!r}: {valid} "
            "(or 'auto')."
        )
    return collective


def make_exchange(compressor: Compressor, collective: str = "auto", group=None) -> Exchange:
    name = validate_collective(compressor, collective)
    factory, _ = _EXCHANGES[name]
    return factory(compressor, group)
