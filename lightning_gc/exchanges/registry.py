"""Names users pass as ``collective=...`` → exchange factories, and validation of the pairing.

Which exchanges a compressor may use follows from its wire format and the formats each exchange
class declares (``Exchange.formats``); an incompatible pair is refused at construction with a
message naming the valid choices. Add a collective with :func:`register_exchange`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..comm.exchange import (
    AllgatherExchange,
    AllreduceExchange,
    Exchange,
    RingAllreduceExchange,
    TreeAllreduceExchange,
)
from ..comm.network import NetworkState
from ..compressors.base import Compressor
from .artopk import ARTopkExchange, AutoSparseExchange
from .gradiveq import GradiVeQExchange, GradiVeQRingExchange
from .lowbit import LowBitExchange
from .lowrank import LowRankExchange
from .marsit import MarsitExchange
from .ssdm_cascade import SSDMCascadeExchange

ExchangeFactory = Callable[[Compressor, object, NetworkState], Exchange]

#: The one table of numeric codes for collectives in scalar logs (``gc/collective``,
#: ``adaptive/collective``, ``adaptive/decision_collective``); -1 for any other name.
COLLECTIVE_CODES: dict[str, int] = {"allgather": 0, "art_ring": 1, "art_tree": 2, "art_allreduce": 3,
                                    "allreduce": 4, "ring": 5, "tree": 6}


def collective_code(name: str | None) -> float:
    """The logged code of a collective name (see :data:`COLLECTIVE_CODES`)."""
    return float(COLLECTIVE_CODES.get(name or "", -1))


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
# what each wire format's collectives carry, in words (for refusals)
_FORMAT_WORDS = {
    "allreduce": "payloads that add up element-wise across ranks",
    "allgather": "fixed-size payloads gathered from every rank and combined after the gather",
    "artopk": "AR-Topk payloads (one source rank's indices, values summed at them)",
    "artopk_auto": "AR-Topk payloads on a collective chosen by the cost model",
    "marsit": "packed sign bits merged hop by hop along a ring",
    "gradiveq": "GradiVeQ PCA coefficients summed in the compressed domain (QSGD on sample steps)",
    "lowbit": "k-bit blocks dequantised, summed in fp32 and requantised at every ring hop",
    "lowrank": "rank-r factors P and Q of each gradient matrix, in two allreduces with an orthogonalisation between",
}
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
                   "the backend's allreduce of summable payloads (dense, fp16/bf16, RandomK)"), ("allreduce",)),
    (ExchangeEntry("ring", RingAllreduceExchange, _plain(RingAllreduceExchange),
                   "lightning_gc's point-to-point ring allreduce of summable payloads"), ()),
    (ExchangeEntry("tree", TreeAllreduceExchange, _plain(TreeAllreduceExchange),
                   "lightning_gc's point-to-point tree allreduce of summable payloads"), ()),
    (ExchangeEntry("allgather", AllgatherExchange, _plain(AllgatherExchange),
                   "one allgather of every rank's fixed-size packed payload (Top-k family, QSGD, signSGD)"), ("allgather",)),
    (ExchangeEntry("art_allreduce", ARTopkExchange, _art("allreduce"),
                   "AR-Topk: source rank broadcasts its indices, values summed by the backend's allreduce"), ("artopk",)),
    (ExchangeEntry("art_ring", ARTopkExchange, _art("ring"), "AR-Topk: index broadcast, values summed by the P2P ring (ART-Ring)"), ()),
    (ExchangeEntry("art_tree", ARTopkExchange, _art("tree"), "AR-Topk: index broadcast, values summed by the P2P tree (ART-Tree)"), ()),
    (ExchangeEntry("auto_sparse", AutoSparseExchange, _plain(AutoSparseExchange),
                   "artopk_auto: Top-k allgather, ART-Ring or ART-Tree per step, chosen by the alpha-beta model"),
     ("artopk_auto",)),
    (ExchangeEntry("marsit", MarsitExchange, _plain(MarsitExchange),
                   "Marsit: one-bit ring allreduce, signs merged without bias at every hop (P2P ring)"), ("marsit",)),
    (ExchangeEntry("marsit_cascade", SSDMCascadeExchange, _plain(SSDMCascadeExchange),
                   "Marsit's schedule with SSDM re-compression at every hop (the paper's biased foil; bench baseline)"),
     ()),
    (ExchangeEntry("gradiveq_ring", GradiVeQRingExchange, _plain(GradiVeQRingExchange),
                   "GradiVeQ, Algorithm 1: P2P ring that compresses the next segment while the previous one travels"),
     ("gradiveq",)),
    (ExchangeEntry("gradiveq_allreduce", GradiVeQExchange, _plain(GradiVeQExchange),
                   "GradiVeQ, simple path: compress all, backend allreduce of the coefficients, decompress"), ()),
    (ExchangeEntry("lowbit", LowBitExchange, _plain(LowBitExchange),
                   "low-bit ring allreduce: k-bit reduce-scatter summed in fp32 at each hop, k-bit allgather (P2P ring)"),
     ("lowbit",)),
    (ExchangeEntry("lowrank", LowRankExchange, _plain(LowRankExchange),
                   "PowerSGD family: allreduce of P = M·Q (with the small tensors), orthogonalise, allreduce of Q = Mᵀ·P̂"),
     ("lowrank",)),
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
        carries = " and ".join(_FORMAT_WORDS.get(f, f) for f in sorted(_EXCHANGES[collective].formats))
        hint = (
            " For an allreduce-friendly sparse format use compressor='star_topk' (AR-Topk) or 'randomk'."
            if compressor.sends_exact_subset and compressor.wire_format == "allgather"
            else ""
        )
        raise ValueError(
            f"compressor {compressor.name!r} cannot travel by collective={collective!r}: it sends "
            f"{compressor.wire_description} (wire format {compressor.wire_format!r}), while "
            f"{collective!r} carries {carries}.{hint} Valid collectives for {compressor.name!r}: {valid} "
            "(or 'auto')."
        )
    return collective


def make_exchange(compressor: Compressor, collective: str = "auto", group=None,
                  network: NetworkState | None = None) -> Exchange:
    """Build the exchange for ``collective`` (``"auto"``: the format's default). Every collective runs
    on every backend and device: the point-to-point rings and trees stage CUDA tensors through host
    memory on gloo (:mod:`lightning_gc.comm.p2p`)."""
    name = validate_collective(compressor, collective)
    ex = _EXCHANGES[name].factory(compressor, group, network if network is not None else NetworkState())
    ex.name = name
    return ex
