"""Names users pass as ``collective=...`` → exchange factories, and validation of the pairing.

Which exchanges a compressor may use follows from its wire format and the formats each exchange
class declares (``Exchange.formats``); an incompatible pair is refused at construction with a
message naming the valid choices. Add a collective with :func:`register_exchange`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..compressors.base import Compressor
from .artopk import ARTopkExchange, AutoSparseExchange
from .exchange import (
    AllgatherExchange,
    AllreduceExchange,
    Exchange,
    RingAllreduceExchange,
    TreeAllreduceExchange,
)
from .network import NetworkState

ExchangeFactory = Callable[[Compressor, object, NetworkState], Exchange]


@dataclass(frozen=True)
class ExchangeEntry:
    """A registered collective: how to build it, and which exchange class (capabilities) it is."""

    name: str
    cls: type[Exchange]
    factory: ExchangeFactory
    summary: str

    @property
    def formats(self) -> frozenset[str]:
        return self.cls.formats


def _plain(cls: type[Exchange]) -> ExchangeFactory:
    return lambda compressor, group, network: cls(compressor, group, network)


def _art(reduce: str) -> ExchangeFactory:
    return lambda compressor, group, network: ARTopkExchange(compressor, group, reduce)  # type: ignore[arg-type]


_EXCHANGES: dict[str, ExchangeEntry] = {}
# what collective="auto" means for each wire format
_DEFAULT_FOR_FORMAT: dict[str, str] = {}


def register_exchange(entry: ExchangeEntry, default_for: tuple[str, ...] = ()) -> None:
    """Add a collective choice; ``default_for`` names wire formats whose ``"auto"`` it becomes."""
    if entry.name in _EXCHANGES and _EXCHANGES[entry.name] != entry:
        raise ValueError(f"a collective named {entry.name!r} is already registered")
    _EXCHANGES[entry.name] = entry
    for fmt in default_for:
        _DEFAULT_FOR_FORMAT[fmt] = entry.name


for _entry, _default in [
    (ExchangeEntry("allreduce", AllreduceExchange, _plain(AllreduceExchange),
                   "the backend's allreduce of summable payloads"), ("allreduce",)),
    (ExchangeEntry("ring", RingAllreduceExchange, _plain(RingAllreduceExchange),
                   "our P2P ring allreduce of summable payloads"), ()),
    (ExchangeEntry("tree", TreeAllreduceExchange, _plain(TreeAllreduceExchange),
                   "our P2P tree allreduce of summable payloads"), ()),
    (ExchangeEntry("allgather", AllgatherExchange, _plain(AllgatherExchange),
                   "one allgather of every rank's fixed-size packed payload"), ("allgather",)),
    (ExchangeEntry("art_allreduce", ARTopkExchange, _art("allreduce"),
                   "AR-Topk: backend broadcast of the source's indices, backend allreduce of values"), ("artopk",)),
    (ExchangeEntry("art_ring", ARTopkExchange, _art("ring"),
                   "AR-Topk: binomial broadcast of indices, P2P ring allreduce of values"), ()),
    (ExchangeEntry("art_tree", ARTopkExchange, _art("tree"),
                   "AR-Topk: binomial broadcast of indices, P2P tree allreduce of values"), ()),
    (ExchangeEntry("auto_sparse", AutoSparseExchange, _plain(AutoSparseExchange),
                   "per group and step, Top-k allgather, ART-Ring or ART-Tree as the alpha-beta model predicts"),
     ("artopk_auto",)),
]:
    register_exchange(_entry, _default)


def available_collectives() -> dict[str, str]:
    """name → one-line summary."""
    return {n: e.summary for n, e in _EXCHANGES.items()}


def compatible_collectives(compressor: Compressor) -> list[str]:
    fmt = compressor.wire_format
    return [n for n, e in _EXCHANGES.items() if fmt in e.formats]


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


def exchange_entry(name: str) -> ExchangeEntry:
    return _EXCHANGES[name]


def make_exchange(compressor: Compressor, collective: str = "auto", group=None,
                  network: NetworkState | None = None) -> Exchange:
    name = validate_collective(compressor, collective)
    ex = _EXCHANGES[name].factory(compressor, group, network if network is not None else NetworkState())
    ex.name = name
    return ex
